"""Multi-node restarts, timed: two `gradsync-worker launch` processes as two nodes on
127.0.0.1 (--nnodes 2, --max-restarts 3), DDP over TCP, the default model on the digits, 300
steps, a checkpoint every 20; three times a rank of node 1, drawn at random, is SIGKILLed after
a random number of rank 0's steps. Prints, per kill, the seconds to node 0's log of the restart
and to rank 0's first step record of the new generation (its metrics file), the step reached
and the step resumed after.

    python3 scripts/restart-two-nodes.py target/release/gradsync-worker OUT_DIR SEED NPROC
"""
import json, os, random, signal, socket, subprocess, sys, threading, time
W = sys.argv[1]; out = sys.argv[2]; seed = int(sys.argv[3]); nproc = int(sys.argv[4])
os.makedirs(out, exist_ok=True)
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
ck = os.path.join(out, f"ck{seed}"); m = os.path.join(out, f"m{seed}-rank{{rank}}.jsonl")
train = ["train", "--mode", "ddp", "--transport", "tcp", "--model", "mnist", "--data", "digits", "--device", "cpu",
         "--threads", "1", "--steps", "300", "--batch", "64", "--checkpoint", ck, "--checkpoint-every", "20",
         "--metrics", m, "--eval-every", "0"]
env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
def node(i):
    return subprocess.Popen([W, "launch", "--nnodes", "2", "--node-rank", str(i), "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "3", "--monitor-interval", "0.1",
        "--"] + train, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
n0, n1 = node(0), node(1)
# However this script ends, the launchers stop (SIGTERM: each stops its ranks).
import atexit
atexit.register(lambda: [p.terminate() for p in (n0, n1) if p.poll() is None])
restart_at = {}
def watch(p, tag):
    for line in p.stderr:
        if "restart " in line and "of 3" in line and tag == 0:
            k = int(line.split("restart ")[1].split(" ")[0]); restart_at[k] = time.time()
threading.Thread(target=watch, args=(n0, 0), daemon=True).start()
threading.Thread(target=watch, args=(n1, 1), daemon=True).start()
path = m.replace("{rank}", "0")
def records():
    try:
        return [json.loads(l) for l in open(path) if '"kind":"step"' in l]
    except FileNotFoundError:
        return []
rng = random.Random(seed); figures = []
for k in (1, 2, 3):
    n_before = len(records())
    target = n_before + rng.randint(25, 60)
    while len(records()) < target:
        time.sleep(0.01)
    kids = [int(x) for t in os.listdir(f"/proc/{n1.pid}/task") for x in open(f"/proc/{n1.pid}/task/{t}/children").read().split()]
    victim = rng.choice(kids)
    reached = records()[-1]["step"]
    t = time.time(); os.kill(victim, signal.SIGKILL)
    while k not in restart_at:
        time.sleep(0.002)
    # the first step record written after node 0 logged the restart (from the start of the
    # file if the new generation began it again)
    size = os.path.getsize(path)
    first = None
    while first is None:
        now = os.path.getsize(path)
        off = 0 if now < size else size
        with open(path) as f:
            f.seek(off); text = f.read()
        for l in text.splitlines(keepends=True):
            if l.endswith("\n") and '"kind":"step"' in l:
                first = json.loads(l); break
        if first is None:
            time.sleep(0.002)
    figures.append((time.time() - t, restart_at[k] - t, reached, first["step"] - 1))
c0, c1 = n0.wait(timeout=600), n1.wait(timeout=600)
for f in figures:
    print(f"seed {seed}: kill to first new step {f[0]:.3f} s (restart logged {f[1]:.3f} s), reached {f[2]}, resumed after {f[3]}")
print(f"exit codes {c0} {c1}")
