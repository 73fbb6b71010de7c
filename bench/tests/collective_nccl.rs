//! The one-rank NCCL rows of `gradsync-bench collective` time what NCCL does on the GPU: the
//! buffers stay in GPU memory and the timed all-reduces are queued back to back. Run on a real
//! GPU in place, elsewhere against gradsync-testkit's fake CUDA and NCCL, whose counters show
//! every copy between host and device.

#![allow(clippy::unwrap_used)]

use gradsync_testkit::{GpuRun, gpu_test};

const SIZES: [usize; 3] = [8, 4096, 1 << 20];
const BUDGET: usize = 64 << 10;

#[test]
fn one_rank_nccl_times_buffers_that_stay_on_the_gpu() {
    const TEST: &str = "one_rank_nccl_times_buffers_that_stay_on_the_gpu";
    match gpu_test(TEST) {
        GpuRun::Here => {
            if let Err(e) = gradsync_worker::collective::nccl::available() {
                eprintln!("SKIPPED (no NCCL: {e}) [{TEST}]");
                return;
            }
            let rows = gradsync_bench::collective::nccl_single(&SIZES, BUDGET).unwrap();
            assert_eq!(rows.iter().map(|r| r.bytes).collect::<Vec<_>>(), SIZES);
            for r in &rows {
                assert_eq!(r.wrong, 0, "{r:?}");
                assert!(r.secs > 0.0 && r.secs.is_finite(), "{r:?}");
            }
        }
        GpuRun::Fake(c) => {
            // One checked all-reduce per size, then the timed ones.
            let expected: u64 = SIZES.iter().map(|&b| (BUDGET / b).clamp(3, 200) as u64 + 1).sum();
            assert_eq!(c.collectives, expected, "{c}");
            // Each buffer goes to the GPU once and back once, for the check: none inside the
            // timed loop (staging through the host would copy twice per all-reduce).
            assert_eq!(c.host_copies, 2 * SIZES.len() as u64, "{c}");
        }
        GpuRun::Skipped => {}
    }
}
