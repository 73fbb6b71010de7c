//! Child processes of the comparison runner: a command with what its stdin must first take,
//! and every wait on a child with a deadline (its exit, a line of its output).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{ChildStdout, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Context;

/// A command ready to spawn, and what must be written to its stdin first (the run's secrets,
/// for a process started over ssh). Its stdin must then stay open for as long as the process
/// should live: its end stops the process.
#[derive(Debug)]
pub struct Launch {
    /// The command.
    pub command: Command,
    /// Bytes for its stdin, when it takes them (else stdin is closed).
    pub stdin: Option<Vec<u8>>,
}

/// Run `cmd` to its end with `stdin` written to it, killing it after `limit`.
pub fn run_limited(mut cmd: Command, stdin: Option<&[u8]>, limit: Duration) -> anyhow::Result<Output> {
    let mut child = cmd
        // Its own process group, as every process of a run: a terminal's Ctrl-C reaches the
        // runner alone (and not the shared connection an ssh here may leave behind).
        .process_group(0)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {:?}", cmd.get_program()))?;
    let writer = match (stdin, child.stdin.take()) {
        (Some(bytes), Some(mut w)) => {
            let bytes = bytes.to_vec();
            Some(std::thread::spawn(move || {
                let _ = w.write_all(&bytes);
            }))
        }
        _ => None,
    };
    // Pipes are drained on threads so a chatty command never blocks on a full one.
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut v);
            }
            v
        })
    };
    let out = drain(child.stdout.take().map(|o| Box::new(o) as Box<dyn Read + Send>));
    let err = drain(child.stderr.take().map(|o| Box::new(o) as Box<dyn Read + Send>));
    let status = wait_until(&mut child, Instant::now() + limit);
    let Some(status) = status else {
        anyhow::bail!("no answer within {} s", limit.as_secs());
    };
    if let Some(w) = writer {
        let _ = w.join();
    }
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    Ok(Output { status, stdout, stderr })
}

/// The child's exit status, or `None` (after killing it) once `until` has passed.
pub fn wait_until(c: &mut std::process::Child, until: Instant) -> Option<std::process::ExitStatus> {
    loop {
        match c.try_wait() {
            Ok(Some(st)) => return Some(st),
            Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = c.kill();
                let _ = c.wait();
                return None;
            }
        }
    }
}

/// Read `out` until a line starting with `prefix` and return the rest of it, trimmed; a reader
/// thread hands lines over a channel so the wait has a deadline, and keeps draining the
/// output afterwards so its writer never blocks on a full pipe. `Err` says whether the output
/// ended first or `limit` passed.
pub fn wait_for_line(out: ChildStdout, prefix: &str, limit: Duration) -> Result<String, LineError> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            // After the wanted line nobody listens any more; keep reading to the end anyway.
            let _ = tx.send(line);
        }
    });
    let until = Instant::now() + limit;
    loop {
        match rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
            Ok(line) => {
                if let Some(rest) = line.trim().strip_prefix(prefix) {
                    return Ok(rest.trim().to_string());
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => return Err(LineError::Timeout(limit)),
            Err(mpsc::RecvTimeoutError::Disconnected) => return Err(LineError::Closed),
        }
    }
}

/// Why [`wait_for_line`] found no line.
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    /// The output ended (the process exited) first.
    #[error("its output ended before that line")]
    Closed,
    /// The time allowed passed.
    #[error("no such line after {} s", .0.as_secs())]
    Timeout(Duration),
}
