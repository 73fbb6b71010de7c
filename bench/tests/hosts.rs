//! `compare --hosts` for real: emulated hosts (network namespaces) each running OpenSSH's
//! sshd with keys made here, and `gradsync-bench compare --hosts` started on another of them
//! (the head), as a user would from a login node. Also what keeps strangers out: each run's
//! tokens travel in the environment, never on a command line, and a process without them is
//! refused. The ssh tests need root, iproute2 and OpenSSH (installed with apt-get when missing
//! and possible); where they cannot run they print SKIPPED with the reason and pass.
#![allow(clippy::unwrap_used)] // a test fails loudly on anything unexpected

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gradsync_compare::local::Local;
use gradsync_compare::modes::{self, Bins, Ctx, Placement};
use gradsync_compare::net::{Cluster, ClusterError, Shape};
use gradsync_compare::scenario::{ModeKind, Scenario};
use gradsync_compare::site::Slot;
use gradsync_testkit::Scratch;
use gradsync_testkit::process::Proc;

const SSHD: &str = "/usr/sbin/sshd";

// The comparison's test helpers, shared with the tests of its library in compare/tests.
#[path = "../../compare/tests/common/mod.rs"]
mod common;

/// PS-BSP (one shard) and DDP-TCP with two workers.
fn scenario(steps: u64) -> Scenario {
    let mut s = common::small_scenario(steps);
    s.workers = vec![2];
    s.shards = gradsync_compare::scenario::Shards::counts(&[1]);
    s.modes = vec![ModeKind::PsBsp, ModeKind::DdpTcp];
    s.rawtcp_s = 0.5;
    s.run_timeout_s = 60.0;
    s
}

/// The run's processes of `ctx`, started here with `env` or without it.
fn spawn(p: &modes::ProcSpec, env: bool, stdout: Stdio) -> Proc {
    let env = if env { p.env.clone() } else { vec![] };
    let mut l = p.site.launch(&p.program, &p.args, &env, Path::new("."), None);
    for v in [modes::TOKEN_ENV, modes::RING_TOKEN_ENV, "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
        if !env.iter().any(|(k, _)| k == v) {
            l.command.env_remove(v);
        }
    }
    l.command.stdout(stdout);
    Proc::spawn(&mut l.command)
}

fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// A run placed on hosts gets fresh tokens in its processes' environment (never on their
/// command lines), and a process without them is refused by the server and by the ring.
#[test]
fn a_process_without_the_runs_tokens_is_refused() {
    let dir = Scratch::new("hosts-tokens");
    let bins = Bins::find(Some(&gradsync_testkit::process::bin_dir())).unwrap();
    let local = || Slot { addr: "127.0.0.1".into(), site: Arc::new(Local) };
    let ctx = |mode: ModeKind| {
        let mut s = scenario(4);
        s.modes = vec![mode];
        let spec = s.expand().remove(0);
        let placement = Placement::Hosts { servers: vec![local()], workers: vec![local(), local()] };
        assert!(placement.needs_tokens());
        Ctx {
            scenario: s,
            spec,
            dir: dir.to_path_buf(),
            bins: bins.clone(),
            placement,
            env: modes::fresh_tokens().unwrap(),
            tls: None,
        }
    };
    // Two runs never share a token.
    assert_ne!(ctx(ModeKind::PsBsp).env, ctx(ModeKind::PsBsp).env);

    let c = ctx(ModeKind::PsBsp);
    let token = c.env[0].1.clone();
    assert_eq!(token.len(), 64);
    let plan = modes::plan(&c).unwrap();
    let mut server = spawn(&plan.servers[0], true, Stdio::piped());
    let out = server.child().stdout.take().unwrap();
    let addr =
        gradsync_compare::child::wait_for_line(out, "gradsync-server listening on ", Duration::from_secs(60))
            .unwrap();
    assert!(!cmdline(server.id()).contains(&token), "the token is on the server's command line");
    let workers = (plan.workers)(&[addr]);
    assert!(workers.iter().all(|w| {
        !w.args
            .iter()
            .any(|a| a.contains(&token) || a.starts_with("--token") || a.starts_with("--ring-token"))
    }));
    // A stranger: the same command line, no token.
    let (code, err, took) = spawn(&workers[1], false, Stdio::null()).finish(Duration::from_secs(60));
    assert_ne!(code, 0, "a worker without the token trained");
    assert!(err.to_lowercase().contains("token") || err.contains("nauthenticated"), "{err}");
    assert!(took < Duration::from_secs(30), "refused only after {took:?}");
    // The run's own processes train.
    let mut ranks: Vec<Proc> = workers.iter().map(|w| spawn(w, true, Stdio::null())).collect();
    for (r, p) in ranks.iter_mut().enumerate() {
        let (code, err, _) = p.finish(Duration::from_secs(60));
        assert_eq!(code, 0, "rank {r} with the token failed: {err}");
    }

    // The ring: rank 1 without the ring token is refused by rank 0 (and fails itself).
    let c = ctx(ModeKind::DdpTcp);
    let ring = (modes::plan(&c).unwrap().workers)(&[]);
    let mut rank0 = spawn(&ring[0], true, Stdio::null());
    let (code, err, _) = spawn(&ring[1], false, Stdio::null()).finish(Duration::from_secs(60));
    assert_ne!(code, 0, "a rank without the ring token joined");
    assert!(err.to_lowercase().contains("token"), "{err}");
    rank0.kill9();
}

/// Emulated hosts with sshd running on each but the head: host 0 starts the comparison.
struct SshHosts {
    cluster: Cluster,
    /// The sshd of host `i + 1`.
    sshd: Vec<Proc>,
    dir: Scratch,
}

impl SshHosts {
    /// `ssh -F` with the test's key and no host-key questions.
    fn config(&self) -> PathBuf {
        self.dir.join("ssh_config")
    }

    fn addr(&self, host: usize) -> String {
        self.cluster.hosts()[host].addr.clone()
    }

    /// `gradsync-bench compare ARGS` on the head (host 0), with the test's ssh config.
    fn compare<S: AsRef<std::ffi::OsStr>>(&self, args: &[S]) -> Proc {
        let mut c = self.cluster.command(0, env!("CARGO_BIN_EXE_gradsync-bench")).unwrap();
        c.arg("compare").args(args).env("GRADSYNC_SSH_OPTS", format!("-F {}", self.config().display()));
        c.stdout(Stdio::null());
        Proc::spawn(&mut c)
    }
}

/// Whether `program` runs.
fn have(program: &str) -> bool {
    Command::new(program).arg("-V").stdin(Stdio::null()).output().is_ok()
}

/// OpenSSH's client and server, installed from the distribution's packages when missing.
fn openssh() -> Result<(), String> {
    if Path::new(SSHD).exists() && have("ssh") && have("ssh-keygen") {
        return Ok(());
    }
    if !have("apt-get") {
        return Err("OpenSSH is not installed and there is no apt-get to install it".into());
    }
    let mut c = Command::new("apt-get");
    c.args(["install", "-y", "-q", "openssh-server", "openssh-client"])
        .env("DEBIAN_FRONTEND", "noninteractive");
    let (code, err, _) = Proc::spawn(&mut c).finish(Duration::from_secs(600));
    if code != 0 || !Path::new(SSHD).exists() {
        return Err(format!("installing openssh-server failed: {}", err.lines().last().unwrap_or("")));
    }
    Ok(())
}

fn run(cmd: &mut Command) {
    let o = cmd.stdin(Stdio::null()).output().unwrap();
    assert!(o.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&o.stderr));
}

/// `n` hosts with sshd (hosts 1..=n) and a head (host 0) on 1 Gbit/s links; for host `i` in
/// `hidden`, the binaries' directory is hidden from its sshd's sessions (an empty tmpfs over
/// it, in that sshd's own mount namespace): a host that lacks them. `None` (after saying why)
/// where this machine cannot.
fn ssh_hosts(test: &str, n: usize, hidden: &[usize]) -> Option<SshHosts> {
    if let Err(why) = gradsync_compare::net::available().map_err(|e| e.to_string()).and_then(|_| openssh()) {
        eprintln!("SKIPPED: {test}: {why}");
        return None;
    }
    let shape = Shape::at_rate(1e9);
    let cluster = match Cluster::create(n + 1, shape) {
        Ok(c) => c,
        Err(ClusterError::Unavailable(why)) => {
            eprintln!("SKIPPED: {test}: no emulated cluster here: {why}");
            return None;
        }
        Err(e) => panic!("{test}: making the cluster failed: {e}"),
    };
    let dir = Scratch::new(&format!("hosts-{test}"));
    for (key, file) in [("id", "id"), ("bad", "bad"), ("host", "host_ed25519")] {
        let _ = key;
        run(Command::new("ssh-keygen").args(["-q", "-t", "ed25519", "-N", "", "-f"]).arg(dir.join(file)));
    }
    std::fs::copy(dir.join("id.pub"), dir.join("authorized_keys")).unwrap();
    // sshd's privilege separation directory, as the package's service would make it.
    std::fs::create_dir_all("/run/sshd").unwrap();
    for (name, key) in [("ssh_config", "id"), ("ssh_config_bad", "bad")] {
        std::fs::write(
            dir.join(name),
            format!(
                "Host *\n  User root\n  IdentityFile {}\n  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  \
                 UserKnownHostsFile /dev/null\n  LogLevel ERROR\n",
                dir.join(key).display()
            ),
        )
        .unwrap();
    }
    let bin_dir = gradsync_testkit::process::bin_dir();
    let mut sshd = Vec::new();
    for i in 1..=n {
        let addr = cluster.hosts()[i].addr.clone();
        let cfg = dir.join(format!("sshd_config_{i}"));
        std::fs::write(
            &cfg,
            format!(
                "ListenAddress {addr}\nPort 22\nHostKey {}\nAuthorizedKeysFile {}\nPermitRootLogin prohibit-password\n\
                 PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPidFile none\n\
                 LogLevel ERROR\nClientAliveInterval 1\nClientAliveCountMax 3\n",
                dir.join("host_ed25519").display(),
                dir.join("authorized_keys").display()
            ),
        )
        .unwrap();
        let mut c = cluster.command(i, "sh").unwrap();
        // `ip netns exec` gives the command a mount namespace of its own: a mount made there
        // hides the binaries from this sshd's sessions alone.
        let hide = if hidden.contains(&i) {
            format!("mount -t tmpfs gradsync-test-empty '{}' && ", bin_dir.display())
        } else {
            String::new()
        };
        c.args(["-c", &format!("{hide}exec {SSHD} -D -e -f '{}'", cfg.display())]);
        sshd.push(Proc::spawn(&mut c));
    }
    let hosts = SshHosts { cluster, sshd, dir };
    // Ready once each answers with its banner, from the head.
    for i in 1..=n {
        let addr: std::net::SocketAddr = format!("{}:22", hosts.addr(i)).parse().unwrap();
        let t = hosts.cluster.spawn_on(0, move || {
            let until = Instant::now() + Duration::from_secs(30);
            loop {
                if let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
                    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                    let mut b = [0u8; 4];
                    if s.read_exact(&mut b).is_ok() && &b == b"SSH-" {
                        return true;
                    }
                }
                if Instant::now() > until {
                    return false;
                }
                // Between attempts while sshd starts: connecting is the readiness check.
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        assert!(t.unwrap().join().unwrap().unwrap(), "{test}: sshd on host {i} ({addr}) never answered");
    }
    Some(hosts)
}

/// The processes of this machine whose command line mentions `needle`.
fn running(needle: &str) -> Vec<(u32, String)> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let c = cmdline(pid);
        if c.contains(needle) && pid != std::process::id() {
            v.push((pid, c));
        }
    }
    v
}

/// `compare`'s arguments for `scen` on the hosts of `list`, writing `out` here and `remote` on
/// the hosts.
fn on_hosts(scen: &Path, out: &Path, list: &str, remote: &Path) -> Vec<String> {
    let bin = gradsync_testkit::process::bin_dir();
    [scen, Path::new("--out"), out, Path::new("--bin-dir"), &bin, Path::new("--hosts"), Path::new(list)]
        .iter()
        .chain(&[Path::new("--remote-dir"), remote])
        .map(|p| p.display().to_string())
        .collect()
}

/// Nothing of the runs writing under `remote` is running on any host.
fn nothing_left(remote: &Path) {
    let left = running(&remote.display().to_string());
    assert!(left.is_empty(), "left running: {left:?}");
}

/// Wait (at most 90 s) until a worker of a run writing under `remote` runs on its host.
fn a_worker_runs(remote: &Path) {
    let until = Instant::now() + Duration::from_secs(90);
    while !running(&remote.display().to_string())
        .iter()
        .any(|(_, c)| c.contains(" train ") && !c.contains("supervise"))
    {
        assert!(Instant::now() < until, "no worker writing under {} ever started", remote.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A DDP run of two ranks, each holding 4 x 8 GB of a 2-billion-parameter MLP: more than any
/// host here has.
fn huge_model_scenario() -> Scenario {
    let mut s = common::small_scenario(1);
    (s.models, s.modes, s.workers) = (vec!["64-20000-100000-10".into()], vec![ModeKind::DdpTcp], vec![2]);
    s.rawtcp_s = 0.2;
    s
}

fn write_scenario(dir: &Path, s: &Scenario) -> PathBuf {
    let p = dir.join("scenario.toml");
    std::fs::write(&p, toml::to_string(s).unwrap()).unwrap();
    p
}

/// Three hosts, PS-BSP (over TLS, with the user's certificate) and DDP-TCP, end to end.
#[test]
fn compare_over_ssh_runs_on_three_hosts_with_the_report() {
    let Some(h) = ssh_hosts("e2e", 3, &[]) else { return };
    let hostfile = h.dir.join("hosts");
    std::fs::write(
        &hostfile,
        format!(
            "# three emulated hosts\n\n{} slots=2\n{} slots=2   # the second\n{} slots=2\n",
            h.addr(1),
            h.addr(2),
            h.addr(3)
        ),
    )
    .unwrap();
    let s = scenario(6);
    let scen = write_scenario(&h.dir, &s);
    let out = h.dir.join("out");
    let remote = h.dir.join("remote");
    // The parameter server's TLS, with the user's certificate: the same paths on every host.
    let ck = rcgen::generate_simple_self_signed(vec!["gradsync-ps".into()]).unwrap();
    let (cert, key) = (h.dir.join("ps.crt"), h.dir.join("ps.key"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.key_pair.serialize_pem()).unwrap();
    let mut args = on_hosts(&scen, &out, hostfile.to_str().unwrap(), &remote);
    for (flag, v) in [("--tls-cert", &cert), ("--tls-key", &key), ("--tls-ca", &cert)] {
        args.extend([flag.to_string(), v.display().to_string()]);
    }
    args.extend(["--tls-domain".to_string(), "gradsync-ps".to_string()]);
    let t = Instant::now();
    let (code, err, _) = h.compare(&args).finish(Duration::from_secs(300));
    assert_eq!(code, 0, "compare --hosts failed:\n{err}");
    eprintln!("compare --hosts: 2 runs in {:.1} s\n{err}", t.elapsed().as_secs_f64());
    let outcomes = std::fs::read_to_string(out.join("outcomes.jsonl")).unwrap();
    assert_eq!(outcomes.lines().count(), 2, "{outcomes}");
    for line in outcomes.lines() {
        assert!(line.contains("\"status\":\"ok\""), "a run failed: {line}");
    }
    // Every process's metrics came back from its host.
    for spec in s.expand() {
        let d = out.join("runs").join(&spec.id);
        for rank in 0..2 {
            let m = std::fs::read_to_string(d.join(format!("rank{rank}.jsonl"))).unwrap();
            assert_eq!(m.matches("\"kind\":\"step\"").count(), 6, "{} rank {rank}", spec.id);
        }
        if spec.mode.is_ps() {
            assert!(d.join("server0.jsonl").is_file(), "{}: no server metrics", spec.id);
        }
    }
    // The hosts and the link between two of them, measured across their 1 Gbit/s links.
    let machine: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("machine.json")).unwrap()).unwrap();
    assert_eq!(machine["hosts"].as_array().unwrap().len(), 3, "{machine}");
    assert_eq!(machine["link"].as_str().unwrap(), format!("{} to {}", h.addr(1), h.addr(2)));
    let gbit = machine["tcp_bandwidth"].as_f64().unwrap() * 8.0 / 1e9;
    assert!((0.5..1.0).contains(&gbit), "{gbit} Gbit/s between hosts on 1 Gbit/s links");
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("host-to-host") && html.contains(&h.addr(3)), "the report lacks the hosts");
    assert!(!html.contains("no link figures"), "the cost model had no link to fit");
    // Nothing left on the hosts: no process, no files.
    nothing_left(&remote);
    assert!(!remote.exists(), "{} left on the hosts", remote.display());

    // --resume over the same hosts: nothing left to run, the report rebuilt.
    let hosts = hostfile.display().to_string();
    let (code, err, _) =
        h.compare(&["--resume", out.to_str().unwrap(), "--hosts", &hosts]).finish(Duration::from_secs(120));
    assert_eq!(code, 0, "compare --resume --hosts failed:\n{err}");
    assert!(err.contains("0 run(s) to go"), "{err}");
    // stop_at_target: rank 0's metrics, written on its host, come back as they grow over its
    // ssh session, and the run stops at the target far short of its budget.
    let mut s = scenario(2000);
    s.modes = vec![ModeKind::DdpTcp];
    (s.stop_at_target, s.target_accuracy, s.eval_samples) = (true, Some(0.6), Some(320));
    let scen = write_scenario(&h.dir, &s);
    let out = h.dir.join("out-target");
    let (code, err, _) = h.compare(&on_hosts(&scen, &out, &hosts, &remote)).finish(Duration::from_secs(180));
    assert_eq!(code, 0, "compare --hosts with stop_at_target failed:\n{err}");
    let outcomes = std::fs::read_to_string(out.join("outcomes.jsonl")).unwrap();
    assert!(outcomes.contains("\"status\":\"ok\""), "{outcomes}");
    // This machine's cores say nothing of how busy the hosts were: no share recorded.
    let o: serde_json::Value = serde_json::from_str(outcomes.lines().next().unwrap()).unwrap();
    assert!(o["cpu_busy"].is_null(), "{o}");
    let id = &s.expand()[0].id;
    let (steps, best) = common::stopped_at_target(&out.join("runs").join(id), 2000, 0.6);
    eprintln!("stop_at_target over ssh: stopped after {steps} of 2000 steps at {best:.3}");
    nothing_left(&remote);
    // A run whose ranks need more memory than their hosts had available is skipped, naming
    // the host and its memory as read over ssh.
    let too_big = huge_model_scenario();
    let scen = write_scenario(&h.dir, &too_big);
    let out = h.dir.join("out-memory");
    let (code, err, _) = h.compare(&on_hosts(&scen, &out, &hosts, &remote)).finish(Duration::from_secs(120));
    assert_eq!(code, 0, "{err}");
    let outcomes = std::fs::read_to_string(out.join("outcomes.jsonl")).unwrap();
    let o: serde_json::Value = serde_json::from_str(outcomes.lines().next().unwrap()).unwrap();
    assert_eq!(o["status"], "skipped", "{o}");
    let why = o["error"].as_str().unwrap();
    assert!(
        why.starts_with(&format!("1 worker(s) placed on host {} need about 29.8 GiB", h.addr(1)))
            && why.contains("GiB available"),
        "{why}"
    );
    drop(h.sshd);
}

#[test]
fn compare_over_ssh_names_the_host_that_fails() {
    let Some(h) = ssh_hosts("faults", 3, &[3]) else { return };
    let s = scenario(6);
    let scen = write_scenario(&h.dir, &s);
    let bin = gradsync_testkit::process::bin_dir();
    let fails = |hosts: &str, extra: &[&str], says: &[&str]| {
        let out = h.dir.join(format!("out-{}", hosts.len()));
        let mut args = vec![
            scen.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--bin-dir",
            bin.to_str().unwrap(),
            "--hosts",
            hosts,
        ];
        args.extend_from_slice(extra);
        let mut compare = h.compare(&args);
        let control = std::env::temp_dir().join(format!("gradsync-ssh-{}", compare.id()));
        let (code, err, took) = compare.finish(Duration::from_secs(120));
        assert_ne!(code, 0, "compare --hosts {hosts} succeeded:\n{err}");
        // The connections the check opened are closed.
        assert!(!control.exists(), "{} left behind", control.display());
        let left = running(&control.display().to_string());
        assert!(left.is_empty(), "left running: {left:?}");
        for s in says {
            assert!(err.contains(s), "compare --hosts {hosts}: expected {s:?} in:\n{err}");
        }
        assert!(took < Duration::from_secs(40), "compare --hosts {hosts} took {took:?} to fail");
    };
    // A host whose link is down: unreachable, named, within ssh's connection timeout.
    h.cluster.cut(2).unwrap();
    let list = format!("{}:2,{}:2", h.addr(1), h.addr(2));
    fails(
        &list,
        &["--ssh-opts", &format!("-F {} -o ConnectTimeout=3", h.config().display())],
        &[&format!("host {} unreachable", h.addr(2))],
    );
    h.cluster.restore(2).unwrap();
    // A key the hosts do not know: the login is refused, not asked for.
    let bad = format!("-F {}", h.dir.join("ssh_config_bad").display());
    fails(
        &format!("{}:2", h.addr(1)),
        &["--ssh-opts", &bad],
        &[&format!("host {}: ssh login refused", h.addr(1))],
    );
    // A host without the binaries: named, with the flag that would put them there.
    fails(
        &format!("{}:2,{}:2", h.addr(1), h.addr(3)),
        &[],
        &[&format!("host {} lacks {}", h.addr(3), bin.join("gradsync-worker").display()), "--copy-binaries"],
    );

    // A worker killed on its host mid-run: that run fails naming the host, the next runs.
    let mut s = scenario(300);
    s.modes = vec![ModeKind::PsBsp];
    s.repeats = 2;
    (s.slow_ms, s.slow_rank) = (vec![10], 1);
    let scen = write_scenario(&h.dir, &s);
    let out = h.dir.join("out-kill");
    let remote = h.dir.join("remote-kill");
    let list = format!("{}:2,{}:2", h.addr(1), h.addr(2));
    let mut compare = h.compare(&on_hosts(&scen, &out, &list, &remote));
    let first = s.expand().remove(0).id;
    let until = Instant::now() + Duration::from_secs(90);
    let victim = loop {
        let found: Vec<(u32, String)> = running(&remote.join("runs").join(&first).display().to_string())
            .into_iter()
            .filter(|(_, c)| c.contains(" train ") && c.contains("--rank 1 ") && !c.contains("supervise"))
            .collect();
        if let Some((pid, c)) = found.first() {
            // Tokens travel in the environment, never on a command line.
            assert!(!c.contains("--token") && !c.contains("--ring-token"), "{c}");
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            assert!(String::from_utf8_lossy(&env).contains("GRADSYNC_TOKEN="), "no token in the environment");
            break *pid;
        }
        assert!(Instant::now() < until, "rank 1 of {first} never started");
        std::thread::sleep(Duration::from_millis(10));
    };
    // SAFETY: kill(2) on the worker this test's comparison started (found by its run's own
    // remote directory).
    unsafe {
        libc::kill(victim as i32, libc::SIGKILL);
    }
    let (code, err, _) = compare.finish(Duration::from_secs(180));
    assert_eq!(code, 0, "the comparison stopped at the failed run:\n{err}");
    let outcomes = std::fs::read_to_string(out.join("outcomes.jsonl")).unwrap();
    let lines: Vec<&str> = outcomes.lines().collect();
    assert_eq!(lines.len(), 2, "{outcomes}");
    assert!(
        lines[0].contains("\"status\":\"failed\"")
            && lines[0].contains(&format!("rank1 on host {}", h.addr(2))),
        "{}",
        lines[0]
    );
    assert!(lines[1].contains("\"status\":\"ok\""), "the next run: {}", lines[1]);
    nothing_left(&remote);

    // Ctrl-C: the run under way is stopped on its hosts and recorded as interrupted.
    let out = h.dir.join("out-interrupt");
    let remote = h.dir.join("remote-interrupt");
    let mut compare = h.compare(&on_hosts(&scen, &out, &list, &remote));
    a_worker_runs(&remote);
    // SAFETY: kill(2) on the comparison this test started.
    unsafe {
        libc::kill(compare.id() as i32, libc::SIGINT);
    }
    let (code, err, took) = compare.finish(Duration::from_secs(60));
    assert_eq!(code, 130, "after Ctrl-C:\n{err}");
    assert!(took < Duration::from_secs(30), "Ctrl-C took {took:?}");
    let outcomes = std::fs::read_to_string(out.join("outcomes.jsonl")).unwrap();
    assert!(outcomes.contains("\"status\":\"interrupted\""), "{outcomes}");
    nothing_left(&remote);

    // A host that dies mid-run (its link cut): the run fails naming it within ssh's keepalive,
    // the next run (the host still gone) fails naming it too, and the comparison ends.
    let out = h.dir.join("out-dies");
    let remote = h.dir.join("remote-dies");
    let mut args = on_hosts(&scen, &out, &list, &remote);
    let quick = format!(
        "-F {} -o ConnectTimeout=3 -o ServerAliveInterval=1 -o ServerAliveCountMax=3",
        h.config().display()
    );
    args.extend(["--ssh-opts".to_string(), quick]);
    let mut compare = h.compare(&args);
    a_worker_runs(&remote);
    h.cluster.cut(2).unwrap();
    let (code, err, took) = compare.finish(Duration::from_secs(120));
    assert_eq!(code, 0, "the comparison stopped at the failed run:\n{err}");
    assert!(took < Duration::from_secs(60), "{took:?} to give up on a dead host");
    let outcomes = std::fs::read_to_string(out.join("outcomes.jsonl")).unwrap();
    let lines: Vec<&str> = outcomes.lines().collect();
    assert_eq!(lines.len(), 2, "{outcomes}");
    for l in &lines {
        assert!(l.contains("\"status\":\"failed\"") && l.contains(&format!("host {}", h.addr(2))), "{l}");
    }
    assert!(lines[0].contains("the connection to the host was lost"), "{}", lines[0]);
    // What ran on the live host is gone; the dead host's sshd drops the silent session (its
    // ClientAlive probes go unanswered) and with it the processes.
    h.cluster.restore(2).unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    while !running(remote.to_str().unwrap()).is_empty() {
        assert!(Instant::now() < until, "left running: {:?}", running(remote.to_str().unwrap()));
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(h.sshd);
}

/// The SHA-256 of `path` as the sshd of `h`'s host `host` sees it (in its mount namespace),
/// or `missing`.
fn sha_on(h: &SshHosts, host: usize, path: &Path) -> String {
    let pid = h.sshd[host - 1].id().to_string();
    let o = Command::new("nsenter")
        .args(["-t", &pid, "-m", "sh", "-c", "sha256sum < \"$0\" || echo missing"])
        .arg(path)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout).split_whitespace().next().unwrap_or("").to_string()
}

/// The SHA-256 of `path` here.
fn sha_here(path: &Path) -> String {
    let o = Command::new("sha256sum").arg(path).stdin(Stdio::null()).output().unwrap();
    String::from_utf8_lossy(&o.stdout).split_whitespace().next().unwrap_or("").to_string()
}

/// `--copy-binaries`: a host whose binaries' directory is empty is refused without it (naming
/// the flag); with it, this machine's three binaries arrive there whole (the same SHA-256) and
/// a run with a rank and the yardstick's far end on that host runs with them. A binary of
/// another build there is replaced the same way; where every host has them, nothing is copied.
#[test]
fn copy_binaries_puts_this_machines_binaries_on_a_host_that_lacks_them() {
    let Some(h) = ssh_hosts("copy", 2, &[2]) else { return };
    let bin = gradsync_testkit::process::bin_dir();
    let names = ["gradsync-worker", "gradsync-server", "gradsync-bench"];
    let mut s = scenario(4);
    s.modes = vec![ModeKind::DdpTcp];
    let scen = write_scenario(&h.dir, &s);
    // One slot each: rank 1 and the yardstick's far end run on host 2.
    let list = format!("{}:1,{}:1", h.addr(1), h.addr(2));
    let remote = h.dir.join("remote");
    let compare = |name: &str, list: &str, copy: bool| {
        let mut args = on_hosts(&scen, &h.dir.join(name), list, &remote);
        if copy {
            args.push("--copy-binaries".into());
        }
        h.compare(&args).finish(Duration::from_secs(240))
    };
    assert_eq!(sha_on(&h, 2, &bin.join("gradsync-worker")), "missing");
    let (code, err, _) = compare("out-refused", &list, false);
    assert_ne!(code, 0, "compare without the binaries on host 2 succeeded:\n{err}");
    let lacks = format!("host {} lacks {}", h.addr(2), bin.join("gradsync-worker").display());
    assert!(err.contains(&lacks) && err.contains("(--copy-binaries puts this machine's there)"), "{err}");
    assert_eq!(sha_on(&h, 2, &bin.join("gradsync-worker")), "missing", "copied without the flag");

    let ran_ok = |out: &str, err: &str| {
        let outcomes = std::fs::read_to_string(h.dir.join(out).join("outcomes.jsonl")).unwrap();
        assert!(outcomes.contains("\"status\":\"ok\""), "{outcomes}\n{err}");
    };
    let copied =
        |host: usize| format!("host {}: this machine's binaries copied into {}", h.addr(host), bin.display());
    let (code, err, took) = compare("out-copied", &list, true);
    assert_eq!(code, 0, "compare --copy-binaries failed:\n{err}");
    assert!(err.contains(&copied(2)) && !err.contains(&copied(1)), "{err}");
    ran_ok("out-copied", &err);
    for b in names {
        assert_eq!(sha_on(&h, 2, &bin.join(b)), sha_here(&bin.join(b)), "{b} on host 2");
    }
    eprintln!("compare --copy-binaries: binaries copied and one run in {:.1} s", took.as_secs_f64());

    // Another build of one binary there (a byte more): replaced, the others left alone.
    let pid = h.sshd[1].id().to_string();
    let bench = bin.join("gradsync-bench");
    let st = Command::new("nsenter")
        .args(["-t", &pid, "-m", "sh", "-c", "printf x >> \"$0\""])
        .arg(&bench)
        .status()
        .unwrap();
    assert!(st.success());
    assert_ne!(sha_on(&h, 2, &bench), sha_here(&bench));
    let (code, err, _) = compare("out-other", &list, true);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains(&copied(2)), "{err}");
    ran_ok("out-other", &err);
    assert_eq!(sha_on(&h, 2, &bench), sha_here(&bench));
    // Every host has them now: nothing copied, said once.
    let (code, err, _) = compare("out-nothing", &list, true);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("--copy-binaries: every host already has this machine's binaries"), "{err}");
    assert!(!err.contains("binaries copied into"), "{err}");
    // No temporary directory left beside the binaries.
    let o = Command::new("nsenter").args(["-t", &pid, "-m", "ls", "-A"]).arg(&bin).output().unwrap();
    let listed = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(!listed.contains(".gradsync-put"), "{listed}");
    nothing_left(&remote);
    drop(h.sshd);
}

/// `advise --hosts --check 1` against two sshd hosts: the advice predicted for the NIC the
/// hosts measured, then its pick and plain DDP each replayed on those hosts as `compare
/// --hosts` runs a scenario there (every process over ssh, its files brought back),
/// undilated, and measured beside the prediction for the link as measured (the advice's own
/// measurement), in check.json, report.html and the text page; nothing left on the hosts. The
/// model's update (40 ms) makes the pick a parameter server colocated one a host (its update
/// split over the servers, half-precision pushes), which the emulated cluster cannot check and
/// the real hosts can.
#[test]
fn advise_check_runs_its_configurations_on_the_hosts() {
    let Some(h) = ssh_hosts("advise-check", 2, &[]) else { return };
    let model = common::tiny_profile(h.dir.path(), 40.0);
    let out = h.dir.join("check");
    let list = format!("{},{}", h.addr(1), h.addr(2));
    let stdout = h.dir.join("advise.txt");
    let mut c = h.cluster.command(0, env!("CARGO_BIN_EXE_gradsync-bench")).unwrap();
    c.args([
        "advise",
        "--model",
        &model,
        "--hosts",
        &list,
        "--bucket-mb",
        "25",
        "--no-topk",
        "--free-codecs",
    ])
    .args(["--check", "1", "--check-steps", "3", "--out"])
    .arg(&out)
    .arg("--bin-dir")
    .arg(gradsync_testkit::process::bin_dir())
    .env("GRADSYNC_SSH_OPTS", format!("-F {}", h.config().display()))
    .stdout(std::fs::File::create(&stdout).unwrap());
    let t = Instant::now();
    let mut p = gradsync_testkit::process::Proc::spawn(&mut c);
    let pid = p.id();
    let (code, err, _) = p.finish(Duration::from_secs(180));
    let text = std::fs::read_to_string(&stdout).unwrap();
    assert_eq!(code, 0, "advise --hosts --check failed:\n{text}\n{err}");
    eprintln!("advise --hosts --check 1: {:.1} s\n{err}\n{text}", t.elapsed().as_secs_f64());
    assert!(
        text.contains("check: measured on 2 host(s) x 1 rank(s) at ")
            && text.contains(&format!("as measured, the real hosts of --hosts {list}")),
        "{text}"
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("check.json")).unwrap()).unwrap();
    assert_eq!(report["testbed"], "hosts", "{report:#}");
    let checked = report["checked"].as_array().unwrap();
    let labels: Vec<&str> = checked.iter().map(|c| c["label"].as_str().unwrap()).collect();
    assert_eq!(
        labels,
        ["ps-bsp-fp16, 2 servers colocated", "ddp-tcp flat ring, 25 MB buckets"],
        "{report:#}"
    );
    assert_eq!(
        (checked[0]["is_pick"].as_bool(), checked[0]["predicted_rank"].as_u64()),
        (Some(true), Some(1))
    );
    for c in checked {
        let m = c["measured_ms"].as_f64().unwrap_or_else(|| panic!("not measured: {c:#}"));
        // The link as measured is the advice's own: its prediction is the SPEC's.
        let (spec, link) =
            (c["predicted_ms"].as_f64().unwrap(), c["predicted_measured_link_ms"].as_f64().unwrap());
        assert!(m > 0.0 && (spec - link).abs() < 1e-9, "{c:#}");
        assert!(c["dilation"].is_null() && c["sound"].as_u64().unwrap() >= 1, "{c:#}");
        // Run as a comparison on the hosts: their record, and every rank's steps brought back.
        let dir = PathBuf::from(c["dir"].as_str().unwrap());
        let machine: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("machine.json")).unwrap()).unwrap();
        assert_eq!(machine["link"].as_str().unwrap(), format!("{} to {}", h.addr(1), h.addr(2)), "{machine}");
        let outcomes = std::fs::read_to_string(dir.join("outcomes.jsonl")).unwrap();
        assert_eq!(outcomes.lines().filter(|l| l.contains("\"status\":\"ok\"")).count(), 2, "{outcomes}");
    }
    // The colocated servers ran one a host, beside the workers.
    let ps_run = std::fs::read_dir(PathBuf::from(checked[0]["dir"].as_str().unwrap()).join("runs"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    for f in ["server0.jsonl", "server1.jsonl", "rank0.jsonl", "rank1.jsonl"] {
        assert!(ps_run.join(f).is_file(), "{}: no {f}", ps_run.display());
    }
    assert!(report["verdict"].as_str().unwrap().starts_with("Measured fastest: "), "{report:#}");
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    let (card, table, chart) =
        (html.find("class=\"card\"").unwrap(), html.find("<table>").unwrap(), html.find("<svg").unwrap());
    assert!(card < table && table < chart, "verdict card, table, chart in that order");
    assert!(html.contains("What the check on the hosts is not") && !html.contains("dilat"), "the page");
    // Each configuration's comparison tidied the hosts after it.
    let left: Vec<String> = std::fs::read_dir("/tmp")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("gradsync-compare-") && n.ends_with(&format!("-{pid}")))
        .collect();
    assert!(left.is_empty(), "left on the hosts: {left:?}");
    drop(h.sshd);
}

/// The start-up overhead of a run over ssh: the same one-step runs over three emulated ssh
/// hosts and over loopback on the head, their wall times side by side (medians of five
/// repeats). A measurement, run by hand: `cargo nextest run -p gradsync-bench --test hosts
/// --run-ignored only --no-capture start_up`.
#[test]
#[ignore = "a measurement: run by hand, as docs/cluster.md says"]
fn start_up_overhead_over_ssh() {
    let Some(h) = ssh_hosts("overhead", 3, &[]) else { return };
    let mut s = scenario(1);
    s.repeats = 5;
    let scen = write_scenario(&h.dir, &s);
    let bin = gradsync_testkit::process::bin_dir();
    let list = format!("{}:2,{}:2,{}:2", h.addr(1), h.addr(2), h.addr(3));
    let median_s = |hosts: bool| {
        let out = h.dir.join(if hosts { "out-ssh" } else { "out-local" });
        let mut args =
            vec![scen.to_str().unwrap(), "--out", out.to_str().unwrap(), "--bin-dir", bin.to_str().unwrap()];
        if hosts {
            args.extend(["--hosts", list.as_str()]);
        }
        let (code, err, _) = h.compare(&args).finish(Duration::from_secs(300));
        assert_eq!(code, 0, "{err}");
        let text = std::fs::read_to_string(out.join("outcomes.jsonl")).unwrap();
        let mut by_mode: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
        for l in text.lines() {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            assert_eq!(v["status"], "ok", "{l}");
            by_mode
                .entry(v["mode"].as_str().unwrap().to_string())
                .or_default()
                .push(v["seconds"].as_f64().unwrap());
        }
        by_mode
            .into_iter()
            .map(|(m, mut v)| {
                v.sort_by(f64::total_cmp);
                (m, v[v.len() / 2], v[0], v[v.len() - 1])
            })
            .collect::<Vec<_>>()
    };
    let local = median_s(false);
    let ssh = median_s(true);
    for ((m, l, llo, lhi), (_, r, rlo, rhi)) in local.iter().zip(&ssh) {
        eprintln!(
            "{m}: one step on loopback {l:.3} s ({llo:.3}-{lhi:.3}), over ssh {r:.3} s ({rlo:.3}-{rhi:.3}): \
             {:.3} s more",
            r - l
        );
    }
}

/// The target, run by hand (about eight minutes on 2 cores): the built-in default
/// scenario across four emulated ssh hosts gives the same runs as on one machine, with the
/// charts, the report and the link between two hosts measured. `cargo nextest run -p
/// gradsync-bench --test hosts --run-ignored only --no-capture default_scenario`.
#[test]
#[ignore = "a measurement: run by hand, as docs/cluster.md says"]
fn default_scenario_across_four_ssh_hosts() {
    let Some(h) = ssh_hosts("default", 4, &[]) else { return };
    let s = Scenario::load(None).unwrap();
    let scen = write_scenario(&h.dir, &s);
    let out = std::env::var_os("GRADSYNC_DEFAULT_OUT").map_or_else(|| h.dir.join("out"), PathBuf::from);
    let list = (1..=4).map(|i| format!("{}:4", h.addr(i))).collect::<Vec<_>>().join(",");
    let t = Instant::now();
    let (code, err, _) =
        h.compare(&on_hosts(&scen, &out, &list, &h.dir.join("remote"))).finish(Duration::from_secs(1800));
    assert_eq!(code, 0, "{err}");
    eprintln!("{err}\nthe default scenario across 4 ssh hosts: {:.0} s", t.elapsed().as_secs_f64());
    let outcomes = std::fs::read_to_string(out.join("outcomes.jsonl")).unwrap();
    assert_eq!(outcomes.lines().count(), s.expand().len(), "one outcome per run");
    for c in gradsync_compare::charts::NAMES {
        assert!(out.join(format!("{c}.svg")).is_file(), "chart {c} missing");
    }
    let machine = std::fs::read_to_string(out.join("machine.json")).unwrap();
    assert!(machine.contains("\"link\""), "{machine}");
}
