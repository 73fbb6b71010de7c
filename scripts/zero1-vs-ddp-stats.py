"""Medians of scripts/zero1-vs-ddp.sh's runs: per run, rank 0's median step (steps 6 on),
exposed communication, communication and update; the median and range over repeats; the
header's optimiser-state bytes and peak RSS after start; the largest rank's peak RSS (GNU
time on the launcher)."""
import json,glob,statistics as st,sys
out=sys.argv[1]
res={}
for d in sorted(glob.glob(out+'/*-*-*')):
    mode,n,rep=d.split('/')[-1].split('-')
    steps=[];hdr=None;exp=[];upd=[];comm=[]
    for r in range(int(n)):
        lines=[json.loads(l) for l in open(f'{d}/m-{r}.jsonl')]
        if r==0: hdr=lines[0]
        ss=[l for l in lines if l['kind']=='step' and l['step']>5]
        if r==0:
            steps=[s['step_ms'] for s in ss]; exp=[s['comm_exposed_ms'] for s in ss]; upd=[s['update_ms'] for s in ss]; comm=[s['comm_ms'] for s in ss]
    rss=int(open(d+'/maxrss').read().split()[-1])
    res.setdefault((mode,int(n)),[]).append((st.median(steps),st.median(exp),st.median(upd),st.median(comm),hdr['extra']['optimizer_state_bytes'],hdr['extra'].get('peak_rss_kib_at_start'),rss))
for (mode,n),v in sorted(res.items(),key=lambda k:(k[0][1],k[0][0])):
    m=[x[0] for x in v]
    print(f"{mode:6} n={n} step median-of-medians {st.median(m):7.1f} ms range {min(m):.1f}-{max(m):.1f} | exposed {st.median([x[1] for x in v]):.1f} comm {st.median([x[3] for x in v]):.1f} update {st.median([x[2] for x in v]):.2f} ms | opt state {v[0][4]/2**20:.2f} MiB | rss@start {v[0][5]/1024:.1f} MiB | max rss {st.median([x[6] for x in v])/1024:.1f} MiB")
