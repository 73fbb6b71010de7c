#!/usr/bin/env bash
# Build, on an x86-64 development machine, everything scripts/gpu-check.sh needs on a GPU
# machine that has no Rust toolchain: stripped release binaries with the PyTorch scripts beside
# them (.gpu/bin/pytorch/) and the GPU test executables, in .gpu/ (ignored by git), small
# enough to travel with the working tree. Then, on the GPU machine:
#   scripts/gpu-check.sh correctness OUT && scripts/gpu-check.sh bench OUT
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --workspace --bins
rm -rf .gpu && mkdir -p .gpu/bin .gpu/tests
for b in gradsync-server gradsync-worker gradsync-bench; do
  cp "target/release/$b" .gpu/bin/
  strip .gpu/bin/$b
done
# The PyTorch scripts the step and collective benchmarks run, where gradsync-bench looks for
# them at run time: pytorch/ beside the binary.
cp -r bench/pytorch .gpu/bin/pytorch
# The GPU test executables: core's (CPU-vs-GPU, training on the GPU, the half-precision
# kernels, and every model against PyTorch), the worker's collectives (NCCL) and DDP's (NCCL
# with --compress fp16|bf16), each as one file.
test_exe() { # test_exe PACKAGE TEST
  cargo test --release -p "$1" --test "$2" --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$2"
}
for t in "gradsync-core gpu" "gradsync-core pytorch" "gradsync-worker collective" "gradsync-worker ddp"; do
  set -- $t
  exe=$(test_exe "$1" "$2")
  cp "$exe" ".gpu/tests/$2"
  strip ".gpu/tests/$2"
done
du -sh .gpu
