//! Where one process of a run goes and how it is started there: the seam the comparison's
//! runner ([`super::exec`]) starts every process through, whether the process runs on this
//! machine, in an emulated host's network namespace ([`crate::net`]), on another host over
//! ssh ([`super::ssh`]), or as a job step on a node of a Slurm allocation ([`super::slurm`]).
//! The runner never asks which.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::child::{Launch, wait_for_line, wait_until};
use super::{slurm, ssh};

/// Where a process runs.
#[derive(Debug, Clone, Default)]
pub enum Site {
    /// This machine, as it is.
    #[default]
    Local,
    /// An emulated host: this machine inside a network namespace (`ip netns exec`).
    Netns(String),
    /// Another host, reached over the system's ssh.
    Ssh(Arc<ssh::Host>),
    /// A node of the Slurm allocation this runs in: a job step started with `srun`.
    Slurm(Arc<slurm::Node>),
}

/// A host a run's process is placed on: where it runs and the address the others reach it at.
#[derive(Debug, Clone)]
pub struct Slot {
    /// The address its servers listen on and its peers dial.
    pub addr: String,
    /// How a process is started there.
    pub site: Site,
}

impl From<&Arc<ssh::Host>> for Slot {
    fn from(h: &Arc<ssh::Host>) -> Slot {
        Slot { addr: h.addr.clone(), site: Site::Ssh(h.clone()) }
    }
}

impl From<&Arc<slurm::Node>> for Slot {
    fn from(n: &Arc<slurm::Node>) -> Slot {
        Slot { addr: n.addr.clone(), site: Site::Slurm(n.clone()) }
    }
}

impl From<&crate::net::HostSlot> for Slot {
    fn from(h: &crate::net::HostSlot) -> Slot {
        Slot { addr: h.addr.clone(), site: Site::Netns(h.netns.clone()) }
    }
}

impl Site {
    /// How to start `program args` here with `env` added to its environment, its files going
    /// to `files` (a directory made first where needed). `env` never reaches a command line.
    /// On another host or node, `follow` (a file the program writes there) has the lines
    /// appended to it sent back on the process's stdout as they are written (the program's
    /// own stdout then joins its stderr); here the file can be read directly.
    pub fn launch(
        &self,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        files: &Path,
        follow: Option<&Path>,
    ) -> Launch {
        match self {
            Site::Local | Site::Netns(_) => {
                // `ip netns exec` enters the namespace and execs the program: the child's pid
                // is the program's, so signals and exit statuses are its own.
                let mut command = match self {
                    Site::Netns(ns) => {
                        let mut c = Command::new("ip");
                        c.args(["netns", "exec", ns]).arg(program);
                        c
                    }
                    _ => Command::new(program),
                };
                command.args(args).envs(env.iter().map(|(k, v)| (k, v)));
                Launch { command, stdin: None }
            }
            Site::Ssh(h) => h.launch(program, args, env, files, follow),
            Site::Slurm(n) => n.launch(program, args, env, files, follow),
        }
    }

    /// Where the process runs, for messages: `host node1`; none on this machine.
    pub fn label(&self) -> Option<String> {
        match self {
            Site::Local => None,
            Site::Netns(ns) => Some(format!("emulated host {ns}")),
            Site::Ssh(h) => Some(format!("host {}", h.name)),
            Site::Slurm(n) => Some(format!("node {}", n.name)),
        }
    }

    /// A port for a rendezvous here: one free on loopback now (an emulated host's namespace
    /// has every port free), or on another host (over ssh, a Slurm node) a random one among the unprivileged ports above
    /// the usual ephemeral range's start (a taken one fails the run with rank 0's bind error,
    /// reported like any failure).
    pub fn free_port(&self) -> anyhow::Result<u16> {
        match self {
            Site::Local | Site::Netns(_) => {
                let l = std::net::TcpListener::bind("127.0.0.1:0")?;
                Ok(l.local_addr()?.port())
            }
            Site::Ssh(_) | Site::Slurm(_) => {
                let mut b = [0u8; 2];
                getrandom::fill(&mut b).map_err(|e| anyhow::anyhow!("drawing a port: {e}"))?;
                Ok(20_000 + u16::from_le_bytes(b) % 12_000)
            }
        }
    }

    /// Where a process here writes the files of the run directory `dir`: `dir` itself on this
    /// machine, the same run's directory under the remote directory on another host.
    pub fn files_dir(&self, dir: &Path) -> PathBuf {
        match self {
            Site::Ssh(h) => h.files_dir(dir),
            Site::Slurm(n) => n.files_dir(dir),
            _ => dir.to_path_buf(),
        }
    }

    /// Bring what the run's processes here wrote into `dir` (and clear it there): nothing to do
    /// on this machine.
    pub fn collect(&self, dir: &Path) -> anyhow::Result<()> {
        match self {
            Site::Ssh(h) => h.collect(dir),
            Site::Slurm(n) => n.collect(dir),
            _ => Ok(()),
        }
    }

    /// Run the shell command line `script` here to its end, within `limit`: over ssh on a
    /// host, as a job step on a node, with `sh -c` on this machine or in a namespace.
    pub fn run(&self, script: &str, limit: Duration) -> anyhow::Result<Output> {
        match self {
            Site::Ssh(h) => h.run(script, None, limit),
            Site::Slurm(n) => n.run(script, limit),
            Site::Local | Site::Netns(_) => {
                let mut c = match self {
                    Site::Netns(ns) => {
                        let mut c = Command::new("ip");
                        c.args(["netns", "exec", ns, "sh", "-c", script]);
                        c
                    }
                    _ => {
                        let mut c = Command::new("sh");
                        c.args(["-c", script]);
                        c
                    }
                };
                c.stdin(Stdio::null());
                super::child::run_limited(c, None, limit)
            }
        }
    }

    /// Whether `other` is the same place.
    pub fn same(&self, other: &Site) -> bool {
        match (self, other) {
            (Site::Local, Site::Local) => true,
            (Site::Netns(a), Site::Netns(b)) => a == b,
            (Site::Ssh(a), Site::Ssh(b)) => Arc::ptr_eq(a, b),
            (Site::Slurm(a), Site::Slurm(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// Whether the process is a child of this one (here or in a namespace of this machine),
    /// so that its CPU time is counted in this one's children's.
    pub fn is_child(&self) -> bool {
        matches!(self, Site::Local | Site::Netns(_))
    }

    /// The host behind an ssh site.
    pub fn ssh_host(&self) -> Option<&Arc<ssh::Host>> {
        match self {
            Site::Ssh(h) => Some(h),
            _ => None,
        }
    }
}

/// The raw-TCP yardstick from `from` to `to` (the same site: over its loopback): the far end
/// (`gradsync-bench rawtcp-peer --listen`, `bench` being the path where both run) listens on
/// `listen` at `to`, the near end streams `rounds` measurements of `each` to it and measures
/// the small-message latency; `files` is a directory the far end may make.
pub fn measure_link(
    from: &Site,
    to: &Site,
    listen: &str,
    bench: &Path,
    files: &Path,
    rounds: usize,
    each: Duration,
) -> anyhow::Result<crate::rawtcp::PeerReading> {
    let (from_name, to_name) = (from.label().unwrap_or_default(), to.label().unwrap_or_default());
    let args = ["rawtcp-peer".to_string(), "--listen".into(), format!("{}:0", ssh::bracket(listen))];
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
            ssh::quote(&bench.display().to_string()),
            ssh::quote(&addr),
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
