#!/usr/bin/env bash
# The scale scenario (bench/scenarios/scale.toml) in the cells an hour on 2 cores holds, every
# run on emulated hosts in dilated time, each group a cluster of its own with its report:
#
#   scripts/scale.sh OUT          # needs root (namespaces) and release binaries
#
# Why these cells: a dilated step costs its CPU work whatever the factor (the bytes every
# worker moves times its mode's CPU seconds per GB), so a run's wall time grows with the hosts
# and the model, not with the rate, and `auto`'s probes cost a run each at every trial. The
# whole product (4 models x 3 host counts x 2 placements x 3 rates x 5 designs x 2 repeats) is
# some 400 runs, most of them refused for memory beyond 8 hosts for the 100M-parameter models,
# and would take 5-8 hours here. These groups keep each factor's levels and each pair that
# decides a verdict:
#   hosts   ResNet-50 on 8 hosts at 10, 25 and 100 Gbit/s (every design), and on 32 at 25
#   place   ResNet-50 on 8 hosts of 2 ranks at 25 Gbit/s: the flat ring against ddp-hier
#   models  VGG-16, BERT-base and GPT-2 on 8 hosts at 25 Gbit/s
# Each with 3 steps (the first, the warm-up, left out) and 2 repeats, the least that ranks.
# The 32-host group runs at a fixed x128 (from the 8-host probe: four times the CPU work per
# step over a step 0.8 times as long, at 2.5 times the rate), since `auto`'s probes at 64
# processes would cost as much as its runs; its self-check at x256 vouches for it.
#
# Writes OUT/<group>/ (run directories with report.html) and OUT/scale.md: each run's step,
# communication, the cost model's communication, the advisor's predicted step, its cores'
# busy share and whether its group ranked it.
set -euo pipefail
OUT=${1:?usage: scripts/scale.sh OUT}
cd "$(dirname "$0")/.."
B=${GRADSYNC_BIN_DIR:-$PWD/target/release}/gradsync-bench
[ -x "$B" ] || { echo "no $B: cargo build --release first" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "SKIPPED: emulated hosts need root" >&2; exit 0; }
mkdir -p "$OUT"
S=bench/scenarios/scale.toml
group() { # name flags...
  local name=$1; shift
  local t=$SECONDS
  "$B" cluster "$S" --out "$OUT/$name" --steps 3 --repeats 2 "$@" >"$OUT/$name.log" 2>&1 || true
  echo "$name: $((SECONDS - t)) s" | tee -a "$OUT/times.txt"
}
: >"$OUT/times.txt"
group hosts8 --models resnet50 --workers 8 --ranks-per-host 1 --rates 10,25,100 \
  --modes ddp-tcp,ps-bsp,zero1-tcp --shards hosts,hosts/2
group place --models resnet50 --workers 16 --ranks-per-host 2 --rates 25 \
  --modes ddp-tcp,ddp-hier,ps-bsp --shards hosts
group models --models vgg16,bert-base,gpt2 --workers 8 --ranks-per-host 1 --rates 25 \
  --modes ddp-tcp,ps-bsp,zero1-tcp --shards hosts
group hosts32 --models resnet50 --workers 32 --ranks-per-host 1 --rates 25 --dilate 128 \
  --modes ddp-tcp,ps-bsp,zero1-tcp --shards hosts/2
python3 - "$OUT" <<'PY' | tee "$OUT/scale.md"
import csv, html, json, os, re, sys
out = sys.argv[1]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
print(f"CPU: {cpu}, {os.cpu_count()} cores\n")
print("| group | run | status | step ms | advisor's step ms | error | comm ms | model ms | comm/model | cores busy | dilation |")
print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
def cells(tr):
    return [re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", c))).strip() for c in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", tr, re.S)]
for g in ("hosts8", "place", "models", "hosts32"):
    d = os.path.join(out, g)
    if not os.path.exists(os.path.join(d, "summary.csv")):
        print(f"| {g} | (no runs) | | | | | | | | | |")
        continue
    rows = {r["id"]: r for r in csv.DictReader(open(os.path.join(d, "summary.csv")))}
    page = open(os.path.join(d, "report.html")).read()
    table = next((t for t in re.findall(r"<table.*?</table>", page, re.S) if "advisor" in t), "")
    trs = re.findall(r"<tr.*?</tr>", table, re.S)
    head = cells(trs[0]) if trs else []
    runs = {r["id"]: r for r in json.load(open(os.path.join(d, "cluster.json")))}
    # A table row is a run's: its mode and step (as the table rounds it) name it.
    for tr in trs[1:]:
        c = dict(zip(head, cells(tr)))
        step, adv = c.get("step ms", ""), c.get("advisor's step ms (predicted)", "")
        s = next((r for r in rows.values() if r["mode"] == c.get("mode") and r["step_ms"]
                  and f"{float(r['step_ms']):.1f}" == step and r["id"] in runs), {})
        run = runs.get(s.get("id"), {})
        try:
            err = f"{(float(adv) - float(step)) / float(step) * 100:+.1f}%"
        except ValueError:
            err = ""
        busy = s.get("cpu_busy", "")
        busy = f"{float(busy) * 100:.0f}%" if busy else ""
        name = f"{c.get('mode')} {c.get('workers')} k={c.get('shards')} {s.get('model', '')} {run.get('rate_gbit', 0):g}G"
        print(f"| {g} | {name} | {c.get('status', '')} | {step} | {adv} | {err} | {c.get('communication ms', '')} | "
              f"{c.get('model ms', '')} | {c.get('communication / model', '')} | {busy} | x{run.get('dilation', 1):g} |")
PY
