//! The emulated cluster with real processes: PS-BSP and DDP-TCP across three hosts, and one
//! host's link cut mid-training (PS strict, PS elastic, DDP). Every test skips with a visible
//! message when it cannot make network namespaces (not root, no iproute2); every namespace is
//! deleted when its cluster drops, also when an assertion fails.
#![allow(clippy::unwrap_used)] // a test fails loudly on anything unexpected

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use gradsync_compare::cluster;
use gradsync_compare::modes::{self, Bins, Ctx, Placement, ProcSpec};
use gradsync_compare::net::{Cluster, ClusterError, Queue, Shape};
use gradsync_compare::scenario::{ModeKind, RunSpec, Scenario};
use gradsync_compare::site::Slot;
use gradsync_testkit::Scratch;

/// A cluster, or `None` (after saying why) where this machine cannot make one.
fn cluster_or_skip(test: &str, n: usize, shape: Shape) -> Option<Cluster> {
    match Cluster::create(n, shape) {
        Ok(c) => Some(c),
        Err(ClusterError::Unavailable(why)) => {
            eprintln!("SKIPPED {test}: no emulated cluster here: {why}");
            None
        }
        Err(e) => panic!("{test}: making the cluster failed: {e}"),
    }
}

fn tmp(name: &str) -> Scratch {
    Scratch::new(&format!("cluster-{name}"))
}

mod common;

fn scenario(steps: u64) -> Scenario {
    common::small_scenario(steps)
}

fn namespaces() -> String {
    String::from_utf8_lossy(&Command::new("ip").args(["netns", "list"]).output().unwrap().stdout).into_owned()
}

#[test]
fn three_hosts_run_ps_bsp_and_ddp_tcp_and_clean_up() {
    let shape = Shape::at_rate(1e9);
    // Probe first so the skip is visible; the runner makes its own clusters.
    let Some(probe) = cluster_or_skip("three_hosts", 3, shape) else { return };
    let names: Vec<String> = probe.hosts().iter().map(|h| h.netns.clone()).collect();
    assert!(names.iter().all(|n| namespaces().contains(n.as_str())));
    drop(probe);
    let left = namespaces();
    assert!(names.iter().all(|n| !left.contains(n.as_str())), "namespaces left behind: {left}");

    let out = tmp("three");
    let mut s = scenario(6);
    s.modes = vec![ModeKind::PsBsp, ModeKind::DdpTcp];
    s.workers = vec![2];
    s.shards = gradsync_compare::scenario::Shards::counts(&[1]);
    let bins = Bins::find(Some(&gradsync_testkit::process::bin_dir())).unwrap();
    let runs = cluster::run_cluster(&s, &bins, &out, &[1.0], |_| shape, None).unwrap();
    assert_eq!(runs.len(), 2);
    assert!(runs.iter().all(|r| r.hosts == 3 && r.rate_gbit == 1.0));
    // The link as measured on each run's cluster: TCP over a 1 Gbit/s link carries a little less,
    // or, with the shaper's burst let through at the start of a short measurement, a hair more
    // (1.0004 Gbit/s has been measured under load).
    for r in &runs {
        let g = r.measured_gbit.unwrap_or_else(|| panic!("{}: the link was not measured", r.id));
        assert!((0.7..1.02).contains(&g), "{}: {g} Gbit/s measured over a 1 Gbit/s link", r.id);
        // No delay was added: the latency is the namespaces' and veth's own, tens of us.
        let us = r.measured_latency_us.unwrap_or_else(|| panic!("{}: the latency was not measured", r.id));
        assert!(us > 0.0 && us < 5_000.0, "{}: {us} us one way between two hosts", r.id);
    }
    let outcomes = std::fs::read_to_string(out.join("outcomes.jsonl")).unwrap();
    for line in outcomes.lines() {
        assert!(line.contains("\"status\":\"ok\""), "a run failed: {line}");
    }
    // Every worker trained every step; the report carries the cluster section.
    for r in &runs {
        for rank in 0..2 {
            let m = std::fs::read_to_string(out.join(&r.id).join(format!("rank{rank}.jsonl"))).unwrap();
            assert_eq!(m.matches("\"kind\":\"step\"").count(), 6, "{} rank {rank}", r.id);
        }
    }
    let html = gradsync_compare::plot(&[out.to_path_buf()], &out).unwrap();
    let html = std::fs::read_to_string(html).unwrap();
    assert!(html.contains("Emulated cluster") && html.contains("ddp-tcp"), "no cluster section");
    assert!(html.contains("measured)"), "the report does not show the measured link");
    // The cost model is fitted to the measured link even with no delay added.
    assert!(html.contains("us one way, measured)"), "the report does not show the measured latency");
    assert!(!html.contains("no link figures"), "the cost model had no link to fit");
}

/// Every emulated host's TCP clocks: Reno (whose window grows by round trips, which dilation
/// stretches; CUBIC's grows by real time), slow start after idle off, and a dilated link's
/// minimum retransmission timeout stretched on the host's route.
#[test]
fn every_host_runs_reno_without_slow_start_after_idle_and_a_dilated_rto() {
    let shape = Shape::at_rate(1e9);
    let Some(c) = cluster_or_skip("every_host_runs_reno", 2, shape.dilated(4.0)) else { return };
    for h in c.hosts() {
        let sysctl = |key: &str| {
            let o =
                Command::new("ip").args(["netns", "exec", &h.netns, "sysctl", "-n", key]).output().unwrap();
            String::from_utf8_lossy(&o.stdout).trim().to_string()
        };
        assert_eq!(sysctl("net.ipv4.tcp_congestion_control"), gradsync_compare::net::CONGESTION_CONTROL);
        assert_eq!(sysctl("net.ipv4.tcp_slow_start_after_idle"), "0");
        let o = Command::new("ip").args(["-n", &h.netns, "route", "show"]).output().unwrap();
        let routes = String::from_utf8_lossy(&o.stdout);
        assert!(routes.contains("rto_min lock 800ms"), "{}: {routes}", h.netns);
    }
}

/// `modes` on 2 worker hosts at 1 Gbit/s, a shard per host, 3 steps and one run each, the
/// scenario changed by `more`; every one of the `ok` runs it should make checked complete.
/// None (SKIPPED said) where no cluster can be made here.
fn placed_runs(
    name: &str,
    modes: &[ModeKind],
    ok: usize,
    more: impl FnOnce(&mut Scenario),
) -> Option<(Scratch, Vec<gradsync_compare::emulated::ClusterRun>)> {
    let shape = Shape::at_rate(1e9);
    drop(cluster_or_skip(name, 1, shape)?);
    let out = tmp(name);
    let mut s = scenario(3);
    s.modes = modes.to_vec();
    (s.workers, s.hosts, s.ranks_per_host) = (Vec::new(), vec![2], vec![1]);
    s.shards = vec!["hosts".parse().unwrap()];
    s.repeats = 1;
    more(&mut s);
    let bins = Bins::find(Some(&gradsync_testkit::process::bin_dir())).unwrap();
    let runs = cluster::run_cluster(&s, &bins, &out, &[1.0], |_| shape, None).unwrap();
    let outcomes = std::fs::read_to_string(out.join("outcomes.jsonl")).unwrap();
    assert_eq!(outcomes.matches("\"status\":\"ok\"").count(), ok, "{outcomes}");
    Some((out, runs))
}

/// Two ranks to a host: ddp-hier's all-reduce goes through the two hosts (its ranks find them
/// by network namespace), the flat ring stays flat although ranks share hosts, the PS's four
/// workers share two hosts' links with a shard per host, and the report groups them apart
/// from one rank a host.
#[test]
fn ranks_sharing_hosts_go_through_them_only_in_ddp_hier() {
    let modes = [ModeKind::PsBsp, ModeKind::DdpTcp, "ddp-hier".parse().unwrap()];
    let Some((out, runs)) = placed_runs("ranks_sharing_hosts", &modes, 3, |s| s.ranks_per_host = vec![2])
    else {
        return;
    };
    assert_eq!(runs.len(), 3);
    for r in &runs {
        assert_eq!((r.workers, r.ranks_per_host), (4, 2), "{}", r.id);
        // Two worker hosts, and the PS's two shards (a shard per host) or the ring's spare.
        assert_eq!((r.shards, r.hosts), if r.mode == ModeKind::PsBsp { (2, 4) } else { (0, 3) }, "{}", r.id);
        assert!(r.label().contains("2 ranks a host"), "{}", r.label());
        if r.mode.is_ps() {
            continue;
        }
        for rank in 0..4 {
            let m = std::fs::read_to_string(out.join(&r.id).join(format!("rank{rank}.jsonl"))).unwrap();
            let header = m.lines().next().unwrap();
            let hier = r.mode.label() == "ddp-hier";
            let said = if hier { "\"all_reduce\":\"hierarchical\"" } else { "\"all_reduce\":\"ring\"" };
            assert!(header.contains(said), "{} rank {rank}: {header}", r.id);
            assert_eq!(header.contains("\"hosts\":2"), hier, "{} rank {rank}: {header}", r.id);
            assert_eq!(m.matches("\"kind\":\"step\"").count(), 3, "{} rank {rank}", r.id);
        }
    }
    // Read back under their own names, in a group of their own.
    let html = std::fs::read_to_string(gradsync_compare::plot(&[out.to_path_buf()], &out).unwrap()).unwrap();
    assert!(html.contains("ddp-hier") && html.contains("4 (2 a host)"), "the report lost the placement");
}

/// `servers = ['apart', 'colocated']`: each PS cell runs with its shards on hosts of their own
/// and again with shard `i` on worker host `i`. The colocated run's cluster has only the worker
/// hosts, its workers reach the shards at two of those hosts' addresses, the ring is run once,
/// and the report and the cells keep the two placements apart, each under its own name.
#[test]
fn colocated_shards_run_on_the_worker_hosts_as_a_design_of_their_own() {
    use gradsync_compare::scenario::Servers;
    let Some((out, runs)) = placed_runs("colocated_shards", &[ModeKind::PsBsp, ModeKind::DdpTcp], 3, |s| {
        s.servers = vec![Servers::Apart, Servers::Colocated];
    }) else {
        return;
    };
    let placed: Vec<(ModeKind, bool, usize)> = runs.iter().map(|r| (r.mode, r.colocated, r.hosts)).collect();
    // Apart: 2 shard hosts + 2 worker hosts; colocated: the 2 worker hosts; the ring its spare.
    assert_eq!(
        placed,
        [(ModeKind::PsBsp, false, 4), (ModeKind::PsBsp, true, 2), (ModeKind::DdpTcp, false, 3)]
    );
    // The servers each worker was given: two addresses, the same for both workers.
    let servers_of = |id: &str, rank: usize| -> Vec<String> {
        let m = std::fs::read_to_string(out.join(id).join(format!("rank{rank}.jsonl"))).unwrap();
        let header: serde_json::Value = serde_json::from_str(m.lines().next().unwrap()).unwrap();
        let list = header["extra"]["servers"].as_array().unwrap();
        list.iter().map(|a| a.as_str().unwrap().rsplit_once(':').unwrap().0.to_string()).collect()
    };
    let (apart, colocated) = (&runs[0].id, &runs[1].id);
    assert!(colocated.ends_with("-colocated-1g"), "{colocated}");
    for id in [apart, colocated] {
        let a = servers_of(id, 0);
        assert_eq!(
            (a.len(), a.iter().collect::<std::collections::BTreeSet<_>>().len()),
            (2, 2),
            "{id}: {a:?}"
        );
        assert_eq!(a, servers_of(id, 1), "{id}");
    }
    // Read back as three cells, the colocated PS under its own name.
    let c = gradsync_compare::results::collect(&[out.to_path_buf()], None).unwrap();
    assert_eq!(c.cells.len(), 3);
    let names: Vec<String> = c.summaries.iter().map(|s| s.design()).collect();
    assert!(
        names.contains(&"ps-bsp k=2 colocated".to_string()) && names.contains(&"ps-bsp k=2".to_string()),
        "{names:?}"
    );
    let html = std::fs::read_to_string(gradsync_compare::plot(&[out.to_path_buf()], &out).unwrap()).unwrap();
    assert!(
        html.contains("ps-bsp k=2 colocated") && html.contains("(servers colocated)"),
        "the report lost the placement"
    );
}
/// A dilated cluster: every process runs with `--dilate`, its metrics say the factor, each
/// link is shaped at rate / D, and the rate's self-check reruns its busiest run at twice its
/// factor under `checks/`, which the comparison's own cells never read; `dilation.json` says
/// what it found. A design given a factor of its own (`dilate_for`) runs at it and stays in
/// the same group of the report as the others on its link.
#[test]
fn a_dilated_cluster_dilates_every_process_and_checks_itself_at_twice_the_factor() {
    let shape = Shape::at_rate(1e9);
    let Some(c) = cluster_or_skip("a_dilated_cluster", 1, shape) else { return };
    drop(c);
    let out = tmp("dilated");
    let mut s = scenario(4);
    s.modes = vec![ModeKind::PsBsp, ModeKind::DdpTcp];
    s.workers = vec![2];
    s.shards = gradsync_compare::scenario::Shards::counts(&[1]);
    s.repeats = 1;
    s.dilate_for = [("ddp-tcp".to_string(), 2.0)].into();
    let bins = Bins::find(Some(&gradsync_testkit::process::bin_dir())).unwrap();
    let dilate = Some(gradsync_compare::scenario::Dilate::Factor(4.0));
    let runs = cluster::run_cluster(&s, &bins, &out, &[1.0], |_| shape, dilate).unwrap();
    assert_eq!(runs.len(), 2);
    let own = |r: &gradsync_compare::emulated::ClusterRun| if r.mode == ModeKind::DdpTcp { 2.0 } else { 4.0 };
    for r in &runs {
        assert_eq!(r.dilation, own(r), "{}", r.id);
        assert!(r.id.ends_with(&format!("-1g-x{}", own(r))), "{}", r.id);
        // The link measured at 1 / D Gbit/s, reported in the emulated world's units.
        let g = r.measured_gbit.unwrap();
        assert!((0.7..1.1).contains(&g), "{}: {g} Gbit/s (emulated) over a dilated 1 Gbit/s link", r.id);
        for f in ["rank0.jsonl", "rank1.jsonl"] {
            let m = std::fs::read_to_string(out.join(&r.id).join(f)).unwrap();
            let said = format!("\"dilation\":{:.1}", own(r));
            assert!(m.lines().next().unwrap().contains(&said), "{}: {m}", r.id);
        }
    }
    let ps = runs.iter().find(|r| r.mode == ModeKind::PsBsp).unwrap();
    let server = std::fs::read_to_string(out.join(&ps.id).join("server0.jsonl")).unwrap();
    assert!(server.lines().next().unwrap().contains("\"dilation\":4.0"), "{server}");
    let d = gradsync_compare::emulated::load_dilation(&out);
    assert_eq!(d.len(), 1);
    assert_eq!((d[0].rate_gbit, d[0].dilation), (1.0, 4.0));
    assert_eq!(d[0].designs, s.dilate_for);
    let check = d[0].check.as_ref().expect("the rate was checked");
    let checked = runs.iter().find(|r| check.id == r.id).expect("the check names a run");
    let at = 2.0 * own(checked);
    assert_eq!(check.at, Some(at));
    assert!(
        check.again.starts_with("checks/runs/check-") && check.again.ends_with(&format!("-1g-x{at}")),
        "{check:?}"
    );
    assert!(check.step_ms.is_some() && check.step_ms_2x.is_some(), "{check:?}");
    assert!(out.join(&check.again).join("rank0.jsonl").exists());
    // The check is not one of the comparison's runs; the two factors are one link's group.
    let c = gradsync_compare::results::collect(&[out.to_path_buf()], None).unwrap();
    assert_eq!(c.summaries.len(), 2, "{:?}", c.summaries.iter().map(|s| &s.id).collect::<Vec<_>>());
    assert!(c.summaries.iter().all(|s| s.cpu_s.is_some()));
    for r in &runs {
        let sum = c.summaries.iter().find(|s| s.id == r.id).unwrap();
        assert_eq!(sum.dilation, Some(own(r)), "{}", r.id);
    }
    assert_eq!(c.summaries[0].link, c.summaries[1].link, "one link, one group");
    let html = gradsync_compare::plot(&[out.to_path_buf()], &out).unwrap();
    let html = std::fs::read_to_string(html).unwrap();
    assert!(
        html.contains("dilated x4")
            && html.contains("ddp-tcp x2 at factors of their own")
            && html.contains("Self-check"),
        "the report does not say the dilation"
    );
}

/// `dilate = auto`: each mode's largest cell is probed at x4 under `checks/`, the busiest
/// probe decides, and the factor chosen is the one that brings the cores to 45% busy (at least
/// 1); `dilation.json` records it and the runs ran at it.
#[test]
fn an_auto_dilated_cluster_probes_first_and_records_what_it_chose() {
    let shape = Shape::at_rate(1e9);
    let Some(c) = cluster_or_skip("an_auto_dilated_cluster", 1, shape) else { return };
    drop(c);
    let out = tmp("auto");
    let mut s = scenario(4);
    s.modes = vec![ModeKind::PsBsp, ModeKind::DdpTcp];
    s.workers = vec![2];
    s.shards = gradsync_compare::scenario::Shards::counts(&[1]);
    s.repeats = 1;
    let bins = Bins::find(Some(&gradsync_testkit::process::bin_dir())).unwrap();
    let auto = Some(gradsync_compare::scenario::Dilate::Auto);
    let runs = cluster::run_cluster(&s, &bins, &out, &[1.0], |_| shape, auto).unwrap();
    let d = gradsync_compare::emulated::load_dilation(&out);
    let p = d[0].probe.as_ref().expect("auto records its probe");
    assert!(p.busiest.starts_with("runs/probe-") && out.join("checks").join(&p.busiest).is_dir(), "{p:?}");
    // From x4, four times slower while a probe saturates the cores (other tests may share them).
    let cap = cluster::AUTO_CAP;
    assert!(p.at >= 4.0 && p.at <= cap && p.busy > 0.0 && (p.busy < 0.9 || p.at == cap), "{p:?}");
    assert_eq!(p.chose, (p.at * p.busy / 0.45).ceil().clamp(1.0, cap), "{p:?}");
    assert_eq!(d[0].dilation, p.chose);
    assert!(runs.iter().all(|r| r.dilation == p.chose), "{runs:?}");
    // The probes are not the comparison's runs.
    let c = gradsync_compare::results::collect(&[out.to_path_buf()], None).unwrap();
    assert_eq!(c.summaries.len(), 2);
}

/// A process started inside a host; killed when dropped.
struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn start(p: &ProcSpec, extra: &[&str], logs: &Path, stdout: Stdio) -> Proc {
        let log = logs.join(format!("{}.log", p.name));
        let mut c = p.site.launch(&p.program, &p.args, &p.env, logs, None).command;
        c.args(extra);
        // Warnings on: the server says which rank it dropped.
        let child = c
            .env("GRADSYNC_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Proc { name: p.name.clone(), child, log }
    }

    /// The address from the server's `gradsync-server listening on ADDR` line.
    fn listening(&mut self) -> String {
        let out = self.child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        loop {
            let line = rx
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|e| panic!("{} never listened ({e}): {}", self.name, self.log()));
            if let Some(a) = line.strip_prefix("gradsync-server listening on ") {
                std::thread::spawn(move || while rx.recv().is_ok() {});
                return a.trim().to_string();
            }
        }
    }

    /// The exit status, waiting at most `limit`.
    fn wait(&mut self, limit: Duration) -> Option<ExitStatus> {
        let until = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            if Instant::now() > until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn steps_in(metrics: &Path) -> usize {
    std::fs::read_to_string(metrics).map_or(0, |t| t.matches("\"kind\":\"step\"").count())
}

/// Wait until `metrics` holds `n` step records (training is under way on every host).
fn wait_steps(metrics: &Path, n: usize, procs: &mut [Proc]) {
    let until = Instant::now() + Duration::from_secs(60);
    while steps_in(metrics) < n {
        for p in procs.iter_mut() {
            if let Some(st) = p.child.try_wait().unwrap() {
                panic!("{} exited ({st}) before the cut: {}", p.name, p.log());
            }
        }
        assert!(Instant::now() < until, "no progress in {}", metrics.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The command lines of `mode` with W workers on hosts 1..=W and the server on host 0.
fn plan(c: &Cluster, mode: ModeKind, workers: usize, steps: u64, dir: &Path) -> modes::Plan {
    let h = c.hosts();
    let ctx = Ctx {
        scenario: scenario(steps),
        spec: RunSpec {
            id: "cut".into(),
            mode,
            workers,
            model: CUT_MODEL.into(),
            global_batch: 16 * workers,
            batch: 16,
            shards: usize::from(mode.is_ps()),
            colocated: false,
            ranks_per_host: 1,
            slow_ms: 0,
            repeat: 0,
            skip: None,
            dilate: 1.0,
        },
        dir: dir.to_path_buf(),
        bins: Bins::find(Some(&gradsync_testkit::process::bin_dir())).unwrap(),
        placement: Placement::Hosts {
            servers: h[..1].iter().map(Slot::from).collect(),
            workers: h[1..].iter().map(Slot::from).collect(),
        },
        env: modes::fresh_tokens().unwrap(),
        tls: None,
    };
    modes::plan(&ctx).unwrap()
}

/// 1 Gbit/s links (rate only: delay needs netem, which some kernels lack).
const SLOW: Shape = Shape::at_rate(1e9);
/// A model big enough (0.8 MB of gradients) that a step takes milliseconds on [`SLOW`] links, so
/// the cut lands mid-training.
const CUT_MODEL: &str = "784-256-10";
/// The server's and the collectives' timeout for a silent peer, seconds.
const TIMEOUT_S: u64 = 3;

/// PS with one host's link cut: the cut worker fails within its RPC timeout naming the server;
/// the others either go on without it (`--elastic`) or fail naming its rank.
fn ps_link_cut(elastic: bool) {
    let test = if elastic { "ps_elastic_link_cut" } else { "ps_strict_link_cut" };
    let Some(c) = cluster_or_skip(test, 4, SLOW) else { return };
    let dir = tmp(test);
    let steps = 200;
    let plan = plan(&c, ModeKind::PsBsp, 3, steps, &dir);
    let timeout = TIMEOUT_S.to_string();
    let mut server_flags = vec!["--worker-timeout", &timeout];
    if elastic {
        server_flags.push("--elastic");
    }
    let mut server = Proc::start(&plan.servers[0], &server_flags, &dir, Stdio::piped());
    let addr = server.listening();
    assert!(addr.starts_with(&c.hosts()[0].addr), "server on {addr}, not on host 0");
    let specs = (plan.workers)(std::slice::from_ref(&addr));
    // A worker must wait on a request longer than the server waits on a silent peer, or it gives
    // up before the server's answer (go on without it, or fail naming it) arrives.
    let rpc_timeout = (3 * TIMEOUT_S).to_string();
    let mut workers: Vec<Proc> =
        specs.iter().map(|p| Proc::start(p, &["--rpc-timeout", &rpc_timeout], &dir, Stdio::null())).collect();
    wait_steps(&specs[0].metrics, 10, &mut workers);
    let cut_at = Instant::now();
    c.cut(3).unwrap(); // rank 2's host

    // The cut worker cannot reach the server: it fails within its RPC timeout (plus the
    // request that was in flight), naming the server.
    let st = workers[2].wait(Duration::from_secs(6 * TIMEOUT_S + 10)).expect("cut worker hung");
    assert!(!st.success(), "the cut worker exited 0");
    let log = workers[2].log();
    assert!(log.contains(&addr) || log.contains("server"), "cut worker's error names no server: {log}");
    for w in &mut workers[..2] {
        let st = w.wait(Duration::from_secs(60)).unwrap_or_else(|| panic!("{} hung: {}", w.name, w.log()));
        if elastic {
            assert!(st.success(), "{} failed: {}", w.name, w.log());
        } else {
            assert!(!st.success(), "{} finished without rank 2", w.name);
            let log = w.log();
            assert!(log.contains('2') && log.contains("rank"), "{}'s error names no rank: {log}", w.name);
            assert!(
                cut_at.elapsed() < Duration::from_secs(6 * TIMEOUT_S + 20),
                "{} failed only after {:?}",
                w.name,
                cut_at.elapsed()
            );
        }
    }
    if elastic {
        // The remaining workers trained to the end.
        for p in &specs[..2] {
            assert_eq!(steps_in(&p.metrics), steps as usize, "{}", p.name);
        }
        assert!(steps_in(&specs[2].metrics) < steps as usize);
        let log = server.log();
        assert!(log.contains("dropping workers") && log.contains('2'), "server log: {log}");
    }
}

#[test]
fn ps_elastic_finishes_with_the_remaining_workers_when_a_link_is_cut() {
    ps_link_cut(true);
}

#[test]
fn ps_strict_fails_naming_the_rank_when_a_link_is_cut() {
    ps_link_cut(false);
}

#[test]
fn ddp_fails_naming_a_rank_when_a_link_is_cut() {
    let test = "ddp_link_cut";
    let Some(c) = cluster_or_skip(test, 4, SLOW) else { return };
    let dir = tmp(test);
    let plan = plan(&c, ModeKind::DdpTcp, 3, 300, &dir);
    let specs = (plan.workers)(&[]);
    let timeout = TIMEOUT_S.to_string();
    let mut workers: Vec<Proc> =
        specs.iter().map(|p| Proc::start(p, &["--comm-timeout", &timeout], &dir, Stdio::null())).collect();
    wait_steps(&specs[0].metrics, 10, &mut workers);
    let cut_at = Instant::now();
    c.cut(2).unwrap(); // rank 1's host
    for w in &mut workers {
        let st = w.wait(Duration::from_secs(4 * TIMEOUT_S + 20)).unwrap_or_else(|| panic!("{} hung", w.name));
        assert!(!st.success(), "{} finished with a cut ring", w.name);
        let log = w.log();
        assert!(log.contains("rank"), "{}'s error names no rank: {log}", w.name);
    }
    assert!(cut_at.elapsed() < Duration::from_secs(4 * TIMEOUT_S + 20));
}

/// `--loss` without netem: the BPF classifier drops the asked share of packets. Host to host a
/// packet leaves through two shaped ends (the sender's eth0, the hub's port to the receiver),
/// so 30% per end delivers 0.7 x 0.7 = 49%.
#[test]
fn loss_is_emulated_without_netem() {
    let shape = Shape {
        rate_bit: Some(1e9),
        delay: Duration::ZERO,
        loss_pct: 30.0,
        rto_min: None,
        queue: Queue::Fair,
    };
    let Some(c) = cluster_or_skip("loss_is_emulated_without_netem", 2, shape) else { return };
    let on = |host: usize, f: Box<dyn FnOnce() -> std::net::UdpSocket + Send>| {
        c.spawn_on(host, f).unwrap().join().unwrap().unwrap()
    };
    let to = format!("{}:9999", c.hosts()[1].addr);
    let rx = on(1, Box::new(move || std::net::UdpSocket::bind(to).unwrap()));
    let tx = on(0, Box::new(|| std::net::UdpSocket::bind("0.0.0.0:0").unwrap()));
    let sent = 4000;
    let dest = rx.local_addr().unwrap();
    let mut buf = [0u8; 128];
    // ARP is subject to the loss too: resolve the neighbour first (marked datagrams, not
    // counted), so that none of the counted ones wait in the neighbour queue.
    rx.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let resolved = (0..100).any(|_| {
        tx.send_to(&[1u8; 64], dest).unwrap();
        rx.recv(&mut buf).is_ok()
    });
    assert!(resolved, "no datagram crossed the lossy link in 100 tries");
    // Read while sending: a socket buffer holds only a few hundred datagrams.
    rx.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    let counter = std::thread::spawn(move || {
        let mut got = 0;
        let mut buf = [0u8; 128];
        while let Ok(n) = rx.recv(&mut buf) {
            got += usize::from(n == 64 && buf[0] == 0);
        }
        got
    });
    for i in 0..sent {
        tx.send_to(&[0u8; 64], dest).unwrap();
        if i % 50 == 0 {
            // Paced well below the link rate, so no queue overflows: every loss is the filter's.
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let got = counter.join().unwrap();
    let share = got as f64 / sent as f64;
    eprintln!("loss_is_emulated_without_netem: delivered {got} of {sent} ({share:.3}; expected 0.49)");
    assert!((share - 0.49).abs() < 0.05, "delivered {got} of {sent} ({share:.3}), expected about 0.49");
}

/// What one of two sending hosts got of one host's link, as a share of what both got over a
/// second (the other sends over four connections to its one), and what the receiver's
/// connection queues carried from the host of four.
fn one_connections_share(queue: Queue) -> Option<(f64, Vec<u64>)> {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    let shape = Shape { rate_bit: Some(200e6), delay: Duration::ZERO, loss_pct: 0.0, rto_min: None, queue };
    let c = cluster_or_skip("a_fair_queue_shares", 3, shape)?;
    let addr = format!("{}:5201", c.hosts()[2].addr);
    let got: Arc<[AtomicU64; 2]> = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let (ready_tx, ready_rx) = mpsc::channel();
    let counts = got.clone();
    let receiver = c
        .spawn_on(2, move || {
            let l = TcpListener::bind("0.0.0.0:5201").unwrap();
            ready_tx.send(()).unwrap();
            let mut readers = Vec::new();
            for _ in 0..5 {
                let (mut s, _) = l.accept().unwrap();
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                let mut who = [0u8; 1];
                s.read_exact(&mut who).unwrap();
                let counts = counts.clone();
                readers.push(std::thread::spawn(move || {
                    let mut buf = vec![0u8; 1 << 16];
                    while let Ok(n) = s.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        counts[who[0] as usize].fetch_add(n as u64, Ordering::Relaxed);
                    }
                }));
            }
            readers.into_iter().for_each(|r| r.join().unwrap());
        })
        .unwrap();
    ready_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let send = |host: usize, who: u8, connections: usize| {
        let addr = addr.clone();
        c.spawn_on(host, move || {
            let until = Instant::now() + Duration::from_secs_f64(1.8);
            let streams: Vec<_> = (0..connections)
                .map(|k| {
                    let addr = addr.clone();
                    std::thread::spawn(move || {
                        // Source ports 32 apart: the ports' hash puts every one in one queue,
                        // so only the tracker gives each a queue of its own.
                        let s =
                            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
                        s.set_reuse_address(true).unwrap();
                        let from = std::net::SocketAddr::from(([0, 0, 0, 0], 40_000 + 32 * k as u16));
                        s.bind(&from.into()).unwrap();
                        let to: std::net::SocketAddr = addr.parse().unwrap();
                        s.connect_timeout(&to.into(), Duration::from_secs(10)).unwrap();
                        let mut s: TcpStream = s.into();
                        s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
                        s.write_all(&[who]).unwrap();
                        let buf = vec![7u8; 1 << 16];
                        while Instant::now() < until {
                            s.write_all(&buf).unwrap();
                        }
                    })
                })
                .collect();
            streams.into_iter().for_each(|s| s.join().unwrap());
        })
        .unwrap()
    };
    let (many, one) = (send(0, 0, 4), send(1, 1, 1));
    // Left out: the first 0.4 s (the connections, their slow start).
    std::thread::sleep(Duration::from_millis(400));
    let at = |i: usize| got[i].load(Ordering::Relaxed) as f64;
    let (a0, b0, q0) = (at(0), at(1), c.connection_bytes(2, 0).unwrap());
    std::thread::sleep(Duration::from_secs(1));
    let (a, b, q1) = (at(0) - a0, at(1) - b0, c.connection_bytes(2, 0).unwrap());
    many.join().unwrap().unwrap();
    one.join().unwrap().unwrap();
    receiver.join().unwrap().unwrap();
    Some((b / (a + b), q1.iter().zip(q0.iter().chain(std::iter::repeat(&0))).map(|(x, y)| x - y).collect()))
}

/// Every host gets a TCP connection table of its own, not the machine's (hundreds of
/// thousands of buckets, which each read of a host's connections would walk: its
/// connection tracker reads them twenty times a second), where the kernel allows it (Linux
/// 6.1 and later); and the hosts so made work as any: they reach each other, and are deleted.
#[test]
fn hosts_get_tcp_tables_of_their_own_and_reach_each_other() {
    let Some(c) = cluster_or_skip("hosts_get_tcp_tables", 2, Shape::at_rate(1e9)) else { return };
    let buckets = |i: usize| {
        let o = c.command(i, "sysctl").unwrap().args(["-n", "net.ipv4.tcp_ehash_entries"]).output().unwrap();
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    let child = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_child_ehash_entries");
    if child.is_err() {
        eprintln!("SKIPPED hosts_get_tcp_tables: this kernel has no tcp_child_ehash_entries (before 6.1)");
        return;
    }
    for i in 0..2 {
        assert_eq!(buckets(i), "1024", "host {i}'s TCP table");
    }
    let to = format!("{}:5202", c.hosts()[1].addr);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let server = c
        .spawn_on(1, move || {
            let l = std::net::TcpListener::bind("0.0.0.0:5202").unwrap();
            ready_tx.send(()).unwrap();
            let (mut s, _) = l.accept().unwrap();
            let mut b = [0u8; 5];
            std::io::Read::read_exact(&mut s, &mut b).unwrap();
            b
        })
        .unwrap();
    ready_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let client = c
        .spawn_on(0, move || {
            let mut s =
                std::net::TcpStream::connect_timeout(&to.parse().unwrap(), Duration::from_secs(10)).unwrap();
            std::io::Write::write_all(&mut s, b"hello").unwrap();
        })
        .unwrap();
    client.join().unwrap().unwrap();
    assert_eq!(&server.join().unwrap().unwrap(), b"hello");
    let names: Vec<String> = c.hosts().iter().map(|h| h.netns.clone()).collect();
    drop(c);
    let left = std::fs::read_dir("/var/run/netns")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| names.iter().any(|n| e.file_name().to_string_lossy() == *n));
    assert_eq!(left.count(), 0, "the hosts are deleted with the cluster");
}

/// A fair NIC queue gives each peer host sending into a busy link its share, however many
/// connections the others open: a host of one connection beside a host of four gets half (a
/// FIFO gives each connection its share: a fifth; printed beside); and it splits a host's
/// share among its connections, each in a queue of its own served in turn: the four carry a
/// quarter each, though their source ports are chosen so that the ports' hash alone would
/// put all four in one queue.
#[test]
fn a_fair_queue_shares_a_busy_link_among_hosts_then_among_their_connections() {
    let Some((fair, queues)) = one_connections_share(Queue::Fair) else { return };
    let (fifo, none) = one_connections_share(Queue::Fifo).unwrap();
    eprintln!(
        "the one connection's share: {:.0}% with fair queues, {:.0}% with one FIFO; the four's queues: {queues:?}",
        fair * 100.0,
        fifo * 100.0
    );
    assert!((0.4..0.6).contains(&fair), "fair queues gave the host of one connection {:.0}%", fair * 100.0);
    assert!(none.is_empty(), "one FIFO has no connection queues: {none:?}");
    // Over the measured second: four queues busy, the rest (the first carries the ACKs of no
    // data) all but idle.
    let mut busy: Vec<u64> = queues.iter().copied().filter(|&b| b > 100_000).collect();
    busy.sort_unstable();
    assert_eq!(busy.len(), 4, "four connections, four busy queues: {queues:?}");
    // Served in turn they carry the same, give or take a connection that waited out a
    // retransmission timeout (one in a dozen runs here): none is starved.
    let (least, most) = (busy[0] as f64, busy[3] as f64);
    assert!(least / most > 0.3, "the four connections' queues carried {busy:?}: not served in turn");
}

/// `validate` over a real cluster's runs: ResNet-50 replayed by two workers, the flat ring and
/// a parameter server, each run measured beside the advisor's step and the alpha-beta model's,
/// and the group's pick judged (or said why not).
#[test]
fn validate_sets_each_replayed_run_beside_the_advisor_and_the_alpha_beta_model() {
    let shape = Shape::at_rate(10e9);
    let Some(c) = cluster_or_skip("validate_sets", 1, shape) else { return };
    drop(c);
    let root = tmp("validate");
    let out = root.join("resnet50-2x1-10g");
    let mut s = scenario(2);
    s.models = vec!["resnet50".into()];
    s.batches = vec![];
    s.modes = vec![ModeKind::DdpTcp, ModeKind::PsBsp];
    s.workers = vec![2];
    s.shards = gradsync_compare::scenario::Shards::counts(&[1]);
    let bins = Bins::find(Some(&gradsync_testkit::process::bin_dir())).unwrap();
    let runs = cluster::run_cluster(&s, &bins, &out, &[10.0], |_| shape, None).unwrap();
    assert_eq!(runs.len(), 2);
    // The parent directory stands for its groups.
    let v = gradsync_compare::advise::validate::validate(&[root.to_path_buf()]).unwrap();
    assert_eq!(v.rows.len(), 2, "{:?}", v.rows);
    for r in &v.rows {
        assert_eq!(r.group, "resnet50-2x1-10g");
        let m = r.measured_ms.unwrap_or_else(|| panic!("{}: not measured", r.design));
        for (what, p) in [
            ("advisor", r.advisor_ms),
            ("from the profile", r.advisor_profile_ms),
            ("alpha-beta", r.alpha_beta_ms),
        ] {
            let p = p.unwrap_or_else(|| panic!("{}: no {what} prediction", r.design));
            assert!(
                p > 0.0 && p / m > 0.2 && p / m < 5.0,
                "{}: {what} {p} ms against {m} ms measured",
                r.design
            );
        }
    }
    assert!(v.rows.iter().any(|r| r.design == "ps-bsp k=1") && v.rows.iter().any(|r| r.design == "ddp-tcp"));
    assert_eq!(v.picks.len() + v.unjudged.len(), 1, "one group: {:?} {:?}", v.picks, v.unjudged);
    assert!(!v.cpu.is_empty(), "the CPU is not named");
    let md = gradsync_compare::advise::validate::markdown(&v);
    assert!(md.contains("| resnet50-2x1-10g | ps-bsp k=1 |") && md.contains("CPU: "), "{md}");
}
