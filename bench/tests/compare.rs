//! `gradsync-bench compare` end to end: the default scenario scaled down (tiny model, a few
//! steps, 1 and 2 workers) with real worker and server processes. Every mode is started; a
//! mode this build cannot run fails, is reported with its error, and the others go on.
#![allow(clippy::unwrap_used)] // a test fails loudly on anything unexpected

use std::path::{Path, PathBuf};
use std::process::Command;

use gradsync_bench::compare::scenario::Scenario;

/// The directory holding the workspace's binaries, building the worker and server first if
/// they are not there yet (when only this crate's tests were built).
fn bin_dir() -> PathBuf {
    let bench = PathBuf::from(env!("CARGO_BIN_EXE_gradsync-bench"));
    let dir = bench.parent().expect("binary directory").to_path_buf();
    if !dir.join("gradsync-worker").is_file() || !dir.join("gradsync-server").is_file() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let profile_release = dir.ends_with("release");
        let mut c = Command::new(cargo);
        c.args(["build", "-p", "gradsync-worker", "-p", "gradsync-server"]);
        if profile_release {
            c.arg("--release");
        }
        let st = c.status().expect("running cargo build");
        assert!(st.success(), "building gradsync-worker and gradsync-server failed");
    }
    dir
}

use gradsync_bench::compare::charts::NAMES as CHARTS;

fn compare(scenario: &Path, out: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gradsync-bench"))
        .arg("compare")
        .arg(scenario)
        .arg("--out")
        .arg(out)
        .arg("--bin-dir")
        .arg(bin_dir())
        .output()
        .unwrap()
}

#[test]
fn default_scenario_scaled_down_runs_end_to_end() {
    let root = std::env::temp_dir().join(format!("gs-compare-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let mut s = Scenario::load(None).unwrap();
    s.models = vec!["tiny".into()];
    s.steps = 6;
    s.workers = vec![1, 2];
    s.shards = vec![1];
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
    assert!(html.contains("is fastest with"), "no computed reading in the report");

    // A second comparison into the same directory is refused rather than mixed in.
    let again = compare(&scenario, &out);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already holds a comparison"));
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_bad_scenario_is_refused_with_its_name() {
    let p = std::env::temp_dir().join(format!("gs-bad-scenario-{}.toml", std::process::id()));
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
