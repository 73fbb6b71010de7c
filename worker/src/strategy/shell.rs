//! The shell DDP and ZeRO-1 share, so that each file holds only where its algorithm differs:
//! meeting the other ranks and connecting the communicator, the bucket plan, rank 0's initial
//! parameters and momentum on every rank (sent only where a rank holds others), and the start
//! and end of every step (rank 0's batch-norm statistics broadcast as DDP's
//! `broadcast_buffers` does, `no_sync` micro-steps, the traffic counted, the gradient's
//! scale), the final barrier and the header's common fields; and their configuration,
//! [`DdpConfig`].

use gradsync_core::Engine;
use gradsync_core::compress::Compression;
use gradsync_core::device::Device;
use gradsync_core::metrics::Step;
use gradsync_core::model::BucketPlan;
use gradsync_core::net::BatchLoss;
use gradsync_core::optim::SgdConfig;
use gradsync_core::trace::Trace;

use super::error::During;
use super::{Result, StrategyError, forward_unless_synced, timed_span};
use crate::collective::{
    Communicator, Hierarchy, Nccl, RingConfig, Traffic, Transport, broadcast_unless_held, held_everywhere,
    params_digest,
};
use crate::rendezvous::{self, RendezvousConfig};

/// What DDP needs to know (ZeRO-1 too, beside its own).
#[derive(Debug, Clone)]
pub struct DdpConfig {
    /// Where to meet the other ranks, this rank's place among them, and the timeout of every
    /// blocking call.
    pub rendezvous: RendezvousConfig,
    /// The collective backend.
    pub backend: Backend,
    /// This rank's device (NCCL needs a GPU).
    pub device: Device,
    /// Values per gradient bucket.
    pub bucket_values: usize,
    /// Synchronise every this many steps, accumulating in between.
    pub sync_every: u64,
    /// Reduce each bucket while backward computes the rest.
    pub overlap: bool,
    /// Synchronised batch norm (`--sync-bn`): the batch's statistics over every rank.
    pub sync_bn: bool,
    /// The TCP ring's chunk, KiB (`None`: the ranks choose, [`RingConfig::chunk_auto`]).
    pub chunk_kb: Option<usize>,
    /// How the TCP ring reaches its neighbours.
    pub transport: Transport,
    /// Whether the TCP backend's all-reduce goes through the hosts.
    pub hierarchy: Hierarchy,
    /// The host this rank counts as on (`--host-id`), instead of the one it finds.
    pub host_id: Option<String>,
    /// The optimiser every rank applies.
    pub sgd: SgdConfig,
    /// Timeline recorder (`--trace`).
    pub trace: Trace,
    /// How each bucket travels (`--compress`).
    pub compression: Compression,
    /// How an embedding model's table travels (`--sparse-grads`).
    pub sparse_grads: super::sparse::SparseGrads,
}

/// Collective backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Default)]
pub enum Backend {
    /// TCP ring on host memory (GPU buffers staged through the host).
    #[default]
    Tcp,
    /// NCCL on GPU memory.
    Nccl,
}

/// What a data-parallel strategy's step hands to its own part: everything the shell holds.
pub(super) struct Shell {
    pub comm: Communicator,
    pub sgd: SgdConfig,
    pub rank: usize,
    pub world: usize,
    pub bucket_values: usize,
    pub sync_every: u64,
    micro: u64,
    pub overlap: bool,
    /// Batch norms normalise with the statistics of every rank's batch (`--sync-bn`).
    pub sync_bn: bool,
    pub trace: Trace,
    plan: Option<BucketPlan>,
    /// Whether an embedding model's table stays out of the buckets (it travels as rows).
    rows_apart: bool,
}

/// One synchronising step as the strategy's own part sees it.
pub(super) struct StepCtx<'s> {
    /// The bucket plan.
    pub plan: &'s BucketPlan,
    /// Whether backward adds to the gradients already there (after `no_sync` micro-steps).
    pub accumulate: bool,
    /// What turns the summed gradient into the mean over every rank and micro-step.
    pub scale: f32,
}

impl Shell {
    /// Meet the other ranks (rendezvous through rank 0's store) and connect `c`'s backend.
    pub fn connect(c: &DdpConfig) -> Result<Shell> {
        let cfg = &c.rendezvous;
        let (rank, world) = (cfg.rank, cfg.world);
        let comm = match c.backend {
            Backend::Tcp => {
                let ring = RingConfig {
                    timeout: cfg.timeout,
                    transport: c.transport,
                    hierarchy: c.hierarchy,
                    host_id: c.host_id.clone(),
                    ..RingConfig::default()
                }
                .with_chunk_kb(c.chunk_kb);
                let tcp = rendezvous::connect_tcp(cfg, ring).map_err(|source| StrategyError::Ring {
                    world,
                    master: cfg.master.clone(),
                    source,
                })?;
                Communicator::Tcp(Box::new(tcp))
            }
            Backend::Nccl => {
                let ordinal = c.device.cuda_ordinal().ok_or_else(|| {
                    StrategyError::Config(
                        "--backend nccl works on GPU memory: use --device cuda (or --backend tcp)".into(),
                    )
                })?;
                let id = if world == 1 {
                    crate::collective::nccl::unique_id()?
                } else {
                    rendezvous::join(cfg)?
                        .nccl_id
                        .ok_or_else(|| StrategyError::NoNcclId { master: cfg.master.clone() })?
                };
                Communicator::Nccl(Box::new(Nccl::new(ordinal, rank, world, &id, cfg.timeout)?))
            }
        };
        Ok(Shell {
            comm,
            sgd: c.sgd,
            rank,
            world,
            bucket_values: c.bucket_values,
            sync_every: c.sync_every,
            micro: 0,
            overlap: c.overlap,
            sync_bn: c.sync_bn,
            trace: c.trace.clone(),
            plan: None,
            rows_apart: c.sparse_grads != super::sparse::SparseGrads::Dense,
        })
    }

    /// Before the first step: the bucket plan, and one set of initial parameters for every
    /// rank, rank 0's, written into `engine`. Returns the plan and rank 0's momentum where some
    /// rank holds one (`--load` gave it), which the strategy keeps where its optimiser state
    /// lives; `None` where none does, the usual start: momentum is zero until an update makes
    /// it, and a zero buffer of the model's size is neither sent nor written.
    pub fn start(&mut self, engine: &mut Engine) -> Result<(BucketPlan, Option<Vec<f32>>)> {
        let mut plan = BucketPlan::with_cap(engine.layout(), self.bucket_values);
        if self.rows_apart {
            plan = plan.without_table(engine.layout());
        }
        // Sent only where some rank holds other values (`--load` on one rank, say): ranks that
        // drew the same ones from the seed compare digests instead.
        let own = params_digest(engine, 0..engine.layout().len)?;
        if !held_everywhere(self.comm.get(), own, 0).during(|| "comparing the initial parameters")? {
            let mut p = engine.params()?;
            self.comm.get().broadcast(&mut p, 0).during(|| "broadcasting the initial parameters")?;
            engine.write_params(0, &p)?;
        }
        let mut without = [f32::from(u8::from(engine.optimizer_state_bytes() == 0))];
        self.comm.get().all_reduce(&mut without).during(|| "asking which ranks hold momentum")?;
        let momentum = if without[0] as usize == self.world {
            None
        } else {
            let mut p = vec![0.0; engine.layout().len];
            engine.read_momentum(&mut p)?;
            broadcast_unless_held(self.comm.get(), &mut p, 0).during(|| "broadcasting the momentum")?;
            Some(p)
        };
        self.plan = Some(plan.clone());
        Ok((plan, momentum))
    }

    /// One step: forward; on a `no_sync` micro-step the local backward and nothing more;
    /// otherwise `sync`, the strategy's backward, synchronisation and update, with the
    /// traffic it caused counted into `rec`.
    pub fn step<S>(
        this: &mut S,
        shell: impl Fn(&mut S) -> &mut Shell,
        engine: &mut Engine,
        (x, y): (&[f32], &[u32]),
        rec: &mut Step,
        sync: impl FnOnce(&mut S, &mut Engine, &StepCtx<'_>, &mut Step) -> Result<()>,
    ) -> Result<BatchLoss> {
        let sh = shell(this);
        let plan = sh.plan.take().ok_or(StrategyError::NotStarted("step"))?;
        let trace = sh.trace.clone();
        let out = (|| {
            let sh = shell(this);
            let before: Traffic = sh.comm.get().traffic();
            if engine.layout().buffers_len > 0 {
                // DDP's broadcast_buffers: every rank's batch norms start the step from rank
                // 0's running statistics (each normalises with its own batch's).
                let mut b = engine.buffers()?;
                sh.comm
                    .get()
                    .broadcast(&mut b, 0)
                    .during(|| "broadcasting rank 0's batch-norm statistics")?;
                engine.write_buffers(&b)?;
            }
            let (loss, synced) = if sh.sync_bn {
                // SyncBatchNorm: the batch's statistics all-reduced in forward (the communicator
                // is idle then), and in backward with the buckets (`backward_synced`).
                let comm = &mut sh.comm;
                let mut all_reduce = |buf: &mut [f32]| comm.sum_norm_stats(buf);
                let (loss, ms) =
                    timed_span(engine, &trace, "forward", |e| e.forward_synced(x, y, &mut all_reduce))?;
                rec.forward_ms = ms;
                (loss, Some(false))
            } else {
                forward_unless_synced(engine, x, y, rec, &trace, (&mut sh.micro, sh.sync_every))?
            };
            let Some(accumulate) = synced else { return Ok(loss) };
            // The sum of W ranks' (and K micro-steps') mean gradients, scaled to their mean.
            let scale = 1.0 / (sh.world as f32 * sh.sync_every as f32);
            sync(this, engine, &StepCtx { plan: &plan, accumulate, scale }, rec)?;
            let moved = shell(this).comm.get().traffic() - before;
            // Added: a strategy may have counted traffic of its own (a table's rows).
            rec.bytes_sent += moved.sent;
            rec.bytes_recv += moved.recv;
            Ok(loss)
        })();
        shell(this).plan = Some(plan);
        out
    }

    /// The bucket ranges (none before start).
    pub fn plan_buckets(&self) -> Vec<std::ops::Range<usize>> {
        self.plan.as_ref().map(|p| p.buckets.clone()).unwrap_or_default()
    }

    /// After the last step: nobody leaves while another rank may still be reading from it.
    pub fn finish(&mut self) -> Result<()> {
        self.comm.get().barrier().during(|| "the final barrier")
    }

    /// The header's fields every data-parallel strategy has, into `m`; returns the variant.
    pub fn describe(&self, m: &mut serde_json::Map<String, serde_json::Value>) -> String {
        m.insert("bucket_values".into(), self.bucket_values.into());
        m.insert("buckets".into(), self.plan.as_ref().map_or(0, |p| p.buckets.len()).into());
        m.insert("sync_every".into(), self.sync_every.into());
        m.insert("overlap".into(), self.overlap.into());
        m.insert("sync_bn".into(), self.sync_bn.into());
        m.insert("chunk_kb".into(), self.comm.chunk_kb().into());
        self.comm.describe(m)
    }
}
