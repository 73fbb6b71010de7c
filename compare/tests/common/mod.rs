//! What the tests of runs on several hosts share: the scenario they cut down, and the check of
//! a run stopped at its target.

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
