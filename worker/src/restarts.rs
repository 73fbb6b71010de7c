//! Restarts agreed across nodes, torchrun's way. With `launch --nnodes M --max-restarts N`,
//! node 0's launcher serves a store for the launchers at `--master-addr:--master-port`; every
//! node's launcher (node 0's too) registers with it, proving the ring token as the ranks do
//! with theirs, and the store numbers the run's *generations*: each restart is a new one, and
//! every node's ranks start together in it.
//!
//! ```text
//!   node k's launcher                         the store (in node 0's launcher)
//!   Ready { g }                   ───────▶    all M ready: a fresh port P for the ranks' own
//!                                 ◀───────    Start { g, P }            rendezvous (rank 0's)
//!   ranks run; one fails
//!   Failed { g, rank, exit }      ───────▶    a moment for the failures it caused to arrive;
//!                                             restarts left: generation g + 1, to every node
//!                                 ◀───────    Restart { g + 1, node, rank, exit }
//!   (the other nodes see it at their next --monitor-interval and stop their ranks too)
//!   Ready { g + 1 }               ───────▶    ...
//!   all ranks exit 0: Done { g }  ───────▶    all M done
//!                                 ◀───────    Finished
//! ```
//!
//! No restarts left, a node's launcher lost (its connection closes, or it sends nothing, not
//! even its heartbeat, for `--rdzv-timeout`), or a node that does not come back to the new
//! generation within `--rdzv-timeout`: the store tells every node `Abort` with the reason,
//! naming the node. A launcher that loses the store (node 0's launcher gone) gives up the same
//! way. Every wait is bounded.
//!
//! [`blame`], the rule that names a restart's cause, is here too: the store applies it to the
//! failures the nodes report, the launcher (`crate::launch`, which imports this file and is
//! never imported by it) to its own ranks' exits. Like the launcher, this is the `launch`
//! subcommand's body, the binary's edge: its errors (`anyhow`) are printed and end the process.

use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

use crate::collective::handshake::{self, Hello, MAGIC, Welcome, fresh_nonce, read_line, write_line};
use crate::collective::tcp::connect_retry;

/// What a launcher tells the store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ToStore {
    /// This node is ready to start its ranks in generation `generation`.
    Ready {
        /// The generation.
        generation: u64,
    },
    /// A rank of this node failed in `generation`.
    Failed {
        /// The generation it ran in.
        generation: u64,
        /// The rank (global).
        rank: usize,
        /// How it ended, as the launcher prints it (`signal: 9 (SIGKILL)`).
        exit: String,
        /// Whether a signal ended it (a rank killed from outside failed on its own; one that
        /// exits with an error usually reports a peer's failure).
        signalled: bool,
    },
    /// Every rank of this node exited 0 in `generation`.
    Done {
        /// The generation.
        generation: u64,
    },
    /// Still here (sent every [`beat`] whatever else happens).
    Beat,
}

/// What the store tells every launcher.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FromStore {
    /// Every node is ready: start the ranks of `generation`, their rendezvous at the store's
    /// host and `port`.
    Start {
        /// The generation.
        generation: u64,
        /// The port of the ranks' rendezvous (rank 0's store), fresh for each generation.
        port: u16,
    },
    /// A rank failed: stop this node's ranks and start them again, with `--resume`, as
    /// `generation`.
    Restart {
        /// The new generation.
        generation: u64,
        /// Which restart of the job this is, from 1.
        restart: u32,
        /// The node whose rank failed first.
        node: usize,
        /// That rank.
        rank: usize,
        /// How it ended.
        exit: String,
    },
    /// The run is over on every node, for this reason.
    Abort {
        /// Why.
        why: String,
    },
    /// Every node's ranks exited 0.
    Finished,
    /// The store is still here.
    Beat,
}

/// How the launchers' store runs.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Nodes in the run.
    pub nnodes: usize,
    /// Ranks per node (every node must agree).
    pub nproc: usize,
    /// Restarts allowed across the whole job.
    pub max_restarts: u32,
    /// The ring token every launcher must know, if any.
    pub token: Option<String>,
    /// How long a node may take to register or to come back to a new generation, and how long
    /// a launcher may stay silent before it counts as lost.
    pub timeout: Duration,
}

impl StoreConfig {
    /// What every launcher must agree on: refused by name when it does not.
    fn fingerprint(nproc: usize, max_restarts: u32) -> String {
        format!("gradsync-launch --nproc-per-node {nproc} --max-restarts {max_restarts}")
    }
}

/// How long the store waits, after the first failure of a generation, for the failures it
/// caused on other nodes (no longer once every node has reported one), so that the rank
/// reported is the one that failed on its own.
const SETTLE: Duration = Duration::from_millis(1500);

/// How often each side says it is still here: a quarter of the time after which silence means
/// lost, at most a second.
pub fn beat(timeout: Duration) -> Duration {
    (timeout / 4).min(Duration::from_secs(1))
}

/// What the store's loop hears.
enum Heard {
    /// Node `0` registered; its writing half.
    Joined(usize, TcpStream),
    /// Node `0` said this.
    Said(usize, ToStore),
    /// Node `0`'s connection ended or went silent, for this reason.
    Gone(usize, String),
}

/// Serve the launchers of a run on `listener` until every node's ranks have finished (`Ok`)
/// or the run is aborted (`Err`, the reason every node was told). `ranks_addr` is where the
/// ranks' own rendezvous listens (this host), for which each generation gets a fresh port.
pub fn serve(listener: TcpListener, cfg: &StoreConfig, ranks_addr: &str) -> Result<(), String> {
    let here = listener.local_addr().map_or_else(|_| "?".into(), |a| a.to_string());
    let (tx, rx) = mpsc::channel::<Heard>();
    let done = Arc::new(AtomicBool::new(false));
    {
        let (cfg, tx, done) = (cfg.clone(), tx.clone(), done.clone());
        std::thread::spawn(move || accept_nodes(listener, &cfg, &tx, &done));
    }
    drop(tx);
    let mut writers: Vec<Option<TcpStream>> = (0..cfg.nnodes).map(|_| None).collect();
    let result = store_loop(&rx, cfg, ranks_addr, &here, &mut writers);
    // The last word (Finished, Abort) must reach every launcher before this one exits and its
    // connections close: wait, bounded, for each to hang up first.
    let until = Instant::now() + cfg.timeout;
    let mut open = writers.iter().filter(|w| w.is_some()).count();
    while open > 0 {
        match rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
            Ok(Heard::Gone(..)) => open -= 1,
            Ok(_) => {}
            Err(_) => break,
        }
    }
    done.store(true, Ordering::Relaxed);
    result
}

/// Accept registrations until the store ends: each connection's handshake, then a thread
/// forwarding what it says.
fn accept_nodes(listener: TcpListener, cfg: &StoreConfig, tx: &mpsc::Sender<Heard>, done: &AtomicBool) {
    if listener.set_nonblocking(true).is_err() {
        return;
    }
    let fingerprint = StoreConfig::fingerprint(cfg.nproc, cfg.max_restarts);
    while !done.load(Ordering::Relaxed) {
        let (s, from) = match listener.accept() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(_) => return,
        };
        let _ = s.set_nonblocking(false);
        let _ = s.set_read_timeout(Some(cfg.timeout));
        let _ = s.set_write_timeout(Some(cfg.timeout));
        let (Ok(mut w), Ok(nonce)) = (s.try_clone(), fresh_nonce()) else { continue };
        let token = cfg.token.as_deref();
        let hello = match handshake::accept(&s, &mut w, None, cfg.nnodes, &fingerprint, token, &nonce) {
            Ok(h) => h,
            Err(e) => {
                eprintln!("gradsync-worker launch: the launchers' store refused {from}: {e}");
                continue;
            }
        };
        let proof = handshake::proof(token, handshake::Role::Acceptor, &hello, &nonce);
        if write_line(&mut w, &Welcome { refused: None, proof: Some(proof) }).is_err() {
            continue;
        }
        let node = hello.rank;
        if tx.send(Heard::Joined(node, w)).is_err() {
            return;
        }
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut r = BufReader::new(s);
            loop {
                match next_message::<ToStore>(&mut r) {
                    Ok(ToStore::Beat) => {}
                    Ok(m) => {
                        if tx.send(Heard::Said(node, m)).is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        let why = match e.kind() {
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                                "it sent nothing, not even a heartbeat, within the timeout".to_string()
                            }
                            std::io::ErrorKind::UnexpectedEof => "its connection to the store closed".into(),
                            _ => format!("its connection failed: {e}"),
                        };
                        let _ = tx.send(Heard::Gone(node, why));
                        return;
                    }
                }
            }
        });
    }
}

/// Of the failures seen together, in the order they were seen, put first the one to blame: a
/// process ended by a signal (killed from outside: it failed on its own) before one that
/// exited with an error (which usually reports a peer's failure). The launcher, the
/// launchers' store and `gradsync-bench compare` all name a restart's cause by this rule.
pub fn blame<T>(failed: &mut [T], signalled: impl Fn(&T) -> bool) {
    if let Some(i) = failed.iter().position(&signalled)
        && !signalled(&failed[0])
    {
        failed[..=i].rotate_right(1);
    }
}

/// A failure reported in the current generation: (node, rank, exit, signalled).
type Failure = (usize, usize, String, bool);

/// The store's decisions, from what the launchers say.
fn store_loop(
    rx: &mpsc::Receiver<Heard>,
    cfg: &StoreConfig,
    ranks_addr: &str,
    here: &str,
    writers: &mut Vec<Option<TcpStream>>,
) -> Result<(), String> {
    let n = cfg.nnodes;
    let mut generation = 0u64;
    let mut restarts = 0u32;
    let mut ready = vec![false; n];
    let mut done = vec![false; n];
    // Until when the nodes may take to be ready for the generation (None once it started).
    let mut ready_by = Some(Instant::now() + cfg.timeout);
    // The failures of this generation, and when to decide on them.
    let mut failures: Option<(Instant, Vec<Failure>)> = None;
    let beat = beat(cfg.timeout);
    let mut next_beat = Instant::now() + beat;
    let tell = |writers: &mut Vec<Option<TcpStream>>, m: &FromStore| {
        for w in writers.iter_mut().flatten() {
            // A node that cannot be told is lost: its reader reports that.
            let _ = write_line(w, m);
        }
    };
    let abort = |writers: &mut Vec<Option<TcpStream>>, why: String| -> Result<(), String> {
        tell(writers, &FromStore::Abort { why: why.clone() });
        Err(why)
    };
    loop {
        let now = Instant::now();
        if now >= next_beat {
            tell(writers, &FromStore::Beat);
            next_beat = now + beat;
        }
        if let Some((at, list)) = &failures
            && now >= *at
        {
            // Among the failures reported together, one ended by a signal goes first.
            let mut list = list.clone();
            blame(&mut list, |f| f.3);
            let first = list.swap_remove(0);
            failures = None;
            let (node, rank, exit, _) = first;
            if restarts >= cfg.max_restarts {
                return abort(
                    writers,
                    format!(
                        "rank {rank} on node {node} failed first ({exit}); every node stopped its ranks after \
                         {restarts} restart(s) of {}",
                        cfg.max_restarts
                    ),
                );
            }
            restarts += 1;
            generation += 1;
            ready.fill(false);
            done.fill(false);
            ready_by = Some(now + cfg.timeout);
            tell(writers, &FromStore::Restart { generation, restart: restarts, node, rank, exit });
        }
        if let Some(by) = ready_by
            && now >= by
        {
            let missing: Vec<usize> = (0..n).filter(|&k| !ready[k]).collect();
            let what = if generation == 0 {
                "did not register with the launchers' store".to_string()
            } else {
                format!("did not come back for restart {restarts} (generation {generation})")
            };
            return abort(
                writers,
                format!(
                    "node(s) {missing:?} {what} within {:.1} s (--rdzv-timeout)",
                    cfg.timeout.as_secs_f64()
                ),
            );
        }
        let heard = match rx.recv_timeout(beat.min(Duration::from_millis(50))) {
            Ok(h) => h,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return abort(writers, format!("the launchers' store at {here} stopped listening"));
            }
        };
        match heard {
            Heard::Joined(node, mut w) => {
                if writers[node].is_some() {
                    let why = format!("node {node} registered twice with the launchers' store");
                    let _ = write_line(&mut w, &FromStore::Abort { why: why.clone() });
                    return abort(writers, why);
                }
                writers[node] = Some(w);
            }
            Heard::Said(node, ToStore::Ready { generation: g }) if g == generation => {
                ready[node] = true;
                if ready.iter().all(|&r| r) && writers.iter().all(Option::is_some) {
                    let port = match free_port(ranks_addr) {
                        Ok(p) => p,
                        Err(e) => return abort(writers, format!("{e:#}")),
                    };
                    ready_by = None;
                    tell(writers, &FromStore::Start { generation, port });
                }
            }
            Heard::Said(node, ToStore::Failed { generation: g, rank, exit, signalled })
                if g == generation =>
            {
                let f = (node, rank, exit, signalled);
                let list = match &mut failures {
                    Some((_, list)) => {
                        list.push(f);
                        list
                    }
                    None => &mut failures.insert((Instant::now() + SETTLE, vec![f])).1,
                };
                // Every node has a failure to report: nothing more to wait for.
                if (0..n).all(|k| list.iter().any(|f| f.0 == k))
                    && let Some((at, _)) = &mut failures
                {
                    *at = Instant::now();
                }
            }
            Heard::Said(node, ToStore::Done { generation: g }) if g == generation => {
                done[node] = true;
                if failures.is_none() && done.iter().all(|&d| d) {
                    tell(writers, &FromStore::Finished);
                    return Ok(());
                }
            }
            // A message of a generation already left behind (a rank that failed because of
            // the restart), or a heartbeat.
            Heard::Said(..) => {}
            Heard::Gone(node, why) => {
                writers[node] = None;
                return abort(writers, format!("node {node}'s launcher was lost: {why}"));
            }
        }
    }
}

/// The longest message accepted from the other side.
const MAX_MESSAGE: u64 = 64 << 10;

/// The next JSON line on `r`; a connection that ends is `UnexpectedEof`.
fn next_message<T: for<'de> Deserialize<'de>>(r: &mut impl BufRead) -> std::io::Result<T> {
    let mut line = Vec::new();
    r.take(MAX_MESSAGE).read_until(b'\n', &mut line)?;
    if line.last() != Some(&b'\n') {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the connection closed"));
    }
    serde_json::from_slice(&line).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// A free TCP port on `addr`.
pub fn free_port(addr: &str) -> anyhow::Result<u16> {
    let l = TcpListener::bind((addr, 0)).with_context(|| format!("finding a free port on {addr}"))?;
    Ok(l.local_addr()?.port())
}

/// What a launcher hears from the store.
#[derive(Debug, Clone, PartialEq)]
pub enum News {
    /// The store said this.
    Said(FromStore),
    /// The store is gone, for this reason.
    Lost(String),
}

/// A launcher's registration with the store: what it tells it and what it hears back.
pub struct Member {
    writer: Arc<Mutex<TcpStream>>,
    news: mpsc::Receiver<News>,
    stop: Arc<AtomicBool>,
    store: String,
}

impl Member {
    /// Register node `node` with the store at `store`, retrying until `timeout` for it to come
    /// up.
    pub fn join(store: &str, node: usize, cfg: &StoreConfig) -> anyhow::Result<Member> {
        let addr: SocketAddr = crate::rendezvous::resolve(store).map_err(|e| anyhow::anyhow!("{e}"))?;
        let deadline = Instant::now() + cfg.timeout;
        let s = connect_retry(&addr, deadline).with_context(|| {
            format!("node {node}: cannot reach the launchers' store at {store} (node 0's launcher)")
        })?;
        s.set_read_timeout(Some(cfg.timeout))?;
        s.set_write_timeout(Some(cfg.timeout))?;
        let mut w = s.try_clone()?;
        let hello = Hello {
            magic: MAGIC.into(),
            rank: node,
            world: cfg.nnodes,
            fingerprint: StoreConfig::fingerprint(cfg.nproc, cfg.max_restarts),
            to: None,
            addr: Some(s.local_addr()?),
            nonce: fresh_nonce()?,
        };
        let token = cfg.token.as_deref();
        let registered = handshake::offer(&s, &mut w, &hello, token).and_then(|nonce| {
            let welcome: Welcome = read_line(&s)?;
            handshake::confirm(token, &hello, &nonce, welcome.refused, welcome.proof.as_ref())
        });
        registered
            .map_err(|e| anyhow::anyhow!("node {node}: the launchers' store at {store} refused it: {e}"))?;
        let (tx, news) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        {
            let (s, stop, store) = (s.try_clone()?, stop.clone(), store.to_string());
            std::thread::spawn(move || {
                let mut r = BufReader::new(s);
                loop {
                    let n = match next_message::<FromStore>(&mut r) {
                        Ok(FromStore::Beat) => continue,
                        Ok(m) => News::Said(m),
                        Err(_) if stop.load(Ordering::Relaxed) => return,
                        Err(e) => News::Lost(match e.kind() {
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
                                "the launchers' store at {store} (node 0's launcher) sent nothing, not even \
                                 a heartbeat, within the timeout"
                            ),
                            std::io::ErrorKind::UnexpectedEof => format!(
                                "lost the launchers' store at {store}: its connection closed (node 0's launcher is gone)"
                            ),
                            _ => format!("lost the launchers' store at {store}: {e}"),
                        }),
                    };
                    let end = matches!(n, News::Lost(_));
                    if tx.send(n).is_err() || end {
                        return;
                    }
                }
            });
        }
        let writer = Arc::new(Mutex::new(w));
        {
            let (writer, stop, period) = (writer.clone(), stop.clone(), beat(cfg.timeout));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(period);
                    let Ok(mut w) = writer.lock() else { return };
                    if write_line(&mut *w, &ToStore::Beat).is_err() {
                        return;
                    }
                }
            });
        }
        Ok(Member { writer, news, stop, store: store.to_string() })
    }

    /// Tell the store `m`.
    pub fn tell(&self, m: &ToStore) -> anyhow::Result<()> {
        let mut w =
            self.writer.lock().map_err(|_| anyhow::anyhow!("the store's connection lock is poisoned"))?;
        write_line(&mut *w, m).with_context(|| format!("telling the launchers' store at {}", self.store))
    }

    /// What the store said since the last call, if anything (never blocks).
    pub fn poll(&self) -> Option<News> {
        match self.news.try_recv() {
            Ok(n) => Some(n),
            Err(mpsc::TryRecvError::Empty) => None,
            Err(mpsc::TryRecvError::Disconnected) => {
                Some(News::Lost(format!("lost the launchers' store at {}", self.store)))
            }
        }
    }

    /// The store's next word, waiting at most `limit` (`None`: as long as the store keeps
    /// beating, which a lost store stops).
    pub fn next(&self, limit: Option<Duration>, waiting_for: &str) -> anyhow::Result<FromStore> {
        let got = match limit {
            Some(l) => self.news.recv_timeout(l).map_err(|_| {
                anyhow::anyhow!(
                    "no word from the launchers' store at {} within {:.1} s while waiting for {waiting_for}",
                    self.store,
                    l.as_secs_f64()
                )
            })?,
            None => self
                .news
                .recv()
                .map_err(|_| anyhow::anyhow!("lost the launchers' store at {}", self.store))?,
        };
        match got {
            News::Said(m) => Ok(m),
            News::Lost(why) => bail!("{why}"),
        }
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Ok(w) = self.writer.lock() {
            let _ = w.shutdown(std::net::Shutdown::Both);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::blame;

    #[test]
    fn a_signalled_failure_is_blamed_first() {
        let mut f = [(0, false), (1, false), (2, true), (3, true)];
        blame(&mut f, |x| x.1);
        assert_eq!(f, [(2, true), (0, false), (1, false), (3, true)]);
        let mut f = [(1, true), (0, true)];
        blame(&mut f, |x| x.1);
        assert_eq!(f, [(1, true), (0, true)]);
        let mut f = [(4, false), (5, false)];
        blame(&mut f, |x| x.1);
        assert_eq!(f, [(4, false), (5, false)]);
    }
}
