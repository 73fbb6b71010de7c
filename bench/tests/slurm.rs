//! `compare --slurm` for real: a one-node Slurm cluster on this machine (the distribution's
//! munge, slurmctld and slurmd, installed with apt-get when missing and possible, started here
//! as the test's children with a configuration of its own in a scratch directory), and
//! `gradsync-bench compare --slurm` run inside `salloc` on a small scenario: every run's
//! processes start as job steps, and every run ends ok. Then two nodes: two slurmd, each in an
//! emulated host's network namespace ([`gradsync_compare::net`]) with a `/tmp` of its own (a
//! tmpfs in its mount namespace), so that the link is measured between nodes and the run
//! directory is shared with no node; and two nodes of which one does not see this machine's
//! binaries (`--copy-binaries`). Where this machine cannot (not root, no packages, the
//! daemons do not start) the tests print SKIPPED with the reason and pass.
#![allow(clippy::unwrap_used)] // a test fails loudly on anything unexpected

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gradsync_compare::scenario::ModeKind;
use gradsync_testkit::Scratch;
use gradsync_testkit::process::Proc;

// The comparison's test helpers, shared with the tests of its library in compare/tests.
#[path = "../../compare/tests/common/mod.rs"]
mod common;

/// The programs the cluster needs.
const PROGRAMS: [&str; 6] = ["munged", "slurmctld", "slurmd", "salloc", "srun", "sinfo"];

/// Whether `program` is on the PATH (or in /usr/sbin, where the daemons are).
fn found(program: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain([PathBuf::from("/usr/sbin")])
        .any(|d| d.join(program).is_file())
}

/// Slurm and munge from the distribution's packages, installed when missing.
fn slurm_packages() -> Result<(), String> {
    if PROGRAMS.iter().all(|p| found(p)) {
        return Ok(());
    }
    if !found("apt-get") {
        return Err("Slurm is not installed and there is no apt-get to install it".into());
    }
    let mut c = Command::new("apt-get");
    c.args([
        "install",
        "-y",
        "-q",
        "--no-install-recommends",
        "slurmctld",
        "slurmd",
        "slurm-client",
        "munge",
    ])
    .env("DEBIAN_FRONTEND", "noninteractive");
    let (code, err, _) = Proc::spawn(&mut c).finish(Duration::from_secs(600));
    match PROGRAMS.iter().find(|p| !found(p)) {
        Some(p) => Err(format!(
            "installing Slurm failed ({code}), {p} is missing: {}",
            err.lines().last().unwrap_or("")
        )),
        None => Ok(()),
    }
}

/// A free TCP port on this machine.
fn port() -> u16 {
    gradsync_testkit::process::free_port()
}

/// munged, slurmctld and slurmd, stopped (jobs cancelled first) when dropped.
struct Cluster {
    /// The test's files: scenarios, run directories.
    dir: Scratch,
    /// The daemons' files (configuration, munge's key and socket, logs, spool): `dir` for one
    /// node; for two, a directory outside /tmp (which the nodes do not share).
    files: PathBuf,
    /// The node (the first node, with two).
    node: String,
    daemons: Vec<(String, Proc)>,
    /// With two nodes, the emulated hosts: slurmctld and the commands on host 0, a node on
    /// each of the others. Dropped last, once the daemons are gone.
    net: Option<gradsync_compare::net::Cluster>,
}

impl Cluster {
    /// A Slurm command with this cluster's configuration (on host 0 with two nodes).
    fn command(&self, program: &str) -> Command {
        let mut c = match &self.net {
            Some(net) => net.command(0, program).unwrap(),
            None => Command::new(program),
        };
        c.env("SLURM_CONF", self.files.join("slurm.conf"));
        c
    }

    /// Start the cluster; `Err` says why it cannot run here.
    fn start() -> Result<Cluster, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root (slurmd starts job steps as their users)".into());
        }
        slurm_packages()?;
        let dir = Scratch::new("slurm");
        let node = String::from_utf8_lossy(
            &Command::new("hostname").arg("-s").output().map_err(|e| e.to_string())?.stdout,
        )
        .trim()
        .to_string();
        let files = dir.path().to_path_buf();
        let nodes = [(node.clone(), "127.0.0.1".to_string())];
        let mut c = Cluster { dir, files, node, daemons: Vec::new(), net: None };
        c.start_daemons("127.0.0.1", &nodes, &[])?;
        Ok(c)
    }

    /// Two nodes, `gs-node1` and `gs-node2`, each a slurmd on an emulated host of its own
    /// (hosts 1 and 2, 1 Gbit/s links) whose `/tmp` is a tmpfs of its own; slurmctld and the
    /// test's commands on host 0. To node `i` of `hidden` the gradsync binaries' directory is
    /// an empty tmpfs: a node that does not see this machine's binaries.
    fn start_two(hidden: &[usize]) -> Result<Cluster, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root (slurmd starts job steps as their users)".into());
        }
        slurm_packages()?;
        gradsync_compare::net::available().map_err(|e| e.to_string())?;
        let shape = gradsync_compare::net::Shape::at_rate(1e9);
        let net = gradsync_compare::net::Cluster::create(3, shape).map_err(|e| e.to_string())?;
        let node = String::from_utf8_lossy(
            &Command::new("hostname").arg("-s").output().map_err(|e| e.to_string())?.stdout,
        )
        .trim()
        .to_string();
        let files = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "slurm-two-{}-{}",
            std::process::id(),
            port()
        ));
        std::fs::create_dir_all(&files).map_err(|e| format!("{}: {e}", files.display()))?;
        let nodes: Vec<(String, String)> =
            (1..=2).map(|i| (format!("gs-node{i}"), net.hosts()[i].addr.clone())).collect();
        let ctld = net.hosts()[0].addr.clone();
        let mut c =
            Cluster { dir: Scratch::new("slurm-two"), files, node, daemons: Vec::new(), net: Some(net) };
        c.start_daemons(&ctld, &nodes, hidden)?;
        c.node = nodes[0].0.clone();
        Ok(c)
    }

    /// Write the configuration (slurmctld at `ctld`, on this machine's host name, and `nodes`,
    /// each a name and address) and start munged, slurmctld and a slurmd per node (the
    /// binaries' directory hidden from node `i` of `hidden`, counted from 1, when it has a
    /// host of its own); ready once every node is idle.
    fn start_daemons(
        &mut self,
        ctld: &str,
        nodes: &[(String, String)],
        hidden: &[usize],
    ) -> Result<(), String> {
        let host = String::from_utf8_lossy(
            &Command::new("hostname").arg("-s").output().map_err(|e| e.to_string())?.stdout,
        )
        .trim()
        .to_string();
        if host.is_empty() {
            return Err("this machine has no host name".into());
        }
        let files = self.files.clone();
        for d in ["munge", "state"] {
            std::fs::create_dir_all(files.join(d)).unwrap();
        }
        // munged checks that its directories are the user's alone (and the socket's reachable).
        std::fs::set_permissions(files.join("munge"), std::os::unix::fs::PermissionsExt::from_mode(0o711))
            .unwrap();
        let key = files.join("munge/key");
        let mut bytes = [0u8; 1024];
        getrandom::fill(&mut bytes).unwrap();
        std::fs::write(&key, bytes).unwrap();
        std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o400)).unwrap();
        let d = files.display().to_string();
        let mut conf = format!(
            "ClusterName=gradsync\n\
             SlurmctldHost={host}({ctld})\n\
             SlurmctldPort={ctld_port}\n\
             SlurmdPort={slurmd}\n\
             AuthType=auth/munge\n\
             AuthInfo=socket={d}/munge/sock\n\
             CredType=cred/munge\n\
             ProctrackType=proctrack/linuxproc\n\
             TaskPlugin=task/none\n\
             SelectType=select/cons_tres\n\
             SelectTypeParameters=CR_Core\n\
             SchedulerType=sched/builtin\n\
             SlurmUser=root\n\
             SlurmdUser=root\n\
             StateSaveLocation={d}/state\n\
             SlurmdSpoolDir={d}/spool-%n\n\
             SlurmctldPidFile={d}/slurmctld.pid\n\
             SlurmdPidFile={d}/slurmd-%n.pid\n\
             SlurmctldLogFile={d}/slurmctld.log\n\
             SlurmdLogFile={d}/slurmd-%n.log\n\
             JobAcctGatherType=jobacct_gather/none\n\
             AccountingStorageType=accounting_storage/none\n\
             MpiDefault=none\n\
             ReturnToService=2\n",
            ctld_port = port(),
            slurmd = port(),
        );
        for (name, addr) in nodes {
            std::fs::create_dir_all(files.join(format!("spool-{name}"))).unwrap();
            conf.push_str(&format!(
                "NodeName={name} NodeAddr={addr} CPUs=2 Sockets=1 CoresPerSocket=2 ThreadsPerCore=1 State=UNKNOWN\n"
            ));
        }
        let names: Vec<&str> = nodes.iter().map(|(n, _)| n.as_str()).collect();
        conf.push_str(&format!(
            "PartitionName=gradsync Nodes={} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4\n",
            names.join(",")
        ));
        std::fs::write(files.join("slurm.conf"), conf).unwrap();
        let conf = files.join("slurm.conf");
        let mut munged = Command::new("munged");
        munged
            .arg("-F")
            .arg("-f")
            .arg(format!("--socket={d}/munge/sock"))
            .arg(format!("--key-file={}", key.display()));
        munged.arg(format!("--log-file={d}/munge/log")).arg(format!("--pid-file={d}/munge/pid"));
        munged.arg(format!("--seed-file={d}/munge/seed"));
        self.daemons.push(("munged".into(), Proc::spawn(munged.stdout(Stdio::null()))));
        self.wait_for("munged's socket", Duration::from_secs(20), |c| c.files.join("munge/sock").exists())?;
        let mut ctld = self.command("slurmctld");
        ctld.arg("-D").arg("-i").arg("-f").arg(&conf);
        self.daemons.push(("slurmctld".into(), Proc::spawn(ctld.stdout(Stdio::null()))));
        for (i, (name, _)) in nodes.iter().enumerate() {
            let slurmd = format!("exec slurmd -D -f '{}' -N {name}", conf.display());
            let mut c = match &self.net {
                // The host's network namespace and a mount namespace of the node's own, where a
                // tmpfs is a /tmp the other nodes and the runner do not see. (Not `ip netns
                // exec`: its fresh /sys lacks the cgroup hierarchy slurmd reads.)
                Some(net) => {
                    let hide = if hidden.contains(&(i + 1)) {
                        let bin = gradsync_testkit::process::bin_dir();
                        format!("mount -t tmpfs gradsync-test-empty '{}' && ", bin.display())
                    } else {
                        String::new()
                    };
                    let mut c = Command::new("nsenter");
                    c.arg(format!("--net=/run/netns/{}", net.hosts()[i + 1].netns))
                        .args(["unshare", "-m", "--propagation", "private", "sh", "-c"])
                        .arg(format!("mount -t tmpfs gradsync-node-tmp /tmp && {hide}{slurmd}"));
                    c
                }
                None => {
                    let mut c = Command::new("sh");
                    c.args(["-c", &slurmd]);
                    c
                }
            };
            c.env("SLURM_CONF", &conf);
            self.daemons.push((format!("slurmd {name}"), Proc::spawn(c.stdout(Stdio::null()))));
        }
        let want = nodes.len();
        self.wait_for("every node to be idle", Duration::from_secs(30), |c| {
            let o = c.command("sinfo").args(["-h", "-N", "-o", "%T"]).stdin(Stdio::null()).output();
            o.is_ok_and(|o| {
                let text = String::from_utf8_lossy(&o.stdout).to_string();
                text.lines().filter(|l| l.trim() == "idle").count() == want
            })
        })
    }

    /// The lines of `ls /tmp` on node `i` (1 or 2) of a two-node cluster, as its slurmd sees it.
    fn node_tmp(&self, i: usize) -> String {
        let pid = self.daemons.iter().find(|(n, _)| n == &format!("slurmd gs-node{i}")).unwrap().1.id();
        let o = Command::new("nsenter")
            .args(["-t", &pid.to_string(), "-m", "ls", "/tmp"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(o.status.success(), "nsenter: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).to_string()
    }

    /// Poll `ready` until it holds, a daemon dies, or `limit` passes (then why, with the logs).
    fn wait_for(
        &mut self,
        what: &str,
        limit: Duration,
        ready: impl Fn(&Cluster) -> bool,
    ) -> Result<(), String> {
        let until = Instant::now() + limit;
        while Instant::now() < until {
            if ready(self) {
                return Ok(());
            }
            let dead = self
                .daemons
                .iter_mut()
                .find_map(|(name, p)| p.child().try_wait().ok().flatten().is_some().then(|| name.clone()));
            if let Some(name) = dead {
                return Err(format!("{name} exited while waiting for {what}: {}", self.logs()));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Err(format!("no {what} within {} s: {}", limit.as_secs(), self.logs()))
    }

    /// The daemons' logs' last lines.
    fn logs(&self) -> String {
        let mut names = vec!["munge/log".to_string(), "slurmctld.log".to_string()];
        for e in std::fs::read_dir(&self.files).into_iter().flatten().flatten() {
            let n = e.file_name().to_string_lossy().to_string();
            if n.starts_with("slurmd-") && n.ends_with(".log") {
                names.push(n);
            }
        }
        names
            .iter()
            .map(|f| {
                let text = std::fs::read_to_string(self.files.join(f)).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                format!("{f}: {}", lines[lines.len().saturating_sub(3)..].join(" / "))
            })
            .collect::<Vec<_>>()
            .join("; ")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Whatever is left of the jobs goes first, while slurmd can still end their steps.
        let _ =
            self.command("scancel").arg("--full").arg("--partition=gradsync").stdin(Stdio::null()).output();
        for (_, p) in self.daemons.iter_mut().rev() {
            if let Ok(pid) = i32::try_from(p.id()) {
                // SAFETY: kill(2) on a child of this test that has not been reaped.
                unsafe {
                    libc::kill(pid, libc::SIGTERM);
                }
            }
            let until = Instant::now() + Duration::from_secs(10);
            while Instant::now() < until && p.child().try_wait().ok().flatten().is_none() {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        // Dropping the daemons kills whatever did not stop.
        self.daemons.clear();
        if self.net.is_some() {
            let _ = std::fs::remove_dir_all(&self.files);
        }
    }
}

/// The cluster, or `None` after printing `SKIPPED: <test>: <why>`.
fn cluster_or_skip(test: &str) -> Option<Cluster> {
    Cluster::start().map_err(|why| eprintln!("SKIPPED: {test}: {why}")).ok()
}

/// The small scenario inside an allocation: PS-BSP and DDP-TCP with two workers each, every
/// process a job step on the one node; the report is written and every run is ok.
#[test]
fn compare_runs_every_process_as_a_job_step_inside_salloc() {
    let Some(cluster) = cluster_or_skip("compare --slurm") else { return };
    let mut s = common::small_scenario(4);
    (s.workers, s.shards) = (vec![2], gradsync_compare::scenario::Shards::counts(&[1]));
    s.modes = vec![ModeKind::PsBsp, ModeKind::DdpTcp, ModeKind::DdpNccl];
    (s.rawtcp_s, s.run_timeout_s) = (0.2, 60.0);
    let scenario = cluster.dir.join("scenario.toml");
    std::fs::write(&scenario, toml::to_string(&s).unwrap()).unwrap();
    let out = cluster.dir.join("out");
    let mut c = cluster.command("salloc");
    c.args(["-N1", "-n3", "--overcommit", "--time=5", "--quiet"])
        .arg(env!("CARGO_BIN_EXE_gradsync-bench"))
        .args(["compare", "--slurm"])
        .arg(&scenario)
        .arg("--out")
        .arg(&out)
        .arg("--bin-dir")
        .arg(gradsync_testkit::process::bin_dir())
        .stdout(Stdio::null());
    let t = Instant::now();
    let (code, err, _) = Proc::spawn(&mut c).finish(Duration::from_secs(240));
    assert_eq!(code, 0, "compare --slurm failed:\n{err}\nSlurm: {}", cluster.logs());
    assert!(
        err.contains("Slurm job") && err.contains(&format!("{} (127.0.0.1, 3 tasks)", cluster.node)),
        "{err}"
    );
    let outcomes = outcomes(&out, 3);
    for o in &outcomes[..2] {
        assert_eq!(o["status"], "ok", "{o}\n{err}");
    }
    // NCCL's ranks need a GPU each on their node, read by a step on it: this node has none.
    assert_eq!(outcomes[2]["status"], "skipped", "{}", outcomes[2]);
    let why = outcomes[2]["error"].as_str().unwrap();
    assert_eq!(why, format!("2 NCCL ranks placed on node {} and it has 0 GPU(s)", cluster.node));
    assert!(out.join("report.html").is_file());
    // The node as a step on it found it, and the link measured on its loopback (one node).
    let machine: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("machine.json")).unwrap()).unwrap();
    assert_eq!(machine["link"], format!("loopback (one node: {})", cluster.node), "{machine}");
    let node = &machine["hosts"][0];
    assert!(
        node["cores"].as_u64().unwrap() >= 1 && node["memory_available_bytes"].as_u64().unwrap() > 0,
        "{node}"
    );
    // Every process was a step of the job: slurmd launched eleven: a step reading the node,
    // two for the yardstick (its two ends), a server and two ranks then a step bringing the
    // run's files back, two ranks and that step again, and a last one tidying the node.
    let slurmd = std::fs::read_to_string(cluster.files.join(format!("slurmd-{}.log", cluster.node)))
        .unwrap_or_default();
    let steps = slurmd.lines().filter(|l| l.contains("launch task StepId=")).count();
    assert_eq!(steps, 11, "steps launched (slurmd.log):\n{slurmd}");
    eprintln!("compare --slurm: 2 runs in {:.1} s", t.elapsed().as_secs_f64());
}

/// `advise --slurm --check 1` inside `salloc` on the one node (two tasks: one host of two
/// ranks, over shared memory as --intra says): the advice predicted for the link a step
/// measured there, then its pick (or the best the node can run) and plain DDP each replayed as
/// a comparison of job steps, as `compare --slurm` runs one, undilated, and measured beside
/// the prediction; a server on a node of its own, which the one node of workers leaves no room
/// for, listed as not checked with why.
#[test]
fn advise_check_runs_its_configurations_as_job_steps_inside_salloc() {
    let Some(cluster) = cluster_or_skip("advise --slurm --check") else { return };
    let model = common::tiny_profile(cluster.dir.path(), 40.0);
    let out = cluster.dir.join("check");
    let stdout = cluster.dir.join("advise.txt");
    let mut c = cluster.command("salloc");
    c.args(["-N1", "-n2", "--overcommit", "--time=5", "--quiet"])
        .arg(env!("CARGO_BIN_EXE_gradsync-bench"))
        .args(["advise", "--model", &model, "--slurm", "--intra", "shm", "--bucket-mb", "25", "--no-topk"])
        .args(["--free-codecs", "--check", "1", "--check-steps", "3", "--out"])
        .arg(&out)
        .arg("--bin-dir")
        .arg(gradsync_testkit::process::bin_dir())
        .stdout(std::fs::File::create(&stdout).unwrap());
    let t = Instant::now();
    let (code, err, _) = Proc::spawn(&mut c).finish(Duration::from_secs(240));
    let text = std::fs::read_to_string(&stdout).unwrap();
    assert_eq!(code, 0, "advise --slurm --check failed:\n{text}\n{err}\nSlurm: {}", cluster.logs());
    eprintln!("advise --slurm --check 1: {:.1} s\n{text}", t.elapsed().as_secs_f64());
    assert!(
        text.contains("check: measured on 1 host(s) x 2 rank(s) at ")
            && text.contains("as measured, the real hosts of --slurm"),
        "{text}"
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("check.json")).unwrap()).unwrap();
    assert_eq!(report["testbed"], "slurm", "{report:#}");
    let checked = report["checked"].as_array().unwrap();
    assert!(checked.iter().any(|c| c["label"] == "ddp-tcp flat ring, 25 MB buckets"), "{report:#}");
    for c in checked {
        let m = c["measured_ms"].as_f64().unwrap_or_else(|| panic!("not measured: {c:#}\n{err}"));
        assert!(m > 0.0 && c["dilation"].is_null() && c["sound"].as_u64().unwrap() >= 1, "{c:#}");
        let dir = PathBuf::from(c["dir"].as_str().unwrap());
        let machine: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("machine.json")).unwrap()).unwrap();
        assert_eq!(machine["launcher"], "Slurm", "{machine}");
        assert_eq!(machine["link"], format!("loopback (one node: {})", cluster.node), "{machine}");
    }
    for n in report["not_checked"].as_array().unwrap() {
        if n[0].as_str().unwrap().contains("on their own hosts") {
            assert!(n[1].as_str().unwrap().contains("beyond the 1 given"), "{n}");
        }
    }
    assert!(out.join("report.html").is_file());
}

/// The outcomes of the comparison in `out`, `n` of them.
fn outcomes(out: &Path, n: usize) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(out.join("outcomes.jsonl")).unwrap();
    let v: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(v.len(), n, "{v:?}");
    v
}

impl Cluster {
    /// `gradsync-bench compare --slurm SCENARIO --out OUT` in the allocation `job`, as if on
    /// the nodes `nodes` with 3 tasks each.
    fn compare_in(&self, job: &str, nodes: &str, scenario: &Path, out: &Path) -> Command {
        let mut c = self.command(env!("CARGO_BIN_EXE_gradsync-bench"));
        c.args(["compare", "--slurm"])
            .arg(scenario)
            .arg("--out")
            .arg(out)
            .arg("--bin-dir")
            .arg(gradsync_testkit::process::bin_dir())
            .env("SLURM_JOB_ID", job)
            .env("SLURM_JOB_NODELIST", nodes)
            .env("SLURM_TASKS_PER_NODE", "3")
            .stdout(Stdio::null());
        c
    }

    /// The job steps of `job` Slurm knows of now (`squeue -s`), one a line.
    fn steps(&self, job: &str) -> String {
        let o =
            self.command("squeue").args(["-h", "-s", "-j", job, "-o", "%i %j"]).stdin(Stdio::null()).output();
        o.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default()
    }
}

/// Ctrl-C while a run's steps are running, in an allocation that outlives the comparison
/// (`salloc --no-shell`): the comparison exits 130 with the run `interrupted`, and none of
/// its steps is left in the allocation. Then a node the allocation lacks: refused at the
/// start, naming it.
#[test]
fn ctrl_c_ends_the_runs_steps_and_a_node_the_allocation_lacks_is_named() {
    let Some(cluster) = cluster_or_skip("compare --slurm, Ctrl-C") else { return };
    let o = cluster
        .command("salloc")
        .args(["--no-shell", "-N1", "-n3", "--overcommit", "--time=5"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&o.stderr).to_string();
    let job = said
        .split_whitespace()
        .skip_while(|w| *w != "allocation")
        .nth(1)
        .unwrap_or_else(|| panic!("no job in salloc's answer: {said}"))
        .to_string();
    let mut s = common::small_scenario(100_000);
    (s.workers, s.shards, s.modes) =
        (vec![2], gradsync_compare::scenario::Shards::counts(&[1]), vec![ModeKind::PsBsp]);
    (s.rawtcp_s, s.run_timeout_s) = (0.2, 120.0);
    let scenario = cluster.dir.join("long.toml");
    std::fs::write(&scenario, toml::to_string(&s).unwrap()).unwrap();
    let mut c = cluster.compare_in(&job, &cluster.node, &scenario, &cluster.dir.join("long"));
    let mut p = Proc::spawn(&mut c);
    // The server and both ranks running as steps of the job.
    let until = Instant::now() + Duration::from_secs(60);
    while cluster.steps(&job).lines().count() < 3 {
        assert!(Instant::now() < until, "the run's steps never all ran: {}", cluster.steps(&job));
        std::thread::sleep(Duration::from_millis(100));
    }
    // SAFETY: kill(2) on a child of this test that has not been reaped.
    assert_eq!(unsafe { libc::kill(i32::try_from(p.id()).unwrap(), libc::SIGINT) }, 0);
    let (code, err, took) = p.finish(Duration::from_secs(60));
    assert_eq!(code, 130, "{err}");
    let long = std::fs::read_to_string(cluster.dir.join("long/outcomes.jsonl")).unwrap();
    assert!(long.contains("\"status\":\"interrupted\""), "{long}");
    let until = Instant::now() + Duration::from_secs(15);
    while !cluster.steps(&job).is_empty() {
        assert!(Instant::now() < until, "steps left in job {job}: {}", cluster.steps(&job));
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("compare --slurm: interrupted, every step gone, {:.1} s after Ctrl-C", took.as_secs_f64());
    s.steps = Some(4);
    s.modes = vec![ModeKind::PsBsp, ModeKind::DdpTcp];
    std::fs::write(&scenario, toml::to_string(&s).unwrap()).unwrap();
    // A node the allocation lacks: the step reading it cannot start, and the comparison is
    // refused before any run, naming the node (as --hosts names a host it cannot reach).
    let out = cluster.dir.join("bad-node");
    let mut c = cluster.compare_in(&job, "nosuchnode", &scenario, &out);
    let (code, err, _) = Proc::spawn(&mut c).finish(Duration::from_secs(120));
    assert_ne!(code, 0, "{err}");
    assert!(err.contains("--slurm: node nosuchnode: reading what it is failed"), "{err}");
    assert!(!out.join("outcomes.jsonl").exists());
    assert!(cluster.steps(&job).is_empty(), "{}", cluster.steps(&job));
}

/// Two nodes, each with a /tmp of its own and no file system shared with the runner's run
/// directory (which is under the runner's /tmp): every rank's and server's metrics come back
/// to the run directory by a step per node, the link is measured between the two nodes (their
/// 1 Gbit/s links, not a loopback), rank 0's metrics are followed over its step's stdout to
/// stop a run at its target accuracy, and nothing is left in the nodes' /tmp.
#[test]
fn compare_on_two_nodes_measures_the_link_between_them_and_brings_the_files_back() {
    let cluster = match Cluster::start_two(&[]) {
        Ok(c) => c,
        Err(why) => {
            eprintln!("SKIPPED: compare --slurm on two nodes: {why}");
            return;
        }
    };
    let mut s = common::small_scenario(6);
    (s.workers, s.shards, s.modes) =
        (vec![2], gradsync_compare::scenario::Shards::counts(&[1]), vec![ModeKind::PsBsp, ModeKind::DdpTcp]);
    (s.rawtcp_s, s.run_timeout_s) = (0.5, 60.0);
    let scenario = cluster.dir.join("scenario.toml");
    std::fs::write(&scenario, toml::to_string(&s).unwrap()).unwrap();
    let out = cluster.dir.join("out");
    let salloc = |scenario: &Path, out: &Path| {
        let mut c = cluster.command("salloc");
        c.args(["-N2", "-n4", "--overcommit", "--time=5", "--quiet"])
            .arg(env!("CARGO_BIN_EXE_gradsync-bench"))
            .args(["compare", "--slurm"])
            .arg(scenario)
            .arg("--out")
            .arg(out)
            .arg("--bin-dir")
            .arg(gradsync_testkit::process::bin_dir())
            .stdout(Stdio::null());
        c
    };
    let (code, err, took) = Proc::spawn(&mut salloc(&scenario, &out)).finish(Duration::from_secs(240));
    assert_eq!(code, 0, "compare --slurm on two nodes failed:\n{err}\nSlurm: {}", cluster.logs());
    for o in outcomes(&out, 2) {
        assert_eq!(o["status"], "ok", "{o}\n{err}");
    }
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
    let machine: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("machine.json")).unwrap()).unwrap();
    assert_eq!(machine["link"], "gs-node1 to gs-node2", "{machine}");
    assert_eq!(machine["hosts"].as_array().unwrap().len(), 2, "{machine}");
    let gbit = machine["tcp_bandwidth"].as_f64().unwrap() * 8.0 / 1e9;
    assert!((0.5..1.0).contains(&gbit), "{gbit} Gbit/s between nodes on 1 Gbit/s links");
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(
        html.contains("raw host-to-host (gs-node1 to gs-node2) TCP") && html.contains("2 x</th>"),
        "the report"
    );
    eprintln!("compare --slurm on two nodes: 2 runs in {:.1} s, link {gbit:.2} Gbit/s", took.as_secs_f64());

    // stop_at_target: rank 0's metrics, on its node's own /tmp, followed over its step.
    let mut t = common::small_scenario(2000);
    (t.workers, t.modes) = (vec![2], vec![ModeKind::DdpTcp]);
    (t.stop_at_target, t.target_accuracy, t.eval_samples) = (true, Some(0.6), Some(320));
    (t.rawtcp_s, t.run_timeout_s) = (0.2, 120.0);
    let target = cluster.dir.join("target.toml");
    std::fs::write(&target, toml::to_string(&t).unwrap()).unwrap();
    let out = cluster.dir.join("out-target");
    let (code, err, _) = Proc::spawn(&mut salloc(&target, &out)).finish(Duration::from_secs(240));
    assert_eq!(code, 0, "compare --slurm with stop_at_target failed:\n{err}\nSlurm: {}", cluster.logs());
    let o = outcomes(&out, 1).remove(0);
    assert_eq!(o["status"], "ok", "{o}");
    let (steps, best) = common::stopped_at_target(&out.join(o["id"].as_str().unwrap()), 2000, 0.6);
    eprintln!("stop_at_target under srun: stopped after {steps} of 2000 steps at {best:.3}");
    // A run stopped by its time budget after two seconds of steps: the runner's cores say
    // nothing of how busy the nodes were, so no share of them is recorded.
    let mut b = common::small_scenario(1_000_000);
    (b.workers, b.modes, b.time_s) = (vec![2], vec![ModeKind::DdpTcp], Some(2.0));
    b.rawtcp_s = 0.2;
    let budget = cluster.dir.join("budget.toml");
    std::fs::write(&budget, toml::to_string(&b).unwrap()).unwrap();
    let out = cluster.dir.join("out-budget");
    let (code, err, _) = Proc::spawn(&mut salloc(&budget, &out)).finish(Duration::from_secs(120));
    assert_eq!(code, 0, "{err}");
    let o = outcomes(&out, 1).remove(0);
    assert_eq!(o["status"], "stopped", "{o}");
    assert!(o["cpu_busy"].is_null(), "{o}");
    // A run whose ranks need more memory than their nodes had available (as a step on each
    // read it) is skipped, naming the node: two ranks of a 2-billion-parameter MLP.
    let mut m = common::small_scenario(1);
    (m.models, m.modes, m.workers) = (vec!["64-20000-100000-10".into()], vec![ModeKind::DdpTcp], vec![2]);
    m.rawtcp_s = 0.2;
    let memory = cluster.dir.join("memory.toml");
    std::fs::write(&memory, toml::to_string(&m).unwrap()).unwrap();
    let out = cluster.dir.join("out-memory");
    let (code, err, _) = Proc::spawn(&mut salloc(&memory, &out)).finish(Duration::from_secs(120));
    assert_eq!(code, 0, "{err}");
    let o = outcomes(&out, 1).remove(0);
    assert_eq!(o["status"], "skipped", "{o}");
    let why = o["error"].as_str().unwrap();
    assert!(why.starts_with("1 worker(s) placed on node gs-node1 need about 29.8 GiB"), "{why}");
    // Nothing of the runs is left on either node.
    for i in 1..=2 {
        let left = cluster.node_tmp(i);
        assert!(!left.contains("gradsync-compare-"), "node {i}'s /tmp holds {left}");
    }
}

/// `--copy-binaries` under Slurm: of two nodes, the second does not see this machine's
/// binaries (an empty tmpfs over their directory in its mount namespace). Without the flag the
/// comparison is refused before any run, naming that node and the flag; with it, that node
/// alone gets this machine's binaries in a directory of its own under its `/tmp` (the first
/// sees them where they are, as on a shared file system), a run with a rank and the
/// yardstick's far end there runs with them, and the copy is gone at the end. Where every node
/// sees them, nothing is copied.
#[test]
fn copy_binaries_puts_them_on_a_node_that_does_not_see_them() {
    let cluster = match Cluster::start_two(&[2]) {
        Ok(c) => c,
        Err(why) => {
            eprintln!("SKIPPED: compare --slurm --copy-binaries: {why}");
            return;
        }
    };
    let bin = gradsync_testkit::process::bin_dir();
    let mut s = common::small_scenario(4);
    (s.workers, s.modes) = (vec![2], vec![ModeKind::DdpTcp]);
    (s.rawtcp_s, s.run_timeout_s) = (0.2, 60.0);
    let scenario = cluster.dir.join("scenario.toml");
    std::fs::write(&scenario, toml::to_string(&s).unwrap()).unwrap();
    // One task a node: rank 1, and the yardstick's far end, on gs-node2.
    let compare = |out: &str, nodes: &[&str], copy: bool| {
        let mut c = cluster.command("salloc");
        c.args([&format!("-N{}", nodes.len()), "-n2", "--overcommit", "--time=5", "--quiet"])
            .arg(format!("--nodelist={}", nodes.join(",")))
            .arg(env!("CARGO_BIN_EXE_gradsync-bench"))
            .args(["compare", "--slurm"])
            .arg(&scenario)
            .arg("--out")
            .arg(cluster.dir.join(out))
            .arg("--bin-dir")
            .arg(&bin)
            .stdout(Stdio::null());
        if copy {
            c.arg("--copy-binaries");
        }
        Proc::spawn(&mut c).finish(Duration::from_secs(240))
    };
    let (code, err, _) = compare("out-refused", &["gs-node1", "gs-node2"], false);
    assert_ne!(code, 0, "compare --slurm with a node lacking the binaries succeeded:\n{err}");
    let lacks = format!("--slurm: node gs-node2 lacks {}", bin.join("gradsync-worker").display());
    assert!(err.contains(&lacks) && err.contains("(--copy-binaries puts this machine's there)"), "{err}");
    assert!(!err.contains("node gs-node1 lacks"), "{err}");
    assert!(!cluster.dir.join("out-refused/outcomes.jsonl").exists());

    let (code, err, took) = compare("out-copied", &["gs-node1", "gs-node2"], true);
    assert_eq!(code, 0, "compare --slurm --copy-binaries failed:\n{err}\nSlurm: {}", cluster.logs());
    let copied =
        |node: &str| format!("node {node}: this machine's binaries copied into /tmp/gradsync-compare-");
    assert!(err.contains(&copied("gs-node2")) && !err.contains("node gs-node1: this machine's"), "{err}");
    for o in outcomes(&cluster.dir.join("out-copied"), 1) {
        assert_eq!(o["status"], "ok", "{o}\n{err}");
    }
    let machine: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(cluster.dir.join("out-copied/machine.json")).unwrap())
            .unwrap();
    assert_eq!(machine["link"], "gs-node1 to gs-node2", "{machine}");
    let left = cluster.node_tmp(2);
    assert!(!left.contains("gradsync-compare-"), "node 2's /tmp holds {left}");
    eprintln!("compare --slurm --copy-binaries: binaries copied and one run in {:.1} s", took.as_secs_f64());

    // A node that sees them where they are (a shared file system): nothing copied, said once.
    let (code, err, _) = compare("out-shared", &["gs-node1"], true);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("--copy-binaries: every node already sees this machine's binaries"), "{err}");
    assert!(!err.contains("binaries copied into"), "{err}");
}
