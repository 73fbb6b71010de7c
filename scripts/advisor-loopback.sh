#!/usr/bin/env bash
# The advisor against `compare`'s ranked runs on this machine's loopback (docs/advisor.md):
# the default comparison (the MLP preset on the digits) and the conv preset's
# (bench/scenarios/conv-digits.toml), each model's profile recorded by `replay record` at the
# per-worker batch of 2 workers, then every cell's median step beside the advisor's and the
# alpha-beta model's:
#
#   scripts/advisor-loopback.sh OUT    # release binaries; about 10 minutes on 2 cores
#
# A comparison whose directory already holds report.html is kept, so the script can be run
# again after a failure without redoing what finished.
set -euo pipefail
OUT=${1:?usage: scripts/advisor-loopback.sh OUT}
cd "$(dirname "$0")/.."
BIN=${GRADSYNC_BIN_DIR:-$PWD/target/release}
B=$BIN/gradsync-bench
[ -x "$B" ] || { echo "no $B: cargo build --release first" >&2; exit 2; }
mkdir -p "$OUT"
for pair in mnist:default cnn8:conv-digits; do
  model=${pair%%:*} scenario=${pair#*:}
  if [ ! -f "$OUT/$model/report.html" ]; then
    rm -rf "${OUT:?}/$model"
    t=$SECONDS
    "$B" compare "bench/scenarios/$scenario.toml" --out "$OUT/$model" --bin-dir "$BIN" >"$OUT/$model.log" 2>&1
    echo "$model: $((SECONDS - t)) s" | tee -a "$OUT/times.txt"
  fi
  "$B" replay record --model "$model" --batch 32 --data digits --steps 20 --out "$OUT/$model.profile.json"
done
"$B" validate --loopback "$OUT/mnist" --loopback "$OUT/cnn8" \
  --profile "$OUT/mnist.profile.json" --profile "$OUT/cnn8.profile.json" | tee "$OUT/validation.md"
