//! A worker's link to parameter servers, what `--mode ps` and the hybrid's table share: the
//! client on its own tokio runtime (the training loop is synchronous), connected as the flags
//! say; its heartbeat; and a sparse model's table by rows, written once for both: before a
//! step's forward pass its batch's rows made current and the next batch's named for the step's
//! pull ([`Servers::fetch_rows`]), and the whole table pulled before anything reads it outside
//! a step ([`Servers::whole_table`]). The push and pull of a step's rows stay with each mode,
//! since PS sends them with the dense gradient and the hybrid alone.

use std::time::{Duration, Instant};

use gradsync_core::Engine;
use gradsync_core::trace::Trace;
use gradsync_proto::tuning::Tuning;

use super::{Batch, PsConfig, Result, StrategyError, ms_since};
use crate::ps::{PsClient, TableRows};

/// One worker's connection to the servers of a [`PsConfig`].
pub(super) struct Servers {
    /// The runtime the client's calls are driven on.
    pub rt: tokio::runtime::Runtime,
    /// The client.
    pub client: PsClient,
    /// A model with a sparse table: what moves its rows (made at the strategy's start).
    pub rows: Option<TableRows>,
    heartbeat: Option<tokio::task::JoinHandle<()>>,
    /// How often it tells the servers it is alive ([`PsConfig::heartbeat`]).
    beat: Duration,
}

/// The rows a step fetched before its forward pass.
pub(super) struct Fetched {
    /// Milliseconds it took (none when the step before had pulled them).
    pub ms: f64,
    /// Payload bytes pulled.
    pub bytes: u64,
}

impl Servers {
    /// Connect to the servers of `cfg` (waiting for them as `--connect-timeout` allows), with
    /// their sync mode asked and `cfg`'s pipelining and chunk size set; the runtime's threads
    /// are named `thread_name`. Registration is the strategy's, at its start.
    pub fn connect(cfg: &PsConfig, thread_name: &str) -> Result<Servers> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .thread_name(thread_name)
            .build()
            .map_err(StrategyError::Runtime)?;
        let mut tuning = Tuning::tuned();
        if let Some(c) = cfg.chunk_bytes {
            tuning.chunk_bytes = c;
        }
        let client = rt.block_on(async {
            let tls = match &cfg.tls {
                Some((ca, domain)) => {
                    Some(gradsync_proto::tls::client(ca, domain.as_deref()).map_err(StrategyError::Tls)?)
                }
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
            Ok::<_, StrategyError>(c)
        })?;
        Ok(Servers { rt, client, rows: None, heartbeat: None, beat: cfg.heartbeat })
    }

    /// Once registered: tell the servers every [`PsConfig::heartbeat`] that this worker is
    /// alive, whatever it is doing, until it leaves.
    pub fn keep_alive(&mut self) {
        let mut hb = self.client.share();
        let beat = self.beat;
        self.heartbeat = Some(self.rt.spawn(async move {
            let mut tick = tokio::time::interval(beat);
            loop {
                tick.tick().await;
                if let Err(e) = hb.heartbeat().await {
                    tracing::warn!("heartbeat: {e:#}");
                }
            }
        }));
    }

    /// Before the forward pass of `batch`: its table rows current in the engine (unless the
    /// step before pulled them), and the next batch's rows named, so this step's exchange
    /// pulls them. Nothing for a model without a table.
    pub fn fetch_rows(
        &mut self,
        engine: &mut Engine,
        batch: &mut Batch<'_>,
        trace: &Trace,
    ) -> Result<Fetched> {
        let Some(rows) = &mut self.rows else { return Ok(Fetched { ms: 0.0, bytes: 0 }) };
        if let Some(next) = batch.next_x() {
            rows.set_next(engine, next)?;
        }
        let t = Instant::now();
        let bytes = self.rt.block_on(rows.ensure(&mut self.client, engine, batch.x))?;
        if bytes == 0 {
            return Ok(Fetched { ms: 0.0, bytes });
        }
        trace.span("pull rows", "comm", "comm", t);
        Ok(Fetched { ms: ms_since(t), bytes })
    }

    /// Every row of the table, of the servers' current version, into the engine (before
    /// evaluation or `--save`). Nothing for a model without a table.
    pub fn whole_table(&mut self, engine: &mut Engine) -> Result<()> {
        if let Some(rows) = &mut self.rows {
            self.rt.block_on(rows.sync(&mut self.client, engine))?;
        }
        Ok(())
    }

    /// Stop the heartbeat and leave the servers.
    pub fn leave(&mut self) -> Result<()> {
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
        Ok(self.rt.block_on(self.client.deregister())?)
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
    }
}
