//! Faults, as real processes on 127.0.0.1, for every mode: a worker killed with SIGKILL in the
//! middle of a step (PS under BSP, SSP and ASP, strict and elastic; DDP by hand and under the
//! launcher), the server killed with SIGKILL mid-training and restarted with `--resume`, and a
//! bad `--slow-rank`. In every case: no hang beyond the configured timeout, an error naming
//! the rank or the server, elastic servers finish with the remaining workers, and the
//! checkpoint holds what it held before the kill.
//!
//! "Mid-step" without sleeping to synchronise: the victim is a straggler (`--slow-rank`, the
//! injected delay sits inside the step), and the test kills it as soon as rank 0's first
//! progress line says training is under way; from then on the victim spends nearly all its
//! time inside a step. Every child is killed and reaped when its guard drops.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gradsync_core::checkpoint::Checkpoint;
use gradsync_core::metrics::{Record, ServerApply, parse_line};

mod common;
use common::server_bin;
use gradsync_testkit::Scratch;
use gradsync_testkit::process::{Proc, start_server};

const WORKER: &str = env!("CARGO_BIN_EXE_gradsync-worker");
const DATA: &str = "synthetic:2048:32:8";

fn tmp(name: &str) -> Scratch {
    Scratch::new(&format!("faults-{name}"))
}

/// Start a server shard (tiny model, DATA) with `extra` flags; returns it and its address,
/// read from its `gradsync-server listening on ADDR` line.
fn server(extra: &[&str]) -> (Proc, String) {
    let mut cmd = Command::new(server_bin());
    cmd.args(["--listen", "127.0.0.1:0", "--model", "tiny", "--seed", "7", "--data", DATA])
        .args(extra)
        // The default log level: what a user sees without asking.
        .env_remove("GRADSYNC_LOG");
    start_server(&mut cmd, true)
}

/// A PS worker process. Rank 0 prints progress (not --quiet) so the test can see training
/// under way.
fn ps_worker(addr: &str, rank: usize, steps: u64, extra: &[&str]) -> Proc {
    let mut cmd = Command::new(WORKER);
    cmd.args(["train", "--mode", "ps", "--servers", addr, "--model", "tiny", "--seed", "7"])
        .args(["--data", DATA, "--device", "cpu", "--threads", "1", "--batch", "4", "--eval-every", "0"])
        .args(["--steps", &steps.to_string(), "--rank", &rank.to_string(), "--world-size", "2"])
        .args(["--rpc-timeout", "5"])
        .args(extra)
        .stdout(Stdio::null());
    Proc::spawn(&mut cmd)
}

fn applies(path: &Path) -> Vec<ServerApply> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter_map(|l| match parse_line(l) {
            Ok(Record::ServerApply(a)) => Some(a),
            _ => None,
        })
        .collect()
}

/// Worker timeout the PS tests configure, seconds (an elastic server needs more than the
/// workers' 2 s heartbeat interval).
const WORKER_TIMEOUT_S: u64 = 3;

/// Rank 0 (a straggler, so it is inside a step nearly all the time) is killed with SIGKILL
/// after its first progress line; rank 1 runs `steps` steps.
fn ps_worker_killed(sync: &str, elastic: bool) {
    let dir = tmp(&format!("ps-{}-{elastic}", sync.replace(':', "")));
    let metrics = dir.join("server.jsonl");
    let ck = dir.join("server.ckpt");
    let timeout = WORKER_TIMEOUT_S.to_string();
    let mut flags = vec![
        "--sync",
        sync,
        "--worker-timeout",
        &timeout,
        "--metrics",
        metrics.to_str().unwrap(),
        "--checkpoint",
        ck.to_str().unwrap(),
        "--checkpoint-every",
        "5",
    ];
    if elastic {
        flags.push("--elastic");
    }
    let (mut srv, addr) = server(&flags);
    // 40 steps: progress every 2 steps. The victim sleeps 100 ms per step.
    let steps = 40;
    let mut victim = ps_worker(&addr, 0, steps, &["--slow-rank", "0:100"]);
    // Rank 1 is slowed a little too, so it is still training when rank 0 dies even under ASP.
    let mut other = ps_worker(&addr, 1, steps, &["--quiet", "--slow-rank", "1:25"]);
    victim.wait_line("step ", Duration::from_secs(60));
    victim.kill9();
    let t_kill = Instant::now();
    let (code, err, _) = other.finish(Duration::from_secs(30));
    let took = t_kill.elapsed();
    let waits = sync != "asp";
    if waits && !elastic {
        // The survivor's step fails at the worker timeout with an error naming rank 0.
        assert_ne!(code, 0, "{sync}: rank 1 should fail once rank 0 is gone");
        assert!(err.contains("rank(s) [0]"), "{sync}: the error does not name rank 0:\n{err}");
        assert!(
            took < Duration::from_secs(WORKER_TIMEOUT_S + 10),
            "{sync}: took {took:?}, the timeout is {WORKER_TIMEOUT_S} s"
        );
    } else {
        // ASP does not wait for anyone; elastic servers drop the dead worker.
        assert_eq!(code, 0, "{sync} elastic={elastic}: rank 1 failed:\n{err}");
        let mine = applies(&metrics).iter().filter(|a| a.ranks.contains(&1)).count();
        assert_eq!(mine as u64, steps, "{sync}: every one of rank 1's gradients is applied once");
        let last = applies(&metrics).pop().unwrap();
        assert_eq!(last.ranks, vec![1], "{sync}: the last update is rank 1's alone");
    }
    // A clean stop writes the final checkpoint; it holds every update applied.
    let version = applies(&metrics).last().map_or(0, |a| a.version);
    let (code, log, _) = stop(&mut srv);
    assert_eq!(code, 0, "{log}");
    assert_eq!(Checkpoint::load(&ck).unwrap().header.step, version, "{sync}: final checkpoint");
    if elastic && waits {
        // One line at the default log level: which rank, why, how many remain.
        let line = log.lines().find(|l| l.contains("dropping workers")).unwrap_or_default();
        assert!(
            line.contains("rank(s) [0]")
                && line.contains("within --worker-timeout 3 s")
                && line.contains("1 worker(s) remain: [1]"),
            "{sync}: the server log:\n{log}"
        );
    }
}

/// SIGTERM the server (a clean stop: final checkpoint, exit 0) and wait for its exit.
fn stop(p: &mut Proc) -> (i32, String, Duration) {
    let ok = Command::new("kill").args(["-TERM", &p.id().to_string()]).status().unwrap();
    assert!(ok.success());
    p.finish(Duration::from_secs(30))
}

#[test]
fn ps_bsp_strict_worker_sigkill_fails_the_step_naming_it() {
    ps_worker_killed("bsp", false);
}

#[test]
fn ps_bsp_elastic_worker_sigkill_the_rest_finish() {
    ps_worker_killed("bsp", true);
}

#[test]
fn ps_ssp_strict_worker_sigkill_fails_naming_it() {
    ps_worker_killed("ssp:1", false);
}

#[test]
fn ps_ssp_elastic_worker_sigkill_the_rest_finish() {
    ps_worker_killed("ssp:1", true);
}

#[test]
fn ps_asp_worker_sigkill_the_rest_finish() {
    ps_worker_killed("asp", false);
}

/// The server is killed with SIGKILL while two workers train; both fail within their RPC
/// timeout naming the server; a server restarted with `--resume` serves exactly the last
/// checkpoint and training goes on from its version.
fn server_killed(sync: &str) {
    let dir = tmp(&format!("srv-{sync}"));
    let ck = dir.join("server.ckpt");
    let ckf = ck.to_str().unwrap();
    let (mut srv, addr) = server(&["--sync", sync, "--checkpoint", ckf, "--checkpoint-every", "4"]);
    let mut w0 = ps_worker(&addr, 0, 2000, &["--slow-rank", "0:20"]);
    let w1 = ps_worker(&addr, 1, 2000, &["--quiet", "--slow-rank", "1:20"]);
    // Progress every 100 steps: by then at least 4 updates, so a periodic checkpoint exists.
    w0.wait_line("step ", Duration::from_secs(60));
    srv.kill9();
    for (r, mut w) in [w0, w1].into_iter().enumerate() {
        let (code, err, took) = w.finish(Duration::from_secs(30));
        assert_ne!(code, 0, "rank {r} went on without its server");
        assert!(err.contains(&addr), "rank {r}: the error does not name the server {addr}:\n{err}");
        assert!(took < Duration::from_secs(15), "rank {r} took {took:?} (rpc timeout 5 s)");
    }
    let saved = Checkpoint::load(&ck).expect("the last periodic checkpoint");
    assert!(saved.header.step >= 4 && saved.header.step.is_multiple_of(4), "{}", saved.header.step);

    let (mut srv, addr) = server(
        &["--sync", sync, "--checkpoint", ckf, "--resume", "--metrics"]
            .into_iter()
            .chain([dir.join("resumed.jsonl").to_str().unwrap()])
            .collect::<Vec<_>>(),
    );
    // No steps: the worker pulls and saves what the server resumed with.
    let pulled = dir.join("pulled.ckpt");
    let mut cmd = Command::new(WORKER);
    cmd.args(["train", "--mode", "ps", "--servers", &addr, "--model", "tiny", "--seed", "7"])
        .args(["--data", DATA, "--device", "cpu", "--threads", "1", "--quiet", "--steps", "0"])
        .args(["--world-size", "1", "--rank", "0", "--batch", "4", "--save", pulled.to_str().unwrap()])
        .stdout(Stdio::null());
    let (code, err, _) = Proc::spawn(&mut cmd).finish(Duration::from_secs(30));
    assert_eq!(code, 0, "{err}");
    assert_eq!(Checkpoint::load(&pulled).unwrap().params, saved.params, "resumed parameters differ");
    // Training goes on from the checkpoint's version.
    let mut cmd = Command::new(WORKER);
    cmd.args(["train", "--mode", "ps", "--servers", &addr, "--model", "tiny", "--seed", "7"])
        .args(["--data", DATA, "--device", "cpu", "--threads", "1", "--quiet", "--steps", "3"])
        .args(["--world-size", "1", "--rank", "0", "--batch", "4"])
        .stdout(Stdio::null());
    let (code, err, _) = Proc::spawn(&mut cmd).finish(Duration::from_secs(30));
    assert_eq!(code, 0, "{err}");
    let v: Vec<u64> = applies(&dir.join("resumed.jsonl")).iter().map(|a| a.version).collect();
    let base = saved.header.step;
    assert_eq!(v, vec![base + 1, base + 2, base + 3], "versions after resuming from {base}");
    let (code, log, _) = stop(&mut srv);
    assert_eq!(code, 0, "{log}");
    assert_eq!(Checkpoint::load(&ck).unwrap().header.step, base + 3);
}

#[test]
fn ps_bsp_server_sigkill_then_resume() {
    server_killed("bsp");
}

#[test]
fn ps_asp_server_sigkill_then_resume() {
    server_killed("asp");
}

/// A port free right now (bound, then released) for a DDP store the ranks must all know.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn ddp_args(steps: u64) -> Vec<String> {
    ["train", "--mode", "ddp", "--model", "tiny", "--data", DATA, "--device", "cpu", "--threads", "1"]
        .iter()
        .map(|s| s.to_string())
        .chain(["--batch", "4", "--eval-every", "0", "--comm-timeout", "5", "--steps"].map(String::from))
        .chain([steps.to_string()])
        .collect()
}

/// Rank 2 of 3 is killed with SIGKILL while the others wait for it inside an all-reduce, on
/// `transport`: the others fail within the timeout and name it.
fn ddp_rank_sigkill(transport: &str) {
    let port = free_port().to_string();
    let spawn = |rank: usize, extra: &[&str]| {
        let mut cmd = Command::new(WORKER);
        cmd.args(ddp_args(100))
            .args(["--rank", &rank.to_string(), "--world-size", "3", "--master-addr", "127.0.0.1"])
            .args(["--master-port", &port, "--transport", transport])
            .args(extra)
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .stdout(Stdio::null());
        Proc::spawn(&mut cmd)
    };
    let mut r0 = spawn(0, &[]);
    let r1 = spawn(1, &["--quiet"]);
    let mut victim = spawn(2, &["--quiet", "--slow-rank", "2:50"]);
    // The ring is in lockstep: once rank 0 reports progress, rank 2 is inside its steps.
    r0.wait_line("step ", Duration::from_secs(60));
    victim.kill9();
    // Rank 0 receives from rank 2 (its left neighbour) and names it. Rank 1 may learn it first
    // from rank 0, which tells its peers whom it blames before it closes: rank 1's error must
    // name rank 2 too, first, not the neighbour that closed on it.
    for (r, mut p) in [(0, r0), (1, r1)] {
        let (code, err, took) = p.finish(Duration::from_secs(30));
        assert_ne!(code, 0, "rank {r} went on without rank 2");
        assert_eq!(first_rank_named(&err), Some(2), "rank {r}: the error does not blame rank 2:\n{err}");
        assert!(took < Duration::from_secs(5 + 5), "rank {r} took {took:?}; --comm-timeout is 5 s");
    }
}

/// The first rank named ("rank N") in the process's final error line.
fn first_rank_named(stderr: &str) -> Option<usize> {
    let line = stderr.lines().rfind(|l| l.contains("error:"))?;
    let at = line.find("rank ")? + "rank ".len();
    line[at..].split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

#[test]
fn ddp_rank_sigkill_fails_the_others_naming_it() {
    ddp_rank_sigkill("tcp");
}

#[test]
fn ddp_rank_sigkill_over_shared_memory_fails_the_others_naming_it() {
    ddp_rank_sigkill("shm");
}

#[test]
fn launcher_stops_the_ring_when_a_rank_is_sigkilled() {
    let mut cmd = gradsync_testkit::process::isolated(WORKER);
    cmd.args(["launch", "--nproc-per-node", "3", "--master-port", "0", "--"])
        .args(ddp_args(200))
        .args(["--slow-rank", "1:50"])
        .stdout(Stdio::null());
    let mut launcher = Proc::spawn(&mut cmd);
    // Rank 0's progress comes through the launcher's stderr, prefixed with its rank.
    launcher.wait_line("step ", Duration::from_secs(60));
    let kids = gradsync_worker::launch::children(launcher.id());
    assert_eq!(kids.len(), 3, "the launcher's ranks: {kids:?}");
    let rank_of = |pid: u32| {
        let mut env = String::new();
        std::fs::File::open(format!("/proc/{pid}/environ")).unwrap().read_to_string(&mut env).unwrap();
        env.split('\0').find_map(|kv| kv.strip_prefix("RANK=")).map(String::from).unwrap()
    };
    let victim = *kids.iter().find(|p| rank_of(**p) == "1").unwrap();
    let ok = Command::new("kill").args(["-KILL", &victim.to_string()]).status().unwrap();
    assert!(ok.success());
    let (code, err, took) = launcher.finish(Duration::from_secs(30));
    assert_ne!(code, 0);
    // The launcher's summary names the rank that was killed, with the signal, even though
    // the others failed because of it within milliseconds; and each survivor blames rank 1.
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.contains("rank 1 failed first (signal: 9 (SIGKILL))")
            && last.contains("stopped the other ranks"),
        "the launcher's summary: {last}\n{err}"
    );
    for r in [0, 2] {
        let own = err.lines().filter(|l| l.starts_with(&format!("[{r}] "))).collect::<Vec<_>>().join("\n");
        if own.contains("error:") {
            assert_eq!(first_rank_named(&own), Some(1), "rank {r} blames another rank:\n{own}");
        }
    }
    assert!(took < Duration::from_secs(15), "took {took:?}");
    for pid in kids {
        assert!(!Path::new(&format!("/proc/{pid}")).exists() || zombie(pid), "rank pid {pid} survived");
    }
}

fn zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z')))
        .unwrap_or(true)
}

#[test]
fn elastic_worker_timeout_must_exceed_the_heartbeat() {
    for (timeout, ok) in [("2", false), ("0.5", false), ("2.5", true)] {
        let mut cmd = Command::new(server_bin());
        cmd.args(["--listen", "127.0.0.1:0", "--model", "tiny", "--data", DATA, "--elastic"])
            .args(["--worker-timeout", timeout])
            .stdout(Stdio::piped());
        let mut p = Proc::spawn(&mut cmd);
        if ok {
            // It serves: its first line is the listening address.
            let mut line = String::new();
            BufReader::new(p.child().stdout.take().unwrap()).read_line(&mut line).unwrap();
            assert!(line.starts_with("gradsync-server listening on "), "{line}");
            continue;
        }
        let (code, err, _) = p.finish(Duration::from_secs(30));
        assert_ne!(code, 0, "--elastic --worker-timeout {timeout} was accepted");
        assert!(
            err.contains("--worker-timeout") && err.contains("heartbeat interval of 2 s"),
            "--worker-timeout {timeout}: {err}"
        );
    }
}

#[test]
fn slow_rank_is_validated() {
    for (flag, want) in [
        ("1", "expected RANK:MS"),
        ("x:5", "rank 'x'"),
        ("1:-5", "milliseconds '-5'"),
        ("2:10", "rank 2 is not below the world size 2"),
    ] {
        let out = Command::new(WORKER)
            .args(["train", "--mode", "dp", "--replicas", "2", "--model", "tiny", "--data", DATA])
            .args(["--device", "cpu", "--threads", "1", "--steps", "1", "--quiet", "--slow-rank", flag])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "--slow-rank {flag} was accepted");
        assert!(err.contains(want), "--slow-rank {flag}: {err}");
    }
}

/// A straggler under the parameter server: rank 1 is delayed 40 ms per step. BSP names it in
/// every update's `waited_for`; SSP names it on the updates that released a held push (and
/// never names the fast rank); ASP waits for nobody.
fn straggler_named(sync: &str) -> Vec<ServerApply> {
    let dir = tmp(&format!("straggler-{}", sync.replace(':', "")));
    let metrics = dir.join("server.jsonl");
    let (mut srv, addr) = server(&["--sync", sync, "--metrics", metrics.to_str().unwrap()]);
    let mut ws: Vec<Proc> =
        (0..2).map(|r| ps_worker(&addr, r, 8, &["--quiet", "--slow-rank", "1:40"])).collect();
    for (r, w) in ws.iter_mut().enumerate() {
        let (code, err, _) = w.finish(Duration::from_secs(60));
        assert_eq!(code, 0, "rank {r}: {err}");
    }
    let (code, log, _) = stop(&mut srv);
    assert_eq!(code, 0, "{log}");
    applies(&metrics)
}

#[test]
fn bsp_names_the_straggler_in_every_update() {
    let a = straggler_named("bsp");
    assert_eq!(a.len(), 8);
    assert!(a.iter().all(|a| a.waited_for == Some(1)), "{a:?}");
    // The fast rank's gradient waited about the injected delay for the straggler's.
    let mean = a.iter().map(|a| a.queue_wait_ms).sum::<f64>() / a.len() as f64;
    assert!(mean > 20.0, "mean queue wait {mean} ms with a 40 ms straggler");
}

#[test]
fn ssp_names_the_straggler_it_held_a_push_for() {
    let a = straggler_named("ssp:1");
    assert_eq!(a.len(), 16, "SSP applies every gradient");
    assert!(a.iter().any(|a| a.waited_for == Some(1)), "{a:?}");
    assert!(a.iter().all(|a| a.waited_for != Some(0)), "the fast rank is never the straggler: {a:?}");
}

#[test]
fn asp_waits_for_nobody() {
    let a = straggler_named("asp");
    assert_eq!(a.len(), 16);
    assert!(a.iter().all(|a| a.waited_for.is_none()), "{a:?}");
}

#[test]
fn dp_slow_replica_is_recorded_and_delays_the_step() {
    let dir = tmp("dp-slow");
    let m = dir.join("dp.jsonl");
    let mut cmd = Command::new(WORKER);
    cmd.args(["train", "--mode", "dp", "--replicas", "2", "--model", "tiny", "--data", DATA])
        .args(["--device", "cpu", "--threads", "1", "--steps", "3", "--quiet", "--slow-rank", "1:60"])
        .args(["--metrics", m.to_str().unwrap()])
        .stdout(Stdio::null());
    let (code, err, _) = Proc::spawn(&mut cmd).finish(Duration::from_secs(60));
    assert_eq!(code, 0, "{err}");
    let text = std::fs::read_to_string(&m).unwrap();
    let mut recs = text.lines().map(|l| parse_line(l).unwrap());
    let Some(Record::Header(h)) = recs.next() else { panic!("no header: {text}") };
    assert_eq!((h.extra.get("slow_rank"), h.extra.get("slow_ms")), (Some(&1.into()), Some(&60.into())));
    for r in recs {
        if let Record::Step(s) = r {
            assert!(s.step_ms >= 60.0, "step {} took {} ms with a 60 ms replica delay", s.step, s.step_ms);
        }
    }
}

/// DP is one process: a replica that fails (its thread panics, or its device errors) must end
/// the run with an error naming the replica and the step, exit 1 without waiting on anything,
/// and leave the `--save` of the run before it as it was.
#[test]
fn dp_replica_failure_names_it_and_keeps_the_last_save() {
    let dir = tmp("dp-fail");
    let save = dir.join("params.ckpt");
    let dp = |steps: &str, extra: &[&str]| {
        let mut cmd = Command::new(WORKER);
        cmd.args(["train", "--mode", "dp", "--replicas", "3", "--model", "tiny", "--data", DATA])
            .args(["--device", "cpu", "--threads", "1", "--eval-every", "0", "--quiet", "--steps", steps])
            .args(["--save", save.to_str().unwrap()])
            .args(extra)
            .env_remove("GRADSYNC_DP_FAULT")
            .stdout(Stdio::null());
        Proc::spawn(&mut cmd).finish(Duration::from_secs(60))
    };
    let (code, err, _) = dp("3", &[]);
    assert_eq!(code, 0, "{err}");
    let before = std::fs::read(&save).unwrap();
    let saved = Checkpoint::load(&save).unwrap();
    assert_eq!(saved.header.step, 3);
    for (fault, want) in [
        ("1:2:panic", "step 2: replica 1: the replica's thread panicked: injected fault"),
        ("0:2:panic", "step 2: replica 0: the replica's thread panicked: injected fault"),
        ("2:3:error", "step 3: replica 2: injected device error"),
    ] {
        let metrics = dir.join(format!("{}.jsonl", fault.replace(':', "-")));
        let (code, err, took) = dp(
            "5",
            &[
                "--load",
                save.to_str().unwrap(),
                "--metrics",
                metrics.to_str().unwrap(),
                "--fail-replica",
                fault,
            ],
        );
        assert_eq!(code, 1, "--fail-replica {fault}: exit {code}\n{err}");
        let last = err.lines().rfind(|l| l.starts_with("gradsync-worker: error:")).unwrap_or_default();
        assert!(last.contains(want), "--fail-replica {fault}: the error line is {last:?}\n{err}");
        assert!(took < Duration::from_secs(30), "--fail-replica {fault} took {took:?}");
        // The save of the run before is untouched, and the steps before the failure were recorded.
        assert_eq!(std::fs::read(&save).unwrap(), before, "--fail-replica {fault} changed the last save");
        let text = std::fs::read_to_string(&metrics).unwrap();
        let steps = text.lines().filter(|l| matches!(parse_line(l), Ok(Record::Step(_)))).count();
        let failed_at: usize = fault.split(':').nth(1).unwrap().parse().unwrap();
        assert_eq!(steps, failed_at - 1, "--fail-replica {fault}: {text}");
    }
    // A replica outside the run is refused before anything starts.
    let (code, err, _) = dp("1", &["--fail-replica", "3:1:panic"]);
    assert_ne!(code, 0);
    assert!(err.contains("replica 3 is not below the 3 replicas"), "{err}");
    assert_eq!(std::fs::read(&save).unwrap(), before);
}
