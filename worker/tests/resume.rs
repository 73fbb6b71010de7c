//! Checkpoints and `--resume`, as real processes: a run killed with SIGKILL after a checkpoint
//! and resumed ends with exactly the parameters and momentum of the unbroken run (local
//! training; DDP over TCP sockets and over shared memory, one rank killed and the launcher
//! stopping the other); modes whose state a checkpoint does not hold yet are refused by name.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use gradsync_core::checkpoint::Checkpoint;
use gradsync_testkit::Scratch;
use gradsync_testkit::process::Proc;

const WORKER: &str = env!("CARGO_BIN_EXE_gradsync-worker");
const STEPS: &str = "40";

fn worker(args: &[String]) -> Command {
    let mut cmd = gradsync_testkit::process::isolated(WORKER);
    cmd.args(args).stdout(Stdio::null());
    cmd
}

/// The training flags every run of a test shares (the tiny model, 40 steps, 2 epochs' worth
/// of data so the resumed run crosses an epoch), then `extra`.
fn train(mode: &[&str], extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = ["train", "--model", "tiny", "--data", "synthetic:320:32:8", "--device", "cpu"]
        .into_iter()
        .chain(["--threads", "1", "--steps", STEPS, "--eval-every", "0", "--lr", "0.05"])
        .chain(mode.iter().copied())
        .chain(extra.iter().copied())
        .map(String::from)
        .collect();
    a.retain(|s| !s.is_empty());
    a
}

/// `train` under `launch` with `ranks` ranks when `ranks > 0`.
fn launched(ranks: usize, args: Vec<String>) -> Vec<String> {
    if ranks == 0 {
        return args;
    }
    ["launch", "--nproc-per-node", &ranks.to_string(), "--master-port", "0", "--"]
        .into_iter()
        .map(String::from)
        .chain(args)
        .collect()
}

fn run_ok(args: &[String]) {
    let mut p = Proc::spawn(&mut worker(args));
    let (code, err, _) = p.finish(Duration::from_secs(120));
    assert_eq!(code, 0, "gradsync-worker {args:?} failed:\n{err}");
}

/// The children of process `pid` (the launcher's ranks).
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

fn assert_same(a: &Path, b: &Path) {
    let (a_ck, b_ck) = (Checkpoint::load(a).unwrap(), Checkpoint::load(b).unwrap());
    assert_eq!(a_ck.header.step, b_ck.header.step);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&a_ck.params) == bits(&b_ck.params),
        "parameters differ: {} vs {}",
        a.display(),
        b.display()
    );
    assert!(
        bits(a_ck.momentum.as_deref().unwrap()) == bits(b_ck.momentum.as_deref().unwrap()),
        "momentum differs: {} vs {}",
        a.display(),
        b.display()
    );
}

/// Run unbroken, then run with checkpoints every 10 steps, SIGKILL a process once the
/// checkpoint of step 20 is written (the worker itself, or with `ranks` ranks the last rank,
/// so the launcher stops the others), resume, and compare the two ends bit for bit.
fn killed_and_resumed_ends_as_unbroken(name: &str, ranks: usize, mode: &[&str]) {
    let dir = Scratch::new(name);
    let (unbroken, resumed, ck) = (dir.join("unbroken.ckpt"), dir.join("resumed.ckpt"), dir.join("ck"));
    let s = |p: &Path| p.display().to_string();
    run_ok(&launched(ranks, train(mode, &["--quiet", "--save", &s(&unbroken)])));

    // A step's pause (rank 0's) keeps the run going well past the checkpoint it is killed after.
    let first = launched(
        ranks,
        train(mode, &["--checkpoint", &s(&ck), "--checkpoint-every", "10", "--slow-rank", "0:20"]),
    );
    let mut p = Proc::spawn(&mut worker(&first));
    p.wait_line("checkpoint of step 20", Duration::from_secs(60));
    if ranks == 0 {
        p.kill9();
    } else {
        let ranks_now = children(p.id());
        assert_eq!(ranks_now.len(), ranks, "the launcher's ranks: {ranks_now:?}");
        let last = *ranks_now.iter().max().unwrap();
        // SAFETY-free: a plain signal to a child of ours.
        let killed = Command::new("kill").args(["-9", &last.to_string()]).status().unwrap();
        assert!(killed.success());
        let (code, err, _) = p.finish(Duration::from_secs(60));
        assert_ne!(code, 0, "the launcher must fail when a rank is killed:\n{err}");
    }
    let written: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    assert!(written.iter().any(|n| n == "step-0000000020"), "{written:?}");
    assert!(
        !written.iter().any(|n| n == &format!("step-{:010}", STEPS.parse::<u64>().unwrap())),
        "{written:?}"
    );

    let again = launched(ranks, train(mode, &["--checkpoint", &s(&ck), "--resume", "--save", &s(&resumed)]));
    let mut p = Proc::spawn(&mut worker(&again));
    let (code, err, _) = p.finish(Duration::from_secs(120));
    assert_eq!(code, 0, "the resumed run failed:\n{err}");
    assert!(err.contains("resuming after step"), "{err}");
    assert_same(&unbroken, &resumed);
}

#[test]
fn a_killed_local_run_resumes_to_the_unbroken_runs_bits() {
    killed_and_resumed_ends_as_unbroken("resume-local", 0, &[]);
}

#[test]
fn a_ddp_run_over_tcp_with_a_killed_rank_resumes_to_the_unbroken_runs_bits() {
    killed_and_resumed_ends_as_unbroken(
        "resume-ddp-tcp",
        2,
        &["--mode", "ddp", "--transport", "tcp", "--batch", "8"],
    );
}

#[test]
fn a_ddp_run_over_shared_memory_with_a_killed_rank_resumes_to_the_unbroken_runs_bits() {
    killed_and_resumed_ends_as_unbroken(
        "resume-ddp-shm",
        2,
        &["--mode", "ddp", "--transport", "shm", "--batch", "8"],
    );
}

#[test]
fn checkpoints_of_a_mode_they_cannot_hold_yet_are_refused_by_name() {
    let dir = Scratch::new("resume-refused-modes");
    let ck = dir.join("ck").display().to_string();
    for (mode, says) in [
        (&["--mode", "ddp", "--compress", "topk:0.1"][..], "--compress topk keeps each rank's residual"),
        (&["--mode", "ddp", "--sync-every", "2"][..], "--sync-every above 1"),
        (&["--mode", "zero1"][..], "--checkpoint with --mode zero1"),
    ] {
        let args = launched(1, train(mode, &["--checkpoint", &ck]));
        let mut p = Proc::spawn(&mut worker(&args));
        let (code, err, _) = p.finish(Duration::from_secs(60));
        assert_ne!(code, 0, "{mode:?}");
        assert!(err.contains(says), "{mode:?}: {err}");
    }
    // --resume needs the folder.
    let mut p = Proc::spawn(&mut worker(&train(&[], &["--resume"])));
    let (code, err, _) = p.finish(Duration::from_secs(30));
    assert_ne!(code, 0);
    assert!(err.contains("--checkpoint"), "{err}");
}
