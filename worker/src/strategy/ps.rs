//! Parameter-server mode: compute the gradient on the device, send each shard its range and
//! receive the parameters back, all shards concurrently. The servers own the optimiser; this
//! side owns no update. Under BSP the push and the pull of the next version go at once, each on
//! its own connection to the shard, and the servers stream the new parameters block by block as
//! they step them (`gradsync_server::round`); under ASP and SSP the worker pushes, then pulls.
//!
//! The client ([`crate::ps::PsClient`]) does the communication and [`EngineLink`] reaches the
//! engine's memory; [`Ps`] is the [`Strategy`] that drives them with a tokio runtime, because
//! the training loop is synchronous, and records the step's timings.

use std::time::{Duration, Instant};

use anyhow::Context;
use gradsync_core::Engine;
use gradsync_core::compress::{Compression, Half, Sparse, TopK};
use gradsync_core::metrics::Step;
use gradsync_core::net::BatchLoss;
use gradsync_core::optim::SgdConfig;
use gradsync_core::state_dict::{Entry, Tensors};
use gradsync_core::trace::Trace;
use gradsync_proto::SyncMode;
use gradsync_proto::tuning::Tuning;

use super::{Shape, Strategy, forward, ms_since};
use crate::ps::{Encoded, EngineLink, PsClient, TableRows};

/// `--mode ps`: the [`Strategy`].
pub struct Ps {
    rt: tokio::runtime::Runtime,
    client: PsClient,
    rank: usize,
    world: usize,
    fingerprint: String,
    servers: Vec<String>,
    /// How the exchange reaches the engine's memory (known at [`Strategy::start`]).
    link: EngineLink,
    heartbeat: Option<tokio::task::JoinHandle<()>>,
    /// Timeline recorder (`--trace`).
    trace: Trace,
    /// How pushes are encoded, and what that keeps between steps.
    codec: Codec,
    /// The gradient read to the host for a compressed push.
    host: Vec<f32>,
    /// A model with a sparse table: what moves its rows.
    rows: Option<TableRows>,
    /// Registered as a rank coming back (`--resume`).
    rejoin: bool,
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

/// The top-k residual's name in a worker's checkpoint.
const RESIDUAL: &str = "residual";

/// How often a worker tells the servers it is alive, whatever it is doing.
const HEARTBEAT: Duration = gradsync_proto::HEARTBEAT_INTERVAL;

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
    /// A worker restarted with `--resume`: come back under its rank ([`PsClient::set_rejoin`]).
    pub rejoin: bool,
}

impl Ps {
    /// Connect to the servers of `cfg` (registration waits for [`Strategy::start`]).
    pub fn new(cfg: PsConfig) -> anyhow::Result<Self> {
        gradsync_core::heap::keep_freed_memory();
        gradsync_core::heap::single_arena();
        let (rt, mut client) = connect(&cfg, "gradsync-ps")?;
        client.set_compression(cfg.compression);
        client.set_rejoin(cfg.rejoin);
        Ok(Ps {
            rt,
            client,
            rank: cfg.rank,
            world: cfg.world,
            fingerprint: cfg.fingerprint,
            servers: cfg.servers,
            link: EngineLink::default(),
            heartbeat: None,
            trace: cfg.trace,
            codec: match cfg.compression {
                Compression::None => Codec::None,
                Compression::Fp16 => Codec::Half(Half::F16),
                Compression::Bf16 => Codec::Half(Half::Bf16),
                Compression::TopK(r) => Codec::TopK(r, None, Sparse::default()),
            },
            host: Vec::new(),
            rows: None,
            rejoin: cfg.rejoin,
        })
    }
}

impl Strategy for Ps {
    fn shape(&self) -> Shape {
        Shape::processes(self.world, self.rank)
    }

    fn start(&mut self, engine: &mut Engine) -> anyhow::Result<()> {
        let n = engine.layout().len;
        if let Some(t) = &engine.layout().table {
            anyhow::ensure!(
                matches!(self.codec, Codec::None),
                "--compress with a sparse table: its rows move as ids and f32 values; push them uncompressed"
            );
            self.client.set_table(Some((t.range.clone(), t.rows, t.dim)));
            self.rows = Some(TableRows::new(t.dim));
        }
        if let Codec::TopK(ratio, residual, _) = &mut self.codec {
            *residual = Some(TopK::new(*ratio, n));
        }
        self.link = EngineLink::new(engine);
        let (client, link) = (&mut self.client, &mut self.link);
        let (rank, world, fp) = (self.rank, self.world, self.fingerprint.as_str());
        self.rt.block_on(async {
            let version = client.register(rank, world, fp, n).await?;
            let join = client.join_version();
            if join <= version {
                return Ok(link.pull(client, engine).await?);
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
                    Err(e) => {
                        break Err(anyhow::Error::from(e)
                            .context(format!("pulling version {join}, the step this rank joins at")));
                    }
                }
            }
        })?;
        let versions = self.client.versions();
        if self.rejoin
            && self.client.sync() == SyncMode::Bsp
            && versions.iter().any(|(_, v)| *v != versions[0].1)
        {
            // Killed after one shard had its whole push of a step and committed it, before
            // another had: that step's gradient is in one shard's version and not the other's.
            anyhow::bail!(
                "came back while the shards were at different versions ({}): the step in progress when this \
                 rank died was applied by some shards and not by others; restart the servers from their \
                 checkpoints and the workers with --resume",
                versions.iter().map(|(a, v)| format!("{a} at {v}")).collect::<Vec<_>>().join(", ")
            );
        }
        let mut hb = self.client.share();
        self.heartbeat = Some(self.rt.spawn(async move {
            let mut tick = tokio::time::interval(HEARTBEAT);
            loop {
                tick.tick().await;
                if let Err(e) = hb.heartbeat().await {
                    tracing::warn!("heartbeat: {e:#}");
                }
            }
        }));
        Ok(())
    }

    fn step(
        &mut self,
        engine: &mut Engine,
        x: &[f32],
        y: &[u32],
        rec: &mut Step,
    ) -> anyhow::Result<BatchLoss> {
        let t_rows = Instant::now();
        let fetched = match &mut self.rows {
            Some(tr) => self.rt.block_on(tr.ensure(&mut self.client, engine, x))?,
            None => 0,
        };
        if fetched > 0 {
            self.trace.span("pull rows", "comm", "comm", t_rows);
        }
        let fetch_ms = ms_since(t_rows);
        let loss = forward(engine, x, y, rec, &self.trace)?;
        // Backward through the link, which stages the gradient for the push where it must.
        let tb = Instant::now();
        self.link.backward(engine)?;
        engine.synchronize()?;
        rec.backward_ms = ms_since(tb);
        self.trace.span("backward", "compute", "compute", tb);
        let t = Instant::now();
        // Compressed pushes are built on the host from the whole gradient (top-k's error
        // feedback needs all of it at once); the pull still goes straight into the engine.
        if !matches!(self.codec, Codec::None) {
            let n = engine.layout().len;
            self.host.resize(n, 0.0);
            engine.read_grads(0..n, &mut self.host)?;
        }
        let grads = match &mut self.codec {
            Codec::None => None,
            Codec::Half(h) => {
                fits(*h, &self.host)?;
                Some(Encoded::Half(*h, &self.host))
            }
            Codec::TopK(_, residual, pairs) => {
                residual.as_mut().context("step before start")?.compress(&self.host, pairs)?;
                Some(Encoded::Sparse(pairs))
            }
        };
        let (t_comm, push, mut pull) = match (&grads, &mut self.rows) {
            (None, Some(tr)) => {
                rec.rows = Some(tr.stage(engine)? as u64);
                let got = self.rt.block_on(self.link.exchange_rows(&mut self.client, engine, tr.step()))?;
                tr.land(engine)?;
                got
            }
            (None, None) => self.rt.block_on(self.link.exchange(&mut self.client, engine))?,
            (Some(g), _) => self.rt.block_on(self.link.exchange_from(&mut self.client, engine, g))?,
        };
        pull.bytes += fetched;
        let at = |ms: f64| t_comm + Duration::from_secs_f64(ms / 1e3);
        let mut args = serde_json::Map::new();
        args.insert("bytes".into(), push.bytes.into());
        args.insert("wait_ms".into(), push.wait_ms.into());
        args.insert("staleness".into(), push.staleness.into());
        self.trace.span_with("push", "comm", "comm", t, at(push.ms), args);
        // A pipelined pull runs beside the push (the lane shows them overlapping).
        let pull_from = if self.client.pipelined() { t_comm } else { at(push.ms) };
        self.trace.span("pull", "comm", "comm", pull_from);
        engine.synchronize()?;
        // The time the servers held the push for other workers is waiting, not communication:
        // the step's parts (exposed communication + wait + ...) then add up to at most the step.
        rec.wait_ms = push.wait_ms.min(ms_since(t));
        rec.comm_ms = ms_since(t) - rec.wait_ms + fetch_ms;
        rec.comm_exposed_ms = rec.comm_ms;
        rec.bytes_sent = push.bytes;
        rec.bytes_recv = pull.bytes;
        rec.staleness = Some(push.staleness);
        Ok(loss)
    }

    fn finish(&mut self, _engine: &mut Engine) -> anyhow::Result<()> {
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
        Ok(self.rt.block_on(self.client.deregister())?)
    }

    fn looks_ahead(&self) -> bool {
        self.rows.is_some()
    }

    fn next_batch(&mut self, engine: &Engine, x: &[f32]) -> anyhow::Result<()> {
        match &mut self.rows {
            Some(tr) => Ok(tr.set_next(engine, x)?),
            None => Ok(()),
        }
    }

    fn sync_params(&mut self, engine: &mut Engine) -> anyhow::Result<()> {
        if let Some(tr) = &mut self.rows {
            self.rt.block_on(tr.sync(&mut self.client, engine))?;
        }
        Ok(())
    }

    fn state_on_servers(&self) -> bool {
        true
    }

    fn server_version(&self) -> Option<u64> {
        (self.client.sync() == SyncMode::Bsp).then(|| self.client.version())
    }

    fn checkpoint_state(&mut self, _engine: &Engine) -> anyhow::Result<Option<Tensors>> {
        Ok(match &self.codec {
            Codec::TopK(_, Some(t), _) => {
                let r = t.residual();
                Some(Tensors::from_iter([(RESIDUAL.to_string(), Entry::f32(vec![r.len()], r.to_vec()))]))
            }
            _ => None,
        })
    }

    fn restore_state(&mut self, saved: &Tensors) -> anyhow::Result<()> {
        let Codec::TopK(ratio, residual, _) = &mut self.codec else { return Ok(()) };
        let n = residual.as_ref().map_or(0, |t| t.residual().len());
        let e = saved.get(RESIDUAL).context("the checkpoint holds no top-k residual")?;
        anyhow::ensure!(
            e.shape == [n],
            "the checkpoint's top-k residual has shape {:?}, this model {n} values",
            e.shape
        );
        *residual = Some(TopK::with_residual(*ratio, e.to_f32()));
        Ok(())
    }

    fn applied_optimiser(&self) -> Option<SgdConfig> {
        self.client.optimiser().map(|o| o.0)
    }

    fn describe(&self) -> (String, serde_json::Map<String, serde_json::Value>) {
        let mut extra = serde_json::Map::new();
        if let Some((_, stale)) = self.client.optimiser() {
            extra.insert("staleness_lr".into(), stale.clone().into());
        }
        extra.insert("servers".into(), self.servers.clone().into());
        extra.insert("shards".into(), self.client.ranges().len().into());
        extra.insert("chunk_bytes".into(), self.client.chunk_bytes().into());
        extra.insert("pipeline".into(), self.client.pipelined().into());
        extra.insert("compression".into(), self.client.compression().to_string().into());
        (self.client.sync().to_string(), extra)
    }

    fn divergence_advice(&self) -> Option<String> {
        let policy = self.client.optimiser().map_or("none", |(_, stale)| stale.as_str());
        stale_gradient_advice(self.client.sync(), policy)
    }
}

/// A runtime for a PS client (the training loop is synchronous) and the client, connected to
/// the servers of `cfg` (waiting for them as `--connect-timeout` allows), with their sync mode
/// asked and `cfg`'s pipelining and chunk size set. Registration waits for the strategy's
/// start. Shared by `--mode ps` and the hybrid's table servers.
pub(super) fn connect(
    cfg: &PsConfig,
    thread_name: &str,
) -> anyhow::Result<(tokio::runtime::Runtime, PsClient)> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name(thread_name)
        .build()
        .context("starting the PS client runtime")?;
    let mut tuning = Tuning::tuned();
    if let Some(c) = cfg.chunk_bytes {
        tuning.chunk_bytes = c;
    }
    let client = rt.block_on(async {
        let tls = match &cfg.tls {
            Some((ca, domain)) => Some(gradsync_proto::tls::client(ca, domain.as_deref())?),
            None => None,
        };
        let mut c = PsClient::connect_waiting(
            &cfg.servers,
            cfg.token.as_deref(),
            cfg.rpc_timeout,
            tuning,
            tls,
            cfg.connect_wait,
        )
        .await?;
        c.sync_mode().await?;
        c.set_pipeline(cfg.pipeline);
        c.set_chunk_bytes(cfg.chunk_bytes);
        anyhow::Ok(c)
    })?;
    Ok((rt, client))
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

impl Drop for Ps {
    fn drop(&mut self) {
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
    }
}

/// Refuse a gradient `h` cannot carry: a finite value past its range would reach the servers
/// as an infinity and be refused as non-finite, as if training had diverged; this says what
/// happened instead.
fn fits(h: Half, grads: &[f32]) -> anyhow::Result<()> {
    match h.first_overflow(grads) {
        None => Ok(()),
        Some((i, v)) => anyhow::bail!(h.overflow_error(&format!("gradient value {i}"), v, "push")),
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
