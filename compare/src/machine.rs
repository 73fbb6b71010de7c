//! A description of the machine a comparison ran on (`machine.json`), and the link figures the
//! cost model is fitted to, measured in the same run.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use super::scenario::ModeKind;

/// What the report needs to know about the machine.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    /// Host name.
    pub host: String,
    /// CPU model name.
    pub cpu: String,
    /// Logical cores.
    pub cores: usize,
    /// Physical memory, bytes.
    pub memory_bytes: u64,
    /// GPUs, by name (empty without one).
    pub gpus: Vec<String>,
    /// Kernel release.
    pub kernel: String,
    /// gradsync's version.
    pub gradsync_version: String,
    /// The git commit gradsync-bench was built from, or "unknown".
    pub gradsync_commit: String,
    /// Raw loopback TCP bandwidth, bytes/s (one stream): the median of `tcp_yardstick`.
    pub tcp_bandwidth: f64,
    /// Every measurement behind `tcp_bandwidth`, for its spread.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_yardstick: Option<crate::rawtcp::Yardstick>,
    /// One-way small-message latency over loopback TCP, seconds (half the round trip).
    pub tcp_latency_s: f64,
    /// What several raw TCP streams carried together over loopback, streaming at once: one
    /// entry per stream count the comparison's modes keep busy ([`tcp_streams`]), the
    /// yardstick each mode is read against (one stream is `tcp_yardstick`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tcp_parallel: Vec<Parallel>,
    /// The hosts of `compare --hosts` or the nodes of `--slurm`, each described (empty when
    /// every process ran here). `cores` then counts theirs together (only for telling whether
    /// a run's processes outnumbered them; the report describes each kind of host), and the
    /// link figures are those between two of them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<super::ssh::HostFacts>,
    /// What the link figures crossed when not this machine's loopback (`node0 to node1`,
    /// `loopback (one node: node0)`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<String>,
    /// How the processes reached `hosts`: `ssh` (`compare --hosts`) or `Slurm` (`--slurm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launcher: Option<String>,
}

/// What `streams` raw TCP streams carried together, bytes per second (the sum of their rates
/// in each measurement).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Parallel {
    /// Streams at once.
    pub streams: usize,
    /// Their summed rate in each measurement.
    pub yardstick: crate::rawtcp::Yardstick,
}

/// The most streams a yardstick is measured with (two threads each); a mode that keeps more
/// busy is read against one stream, named as such.
pub const MAX_STREAMS: usize = 128;

/// The TCP streams a run keeps busy at once on loopback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Streams {
    /// Every stream of the run: a ring's one per rank (each sends to its neighbour while
    /// receiving from the other), a parameter server's push and pull socket per worker per shard.
    pub total: usize,
    /// Those through the busiest process: a PS shard's push and pull socket per worker; a
    /// ring rank's one out (its incoming one is its neighbour's).
    pub busiest: usize,
}

/// The streams a run of `mode` with `workers` and `shards` keeps busy, or `None` for a mode
/// whose traffic does not cross TCP (or a single process).
pub fn tcp_streams(mode: ModeKind, workers: usize, shards: usize) -> Option<Streams> {
    if !mode.over_tcp() || workers < 2 && !mode.is_ps() {
        return None;
    }
    if mode == ModeKind::Hybrid {
        // The table's push and pull sockets per worker per shard, and the ring's one per rank.
        Some(Streams { total: 2 * workers * shards.max(1) + workers, busiest: 2 * workers })
    } else if mode.is_ps() {
        Some(Streams { total: 2 * workers * shards.max(1), busiest: 2 * workers })
    } else {
        Some(Streams { total: workers, busiest: 1 })
    }
}

impl Machine {
    /// Read the machine's description (the link figures are filled in by the caller).
    pub fn detect() -> Machine {
        let host = gradsync_core::metrics::HostInfo::detect();
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, v)| v.trim()))
            .unwrap_or("unknown")
            .to_string();
        let memory_bytes = meminfo("MemTotal").unwrap_or(0);
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "unknown".into());
        Machine {
            host: host.host,
            cpu,
            cores: host.cores,
            memory_bytes,
            gpus: gpus(),
            kernel,
            gradsync_version: gradsync_core::VERSION.into(),
            gradsync_commit: env!("GRADSYNC_COMMIT").into(),
            tcp_bandwidth: 0.0,
            tcp_yardstick: None,
            tcp_latency_s: 0.0,
            tcp_parallel: Vec::new(),
            hosts: Vec::new(),
            link: None,
            launcher: None,
        }
    }

    /// Why a run of `mode` with `workers` ranks cannot run on this machine, if it cannot: NCCL
    /// needs a GPU of its own for every rank (it refuses two ranks on one device).
    pub fn cannot_run(&self, mode: ModeKind, workers: usize) -> Option<String> {
        if mode != ModeKind::DdpNccl {
            return None;
        }
        match self.gpus.len() {
            0 => Some("no GPU on this machine (nvidia-smi found none)".into()),
            g if workers > g => Some(format!(
                "{workers} NCCL ranks need a GPU each and this machine has {g} (NCCL refuses two ranks on one GPU)"
            )),
            _ => None,
        }
    }

    /// Why a run cannot fit in this machine's memory now, if it cannot: its estimated memory
    /// ([`run_memory`]) against what `/proc/meminfo` calls available, so that a run of large
    /// models (eight replicas of VGG-16) is refused with the figures rather than swapping.
    pub fn memory_short(spec: &super::scenario::RunSpec) -> Option<String> {
        let params = gradsync_core::model::ModelSpec::parse(&spec.model)
            .map(|m| gradsync_core::model::Layout::new(&m).len)
            .ok()?;
        let need = run_memory(spec.mode, spec.workers, params);
        let available = meminfo("MemAvailable")?;
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        (need as f64 > 0.9 * available as f64).then(|| {
            format!(
                "needs about {:.1} GiB ({} of {:.0} MB of parameters each: parameters, gradients, optimiser \
                 state and buffers) and {:.1} GiB is available: run fewer workers, or on a machine with more memory",
                gib(need),
                if spec.mode.is_ps() { format!("{} workers and the servers", spec.workers) } else { format!("{} processes", spec.workers) },
                params as f64 * 4.0 / 1e6,
                gib(available)
            )
        })
    }

    /// What `streams` raw TCP streams carried together over loopback (median bytes per
    /// second), where measured.
    pub fn streams_bandwidth(&self, streams: usize) -> Option<f64> {
        match streams {
            1 => (self.tcp_bandwidth > 0.0).then_some(self.tcp_bandwidth),
            n => self.tcp_parallel.iter().find(|p| p.streams == n).map(|p| p.yardstick.median()),
        }
    }

    /// Measure the loopback link the cost model is fitted to: the raw TCP yardstick (five
    /// measurements splitting `seconds`), the small-message latency, and for each of
    /// `streams` above one (up to [`MAX_STREAMS`]) what that many streams carry together
    /// (three measurements of a fifth of `seconds` each).
    pub fn measure_link(&mut self, seconds: f64, streams: &[usize]) -> anyhow::Result<()> {
        const ROUNDS: usize = 5;
        let y = crate::rawtcp::Yardstick::loopback(
            "127.0.0.1",
            ROUNDS,
            std::time::Duration::from_secs_f64(seconds / ROUNDS as f64),
        )
        .context("measuring raw TCP bandwidth")?;
        self.tcp_bandwidth = y.median();
        self.tcp_yardstick = Some(y);
        self.tcp_latency_s = crate::rawtcp::latency("127.0.0.1", 2000).context("measuring TCP latency")?;
        let mut counts: Vec<usize> = streams.iter().copied().filter(|&n| n > 1 && n <= MAX_STREAMS).collect();
        counts.sort_unstable();
        counts.dedup();
        self.tcp_parallel = counts
            .into_iter()
            .map(|n| {
                let each = std::time::Duration::from_secs_f64(seconds / ROUNDS as f64);
                let y = crate::rawtcp::Yardstick::loopback_streams("127.0.0.1", n, 3, each)
                    .with_context(|| format!("measuring {n} raw TCP streams at once"))?;
                Ok(Parallel { streams: n, yardstick: y })
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(())
    }
}

impl Machine {
    /// For `compare --hosts`: the hosts' descriptions and the link the cost model is fitted to
    /// measured between two of them (the yardstick in five measurements splitting `seconds`,
    /// and the small-message latency).
    pub fn measure_hosts(&mut self, hosts: &super::ssh::Hosts, seconds: f64) -> anyhow::Result<()> {
        let r = hosts
            .measure_link(LINK_ROUNDS, Duration::from_secs_f64(seconds / LINK_ROUNDS as f64))
            .context("measuring the link between the hosts")?;
        self.set_hosts(hosts.facts(), r, "ssh");
        Ok(())
    }

    /// For `compare --slurm`: the nodes' descriptions and the link measured between two of
    /// them, or on the one node's loopback.
    pub fn measure_nodes(&mut self, alloc: &super::slurm::Alloc, seconds: f64) -> anyhow::Result<()> {
        let r = alloc
            .measure_link(LINK_ROUNDS, Duration::from_secs_f64(seconds / LINK_ROUNDS as f64))
            .context("measuring the link between the allocation's nodes")?;
        self.set_hosts(alloc.facts(), r, "Slurm");
        Ok(())
    }

    /// Record `hosts` (their cores together in `cores`, for telling whether a run's processes
    /// outnumbered the cores they had), started by `launcher`, and the link `r` measured
    /// between the first two (the first's loopback when there is one).
    fn set_hosts(
        &mut self,
        hosts: Vec<super::ssh::HostFacts>,
        r: crate::rawtcp::PeerReading,
        launcher: &str,
    ) {
        self.hosts = hosts;
        self.launcher = Some(launcher.into());
        self.cores = self.hosts.iter().map(|h| h.cores).sum();
        self.gpus =
            self.hosts.iter().flat_map(|h| h.gpus.iter().map(|g| format!("{g} ({})", h.name))).collect();
        let y = crate::rawtcp::Yardstick { samples: r.samples };
        self.tcp_bandwidth = y.median();
        self.tcp_yardstick = Some(y);
        self.tcp_latency_s = r.latency_s;
        self.link = Some(match self.hosts.as_slice() {
            [a, b, ..] => format!("{} to {}", a.name, b.name),
            [a] => format!("loopback (one node: {})", a.name),
            [] => "loopback".into(),
        });
    }

    /// The hosts grouped by kind (CPU, cores, memory to the GiB, GPUs), in the order each
    /// kind first appears: each kind with the names of its hosts.
    pub fn host_kinds(&self) -> Vec<(&super::ssh::HostFacts, Vec<&str>)> {
        let mut kinds: Vec<(&super::ssh::HostFacts, Vec<&str>)> = Vec::new();
        let key = |h: &super::ssh::HostFacts| (h.cpu.clone(), h.cores, h.memory_bytes >> 30, h.gpus.clone());
        for h in &self.hosts {
            match kinds.iter_mut().find(|(k, _)| key(k) == key(h)) {
                Some((_, names)) => names.push(&h.name),
                None => kinds.push((h, vec![&h.name])),
            }
        }
        kinds
    }
}

/// The measurements the yardstick between two hosts or nodes splits its seconds into.
const LINK_ROUNDS: usize = 5;

/// GPU names from `nvidia-smi` (none when it is missing, fails, or takes more than 10 s, as a
/// wedged driver can).
pub fn gpus() -> Vec<String> {
    let Ok(mut child) = Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
    else {
        return Vec::new();
    };
    let status = super::child::wait_until(&mut child, Instant::now() + Duration::from_secs(10));
    let mut out = String::new();
    if status.is_some_and(|s| s.success())
        && let Some(mut o) = child.stdout.take()
    {
        let _ = o.read_to_string(&mut out);
    }
    out.lines().map(|l| l.trim().to_string()).filter(|l| !l.is_empty()).collect()
}

/// `/proc/meminfo`'s `key` (`MemTotal`, `MemAvailable`), bytes.
fn meminfo(key: &str) -> Option<u64> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    m.lines().find_map(|l| {
        let kb = l.strip_prefix(key)?.strip_prefix(':')?.trim().strip_suffix("kB")?.trim();
        kb.parse::<u64>().ok().map(|kb| kb * 1024)
    })
}

/// The machine's CPU time so far, from `/proc/stat`'s first line: (busy, total) in clock ticks,
/// busy being all but idle and iowait. Two readings make the share of the cores busy between
/// them, whatever kept them busy.
pub fn cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = line.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
    Some((total - idle, total))
}

/// The share of the cores busy between two [`cpu_ticks`] readings; `None` for a window of
/// under `min_ticks` (too short to say).
pub fn busy_between(a: (u64, u64), b: (u64, u64), min_ticks: u64) -> Option<f64> {
    let total = b.1.checked_sub(a.1)?;
    (total >= min_ticks.max(1)).then(|| b.0.saturating_sub(a.0) as f64 / total as f64)
}

/// Why the hosts (or Slurm nodes, `what`) a run is placed on cannot take it, if they cannot:
/// `ddp-nccl` with more ranks on one than it has GPUs (NCCL refuses two ranks on one device),
/// or the processes placed on one needing more than 0.9 of the memory it had available when
/// it was checked ([`process_memory`]; a host whose memory was not read is not checked).
/// `servers` and `workers` are indexes into `hosts`.
pub fn placement_short(
    spec: &super::scenario::RunSpec,
    hosts: &[&super::ssh::HostFacts],
    servers: &[usize],
    workers: &[usize],
    what: &str,
) -> Option<String> {
    if spec.mode == ModeKind::DdpNccl {
        for (i, h) in hosts.iter().enumerate() {
            let ranks = workers.iter().filter(|&&w| w == i).count();
            if ranks > h.gpus.len() {
                return Some(format!(
                    "{ranks} NCCL ranks placed on {what} {} and it has {} GPU(s)",
                    h.name,
                    h.gpus.len()
                ));
            }
        }
    }
    let params = gradsync_core::model::ModelSpec::parse(&spec.model)
        .map(|m| gradsync_core::model::Layout::new(&m).len)
        .ok()?;
    let (server, worker) = process_memory(spec.mode, spec.workers, spec.shards, params);
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    hosts.iter().enumerate().find_map(|(i, h)| {
        let (k, w) = (servers.iter().filter(|&&s| s == i).count(), workers.iter().filter(|&&s| s == i).count());
        let need = k as u64 * server + w as u64 * worker;
        (h.memory_available_bytes > 0 && need as f64 > 0.9 * h.memory_available_bytes as f64).then(|| {
            let who = match (k, w) {
                (0, w) => format!("{w} worker(s)"),
                (k, 0) => format!("{k} server shard(s)"),
                (k, w) => format!("{k} server shard(s) and {w} worker(s)"),
            };
            format!(
                "{who} placed on {what} {} need about {:.1} GiB ({:.0} MB of parameters each: parameters, \
                 gradients, optimiser state and buffers) and it had {:.1} GiB available: run fewer workers, or \
                 on more {what}s",
                h.name,
                gib(need),
                params as f64 * 4.0 / 1e6,
                gib(h.memory_available_bytes)
            )
        })
    })
}

/// Bytes one server shard and one worker process of a run hold at most (for [`run_memory`]'s
/// run, split by process): a parameter server's shards share its 5S evenly; DP is one
/// process holding everything.
pub fn process_memory(mode: ModeKind, workers: usize, shards: usize, params: usize) -> (u64, u64) {
    let s = params as u64 * 4;
    let k = shards.max(1) as u64;
    match mode.base() {
        ModeKind::Local | ModeKind::Dp => (0, run_memory(mode, workers, params)),
        ModeKind::Hybrid => ((5 * s).div_ceil(k), 4 * s),
        m if m.is_ps() => ((5 * s).div_ceil(k), 3 * s),
        _ => (0, 4 * s),
    }
}

/// Bytes a run of `mode` holds at most, all processes together, for a model of `params`
/// f32 parameters (S bytes): each training process its parameters, gradients and momentum,
/// and one more S of communication buffers for a ring; DP its replicas' parameters and
/// gradients and replica 0's sum, momentum and copies; the parameter servers, over all their
/// shards, parameters, momentum, the sum of pushes and the next step's parameters and momentum.
pub fn run_memory(mode: ModeKind, workers: usize, params: usize) -> u64 {
    let s = params as u64 * 4;
    let w = workers.max(1) as u64;
    match mode.base() {
        ModeKind::Local => 3 * s,
        ModeKind::Dp => (2 * w + 4) * s,
        // A whole replica per rank, as DDP's, and the table (at most the model) on the servers.
        ModeKind::Hybrid => 4 * s * w + 5 * s,
        m if m.is_ps() => 3 * s * w + 5 * s,
        _ => 4 * s * w,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run placed on hosts is checked host by host: its processes there against the memory
    /// the host had available, and NCCL ranks against the host's GPUs, naming the host.
    #[test]
    fn placement_is_checked_against_each_hosts_memory_and_gpus() {
        let mut s = crate::scenario::Scenario::load(None).unwrap();
        (s.models, s.modes, s.workers, s.shards) =
            (vec!["vgg11".into()], vec![ModeKind::PsBsp], vec![4], vec![2]);
        let spec = s.expand().remove(0);
        let params =
            gradsync_core::model::Layout::new(&gradsync_core::model::ModelSpec::parse("vgg11").unwrap()).len;
        let sz = params as u64 * 4;
        let (server, worker) = process_memory(ModeKind::PsBsp, 4, 2, params);
        assert_eq!((server, worker), ((5 * sz).div_ceil(2), 3 * sz));
        // With one shard the processes add up to the run's estimate.
        let (one, _) = process_memory(ModeKind::PsBsp, 4, 1, params);
        assert_eq!(one + 4 * worker, run_memory(ModeKind::PsBsp, 4, params));
        let host = |name: &str, avail: u64, gpus: usize| crate::ssh::HostFacts {
            name: name.into(),
            memory_available_bytes: avail,
            gpus: vec!["H100".into(); gpus],
            ..Default::default()
        };
        // Servers on n0 and n1, two workers each on n2 and n3; n3 has room for one.
        let (hosts, servers, workers) = (
            [
                host("n0", 64 << 30, 0),
                host("n1", 64 << 30, 0),
                host("n2", 64 << 30, 0),
                host("n3", 512 << 20, 0),
            ],
            [0, 1],
            [2, 3, 2, 3],
        );
        let refs: Vec<_> = hosts.iter().collect();
        let why = placement_short(&spec, &refs, &servers, &workers, "host").unwrap();
        assert!(
            why.starts_with("2 worker(s) placed on host n3 need about 0.6 GiB (113 MB of parameters each"),
            "{why}"
        );
        assert!(why.contains("it had 0.5 GiB available"), "{why}");
        let roomy: Vec<_> = hosts
            .iter()
            .map(|h| crate::ssh::HostFacts { memory_available_bytes: 64 << 30, ..h.clone() })
            .collect();
        assert_eq!(
            placement_short(&spec, &roomy.iter().collect::<Vec<_>>(), &servers, &workers, "host"),
            None
        );
        // Memory not read: not checked.
        let unknown: Vec<_> =
            hosts.iter().map(|h| crate::ssh::HostFacts { memory_available_bytes: 0, ..h.clone() }).collect();
        assert_eq!(
            placement_short(&spec, &unknown.iter().collect::<Vec<_>>(), &servers, &workers, "host"),
            None
        );
        // NCCL: two ranks on a node with one GPU is refused naming the node; none on a node
        // without GPUs.
        (s.models, s.modes, s.workers) = (vec!["tiny".into()], vec![ModeKind::DdpNccl], vec![3]);
        let spec = s.expand().remove(0);
        let nodes = [host("gpu1", 64 << 30, 2), host("gpu2", 64 << 30, 1)];
        let refs: Vec<_> = nodes.iter().collect();
        let why = placement_short(&spec, &refs, &[], &[0, 1, 1], "node").unwrap();
        assert_eq!(why, "2 NCCL ranks placed on node gpu2 and it has 1 GPU(s)");
        assert_eq!(placement_short(&spec, &refs, &[], &[0, 0, 1], "node"), None);
        let cpu = [host("cpu1", 64 << 30, 0)];
        let why = placement_short(&spec, &cpu.iter().collect::<Vec<_>>(), &[], &[0], "node").unwrap();
        assert!(why.contains("on node cpu1 and it has 0 GPU(s)"), "{why}");
    }

    fn with_gpus(n: usize) -> Machine {
        Machine { gpus: vec!["GPU".into(); n], ..Machine::default() }
    }

    /// NCCL needs a GPU per rank: more ranks than GPUs is skipped with the reason, as is NCCL
    /// without a GPU; other modes always run.
    #[test]
    fn nccl_runs_beyond_the_gpus_are_skipped() {
        assert!(with_gpus(0).cannot_run(ModeKind::DdpNccl, 1).unwrap().contains("no GPU"));
        let why = with_gpus(1).cannot_run(ModeKind::DdpNccl, 2).unwrap();
        assert!(why.contains("2 NCCL ranks need a GPU each and this machine has 1"), "{why}");
        assert_eq!(with_gpus(1).cannot_run(ModeKind::DdpNccl, 1), None);
        assert_eq!(with_gpus(4).cannot_run(ModeKind::DdpNccl, 4), None);
        assert_eq!(with_gpus(0).cannot_run(ModeKind::DdpTcp, 8), None);
    }

    /// The busy share between two readings of `/proc/stat`, and none over too short a window.
    #[test]
    fn cpu_readings_give_the_busy_share() {
        assert_eq!(busy_between((100, 1000), (250, 1200), 50), Some(0.75));
        assert_eq!(busy_between((100, 1000), (110, 1020), 50), None);
        assert_eq!(busy_between((100, 1000), (90, 900), 1), None);
        let (busy, total) = cpu_ticks().expect("/proc/stat");
        assert!(busy <= total && total > 0);
    }

    /// Eight DDP ranks of VGG-16 (553 MB of parameters) need 17.7 GB, whatever they compress;
    /// ResNet-50 under a fifth of that.
    #[test]
    fn run_memory_counts_every_process() {
        let vgg = 138_357_544;
        let s = vgg as u64 * 4;
        assert_eq!(run_memory(ModeKind::DdpTcp, 8, vgg), 32 * s);
        assert_eq!(run_memory(ModeKind::DdpTcpFp16, 8, vgg), 32 * s);
        assert_eq!(run_memory(ModeKind::Local, 1, vgg), 3 * s);
        assert_eq!(run_memory(ModeKind::PsBspTopk, 8, vgg), 29 * s);
        assert_eq!(run_memory(ModeKind::Dp, 8, vgg), 20 * s);
        assert!(run_memory(ModeKind::DdpTcp, 8, 25_557_032) < run_memory(ModeKind::DdpTcp, 8, vgg) / 5);
    }

    #[test]
    fn streams_per_mode() {
        let s = |m, w, k| tcp_streams(m, w, k);
        assert_eq!(s(ModeKind::PsBsp, 4, 2), Some(Streams { total: 16, busiest: 8 }));
        assert_eq!(s(ModeKind::PsBsp, 1, 1), Some(Streams { total: 2, busiest: 2 }));
        assert_eq!(s(ModeKind::DdpTcp, 4, 0), Some(Streams { total: 4, busiest: 1 }));
        assert_eq!(s(ModeKind::DdpTcp, 1, 0), None);
        assert_eq!(s(ModeKind::DdpShm, 4, 0), None);
        // The hybrid: the table's sockets to its shards and the ring among the workers.
        assert_eq!(s(ModeKind::Hybrid, 4, 2), Some(Streams { total: 20, busiest: 8 }));
        assert_eq!(s(ModeKind::PsSparse, 4, 1), s(ModeKind::PsBsp, 4, 1));
        assert_eq!(s(ModeKind::DdpAllgather, 4, 0), s(ModeKind::DdpTcp, 4, 0));
        assert_eq!(s(ModeKind::Local, 1, 0), None);
    }
}
