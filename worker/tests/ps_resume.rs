//! Parameter-server workers that come back, as real processes on 127.0.0.1: a worker killed
//! with SIGKILL at a random step and restarted with `--resume` re-registers under its rank,
//! continues at the step the servers' version stands for, and the run ends with exactly the
//! servers' state of an unbroken run (strict BSP; with `--compress topk` too, its residual
//! restored from its checkpoint); a step that already failed at the worker timeout is taken up
//! by every worker restarted with `--resume`; an elastic server that dropped the rank takes it
//! back at the next step, and one killed in the middle of a step (before it pushed) joins at the
//! round after the one that went on without it; with two server shards, a worker restarted
//! with `--resume` is taken back by both at the same step, and both end at the unbroken run's
//! bits; servers behind every checkpoint a worker kept are refused, naming both versions.
//!
//! A kill "at a random step" without sleeping to synchronise: the victim is rank 0, which
//! prints a line after each checkpoint it writes, and is a straggler (`--slow-rank`), so the
//! moment after that line it sleeps inside its next step; the step after which it is killed
//! is drawn at random (and printed, to replay a failure). Every child is killed and reaped on
//! drop.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use gradsync_core::metrics::{Record, ServerApply, Step, parse_line};

mod common;
use common::{assert_same_checkpoints, server_bin};
use gradsync_testkit::Scratch;
use gradsync_testkit::process::{Proc, start_server};

const WORKER: &str = env!("CARGO_BIN_EXE_gradsync-worker");
const DATA: &str = "synthetic:2048:32:8";
const STEPS: u64 = 40;

/// A server shard (tiny model, DATA) with `extra` flags, its checkpoint in `ck`: it and its
/// address.
fn server(ck: &Path, extra: &[&str]) -> (Proc, String) {
    let mut cmd = Command::new(server_bin());
    cmd.args(["--listen", "127.0.0.1:0", "--model", "tiny", "--seed", "7", "--data", DATA])
        .args(["--checkpoint", ck.to_str().unwrap(), "--checkpoint-every", "1000"])
        .args(extra)
        .env_remove("GRADSYNC_LOG");
    start_server(&mut cmd, true)
}

/// A PS worker of two, `STEPS` steps; rank 0 prints its progress and checkpoints.
fn worker(addr: &str, rank: usize, extra: &[&str]) -> Proc {
    let mut cmd = Command::new(WORKER);
    cmd.args(["train", "--mode", "ps", "--servers", addr, "--model", "tiny", "--seed", "7"])
        .args(["--data", DATA, "--device", "cpu", "--threads", "1", "--batch", "4", "--eval-every", "0"])
        .args(["--steps", &STEPS.to_string(), "--rank", &rank.to_string(), "--world-size", "2"])
        .args(["--rpc-timeout", "30"])
        .args(extra)
        .stdout(Stdio::null());
    if rank != 0 {
        cmd.arg("--quiet");
    }
    Proc::spawn(&mut cmd)
}

fn finish_ok(p: &mut Proc, what: &str) -> String {
    let (code, err, _) = p.finish(Duration::from_secs(120));
    assert_eq!(code, 0, "{what} failed:\n{err}");
    err
}

/// SIGTERM the server (a clean stop writes its final checkpoint) and wait for it.
fn stop(p: &mut Proc) -> String {
    let ok = Command::new("kill").args(["-TERM", &p.id().to_string()]).status().unwrap();
    assert!(ok.success());
    let (code, log, _) = p.finish(Duration::from_secs(30));
    assert_eq!(code, 0, "the server's stop:\n{log}");
    log
}

fn records<T>(path: &Path, pick: impl Fn(Record) -> Option<T>) -> Vec<T> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter_map(|l| parse_line(l).ok().and_then(&pick))
        .collect()
}

fn applies(path: &Path) -> Vec<ServerApply> {
    records(path, |r| match r {
        Record::ServerApply(a) => Some(a),
        _ => None,
    })
}

fn steps(path: &Path) -> Vec<Step> {
    records(path, |r| match r {
        Record::Step(s) => Some(s),
        _ => None,
    })
}

/// A step between 5 and 30 drawn from the clock, a multiple of `every`.
fn random_step(every: u64) -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    let k = 5 + u64::from(nanos) % 26;
    (k / every).max(1) * every
}

/// The unbroken run's final server checkpoint.
fn unbroken(dir: &Scratch, server_flags: &[&str], worker_flags: &[&str]) -> std::path::PathBuf {
    let ck = dir.join("unbroken.ckpt");
    let (mut srv, addr) = server(&ck, server_flags);
    let mut w0 = worker(&addr, 0, worker_flags);
    let mut w1 = worker(&addr, 1, worker_flags);
    finish_ok(&mut w0, "the unbroken run's rank 0");
    finish_ok(&mut w1, "the unbroken run's rank 1");
    stop(&mut srv);
    ck
}

/// Strict BSP: rank 0 is killed after the checkpoint of a random step and restarted with
/// `--resume` at once, while rank 1's push of the next step waits for it; the run finishes
/// and the servers end with the unbroken run's bits, every version holding both ranks'
/// gradients once.
fn killed_worker_comes_back(name: &str, every: u64, server_flags: &[&str], worker_flags: &[&str]) {
    let dir = Scratch::new(name);
    let want = unbroken(&dir, server_flags, worker_flags);
    let (ck, metrics, wck) = (dir.join("server.ckpt"), dir.join("server.jsonl"), dir.join("workers"));
    let m = metrics.display().to_string();
    let (mut srv, addr) = server(&ck, &[server_flags, &["--metrics", &m]].concat());
    let every_s = every.to_string();
    let w = wck.display().to_string();
    let ckf = ["--checkpoint", &w, "--checkpoint-every", &every_s, "--slow-rank", "0:30"];
    let flags = [worker_flags, &ckf].concat();
    let mut w0 = worker(&addr, 0, &flags);
    let mut w1 = worker(&addr, 1, &flags);
    let k = random_step(every);
    eprintln!("{name}: rank 0 is killed after the checkpoint of step {k}");
    w0.wait_line(&format!("checkpoint of step {k} in"), Duration::from_secs(60));
    w0.kill9();
    let killed = std::time::Instant::now();
    let mut again = worker(&addr, 0, &[&flags[..], &["--resume"]].concat());
    again.wait_line("gradsync: resuming", Duration::from_secs(60));
    let resumed = killed.elapsed();
    // The first progress line after the kill: the step that waited for rank 0 is done.
    again.wait_line("step ", Duration::from_secs(60));
    eprintln!(
        "{name}: restarted rank 0 resumed {:.3} s after the kill, its first progress line {:.3} s after",
        resumed.as_secs_f64(),
        killed.elapsed().as_secs_f64()
    );
    finish_ok(&mut again, "the restarted rank 0");
    finish_ok(&mut w1, "rank 1");
    let log = stop(&mut srv);
    assert!(log.contains("rank 0 came back"), "{log}");
    let applied = applies(&metrics);
    assert_eq!(applied.len() as u64, STEPS, "one update per step");
    for (i, a) in applied.iter().enumerate() {
        assert_eq!((a.version, &a.ranks[..]), (i as u64 + 1, &[0, 1][..]), "every gradient once");
    }
    assert_same_checkpoints(&want, &ck);
}

#[test]
fn a_killed_ps_worker_restarted_with_resume_ends_at_the_unbroken_runs_bits() {
    killed_worker_comes_back("ps-resume-strict", 5, &["--worker-timeout", "30"], &[]);
}

/// With top-k, a worker's residual is part of the run: checkpointed every step, restored by
/// `--resume`, and the run still ends at the unbroken run's bits.
#[test]
fn a_killed_ps_worker_with_topk_resumes_its_residual_to_the_unbroken_runs_bits() {
    killed_worker_comes_back(
        "ps-resume-topk",
        1,
        &["--worker-timeout", "30", "--compress", "topk:0.1"],
        &["--compress", "topk:0.1"],
    );
}

/// Strict BSP, the restart too late: the step waiting for the killed rank fails at the worker
/// timeout and the other worker exits naming it. Both restarted with `--resume` take the run
/// up from the servers' version, and it ends at the unbroken run's bits.
#[test]
fn a_failed_step_is_taken_up_by_the_workers_restarted_with_resume() {
    let dir = Scratch::new("ps-resume-failed-step");
    let strict = ["--worker-timeout", "3"];
    let want = unbroken(&dir, &strict, &[]);
    let (ck, wck) = (dir.join("server.ckpt"), dir.join("workers").display().to_string());
    let (mut srv, addr) = server(&ck, &strict);
    let flags = ["--checkpoint", &wck, "--checkpoint-every", "5", "--slow-rank", "0:30"];
    let mut w0 = worker(&addr, 0, &flags);
    let mut w1 = worker(&addr, 1, &flags);
    w0.wait_line("checkpoint of step 10 in", Duration::from_secs(60));
    w0.kill9();
    let (code, err, _) = w1.finish(Duration::from_secs(60));
    assert_ne!(code, 0, "rank 1 must fail once the step times out");
    assert!(err.contains("rank(s) [0] sent nothing within the worker timeout of 3 s"), "{err}");
    let resumed = [&flags[..], &["--resume"]].concat();
    let mut w0 = worker(&addr, 0, &resumed);
    let mut w1 = worker(&addr, 1, &resumed);
    finish_ok(&mut w0, "the restarted rank 0");
    finish_ok(&mut w1, "the restarted rank 1");
    stop(&mut srv);
    assert_same_checkpoints(&want, &ck);
}

/// Elastic BSP: the server drops the killed rank at the worker timeout and goes on with the
/// other; the rank restarted with `--resume` joins again at the next step. Every gradient the
/// rank recorded is in the update of its step, none twice, and the rank's steps after its
/// return follow the servers' version.
#[test]
fn an_elastic_server_takes_a_dropped_worker_back_at_the_next_step() {
    let dir = Scratch::new("ps-resume-elastic");
    let (ck, metrics, wck) = (dir.join("server.ckpt"), dir.join("server.jsonl"), dir.join("workers"));
    let m = metrics.display().to_string();
    let (mut srv, addr) = server(&ck, &["--elastic", "--worker-timeout", "3", "--metrics", &m]);
    let w = wck.display().to_string();
    let mine = dir.join("rank{rank}.jsonl").display().to_string();
    // Rank 1 is slow (100 ms a step) so that the run outlasts the timeout and the return.
    let flags = ["--checkpoint", &w, "--checkpoint-every", "5", "--slow-rank", "1:100", "--metrics", &mine];
    let mut w0 = worker(&addr, 0, &flags);
    let mut w1 = worker(&addr, 1, &flags);
    w0.wait_line("checkpoint of step 5 in", Duration::from_secs(60));
    w0.kill9();
    srv.wait_line("dropping workers", Duration::from_secs(30));
    let mut again = worker(&addr, 0, &[&flags[..], &["--resume"]].concat());
    let err = finish_ok(&mut again, "the restarted rank 0");
    assert!(err.contains("resuming at step"), "{err}");
    finish_ok(&mut w1, "rank 1");
    let log = stop(&mut srv);
    assert!(log.contains("rank 0 came back (it had left or was dropped)"), "{log}");
    let applied = applies(&metrics);
    for (i, a) in applied.iter().enumerate() {
        assert_eq!(a.version, i as u64 + 1, "versions in order");
    }
    let recorded = steps(&dir.join("rank0.jsonl"));
    let at: Vec<u64> = recorded.iter().map(|s| s.step).collect();
    assert!(at.windows(2).all(|w| w[0] < w[1]), "no step twice: {at:?}");
    assert_eq!(*at.last().unwrap(), STEPS, "{at:?}");
    let gap = at.windows(2).find(|w| w[1] > w[0] + 1).expect("rank 0 missed the steps it was away");
    for s in &recorded {
        let a = &applied[s.step as usize - 1];
        assert!(a.ranks.contains(&0), "rank 0's gradient of step {} is not in version {}", s.step, a.version);
    }
    // Every update with rank 0's gradient is one of its recorded steps, but for the one it
    // may have pushed just before it was killed.
    let unrecorded = applied.iter().filter(|a| a.ranks.contains(&0) && !at.contains(&a.version)).count();
    assert!(unrecorded <= 1, "{unrecorded} updates hold a gradient of rank 0 it never recorded");
    // While it was away, rank 1 alone (but for the step rank 0 may have pushed just before
    // the kill): versions gap[0] + 1 ..= gap[1] - 1.
    let away = &applied[gap[0] as usize..gap[1] as usize - 1];
    let alone = away.iter().filter(|a| a.ranks == [1]).count();
    assert!(alone >= 1 && alone + 1 >= away.len(), "{gap:?}: {away:?}");
}

/// The version from which `log` (a server's) expects rank 0 back: its "came back" line's.
fn join_version(log: &str) -> u64 {
    let line = log.lines().find(|l| l.contains("rank 0 came back")).unwrap_or_else(|| panic!("{log}"));
    let at = line.split("expected from version ").nth(1).unwrap_or_else(|| panic!("{line}"));
    at.split_whitespace().next().unwrap().parse().unwrap_or_else(|_| panic!("{line}"))
}

/// Elastic BSP, rank 0 killed in the middle of a step: it is the straggler (it sleeps inside
/// each step, before its push), killed there right after a checkpoint. The server goes on
/// without it once the worker timeout passes (that step's update holds rank 1's gradient
/// alone, nothing of the killed process), and the rank restarted with `--resume` joins at the
/// next round: from the version the server names, every update holds both ranks.
#[test]
fn an_elastic_worker_killed_mid_step_joins_at_the_next_round() {
    let dir = Scratch::new("ps-resume-elastic-mid-step");
    let (ck, metrics, wck) = (dir.join("server.ckpt"), dir.join("server.jsonl"), dir.join("workers"));
    let m = metrics.display().to_string();
    let (mut srv, addr) = server(&ck, &["--elastic", "--worker-timeout", "3", "--metrics", &m]);
    let w = wck.display().to_string();
    let mine = dir.join("rank{rank}.jsonl").display().to_string();
    let flags = ["--checkpoint", &w, "--checkpoint-every", "5", "--metrics", &mine];
    // Rank 1 is slowed too (less): alone after the drop it must not run through the last step
    // before the restarted rank 0 is back (10 steps at least are left, a second or more).
    let (slow0, slow1) = (["--slow-rank", "0:200"], ["--slow-rank", "1:100"]);
    let mut w0 = worker(&addr, 0, &[&flags[..], &slow0].concat());
    let mut w1 = worker(&addr, 1, &[&flags[..], &slow1].concat());
    let k = random_step(5);
    eprintln!("rank 0 is killed inside step {}", k + 1);
    w0.wait_line(&format!("checkpoint of step {k} in"), Duration::from_secs(60));
    w0.kill9();
    srv.wait_line("dropping workers", Duration::from_secs(30));
    let mut again = worker(&addr, 0, &[&flags[..], &slow0, &["--resume"]].concat());
    let err = finish_ok(&mut again, "the restarted rank 0");
    assert!(err.contains("resuming at step"), "{err}");
    finish_ok(&mut w1, "rank 1");
    let log = stop(&mut srv);
    assert!(log.contains("rank 0 came back (it had left or was dropped)"), "{log}");
    let join = join_version(&log);
    let applied = applies(&metrics);
    for (i, a) in applied.iter().enumerate() {
        assert_eq!(a.version, i as u64 + 1, "versions in order");
    }
    // The step rank 0 was killed in went on without it, as did every step until it joined.
    assert!(join > k, "joined at {join}, killed inside step {}", k + 1);
    for a in &applied[k as usize..join as usize] {
        assert_eq!(a.ranks, [1], "version {} while rank 0 was away: {:?}", a.version, a.ranks);
    }
    for a in &applied[join as usize..] {
        assert_eq!(a.ranks, [0, 1], "version {} after rank 0 joined at {join}", a.version);
    }
    let recorded = steps(&dir.join("rank0.jsonl"));
    let at: Vec<u64> = recorded.iter().map(|s| s.step).collect();
    assert!(at.windows(2).all(|w| w[0] < w[1]), "no step twice: {at:?}");
    assert_eq!(*at.last().unwrap(), STEPS, "{at:?}");
    assert!(!at.contains(&(k + 1)), "rank 0 recorded the step it was killed in: {at:?}");
}

/// Two server shards, strict BSP: rank 0 killed after a checkpoint and restarted with
/// `--resume` at once. Both shards take it back at the same step (the one their logs name),
/// every update holds both ranks' gradients on both shards, and each shard ends at the
/// unbroken run's bits.
#[test]
fn a_ps_worker_rejoining_two_shards_is_taken_back_at_the_same_step_by_both() {
    let dir = Scratch::new("ps-resume-two-shards");
    let strict = ["--worker-timeout", "30"];
    let two = |dir: &Path, tag: &str| -> Vec<(Proc, String, std::path::PathBuf, std::path::PathBuf)> {
        (0..2)
            .map(|i| {
                let (ck, m) = (dir.join(format!("{tag}{i}.ckpt")), dir.join(format!("{tag}{i}.jsonl")));
                let shard = format!("{i}/2");
                let ms = m.display().to_string();
                let (p, addr) = server(&ck, &[&strict[..], &["--shard", &shard, "--metrics", &ms]].concat());
                (p, addr, ck, m)
            })
            .collect()
    };
    let mut base = two(&dir, "unbroken");
    let addrs = format!("{},{}", base[0].1, base[1].1);
    let (mut u0, mut u1) = (worker(&addrs, 0, &[]), worker(&addrs, 1, &[]));
    finish_ok(&mut u0, "the unbroken run's rank 0");
    finish_ok(&mut u1, "the unbroken run's rank 1");
    for s in base.iter_mut() {
        stop(&mut s.0);
    }
    let mut shards = two(&dir, "shard");
    let addrs = format!("{},{}", shards[0].1, shards[1].1);
    let w = dir.join("workers").display().to_string();
    let flags = ["--checkpoint", &w, "--checkpoint-every", "5", "--slow-rank", "0:30"];
    let mut w0 = worker(&addrs, 0, &flags);
    let mut w1 = worker(&addrs, 1, &flags);
    let k = random_step(5);
    eprintln!("rank 0 is killed after the checkpoint of step {k}");
    w0.wait_line(&format!("checkpoint of step {k} in"), Duration::from_secs(60));
    w0.kill9();
    let mut again = worker(&addrs, 0, &[&flags[..], &["--resume"]].concat());
    finish_ok(&mut again, "the restarted rank 0");
    finish_ok(&mut w1, "rank 1");
    let logs: Vec<String> = shards.iter_mut().map(|s| stop(&mut s.0)).collect();
    let joins: Vec<u64> = logs.iter().map(|l| join_version(l)).collect();
    assert_eq!(joins[0], joins[1], "the shards took rank 0 back at different steps");
    let updates: Vec<Vec<ServerApply>> = shards.iter().map(|s| applies(&s.3)).collect();
    for u in &updates {
        assert_eq!(u.len() as u64, STEPS, "one update per step");
        for (i, a) in u.iter().enumerate() {
            assert_eq!((a.version, &a.ranks[..]), (i as u64 + 1, &[0, 1][..]), "every gradient once");
        }
    }
    for (s, b) in shards.iter().zip(&base) {
        assert_same_checkpoints(&b.2, &s.2);
    }
}

/// Servers that resumed from an older checkpoint than any a worker kept: the worker refuses,
/// naming both versions.
#[test]
fn servers_behind_every_worker_checkpoint_are_refused_naming_both() {
    let dir = Scratch::new("ps-resume-behind");
    let (ck, wck) = (dir.join("server.ckpt"), dir.join("workers").display().to_string());
    let one = |addr: &str, extra: &[&str]| {
        let mut cmd = Command::new(WORKER);
        cmd.args(["train", "--mode", "ps", "--servers", addr, "--model", "tiny", "--seed", "7"])
            .args(["--data", DATA, "--device", "cpu", "--threads", "1", "--batch", "4", "--eval-every", "0"])
            .args(["--steps", "12", "--rank", "0", "--world-size", "1", "--rpc-timeout", "30"])
            .args(["--checkpoint", &wck, "--checkpoint-every", "5"])
            .args(extra)
            .stdout(Stdio::null());
        Proc::spawn(&mut cmd)
    };
    let (mut srv, addr) = server(&ck, &[]);
    finish_ok(&mut one(&addr, &[]), "the first run");
    stop(&mut srv);
    // A fresh server (version 0) and the worker's checkpoints of versions 5 and 10.
    let (mut srv, addr) = server(&dir.join("fresh.ckpt"), &[]);
    let (code, err, _) = one(&addr, &["--resume"]).finish(Duration::from_secs(60));
    assert_ne!(code, 0);
    assert!(
        err.contains("written at the servers' version 5") && err.contains("the servers are at version 0"),
        "{err}"
    );
    stop(&mut srv);
}
