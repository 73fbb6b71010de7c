//! The metrics schema: one JSON object per line, a header first, then one record per step.
//! Every process (worker rank, DP master, server shard) writes its own file; the comparison
//! runner merges them. This file is the schema's single definition; docs/metrics.md describes
//! it for users.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Bumped whenever a field changes meaning or disappears (adding fields does not bump it).
pub const SCHEMA_VERSION: u32 = 1;

/// One line of a metrics file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Record {
    /// The run's configuration; always the first line.
    Header(Header),
    /// One training step of one worker rank.
    Step(Step),
    /// One update applied by a parameter-server shard.
    ServerApply(ServerApply),
}

/// The run configuration, written once at the top of every metrics file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Header {
    /// [`SCHEMA_VERSION`].
    pub schema: u32,
    /// `local`, `dp`, `ps`, `ddp`, or `server`.
    pub mode: String,
    /// Mode detail: `bsp`, `asp`, `ssp:3`, `tcp`, `nccl`, or empty.
    pub variant: String,
    /// `cpu` or `cuda:N`.
    pub device: String,
    /// Model preset name (or `custom`).
    pub preset: String,
    /// Layer widths, `784-1024-1024-10`.
    pub widths: String,
    /// Number of parameters.
    pub params: usize,
    /// Samples per step per worker.
    pub batch: usize,
    /// Samples per step across all workers.
    pub global_batch: usize,
    /// Number of workers (ranks or replicas).
    pub world_size: usize,
    /// This process's rank (0 for the server and DP).
    pub rank: usize,
    /// The seed behind init, data and shuffles.
    pub seed: u64,
    /// The dataset (`synthetic:8192:784:10`, `mnist:/data`).
    pub data: String,
    /// The model fingerprint.
    pub fingerprint: String,
    /// Learning rate, momentum, weight decay.
    pub lr: f32,
    /// Momentum.
    pub momentum: f32,
    /// Weight decay.
    pub weight_decay: f32,
    /// CPU threads per process.
    pub threads: usize,
    /// gradsync's version.
    pub gradsync_version: String,
    /// Host name.
    pub host: String,
    /// Logical CPU cores on the host.
    pub cores: usize,
    /// GPU name, when the device is a GPU.
    pub gpu: Option<String>,
    /// The CUDA libraries loaded (each one's path and version), when the device is a GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_libs: Option<Box<crate::device::libs::CudaLibs>>,
    /// Unix time (ms) when the run started.
    pub start_unix_ms: u64,
    /// Anything mode-specific (bucket size, servers, shard, staleness bound).
    #[serde(default)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// One training step of one rank. Times are wall-clock milliseconds; byte counts are this
/// rank's payload bytes for the step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Step {
    /// Rank that took the step.
    pub rank: usize,
    /// Step number, from 1.
    pub step: u64,
    /// Epoch, from 0.
    pub epoch: u64,
    /// Samples processed by all workers so far (global batch x steps).
    pub samples: u64,
    /// Milliseconds since the run started, at the end of this step.
    pub wall_ms: f64,
    /// Duration of the whole step.
    pub step_ms: f64,
    /// Mean training loss of this rank's batch.
    pub loss: f64,
    /// Training accuracy of this rank's batch.
    pub train_accuracy: f64,
    /// Held-out loss, on steps where the model was evaluated.
    pub eval_loss: Option<f64>,
    /// Held-out accuracy, on steps where the model was evaluated.
    pub accuracy: Option<f64>,
    /// Forward pass.
    pub forward_ms: f64,
    /// Backward pass.
    pub backward_ms: f64,
    /// Optimiser update (zero where the server updates).
    pub update_ms: f64,
    /// Time spent communicating, overlapped or not.
    pub comm_ms: f64,
    /// The part of `comm_ms` not hidden behind computation.
    pub comm_exposed_ms: f64,
    /// Time blocked on other workers (BSP barrier, SSP bound).
    pub wait_ms: f64,
    /// Payload bytes sent this step.
    pub bytes_sent: u64,
    /// Payload bytes received this step.
    pub bytes_recv: u64,
    /// Parameter-server staleness: the steps the server applied between this worker's pull
    /// and the application of its gradient.
    pub staleness: Option<u64>,
    /// Rows of a sparse model's table this step's synchronisation covered: under
    /// `--sparse-grads allgather` the rows any rank's batch named (summed on every rank).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<u64>,
    /// The training clock at the end of this step: `wall_ms` less the time spent evaluating
    /// before it. Time-to-accuracy and throughput read this clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_ms: Option<f64>,
    /// Time spent evaluating after this step, when it was evaluated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_ms: Option<f64>,
}

/// One update applied by a parameter-server shard.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ServerApply {
    /// The shard index.
    pub shard: usize,
    /// The server's version after this update.
    pub version: u64,
    /// Milliseconds since the server started.
    pub wall_ms: f64,
    /// Gradients combined in this update.
    pub gradients: usize,
    /// Ranks whose gradients were combined.
    pub ranks: Vec<usize>,
    /// Staleness of each combined gradient (versions behind).
    pub staleness: Vec<u64>,
    /// Time the first gradient of this update waited for the last (BSP), ms.
    pub queue_wait_ms: f64,
    /// Time to average the gradients, ms.
    pub aggregate_ms: f64,
    /// Time to apply the optimiser step, ms.
    pub apply_ms: f64,
    /// Bytes received for this update.
    pub bytes_in: u64,
    /// Bytes sent (pulls answered) since the previous update.
    pub bytes_out: u64,
    /// The rank the update waited for longest, when any waited.
    pub waited_for: Option<usize>,
}

/// Appends [`Record`]s to a file, one JSON object per line, flushed per line so a crash
/// loses at most the line being written.
pub struct MetricsWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl MetricsWriter {
    /// Create (truncate) `path`, creating its directory.
    pub fn create(path: &Path) -> Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        }
        let f = File::create(path).map_err(|e| Error::io(path, e))?;
        Ok(MetricsWriter { path: path.to_path_buf(), out: BufWriter::new(f) })
    }

    /// Add to the metrics already at `path` (a resumed run continuing its file; no header).
    pub fn append(path: &Path) -> Result<Self> {
        let f = std::fs::OpenOptions::new().append(true).open(path).map_err(|e| Error::io(path, e))?;
        Ok(MetricsWriter { path: path.to_path_buf(), out: BufWriter::new(f) })
    }

    /// Write one record.
    pub fn write(&mut self, rec: &Record) -> Result<()> {
        let line = serde_json::to_string(rec).map_err(|e| Error::file(&self.path, e.to_string()))?;
        writeln!(self.out, "{line}").and_then(|_| self.out.flush()).map_err(|e| Error::io(&self.path, e))
    }
}

/// Reads the lines added to a metrics file as it grows, for a reader following a run. A worker
/// restarted before its first checkpoint writes its file again from the start under a header of
/// its own; the length alone cannot tell (the new file may be as long as the old one already),
/// so the file's first line is kept and a file no longer beginning with it is read again from
/// its start, the old file's half-written last line dropped.
pub struct MetricsTail {
    path: PathBuf,
    offset: u64,
    /// The file's first line, with its newline once whole; until then, what was read of it.
    head: Vec<u8>,
    /// What was read past the last whole line.
    partial: Vec<u8>,
}

impl MetricsTail {
    /// Follow `path`, which may not exist yet.
    pub fn new(path: PathBuf) -> Self {
        MetricsTail { path, offset: 0, head: Vec::new(), partial: Vec::new() }
    }

    /// The whole lines written since the last read (nothing while the file cannot be read).
    pub fn read(&mut self) -> Vec<u8> {
        use std::io::{Read, Seek, SeekFrom};
        let Ok(mut f) = File::open(&self.path) else { return Vec::new() };
        let mut begun = vec![0; self.head.len()];
        let again = self.offset > 0
            && (f.read_exact(&mut begun).is_err()
                || begun != self.head
                || f.metadata().is_ok_and(|m| m.len() < self.offset));
        if again {
            self.offset = 0;
            self.head.clear();
            self.partial.clear();
        }
        let mut buf = Vec::new();
        if f.seek(SeekFrom::Start(self.offset)).is_err() || f.read_to_end(&mut buf).is_err() {
            return Vec::new();
        }
        self.offset += buf.len() as u64;
        if self.head.last() != Some(&b'\n') {
            let end = buf.iter().position(|&b| b == b'\n').map_or(buf.len(), |i| i + 1);
            self.head.extend_from_slice(&buf[..end]);
        }
        self.partial.extend_from_slice(&buf);
        match self.partial.iter().rposition(|&b| b == b'\n') {
            Some(end) => self.partial.drain(..=end).collect(),
            None => Vec::new(),
        }
    }
}

/// Parse one metrics line.
pub fn parse_line(line: &str) -> std::result::Result<Record, serde_json::Error> {
    serde_json::from_str(line)
}

/// Facts about this machine for the header.
#[derive(Debug, Clone, Default)]
pub struct HostInfo {
    /// Host name.
    pub host: String,
    /// Logical cores.
    pub cores: usize,
}

impl HostInfo {
    /// Read them.
    pub fn detect() -> Self {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .or_else(|_| std::fs::read_to_string("/etc/hostname"))
            .map(|s| s.trim().to_string())
            .or_else(|_| std::env::var("HOSTNAME"))
            .unwrap_or_else(|_| "unknown".into());
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        HostInfo { host, cores }
    }
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Milliseconds since `t`: how every timing in a step record is taken.
pub fn ms_since(t: std::time::Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// A measured duration for people to read: milliseconds below a second (a short run is not
/// "0.0 s"), seconds with one decimal from there on.
pub fn elapsed(seconds: f64) -> String {
    if seconds < 1.0 { format!("{:.1} ms", seconds * 1e3) } else { format!("{seconds:.1} s") }
}

#[cfg(test)]
mod tests {
    #[test]
    fn short_durations_read_in_milliseconds() {
        assert_eq!(super::elapsed(0.0123), "12.3 ms");
        assert_eq!(super::elapsed(0.9994), "999.4 ms");
        assert_eq!(super::elapsed(1.0), "1.0 s");
        assert_eq!(super::elapsed(75.25), "75.2 s");
    }

    use super::*;

    #[test]
    fn a_file_written_again_from_its_start_is_read_from_its_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rank0.jsonl");
        let mut t = MetricsTail::new(path.clone());
        assert_eq!(t.read(), b"", "not there yet");
        std::fs::write(&path, "head 1 ha").unwrap();
        assert_eq!(t.read(), b"", "half a line");
        std::fs::write(&path, "head 1 half\nstep 1\nst").unwrap();
        assert_eq!(t.read(), b"head 1 half\nstep 1\n");
        // Begun again, and already longer than the old file when next read: the old file's half
        // line is dropped.
        std::fs::write(&path, "head 2 half\nstep 1\nstep 2\n").unwrap();
        assert_eq!(t.read(), b"head 2 half\nstep 1\nstep 2\n");
        // Appended to: read on.
        let mut f = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"step 2\n").unwrap();
        assert_eq!(t.read(), b"step 2\n");
        // Begun again, half its head written so far.
        std::fs::write(&path, "head").unwrap();
        assert_eq!(t.read(), b"");
        std::fs::write(&path, "head 3\nstep 1\n").unwrap();
        assert_eq!(t.read(), b"head 3\nstep 1\n");
    }

    #[test]
    fn round_trips_with_kind_tag() {
        let s = Record::Step(Step { rank: 1, step: 3, loss: 0.5, staleness: Some(2), ..Step::default() });
        let line = serde_json::to_string(&s).unwrap();
        assert!(line.starts_with("{\"kind\":\"step\""));
        assert_eq!(parse_line(&line).unwrap(), s);
        let h = Record::Header(Header { mode: "local".into(), ..Header::default() });
        assert_eq!(parse_line(&serde_json::to_string(&h).unwrap()).unwrap(), h);
        assert!(parse_line("{\"kind\":\"step\",\"step\":\"x\"}").is_err());
    }
}
