//! `gradsync-bench compare` end to end: the default scenario scaled down (tiny model, a few
//! steps, 1 and 2 workers) with real worker and server processes. Every mode is started; a
//! mode this build cannot run fails, is reported with its error, and the others go on.
#![allow(clippy::unwrap_used)] // a test fails loudly on anything unexpected

use std::path::{Path, PathBuf};
use std::process::Command;

use gradsync_compare::scenario::Scenario;

use gradsync_compare::charts::NAMES as CHARTS;
use gradsync_testkit::Scratch;

fn compare(scenario: &Path, out: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gradsync-bench"))
        .arg("compare")
        .arg(scenario)
        .arg("--out")
        .arg(out)
        .arg("--bin-dir")
        .arg(gradsync_testkit::process::bin_dir())
        // Set for `compare --hosts`, it must not stop a comparison on this machine.
        .env("GRADSYNC_SSH_OPTS", "-F /nonexistent")
        .output()
        .unwrap()
}

#[test]
fn default_scenario_scaled_down_runs_end_to_end() {
    let root = Scratch::new("compare");
    let mut s = Scenario::load(None).unwrap();
    s.models = vec!["tiny".into()];
    (s.steps, s.epochs) = (Some(6), None);
    s.eval_samples = Some(64);
    s.repeats = 2;
    s.workers = vec![2];
    s.shards = gradsync_compare::scenario::Shards::counts(&[1]);
    s.batches = vec![32];
    s.rawtcp_s = 0.2;
    s.run_timeout_s = 60.0;
    s.trace = true;
    let scenario = root.join("small.toml");
    std::fs::write(&scenario, toml::to_string(&s).unwrap()).unwrap();
    let out = root.join("out");
    let o = compare(&scenario, &out);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "compare failed:\n{err}");

    // The run directory: scenario, machine, outcomes, per-process metrics.
    for f in ["scenario.toml", "machine.json", "outcomes.jsonl", "runs.jsonl", "summary.csv", "report.html"] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    let machine: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("machine.json")).unwrap()).unwrap();
    assert!(machine["tcp_bandwidth"].as_f64().unwrap() > 1e6);
    assert!(machine["tcp_latency_s"].as_f64().unwrap() > 0.0);
    assert!(!machine["gradsync_commit"].as_str().unwrap().is_empty());
    assert!(machine["cores"].as_u64().unwrap() >= 1);

    // Every cell of the matrix has a row, with a status; failures say why.
    let expected = s.expand().len();
    let mut rdr = csv::Reader::from_path(out.join("summary.csv")).unwrap();
    let head = rdr.headers().unwrap().clone();
    let col = |name: &str| head.iter().position(|h| h == name).unwrap();
    let rows: Vec<csv::StringRecord> = rdr.records().map(|r| r.unwrap()).collect();
    assert_eq!(rows.len(), expected, "one row per run");
    for r in &rows {
        let status = &r[col("status")];
        assert!(["ok", "failed", "skipped"].contains(&status), "{r:?}");
        if status != "ok" {
            assert!(!r[col("error")].is_empty(), "a {status} run without a reason: {r:?}");
        } else {
            assert!(r[col("samples_per_s")].parse::<f64>().unwrap() > 0.0, "{r:?}");
            assert_eq!(r[col("steps")].parse::<u64>().unwrap(), 6, "{r:?}");
        }
    }
    let local = rows.iter().find(|r| &r[col("mode")] == "local").unwrap();
    assert_eq!(&local[col("status")], "ok", "local must always run: {local:?}");
    let nccl: Vec<_> = rows.iter().filter(|r| &r[col("mode")] == "ddp-nccl").collect();
    if machine["gpus"].as_array().unwrap().is_empty() {
        assert!(nccl.iter().all(|r| &r[col("status")] == "skipped"), "NCCL without a GPU must be skipped");
    }

    // The local run's files: metrics with a header and 6 steps, a Chrome trace with the spans.
    let local_dir = out.join(&local[col("id")]);
    let metrics = std::fs::read_to_string(local_dir.join("rank0.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 7);
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(local_dir.join("trace-rank0.json")).unwrap()).unwrap();
    let names: Vec<&str> =
        trace["traceEvents"].as_array().unwrap().iter().filter_map(|e| e["name"].as_str()).collect();
    for span in ["forward", "backward", "update", "step 6"] {
        assert!(names.contains(&span), "no {span} span in {names:?}");
    }
    // A BSP server's timeline: each round's wait for pushes and apply, each pull encoding.
    let bsp = rows.iter().find(|r| &r[col("mode")] == "ps-bsp" && &r[col("status")] == "ok").unwrap();
    let trace: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join(&bsp[col("id")]).join("trace-server0.json")).unwrap(),
    )
    .unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    for (prefix, pid) in [("wait for pushes v", 1000), ("apply v", 1000)] {
        let n = events.iter().filter(|e| e["name"].as_str().is_some_and(|n| n.starts_with(prefix))).count();
        assert!(n >= 5, "{n} '{prefix}' spans in the server's trace");
        assert!(events.iter().all(|e| e["pid"] == pid), "server spans under its own process id");
    }

    // Every chart, both formats, inlined in the report.
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    for c in CHARTS {
        let png = std::fs::read(out.join(format!("{c}.png"))).unwrap();
        assert!(png.starts_with(b"\x89PNG") && png.len() > 2000, "{c}.png");
        let svg = std::fs::read_to_string(out.join(format!("{c}.svg"))).unwrap();
        assert!(svg.contains("<svg") && svg.contains("</svg>"), "{c}.svg");
        assert!(html.contains(&format!("<figure id=\"{c}\">")), "{c} not in the report");
    }
    assert!(html.contains("Scaling efficiency") && html.contains("Cost model, extrapolated"));
    assert!(
        html.contains("is fastest with") || html.contains("the fastest are level"),
        "no computed reading in the report"
    );
    assert!(html.contains("Time to 97.0% held-out accuracy"), "no convergence table");

    // Each cell ran `repeats` times with another data order; the ring's two modes ran on the
    // wire they are named for, and every chart label names it.
    for mode in ["local", "ps-bsp", "ddp-tcp"] {
        let n = rows.iter().filter(|r| &r[col("mode")] == mode && &r[col("status")] == "ok").count();
        assert_eq!(n, 2, "{mode}: one row per repeat");
    }
    for (mode, transport) in [("ddp-tcp", "tcp"), ("ddp-shm", "shm"), ("zero1-tcp", "tcp")] {
        let r = rows.iter().find(|r| &r[col("mode")] == mode && &r[col("status")] == "ok").unwrap();
        let header: serde_json::Value = serde_json::from_str(
            std::fs::read_to_string(out.join(&r[col("id")]).join("rank0.jsonl"))
                .unwrap()
                .lines()
                .next()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(header["extra"]["transport"], transport, "{mode}: {header}");
        assert!(header["extra"]["buckets"].as_u64() >= Some(1), "{mode}: no bucket count: {header}");
        // The breakdown adds up: the exposed part of communication is part of it.
        let text = std::fs::read_to_string(out.join(&r[col("id")]).join("rank0.jsonl")).unwrap();
        for l in text.lines().skip(1) {
            let st: serde_json::Value = serde_json::from_str(l).unwrap();
            let (c, e) = (st["comm_ms"].as_f64().unwrap(), st["comm_exposed_ms"].as_f64().unwrap());
            assert!(e <= c + 1e-9, "{mode}: exposed {e} ms > communication {c} ms: {l}");
        }
    }
    let orders: Vec<u64> = rows
        .iter()
        .filter(|r| &r[col("mode")] == "local")
        .map(|r| {
            let h: serde_json::Value = serde_json::from_str(
                std::fs::read_to_string(out.join(&r[col("id")]).join("rank0.jsonl"))
                    .unwrap()
                    .lines()
                    .next()
                    .unwrap(),
            )
            .unwrap();
            h["extra"]["order_seed"].as_u64().unwrap()
        })
        .collect();
    assert_eq!(orders, [s.seed, s.seed + 1], "repeats draw the data in other orders");
    for label in [
        "ddp-tcp (TCP sockets)",
        "ddp-shm (shared memory)",
        "ps-bsp k=1 (gRPC over TCP)",
        "zero1-tcp (TCP sockets)",
    ] {
        assert!(html.contains(label), "{label} not labelled in the report");
    }
    // ZeRO-1 is read against DDP over the same sockets.
    assert!(html.contains("ZeRO-1 at 2 workers:"), "no ZeRO-1 reading in the report");

    // A second comparison into the same directory is refused rather than mixed in.
    let again = compare(&scenario, &out);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already holds a comparison"));
}

/// A small scenario of `modes` at 2 workers into `root/name.toml`.
fn small(root: &Path, name: &str, modes: &[&str], steps: u64, extra: &str) -> PathBuf {
    let text = format!(
        "name = '{name}'\nmodes = {modes:?}\nworkers = [2]\nmodels = ['tiny']\nbatches = [32]\ndata = 'digits'\n\
         steps = {steps}\nrepeats = 2\nrawtcp_s = 0.2\nrun_timeout_s = 60\n{extra}"
    );
    let p = root.join(format!("{name}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

fn outcomes(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("outcomes.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn ctrl_c_keeps_the_finished_runs_and_resume_runs_the_rest() {
    use std::io::{BufRead, BufReader};
    let root = Scratch::new("resume");
    let scenario = small(&root, "resume", &["local", "ps-asp"], 400, "");
    let out = root.join("out");
    let mut child = Command::new(env!("CARGO_BIN_EXE_gradsync-bench"))
        .arg("compare")
        .arg(&scenario)
        .arg("--out")
        .arg(&out)
        .arg("--bin-dir")
        .arg(gradsync_testkit::process::bin_dir())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Each finished run prints its line: interrupt right after the first one, as Ctrl-C would.
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        assert!(err.read_line(&mut line).unwrap() > 0, "compare ended before a run finished:\n{seen}");
        seen.push_str(&line);
        if line.starts_with("001-local") {
            break;
        }
    }
    let pid = i32::try_from(child.id()).unwrap();
    // SAFETY: kill(2) on the child we spawned and have not reaped.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGINT) }, 0);
    let rest = std::io::read_to_string(err).unwrap();
    let st = child.wait().unwrap();
    assert_eq!(st.code(), Some(130), "{seen}{rest}");
    assert!(rest.contains("interrupted") && rest.contains("--resume"), "{rest}");
    // What finished is summarised; the run under way is listed apart, never in a figure.
    assert!(out.join("report.html").is_file() && out.join("summary.csv").is_file());
    let first = outcomes(&out);
    assert_eq!(first[0]["status"], "ok");
    assert!(first.iter().all(|o| o["status"] == "ok" || o["status"] == "interrupted"), "{first:?}");
    assert!(first.len() < 4, "interrupted after the first run, yet {} ran", first.len());

    let o = Command::new(env!("CARGO_BIN_EXE_gradsync-bench"))
        .arg("compare")
        .arg("--resume")
        .arg(&out)
        .arg("--bin-dir")
        .arg(gradsync_testkit::process::bin_dir())
        // Set for `compare --hosts`, it must not stop a comparison on this machine.
        .env("GRADSYNC_SSH_OPTS", "-F /nonexistent")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let all = outcomes(&out);
    let mut ids: Vec<&str> = all.iter().map(|o| o["id"].as_str().unwrap()).collect();
    ids.sort();
    assert_eq!(ids.len(), 4, "{all:?}");
    ids.dedup();
    assert_eq!(ids.len(), 4, "a run recorded twice: {all:?}");
    assert!(all.iter().all(|o| o["status"] == "ok"), "{all:?}");
    // The finished run was kept as it was, not run again.
    assert_eq!(all[0], first[0]);
}

#[test]
fn a_diverged_run_is_recorded_as_such_and_read_as_nothing() {
    let root = Scratch::new("diverge");
    let scenario = small(&root, "diverge", &["local", "ps-asp"], 60, "lr = 40.0\n");
    let out = root.join("out");
    let o = compare(&scenario, &out);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let all = outcomes(&out);
    assert_eq!(all.len(), 4);
    for x in &all {
        assert_eq!(x["status"], "diverged", "{x}");
        let error = x["error"].as_str().unwrap();
        assert!(error.contains("diverged at step") && error.contains("--lr 40"), "{x}");
        // The advice besides the learning rate is the strategy's: ASP servers' staleness.
        let asp = x["id"].as_str().unwrap().contains("ps-asp");
        assert_eq!(error.contains("--staleness-lr inverse") && error.contains("--sync ssp:S"), asp, "{x}");
    }
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(
        html.contains("4 runs diverged") && html.contains("never read as a speed"),
        "report says nothing"
    );
    assert!(
        !html.contains("is fastest with") && !html.contains("are level"),
        "a speed read from diverged runs"
    );
}

#[test]
fn a_run_can_stop_at_its_target_accuracy() {
    let root = Scratch::new("target");
    let scenario = small(
        &root,
        "target",
        &["local"],
        2000,
        "eval_samples = 320\ntarget_accuracy = 0.6\nstop_at_target = true\n",
    );
    let out = root.join("out");
    let o = compare(&scenario, &out);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let all = outcomes(&out);
    assert_eq!(all.len(), 2);
    for x in &all {
        assert_eq!(x["status"], "ok", "{x}");
        let text = std::fs::read_to_string(out.join(x["id"].as_str().unwrap()).join("rank0.jsonl")).unwrap();
        let steps: Vec<serde_json::Value> =
            text.lines().skip(1).filter_map(|l| serde_json::from_str(l).ok()).collect();
        assert!(steps.len() < 2000, "ran its whole budget of 2000 steps");
        let best = steps.iter().filter_map(|s| s["accuracy"].as_f64()).fold(0.0, f64::max);
        assert!(best >= 0.6, "stopped before the target: {best}");
    }
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("Time to 60.0% held-out accuracy"), "no convergence table");
}

#[test]
fn a_bad_scenario_is_refused_with_its_name() {
    let dir = Scratch::new("bad-scenario");
    let p = dir.join("scenario.toml");
    std::fs::write(&p, "name = 'x'\nmodes = ['local']\nworkers = [1]\nmodels = ['tiny']\nbatches = [8]\n")
        .unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_gradsync-bench"))
        .args(["compare", p.to_str().unwrap(), "--bin-dir", "/nonexistent"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(&p.display().to_string()) && err.contains("steps"), "{err}");
    std::fs::remove_file(&p).unwrap();
}

/// A dilated world slows its links with its clocks, and ranks placed several to a host (or
/// shards beside them) need hosts to place them on: `compare` has neither, and says to run such a scenario with
/// `cluster`, before starting anything.
#[test]
fn a_dilated_or_placed_scenario_is_sent_to_the_cluster() {
    let dir = Scratch::new("dilate-compare");
    let base = "name = 'x'\nmodes = ['local']\nmodels = ['tiny']\nbatches = [8]\nsteps = 2\n";
    for (i, (keys, says)) in [
        ("workers = [1]\ndilate = 4\n", "`dilate = 4` needs emulated links"),
        (
            "workers = [2]\nranks_per_host = [2]\n",
            "`hosts` and `ranks_per_host` place ranks on emulated hosts",
        ),
        ("hosts = [2]\n", "`hosts` and `ranks_per_host` place ranks on emulated hosts"),
        ("workers = [2]\nservers = ['colocated']\n", "`servers` places shards on emulated worker hosts"),
    ]
    .into_iter()
    .enumerate()
    {
        let p = dir.join(format!("scenario{i}.toml"));
        std::fs::write(&p, format!("{base}{keys}")).unwrap();
        let out = dir.join(format!("out{i}"));
        let o = Command::new(env!("CARGO_BIN_EXE_gradsync-bench"))
            .args(["compare", p.to_str().unwrap(), "--out", out.to_str().unwrap()])
            .arg("--bin-dir")
            .arg(gradsync_testkit::process::bin_dir())
            .output()
            .unwrap();
        assert!(!o.status.success(), "{keys}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(says) && err.contains("gradsync-bench cluster"), "{keys}: {err}");
        assert!(!out.join("outcomes.jsonl").exists(), "{keys}: a run was started");
    }
}

/// The sparse modes end to end on a small table: each starts what its name says, is read back
/// under its name (the hybrid with its table's server), trains to local training's accuracy,
/// and moves the bytes the cost model gives it from the rows its batches named.
#[test]
fn sparse_modes_move_the_bytes_the_cost_model_gives_them() {
    use gradsync_compare::cost::{self, Sparse};
    use gradsync_compare::scenario::ModeKind;

    let root = Scratch::new("sparse");
    let text = "name = 'sparse'\nmodes = ['local', 'ps-sparse', 'ddp-dense', 'ddp-allgather', 'hybrid']\n\
                workers = [2]\nmodels = ['embedding:4096:8']\ndata = 'clicks:2048:4096'\nbatches = [32]\n\
                steps = 12\neval_samples = 192\nrepeats = 1\nlr = 0.5\nrawtcp_s = 0.2\nrun_timeout_s = 60\n";
    let scenario = root.join("sparse.toml");
    std::fs::write(&scenario, text).unwrap();
    let out = root.join("out");
    let o = compare(&scenario, &out);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "compare failed:\n{err}");
    for x in outcomes(&out) {
        assert_eq!(x["status"], "ok", "{x}");
    }
    let c = gradsync_compare::results::collect(std::slice::from_ref(&out), None).unwrap();
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    let row = |m: ModeKind| {
        c.summaries.iter().find(|s| s.mode == m.label()).unwrap_or_else(|| panic!("no {m} row"))
    };
    // The table, 4096 x 8, and the dense layers: 8x64 + 64, 64x2 + 2.
    let (rows, dim) = (4096, 8);
    let dense = 4.0 * (8 * 64 + 64 + 64 * 2 + 2) as f64;
    let ps = row(ModeKind::PsSparse);
    let unique = ps.rows_per_step.unwrap();
    let sp = Sparse { rows, dim, dense, unique };
    let sent = |m: ModeKind| row(m).bytes_sent_per_step_worker.unwrap();
    // Push: the rows by id and the dense values, and a few bytes of gRPC framing.
    let model = sp.bytes_per_worker(ModeKind::PsSparse, 2).unwrap() / 2.0;
    assert!(
        sent(ModeKind::PsSparse) >= model && sent(ModeKind::PsSparse) < 1.01 * model,
        "{} vs {model}",
        sent(ModeKind::PsSparse)
    );
    // The dense ring: exactly 2(n-1)/n of the whole model.
    assert_eq!(sent(ModeKind::DdpDense), sp.bytes_per_worker(ModeKind::DdpDense, 2).unwrap() / 2.0);
    // The hybrid: its rows to the table's server, the dense values around the ring.
    let hybrid = Sparse { unique: row(ModeKind::Hybrid).rows_per_step.unwrap(), ..sp };
    let model = hybrid.bytes_per_worker(ModeKind::Hybrid, 2).unwrap() / 2.0;
    assert!(
        sent(ModeKind::Hybrid) >= model && sent(ModeKind::Hybrid) < 1.01 * model,
        "{} vs {model}",
        sent(ModeKind::Hybrid)
    );
    assert!(row(ModeKind::Hybrid).bytes_per_step_server.is_some(), "the hybrid's server joins its run");
    // The all-gather pads each rank's rows to the largest count (its `rows` are the union), and
    // sends the two counts too.
    let model = sp.bytes_per_worker(ModeKind::DdpAllgather, 2).unwrap() / 2.0;
    let ag = sent(ModeKind::DdpAllgather);
    assert!(ag >= 0.99 * model && ag < 1.15 * model, "{ag} vs {model}");
    assert!(
        row(ModeKind::DdpAllgather).rows_per_step.unwrap() > unique,
        "the union is larger than one rank's rows"
    );
    // Every way of moving the table trains as local training does with the combined batch.
    let local = row(ModeKind::Local).final_accuracy.unwrap();
    for m in [ModeKind::PsSparse, ModeKind::DdpDense, ModeKind::DdpAllgather, ModeKind::Hybrid] {
        let a = row(m).final_accuracy.unwrap();
        assert!((a - local).abs() <= 0.005, "{m}: {a} against local {local}");
    }
    // The cost model's estimate of the rows a batch of 16 names, against what the runs named.
    let est =
        cost::clicks_unique_rows(rows, gradsync_core::data::CLICKS_IDS, gradsync_core::data::CLICKS_ZIPF, 16);
    assert!((est / unique - 1.0).abs() < 0.1, "estimate {est} against measured {unique}");
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("Sparse table (4096 rows x 8"), "no sparse reading");
}

/// A seed whose `kills` fall at or before step `by` of `steps` (the workers need time after the
/// last kill to be seen failing and to restart before the run ends).
fn seed_killing_early(kills: u32, steps: u64, by: u64) -> u64 {
    let mut s = Scenario::load(None).unwrap();
    (s.steps, s.epochs, s.kills, s.repeats) = (Some(steps), None, kills, 1);
    (1..1000)
        .find(|&seed| {
            s.seed = seed;
            (0..2).all(|repeat| s.kill_plan(repeat, 2).iter().all(|&(at, _)| at <= by))
        })
        .unwrap()
}

/// `kills = 1` with `max_restarts = 1` and checkpoints every 5 steps: a worker is SIGKILLed at
/// a random step, every worker restarts from the newest checkpoint, and the run finishes; the
/// record says which rank, how it ended, the step reached, the checkpoint resumed from and the
/// seconds from the kill to the first new step, and the report shows them beside the run.
/// With two kills and one restart allowed, the run is failed and never ranked.
#[test]
fn a_restarted_run_records_its_restarts_and_what_they_cost() {
    let root = Scratch::new("restarts");
    // Rank 0 slowed to 40 ms a step: the runner (which looks every 100 ms) kills while the
    // run is under way.
    let keys = |kills: u32, max: u32| {
        let seed = seed_killing_early(kills, 30, 18);
        format!(
            "seed = {seed}\nslow_ms = [40]\nslow_rank = 0\nkills = {kills}\nmax_restarts = {max}\n\
             checkpoint_every = 5\n"
        )
    };
    let scenario = small(&root, "restart", &["ddp-tcp"], 30, &keys(1, 1));
    let out = root.join("out");
    let o = compare(&scenario, &out);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let all = outcomes(&out);
    assert_eq!(all.len(), 2, "two repeats");
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    let mut rdr = csv::Reader::from_path(out.join("summary.csv")).unwrap();
    let head = rdr.headers().unwrap().clone();
    let col = |name: &str| head.iter().position(|h| h == name).unwrap();
    let rows: Vec<csv::StringRecord> = rdr.records().map(|r| r.unwrap()).collect();
    for run in &all {
        assert_eq!(run["status"], "ok", "{run}");
        let r = run["restarts"].as_array().unwrap();
        assert_eq!(r.len(), 1, "{run}");
        let r = &r[0];
        assert_eq!(r["injected"], true, "{r}");
        assert!(r["exit"].as_str().unwrap().contains("signal: 9"), "{r}");
        let (reached, after) = (r["step_reached"].as_u64().unwrap(), r["resumed_after"].as_u64().unwrap());
        assert!(reached >= 1 && after <= reached && after % 5 == 0 && reached - after < 30, "{r}");
        let lost = r["lost_s"].as_f64().unwrap();
        assert!(lost > 0.0 && lost < 30.0, "{r}");
        // The steps that count: every step once, to the last.
        let id = run["id"].as_str().unwrap();
        let row = rows.iter().find(|x| id.ends_with(&x[col("id")]) || x[col("id")].ends_with(id)).unwrap();
        assert_eq!(&row[col("steps")], "30", "{row:?}");
        assert!(
            html.contains(&format!("resumed after step {after}: {lost:.2} s")),
            "the cost of {id}'s restart is not beside it"
        );
    }
    assert!(
        html.contains("restarted its workers 1 time and finished"),
        "the report says nothing of the restart"
    );

    // Two kills, one restart: failed, with the restart it took recorded, and not ranked.
    let scenario = small(&root, "exhausted", &["ddp-tcp"], 30, &keys(2, 1));
    let out = root.join("out2");
    let o = compare(&scenario, &out);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for run in &outcomes(&out) {
        assert_eq!(run["status"], "failed", "{run}");
        assert!(run["error"].as_str().unwrap().contains("after 1 restart(s) of 1"), "{run}");
        assert_eq!(run["restarts"].as_array().unwrap().len(), 1, "{run}");
    }
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("2 runs failed") && !html.contains("is fastest with"), "a failed run was ranked");
}

/// `validate --loopback`: a comparison of the tiny MLP trained for real on loopback (the
/// ring, ZeRO-1 and a parameter server of one shard, two repeats), its profile recorded by
/// `replay record`; each cell's median step set beside the advisor's and the alpha-beta
/// model's, counted only where `compare` ranks it (a cell of more processes than cores is
/// set aside, named so), and the group's pick judged or said why not. Without the profile the
/// command names the model and how to record it.
#[test]
fn validate_loopback_sets_the_advisor_beside_compares_runs_of_a_real_model() {
    let root = Scratch::new("validate-loopback");
    let scenario = small(&root, "loopback", &["ddp-tcp", "zero1-tcp", "ps-bsp"], 12, "shards = [1]\n");
    let out = root.join("out");
    let o = compare(&scenario, &out);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let bench = env!("CARGO_BIN_EXE_gradsync-bench");
    let profile = root.join("tiny.json");
    let rec = Command::new(bench)
        .args([
            "replay", "record", "--model", "tiny", "--batch", "16", "--data", "digits", "--steps", "5",
            "--out",
        ])
        .arg(&profile)
        .output()
        .unwrap();
    assert!(rec.status.success(), "{}", String::from_utf8_lossy(&rec.stderr));
    let validate = |extra: &[&str]| {
        Command::new(bench).args(["validate", "--loopback"]).arg(&out).args(extra).output().unwrap()
    };
    let o = validate(&["--profile", profile.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["clusters"].is_null(), "no clusters were asked for");
    let rows = v["loopback"]["rows"].as_array().unwrap();
    let designs: Vec<&str> = rows.iter().map(|r| r["design"].as_str().unwrap()).collect();
    assert_eq!(rows.len(), 3, "{designs:?}");
    for d in ["ddp-tcp", "zero1-tcp", "ps-bsp k=1"] {
        assert!(designs.contains(&d), "{d} missing from {designs:?}");
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for r in rows {
        let (d, m) = (r["design"].as_str().unwrap(), r["measured_ms"].as_f64().unwrap());
        assert_eq!(r["group"], "tiny-2w-loopback");
        // The tiny model's step is a millisecond or less, most of it the per-message costs of
        // gRPC and the threads' wake-ups that no prediction here prices (a parameter server's
        // measured 10x its prediction beside other tests): the rings' predictions from the
        // run's own compute are held to its order of magnitude, every other one to being there.
        for what in ["advisor_ms", "advisor_profile_ms", "alpha_beta_ms"] {
            let p = r[what].as_f64().unwrap_or_else(|| panic!("{d}: no {what}: {r}"));
            let held = what == "advisor_ms" && !d.starts_with("ps-");
            let near = !held || (p / m > 0.1 && p / m < 10.0);
            assert!(p > 0.0 && near, "{d}: {what} {p} ms against {m} ms measured: {r}");
        }
        let processes = 2 + usize::from(d.starts_with("ps-"));
        let why = r["unsound"].as_str().unwrap_or("");
        assert_eq!(r["sound"], processes <= cores, "{d}: {processes} processes on {cores} cores: {why}");
        if processes > cores {
            assert!(why.contains("CPU-saturated"), "{d}: {why}");
        }
    }
    let md = validate(&["--profile", profile.to_str().unwrap()]);
    let md = String::from_utf8_lossy(&md.stdout);
    assert!(
        md.contains("On this machine's loopback") && md.contains("| tiny-2w-loopback | ddp-tcp |"),
        "{md}"
    );
    // Without the model's profile: refused, naming the model and the command that records it.
    let other = root.join("other.json");
    let rec = Command::new(bench)
        .args(["replay", "record", "--model", "8-4-2", "--batch", "16", "--steps", "2", "--out"])
        .arg(&other)
        .output()
        .unwrap();
    assert!(rec.status.success(), "{}", String::from_utf8_lossy(&rec.stderr));
    let o = validate(&["--profile", other.to_str().unwrap()]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && e.contains("no profile of tiny") && e.contains("replay record --model tiny"),
        "{e}"
    );
    let o = validate(&[]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("--profile"), "{e}");
}
