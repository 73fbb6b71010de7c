#!/usr/bin/env bash
# Dilated time checked where the cores are many: 8 emulated hosts at 10 Gbit/s run undilated on
# all of a machine's cores (16 on the GPU machine), then dilated with the whole run pinned to 2
# cores (`taskset`, which every process it starts inherits): the dilated figures should be
# within 10% of the undilated ones (docs/cluster.md, "Dilated time").
#
#   scripts/dilation-check.sh OUT        # about 6 minutes on 16 cores; needs root (namespaces)
#
# Build first (scripts/gpu-build.sh leaves the binaries in .gpu/bin; GRADSYNC_BIN_DIR names
# another folder). Writes OUT/undilated and OUT/dilated (run directories with their reports) and
# OUT/dilation.md: each mode's mean step and communication, undilated against dilated.
set -euo pipefail
OUT=${1:?usage: scripts/dilation-check.sh OUT}
cd "$(dirname "$0")/.."
BIN=${GRADSYNC_BIN_DIR:-$PWD/.gpu/bin}
B="$BIN/gradsync-bench"
[ -x "$B" ] || { echo "no $B: run scripts/gpu-build.sh first" >&2; exit 2; }
command -v taskset >/dev/null || { echo "SKIPPED: no taskset" >&2; exit 0; }
[ "$(id -u)" = 0 ] || { echo "SKIPPED: emulated hosts need root" >&2; exit 0; }
mkdir -p "$OUT"
echo "cores: $(nproc); $(grep -m1 'model name' /proc/cpuinfo)" | tee "$OUT/dilation.md"
# Ring over 8 hosts; PS with 4 workers and 4 shards, each on its own host (8 hosts).
cell() { # name pin-command... (DILATE: the cluster's --dilate flag, empty for none)
  local name=$1; shift
  timeout 300 "$@" "$B" cluster --bin-dir "$BIN" --rates 10 --models resnet50 --steps 6 --repeats 2 \
    --out "$OUT/$name" --modes ddp-tcp --workers 8 $DILATE >/dev/null
  timeout 300 "$@" "$B" cluster --bin-dir "$BIN" --rates 10 --models resnet50 --steps 6 --repeats 2 \
    --out "$OUT/$name-ps" --modes ps-bsp --workers 4 --shards 4 $DILATE >/dev/null
}
DILATE="" cell undilated env
DILATE="--dilate auto" cell dilated taskset -c 0,1
python3 - "$OUT" <<'PY' | tee -a "$OUT/dilation.md"
import csv, sys, os
out = sys.argv[1]
def means(d):
    rows = [r for r in csv.DictReader(open(os.path.join(d, "summary.csv"))) if r["status"] == "ok"]
    f = lambda k: sum(float(r[k]) for r in rows) / max(len(rows), 1)
    return f("step_ms"), f("comm_ms"), rows[0].get("dilation", "") if rows else ""
for tag in ("", "-ps"):
    u, d = means(f"{out}/undilated{tag}"), means(f"{out}/dilated{tag}")
    print(f"{'ps-bsp 4+4' if tag else 'ddp-tcp 8'}: undilated step {u[0]:.1f} comm {u[1]:.1f} ms; "
          f"dilated x{d[2]} on 2 cores step {d[0]:.1f} ({d[0]/u[0]-1:+.1%}) comm {d[1]:.1f} ({d[1]/u[1]-1:+.1%})")
PY
