//! `gradsync-worker train --mode local` as a real process: it learns, saves, loads, refuses a
//! mismatched checkpoint, writes the metrics schema, and rejects bad flags clearly.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use gradsync_testkit::Scratch;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_gradsync-worker");

fn tmp(tag: &str) -> Scratch {
    Scratch::new(&format!("local-{tag}"))
}

fn worker(args: &[&str]) -> Output {
    Command::new(BIN).arg("train").args(args).output().expect("gradsync-worker runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn learns_and_writes_metrics() {
    let d = tmp("learn");
    let metrics = d.join("m.jsonl");
    let o = worker(&[
        "--device",
        "cpu",
        "--threads",
        "1",
        "--model",
        "64-64-10",
        "--data",
        "synthetic:2048:64:10",
        "--batch",
        "32",
        "--steps",
        "120",
        "--eval-every",
        "40",
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["kind"], "header");
    assert_eq!(lines[0]["mode"], "local");
    assert_eq!(lines[0]["widths"], "64-64-10");
    let steps: Vec<&serde_json::Value> = lines.iter().filter(|l| l["kind"] == "step").collect();
    assert_eq!(steps.len(), 120);
    for field in ["forward_ms", "backward_ms", "update_ms", "comm_ms", "wait_ms", "bytes_sent", "samples"] {
        assert!(steps[0].get(field).is_some(), "step record lacks {field}");
    }
    let evals: Vec<f64> = steps.iter().filter_map(|s| s["accuracy"].as_f64()).collect();
    assert_eq!(evals.len(), 3);
    let mean = |s: &[&serde_json::Value]| {
        s.iter().map(|v| v["loss"].as_f64().unwrap()).sum::<f64>() / s.len() as f64
    };
    assert!(mean(&steps[100..]) < 0.5 * mean(&steps[..10]), "loss did not fall");
    assert!(evals[2] > 0.5, "held-out accuracy {evals:?} did not rise well above chance (0.1)");
}

#[test]
fn save_load_and_fingerprint_refusal() {
    let d = tmp("save");
    let ckpt = d.join("p.ckpt");
    let base = [
        "--device",
        "cpu",
        "--threads",
        "1",
        "--model",
        "tiny",
        "--data",
        "synthetic:256:32:8",
        "--batch",
        "16",
    ];
    let o = worker(&[&base[..], &["--steps", "5", "--save", ckpt.to_str().unwrap(), "-q"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let o = worker(&[&base[..], &["--steps", "1", "--load", ckpt.to_str().unwrap(), "-q"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let o = worker(&[&base[..], &["--steps", "1", "--seed", "7", "--load", ckpt.to_str().unwrap()]].concat());
    assert!(!o.status.success());
    assert!(stderr(&o).contains("fingerprint mismatch") && stderr(&o).contains("seed=42"), "{}", stderr(&o));
    std::fs::write(&ckpt, b"garbage").unwrap();
    let o = worker(&[&base[..], &["--steps", "1", "--load", ckpt.to_str().unwrap()]].concat());
    assert!(!o.status.success());
    assert!(stderr(&o).contains("p.ckpt"), "{}", stderr(&o));
}

/// `--steps 0 --save` is the way to write a model's initial weights: the run says what it did
/// and names no loss (there is none: no step was taken), its metrics hold the header alone, and
/// the file holds the weights a run of the same seed starts from (those of one step at
/// learning rate 0).
#[test]
fn zero_steps_write_the_initial_weights_and_say_so() {
    let d = tmp("zero-steps");
    let (init, one, metrics) = (d.join("init.safetensors"), d.join("one.safetensors"), d.join("m.jsonl"));
    let base = [
        "--device",
        "cpu",
        "--threads",
        "1",
        "--model",
        "tiny",
        "--data",
        "synthetic:256:32:8",
        "--batch",
        "16",
    ];
    let o = worker(
        &[
            &base[..],
            &["--steps", "0", "--save", init.to_str().unwrap(), "--metrics", metrics.to_str().unwrap()],
        ]
        .concat(),
    );
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let said = format!("gradsync: 0 steps: wrote the initial weights to {}", init.display());
    assert!(err.contains(&said), "{err}");
    assert!(!err.contains("NaN") && !err.contains("loss"), "{err}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!((&lines[0]["kind"], &lines[0]["extra"]["total_steps"]), (&"header".into(), &0.into()));
    let o =
        worker(&[&base[..], &["--steps", "1", "--lr", "0", "--save", one.to_str().unwrap(), "-q"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let (a, b) =
        (gradsync_core::state_dict::load(&init).unwrap(), gradsync_core::state_dict::load(&one).unwrap());
    assert!(!a.is_empty());
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (name, t) in &a {
        assert_eq!(t.to_f32(), b[name].to_f32(), "{name}");
    }
}

/// A conv net trained on the built-in digits (images), saved as a PyTorch state dict and
/// loaded back: the loaded run starts where the saved one ended (its held-out accuracy).
#[test]
fn a_conv_net_saves_and_loads_a_pytorch_state_dict() {
    let d = tmp("state-dict");
    let path = d.join("cnn8.safetensors");
    let common =
        ["--device", "cpu", "--threads", "1", "--model", "cnn8", "--data", "digits", "--batch", "32"];
    let o = worker(&[&common[..], &["--steps", "60", "--save", path.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let trained = stderr(&o);
    let accuracy = |text: &str| -> f64 {
        let at = text.rfind("accuracy ").expect("a final accuracy");
        text[at + 9..].trim().trim_end_matches('%').parse().expect("a number")
    };
    assert!(accuracy(&trained) > 80.0, "60 steps of cnn8 on digits: {trained}");
    let tensors = gradsync_core::state_dict::load(&path).unwrap();
    assert!(tensors.contains_key("features.1.running_var") && tensors.contains_key("classifier.2.bias"));
    // One step at a rate of zero from the saved state: the same held-out accuracy.
    let o = worker(&[&common[..], &["--steps", "1", "--lr", "0", "--load", path.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let reloaded = stderr(&o);
    assert!((accuracy(&reloaded) - accuracy(&trained)).abs() < 1.0, "saved: {trained}\nloaded: {reloaded}");
}

#[test]
fn bad_flags_are_clear_errors() {
    for (args, needle) in [
        (&["--model", "huge"][..], "unknown preset 'huge'"),
        (&["--model", "10-0-3"][..], "widths must be positive integers"),
        (&["--batch", "0"][..], "must be at least 1"),
        (&["--device", "tpu"][..], "'tpu' (expected auto, cpu, cuda or cuda:N)"),
        (&["--data", "imagenet:/x"][..], "'imagenet:/x'"),
        (&["--data", "mnist:/nonexistent/gs"][..], "/nonexistent/gs: no such directory"),
        (&["--device", "cuda"][..], "CUDA unavailable"),
        (&["--rank", "3", "--world-size", "2"][..], "--rank 3 is not below --world-size 2"),
        (&["--model", "resnet20", "--data", "synthetic:64:20:5"][..], "needs images"),
        (&["--model", "cnn8", "--data", "synthetic:64:1x1x1:5"][..], "does not fit a 1x1 input"),
        (&["--data", "synthetic:64:3x32:5"][..], "must be CxHxW"),
        (
            &["--model", "cnn8", "--data", "digits", "--save", "/tmp/x.ckpt"][..],
            "a path ending in .safetensors",
        ),
        (&["--mode", "ddp", "--sync-bn"][..], "tiny has no batch norm to synchronise"),
        (
            &["--model", "cnn8", "--data", "digits", "--mode", "ddp", "--sync-bn", "--sync-every", "2"][..],
            "needs --sync-every 1",
        ),
        // --sync-bn goes over NCCL as over the TCP backend; NCCL itself needs a GPU.
        (
            &[
                "--model",
                "cnn8",
                "--data",
                "digits",
                "--mode",
                "ddp",
                "--sync-bn",
                "--backend",
                "nccl",
                "--device",
                "cpu",
            ][..],
            "--backend nccl works on GPU memory",
        ),
    ] {
        let model: &[&str] = if args[0] == "--model" { &[] } else { &["--model", "tiny"] };
        let o = worker(&[&["--steps", "1"][..], model, args].concat());
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(stderr(&o).contains(needle), "{args:?}: expected '{needle}' in: {}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"), "{args:?} panicked: {}", stderr(&o));
    }
}

#[test]
fn auto_device_falls_back_with_one_line() {
    let o = worker(&[
        "--model",
        "tiny",
        "--data",
        "synthetic:64:32:8",
        "--batch",
        "16",
        "--steps",
        "1",
        "--device",
        "auto",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    if !err.contains("on cuda") {
        assert_eq!(err.lines().filter(|l| l.contains("using the CPU")).count(), 1, "{err}");
    }
}

#[test]
fn divergence_is_its_own_exit_status_and_names_the_fix() {
    let d = tmp("diverge");
    let metrics = d.join("m.jsonl");
    // The built-in digits at a learning rate no SGD survives.
    let o = worker(&[
        "--device",
        "cpu",
        "--threads",
        "1",
        "--model",
        "64-64-10",
        "--data",
        "digits",
        "--batch",
        "32",
        "--steps",
        "60",
        "--lr",
        "40",
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("diverged at step") && err.contains("--lr 40"), "{err}");
    // Every record written is finite: the diverged step itself is not recorded.
    let text = std::fs::read_to_string(&metrics).unwrap();
    for l in text.lines().skip(1) {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert!(v["loss"].as_f64().is_some_and(f64::is_finite), "{l}");
    }
    // A healthy run of the same data does not trip it, and evaluates on its samples cadence
    // with the evaluation kept off the training clock.
    let o = worker(&[
        "--device",
        "cpu",
        "--threads",
        "1",
        "--model",
        "64-64-10",
        "--data",
        "digits",
        "--batch",
        "32",
        "--steps",
        "40",
        "--eval-samples",
        "320",
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let steps: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let evaluated: Vec<u64> =
        steps.iter().filter(|s| s["accuracy"].is_number()).map(|s| s["step"].as_u64().unwrap()).collect();
    assert_eq!(evaluated, [10, 20, 30, 40], "every 320 samples of batch 32");
    let last = steps.last().unwrap();
    let (wall, train) = (last["wall_ms"].as_f64().unwrap(), last["train_ms"].as_f64().unwrap());
    let eval: f64 = steps.iter().filter_map(|s| s["eval_ms"].as_f64()).sum();
    assert!(eval > 0.0 && train < wall, "train {train} wall {wall} eval {eval}");
    assert!(last["accuracy"].as_f64().unwrap() > 0.5, "the digits are learnable: {last}");
}

#[test]
fn digits_is_built_in_and_takes_no_argument() {
    let o = worker(&["--data", "digits:/tmp", "--steps", "1"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("built in"), "{}", stderr(&o));
}

/// On a GPU the worker names the CUDA libraries it loaded, each with its version, on the line
/// after its start line, and writes the same into the metrics header: cuBLAS and cuBLASLt from
/// one folder. Runs against the fake CUDA where there is no GPU.
#[test]
fn a_gpu_run_names_its_cuda_libraries_in_its_start_line_and_metrics() {
    const TEST: &str = "a_gpu_run_names_its_cuda_libraries_in_its_start_line_and_metrics";
    if !matches!(gradsync_testkit::gpu_test(TEST), gradsync_testkit::GpuRun::Here) {
        return;
    }
    let d = tmp("cuda-libs");
    let metrics = d.join("m.jsonl");
    let o = worker(&[
        "--device",
        "cuda",
        "--model",
        "tiny",
        "--data",
        "synthetic:64:32:8",
        "--steps",
        "2",
        "--eval-every",
        "0",
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("gradsync: CUDA libraries: cuBLAS "))
        .unwrap_or_else(|| panic!("no CUDA libraries line in: {err}"));
    let text = std::fs::read_to_string(&metrics).unwrap();
    let header: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    let libs = &header["cuda_libs"];
    let path = |k: &str| {
        std::path::PathBuf::from(libs[k]["path"].as_str().unwrap_or_else(|| panic!("no {k} in {libs}")))
    };
    assert_eq!(path("cublas").parent(), path("cublas_lt").parent(), "{libs}");
    assert!(libs["cublas"]["version"].is_string() && libs["nvrtc"]["version"].is_string(), "{libs}");
    for k in ["cublas", "cublas_lt", "nvrtc"] {
        assert!(line.contains(&path(k).display().to_string()), "{line} lacks {k}");
    }
}
