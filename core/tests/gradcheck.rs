//! Backward of every layer and of the loss against finite differences, on the CPU device.
//!
//! Single-precision finite differences are noisy element by element, so each parameter tensor
//! is checked through a directional derivative along a random direction: the analytic
//! `grad . d` against `(L(p + eps d) - L(p - eps d)) / 2 eps`. A wrong gradient in any
//! element of the tensor moves that dot product.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use gradsync_core::Engine;
use gradsync_core::device::{Backend, Cpu, Device};
use gradsync_core::model::ModelSpec;
use gradsync_core::rng::Rng;

const EPS: f32 = 1e-2;

fn batch(dim: usize, classes: usize, rows: usize, seed: u64) -> (Vec<f32>, Vec<u32>) {
    let mut r = Rng::new(seed, 1);
    let x = (0..rows * dim).map(|_| r.normal()).collect();
    let y = (0..rows).map(|_| r.below(classes as u64) as u32).collect();
    (x, y)
}

#[test]
fn every_layer_matches_finite_differences() {
    check_every_tensor(&ModelSpec::parse("6-9-7-4").unwrap(), 5);
}

/// The loss in training mode (batch statistics), as backward differentiates it.
fn train_loss_at(engine: &mut Engine, params: &[f32], x: &[f32], y: &[u32]) -> f64 {
    engine.write_params(0, params).unwrap();
    engine.forward(x, y, true).unwrap().loss
}

fn check_every_tensor(spec: &ModelSpec, rows: usize) {
    let (x, y) = batch(spec.input(), spec.classes(), rows, 2);
    check_every_tensor_on(spec, &x, &y);
}

#[test]
fn the_embedding_bag_matches_finite_differences() {
    for pool in ["mean", "sum"] {
        let spec = ModelSpec::parse(&format!("embedding:12:5:7:{pool}")).unwrap();
        let spec = spec.fit(gradsync_core::model::Input::Bag { rows: 12, slots: 4 }, 3).unwrap();
        let mut r = Rng::new(7, 3);
        let x = gradsync_core::data::random_bags(12, 4, 6, &mut r);
        let y: Vec<u32> = (0..6).map(|_| r.below(3) as u32).collect();
        check_every_tensor_on(&spec, &x, &y);
    }
}

fn check_every_tensor_on(spec: &ModelSpec, x: &[f32], y: &[u32]) {
    let (x, y) = (x.to_vec(), y.to_vec());
    let mut engine = Engine::new(Device::Cpu { threads: 1 }, spec.clone(), 11).unwrap();
    engine.forward(&x, &y, true).unwrap();
    engine.backward(false).unwrap();
    let grads = engine.grads().unwrap();
    let p0 = engine.params().unwrap();
    let layout = engine.layout().clone();
    let mut rng = Rng::new(99, 2);
    for t in &layout.params {
        {
            let (name, range) = (&t.name, t.range.clone());
            let d: Vec<f32> = range.clone().map(|_| rng.normal()).collect();
            let analytic: f64 = range.clone().zip(&d).map(|(i, &di)| f64::from(grads[i] * di)).sum();
            let shifted = |sign: f32| {
                let mut p = p0.clone();
                for (i, &di) in range.clone().zip(&d) {
                    p[i] += sign * EPS * di;
                }
                p
            };
            let lp = train_loss_at(&mut engine, &shifted(1.0), &x, &y);
            let lm = train_loss_at(&mut engine, &shifted(-1.0), &x, &y);
            let numeric = (lp - lm) / (2.0 * f64::from(EPS));
            let err = (analytic - numeric).abs() / analytic.abs().max(numeric.abs()).max(1e-3);
            assert!(
                err < 2e-2,
                "{}: {name}: analytic {analytic:.6} numeric {numeric:.6} (rel err {err:.2e})",
                spec.name
            );
        }
    }
}

#[test]
fn loss_gradient_matches_finite_differences() {
    let cpu = Cpu::new(1).unwrap();
    let (rows, cols) = (3, 5);
    let mut r = Rng::new(5, 5);
    let logits: Vec<f32> = (0..rows * cols).map(|_| 2.0 * r.normal()).collect();
    let labels = Some(vec![0u32, 4, 2]);
    let labels = labels.as_ref().unwrap();
    let mut d = vec![0.0f32; rows * cols];
    let (loss, _) = cpu.softmax_xent(&logits, labels, Some(&mut d), rows, cols, 1.0 / rows as f32).unwrap();
    assert!(loss > 0.0);
    for i in 0..rows * cols {
        let at = |delta: f32| {
            let mut z = logits.clone();
            z[i] += delta;
            cpu.softmax_xent(&z, labels, None, rows, cols, 1.0).unwrap().0 / rows as f64
        };
        let numeric = (at(1e-2) - at(-1e-2)) / 2e-2;
        assert!((numeric - f64::from(d[i])).abs() < 2e-4, "logit {i}: analytic {} numeric {numeric}", d[i]);
    }
}

#[test]
fn accumulate_adds_gradients() {
    let spec = ModelSpec::parse("tiny").unwrap();
    let mut engine = Engine::new(Device::Cpu { threads: 1 }, spec, 1).unwrap();
    let (x, y) = batch(32, 8, 8, 3);
    engine.forward(&x, &y, true).unwrap();
    engine.backward(false).unwrap();
    let once = engine.grads().unwrap();
    engine.forward(&x, &y, true).unwrap();
    engine.backward(true).unwrap();
    let twice = engine.grads().unwrap();
    for (a, b) in once.iter().zip(&twice) {
        assert!((2.0 * a - b).abs() <= 1e-6 * (1.0 + a.abs()), "{a} doubled is not {b}");
    }
}

/// The embedding model's flags and fitting: rows fitted to the data unless given, a table
/// smaller than the data's ids refused by name, dense data refused, and dense models refusing
/// bags.
#[test]
fn the_embedding_model_fits_the_data_or_says_why_not() {
    use gradsync_core::model::{Input, Layout};
    let bags = Input::Bag { rows: 1000, slots: 7 };
    let fitted = ModelSpec::parse("embedding").unwrap().fit(bags, 2).unwrap();
    assert_eq!(fitted.table(), Some((1000, 16)));
    let layout = Layout::new(&fitted);
    assert_eq!(layout.params[0].name, "embedding.weight");
    assert_eq!(layout.len, 1000 * 16 + 16 * 64 + 64 + 64 * 2 + 2);
    assert_eq!(ModelSpec::from_token(&fitted.widths_str()).unwrap(), fitted);
    let given = ModelSpec::parse("embedding:5000:8:32:16:sum").unwrap().fit(bags, 3).unwrap();
    assert_eq!(given.table(), Some((5000, 8)));
    assert_eq!(given.widths_str(), "embedding:5000:8:32:16:sum/7-3");
    assert_eq!(given.label(), "embedding 5000x8 (sum of up to 7 ids, 3 classes)");
    let small = ModelSpec::parse("embedding:10:4").unwrap().fit(bags, 2).unwrap_err().to_string();
    assert!(small.contains("run to 1000, past the 10 rows"), "{small}");
    let flat = ModelSpec::parse("embedding").unwrap().fit(Input::Flat(8), 2).unwrap_err().to_string();
    assert!(flat.contains("needs id data"), "{flat}");
    let mlp = ModelSpec::parse("tiny").unwrap().fit(bags, 2).unwrap_err().to_string();
    assert!(mlp.contains("bags of ids"), "{mlp}");
    for bad in ["embedding:10", "embedding:0:4", "embedding:10:x", "embedding:99999999:4"] {
        assert!(ModelSpec::parse(bad).is_err(), "{bad}");
    }
}
