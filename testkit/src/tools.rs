//! NVRTC (`libnvrtc.so.13`) and ptxas from NVIDIA's wheels on PyPI (`nvidia-cuda-nvrtc`,
//! `nvidia-cuda-nvcc`), installed with pip into a cache folder the first time a test needs
//! them, so that a fresh clone's `cargo nextest run --workspace` compiles the real kernels.
//!
//! The cache is `$GRADSYNC_CUDA_TOOLS`, else `$XDG_CACHE_HOME/gradsync/cuda-13`, else
//! `~/.cache/gradsync/cuda-13`. Concurrent test processes take a file lock; the wheels go into
//! a temporary folder that is renamed into place only once complete. The Python used is
//! `$PYTHON`, else `python3`.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::Error;

/// The wheels, pinned to one CUDA major version (13, which cudarc's `cuda-13000` expects).
const WHEELS: [&str; 2] = ["nvidia-cuda-nvrtc==13.*", "nvidia-cuda-nvcc==13.*"];

/// Where NVRTC and ptxas are.
#[derive(Debug, Clone)]
pub struct Tools {
    /// The folder holding `libnvrtc.so.13` (and its builtins).
    pub lib_dir: PathBuf,
    /// The ptxas executable.
    pub ptxas: PathBuf,
}

impl Tools {
    fn under(root: &Path) -> Tools {
        let cu = root.join("nvidia").join("cu13");
        Tools { lib_dir: cu.join("lib"), ptxas: cu.join("bin").join("ptxas") }
    }

    fn complete(&self) -> bool {
        self.lib_dir.join("libnvrtc.so.13").is_file() && self.ptxas.is_file()
    }
}

fn cache_root() -> Result<PathBuf, Error> {
    if let Some(p) = std::env::var_os("GRADSYNC_CUDA_TOOLS") {
        return Ok(PathBuf::from(p));
    }
    let base = match std::env::var_os("XDG_CACHE_HOME") {
        Some(x) if !x.is_empty() => PathBuf::from(x),
        _ => PathBuf::from(std::env::var_os("HOME").ok_or_else(|| Error::Tools("HOME is not set".into()))?)
            .join(".cache"),
    };
    Ok(base.join("gradsync").join("cuda-13"))
}

/// NVRTC and ptxas, installed into the cache first when missing.
pub fn tools() -> Result<Tools, Error> {
    let root = cache_root()?;
    let tools = Tools::under(&root);
    if tools.complete() {
        return Ok(tools);
    }
    let parent = root.parent().ok_or_else(|| Error::Tools(format!("{} has no parent", root.display())))?;
    std::fs::create_dir_all(parent)
        .map_err(|e| Error::Tools(format!("cannot create {}: {e}", parent.display())))?;
    let lock_path = parent.join(".cuda-13.lock");
    let lock = File::create(&lock_path)
        .map_err(|e| Error::Tools(format!("cannot create {}: {e}", lock_path.display())))?;
    // SAFETY: flock on a descriptor this function owns; released when `lock` is closed.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(Error::Tools(format!("cannot lock {}", lock_path.display())));
    }
    // Another process may have installed them while this one waited for the lock.
    if tools.complete() {
        return Ok(tools);
    }
    let partial = parent.join(format!(".cuda-13.partial.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&partial);
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    eprintln!("installing NVRTC and ptxas from PyPI into {} (once)", root.display());
    let out = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--timeout",
            "30",
        ])
        .arg("--target")
        .arg(&partial)
        .args(WHEELS)
        .output()
        .map_err(|e| Error::Tools(format!("cannot run {python} -m pip: {e}")))?;
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&partial);
        let why = String::from_utf8_lossy(&out.stderr);
        let last = why.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no message");
        return Err(Error::Tools(format!(
            "pip could not install {} ({}): {last}",
            WHEELS.join(" "),
            out.status
        )));
    }
    let _ = std::fs::remove_dir_all(&root);
    std::fs::rename(&partial, &root)
        .map_err(|e| Error::Tools(format!("cannot move the wheels into {}: {e}", root.display())))?;
    if tools.complete() {
        Ok(tools)
    } else {
        Err(Error::Tools(format!(
            "the wheels in {} lack libnvrtc.so.13 or ptxas (did their layout change?)",
            root.display()
        )))
    }
}
