//! Each step's batch, drawn from this process's shard in the sampler's order for the step's
//! epoch (a function of the seed and the epoch alone, so a resumed run draws the batches the
//! unbroken run would), and the batch after it, drawn only when the strategy asks for it.

use gradsync_core::data::{Augment, Dataset, DistributedSampler};

use crate::setup::Budget;
use crate::strategy::{Batch, NextBatch};

/// The batches of a run, step by step.
pub(super) struct Batches<'r> {
    /// The current step's rows and labels.
    x: Vec<f32>,
    y: Vec<u32>,
    /// What draws the batch after it.
    ahead: Ahead<'r>,
}

/// The next step's batch, drawn on demand.
struct Ahead<'r> {
    draw: Draw<'r>,
    /// The step it belongs to.
    step: u64,
    x: Vec<f32>,
    y: Vec<u32>,
}

/// How a step's batch is drawn.
struct Draw<'r> {
    data: &'r Dataset,
    augment: Augment,
    seed: u64,
    sampler: DistributedSampler,
    /// Rows per step.
    rows: usize,
    /// Steps per epoch.
    per_epoch: u64,
    /// The run's last step: no batch follows it.
    last: u64,
    /// The orders of the epochs drawn last, at most two (a look-ahead across an epoch's end
    /// draws the next epoch's while this one's is still in use).
    orders: Vec<(u64, Vec<usize>)>,
}

impl<'r> Batches<'r> {
    /// `rows` rows a step from `data` in the order of `sampler` (this process's shard),
    /// augmented as `augment` says with `seed`, for as long as `budget` says. Refuses more
    /// rows a step than the shard holds.
    pub fn new(
        (data, augment, seed): (&'r Dataset, Augment, u64),
        sampler: DistributedSampler,
        rows: usize,
        budget: Budget,
    ) -> anyhow::Result<Self> {
        let per_epoch = (sampler.num_samples() / rows.max(1)) as u64;
        anyhow::ensure!(
            per_epoch > 0,
            "--batch {rows} is larger than this rank's {} training samples",
            sampler.num_samples()
        );
        let last = match budget {
            Budget::Steps(n) => n,
            Budget::Epochs(e) => per_epoch * e,
        };
        let draw = Draw { data, augment, seed, sampler, rows, per_epoch, last, orders: Vec::new() };
        Ok(Batches {
            x: Vec::new(),
            y: Vec::new(),
            ahead: Ahead { draw, step: 0, x: Vec::new(), y: Vec::new() },
        })
    }

    /// The run's steps in all.
    pub fn steps(&self) -> u64 {
        self.ahead.draw.last
    }

    /// The batch of `step` (counted from 1) and its epoch; the batch after it comes from the
    /// returned [`Batch`] when asked for.
    pub fn draw(&mut self, step: u64) -> (Batch<'_>, u64) {
        let epoch = self.ahead.draw.gather(step, &mut self.x, &mut self.y);
        self.ahead.step = step + 1;
        (Batch::new(&self.x, &self.y, Some(&mut self.ahead)), epoch)
    }
}

impl NextBatch for Ahead<'_> {
    fn next_x(&mut self) -> Option<&[f32]> {
        if self.step > self.draw.last {
            return None;
        }
        self.draw.gather(self.step, &mut self.x, &mut self.y);
        Some(&self.x)
    }
}

impl Draw<'_> {
    /// Gather (and augment) the rows of `step` into `x` and `y`; returns its epoch.
    fn gather(&mut self, step: u64, x: &mut Vec<f32>, y: &mut Vec<u32>) -> u64 {
        let (epoch, i) = ((step - 1) / self.per_epoch, ((step - 1) % self.per_epoch) as usize);
        let k = self.order(epoch);
        let chunk = &self.orders[k].1[i * self.rows..(i + 1) * self.rows];
        self.data.gather(chunk, x, y);
        self.augment.apply(x, self.data.input, chunk, self.seed, epoch);
        epoch
    }

    /// Where in `orders` the order of `epoch` is, drawn from the sampler if it is not there.
    fn order(&mut self, epoch: u64) -> usize {
        if let Some(k) = self.orders.iter().position(|(e, _)| *e == epoch) {
            return k;
        }
        if self.orders.len() == 2 {
            self.orders.remove(0);
        }
        self.orders.push((epoch, self.sampler.indices(epoch)));
        self.orders.len() - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradsync_core::data::DataSource;

    /// The batches a run draws are the sampler's order cut into steps, epoch after epoch, and
    /// the batch after each is the one the next step draws (none after the last).
    #[test]
    fn steps_cut_each_epochs_order_and_the_next_batch_is_the_next_steps() {
        let source: DataSource = "synthetic:40:4:3".parse().unwrap();
        let data = source.load(1).unwrap();
        let sampler = || DistributedSampler::new(data.train.len(), 2, 1, true, 5, false).unwrap();
        let rows = 6;
        let (per_epoch, last) = ((sampler().num_samples() / rows) as u64, 7);
        assert!(per_epoch < last, "the steps cross an epoch's end");
        let batches = Batches::new((&data, Augment::default(), 1), sampler(), rows, Budget::Steps(last));
        let mut batches = batches.unwrap();
        assert_eq!(batches.steps(), last);
        let mut want_next: Option<Vec<f32>> = None;
        for step in 1..=last {
            let (mut batch, epoch) = batches.draw(step);
            let want_epoch = (step - 1) / per_epoch;
            assert_eq!(epoch, want_epoch, "step {step}");
            let i = ((step - 1) % per_epoch) as usize;
            let order = sampler().indices(want_epoch);
            let (mut x, mut y) = (Vec::new(), Vec::new());
            data.gather(&order[i * rows..(i + 1) * rows], &mut x, &mut y);
            assert_eq!((batch.x, batch.y), (&x[..], &y[..]), "step {step}");
            if let Some(w) = want_next.take() {
                assert_eq!(batch.x, &w[..], "step {step} is the batch drawn ahead of it");
            }
            want_next = batch.next_x().map(<[f32]>::to_vec);
            assert_eq!(want_next.is_some(), step < last, "step {step}");
        }
        let err = Batches::new((&data, Augment::default(), 1), sampler(), 100, Budget::Epochs(1)).err();
        let err = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("--batch 100 is larger than this rank's 20 training samples"), "{err}");
    }
}
