#!/usr/bin/env bash
# Run every GPU test and GPU benchmark of gradsync on a machine with an NVIDIA GPU, writing the
# results into the folder given as the only argument. Build first, on an x86-64 machine with
# Rust: scripts/gpu-build.sh (this script runs the binaries it leaves in .gpu/).
#
# Each check's full output goes to OUT/gpu-check.log; OUT/summary.md lists every check with its
# exit status; OUT/step.jsonl holds the step benchmark's figures and OUT/compare.tar.gz the
# comparison runner's run directory.
set -uo pipefail
OUT=${1:?usage: scripts/gpu-check.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
BIN=$PWD/.gpu/bin
[ -x "$BIN/gradsync-worker" ] || { echo "no binaries in .gpu/bin: run scripts/gpu-build.sh first" >&2; exit 2; }
LOG=$OUT/gpu-check.log
SUM=$OUT/summary.md
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"; pkill -P $$ 2>/dev/null' EXIT
: >"$LOG"

# PyTorch's Python: $PYTHON if set, else the first of the usual places whose Python imports
# torch (an active virtualenv or conda environment, python3 on PATH, common install folders).
# Its environment holds cuBLAS, NVRTC and NCCL when no CUDA toolkit is installed, and the
# step benchmark compares against its PyTorch.
find_torch_python() {
  local c
  for c in ${PYTHON:+"$PYTHON"} ${VIRTUAL_ENV:+"$VIRTUAL_ENV/bin/python"} ${CONDA_PREFIX:+"$CONDA_PREFIX/bin/python"} \
    python3 python "$HOME"/.venv/bin/python "$HOME"/venv/bin/python /opt/conda/bin/python \
    "$HOME"/miniconda3/bin/python "$HOME"/anaconda3/bin/python "$HOME"/miniforge3/bin/python \
    /usr/local/bin/python3 /usr/bin/python3; do
    command -v "$c" >/dev/null 2>&1 || continue
    if "$c" -c 'import torch' >/dev/null 2>&1; then
      command -v "$c"
      return 0
    fi
  done
  return 1
}
if PY=$(find_torch_python); then
  PY_NOTE="$PY (imports torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null))"
else
  PY=${PYTHON:-python3}
  PY_NOTE="NONE: no Python that imports torch was found (set PYTHON=/path/to/python); CUDA libraries come from system paths only and the PyTorch comparison will fail"
  echo "gpu-check: $PY_NOTE" >&2
fi
libs=$("$PY" - <<'PYEOF' 2>/dev/null
import glob, os, site
dirs = []
try:
    import torch
    dirs.append(os.path.join(os.path.dirname(torch.__file__), "lib"))
except Exception:
    pass
for sp in site.getsitepackages():
    dirs += sorted(glob.glob(os.path.join(sp, "nvidia", "*", "lib")))
    dirs += sorted(glob.glob(os.path.join(sp, "nvidia", "cu*", "lib")))
print(":".join(d for d in dirs if os.path.isdir(d)))
PYEOF
)
export LD_LIBRARY_PATH=${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

{
  echo "# gradsync GPU check"
  echo
  echo "- date: $(date -u +%FT%TZ)"
  echo "- gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
  echo "- python: $PY_NOTE"
  echo "- cuda libraries from: ${libs:-system paths}"
  echo "- gradsync: $("$BIN/gradsync-worker" --version)"
  echo
  echo "| check | status | last line |"
  echo "|---|---|---|"
} >"$SUM"

failures=0
# check NAME CMD...: run, log everything, record the status and the last line.
check() {
  local name=$1
  shift
  echo "=== $name: $*" >>"$LOG"
  local t0=$SECONDS
  "$@" >>"$LOG.part" 2>&1
  local rc=$?
  cat "$LOG.part" >>"$LOG"
  local last
  last=$(grep -v '^\s*$' "$LOG.part" | tail -1 | cut -c1-160 | tr '|' '/')
  rm -f "$LOG.part"
  local status=ok
  [ $rc -eq 0 ] || { status="FAILED (rc $rc)"; failures=$((failures + 1)); }
  echo "| $name | $status ($((SECONDS - t0)) s) | \`$last\` |" >>"$SUM"
  echo "=== $name: $status" >>"$LOG"
  echo "$name: $status"
}

W="$BIN/gradsync-worker"
S="$BIN/gradsync-server"
B="$BIN/gradsync-bench"
TRAIN=(train --model tiny --data synthetic:2048:32:8 --seed 5 --steps 40 --eval-every 0 -q)

# server_up ARGS...: start a server on a free port as a coprocess and set ADDR once it says
# it listens (its first line), without polling.
server_up() {
  coproc SERVER { exec "$S" --listen 127.0.0.1:0 "$@" 2>>"$LOG"; }
  local line
  IFS= read -r -t 60 -u "${SERVER[0]}" line || return 1
  ADDR=${line#gradsync-server listening on }
  [ "$ADDR" != "$line" ]
}

ps_run() { # ps_run WORKERS BATCH SAVE: BSP on the GPU, W workers sharing it
  local w=$1 b=$2 save=$3
  server_up --sync bsp --model tiny --data synthetic:2048:32:8 --seed 5 || return 1
  local addr=$ADDR
  local pids=()
  for r in $(seq 0 $((w - 1))); do
    local extra=()
    [ "$r" = 0 ] && extra=(--save "$save")
    "$W" "${TRAIN[@]}" --mode ps --device cuda --servers "$addr" --rank "$r" --world-size "$w" --batch "$b" "${extra[@]}" &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  kill -TERM "$SERVER_PID" 2>/dev/null
  wait "$SERVER_PID" 2>/dev/null
  return $rc
}

# 1. The core GPU tests: every backend method and whole steps on the GPU against the CPU,
# NaN/Inf, determinism, allocations, the half-precision kernels bit for bit against the host
# codec; then NCCL against a serial reference (as many ranks as there are GPUs, up to 3),
# its fp16/bf16 all-reduce, and its failure paths (set-up and call timeouts abort); then DDP
# over NCCL with --compress fp16|bf16 against the TCP ring (two ranks: skipped with one GPU).
check "core GPU tests" .gpu/tests/gpu --nocapture --test-threads 1
check "NCCL collective tests" .gpu/tests/collective nccl --nocapture --test-threads 1
check "DDP NCCL fp16/bf16 test" .gpu/tests/ddp ddp_over_nccl_compresses_buckets_on_the_device --exact --nocapture --test-threads 1

# 2. Local training on the GPU learns, and matches the CPU after 40 steps.
check "local, mnist, GPU" "$W" train --device cuda --model mnist --steps 300 --eval-every 100 --batch 128
check "local tiny, CPU reference" "$W" "${TRAIN[@]}" --device cpu --batch 64 --save "$WORK/cpu-64.ckpt"
check "local tiny, GPU" "$W" "${TRAIN[@]}" --device cuda --batch 64 --save "$WORK/gpu-64.ckpt"
check "GPU vs CPU after 40 steps" "$B" diff "$WORK/cpu-64.ckpt" "$WORK/gpu-64.ckpt" --tol 1e-4

# 3. PS with 2 and 4 workers sharing the GPU, against local training with the same global batch.
for w in 2 4; do
  check "PS BSP, $w GPU workers" ps_run $w $((64 / w)) "$WORK/ps-$w.ckpt"
  check "PS BSP $w workers vs local" "$B" diff "$WORK/cpu-64.ckpt" "$WORK/ps-$w.ckpt" --tol 1e-4
done

# 4. DDP with the TCP backend staging GPU buffers through the host (2 ranks on the one GPU).
check "DDP TCP, 2 GPU ranks" "$W" launch --nproc-per-node 2 --master-port 29611 -- \
  "${TRAIN[@]}" --mode ddp --backend tcp --device cuda --batch 32 --save "$WORK/ddp-tcp.ckpt"
check "DDP TCP vs local" "$B" diff "$WORK/cpu-64.ckpt" "$WORK/ddp-tcp.ckpt" --tol 1e-4

# 5. NCCL with world size 1 (NCCL refuses two ranks on one GPU).
check "DDP NCCL, world size 1" "$W" launch --nproc-per-node 1 --master-port 29612 -- \
  "${TRAIN[@]}" --mode ddp --backend nccl --device cuda --batch 64 --save "$WORK/ddp-nccl.ckpt"
check "DDP NCCL vs local GPU" "$B" diff "$WORK/gpu-64.ckpt" "$WORK/ddp-nccl.ckpt" --tol 1e-5
# With --compress fp16|bf16 each bucket is rounded on the GPU, reduced in NCCL's half type and
# widened back: the gradients' rounding alone (1.5e-3 and 8.7e-4 relative on the fake CUDA).
for c in fp16 bf16; do
  check "DDP NCCL --compress $c, world size 1" "$W" launch --nproc-per-node 1 --master-port 29613 -- \
    "${TRAIN[@]}" --mode ddp --backend nccl --compress $c --device cuda --batch 64 --save "$WORK/ddp-nccl-$c.ckpt"
  check "DDP NCCL $c vs local GPU" "$B" diff "$WORK/gpu-64.ckpt" "$WORK/ddp-nccl-$c.ckpt" --tol 1e-2
done

# 6. DP with several replicas on the one GPU.
check "DP, 2 replicas on one GPU" "$W" "${TRAIN[@]}" --mode dp --replicas 2 --world-size 2 --device cuda --batch 32 --save "$WORK/dp.ckpt"
check "DP vs local" "$B" diff "$WORK/cpu-64.ckpt" "$WORK/dp.ckpt" --tol 1e-4

# 7. compute-sanitizer (memcheck) over a short GPU training run.
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$SAN" ]; then
  check "compute-sanitizer memcheck" "$SAN" --tool memcheck --leak-check full --error-exitcode 3 \
    "$W" "${TRAIN[@]}" --device cuda --batch 64 --steps 10
else
  echo "| compute-sanitizer memcheck | SKIPPED: compute-sanitizer not found | |" >>"$SUM"
fi

# 8. Benchmarks: the step against PyTorch eager on the same GPU, collectives, the comparison.
check "step benchmark vs PyTorch" "$B" step --model mnist,wide --batch 128,512,2048,8192 --threads 16 \
  --python "$PY" --json "$OUT/step.jsonl"
check "collective benchmark (NCCL, 1 rank; TCP)" "$B" collective --backend nccl,tcp --ranks 1,2 --max-bytes 268435456
check "comparison runner on the GPU" "$B" compare --device cuda --out "$WORK/compare"
tar -C "$WORK" -czf "$OUT/compare.tar.gz" compare 2>/dev/null

echo >>"$SUM"
echo "$failures check(s) failed." >>"$SUM"
cat "$SUM"
exit $((failures > 0))
