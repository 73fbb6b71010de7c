//! `gradsync-worker launch`: torchrun's job for gradsync. Starts `--nproc-per-node` local
//! processes with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT
//! set, prefixes every line they print with their rank, and stops all of them as soon as one
//! fails, exiting with an error that names it; with `--max-restarts N`, starts them all again
//! (a `train` command with `--resume`, from its newest checkpoint), up to N times, each restart
//! logged with the rank that failed and how. With several nodes, the restarts are agreed
//! through node 0's launcher ([`crate::restarts`]): every node's ranks restart together.
//!
//! This is the subcommand's body, the binary's edge: its errors are `anyhow` errors, printed by
//! `main`, which ends the process (the library areas below it, `collective` and `ps`, return
//! their own typed errors).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use anyhow::{Context, bail, ensure};

use crate::cli::LaunchArgs;
// The rule naming a restart's cause lives with the launchers' store, which applies it too;
// `gradsync-bench compare` reaches it here, beside the launcher that prints it.
pub use crate::restarts::blame;

/// Set by SIGTERM or SIGINT once [`stop_on_signals`] has run: a signal handler can do no more
/// than store a flag, so the supervisor polls it.
static SIGNALLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    SIGNALLED.store(true, Ordering::Relaxed);
}

/// Make SIGTERM (Slurm's, a scheduler's) and SIGINT stop the ranks cleanly: each gets
/// SIGTERM, then SIGKILL if it has not exited within [`GRACE`]. Call once, before
/// [`launch`], from the binary (the ranks reset the handlers when they exec).
pub fn stop_on_signals() {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGTERM, handler);
        libc::signal(libc::SIGINT, handler);
    }
}

/// How long the supervisor keeps collecting exits after the first failure, to tell the rank
/// that failed from the ones that failed because of it.
const SETTLE: Duration = Duration::from_millis(1000);

/// How long stopped ranks get to exit after SIGTERM before they are killed.
const GRACE: Duration = Duration::from_secs(5);

/// The started ranks; any still running when this is dropped are killed, so no path out of
/// [`launch`] (error, panic) leaves a process behind.
struct Ranks(Vec<(usize, Child)>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}

/// Copy `from` to our stdout or stderr line by line, each line prefixed with `[rank] `.
fn relay(from: impl Read + Send + 'static, rank: usize, to_stderr: bool) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match r.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            if line.last() != Some(&b'\n') {
                line.push(b'\n');
            }
            let prefix = format!("[{rank}] ");
            // One write per line under the lock keeps lines from different ranks whole.
            let _ = if to_stderr {
                let mut e = std::io::stderr().lock();
                e.write_all(prefix.as_bytes()).and_then(|_| e.write_all(&line))
            } else {
                let mut o = std::io::stdout().lock();
                o.write_all(prefix.as_bytes()).and_then(|_| o.write_all(&line)).and_then(|_| o.flush())
            };
        }
    })
}

/// The children of process `pid`, whichever of its threads started them (each thread's
/// `/proc/PID/task/TID/children`), in pid order: a launcher's ranks, for a test or benchmark
/// that kills one. Empty once it has none, or where /proc cannot tell.
pub fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
        let text = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
        out.extend(text.split_whitespace().filter_map(|s| s.parse::<u32>().ok()));
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// What the ranks run: the worker itself for `train ...`, else the given program.
fn program(cmd: &[String], worker: &Path) -> anyhow::Result<(PathBuf, Vec<String>)> {
    let Some(first) = cmd.first() else { bail!("nothing to launch: give the command after `--`") };
    if first == "train" || first.starts_with('-') {
        let mut args = cmd.to_vec();
        if first.starts_with('-') {
            args.insert(0, "train".into());
        }
        Ok((worker.to_path_buf(), args))
    } else {
        Ok((PathBuf::from(first), cmd[1..].to_vec()))
    }
}

/// Start the local ranks and supervise them until all exit, restarting them all after a
/// failure while `--max-restarts` allows (with several nodes, every node together: see
/// [`crate::restarts`]); `stop` (Ctrl-C, a test) ends them early. `worker` is the
/// `gradsync-worker` binary, run for `-- train ...` commands.
pub fn launch(a: &LaunchArgs, worker: &Path, stop: Arc<AtomicBool>) -> anyhow::Result<()> {
    ensure!(a.nproc_per_node >= 1, "--nproc-per-node must be at least 1");
    ensure!(a.nnodes >= 1, "--nnodes must be at least 1");
    ensure!(a.node_rank < a.nnodes, "--node-rank {} is not below --nnodes {}", a.node_rank, a.nnodes);
    ensure!(
        a.master_port != 0 || a.nnodes == 1,
        "--master-port 0 (pick a free port) only works on one node: the other nodes must know the port"
    );
    let (prog, args) = program(&a.cmd, worker)?;
    let trains = prog == worker;
    if a.max_restarts > 0 && trains {
        ensure!(
            args.iter().any(|x| x == "--checkpoint" || x.starts_with("--checkpoint=")),
            "--max-restarts {}: the ranks restart from their newest checkpoint, so the train command needs \
             --checkpoint DIR (and --checkpoint-every N)",
            a.max_restarts
        );
    }
    if a.nnodes > 1 && a.max_restarts > 0 {
        return launch_agreed(a, &prog, args, trains, &stop);
    }
    launch_alone(a, &prog, args, trains, &stop)
}

/// The ranks' command for the generation after a restart: a `train` command resumes from its
/// newest checkpoint.
fn resuming(args: &mut Vec<String>, trains: bool) {
    if trains {
        resume_args(args);
    }
}

/// A `train` command's arguments made to continue from the newest checkpoint (`--resume`
/// added once): how every restart starts its ranks again, the launcher's and
/// `gradsync-bench compare`'s.
pub fn resume_args(args: &mut Vec<String>) {
    let flag = format!("--{}", crate::cli::flag::RESUME);
    if !args.contains(&flag) {
        args.push(flag);
    }
}

/// One node on its own: restarts decided here.
fn launch_alone(
    a: &LaunchArgs,
    prog: &Path,
    mut args: Vec<String>,
    trains: bool,
    stop: &AtomicBool,
) -> anyhow::Result<()> {
    let mut restarts = 0;
    loop {
        let t = std::time::Instant::now();
        // A fresh port for each generation when the port is ours to pick: the last one's store
        // may still hold it.
        let port =
            if a.master_port == 0 { crate::restarts::free_port(&a.master_addr)? } else { a.master_port };
        let failed = match run_ranks(a, prog, &args, restarts.into(), port, stop, &mut || {
            None::<std::convert::Infallible>
        })? {
            Ended::AllDone => return Ok(()),
            Ended::Failed(f) => f,
            Ended::Told(never) => match never {},
        };
        let ((rank, status), also) = failed;
        let also: String = also.iter().map(|(r, s)| format!("rank {r} ended after it ({s}); ")).collect();
        if restarts >= a.max_restarts {
            let tried =
                if a.max_restarts > 0 { format!(" after {restarts} restart(s)") } else { String::new() };
            bail!("rank {rank} failed first ({status}); {also}stopped the other ranks{tried}");
        }
        restarts += 1;
        eprintln!(
            "gradsync-worker launch: rank {rank} failed ({status}) after {:.1} s; {also}stopped the node's ranks; \
             restart {restarts} of {}{}",
            t.elapsed().as_secs_f64(),
            a.max_restarts,
            if trains { ", from the newest checkpoint (--resume)" } else { "" }
        );
        resuming(&mut args, trains);
    }
}

/// Several nodes with `--max-restarts`: node 0's launcher serves the launchers' store, every
/// node's launcher follows its generations ([`crate::restarts`]).
fn launch_agreed(
    a: &LaunchArgs,
    prog: &Path,
    mut args: Vec<String>,
    trains: bool,
    stop: &AtomicBool,
) -> anyhow::Result<()> {
    use crate::restarts::StoreConfig;
    let cfg = StoreConfig {
        nnodes: a.nnodes,
        nproc: a.nproc_per_node,
        max_restarts: a.max_restarts,
        token: std::env::var("GRADSYNC_RING_TOKEN").ok().filter(|t| !t.is_empty()),
        timeout: Duration::from_secs_f64(a.rdzv_timeout),
    };
    let store_addr = if a.master_addr.contains(':') && !a.master_addr.starts_with('[') {
        format!("[{}]:{}", a.master_addr, a.master_port)
    } else {
        format!("{}:{}", a.master_addr, a.master_port)
    };
    let store = if a.node_rank == 0 {
        let at = crate::rendezvous::resolve(&store_addr).map_err(|e| anyhow::anyhow!("{e}"))?;
        let listener = crate::rendezvous::bind_store(at)
            .map_err(|e| anyhow::anyhow!("{e} (the launchers' store, node 0)"))?;
        let (cfg, ranks_addr) = (cfg.clone(), a.master_addr.clone());
        Some(std::thread::spawn(move || crate::restarts::serve(listener, &cfg, &ranks_addr)))
    } else {
        None
    };
    let ended = follow_store(a, prog, &mut args, trains, stop, &store_addr, &cfg);
    // Node 0 serves the store until every launcher has heard its last word.
    if let Some(h) = store {
        let _ = h.join();
    }
    ended
}

/// Register with the launchers' store and run the generations it starts, until it says the
/// run finished or aborted.
fn follow_store(
    a: &LaunchArgs,
    prog: &Path,
    args: &mut Vec<String>,
    trains: bool,
    stop: &AtomicBool,
    store_addr: &str,
    cfg: &crate::restarts::StoreConfig,
) -> anyhow::Result<()> {
    use crate::restarts::{FromStore, Member, News, ToStore};
    let node = a.node_rank;
    let me = Member::join(store_addr, node, cfg)?;
    // Bounded waits: the store decides within its own timeout, plus a margin for the messages.
    let limit = Some(cfg.timeout + Duration::from_secs(5));
    let mut generation = 0u64;
    let restart_line = |generation: u64, restart: u32, node: usize, rank: usize, exit: &str| {
        eprintln!(
            "gradsync-worker launch: node {}: rank {rank} on node {node} failed ({exit}); every node stops its \
             ranks; restart {restart} of {} (generation {generation}){}",
            a.node_rank,
            a.max_restarts,
            if trains { ", from the newest checkpoint (--resume)" } else { "" }
        );
    };
    loop {
        me.tell(&ToStore::Ready { generation })?;
        let port = match me.next(limit, &format!("every node to be ready for generation {generation}"))? {
            FromStore::Start { generation: g, port } if g == generation => port,
            FromStore::Abort { why } => bail!("{why}"),
            other => bail!("the launchers' store said {other:?} while this node waited to start"),
        };
        let mut told = || match me.poll() {
            Some(News::Said(FromStore::Beat)) | None => None,
            Some(n) => Some(n),
        };
        let ended = run_ranks(a, prog, args, generation, port, stop, &mut told)?;
        let word = match ended {
            Ended::AllDone => {
                me.tell(&ToStore::Done { generation })?;
                // The other nodes' ranks may still be training: as long as the store beats.
                me.next(None, "the other nodes to finish")?
            }
            Ended::Failed(((rank, st), _)) => {
                me.tell(&ToStore::Failed {
                    generation,
                    rank,
                    exit: st.to_string(),
                    signalled: st.signal().is_some(),
                })?;
                me.next(limit, "the store's decision on the failure")?
            }
            Ended::Told(News::Said(w)) => w,
            Ended::Told(News::Lost(why)) => bail!("node {node}: {why}; stopped this node's ranks"),
        };
        match word {
            FromStore::Finished => return Ok(()),
            FromStore::Restart { generation: g, restart, node, rank, exit } => {
                restart_line(g, restart, node, rank, &exit);
                generation = g;
                resuming(args, trains);
            }
            FromStore::Abort { why } => bail!("{why}"),
            other => bail!("the launchers' store said {other:?} while this node's ranks ran"),
        }
    }
}

/// How a generation of the node's ranks ended.
enum Ended<T> {
    /// Every rank exited 0.
    AllDone,
    /// One failed: the others were killed.
    Failed(Failed),
    /// Something outside the node said to stop (the ranks were killed): what it said.
    Told(T),
}

/// One generation of the node's ranks: start them, relay their output and supervise them
/// until all exit or one fails, or `told` (asked every `--monitor-interval`) says to stop.
fn run_ranks<T>(
    a: &LaunchArgs,
    prog: &Path,
    args: &[String],
    generation: u64,
    port: u16,
    stop: &AtomicBool,
    told: &mut dyn FnMut() -> Option<T>,
) -> anyhow::Result<Ended<T>> {
    let world = a.nnodes * a.nproc_per_node;
    let mut ranks = Ranks(Vec::new());
    let mut relays = Vec::new();
    for local in 0..a.nproc_per_node {
        let rank = a.node_rank * a.nproc_per_node + local;
        let mut child = Command::new(prog)
            .args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", a.nproc_per_node.to_string())
            .env("GROUP_RANK", a.node_rank.to_string())
            .env("MASTER_ADDR", &a.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env("TORCHELASTIC_RESTART_COUNT", generation.to_string())
            .env("TORCHELASTIC_MAX_RESTARTS", a.max_restarts.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting rank {rank}: {}", prog.display()))?;
        if let Some(o) = child.stdout.take() {
            relays.push(relay(o, rank, false));
        }
        if let Some(e) = child.stderr.take() {
            relays.push(relay(e, rank, true));
        }
        ranks.0.push((rank, child));
    }
    let ended = supervise(&mut ranks, stop, Duration::from_secs_f64(a.monitor_interval), told);
    drop(ranks);
    for r in relays {
        let _ = r.join();
    }
    ended
}

/// Tell `tx` the moment child `pid` exits, without reaping it (the supervisor reaps it with
/// `try_wait`): the order of these messages is the order in which the ranks ended, which a
/// polling loop cannot tell apart within its nap.
fn watch_exit(rank: usize, pid: u32, tx: mpsc::Sender<usize>) {
    std::thread::spawn(move || {
        let pid = libc::id_t::from(pid);
        loop {
            // SAFETY: a zeroed siginfo_t is a valid out-parameter for waitid.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: waitid(2) on a child we started; WNOWAIT leaves it for try_wait.
            let rc = unsafe { libc::waitid(libc::P_PID, pid, &mut info, libc::WEXITED | libc::WNOWAIT) };
            if rc == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                break;
            }
        }
        let _ = tx.send(rank);
    });
}

/// Which rank failed first, with its status, and the ranks that had also failed by then.
type Failed = ((usize, ExitStatus), Vec<(usize, ExitStatus)>);

/// Wait until every rank has exited or one has failed, in which case the others are killed;
/// `told`, asked after each exit and every `monitor`, stops them all with what it said. The rank reported is the first to end with a failure; among ranks that had
/// already ended when it was seen, one killed by a signal is reported first (a rank killed
/// from outside failed on its own; one that exits with an error usually reports a peer's
/// failure).
fn supervise<T>(
    ranks: &mut Ranks,
    stop: &AtomicBool,
    monitor: Duration,
    told: &mut dyn FnMut() -> Option<T>,
) -> anyhow::Result<Ended<T>> {
    let (tx, exits) = mpsc::channel();
    for (rank, c) in &ranks.0 {
        watch_exit(*rank, c.id(), tx.clone());
    }
    drop(tx);
    let mut running = ranks.0.len();
    let status_of = |ranks: &mut Ranks, rank: usize| -> anyhow::Result<Option<ExitStatus>> {
        match ranks.0.iter_mut().find(|(r, _)| *r == rank) {
            Some((_, c)) => c.try_wait().with_context(|| format!("waiting for rank {rank}")),
            None => Ok(None),
        }
    };
    loop {
        match exits.recv_timeout(monitor) {
            Ok(rank) => {
                let Some(st) = status_of(ranks, rank)? else { continue };
                running -= 1;
                if !st.success() {
                    // The others usually fail within milliseconds because of this one, and a
                    // rank killed by a signal may be reported after them (its sockets close,
                    // waking its peers, before its exit is). Collect what ends within a
                    // moment before deciding and stopping the rest.
                    let mut failed = vec![(rank, st)];
                    let settle = std::time::Instant::now() + SETTLE;
                    while running > 0 {
                        let left = settle.saturating_duration_since(std::time::Instant::now());
                        let Ok(r) = exits.recv_timeout(left) else { break };
                        if let Some(s) = status_of(ranks, r)? {
                            running -= 1;
                            if !s.success() {
                                failed.push((r, s));
                            }
                        }
                    }
                    blame(&mut failed, |(_, s)| s.signal().is_some());
                    for (_, other) in ranks.0.iter_mut() {
                        if matches!(other.try_wait(), Ok(None)) {
                            let _ = other.kill();
                        }
                    }
                    let first = failed.remove(0);
                    return Ok(Ended::Failed((first, failed)));
                }
                if running == 0 {
                    return Ok(Ended::AllDone);
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(Ended::AllDone),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if let Some(word) = told() {
            for (_, c) in ranks.0.iter_mut() {
                if matches!(c.try_wait(), Ok(None)) {
                    let _ = c.kill();
                }
            }
            return Ok(Ended::Told(word));
        }
        if stop.load(Ordering::Relaxed) || SIGNALLED.load(Ordering::Relaxed) {
            terminate(ranks);
            bail!("stopped by a signal: the ranks were terminated");
        }
    }
}

/// SIGTERM every running rank, give them [`GRACE`] to exit, then kill the rest.
fn terminate(ranks: &mut Ranks) {
    for (_, c) in &mut ranks.0 {
        if matches!(c.try_wait(), Ok(None))
            && let Ok(pid) = libc::pid_t::try_from(c.id())
        {
            // SAFETY: kill(2) on a child we started and have not reaped.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
    }
    let t = std::time::Instant::now();
    while t.elapsed() < GRACE && ranks.0.iter_mut().any(|(_, c)| matches!(c.try_wait(), Ok(None))) {
        std::thread::sleep(Duration::from_millis(20));
    }
    for (_, c) in &mut ranks.0 {
        if matches!(c.try_wait(), Ok(None)) {
            let _ = c.kill();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::program;
    use std::path::Path;

    #[test]
    fn picks_the_program() {
        let w = Path::new("/bin/gradsync-worker");
        let (p, a) = program(&["train".into(), "--mode".into(), "ddp".into()], w).unwrap();
        assert_eq!((p.as_path(), a[0].as_str()), (w, "train"));
        let (p, a) = program(&["--mode".into(), "ddp".into()], w).unwrap();
        assert_eq!((p.as_path(), a[0].as_str()), (w, "train"));
        let (p, a) = program(&["python3".into(), "x.py".into()], w).unwrap();
        assert_eq!((p.to_str().unwrap(), a.len()), ("python3", 1));
        assert!(program(&[], w).is_err());
    }
}
