//! Parameter-server mode: compute the gradient on the device, send each shard its range and
//! receive the parameters back, all shards concurrently. The servers own the optimiser; this
//! side owns no update. Under BSP the push and the pull of the next version go at once, each on
//! its own connection to the shard, and the servers stream the new parameters block by block as
//! they step them (`gradsync_server::round`); under ASP and SSP the worker pushes, then pulls.
//!
//! The client ([`crate::ps::PsClient`]) does the communication and [`EngineLink`] reaches the
//! engine's memory; [`Ps`] is the [`Strategy`] that drives them on the tokio runtime of
//! `servers.rs` (the training loop is synchronous; the hybrid's table shares it, with the
//! fetching of a sparse table's rows ahead of each step), and records the step's timings. A
//! worker's checkpoint is its own (the servers keep the parameters), and a resumed worker
//! reads it once the servers have said, by their version, where the run is.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use gradsync_core::Engine;
use gradsync_core::compress::{Compression, Half, Sparse, TopK};
use gradsync_core::metrics::Step;
use gradsync_core::net::BatchLoss;
use gradsync_core::optim::{OptimiserArgs, SgdConfig};
use gradsync_core::state_dict::{Entry, Tensors};
use gradsync_core::trace::Trace;
use gradsync_proto::SyncMode;

use super::servers::Servers;
use super::{Batch, Result, Shape, Strategy, StrategyError, forward, ms_since};
use crate::ps::{Encoded, EngineLink, TableRows};
use crate::resume::{CheckpointAt, Contents, Resume, Resumed};

/// `--mode ps`: the [`Strategy`].
pub struct Ps {
    /// The client, its runtime and heartbeat, and a sparse table's rows.
    servers: Servers,
    rank: usize,
    world: usize,
    fingerprint: String,
    /// The servers' addresses, for the metrics header.
    addresses: Vec<String>,
    /// The optimiser this worker's flags name, checked against the servers'.
    optimiser: OptimiserArgs,
    /// How the exchange reaches the engine's memory (known at [`Strategy::start`]).
    link: EngineLink,
    /// Timeline recorder (`--trace`).
    trace: Trace,
    /// How pushes are encoded, and what that keeps between steps.
    codec: Codec,
    /// The gradient read to the host for a compressed push.
    host: Vec<f32>,
}

/// `--compress` as a push applies it.
enum Codec {
    /// The engine's f32 gradient, straight into the messages.
    None,
    /// Every value in half precision.
    Half(Half),
    /// Top-k with error feedback: the residual over the whole flat buffer (made at
    /// [`Strategy::start`], once its length is known) and the pairs of the current push.
    TopK(f64, Option<TopK>, Sparse),
}

impl Codec {
    /// The push of the engine's gradient, when compressed: built on the host from the whole
    /// gradient (read into `host`), since top-k's error feedback needs all of it at once; the
    /// pull still goes straight into the engine. `None`: the f32 gradient goes as it is.
    fn encode<'a>(&'a mut self, engine: &Engine, host: &'a mut Vec<f32>) -> Result<Option<Encoded<'a>>> {
        if matches!(self, Codec::None) {
            return Ok(None);
        }
        let n = engine.layout().len;
        host.resize(n, 0.0);
        engine.read_grads(0..n, host)?;
        Ok(match self {
            Codec::None => None,
            Codec::Half(h) => {
                fits(*h, host)?;
                Some(Encoded::Half(*h, host))
            }
            Codec::TopK(_, residual, pairs) => {
                residual.as_mut().ok_or(StrategyError::NotStarted("step"))?.compress(host, pairs)?;
                Some(Encoded::Sparse(pairs))
            }
        })
    }
}

/// The top-k residual's name in a worker's checkpoint.
const RESIDUAL: &str = "residual";

/// What PS mode needs to know.
#[derive(Debug, Clone)]
pub struct PsConfig {
    /// The servers, one per shard, in shard order.
    pub servers: Vec<String>,
    /// The shared secret sent with every request.
    pub token: Option<String>,
    /// How long any one request may take.
    pub rpc_timeout: Duration,
    /// How long to keep retrying until the servers accept connections (zero: one attempt).
    pub connect_wait: Duration,
    /// How often the worker tells the servers it is alive (`--dilate` stretches it).
    pub heartbeat: Duration,
    /// Payload bytes per pushed chunk, when not the tuned default.
    pub chunk_bytes: Option<usize>,
    /// TLS: the CA certificate to trust and the name the servers' certificates carry.
    pub tls: Option<(std::path::PathBuf, Option<String>)>,
    /// Under BSP, pull the next version while pushing.
    pub pipeline: bool,
    /// This worker's rank and the number of workers.
    pub rank: usize,
    /// The number of workers.
    pub world: usize,
    /// The model fingerprint the servers must share.
    pub fingerprint: String,
    /// Timeline recorder (`--trace`).
    pub trace: Trace,
    /// How pushes are encoded (`--compress`), announced to the servers at registration.
    pub compression: Compression,
    /// The optimiser the worker's flags name, each value optional: the servers apply their
    /// own, and a flag that contradicts it is refused at the start (nothing: no check).
    pub optimiser: OptimiserArgs,
}

impl Ps {
    /// Connect to the servers of `cfg` (registration waits for [`Strategy::start`]).
    pub fn new(cfg: PsConfig) -> Result<Self> {
        gradsync_core::heap::keep_freed_memory();
        gradsync_core::heap::single_arena();
        let mut servers = Servers::connect(&cfg, "gradsync-ps")?;
        servers.client.set_compression(cfg.compression);
        Ok(Ps {
            servers,
            rank: cfg.rank,
            world: cfg.world,
            fingerprint: cfg.fingerprint,
            addresses: cfg.servers,
            optimiser: cfg.optimiser,
            link: EngineLink::default(),
            trace: cfg.trace,
            codec: match cfg.compression {
                Compression::None => Codec::None,
                Compression::Fp16 => Codec::Half(Half::F16),
                Compression::Bf16 => Codec::Half(Half::Bf16),
                Compression::TopK(r) => Codec::TopK(r, None, Sparse::default()),
            },
            host: Vec::new(),
        })
    }

    /// Register with the servers (coming back under this rank when `rejoin`), pull the
    /// parameters of the version this worker joins at, and start the heartbeat.
    fn join(&mut self, engine: &mut Engine, rejoin: bool) -> Result<()> {
        let n = engine.layout().len;
        if let Some(t) = &engine.layout().table {
            if !matches!(self.codec, Codec::None) {
                return Err(StrategyError::Config(
                    "--compress with a sparse table: its rows move as ids and f32 values; push them uncompressed"
                        .into(),
                ));
            }
            self.servers.client.set_table(Some((t.range.clone(), t.rows, t.dim)));
            self.servers.rows = Some(TableRows::new(t.dim));
        }
        if let Codec::TopK(ratio, residual, _) = &mut self.codec {
            *residual = Some(TopK::new(*ratio, n));
        }
        self.link = EngineLink::new(engine);
        let Servers { rt, client, .. } = &mut self.servers;
        client.set_rejoin(rejoin);
        let link = &mut self.link;
        let (rank, world, fp) = (self.rank, self.world, self.fingerprint.as_str());
        rt.block_on(async {
            let version = client.register(rank, world, fp, n).await?;
            let join = client.join_version();
            if join <= version {
                return Ok(link.pull_unless_held(client, engine).await?);
            }
            // Back during a step that does not wait for it: its first gradient is computed from
            // the version that step makes. A pull of it streamed while the step runs fails if
            // the step has to redo blocks already sent; then it is asked for again.
            let mut tries = 0;
            loop {
                match link.pull_version(client, engine, join).await {
                    Ok(t) => break Ok(t),
                    Err(e) if tries < 3 => {
                        tries += 1;
                        tracing::debug!("{e:#}; pulling version {join} again");
                    }
                    Err(source) => break Err(StrategyError::Rejoin { version: join, source }),
                }
            }
        })?;
        let versions = client.versions();
        if rejoin && client.sync() == SyncMode::Bsp && versions.iter().any(|(_, v)| *v != versions[0].1) {
            // Killed after one shard had its whole push of a step and committed it, before
            // another had: that step's gradient is in one shard's version and not the other's.
            let versions = versions.iter().map(|(a, v)| format!("{a} at {v}")).collect::<Vec<_>>().join(", ");
            return Err(StrategyError::Versions { versions });
        }
        self.servers.keep_alive();
        Ok(())
    }

    /// Under BSP, the version of the parameters this worker holds (its next gradient is
    /// computed from it): steps and versions advance together. `None` under ASP and SSP.
    fn server_version(&self) -> Option<u64> {
        let client = &self.servers.client;
        (client.sync() == SyncMode::Bsp).then(|| client.version())
    }

    /// Take back the top-k residual of a resumed worker's checkpoint (nothing without top-k).
    fn restore_residual(&mut self, saved: &Tensors) -> Result<()> {
        let Codec::TopK(ratio, residual, _) = &mut self.codec else { return Ok(()) };
        let n = residual.as_ref().map_or(0, |t| t.residual().len());
        let e = saved
            .get(RESIDUAL)
            .ok_or_else(|| StrategyError::Restore("the checkpoint holds no top-k residual".into()))?;
        if e.shape != [n] {
            return Err(StrategyError::Restore(format!(
                "the checkpoint's top-k residual has shape {:?}, this model {n} values",
                e.shape
            )));
        }
        *residual = Some(TopK::with_residual(*ratio, e.to_f32()));
        Ok(())
    }
}

impl Strategy for Ps {
    fn shape(&self) -> Shape {
        Shape::processes(self.world, self.rank)
    }

    /// Meet the servers, then take this worker's own state from its checkpoint where their
    /// version says the run is (under `--resume`), and refuse an optimiser flag that
    /// contradicts theirs.
    fn start(&mut self, engine: &mut Engine, resume: &Resume) -> Result<Option<Resumed>> {
        self.join(engine, resume.resuming())?;
        let resumed = resume.worker(self.server_version())?;
        if let Some(saved) = resumed.as_ref().and_then(|r| r.state.as_ref()) {
            self.restore_residual(saved)?;
        }
        // The servers' optimiser is the one applied (and recorded); a contradicting flag is
        // refused, never recorded.
        if let Some(applied) = self.applied_optimiser()
            && let Err(e) = self.optimiser.check(&applied, "the parameter servers")
        {
            // Leave the servers as they were: without this they would hold the rank as
            // registered until it timed out, and refuse it when started again.
            let _ = self.finish(engine);
            return Err(StrategyError::Optimiser(e));
        }
        Ok(resumed)
    }

    fn step(&mut self, engine: &mut Engine, batch: &mut Batch<'_>, rec: &mut Step) -> Result<BatchLoss> {
        let fetched = self.servers.fetch_rows(engine, batch, &self.trace)?;
        let (x, y) = (batch.x, batch.y);
        let loss = forward(engine, x, y, rec, &self.trace)?;
        // Backward through the link, which stages the gradient for the push where it must.
        let tb = Instant::now();
        self.link.backward(engine)?;
        engine.synchronize()?;
        rec.backward_ms = ms_since(tb);
        self.trace.span("backward", "compute", "compute", tb);
        let t = Instant::now();
        let grads = self.codec.encode(engine, &mut self.host)?;
        let Servers { rt, client, rows, .. } = &mut self.servers;
        let (t_comm, push, mut pull) = match (&grads, rows) {
            (None, Some(tr)) => {
                rec.rows = Some(tr.stage(engine)? as u64);
                let got = rt.block_on(self.link.exchange_rows(client, engine, tr.step()))?;
                tr.land(engine)?;
                got
            }
            (None, None) => rt.block_on(self.link.exchange(client, engine))?,
            (Some(g), _) => rt.block_on(self.link.exchange_from(client, engine, g))?,
        };
        pull.bytes += fetched.bytes;
        let at = |ms: f64| t_comm + Duration::from_secs_f64(ms / 1e3);
        let mut args = serde_json::Map::new();
        args.insert("bytes".into(), push.bytes.into());
        args.insert("wait_ms".into(), push.wait_ms.into());
        args.insert("staleness".into(), push.staleness.into());
        self.trace.span_with("push", "comm", "comm", t, at(push.ms), args);
        // A pipelined pull runs beside the push (the lane shows them overlapping).
        let pull_from = if client.pipelined() { t_comm } else { at(push.ms) };
        self.trace.span("pull", "comm", "comm", pull_from);
        engine.synchronize()?;
        // The time the servers held the push for workers that began theirs later is waiting,
        // not communication (the rest of a hold is other workers' bytes on their way through a
        // shared link, which is the exchange): the step's parts (exposed communication + wait
        // + ...) then add up to at most the step.
        rec.wait_ms = push.wait_ms.min(ms_since(t));
        rec.comm_ms = ms_since(t) - rec.wait_ms + fetched.ms;
        rec.comm_exposed_ms = rec.comm_ms;
        rec.bytes_sent = push.bytes;
        rec.bytes_recv = pull.bytes;
        rec.staleness = Some(push.staleness);
        Ok(loss)
    }

    fn whole_params(&mut self, engine: &mut Engine) -> Result<()> {
        self.servers.whole_table(engine)
    }

    /// Every worker its own, in its folder: the servers hold the parameters, so only its data
    /// position, the servers' version it stands for, and its top-k residual.
    fn checkpoint(&mut self, _engine: &mut Engine, at: &CheckpointAt<'_>) -> Result<Option<PathBuf>> {
        let state = match &self.codec {
            Codec::TopK(_, Some(t), _) => {
                let r = t.residual();
                Some(Tensors::from_iter([(RESIDUAL.to_string(), Entry::f32(vec![r.len()], r.to_vec()))]))
            }
            _ => None,
        };
        let contents = Contents { state, server_version: self.server_version(), ..Contents::default() };
        Ok(Some(at.write_own(contents)?))
    }

    fn finish(&mut self, _engine: &mut Engine) -> Result<()> {
        self.servers.leave()
    }

    fn applied_optimiser(&self) -> Option<SgdConfig> {
        self.servers.client.optimiser().map(|o| o.0)
    }

    fn describe(&self) -> (String, serde_json::Map<String, serde_json::Value>) {
        let client = &self.servers.client;
        let mut extra = serde_json::Map::new();
        if let Some((_, stale)) = client.optimiser() {
            extra.insert("staleness_lr".into(), stale.clone().into());
        }
        extra.insert("servers".into(), self.addresses.clone().into());
        extra.insert("shards".into(), client.ranges().len().into());
        extra.insert("chunk_bytes".into(), client.chunk_bytes().into());
        extra.insert("pipeline".into(), client.pipelined().into());
        extra.insert("compression".into(), client.compression().to_string().into());
        (client.sync().to_string(), extra)
    }

    fn divergence_advice(&self) -> Option<String> {
        let client = &self.servers.client;
        let policy = client.optimiser().map_or("none", |(_, stale)| stale.as_str());
        stale_gradient_advice(client.sync(), policy)
    }
}

/// What keeps asynchronous servers' stale gradients from diverging a run: scaling them by their
/// staleness (`policy` is the servers' now), and under ASP bounding it. Nothing under BSP,
/// whose gradients are never stale.
fn stale_gradient_advice(sync: SyncMode, policy: &str) -> Option<String> {
    let scale = format!("scale stale gradients on the servers (--staleness-lr inverse; now {policy})");
    match sync {
        SyncMode::Bsp => None,
        SyncMode::Asp => Some(format!("{scale}, or bound the staleness (--sync ssp:S)")),
        SyncMode::Ssp(_) => Some(scale),
    }
}

/// Refuse a gradient `h` cannot carry: a finite value past its range would reach the servers
/// as an infinity and be refused as non-finite, as if training had diverged; this says what
/// happened instead.
fn fits(h: Half, grads: &[f32]) -> Result<()> {
    match h.first_overflow(grads) {
        None => Ok(()),
        Some((i, v)) => {
            Err(StrategyError::Overflow(h.overflow_error(&format!("gradient value {i}"), v, "push")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gradient_past_fp16s_range_is_refused_naming_it() {
        assert!(fits(Half::F16, &[1.0, -65504.0]).is_ok());
        let e = fits(Half::F16, &[1.0, 2.0, 70000.0]).unwrap_err().to_string();
        assert!(e.contains("gradient value 2 is 70000, beyond fp16's range (largest 65504)"), "{e}");
        assert!(e.contains("--compress bf16"), "{e}");
        assert!(fits(Half::Bf16, &[70000.0]).is_ok());
    }

    #[test]
    fn stale_gradients_are_advised_on_by_the_servers_sync_mode() {
        assert_eq!(stale_gradient_advice(SyncMode::Bsp, "none"), None);
        let asp = stale_gradient_advice(SyncMode::Asp, "none").unwrap();
        assert!(asp.contains("--staleness-lr inverse; now none") && asp.contains("--sync ssp:S"), "{asp}");
        let ssp = stale_gradient_advice(SyncMode::Ssp(2), "inverse").unwrap();
        assert!(ssp.contains("now inverse") && !ssp.contains("--sync"), "{ssp}");
    }
}
