//! Emulated hosts on one Linux machine: one network namespace per host, each with a veth pair
//! whose other end sits on a bridge in a hub namespace of its own, so nothing is added to the
//! machine's own network and parallel clusters never see each other.
//!
//! ```text
//!   gs-<pid>-<n>-h0          gs-<pid>-<n>-hub             gs-<pid>-<n>-h1
//!  [eth0 10.77.0.1] ==veth== [h0]--br0--[h1] ==veth== [eth0 10.77.0.2]   ...
//!      tc: htb rate,            tc: htb rate,               tc: ...
//!          bpf loss, netem delay    bpf loss, netem delay
//! ```
//!
//! Loss does not need netem (which some kernels lack): a classic-BPF classifier draws a
//! random number per packet (`ld rand`) and sends the chosen share to an htb class whose queue
//! holds nothing (`pfifo limit 0`), where they are dropped. Delay needs netem.
//!
//! Each link is shaped in both directions: the host's `eth0` shapes what the host sends, the
//! hub's end shapes what it receives. Under the rate, a NIC's queue is [`Queue::Fair`] by
//! default: one htb class per peer host (by destination on `eth0`, by source on the hub's
//! end), each guaranteed its share and lending the rest, and inside each a queue per
//! connection (an htb of its own whose classes a BPF classifier picks by the TCP ports), so
//! that peers with packets waiting share the link evenly, and a peer's connections its share,
//! whatever their TCP windows, as the fabric the advisor prices does.
//! [`Queue::Fifo`] keeps one queue of `txqueuelen` packets for all of them: windows grown
//! unevenly then share it unevenly (a parameter server's incast leaves some workers' pushes
//! behind the others' and every worker waiting at the barrier for the last). A [`Cluster`] deletes its namespaces (and kills whatever
//! still runs in them) when dropped; [`cleanup_all`] does the same from a signal handler's
//! thread, and [`sweep_stale`] removes what a killed run left behind.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// One host of an emulated cluster: a network namespace and its address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSlot {
    /// The namespace's name.
    pub netns: String,
    /// The host's IPv4 address.
    pub addr: String,
}

/// Why a cluster could not be made or changed.
#[derive(Debug, Error)]
pub enum ClusterError {
    /// Not root, no `ip`/`tc`, or the kernel refused a namespace: the cluster cannot exist here.
    #[error("the emulated cluster needs root and iproute2 (ip, tc): {0}")]
    Unavailable(String),
    /// An `ip` or `tc` command failed.
    #[error("`{cmd}` failed: {stderr}")]
    Command {
        /// The command line.
        cmd: String,
        /// What it wrote to stderr.
        stderr: String,
    },
    /// Delay was asked for and the kernel has no netem qdisc.
    #[error(
        "--delay-us needs the kernel's netem qdisc (sch_netem), which this kernel lacks (rate shaping \
         and --loss work without it): {0}"
    )]
    NoNetem(String),
    /// Loss was asked for and the kernel cannot classify with BPF or drop in htb.
    #[error("--loss needs the kernel's bpf classifier (cls_bpf) and htb: {0}")]
    NoLoss(String),
    /// A host index outside the cluster.
    #[error("no host {0} in this cluster of {1}")]
    NoHost(usize, usize),
}

/// How a shaped NIC's queue shares its link among the peer hosts whose packets wait in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Queue {
    /// A queue per peer host, served in turn (htb's deficit round robin among classes of
    /// equal share): every backlogged peer gets its share of the link; and inside it a queue
    /// per connection, served in turn: two ranks of one host sending to one peer get half of
    /// that share each.
    #[default]
    Fair,
    /// One FIFO for every peer, `txqueuelen` (1000) packets deep: TCP windows share the link
    /// as unevenly as they grew.
    Fifo,
}

impl Queue {
    /// How reports name it.
    pub fn label(self) -> &'static str {
        match self {
            Queue::Fair => "fair among peers and connections",
            Queue::Fifo => "one FIFO",
        }
    }
}

/// One direction of every host's link.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Shape {
    /// Bits per second (none: as fast as the machine copies).
    pub rate_bit: Option<f64>,
    /// Delay added in each direction of each link: host to host is twice this.
    pub delay: Duration,
    /// Percentage of packets dropped in each direction.
    pub loss_pct: f64,
    /// The hosts' TCP minimum retransmission timeout, set on their route (none: the kernel's
    /// 200 ms). A dilated cluster stretches it with every other clock ([`Shape::dilated`]).
    pub rto_min: Option<Duration>,
    /// How the NIC's queue shares the rate among peers (shaped links only).
    pub queue: Queue,
}

/// Linux's minimum TCP retransmission timeout (`TCP_RTO_MIN`).
pub const KERNEL_RTO_MIN: Duration = Duration::from_millis(200);

impl Shape {
    /// A link of `rate_bit` bits per second, nothing else added (no delay, no loss, the
    /// kernel's retransmission timeout, fair queues).
    pub const fn at_rate(rate_bit: f64) -> Shape {
        Shape {
            rate_bit: Some(rate_bit),
            delay: Duration::ZERO,
            loss_pct: 0.0,
            rto_min: None,
            queue: Queue::Fair,
        }
    }

    /// The same link in a world `d` times slower ([`gradsync_core::dilation`]): the rate
    /// divided by `d`, the delay and the minimum retransmission timeout times `d` (the bytes
    /// of the shaper's burst and queue stay: a byte is a byte in either world); loss unchanged.
    pub fn dilated(self, d: f64) -> Shape {
        if d <= 1.0 {
            return self;
        }
        Shape {
            rate_bit: self.rate_bit.map(|r| r / d),
            delay: self.delay.mul_f64(d),
            loss_pct: self.loss_pct,
            rto_min: Some(self.rto_min.unwrap_or(KERNEL_RTO_MIN).mul_f64(d)),
            queue: self.queue,
        }
    }
}

/// Every namespace made by this process and not yet deleted, for [`cleanup_all`].
static LIVE: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
/// Clusters made by this process so far: names stay unique within it.
static SEQ: AtomicUsize = AtomicUsize::new(0);
/// Every namespace name starts with this, then the creating process's id.
const PREFIX: &str = "gs-";
/// The hosts' subnet (inside the cluster's own namespaces, so it never meets the machine's).
const SUBNET: &str = "10.77";

/// Hosts in network namespaces, joined by a bridge, each link shaped.
#[derive(Debug)]
pub struct Cluster {
    hub: String,
    hosts: Vec<HostSlot>,
    shape: Shape,
    /// Under [`Queue::Fair`]: each host's connection tracker ([`track_connections`]) and the
    /// flag that stops them.
    trackers: Option<(Arc<AtomicBool>, Vec<Tracker>)>,
}

/// A host's connection tracker's thread.
type Tracker = std::thread::JoinHandle<std::io::Result<()>>;

impl Cluster {
    /// Make `n` hosts with links shaped by `shape`. Everything made so far is deleted again
    /// if a step fails.
    pub fn create(n: usize, shape: Shape) -> Result<Cluster, ClusterError> {
        available()?;
        let tag = format!("{PREFIX}{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
        let hub = format!("{tag}-hub");
        let mut c = Cluster { hub: hub.clone(), hosts: Vec::new(), shape, trackers: None };
        add_ns(&hub).map_err(|e| match e {
            ClusterError::Command { stderr, .. } => {
                ClusterError::Unavailable(format!("`ip netns add` failed: {stderr}"))
            }
            e => e,
        })?;
        ip(&["-n", &hub, "link", "set", "lo", "up"])?;
        // Hosts made from the hub get TCP tables of their own, small enough to read often.
        let own_tables = run(
            "ip",
            &[
                "netns",
                "exec",
                &hub,
                "sysctl",
                "-q",
                "-w",
                &format!("net.ipv4.tcp_child_ehash_entries={HOST_EHASH}"),
            ],
        )
        .is_ok();
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &hub, "link", "set", "br0", "up"])?;
        let addrs: Vec<String> = (0..n).map(host_addr).collect();
        for (i, addr) in addrs.iter().cloned().enumerate() {
            let ns = format!("{tag}-h{i}");
            if own_tables {
                add_ns_from(&hub, &ns)?;
            } else {
                add_ns(&ns)?;
            }
            c.hosts.push(HostSlot { netns: ns.clone(), addr: addr.clone() });
            let port = format!("h{i}");
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            ip(&["-n", &ns, "link", "add", "eth0", "type", "veth", "peer", "name", &port, "netns", &hub])?;
            ip(&["-n", &ns, "addr", "add", &format!("{addr}/16"), "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            tcp_clocks(&ns, &shape)?;
            ip(&["-n", &hub, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &hub, "link", "set", &port, "up"])?;
            shape_dev(&ns, "eth0", &shape, &Peers { addrs: &addrs, by: "dst" })?;
            shape_dev(&hub, &port, &shape, &Peers { addrs: &addrs, by: "src" })?;
        }
        if shape.queue == Queue::Fair && shape.rate_bit.is_some() && n > 1 {
            let stop = Arc::new(AtomicBool::new(false));
            let mut threads = Vec::new();
            for i in 0..n {
                let (hub, addrs, stop) = (hub.clone(), addrs.clone(), stop.clone());
                let ns = c.hosts[i].netns.clone();
                let every = if own_tables { TRACK_EVERY } else { TRACK_EVERY_SHARED };
                threads.push(c.spawn_on(i, move || track_connections(i, &ns, &hub, &addrs, every, &stop))?);
            }
            c.trackers = Some((stop, threads));
        }
        Ok(c)
    }

    /// The hosts, in order.
    pub fn hosts(&self) -> &[HostSlot] {
        &self.hosts
    }

    /// How every link is shaped.
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// A command that runs `program` on host `i`.
    pub fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Result<Command, ClusterError> {
        let h = self.hosts.get(i).ok_or(ClusterError::NoHost(i, self.hosts.len()))?;
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &h.netns]).arg(program);
        Ok(c)
    }

    /// Start a thread inside host `i`'s network namespace running `f`: every socket it makes
    /// belongs to that host and stays there when handed to another thread (accepted ones too,
    /// for a listener made here). Threads it starts inherit the namespace.
    pub fn spawn_on<T: Send + 'static>(
        &self,
        i: usize,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<std::thread::JoinHandle<std::io::Result<T>>, ClusterError> {
        let h = self.hosts.get(i).ok_or(ClusterError::NoHost(i, self.hosts.len()))?;
        let path = Path::new("/var/run/netns").join(&h.netns);
        Ok(std::thread::spawn(move || {
            let ns = std::fs::File::open(&path)?;
            // SAFETY: setns reads only its two integer arguments; with CLONE_NEWNET it moves
            // this thread alone (not the process) into the namespace the open file names.
            if unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(f())
        }))
    }

    /// Cut host `i`'s link (its `eth0` goes down): packets to and from it are lost, sockets
    /// are not told.
    pub fn cut(&self, i: usize) -> Result<(), ClusterError> {
        let h = self.hosts.get(i).ok_or(ClusterError::NoHost(i, self.hosts.len()))?;
        ip(&["-n", &h.netns, "link", "set", "eth0", "down"])
    }

    /// Bring host `i`'s link back.
    pub fn restore(&self, i: usize) -> Result<(), ClusterError> {
        let h = self.hosts.get(i).ok_or(ClusterError::NoHost(i, self.hosts.len()))?;
        ip(&["-n", &h.netns, "link", "set", "eth0", "up"])
    }

    /// The bytes each connection queue of host `to`'s link carried from host `from` so far
    /// (its hub end's [`Queue::Fair`] queues, in order): empty where the link has none (one
    /// FIFO, or not shaped).
    pub fn connection_bytes(&self, to: usize, from: usize) -> Result<Vec<u64>, ClusterError> {
        let n = self.hosts.len();
        for i in [to, from] {
            if i >= n {
                return Err(ClusterError::NoHost(i, n));
            }
        }
        let dev = format!("h{to}");
        let cmd = format!("tc -n {} -s class show dev {dev}", self.hub);
        let o = Command::new("tc")
            .args(["-n", &self.hub, "-s", "class", "show", "dev", &dev])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| ClusterError::Unavailable(format!("running `{cmd}`: {e}")))?;
        if !o.status.success() {
            let stderr = String::from_utf8_lossy(&o.stderr).trim().to_string();
            return Err(ClusterError::Command { cmd, stderr });
        }
        Ok(queue_bytes(&String::from_utf8_lossy(&o.stdout), PEER_CLASS + from))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some((stop, threads)) = self.trackers.take() {
            stop.store(true, Ordering::Relaxed);
            threads.into_iter().for_each(|t| drop(t.join()));
        }
        for h in &self.hosts {
            delete_ns(&h.netns);
        }
        delete_ns(&self.hub);
    }
}

/// Whether a cluster can be made here: root, `ip` and `tc` present.
pub fn available() -> Result<(), ClusterError> {
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        return Err(ClusterError::Unavailable("not running as root".into()));
    }
    for tool in ["ip", "tc"] {
        let ok = Command::new(tool).arg("-V").stdin(Stdio::null()).output().is_ok_and(|o| o.status.success());
        if !ok {
            return Err(ClusterError::Unavailable(format!("`{tool}` not found (install iproute2)")));
        }
    }
    Ok(())
}

/// Before making clusters: delete what killed runs left behind (saying so, as `tool`), and on
/// Ctrl-C or SIGTERM kill what runs in this process's namespaces and delete them before
/// exiting with 130.
pub fn guard(tool: &'static str) {
    for n in sweep_stale() {
        eprintln!("{tool}: deleted namespace {n} left by a killed run");
    }
    std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
        rt.block_on(async {
            let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            else {
                return;
            };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            eprintln!("{tool}: interrupted; deleting the emulated hosts");
            cleanup_all();
            std::process::exit(130);
        });
    });
}

/// Kill the processes in, and delete, every namespace this process made and has not deleted:
/// what a signal handler calls before exiting.
pub fn cleanup_all() {
    let names: Vec<String> = LIVE.lock().map(|l| l.iter().cloned().collect()).unwrap_or_default();
    for n in names {
        delete_ns(&n);
    }
}

/// Delete the namespaces left by gradsync processes that no longer exist (a run killed with
/// SIGKILL cannot clean up after itself). Returns the names deleted.
pub fn sweep_stale() -> Vec<String> {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).stdin(Stdio::null()).output() else {
        return vec![];
    };
    let mut gone = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(pid) = name.strip_prefix(PREFIX).and_then(|r| r.split('-').next()) else { continue };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            delete_ns(name);
            gone.push(name.to_string());
        }
    }
    gone
}

fn add_ns(name: &str) -> Result<(), ClusterError> {
    ip(&["netns", "add", name])?;
    if let Ok(mut l) = LIVE.lock() {
        l.insert(name.to_string());
    }
    Ok(())
}

/// Buckets of a host's own TCP connection table (`tcp_child_ehash_entries` in the hub, which
/// its hosts are made from): the machine's table has hundreds of thousands, and reading the
/// host's connections (`/proc/net/tcp`) walks every one of them, some 7 ms a read.
const HOST_EHASH: usize = 1024;

/// `ip netns add name` made from inside `parent`'s namespace, so that the new one takes the
/// TCP settings `parent` gives its children ([`HOST_EHASH`]): a thread moves into `parent`,
/// unshares a namespace of its own and bind-mounts it where `ip netns` keeps them
/// (`/var/run/netns`, which making `parent` set up).
fn add_ns_from(parent: &str, name: &str) -> Result<(), ClusterError> {
    use std::ffi::CString;
    let dir = Path::new("/var/run/netns");
    let (from, at) = (dir.join(parent), dir.join(name));
    let failed = |what: &str, e: std::io::Error| ClusterError::Command {
        cmd: format!("making namespace {name} from {parent}"),
        stderr: format!("{what}: {e}"),
    };
    std::fs::File::create(&at).map_err(|e| failed(&format!("creating {}", at.display()), e))?;
    if let Ok(mut l) = LIVE.lock() {
        l.insert(name.to_string());
    }
    let target = CString::new(at.as_os_str().as_encoded_bytes()).map_err(|e| failed("its path", e.into()))?;
    let made = std::thread::spawn(move || -> Result<(), (&'static str, std::io::Error)> {
        let p = std::fs::File::open(&from).map_err(|e| ("opening the parent", e))?;
        let last = || std::io::Error::last_os_error();
        // SAFETY: setns and unshare read only their integer arguments and move this thread
        // alone; mount reads the two NUL-terminated paths, which outlive the call.
        unsafe {
            if libc::setns(std::os::fd::AsRawFd::as_raw_fd(&p), libc::CLONE_NEWNET) != 0 {
                return Err(("entering the parent", last()));
            }
            if libc::unshare(libc::CLONE_NEWNET) != 0 {
                return Err(("unshare", last()));
            }
            let source = c"/proc/thread-self/ns/net";
            if libc::mount(
                source.as_ptr(),
                target.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            ) != 0
            {
                return Err(("bind-mounting it", last()));
            }
        }
        Ok(())
    })
    .join();
    match made {
        Ok(Ok(())) => Ok(()),
        Ok(Err((what, e))) => Err(failed(what, e)),
        Err(_) => Err(failed("its thread", std::io::Error::other("panicked"))),
    }
}

/// Kill what still runs in `name`, then delete it (its veth ends go with it).
fn delete_ns(name: &str) {
    if let Ok(o) = Command::new("ip").args(["netns", "pids", name]).stdin(Stdio::null()).output() {
        for pid in String::from_utf8_lossy(&o.stdout).split_whitespace() {
            if let Ok(pid) = pid.parse::<i32>() {
                // SAFETY: kill(2) on a pid read from the namespace; no memory is touched.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
        }
    }
    let _ = Command::new("ip")
        .args(["netns", "del", name])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if let Ok(mut l) = LIVE.lock() {
        l.remove(name);
    }
}

/// The congestion control every emulated host runs. CUBIC, the kernel's default, grows its
/// window as a function of real time since the last loss, a clock a dilated world does not
/// stretch: dilated D times, it grows D times faster per emulated round trip than the world it
/// stands for, and measured so (4 workers pushing ResNet-50 into 4 shards at 1 Gbit/s, x4 and
/// x8: 1107.5 against 1227.2 ms a step, the check 10% apart). Reno grows by round trips, which
/// dilation stretches with everything else (the same cells: 908.8 and 906.1 ms, 0.3% apart),
/// and it is what CUBIC does at a datacenter's round trips of tens of microseconds (its
/// Reno-friendly region), so every emulated host runs it, dilated or not.
pub const CONGESTION_CONTROL: &str = "reno";

/// The host's TCP clocks that a link's shape does not set: [`CONGESTION_CONTROL`], slow start
/// after idle off (as training clusters tune it: a gap between steps would otherwise restart
/// every connection's window, and a dilated world's longer real gaps would restart it more
/// often than the world it stands for), and the minimum retransmission timeout on the host's
/// route when the shape names one.
fn tcp_clocks(ns: &str, s: &Shape) -> Result<(), ClusterError> {
    run("ip", &["netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.tcp_slow_start_after_idle=0"])?;
    let cc = format!("net.ipv4.tcp_congestion_control={CONGESTION_CONTROL}");
    run("ip", &["netns", "exec", ns, "sysctl", "-q", "-w", &cc])?;
    if let Some(rto) = s.rto_min {
        let ms = format!("{}ms", rto.as_millis().clamp(1, 120_000));
        ip(&["-n", ns, "route", "replace", &format!("{SUBNET}.0.0/16"), "dev", "eth0", "rto_min", &ms])?;
    }
    Ok(())
}

/// Host `i`'s address in the cluster's subnet.
fn host_addr(i: usize) -> String {
    format!("{SUBNET}.{}.{}", (i + 1) / 250, (i + 1) % 250 + 1)
}

/// The hosts a NIC's queue tells apart under [`Queue::Fair`], and by which address of a
/// packet: `dst` for what a host sends, `src` for what it receives.
struct Peers<'a> {
    addrs: &'a [String],
    by: &'static str,
}

/// The first class id of a [`Queue::Fair`] NIC's peers: peer `j` is `1:(PEER_CLASS + j)`, in
/// hex, and the class after the last takes what no peer's filter matched.
const PEER_CLASS: usize = 0x100;

/// An htb rate for links given no rate: far above what loopback copies reach.
const UNSHAPED: &str = "100gbit";

/// htb for the rate (netem's own rate drops the GSO batches veth hands it), netem under it
/// for delay, and a BPF classifier in front of it for loss. A [`Queue::Fair`] rate has a class
/// per peer under it ([`peer_classes`]), each with its own netem for delay.
fn shape_dev(ns: &str, dev: &str, s: &Shape, peers: &Peers) -> Result<(), ClusterError> {
    let tc = |args: &[&str]| -> Result<(), ClusterError> {
        let mut a = vec!["-n", ns];
        a.extend_from_slice(args);
        run("tc", &a)
    };
    // A queue deep enough for a 10 Gbit/s link's bandwidth-delay product.
    let delay = format!("{}us", s.delay.as_micros());
    let netem = ["netem", "delay", delay.as_str(), "limit", "100000"];
    let rate = s.rate_bit.map(|r| format!("{}bit", r.round() as u64));
    if rate.is_none() && s.loss_pct <= 0.0 {
        if !s.delay.is_zero() {
            tc(&[&["qdisc", "add", "dev", dev, "root"][..], &netem].concat()).map_err(netem_err)?;
        }
        return Ok(());
    }
    let fair = s.queue == Queue::Fair && s.rate_bit.is_some() && peers.addrs.len() > 1;
    let default = if fair { format!("{:x}", PEER_CLASS + peers.addrs.len()) } else { "1".into() };
    let rate = rate.as_deref().unwrap_or(UNSHAPED);
    tc(&["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", &default])?;
    // A burst of 64 KiB or more lets a GSO batch through at once, as a NIC would.
    let class = |id: &str| {
        tc(&[
            "class", "add", "dev", dev, "parent", "1:", "classid", id, "htb", "rate", rate, "ceil", rate,
            "burst", "256k", "cburst", "256k", "quantum", "65536",
        ])
    };
    class("1:1")?;
    if fair {
        peer_classes(ns, dev, s, peers)?;
    } else if !s.delay.is_zero() {
        tc(&[&["qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:"][..], &netem].concat())
            .map_err(netem_err)?;
    }
    if s.loss_pct > 0.0 {
        let lossy = |e: ClusterError| ClusterError::NoLoss(e.to_string());
        class("1:2").map_err(lossy)?;
        tc(&["qdisc", "add", "dev", dev, "parent", "1:2", "handle", "20:", "pfifo", "limit", "0"])
            .map_err(lossy)?;
        let program = drop_program(s.loss_pct);
        tc(&[
            "filter", "add", "dev", dev, "parent", "1:", "protocol", "all", "prio", "1", "bpf", "bytecode",
            &program, "flowid", "1:2",
        ])
        .map_err(lossy)?;
    }
    Ok(())
}

/// [`Queue::Fair`]'s classes under the rate class `1:1`: one per peer, guaranteed an equal
/// share of the rate and borrowing up to all of it (so a peer alone gets the whole link), a
/// u32 filter sending each peer's packets to its class, and one more class, htb's default,
/// for what no filter matched (ARP). Each peer's class holds an htb of its own,
/// `<PEER_CLASS + j>:`, of [`FLOW_QUEUES`] classes that never limit (their rate far above the
/// link's, so htb serves them in turn, a quantum each) and a BPF classifier
/// ([`flow_program`]) choosing one by the packet's TCP ports: the outer htb shares the link
/// among peers, the inner one a peer's share among its connections. One `tc -batch` for
/// them all: a 16-host cluster has 16 classes, 15 filters and 15 htbs of 16 classes on each
/// of its 32 ends.
fn peer_classes(ns: &str, dev: &str, s: &Shape, peers: &Peers) -> Result<(), ClusterError> {
    let rate = s.rate_bit.unwrap_or(0.0).round() as u64;
    let n = peers.addrs.len();
    let share = (rate / (n as u64 + 1)).max(8_000);
    let netem = |parent: &str| match s.delay.is_zero() {
        true => String::new(),
        false => format!(
            "qdisc add dev {dev} parent {parent} netem delay {}us limit 100000\n",
            s.delay.as_micros()
        ),
    };
    let mut batch = String::new();
    for j in 0..=n {
        let major = PEER_CLASS + j;
        let id = format!("1:{major:x}");
        batch += &format!(
            "class add dev {dev} parent 1:1 classid {id} htb rate {share}bit ceil {rate}bit burst 256k cburst 256k quantum 65536\n"
        );
        let Some(a) = peers.addrs.get(j) else {
            batch += &netem(&id);
            continue;
        };
        batch += &format!(
            "filter add dev {dev} parent 1: protocol ip prio 2 u32 match ip {} {a}/32 flowid {id}\n",
            peers.by
        );
        batch += &format!("qdisc add dev {dev} parent {id} handle {major:x}: htb default {FLOW_CLASS:x}\n");
        for q in 0..FLOW_QUEUES {
            let flow = format!("{major:x}:{:x}", FLOW_CLASS + q);
            batch += &format!(
                "class add dev {dev} parent {major:x}: classid {flow} htb rate {UNSHAPED} ceil {UNSHAPED} burst 256k cburst 256k quantum 65536\n"
            );
            batch += &netem(&flow);
        }
        batch += &format!(
            "filter add dev {dev} parent {major:x}: protocol all prio 2 bpf bytecode \"{}\"\n",
            flow_program(major as u32)
        );
    }
    run_batch(ns, &batch).map_err(netem_err)
}

/// The bytes sent by each class of htb `major:` in `tc -s class show`'s text, by class id.
fn queue_bytes(text: &str, major: usize) -> Vec<u64> {
    let prefix = format!("class htb {major:x}:");
    let mut out = Vec::new();
    let mut lines = text.lines();
    while let Some(l) = lines.next() {
        if !l.starts_with(&prefix) {
            continue;
        }
        let sent = lines.find_map(|l| l.trim().strip_prefix("Sent ")?.split(' ').next()?.parse::<u64>().ok());
        out.push(sent.unwrap_or(0));
    }
    out
}

/// How often a host's connection tracker looks for new connections, in a host with a TCP
/// table of its own ([`HOST_EHASH`]: a read takes some tens of microseconds).
const TRACK_EVERY: Duration = Duration::from_millis(50);
/// The same where the kernel gives hosts no table of their own (before Linux 6.1): each read
/// then walks the machine's table.
const TRACK_EVERY_SHARED: Duration = Duration::from_secs(1);

/// Host `me`'s connection tracker under [`Queue::Fair`], run on a thread inside its namespace
/// `ns` until `stop`: each `every` ([`TRACK_EVERY`], or [`TRACK_EVERY_SHARED`] where hosts
/// share the machine's TCP table) it reads the host's established TCP connections
/// (`/proc/thread-self/net/tcp`, this thread's namespace) and gives each new one to another
/// host a connection queue of its own in that peer's htb at both of the host's ends (its
/// `eth0`, and its port on the hub), in turn, by an exact u32 match on the two ports ahead
/// of the hash ([`flow_program`]), which carries a connection until then and whatever comes
/// after the [`FLOW_QUEUES`]th to one peer. The ports a kernel hands out are random enough
/// that the hash alone puts two of four connections in one queue about a third of the time;
/// a connection's first packets (its handshake, the first of its window) take the hash's
/// queue.
fn track_connections(me: usize, ns: &str, hub: &str, addrs: &[String], every: Duration, stop: &AtomicBool) {
    let peers: Vec<Option<std::net::Ipv4Addr>> = addrs.iter().map(|a| a.parse().ok()).collect();
    let mut seen = BTreeSet::new();
    let mut next = vec![0usize; addrs.len()];
    let mut warned = false;
    while !stop.load(Ordering::Relaxed) {
        let table = std::fs::read_to_string("/proc/thread-self/net/tcp").unwrap_or_default();
        let (mut own, mut at_hub) = (String::new(), String::new());
        for c in established(&table) {
            let Some(j) = peers.iter().position(|p| *p == Some(c.remote)).filter(|&j| j != me) else {
                continue;
            };
            if !seen.insert((c.local_port, j, c.remote_port)) {
                continue;
            }
            let q = FLOW_CLASS + next[j] % FLOW_QUEUES;
            next[j] += 1;
            let major = PEER_CLASS + j;
            let exact = |dev: &str, sport: u16, dport: u16| {
                let ports = (u32::from(sport) << 16) | u32::from(dport);
                format!(
                    "filter add dev {dev} parent {major:x}: protocol ip prio 1 u32 match ip protocol 6 0xff \
                     match u32 {ports:#010x} 0xffffffff at 20 flowid {major:x}:{q:x}\n"
                )
            };
            own += &exact("eth0", c.local_port, c.remote_port);
            at_hub += &exact(&format!("h{me}"), c.remote_port, c.local_port);
        }
        for (where_, batch) in [(ns, &own), (hub, &at_hub)] {
            if batch.is_empty() {
                continue;
            }
            if let Err(e) = run_batch(where_, batch)
                && !std::mem::replace(&mut warned, true)
            {
                eprintln!("emulated host {me}: a connection keeps the hashed queue, not one of its own: {e}");
            }
        }
        std::thread::sleep(every);
    }
}

/// One established IPv4 TCP connection of a host, from its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Connection {
    local_port: u16,
    remote: std::net::Ipv4Addr,
    remote_port: u16,
}

/// The established connections in the text of `/proc/net/tcp` (addresses in hex as the
/// kernel keeps them, in network order; ports in hex; state `01`).
fn established(table: &str) -> Vec<Connection> {
    let endpoint = |t: &str| -> Option<(std::net::Ipv4Addr, u16)> {
        let (ip, port) = t.split_once(':')?;
        let ip = u32::from_str_radix(ip, 16).ok()?.to_ne_bytes();
        Some((std::net::Ipv4Addr::from(ip), u16::from_str_radix(port, 16).ok()?))
    };
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.get(3) != Some(&"01") {
                return None;
            }
            let ((_, local_port), (remote, remote_port)) = (endpoint(f.get(1)?)?, endpoint(f.get(2)?)?);
            Some(Connection { local_port, remote, remote_port })
        })
        .collect()
}

/// The queues a [`Queue::Fair`] peer's share is split into, one a connection (a hash of its
/// ports picks it: [`flow_program`]).
const FLOW_QUEUES: usize = 16;
/// The first class id of a peer's connection queues: queue `q` of peer htb `M:` is
/// `M:(FLOW_CLASS + q)`, in hex.
const FLOW_CLASS: usize = 0x10;

/// Classic BPF for `tc ... bpf bytecode` that returns the class id of a TCP packet's
/// connection queue in the peer htb `major:`: bits 1-4 of its source port XOR its destination
/// port. Either end of a connection sees the same pair, and a host's connections to one
/// address and port take ports a step of 2 apart (Linux's `connect`), so up to
/// [`FLOW_QUEUES`] of them opened in a row fall in queues of their own. Anything else (not
/// IPv4 TCP, or a fragment past the first) goes to the first queue. Offsets are from the
/// Ethernet header, where a classifier on egress finds the packet.
fn flow_program(major: u32) -> String {
    let base = (major << 16) | FLOW_CLASS as u32;
    let mask = (FLOW_QUEUES - 1) as u32;
    // (code, jt, jf, k); a jump's target is the next instruction plus its offset.
    let insns: [(u16, u8, u8, u32); 17] = [
        (0x28, 0, 0, 12),      // 0: ldh [12]            the ethertype
        (0x15, 0, 14, 0x800),  // 1: jeq #IPv4 ? 2 : 16
        (0x30, 0, 0, 23),      // 2: ldb [23]            the IP protocol
        (0x15, 0, 12, 6),      // 3: jeq #TCP ? 4 : 16
        (0x28, 0, 0, 20),      // 4: ldh [20]            flags and fragment offset
        (0x45, 10, 0, 0x1fff), // 5: jset #offset ? 16 : 6
        (0xb1, 0, 0, 14),      // 6: ldxb 4*([14]&0xf)   x = the IP header's length
        (0x48, 0, 0, 14),      // 7: ldh [x+14]          the source port
        (0x02, 0, 0, 0),       // 8: st M[0]
        (0x48, 0, 0, 16),      // 9: ldh [x+16]          the destination port
        (0x61, 0, 0, 0),       // 10: ldx M[0]
        (0xac, 0, 0, 0),       // 11: xor x
        (0x74, 0, 0, 1),       // 12: rsh #1
        (0x54, 0, 0, mask),    // 13: and #mask
        (0x04, 0, 0, base),    // 14: add #base
        (0x16, 0, 0, 0),       // 15: ret a
        (0x06, 0, 0, base),    // 16: ret #base
    ];
    bytecode(&insns)
}

/// `tc`'s `bpf bytecode` text for classic BPF instructions: their count, then each one's
/// code, jt, jf and k, comma-separated.
fn bytecode(insns: &[(u16, u8, u8, u32)]) -> String {
    let mut out = format!("{},", insns.len());
    for (code, jt, jf, k) in insns {
        out.push_str(&format!("{code} {jt} {jf} {k},"));
    }
    out
}

/// `tc -n ns -batch -` fed `commands`, one a line.
fn run_batch(ns: &str, commands: &str) -> Result<(), ClusterError> {
    use std::io::Write;
    let cmd = format!("tc -n {ns} -batch - ({} commands)", commands.lines().count());
    let unavailable = |e: std::io::Error| ClusterError::Unavailable(format!("running `{cmd}`: {e}"));
    let mut child = Command::new("tc")
        .args(["-n", ns, "-batch", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(unavailable)?;
    let written = child.stdin.take().map(|mut i| i.write_all(commands.as_bytes()));
    let o = child.wait_with_output().map_err(unavailable)?;
    match written {
        Some(Err(e)) if o.status.success() => Err(unavailable(e)),
        _ if o.status.success() => Ok(()),
        _ => {
            Err(ClusterError::Command { cmd, stderr: String::from_utf8_lossy(&o.stderr).trim().to_string() })
        }
    }
}

/// Classic BPF for `tc ... bpf bytecode`: a packet goes to the dropping class (the filter's
/// flowid, return -1) when a fresh random u32 is below `pct`% of 2^32, else on to the default
/// class (return 0: no match).
fn drop_program(pct: f64) -> String {
    // SKF_AD_OFF + SKF_AD_RANDOM: the "ld rand" ancillary load.
    const LD_RAND: u32 = 0xffff_f000 + 56;
    let threshold = ((pct / 100.0) * 4_294_967_296.0).round().clamp(0.0, u32::MAX as f64) as u32;
    // ld rand; jge #threshold (skip 1 : fall through); ret #-1; ret #0
    bytecode(&[(0x20, 0, 0, LD_RAND), (0x35, 1, 0, threshold), (0x06, 0, 0, u32::MAX), (0x06, 0, 0, 0)])
}

fn netem_err(e: ClusterError) -> ClusterError {
    match e {
        ClusterError::Command { cmd, stderr }
            if stderr.contains("qdisc kind is unknown") || stderr.contains("Unknown qdisc") =>
        {
            ClusterError::NoNetem(format!("`{cmd}`: {stderr}"))
        }
        e => e,
    }
}

fn ip(args: &[&str]) -> Result<(), ClusterError> {
    run("ip", args)
}

fn run(program: &str, args: &[&str]) -> Result<(), ClusterError> {
    let cmd = format!("{program} {}", args.join(" "));
    let o = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| ClusterError::Unavailable(format!("running `{cmd}`: {e}")))?;
    if o.status.success() {
        Ok(())
    } else {
        Err(ClusterError::Command { cmd, stderr: String::from_utf8_lossy(&o.stderr).trim().to_string() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dilated_link_is_slower_by_the_factor_and_its_clocks_longer() {
        let s = Shape {
            rate_bit: Some(10e9),
            delay: Duration::from_micros(50),
            loss_pct: 0.1,
            rto_min: None,
            queue: Queue::Fair,
        };
        let d = s.dilated(8.0);
        assert_eq!(d.rate_bit, Some(1.25e9));
        assert_eq!(d.delay, Duration::from_micros(400));
        assert_eq!(d.loss_pct, 0.1, "loss is a share of packets: the same in either world");
        assert_eq!(d.rto_min, Some(Duration::from_millis(1600)));
        // Undilated, nothing changes (the kernel's own timeout stays unset).
        assert_eq!(s.dilated(1.0), s);
        // An unshaped link stays unshaped.
        assert_eq!(Shape::default().dilated(4.0).rate_bit, None);
    }

    /// Runs `tc` bytecode text on a packet with just the classic-BPF instructions the
    /// programs here use; an out-of-range load ends the program with 0, as the kernel's does.
    fn run_bpf(bytecode: &str, packet: &[u8]) -> u32 {
        let mut parts = bytecode.trim_end_matches(',').split(',');
        let n: usize = parts.next().unwrap().parse().unwrap();
        let insns: Vec<[u32; 4]> = parts
            .map(|i| {
                let v: Vec<u32> = i.split(' ').map(|x| x.parse().unwrap()).collect();
                [v[0], v[1], v[2], v[3]]
            })
            .collect();
        assert_eq!(insns.len(), n, "the count leads the instructions");
        let load = |at: usize, size: usize| -> Option<u32> {
            let b = packet.get(at..at + size)?;
            Some(b.iter().fold(0, |acc, &x| (acc << 8) | x as u32))
        };
        let (mut a, mut x, mut mem, mut pc) = (0u32, 0u32, [0u32; 16], 0usize);
        loop {
            let [code, jt, jf, k] = insns[pc];
            pc += 1;
            let jump = |taken: bool| if taken { jt as usize } else { jf as usize };
            match code {
                0x28 => match load(k as usize, 2) {
                    Some(v) => a = v,
                    None => return 0,
                },
                0x30 => match load(k as usize, 1) {
                    Some(v) => a = v,
                    None => return 0,
                },
                0x48 => match load(x as usize + k as usize, 2) {
                    Some(v) => a = v,
                    None => return 0,
                },
                0xb1 => match load(k as usize, 1) {
                    Some(v) => x = 4 * (v & 0xf),
                    None => return 0,
                },
                0x02 => mem[k as usize] = a,
                0x61 => x = mem[k as usize],
                0xac => a ^= x,
                0x74 => a >>= k,
                0x54 => a &= k,
                0x04 => a = a.wrapping_add(k),
                0x15 => pc += jump(a == k),
                0x45 => pc += jump(a & k != 0),
                0x16 => return a,
                0x06 => return k,
                other => panic!("opcode {other:#x} not run here"),
            }
        }
    }

    /// An Ethernet frame holding an IPv4 packet of `proto` (IP header of `ihl` words, the
    /// fragment offset `frag`) and, after it, the ports `sport` and `dport`.
    fn frame(proto: u8, ihl: u8, frag: u16, sport: u16, dport: u16) -> Vec<u8> {
        let mut f = vec![0u8; 14];
        f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
        let mut ip = vec![0u8; 4 * ihl as usize];
        ip[0] = 0x40 | ihl;
        ip[6..8].copy_from_slice(&frag.to_be_bytes());
        ip[9] = proto;
        f.extend(ip);
        f.extend(sport.to_be_bytes());
        f.extend(dport.to_be_bytes());
        f.extend([0u8; 16]);
        f
    }

    #[test]
    fn a_connections_queue_is_picked_by_its_ports_the_same_at_either_end() {
        let p = flow_program(0x103);
        let queue = |f: &[u8]| {
            let id = run_bpf(&p, f);
            assert_eq!(id >> 16, 0x103, "a class of the peer's htb: {id:#x}");
            (id & 0xffff) as usize - FLOW_CLASS
        };
        let listen = 5201u16;
        // Connections one host opens in a row to one port, 2 apart: a queue each.
        let mut seen = BTreeSet::new();
        for i in 0..FLOW_QUEUES as u16 {
            let eph = 40_000 + 2 * i;
            let out = queue(&frame(6, 5, 0, eph, listen));
            assert_eq!(out, queue(&frame(6, 5, 0, listen, eph)), "both ends of port {eph}");
            // Bits 1-4 of the ports' XOR, by hand.
            assert_eq!(out, (((eph ^ listen) >> 1) & 0xf) as usize);
            // IP options move the ports; the queue stays.
            assert_eq!(out, queue(&frame(6, 7, 0, eph, listen)));
            seen.insert(out);
        }
        assert_eq!(seen.len(), FLOW_QUEUES, "{seen:?}");
        // Not TCP, a later fragment, not IPv4, a runt: the first queue.
        assert_eq!(queue(&frame(17, 5, 0, 40_002, listen)), 0);
        assert_eq!(queue(&frame(6, 5, 0x20, 40_002, listen)), 0);
        let mut arp = frame(6, 5, 0, 40_002, listen);
        arp[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
        assert_eq!(queue(&arp), 0);
        assert_eq!(run_bpf(&p, &[0u8; 10]), 0, "too short to read: no match");
    }

    #[test]
    fn established_connections_are_read_from_the_kernels_table() {
        // /proc/net/tcp: a listener, an established connection 10.77.0.2:40002 ->
        // 10.77.0.3:5201 and one in TIME_WAIT.
        let a = |ip: [u8; 4]| format!("{:08X}", u32::from_ne_bytes(ip));
        let text = format!(
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
             0: 00000000:1451 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1\n\
             1: {}:9C42 {}:1451 01 00000000:00000000 00:00000000 00000000     0        0 2\n\
             2: {}:9C44 {}:1451 06 00000000:00000000 00:00000000 00000000     0        0 0\n",
            a([10, 77, 0, 2]),
            a([10, 77, 0, 3]),
            a([10, 77, 0, 2]),
            a([10, 77, 0, 3])
        );
        assert_eq!(
            established(&text),
            vec![Connection { local_port: 40002, remote: [10, 77, 0, 3].into(), remote_port: 5201 }]
        );
        assert!(established("garbage\n 0: nothing here 01\n").is_empty());
    }

    #[test]
    fn a_classes_bytes_are_read_from_tcs_statistics() {
        let text = "class htb 101:10 parent 101: leaf 8010: prio 0 rate 100Gbit ceil 100Gbit burst 256Kb cburst 256Kb \n              Sent 4470 bytes 61 pkt (dropped 0, overlimits 0 requeues 0) \n              backlog 0b 0p requeues 0\n\
             class htb 1:101 parent 1:1 prio 0 rate 66666Kbit ceil 200Mbit \n              Sent 999 bytes 3 pkt (dropped 0, overlimits 0 requeues 0) \n\
             class htb 101:11 parent 101: leaf 8011: prio 0 rate 100Gbit ceil 100Gbit \n              Sent 13019646 bytes 8977 pkt (dropped 0, overlimits 0 requeues 0) \n";
        assert_eq!(queue_bytes(text, 0x101), vec![4470, 13019646]);
        assert!(queue_bytes(text, 0x102).is_empty());
    }
}
