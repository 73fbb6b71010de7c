//! Child processes of the comparison runner: a command with what its stdin must first take,
//! two commands piped one into the other (a `tar` stream to another host), and every wait on a
//! child with a deadline (its exit, a line of its output).

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
    let out = drain(child.stdout.take());
    let err = drain(child.stderr.take());
    let status = wait_until(&mut child, Instant::now() + limit);
    let Some(status) = status else {
        anyhow::bail!("no answer within {} s", limit.as_secs());
    };
    if let Some(w) = writer {
        let _ = w.join();
    }
    Ok(Output { status, stdout: out.join().unwrap_or_default(), stderr: err.join().unwrap_or_default() })
}

/// Run `from | to` to its end: `from`'s stdout is `to`'s stdin, streamed (what passes is never
/// held here, however large), both killed after `limit`. Each one's exit status and stderr
/// (`from`'s stdout went to `to`); where `limit` passed, the `Err` says so.
pub fn run_pipe(mut from: Command, mut to: Command, limit: Duration) -> anyhow::Result<(Output, Output)> {
    let mut src = from
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {:?}", from.get_program()))?;
    let Some(pipe) = src.stdout.take() else {
        let _ = src.kill();
        let _ = src.wait();
        anyhow::bail!("{:?} has no stdout", from.get_program());
    };
    let dst =
        to.process_group(0).stdin(Stdio::from(pipe)).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn();
    // `to` holds this process's copy of the pipe's reading end: gone, `from` learns of a
    // `to` that stopped reading (a broken pipe) instead of blocking on a full pipe.
    let program = to.get_program().to_os_string();
    drop(to);
    let mut dst = match dst {
        Ok(d) => d,
        Err(e) => {
            let _ = src.kill();
            let _ = src.wait();
            return Err(e).with_context(|| format!("starting {program:?}"));
        }
    };
    let (src_err, dst_out, dst_err) =
        (drain(src.stderr.take()), drain(dst.stdout.take()), drain(dst.stderr.take()));
    let until = Instant::now() + limit;
    let dst_status = wait_until(&mut dst, until);
    // Once `to` has ended, `from` ends too (its writes fail); past the deadline it is killed.
    let src_status = wait_until(&mut src, until);
    let (Some(src_status), Some(dst_status)) = (src_status, dst_status) else {
        anyhow::bail!("not done within {} s", limit.as_secs());
    };
    let src = Output { status: src_status, stdout: Vec::new(), stderr: src_err.join().unwrap_or_default() };
    let dst = Output {
        status: dst_status,
        stdout: dst_out.join().unwrap_or_default(),
        stderr: dst_err.join().unwrap_or_default(),
    };
    Ok((src, dst))
}

/// Read `r` to its end on a thread of its own (so a chatty child never blocks on a full pipe),
/// handing back what it read.
fn drain<R: Read + Send + 'static>(r: Option<R>) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        if let Some(mut r) = r {
            let _ = r.read_to_end(&mut v);
        }
        v
    })
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Command {
        let mut c = Command::new("/bin/sh");
        c.args(["-c", script]);
        c
    }

    #[test]
    fn a_pipe_streams_what_passes_and_ends_with_its_far_end() {
        let (from, to) =
            run_pipe(sh("head -c 67108864 /dev/zero"), sh("wc -c"), Duration::from_secs(60)).unwrap();
        assert!(from.status.success() && to.status.success());
        assert_eq!(String::from_utf8_lossy(&to.stdout).trim(), "67108864");
        // A far end that stops reading ends the near end too (its writes fail), at once.
        let t = Instant::now();
        let (from, to) = run_pipe(sh("yes"), sh("head -c 10 >/dev/null"), Duration::from_secs(60)).unwrap();
        assert!(!from.status.success() && to.status.success(), "{:?} {:?}", from.status, to.status);
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    }

    #[test]
    fn a_pipe_past_its_limit_is_killed_and_says_so() {
        let t = Instant::now();
        let e = run_pipe(sh("exec sleep 30"), sh("exec cat"), Duration::from_secs(1)).unwrap_err();
        assert!(e.to_string().contains("not done within 1 s"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        let e = run_pipe(Command::new("/nonexistent/tar"), sh("cat"), Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("starting \"/nonexistent/tar\""), "{e}");
    }
}
