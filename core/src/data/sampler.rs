//! The distributed sampler, with PyTorch `DistributedSampler` semantics.
//!
//! Each epoch, the indices `0..len` are shuffled with a generator seeded by `seed + epoch`
//! (or left in order); then either padded by repeating from the front until the total divides
//! by the world size, or (`drop_last`) truncated to the largest multiple of it. Rank `r` takes
//! every `world`-th index starting at `r`. Shards are disjoint (up to the padding), cover the
//! dataset, and have equal length, so every rank runs the same number of steps.
//!
//! Because shards are strided, the union of the ranks' `k`-th batches of `b` samples is exactly
//! the `k`-th batch of `world * b` samples of a single process: the property behind gradsync's
//! "same samples in every mode" comparisons.

use crate::error::{Error, Result};
use crate::rng::Rng;

/// One rank's view of the dataset.
#[derive(Debug, Clone)]
pub struct DistributedSampler {
    len: usize,
    world: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
}

impl DistributedSampler {
    /// A sampler for `rank` of `world` over `len` samples.
    pub fn new(
        len: usize,
        world: usize,
        rank: usize,
        shuffle: bool,
        seed: u64,
        drop_last: bool,
    ) -> Result<Self> {
        if world == 0 {
            return Err(Error::invalid("world size", "must be at least 1"));
        }
        if rank >= world {
            return Err(Error::invalid("rank", format!("{rank} is not below the world size {world}")));
        }
        if len == 0 {
            return Err(Error::invalid("dataset", "has no samples"));
        }
        if drop_last && len < world {
            return Err(Error::invalid(
                "dataset",
                format!("{len} samples cannot give each of {world} ranks one with drop_last"),
            ));
        }
        Ok(DistributedSampler { len, world, rank, shuffle, seed, drop_last })
    }

    /// Samples per rank per epoch.
    pub fn num_samples(&self) -> usize {
        if self.drop_last { self.len / self.world } else { self.len.div_ceil(self.world) }
    }

    /// This rank's indices for `epoch`.
    pub fn indices(&self, epoch: u64) -> Vec<usize> {
        let mut all: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            Rng::new(self.seed.wrapping_add(epoch), 0x5A3B).shuffle(&mut all);
        }
        let total = self.num_samples() * self.world;
        if total > all.len() {
            let pad: Vec<usize> = all.iter().cycle().take(total - all.len()).copied().collect();
            all.extend(pad);
        } else {
            all.truncate(total);
        }
        all.into_iter().skip(self.rank).step_by(self.world).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    fn shards(len: usize, world: usize, drop_last: bool, epoch: u64) -> Vec<Vec<usize>> {
        (0..world)
            .map(|r| DistributedSampler::new(len, world, r, true, 3, drop_last).unwrap().indices(epoch))
            .collect()
    }

    #[test]
    fn disjoint_and_covering_when_divisible() {
        let s = shards(100, 4, false, 0);
        let all: HashSet<usize> = s.iter().flatten().copied().collect();
        assert_eq!(all.len(), 100);
        assert!(s.iter().all(|sh| sh.len() == 25));
    }

    #[test]
    fn pads_to_equal_length() {
        let s = shards(10, 4, false, 0);
        assert!(s.iter().all(|sh| sh.len() == 3));
        let flat: Vec<usize> = s.iter().flatten().copied().collect();
        assert_eq!(flat.len(), 12);
        assert_eq!(flat.iter().copied().collect::<HashSet<_>>().len(), 10, "covers every sample");
        // More padding than samples (len < world) cycles the permutation.
        let tiny = shards(2, 5, false, 0);
        assert!(tiny.iter().all(|sh| sh.len() == 1));
    }

    #[test]
    fn drop_last_truncates() {
        let s = shards(10, 4, true, 0);
        assert!(s.iter().all(|sh| sh.len() == 2));
        let all: HashSet<usize> = s.iter().flatten().copied().collect();
        assert_eq!(all.len(), 8, "disjoint, and the 2 left over are dropped");
        assert!(DistributedSampler::new(3, 4, 0, true, 0, true).is_err());
    }

    #[test]
    fn reshuffles_per_epoch_deterministically() {
        assert_ne!(shards(64, 2, false, 0), shards(64, 2, false, 1));
        assert_eq!(shards(64, 2, false, 5), shards(64, 2, false, 5));
        let ordered = DistributedSampler::new(8, 2, 1, false, 0, false).unwrap();
        assert_eq!(ordered.indices(0), vec![1, 3, 5, 7]);
    }

    #[test]
    fn strided_union_is_the_big_batch() {
        let (world, b) = (4, 3);
        let s = shards(48, world, false, 2);
        let single = DistributedSampler::new(48, 1, 0, true, 3, false).unwrap().indices(2);
        for k in 0..4 {
            let mut union: Vec<usize> = s.iter().flat_map(|sh| sh[k * b..(k + 1) * b].to_vec()).collect();
            let mut big = single[k * world * b..(k + 1) * world * b].to_vec();
            union.sort();
            big.sort();
            assert_eq!(union, big);
        }
    }

    #[test]
    fn bad_arguments() {
        assert!(DistributedSampler::new(10, 0, 0, true, 0, false).is_err());
        assert!(DistributedSampler::new(10, 2, 2, true, 0, false).is_err());
        assert!(DistributedSampler::new(0, 1, 0, true, 0, false).is_err());
    }
}
