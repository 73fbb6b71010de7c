//! Restarts agreed across nodes: two `launch` processes as two nodes on 127.0.0.1, DDP over
//! TCP with checkpoints; a rank of node 1 SIGKILLed at a random step (several seeds, one or
//! two ranks per node): both nodes log the restart with the failed node, rank and exit, restart
//! together as a new generation, and the run ends with exactly the unbroken run's parameters.
//! A node whose launcher dies makes the other give up with an error naming it; the launchers'
//! store itself (as a library) names a node that does not come back for a restart, and gives
//! up once the restarts are spent.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::assert_same_checkpoints;
use gradsync_testkit::Scratch;
use gradsync_testkit::process::Proc;
use gradsync_worker::restarts::{FromStore, Member, StoreConfig, ToStore, serve};

const WORKER: &str = env!("CARGO_BIN_EXE_gradsync-worker");

fn worker(args: &[String]) -> Command {
    let mut cmd = gradsync_testkit::process::isolated(WORKER);
    cmd.args(args).stdout(Stdio::null());
    cmd
}

/// The DDP training flags of every run here (the tiny model, 40 steps, 2 epochs of data), then
/// `extra`.
fn train(extra: &[&str]) -> Vec<String> {
    ["train", "--model", "tiny", "--data", "synthetic:320:32:8", "--device", "cpu", "--threads", "1"]
        .into_iter()
        .chain(["--steps", "40", "--eval-every", "0", "--lr", "0.05", "--mode", "ddp"])
        .chain(["--transport", "tcp", "--batch", "8", "--comm-timeout", "20"])
        .chain(extra.iter().copied())
        .map(String::from)
        .collect()
}

/// A port nothing listens on now, for the launchers' store (each node must be told it).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `launch` for node `node` of two, `nproc` ranks each, the launchers' store on `port`.
fn node(node: usize, nproc: usize, port: u16, launch: &[&str], args: Vec<String>) -> Vec<String> {
    let n = |x: usize| x.to_string();
    ["launch", "--nnodes", "2", "--node-rank", &n(node), "--nproc-per-node", &n(nproc)]
        .into_iter()
        .map(String::from)
        .chain(["--master-addr", "127.0.0.1", "--master-port", &n(port.into())].map(String::from))
        .chain(launch.iter().map(|x| x.to_string()))
        .chain(["--".to_string()])
        .chain(args)
        .collect()
}

fn kill9(pid: u32) {
    assert!(Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap().success());
}

/// The unbroken run of `world` ranks on one node, saved to `to`.
fn unbroken(world: usize, to: &Path) {
    let mut args: Vec<String> =
        ["launch", "--nproc-per-node", &world.to_string(), "--master-port", "0", "--"]
            .map(String::from)
            .to_vec();
    args.extend(train(&["--quiet", "--save", &to.display().to_string()]));
    let mut p = Proc::spawn(&mut worker(&args));
    let (code, err, _) = p.finish(Duration::from_secs(120));
    assert_eq!(code, 0, "the unbroken run failed:\n{err}");
}

/// Two nodes of `nproc` ranks, `kills` ranks of node 1 SIGKILLed one after another at random
/// steps (from `seed`); both nodes restart each time, and the run ends at `reference`'s bits.
/// Returns the seconds from each kill to node 0's first step of the new generation.
fn two_nodes_survive(dir: &Path, seed: u64, nproc: usize, kills: u32, reference: &Path) -> Vec<f64> {
    let s = |p: &Path| p.display().to_string();
    let (ck, save) =
        (dir.join(format!("ck-{seed}-{nproc}")), dir.join(format!("restarted-{seed}-{nproc}.ckpt")));
    let args = train(&[
        "--checkpoint",
        &s(&ck),
        "--checkpoint-every",
        "2",
        "--slow-rank",
        "0:20",
        "--save",
        &s(&save),
    ]);
    let port = free_port();
    let launch = ["--max-restarts", "3", "--monitor-interval", "0.05", "--rdzv-timeout", "20"];
    let mut n0 = Proc::spawn(&mut worker(&node(0, nproc, port, &launch, args.clone())));
    let mut n1 = Proc::spawn(&mut worker(&node(1, nproc, port, &launch, args)));
    let mut rng = seed;
    let mut costs = Vec::new();
    for k in 1..=kills {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        for _ in 0..1 + (rng >> 33) % 4 {
            n0.wait_line("[0] step ", Duration::from_secs(60));
        }
        let ranks = gradsync_worker::launch::children(n1.id());
        assert_eq!(ranks.len(), nproc, "node 1's ranks: {ranks:?}");
        let victim = ranks[((rng >> 40) % nproc as u64) as usize];
        let killed = Instant::now();
        kill9(victim);
        let said = format!("restart {k} of 3");
        let l0 = n0.wait_line(&said, Duration::from_secs(60));
        let l1 = n1.wait_line(&said, Duration::from_secs(60));
        for l in [&l0, &l1] {
            assert!(l.contains("on node 1 failed (signal: 9") && l.contains("--resume"), "seed {seed}: {l}");
            assert!(l.contains(&format!("(generation {k})")), "seed {seed}: {l}");
        }
        n0.wait_line("resuming after step", Duration::from_secs(60));
        n0.wait_line("[0] step ", Duration::from_secs(60));
        costs.push(killed.elapsed().as_secs_f64());
    }
    let (c0, e0, _) = n0.finish(Duration::from_secs(120));
    let (c1, e1, _) = n1.finish(Duration::from_secs(120));
    assert_eq!((c0, c1), (0, 0), "seed {seed}: a node failed:\nnode 0:\n{e0}\nnode 1:\n{e1}");
    assert_same_checkpoints(reference, &save);
    costs
}

#[test]
fn two_nodes_restart_together_to_the_unbroken_runs_bits() {
    let dir = Scratch::new("restarts-two-nodes");
    let (two, four) = (dir.join("unbroken2.ckpt"), dir.join("unbroken4.ckpt"));
    unbroken(2, &two);
    unbroken(4, &four);
    let mut costs = Vec::new();
    for seed in [1, 2, 3] {
        costs.extend(two_nodes_survive(&dir, seed, 1, 2, &two));
    }
    costs.extend(two_nodes_survive(&dir, 4, 2, 3, &four));
    let max = costs.iter().copied().fold(0.0, f64::max);
    let mean = costs.iter().sum::<f64>() / costs.len() as f64;
    eprintln!(
        "{} restarts across two nodes: kill to node 0's first new step {mean:.2} s on average, {max:.2} s at most",
        costs.len()
    );
}

/// A node whose launcher dies (SIGKILL, its ranks left behind) makes the other node give up
/// within the rendezvous timeout, naming it; node 0's launcher gone, node 1 names the lost
/// store.
#[test]
fn a_dead_launcher_makes_the_other_node_give_up_naming_it() {
    let dir = Scratch::new("restarts-dead-launcher");
    for dead in [1usize, 0] {
        let ck = dir.join(format!("ck{dead}")).display().to_string();
        // Slow steps: the run is still going when the launcher dies.
        let args = train(&["--checkpoint", &ck, "--checkpoint-every", "2", "--slow-rank", "0:200"]);
        let port = free_port();
        let launch = ["--max-restarts", "3", "--monitor-interval", "0.05", "--rdzv-timeout", "3"];
        let mut nodes = [
            Proc::spawn(&mut worker(&node(0, 1, port, &launch, args.clone()))),
            Proc::spawn(&mut worker(&node(1, 1, port, &launch, args))),
        ];
        nodes[0].wait_line("[0] step ", Duration::from_secs(60));
        let orphans = gradsync_worker::launch::children(nodes[dead].id());
        let t = Instant::now();
        nodes[dead].kill9();
        let other = &mut nodes[1 - dead];
        let (code, err, _) = other.finish(Duration::from_secs(30));
        let took = t.elapsed().as_secs_f64();
        for pid in orphans {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        assert_ne!(code, 0, "{err}");
        let says = if dead == 1 { "node 1's launcher was lost" } else { "lost the launchers' store" };
        assert!(err.contains(says), "launcher of node {dead} killed:\n{err}");
        // At once, not after the 3 s timeout: the connection's end says the launcher is gone.
        assert!(took < 2.5, "gave up after {took:.1} s");
        let last = err.lines().rev().find(|l| l.contains("error")).unwrap_or_default();
        eprintln!("node {dead}'s launcher killed: node {} gave up after {took:.2} s: {last}", 1 - dead);
    }
}

fn store(
    nnodes: usize,
    max_restarts: u32,
) -> (String, std::thread::JoinHandle<Result<(), String>>, StoreConfig) {
    let cfg = StoreConfig {
        nnodes,
        nproc: 1,
        max_restarts,
        token: Some("t".into()),
        timeout: Duration::from_secs(2),
    };
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let c = cfg.clone();
    (addr, std::thread::spawn(move || serve(l, &c, "127.0.0.1")), cfg)
}

fn expect_start(m: &Member, generation: u64) {
    match m.next(Some(Duration::from_secs(10)), "start").unwrap() {
        FromStore::Start { generation: g, port } => assert!(g == generation && port != 0),
        other => panic!("{other:?}"),
    }
}

/// The store's decisions: the failure ended by a signal is the one named, even when another
/// node's rank (failing because of it) reports first; a node that does not come back for the
/// restart is named once the timeout passes; a second failure with one restart allowed ends
/// the run on every node; a launcher with another --nproc-per-node, or the wrong token, is
/// refused by name.
#[test]
fn the_launchers_store_names_what_stopped_the_run() {
    // Node 1 does not come back.
    let (addr, h, cfg) = store(2, 3);
    let (a, b) = (Member::join(&addr, 0, &cfg).unwrap(), Member::join(&addr, 1, &cfg).unwrap());
    a.tell(&ToStore::Ready { generation: 0 }).unwrap();
    b.tell(&ToStore::Ready { generation: 0 }).unwrap();
    expect_start(&a, 0);
    expect_start(&b, 0);
    a.tell(&ToStore::Failed { generation: 0, rank: 0, exit: "exit status: 1".into(), signalled: false })
        .unwrap();
    b.tell(&ToStore::Failed { generation: 0, rank: 1, exit: "signal: 9 (SIGKILL)".into(), signalled: true })
        .unwrap();
    for m in [&a, &b] {
        let w = m.next(Some(Duration::from_secs(10)), "restart").unwrap();
        let want = FromStore::Restart {
            generation: 1,
            restart: 1,
            node: 1,
            rank: 1,
            exit: "signal: 9 (SIGKILL)".into(),
        };
        assert_eq!(w, want);
    }
    a.tell(&ToStore::Ready { generation: 1 }).unwrap();
    let t = Instant::now();
    match a.next(Some(Duration::from_secs(10)), "abort").unwrap() {
        FromStore::Abort { why } => {
            assert!(why.contains("node(s) [1] did not come back for restart 1"), "{why}")
        }
        other => panic!("{other:?}"),
    }
    assert!(t.elapsed() >= Duration::from_secs(1), "{:?}", t.elapsed());
    assert!(h.join().unwrap().unwrap_err().contains("[1]"));

    // The restarts spent.
    let (addr, h, cfg) = store(2, 1);
    let (a, b) = (Member::join(&addr, 0, &cfg).unwrap(), Member::join(&addr, 1, &cfg).unwrap());
    for g in 0..2 {
        a.tell(&ToStore::Ready { generation: g }).unwrap();
        b.tell(&ToStore::Ready { generation: g }).unwrap();
        expect_start(&a, g);
        expect_start(&b, g);
        a.tell(&ToStore::Failed { generation: g, rank: 0, exit: "exit status: 1".into(), signalled: false })
            .unwrap();
        let w = b.next(Some(Duration::from_secs(10)), "verdict").unwrap();
        if g == 0 {
            assert!(matches!(w, FromStore::Restart { generation: 1, node: 0, rank: 0, .. }), "{w:?}");
            let _ = a.next(Some(Duration::from_secs(10)), "restart").unwrap();
        } else {
            let FromStore::Abort { why } = w else { panic!("{w:?}") };
            assert!(
                why.contains("rank 0 on node 0 failed first (exit status: 1)")
                    && why.contains("after 1 restart(s) of 1"),
                "{why}"
            );
        }
    }
    assert!(h.join().unwrap().is_err());

    // Refused: another --nproc-per-node; the wrong token. Then both right, and a clean end.
    let (addr, h, cfg) = store(2, 1);
    let e = Member::join(&addr, 1, &StoreConfig { nproc: 2, ..cfg.clone() }).err().unwrap();
    assert!(format!("{e:#}").contains("--nproc-per-node 2"), "{e:#}");
    let e = Member::join(&addr, 1, &StoreConfig { token: Some("u".into()), ..cfg.clone() }).err().unwrap();
    assert!(format!("{e:#}").contains("token"), "{e:#}");
    let (a, b) = (Member::join(&addr, 0, &cfg).unwrap(), Member::join(&addr, 1, &cfg).unwrap());
    a.tell(&ToStore::Ready { generation: 0 }).unwrap();
    b.tell(&ToStore::Ready { generation: 0 }).unwrap();
    expect_start(&a, 0);
    a.tell(&ToStore::Done { generation: 0 }).unwrap();
    b.tell(&ToStore::Done { generation: 0 }).unwrap();
    for m in [&a, &b] {
        // Start already read for a; b's Start comes first.
        let mut w = m.next(Some(Duration::from_secs(10)), "finish").unwrap();
        if matches!(w, FromStore::Start { .. }) {
            w = m.next(Some(Duration::from_secs(10)), "finish").unwrap();
        }
        assert_eq!(w, FromStore::Finished);
    }
    assert_eq!(h.join().unwrap(), Ok(()));
}
