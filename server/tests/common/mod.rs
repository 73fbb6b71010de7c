//! What the server's integration tests share: this package's `gradsync-server`, started
//! through the test kit and waited for through its `listening on` line.

use std::process::{Command, Stdio};

#[allow(unused_imports)] // each test binary uses its own subset of this module
pub use gradsync_testkit::process::{Proc, python_has};

/// Start `gradsync-server` with `args` (stderr discarded) and wait for its `listening on`
/// line: the process and its address.
pub fn start_server(args: &[&std::ffi::OsStr]) -> (Proc, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gradsync-server"));
    cmd.args(args).stderr(Stdio::null());
    spawn_server(cmd)
}

/// Spawn `cmd` (a `gradsync-server` command, stderr as it was set) and wait for its
/// `listening on` line: the process and its address.
#[allow(dead_code)] // each test binary uses its own subset of this module
pub fn spawn_server(mut cmd: Command) -> (Proc, String) {
    gradsync_testkit::process::start_server(&mut cmd, false)
}
