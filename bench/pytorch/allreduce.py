"""One rank of the PyTorch gloo reference for `gradsync-bench collective`: torch.distributed
all_reduce on CPU tensors with the gloo backend, in this process, timed like gradsync's ranks
(one checked reduction, then iterations between barriers).

`gradsync-bench collective` starts one of these per rank (inside an emulated host's network
namespace where it runs there), exactly as it starts its own ranks. Rank 0 hosts the store:
it binds --master (port 0: any) and prints {"listening": "host:port"} before anything else;
the bench then starts the other ranks with that address. Every rank then prints one JSON object
per size: {"bytes": B, "seconds": S, "wrong": N}; the bench keeps the slowest rank's time.
Rank 0 adds "busy": the core-seconds the whole machine was busy per iteration (/proc/stat),
as gradsync's rank 0 does."""
import argparse, json, os, sys, time
from datetime import timedelta


def machine_busy_seconds():
    """Busy core-seconds since boot (user, nice, system, irq, softirq), or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        if fields[0] != "cpu":
            return None
        return sum(int(fields[i]) for i in (1, 2, 3, 6, 7)) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True, help="host:port of rank 0's store (rank 0: port 0 = any)")
    p.add_argument("--sizes", required=True, help="comma-separated buffer sizes, bytes")
    p.add_argument("--budget-bytes", type=int, default=512 << 20)
    a = p.parse_args()
    host, port = a.master.rsplit(":", 1)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = timedelta(seconds=120)
    if a.rank == 0:
        store = dist.TCPStore(host, int(port), a.world, True, timeout=timeout, wait_for_workers=False)
        print(json.dumps({"listening": f"{host}:{store.port}"}), flush=True)
    else:
        store = dist.TCPStore(host, int(port), a.world, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=a.rank, world_size=a.world, timeout=timeout)
    want = a.world * (a.world + 1) / 2
    for nbytes in (int(s) for s in a.sizes.split(",")):
        n = nbytes // 4
        t = torch.full((n,), float(a.rank + 1), dtype=torch.float32)
        dist.all_reduce(t)
        wrong = int((t != want).sum())
        iters = max(3, min(200, a.budget_bytes // max(nbytes, 1)))
        dist.barrier()
        busy0 = machine_busy_seconds() if a.rank == 0 else None
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        secs = (time.perf_counter() - t0) / iters
        row = {"bytes": n * 4, "seconds": secs, "wrong": wrong}
        busy1 = machine_busy_seconds() if busy0 is not None else None
        if busy1 is not None:
            row["busy"] = (busy1 - busy0) / iters
        print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
