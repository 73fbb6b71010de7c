//! The engine's memory as a push's source and a pull's destination: the one place the PS path
//! depends on where the engine keeps its buffers ([`EngineLink`], chosen once per run).
//!
//! ```text
//!   host memory (CPU engine):   grads --read_grads per chunk--> messages -----> shard k
//!                               params <--write_params per chunk-- DATA frames <-- shard k
//!   device memory (GPU engine): grads --read_grads--> host f32 --> messages --> shard k
//!                               params <--write_params-- host f32 <-- DATA frames <-- shard k
//! ```

use std::cell::RefCell;
use std::time::Instant;

use gradsync_core::Engine;
use gradsync_proto::frames::FramedChunk;
use gradsync_proto::pb::GradientChunk;
use gradsync_proto::tag::GRADIENT_DATA;
use gradsync_proto::wire;
use std::ops::Range;

use super::bulk::Transfer;
use super::chunks::{ChunkSink, Gradients};
use super::client::PsClient;

/// How pushes read the engine's gradients and pulls write its parameters.
pub enum EngineLink {
    /// Host memory: each gradient chunk is copied out straight into its message and each
    /// pulled chunk written straight into the parameters, with no whole-buffer copy between.
    InPlace,
    /// Device memory: one copy of the whole buffer to the host each way, the exchange between
    /// these host buffers.
    Staged {
        /// The gradient, read from the device before the push.
        grads: Vec<f32>,
        /// The pulled parameters, written to the device after the pull.
        params: Vec<f32>,
    },
}

impl EngineLink {
    /// The link that fits `engine`'s memory.
    pub fn new(engine: &Engine) -> Self {
        if engine.is_cuda() {
            let n = engine.layout().len;
            EngineLink::Staged { grads: vec![0.0; n], params: vec![0.0; n] }
        } else {
            EngineLink::InPlace
        }
    }

    /// Pull every shard's current parameters into the engine.
    pub async fn pull(&mut self, client: &mut PsClient, engine: &mut Engine) -> anyhow::Result<Transfer> {
        match self {
            EngineLink::InPlace => {
                let engine = RefCell::new(engine);
                client.pull_into(ranges(client, &engine)).await
            }
            EngineLink::Staged { params, .. } => {
                let t = client.pull(params).await?;
                engine.write_params(0, params)?;
                Ok(t)
            }
        }
    }

    /// One step's communication ([`PsClient::exchange`]): push the engine's gradient and pull
    /// the parameters the update makes into the engine. Returns when the communication began
    /// (after the copy off the device, if any) and the push's and the pull's traffic, timed
    /// from then.
    pub async fn exchange(
        &mut self,
        client: &mut PsClient,
        engine: &mut Engine,
    ) -> anyhow::Result<(Instant, Transfer, Transfer)> {
        match self {
            EngineLink::InPlace => {
                let t = Instant::now();
                let engine = RefCell::new(engine);
                let sinks = ranges(client, &engine);
                let (push, pull) = client.exchange(&EngineGrads(&engine), sinks).await?;
                Ok((t, push, pull))
            }
            EngineLink::Staged { grads, params } => {
                engine.read_grads(0..grads.len(), grads)?;
                let t = Instant::now();
                let (push, pull) = client.step(grads, params).await?;
                engine.write_params(0, params)?;
                Ok((t, push, pull))
            }
        }
    }

    /// [`EngineLink::exchange`] for a push that does not come straight from the engine's
    /// gradient buffer (one compressed on the host, `--compress`): only the pull reaches the
    /// engine. Returns when the communication began and the push's and the pull's traffic.
    pub async fn exchange_from<G: Gradients + ?Sized>(
        &mut self,
        client: &mut PsClient,
        engine: &mut Engine,
        grads: &G,
    ) -> anyhow::Result<(Instant, Transfer, Transfer)> {
        let t = Instant::now();
        match self {
            EngineLink::InPlace => {
                let engine = RefCell::new(engine);
                let sinks = ranges(client, &engine);
                let (push, pull) = client.exchange(grads, sinks).await?;
                Ok((t, push, pull))
            }
            EngineLink::Staged { params, .. } => {
                let (push, pull) = client.exchange_into(grads, params).await?;
                engine.write_params(0, params)?;
                Ok((t, push, pull))
            }
        }
    }
}

/// One sink per shard over the engine's parameters.
fn ranges<'a, 'e>(client: &PsClient, engine: &'a RefCell<&'e mut Engine>) -> Vec<EngineRange<'a, 'e>> {
    client
        .ranges()
        .map(|r| EngineRange { engine, start: r.start, len: r.len(), scratch: Vec::new() })
        .collect()
}

/// The engine's gradients, copied out straight into the message. The shards' pushes share
/// the engine: they run on one task and never hold it across an await.
struct EngineGrads<'a, 'e>(&'a RefCell<&'e mut Engine>);

impl Gradients for EngineGrads<'_, '_> {
    fn chunk(&self, head: &GradientChunk, values: Range<usize>) -> anyhow::Result<FramedChunk> {
        let engine = self.0.try_borrow().map_err(|e| anyhow::anyhow!("the engine is busy: {e}"))?;
        FramedChunk::build_f32(head, GRADIENT_DATA, head.offset, values.len(), |dst| {
            engine.read_grads(values.clone(), dst)
        })
        .map_err(Into::into)
    }
}

/// A shard's range of the engine's parameters, from `start` for `len` values, written through
/// a chunk-sized buffer. The shards' pulls share the engine: they run on one task and never
/// hold it across an await.
struct EngineRange<'a, 'e> {
    engine: &'a RefCell<&'e mut Engine>,
    start: usize,
    len: usize,
    scratch: Vec<f32>,
}

impl ChunkSink for EngineRange<'_, '_> {
    fn put(&mut self, payload: &[u8], offset: u64) -> Result<(), tonic::Status> {
        let n = payload.len() / 4;
        if usize::try_from(offset).ok().and_then(|o| o.checked_add(n)).is_none_or(|end| end > self.len) {
            return Err(tonic::Status::data_loss(format!(
                "a chunk of {n} values at {offset} overruns the {} of the range",
                self.len
            )));
        }
        self.scratch.resize(n, 0.0);
        wire::copy_into(payload, 0, &mut self.scratch)
            .map_err(|e| tonic::Status::data_loss(e.to_string()))?;
        let internal = |e: String| tonic::Status::internal(e);
        let mut engine = self.engine.try_borrow_mut().map_err(|e| internal(e.to_string()))?;
        engine.write_params(self.start + offset as usize, &self.scratch).map_err(|e| internal(e.to_string()))
    }

    fn values(&self) -> usize {
        self.len
    }
}
