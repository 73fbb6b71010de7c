//! Same seed and data: bit-identical parameters after N steps, run twice; and the bucket hook
//! of backward lets another thread read finished buckets while backward goes on.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use gradsync_core::Engine;
use gradsync_core::data::SyntheticConfig;
use gradsync_core::device::{Cpu, Device};
use gradsync_core::mlp::Mlp;
use gradsync_core::model::{BucketPlan, ModelSpec};
use gradsync_core::optim::SgdConfig;

fn train(threads: usize, steps: usize) -> Vec<f32> {
    let spec = ModelSpec::parse("64-128-64-10").unwrap();
    let data = SyntheticConfig { train: 256, test: 16, dim: 64, classes: 10 }.generate(4);
    let mut e = Engine::new(Device::Cpu { threads }, spec, 4).unwrap();
    for s in 0..steps {
        let rows = 32;
        let start = (s * rows) % 256;
        e.forward(&data.train.x[start * 64..(start + rows) * 64], &data.train.y[start..start + rows], true)
            .unwrap();
        e.backward(false).unwrap();
        e.update(&SgdConfig::default(), 1.0).unwrap();
    }
    e.params().unwrap()
}

#[test]
fn bit_identical_runs() {
    for threads in [1, 2] {
        let a = train(threads, 12);
        let b = train(threads, 12);
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{threads} threads differ");
    }
}

#[test]
fn buckets_can_be_reduced_concurrently_with_backward() {
    let spec = ModelSpec::parse("tiny").unwrap();
    let data = SyntheticConfig { train: 16, test: 16, dim: 32, classes: 8 }.generate(1);
    let mut mlp = Mlp::new(Cpu::new(1).unwrap(), spec, 3).unwrap();
    mlp.forward(&data.train.x, &data.train.y, true).unwrap();
    let plan = BucketPlan::with_cap(mlp.layout(), 300);
    assert!(plan.buckets.len() > 1);
    let mut reference = vec![0.0; mlp.layout().len];
    let mut sums = vec![0.0f64; plan.buckets.len()];
    {
        let m = &mut mlp;
        std::thread::scope(|s| {
            let (tx, rx) = std::sync::mpsc::channel::<(usize, &mut [f32])>();
            let worker = s.spawn(move || {
                let mut out = Vec::new();
                for (i, view) in rx {
                    out.push((i, view.iter().map(|&v| f64::from(v)).sum::<f64>()));
                    view.iter_mut().for_each(|v| *v *= 2.0);
                }
                out
            });
            m.backward(&plan, false, &mut |i, _, view| tx.send((i, view)).unwrap()).unwrap();
            drop(tx);
            for (i, s) in worker.join().unwrap() {
                sums[i] = s;
            }
        });
    }
    mlp.read_grads(0..reference.len(), &mut reference).unwrap();
    for (b, s) in plan.buckets.iter().zip(&sums) {
        let doubled: f64 = reference[b.clone()].iter().map(|&v| f64::from(v)).sum();
        assert!((doubled - 2.0 * s).abs() < 1e-4, "bucket {b:?}: the other thread's writes were lost");
    }
}
