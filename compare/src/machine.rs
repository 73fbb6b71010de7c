//! A description of the machine a comparison ran on (`machine.json`), and the link figures the
//! cost model is fitted to, measured in the same run.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::place::run_memory;
use crate::rawtcp::PeerReading;
use crate::scenario::ModeKind;
use crate::site::{HostFacts, Pool};

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
    pub hosts: Vec<HostFacts>,
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
    if mode.is_ps() && mode.compared().ring.is_some() {
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
        if !mode.compared().needs.gpu {
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
    pub fn memory_short(spec: &crate::scenario::RunSpec) -> Option<String> {
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
    /// For `compare --hosts` and `--slurm`: the descriptions of the `pool`'s sites and the
    /// link the cost model is fitted to, measured between two of them (or on the one site's
    /// loopback): the yardstick in five measurements splitting `seconds`, and the
    /// small-message latency.
    pub fn measure_pool(&mut self, pool: &dyn Pool, seconds: f64) -> anyhow::Result<()> {
        let r = pool
            .measure_link(LINK_ROUNDS, Duration::from_secs_f64(seconds / LINK_ROUNDS as f64))
            .with_context(|| format!("measuring the link between {}", pool.what()))?;
        let facts = pool.sites().iter().filter_map(|s| s.facts().cloned()).collect();
        self.set_hosts(facts, r, pool.launcher());
        Ok(())
    }

    /// Record `hosts` (their cores together in `cores`, for telling whether a run's processes
    /// outnumbered the cores they had), started by `launcher`, and the link `r` measured
    /// between the first two (the first's loopback when there is one).
    fn set_hosts(&mut self, hosts: Vec<HostFacts>, r: PeerReading, launcher: &str) {
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
    pub fn host_kinds(&self) -> Vec<(&HostFacts, Vec<&str>)> {
        let mut kinds: Vec<(&HostFacts, Vec<&str>)> = Vec::new();
        let key = |h: &HostFacts| (h.cpu.clone(), h.cores, h.memory_bytes >> 30, h.gpus.clone());
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
    let status = crate::child::wait_until(&mut child, Instant::now() + Duration::from_secs(10));
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

#[cfg(test)]
mod tests {
    use super::*;

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
