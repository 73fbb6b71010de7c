//! `gradsync-worker supervise -- PROGRAM ARGS...`: how `gradsync-bench compare --hosts` runs a
//! process on another host over ssh. It reads the run's secrets from stdin (never from the
//! command line, where `ps` on a shared host would show them), starts the program in a process
//! group of its own with them in its environment, and stops that whole group when the ssh
//! connection closes (stdin reaches its end: the runner was stopped, killed, or lost the host),
//! on SIGTERM, SIGINT or SIGHUP, and when the program itself exits (whatever it left running
//! goes with it). Its exit status is the program's.
//!
//! Stdin, before anything else: `KEY=VALUE` lines, then an empty line. Nothing else is read from
//! it; what follows (normally nothing) only keeps the connection open.
//!
//! With `--follow FILE` (rank 0's metrics file, for a runner that stops a run at its target
//! accuracy) the supervisor's stdout carries the complete lines appended to FILE while the
//! program runs, and the program's own stdout goes to stderr: the runner then reads rank 0's
//! progress over the connection that already carries its output, though the file itself only
//! comes back when the run ends.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use clap::Args;

/// How long the environment block may take to arrive.
const ENV_WAIT: Duration = Duration::from_secs(30);
/// The most bytes of environment accepted.
const ENV_MAX: usize = 64 << 10;
/// How often a followed file is read for new lines.
const FOLLOW_TICK: Duration = Duration::from_millis(100);

/// Flags of `gradsync-worker supervise`.
#[derive(Debug, Clone, Args)]
pub struct SuperviseArgs {
    /// Seconds the program's group has to exit after SIGTERM before it is killed.
    #[arg(long, default_value_t = 5.0)]
    pub grace: f64,
    /// Copy the complete lines appended to this file (made by the program) to stdout while
    /// the program runs, and send the program's own stdout to stderr.
    #[arg(long, value_name = "FILE")]
    pub follow: Option<PathBuf>,
    /// The program and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// Why the supervised group is stopped.
#[derive(Debug)]
enum Event {
    /// The program exited with this status.
    Exited(std::process::ExitStatus),
    /// Stdin ended: the connection to the runner is gone.
    Hangup,
    /// A signal reached the supervisor.
    Signal,
}

/// Run `a`: returns the exit code to leave with.
pub fn supervise(a: &SuperviseArgs) -> anyhow::Result<i32> {
    let (program, args) = a.command.split_first().ok_or_else(|| anyhow::anyhow!("supervise: no program"))?;
    let (env_tx, env_rx) = mpsc::channel();
    let (tx, rx) = mpsc::channel::<Event>();
    let hangup = tx.clone();
    std::thread::spawn(move || {
        let mut stdin = BufReader::new(std::io::stdin().lock());
        let _ = env_tx.send(read_env(&mut stdin));
        // Whatever follows is drained; its end is the connection's.
        let mut sink = [0u8; 4096];
        while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
        let _ = hangup.send(Event::Hangup);
    });
    let env = match env_rx.recv_timeout(ENV_WAIT) {
        Ok(r) => r?,
        Err(_) => anyhow::bail!("supervise: no environment block on stdin within {} s", ENV_WAIT.as_secs()),
    };
    let signalled = tx.clone();
    std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
        rt.block_on(async {
            use tokio::signal::unix::{SignalKind, signal};
            let (Ok(mut t), Ok(mut i), Ok(mut h)) = (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
                signal(SignalKind::hangup()),
            ) else {
                return;
            };
            tokio::select! {
                _ = t.recv() => {}
                _ = i.recv() => {}
                _ = h.recv() => {}
            }
            let _ = signalled.send(Event::Signal);
        });
    });
    let mut command = Command::new(program);
    command.args(args).envs(env).process_group(0).stdin(Stdio::null());
    if a.follow.is_some() {
        // Stdout carries the followed lines alone.
        let err = std::io::stderr().as_fd().try_clone_to_owned()?;
        command.stdout(Stdio::from(err));
    }
    let mut child = command.spawn().map_err(|e| anyhow::anyhow!("supervise: starting {program}: {e}"))?;
    let stop_following = Arc::new(AtomicBool::new(false));
    let follower = a.follow.clone().map(|path| {
        let stop = stop_following.clone();
        std::thread::spawn(move || follow(&path, &stop, &mut std::io::stdout().lock()))
    });
    // The last lines are copied before the supervisor exits.
    let finish = move || {
        stop_following.store(true, Ordering::SeqCst);
        if let Some(f) = follower {
            let _ = f.join();
        }
    };
    let pgid = i32::try_from(child.id()).map_err(|_| anyhow::anyhow!("supervise: pid out of range"))?;
    std::thread::spawn(move || {
        if let Ok(st) = child.wait() {
            let _ = tx.send(Event::Exited(st));
        }
    });
    let code = |st: std::process::ExitStatus| st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0));
    match rx.recv() {
        Ok(Event::Exited(st)) => {
            // What the program left in its group (a launcher's ranks) goes with it.
            kill_group(pgid, libc::SIGKILL);
            finish();
            Ok(code(st))
        }
        Ok(Event::Hangup | Event::Signal) | Err(_) => {
            kill_group(pgid, libc::SIGTERM);
            let grace = Duration::from_secs_f64(a.grace.max(0.0));
            let st = loop {
                match rx.recv_timeout(grace) {
                    Ok(Event::Exited(st)) => break Some(st),
                    Ok(_) => continue,
                    Err(_) => break None,
                }
            };
            kill_group(pgid, libc::SIGKILL);
            finish();
            Ok(st.map_or(128 + libc::SIGKILL, code))
        }
    }
}

/// Copy the complete lines appended to `path` (which may not exist yet) to `out` every
/// [`FOLLOW_TICK`] until `stop` is set, then once more. A write that fails (the runner went
/// away) ends the copying; the program is not disturbed.
fn follow(path: &std::path::Path, stop: &AtomicBool, out: &mut impl Write) {
    let mut tail = gradsync_core::metrics::MetricsTail::new(path.to_path_buf());
    loop {
        let last = stop.load(Ordering::SeqCst);
        let lines = tail.read();
        if !lines.is_empty() && out.write_all(&lines).and_then(|_| out.flush()).is_err() {
            return;
        }
        if last {
            return;
        }
        std::thread::sleep(FOLLOW_TICK);
    }
}

/// Signal every process of group `pgid`.
fn kill_group(pgid: i32, sig: i32) {
    // SAFETY: kill(2) on a process group this process made; no memory is touched.
    unsafe {
        libc::kill(-pgid, sig);
    }
}

/// The `KEY=VALUE` lines before the first empty one (or the end of input).
fn read_env(r: &mut impl BufRead) -> anyhow::Result<Vec<(String, String)>> {
    let mut env = Vec::new();
    let mut total = 0;
    loop {
        let mut line = String::new();
        let n = r.take((ENV_MAX - total + 1) as u64).read_line(&mut line)?;
        total += n;
        anyhow::ensure!(total <= ENV_MAX, "supervise: more than {ENV_MAX} bytes of environment on stdin");
        let line = line.trim_end_matches(['\n', '\r']);
        if line.is_empty() {
            return Ok(env);
        }
        let (k, v) = line
            .split_once('=')
            .filter(|(k, _)| {
                !k.is_empty()
                    && k.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
                    && !k.as_bytes()[0].is_ascii_digit()
            })
            .ok_or_else(|| {
                anyhow::anyhow!("supervise: line {} of the environment is not KEY=VALUE", env.len() + 1)
            })?;
        env.push((k.to_string(), v.to_string()));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::read_env;

    #[test]
    fn following_copies_whole_lines_and_the_last_ones_at_the_end() {
        use std::io::Write;
        use std::sync::atomic::{AtomicBool, Ordering};
        let dir = std::env::temp_dir().join(format!("gs-follow-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rank0.jsonl");
        let stop = AtomicBool::new(false);
        let got = std::thread::scope(|s| {
            let h = s.spawn(|| {
                let mut out = Vec::new();
                super::follow(&path, &stop, &mut out);
                out
            });
            // The file appears after the follower started, its last line half written.
            let mut f = std::fs::File::create(&path).unwrap();
            f.write_all(b"{\"step\":1}\n{\"ste").unwrap();
            f.flush().unwrap();
            f.write_all(b"p\":2}\n").unwrap();
            stop.store(true, Ordering::SeqCst);
            h.join().unwrap()
        });
        assert_eq!(String::from_utf8(got).unwrap(), "{\"step\":1}\n{\"step\":2}\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_environment_block_ends_at_an_empty_line_and_refuses_anything_else() {
        let mut r = std::io::Cursor::new(b"GRADSYNC_TOKEN=a=b\nX_1=\n\nrest".to_vec());
        let env = read_env(&mut r).unwrap();
        assert_eq!(env, vec![("GRADSYNC_TOKEN".into(), "a=b".into()), ("X_1".into(), String::new())]);
        assert!(read_env(&mut std::io::Cursor::new(b"".to_vec())).unwrap().is_empty());
        for bad in ["no equals\n\n", "lower=x\n\n", "1X=y\n\n", "=v\n\n"] {
            let e = read_env(&mut std::io::Cursor::new(bad.as_bytes().to_vec())).unwrap_err();
            assert!(e.to_string().contains("line 1"), "{bad:?}: {e}");
        }
        let big = format!("A={}\n\n", "x".repeat(super::ENV_MAX));
        assert!(read_env(&mut std::io::Cursor::new(big.into_bytes())).is_err());
    }
}
