//! What a run shows while it trains: a progress bar on a terminal, a log line every few
//! steps otherwise, silent off rank 0; its opening lines (the model, the device, a replay's
//! source) and its closing line, with the `Summary` a finished run reports.

use std::io::IsTerminal;
use std::path::Path;

use gradsync_core::Engine;
use gradsync_core::metrics::Step;
use indicatif::{ProgressBar, ProgressStyle};

/// What a finished run reports.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// The steps the model has taken (a resumed run's count from the run's beginning).
    pub steps: u64,
    /// The steps this process took: fewer than `steps` when resumed, none under `--steps 0`.
    pub taken: u64,
    /// Mean training loss of the run's first step (a resumed run's, from its checkpoint);
    /// `None` before any step.
    pub first_loss: Option<f64>,
    /// Mean training loss of the last step; `None` when this process took none.
    pub last_loss: Option<f64>,
    /// Held-out loss and accuracy at the end (rank 0).
    pub eval: Option<(f64, f64)>,
    /// Wall-clock seconds of the training loop (under `--dilate`, the emulated world's).
    pub seconds: f64,
    /// The run's time-dilation factor (1: none).
    pub dilation: f64,
}

/// A progress bar on a terminal, a log line every few steps otherwise; silent off rank 0.
pub(super) struct Progress {
    bar: Option<ProgressBar>,
    enabled: bool,
    every: u64,
    /// Whether the model is replayed (no loss to show).
    replay: bool,
}

impl Progress {
    /// Shown when `enabled` (rank 0, not `--quiet`): the opening lines for `engine`, then a bar
    /// of `total` steps of `batch` samples each.
    pub fn new(enabled: bool, total: u64, engine: &Engine, batch: usize) -> Self {
        let replay = engine.spec().profile();
        if enabled {
            eprintln!(
                "gradsync: {} parameters on {}, {} steps",
                engine.layout().len,
                engine.describe(),
                total
            );
            if let Some(p) = replay {
                let (forward, backward) = p.step_ms(batch);
                let how = if p.estimated_at(batch) { "estimated" } else { "measured" };
                eprintln!(
                    "gradsync: replay of {} ({}): speed only, no accuracy; compute {how} at {forward:.2} ms forward + \
                     {backward:.2} ms backward per step of {batch} samples ({}{})",
                    p.model,
                    p.source,
                    p.device,
                    if batch == p.batch { String::new() } else { format!(", scaled from batch {}", p.batch) },
                );
            }
            if let Some(libs) =
                engine.gpu_name().is_some().then(gradsync_core::device::libs::loaded).flatten()
            {
                eprintln!("gradsync: CUDA libraries: {libs}");
            }
        }
        let bar = (enabled && std::io::stderr().is_terminal()).then(|| {
            let b = ProgressBar::new(total);
            b.set_style(
                ProgressStyle::with_template("{bar:40} {pos}/{len} steps {per_sec} eta {eta} {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b
        });
        Progress { bar, enabled, every: (total / 20).max(1), replay: replay.is_some() }
    }

    /// After each step: the bar moved, or a line every twentieth of the run and at each
    /// evaluation.
    pub fn step(&self, rec: &Step) {
        let acc = rec.accuracy.map(|a| format!(" eval acc {:.1}%", 100.0 * a)).unwrap_or_default();
        let loss = if self.replay { "replay".to_string() } else { format!("loss {:.4}", rec.loss) };
        if let Some(b) = &self.bar {
            b.set_position(rec.step);
            b.set_message(format!("{loss}{acc}"));
        } else if self.enabled && (rec.step.is_multiple_of(self.every) || rec.accuracy.is_some()) {
            eprintln!(
                "step {:>6}  epoch {:>3}  {loss}  {:.1} ms/step{acc}",
                rec.step, rec.epoch, rec.step_ms
            );
        }
    }

    /// A line between the steps' (above the bar on a terminal).
    pub fn note(&self, msg: &str) {
        if let Some(b) = &self.bar {
            b.println(format!("gradsync: {msg}"));
        } else if self.enabled {
            eprintln!("gradsync: {msg}");
        }
    }

    /// The closing line, after the model was saved to `saved` (rank 0's `--save`).
    pub fn finish(&self, s: &Summary, saved: Option<&Path>) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
        if self.enabled {
            eprintln!("gradsync: {}", closing_line(s, self.replay, saved));
        }
    }
}

/// What a run did, in one line: its steps, time, loss and held-out result; a run that took no
/// step (`--steps 0`, the way to write a model's initial weights, or one resumed at its last
/// step) says so and what it wrote, and names no loss.
fn closing_line(s: &Summary, replay: bool, saved: Option<&Path>) -> String {
    let mut took = gradsync_core::metrics::elapsed(s.seconds);
    if s.dilation > 1.0 {
        took += &format!(" (dilated x{}: the emulated world's time)", s.dilation);
    }
    if s.taken == 0 {
        return match (s.steps, saved) {
            (0, Some(p)) => format!("0 steps: wrote the initial weights to {}", p.display()),
            (0, None) => "0 steps: nothing trained".into(),
            (n, Some(p)) => {
                format!("0 steps (resumed after step {n}, the last): wrote its weights to {}", p.display())
            }
            (n, None) => format!("0 steps (resumed after step {n}, the last): nothing left to train"),
        };
    }
    if replay {
        return format!("{} steps in {took} (replay: speed only, no accuracy)", s.steps);
    }
    let eval = s
        .eval
        .map(|(l, a)| format!(", held-out loss {l:.4}, accuracy {:.2}%", 100.0 * a))
        .unwrap_or_default();
    let loss = |l: Option<f64>| l.map_or("-".into(), |l| format!("{l:.4}"));
    format!("{} steps in {took}, loss {} -> {}{eval}", s.steps, loss(s.first_loss), loss(s.last_loss))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(steps: u64, taken: u64, loss: Option<(f64, f64)>) -> Summary {
        Summary {
            steps,
            taken,
            first_loss: loss.map(|l| l.0),
            last_loss: loss.map(|l| l.1),
            eval: None,
            seconds: 0.5,
            dilation: 1.0,
        }
    }

    #[test]
    fn a_run_of_no_steps_says_what_it_wrote_and_names_no_loss() {
        let saved = Path::new("init.safetensors");
        let line = closing_line(&summary(0, 0, None), false, Some(saved));
        assert_eq!(line, "0 steps: wrote the initial weights to init.safetensors");
        assert_eq!(closing_line(&summary(0, 0, None), false, None), "0 steps: nothing trained");
        let resumed = closing_line(&summary(40, 0, Some((2.3, 0.4))), false, Some(saved));
        assert_eq!(
            resumed,
            "0 steps (resumed after step 40, the last): wrote its weights to init.safetensors"
        );
        let nothing = closing_line(&summary(40, 0, None), true, None);
        assert_eq!(nothing, "0 steps (resumed after step 40, the last): nothing left to train");
    }

    #[test]
    fn a_run_of_steps_names_its_first_and_last_loss() {
        let line = closing_line(&summary(3, 3, Some((2.25, 1.5))), false, None);
        assert!(line.starts_with("3 steps in ") && line.ends_with(", loss 2.2500 -> 1.5000"), "{line}");
        let replay = closing_line(&summary(3, 3, Some((2.25, 1.5))), true, None);
        assert!(replay.ends_with("(replay: speed only, no accuracy)"), "{replay}");
    }
}
