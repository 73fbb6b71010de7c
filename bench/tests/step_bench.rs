//! `gradsync-bench step` with `--python`: the PyTorch script is found at run time (never
//! through the folder the binary was built in), and a PyTorch row that cannot be measured
//! fails the run instead of leaving it out with a warning.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A stand-in for a Python with torch, serving as `bench/pytorch/step.py` does: one reply line
/// (`figures`) for each request line, or failing at once, for `None`. Each start appends a
/// line to `starts` in `dir`.
fn fake_python(dir: &Path, figures: Option<&str>) -> PathBuf {
    let path = dir.join("python");
    let starts = dir.join("starts");
    let body = match figures {
        Some(json) => format!(
            "#!/bin/sh\necho started >> '{}'\nwhile read -r line; do echo '{json}'; done\n",
            starts.display()
        ),
        None => "#!/bin/sh\necho 'torch: out of memory' >&2\nexit 1\n".to_string(),
    };
    std::fs::write(&path, body).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// `step` on the CPU, tiny model, one short round, from `cwd`; a flag in `extra` replaces its
/// default.
fn step(cwd: &Path, extra: &[&std::ffi::OsStr]) -> Output {
    let mut args: Vec<&std::ffi::OsStr> = Vec::new();
    for [flag, default] in [
        ["--model", "tiny"],
        ["--batch", "8"],
        ["--threads", "1"],
        ["--gpu", "false"],
        ["--steps", "2"],
        ["--warmup", "0"],
        ["--rounds", "1"],
    ] {
        if !extra.contains(&std::ffi::OsStr::new(flag)) {
            args.extend([std::ffi::OsStr::new(flag), std::ffi::OsStr::new(default)]);
        }
    }
    Command::new(env!("CARGO_BIN_EXE_gradsync-bench"))
        .arg("step")
        .args(args)
        .args(extra)
        .current_dir(cwd)
        .env_remove("GRADSYNC_PYTORCH_DIR")
        .env_remove("GRADSYNC_PYTHON")
        .output()
        .unwrap()
}

/// An empty `bench/pytorch/step.py` in `dir`, where the benchmark looks from its working
/// directory (the stand-in Python never reads it).
fn with_script(dir: &Path) {
    std::fs::create_dir_all(dir.join("bench/pytorch")).unwrap();
    std::fs::write(dir.join("bench/pytorch/step.py"), "").unwrap();
}

const FIGURES: &str = r#"{"step_ms": 1.0, "forward_ms": 0.3, "backward_ms": 0.5, "update_ms": 0.2, "tf32": {"matmul": false, "cudnn": false}}"#;

#[test]
fn a_missing_script_with_python_is_an_error_naming_where_it_looked() {
    let dir = gradsync_testkit::Scratch::new("step-no-script");
    let python = fake_python(&dir, Some(FIGURES));
    let out = step(&dir, &["--python".as_ref(), python.as_os_str()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("step.py was not found"), "{stderr}");
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_gradsync-bench")).parent().unwrap();
    for d in [bin_dir.join("pytorch"), dir.join("bench/pytorch")] {
        assert!(stderr.contains(&d.display().to_string()), "{stderr} lacks {}", d.display());
    }
}

#[test]
fn the_working_directorys_scripts_give_the_pytorch_row() {
    let dir = gradsync_testkit::Scratch::new("step-cwd-script");
    with_script(&dir);
    let python = fake_python(&dir, Some(FIGURES));
    let out = step(&dir, &["--python".as_ref(), python.as_os_str()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.lines().any(|l| l.contains("pytorch") && l.contains("1.00")), "{stdout}");
}

#[test]
fn a_pytorch_row_that_fails_fails_the_run() {
    let dir = gradsync_testkit::Scratch::new("step-torch-fails");
    let python = fake_python(&dir, None);
    let out = step(
        &dir,
        &[
            "--python".as_ref(),
            python.as_os_str(),
            "--pytorch-dir".as_ref(),
            concat!(env!("CARGO_MANIFEST_DIR"), "/pytorch").as_ref(),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("PyTorch row tiny batch 8 on cpu") && stderr.contains("out of memory"),
        "{stderr}"
    );
}

#[test]
fn one_pytorch_process_serves_every_row_of_a_device() {
    let dir = gradsync_testkit::Scratch::new("step-one-process");
    with_script(&dir);
    let python = fake_python(&dir, Some(FIGURES));
    let json = dir.join("rows.jsonl");
    let out = step(
        &dir,
        &[
            "--python".as_ref(),
            python.as_os_str(),
            "--batch".as_ref(),
            "4,8".as_ref(),
            "--rounds".as_ref(),
            "2".as_ref(),
            "--json".as_ref(),
            json.as_os_str(),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let starts = std::fs::read_to_string(dir.join("starts")).unwrap();
    assert_eq!(starts.lines().count(), 1, "four PyTorch rows, one process: {starts:?}");
    // Each configuration says what it measured as it finishes, and every row is in the file.
    assert_eq!(stderr.matches("PyTorch 1.00 ms").count(), 2, "{stderr}");
    assert_eq!(std::fs::read_to_string(&json).unwrap().lines().count(), 4);
}

#[test]
fn a_pytorch_row_computed_in_tf32_fails_the_run() {
    let dir = gradsync_testkit::Scratch::new("step-torch-tf32");
    with_script(&dir);
    for (figures, says) in [
        (FIGURES.replace(r#""cudnn": false"#, r#""cudnn": true"#), "TF32 allowed"),
        (FIGURES.replace(r#", "tf32": {"matmul": false, "cudnn": false}"#, ""), "does not say whether TF32"),
    ] {
        let python = fake_python(&dir, Some(&figures));
        let out = step(&dir, &["--python".as_ref(), python.as_os_str()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{figures}: {stderr}");
        assert!(stderr.contains(says), "{stderr}");
    }
}

/// The real script, on the CPU, when a Python with torch is at hand: it answers every request
/// of one process, in FP32.
#[test]
fn the_pytorch_script_serves_requests_in_fp32() {
    let Some(python) = gradsync_testkit::torch_python_or_skip("the_pytorch_script_serves_requests_in_fp32")
    else {
        return;
    };
    let dir = gradsync_testkit::Scratch::new("step-real-script");
    let json = dir.join("rows.jsonl");
    let out = step(
        &dir,
        &[
            "--python".as_ref(),
            python.as_os_str(),
            "--pytorch-dir".as_ref(),
            concat!(env!("CARGO_MANIFEST_DIR"), "/pytorch").as_ref(),
            "--batch".as_ref(),
            "4,8".as_ref(),
            "--json".as_ref(),
            json.as_os_str(),
        ],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows = std::fs::read_to_string(&json).unwrap();
    assert_eq!(rows.lines().filter(|l| l.contains(r#""impl_":"pytorch""#)).count(), 2, "{rows}");
}
