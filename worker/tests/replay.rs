//! Replayed models (`--model profile:FILE`, the built-ins) as real processes: every mode runs
//! one, the metrics say it is a replay and carry no accuracy, the real communication moves the
//! profile's bytes (DDP's ring and the parameter server alike), and bad profiles and rates are
//! refused by name.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use gradsync_core::metrics::{Record, parse_line};
use gradsync_testkit::Scratch;
use gradsync_testkit::process::{Proc, start_server};

mod common;
use common::server_bin;

const WORKER: &str = env!("CARGO_BIN_EXE_gradsync-worker");

/// Parameters of [`PROFILE`]: fc2 (10 + 10 x 4096) and fc1 (4096 + 4096 x 64).
const PARAMS: u64 = 10 + 10 * 4096 + 4096 + 4096 * 64;

/// A two-layer model measured at batch 8: 0.6 ms forward, 1.2 ms backward.
const PROFILE: &str = r#"{
 "format": "gradsync-profile", "version": 1, "model": "two-layer", "batch": 8,
 "device": "a test's", "estimated": false, "optimizer_ms": 0.1,
 "layers": [
  {"name": "fc2", "forward_ms": 0.2, "backward_ms": 0.4,
   "tensors": [{"name": "fc2.bias", "shape": [10]}, {"name": "fc2.weight", "shape": [10, 4096]}]},
  {"name": "relu", "forward_ms": 0.1, "backward_ms": 0.1},
  {"name": "fc1", "forward_ms": 0.3, "backward_ms": 0.7,
   "tensors": [{"name": "fc1.bias", "shape": [4096]}, {"name": "fc1.weight", "shape": [4096, 64]}]}
 ]
}"#;

fn profile(dir: &Path) -> String {
    let path = dir.join("two-layer.json");
    std::fs::write(&path, PROFILE).unwrap();
    format!("profile:{}", path.display())
}

fn worker(args: &[impl AsRef<std::ffi::OsStr>]) -> Command {
    let mut cmd = gradsync_testkit::process::isolated(WORKER);
    cmd.args(args).stdout(Stdio::null());
    cmd
}

/// `train` of `model` for `steps` on one CPU thread, then `extra`; under `launch` with two
/// ranks when `launched`.
fn train(launched: bool, model: &str, steps: &str, extra: &[&str]) -> Vec<String> {
    let launch: &[&str] =
        if launched { &["launch", "--nproc-per-node", "2", "--master-port", "0", "--"] } else { &[] };
    launch
        .iter()
        .chain(&["train", "--model", model, "--steps", steps, "--device", "cpu", "--threads", "1"])
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
}

/// Run to completion; returns the exit code and stderr.
fn run(args: &[impl AsRef<std::ffi::OsStr>]) -> (i32, String) {
    let mut p = Proc::spawn(&mut worker(args));
    let (code, err, _) = p.finish(Duration::from_secs(120));
    (code, err)
}

/// The header's extra fields and the steps of a metrics file.
fn metrics(path: &Path) -> (serde_json::Map<String, serde_json::Value>, Vec<gradsync_core::metrics::Step>) {
    let text = std::fs::read_to_string(path).unwrap();
    let (mut extra, mut steps) = (None, Vec::new());
    for line in text.lines() {
        match parse_line(line).unwrap() {
            Record::Header(h) => extra = Some(h.extra),
            Record::Step(s) => steps.push(s),
            _ => {}
        }
    }
    (extra.expect("a header"), steps)
}

#[test]
fn a_replayed_run_says_so_and_reports_no_accuracy() {
    let dir = Scratch::new("replay-local");
    let model = profile(dir.path());
    let m = dir.path().join("m.jsonl");
    let (code, err) = run(&train(false, &model, "4", &["--metrics", m.to_str().unwrap()]));
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("replay of two-layer") && err.contains("speed only, no accuracy"), "{err}");
    let (extra, steps) = metrics(&m);
    let replay = &extra["replay"];
    assert_eq!(replay["estimated"], false, "{replay}");
    assert_eq!(replay["profile_batch"], 8);
    assert!((replay["forward_ms"].as_f64().unwrap() - 0.6).abs() < 1e-9, "{replay}");
    assert!((replay["backward_ms"].as_f64().unwrap() - 1.2).abs() < 1e-9, "{replay}");
    assert_eq!(steps.len(), 4);
    assert!(steps.iter().all(|s| s.accuracy.is_none()), "a replay evaluates nothing");
    // Waits never end early: every step takes at least the profile's compute.
    assert!(steps.iter().all(|s| s.forward_ms >= 0.6 && s.backward_ms >= 1.2), "{steps:?}");

    // Another batch scales the times and makes them an estimate.
    let (code, err) = run(&train(false, &model, "2", &["--batch", "16", "--metrics", m.to_str().unwrap()]));
    assert_eq!(code, 0, "{err}");
    let (extra, _) = metrics(&m);
    assert_eq!(extra["replay"]["estimated"], true);
    assert!((extra["replay"]["backward_ms"].as_f64().unwrap() - 2.4).abs() < 1e-9);
    assert!(err.contains("scaled from batch 8"), "{err}");
}

#[test]
fn every_mode_replays_a_profile() {
    let dir = Scratch::new("replay-modes");
    let model = profile(dir.path());
    let modes: &[&[&str]] = &[
        &["--mode", "local"],
        &["--mode", "dp", "--replicas", "2"],
        &["--mode", "ddp"],
        &["--mode", "ddp", "--transport", "shm"],
        &["--mode", "ddp", "--compress", "fp16"],
        &["--mode", "ddp", "--compress", "topk:0.01"],
        &["--mode", "zero1"],
        &["--mode", "ddp", "--hierarchy", "on"],
    ];
    for mode in modes {
        let launched = !mode.contains(&"local") && !mode.contains(&"dp");
        let (code, err) = run(&train(launched, &model, "3", mode));
        assert_eq!(code, 0, "{mode:?}: {err}");
        assert!(err.contains("3 steps in") && err.contains("replay: speed only"), "{mode:?}: {err}");
    }
}

#[test]
fn the_ring_moves_the_profiles_bytes() {
    let dir = Scratch::new("replay-ddp");
    let model = profile(dir.path());
    let m = dir.path().join("ddp-{rank}.jsonl");
    let (code, err) = run(&train(true, &model, "3", &["--mode", "ddp", "--metrics", m.to_str().unwrap()]));
    assert_eq!(code, 0, "{err}");
    for rank in 0..2 {
        let (_, steps) = metrics(&dir.path().join(format!("ddp-{rank}.jsonl")));
        for s in &steps {
            // Two ranks: each sends 2(n-1)/n = 1 times the gradient's bytes, and framing.
            let ratio = s.bytes_sent as f64 / (4 * PARAMS) as f64;
            assert!((1.0..1.01).contains(&ratio), "rank {rank} step {}: {} bytes", s.step, s.bytes_sent);
            assert!(s.comm_ms > 0.0);
        }
    }
}

/// The parameter server in every synchronisation, over one and two shards (a large tensor
/// split between them, as the flat buffer always is), with compressed pushes: the workers
/// finish, and a dense exchange moves the profile's bytes each way every step.
#[test]
fn the_parameter_server_moves_the_profiles_bytes() {
    let dir = Scratch::new("replay-ps");
    let model = profile(dir.path());
    let cases: &[(&str, usize, &[&str], bool)] = &[
        ("bsp", 1, &[], true),
        ("bsp", 2, &[], true),
        ("asp", 2, &[], true),
        ("ssp:1", 1, &[], true),
        ("bsp", 2, &["--compress", "fp16"], false),
        ("bsp", 1, &["--compress", "topk:0.01"], false),
    ];
    for (case, &(sync, k, compress, dense)) in cases.iter().enumerate() {
        let servers: Vec<(Proc, String)> = (0..k)
            .map(|i| {
                let mut cmd = Command::new(server_bin());
                cmd.args(["--listen", "127.0.0.1:0", "--model", &model, "--sync", sync])
                    .args(["--shard", &format!("{i}/{k}")])
                    .args(compress)
                    .stderr(Stdio::inherit());
                start_server(&mut cmd, false)
            })
            .collect();
        let addrs = servers.iter().map(|s| s.1.clone()).collect::<Vec<_>>().join(",");
        let procs: Vec<Proc> = (0..2)
            .map(|r| {
                let m = dir.path().join(format!("ps{case}-{r}.jsonl"));
                let (rank, m) = (r.to_string(), m.to_str().unwrap().to_string());
                let extra = [
                    "--mode",
                    "ps",
                    "--servers",
                    &addrs,
                    "--rank",
                    &rank,
                    "--world-size",
                    "2",
                    "--metrics",
                    &m,
                ];
                let args = [&extra[..], &["--rpc-timeout", "30"], compress].concat();
                Proc::spawn(&mut worker(&train(false, &model, "3", &args)))
            })
            .collect();
        for mut p in procs {
            let (code, err, _) = p.finish(Duration::from_secs(120));
            assert_eq!(code, 0, "{sync} k={k} {compress:?}: {err}");
        }
        for r in 0..2 {
            let (_, steps) = metrics(&dir.path().join(format!("ps{case}-{r}.jsonl")));
            assert_eq!(steps.len(), 3, "{sync} k={k} {compress:?}");
            for s in steps.iter().filter(|_| dense) {
                for (what, bytes) in [("pushed", s.bytes_sent), ("pulled", s.bytes_recv)] {
                    let ratio = bytes as f64 / (4 * PARAMS) as f64;
                    assert!(
                        (1.0..1.01).contains(&ratio),
                        "{sync} k={k}: worker {r} step {} {what} {bytes} bytes",
                        s.step
                    );
                }
            }
        }
    }
}

#[test]
fn bad_profiles_and_rates_are_refused_by_name() {
    let dir = Scratch::new("replay-bad");
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, PROFILE.replace("\"batch\": 8", "\"batch\": 0")).unwrap();
    let model = format!("profile:{}", bad.display());
    let (code, err) = run(&["train", "--model", &model, "--steps", "1"]);
    assert_ne!(code, 0);
    assert!(err.contains("bad.json") && err.contains("\"batch\" must be at least 1"), "{err}");
    std::fs::write(&bad, &PROFILE[..200]).unwrap();
    let (code, err) = run(&["train", "--model", &model, "--steps", "1"]);
    assert_ne!(code, 0);
    assert!(err.contains("bad.json") && err.contains("line 5"), "{err}");
    for (args, want) in [
        (&["--model", "tiny", "--device-tflops", "100"][..], "applies to a replayed model"),
        (&["--model", "resnet50", "--device-tflops", "0"][..], "device-tflops: 0"),
        (&["--model", &profile(dir.path()), "--device-tbps", "2"][..], "holds its own times"),
    ] {
        let mut a = vec!["train", "--steps", "1", "--device", "cpu"];
        a.extend(args);
        let (code, err) = run(&a);
        assert_ne!(code, 0, "{args:?}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// A replay on the GPU under NCCL (one rank: NCCL refuses two on one GPU; here the fake's): the
/// buckets are all-reduced on the device as a trained model's are, and no kernel computes.
#[test]
fn a_replay_runs_over_nccl_on_the_gpu() {
    let test = "a_replay_runs_over_nccl_on_the_gpu";
    let reduced = |c: &gradsync_testkit::Counters| {
        assert!(c.processes >= 1 && c.collectives > 0 && c.gemms == 0 && c.alive_at_exit == 0, "{c}");
    };
    match gradsync_testkit::gpu_test(test) {
        gradsync_testkit::GpuRun::Here => {}
        gradsync_testkit::GpuRun::Fake(c) => return reduced(&c),
        gradsync_testkit::GpuRun::Skipped => return,
    }
    let dir = Scratch::new("replay-nccl");
    let model = profile(dir.path());
    let m = dir.path().join("nccl-{rank}.jsonl");
    let mut args = train(false, &model, "3", &["--mode", "ddp", "--backend", "nccl", "--bucket-mb", "0.1"]);
    args.extend(["--metrics".to_string(), m.display().to_string()]);
    let i = args.iter().position(|a| a == "cpu").unwrap();
    args[i] = "cuda".into();
    let launch = ["launch", "--nproc-per-node", "1", "--master-port", "0", "--"].map(String::from);
    let (code, err) = run(&[&launch[..], &args].concat());
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("replay: speed only"), "{err}");
    let (extra, steps) = metrics(&dir.path().join("nccl-0.jsonl"));
    assert_eq!(steps.len(), 3);
    assert!(extra["buckets"].as_u64().is_some_and(|b| b >= 2), "{extra:?}");
}
