//! What the worker's process tests share: the `gradsync-server` binary they start.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// This package's worker binary; the server is built beside it.
const WORKER: &str = env!("CARGO_BIN_EXE_gradsync-worker");

/// `gradsync-server`, built into the same target directory as this test (cargo sets
/// CARGO_BIN_EXE_* only for the package's own binaries). Building first keeps it fresh; the
/// build names both packages so it resolves the same features as this test's build (the
/// server is a dev-dependency for that reason) and is a no-op when nothing changed. Set
/// GRADSYNC_SERVER_BIN to use another binary.
pub fn server_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Ok(p) = std::env::var("GRADSYNC_SERVER_BIN") {
            return PathBuf::from(p);
        }
        let dir = Path::new(WORKER).parent().expect("worker binary has a directory").to_path_buf();
        let bin = dir.join("gradsync-server");
        if fresh(&bin, &dir.join("deps")) {
            return bin;
        }
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "-q", "-p", "gradsync-server", "-p", "gradsync-worker", "--bins"]);
        // Cargo gives this test its package's variables; build scripts that watch them (ring
        // watches CARGO_PKG_NAME and CARGO_MANIFEST_DIR) would then rerun, and the next
        // `cargo nextest` would rebuild everything after them again.
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy();
            if ["CARGO_PKG_", "CARGO_MANIFEST_", "CARGO_CRATE_", "CARGO_PRIMARY_PACKAGE"]
                .iter()
                .any(|p| k.starts_with(p))
            {
                cmd.env_remove(k.as_ref());
            }
        }
        if dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("running cargo build for gradsync-server");
        assert!(status.success(), "building gradsync-server failed");
        assert!(bin.exists(), "{} missing after the build", bin.display());
        bin
    })
    .clone()
}

/// Whether `bin` is at least as new as the server library this test was built against (the
/// dev-dependency rebuilds that library whenever the server's sources change).
fn fresh(bin: &Path, deps: &Path) -> bool {
    let mtime = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let newest_lib = std::fs::read_dir(deps)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with("libgradsync_server-") && name.ends_with(".rlib")
        })
        .filter_map(|e| mtime(&e.path()))
        .max();
    matches!((mtime(bin), newest_lib), (Some(b), Some(l)) if b >= l)
}
