//! Where the PyTorch scripts (`bench/pytorch/*.py`) are, found when the benchmark runs: a
//! binary built in one folder and run from another (`scripts/gpu-build.sh` copies the scripts
//! into `.gpu/bin/pytorch/`) finds them as well as `cargo run` in the repository does.
//!
//! The search, first match wins: `--pytorch-dir` (or `GRADSYNC_PYTORCH_DIR`) when given, and
//! then nowhere else; otherwise beside the binary (`pytorch/`, the binary's own folder,
//! `../share/gradsync/pytorch/`), then the working directory's `bench/pytorch/`.

use std::path::{Path, PathBuf};

/// A script that is in none of the places looked at.
#[derive(Debug, thiserror::Error)]
#[error(
    "the PyTorch script {name} was not found; looked in {} (pass --pytorch-dir DIR, or keep \
     bench/pytorch beside the binary as pytorch/: scripts/gpu-build.sh copies it there)",
    looked.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
)]
pub struct NotFound {
    /// The script's file name.
    pub name: String,
    /// Every folder looked in, in order.
    pub looked: Vec<PathBuf>,
}

/// The folders to look in for the scripts, in order: `explicit` alone when given; else the
/// ones beside `exe`, then `cwd/bench/pytorch`.
pub fn search_dirs(explicit: Option<&Path>, exe: Option<&Path>, cwd: Option<&Path>) -> Vec<PathBuf> {
    if let Some(dir) = explicit {
        return vec![dir.to_path_buf()];
    }
    let mut dirs = Vec::new();
    if let Some(bin) = exe.and_then(Path::parent) {
        dirs.push(bin.join("pytorch"));
        dirs.push(bin.to_path_buf());
        dirs.push(bin.join("..").join("share").join("gradsync").join("pytorch"));
    }
    if let Some(cwd) = cwd {
        dirs.push(cwd.join("bench").join("pytorch"));
    }
    dirs
}

/// The first of `dirs` holding `name`.
pub fn find_in(name: &str, dirs: &[PathBuf]) -> Result<PathBuf, NotFound> {
    dirs.iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| NotFound { name: name.to_string(), looked: dirs.to_vec() })
}

/// The model flags of the PyTorch scripts (`step.py`, `reference.py`) for `spec`: an MLP's
/// widths, or a preset of `models.py` with its input shape and classes.
pub fn model_args(spec: &gradsync_core::model::ModelSpec) -> Vec<String> {
    match spec.input {
        gradsync_core::model::Input::Image { channels, height, width } if !spec.is_mlp() => {
            let mut args = vec!["--model".to_string(), spec.name.clone()];
            for (flag, v) in [
                ("--in-channels", channels),
                ("--height", height),
                ("--width", width),
                ("--classes", spec.classes),
            ] {
                args.extend([flag.to_string(), v.to_string()]);
            }
            args
        }
        _ => vec!["--widths".to_string(), spec.widths_str()],
    }
}

/// The script `name` (`step.py`, `allreduce.py`), searched for from this process: beside the
/// running binary and in the working directory, or in `explicit` alone.
pub fn find(name: &str, explicit: Option<&Path>) -> Result<PathBuf, NotFound> {
    let exe = std::env::current_exe().ok();
    let cwd = std::env::current_dir().ok();
    find_in(name, &search_dirs(explicit, exe.as_deref(), cwd.as_deref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_folder_beside_the_binary_comes_before_the_working_directory() {
        let root = gradsync_testkit::Scratch::new("pytorch-dirs");
        let (bin, cwd) = (root.join("opt/bin"), root.join("work"));
        let exe = bin.join("gradsync-bench");
        for d in [bin.join("pytorch"), cwd.join("bench/pytorch")] {
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("step.py"), "").unwrap();
        }
        let dirs = search_dirs(None, Some(&exe), Some(&cwd));
        assert_eq!(find_in("step.py", &dirs).unwrap(), bin.join("pytorch/step.py"));
        std::fs::remove_file(bin.join("pytorch/step.py")).unwrap();
        assert_eq!(find_in("step.py", &dirs).unwrap(), cwd.join("bench/pytorch/step.py"));
        std::fs::create_dir_all(root.join("opt/share/gradsync/pytorch")).unwrap();
        std::fs::write(root.join("opt/share/gradsync/pytorch/step.py"), "").unwrap();
        let found = find_in("step.py", &dirs).unwrap();
        assert_eq!(found.canonicalize().unwrap(), root.join("opt/share/gradsync/pytorch/step.py"));
    }

    #[test]
    fn a_missing_script_names_every_folder_looked_in() {
        let root = gradsync_testkit::Scratch::new("pytorch-missing");
        let exe = root.join("bin/gradsync-bench");
        let e = find_in("allreduce.py", &search_dirs(None, Some(&exe), Some(&root))).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("allreduce.py") && msg.contains("--pytorch-dir"), "{msg}");
        for d in [root.join("bin/pytorch"), root.join("bench/pytorch")] {
            assert!(msg.contains(&d.display().to_string()), "{msg} lacks {}", d.display());
        }
        // An explicit folder is the only place looked in.
        let e =
            find_in("step.py", &search_dirs(Some(&root.join("mine")), Some(&exe), Some(&root))).unwrap_err();
        assert_eq!(e.looked, vec![root.join("mine")]);
    }
}
