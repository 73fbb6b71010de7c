//! `compare --hosts`: the comparison's processes on other hosts, started with the system's
//! `ssh` (BatchMode, so a missing key fails at once instead of asking; the user's keys and
//! `~/.ssh/config`; more options from `--ssh-opts` or `GRADSYNC_SSH_OPTS`).
//!
//! A [`Host`] is a [`Site`] (how a command is started there; launching a process, and bringing
//! its files back, are the trait's, written once) and the checked [`Hosts`] a [`Pool`].
//! Every remote process runs under `gradsync-worker supervise` ([`gradsync_worker::supervise`]):
//! the run's secrets travel on the ssh session's stdin into the process's environment (never
//! on a command line), and when the session ends (the run is over, the runner stopped or was
//! killed, the link died) the supervisor stops the process's whole group on that host. Each
//! process writes its files under `--remote-dir` on its host; they come back into the run
//! directory with `tar` over the same ssh when the run ends.
//!
//! Before the first run every host is checked in parallel: it answers over ssh, it has the
//! same gradsync binaries at the same path as this machine (`--version` and a SHA-256 of each
//! file, [`crate::binaries`]; with `--copy-binaries` a host lacking them gets this machine's
//! put there and is checked again), and what it is (CPU, cores, memory, GPUs, kernel) is
//! recorded for the report.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use crate::binaries::{LocalBinaries, check_script, copy_and_check, read_check, refusal};
use crate::child::run_limited;
use crate::hostfile::HostEntry;
use crate::place::{assign, placement_short};
use crate::rawtcp::PeerReading;
use crate::scenario::RunSpec;
use crate::site::{HostFacts, Pool, Site, Slot, files_under, quote, random_port};

/// How long ssh may take to connect (`ConnectTimeout`), unless `--ssh-opts` says otherwise.
const CONNECT_TIMEOUT_S: u64 = 10;
/// How long the start check on one host may take, connection included.
const CHECK_LIMIT: Duration = Duration::from_secs(60);

/// The ssh settings every host of a comparison shares.
#[derive(Debug)]
pub struct Conn {
    /// `ssh`'s options, ours then the user's.
    options: Vec<String>,
    /// The directory on every host under which processes write (`runs/<id>/` below it).
    remote_root: PathBuf,
    /// The run directory here, whose `runs/<id>` map onto `remote_root`'s.
    local_root: PathBuf,
    /// Where the binaries are on every host.
    bin_dir: PathBuf,
    /// The directory of the shared connections' sockets, removed at the end.
    control: PathBuf,
    /// Set once the hosts have been tidied.
    tidied: std::sync::atomic::AtomicBool,
}

/// One host of `--hosts`.
#[derive(Debug)]
pub struct Host {
    /// The name ssh is given.
    pub name: String,
    /// The address the other hosts reach it at.
    pub addr: String,
    /// Processes it takes.
    pub slots: usize,
    /// What it is.
    pub facts: HostFacts,
    conn: Arc<Conn>,
}

/// The options `compare --hosts` takes besides the list.
#[derive(Debug, Clone, Default)]
pub struct SshArgs {
    /// More ssh options, split at white space (`-F FILE -o User=me`).
    pub ssh_opts: Option<String>,
    /// Where processes write on the hosts (default: a fresh directory under /tmp).
    pub remote_dir: Option<PathBuf>,
    /// Where the binaries are on the hosts (default: where they are here).
    pub remote_bin_dir: Option<PathBuf>,
    /// Put this machine's binaries there on a host that lacks them or has another build.
    pub copy_binaries: bool,
}

/// The hosts of a comparison, checked.
#[derive(Debug)]
pub struct Hosts {
    /// In the list's order.
    pub hosts: Vec<Arc<Host>>,
    /// Every name of the list, checked or not: each may hold a shared connection.
    names: Vec<String>,
    conn: Arc<Conn>,
}

impl Site for Host {
    fn label(&self) -> Option<String> {
        Some(format!("host {}", self.name))
    }

    /// `ssh [options] NAME 'PROGRAM' 'ARG'...`: the remote shell gets one command line, every
    /// word quoted; ssh forwards its stdin whatever `input` says.
    fn command(&self, program: &OsStr, args: &[OsString], _input: bool) -> Command {
        let mut remote = quote(&program.to_string_lossy());
        for a in args {
            remote.push(' ');
            remote.push_str(&quote(&a.to_string_lossy()));
        }
        let mut c = Command::new("ssh");
        c.args(&self.conn.options).arg(&self.name).arg(remote);
        c
    }

    fn is_child(&self) -> bool {
        false
    }

    fn free_port(&self) -> anyhow::Result<u16> {
        random_port()
    }

    /// The binary of the same name in the hosts' binaries' directory.
    fn binary(&self, local: &Path) -> PathBuf {
        self.conn.bin_dir.join(local.file_name().unwrap_or(local.as_os_str()))
    }

    fn files_dir(&self, dir: &Path) -> PathBuf {
        files_under(&self.conn.local_root, &self.conn.remote_root, dir)
    }

    fn facts(&self) -> Option<&HostFacts> {
        Some(&self.facts)
    }

    fn launcher_failure(&self, status: ExitStatus) -> Option<&'static str> {
        (status.code() == Some(255))
            .then_some(" (ssh's own failure: the connection to the host was lost or refused)")
    }
}

impl From<&Arc<Host>> for Slot {
    fn from(h: &Arc<Host>) -> Slot {
        Slot { addr: h.addr.clone(), site: h.clone() }
    }
}

/// The options of every ssh command: the user's (`--ssh-opts`, `GRADSYNC_SSH_OPTS`), then
/// ours; and the directory of the shared connections' sockets, made here.
fn ssh_options(a: &SshArgs) -> anyhow::Result<(Vec<String>, PathBuf)> {
    // The user's options first: ssh keeps the first value it is given for each.
    let user = a.ssh_opts.clone().or_else(|| std::env::var("GRADSYNC_SSH_OPTS").ok()).unwrap_or_default();
    let mut options: Vec<String> = user.split_whitespace().map(String::from).collect();
    options.extend::<Vec<String>>(
        [
            "-T".to_string(),
            "-o".into(),
            "BatchMode=yes".into(),
            "-o".into(),
            format!("ConnectTimeout={CONNECT_TIMEOUT_S}"),
            "-o".into(),
            "ServerAliveInterval=5".into(),
            "-o".into(),
            "ServerAliveCountMax=3".into(),
            "-o".into(),
            "LogLevel=ERROR".into(),
        ]
        .into(),
    );
    // One connection per host for the whole comparison, every session a channel of it:
    // a run's processes then start without a key exchange each. Its socket lives in a
    // directory of this process's own; an idle master leaves after a minute even if this
    // process is killed.
    let control = std::env::temp_dir().join(format!("gradsync-ssh-{}", std::process::id()));
    std::fs::create_dir_all(&control).with_context(|| format!("creating {}", control.display()))?;
    std::fs::set_permissions(&control, std::os::unix::fs::PermissionsExt::from_mode(0o700))
        .with_context(|| format!("restricting {}", control.display()))?;
    options.extend::<Vec<String>>(
        [
            "-o".to_string(),
            "ControlMaster=auto".into(),
            "-o".into(),
            format!("ControlPath={}/%C", control.display()),
            "-o".into(),
            "ControlPersist=60".into(),
        ]
        .into(),
    );
    Ok((options, control))
}

/// Why ssh to `name` failed, from its exit status 255 and what it said.
fn ssh_failure(name: &str, stderr: &str) -> String {
    let said = stderr.trim().lines().last().unwrap_or("").trim();
    let l = stderr.to_lowercase();
    if l.contains("permission denied") || l.contains("authentication") || l.contains("host key verification")
    {
        format!("host {name}: ssh login refused (BatchMode: no password is asked): {said}")
    } else if l.contains("could not resolve") || l.contains("name or service not known") {
        format!("host {name}: unknown host: {said}")
    } else {
        format!("host {name} unreachable over ssh: {said}")
    }
}

impl Hosts {
    /// Check every host of `entries` in parallel and describe it: reachable over ssh, the same
    /// binaries as `local` (this machine's; with `a.copy_binaries` put on a host that lacks
    /// them or has another build, then checked again). Every host that fails is named, with why.
    pub fn connect(
        entries: &[HostEntry],
        a: &SshArgs,
        local: &LocalBinaries,
        local_root: &Path,
    ) -> anyhow::Result<Hosts> {
        anyhow::ensure!(!entries.is_empty(), "--hosts: no hosts");
        let (options, control) = ssh_options(a)?;
        let bin_dir = match &a.remote_bin_dir {
            Some(d) => d.clone(),
            None => local.paths[0].parent().map(Path::to_path_buf).context("the binaries' directory")?,
        };
        anyhow::ensure!(bin_dir.is_absolute(), "--remote-bin-dir {}: must be absolute", bin_dir.display());
        let remote_root = match &a.remote_dir {
            Some(d) => d.clone(),
            None => {
                let secs = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                PathBuf::from(format!("/tmp/gradsync-compare-{secs}-{}", std::process::id()))
            }
        };
        anyhow::ensure!(
            remote_root.is_absolute(),
            "--remote-dir {}: must be absolute",
            remote_root.display()
        );
        let local_root = std::path::absolute(local_root).unwrap_or_else(|_| local_root.to_path_buf());
        let conn = Arc::new(Conn {
            options,
            remote_root,
            local_root,
            bin_dir: bin_dir.clone(),
            control,
            tidied: false.into(),
        });
        let script = check_script(&bin_dir);
        let copy = a.copy_binaries;
        let results: Vec<Result<(Host, bool), String>> = std::thread::scope(|s| {
            let handles: Vec<_> = entries
                .iter()
                .map(|e| {
                    let (conn, script) = (conn.clone(), &script);
                    s.spawn(move || check_host(e, conn, script, local, copy))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("the check's thread panicked".into())))
                .collect()
        });
        let mut hosts =
            Hosts { hosts: Vec::new(), names: entries.iter().map(|e| e.name.clone()).collect(), conn };
        let (mut errors, mut copied) = (Vec::new(), 0);
        for r in results {
            match r {
                Ok((h, c)) => {
                    copied += usize::from(c);
                    hosts.hosts.push(Arc::new(h));
                }
                Err(e) => errors.push(e),
            }
        }
        // On failure, dropping `hosts` closes the connections the check opened.
        anyhow::ensure!(errors.is_empty(), "--hosts: {}", errors.join("; "));
        if copy && copied == 0 {
            eprintln!(
                "gradsync-bench compare: --copy-binaries: every host already has this machine's binaries in {}; \
                 nothing copied",
                bin_dir.display()
            );
        }
        Ok(hosts)
    }

    /// The remote directory every host's processes write under.
    pub fn remote_root(&self) -> &Path {
        &self.conn.remote_root
    }

    /// Where the processes of `spec` go ([`assign`]): the host of each server shard and of
    /// each worker rank, or why the hosts cannot take them.
    #[allow(clippy::type_complexity)]
    pub fn place(&self, spec: &RunSpec) -> Result<(Vec<Arc<Host>>, Vec<Arc<Host>>), String> {
        let slots: Vec<usize> = self.hosts.iter().map(|h| h.slots).collect();
        let (servers, workers) = assign(&slots, spec.mode, spec.workers, spec.shards)?;
        let facts: Vec<&HostFacts> = self.hosts.iter().map(|h| &h.facts).collect();
        if let Some(why) = placement_short(spec, &facts, &servers, &workers, "host") {
            return Err(why);
        }
        let host = |i: &usize| self.hosts[*i].clone();
        Ok((servers.iter().map(host).collect(), workers.iter().map(host).collect()))
    }
}

impl Pool for Hosts {
    fn sites(&self) -> Vec<Arc<dyn Site>> {
        self.hosts.iter().map(|h| h.clone() as Arc<dyn Site>).collect()
    }

    fn launcher(&self) -> &'static str {
        "ssh"
    }

    fn what(&self) -> &'static str {
        "the hosts"
    }

    fn place_slots(&self, spec: &RunSpec) -> Result<(Vec<Slot>, Vec<Slot>), String> {
        let (servers, workers) = self.place(spec)?;
        Ok((servers.iter().map(Slot::from).collect(), workers.iter().map(Slot::from).collect()))
    }

    /// Measured by `gradsync-bench rawtcp-peer` on both hosts.
    fn measure_link(&self, rounds: usize, each: Duration) -> anyhow::Result<PeerReading> {
        let from = &self.hosts[0];
        let to = self.hosts.get(1).unwrap_or(from);
        let listen =
            if std::ptr::eq(from.as_ref(), to.as_ref()) { "127.0.0.1".to_string() } else { to.addr.clone() };
        crate::site::measure_link(
            from.as_ref(),
            to.as_ref(),
            &listen,
            &self.conn.bin_dir.join("gradsync-bench"),
            &self.conn.remote_root,
            rounds,
            each,
        )
    }

    /// Remove the (then empty) remote directories the runs used, on every host,
    /// and close the shared connections; once.
    fn tidy(&self) {
        if self.conn.tidied.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let root = quote(&self.conn.remote_root.display().to_string());
        let runs = quote(&self.conn.remote_root.join("runs").display().to_string());
        std::thread::scope(|s| {
            for h in &self.hosts {
                s.spawn(|| {
                    let _ = h.run(&format!("rmdir {runs} {root} 2>/dev/null; true"), Duration::from_secs(30));
                });
            }
        });
        std::thread::scope(|s| {
            for name in &self.names {
                let options = &self.conn.options;
                s.spawn(move || {
                    let mut exit = Command::new("ssh");
                    exit.args(options).args(["-O", "exit"]).arg(name);
                    let _ = run_limited(exit, None, Duration::from_secs(10));
                });
            }
        });
        let _ = std::fs::remove_dir_all(&self.conn.control);
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        self.tidy();
    }
}

/// Check one host: its address, that ssh logs in, its binaries (with `copy`, this machine's
/// put there where they are missing or another build, and checked again), its facts. The
/// host, and whether the binaries were copied there.
fn check_host(
    e: &HostEntry,
    conn: Arc<Conn>,
    script: &str,
    local: &LocalBinaries,
    copy: bool,
) -> Result<(Host, bool), String> {
    let addr = match &e.addr {
        Some(a) => a.clone(),
        None => resolve(&e.name, &conn.options).map_err(|err| format!("host {}: {err:#}", e.name))?,
    };
    let host =
        Host { name: e.name.clone(), addr: addr.clone(), slots: e.slots, facts: HostFacts::default(), conn };
    let o = host
        .run(script, CHECK_LIMIT)
        .map_err(|err| format!("host {} unreachable over ssh: {err:#}", e.name))?;
    let stderr = String::from_utf8_lossy(&o.stderr);
    if o.status.code() == Some(255) {
        return Err(ssh_failure(&e.name, &stderr));
    }
    let text = String::from_utf8_lossy(&o.stdout);
    if !o.status.success() || !text.lines().any(|l| l == "end") {
        return Err(format!("host {}: the check failed ({}): {}", e.name, o.status, stderr.trim()));
    }
    let base = HostFacts { name: e.name.clone(), addr, slots: e.slots, ..HostFacts::default() };
    let bin_dir = &host.conn.bin_dir;
    match read_check(&text, base.clone(), &local.expected, bin_dir) {
        Ok(facts) => Ok((Host { facts, ..host }, false)),
        Err(_) if copy => {
            let facts =
                copy_and_check(&host, local, bin_dir, base, CHECK_LIMIT).map_err(|err| format!("{err:#}"))?;
            Ok((Host { facts, ..host }, true))
        }
        Err(problems) => Err(refusal(&format!("host {}", e.name), &problems)),
    }
}

/// The address ssh reaches `name` at (`ssh -G`: the `HostName` of the user's config).
fn resolve(name: &str, options: &[String]) -> anyhow::Result<String> {
    let mut c = Command::new("ssh");
    c.args(options).arg("-G").arg(name);
    let o = run_limited(c, None, Duration::from_secs(30)).context("ssh -G")?;
    anyhow::ensure!(o.status.success(), "ssh -G failed: {}", String::from_utf8_lossy(&o.stderr).trim());
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("hostname ").map(|h| h.trim().to_string()))
        .context("ssh -G named no hostname")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn ssh_failures_say_which_host_and_why() {
        let e = ssh_failure("node2", "root@node2: Permission denied (publickey).\n");
        assert!(e.contains("host node2: ssh login refused") && e.contains("publickey"), "{e}");
        let e = ssh_failure("node3", "ssh: connect to host 10.0.0.3 port 22: Connection refused\n");
        assert!(e.contains("host node3 unreachable") && e.contains("Connection refused"), "{e}");
    }
}
