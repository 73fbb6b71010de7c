//! What a measurement of `gradsync-bench collective` is made of, shared by the threads mode,
//! the rank processes and the plain-socket rows: the flags, one measured `Row` (and the
//! slowest rank's), the machine's busy time, the sizes measured, and the series of the table.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use gradsync_worker::collective::{Hierarchy, Transport};

/// How long a rank waits for its peers (connecting, and in any collective).
pub(super) const RANK_TIMEOUT: Duration = Duration::from_secs(120);

/// Flags of `gradsync-bench collective`.
#[derive(Debug, Clone, Args)]
pub struct CollectiveArgs {
    /// Rank counts.
    #[arg(long, default_value = "2,4,8", value_delimiter = ',')]
    pub ranks: Vec<usize>,
    /// Backends: tcp, nccl (nccl needs one GPU per rank; skipped with a note otherwise).
    #[arg(long, default_value = "tcp,nccl", value_delimiter = ',')]
    pub backend: Vec<String>,
    /// Smallest buffer, bytes.
    #[arg(long, default_value_t = 8)]
    pub min_bytes: usize,
    /// Largest buffer, bytes.
    #[arg(long, default_value_t = 256 << 20)]
    pub max_bytes: usize,
    /// Size multiplier between rows.
    #[arg(long, default_value_t = 4)]
    pub factor: usize,
    /// Bytes to move per size (sets the iteration count: more for small buffers).
    #[arg(long, default_value_t = 512 << 20)]
    pub budget_bytes: usize,
    /// Transports of the TCP backend to measure, one row set each: tcp (sockets only), auto
    /// (shared memory between ranks of one host), shm.
    #[arg(long, value_enum, default_value = "tcp,auto", value_delimiter = ',', env = "GRADSYNC_TRANSPORT")]
    pub transport: Vec<Transport>,
    /// All-reduce of the TCP backend to measure, one row set each (with every transport):
    /// auto (through the hosts when several ranks share each of several hosts), off (one flat
    /// ring), on (always through the hosts).
    #[arg(long, value_enum, default_value = "auto", value_delimiter = ',', env = "GRADSYNC_HIERARCHY")]
    pub hierarchy: Vec<Hierarchy>,
    /// Ring chunk size, KiB (default: the ranks choose, as `gradsync-worker --chunk-kb` does).
    #[arg(long)]
    pub chunk_kb: Option<usize>,
    /// Socket buffer size to ask for, KiB (0: the kernel's autotuning).
    #[arg(long, default_value_t = 4096)]
    pub socket_buffer_kb: usize,
    /// Seconds of raw TCP measurement.
    #[arg(long, default_value_t = 2.0)]
    pub raw_secs: f64,
    /// Interleaved rounds (every backend once per round); the table shows each size's median.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Run gradsync's ranks as threads of this process rather than one process each.
    #[arg(long)]
    pub threads: bool,
    /// Put every rank on an emulated host of its own whose link is shaped to this many
    /// Gbit/s each way (network namespaces, veth and tc: needs root and iproute2).
    #[arg(long, value_parser = crate::ps::positive_gbit)]
    pub link_gbit: Option<f64>,
    /// Ranks per emulated host (with --link-gbit): ranks 0..N on the first host, N..2N on the
    /// second, and so on; the ranks of one host share its link and its memory.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub ranks_per_host: u64,
    /// A Python with torch, for the gloo rows (default: ~/.cache/gradsync/torch-venv/bin/python
    /// when it exists). Given, every gloo row must be measured: the run fails when one cannot be.
    #[arg(long, env = "GRADSYNC_PYTHON")]
    pub python: Option<PathBuf>,
    /// The folder holding `allreduce.py` (default: `pytorch/` beside this program, then the
    /// working directory's `bench/pytorch/`).
    #[arg(long, env = "GRADSYNC_PYTORCH_DIR")]
    pub pytorch_dir: Option<PathBuf>,
    /// Leave out the gloo rows even when a Python with torch is found.
    #[arg(long)]
    pub no_gloo: bool,
    /// Leave out the plain-sockets rows (the same bytes per rank around the ring, nothing
    /// computed: the yardstick the "of plain" column divides by).
    #[arg(long)]
    pub no_plain: bool,
}

/// Flags of `gradsync-bench collective-rank`: one rank of a `collective` run in processes
/// (started by `collective`, not meant to be typed).
#[derive(Debug, Clone, Args)]
pub struct RankArgs {
    /// This rank.
    #[arg(long)]
    pub rank: usize,
    /// Number of ranks.
    #[arg(long)]
    pub world: usize,
    /// The rendezvous store, host:port. Rank 0 binds it (port 0: any) and prints
    /// {"listening": "host:port"} first.
    #[arg(long)]
    pub master: String,
    /// Buffer sizes, bytes.
    #[arg(long, value_delimiter = ',', required = true)]
    pub sizes: Vec<usize>,
    /// Bytes to move per size.
    #[arg(long, default_value_t = 512 << 20)]
    pub budget_bytes: usize,
    /// Transport of the ring.
    #[arg(long, value_enum, default_value = "tcp")]
    pub transport: Transport,
    /// Whether all-reduce goes through the hosts.
    #[arg(long, value_enum, default_value = "auto")]
    pub hierarchy: Hierarchy,
    /// Ring chunk size, KiB (default: the ranks choose, as `gradsync-worker --chunk-kb` does).
    #[arg(long)]
    pub chunk_kb: Option<usize>,
    /// Socket buffer size to ask for, KiB (0: the kernel's autotuning).
    #[arg(long, default_value_t = 4096)]
    pub socket_buffer_kb: usize,
    /// Stream the bytes a ring all-reduce sends over plain sockets instead (the plain row).
    #[arg(long)]
    pub plain: bool,
}

/// One measured row.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Row {
    /// Buffer size.
    pub bytes: usize,
    /// Seconds per all-reduce.
    #[serde(rename = "seconds")]
    pub secs: f64,
    /// Values that differ from the expected sum.
    pub wrong: usize,
    /// Core-seconds the whole machine was busy per iteration (rank 0 alone measures it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub busy: Option<f64>,
}

impl Row {
    pub(super) fn algbw(&self) -> f64 {
        self.bytes as f64 / self.secs / 1e9
    }
}

/// The machine's busy time over a timed loop, read by rank 0 only (every rank would read the
/// same machine).
pub(super) struct Busy(Option<f64>);

impl Busy {
    pub(super) fn start(rank: usize) -> Busy {
        Busy(if rank == 0 { gradsync_compare::rawtcp::machine_busy_seconds() } else { None })
    }

    /// Busy core-seconds per iteration since [`Busy::start`].
    pub(super) fn per(&self, iters: usize) -> Option<f64> {
        let start = self.0?;
        Some((gradsync_compare::rawtcp::machine_busy_seconds()? - start) / iters.max(1) as f64)
    }
}

/// Busy core-seconds per GB that an all-reduce of `bytes` over `world` ranks moves between
/// them (`2(n-1)` times the buffer, the least any all-reduce moves): `None` with one rank.
pub(super) fn busy_per_gb(busy: f64, bytes: usize, world: usize) -> Option<f64> {
    let moved = 2.0 * world.saturating_sub(1) as f64 * bytes as f64 / 1e9;
    (moved > 0.0).then(|| busy / moved)
}

pub(super) fn busbw(algbw: f64, n: usize) -> f64 {
    algbw * 2.0 * (n as f64 - 1.0) / n as f64
}

pub(super) fn sizes(a: &CollectiveArgs) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = a.min_bytes.max(4);
    while s <= a.max_bytes {
        v.push(s);
        s *= a.factor.max(2);
    }
    if v.last() != Some(&a.max_bytes) && a.max_bytes >= a.min_bytes {
        v.push(a.max_bytes);
    }
    v
}

/// The slowest rank's time per size, the wrong values of all ranks, rank 0's busy time.
pub(super) fn slowest(per_rank: Vec<Vec<Row>>) -> anyhow::Result<Vec<Row>> {
    per_rank
        .into_iter()
        .reduce(|acc, rows| {
            acc.into_iter()
                .zip(rows)
                .map(|(x, y)| Row {
                    bytes: x.bytes,
                    secs: x.secs.max(y.secs),
                    wrong: x.wrong + y.wrong,
                    busy: x.busy.or(y.busy),
                })
                .collect()
        })
        .context("no ranks")
}

/// What the TCP backend's ranks ended up running: the transport, and the hosts when
/// all-reduce went through them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ran {
    pub(super) transport: Transport,
    pub(super) hosts: Option<usize>,
    /// The ring's chunk as the ranks settled it, KiB.
    pub(super) chunk_kb: Option<usize>,
}

/// One set of rows of the table: a backend (on a transport, with a hierarchy), and how its
/// ranks ran.
#[derive(Debug, Clone)]
pub(super) struct Series {
    pub(super) backend: String,
    pub(super) transport: Option<Transport>,
    pub(super) hierarchy: Hierarchy,
}
