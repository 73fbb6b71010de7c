//! `gradsync-bench restart` as a real process: one DDP run under `launch --max-restarts`, a
//! rank SIGKILLed, and the restart's timings printed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

#[test]
fn the_restart_benchmark_kills_restarts_and_times() {
    let out = Command::new(env!("CARGO_BIN_EXE_gradsync-bench"))
        .args(["restart", "--runs", "1", "--kills", "2", "--model", "tiny", "--data", "synthetic:512:32:8"])
        .args(["--steps", "100", "--checkpoint-every", "5"])
        .arg("--worker")
        .arg(gradsync_testkit::process::binary("gradsync-worker"))
        .output()
        .unwrap();
    let (text, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{err}");
    assert!(err.contains("run 1: 2 kills, finished"), "{err}");
    for row in ["the launcher logs the restart", "rank 0 has restored the checkpoint"] {
        let line = text.lines().find(|l| l.contains(row)).unwrap_or_else(|| panic!("{row}: {text}"));
        assert!(line.contains("|        2 |"), "two restarts timed: {line}");
    }
}
