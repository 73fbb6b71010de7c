//! Replay's tools as real processes: `bench/pytorch/profile_model.py` measures a small PyTorch
//! module into a profile gradsync reads and replays (when a Python with torch is at hand;
//! SKIPPED otherwise, failing under CI), and `gradsync-bench replay show` writes a built-in's
//! profile that reads back as the same model.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::Command;

use gradsync_core::model::ModelSpec;
use gradsync_core::profile::Profile;

const BENCH: &str = env!("CARGO_BIN_EXE_gradsync-bench");

fn script() -> PathBuf {
    std::env::var_os("GRADSYNC_PYTORCH_DIR")
        .map_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/pytorch")), PathBuf::from)
        .join("profile_model.py")
}

/// A conv net and two linear layers, the second layer's input a functional ReLU's output.
const MODULE: &str = r#"
import torch.nn as nn
class Net(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8 * 8 * 8, width)
        self.fc2 = nn.Linear(width, 10)
    def forward(self, x):
        x = self.bn(self.conv(x)).relu().flatten(1)
        return self.fc2(self.fc1(x).relu())
"#;

#[test]
fn a_measured_pytorch_module_replays() {
    const TEST: &str = "a_measured_pytorch_module_replays";
    let Some(python) = gradsync_testkit::torch_python_or_skip(TEST) else { return };
    let dir = gradsync_testkit::Scratch::new("profile-model");
    let module = dir.join("net.py");
    std::fs::write(&module, MODULE).unwrap();
    let out_path = dir.join("net.json");
    let out = Command::new(&python)
        .arg(script())
        .arg(format!("{}:Net", module.display()))
        .args(["--kwargs", r#"{"width": 32}"#, "--input", "3x8x8", "--batch", "16", "--device", "cpu"])
        .args(["--steps", "3", "--warmup", "1", "--out"])
        .arg(&out_path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let p = Profile::load(&out_path).unwrap();
    assert!(!p.estimated);
    assert_eq!(p.batch, 16);
    assert_eq!(p.model, "Net");
    assert_eq!(p.parameters(), 8 * 3 * 9 + 8 + 16 + 512 * 32 + 32 + 32 * 10 + 10);
    // PyTorch's backward order: the last layer's bias, then its weight; a norm's weight first.
    let order: Vec<&str> = p.layers.iter().flat_map(|l| &l.tensors).map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        order,
        [
            "fc2.bias",
            "fc2.weight",
            "fc1.bias",
            "fc1.weight",
            "bn.weight",
            "bn.bias",
            "conv.weight",
            "conv.bias"
        ]
    );
    let names: Vec<&str> = p.layers.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["fc2", "fc1", "bn", "conv", "(backward tail)", "(forward, other)"]);
    let (f, b) = p.compute_ns();
    assert!(f > 0 && b > 0 && p.optimizer_ns > 0, "{p:?}");

    // gradsync replays it.
    let worker = gradsync_testkit::process::binary("gradsync-worker");
    let model = format!("profile:{}", out_path.display());
    let run = Command::new(worker)
        .args(["train", "--model", &model, "--steps", "3", "--device", "cpu"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{err}");
    assert!(err.contains("replay of Net") && err.contains("measured"), "{err}");
}

#[test]
fn a_builtins_profile_file_reads_back_as_the_same_model() {
    let dir = gradsync_testkit::Scratch::new("replay-show");
    for name in ["resnet50", "gpt2"] {
        let path = dir.join(format!("{name}.json"));
        let out = Command::new(BENCH)
            .args(["replay", "show", name, "--device-tflops", "100", "--out"])
            .arg(&path)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(text.contains("bytes ready") && text.contains("estimated"), "{text}");
        let read = Profile::load(&path).unwrap();
        let builtin = ModelSpec::parse(name)
            .unwrap()
            .at_rate(gradsync_core::profile::DeviceRate { tflops: 100.0, tbps: 3.35 })
            .unwrap();
        let want = builtin.profile().unwrap();
        assert_eq!(read.layout_tag(), want.layout_tag(), "{name}");
        // Times pass through milliseconds in the file: within a nanosecond each.
        for (a, b) in read.layers.iter().zip(&want.layers) {
            assert!(a.backward_ns.abs_diff(b.backward_ns) <= 1, "{name} {}", a.name);
        }
    }
    let out = Command::new(BENCH).args(["replay", "show", "mnist"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("trained for real"));
}

/// A run whose processes would not fit in memory (64 DDP ranks of VGG-16: 141 GB) is skipped
/// before it starts, with the figures; the rest of the matrix runs.
#[test]
fn a_run_too_large_for_memory_is_skipped_with_the_figures() {
    let dir = gradsync_testkit::Scratch::new("replay-memory");
    let scenario = dir.join("s.toml");
    std::fs::write(
        &scenario,
        "name='mem'\nmodes=['local','ddp-tcp']\nworkers=[64]\nmodels=['vgg16']\nsteps=1\nrepeats=1\n\
         device='cpu'\nrawtcp_s=0.2\nrun_timeout_s=60\n",
    )
    .unwrap();
    let out = dir.join("out");
    let run = Command::new(BENCH).arg("compare").arg(&scenario).arg("--out").arg(&out).output().unwrap();
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{err}");
    let outcomes = std::fs::read_to_string(out.join("outcomes.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = outcomes.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2, "{outcomes}");
    let ddp = lines.iter().find(|o| o["id"].as_str().unwrap().contains("ddp-tcp")).unwrap();
    assert_eq!(ddp["status"], "skipped", "{ddp}");
    let why = ddp["error"].as_str().unwrap();
    assert!(
        why.contains("needs about 131.9 GiB (64 processes of 553 MB") && why.contains("is available"),
        "{why}"
    );
}

/// `replay honesty --dilate`: gradsync's own model trained for real and replayed from the
/// profile it records, both on an emulated cluster in dilated time (needs root and iproute2;
/// SKIPPED otherwise), each mode's row with the real run's and the replay's figures.
#[test]
fn the_honesty_check_runs_both_sides_dilated_on_emulated_links() {
    const TEST: &str = "the_honesty_check_runs_both_sides_dilated_on_emulated_links";
    let dir = gradsync_testkit::Scratch::new("honesty-dilated");
    let out = dir.join("out");
    let o = Command::new(BENCH)
        .args(["replay", "honesty", "--model", "tiny", "--batch", "16", "--workers", "2", "--steps", "4"])
        .args(["--repeats", "1", "--modes", "ddp-tcp", "--dilate", "2", "--rate-gbit", "1", "--out"])
        .arg(&out)
        .env("GRADSYNC_BIN_DIR", gradsync_testkit::process::bin_dir())
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{stdout}\n{stderr}");
    if stdout.contains("SKIPPED") {
        eprintln!("SKIPPED {TEST}: {stdout}{stderr}");
        return;
    }
    assert!(stdout.contains("on emulated 1 Gbit/s links, both sides dilated x2"), "{stdout}");
    let row = stdout.lines().find(|l| l.contains("| ddp-tcp |")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(!row.contains("no complete run"), "{stdout}\n{stderr}");
    // Both sides' step times are figures, and every run (the check's at 2D too) was dilated.
    let figures: Vec<f64> = row.split('|').filter_map(|w| w.trim().parse().ok()).collect();
    assert!(figures.len() >= 6 && figures.iter().all(|f| *f > 0.0), "{row}");
    let cluster = std::fs::read_to_string(out.join("compare/cluster.json")).unwrap();
    assert!(cluster.contains("\"dilation\": 2.0") && !cluster.contains("\"dilation\": 1.0"), "{cluster}");
}
