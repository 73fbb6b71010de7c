//! The engine's memory as a push's source and a pull's destination: the one place the PS path
//! depends on where the engine keeps its buffers ([`EngineLink`], chosen once per run).
//!
//! ```text
//!   host memory (CPU engine):   grads --swapped out, lent, swapped back--> frames --> shard k
//!                               params <--copied per chunk-- DATA frames <-- shard k
//!   device memory (GPU engine): grads --staged per bucket during backward--> host f32 --lent--> frames --> shard k
//!                               params <--write_params-- host f32 <-- DATA frames <-- shard k
//! ```

use std::cell::RefCell;
use std::time::Instant;

use gradsync_core::Engine;
use gradsync_core::model::BucketPlan;
use gradsync_proto::wire;

use super::bulk::Transfer;
use super::chunks::{ChunkSink, Gradients, SharedGrads};
use super::client::PsClient;
use super::error::{PsError, Result};
use super::rows::RowsStep;

/// How pushes read the engine's gradients and pulls write its parameters.
pub enum EngineLink {
    /// Host memory: the engine's gradient buffer itself is pushed, without a copy. For the
    /// exchange it is swapped with `spare`'s (the engine meanwhile holds the spare one, which
    /// nothing reads), lent to the push's messages, and swapped back after; each pulled chunk
    /// is copied straight into the engine's parameters.
    InPlace {
        /// The buffer the engine holds while its own is pushed.
        spare: SharedGrads,
    },
    /// Device memory: the gradient copied to the host bucket by bucket as backward finishes
    /// each ([`EngineLink::backward`], overlapped with the rest of backward), the parameters
    /// copied back whole after the pull; the exchange between these host buffers (the push lent
    /// the host gradient, not copying it again).
    Staged {
        /// The gradient, staged from the device during backward.
        grads: SharedGrads,
        /// The pulled parameters, written to the device after the pull.
        params: Vec<f32>,
        /// The buckets the gradient is staged in, last layer first.
        plan: BucketPlan,
        /// `grads` holds this step's gradient (staged by [`EngineLink::backward`]).
        fresh: bool,
    },
    /// A model with a sparse table, on either device: only the values outside the table move
    /// densely, copied out of the engine and back (a few thousand against the table's
    /// millions); the table moves by rows ([`EngineLink::exchange_rows`]). The engine's own
    /// buffers are never lent or swapped, so it keeps track of which rows of the table's
    /// gradient hold values and clears only those.
    Sparse {
        /// The gradient's dense values, at their flat offsets.
        grads: SharedGrads,
        /// The pulled dense values, at their flat offsets.
        params: Vec<f32>,
        /// Where the dense values lie.
        dense: std::ops::Range<usize>,
    },
}

impl Default for EngineLink {
    /// Host memory (the spare buffer is sized at the first exchange).
    fn default() -> Self {
        EngineLink::InPlace { spare: SharedGrads::default() }
    }
}

impl EngineLink {
    /// The link that fits `engine`'s memory: in place where the engine lends its buffers as
    /// host memory, staged otherwise.
    pub fn new(engine: &mut Engine) -> Self {
        let n = engine.layout().len;
        if let Some(t) = &engine.layout().table {
            let dense = if t.range.start == 0 { t.range.end..n } else { 0..t.range.start };
            return EngineLink::Sparse { grads: SharedGrads::new(vec![0.0; n]), params: vec![0.0; n], dense };
        }
        match engine.host_buffers_mut() {
            Some(_) => EngineLink::InPlace { spare: SharedGrads::new(vec![0.0; n]) },
            None => EngineLink::Staged {
                grads: SharedGrads::new(vec![0.0; n]),
                params: vec![0.0; n],
                // A handful of buckets, so that all but the first layer's leave during backward.
                plan: BucketPlan::with_cap(engine.layout(), (n / 8).max(1)),
                fresh: false,
            },
        }
    }

    /// Backward into the engine's gradient buffer; where the link stages it, each finished
    /// bucket is copied to the host gradient while backward computes the earlier layers, so
    /// the push starts from host memory without a copy of the whole gradient after backward.
    pub fn backward(&mut self, engine: &mut Engine) -> Result<()> {
        match self {
            EngineLink::InPlace { .. } | EngineLink::Sparse { .. } => Ok(engine.backward(false)?),
            EngineLink::Staged { grads, plan, fresh, .. } => {
                *fresh = false;
                let host = grads.make_mut();
                host.resize(engine.layout().len, 0.0);
                let mut staged = Vec::new();
                let mut failed = None;
                engine.backward_buckets(plan, false, &mut |b| {
                    let index = b.index;
                    match b.into_host() {
                        Ok(h) => staged.push(h),
                        Err(cause) => drop(failed.get_or_insert(PsError::Staging { index, cause })),
                    }
                })?;
                if let Some(e) = failed {
                    return Err(e);
                }
                for mut b in staged {
                    let range = b.range.clone();
                    host[range].copy_from_slice(b.values()?);
                }
                *fresh = true;
                Ok(())
            }
        }
    }

    /// Pull every shard's current parameters into the engine.
    pub async fn pull(&mut self, client: &mut PsClient, engine: &mut Engine) -> Result<Transfer> {
        self.pull_except(client, engine, &[]).await
    }

    /// [`EngineLink::pull`], but only from the shards whose parameters the engine does not
    /// hold already ([`PsClient::held`]): at a run's start every worker and shard draws the
    /// same initial values from the seed, and the first pull of the whole model, which on a
    /// slow or dilated link takes about as long as a step's, is skipped.
    pub async fn pull_unless_held(&mut self, client: &mut PsClient, engine: &mut Engine) -> Result<Transfer> {
        let held = client.held(|range| Ok(crate::collective::params_digest(engine, range)?))?;
        self.pull_except(client, engine, &held).await
    }

    /// Pull the shards not `held` (by shard) into the engine, leaving the held ones as they are.
    async fn pull_except(
        &mut self,
        client: &mut PsClient,
        engine: &mut Engine,
        held: &[bool],
    ) -> Result<Transfer> {
        let (params, dense) = match self {
            EngineLink::InPlace { .. } => {
                let engine = RefCell::new(engine);
                return client.pull_into_except(ranges(client, &engine), held).await;
            }
            EngineLink::Staged { params, .. } => {
                let n = params.len();
                (params, 0..n)
            }
            EngineLink::Sparse { params, dense, .. } => (params, dense.clone()),
        };
        // The host copy is written back whole: the values kept come from the engine.
        for (range, _) in client.ranges().zip(held).filter(|(_, h)| **h) {
            engine.read_params(range.clone(), &mut params[range])?;
        }
        let sinks = client.host_sinks(params)?;
        let t = client.pull_into_except(sinks, held).await?;
        engine.write_params(dense.start, &params[dense])?;
        Ok(t)
    }

    /// One step of a model with a sparse table: the dense values exchanged as
    /// [`EngineLink::exchange`] does, the table's rows beside them ([`RowsStep`]). Returns when
    /// the communication began and the push's and the pull's traffic.
    pub async fn exchange_rows(
        &mut self,
        client: &mut PsClient,
        engine: &mut Engine,
        rows: RowsStep<'_>,
    ) -> Result<(Instant, Transfer, Transfer)> {
        let EngineLink::Sparse { grads, params, dense } = self else {
            return Err(PsError::Invalid {
                what: "an exchange of rows",
                why: "the model has no sparse table (EngineLink::new saw none)".into(),
            });
        };
        let host = grads.make_mut();
        engine.read_grads(dense.clone(), &mut host[dense.clone()])?;
        let t = Instant::now();
        let (push, pull) = client.exchange_into_with_rows(&*grads, params, rows).await?;
        engine.write_params(dense.start, &params[dense.clone()])?;
        Ok((t, push, pull))
    }

    /// Pull version `want` of every shard's parameters into the engine: as the servers make
    /// it when it is the next version (a step in progress), at once when it is the current one
    /// ([`PsClient::pull_version_into`]).
    pub async fn pull_version(
        &mut self,
        client: &mut PsClient,
        engine: &mut Engine,
        want: u64,
    ) -> Result<Transfer> {
        match self {
            EngineLink::InPlace { .. } => {
                let engine = RefCell::new(engine);
                client.pull_version_into(ranges(client, &engine), want).await
            }
            EngineLink::Staged { params, .. } => {
                let t = client.pull_version(params, want).await?;
                engine.write_params(0, params)?;
                Ok(t)
            }
            EngineLink::Sparse { params, dense, .. } => {
                let t = client.pull_version(params, want).await?;
                engine.write_params(dense.start, &params[dense.clone()])?;
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
    ) -> Result<(Instant, Transfer, Transfer)> {
        match self {
            EngineLink::InPlace { spare } => {
                let t = Instant::now();
                let n = engine.layout().len;
                let held = spare.make_mut();
                held.resize(n, 0.0);
                if !engine.swap_host_grads(held)? {
                    return Err(PsError::Invalid {
                        what: "an exchange in place",
                        why: "the engine's gradient is not in host memory".into(),
                    });
                }
                // `spare` now holds the gradient.
                let engine = RefCell::new(engine);
                let sinks = ranges(client, &engine);
                let result = client.exchange(&*spare, sinks).await;
                // The gradient back into the engine: the same buffer once no push holds it,
                // else a copy of it (a push that ended early may still have frames queued).
                engine.into_inner().swap_host_grads(spare.make_mut())?;
                let (push, pull) = result?;
                Ok((t, push, pull))
            }
            EngineLink::Sparse { .. } => Err(PsError::Invalid {
                what: "an exchange",
                why: "a model with a table exchanges its rows too (EngineLink::exchange_rows)".into(),
            }),
            EngineLink::Staged { grads, params, fresh, .. } => {
                if !std::mem::take(fresh) {
                    let host = grads.make_mut();
                    engine.read_grads(0..host.len(), host)?;
                }
                let t = Instant::now();
                let (push, pull) = client.exchange_into(&*grads, params).await?;
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
    ) -> Result<(Instant, Transfer, Transfer)> {
        let t = Instant::now();
        match self {
            EngineLink::InPlace { .. } => {
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
            EngineLink::Sparse { .. } => Err(PsError::Invalid {
                what: "a compressed push",
                why: "a model with a table pushes uncompressed".into(),
            }),
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

/// A shard's range of the engine's parameters, from `start` for `len` values: each chunk
/// copied straight into them where they are in host memory, else written through a
/// chunk-sized buffer. The shards' pulls share the engine: they run on one task and never hold
/// it across an await.
struct EngineRange<'a, 'e> {
    engine: &'a RefCell<&'e mut Engine>,
    start: usize,
    len: usize,
    scratch: Vec<f32>,
}

impl ChunkSink for EngineRange<'_, '_> {
    fn put(&mut self, payload: &[u8], offset: u64) -> std::result::Result<(), tonic::Status> {
        let n = payload.len() / 4;
        if usize::try_from(offset).ok().and_then(|o| o.checked_add(n)).is_none_or(|end| end > self.len) {
            return Err(tonic::Status::data_loss(format!(
                "a chunk of {n} values at {offset} overruns the {} of the range",
                self.len
            )));
        }
        let internal = |e: String| tonic::Status::internal(e);
        let data_loss = |e: gradsync_proto::Error| tonic::Status::data_loss(e.to_string());
        let mut engine = self.engine.try_borrow_mut().map_err(|e| internal(e.to_string()))?;
        let at = self.start as u64 + offset;
        if let Some((params, _)) = engine.host_buffers_mut() {
            return wire::copy_into(payload, at, params).map_err(data_loss);
        }
        self.scratch.resize(n, 0.0);
        wire::copy_into(payload, 0, &mut self.scratch).map_err(data_loss)?;
        engine.write_params(at as usize, &self.scratch).map_err(|e| internal(e.to_string()))
    }

    fn values(&self) -> usize {
        self.len
    }
}
