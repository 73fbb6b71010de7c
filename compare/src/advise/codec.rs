//! What compression costs in time, per value, as measured on this machine with gradsync's own
//! codecs (`gradsync_core::compress`, the code the ring and the parameter server run): the
//! half-precision encode and decode, top-k's selection (with its error feedback) and the sum of
//! every rank's pairs into a bucket. The predictor takes these rates as an input, so a test (or
//! a check on other hosts) gives its own.

use std::time::Instant;

use gradsync_core::compress::{Half, Sparse, TopK, pack, unpack_sum};
use serde::{Deserialize, Serialize};

use super::error::AdviseError;

/// Values each measurement runs over: large enough that the timer and the caches are a small
/// part, small enough that all four take a few tens of milliseconds.
const VALUES: usize = 1 << 20;
/// Each rate is the fastest of this many runs (the others met other load).
const RUNS: usize = 3;
/// Ranks whose pairs the measured sum adds.
const RANKS: usize = 4;

/// Seconds per value of each codec step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CodecRates {
    /// Rounding one f32 value to half precision.
    pub half_encode_s: f64,
    /// Widening one half-precision value to f32.
    pub half_decode_s: f64,
    /// Top-k's selection per value of the buffer (the residual added, the k largest chosen).
    pub topk_select_s: f64,
    /// Adding one received (index, value) pair into a bucket.
    pub topk_add_s: f64,
    /// Where the figures came from.
    pub source: String,
}

impl CodecRates {
    /// Codecs that take no time: what a prediction of bytes alone assumes.
    pub fn free() -> Self {
        CodecRates {
            half_encode_s: 0.0,
            half_decode_s: 0.0,
            topk_select_s: 0.0,
            topk_add_s: 0.0,
            source: "none (codecs taken to cost no time)".into(),
        }
    }

    /// Measure gradsync's codecs here, top-k at `ratio`.
    pub fn measure(ratio: f64) -> Result<Self, AdviseError> {
        let fail = |e: gradsync_core::Error| AdviseError::invalid("measuring the codecs", e.to_string());
        let grad: Vec<f32> = (0..VALUES).map(|i| ((i as f32) * 0.618).sin() * 1e-3).collect();
        let mut bytes = vec![0u8; 2 * VALUES];
        let mut back = vec![0f32; VALUES];
        let half_encode_s = fastest(|| Half::F16.encode(&grad, &mut bytes)).map_err(fail)? / VALUES as f64;
        let half_decode_s = fastest(|| Half::F16.decode(&bytes, &mut back)).map_err(fail)? / VALUES as f64;
        let mut topk = TopK::new(ratio, VALUES);
        let mut pairs = Sparse::default();
        let topk_select_s = fastest(|| topk.compress(&grad, &mut pairs)).map_err(fail)? / VALUES as f64;
        let k = pairs.len();
        let mut slots = vec![0f32; 2 * k];
        pack(&pairs, &mut slots).map_err(fail)?;
        let gathered: Vec<f32> = std::iter::repeat_n(slots, RANKS).flatten().collect();
        let add = fastest(|| unpack_sum(&gathered, k, &mut back)).map_err(fail)?;
        Ok(CodecRates {
            half_encode_s,
            half_decode_s,
            topk_select_s,
            topk_add_s: add / (RANKS * k.max(1)) as f64,
            source: format!(
                "gradsync's codecs on this machine, {VALUES} values, fastest of {RUNS} runs{}",
                if cfg!(debug_assertions) { "; a debug build, slower than a release build's" } else { "" }
            ),
        })
    }

    /// The rates a cluster dilated `d` times runs these codecs at: `d` times faster, since
    /// dilation shrinks every per-byte CPU step that is not compute by its factor, the codecs'
    /// as the kernel's TCP, the ring's sums and the servers' steps (docs/cluster.md). What a
    /// prediction set beside a dilated run's measurement prices them at.
    pub fn dilated(&self, d: f64) -> CodecRates {
        if d <= 1.0 {
            return self.clone();
        }
        CodecRates {
            half_encode_s: self.half_encode_s / d,
            half_decode_s: self.half_decode_s / d,
            topk_select_s: self.topk_select_s / d,
            topk_add_s: self.topk_add_s / d,
            source: format!("{}, run {d} times faster dilated x{d}", self.source),
        }
    }

    /// The rates in words: `fp16 1.2 GB/s encode, ...` (bytes of f32 values per second).
    pub fn describe(&self) -> String {
        let rate = |s: f64| if s > 0.0 { format!("{:.2} GB/s", 4.0 / s / 1e9) } else { "free".into() };
        format!(
            "half encode {}, decode {}; top-k select {}, pair add {:.1} ns ({})",
            rate(self.half_encode_s),
            rate(self.half_decode_s),
            rate(self.topk_select_s),
            self.topk_add_s * 1e9,
            self.source
        )
    }
}

/// The fastest of [`RUNS`] runs of `f`, seconds.
fn fastest<E>(mut f: impl FnMut() -> Result<(), E>) -> Result<f64, E> {
    let mut best = f64::INFINITY;
    for _ in 0..RUNS {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_codecs_are_measured_at_a_positive_rate() {
        let r = CodecRates::measure(0.01).unwrap();
        for v in [r.half_encode_s, r.half_decode_s, r.topk_select_s, r.topk_add_s] {
            // Above zero, and below a microsecond a value on any machine that runs gradsync.
            assert!(v > 0.0 && v < 1e-6, "{r:?}");
        }
        assert!(r.describe().contains("GB/s"));
        assert_eq!(CodecRates::free().half_encode_s, 0.0);
        // Dilated D times: each step D times faster; undilated, the same.
        let d = r.dilated(8.0);
        let each = |c: &CodecRates| [c.half_encode_s, c.half_decode_s, c.topk_select_s, c.topk_add_s];
        for (a, b) in each(&r).into_iter().zip(each(&d)) {
            assert!((a / b - 8.0).abs() < 1e-9, "{a} against {b}");
        }
        assert!(d.source.contains("dilated x8"), "{}", d.source);
        assert_eq!(r.dilated(1.0), r);
    }
}
