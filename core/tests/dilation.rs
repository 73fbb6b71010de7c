//! Dilated compute (`--dilate`): a model trained for real has its training forward, backward
//! up to each bucket and update each last the factor times its thread's CPU time, the bucket
//! handed out only then; evaluation is not paced; a replayed model's waits stretch by the
//! factor. Tolerances: the wake-up of a sleeping thread is late by up to a millisecond on a
//! busy machine, so lower bounds are exact and upper bounds allow 25 ms.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use gradsync_core::Engine;
use gradsync_core::data::SyntheticConfig;
use gradsync_core::device::Device;
use gradsync_core::dilation::{Dilation, thread_cpu};
use gradsync_core::model::{BucketPlan, Input, ModelSpec};
use gradsync_core::optim::SgdConfig;
use gradsync_core::profile::{DeviceRate, builtin};

const LATE: Duration = Duration::from_millis(25);

fn data(dim: usize) -> gradsync_core::data::Dataset {
    SyntheticConfig { train: 64, test: 16, dim, input: Input::Flat(dim), classes: 10 }.generate(3)
}

#[test]
fn each_training_phase_lasts_the_factor_times_its_cpu_time_and_buckets_wait_for_it() {
    let spec = ModelSpec::parse("256-512-512-10").unwrap();
    let d = data(256);
    let (x, y) = (&d.train.x[..32 * 256], &d.train.y[..32]);
    let mut e = Engine::new(Device::Cpu { threads: 1 }, spec, 1).unwrap();
    let plan = BucketPlan::with_cap(e.layout(), 1000);
    assert!(plan.buckets.len() >= 3, "{} buckets", plan.buckets.len());
    // Warm up undilated (first-touch allocations), then measure dilated x8.
    e.forward(x, y, true).unwrap();
    e.backward_buckets(&plan, false, &mut |_| {}).unwrap();
    e.update(&SgdConfig::default(), 1.0).unwrap();
    let _ = e.take_pace();
    e.set_dilation(Dilation::new("--dilate", 8.0).unwrap());

    let (t0, c0) = (Instant::now(), thread_cpu());
    e.forward(x, y, true).unwrap();
    let forward = e.take_pace();
    assert_eq!(forward.phases, 1);
    let mut handed = Vec::new();
    let (t1, c1) = (Instant::now(), thread_cpu());
    e.backward_buckets(&plan, false, &mut |b| handed.push((b.index, t1.elapsed(), thread_cpu()))).unwrap();
    let backward = e.take_pace();
    e.update(&SgdConfig::default(), 1.0).unwrap();
    let update = e.take_pace();
    let (wall, cpu) = (t0.elapsed(), thread_cpu() - c0);

    // One phase per bucket handed out, and the rest of backward after the last.
    assert_eq!(backward.phases as usize, plan.buckets.len() + 1);
    assert_eq!(update.phases, 1);
    // The whole step lasted 8 times its compute (the pacing's own clock reads are CPU too).
    let paced = forward.cpu + backward.cpu + update.cpu;
    assert!(wall >= paced * 8, "{wall:?} < 8 x {paced:?}");
    assert!(wall <= cpu * 8 + LATE * 3, "{wall:?} against 8 x {cpu:?}");
    // A bucket is handed out only once backward's compute so far, dilated, has passed. Its
    // compute is counted from backward's start: CPU time a loaded VM charges the thread around
    // forward's wait (up to 0.2 ms seen under the whole suite) is no part of backward's.
    for &(i, at, cpu_then) in &handed {
        let computed = cpu_then.saturating_sub(c1);
        assert!(at + Duration::from_millis(1) >= computed * 7, "bucket {i} at {at:?}, compute {computed:?}");
    }
    // Nothing here waited for a core it did not have.
    let under = forward.under + backward.under + update.under;
    assert!(under <= 1, "{under} phases under-dilated on an idle thread");

    // Evaluation is not paced.
    e.forward(x, y, false).unwrap();
    assert_eq!(e.take_pace().phases, 0);
}

#[test]
fn a_replayed_models_waits_stretch_by_the_factor() {
    let profile = builtin("resnet50", DeviceRate::H100).unwrap();
    let batch = profile.batch;
    let mut e = Engine::new(Device::Cpu { threads: 1 }, ModelSpec::replay(profile), 1).unwrap();
    let labels = vec![0u32; batch];
    let x = vec![0.0f32; batch];
    let time = |e: &mut Engine| {
        let t = Instant::now();
        e.forward(&x, &labels, true).unwrap();
        t.elapsed()
    };
    let plain = time(&mut e);
    e.set_dilation(Dilation::new("--dilate", 10.0).unwrap());
    let dilated = time(&mut e);
    // Resnet-50's forward at an H100's rate is a few milliseconds: ten times it, give or take a
    // late wake-up.
    assert!(dilated <= plain * 10 + LATE, "{dilated:?} against 10 x {plain:?}");
    assert!(dilated >= plain * 9, "{dilated:?} against 10 x {plain:?}");
}
