//! What the tests of runs on several hosts share: the scenario they cut down.

use gradsync_bench::compare::scenario::Scenario;

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
