//! Where one process of a run goes and how it is started there: the seam the comparison's
//! runner ([`crate::exec`]) starts every process through. A [`Site`] is this machine
//! ([`crate::local`]), an emulated host's network namespace ([`crate::netns`]), another host
//! reached over ssh ([`crate::ssh`]) or a node of a Slurm allocation ([`crate::slurm`]); each
//! says how to run a command there, and what is the same everywhere (how a process is
//! launched, its files copied back, the link between two sites measured) is written once,
//! here, over that. The runner never asks which site it has.
//!
//! ```text
//!        exec, modes, machine, lib (the callers)
//!             |  Arc<dyn Site>, &dyn Pool
//!             v
//!          site.rs  (the traits, and launch / run / collect / measure_link once)
//!          ^   ^   ^   ^
//!   local.rs netns.rs ssh.rs slurm.rs   (one implementation each)
//! ```
//!
//! A site where processes are this one's children (this machine, a namespace of it) starts
//! the program itself with its environment; anywhere else the program runs under
//! `gradsync-worker supervise` ([`gradsync_worker::supervise`]), which makes its files'
//! directory, reads its environment from stdin (the run's secrets never reach a command line)
//! and stops it when that stdin ends: the run is over, the runner stopped or was killed, or
//! the link died.

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::child::{Launch, run_limited, wait_for_line, wait_until};
use crate::rawtcp::PeerReading;
use crate::scenario::RunSpec;

/// How long bringing a run's files back from one site may take.
const COLLECT_LIMIT: Duration = Duration::from_secs(300);

/// Where a process runs: how a command is started there, and where its files go.
pub trait Site: fmt::Debug + Send + Sync {
    /// Where it is, for messages (`host node1`, `node gpu7`, `emulated host gs-3`); none for
    /// this machine. Two sites with the same label are the same place.
    fn label(&self) -> Option<String>;

    /// A command, started here, that runs `program args` there. With `input`, what is written
    /// to the command's stdin reaches the program's (a Slurm step forwards it only when asked).
    fn command(&self, program: &OsStr, args: &[OsString], input: bool) -> Command;

    /// Whether a process started there is a child of this one (this machine, or a namespace of
    /// it): it then takes its environment directly, writes its files in place, and its CPU time
    /// is counted in this one's children's. Anywhere else it runs under the supervisor.
    fn is_child(&self) -> bool;

    /// A port for a rendezvous there: [`loopback_port`] where this machine's ports are the
    /// site's, else [`random_port`].
    fn free_port(&self) -> anyhow::Result<u16>;

    /// The path there of the gradsync binary that is at `local` here.
    fn binary(&self, local: &Path) -> PathBuf {
        local.to_path_buf()
    }

    /// Where a process there writes the files of the run directory `dir`.
    fn files_dir(&self, dir: &Path) -> PathBuf {
        dir.to_path_buf()
    }

    /// What it is (CPU, cores, memory, GPUs: the kind of host it is), as read when it was
    /// reached; none for this machine and its namespaces, which `machine.json` describes.
    fn facts(&self) -> Option<&HostFacts> {
        None
    }

    /// What an exit status of the command itself, rather than of the program it ran, says
    /// (ssh's 255 is its own failure), for messages; none where the two cannot be told apart.
    fn launcher_failure(&self, _status: ExitStatus) -> Option<&'static str> {
        None
    }

    /// How to start `program args` here with `env` added to its environment, its files going
    /// to `files` (made first where needed). `env` never reaches a command line. Where the
    /// process is not a child of this one, `follow` (a file the program writes there) has the
    /// lines appended to it sent back on the process's stdout as they are written (the
    /// program's own stdout then joins its stderr); here the file can be read directly.
    fn launch(
        &self,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        files: &Path,
        follow: Option<&Path>,
    ) -> Launch {
        let program = self.binary(program);
        let args: Vec<OsString> = args.iter().map(OsString::from).collect();
        if self.is_child() {
            let mut command = self.command(program.as_os_str(), &args, false);
            command.envs(env.iter().map(|(k, v)| (k, v)));
            return Launch { command, stdin: None };
        }
        // `sh -c 'mkdir -p "$0" && exec "$@"' DIR SUPERVISOR ...`: every argument stays one word.
        let mut argv: Vec<OsString> =
            vec!["-c".into(), "mkdir -p -- \"$0\" && exec \"$@\"".into(), files.into()];
        argv.push(self.binary(Path::new("gradsync-worker")).into());
        argv.push("supervise".into());
        if let Some(f) = follow {
            argv.extend(["--follow".into(), f.into()]);
        }
        argv.push("--".into());
        argv.push(program.into());
        argv.extend(args);
        let mut stdin = String::new();
        for (k, v) in env {
            stdin.push_str(&format!("{k}={v}\n"));
        }
        stdin.push('\n');
        Launch { command: self.command(OsStr::new("/bin/sh"), &argv, true), stdin: Some(stdin.into_bytes()) }
    }

    /// Run the shell command line `script` there to its end, within `limit`.
    fn run(&self, script: &str, limit: Duration) -> anyhow::Result<Output> {
        let c = self.command(OsStr::new("/bin/sh"), &["-c".into(), script.into()], false);
        run_limited(c, None, limit).with_context(|| self.label().unwrap_or_else(|| "this machine".into()))
    }

    /// Bring what the run's processes wrote there into `dir` (a `tar` stream on the command's
    /// stdout), then remove it there. Nothing to do where the files were written in place, or
    /// where nothing was written (another site of a shared file system took it already).
    fn collect(&self, dir: &Path) -> anyhow::Result<()> {
        if self.is_child() {
            return Ok(());
        }
        let packed = self.run(&pack_files(&self.files_dir(dir)), COLLECT_LIMIT);
        unpack_files(&self.label().unwrap_or_default(), packed, dir)
    }

    /// Whether `other` is the same place.
    fn same(&self, other: &dyn Site) -> bool {
        self.label() == other.label()
    }
}

/// The sites a whole comparison places its runs on: the hosts of `compare --hosts`, the nodes
/// of `compare --slurm`.
pub trait Pool: Send + Sync {
    /// Its sites, in order.
    fn sites(&self) -> Vec<Arc<dyn Site>>;

    /// How the processes reach them, as `machine.json` records it (`ssh`, `Slurm`).
    fn launcher(&self) -> &'static str;

    /// The sites, for messages (`the hosts`).
    fn what(&self) -> &'static str;

    /// Where the processes of `spec` go: one slot per server shard and one per worker rank,
    /// or why the sites cannot take them.
    fn place_slots(&self, spec: &RunSpec) -> Result<(Vec<Slot>, Vec<Slot>), String>;

    /// The raw-TCP yardstick between the first two sites (one site: over its own loopback):
    /// `rounds` measurements streaming `each`, and the small-message latency.
    fn measure_link(&self, rounds: usize, each: Duration) -> anyhow::Result<PeerReading>;

    /// Remove what the runs left on the sites, once the comparison is over.
    fn tidy(&self);
}

/// A host a run's process is placed on: where it runs and the address the others reach it at.
#[derive(Debug, Clone)]
pub struct Slot {
    /// The address its servers listen on and its peers dial.
    pub addr: String,
    /// How a process is started there.
    pub site: Arc<dyn Site>,
}

/// What a host or node is, as recorded in `machine.json` (`hosts`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HostFacts {
    /// The name in the host list.
    pub name: String,
    /// The address the other hosts reach it at.
    pub addr: String,
    /// Its slots in the host list.
    pub slots: usize,
    /// Its own host name.
    pub hostname: String,
    /// CPU model name.
    pub cpu: String,
    /// Logical cores.
    pub cores: usize,
    /// Physical memory, bytes.
    pub memory_bytes: u64,
    /// What `/proc/meminfo` called available when the host was checked, bytes (0: not read):
    /// what a run placed there may use.
    #[serde(default)]
    pub memory_available_bytes: u64,
    /// GPUs, by name.
    pub gpus: Vec<String>,
    /// Kernel release.
    pub kernel: String,
}

/// What a host or node is, one `key value` a line ([`read_facts`] reads it), then `end`:
/// names, cores, CPU, memory (total and available), and its GPUs, from `nvidia-smi` or, where
/// that is missing, the driver's `/proc/driver/nvidia/gpus` (one directory a GPU).
pub const FACTS_SCRIPT: &str = "echo \"hostname $(hostname)\"; echo \"cores $(nproc)\"; echo \"kernel $(uname -r)\"; \
     grep -m1 '^model name' /proc/cpuinfo | sed 's/^[^:]*: */cpu /'; \
     grep -m1 '^MemTotal' /proc/meminfo | sed 's/^MemTotal: *\\([0-9]*\\).*/memkb \\1/'; \
     grep -m1 '^MemAvailable' /proc/meminfo | sed 's/^MemAvailable: *\\([0-9]*\\).*/availkb \\1/'; \
     if command -v nvidia-smi >/dev/null 2>&1; then \
       (nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true) | sed 's/^/gpu /'; \
     elif [ -d /proc/driver/nvidia/gpus ]; then \
       for g in /proc/driver/nvidia/gpus/*; do [ -e \"$g\" ] && echo \"gpu $(sed -n 's/^Model:[[:space:]]*//p' \"$g/information\")\"; done; \
     fi; \
     echo end";

/// Fill `facts` from what [`FACTS_SCRIPT`] printed; lines of other keys are left to the caller
/// (an ssh host's check prints its binaries among them).
pub fn read_facts(text: &str, facts: &mut HostFacts) {
    for line in text.lines() {
        let (key, rest) = line.split_once(' ').unwrap_or((line, ""));
        match key {
            "hostname" => facts.hostname = rest.to_string(),
            "cores" => facts.cores = rest.parse().unwrap_or(0),
            "kernel" => facts.kernel = rest.to_string(),
            "cpu" => facts.cpu = rest.to_string(),
            "memkb" => facts.memory_bytes = rest.parse::<u64>().unwrap_or(0) * 1024,
            "availkb" => facts.memory_available_bytes = rest.parse::<u64>().unwrap_or(0) * 1024,
            "gpu" if !rest.trim().is_empty() => facts.gpus.push(rest.trim().to_string()),
            _ => {}
        }
    }
}

/// A port free on this machine's loopback now (an emulated host's namespace has every port
/// free too).
pub fn loopback_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// A port on another host: a random one among the unprivileged ports above the usual
/// ephemeral range's start (a taken one fails the run with rank 0's bind error, reported like
/// any failure).
pub fn random_port() -> anyhow::Result<u16> {
    let mut b = [0u8; 2];
    getrandom::fill(&mut b).map_err(|e| anyhow::anyhow!("drawing a port: {e}"))?;
    Ok(20_000 + u16::from_le_bytes(b) % 12_000)
}

/// Where the files of the run directory `dir` go under `remote_root` on another host, `dir`
/// being under `local_root` here (`runs/<id>` keeps its place below either).
pub fn files_under(local_root: &Path, remote_root: &Path, dir: &Path) -> PathBuf {
    match dir.strip_prefix(local_root) {
        Ok(rel) => remote_root.join(rel),
        Err(_) => remote_root.join(dir.file_name().unwrap_or_default()),
    }
}

/// The shell command, run on another host or node, that writes the files below `files` to its
/// stdout as a tar stream and removes them (nothing where the folder is not there).
pub fn pack_files(files: &Path) -> String {
    let d = quote(&files.display().to_string());
    format!("if [ -d {d} ]; then tar -C {d} -cf - . && rm -rf {d}; fi")
}

/// Unpack into `dir` the tar stream that [`pack_files`] sent back from `whence` (`host X`,
/// `node X`), naming it where either end failed.
pub fn unpack_files(whence: &str, packed: anyhow::Result<Output>, dir: &Path) -> anyhow::Result<()> {
    let o = packed.context("copying the run's files back")?;
    anyhow::ensure!(
        o.status.success(),
        "{whence}: copying the run's files back failed ({}): {}",
        o.status,
        String::from_utf8_lossy(&o.stderr).trim()
    );
    if o.stdout.is_empty() {
        return Ok(());
    }
    let mut tar = Command::new("tar");
    tar.arg("-C").arg(dir).args(["-xf", "-"]);
    let t = run_limited(tar, Some(&o.stdout), COLLECT_LIMIT).context("unpacking with tar")?;
    anyhow::ensure!(
        t.status.success(),
        "unpacking the files of {whence} ({}): {}",
        t.status,
        String::from_utf8_lossy(&t.stderr).trim()
    );
    Ok(())
}

/// `s` as one word of a POSIX shell command line.
pub fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// `[v6]` for an IPv6 address in `host:port`, anything else as it is.
pub fn bracket(addr: &str) -> String {
    if addr.contains(':') && !addr.starts_with('[') { format!("[{addr}]") } else { addr.to_string() }
}

/// The raw-TCP yardstick from `from` to `to` (the same site: over its loopback): the far end
/// (`gradsync-bench rawtcp-peer --listen`, `bench` being its path here, found on each site by
/// [`Site::binary`]) listens on `listen` at `to`, the near end streams `rounds` measurements of
/// `each` to it and measures the small-message latency; `files` is a directory the far end may
/// make.
pub fn measure_link(
    from: &dyn Site,
    to: &dyn Site,
    listen: &str,
    bench: &Path,
    files: &Path,
    rounds: usize,
    each: Duration,
) -> anyhow::Result<PeerReading> {
    let (from_name, to_name) = (from.label().unwrap_or_default(), to.label().unwrap_or_default());
    let args = ["rawtcp-peer".to_string(), "--listen".into(), format!("{}:0", bracket(listen))];
    let mut launch = to.launch(bench, &args, &[], files, None);
    let mut peer = launch
        .command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .with_context(|| format!("{to_name}: starting the yardstick's far end"))?;
    // The far end lives while this stdin stays open.
    let mut keep = peer.stdin.take();
    if let (Some(w), Some(bytes)) = (keep.as_mut(), launch.stdin.as_deref()) {
        let _ = w.write_all(bytes);
    }
    let result = (|| {
        let out = peer.stdout.take().context("the far end's stdout")?;
        let addr = wait_for_line(out, "gradsync-bench listening on ", Duration::from_secs(60))
            .with_context(|| format!("{to_name}: the yardstick's far end did not start"))?;
        let script = format!(
            "exec {} rawtcp-peer --to {} --rounds {} --seconds {}",
            quote(&from.binary(bench).display().to_string()),
            quote(&addr),
            rounds.max(1),
            each.as_secs_f64()
        );
        let limit = each * (rounds.max(1) as u32) * 2 + Duration::from_secs(60);
        let o = from.run(&script, limit)?;
        anyhow::ensure!(
            o.status.success(),
            "{from_name}: measuring the link to {to_name} failed ({}): {}",
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        );
        let text = String::from_utf8_lossy(&o.stdout);
        serde_json::from_str(text.trim()).with_context(|| format!("{from_name}: reading `{}`", text.trim()))
    })();
    drop(keep);
    if wait_until(&mut peer, Instant::now() + Duration::from_secs(10)).is_none() {
        let _ = peer.kill();
        let _ = peer.wait();
        eprintln!("gradsync-bench compare: {to_name}: the yardstick's far end was stopped");
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_keeps_every_argument_one_word() {
        assert_eq!(quote("a b"), "'a b'");
        assert_eq!(quote("it's"), "'it'\\''s'");
        assert_eq!(bracket("::1"), "[::1]");
        assert_eq!(bracket("10.0.0.1"), "10.0.0.1");
    }
}
