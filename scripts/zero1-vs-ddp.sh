#!/bin/bash
# ZeRO-1 against DDP (docs/zero1.md): step time, optimiser state and peak RSS,
# zero1 vs ddp step time, interleaved: for rep in 1..3, for world in 2 4, for mode in ddp zero1.
cd "$(dirname "$0")/.."
W=target/release/gradsync-worker
out=${OUT:-/tmp/zero1-vs-ddp}; mkdir -p $out
for rep in 1 2 3; do for n in 2 4; do for mode in ddp zero1; do
  d=$out/$mode-$n-$rep; mkdir -p $d
  /usr/bin/time -f "%M" -o $d/maxrss $W launch --nproc-per-node $n --master-port 0 -- train --mode $mode \
    --model mnist --data synthetic:8192 --device cpu --threads 1 --batch 64 --steps ${STEPS:-40} --eval-every 0 \
    --transport tcp --quiet --metrics $d/m-{rank}.jsonl || echo FAIL $d
done; done; uptime >> $out/load; done
python3 scripts/zero1-vs-ddp-stats.py $out
cat $out/load
