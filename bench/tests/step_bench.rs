//! `gradsync-bench step` with `--python`: the PyTorch script is found at run time (never
//! through the folder the binary was built in), and a PyTorch row that cannot be measured
//! fails the run instead of leaving it out with a warning.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A stand-in for a Python with torch: prints `body`'s figures (or fails, for `None`), as
/// `bench/pytorch/step.py` prints its own.
fn fake_python(dir: &Path, figures: Option<&str>) -> PathBuf {
    let path = dir.join("python");
    let body = match figures {
        Some(json) => format!("#!/bin/sh\necho '{json}'\n"),
        None => "#!/bin/sh\necho 'torch: out of memory' >&2\nexit 1\n".to_string(),
    };
    std::fs::write(&path, body).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// `step` on the CPU, tiny model, one short round, from `cwd`.
fn step(cwd: &Path, extra: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gradsync-bench"))
        .args(["step", "--model", "tiny", "--batch", "8", "--threads", "1", "--gpu", "false"])
        .args(["--steps", "2", "--warmup", "0", "--rounds", "1"])
        .args(extra)
        .current_dir(cwd)
        .env_remove("GRADSYNC_PYTORCH_DIR")
        .env_remove("GRADSYNC_PYTHON")
        .output()
        .unwrap()
}

const FIGURES: &str = r#"{"step_ms": 1.0, "forward_ms": 0.3, "backward_ms": 0.5, "update_ms": 0.2}"#;

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
    std::fs::create_dir_all(dir.join("bench/pytorch")).unwrap();
    std::fs::write(dir.join("bench/pytorch/step.py"), "").unwrap();
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
