//! A sparse model's table between data-parallel ranks, as PyTorch's DDP moves a sparse
//! gradient: every rank's rows (ids and values) all-gathered, then summed locally. Each rank
//! first says how many rows its batch named; then each sends its rows padded to the largest
//! count, ids as `f32` (exact below 2^24, `MAX_BAG_ROWS`) followed by their values. Every rank
//! adds the rows up in rank order, so all of them hold the same sums bit for bit.

use std::collections::BTreeMap;

use gradsync_core::Engine;
use gradsync_core::net::RowsOf;

use super::error::During;
use super::{Result, StrategyError};
use crate::collective::Collective;

/// How DDP synchronises a sparse model's table (`--sparse-grads`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum SparseGrads {
    /// The whole table's gradient all-reduced with the dense buckets, zeros and all
    /// (`nn.EmbeddingBag` under DDP by default).
    #[default]
    Dense,
    /// The rows each rank's batch named all-gathered as (id, values) and summed (DDP with
    /// `sparse=True`).
    Allgather,
    /// The rows pushed to and pulled from parameter servers that hold the table
    /// (`--mode hybrid`; not a `--sparse-grads` value).
    #[value(skip)]
    Servers,
}

impl SparseGrads {
    /// The name on command lines and in metrics.
    pub fn name(self) -> &'static str {
        match self {
            SparseGrads::Dense => "dense",
            SparseGrads::Allgather => "allgather",
            SparseGrads::Servers => "servers",
        }
    }
}

/// What an all-gather of rows keeps between steps.
#[derive(Debug, Default)]
pub(super) struct RowGather {
    mine: Vec<f32>,
    gathered: Vec<f32>,
}

impl RowGather {
    /// Leave in `engine`'s table gradient, for every row any rank's batch named, the sum of
    /// every rank's gradient of it. Returns how many rows that was.
    pub(super) fn all_gather(&mut self, comm: &mut dyn Collective, engine: &mut Engine) -> Result<usize> {
        let dim = engine
            .layout()
            .table
            .as_ref()
            .ok_or_else(|| StrategyError::Config("--sparse-grads allgather: the model has no table".into()))?
            .dim;
        let (world, rank) = (comm.world_size(), comm.rank());
        let rows = engine.batch_rows().to_vec();
        self.mine.resize(rows.len() * dim, 0.0);
        engine.read_rows(RowsOf::Grads, &rows, &mut self.mine)?;
        let mut counts = vec![0.0f32; world];
        counts[rank] = rows.len() as f32;
        comm.all_gather(&mut counts).during(|| "all-gather of the table's row counts")?;
        let most = counts.iter().fold(0.0f32, |a, &c| a.max(c)) as usize;
        let per = most * (1 + dim);
        self.gathered.clear();
        self.gathered.resize(per * world, 0.0);
        let slot = &mut self.gathered[per * rank..per * (rank + 1)];
        let (ids, values) = slot.split_at_mut(most);
        ids.fill(-1.0);
        for (i, &r) in rows.iter().enumerate() {
            ids[i] = r as f32;
        }
        values[..self.mine.len()].copy_from_slice(&self.mine);
        comm.all_gather(&mut self.gathered).during(|| "all-gather of the table's rows")?;
        let mut sums: BTreeMap<u32, Vec<f32>> = BTreeMap::new();
        for (r, &count) in counts.iter().enumerate() {
            let slot = &self.gathered[per * r..per * (r + 1)];
            let (ids, values) = slot.split_at(most);
            for (i, &id) in ids[..count as usize].iter().enumerate() {
                if id < 0.0 || id.fract() != 0.0 {
                    return Err(StrategyError::RowId { rank: r, id });
                }
                let sum = sums.entry(id as u32).or_insert_with(|| vec![0.0; dim]);
                for (s, &v) in sum.iter_mut().zip(&values[i * dim..(i + 1) * dim]) {
                    *s += v;
                }
            }
        }
        let union: Vec<u32> = sums.keys().copied().collect();
        let values: Vec<f32> = sums.into_values().flatten().collect();
        engine.write_rows(RowsOf::Grads, &union, &values)?;
        Ok(union.len())
    }
}
