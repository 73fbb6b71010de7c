//! `compare --slurm`: the comparison inside a Slurm allocation (`salloc`, `sbatch`), every
//! server and worker of a run started as a job step of its own with `srun` on the node the
//! run's placement gives it (the rules of `--hosts`: [`crate::place::assign`], each node taking
//! the tasks the allocation gives it). Steps share their nodes (`--overlap`), so a run may
//! place more processes on a node than it has CPUs when the allocation overcommits.
//!
//! A [`Node`] is a [`Site`] (how a step is started there; launching a process, and bringing
//! its files back, are the trait's, written once) and the [`Alloc`] a [`Pool`]. As over ssh,
//! every step runs under `gradsync-worker supervise`: the run's tokens reach it on
//! the step's stdin (which srun forwards), never on a command line, and the end of that stdin
//! (the run is over, the runner was stopped or killed, srun died) stops the process. Killing
//! an `srun` also ends its step: Slurm signals the step's tasks.
//!
//! Each process writes its files under a directory of its node (`/tmp/gradsync-compare-...`,
//! as over ssh); when a run ends, one step per node sends that directory back with `tar` on its
//! stdout and removes it, so the nodes need share no file system with the runner. Rank 0's
//! metrics come back as they are written on its step's stdout (`supervise --follow`).
//!
//! What each node is (CPU, cores, memory, GPUs) is read by a step on it at the start, with
//! the gradsync binaries it sees beside this machine's (their path here; [`crate::binaries`]):
//! a node lacking them or holding another build is refused, or with `--copy-binaries` gets
//! this machine's in a directory of its own (`bin/` under its files' directory, removed at the
//! end) that its steps then run. The raw-TCP yardstick is measured between the first two nodes
//! (on the one node's loopback when the allocation has one).
//!
//! `compare --emit-sbatch DIR` writes a batch script that asks for an allocation sized from
//! the scenario's largest run and runs `compare --slurm` in it, for those who submit instead.

use std::ffi::{OsStr, OsString};
use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use crate::binaries::{COPY_FLAG, LocalBinaries, check_script, copy_and_check, read_check, refusal};
use crate::child::run_limited;
use crate::place::{assign, placement_short};
use crate::rawtcp::PeerReading;
use crate::scenario::{RunSpec, Scenario};
use crate::site::{HostFacts, Pool, Site, Slot, files_under, quote, random_port};

/// How long reading a node's facts may take, the step's start included.
const FACTS_LIMIT: Duration = Duration::from_secs(60);

/// One node of the allocation.
#[derive(Debug, Clone)]
pub struct Node {
    /// Its name in Slurm's node list (what `--nodelist` takes).
    pub name: String,
    /// The address the other nodes reach it at.
    pub addr: String,
    /// The tasks the allocation gives it: the processes a run may place there.
    pub slots: usize,
    /// The job whose steps run there.
    job: String,
    /// Where the gradsync binaries are on the node (`gradsync-worker`, whose `supervise` every
    /// step runs under, among them): where they are here, or the copy `--copy-binaries` made.
    bin_dir: PathBuf,
    /// What it is, as a step on it found (empty until read).
    pub facts: HostFacts,
    /// The directory on the node under which processes write (`runs/<id>/` below it).
    remote_root: PathBuf,
    /// The run directory here, whose `runs/<id>` map onto `remote_root`'s.
    local_root: PathBuf,
}

/// The allocation a comparison runs in.
#[derive(Debug)]
pub struct Alloc {
    /// `SLURM_JOB_ID`.
    pub job: String,
    /// In the node list's order.
    pub nodes: Vec<Arc<Node>>,
}

impl Site for Node {
    fn label(&self) -> Option<String> {
        Some(format!("node {}", self.name))
    }

    /// `srun` starting `program args` as a one-task step on this node.
    fn command(&self, program: &OsStr, args: &[OsString], input: bool) -> Command {
        let mut c = self.step(input);
        c.arg(program).args(args);
        c
    }

    fn is_child(&self) -> bool {
        false
    }

    fn free_port(&self) -> anyhow::Result<u16> {
        random_port()
    }

    /// The binary of the same name in the node's binaries' directory.
    fn binary(&self, local: &Path) -> PathBuf {
        self.bin_dir.join(local.file_name().unwrap_or(local.as_os_str()))
    }

    fn files_dir(&self, dir: &Path) -> PathBuf {
        files_under(&self.local_root, &self.remote_root, dir)
    }

    fn facts(&self) -> Option<&HostFacts> {
        Some(&self.facts)
    }
}

impl From<&Arc<Node>> for Slot {
    fn from(n: &Arc<Node>) -> Slot {
        Slot { addr: n.addr.clone(), site: n.clone() }
    }
}

impl Node {
    /// `srun` with the flags of one task on this node: sharing the node's CPUs with the run's
    /// other steps, quiet unless something fails, its stdin forwarded to the task when `input`.
    fn step(&self, input: bool) -> Command {
        let mut c = Command::new("srun");
        c.args([
            format!("--jobid={}", self.job),
            "--nodes=1".into(),
            "--ntasks=1".into(),
            format!("--nodelist={}", self.name),
            "--overlap".into(),
            "--kill-on-bad-exit=1".into(),
            format!("--input={}", if input { "all" } else { "none" }),
            "--quiet".into(),
        ]);
        c
    }

    /// What this node is and whether it has this machine's binaries: [`check_script`] run as
    /// a step on it. Where they are missing or another build, with `copy` this machine's are
    /// put in a directory of the node's own and checked again, else the node is refused naming
    /// what it lacks. Its facts, and the directory its binaries were copied to, if they were.
    fn check(&self, local: &LocalBinaries, copy: bool) -> anyhow::Result<(HostFacts, Option<PathBuf>)> {
        let o = self.run(&check_script(&self.bin_dir), FACTS_LIMIT).context("reading what it is")?;
        let text = String::from_utf8_lossy(&o.stdout);
        anyhow::ensure!(
            o.status.success() && text.lines().any(|l| l == "end"),
            "node {}: reading what it is failed ({}): {}",
            self.name,
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        );
        let base = HostFacts {
            name: self.name.clone(),
            addr: self.addr.clone(),
            slots: self.slots,
            ..HostFacts::default()
        };
        match read_check(&text, base.clone(), &local.expected, &self.bin_dir) {
            Ok(facts) => Ok((facts, None)),
            Err(_) if copy => {
                let dir = self.remote_root.join("bin");
                Ok((copy_and_check(self, local, &dir, base, FACTS_LIMIT)?, Some(dir)))
            }
            Err(problems) => anyhow::bail!(refusal(&format!("node {}", self.name), &problems)),
        }
    }
}

impl Alloc {
    /// The allocation this process runs in, from Slurm's variables (`SLURM_JOB_ID`,
    /// `SLURM_JOB_NODELIST`, `SLURM_TASKS_PER_NODE`), each node's address from
    /// `scontrol show node` and what it is from a step on it (every node at once; a node
    /// whose step fails is named), for a comparison written to `out`. Every node must see
    /// `local` (this machine's binaries) at their path here, or with `copy` gets them put in a
    /// directory of its own (said once where no node needs it: a file system they share).
    pub fn from_env(local: &LocalBinaries, out: &Path, copy: bool) -> anyhow::Result<Alloc> {
        let get = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let mut alloc = Alloc::from_vars(get, &local.paths[0], out)?;
        let addrs = node_addrs(&alloc.nodes.iter().map(|n| n.name.clone()).collect::<Vec<_>>());
        let nodes: Vec<Node> = std::mem::take(&mut alloc.nodes)
            .into_iter()
            .zip(addrs)
            .map(|(n, addr)| Node { addr, ..Arc::unwrap_or_clone(n) })
            .collect();
        type Checked = anyhow::Result<(HostFacts, Option<PathBuf>)>;
        let checked: Vec<Checked> = std::thread::scope(|s| {
            let handles: Vec<_> = nodes.iter().map(|n| s.spawn(|| n.check(local, copy))).collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("reading a node panicked"))))
                .collect()
        });
        let (mut errors, mut copied) = (Vec::new(), 0);
        for (n, c) in nodes.into_iter().zip(checked) {
            match c {
                Ok((facts, dir)) => {
                    copied += usize::from(dir.is_some());
                    let bin_dir = dir.unwrap_or_else(|| n.bin_dir.clone());
                    alloc.nodes.push(Arc::new(Node { facts, bin_dir, ..n }));
                }
                Err(e) => errors.push(format!("{e:#}")),
            }
        }
        anyhow::ensure!(errors.is_empty(), "--slurm: {}", errors.join("; "));
        if copy && copied == 0 {
            let here = local.paths[0].parent().unwrap_or(Path::new("")).display();
            eprintln!(
                "gradsync-bench compare: {COPY_FLAG}: every node already sees this machine's binaries in \
                 {here}; nothing copied"
            );
        }
        Ok(alloc)
    }

    /// [`Alloc::from_env`] from the variables `get` gives, every node's address its name, its
    /// facts unread and its binaries taken to be beside `supervisor` (this machine's
    /// gradsync-worker), at its path here.
    pub fn from_vars(
        get: impl Fn(&str) -> Option<String>,
        supervisor: &Path,
        out: &Path,
    ) -> anyhow::Result<Alloc> {
        let job = get("SLURM_JOB_ID").or_else(|| get("SLURM_JOBID")).context(
            "--slurm: SLURM_JOB_ID is not set: run inside an allocation (salloc, or a batch script: \
             see --emit-sbatch)",
        )?;
        let list = get("SLURM_JOB_NODELIST")
            .or_else(|| get("SLURM_NODELIST"))
            .context("--slurm: SLURM_JOB_NODELIST is not set")?;
        let names = gradsync_worker::rendezvous::slurm_hosts(&list)
            .map_err(|e| anyhow::anyhow!("--slurm: SLURM_JOB_NODELIST: {e}"))?;
        let slots = match get("SLURM_TASKS_PER_NODE").or_else(|| get("SLURM_JOB_CPUS_PER_NODE")) {
            Some(t) => per_node(&t, names.len()).context("--slurm: SLURM_TASKS_PER_NODE")?,
            None => vec![1; names.len()],
        };
        let secs =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let remote_root = PathBuf::from(format!("/tmp/gradsync-compare-{secs}-{}", std::process::id()));
        let local_root = std::path::absolute(out).unwrap_or_else(|_| out.to_path_buf());
        let nodes = names
            .into_iter()
            .zip(slots)
            .map(|(name, slots)| {
                Arc::new(Node {
                    addr: name.clone(),
                    name,
                    slots,
                    job: job.clone(),
                    bin_dir: supervisor.parent().unwrap_or(Path::new("")).to_path_buf(),
                    facts: HostFacts::default(),
                    remote_root: remote_root.clone(),
                    local_root: local_root.clone(),
                })
            })
            .collect();
        Ok(Alloc { job, nodes })
    }

    /// Where the processes of `spec` go: the node of each server shard and of each worker
    /// rank, or why the allocation cannot take them.
    #[allow(clippy::type_complexity)]
    pub fn place(&self, spec: &RunSpec) -> Result<(Vec<Arc<Node>>, Vec<Arc<Node>>), String> {
        let slots: Vec<usize> = self.nodes.iter().map(|n| n.slots).collect();
        let (servers, workers) = assign(&slots, spec.mode, spec.workers, spec.shards)
            .map_err(|e| format!("the allocation ({}): {e}", self.describe()))?;
        let facts: Vec<&HostFacts> = self.nodes.iter().map(|n| &n.facts).collect();
        if let Some(why) = placement_short(spec, &facts, &servers, &workers, "node") {
            return Err(why);
        }
        let node = |i: &usize| self.nodes[*i].clone();
        Ok((servers.iter().map(node).collect(), workers.iter().map(node).collect()))
    }

    /// `node01 (10.0.0.1, 4 tasks), ...`, for messages.
    pub fn describe(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("{} ({}, {} tasks)", n.name, n.addr, n.slots))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl Pool for Alloc {
    fn sites(&self) -> Vec<Arc<dyn Site>> {
        self.nodes.iter().map(|n| n.clone() as Arc<dyn Site>).collect()
    }

    fn launcher(&self) -> &'static str {
        "Slurm"
    }

    fn what(&self) -> &'static str {
        "the allocation's nodes"
    }

    fn place_slots(&self, spec: &RunSpec) -> Result<(Vec<Slot>, Vec<Slot>), String> {
        let (servers, workers) = self.place(spec)?;
        Ok((servers.iter().map(Slot::from).collect(), workers.iter().map(Slot::from).collect()))
    }

    /// With `gradsync-bench rawtcp-peer` (in each node's binaries' directory) as a step on each
    /// node.
    fn measure_link(&self, rounds: usize, each: Duration) -> anyhow::Result<PeerReading> {
        let from = self.nodes.first().context("--slurm: the allocation has no node")?;
        let to = self.nodes.get(1).unwrap_or(from);
        let listen = if Arc::ptr_eq(from, to) { "127.0.0.1".to_string() } else { to.addr.clone() };
        let bench = from.binary(Path::new("gradsync-bench"));
        crate::site::measure_link(
            from.as_ref(),
            to.as_ref(),
            &listen,
            &bench,
            &from.remote_root,
            rounds,
            each,
        )
    }

    /// Remove the (then empty) directories the runs used on every node, and the binaries
    /// `--copy-binaries` put there; once is enough, more is harmless.
    fn tidy(&self) {
        std::thread::scope(|s| {
            for n in &self.nodes {
                s.spawn(|| {
                    let root = quote(&n.remote_root.display().to_string());
                    let runs = quote(&n.remote_root.join("runs").display().to_string());
                    let bin = quote(&n.remote_root.join("bin").display().to_string());
                    let _ = n.run(
                        &format!("rm -rf -- {bin}; rmdir {runs} {root} 2>/dev/null; true"),
                        Duration::from_secs(30),
                    );
                });
            }
        });
    }
}

/// Slurm's per-node counts (`SLURM_TASKS_PER_NODE`): `2(x3),1` is 2, 2, 2, 1; one count a
/// node of the `nodes`.
pub fn per_node(text: &str, nodes: usize) -> anyhow::Result<Vec<usize>> {
    let mut out = Vec::new();
    for item in text.split(',').map(str::trim) {
        let (n, times) = match item.split_once('(') {
            Some((n, rest)) => {
                let t = rest.strip_prefix('x').and_then(|r| r.strip_suffix(')'));
                (
                    n,
                    t.and_then(|t| t.parse::<usize>().ok())
                        .with_context(|| format!("`{item}`: expected N(xM)"))?,
                )
            }
            None => (item, 1),
        };
        let n: usize = n.parse().with_context(|| format!("`{item}`: not a count"))?;
        out.extend(std::iter::repeat_n(n.max(1), times));
    }
    anyhow::ensure!(out.len() == nodes, "`{text}` gives {} counts for {nodes} nodes", out.len());
    Ok(out)
}

/// Each node's address (`NodeAddr` of `scontrol show node`, resolved to an IP address where
/// this machine can), in the order of `names`; a node scontrol does not describe keeps its name.
fn node_addrs(names: &[String]) -> Vec<String> {
    let mut c = Command::new("scontrol");
    c.args(["show", "node", "--oneliner"]).arg(names.join(","));
    let text = run_limited(c, None, Duration::from_secs(30))
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let field = |line: &str, key: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key).map(str::to_string))
            .filter(|v| !v.is_empty())
    };
    names
        .iter()
        .map(|name| {
            let addr = text
                .lines()
                .find(|l| field(l, "NodeName=").as_deref() == Some(name))
                .and_then(|l| field(l, "NodeAddr="))
                .unwrap_or_else(|| name.clone());
            let ip = (addr.as_str(), 0)
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.find(|a| a.is_ipv4()))
                .map(|a| a.ip().to_string());
            ip.unwrap_or(addr)
        })
        .collect()
}

/// Processes of a run: its workers and its server shards.
fn processes(spec: &RunSpec) -> usize {
    spec.workers + if spec.mode.is_ps() { spec.shards.max(1) } else { 0 }
}

/// The allocation a batch script asks for: nodes and tasks on each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size {
    /// `--nodes`.
    pub nodes: usize,
    /// `--ntasks-per-node`.
    pub tasks_per_node: usize,
}

/// The allocation `scenario`'s largest run needs with `tasks_per_node` processes a node: as
/// many nodes as that run's processes fill, whole; the time every run may take
/// (`run_timeout_s` each) and ten minutes for the rest.
pub fn size(scenario: &Scenario, tasks_per_node: usize) -> (Size, Duration) {
    let runs = scenario.expand();
    let most = runs.iter().filter(|r| r.skip.is_none()).map(processes).max().unwrap_or(1);
    let tasks = tasks_per_node.max(1);
    let limit = Duration::from_secs_f64(scenario.run_timeout_s * runs.len() as f64 + 600.0);
    (Size { nodes: most.div_ceil(tasks), tasks_per_node: tasks }, limit)
}

/// The batch script of `dir` (`dir/compare.sbatch`): `#SBATCH` lines for `size` and `limit`,
/// then `compare --slurm` with `bench` (and the binaries of `bin_dir`, when given; copied to
/// the nodes that lack them with `copy_binaries`) on `dir/scenario.toml`, the runs going to
/// `dir/runs-<job id>`, its log beside.
pub fn sbatch_script(
    size: Size,
    limit: Duration,
    bench: &Path,
    bin_dir: Option<&Path>,
    copy_binaries: bool,
    dir: &Path,
) -> String {
    let path = |name: &str| dir.join(name).display().to_string();
    format!(
        "#!/bin/bash\n\
         # gradsync-bench compare --slurm on an allocation sized from the scenario's largest run:\n\
         # submit with `sbatch {script}`.\n\
         #SBATCH --job-name=gradsync-compare\n\
         #SBATCH --nodes={nodes}\n\
         #SBATCH --ntasks-per-node={tasks}\n\
         #SBATCH --time={minutes}\n\
         #SBATCH --output={log}\n\
         set -eu\n\
         exec {bench} compare --slurm {scenario} --out {runs}\"${{SLURM_JOB_ID}}\"{bins}{copy}\n",
        script = path("compare.sbatch"),
        nodes = size.nodes,
        tasks = size.tasks_per_node,
        minutes = limit.as_secs().div_ceil(60),
        log = path("runs-%j.log"),
        bench = quote(&bench.display().to_string()),
        scenario = quote(&path("scenario.toml")),
        runs = quote(&path("runs-")),
        bins = bin_dir.map(|d| format!(" --bin-dir {}", quote(&d.display().to_string()))).unwrap_or_default(),
        copy = if copy_binaries { format!(" {COPY_FLAG}") } else { String::new() },
    )
}

/// `compare --emit-sbatch DIR`: the scenario as `DIR/scenario.toml` and the script that runs
/// it as `DIR/compare.sbatch` ([`sbatch_script`]); the script's path.
pub fn emit_sbatch(
    scenario: &Scenario,
    dir: &Path,
    bench: &Path,
    bin_dir: Option<&Path>,
    copy_binaries: bool,
    tasks_per_node: usize,
) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("--emit-sbatch: creating {}", dir.display()))?;
    let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    let toml_path = dir.join("scenario.toml");
    std::fs::write(&toml_path, toml::to_string(scenario).context("writing the scenario")?)
        .with_context(|| format!("writing {}", toml_path.display()))?;
    let (size, limit) = size(scenario, tasks_per_node);
    let script = dir.join("compare.sbatch");
    std::fs::write(&script, sbatch_script(size, limit, bench, bin_dir, copy_binaries, &dir))
        .with_context(|| format!("writing {}", script.display()))?;
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .with_context(|| format!("making {} executable", script.display()))?;
    Ok(script)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::scenario::ModeKind;

    fn vars(list: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| list.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn the_allocation_comes_from_slurms_variables() {
        let a = Alloc::from_vars(
            vars(&[
                ("SLURM_JOB_ID", "42"),
                ("SLURM_JOB_NODELIST", "node[01-03],gpu7"),
                ("SLURM_TASKS_PER_NODE", "2(x3),4"),
            ]),
            Path::new("/opt/g/gradsync-worker"),
            Path::new("/home/u/runs/1"),
        )
        .unwrap();
        let got: Vec<(&str, usize)> = a.nodes.iter().map(|n| (n.name.as_str(), n.slots)).collect();
        assert_eq!(got, [("node01", 2), ("node02", 2), ("node03", 2), ("gpu7", 4)]);
        assert_eq!(a.job, "42");
        // Placement as with --hosts: the server alone on the first node, workers spread.
        let mut s = crate::scenario::Scenario::load(None).unwrap();
        (s.modes, s.workers, s.shards) =
            (vec![ModeKind::PsBsp], vec![4], crate::scenario::Shards::counts(&[1]));
        let spec = s.expand().remove(0);
        let (servers, workers) = a.place(&spec).unwrap();
        assert_eq!(servers.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["node01"]);
        assert_eq!(
            workers.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(),
            ["node02", "node03", "gpu7", "node02"]
        );
        // One step a process, on its node; the tokens on stdin only.
        let env = [("GRADSYNC_TOKEN".to_string(), "s3cret".to_string())];
        let files = workers[2].files_dir(Path::new("/home/u/runs/1/runs/0-x"));
        assert!(
            files.display().to_string().starts_with("/tmp/gradsync-compare-") && files.ends_with("runs/0-x"),
            "{files:?}"
        );
        let l = workers[2].launch(
            Path::new("/opt/g/gradsync-worker"),
            &["train".into()],
            &env,
            &files,
            Some(&files.join("rank0.jsonl")),
        );
        let args: Vec<String> = l.command.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
        assert_eq!(l.command.get_program(), "srun");
        for want in ["--jobid=42", "--nodes=1", "--ntasks=1", "--nodelist=gpu7", "--overlap"] {
            assert!(args.iter().any(|a| a == want), "{want} in {args:?}");
        }
        let files = files.display().to_string();
        let rank0 = format!("{files}/rank0.jsonl");
        assert!(
            args.ends_with(&[
                "/bin/sh".into(),
                "-c".into(),
                "mkdir -p -- \"$0\" && exec \"$@\"".into(),
                files,
                "/opt/g/gradsync-worker".into(),
                "supervise".into(),
                "--follow".into(),
                rank0,
                "--".into(),
                "/opt/g/gradsync-worker".into(),
                "train".into()
            ]),
            "{args:?}"
        );
        assert!(!args.iter().any(|a| a.contains("s3cret")));
        assert_eq!(l.stdin.unwrap(), b"GRADSYNC_TOKEN=s3cret\n\n");
        // Too few tasks: the run cannot go, and the message says what the allocation has.
        (s.workers, s.modes) = (vec![16], vec![ModeKind::DdpTcp]);
        let e = a.place(&s.expand().remove(0)).unwrap_err();
        assert!(e.contains("16 workers need 16 slots") && e.contains("gpu7 (gpu7, 4 tasks)"), "{e}");
    }

    #[test]
    fn outside_an_allocation_or_with_a_bad_list_the_error_says_so() {
        let e = format!("{:#}", Alloc::from_vars(vars(&[]), Path::new("w"), Path::new("o")).unwrap_err());
        assert!(e.contains("SLURM_JOB_ID is not set") && e.contains("salloc"), "{e}");
        let e = format!(
            "{:#}",
            Alloc::from_vars(
                vars(&[("SLURM_JOB_ID", "1"), ("SLURM_JOB_NODELIST", "n[1-2")]),
                Path::new("w"),
                Path::new("o")
            )
            .unwrap_err()
        );
        assert!(e.contains("SLURM_JOB_NODELIST") && e.contains("unbalanced"), "{e}");
        let e = format!(
            "{:#}",
            Alloc::from_vars(
                vars(&[
                    ("SLURM_JOB_ID", "1"),
                    ("SLURM_JOB_NODELIST", "n[1-2]"),
                    ("SLURM_TASKS_PER_NODE", "2")
                ]),
                Path::new("w"),
                Path::new("o")
            )
            .unwrap_err()
        );
        assert!(e.contains("gives 1 counts for 2 nodes"), "{e}");
        assert_eq!(per_node("2(x3),1", 4).unwrap(), [2, 2, 2, 1]);
        assert!(per_node("2(3)", 3).is_err());
    }

    #[test]
    fn the_batch_script_asks_for_the_largest_run() {
        let mut s = crate::scenario::Scenario::load(None).unwrap();
        (s.modes, s.workers, s.shards) =
            (vec![ModeKind::PsBsp, ModeKind::DdpTcp], vec![2, 4], crate::scenario::Shards::counts(&[1, 2]));
        s.run_timeout_s = 600.0;
        s.repeats = 1;
        let runs = s.expand().len();
        // The largest run: PS with 4 workers and 2 shards, 6 processes.
        let (size, limit) = size(&s, 2);
        assert_eq!(size, Size { nodes: 3, tasks_per_node: 2 });
        assert_eq!(limit, Duration::from_secs(600 * runs as u64 + 600));
        let dir = gradsync_testkit::Scratch::new("sbatch");
        let script = emit_sbatch(
            &s,
            dir.path(),
            Path::new("/opt/g/gradsync-bench"),
            Some(Path::new("/opt/g")),
            false,
            2,
        )
        .unwrap();
        let text = std::fs::read_to_string(&script).unwrap();
        assert!(text.starts_with("#!/bin/bash\n"), "{text}");
        for want in ["#SBATCH --nodes=3\n", "#SBATCH --ntasks-per-node=2\n"] {
            assert!(text.contains(want), "{want} in {text}");
        }
        let toml = dir.path().join("scenario.toml");
        assert!(
            text.contains(&format!(
                "exec '/opt/g/gradsync-bench' compare --slurm '{}' --out",
                toml.display()
            )),
            "{text}"
        );
        let prefix = dir.path().join("runs-");
        assert!(
            text.contains(&format!("--out '{}'\"${{SLURM_JOB_ID}}\" --bin-dir '/opt/g'\n", prefix.display())),
            "{text}"
        );
        assert!(text.contains(&format!("sbatch {}", script.display())), "{text}");
        // The scenario written beside it is the one given.
        let back = Scenario::parse(&std::fs::read_to_string(&toml).unwrap(), "x").unwrap();
        assert_eq!(back.expand().len(), runs);
    }

    #[test]
    fn the_batch_script_passes_copy_binaries_on() {
        let size = Size { nodes: 2, tasks_per_node: 1 };
        let (bench, dir) = (Path::new("/opt/my g/gradsync-bench"), Path::new("/jobs/x"));
        let with = sbatch_script(size, Duration::from_secs(60), bench, None, true, dir);
        assert!(with.contains("\"${SLURM_JOB_ID}\" --copy-binaries\n"), "{with}");
        let without = sbatch_script(size, Duration::from_secs(60), bench, None, false, dir);
        assert!(!without.contains(COPY_FLAG), "{without}");
    }
}
