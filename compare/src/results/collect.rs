//! Finding and reading the metrics: walk the run directories, parse every process's file (a
//! bad line is reported with its path and line number and skipped) and the runner's records,
//! group the files into runs by their headers and timing, and write the merged outputs.

use super::*;

/// Walk `roots`, read every metrics file and every `outcomes.jsonl`, and group and summarise;
/// time-to-accuracy is measured to `target`.
pub fn collect(roots: &[PathBuf], target: Option<f64>) -> anyhow::Result<Collected> {
    let mut files = Vec::new();
    let mut out = Collected::default();
    for root in roots {
        anyhow::ensure!(root.is_dir(), "{} is not a directory", root.display());
        let prefix = if roots.len() > 1 {
            root.file_name().map(|n| format!("{}/", n.to_string_lossy())).unwrap_or_default()
        } else {
            String::new()
        };
        let mut paths = Vec::new();
        walk(root, &mut paths).with_context(|| format!("walking {}", root.display()))?;
        for p in paths {
            let rel = format!("{prefix}{}", p.strip_prefix(root).unwrap_or(&p).display());
            let name = p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
            if name == "outcomes.jsonl" {
                read_outcomes(&p, &rel, &prefix, &mut out);
            } else if !NOT_METRICS.contains(&name.as_str())
                && let Some(f) = read_metrics(&p, rel, &mut out.warnings)
            {
                files.push(f);
            }
        }
    }
    out.runs = group(files, &mut out.warnings);
    // Where two modes start the same processes (ps-bsp and ps-sparse on a model with a table),
    // the runner's record keeps the name the scenario gave.
    for r in out.runs.iter_mut() {
        if let Some(o) = out.outcomes.iter().find(|o| o.id == r.id)
            && o.mode.same_run_as(r.mode)
        {
            r.mode = o.mode;
        }
    }
    let mut summaries: Vec<Summary> = out.runs.iter().map(|r| Summary::of(r, target)).collect();
    for s in summaries.iter_mut() {
        if let Some(o) = out.outcomes.iter().find(|o| o.id == s.id) {
            s.status = o.status.clone();
            s.cpu_busy = o.cpu_busy;
            s.cpu_s = o.cpu_s;
            s.error = o.error.clone().unwrap_or_default();
            s.repeat = o.repeat;
            s.restarts = o.restarts.clone();
        }
    }
    for o in &out.outcomes {
        if !summaries.iter().any(|s| s.id == o.id) {
            summaries.push(Summary::missing(o));
        }
    }
    out.dilations = roots.iter().flat_map(|d| crate::emulated::load_dilation(d)).collect();
    let too_small: Vec<(f64, f64)> = out
        .dilations
        .iter()
        .filter(|d| d.check.as_ref().is_some_and(|c| c.differs))
        .map(|d| (d.rate_gbit, d.dilation))
        .collect();
    for r in crate::emulated::load(roots) {
        if let Some(s) = summaries.iter_mut().find(|s| s.id == r.id) {
            s.link = r.label();
            s.colocated = r.colocated;
            s.dilation_too_small = too_small.contains(&(r.rate_gbit, r.dilation));
        }
    }
    out.cells = Cell::all(&summaries);
    out.summaries = summaries;
    out.target = target;
    Ok(out)
}

/// Every `*.jsonl` file under `dir`, in sorted order.
fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    let mut entries: Vec<PathBuf> =
        std::fs::read_dir(dir)?.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            // A dilated cluster's probes and self-checks are a comparison of their own.
            if p.file_name().is_some_and(|n| n == crate::emulated::CHECKS_DIR) {
                continue;
            }
            walk(&p, out)?;
        } else if p.extension().is_some_and(|e| e == "jsonl") {
            out.push(p);
        }
    }
    Ok(())
}

fn read_outcomes(path: &Path, rel: &str, prefix: &str, out: &mut Collected) {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            out.warnings.push(format!("{rel}: {e}"));
            return;
        }
    };
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        match serde_json::from_str::<Outcome>(line) {
            Ok(mut o) => {
                o.id = format!("{prefix}{}", o.id);
                out.outcomes.push(o);
            }
            Err(e) => out.warnings.push(format!("{rel}:{}: {e}", i + 1)),
        }
    }
}

/// Parse one metrics file; `None` (with a warning) when it has no usable header.
fn read_metrics(path: &Path, rel: String, warnings: &mut Vec<String>) -> Option<MetricsFile> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) => {
            warnings.push(format!("{rel}: {e}"));
            return None;
        }
    };
    let text = String::from_utf8_lossy(&bytes);
    let mut header = None;
    let (mut steps, mut applies) = (Vec::new(), Vec::new());
    let complete = text.ends_with('\n');
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let n = i + 1;
        match parse_line(line) {
            Ok(Record::Header(h)) if header.is_none() && n == 1 => header = Some(h),
            Ok(Record::Header(_)) => warnings.push(format!("{rel}:{n}: a second header; line skipped")),
            Ok(_) if header.is_none() => {
                warnings.push(format!("{rel}:{n}: records before any header; file skipped"));
                return None;
            }
            Ok(Record::Step(s)) => {
                // A worker restarted with --resume adds to its file from the step after its
                // checkpoint: the steps it computes again replace those lost with the failure.
                while steps.last().is_some_and(|p: &Step| p.step >= s.step) {
                    steps.pop();
                }
                steps.push(s)
            }
            Ok(Record::ServerApply(a)) => applies.push(a),
            Err(e) if n == 1 => {
                warnings.push(format!("{rel}:1: not a metrics header ({e}); file skipped"));
                return None;
            }
            Err(e) if n == lines.len() && !complete => {
                warnings.push(format!("{rel}:{n}: truncated last line ({e}); skipped"))
            }
            Err(e) => warnings.push(format!("{rel}:{n}: {e}; line skipped")),
        }
    }
    let Some(header) = header else {
        warnings.push(format!("{rel}: empty metrics file; skipped"));
        return None;
    };
    Some(MetricsFile { rel, header, steps, applies })
}

/// The configuration that processes of one run share.
/// What [`config_key`] returns: mode, variant, widths, seed, world size, global batch,
/// compression.
type ConfigKey = (String, String, String, u64, usize, usize, String);

fn config_key(h: &Header) -> ConfigKey {
    let variant = if h.mode == "server" || h.mode == "ps" {
        h.variant.split(':').next().unwrap_or("").to_string()
    } else {
        h.variant.clone()
    };
    let mode = if h.mode == "server" { "ps".to_string() } else { h.mode.clone() };
    // Servers and workers both name the compression they ran with (none when absent).
    let compression = h.extra.get("compression").and_then(|v| v.as_str()).unwrap_or("none").to_string();
    (mode, variant, h.widths.clone(), h.seed, h.world_size, h.global_batch, compression)
}

/// Whether a server of configuration `server` can serve the workers of configuration
/// `worker`: a PS run's of the same synchronisation, model, seed and compression, or a hybrid
/// run's table (its servers run BSP; its workers' variant names their collective backend).
fn serves(worker: &ConfigKey, server: &ConfigKey) -> bool {
    let same_model = (&worker.2, worker.3, &worker.6) == (&server.2, server.3, &server.6);
    same_model
        && match worker.0.as_str() {
            "ps" => worker.1 == server.1,
            "hybrid" => server.1 == "bsp",
            _ => false,
        }
}

/// Whether a header's model has an embedding table (its widths start with the sparse
/// model's name).
fn has_table(h: &Header) -> bool {
    let e = gradsync_core::model::EMBEDDING;
    h.preset == e || h.widths.strip_prefix(e).is_some_and(|rest| rest.is_empty() || rest.starts_with(':'))
}

/// The directory part of a relative path.
fn dir_of(rel: &str) -> &str {
    rel.rsplit_once('/').map_or("", |(d, _)| d)
}

/// Worker files one run holds: one for local and DP (replicas share a process), one per rank
/// otherwise.
fn expected_files(h: &Header) -> usize {
    if h.mode == "local" || h.mode == "dp" { 1 } else { h.world_size.max(1) }
}

/// Group worker files into runs: the same configuration and overlapping lifetimes (processes
/// of one run run together; repeated runs of one configuration follow each other), never two
/// files of one rank, never more files than the run has processes. Files of the same directory
/// are matched first, with exact lifetimes (one clock); files of other directories (other
/// hosts) then, with a little slack for clock skew. Server files join the PS run of their
/// configuration whose lifetime they overlap, preferring their own directory.
///
/// A PS worker's lifetime counts as its server's too (a server of its configuration in its
/// directory whose lifetime overlaps its own): under ASP a fast worker may finish before
/// another has started, and only the server that served both ties them together.
fn group(files: Vec<MetricsFile>, warnings: &mut Vec<String>) -> Vec<RunData> {
    let (mut servers, mut workers): (Vec<_>, Vec<_>) = files.into_iter().partition(MetricsFile::is_server);
    let by_start =
        |a: &MetricsFile, b: &MetricsFile| a.start().total_cmp(&b.start()).then_with(|| a.rel.cmp(&b.rel));
    workers.sort_by(by_start);
    servers.sort_by(by_start);
    let mut runs: Vec<(RunData, f64, f64)> = Vec::new();
    // Clocks of different hosts disagree a little; lifetimes that miss by less still match.
    const SLACK_MS: f64 = 2000.0;
    let overlaps = |s: f64, e: f64, rs: f64, re: f64, slack: f64| s <= re + slack && e + slack >= rs;
    let lifetime = |f: &MetricsFile| {
        let key = config_key(&f.header);
        servers
            .iter()
            .filter(|x| {
                let k = config_key(&x.header);
                serves(&key, &k)
                    && dir_of(&x.rel) == dir_of(&f.rel)
                    && overlaps(f.start(), f.end(), x.start(), x.end(), 0.0)
            })
            .fold((f.start(), f.end()), |(s, e), x| (s.min(x.start()), e.max(x.end())))
    };
    for f in workers {
        let extra = |key: &str| f.header.extra.get(key).and_then(|v| v.as_str());
        let Some(mode) = ModeKind::from_header(&gradsync_worker::modes::HeaderMode {
            mode: &f.header.mode,
            variant: &f.header.variant,
            transport: extra("transport"),
            compression: extra("compression"),
            table: has_table(&f.header),
            sparse_grads: extra("sparse_grads"),
            all_reduce: extra("all_reduce"),
        }) else {
            warnings.push(format!("{}:1: unknown mode '{}'; file skipped", f.rel, f.header.mode));
            continue;
        };
        let key = config_key(&f.header);
        let (s, e) = lifetime(&f);
        let rank = f.header.rank;
        let fits = |r: &RunData| {
            config_key(r.header()) == key
                && r.workers.len() < expected_files(r.header())
                && !r.workers.iter().any(|w| w.header.rank == rank)
        };
        let same_dir = runs.iter().position(|(r, rs, re)| {
            fits(r)
                && r.workers.iter().any(|w| dir_of(&w.rel) == dir_of(&f.rel))
                && overlaps(s, e, *rs, *re, 0.0)
        });
        let found = same_dir.or_else(|| {
            runs.iter().position(|(r, rs, re)| {
                fits(r)
                    && r.workers.iter().all(|w| dir_of(&w.rel) != dir_of(&f.rel))
                    && overlaps(s, e, *rs, *re, SLACK_MS)
            })
        });
        match found {
            Some(i) => {
                let (r, rs, re) = &mut runs[i];
                *rs = rs.min(s);
                *re = re.max(e);
                r.workers.push(f);
            }
            None => runs.push((RunData { id: String::new(), mode, workers: vec![f], servers: vec![] }, s, e)),
        }
    }
    for f in servers {
        let key = config_key(&f.header);
        let (s, e) = (f.start(), f.end());
        let shard = f.header.extra.get("shard").and_then(|v| v.as_u64());
        let fits = |r: &RunData| {
            let k = config_key(r.header());
            let want =
                r.header().extra.get("shards").and_then(|v| v.as_u64()).map_or(usize::MAX, |k| k as usize);
            serves(&k, &key)
                && r.servers.len() < want
                && !r
                    .servers
                    .iter()
                    .any(|x| shard.is_some() && x.header.extra.get("shard").and_then(|v| v.as_u64()) == shard)
        };
        let same_dir = runs.iter().position(|(r, rs, re)| {
            fits(r)
                && r.workers.iter().any(|w| dir_of(&w.rel) == dir_of(&f.rel))
                && overlaps(s, e, *rs, *re, 0.0)
        });
        let found = same_dir
            .or_else(|| runs.iter().position(|(r, rs, re)| fits(r) && overlaps(s, e, *rs, *re, SLACK_MS)));
        match found {
            Some(i) => runs[i].0.servers.push(f),
            None => warnings.push(format!("{}: a server's metrics with no matching workers; skipped", f.rel)),
        }
    }
    let mut out: Vec<RunData> = runs
        .into_iter()
        .map(|(mut r, _, _)| {
            r.workers.sort_by_key(|w| w.header.rank);
            r.servers.sort_by(|a, b| a.rel.cmp(&b.rel));
            r.id = common_dir(r.workers.iter().chain(&r.servers).map(|f| f.rel.as_str()));
            r
        })
        .collect();
    out.sort_by(|a, b| a.id.cmp(&b.id).then_with(|| a.workers[0].rel.cmp(&b.workers[0].rel)));
    // Runs whose files share no directory below the root would share an id.
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for r in out.iter_mut() {
        let n = seen.entry(r.id.clone()).or_insert(0);
        *n += 1;
        if *n > 1 {
            r.id = format!("{}#{n}", r.id);
        }
    }
    out
}

/// The longest common directory of relative paths (`.` when none).
pub(super) fn common_dir<'a>(paths: impl Iterator<Item = &'a str>) -> String {
    let mut common: Option<Vec<&str>> = None;
    for p in paths {
        let dirs: Vec<&str> = p.split('/').collect();
        let dirs = &dirs[..dirs.len().saturating_sub(1)];
        common = Some(match common {
            None => dirs.to_vec(),
            Some(c) => c.iter().zip(dirs).take_while(|(a, b)| a == b).map(|(a, _)| *a).collect(),
        });
    }
    let c = common.unwrap_or_default();
    if c.is_empty() { ".".into() } else { c.join("/") }
}

/// Write `runs.jsonl` (every step and server update, with its run's columns) and
/// `summary.csv` (one row per run) into `dir`.
pub fn write_merged(c: &Collected, dir: &Path) -> anyhow::Result<()> {
    let mut lines = String::new();
    for r in &c.runs {
        let h = r.header();
        let mut base = serde_json::Map::new();
        base.insert("run".into(), r.id.clone().into());
        base.insert("mode".into(), r.mode.label().into());
        base.insert("workers".into(), r.world().into());
        base.insert("shards".into(), r.shards().into());
        base.insert("model".into(), h.preset.clone().into());
        base.insert("global_batch".into(), h.global_batch.into());
        let mut emit = |kind: &str, rec: serde_json::Value| {
            let mut m = base.clone();
            m.insert("kind".into(), kind.into());
            if let serde_json::Value::Object(o) = rec {
                m.extend(o);
            }
            lines.push_str(&serde_json::Value::Object(m).to_string());
            lines.push('\n');
        };
        for f in &r.workers {
            for s in &f.steps {
                emit("step", serde_json::to_value(s).unwrap_or_default());
            }
        }
        for f in &r.servers {
            for a in &f.applies {
                emit("server_apply", serde_json::to_value(a).unwrap_or_default());
            }
        }
    }
    let p = dir.join("runs.jsonl");
    std::fs::write(&p, lines).with_context(|| format!("writing {}", p.display()))?;
    let p = dir.join("summary.csv");
    let mut w = csv::Writer::from_path(&p).with_context(|| format!("writing {}", p.display()))?;
    for s in &c.summaries {
        w.serialize(s).with_context(|| format!("writing {}", p.display()))?;
    }
    w.flush().with_context(|| format!("writing {}", p.display()))?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A worker restarted with --resume after step 3, from its checkpoint of step 2, appends
    /// steps 3 and 4: the file reads as steps 1 to 4 once each, the later step 3 kept.
    #[test]
    fn a_resumed_workers_steps_replace_those_it_computed_again() {
        let dir = std::env::temp_dir().join(format!("gradsync-collect-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rank0.jsonl");
        let line = |r: Record| serde_json::to_string(&r).unwrap();
        let step = |n: u64, wall: f64| Record::Step(Step { step: n, wall_ms: wall, ..Step::default() });
        let lines = [
            line(Record::Header(Header::default())),
            line(step(1, 10.0)),
            line(step(2, 20.0)),
            line(step(3, 30.0)),
            line(step(3, 90.0)),
            line(step(4, 100.0)),
        ];
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        let mut warnings = Vec::new();
        let f = read_metrics(&path, "rank0.jsonl".into(), &mut warnings).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let got: Vec<(u64, f64)> = f.steps.iter().map(|s| (s.step, s.wall_ms)).collect();
        assert_eq!(got, [(1, 10.0), (2, 20.0), (3, 90.0), (4, 100.0)], "{warnings:?}");
    }

    /// The two ranks of a dilated run start 150 ms apart on the machine's clock and record
    /// 40 ms of emulated time (160 ms real at x4): their lifetimes overlap, so they are one
    /// run, not two.
    #[test]
    fn a_dilated_runs_ranks_are_one_run_by_their_real_lifetimes() {
        let file = |rank: usize, start: u64| MetricsFile {
            rel: format!("runs/a/rank{rank}.jsonl"),
            header: Header {
                mode: "ddp".into(),
                variant: "tcp".into(),
                world_size: 2,
                rank,
                start_unix_ms: start,
                dilation: Some(4.0),
                ..Header::default()
            },
            steps: vec![Step { rank, step: 1, wall_ms: 40.0, ..Step::default() }],
            applies: Vec::new(),
        };
        let mut warnings = Vec::new();
        let runs = group(vec![file(0, 1_000), file(1, 1_150)], &mut warnings);
        assert_eq!(runs.len(), 1, "{:?} {warnings:?}", runs.iter().map(|r| &r.id).collect::<Vec<_>>());
        assert_eq!(runs[0].workers.len(), 2);
    }
}
