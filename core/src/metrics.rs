//! The metrics schema: one JSON object per line, a header first, then one record per step.
//! Every process (worker rank, DP master, server shard) writes its own file; the comparison
//! runner merges them. This file is the schema's single definition; docs/metrics.md describes
//! it for users.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::dilation::{Dilation, PaceTally};
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
    /// The time-dilation factor the run ran under (`--dilate`; absent: none). Every duration
    /// in the file is already divided back by it: the emulated world's time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dilation: Option<f64>,
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
    /// Under `--dilate`, the step's training compute phases that lasted longer than the factor
    /// times their CPU time (the thread waited for a core): the dilation did not hold for them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub under_dilated: Option<u32>,
    /// Under `--dilate`, by how much those phases overran, in the emulated world's time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overrun_ms: Option<f64>,
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
    /// ASP and SSP: how long the applied push took to arrive, from its first chunk to its
    /// last, ms; it ended `apply_ms` before `wall_ms`. Pushes from several ranks arriving at
    /// once share the server's link, which is what decides an asynchronous step (the phase
    /// the workers fall into).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receive_ms: Option<f64>,
}

impl Step {
    /// Add a pace's tally ([`crate::dilation::Pace::take`]) to the step's under-dilated phases
    /// and their overrun.
    pub fn count_pace(&mut self, t: PaceTally) {
        self.under_dilated = Some(self.under_dilated.unwrap_or(0) + t.under);
        self.overrun_ms = Some(self.overrun_ms.unwrap_or(0.0) + t.overrun.as_secs_f64() * 1e3);
    }
}

impl Record {
    /// The record with every duration divided by `d` (real time back to a dilated run's
    /// emulated time, [`crate::dilation`]); counts, bytes and clocks' origins unchanged.
    pub fn dilated(&self, d: Dilation) -> Record {
        let k = |ms: f64| d.shrink_ms(ms);
        match self {
            Record::Header(h) => Record::Header(Header { dilation: Some(d.factor()), ..h.clone() }),
            Record::Step(s) => Record::Step(Step {
                wall_ms: k(s.wall_ms),
                step_ms: k(s.step_ms),
                forward_ms: k(s.forward_ms),
                backward_ms: k(s.backward_ms),
                update_ms: k(s.update_ms),
                comm_ms: k(s.comm_ms),
                comm_exposed_ms: k(s.comm_exposed_ms),
                wait_ms: k(s.wait_ms),
                train_ms: s.train_ms.map(k),
                eval_ms: s.eval_ms.map(k),
                overrun_ms: s.overrun_ms.map(k),
                ..s.clone()
            }),
            Record::ServerApply(a) => Record::ServerApply(ServerApply {
                wall_ms: k(a.wall_ms),
                queue_wait_ms: k(a.queue_wait_ms),
                aggregate_ms: k(a.aggregate_ms),
                apply_ms: k(a.apply_ms),
                receive_ms: a.receive_ms.map(k),
                ..a.clone()
            }),
        }
    }
}

/// Appends [`Record`]s to a file, one JSON object per line, flushed per line so a crash
/// loses at most the line being written.
pub struct MetricsWriter {
    path: PathBuf,
    out: BufWriter<File>,
    /// Divides every duration written back to the emulated world's time.
    dilation: Dilation,
}

impl MetricsWriter {
    /// Create (truncate) `path`, creating its directory.
    pub fn create(path: &Path) -> Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        }
        let f = File::create(path).map_err(|e| Error::io(path, e))?;
        Ok(MetricsWriter { path: path.to_path_buf(), out: BufWriter::new(f), dilation: Dilation::NONE })
    }

    /// Add to the metrics already at `path` (a resumed run continuing its file; no header).
    pub fn append(path: &Path) -> Result<Self> {
        let f = std::fs::OpenOptions::new().append(true).open(path).map_err(|e| Error::io(path, e))?;
        Ok(MetricsWriter { path: path.to_path_buf(), out: BufWriter::new(f), dilation: Dilation::NONE })
    }

    /// Write every record from now on in a run dilated by `d`'s time ([`Record::dilated`]):
    /// the header says the factor, every duration is divided by it.
    pub fn dilated(mut self, d: Dilation) -> Self {
        self.dilation = d;
        self
    }

    /// Write one record.
    pub fn write(&mut self, rec: &Record) -> Result<()> {
        let line = if self.dilation.is_none() {
            serde_json::to_string(rec)
        } else {
            serde_json::to_string(&rec.dilated(self.dilation))
        }
        .map_err(|e| Error::file(&self.path, e.to_string()))?;
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

    #[test]
    fn a_dilated_writer_records_the_emulated_worlds_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        let d = Dilation::new("--dilate", 4.0).unwrap();
        let mut w = MetricsWriter::create(&path).unwrap().dilated(d);
        w.write(&Record::Header(Header { mode: "ddp".into(), ..Header::default() })).unwrap();
        let step = Step {
            step: 2,
            samples: 64,
            bytes_sent: 1000,
            wall_ms: 400.0,
            step_ms: 40.0,
            forward_ms: 8.0,
            backward_ms: 12.0,
            update_ms: 4.0,
            comm_ms: 20.0,
            comm_exposed_ms: 16.0,
            wait_ms: 2.0,
            train_ms: Some(360.0),
            eval_ms: Some(40.0),
            under_dilated: Some(1),
            overrun_ms: Some(0.8),
            ..Step::default()
        };
        w.write(&Record::Step(step)).unwrap();
        w.write(&Record::ServerApply(ServerApply {
            wall_ms: 80.0,
            queue_wait_ms: 4.0,
            aggregate_ms: 2.0,
            apply_ms: 6.0,
            bytes_in: 9,
            ..ServerApply::default()
        }))
        .unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let recs: Vec<Record> = text.lines().map(|l| parse_line(l).unwrap()).collect();
        let Record::Header(h) = &recs[0] else { panic!("{text}") };
        assert_eq!(h.dilation, Some(4.0));
        let Record::Step(s) = &recs[1] else { panic!("{text}") };
        assert_eq!(
            (s.wall_ms, s.step_ms, s.forward_ms, s.backward_ms, s.update_ms),
            (100.0, 10.0, 2.0, 3.0, 1.0)
        );
        assert_eq!((s.comm_ms, s.comm_exposed_ms, s.wait_ms), (5.0, 4.0, 0.5));
        assert_eq!((s.train_ms, s.eval_ms, s.overrun_ms), (Some(90.0), Some(10.0), Some(0.2)));
        // Counts and bytes are what they are, dilated or not.
        assert_eq!((s.step, s.samples, s.bytes_sent, s.under_dilated), (2, 64, 1000, Some(1)));
        let Record::ServerApply(a) = &recs[2] else { panic!("{text}") };
        assert_eq!(
            (a.wall_ms, a.queue_wait_ms, a.aggregate_ms, a.apply_ms, a.bytes_in),
            (20.0, 1.0, 0.5, 1.5, 9)
        );
        // Undilated, the header says nothing of dilation.
        let plain = serde_json::to_string(&Record::Header(Header::default())).unwrap();
        assert!(!plain.contains("dilation"), "{plain}");
    }
}
