//! Child processes for the integration tests: the binaries they start (found, never built
//! here), a guard that kills and reaps its child on every exit path, and servers waited for
//! through the line they print once they listen.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a server may take to print its `listening on` line.
const ANNOUNCE: Duration = Duration::from_secs(60);

/// The workspace binary `name` (`gradsync-server`, `gradsync-worker`, `gradsync-bench`), from
/// the target directory the running test was built into. `cargo nextest run --workspace` (the
/// project's test command) builds every binary before any test runs; a test never runs cargo
/// itself. `GRADSYNC_<NAME>_BIN` (e.g. `GRADSYNC_SERVER_BIN`) names another binary.
///
/// # Panics
/// When the binary is missing, or older than a source file it was built from (a stale binary
/// would test old code), naming the command that builds it.
pub fn binary(name: &str) -> PathBuf {
    let var = format!("GRADSYNC_{}_BIN", name.trim_start_matches("gradsync-").to_uppercase());
    if let Some(p) = std::env::var_os(&var) {
        return PathBuf::from(p);
    }
    // A test runs from target/<profile>/deps/<test>-<hash>.
    let exe = std::env::current_exe().expect("the test's own path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("the test lives in target/<profile>/deps");
    let bin = dir.join(name);
    let hint = format!(
        "run the tests with `cargo nextest run --workspace`, which builds every binary first (or \
         `cargo build --bins`), or set {var}"
    );
    assert!(bin.exists(), "{} is missing: {hint}", bin.display());
    // Cargo lists every source file a binary was built from in `<binary>.d`: one edited since
    // means the binary tests old code.
    let mtime = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let deps = std::fs::read_to_string(dir.join(format!("{name}.d"))).unwrap_or_default();
    if let Some(built) = mtime(&bin)
        && let Some((_, sources)) = deps.lines().next().and_then(|l| l.split_once(": "))
        && let Some(newer) =
            sources.split_whitespace().map(Path::new).find(|src| mtime(src).is_some_and(|m| m > built))
    {
        panic!("{} is older than {}: {hint}", bin.display(), newer.display());
    }
    bin
}

/// The directory holding the workspace's binaries, each checked by [`binary`]: what a
/// runner that starts workers and servers by path (`gradsync-bench compare --bin-dir`) needs.
pub fn bin_dir() -> PathBuf {
    let worker = binary("gradsync-worker");
    binary("gradsync-server");
    worker.parent().expect("a binary lives in a directory").to_path_buf()
}

/// A child process, killed (SIGKILL) and reaped on drop, whatever ends the test. Its stderr,
/// when piped by [`Proc::spawn`], is collected, and each line can be waited for.
pub struct Proc {
    child: Child,
    stderr: Option<JoinHandle<String>>,
    lines: Option<Receiver<String>>,
}

impl Proc {
    /// Spawn `cmd` with stdin closed and stderr piped here: every stderr line goes to
    /// [`Proc::wait_line`] and to what [`Proc::finish`] returns.
    pub fn spawn(cmd: &mut Command) -> Proc {
        let mut child = cmd
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {cmd:?}: {e}"));
        let (tx, rx) = channel();
        let err: ChildStderr = child.stderr.take().expect("piped stderr");
        let stderr = std::thread::spawn(move || {
            let mut all = String::new();
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx.send(line.clone());
                all.push_str(&line);
                all.push('\n');
            }
            all
        });
        Proc { child, stderr: Some(stderr), lines: Some(rx) }
    }

    /// Take over an already spawned child (its pipes as they were set).
    pub fn adopt(child: Child) -> Proc {
        Proc { child, stderr: None, lines: None }
    }

    /// The child's process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The child.
    pub fn child(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Block until a stderr line contains `needle`, at most `limit`.
    ///
    /// # Panics
    /// When no such line comes in time, or stderr was not piped by [`Proc::spawn`].
    pub fn wait_line(&mut self, needle: &str, limit: Duration) -> String {
        let rx = self.lines.as_ref().expect("stderr piped by Proc::spawn");
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(l) if l.contains(needle) => return l,
                Ok(_) => {}
                Err(e) => panic!("no stderr line with {needle:?} within {limit:?} ({e})"),
            }
        }
    }

    /// Kill the child (SIGKILL) and reap it.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Wait for the exit, at most `limit`: the exit code (-1 when a signal ended it), stderr
    /// (when piped) and the time it took.
    ///
    /// # Panics
    /// When the child is still running after `limit` (a hang), with its stderr.
    pub fn finish(&mut self, limit: Duration) -> (i32, String, Duration) {
        let t = Instant::now();
        let status = self.wait_for_exit(limit);
        self.lines = None;
        let err = self.stderr.take().map(|h| h.join().unwrap_or_default()).unwrap_or_default();
        (status.code().unwrap_or(-1), err, t.elapsed())
    }

    /// Reap the child, waiting at most `limit`; past it, kill it and panic with its stderr.
    fn wait_for_exit(&mut self, limit: Duration) -> ExitStatus {
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().expect("waiting for a child") {
                return s;
            }
            if t.elapsed() > limit {
                self.kill9();
                let err = self.stderr.take().map(|h| h.join().unwrap_or_default()).unwrap_or_default();
                panic!("process {} still running after {limit:?}: hang. stderr:\n{err}", self.child.id());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Wait for the exit, at most `limit`, collecting whatever stdout and stderr the spawner
    /// piped (what it did not pipe comes back empty).
    ///
    /// # Panics
    /// When the child is still running after `limit` (a hang); it is killed first.
    pub fn output(&mut self, limit: Duration) -> Output {
        fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> JoinHandle<Vec<u8>> {
            std::thread::spawn(move || {
                let mut v = Vec::new();
                if let Some(mut p) = pipe {
                    let _ = p.read_to_end(&mut v);
                }
                v
            })
        }
        let (out, err) = (drain(self.child.stdout.take()), drain(self.child.stderr.take()));
        let status = self.wait_for_exit(limit);
        Output { status, stdout: out.join().unwrap_or_default(), stderr: err.join().unwrap_or_default() }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Start a `gradsync-server` command (its stdout is piped here; set stderr as the test
/// wants, or let [`Proc::spawn`]'s piping apply with `piped_stderr`) and wait for its
/// `gradsync-server listening on ADDR` line: the process and ADDR. Its stdout is drained
/// afterwards so the server never blocks on a full pipe.
///
/// # Panics
/// When the server exits or stays silent for a minute, or its first line is another.
pub fn start_server(cmd: &mut Command, piped_stderr: bool) -> (Proc, String) {
    cmd.stdout(Stdio::piped());
    let mut p = if piped_stderr {
        Proc::spawn(cmd)
    } else {
        Proc::adopt(cmd.stdin(Stdio::null()).spawn().unwrap_or_else(|e| panic!("spawning {cmd:?}: {e}")))
    };
    let out = p.child.stdout.take().expect("piped stdout");
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let mut r = BufReader::new(out);
        let mut line = String::new();
        let _ = r.read_line(&mut line);
        let _ = tx.send(line);
        let _ = std::io::copy(&mut r, &mut std::io::sink());
    });
    let line = rx.recv_timeout(ANNOUNCE).expect("the server announced itself");
    let addr = line
        .trim()
        .strip_prefix("gradsync-server listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    (p, addr)
}

/// A port on 127.0.0.1 that nothing listens on now (bound, then let go), for a process that
/// must be told its port before it starts (a rendezvous store, a server started later).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("binding 127.0.0.1:0");
    l.local_addr().expect("a bound listener's address").port()
}

/// Whether `python3` can import every module in `modules` (comma-separated, as `import` takes
/// them).
pub fn python_has(modules: &str) -> bool {
    Command::new("python3")
        .args(["-c", &format!("import {modules}")])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}
