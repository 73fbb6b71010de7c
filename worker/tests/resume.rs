//! Checkpoints and `--resume`, as real processes: a run killed with SIGKILL after a checkpoint
//! and resumed ends with exactly the parameters and momentum of the unbroken run (local
//! training; DDP over TCP sockets and over shared memory, one rank killed and the launcher
//! stopping the other; with `--compress topk`, every rank's residual restored); a checkpoint
//! that cannot hold the run (`--sync-every` out of step with it) is refused by name.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

mod common;
use common::assert_same_checkpoints;
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
        let ranks_now = gradsync_worker::launch::children(p.id());
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
    assert_same_checkpoints(&unbroken, &resumed);
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

/// With `--compress topk` each rank keeps a residual between steps: the checkpoint holds every
/// rank's (all-gathered, written by rank 0), and the resumed run ends at the unbroken run's
/// bits.
#[test]
fn a_ddp_run_with_topk_resumes_every_ranks_residual_to_the_unbroken_runs_bits() {
    killed_and_resumed_ends_as_unbroken(
        "resume-ddp-topk",
        2,
        &["--mode", "ddp", "--transport", "tcp", "--batch", "8", "--compress", "topk:0.1"],
    );
}

/// ZeRO-1 checkpoints its momentum gathered whole from the ranks' shards; the resumed ranks cut
/// their shards from it again, and the run ends with the unbroken run's parameters and
/// momentum.
/// `--sync-every 2` with a checkpoint every 10 steps: each checkpoint follows a
/// synchronisation, so nothing accumulated is lost and the resumed run's micro-steps line up.
#[test]
fn a_ddp_run_with_sync_every_resumes_to_the_unbroken_runs_bits() {
    killed_and_resumed_ends_as_unbroken(
        "resume-ddp-sync-every",
        2,
        &["--mode", "ddp", "--batch", "8", "--comm-timeout", "30", "--transport", "tcp", "--sync-every", "2"],
    );
}

#[test]
fn a_zero1_run_with_a_killed_rank_resumes_to_the_unbroken_runs_bits() {
    killed_and_resumed_ends_as_unbroken(
        "resume-zero1",
        2,
        &["--mode", "zero1", "--transport", "tcp", "--batch", "8"],
    );
}

/// DP: replica 0 holds the state; the other replicas take its parameters when the resumed run
/// starts, and the run ends with the unbroken run's bits.
#[test]
fn a_killed_dp_run_resumes_to_the_unbroken_runs_bits() {
    killed_and_resumed_ends_as_unbroken("resume-dp", 0, &["--mode", "dp", "--replicas", "2", "--batch", "8"]);
}

#[test]
fn checkpoints_that_cannot_hold_the_run_are_refused_by_name() {
    let dir = Scratch::new("resume-refused-modes");
    let ck = dir.join("ck").display().to_string();
    let mode = ["--mode", "ddp", "--sync-every", "4", "--checkpoint-every", "10"];
    let args = launched(1, train(&mode, &["--checkpoint", &ck]));
    let mut p = Proc::spawn(&mut worker(&args));
    let (code, err, _) = p.finish(Duration::from_secs(60));
    assert_ne!(code, 0);
    assert!(err.contains("give --checkpoint-every a multiple of 4 (it is 10)"), "{err}");
    // --resume needs the folder.
    let mut p = Proc::spawn(&mut worker(&train(&[], &["--resume"])));
    let (code, err, _) = p.finish(Duration::from_secs(30));
    assert_ne!(code, 0);
    assert!(err.contains("--checkpoint"), "{err}");
}

/// A resumed run adds its steps to the metrics file of the run it continues, on that run's
/// clock: every step's `wall_ms` (from the header's start) is at or after the one written before
/// it, the restart's time included, so a reader's rates across the restart hold.
#[test]
fn a_resumed_runs_metrics_continue_the_killed_runs_clock() {
    let dir = Scratch::new("resume-metrics-clock");
    let (ck, metrics) = (dir.join("ck"), dir.join("m.jsonl"));
    let s = |p: &Path| p.display().to_string();
    let args = |extra: &[&str]| {
        let base = [
            "--checkpoint",
            &s(&ck),
            "--checkpoint-every",
            "10",
            "--slow-rank",
            "0:20",
            "--metrics",
            &s(&metrics),
        ];
        train(&[], &[&base[..], extra].concat())
    };
    let mut p = Proc::spawn(&mut worker(&args(&[])));
    p.wait_line("checkpoint of step 20", Duration::from_secs(60));
    p.kill9();
    let killed_at = std::fs::read_to_string(&metrics).unwrap().lines().count();
    run_ok(&args(&["--resume"]));
    let text = std::fs::read_to_string(&metrics).unwrap();
    let records: Vec<gradsync_core::metrics::Record> =
        text.lines().map(|l| gradsync_core::metrics::parse_line(l).unwrap()).collect();
    let headers = records.iter().filter(|r| matches!(r, gradsync_core::metrics::Record::Header(_))).count();
    assert_eq!(headers, 1, "one header, the first run's");
    let walls: Vec<(u64, f64)> = records
        .iter()
        .filter_map(|r| match r {
            gradsync_core::metrics::Record::Step(s) => Some((s.step, s.wall_ms)),
            _ => None,
        })
        .collect();
    assert!(walls.len() > killed_at, "the resumed run added steps");
    assert_eq!(walls.last().unwrap().0, STEPS.parse::<u64>().unwrap());
    for w in walls.windows(2) {
        assert!(
            w[1].1 >= w[0].1,
            "step {} at {} ms follows step {} at {} ms",
            w[1].0,
            w[1].1,
            w[0].0,
            w[0].1
        );
    }
}

/// `launch --max-restarts 3` over a DDP run whose ranks are SIGKILLed three times, each time a
/// rank chosen at random after a random number of steps (two seeds; a checkpoint every 2
/// steps): the launcher logs each restart with the rank that failed and how, restarts both
/// ranks from the newest checkpoint, and the run ends with exactly the unbroken run's
/// parameters. With one restart allowed, a
/// second kill ends the run, naming the rank and the restarts spent.
#[test]
fn launch_restarts_a_killed_ddp_run_to_the_unbroken_runs_bits() {
    let dir = Scratch::new("resume-restarts");
    let s = |p: &Path| p.display().to_string();
    let mode = ["--mode", "ddp", "--transport", "tcp", "--batch", "8"];
    let unbroken = dir.join("unbroken.ckpt");
    run_ok(&launched(2, train(&mode, &["--quiet", "--save", &s(&unbroken)])));
    let restarting = |max: &str, ck: &Path, save: &Path| -> Vec<String> {
        let extra =
            ["--checkpoint", &s(ck), "--checkpoint-every", "2", "--slow-rank", "0:20", "--save", &s(save)];
        let mut a = launched(2, train(&mode, &extra));
        a.splice(
            1..1,
            ["--max-restarts".to_string(), max.to_string(), "--monitor-interval".into(), "0.05".into()],
        );
        a
    };
    let kill_a_rank = |p: &mut Proc, rng: &mut u64| {
        *rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        for _ in 0..1 + (*rng >> 33) % 3 {
            p.wait_line("[0] step ", Duration::from_secs(60));
        }
        let ranks = gradsync_worker::launch::children(p.id());
        assert_eq!(ranks.len(), 2, "the launcher's ranks: {ranks:?}");
        let victim = ranks[((*rng >> 40) % 2) as usize];
        assert!(Command::new("kill").args(["-9", &victim.to_string()]).status().unwrap().success());
    };
    for seed in [1u64, 2] {
        let (ck, save) = (dir.join(format!("ck{seed}")), dir.join(format!("restarted{seed}.ckpt")));
        let mut rng = seed;
        let mut p = Proc::spawn(&mut worker(&restarting("3", &ck, &save)));
        for k in 1..=3 {
            kill_a_rank(&mut p, &mut rng);
            let line = p.wait_line(&format!("restart {k} of 3"), Duration::from_secs(60));
            assert!(line.contains("failed (signal: 9") && line.contains("--resume"), "{line}");
        }
        let (code, err, _) = p.finish(Duration::from_secs(120));
        assert_eq!(code, 0, "seed {seed}: the restarted run failed:\n{err}");
        // Every kill came after a step that wrote a checkpoint: each new generation resumed from
        // one rather than training again from the start (which would end at the same bits).
        assert_eq!(err.matches("resuming after step").count(), 3, "seed {seed}:\n{err}");
        assert_same_checkpoints(&unbroken, &save);
    }
    let (ck, save) = (dir.join("ck-once"), dir.join("once.ckpt"));
    let mut rng = 7;
    let mut p = Proc::spawn(&mut worker(&restarting("1", &ck, &save)));
    kill_a_rank(&mut p, &mut rng);
    p.wait_line("restart 1 of 1", Duration::from_secs(60));
    kill_a_rank(&mut p, &mut rng);
    let (code, err, _) = p.finish(Duration::from_secs(60));
    assert_ne!(code, 0);
    assert!(err.contains("failed first (signal: 9") && err.contains("after 1 restart(s)"), "{err}");
}

/// `--max-restarts` refuses what it cannot do: a train command without checkpoints to resume
/// from, and several nodes without a port every node knows for the launchers' store.
#[test]
fn max_restarts_refuses_what_it_cannot_restart() {
    let args = |extra: &[&str]| -> Vec<String> {
        let mut a = launched(1, train(&[], &[]));
        a.splice(1..1, extra.iter().map(|x| x.to_string()));
        a
    };
    for (extra, says) in [
        (&["--max-restarts", "2"][..], "needs --checkpoint DIR"),
        (
            &["--max-restarts", "2", "--nnodes", "2"][..],
            "--master-port 0 (pick a free port) only works on one node",
        ),
        (&["--rdzv-timeout", "0"][..], "is not a number of seconds from 0.1"),
        (&["--monitor-interval", "0"][..], "is not a number of seconds"),
    ] {
        let mut p = Proc::spawn(&mut worker(&args(extra)));
        let (code, err, _) = p.finish(Duration::from_secs(30));
        assert_ne!(code, 0, "{extra:?}");
        assert!(err.contains(says), "{extra:?}: {err}");
    }
}

/// A tmpfs of `size`, mounted at `dir` for as long as it lives (root only).
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Result<Tmpfs, String> {
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if !out.status.success() {
            return Err(format!("mount -t tmpfs: {}", String::from_utf8_lossy(&out.stderr).trim()));
        }
        Ok(Tmpfs(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// A disk that fills up while a checkpoint is written: the run stops with an error naming the
/// checkpoint and the full disk, leaves no partial checkpoint behind, and the one before stays
/// whole, so a resumed run (once there is room) continues from it to the unbroken run's bits.
#[test]
fn a_full_disk_is_reported_and_the_previous_checkpoint_kept() {
    const TEST: &str = "a_full_disk_is_reported_and_the_previous_checkpoint_kept";
    let dir = Scratch::new("resume-full-disk");
    let ck = dir.join("ck");
    // The default MLP on the digits (1.1 M parameters) checkpoints 9 MB: 12 MB holds one, not two.
    // Like the emulated clusters' namespaces, a mount needs root (CAP_SYS_ADMIN): without it the
    // test says so and passes.
    let _disk = match Tmpfs::mount(&ck, "12m") {
        Ok(t) => t,
        Err(why) => {
            eprintln!("SKIPPED (a small disk needs a tmpfs mount, which needs root: {why}) [{TEST}]");
            return;
        }
    };
    let s = |p: &Path| p.display().to_string();
    let base = [
        "train",
        "--model",
        "mnist",
        "--data",
        "digits",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--steps",
        "30",
    ];
    let args = |extra: &[&str]| base.iter().chain(extra).map(|x| x.to_string()).collect::<Vec<_>>();
    let unbroken = dir.join("unbroken.ckpt");
    run_ok(&args(&["--quiet", "--save", &s(&unbroken)]));
    let mut p = Proc::spawn(&mut worker(&args(&["--checkpoint", &s(&ck), "--checkpoint-every", "10"])));
    let (code, err, _) = p.finish(Duration::from_secs(60));
    assert_ne!(code, 0, "a full disk must fail the run:\n{err}");
    assert!(
        err.contains("writing the checkpoint of step 20") && err.contains("No space left on device"),
        "{err}"
    );
    let left: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, ["step-0000000010"], "only the whole checkpoint is left");
    // The checkpoint of step 10 is whole: a run resumed from it (writing no more) ends where the
    // unbroken run did.
    let resumed = dir.join("resumed.ckpt");
    run_ok(&args(&[
        "--checkpoint",
        &s(&ck),
        "--checkpoint-every",
        "100",
        "--resume",
        "--save",
        &s(&resumed),
    ]));
    assert_same_checkpoints(&unbroken, &resumed);
}

/// SIGKILL while a checkpoint is being written, three times over: each kill lands while the
/// hidden folder of the next checkpoint exists (the write under way), and every time the
/// previous checkpoint is whole and used, so the run resumed after the third kill ends bit for
/// bit where the unbroken run does. A model of 1.86 M parameters, so that each write (two 7.5 MB
/// files and the run state, fsynced) takes long enough to be caught in the middle.
#[test]
fn a_kill_during_a_checkpoint_write_loses_nothing() {
    let dir = Scratch::new("kill-mid-write");
    let (unbroken, resumed, ck) = (dir.join("unbroken.ckpt"), dir.join("resumed.ckpt"), dir.join("ck"));
    let s = |p: &Path| p.display().to_string();
    let big = |extra: &[&str]| -> Vec<String> {
        let mut a = train(&[], extra);
        let m = a.iter().position(|x| x == "tiny").unwrap();
        a[m] = "mnist".into();
        let d = a.iter().position(|x| x == "synthetic:320:32:8").unwrap();
        a[d] = "synthetic:320:784:10".into();
        a
    };
    run_ok(&big(&["--quiet", "--save", &s(&unbroken)]));
    let step_of = |name: &str| -> Option<u64> {
        name.trim_start_matches('.')
            .strip_prefix("step-")
            .and_then(|r| r.get(..10))
            .and_then(|d| d.parse().ok())
    };
    let mut torn_seen = Vec::new();
    for kill in 0..3 {
        let mut args = big(&["--checkpoint", &s(&ck), "--checkpoint-every", "1"]);
        if kill > 0 {
            args.push("--resume".into());
        }
        let mut p = Proc::spawn(&mut worker(&args));
        // Wait (bounded) for a write under way after at least one whole checkpoint.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let torn = loop {
            assert!(std::time::Instant::now() < deadline, "no checkpoint write was seen under way");
            let names: Vec<String> = std::fs::read_dir(&ck)
                .map(|d| d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect())
                .unwrap_or_default();
            let whole = names.iter().filter(|n| n.starts_with("step-")).filter_map(|n| step_of(n)).max();
            let writing = names.iter().filter(|n| n.starts_with(".step-")).filter_map(|n| step_of(n)).max();
            if let (Some(w), Some(t)) = (whole, writing)
                && t > w
                && !torn_seen.contains(&t)
            {
                p.kill9();
                break (w, t);
            }
            std::thread::sleep(Duration::from_micros(200));
        };
        let _ = p.finish(Duration::from_secs(30));
        // The previous checkpoint is whole on disk, and nothing newer claims to be.
        let names: Vec<String> = std::fs::read_dir(&ck)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        let whole = names.iter().filter(|n| n.starts_with("step-")).filter_map(|n| step_of(n)).max().unwrap();
        assert!(
            whole >= torn.0 && whole < torn.1 + 1,
            "kill {kill}: newest whole {whole}, torn {torn:?}: {names:?}"
        );
        torn_seen.push(torn.1);
    }
    let mut args = big(&["--checkpoint", &s(&ck), "--resume", "--save", &s(&resumed)]);
    args.retain(|a| a != "--quiet");
    let mut p = Proc::spawn(&mut worker(&args));
    let (code, err, _) = p.finish(Duration::from_secs(120));
    assert_eq!(code, 0, "the resumed run failed:\n{err}");
    assert!(err.contains("resuming after step"), "{err}");
    assert_same_checkpoints(&unbroken, &resumed);
    // What the killed writes left was cleared once their processes were gone.
    let left: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "interrupted writes left behind: {left:?}");
    eprintln!("killed during the writes of steps {torn_seen:?}; resumed to the unbroken run's bits");
}
