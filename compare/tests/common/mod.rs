//! What the tests of runs on several hosts share: the scenario they cut down, the check of a
//! run stopped at its target, and a tiny replayed model's profile.

use std::path::Path;

use gradsync_compare::scenario::Scenario;

/// The default scenario cut down to the tiny model at a global batch of 32 for `steps` steps:
/// one repeat, no evaluation, no target, two minutes at most per run.
pub fn small_scenario(steps: u64) -> Scenario {
    let mut s = Scenario::load(None).expect("the built-in scenario");
    s.models = vec!["tiny".into()];
    s.batches = vec![32];
    (s.steps, s.epochs) = (Some(steps), None);
    (s.repeats, s.eval_samples, s.target_accuracy) = (1, None, None);
    s.run_timeout_s = 120.0;
    s
}

/// Assert that rank 0's metrics (`rank0.jsonl` in the run folder `run`) show a run stopped by
/// its target: some steps, fewer than `budget`, and a held-out accuracy of at least `target`.
/// Returns the steps and the best accuracy.
#[allow(dead_code, clippy::unwrap_used)] // not every test file sharing this module stops at targets
pub fn stopped_at_target(run: &Path, budget: usize, target: f64) -> (usize, f64) {
    let text = std::fs::read_to_string(run.join("rank0.jsonl")).unwrap();
    let steps: Vec<serde_json::Value> = text
        .lines()
        .filter(|l| l.contains("\"kind\":\"step\""))
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert!(!steps.is_empty() && steps.len() < budget, "{} steps of a budget of {budget}", steps.len());
    let best = steps.iter().filter_map(|s| s["accuracy"].as_f64()).fold(0.0, f64::max);
    assert!(best >= target, "stopped before the target: {best}");
    (steps.len(), best)
}

/// A profile of a tiny model (1.06 M parameters, 4.2 MB of gradients; forward 1 ms and
/// backward 2 ms at batch 16, the whole update `update_ms`) written into `dir`, as `--model`
/// names it (`profile:PATH`): at the same path on every host where the hosts share this
/// machine's file system.
#[allow(dead_code, clippy::unwrap_used)] // not every test file sharing this module replays
pub fn tiny_profile(dir: &Path, update_ms: f64) -> String {
    let path = dir.join("tiny-profile.json");
    let profile = serde_json::json!({
        "format": gradsync_core::profile::FORMAT, "version": gradsync_core::profile::VERSION,
        "model": "tiny", "batch": 16, "device": "a test", "estimated": false, "optimizer_ms": update_ms,
        "layers": [
            {"name": "fc2", "forward_ms": 0.5, "backward_ms": 1.0,
             "tensors": [{"name": "fc2.bias", "shape": [10]}, {"name": "fc2.weight", "shape": [10, 1024]}]},
            {"name": "fc1", "forward_ms": 0.5, "backward_ms": 1.0,
             "tensors": [{"name": "fc1.weight", "shape": [1024, 1024]}]}
        ]
    });
    std::fs::write(&path, profile.to_string()).unwrap();
    format!("profile:{}", path.display())
}
