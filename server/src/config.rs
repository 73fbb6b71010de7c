//! What a server shard is: flags (`gradsync-server ...`) resolved into a [`Config`].

use std::net::SocketAddr;
use std::ops::Range;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use clap::{Args, Parser};
use gradsync_core::compress::Compression;
use gradsync_core::data::DataSource;
use gradsync_core::dilation::Dilation;
use gradsync_core::model::{Fingerprint, Layout, ModelSpec};
use gradsync_core::optim::{OptimiserArgs, SgdConfig, StalenessLr};
use gradsync_proto::tuning::Tuning;

use crate::error::{Error, Result};
use crate::limits::Limits;

pub use gradsync_proto::SyncMode;

/// The long names of the flags another program writes (`gradsync-bench compare` builds every
/// server's command line from these): one definition for this parser and those command lines,
/// so a flag renamed here is renamed there.
pub mod flag {
    /// `--listen`.
    pub const LISTEN: &str = "listen";
    /// `--sync`.
    pub const SYNC: &str = "sync";
    /// `--compress`.
    pub const COMPRESS: &str = "compress";
    /// `--shard`.
    pub const SHARD: &str = "shard";
    /// `--model`.
    pub const MODEL: &str = "model";
    /// `--data`.
    pub const DATA: &str = "data";
    /// `--seed`.
    pub const SEED: &str = "seed";
    /// `--staleness-lr`.
    pub const STALENESS_LR: &str = "staleness-lr";
    /// `--metrics`.
    pub const METRICS: &str = "metrics";
    /// `--trace`.
    pub const TRACE: &str = "trace";
    /// `--chunk-bytes`.
    pub const CHUNK_BYTES: &str = "chunk-bytes";
    /// `--tls-cert`.
    pub const TLS_CERT: &str = "tls-cert";
    /// `--tls-key`.
    pub const TLS_KEY: &str = "tls-key";
    /// `--table-only`.
    pub const TABLE_ONLY: &str = "table-only";
    /// `--dilate`.
    pub const DILATE: &str = "dilate";
}

/// `I/K`: this process is shard `I` of `K`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardSpec {
    /// This shard, from 0.
    pub index: usize,
    /// Number of shards.
    pub count: usize,
}

impl FromStr for ShardSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::invalid("--shard", format!("'{s}' (expected I/K with 0 <= I < K, e.g. 0/2)"));
        let (i, k) = s.split_once('/').ok_or_else(bad)?;
        let (index, count) = (i.trim().parse().map_err(|_| bad())?, k.trim().parse().map_err(|_| bad())?);
        if count == 0 || index >= count {
            return Err(bad());
        }
        Ok(ShardSpec { index, count })
    }
}

impl ShardSpec {
    /// The whole buffer.
    pub const WHOLE: ShardSpec = ShardSpec { index: 0, count: 1 };

    /// This shard's contiguous range of a flat buffer of `len` values (shards differ in
    /// length by at most one value, the longer first).
    pub fn range(&self, len: usize) -> Range<usize> {
        gradsync_core::model::segment(len, self.count, self.index)
    }

    /// The chunk (and BSP block) size for this shard of a buffer of `len` values, chosen from
    /// the shard's size ([`Tuning::chunk_for_shard`]).
    pub fn chunk_bytes(&self, len: usize) -> usize {
        Tuning::chunk_for_shard(self.range(len).len() * 4)
    }

    /// This shard's part of a model laid out as `layout`: its range of the flat buffer's dense
    /// values, and for a model with a sparse table (an embedding) the table's rows it owns.
    /// The table is split by rows, the rest by values, each as evenly as [`Self::range`]; the
    /// table lies at one end of the flat buffer (it is the first layer), so the dense values
    /// are one contiguous range.
    pub fn split(&self, layout: &Layout) -> Result<ShardSplit> {
        let Some(t) = &layout.table else {
            return Ok(ShardSplit { dense: self.range(layout.len), rows: None });
        };
        let dense = if t.range.start == 0 {
            let r = self.range(layout.len - t.range.end);
            r.start + t.range.end..r.end + t.range.end
        } else if t.range.end == layout.len {
            self.range(t.range.start)
        } else {
            return Err(Error::invalid(
                "--model",
                format!(
                    "the table lies at values {}..{} of {}, inside the model rather than at one end",
                    t.range.start, t.range.end, layout.len
                ),
            ));
        };
        let rows = gradsync_core::model::segment(t.rows, self.count, self.index);
        Ok(ShardSplit { dense, rows: Some(TableShard { rows, dim: t.dim, at: t.range.start }) })
    }
}

/// What one shard owns of a model ([`ShardSpec::split`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardSplit {
    /// Its range of the flat buffer's dense values.
    pub dense: Range<usize>,
    /// The sparse table's rows it owns, for a model with one.
    pub rows: Option<TableShard>,
}

/// A shard's rows of a sparse table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableShard {
    /// The rows, counted in the whole table.
    pub rows: Range<usize>,
    /// Values per row.
    pub dim: usize,
    /// Where the table starts in the flat buffer.
    pub at: usize,
}

impl TableShard {
    /// The flat range of this shard's rows.
    pub fn flat(&self) -> Range<usize> {
        self.at + self.rows.start * self.dim..self.at + self.rows.end * self.dim
    }
}

/// gradsync parameter server: one shard of the flat parameter buffer over gRPC.
#[derive(Debug, Parser)]
#[command(name = "gradsync-server", version, about)]
pub struct Cli {
    /// The flags.
    #[command(flatten)]
    pub args: ServerArgs,
}

/// Flags of `gradsync-server`.
#[derive(Debug, Clone, Args)]
pub struct ServerArgs {
    /// Address to serve on.
    #[arg(long = flag::LISTEN, default_value = "0.0.0.0:50051", env = "GRADSYNC_LISTEN")]
    pub listen: SocketAddr,
    /// bsp, asp or ssp:S (a worker may run at most S steps ahead of the slowest).
    #[arg(long = flag::SYNC, default_value = "bsp")]
    pub sync: SyncMode,
    /// How workers encode their pushes: none, fp16, bf16 or topk:RATIO (docs/compression.md).
    /// Every worker must announce the same value at registration.
    #[arg(long = flag::COMPRESS, default_value = "none", env = "GRADSYNC_COMPRESS")]
    pub compress: Compression,
    /// This process's shard of the flat buffer, I/K.
    #[arg(long = flag::SHARD, default_value = "0/1")]
    pub shard: ShardSpec,
    /// Model: a preset (tiny, mnist, wide, resnet20, resnet18, vgg11, cnn8) or MLP widths; fitted
    /// to --data exactly as the workers fit it.
    #[arg(long = flag::MODEL, default_value = "mnist", value_parser = parse_model,
          long_help = gradsync_core::model::presets_help())]
    pub model: ModelSpec,
    /// The workers' --data (only its input width and classes matter here).
    #[arg(long = flag::DATA, value_parser = parse_data)]
    pub data: Option<DataSource>,
    /// The workers' --seed (initial parameters).
    #[arg(long = flag::SEED, default_value_t = 42, env = "GRADSYNC_SEED")]
    pub seed: u64,
    /// The optimiser the servers apply.
    #[command(flatten)]
    pub optimiser: OptimiserArgs,
    /// Under ASP and SSP, scale each gradient's learning rate by its staleness: `none`, or
    /// `inverse` (lr / (staleness + 1), Zhang et al., IJCAI'16; keeps ASP stable as workers
    /// are added). BSP gradients are never stale.
    #[arg(long = flag::STALENESS_LR, default_value = "none", value_parser = parse_staleness_lr)]
    pub staleness_lr: StalenessLr,
    /// Shared secret every worker must send (none: no authentication).
    #[arg(long, env = "GRADSYNC_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Checkpoint file of this shard.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Write a checkpoint every N updates (0: only at shutdown).
    #[arg(long, default_value_t = 0)]
    pub checkpoint_every: u64,
    /// Start from --checkpoint: parameters, momentum and version.
    #[arg(long, requires = "checkpoint")]
    pub resume: bool,
    /// Seconds to wait for a worker (a BSP barrier, the SSP bound, silence) before giving up
    /// on it. With --elastic it must exceed the workers' 2 s heartbeat interval.
    #[arg(long, default_value_t = 30.0)]
    pub worker_timeout: f64,
    /// On a worker timeout, drop the missing workers and continue with the live ones (else
    /// the step fails with a status naming them).
    #[arg(long)]
    pub elastic: bool,
    /// Serve only a sparse model's table (its rows, by id), for workers in `--mode hybrid`,
    /// which all-reduce the rest of the model among themselves.
    #[arg(long = flag::TABLE_ONLY)]
    pub table_only: bool,
    /// Run in dilated time, as the workers' `--dilate` (docs/cluster.md): every timeout D
    /// times longer, every figure recorded divided back by D. Its summing and stepping are
    /// per-byte work, as a ring's reductions are, and are not paced: dilation shrinks them by
    /// D (the report's CPU seconds per GB say how much they cost).
    #[arg(long = flag::DILATE, default_value_t = 1.0, env = "GRADSYNC_DILATE")]
    pub dilate: f64,
    /// Per-update metrics (JSON lines) here.
    #[arg(long = flag::METRICS)]
    pub metrics: Option<PathBuf>,
    /// Write a Chrome trace-event timeline of this shard here at shutdown (process 1000 +
    /// shard): each BSP round's wait for pushes and apply, each ASP/SSP apply, each encoding
    /// of the parameters for pulls, in the workers' trace format.
    #[arg(long = flag::TRACE, env = "GRADSYNC_SERVER_TRACE")]
    pub trace: Option<PathBuf>,
    /// Payload bytes per chunk in pulls, and the BSP step's block (default: chosen from the
    /// shard's size, an eighth of it within 64 KiB to 1 MiB; told to workers at registration,
    /// who push in chunks of the same size).
    #[arg(long = flag::CHUNK_BYTES)]
    pub chunk_bytes: Option<usize>,
    /// Serve with tonic's default HTTP/2 windows and frame size (for comparisons).
    #[arg(long)]
    pub default_transport: bool,
    /// Serve TLS with this certificate chain (PEM); needs --tls-key.
    #[arg(long = flag::TLS_CERT, requires = "tls_key", env = "GRADSYNC_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long = flag::TLS_KEY, requires = "tls_cert", env = "GRADSYNC_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Seconds a new connection has to send its first request (TCP accepted to request
    /// headers, TLS handshake and HTTP/2 preface included) before it is closed.
    #[arg(long, default_value_t = Limits::DEFAULT.handshake.as_secs_f64())]
    pub handshake_timeout: f64,
    /// Seconds a connection may stay open with no request in progress before it is closed
    /// (clients reconnect on their next call).
    #[arg(long, default_value_t = Limits::DEFAULT.idle.as_secs_f64())]
    pub idle_timeout: f64,
    /// Seconds between HTTP/2 pings on a connection; one not answered within as long closes
    /// it (peers that vanished without closing).
    #[arg(long, default_value_t = Limits::DEFAULT.keepalive.as_secs_f64())]
    pub keepalive: f64,
    /// Requests one connection may have open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS;
    /// a worker uses at most 3).
    #[arg(long, default_value_t = Limits::DEFAULT.max_streams)]
    pub max_streams: u32,
    /// MiB that pushes may hold in gradient messages not yet received in full, all clients
    /// together; a push past it is refused with RESOURCE_EXHAUSTED. Each pushing rank holds
    /// at most one chunk (--chunk-bytes) at a time: raise it above ranks x chunk for more
    /// than 256 ranks of 1 MiB chunks.
    #[arg(long, default_value_t = Limits::DEFAULT.push_bytes >> 20)]
    pub push_buffer_mb: usize,
}

/// A shard's resolved configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Synchronisation.
    pub sync: SyncMode,
    /// How pushes are encoded.
    pub compression: Compression,
    /// Which shard.
    pub shard: ShardSpec,
    /// The model, widths fitted to the data.
    pub spec: ModelSpec,
    /// Initialisation seed.
    pub seed: u64,
    /// The data source's text, for the metrics header.
    pub data: String,
    /// Optimiser.
    pub sgd: SgdConfig,
    /// How ASP/SSP scale a stale gradient.
    pub staleness_lr: StalenessLr,
    /// Shared secret.
    pub token: Option<String>,
    /// Checkpoint file.
    pub checkpoint: Option<PathBuf>,
    /// Checkpoint period in updates (0: at shutdown only).
    pub checkpoint_every: u64,
    /// Restore from the checkpoint.
    pub resume: bool,
    /// How long to wait for a worker.
    pub worker_timeout: Duration,
    /// Continue without missing workers.
    pub elastic: bool,
    /// Serve a sparse model's table only (`--mode hybrid`).
    pub table_only: bool,
    /// Metrics file.
    pub metrics: Option<PathBuf>,
    /// Trace file, written at shutdown.
    pub trace: Option<PathBuf>,
    /// Transport settings.
    pub tuning: Tuning,
    /// TLS, checked (None: plaintext HTTP/2).
    pub tls: Option<tonic::transport::ServerTlsConfig>,
    /// What one client may hold, and for how long.
    pub limits: Limits,
    /// The run's time dilation (`--dilate`): the timeouts above are already stretched by it.
    pub dilation: Dilation,
}

impl Config {
    /// A configuration for `spec` with default settings (tests and benchmarks).
    pub fn new(spec: ModelSpec, seed: u64) -> Self {
        Config {
            sync: SyncMode::Bsp,
            compression: Compression::None,
            shard: ShardSpec::WHOLE,
            spec,
            seed,
            data: String::new(),
            sgd: SgdConfig::default(),
            staleness_lr: StalenessLr::None,
            token: None,
            checkpoint: None,
            checkpoint_every: 0,
            resume: false,
            worker_timeout: Duration::from_secs(30),
            elastic: false,
            table_only: false,
            metrics: None,
            trace: None,
            tuning: Tuning::tuned(),
            tls: None,
            limits: Limits::DEFAULT,
            dilation: Dilation::NONE,
        }
    }

    /// Resolve the flags: the data's widths, the timeout, the transport.
    pub fn from_args(a: &ServerArgs) -> Result<Self> {
        let (spec, data) = match &a.data {
            Some(src) => {
                // Loading is the one way to learn a data directory's widths exactly as the
                // workers will.
                let d = src.load(a.seed)?;
                (a.model.fit(d.input, d.classes)?, src.to_string())
            }
            None => {
                (a.model.clone(), DataSource::synthetic_for(a.model.input, a.model.classes()).to_string())
            }
        };
        // Bounded above too: `Duration` cannot hold every float.
        let secs = |flag: &str, v: f64| {
            if v.is_finite() && v > 0.0 && v < 1e9 {
                Ok(Duration::from_secs_f64(v))
            } else {
                Err(Error::invalid(flag, format!("{v} (must be a positive number of seconds, below 1e9)")))
            }
        };
        if a.table_only && gradsync_core::model::Layout::new(&spec).table.is_none() {
            return Err(Error::invalid(
                "--table-only",
                format!(
                    "{} has no sparse table to serve (it is for an embedding model under --mode hybrid)",
                    spec.name
                ),
            ));
        }
        let dilation = Dilation::new("--dilate", a.dilate)?;
        let worker_timeout = dilation.stretch(secs("--worker-timeout", a.worker_timeout)?);
        let beat = gradsync_proto::HEARTBEAT_INTERVAL.as_secs_f64();
        if a.elastic && a.worker_timeout <= beat {
            // Workers beat every 2 s: a shorter silence limit would drop live workers.
            return Err(Error::invalid(
                "--worker-timeout",
                format!(
                    "{} s with --elastic (must be longer than the workers' heartbeat interval of {beat} s, \
                     or live workers are dropped between beats)",
                    a.worker_timeout
                ),
            ));
        }
        if let Some(c) = a.chunk_bytes
            && !(4..=64 << 20).contains(&c)
        {
            return Err(Error::invalid("--chunk-bytes", format!("{c} (must be 4 bytes to 64 MiB)")));
        }
        if a.token.as_deref().is_some_and(|t| t.is_empty() || gradsync_proto::auth::bearer(t).is_err()) {
            return Err(Error::invalid("--token", "must be non-empty visible ASCII"));
        }
        let mut tuning = if a.default_transport { Tuning::tonic_defaults() } else { Tuning::tuned() };
        tuning.chunk_bytes = a.chunk_bytes.unwrap_or_else(|| {
            // Sized on the values the shard moves densely (a table moves by rows).
            let layout = gradsync_core::model::Layout::new(&spec);
            let dense = layout.len - layout.table.as_ref().map_or(0, |t| t.range.len());
            a.shard.chunk_bytes(dense)
        });
        let tls = match (&a.tls_cert, &a.tls_key) {
            (Some(cert), Some(key)) => Some(gradsync_proto::tls::server(cert, key)?),
            (None, None) => None,
            _ => return Err(Error::invalid("--tls-cert/--tls-key", "give both or neither")),
        };
        if a.max_streams == 0 {
            return Err(Error::invalid("--max-streams", "0 (a connection must be allowed one request)"));
        }
        if a.push_buffer_mb == 0 || a.push_buffer_mb > 1 << 30 {
            return Err(Error::invalid(
                "--push-buffer-mb",
                format!("{} (must be 1 to 2^30)", a.push_buffer_mb),
            ));
        }
        let limits = Limits {
            handshake: dilation.stretch(secs("--handshake-timeout", a.handshake_timeout)?),
            idle: dilation.stretch(secs("--idle-timeout", a.idle_timeout)?),
            keepalive: dilation.stretch(secs("--keepalive", a.keepalive)?),
            max_streams: a.max_streams,
            push_bytes: a.push_buffer_mb << 20,
        };
        Ok(Config {
            sync: a.sync,
            compression: a.compress,
            shard: a.shard,
            spec,
            seed: a.seed,
            data,
            sgd: a.optimiser.sgd(),
            staleness_lr: a.staleness_lr,
            token: a.token.clone(),
            checkpoint: a.checkpoint.clone(),
            checkpoint_every: a.checkpoint_every,
            resume: a.resume,
            worker_timeout,
            elastic: a.elastic,
            table_only: a.table_only,
            metrics: a.metrics.clone(),
            trace: a.trace.clone(),
            tuning,
            tls,
            limits,
            dilation,
        })
    }

    /// The model fingerprint workers must present.
    pub fn fingerprint(&self) -> Fingerprint {
        Fingerprint::new(&self.spec, self.seed)
    }
}

fn parse_model(s: &str) -> std::result::Result<ModelSpec, String> {
    ModelSpec::parse(s).map_err(|e| e.to_string())
}

fn parse_staleness_lr(s: &str) -> std::result::Result<StalenessLr, String> {
    s.parse()
}

fn parse_data(s: &str) -> std::result::Result<DataSource, String> {
    s.parse().map_err(|e: gradsync_core::Error| e.to_string())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn parses_sync_and_shard() {
        assert_eq!("bsp".parse::<SyncMode>().unwrap(), SyncMode::Bsp);
        assert_eq!("ssp:3".parse::<SyncMode>().unwrap(), SyncMode::Ssp(3));
        assert_eq!(SyncMode::Ssp(3).to_string(), "ssp:3");
        assert!("ssp".parse::<SyncMode>().is_err());
        assert!("ssp:-1".parse::<SyncMode>().is_err());
        assert_eq!("1/2".parse::<ShardSpec>().unwrap(), ShardSpec { index: 1, count: 2 });
        assert!("2/2".parse::<ShardSpec>().is_err());
        assert!("0/0".parse::<ShardSpec>().is_err());
        let k = 3;
        let ranges: Vec<_> = (0..k).map(|i| ShardSpec { index: i, count: k }.range(10)).collect();
        assert_eq!(ranges, vec![0..4, 4..7, 7..10]);
    }
}
