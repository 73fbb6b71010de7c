//! What the server's integration tests share: a `gradsync-server` child that is killed on
//! drop, started and waited for through its `listening on` line.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A child process killed (and reaped) on drop.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Start `gradsync-server` with `args` and wait for its `listening on` line: the process and
/// its address.
pub fn start_server(args: &[&std::ffi::OsStr]) -> (Proc, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gradsync-server"));
    cmd.args(args).stderr(Stdio::null());
    spawn_server(cmd)
}

/// Spawn `cmd` (a `gradsync-server` command; its stdout is piped here) and wait for its
/// `listening on` line: the process and its address.
#[allow(dead_code)] // each test binary uses its own subset of this module
pub fn spawn_server(mut cmd: Command) -> (Proc, String) {
    let mut child = cmd.stdout(Stdio::piped()).spawn().expect("spawning gradsync-server");
    let stdout = child.stdout.take().expect("piped stdout");
    let proc = Proc(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(Duration::from_secs(60)).expect("server announced itself");
    let addr = line.trim().strip_prefix("gradsync-server listening on ").expect("listening line").to_string();
    (proc, addr)
}

/// Whether `python3` can import every module in `modules` (comma-separated, as `import` takes
/// them).
#[allow(dead_code)] // each test binary uses its own subset of this module
pub fn python_has(modules: &str) -> bool {
    Command::new("python3")
        .args(["-c", &format!("import {modules}")])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}
