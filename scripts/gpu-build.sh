#!/usr/bin/env bash
# Build, on an x86-64 development machine, everything scripts/gpu-check.sh needs on a GPU
# machine that has no Rust toolchain: stripped release binaries and the GPU test executable,
# in .gpu/ (ignored by git), small enough to travel with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --workspace --bins
rm -rf .gpu && mkdir -p .gpu/bin .gpu/tests
for b in gradsync-server gradsync-worker gradsync-bench; do
  cp "target/release/$b" .gpu/bin/
  strip .gpu/bin/$b
done
# The core GPU tests (CPU-vs-GPU gradients, training on the GPU) as one executable.
exe=$(cargo test --release -p gradsync-core --test gpu --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        print(m["executable"])')
cp "$exe" .gpu/tests/gpu
strip .gpu/tests/gpu
du -sh .gpu
