//! `--dilate D` on real processes: a bad factor, or one the run cannot pace, is refused by
//! name; a dilated run lasts about D times its compute and records the emulated world's time
//! (the header names the factor, each step its under-dilated phases), and learns exactly what
//! the undilated run learns; a parameter server and its worker dilate together.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::{Command, Output, Stdio};
use std::time::Instant;

use gradsync_testkit::Scratch;
use gradsync_testkit::process::start_server;

const BIN: &str = env!("CARGO_BIN_EXE_gradsync-worker");

fn worker(args: &[&str]) -> Output {
    Command::new(BIN).arg("train").args(args).output().expect("gradsync-worker runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn records(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

const REAL: [&str; 10] = [
    "--device",
    "cpu",
    "--model",
    "256-512-512-10",
    "--data",
    "synthetic:1024:256:10",
    "--batch",
    "64",
    "--seed",
    "5",
];

#[test]
fn a_bad_or_unpaceable_factor_is_refused_by_name() {
    for bad in ["0.5", "0", "-3", "nan", "2000", "x"] {
        let o = worker(&["--device", "cpu", "--threads", "1", "--steps", "1", &format!("--dilate={bad}")]);
        assert!(!o.status.success(), "--dilate {bad} was taken");
        assert!(stderr(&o).contains("--dilate"), "--dilate {bad}: {}", stderr(&o));
    }
    // A model trained for real is paced by its one thread's CPU time.
    let o = worker(&[&REAL[..], &["--threads", "2", "--steps", "1", "--dilate", "4"]].concat());
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--dilate 4 needs --threads 1"), "{}", stderr(&o));
    // A replayed model has no compute on the CPU to pace: any thread count will do.
    let o = worker(&["--device", "cpu", "--model", "resnet50", "--steps", "1", "--dilate", "4", "--quiet"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn compute_turns_are_refused_where_they_can_do_nothing() {
    let d = Scratch::new("turns-refused");
    let turns = d.join("compute.turns");
    let t = turns.to_str().unwrap();
    let o = worker(&[&REAL[..], &["--threads", "1", "--steps", "1", "--compute-turns", t]].concat());
    assert!(!o.status.success());
    assert!(stderr(&o).contains(&format!("--compute-turns {t} without --dilate")), "{}", stderr(&o));
    let o = worker(&["--model", "resnet50", "--steps", "1", "--dilate", "4", "--compute-turns", t]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("with a replayed model"), "{}", stderr(&o));
    // A file that cannot be a lock (a directory) is named.
    let o = worker(
        &[
            &REAL[..],
            &[
                "--threads",
                "1",
                "--steps",
                "1",
                "--dilate",
                "2",
                "--compute-turns",
                d.path().to_str().unwrap(),
            ],
        ]
        .concat(),
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("--compute-turns") && stderr(&o).contains(d.path().to_str().unwrap()),
        "{}",
        stderr(&o)
    );
}

/// Two dilated processes given the same turns file (that they compute one at a time is
/// `gradsync_core::dilation`'s test): with D well above 2 the wait for a turn fits in each
/// phase's window, and they learn what a process without turns learns. At x16, not x8: a
/// phase of 2 ms that the machine stalls to 14 ms (seen once in CI, its neighbour's turn then
/// waited out) still fits its window.
#[test]
fn processes_given_the_same_turns_compute_one_at_a_time() {
    let d = Scratch::new("turns");
    let turns = d.join("compute.turns");
    let start = |tag: &str, with_turns: bool| {
        let (metrics, save) = (d.join(format!("{tag}.jsonl")), d.join(format!("{tag}.ckpt")));
        let mut args: Vec<String> = REAL.iter().map(|s| s.to_string()).collect();
        args.extend(
            ["--threads", "1", "--steps", "8", "--eval-every", "0", "--dilate", "16", "--quiet"]
                .map(String::from),
        );
        args.extend([
            "--metrics".into(),
            metrics.display().to_string(),
            "--save".into(),
            save.display().to_string(),
        ]);
        if with_turns {
            args.extend(["--compute-turns".into(), turns.display().to_string()]);
        }
        let child = Command::new(BIN)
            .arg("train")
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("gradsync-worker starts");
        (child, metrics, save)
    };
    let (a, b) = (start("a", true), start("b", true));
    let mut out = Vec::new();
    for (c, m, s) in [a, b] {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        out.push((records(&m), std::fs::read(s).unwrap()));
    }
    for (recs, _) in &out {
        let steps: Vec<&serde_json::Value> = recs.iter().filter(|r| r["kind"] == "step").collect();
        assert_eq!(steps.len(), 8);
        let under: u64 = steps.iter().map(|s| s["under_dilated"].as_u64().unwrap()).sum();
        assert!(under <= 2, "{under} phases overran x16 for a turn shared by two: {steps:?}");
    }
    // Turns change when a phase computes, never what.
    let (alone, _, save) = start("alone", false);
    let o = alone.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read(save).unwrap(), out[0].1, "a run taking turns trained another model");
}

#[test]
fn a_dilated_run_lasts_d_times_its_compute_records_emulated_time_and_learns_the_same() {
    let d = Scratch::new("dilate-local");
    let run = |dilate: &str, tag: &str| {
        let (metrics, save) = (d.join(format!("{tag}.jsonl")), d.join(format!("{tag}.ckpt")));
        let t = Instant::now();
        let o = worker(
            &[
                &REAL[..],
                &[
                    "--threads",
                    "1",
                    "--steps",
                    "12",
                    "--dilate",
                    dilate,
                    "--metrics",
                    metrics.to_str().unwrap(),
                    "--save",
                    save.to_str().unwrap(),
                ],
            ]
            .concat(),
        );
        assert!(o.status.success(), "{}", stderr(&o));
        (records(&metrics), std::fs::read(save).unwrap(), t.elapsed(), stderr(&o))
    };
    let (plain, plain_params, _, _) = run("1", "plain");
    let (dilated, dilated_params, wall, said) = run("6", "dilated");
    assert!(plain[0].get("dilation").is_none(), "{}", plain[0]);
    assert_eq!(dilated[0]["dilation"], 6.0);
    // Pacing changes when things happen, never what is computed.
    assert_eq!(plain_params, dilated_params, "a dilated run trained another model");
    let steps: Vec<&serde_json::Value> = dilated.iter().filter(|r| r["kind"] == "step").collect();
    assert_eq!(steps.len(), 12);
    let ms = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap();
    let mut compute = 0.0;
    for s in &steps {
        assert!(s["under_dilated"].is_u64() && s["overrun_ms"].is_f64(), "{s}");
        compute += ms(s, "forward_ms") + ms(s, "backward_ms") + ms(s, "update_ms");
        // The steps' own record is emulated time: the step holds its phases.
        assert!(ms(s, "step_ms") + 0.5 >= ms(s, "forward_ms") + ms(s, "backward_ms"), "{s}");
    }
    // The recorded compute is the emulated world's (real / 6): the process ran at least six
    // times as long as that, since each phase lasted six times its CPU time.
    assert!(wall.as_secs_f64() * 1e3 >= 6.0 * compute * 0.95, "{wall:?} against 6 x {compute:.1} ms");
    assert!(said.contains("dilated x6"), "{said}");
}

#[test]
fn a_server_and_its_worker_dilate_together() {
    let d = Scratch::new("dilate-ps");
    let (smetrics, wmetrics) = (d.join("server.jsonl"), d.join("worker.jsonl"));
    let mut cmd = Command::new(common::server_bin());
    cmd.args(["--listen", "127.0.0.1:0", "--model", "256-512-512-10", "--data", "synthetic:1024:256:10"])
        .args(["--seed", "5", "--dilate", "3", "--metrics", smetrics.to_str().unwrap()])
        .stderr(Stdio::inherit());
    let (server, addr) = start_server(&mut cmd, false);
    let o = worker(
        &[
            &REAL[..],
            &["--threads", "1", "--steps", "6", "--mode", "ps", "--servers", &addr, "--dilate", "3"],
            &["--metrics", wmetrics.to_str().unwrap()],
        ]
        .concat(),
    );
    drop(server);
    assert!(o.status.success(), "{}", stderr(&o));
    let (s, w) = (records(&smetrics), records(&wmetrics));
    assert_eq!((s[0]["dilation"].as_f64(), w[0]["dilation"].as_f64()), (Some(3.0), Some(3.0)));
    let applies = s.iter().filter(|r| r["kind"] == "server_apply").count();
    assert_eq!(applies, 6, "the server applied every step");
}
