#!/usr/bin/env bash
# gradsync's checks on a machine with an NVIDIA GPU, in two phases sized for a 15-minute GPU
# lease (machine start included), each one command:
#
#   scripts/gpu-check.sh correctness OUT   # every GPU test and cross-check; ends within 4 min
#   scripts/gpu-check.sh bench OUT         # benchmarks sized to what is left (7.5 min)
#   scripts/gpu-check.sh --print-commands correctness|bench
#                                          # the command lines a phase would run, one a line,
#                                          # arguments separated by 0x1f; nothing is run
#
# Build first, on an x86-64 machine with Rust: scripts/gpu-build.sh (this script runs the
# binaries it leaves in .gpu/). Every check runs under `timeout`; once a phase's deadline has
# passed no further check starts, and each one left is counted SKIPPED, apart from ok and
# failed. GPU_CHECK_SECS sets a phase's hard limit in seconds (defaults: correctness 240,
# bench 450). GPU_CHECK_ONLY, an extended regular expression, runs only the checks whose names
# it matches (case-insensitive; a cross-check needs the runs it compares selected too), to
# rerun what failed or measure one thing again; the others are counted as not selected. A
# phase exits 1 when a check failed or timed out, 0 otherwise.
#
# Files in OUT (7 at most, both phases together):
#   correctness.md, bench.md   each check's status, time and last line
#   correctness.log, bench.log everything each check printed
#   step.jsonl                 the step benchmark's figures (GPU, then CPU rows)
#   compare.tar.gz             the comparison runner's run directories
#   ncu.csv                    Nsight Compute: each kernel's time over two resnet18 steps (when ncu
#                              exists and time is left)
set -uo pipefail
usage() {
  echo "usage: scripts/gpu-check.sh [--print-commands] correctness|bench [OUT]" >&2
  exit 2
}
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/.."
BIN=$PWD/.gpu/bin
W="$BIN/gradsync-worker"
S="$BIN/gradsync-server"
B="$BIN/gradsync-bench"
TESTS=$PWD/.gpu/tests
DATA=(--model tiny --data synthetic:2048:32:8 --seed 5 --eval-every 0 -q)
# The 40-step run every cross-check compares; the sanitizer's run takes DATA with its own
# --steps (a flag given twice is an error).
TRAIN=(train "${DATA[@]}" --steps 40)
# The embedding model's 40-step run (a 20,000 x 16 table under one hidden layer of 32).
EMB=(train --model embedding:20000:16:32 --data clicks:4096:20000 --seed 5 --eval-every 0 -q --steps 40)

PRINT=0
# x CMD...: run CMD, or print it in --print-commands mode.
x() {
  if [ "$PRINT" = 1 ]; then
    local IFS=$'\x1f'
    printf '%s\n' "$*"
  else
    "$@"
  fi
}

# server_up ARGS...: start a server on a free port as a coprocess and set ADDR once it says
# it listens (its first line), without polling.
server_up() {
  if [ "$PRINT" = 1 ]; then
    x "$S" --listen 127.0.0.1:0 "$@"
    ADDR=127.0.0.1:1
    return 0
  fi
  coproc SERVER { exec "$S" --listen 127.0.0.1:0 "$@"; }
  local line
  IFS= read -r -t 60 -u "${SERVER[0]}" line || return 1
  ADDR=${line#gradsync-server listening on }
  [ "$ADDR" != "$line" ]
}

# ps_run WORKERS BATCH SAVE: BSP on the GPU, WORKERS workers sharing it. Run as
# `gpu-check.sh __ps-run ...` so that one `timeout` covers the server and every worker.
# ps_run WORKERS BATCH SAVE [emb | hybrid]: the same on the embedding model (the table's rows
# pushed and pulled by id), or its hybrid (the table on a --table-only server, the rest over
# NCCL; one rank, as one GPU allows).
ps_run() {
  local w=$1 b=$2 save=$3 kind=${4:-}
  local model=(--model tiny --data synthetic:2048:32:8) train=("${TRAIN[@]}") server=()
  if [ -n "$kind" ]; then
    model=(--model embedding:20000:16:32 --data clicks:4096:20000)
    train=("${EMB[@]}")
  fi
  [ "$kind" = hybrid ] && server=(--table-only)
  server_up --sync bsp "${model[@]}" --seed 5 "${server[@]}" || return 1
  local addr=$ADDR pids=() rc=0
  for r in $(seq 0 $((w - 1))); do
    local extra=()
    [ "$r" = 0 ] && extra=(--save "$save")
    if [ "$kind" = hybrid ]; then
      x "$W" launch --nproc-per-node "$w" --master-port 29617 -- "${train[@]}" --mode hybrid --backend nccl \
        --device cuda --servers "$addr" --batch "$b" "${extra[@]}" &
      pids+=($!)
      break
    fi
    x "$W" "${train[@]}" --mode ps --device cuda --servers "$addr" --rank "$r" --world-size "$w" \
      --batch "$b" "${extra[@]}" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  if [ "$PRINT" = 0 ]; then
    kill -TERM "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID" 2>/dev/null
  fi
  return $rc
}

# ddp_exposed DEVICE BUCKET_MB [MODEL DATA]: DDP with 2 ranks on DEVICE over the TCP backend
# (shared memory on one host), the mnist preset on the digits unless MODEL and DATA are given,
# batch 32 a rank, 150 steps; prints rank 0's mean communication and its exposed part (what is
# left after backward ends) over steps 21-150.
ddp_exposed() {
  local dev=$1 mb=$2 model=${3:-mnist} data=()
  local m=$WORK/exposed-$model-$1-$2-{rank}.jsonl
  [ -n "${4:-}" ] && data=(--data "$4")
  x "$W" launch --nproc-per-node 2 --master-port 29615 -- train --model "$model" "${data[@]}" --steps 150 --seed 5 \
    -q --eval-every 0 --mode ddp --backend tcp --device "$dev" --batch 32 --bucket-mb "$mb" --metrics "$m" ||
    return 1
  [ "$PRINT" = 1 ] && return 0
  python3 - "${m/\{rank\}/0}" "$dev" "$mb" "$model" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
head = rows[0]["extra"]
steps = [r for r in rows if r.get("kind") == "step" and r["step"] > 20]
mean = lambda k: sum(r[k] for r in steps) / len(steps)
c, e = mean("comm_ms"), mean("comm_exposed_ms")
print(f"{sys.argv[4]}, {sys.argv[2]} ranks, --bucket-mb {sys.argv[3]} ({head['buckets']} buckets, {head['transport']}): "
      f"step {mean('step_ms'):.3f} ms, backward {mean('backward_ms'):.3f}, communication {c:.3f}, "
      f"exposed {e:.3f} ({100 * e / c:.0f}% of it), mean of steps 21-150")
PYEOF
}

if [ "${1:-}" = __ps-run ]; then
  shift
  ps_run "$@"
  exit
fi
if [ "${1:-}" = __ddp-exposed ]; then
  shift
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  ddp_exposed "$@"
  exit
fi
if [ "${1:-}" = --print-commands ]; then
  PRINT=1
  shift
fi
PHASE=${1:-}
case "$PHASE" in
  correctness) LIMIT=${GPU_CHECK_SECS:-240} ;;
  bench) LIMIT=${GPU_CHECK_SECS:-450} ;;
  *) usage ;;
esac
# No check starts after the deadline; every check's timeout ends by LIMIT.
T0=$SECONDS
HARD=$((T0 + LIMIT))
DEADLINE=$((HARD - 15))

if [ "$PRINT" = 1 ]; then
  WORK=/nonexistent/gpu-check
  PY=python3
  PYARGS=(--python "$PY")
  SAN=compute-sanitizer
  NCU=ncu
else
  OUT=${2:-}
  [ -n "$OUT" ] || usage
  mkdir -p "$OUT"
  OUT=$(cd "$OUT" && pwd)
  [ -x "$W" ] || {
    echo "no binaries in .gpu/bin: run scripts/gpu-build.sh first" >&2
    exit 2
  }
  LOG=$OUT/$PHASE.log
  SUM=$OUT/$PHASE.md
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"; pkill -P $$ 2>/dev/null' EXIT
  : >"$LOG"

  # PyTorch's Python: $PYTHON if set, else the first of the usual places whose Python imports
  # torch (an active virtualenv or conda environment, python3 on PATH, common install
  # folders). Its environment holds cuBLAS, NVRTC and NCCL when no CUDA toolkit is installed;
  # the step benchmark compares against its PyTorch.
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
    PYARGS=(--python "$PY")
  else
    PY=${PYTHON:-python3}
    PY_NOTE="NONE: no Python that imports torch was found (set PYTHON=/path/to/python); no PyTorch rows"
    PYARGS=()
  fi
  # PyTorch's library folders go on LD_LIBRARY_PATH, after any already there, so that a
  # machine without a CUDA toolkit finds cuBLAS, NVRTC and NCCL; gradsync picks one consistent
  # set among every folder it sees and names it (the "CUDA libraries" check).
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
print(":".join(d for d in dirs if os.path.isdir(d)))
PYEOF
  )
  export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}${libs}
  SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  {
    echo "# gradsync GPU check: $PHASE"
    echo
    echo "- date: $(date -u +%FT%TZ)"
    echo "- gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
    echo "- python: $PY_NOTE"
    echo "- library folders added: ${libs:-none}"
    echo "- gradsync: $("$W" --version)"
    echo "- limit: $LIMIT s (no check starts after $((LIMIT - 15)) s)"
    echo
    echo "| check | status | last line |"
    echo "|---|---|---|"
  } >"$SUM"
fi

ok=0
failed=0
skipped=0
unselected=0
# selected NAME: whether GPU_CHECK_ONLY (when set) picks the check NAME; counts those it does not.
selected() {
  [ -z "${GPU_CHECK_ONLY:-}" ] && return 0
  if grep -qiE -- "$GPU_CHECK_ONLY" <<<"$1"; then
    return 0
  fi
  unselected=$((unselected + 1))
  return 1
}
# skip NAME WHY: count and record a check that did not run.
skip() {
  skipped=$((skipped + 1))
  [ "$PRINT" = 1 ] && return 0
  echo "| $1 | SKIPPED: $2 | |" >>"$SUM"
  echo "=== $1: SKIPPED: $2" >>"$LOG"
  echo "$1: SKIPPED: $2"
}

# check NAME LIMIT CMD...: run CMD under a timeout of LIMIT seconds (less where the phase has
# less left), log everything, record the status and the last line. `self ARGS` runs this
# script's internal command ARGS (so that one timeout covers every process it starts).
check() {
  local name=$1 limit=$2
  shift 2
  selected "$name" || return 0
  if [ "$PRINT" = 1 ]; then
    if [ "$1" = self ]; then
      shift
      case "$1" in
      __ps-run) shift && ps_run "$@" ;;
      __ddp-exposed) shift && ddp_exposed "$@" ;;
      esac
    else
      x "$@"
    fi
    return 0
  fi
  [ "$1" = self ] && { shift && set -- "$SELF" "$@"; }
  if [ "$SECONDS" -ge "$DEADLINE" ]; then
    skip "$name" "the phase's deadline ($((DEADLINE - T0)) s) had passed"
    return 0
  fi
  local left=$((HARD - SECONDS))
  [ "$limit" -le "$left" ] || limit=$left
  echo "=== $name (timeout $limit s): $*" >>"$LOG"
  local t0=$SECONDS part=$WORK/part.log
  timeout -k 10 "$limit" "$@" >"$part" 2>&1
  local rc=$?
  cat "$part" >>"$LOG"
  local last
  last=$(grep -v '^\s*$' "$part" | tail -1 | cut -c1-160 | tr '|' '/')
  local status=ok
  case $rc in
    0) ok=$((ok + 1)) ;;
    124 | 137) status="TIMED OUT after $limit s" && failed=$((failed + 1)) ;;
    *) status="FAILED (rc $rc)" && failed=$((failed + 1)) ;;
  esac
  echo "| $name | $status ($((SECONDS - t0)) s) | \`$last\` |" >>"$SUM"
  echo "=== $name: $status" >>"$LOG"
  echo "$name: $status"
}

# diff_check NAME A B TOL: compare two parameter files; SKIPPED when a run before failed to
# leave one.
diff_check() {
  local name=$1 a=$2 b=$3 tol=$4
  selected "$name" || return 0
  if [ "$PRINT" = 0 ] && ! { [ -f "$a" ] && [ -f "$b" ]; }; then
    skip "$name" "no $(basename "$([ -f "$a" ] && echo "$b" || echo "$a")") (the run that writes it did not succeed)"
    return 0
  fi
  check "$name" 30 "$B" diff "$a" "$b" --tol "$tol"
}

correctness() {
  # 1. Which CUDA libraries the worker loads: one folder for cuBLAS and cuBLASLt, with
  # versions (its start line).
  check "CUDA libraries" 60 "$W" train --device cuda --model tiny --steps 1 --eval-every 0
  # 2. The test executables: every backend method and whole steps on the GPU against the CPU,
  # NaN/Inf, determinism, allocations, the half-precision kernels against the host codec; NCCL
  # against a serial reference (as many ranks as GPUs, up to 3), its fp16/bf16 all-reduce and
  # its failure paths; DDP over NCCL with --compress fp16|bf16 (two ranks: skipped with one GPU).
  check "core GPU tests" 90 "$TESTS/gpu" --nocapture --test-threads 1
  # Every model (the MLP, cnn8, resnet20, resnet18, vgg11) on the GPU against PyTorch eager on
  # the same GPU: loss and gradients within 1e-4, 20 steps within 1e-3 (needs safetensors in
  # PyTorch's Python; SKIPPED, saying so, without it).
  check "models against PyTorch on the GPU" 150 env GRADSYNC_PYTORCH_DIR="$PWD/bench/pytorch" \
    GRADSYNC_TORCH_PYTHON="$PY" GRADSYNC_PYTORCH_DEVICES=cuda "$TESTS/pytorch" --nocapture --test-threads 1
  check "NCCL collective tests" 60 "$TESTS/collective" nccl --nocapture --test-threads 1
  check "DDP NCCL fp16/bf16 test" 60 "$TESTS/ddp" ddp_over_nccl_compresses_buckets_on_the_device --exact \
    --nocapture --test-threads 1
  # 3. Local training on the GPU learns, and matches the CPU after 40 steps.
  check "local, mnist, GPU, 300 steps" 60 "$W" train --device cuda --model mnist --steps 300 --eval-every 100 \
    --batch 128
  check "local tiny, CPU reference" 30 "$W" "${TRAIN[@]}" --device cpu --batch 64 --save "$WORK/cpu-64.ckpt"
  check "local tiny, GPU" 30 "$W" "${TRAIN[@]}" --device cuda --batch 64 --save "$WORK/gpu-64.ckpt"
  diff_check "GPU vs CPU after 40 steps (1e-4)" "$WORK/cpu-64.ckpt" "$WORK/gpu-64.ckpt" 1e-4
  # 4. compute-sanitizer (memcheck, leaks) over a short GPU training run.
  if ! selected "compute-sanitizer memcheck"; then
    :
  elif [ -n "$SAN" ]; then
    check "compute-sanitizer memcheck" 90 "$SAN" --tool memcheck --leak-check full --error-exitcode 3 \
      "$W" train "${DATA[@]}" --steps 10 --device cuda --batch 64
  else
    skip "compute-sanitizer memcheck" "compute-sanitizer not found"
  fi
  # 5. PS with 2 and 4 workers sharing the GPU, against local training with the same global batch.
  for w in 2 4; do
    check "PS BSP, $w GPU workers" 60 self __ps-run $w $((64 / w)) "$WORK/ps-$w.ckpt"
    diff_check "PS BSP $w workers vs local (1e-4)" "$WORK/cpu-64.ckpt" "$WORK/ps-$w.ckpt" 1e-4
  done
  # 6. DDP and ZeRO-1 over the TCP backend, staging GPU buffers through the host (2 ranks on
  # the one GPU).
  check "DDP TCP, 2 GPU ranks" 60 "$W" launch --nproc-per-node 2 --master-port 29611 -- \
    "${TRAIN[@]}" --mode ddp --backend tcp --device cuda --batch 32 --save "$WORK/ddp-tcp.ckpt"
  diff_check "DDP TCP vs local (1e-4)" "$WORK/cpu-64.ckpt" "$WORK/ddp-tcp.ckpt" 1e-4
  check "ZeRO-1 TCP, 2 GPU ranks" 60 "$W" launch --nproc-per-node 2 --master-port 29614 -- \
    "${TRAIN[@]}" --mode zero1 --device cuda --batch 32 --save "$WORK/zero1.ckpt"
  diff_check "ZeRO-1 vs local (1e-4)" "$WORK/cpu-64.ckpt" "$WORK/zero1.ckpt" 1e-4
  # 7. NCCL with world size 1 (NCCL refuses two ranks on one GPU); with --compress fp16|bf16
  # each bucket is rounded on the GPU, reduced in NCCL's half type and widened back.
  check "DDP NCCL, world size 1" 60 "$W" launch --nproc-per-node 1 --master-port 29612 -- \
    "${TRAIN[@]}" --mode ddp --backend nccl --device cuda --batch 64 --save "$WORK/ddp-nccl.ckpt"
  diff_check "DDP NCCL vs local GPU (1e-5)" "$WORK/gpu-64.ckpt" "$WORK/ddp-nccl.ckpt" 1e-5
  for c in fp16 bf16; do
    check "DDP NCCL --compress $c, world size 1" 60 "$W" launch --nproc-per-node 1 --master-port 29613 -- \
      "${TRAIN[@]}" --mode ddp --backend nccl --compress $c --device cuda --batch 64 --save "$WORK/ddp-nccl-$c.ckpt"
    diff_check "DDP NCCL $c vs local GPU (1e-2)" "$WORK/gpu-64.ckpt" "$WORK/ddp-nccl-$c.ckpt" 1e-2
  done
  # 8. DP with two replicas on the one GPU.
  check "DP, 2 replicas on one GPU" 60 "$W" "${TRAIN[@]}" --mode dp --replicas 2 --world-size 2 --device cuda \
    --batch 32 --save "$WORK/dp.ckpt"
  diff_check "DP vs local (1e-4)" "$WORK/cpu-64.ckpt" "$WORK/dp.ckpt" 1e-4
  # 9. The embedding model (bag kernels, lazy row updates): the GPU against the CPU after 40
  # steps, and DDP over NCCL gathering the touched rows (world size 1) against local on the GPU.
  local emb=("${EMB[@]}" --batch 64)
  check "local embedding, CPU reference" 30 "$W" "${emb[@]}" --device cpu --save "$WORK/emb-cpu.ckpt"
  check "local embedding, GPU" 30 "$W" "${emb[@]}" --device cuda --save "$WORK/emb-gpu.ckpt"
  diff_check "embedding GPU vs CPU after 40 steps (1e-4)" "$WORK/emb-cpu.ckpt" "$WORK/emb-gpu.ckpt" 1e-4
  check "DDP NCCL embedding, rows gathered, world size 1" 60 "$W" launch --nproc-per-node 1 --master-port 29616 \
    -- "${emb[@]}" --mode ddp --backend nccl --sparse-grads allgather --device cuda --save "$WORK/emb-nccl.ckpt"
  diff_check "embedding DDP NCCL vs local GPU (1e-5)" "$WORK/emb-gpu.ckpt" "$WORK/emb-nccl.ckpt" 1e-5
  # The table's rows by id from GPU workers: PS BSP with 2 workers sharing the GPU, and the
  # hybrid (the table on a --table-only server, the rest over NCCL, world size 1).
  check "PS BSP embedding, 2 GPU workers" 60 self __ps-run 2 32 "$WORK/emb-ps.ckpt" emb
  diff_check "embedding PS vs local GPU (1e-5)" "$WORK/emb-gpu.ckpt" "$WORK/emb-ps.ckpt" 1e-5
  check "hybrid embedding, NCCL world size 1" 60 self __ps-run 1 64 "$WORK/emb-hybrid.ckpt" hybrid
  diff_check "embedding hybrid vs local GPU (1e-5)" "$WORK/emb-gpu.ckpt" "$WORK/emb-hybrid.ckpt" 1e-5
}

bench() {
  # 1. The step against PyTorch eager on the same GPU, FP32 on both sides (its rows need a
  # Python with torch, one process for the whole run; the run fails when --python is given and
  # a row is missing), then the two 16-thread CPU rows of the targets.
  check "step benchmark, GPU (mnist, wide; b512-8192)" 90 "$B" step --model mnist,wide --batch 512,2048,8192 \
    --cpu false --steps 20 --warmup 5 --rounds 3 "${PYARGS[@]}" --json "$WORK/step-gpu.jsonl"
  for mb in "mnist 8192" "wide 2048"; do
    set -- $mb
    check "step benchmark, CPU ($1 b$2, 16 threads)" 40 "$B" step --model "$1" --batch "$2" --threads 16 \
      --gpu false --steps 5 --warmup 2 --rounds 1 "${PYARGS[@]}" --json "$WORK/step-cpu-$1.jsonl"
  done
  # The embedding model on the GPU (2^20 rows of 16 on the clicks; no PyTorch row).
  check "step benchmark, GPU (embedding; b512, b8192)" 40 "$B" step --model embedding --batch 512,8192 \
    --cpu false --steps 20 --warmup 5 --rounds 3 --json "$WORK/step-emb.jsonl"
  # The conv presets (3x32x32) on the GPU against PyTorch eager: every layer kernel in a step.
  check "step benchmark, GPU (resnet20, resnet18, vgg11; b64, b256)" 90 "$B" step \
    --model resnet20,resnet18,vgg11 --batch 64,256 --cpu false --steps 10 --warmup 3 --rounds 1 "${PYARGS[@]}" \
    --json "$WORK/step-conv.jsonl"
  # DDP with 2 GPU ranks over shared memory: how much of the communication backward hides
  # (buckets staged to the host as backward finishes each), 1 MB buckets (mnist's tensors one
  # a bucket) and the default 25 (one bucket: nothing to overlap), then CPU ranks.
  for dm in "cuda 1" "cuda 25" "cpu 1"; do
    set -- $dm
    check "DDP exposed communication, 2 $1 ranks, $2 MB buckets" 45 self __ddp-exposed $1 $2
  done
  # The same where backward takes longer than the communication it could hide: resnet20
  # (0.27 M parameters in 65 tensors, 1 MB buckets) on 3x32x32 images, GPU ranks.
  check "DDP exposed communication, 2 cuda ranks, 1 MB buckets, resnet20" 60 self __ddp-exposed cuda 1 resnet20 \
    synthetic:2048:3x32x32:10
  # 2. NCCL with one rank: device-resident buffers, timed on the GPU.
  check "collective benchmark, NCCL 1 rank" 60 "$B" collective --backend nccl --ranks 1 \
    --max-bytes 268435456 --rounds 3 --raw-secs 0.5 --no-gloo --no-plain
  # 3. A small comparison on the GPU: every mode at 2 workers sharing it; ddp-nccl at 1 worker
  # only (NCCL refuses two ranks on one GPU).
  check "compare on the GPU (2 workers)" 120 "$B" compare --device cuda \
    --modes local,dp,ps-bsp,ddp-tcp,ddp-shm,zero1-tcp --workers 2 --repeats 1 --epochs 2 --out "$WORK/compare/main"
  check "compare on the GPU (ddp-nccl, 1 worker)" 60 "$B" compare --device cuda --modes ddp-nccl --workers 1 \
    --repeats 1 --epochs 2 --out "$WORK/compare/nccl"
  # 4. Nsight Compute: every kernel's time over two resnet18 steps at batch 256 (the warm-up
  # and the timed one), when it exists and time is left.
  if ! selected "ncu kernel times, resnet18 b256"; then
    :
  elif [ -z "$NCU" ]; then
    skip "ncu kernel times, resnet18 b256" "ncu not found"
  elif [ "$PRINT" = 0 ] && [ $((DEADLINE - SECONDS)) -lt 90 ]; then
    skip "ncu kernel times, resnet18 b256" "less than 90 s left"
  else
    check "ncu kernel times, resnet18 b256" 90 "$NCU" --csv --metrics gpu__time_duration.sum \
      --log-file "${OUT:-/nonexistent}/ncu.csv" \
      "$B" step --model resnet18 --batch 256 --cpu false --steps 1 --warmup 1 --rounds 1
  fi
  if [ "$PRINT" = 0 ]; then
    cat "$WORK"/step-gpu.jsonl "$WORK"/step-cpu-*.jsonl "$WORK"/step-emb.jsonl "$WORK"/step-conv.jsonl >"$WORK/step.jsonl" 2>/dev/null
    [ -s "$WORK/step.jsonl" ] && cp "$WORK/step.jsonl" "$OUT/step.jsonl"
    [ -d "$WORK/compare" ] && tar -C "$WORK" -czf "$OUT/compare.tar.gz" compare 2>/dev/null
  fi
}

"$PHASE"
[ "$PRINT" = 1 ] && exit 0
{
  echo
  echo "$ok ok, $failed failed, $skipped skipped${GPU_CHECK_ONLY:+, $unselected not selected by GPU_CHECK_ONLY=$GPU_CHECK_ONLY}; $((SECONDS - T0)) s of $LIMIT s."
  # What the worker loaded, as its start line said (the "CUDA libraries" check).
  grep -m1 '^gradsync: CUDA libraries:' "$LOG" | sed 's/^gradsync: /\n/'
} >>"$SUM"
cat "$SUM"
exit $((failed > 0))
