//! A description of the machine a comparison ran on (`machine.json`), and the link figures the
//! cost model is fitted to, measured in the same run.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};

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
        let memory_bytes = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines().find_map(|l| {
                    let kb = l.strip_prefix("MemTotal:")?.trim().strip_suffix("kB")?.trim();
                    kb.parse::<u64>().ok()
                })
            })
            .map_or(0, |kb| kb * 1024);
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
        }
    }

    /// Measure the loopback link the cost model is fitted to: the raw TCP yardstick (five
    /// measurements splitting `seconds`) and the small-message latency.
    pub fn measure_link(&mut self, seconds: f64) -> anyhow::Result<()> {
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
        Ok(())
    }
}

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
    let until = Instant::now() + Duration::from_secs(10);
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break Some(st),
            Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let mut out = String::new();
    if status.is_some_and(|s| s.success())
        && let Some(mut o) = child.stdout.take()
    {
        let _ = o.read_to_string(&mut out);
    }
    out.lines().map(|l| l.trim().to_string()).filter(|l| !l.is_empty()).collect()
}
