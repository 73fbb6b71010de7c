//! Rendezvous: how the ranks of a DDP run find each other, torchrun-style.
//!
//! Rank 0 hosts a one-shot store at `--master-addr:--master-port`. Every rank (rank 0
//! included) binds a ring listener, connects to the store, and registers: its rank, the world
//! size, the model fingerprint and its listener's address, proving it knows the shared token
//! in the ring's challenge-response handshake ([`crate::collective::handshake`]). Once all
//! `world` ranks have registered, the store answers each with every rank's address (and, for
//! NCCL, the unique id rank 0 made) and its own proof of the token, which the rank checks
//! before it trusts the addresses; then it closes. Registrations that do not fit (another
//! run, another model, a rank registered twice) are refused with the reason and do not
//! count. Every wait is bounded by the timeout; a rank that never arrives is named.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::collective::handshake::{
    self, Hello, MAGIC, Nonce, Proof, Role, fresh_nonce, read_line, write_line,
};
use crate::collective::tcp::{MeshInfo, connect_retry};
use crate::collective::{CollectiveError, Result, RingConfig, TcpComm, nccl};

/// Who this rank is and where the store is.
#[derive(Debug, Clone)]
pub struct RendezvousConfig {
    /// The store's `host:port` (rank 0 binds it).
    pub master: String,
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// The model fingerprint every rank must share.
    pub fingerprint: String,
    /// The shared token, if any.
    pub token: Option<String>,
    /// How long to wait for the store and for every rank.
    pub timeout: Duration,
    /// Rank 0 makes an NCCL unique id and the store hands it out.
    pub nccl: bool,
    /// The launchers' generation of the run (0, then one more for each restart): the store
    /// refuses a rank of another one, a straggler of a generation already restarted.
    pub generation: u64,
}

impl RendezvousConfig {
    /// What the store and the ranks registering with it compare: the model's fingerprint and,
    /// after a restart, the generation.
    fn registration(&self) -> String {
        match self.generation {
            0 => self.fingerprint.clone(),
            g => format!("{} (generation {g})", self.fingerprint),
        }
    }
}

/// What the store answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StoreReply {
    /// Why the registration was refused, if it was.
    refused: Option<String>,
    /// Every rank's ring listener, by rank. (Defaulted: a refusal in the handshake is a
    /// [`handshake::Welcome`], which has no addresses.)
    #[serde(default)]
    addrs: Vec<SocketAddr>,
    /// The NCCL unique id, when asked for.
    #[serde(default)]
    nccl_id: Option<Vec<u8>>,
    /// The store's proof that it knows the token, for this registration's handshake.
    #[serde(default)]
    proof: Option<Proof>,
}

impl StoreReply {
    fn refusal(why: String) -> StoreReply {
        StoreReply { refused: Some(why), addrs: vec![], nccl_id: None, proof: None }
    }
}

/// A registration the store has accepted: the connection, the rank's hello and the store's
/// nonce (to prove the token back in the reply).
struct Registered {
    stream: TcpStream,
    hello: Hello,
    nonce: Nonce,
}

/// A rank that has met the others.
#[derive(Debug)]
pub struct Joined {
    /// This rank's ring listener (its address is `mesh.addrs[rank]`).
    pub listener: TcpListener,
    /// Every rank's address and the shared identity.
    pub mesh: MeshInfo,
    /// The NCCL unique id, when asked for.
    pub nccl_id: Option<[u8; nccl::ID_BYTES]>,
}

fn rdzv(addr: &str, why: impl Into<String>) -> CollectiveError {
    CollectiveError::Rendezvous { addr: addr.to_string(), why: why.into() }
}

/// Resolve `host:port`, preferring IPv4.
pub fn resolve(master: &str) -> Result<SocketAddr> {
    let addrs: Vec<SocketAddr> =
        master.to_socket_addrs().map_err(|e| rdzv(master, format!("cannot resolve: {e}")))?.collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| rdzv(master, "resolves to no address"))
}

/// Bind the store's listener at `addr` (all interfaces if `addr`'s IP is not local).
pub fn bind_store(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr)
        .or_else(|e| {
            if e.kind() == std::io::ErrorKind::AddrNotAvailable {
                TcpListener::bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), addr.port()))
            } else {
                Err(e)
            }
        })
        .map_err(|e| rdzv(&addr.to_string(), format!("rank 0 cannot bind the store: {e}")))
}

/// Serve one rendezvous of `world` ranks on `listener`, then return.
pub fn serve_store(
    listener: TcpListener,
    world: usize,
    fingerprint: &str,
    token: Option<&str>,
    nccl_id: Option<[u8; nccl::ID_BYTES]>,
    timeout: Duration,
) -> Result<()> {
    let here = listener.local_addr().map_or_else(|_| "?".to_string(), |a| a.to_string());
    let deadline = Instant::now() + timeout;
    let mut pending: Vec<Option<Registered>> = (0..world).map(|_| None).collect();
    listener.set_nonblocking(true).map_err(|e| rdzv(&here, e.to_string()))?;
    while pending.iter().any(Option::is_none) {
        let (s, from) = match listener.accept() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = (0..world).filter(|&r| pending[r].is_none()).collect();
                    let why =
                        format!("ranks {missing:?} never registered within {:.1} s", timeout.as_secs_f64());
                    for mut reg in pending.into_iter().flatten() {
                        let _ = write_line(&mut reg.stream, &StoreReply::refusal(why.clone()));
                    }
                    return Err(CollectiveError::Timeout { peer: missing[0], op: "rendezvous", timeout });
                }
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(e) => return Err(rdzv(&here, format!("accept: {e}"))),
        };
        let _ = s.set_nonblocking(false);
        // A silent client must not hold the store up for long.
        let _ = s.set_read_timeout(Some(timeout.min(Duration::from_secs(10))));
        let _ = s.set_write_timeout(Some(timeout.min(Duration::from_secs(10))));
        let (mut w, nonce) = match (s.try_clone(), fresh_nonce()) {
            (Ok(w), Ok(n)) => (w, n),
            _ => continue,
        };
        let hello = match handshake::accept(&s, &mut w, None, world, fingerprint, token, &nonce) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!("rendezvous store refused a client at {from}: {e}");
                continue;
            }
        };
        if pending[hello.rank].is_some() {
            let why = format!("rank {} registered twice", hello.rank);
            tracing::warn!("rendezvous store refused {from}: {why}");
            let _ = write_line(&mut w, &StoreReply::refusal(why));
            continue;
        }
        let rank = hello.rank;
        pending[rank] = Some(Registered { stream: s, hello, nonce });
    }
    let all: Vec<Registered> = pending.into_iter().flatten().collect();
    // Every slot is filled with a hello that passed `refuse`, which requires an address.
    let addrs: Vec<SocketAddr> = all.iter().filter_map(|r| r.hello.addr).collect();
    for (rank, mut reg) in all.into_iter().enumerate() {
        let reply = StoreReply {
            refused: None,
            addrs: addrs.clone(),
            nccl_id: nccl_id.map(|id| id.to_vec()),
            proof: Some(handshake::proof(token, Role::Acceptor, &reg.hello, &reg.nonce)),
        };
        write_line(&mut reg.stream, &reply)
            .map_err(|e| rdzv(&here, format!("answering rank {rank}: {e}")))?;
    }
    Ok(())
}

/// Register with the store and learn every rank's address. Rank 0 binds and serves the
/// store first, on a thread that ends once everyone has registered.
pub fn join(cfg: &RendezvousConfig) -> Result<Joined> {
    join_with_store(cfg, None)
}

/// [`join`], with rank 0 serving the store on `store` (already bound, e.g. to port 0 by a
/// test) instead of binding `cfg.master` itself.
pub fn join_with_store(cfg: &RendezvousConfig, store: Option<TcpListener>) -> Result<Joined> {
    if cfg.rank >= cfg.world {
        return Err(CollectiveError::Invalid {
            what: "rank",
            why: format!("{} is not below the world size {}", cfg.rank, cfg.world),
        });
    }
    let master = resolve(&cfg.master)?;
    let store: Option<JoinHandle<Result<()>>> = if cfg.rank == 0 {
        let listener = match store {
            Some(l) => l,
            None => bind_store(master)?,
        };
        let id = if cfg.nccl { Some(nccl::unique_id()?) } else { None };
        let (world, fp, token, t) = (cfg.world, cfg.registration(), cfg.token.clone(), cfg.timeout);
        Some(std::thread::spawn(move || serve_store(listener, world, &fp, token.as_deref(), id, t)))
    } else {
        None
    };
    let deadline = Instant::now() + cfg.timeout;
    let s = connect_retry(&master, deadline)
        .map_err(|e| rdzv(&cfg.master, format!("cannot reach the store: {e}")))?;
    // Listen on the interface that reaches the store: the one the other ranks can reach too.
    let ip = s.local_addr().map_err(|e| rdzv(&cfg.master, e.to_string()))?.ip();
    let listener =
        TcpListener::bind((ip, 0)).map_err(|e| rdzv(&cfg.master, format!("binding {ip}:0: {e}")))?;
    let addr = listener.local_addr().map_err(|e| rdzv(&cfg.master, e.to_string()))?;
    let hello = Hello {
        magic: MAGIC.into(),
        rank: cfg.rank,
        world: cfg.world,
        fingerprint: cfg.registration(),
        to: None,
        addr: Some(addr),
        nonce: fresh_nonce().map_err(|e| rdzv(&cfg.master, e.to_string()))?,
    };
    let token = cfg.token.as_deref();
    let mut w = s.try_clone().map_err(|e| rdzv(&cfg.master, e.to_string()))?;
    let _ = s.set_read_timeout(Some(cfg.timeout));
    let _ = s.set_write_timeout(Some(cfg.timeout));
    let registered = handshake::offer(&s, &mut w, &hello, token);
    // The store answers once the last rank registers: wait as long as it may.
    let _ = s.set_read_timeout(Some(cfg.timeout + Duration::from_secs(5)));
    let reply: std::io::Result<StoreReply> = match &registered {
        Ok(_) => read_line(&s),
        Err(_) => Ok(StoreReply::refusal(String::new())),
    };
    if let Some(h) = store {
        h.join().map_err(|_| rdzv(&cfg.master, "the store thread panicked"))??;
    }
    let nonce = registered.map_err(|e| rdzv(&cfg.master, format!("registering: {e}")))?;
    let reply = reply.map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            rdzv(&cfg.master, format!("not every rank registered within {:.1} s", cfg.timeout.as_secs_f64()))
        }
        _ => rdzv(&cfg.master, format!("bad answer: {e}")),
    })?;
    handshake::confirm(token, &hello, &nonce, reply.refused, reply.proof.as_ref())
        .map_err(|e| rdzv(&cfg.master, e.to_string()))?;
    if reply.addrs.len() != cfg.world {
        return Err(rdzv(
            &cfg.master,
            format!("answered {} addresses for {} ranks", reply.addrs.len(), cfg.world),
        ));
    }
    let nccl_id = match reply.nccl_id {
        Some(v) => Some(
            <[u8; nccl::ID_BYTES]>::try_from(v.as_slice())
                .map_err(|_| rdzv(&cfg.master, format!("NCCL id of {} bytes", v.len())))?,
        ),
        None if cfg.nccl => return Err(rdzv(&cfg.master, "no NCCL id in the answer")),
        None => None,
    };
    Ok(Joined {
        listener,
        mesh: MeshInfo {
            rank: cfg.rank,
            addrs: reply.addrs,
            fingerprint: cfg.fingerprint.clone(),
            token: cfg.token.clone(),
        },
        nccl_id,
    })
}

/// Rendezvous, then connect the TCP mesh.
pub fn connect_tcp(cfg: &RendezvousConfig, ring: RingConfig) -> Result<TcpComm> {
    if cfg.world == 1 {
        return Ok(TcpComm::single(ring));
    }
    let joined = join(cfg)?;
    TcpComm::connect(joined.listener, &joined.mesh, ring)
}

/// The first host of a Slurm node list: `node[01-04,07]` gives `node01`, `a,b` gives `a`,
/// `gpu[3-4]-ib,cpu1` gives `gpu3-ib`.
pub fn first_slurm_host(list: &str) -> Option<String> {
    slurm_hosts(list).ok()?.into_iter().next()
}

/// Every host of a Slurm node list (`SLURM_JOB_NODELIST`), in its order: `node[01-03,07]`
/// gives `node01 node02 node03 node07` (a range keeps its zero padding), `gpu[3-4]-ib,cpu1`
/// gives `gpu3-ib gpu4-ib cpu1`; one bracket per entry, as Slurm writes them. `Err` says what
/// is wrong with the list.
pub fn slurm_hosts(list: &str) -> std::result::Result<Vec<String>, String> {
    let list = list.trim();
    let mut hosts = Vec::new();
    // Entries are separated by the commas outside brackets.
    let mut depth = 0i32;
    let mut start = 0;
    let mut entries = Vec::new();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                entries.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    entries.push(&list[start..]);
    for entry in entries {
        let entry = entry.trim();
        let bad = |why: &str| format!("node list `{list}`: `{entry}` {why}");
        match (entry.find('['), entry.find(']')) {
            (None, None) if !entry.is_empty() => hosts.push(entry.to_string()),
            (None, None) => return Err(bad("is an empty host name")),
            (Some(open), Some(close)) if open < close && !entry[close + 1..].contains(['[', ']']) => {
                let (prefix, suffix) = (&entry[..open], &entry[close + 1..]);
                for range in entry[open + 1..close].split(',').map(str::trim) {
                    let (lo, hi) = range.split_once('-').unwrap_or((range, range));
                    let (Ok(a), Ok(b)) = (lo.parse::<u64>(), hi.parse::<u64>()) else {
                        return Err(bad(&format!("has `{range}`, not a number or range of numbers")));
                    };
                    if a > b || b - a > 100_000 {
                        return Err(bad(&format!("has the range `{range}`")));
                    }
                    for n in a..=b {
                        hosts.push(format!("{prefix}{n:0width$}{suffix}", width = lo.len()));
                    }
                }
            }
            _ => return Err(bad("has unbalanced brackets")),
        }
    }
    Ok(hosts)
}

#[cfg(test)]
mod tests {
    use super::{first_slurm_host, slurm_hosts};

    #[test]
    fn slurm_node_lists() {
        assert_eq!(first_slurm_host("node[01-04,07]").as_deref(), Some("node01"));
        assert_eq!(first_slurm_host("node[07,01-04]").as_deref(), Some("node07"));
        assert_eq!(first_slurm_host("alpha,beta").as_deref(), Some("alpha"));
        assert_eq!(first_slurm_host("gpu[3-4]-ib,cpu1").as_deref(), Some("gpu3-ib"));
        assert_eq!(first_slurm_host("single").as_deref(), Some("single"));
        assert_eq!(first_slurm_host("a[1-2],b[3]").as_deref(), Some("a1"));
        assert_eq!(first_slurm_host("").as_deref(), None);
        assert_eq!(first_slurm_host("bad[1-2").as_deref(), None);
        assert_eq!(first_slurm_host("bad[]").as_deref(), None);
    }

    #[test]
    fn slurm_node_lists_expand_whole() {
        let all = |l: &str| slurm_hosts(l).unwrap().join(" ");
        assert_eq!(all("node[01-03,07]"), "node01 node02 node03 node07");
        assert_eq!(all("gpu[3-4]-ib,cpu1"), "gpu3-ib gpu4-ib cpu1");
        assert_eq!(all("a[1-2],b[3]"), "a1 a2 b3");
        assert_eq!(all("n[8-11]"), "n8 n9 n10 n11");
        assert_eq!(all("n[098-101]"), "n098 n099 n100 n101");
        assert_eq!(all("localhost"), "localhost");
        for (bad, says) in [
            ("", "empty host name"),
            ("a,,b", "empty host name"),
            ("n[1-2", "unbalanced"),
            ("n[x]", "`x`, not a number"),
            ("n[3-1]", "the range `3-1`"),
            ("n[1]x[2]", "unbalanced"),
        ] {
            let e = slurm_hosts(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
