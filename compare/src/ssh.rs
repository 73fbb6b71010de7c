//! `compare --hosts`: the comparison's processes on other hosts, started with the system's
//! `ssh` (BatchMode, so a missing key fails at once instead of asking; the user's keys and
//! `~/.ssh/config`; more options from `--ssh-opts` or `GRADSYNC_SSH_OPTS`).
//!
//! Every remote process runs under `gradsync-worker supervise` ([`gradsync_worker::supervise`]):
//! the run's secrets travel on the ssh session's stdin into the process's environment (never
//! on a command line), and when the session ends (the run is over, the runner stopped or was
//! killed, the link died) the supervisor stops the process's whole group on that host. Each
//! process writes its files under `--remote-dir` on its host; they come back into the run
//! directory with `tar` over the same ssh when the run ends.
//!
//! Before the first run every host is checked in parallel: it answers over ssh, it has the
//! same gradsync binaries at the same path as this machine (`--version` and a SHA-256 of each
//! file), and what it is (CPU, cores, memory, GPUs, kernel) is recorded for the report.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use serde::{Deserialize, Serialize};
use sha2::Digest;

use super::child::{Launch, run_limited};
use super::hostfile::HostEntry;
use super::scenario::{ModeKind, RunSpec};

/// The binaries every host must have, in the same build as this machine's.
pub const BINARIES: [&str; 3] = ["gradsync-worker", "gradsync-server", "gradsync-bench"];

/// How long ssh may take to connect (`ConnectTimeout`), unless `--ssh-opts` says otherwise.
const CONNECT_TIMEOUT_S: u64 = 10;
/// How long the start check on one host may take, connection included.
const CHECK_LIMIT: Duration = Duration::from_secs(60);
/// How long bringing a run's files back from one host may take.
const COLLECT_LIMIT: Duration = Duration::from_secs(300);

/// What a host is, as recorded in `machine.json` (`hosts`).
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

impl Host {
    /// `ssh [options] NAME REMOTE`: `remote` is one shell command line on the host.
    fn command(&self, remote: &str) -> Command {
        let mut c = Command::new("ssh");
        c.args(&self.conn.options).arg(&self.name).arg(remote);
        c
    }

    /// Start `program args` on this host under the supervisor, its environment's `env` sent
    /// on stdin, after making `files` there; the lines appended to `follow` come back on its
    /// stdout.
    pub fn launch(
        &self,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        files: &Path,
        follow: Option<&Path>,
    ) -> Launch {
        let program = self.conn.bin_dir.join(program.file_name().unwrap_or(program.as_os_str()));
        let supervisor = self.conn.bin_dir.join("gradsync-worker");
        let follow =
            follow.map(|f| format!(" --follow {}", quote(&f.display().to_string()))).unwrap_or_default();
        let mut remote = format!(
            "mkdir -p {} && exec {} supervise{follow} -- {}",
            quote(&files.display().to_string()),
            quote(&supervisor.display().to_string()),
            quote(&program.display().to_string())
        );
        for a in args {
            remote.push(' ');
            remote.push_str(&quote(a));
        }
        let mut stdin = String::new();
        for (k, v) in env {
            stdin.push_str(&format!("{k}={v}\n"));
        }
        stdin.push('\n');
        Launch { command: self.command(&remote), stdin: Some(stdin.into_bytes()) }
    }

    /// Where this host's processes write the files of the run directory `dir`.
    pub fn files_dir(&self, dir: &Path) -> PathBuf {
        match dir.strip_prefix(&self.conn.local_root) {
            Ok(rel) => self.conn.remote_root.join(rel),
            Err(_) => self.conn.remote_root.join(dir.file_name().unwrap_or_default()),
        }
    }

    /// Copy what the run's processes wrote here into `dir` (`tar` over ssh), then remove it
    /// from the host. A host where nothing was written (another host of a shared file system
    /// took it already) gives nothing.
    pub fn collect(&self, dir: &Path) -> anyhow::Result<()> {
        let o = self.run(&pack_files(&self.files_dir(dir)), None, COLLECT_LIMIT);
        unpack_files(&format!("host {}", self.name), o, dir)
    }

    /// Run `remote` here with `stdin` written to it, waiting at most `limit`.
    pub fn run(&self, remote: &str, stdin: Option<&[u8]>, limit: Duration) -> anyhow::Result<Output> {
        run_limited(self.command(remote), stdin, limit).with_context(|| format!("host {}", self.name))
    }
}

/// `s` as one word of a POSIX shell command line.
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

pub fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// What this machine's binaries are: each one's `--version` line and SHA-256.
fn identity(path: &Path) -> anyhow::Result<(String, String)> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let sha = sha2::Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
    let out = run_limited(
        {
            let mut c = Command::new(path);
            c.arg("--version");
            c
        },
        None,
        Duration::from_secs(30),
    )
    .with_context(|| format!("{} --version", path.display()))?;
    Ok((String::from_utf8_lossy(&out.stdout).trim().to_string(), sha))
}

/// What the check prints on a host: one `key value` a line.
fn check_script(bin_dir: &Path) -> String {
    let mut s = String::new();
    for b in BINARIES {
        let p = quote(&bin_dir.join(b).display().to_string());
        s.push_str(&format!(
            "if [ -x {p} ]; then echo \"bin {b} $(sha256sum < {p} | cut -d' ' -f1) $({p} --version)\"; \
             else echo \"missing {b}\"; fi; "
        ));
    }
    s.push_str(FACTS_SCRIPT);
    s
}

/// What a host or node is, one `key value` a line ([`read_check`] reads it), then `end`:
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
    /// binaries as `local_bins` (this machine's gradsync-worker, gradsync-server and
    /// gradsync-bench, in that order). Every host that fails is named, with why.
    pub fn connect(
        entries: &[HostEntry],
        a: &SshArgs,
        local_bins: &[PathBuf; 3],
        local_root: &Path,
    ) -> anyhow::Result<Hosts> {
        anyhow::ensure!(!entries.is_empty(), "--hosts: no hosts");
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
        let bin_dir = match &a.remote_bin_dir {
            Some(d) => d.clone(),
            None => local_bins[0].parent().map(Path::to_path_buf).context("the binaries' directory")?,
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
        let mut expected = Vec::new();
        for (b, p) in BINARIES.iter().zip(local_bins) {
            let (version, sha) = identity(p).with_context(|| format!("this machine's {b}"))?;
            expected.push((b.to_string(), version, sha));
        }
        let script = check_script(&bin_dir);
        let results: Vec<Result<Host, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = entries
                .iter()
                .map(|e| {
                    let (conn, script, expected) = (conn.clone(), &script, &expected);
                    s.spawn(move || check_host(e, conn, script, expected))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("the check's thread panicked".into())))
                .collect()
        });
        let mut hosts =
            Hosts { hosts: Vec::new(), names: entries.iter().map(|e| e.name.clone()).collect(), conn };
        let mut errors = Vec::new();
        for r in results {
            match r {
                Ok(h) => hosts.hosts.push(Arc::new(h)),
                Err(e) => errors.push(e),
            }
        }
        // On failure, dropping `hosts` closes the connections the check opened.
        anyhow::ensure!(errors.is_empty(), "--hosts: {}", errors.join("; "));
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
        if let Some(why) = super::machine::placement_short(spec, &facts, &servers, &workers, "host") {
            return Err(why);
        }
        let host = |i: &usize| self.hosts[*i].clone();
        Ok((servers.iter().map(host).collect(), workers.iter().map(host).collect()))
    }

    /// The raw-TCP yardstick between the first two hosts (one host: over its own loopback):
    /// `rounds` measurements streaming `each`, and the small-message latency, as measured by
    /// `gradsync-bench rawtcp-peer` on both.
    pub fn measure_link(&self, rounds: usize, each: Duration) -> anyhow::Result<crate::rawtcp::PeerReading> {
        let from = &self.hosts[0];
        let to = self.hosts.get(1).unwrap_or(from);
        let listen =
            if std::ptr::eq(from.as_ref(), to.as_ref()) { "127.0.0.1".to_string() } else { to.addr.clone() };
        super::site::measure_link(
            &super::site::Site::Ssh(from.clone()),
            &super::site::Site::Ssh(to.clone()),
            &listen,
            &self.conn.bin_dir.join("gradsync-bench"),
            &self.conn.remote_root,
            rounds,
            each,
        )
    }

    /// The hosts' descriptions, in order.
    pub fn facts(&self) -> Vec<HostFacts> {
        self.hosts.iter().map(|h| h.facts.clone()).collect()
    }

    /// Remove the (then empty) remote directories the runs used, on every host,
    /// and close the shared connections; once.
    pub fn tidy(&self) {
        if self.conn.tidied.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let root = quote(&self.conn.remote_root.display().to_string());
        let runs = quote(&self.conn.remote_root.join("runs").display().to_string());
        std::thread::scope(|s| {
            for h in &self.hosts {
                s.spawn(|| {
                    let _ = h.run(
                        &format!("rmdir {runs} {root} 2>/dev/null; true"),
                        None,
                        Duration::from_secs(30),
                    );
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

/// `[v6]` for an IPv6 address in `host:port`, anything else as it is.
pub fn bracket(addr: &str) -> String {
    if addr.contains(':') && !addr.starts_with('[') { format!("[{addr}]") } else { addr.to_string() }
}

/// Check one host: its address, that ssh logs in, its binaries, its facts.
fn check_host(
    e: &HostEntry,
    conn: Arc<Conn>,
    script: &str,
    expected: &[(String, String, String)],
) -> Result<Host, String> {
    let addr = match &e.addr {
        Some(a) => a.clone(),
        None => resolve(&e.name, &conn.options).map_err(|err| format!("host {}: {err:#}", e.name))?,
    };
    let host =
        Host { name: e.name.clone(), addr: addr.clone(), slots: e.slots, facts: HostFacts::default(), conn };
    let o = host
        .run(script, None, CHECK_LIMIT)
        .map_err(|err| format!("host {} unreachable over ssh: {err:#}", e.name))?;
    let stderr = String::from_utf8_lossy(&o.stderr);
    if o.status.code() == Some(255) {
        return Err(ssh_failure(&e.name, &stderr));
    }
    let text = String::from_utf8_lossy(&o.stdout);
    if !o.status.success() || !text.lines().any(|l| l == "end") {
        return Err(format!("host {}: the check failed ({}): {}", e.name, o.status, stderr.trim()));
    }
    let facts = HostFacts { name: e.name.clone(), addr, slots: e.slots, ..HostFacts::default() };
    let facts = read_check(&text, facts, expected, &host.conn.bin_dir)
        .map_err(|problems| format!("host {} {}", e.name, problems.join(", and ")))?;
    Ok(Host { facts, ..host })
}

/// What the check printed on a host ([`check_script`], [`FACTS_SCRIPT`]): its facts, or what
/// is wrong with its binaries against `expected` (each one's name, `--version` and SHA-256 here).
pub fn read_check(
    text: &str,
    mut facts: HostFacts,
    expected: &[(String, String, String)],
    bin_dir: &Path,
) -> Result<HostFacts, Vec<String>> {
    let short = |s: &str| s.chars().take(12).collect::<String>();
    let mut problems = Vec::new();
    for line in text.lines() {
        let (key, rest) = line.split_once(' ').unwrap_or((line, ""));
        match key {
            "missing" => problems.push(format!("lacks {}", bin_dir.join(rest).display())),
            "bin" => {
                let mut w = rest.splitn(3, ' ');
                let (b, sha, version) =
                    (w.next().unwrap_or(""), w.next().unwrap_or(""), w.next().unwrap_or(""));
                if let Some((_, v, s)) = expected.iter().find(|(n, _, _)| n == b)
                    && (v != version || s != sha)
                {
                    problems.push(format!(
                        "has another {} ({version}, sha256 {}) than this machine ({v}, sha256 {})",
                        bin_dir.join(b).display(),
                        short(sha),
                        short(s)
                    ));
                }
            }
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
    if problems.is_empty() { Ok(facts) } else { Err(problems) }
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

/// Which host each server shard and each worker rank of a run goes to, given each host's
/// slots: parameter-server shards on hosts of their own when enough are left for the workers
/// (else shard `i` on host `i` among the workers), workers spread over their hosts in turn,
/// each host taking at most its slots; a ring over every host; `local` and `dp` (one process)
/// on the first; `ddp-shm` (shared memory) on one host with the slots for every rank.
pub fn assign(
    slots: &[usize],
    mode: ModeKind,
    workers: usize,
    shards: usize,
) -> Result<(Vec<usize>, Vec<usize>), String> {
    let n = slots.len();
    if n == 0 {
        return Err("no hosts".into());
    }
    match mode.base() {
        ModeKind::Local | ModeKind::Dp => return Ok((vec![], vec![0])),
        ModeKind::DdpShm => {
            return match slots.iter().position(|&s| s >= workers) {
                Some(h) => Ok((vec![], vec![h; workers])),
                None => Err(format!(
                    "ddp-shm needs its {workers} ranks on one host, and no host has {workers} slots"
                )),
            };
        }
        _ => {}
    }
    let (servers, pool): (Vec<usize>, Vec<usize>) = if mode.is_ps() {
        let k = shards.max(1);
        if n > k {
            ((0..k).collect(), (k..n).collect())
        } else {
            ((0..k).map(|i| i % n).collect(), (0..n).collect())
        }
    } else {
        (vec![], (0..n).collect())
    };
    let capacity: usize = pool.iter().map(|&h| slots[h]).sum();
    if capacity < workers {
        return Err(format!(
            "{workers} workers need {workers} slots and the hosts left for them have {capacity}"
        ));
    }
    let mut used = vec![0usize; n];
    let mut out = Vec::with_capacity(workers);
    let mut turn = 0;
    while out.len() < workers {
        let h = pool[turn % pool.len()];
        if used[h] < slots[h] {
            used[h] += 1;
            out.push(h);
        }
        turn += 1;
    }
    Ok((servers, out))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn servers_get_hosts_of_their_own_when_enough_and_workers_spread_by_slots() {
        // Four hosts, one shard: the server alone on host 0, workers spread over 1..3.
        assert_eq!(assign(&[2, 2, 2, 2], ModeKind::PsBsp, 4, 1).unwrap(), (vec![0], vec![1, 2, 3, 1]));
        // Two shards on two of four hosts.
        assert_eq!(assign(&[2, 2, 2, 2], ModeKind::PsAsp, 4, 2).unwrap(), (vec![0, 1], vec![2, 3, 2, 3]));
        // Not enough hosts: the shards share them with the workers.
        assert_eq!(assign(&[4, 4], ModeKind::PsBsp, 2, 2).unwrap(), (vec![0, 1], vec![0, 1]));
        // A ring over every host, each up to its slots.
        assert_eq!(assign(&[1, 3], ModeKind::DdpTcp, 4, 0).unwrap(), (vec![], vec![0, 1, 1, 1]));
        assert_eq!(assign(&[2, 2, 2], ModeKind::DdpTcp, 2, 0).unwrap(), (vec![], vec![0, 1]));
        assert_eq!(assign(&[2, 2], ModeKind::Local, 1, 0).unwrap(), (vec![], vec![0]));
        assert_eq!(assign(&[1, 4], ModeKind::DdpShm, 4, 0).unwrap(), (vec![], vec![1, 1, 1, 1]));
        let e = assign(&[2, 2], ModeKind::DdpShm, 4, 0).unwrap_err();
        assert!(e.contains("one host"), "{e}");
        let e = assign(&[1, 1, 1], ModeKind::PsBsp, 4, 1).unwrap_err();
        assert!(e.contains("4 workers need 4 slots and the hosts left for them have 2"), "{e}");
    }

    #[test]
    fn quoting_keeps_every_argument_one_word() {
        assert_eq!(quote("a b"), "'a b'");
        assert_eq!(quote("it's"), "'it'\\''s'");
        assert_eq!(bracket("::1"), "[::1]");
        assert_eq!(bracket("10.0.0.1"), "10.0.0.1");
    }

    #[test]
    fn the_check_names_a_missing_binary_and_another_build() {
        let expected = [
            ("gradsync-worker".to_string(), "gradsync-worker 0.1.0".to_string(), "aa".repeat(32)),
            ("gradsync-server".to_string(), "gradsync-server 0.1.0".to_string(), "bb".repeat(32)),
        ];
        let same = format!(
            "bin gradsync-worker {} gradsync-worker 0.1.0\nbin gradsync-server {} gradsync-server 0.1.0\n\
             hostname n1\ncores 8\nkernel 6.1\ncpu EPYC\nmemkb 1024\ngpu H100\nend\n",
            "aa".repeat(32),
            "bb".repeat(32)
        );
        let f = read_check(&same, HostFacts::default(), &expected, Path::new("/opt/g")).unwrap();
        assert_eq!((f.hostname.as_str(), f.cores, f.memory_bytes, f.gpus.len()), ("n1", 8, 1 << 20, 1));
        let other = same.replace(&"bb".repeat(32), &"cc".repeat(32));
        let other = format!("missing gradsync-bench\n{other}");
        let e = read_check(&other, HostFacts::default(), &expected, Path::new("/opt/g")).unwrap_err();
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(e[0].contains("lacks /opt/g/gradsync-bench"), "{e:?}");
        assert!(
            e[1].contains("has another /opt/g/gradsync-server") && e[1].contains("sha256 cccccccccccc"),
            "{e:?}"
        );
    }

    #[test]
    fn ssh_failures_say_which_host_and_why() {
        let e = ssh_failure("node2", "root@node2: Permission denied (publickey).\n");
        assert!(e.contains("host node2: ssh login refused") && e.contains("publickey"), "{e}");
        let e = ssh_failure("node3", "ssh: connect to host 10.0.0.3 port 22: Connection refused\n");
        assert!(e.contains("host node3 unreachable") && e.contains("Connection refused"), "{e}");
    }
}
