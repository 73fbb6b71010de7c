//! How DDP reduces one bucket of gradients, by `--compress`: DDP's [`BucketWork`], which the
//! communicator does to every bucket, so a new codec changes this file only. Host buckets go
//! through the [`Collective`] trait ([`BucketReduce::reduce`]); GPU buckets are queued on
//! NCCL's stream ([`BucketWork::queue_device`]).
//!
//! - `none`: the ring all-reduce of the f32 bucket.
//! - `topk:R`: each rank sends the `k = ceil(R len)` largest magnitudes of its bucket plus its
//!   residual (error feedback, kept per rank and per bucket). A sparse sum does not stay sparse
//!   along a ring, so the pairs are not all-reduced: each rank packs its `k` (index, value)
//!   pairs into `2k` f32 slots (indices bit-cast), one all-gather moves every rank's slots
//!   (bytes only, no arithmetic, so the indices arrive exact), and every rank adds the `k x
//!   world` pairs into its zeroed bucket in rank order, the same sum bit for bit everywhere.
//! - `fp16`, `bf16`: the bucket divided by the world size, rounded to half precision and packed
//!   two values to an f32 slot, then the ring's half-precision all-reduce
//!   ([`Collective::all_reduce_half`]: two bytes a value on every hop, each hop adding in f32
//!   and rounding back), widened back into the bucket and multiplied by the world size
//!   ([`collective::all_reduce_as_half`]: the hops add shares of the mean, so an fp16 sum
//!   cannot pass 65504 where no rank's value does). No error feedback: the rounding is at most
//!   2^-11 (2^-8) of each value. A GPU
//!   bucket under NCCL is rounded on the device (kernels that give the host's bits), reduced
//!   in NCCL's `ncclFloat16` / `ncclBfloat16` and widened back into the bucket, all on NCCL's
//!   stream, never through the host.
//! - Top-k of a GPU bucket would need the selection on the device, which is not implemented:
//!   [`BucketReduce::device_refusal`] says so, and DDP refuses `--backend nccl` with it.

use std::collections::BTreeMap;
use std::ops::Range;

use gradsync_core::compress::{self, Compression, Half, Sparse, TopK};

use gradsync_core::engine::DeviceGrads;

use super::error::During;
use super::{Result, StrategyError};
use crate::collective::{self, After, BucketWork, Collective, CollectiveError, Nccl};

/// What one rank keeps to reduce its buckets under a `--compress` value.
pub(super) enum BucketReduce {
    /// f32 all-reduce.
    Dense,
    /// Half-precision all-reduce of the packed bucket.
    Half {
        /// The format.
        half: Half,
        /// The packed bucket (two values a slot).
        packed: Vec<f32>,
    },
    /// Top-k with error feedback.
    TopK {
        /// The fraction of each bucket sent.
        ratio: f64,
        /// Each bucket's residual, by the bucket's first value.
        residuals: BTreeMap<usize, TopK>,
        /// The whole residual a resumed run's checkpoint held, each bucket's cut from it when
        /// the bucket is first reduced.
        restored: Option<Vec<f32>>,
        /// This rank's pairs of the current bucket.
        pairs: Sparse,
        /// Every rank's packed pairs.
        slots: Vec<f32>,
    },
}

impl BucketReduce {
    /// The reduction `c` asks for.
    pub(super) fn new(c: Compression) -> Self {
        match c {
            Compression::None => BucketReduce::Dense,
            Compression::Fp16 => BucketReduce::Half { half: Half::F16, packed: Vec::new() },
            Compression::Bf16 => BucketReduce::Half { half: Half::Bf16, packed: Vec::new() },
            Compression::TopK(ratio) => BucketReduce::TopK {
                ratio,
                residuals: BTreeMap::new(),
                restored: None,
                pairs: Sparse::default(),
                slots: Vec::new(),
            },
        }
    }

    /// This rank's top-k residual over the whole flat buffer of `n` values (zero where no
    /// bucket was reduced yet); `None` without top-k.
    pub(super) fn residual(&self, n: usize) -> Option<Vec<f32>> {
        let BucketReduce::TopK { residuals, restored, .. } = self else { return None };
        let mut flat = restored.clone().filter(|r| r.len() == n).unwrap_or_else(|| vec![0.0; n]);
        for (&start, t) in residuals {
            let r = t.residual();
            flat.get_mut(start..start + r.len())?.copy_from_slice(r);
        }
        Some(flat)
    }

    /// Carry on from `flat`, a residual [`BucketReduce::residual`] returned (a checkpoint's):
    /// every bucket's residual is cut from it again. Nothing without top-k.
    pub(super) fn restore_residual(&mut self, flat: Vec<f32>) {
        if let BucketReduce::TopK { residuals, restored, .. } = self {
            residuals.clear();
            *restored = Some(flat);
        }
    }

    /// Why GPU buckets cannot be reduced this way, if they cannot.
    pub(super) fn device_refusal(&self) -> Option<String> {
        match self {
            BucketReduce::Dense | BucketReduce::Half { .. } => None,
            BucketReduce::TopK { ratio, .. } => Some(format!(
                "--compress topk:{ratio} with --backend nccl: top-k selection on the device is not implemented \
                 (NCCL reduces the buckets in GPU memory); use --backend tcp"
            )),
        }
    }

    /// Leave in `bucket` (values `range` of the flat gradient) the sum over every rank of what
    /// each sends of it.
    pub(super) fn reduce(
        &mut self,
        comm: &mut dyn Collective,
        range: Range<usize>,
        bucket: &mut [f32],
    ) -> Result<()> {
        match self {
            BucketReduce::Dense => {
                comm.all_reduce(bucket).during(|| format!("all-reduce of bucket {range:?}"))
            }
            BucketReduce::Half { half, packed } => {
                collective::all_reduce_as_half(comm, bucket, *half, packed)
                    .during(|| format!("{} all-reduce of bucket {range:?}", half.name()))
            }
            BucketReduce::TopK { ratio, residuals, restored, pairs, slots } => {
                let residual = residuals.entry(range.start).or_insert_with(|| match restored {
                    Some(r) if range.end <= r.len() => TopK::with_residual(*ratio, r[range.clone()].to_vec()),
                    _ => TopK::new(*ratio, bucket.len()),
                });
                residual.compress(bucket, pairs)?;
                let (k, world, rank) = (pairs.len(), comm.world_size(), comm.rank());
                slots.clear();
                slots.resize(2 * k * world, 0.0);
                compress::pack(pairs, &mut slots[2 * k * rank..2 * k * (rank + 1)])?;
                comm.all_gather(slots).during(|| format!("all-gather of bucket {range:?}'s top-k"))?;
                compress::unpack_sum(slots, k, bucket)
                    .during(|| format!("the top-k pairs gathered for bucket {range:?}"))
            }
        }
    }
}

impl BucketWork for BucketReduce {
    type Error = StrategyError;

    fn name(&self) -> &'static str {
        "allreduce"
    }

    fn host(
        &mut self,
        comm: &mut dyn Collective,
        _index: usize,
        range: Range<usize>,
        values: &mut [f32],
    ) -> Result<Range<usize>> {
        self.reduce(comm, range, values)?;
        Ok(0..values.len())
    }

    fn on_device(&self) -> bool {
        self.device_refusal().is_none()
    }

    /// The f32 all-reduce, or the half-precision one rounded and widened on the device, queued
    /// on NCCL's stream behind the bucket's backward.
    unsafe fn queue_device(&self, nccl: &mut Nccl, grads: &DeviceGrads) -> Result<(), CollectiveError> {
        // SAFETY (every arm): the caller's promise; `address` is valid while the engine lives.
        match self {
            BucketReduce::Dense => unsafe {
                nccl.all_reduce_device_after(grads.address(), grads.len(), After::Bucket(grads))
            },
            BucketReduce::Half { half, .. } => unsafe {
                nccl.all_reduce_half_device_after(
                    grads.address(),
                    grads.len(),
                    After::Bucket(grads),
                    *half,
                    grads.half_cast(),
                )
            },
            BucketReduce::TopK { .. } => Err(CollectiveError::Invalid {
                what: "compression",
                why: self.device_refusal().unwrap_or_default(),
            }),
        }
    }
}
