//! Where one process of a run goes and how it is started there: the seam the comparison's
//! runner ([`crate::exec`]) starts every process through. A [`Site`] is this machine
//! ([`crate::local`]), an emulated host's network namespace ([`crate::netns`]), another host
//! reached over ssh ([`crate::ssh`]) or a node of a Slurm allocation ([`crate::slurm`]); each
//! says how to run a command there, and what is the same everywhere (how a process is
//! launched, files copied in before and its files copied back after, the link between two
//! sites measured) is written once, here, over that. The runner never asks which site it has.
//!
//! Files travel as `tar` streams over the command's own pipes: [`Site::put`] streams a `tar`
//! made here into one unpacking there (`--copy-binaries`: this machine's binaries onto the
//! hosts and nodes that lack them, [`crate::binaries`]), [`Site::collect`] the other way.
//!
//! ```text
//!        exec, modes, machine, binaries, lib (the callers)
//!             |  Arc<dyn Site>, &dyn Pool
//!             v
//!          site.rs  (the traits, and launch / run / put / collect / measure_link once)
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

use crate::child::{Launch, run_limited, run_pipe, wait_for_line, wait_until};
use crate::rawtcp::PeerReading;
use crate::scenario::RunSpec;

/// How long bringing a run's files back from one site may take.
const COLLECT_LIMIT: Duration = Duration::from_secs(300);
/// How long copying files to one site may take: this machine's three binaries (some 300 MB
/// in a debug build, 50 MB in a release one) cross a 100 Mbit/s link in under 30 s.
const PUT_LIMIT: Duration = Duration::from_secs(600);

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

    /// Copy `local` (files or directories here, followed where they are symbolic links) into
    /// the directory `remote` there (made where missing), each under its own name and replacing
    /// what had that name: a `tar` stream made here ([`pack_command`]) on the stdin of a command
    /// there that unpacks it beside and renames each into place ([`unpack_script`]), within
    /// [`PUT_LIMIT`]. A file is replaced by one rename, so a process starting it there meanwhile
    /// runs the old whole or the new whole, never a half-written one.
    ///
    /// Where processes are this one's children the file system is this machine's (a namespace
    /// of it shares it): the same two `tar`s run here, and an item whose directory already is
    /// `remote` is left alone: it is in place, and a copy onto itself would only cost time.
    /// The error names the site and what failed (`tar` or `mktemp` missing there, no space, no
    /// permission, the time allowed), with what either end said.
    fn put(&self, local: &[&Path], remote: &Path) -> anyhow::Result<()> {
        let whence = self.label().unwrap_or_else(|| "this machine".into());
        let mut items = put_items(local).with_context(|| format!("{whence}: copying files there"))?;
        if self.is_child() {
            items.retain(|(dir, _)| !same_dir(dir, remote));
        }
        if items.is_empty() {
            return Ok(());
        }
        let names: Vec<String> = items.iter().map(|(_, n)| n.clone()).collect();
        let script = unpack_script(remote, &names);
        let far = if self.is_child() {
            let mut c = Command::new("/bin/sh");
            c.args(["-c", &script]);
            c
        } else {
            self.command(OsStr::new("/bin/sh"), &["-c".into(), script.into()], true)
        };
        let done = run_pipe(pack_command(&items), far, PUT_LIMIT);
        let launcher = done.as_ref().ok().and_then(|(_, there)| self.launcher_failure(there.status));
        put_outcome(&whence, &names, remote, done, launcher)
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

/// What [`Site::put`] copies: each of `local`'s directory (absolute) and name, checked here:
/// it exists, has a name, and no two share one (they would land on one path there).
fn put_items(local: &[&Path]) -> anyhow::Result<Vec<(PathBuf, String)>> {
    let mut items: Vec<(PathBuf, String)> = Vec::new();
    for p in local {
        let abs = std::path::absolute(p).with_context(|| format!("{}", p.display()))?;
        std::fs::metadata(&abs).with_context(|| format!("{}: cannot be read here", p.display()))?;
        let (Some(dir), Some(name)) = (abs.parent(), abs.file_name()) else {
            anyhow::bail!("{}: has no name to copy it under", p.display());
        };
        let name = name.to_string_lossy().into_owned();
        anyhow::ensure!(
            !items.iter().any(|(_, n)| *n == name),
            "two files named {name} would land on one path"
        );
        items.push((dir.to_path_buf(), name));
    }
    Ok(items)
}

/// Whether `a` and `b` are one directory of this machine (`b` existing).
fn same_dir(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// The `tar` run here that writes `items` (each a directory and a name in it) to its stdout,
/// following symbolic links (a link to a binary sends the binary). Each name goes as `./NAME`,
/// so that one starting with `-` is no option.
pub fn pack_command(items: &[(PathBuf, String)]) -> Command {
    let mut c = Command::new("tar");
    c.args(["-c", "-h", "-f", "-"]);
    for (dir, name) in items {
        c.arg("-C").arg(dir).arg(format!("./{name}"));
    }
    c
}

/// The shell command, run there, that unpacks the `tar` stream on its stdin into the
/// directory `remote` (made where missing), whose top-level entries are `names`: into a fresh
/// directory beside them first (`mktemp -d`, removed however the command ends), then each
/// renamed into place. A file replaces a file (or a link to one) by that rename alone; a
/// directory replaces a directory, which is removed first; a file never replaces a directory.
/// The files belong to whoever unpacks them, whatever their owner here. Every path is one
/// quoted word; a failing step ends it with that step's status (127: a program is missing).
pub fn unpack_script(remote: &Path, names: &[String]) -> String {
    let names: Vec<String> = names.iter().map(|n| quote(n)).collect();
    format!(
        "r={r}; mkdir -p -- \"$r\" || exit; \
         t=$(mktemp -d \"$r/.gradsync-put.XXXXXX\") || exit; trap 'rm -rf -- \"$t\"' EXIT; \
         tar --no-same-owner -C \"$t\" -xf - || exit; \
         for n in {names}; do \
           if [ -L \"$r/$n\" ] && [ -d \"$r/$n\" ]; then rm -f -- \"$r/$n\" || exit; \
           elif [ -d \"$r/$n\" ]; then \
             if [ -d \"$t/$n\" ]; then rm -rf -- \"$r/$n\" || exit; \
             else echo \"$r/$n is a directory: a file cannot replace it\" >&2; exit 1; fi; \
           fi; \
           mv -f -- \"$t/$n\" \"$r/$n\" || exit; \
         done",
        r = quote(&remote.display().to_string()),
        names = names.join(" "),
    )
}

/// What a failed copy to a site most likely met, from what the command there said and its
/// exit status; none where it says nothing known.
pub fn put_failure(stderr: &str, status: Option<i32>) -> Option<&'static str> {
    let l = stderr.to_lowercase();
    if l.contains("no space left") || l.contains("quota exceeded") {
        Some("no space left there")
    } else if l.contains("read-only file system") {
        Some("the file system there is read-only")
    } else if l.contains("permission denied") || l.contains("operation not permitted") {
        Some("no permission to write there")
    } else if status == Some(127) || l.contains("not found") {
        Some("a program it needs (tar, mktemp) is missing there")
    } else {
        None
    }
}

/// [`Site::put`]'s result from both ends of the pipe: the far end's failure first (the near
/// end's broken pipe is its echo), said with `launcher` where the command itself failed
/// ([`Site::launcher_failure`]), else with [`put_failure`]'s reading; then the near end's.
fn put_outcome(
    whence: &str,
    names: &[String],
    remote: &Path,
    done: anyhow::Result<(Output, Output)>,
    launcher: Option<&str>,
) -> anyhow::Result<()> {
    let what = format!("{whence}: copying {} into {}", names.join(", "), remote.display());
    let (here, there) = done.with_context(|| format!("{what} failed"))?;
    let said = |o: &Output| String::from_utf8_lossy(&o.stderr).trim().to_string();
    if !there.status.success() {
        let text = said(&there);
        let why = match launcher {
            Some(l) => l.to_string(),
            None => put_failure(&text, there.status.code()).map(|w| format!(" ({w})")).unwrap_or_default(),
        };
        anyhow::bail!("{what} failed: {}{why}: {text}", there.status);
    }
    anyhow::ensure!(
        here.status.success(),
        "{what} failed: reading them here with tar ({}): {}",
        here.status,
        said(&here)
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
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    use gradsync_testkit::Scratch;

    use crate::local::Local;

    /// A site that is not this one's children, whose commands run here with `path` as their
    /// PATH (when given) and, as a Slurm step, forward stdin only when asked.
    #[derive(Debug, Default)]
    struct Far {
        path: Option<PathBuf>,
    }

    impl Site for Far {
        fn label(&self) -> Option<String> {
            Some("far site".into())
        }

        fn command(&self, program: &OsStr, args: &[OsString], input: bool) -> Command {
            let mut c = Command::new("/bin/sh");
            let forward = if input { "exec \"$0\" \"$@\"" } else { "exec \"$0\" \"$@\" </dev/null" };
            c.args(["-c", forward]).arg(program).args(args);
            if let Some(p) = &self.path {
                c.env("PATH", p);
            }
            c
        }

        fn is_child(&self) -> bool {
            false
        }

        fn free_port(&self) -> anyhow::Result<u16> {
            loopback_port()
        }
    }

    fn write(path: &Path, text: &str, mode: u32) {
        std::fs::write(path, text).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn the_unpack_script_and_the_tar_here_keep_every_path_one_word() {
        let names = ["gradsync-worker".to_string(), "it's a bin".to_string(), "-rf".to_string()];
        let s = unpack_script(Path::new("/opt/my dir/o'k"), &names);
        assert!(s.starts_with("r='/opt/my dir/o'\\''k'; mkdir -p -- \"$r\" || exit; "), "{s}");
        assert!(s.contains("for n in 'gradsync-worker' 'it'\\''s a bin' '-rf'; do"), "{s}");
        // Unpacked beside, then renamed into place; the temporary directory goes however it ends.
        assert!(s.contains("t=$(mktemp -d \"$r/.gradsync-put.XXXXXX\")"), "{s}");
        assert!(s.contains("trap 'rm -rf -- \"$t\"' EXIT"), "{s}");
        assert!(s.contains("mv -f -- \"$t/$n\" \"$r/$n\""), "{s}");
        let items = [(PathBuf::from("/a b"), "it's".to_string()), (PathBuf::from("/c"), "-rf".to_string())];
        let c = pack_command(&items);
        let args: Vec<String> = c.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
        assert_eq!(args, ["-c", "-h", "-f", "-", "-C", "/a b", "./it's", "-C", "/c", "./-rf"]);
    }

    #[test]
    fn put_copies_files_and_directories_under_names_with_spaces_and_quotes() {
        let dir = Scratch::new("put");
        let src = dir.join("s p'ace");
        std::fs::create_dir_all(src.join("a dir/deep")).unwrap();
        let (bin, tree, link) = (src.join("we'ird bin"), src.join("a dir"), src.join("-link"));
        write(&bin, "#!/bin/sh\necho new\n", 0o755);
        write(&tree.join("deep/f"), "f1", 0o644);
        std::os::unix::fs::symlink(&bin, &link).unwrap();
        for (site, to) in [(&Far::default() as &dyn Site, "far"), (&Local, "here")] {
            let dest = dir.join(format!("de st'/{to}"));
            // A first copy, then another over it: each file replaced by a rename (a hard link to
            // the old one keeps the old bytes), a directory replaced whole.
            site.put(&[&bin, &tree], &dest).unwrap();
            std::fs::hard_link(dest.join("we'ird bin"), dest.join("old")).unwrap();
            write(&dest.join("a dir/stale"), "x", 0o644);
            write(&bin, "#!/bin/sh\necho newer\n", 0o755);
            site.put(&[&bin, &tree, &link], &dest).unwrap();
            let got = std::fs::read_to_string(dest.join("we'ird bin")).unwrap();
            assert_eq!(got, "#!/bin/sh\necho newer\n", "{to}");
            assert_eq!(std::fs::read_to_string(dest.join("old")).unwrap(), "#!/bin/sh\necho new\n", "{to}");
            let mode = std::fs::metadata(dest.join("we'ird bin")).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o755, "{to}");
            assert_eq!(std::fs::read_to_string(dest.join("a dir/deep/f")).unwrap(), "f1", "{to}");
            assert!(!dest.join("a dir/stale").exists(), "{to}: the old directory was kept");
            // A link sends what it points to.
            let l = std::fs::symlink_metadata(dest.join("-link")).unwrap();
            assert!(l.is_file(), "{to}: {l:?}");
            let left: Vec<String> = std::fs::read_dir(&dest)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(".gradsync-put"))
                .collect();
            assert!(left.is_empty(), "{to}: {left:?} left behind");
            write(&bin, "#!/bin/sh\necho new\n", 0o755);
        }
    }

    #[test]
    fn a_put_where_the_files_are_is_nothing_here_and_harmless_elsewhere() {
        let dir = Scratch::new("put-in-place");
        let f = dir.join("gradsync-worker");
        write(&f, "bytes", 0o755);
        let inode = std::fs::metadata(&f).unwrap().ino();
        // This machine: nothing done (the same inode), whatever way the path is written.
        Local.put(&[&f], &dir.join(".")).unwrap();
        assert_eq!(std::fs::metadata(&f).unwrap().ino(), inode);
        // Another site given the same path: unpacked beside, then renamed, never over itself.
        Far::default().put(&[&f], dir.path()).unwrap();
        assert_eq!(std::fs::read_to_string(&f).unwrap(), "bytes");
    }

    #[test]
    fn a_failed_put_names_the_site_and_what_failed() {
        let dir = Scratch::new("put-fails");
        let f = dir.join("gradsync-server");
        write(&f, "bytes", 0o755);
        let msg = |site: &dyn Site, local: &[&Path], remote: &Path| {
            format!("{:#}", site.put(local, remote).unwrap_err())
        };
        let e = msg(&Far::default(), &[&dir.join("nope")], dir.path());
        assert!(
            e.contains("far site: copying files there") && e.contains("nope: cannot be read here"),
            "{e}"
        );
        std::fs::create_dir_all(dir.join("other")).unwrap();
        write(&dir.join("other/gradsync-server"), "other", 0o755);
        let e = msg(&Far::default(), &[&f, &dir.join("other/gradsync-server")], &dir.join("d"));
        assert!(e.contains("two files named gradsync-server"), "{e}");
        // A destination under a file: mkdir there fails, named with the path.
        let e = msg(&Far::default(), &[&f], &f.join("sub"));
        assert!(
            e.starts_with(&format!(
                "far site: copying gradsync-server into {} failed: exit status: 1",
                f.join("sub").display()
            )) && e.contains("Not a directory"),
            "{e}"
        );
        // A file never replaces a directory.
        std::fs::create_dir_all(dir.join("d/gradsync-server")).unwrap();
        let e = msg(&Local, &[&f], &dir.join("d"));
        assert!(
            e.starts_with("this machine: copying gradsync-server into") && e.contains("is a directory"),
            "{e}"
        );
        // No tar there: named as what is missing, and nothing left behind.
        let tools = dir.join("tools");
        std::fs::create_dir_all(&tools).unwrap();
        for t in ["mkdir", "mktemp", "rm", "mv"] {
            let found =
                ["/usr/bin", "/bin"].iter().map(|d| Path::new(d).join(t)).find(|p| p.exists()).unwrap();
            std::os::unix::fs::symlink(found, tools.join(t)).unwrap();
        }
        let e = msg(&Far { path: Some(tools) }, &[&f], &dir.join("e"));
        assert!(e.contains("exit status: 127 (a program it needs (tar, mktemp) is missing there)"), "{e}");
        assert_eq!(std::fs::read_dir(dir.join("e")).unwrap().count(), 0, "left behind in e");
        // What the far end says is read for its likely cause.
        for (said, code, why) in [
            ("tar: ./gradsync-bench: Cannot write: No space left on device", 2, "no space left there"),
            ("mkdir: cannot create directory '/opt/g': Permission denied", 1, "no permission to write there"),
            ("mktemp: failed to create directory via template: Read-only file system", 1, "read-only"),
            ("sh: 1: tar: not found", 127, "is missing there"),
        ] {
            assert!(put_failure(said, Some(code)).unwrap().contains(why), "{said}");
        }
        assert_eq!(put_failure("tar: something else", Some(2)), None);
    }

    #[test]
    fn quoting_keeps_every_argument_one_word() {
        assert_eq!(quote("a b"), "'a b'");
        assert_eq!(quote("it's"), "'it'\\''s'");
        assert_eq!(bracket("::1"), "[::1]");
        assert_eq!(bracket("10.0.0.1"), "10.0.0.1");
    }
}
