//! `compare --slurm` for real: a one-node Slurm cluster on this machine (the distribution's
//! munge, slurmctld and slurmd, installed with apt-get when missing and possible, started here
//! as the test's children with a configuration of its own in a scratch directory), and
//! `gradsync-bench compare --slurm` run inside `salloc` on a small scenario: every run's
//! processes start as job steps, and every run ends ok. Where this machine cannot (not root,
//! no packages, the daemons do not start) the test prints SKIPPED with the reason and passes.
#![allow(clippy::unwrap_used)] // a test fails loudly on anything unexpected

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gradsync_bench::compare::scenario::ModeKind;
use gradsync_testkit::Scratch;
use gradsync_testkit::process::Proc;

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
    dir: Scratch,
    node: String,
    daemons: Vec<(String, Proc)>,
}

impl Cluster {
    /// A Slurm command with this cluster's configuration.
    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", self.dir.join("slurm.conf"));
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
        if node.is_empty() {
            return Err("this machine has no host name".into());
        }
        for d in ["munge", "state", "spool"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        // munged checks that its directories are the user's alone (and the socket's reachable).
        std::fs::set_permissions(dir.join("munge"), std::os::unix::fs::PermissionsExt::from_mode(0o711))
            .unwrap();
        let key = dir.join("munge/key");
        let mut bytes = [0u8; 1024];
        getrandom::fill(&mut bytes).unwrap();
        std::fs::write(&key, bytes).unwrap();
        std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o400)).unwrap();
        let d = dir.path().display().to_string();
        let conf = format!(
            "ClusterName=gradsync\n\
             SlurmctldHost={node}(127.0.0.1)\n\
             SlurmctldPort={ctld}\n\
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
             SlurmdSpoolDir={d}/spool\n\
             SlurmctldPidFile={d}/slurmctld.pid\n\
             SlurmdPidFile={d}/slurmd.pid\n\
             SlurmctldLogFile={d}/slurmctld.log\n\
             SlurmdLogFile={d}/slurmd.log\n\
             JobAcctGatherType=jobacct_gather/none\n\
             AccountingStorageType=accounting_storage/none\n\
             MpiDefault=none\n\
             ReturnToService=2\n\
             NodeName={node} NodeAddr=127.0.0.1 CPUs=2 Sockets=1 CoresPerSocket=2 ThreadsPerCore=1 State=UNKNOWN\n\
             PartitionName=gradsync Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4\n",
            ctld = port(),
            slurmd = port(),
        );
        std::fs::write(dir.join("slurm.conf"), conf).unwrap();
        let mut c = Cluster { dir, node, daemons: Vec::new() };
        let conf = c.dir.join("slurm.conf");
        let mut munged = Command::new("munged");
        munged
            .arg("-F")
            .arg("-f")
            .arg(format!("--socket={d}/munge/sock"))
            .arg(format!("--key-file={}", key.display()));
        munged.arg(format!("--log-file={d}/munge/log")).arg(format!("--pid-file={d}/munge/pid"));
        munged.arg(format!("--seed-file={d}/munge/seed"));
        c.daemons.push(("munged".into(), Proc::spawn(munged.stdout(Stdio::null()))));
        c.wait_for("munged's socket", Duration::from_secs(20), |c| c.dir.join("munge/sock").exists())?;
        let mut ctld = c.command("slurmctld");
        ctld.arg("-D").arg("-i").arg("-f").arg(&conf);
        c.daemons.push(("slurmctld".into(), Proc::spawn(ctld.stdout(Stdio::null()))));
        let mut slurmd = c.command("slurmd");
        slurmd.arg("-D").arg("-f").arg(&conf).arg("-N").arg(&c.node);
        c.daemons.push(("slurmd".into(), Proc::spawn(slurmd.stdout(Stdio::null()))));
        c.wait_for("the node to be idle", Duration::from_secs(30), |c| {
            let o = c.command("sinfo").args(["-h", "-o", "%T", "-n", &c.node]).stdin(Stdio::null()).output();
            o.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "idle")
        })?;
        Ok(c)
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
        ["munge/log", "slurmctld.log", "slurmd.log"]
            .iter()
            .map(|f| {
                let text = std::fs::read_to_string(self.dir.join(f)).unwrap_or_default();
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
    (s.workers, s.shards, s.modes) = (vec![2], vec![1], vec![ModeKind::PsBsp, ModeKind::DdpTcp]);
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
    let outcomes = outcomes(&out, 2);
    for o in &outcomes {
        assert_eq!(o["status"], "ok", "{o}\n{err}");
    }
    assert!(out.join("report.html").is_file());
    // Every process was a step of the job: slurmd launched five (a server and four ranks).
    let slurmd = std::fs::read_to_string(cluster.dir.join("slurmd.log")).unwrap_or_default();
    let steps = slurmd.lines().filter(|l| l.contains("launch task StepId=")).count();
    assert_eq!(steps, 5, "steps launched (slurmd.log):\n{slurmd}");
    eprintln!("compare --slurm: 2 runs in {:.1} s", t.elapsed().as_secs_f64());
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
/// its steps is left in the allocation. Then a step that cannot start (a node the allocation
/// lacks): each run fails naming the node, and the matrix goes on to its end.
#[test]
fn ctrl_c_ends_the_runs_steps_and_a_failed_step_fails_its_run_alone() {
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
    (s.workers, s.shards, s.modes) = (vec![2], vec![1], vec![ModeKind::PsBsp]);
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
    let out = cluster.dir.join("bad-node");
    let mut c = cluster.compare_in(&job, "nosuchnode", &scenario, &out);
    let (code, err, _) = Proc::spawn(&mut c).finish(Duration::from_secs(120));
    assert_eq!(code, 0, "{err}");
    let outcomes = outcomes(&out, 2);
    for o in &outcomes {
        assert_eq!(o["status"], "failed", "{o}");
        assert!(o["error"].as_str().unwrap().contains("on node nosuchnode"), "{o}");
    }
    assert!(cluster.steps(&job).is_empty(), "{}", cluster.steps(&job));
}
