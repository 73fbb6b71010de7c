//! The ranks as processes: this binary once per gradsync rank (`collective-rank`) and
//! `bench/pytorch/allreduce.py` once per gloo rank, on loopback or each on an emulated host;
//! rank 0 binds the store and says where, the others start after it; every child is killed
//! and reaped when its guard drops.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};

use anyhow::Context;
use gradsync_compare::hosts::Hosts;
use gradsync_compare::net::Cluster;
use gradsync_worker::collective::Transport;

use super::measure::{CollectiveArgs, Ran, Row, Series, slowest};

/// Where the rank processes run: on this machine's loopback, or on emulated hosts, this many
/// consecutive ranks on each.
#[derive(Clone, Copy)]
pub(super) enum Place<'a> {
    Loopback,
    Emulated(&'a Cluster, usize),
}

impl Place<'_> {
    /// The address rank 0's store binds (any port).
    fn store(&self) -> anyhow::Result<String> {
        let ip = match self {
            Place::Loopback => Hosts::Loopback.ip(0)?,
            Place::Emulated(c, _) => Hosts::Emulated(c).ip(0)?,
        };
        Ok(format!("{ip}:0"))
    }

    /// `program` as it runs for rank `rank`; gloo told which interface is the host's.
    fn command(&self, rank: usize, program: &Path) -> anyhow::Result<Command> {
        let (mut c, ifname) = match self {
            Place::Loopback => (Command::new(program), "lo"),
            Place::Emulated(cl, per_host) => (cl.command(rank / (*per_host).max(1), program)?, "eth0"),
        };
        c.env("GLOO_SOCKET_IFNAME", ifname);
        Ok(c)
    }
}

/// Rank processes, killed and reaped when dropped unless they have exited already.
struct Ranks {
    children: Vec<(Child, std::thread::JoinHandle<String>)>,
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for (c, _) in &mut self.children {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}

impl Ranks {
    /// Start one rank's process; its stderr is collected for the error message should it
    /// fail.
    fn start(&mut self, mut cmd: Command) -> anyhow::Result<ChildStdout> {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {cmd:?}"))?;
        let (Some(out), Some(mut err)) = (child.stdout.take(), child.stderr.take()) else {
            anyhow::bail!("no pipes to a rank process");
        };
        let errs = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        self.children.push((child, errs));
        Ok(out)
    }
}

/// What a rank process said it ran on: its transport and, when all-reduce went through the
/// hosts, their number.
#[derive(Default)]
struct Said {
    transport: Option<String>,
    hosts: Option<usize>,
    chunk_kb: Option<usize>,
}

/// What one rank process printed: what it ran on, and its rows.
fn read_rank(out: impl BufRead) -> anyhow::Result<(Said, Vec<Row>)> {
    let (mut said, mut rows) = (Said::default(), Vec::new());
    for line in out.lines() {
        let line = line?;
        if !line.starts_with('{') {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&line).with_context(|| format!("parsing {line}"))?;
        if let Some(t) = v.get("transport").and_then(|t| t.as_str()) {
            said.transport = Some(t.to_string());
            said.hosts = v.get("hosts").and_then(|h| h.as_u64()).map(|h| h as usize);
            said.chunk_kb = v.get("chunk_kb").and_then(|h| h.as_u64()).map(|h| h as usize);
        } else if v.get("bytes").is_some() {
            rows.push(serde_json::from_value(v)?);
        }
    }
    Ok((said, rows))
}

/// Run `world` rank processes, `cmd(rank, master)` each: rank 0 first, which binds the store
/// and prints where; then the others, told that address. Returns the slowest rank's rows and
/// what rank 0 said it ran on.
fn processes(
    world: usize,
    place: Place<'_>,
    cmd: impl Fn(usize, &str) -> anyhow::Result<Command>,
) -> anyhow::Result<(Vec<Row>, Said)> {
    let mut ranks = Ranks { children: Vec::new() };
    let mut first = BufReader::new(ranks.start(cmd(0, &place.store()?)?)?);
    let mut line = String::new();
    first.read_line(&mut line)?;
    let master = serde_json::from_str::<serde_json::Value>(&line)
        .ok()
        .and_then(|v| v.get("listening").and_then(|a| a.as_str()).map(str::to_string));
    let Some(master) = master else {
        let (mut c, errs) = ranks.children.pop().context("rank 0 not started")?;
        let _ = c.kill();
        let _ = c.wait();
        anyhow::bail!("rank 0 did not say where it listens: {}", errs.join().unwrap_or_default().trim());
    };
    let mut outs = vec![first];
    for rank in 1..world {
        outs.push(BufReader::new(ranks.start(cmd(rank, &master)?)?));
    }
    let mut per_rank = Vec::new();
    let mut said = None;
    let mut failure = None;
    for (rank, out) in outs.into_iter().enumerate() {
        let (s, rows) = read_rank(out)?;
        said = said.or((rank == 0).then_some(s));
        per_rank.push(rows);
        let (child, _) = &mut ranks.children[rank];
        let status = child.wait()?;
        if !status.success() && failure.is_none() {
            failure = Some((rank, status));
        }
    }
    if let Some((rank, status)) = failure {
        // The first rank to fail names the cause; the others mostly report its departure.
        let errs: Vec<String> = std::mem::take(&mut ranks.children)
            .into_iter()
            .map(|(_, e)| e.join().unwrap_or_default())
            .collect();
        anyhow::bail!("rank {rank} exited with {status}: {}", errs[rank].trim());
    }
    Ok((slowest(per_rank)?, said.unwrap_or_default()))
}

/// This binary's `collective-rank` as rank `rank` of `world` runs it at `place`.
fn rank_command(
    place: Place<'_>,
    (rank, world): (usize, usize),
    master: &str,
    sizes: &[usize],
    a: &CollectiveArgs,
) -> anyhow::Result<Command> {
    let list: Vec<String> = sizes.iter().map(|s| s.to_string()).collect();
    let mut c = place.command(rank, &std::env::current_exe()?)?;
    c.args(["collective-rank", "--rank", &rank.to_string(), "--world", &world.to_string()])
        .args(["--master", master, "--sizes", &list.join(",")])
        .args(["--budget-bytes", &a.budget_bytes.to_string()])
        .args(["--socket-buffer-kb", &a.socket_buffer_kb.to_string()]);
    Ok(c)
}

/// gradsync's TCP backend on `s`'s transport and hierarchy, one process per rank.
pub(super) fn tcp_processes(
    world: usize,
    sizes: &[usize],
    a: &CollectiveArgs,
    s: &Series,
    place: Place<'_>,
) -> anyhow::Result<(Vec<Row>, Ran)> {
    let transport = s.transport.unwrap_or_default();
    let (rows, said) = processes(world, place, |rank, master| {
        let mut c = rank_command(place, (rank, world), master, sizes, a)?;
        c.args(["--transport", transport.name(), "--hierarchy", s.hierarchy.name()]);
        if let Some(kb) = a.chunk_kb {
            c.args(["--chunk-kb", &kb.to_string()]);
        }
        Ok(c)
    })?;
    let used = match said.transport.as_deref() {
        Some("shm") => Transport::Shm,
        _ => Transport::Tcp,
    };
    Ok((rows, Ran { transport: used, hosts: said.hosts, chunk_kb: said.chunk_kb }))
}

/// Plain sockets around the ring ([`super::plain`]), one process per rank.
pub(super) fn plain_processes(
    world: usize,
    sizes: &[usize],
    a: &CollectiveArgs,
    place: Place<'_>,
) -> anyhow::Result<Vec<Row>> {
    let (rows, _) = processes(world, place, |rank, master| {
        let mut c = rank_command(place, (rank, world), master, sizes, a)?;
        c.arg("--plain");
        Ok(c)
    })?;
    Ok(rows)
}

/// PyTorch gloo through `bench/pytorch/allreduce.py`, one process per rank.
pub(super) fn gloo(
    torch: &Torch,
    world: usize,
    sizes: &[usize],
    a: &CollectiveArgs,
    place: Place<'_>,
) -> anyhow::Result<Vec<Row>> {
    let list: Vec<String> = sizes.iter().map(|s| s.to_string()).collect();
    let (rows, _) = processes(world, place, |rank, master| {
        let mut c = place.command(rank, &torch.python)?;
        c.arg(&torch.script)
            .args(["--rank", &rank.to_string(), "--world", &world.to_string()])
            .args(["--master", master, "--sizes", &list.join(",")])
            .args(["--budget-bytes", &a.budget_bytes.to_string()]);
        Ok(c)
    })?;
    Ok(rows)
}

/// What the gloo rows run: a Python with torch and `bench/pytorch/allreduce.py`.
#[derive(Debug, Clone)]
pub(super) struct Torch {
    pub python: PathBuf,
    pub script: PathBuf,
    /// Given with `--python`: every gloo row must then be measured.
    pub required: bool,
}

/// The Python to run gloo with, and its script. With `--python` both must be usable, else an
/// error naming what is missing; otherwise the conventional virtual environment when it
/// exists, and `None` (with a note on how to get one) when there is none or it lacks torch.
pub(super) fn find_python(a: &CollectiveArgs) -> anyhow::Result<Option<Torch>> {
    let how = "python3 -m venv ~/.cache/gradsync/torch-venv && \
               ~/.cache/gradsync/torch-venv/bin/pip install torch (or pass --python / GRADSYNC_PYTHON)";
    let has_gloo = |py: &Path| {
        Command::new(py)
            .args(["-c", "import torch.distributed as d; assert d.is_gloo_available()"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if let Some(py) = &a.python {
        anyhow::ensure!(
            has_gloo(py),
            "--python {}: it has no torch with gloo, so the gloo rows asked for cannot be measured; {how}",
            py.display()
        );
        let script = crate::pytorch::find("allreduce.py", a.pytorch_dir.as_deref())?;
        return Ok(Some(Torch { python: py.clone(), script, required: true }));
    }
    let conventional =
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/gradsync/torch-venv/bin/python"));
    let Some(py) = conventional.filter(|p| p.exists()) else {
        eprintln!(
            "gradsync-bench collective: gloo rows skipped: no Python with torch found; install one: {how}"
        );
        return Ok(None);
    };
    if !has_gloo(&py) {
        eprintln!(
            "gradsync-bench collective: gloo rows skipped: {} has no torch with gloo; {how}",
            py.display()
        );
        return Ok(None);
    }
    match crate::pytorch::find("allreduce.py", a.pytorch_dir.as_deref()) {
        Ok(script) => Ok(Some(Torch { python: py, script, required: false })),
        Err(e) => {
            eprintln!("gradsync-bench collective: gloo rows skipped: {e}");
            Ok(None)
        }
    }
}
