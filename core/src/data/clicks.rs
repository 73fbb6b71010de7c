//! The built-in sparse data set: click logs with a planted ground truth, for the embedding model.
//!
//! Each sample names 10 to 40 rows of a table of `rows` ids (repeats allowed), drawn from a
//! Zipf distribution over the ids' popularity ranks (exponent [`ZIPF`]; a rank becomes an id
//! through a fixed permutation, so popular ids are spread over the whole table as hashed ids
//! are). A hidden teacher gives each of the [`INFORMATIVE`] most popular ids a score `t[id]`
//! (standard normal) and every other id none: rare ids are in every batch, and move bytes, but
//! carry no signal a model could learn from a few sightings. A sample's label is whether the sum
//! of its ids' scores is above the median over the training samples (so the classes are
//! balanced, and guessing scores 50%), replaced by a fair coin with probability [`NOISE`]. The
//! best any model can do on held-out samples is therefore `1 - NOISE / 2`
//! ([`ClicksConfig::ceiling`]); how close it gets depends on how well it has learned the
//! popular ids' rows.

use super::{Dataset, Split};
use crate::error::{Error, Result};
use crate::model::{Input, MAX_BAG_ROWS};
use crate::rng::Rng;

/// The Zipf exponent of ids' popularity: about half of all draws fall on the top 0.1% of ids
/// of a 2^20-row table, and most ids are seen rarely, as in click logs.
pub const ZIPF: f64 = 1.05;
/// The probability that a label is a coin toss rather than the teacher's.
pub const NOISE: f64 = 0.1;
/// How many of the most popular ids the teacher scores.
pub const INFORMATIVE: usize = 4096;
/// Ids per sample: uniform in this range.
pub const IDS: (usize, usize) = (10, 40);

/// The shape of the click data (`--data clicks[:N[:ROWS]]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClicksConfig {
    /// Training samples.
    pub train: usize,
    /// Held-out samples.
    pub test: usize,
    /// The ids' range.
    pub rows: usize,
}

impl Default for ClicksConfig {
    fn default() -> Self {
        ClicksConfig { train: 65536, test: 8192, rows: crate::model::EMBEDDING_ROWS }
    }
}

impl ClicksConfig {
    /// `""`, `N` (training samples) or `N:ROWS`.
    pub fn parse(s: &str) -> Result<Self> {
        let mut c = ClicksConfig::default();
        let num = |p: &str, what: &str| -> Result<usize> {
            p.parse::<usize>().ok().filter(|&v| v > 0).ok_or_else(|| {
                Error::invalid("data", format!("clicks {what} '{p}' must be a positive integer"))
            })
        };
        let parts: Vec<&str> = if s.is_empty() { Vec::new() } else { s.split(':').collect() };
        match parts.as_slice() {
            [] => {}
            [n] => c.train = num(n, "size")?,
            [n, r] => {
                c.train = num(n, "size")?;
                c.rows = num(r, "rows")?;
            }
            _ => {
                return Err(Error::invalid(
                    "data",
                    format!("clicks:'{s}' (expected clicks, clicks:N or clicks:N:ROWS)"),
                ));
            }
        }
        if c.rows > MAX_BAG_ROWS {
            return Err(Error::invalid(
                "data",
                format!("clicks rows {} is more than {MAX_BAG_ROWS}", c.rows),
            ));
        }
        c.test = (c.train / 8).clamp(1024, 16384);
        Ok(c)
    }

    /// One sample's shape.
    pub fn input(&self) -> Input {
        Input::Bag { rows: self.rows, slots: IDS.1 }
    }

    /// The best held-out accuracy any model can reach: the teacher's label is kept with
    /// probability `1 - NOISE`, and a coin toss is right half the time.
    pub fn ceiling() -> f64 {
        1.0 - NOISE / 2.0
    }

    /// Generate the data set for `seed`.
    pub fn generate(&self, seed: u64) -> Dataset {
        let rows = self.rows;
        let mut rng = Rng::new(seed, 0xC11C);
        let teacher: Vec<f32> = (0..rows.min(INFORMATIVE)).map(|_| rng.normal()).collect();
        // The popularity ranks' cumulative weights, for drawing a rank by bisection.
        let mut cdf = Vec::with_capacity(rows);
        let mut total = 0.0f64;
        for k in 1..=rows {
            total += (k as f64).powf(-ZIPF);
            cdf.push(total);
        }
        // Rank k is id (k * step + shift) mod rows: a permutation when step and rows are coprime.
        let mut step = (0x9E37_79B9u64 % rows as u64).max(1);
        while gcd(step, rows as u64) != 1 {
            step += 1;
        }
        let shift = rng.below(rows as u64);
        let slots = IDS.1;
        // Each sample's ids and teacher score, then labels against the training median.
        let draw = |n: usize, stream: u64| {
            let mut rng = Rng::new(seed, stream);
            let mut x = Vec::with_capacity(n * 2 * slots);
            let mut scores = Vec::with_capacity(n);
            let mut coins = Vec::with_capacity(n);
            for _ in 0..n {
                let count = IDS.0 + rng.below((IDS.1 - IDS.0 + 1) as u64) as usize;
                let mut ids = [-1.0f32; IDS.1];
                let mut score = 0.0f64;
                for id in ids.iter_mut().take(count) {
                    let u = rng.next_u64() as f64 / u64::MAX as f64 * total;
                    let rank = cdf.partition_point(|&c| c < u).min(rows - 1);
                    score += teacher.get(rank).map_or(0.0, |&t| f64::from(t));
                    *id = ((rank as u64 * step + shift) % rows as u64) as f32;
                }
                let coin = ((rng.uniform() as f64) < NOISE).then(|| rng.below(2) as u32);
                x.extend_from_slice(&ids);
                x.extend((0..slots).map(|j| if j < count { 1.0 } else { 0.0 }));
                scores.push(score);
                coins.push(coin);
            }
            (x, scores, coins)
        };
        let (train_x, train_scores, train_coins) = draw(self.train, 0xC7A1);
        let (test_x, test_scores, test_coins) = draw(self.test, 0xC7E5);
        let mut sorted = train_scores.clone();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[sorted.len() / 2];
        let labels = |scores: &[f64], coins: &[Option<u32>]| -> Vec<u32> {
            scores.iter().zip(coins).map(|(&s, c)| c.unwrap_or(u32::from(s >= median))).collect()
        };
        Dataset {
            name: "clicks".into(),
            dim: 2 * slots,
            input: self.input(),
            classes: 2,
            train: Split { y: labels(&train_scores, &train_coins), x: train_x },
            test: Split { y: labels(&test_scores, &test_coins), x: test_x },
        }
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// A batch of `batch` random bags over a table of `rows` (for checks of the embedding model
/// against a reference): sample `s` names `1 + s % slots` ids drawn uniformly (repeats allowed,
/// the other slots empty), each with a weight in [0.5, 1.5).
pub fn random_bags(rows: usize, slots: usize, batch: usize, rng: &mut Rng) -> Vec<f32> {
    let mut x = Vec::with_capacity(batch * 2 * slots);
    for s in 0..batch {
        let count = 1 + s % slots;
        x.extend((0..slots).map(|j| if j < count { rng.below(rows as u64) as f32 } else { -1.0 }));
        x.extend((0..slots).map(|j| if j < count { 0.5 + rng.uniform() } else { 0.0 }));
    }
    x
}
