//! NVRTC (`libnvrtc.so.13`) and ptxas from NVIDIA's wheels on PyPI (`nvidia-cuda-nvrtc`,
//! `nvidia-cuda-nvcc`), installed with pip into a cache folder the first time a test needs
//! them, so that a fresh clone's `cargo nextest run --workspace` compiles the real kernels; and
//! a virtual environment with PyTorch, for the tests that check gradsync's models against it.
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

/// `$XDG_CACHE_HOME/gradsync`, else `~/.cache/gradsync`.
fn cache_base() -> Result<PathBuf, Error> {
    let base = match std::env::var_os("XDG_CACHE_HOME") {
        Some(x) if !x.is_empty() => PathBuf::from(x),
        _ => PathBuf::from(std::env::var_os("HOME").ok_or_else(|| Error::Tools("HOME is not set".into()))?)
            .join(".cache"),
    };
    Ok(base.join("gradsync"))
}

fn cache_root() -> Result<PathBuf, Error> {
    if let Some(p) = std::env::var_os("GRADSYNC_CUDA_TOOLS") {
        return Ok(PathBuf::from(p));
    }
    Ok(cache_base()?.join("cuda-13"))
}

/// Run `install` into a temporary folder beside `root` and rename it to `root` once it
/// succeeded and `complete` holds, under a file lock so that concurrent test processes install
/// once; at once when `complete` already holds.
fn install_once(
    root: &Path,
    complete: &dyn Fn() -> bool,
    install: &dyn Fn(&Path) -> Result<(), Error>,
) -> Result<(), Error> {
    if complete() {
        return Ok(());
    }
    let parent = root.parent().ok_or_else(|| Error::Tools(format!("{} has no parent", root.display())))?;
    std::fs::create_dir_all(parent)
        .map_err(|e| Error::Tools(format!("cannot create {}: {e}", parent.display())))?;
    let name = root.file_name().map_or_else(|| "tools".into(), |n| n.to_string_lossy().into_owned());
    let lock_path = parent.join(format!(".{name}.lock"));
    let lock = File::create(&lock_path)
        .map_err(|e| Error::Tools(format!("cannot create {}: {e}", lock_path.display())))?;
    // SAFETY: flock on a descriptor this function owns; released when `lock` is closed.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(Error::Tools(format!("cannot lock {}", lock_path.display())));
    }
    // Another process may have installed them while this one waited for the lock.
    if complete() {
        return Ok(());
    }
    let partial = parent.join(format!(".{name}.partial.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&partial);
    if let Err(e) = install(&partial) {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(e);
    }
    let _ = std::fs::remove_dir_all(root);
    std::fs::rename(&partial, root).map_err(|e| {
        Error::Tools(format!("cannot move {} into {}: {e}", partial.display(), root.display()))
    })?;
    if complete() {
        Ok(())
    } else {
        Err(Error::Tools(format!(
            "{} is incomplete after installing (did a package's layout change?)",
            root.display()
        )))
    }
}

/// Run `cmd`; an error with its last line of stderr when it fails.
fn run(mut cmd: Command, what: &str) -> Result<(), Error> {
    let out = cmd.output().map_err(|e| Error::Tools(format!("cannot run {what}: {e}")))?;
    if out.status.success() {
        return Ok(());
    }
    let why = String::from_utf8_lossy(&out.stderr);
    let last = why.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no message");
    Err(Error::Tools(format!("{what} failed ({}): {last}", out.status)))
}

/// NVRTC and ptxas, installed into the cache first when missing.
pub fn tools() -> Result<Tools, Error> {
    let root = cache_root()?;
    let tools = Tools::under(&root);
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    install_once(&root, &|| tools.complete(), &|partial| {
        eprintln!("installing NVRTC and ptxas from PyPI into {} (once)", root.display());
        let mut cmd = Command::new(&python);
        cmd.args([
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
        .arg(partial)
        .args(WHEELS);
        run(cmd, &format!("{python} -m pip install {}", WHEELS.join(" ")))
    })?;
    Ok(tools)
}

/// What the PyTorch reference scripts import.
const TORCH_PACKAGES: [&str; 3] = ["torch", "safetensors", "numpy"];

/// A Python that imports torch and safetensors: `$GRADSYNC_TORCH_PYTHON` when set, else a
/// virtual environment in the cache (`~/.cache/gradsync/torch`), created with PyTorch from
/// PyPI the first time a test needs it (several GB, about a minute).
pub fn torch_python() -> Result<PathBuf, Error> {
    if let Some(p) = std::env::var_os("GRADSYNC_TORCH_PYTHON") {
        return Ok(PathBuf::from(p));
    }
    venv_python("torch", &TORCH_PACKAGES, "import torch, safetensors.torch")
}

/// A Python that imports `kubernetes_validate` (Kubernetes' own schemas, for every release,
/// bundled: it validates offline), in a virtual environment in the cache
/// (`~/.cache/gradsync/kubernetes-validate`), installed from PyPI the first time a test needs it.
pub fn kubernetes_validate_python() -> Result<PathBuf, Error> {
    venv_python("kubernetes-validate", &["kubernetes-validate"], "import kubernetes_validate, yaml")
}

/// The Python of the virtual environment `name` in the cache, made with `packages` from PyPI
/// the first time `import` fails in it.
fn venv_python(name: &str, packages: &[&str], import: &str) -> Result<PathBuf, Error> {
    let root = cache_base()?.join(name);
    let python = root.join("bin").join("python");
    let imports =
        |py: &Path| Command::new(py).args(["-c", import]).output().is_ok_and(|o| o.status.success());
    let base = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    install_once(&root, &|| imports(&python), &|partial| {
        eprintln!("installing {} from PyPI into {} (once)", packages.join(" "), root.display());
        let mut venv = Command::new(&base);
        venv.args(["-m", "venv"]).arg(partial);
        run(venv, &format!("{base} -m venv"))?;
        let mut pip = Command::new(partial.join("bin").join("python"));
        pip.args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--timeout", "60"])
            .args(packages);
        run(pip, &format!("pip install {}", packages.join(" ")))
    })?;
    Ok(python)
}
