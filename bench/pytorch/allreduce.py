"""PyTorch gloo reference for `gradsync-bench collective`: torch.distributed.all_reduce on
CPU tensors with the gloo backend, one spawned process per rank over 127.0.0.1, timed like
gradsync (one checked reduction, then iterations between barriers; the slowest rank's time).
Prints one JSON object per size: {"bytes": B, "seconds": S, "wrong": N}."""
import argparse, json, os, socket, time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, world, port, sizes, budget, q):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    want = world * (world + 1) / 2
    for nbytes in sizes:
        n = nbytes // 4
        t = torch.full((n,), float(rank + 1), dtype=torch.float32)
        dist.all_reduce(t)
        wrong = int((t != want).sum())
        iters = max(3, min(200, budget // max(nbytes, 1)))
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        secs = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
        dist.all_reduce(secs, op=dist.ReduceOp.MAX)
        if rank == 0:
            q.put({"bytes": n * 4, "seconds": float(secs), "wrong": wrong})
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--sizes", default="67108864")
    p.add_argument("--budget-bytes", type=int, default=512 << 20)
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, a.world, port, sizes, a.budget_bytes, q)) for r in range(a.world)]
    for pr in procs:
        pr.start()
    for _ in sizes:
        print(json.dumps(q.get(timeout=600)), flush=True)
    for pr in procs:
        pr.join(timeout=60)
        if pr.exitcode != 0:
            raise SystemExit(f"rank process exited with {pr.exitcode}")


if __name__ == "__main__":
    main()
