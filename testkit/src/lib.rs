//! # Layout
//! Test support shared by gradsync's crates: child processes for the integration tests, and
//! what lets GPU code be exercised on machines without a GPU.
//! - `fake/` (C, built by `build.rs`): a fake CUDA driver, cuBLAS and NCCL. Device memory is
//!   host memory with every access checked; the project's own kernels run serially on the host;
//!   allocations alive at exit fail the process. See the comment at the top of each file.
//! - [`tools`]: NVRTC and ptxas from NVIDIA's wheels on PyPI, a Python with PyTorch for the
//!   reference checks, and one with `kubernetes-validate` for the Kubernetes manifests,
//!   installed into a local cache the first time they are needed.
//! - [`process`]: the workspace binaries a test starts (found, never built by a test), free
//!   ports, a child guard that kills and reaps on drop, and servers waited for through their
//!   `listening on` line.
//! - [`Scratch`]: a test's own directory, removed with its contents when the test ends, passed
//!   or not (kept with `GRADSYNC_KEEP_SCRATCH` set).
//! - [`WorkLog`]: the device work as the fake ran it (every kernel launch with its grid and
//!   block, every copy), for tests that check a kernel's parallel work grows with its data and
//!   when a bucket was staged.
//! - [`gpu_test`]: how a GPU test runs here: in place on a real GPU, or again in a child process
//!   whose library path holds the fake CUDA and NVRTC, with the fake's counters handed back.

use std::fmt;
use std::io::Read;
use std::ops::Deref;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub mod process;
pub mod tools;

pub use tools::{Tools, kubernetes_validate_python, tools, torch_python};

/// Set in the child process that runs a test against the fake CUDA.
pub const CHILD_ENV: &str = "GRADSYNC_FAKE_CUDA_CHILD";
/// The file the fake appends its per-process counters to.
const REPORT_ENV: &str = "FAKE_CUDA_REPORT";
/// The file the fake appends every kernel launch and copy to.
const WORK_LOG_ENV: &str = "FAKE_CUDA_WORK_LOG";
/// The longest a child test may run before it is killed and the test fails.
const CHILD_LIMIT: Duration = Duration::from_secs(600);

/// Errors of the test support.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tool (NVRTC and ptxas, a Python with PyTorch) could not be installed or found.
    #[error("{0}")]
    Tools(String),
    /// The child process could not be run or did not pass.
    #[error("{0}")]
    Child(String),
}

/// Set (to anything) to keep every test's [`Scratch`] directory for a look afterwards.
pub const KEEP_SCRATCH_ENV: &str = "GRADSYNC_KEEP_SCRATCH";

/// A directory of a test's own under the system's temporary folder (`gradsync-NAME-` and a
/// random suffix, so tests running at once never share one), removed with everything in it
/// when dropped: at the end of a test that passed and while a failing one unwinds. Kept, and
/// named on stderr, when [`KEEP_SCRATCH_ENV`] is set. Reads as a [`Path`].
#[derive(Debug)]
pub struct Scratch(tempfile::TempDir);

impl Scratch {
    /// A fresh, empty directory for the test `name`. Panics (failing the test) if it cannot
    /// be made.
    pub fn new(name: &str) -> Scratch {
        Scratch::made(name, std::env::var_os(KEEP_SCRATCH_ENV).is_some())
    }

    fn made(name: &str, keep: bool) -> Scratch {
        match tempfile::Builder::new().prefix(&format!("gradsync-{name}-")).disable_cleanup(keep).tempdir() {
            Ok(d) => {
                if keep {
                    eprintln!(
                        "{name}: scratch directory {} (kept: {KEEP_SCRATCH_ENV} is set)",
                        d.path().display()
                    );
                }
                Scratch(d)
            }
            Err(e) => panic!("cannot make a scratch directory for {name}: {e}"),
        }
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        self.0.path()
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        self.0.path()
    }
}

/// The folder holding the fake `libcuda.so.1`, `libcublas.so.13` and `libnccl.so.2`.
pub fn fake_cuda_dir() -> &'static Path {
    Path::new(env!("GRADSYNC_FAKE_CUDA_DIR"))
}

/// What the fake counted over every process of one test (the test's child and the processes
/// it started).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Processes that loaded the fake driver.
    pub processes: u64,
    /// Kernels launched.
    pub launches: u64,
    /// `cublasSgemm` calls accepted.
    pub gemms: u64,
    /// NCCL operations posted.
    pub collectives: u64,
    /// Device allocations made.
    pub allocations: u64,
    /// The most allocations alive at once in any one process.
    pub peak_live: u64,
    /// Allocations still alive when a process exited (a failure; the fake also fails the
    /// process).
    pub alive_at_exit: u64,
    /// Copies between host and device memory (`cuMemcpyHtoD`, `cuMemcpyDtoH`, either form).
    pub host_copies: u64,
}

impl fmt::Display for Counters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} process(es): {} kernel launches, {} GEMM calls, {} collectives, {} allocations (at most {} alive at \
             once), {} alive at exit, {} host copies",
            self.processes,
            self.launches,
            self.gemms,
            self.collectives,
            self.allocations,
            self.peak_live,
            self.alive_at_exit,
            self.host_copies
        )
    }
}

impl Counters {
    /// Sum the `key=value` lines the fake wrote, one per process.
    fn parse(report: &str) -> Counters {
        let mut c = Counters::default();
        for line in report.lines().filter(|l| l.starts_with("pid=")) {
            c.processes += 1;
            for kv in line.split_whitespace() {
                let Some((k, v)) = kv.split_once('=') else { continue };
                let v: u64 = v.parse().unwrap_or(0);
                match k {
                    "launches" => c.launches += v,
                    "gemms" => c.gemms += v,
                    "collectives" => c.collectives += v,
                    "allocations" => c.allocations += v,
                    "peak_live" => c.peak_live = c.peak_live.max(v),
                    "alive_at_exit" => c.alive_at_exit += v,
                    "host_copies" => c.host_copies += v,
                    _ => {}
                }
            }
        }
        c
    }
}

/// How a GPU test runs on this machine.
#[derive(Debug)]
pub enum GpuRun {
    /// This process can use a GPU (a real one, or the fake in the child): run the test's body.
    Here,
    /// The body ran in a child process against the fake CUDA and passed; what it counted.
    Fake(Counters),
    /// Neither is possible; the reason was printed as `SKIPPED (...)`.
    Skipped,
}

/// Whether a real NVIDIA driver with at least one device can be opened.
fn real_gpu() -> bool {
    // SAFETY: loading the driver library runs its initialisers, which expect nothing of us;
    // cuInit and cuDeviceGetCount take plain values and an out-pointer to a live i32.
    unsafe {
        let Ok(lib) = libloading::Library::new("libcuda.so.1") else { return false };
        let (Ok(init), Ok(count)) = (
            lib.get::<unsafe extern "C" fn(u32) -> i32>(b"cuInit\0"),
            lib.get::<unsafe extern "C" fn(*mut i32) -> i32>(b"cuDeviceGetCount\0"),
        ) else {
            return false;
        };
        let mut n = 0;
        init(0) == 0 && count(&mut n) == 0 && n > 0
    }
}

/// Whether this is a CI run, where a test that cannot get its tools fails instead of skipping.
pub fn in_ci() -> bool {
    std::env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// A Python with PyTorch for `test` ([`torch_python`]); where none can be had, `None` after
/// printing `SKIPPED` with the reason, or, under CI, a panic: CI must run what needs it.
pub fn torch_python_or_skip(test: &str) -> Option<std::path::PathBuf> {
    match torch_python() {
        Ok(p) => Some(p),
        Err(e) if !in_ci() => {
            eprintln!("SKIPPED (no Python with torch: {e}) [{test}]");
            None
        }
        Err(e) => panic!("{test}: CI must run this with PyTorch, but PyTorch cannot be had: {e}"),
    }
}

/// Decide how the GPU test `test` (its exact name as the test harness lists it, e.g.
/// `cpu_and_gpu_agree_on_tiny` or `device::cuda::tests::kernels_compile`) runs:
/// - in the child started below, or on a machine with a real GPU: [`GpuRun::Here`];
/// - otherwise the test binary is run again for this one test, with the fake CUDA, NVRTC and
///   ptxas on its library path; the child's output is shown, the test fails unless the child
///   passed, and the fake's counters come back as [`GpuRun::Fake`];
/// - when NVRTC cannot be installed (no network), [`GpuRun::Skipped`], except under CI where
///   that fails the test.
pub fn gpu_test(test: &str) -> GpuRun {
    gpu_test_with_env(test, &[])
}

/// [`gpu_test`], with `env` added to the child's environment (e.g. a binary the parent built,
/// so that the child, whose library path differs, runs no `cargo build` of its own: cargo
/// would see a changed environment and rebuild).
pub fn gpu_test_with_env(test: &str, env: &[(&str, &std::ffi::OsStr)]) -> GpuRun {
    if std::env::var_os(CHILD_ENV).is_some() || real_gpu() {
        return GpuRun::Here;
    }
    let tools = match tools() {
        Ok(t) => t,
        Err(e) if !in_ci() => {
            eprintln!("SKIPPED (no GPU, and {e}) [{test}]");
            return GpuRun::Skipped;
        }
        Err(e) => panic!("{test}: {e} (CI must run the GPU tests against the fake CUDA)"),
    };
    match run_child(test, &tools, env) {
        Ok(c) => {
            eprintln!("{test}: passed against the fake CUDA: {c}");
            GpuRun::Fake(c)
        }
        Err(e) => panic!("{test}: {e}"),
    }
}

/// The library path for a process that should load the fake CUDA and NVRTC.
pub fn fake_library_path(tools: &Tools) -> String {
    let mut dirs = vec![fake_cuda_dir().display().to_string(), tools.lib_dir.display().to_string()];
    if let Ok(old) = std::env::var("LD_LIBRARY_PATH") {
        dirs.extend(old.split(':').filter(|d| !d.is_empty()).map(str::to_owned));
    }
    dirs.join(":")
}

fn run_child(test: &str, tools: &Tools, env: &[(&str, &std::ffi::OsStr)]) -> Result<Counters, Error> {
    let exe =
        std::env::current_exe().map_err(|e| Error::Child(format!("cannot find the test binary: {e}")))?;
    let report =
        std::env::temp_dir().join(format!("gradsync-fake-cuda-{}-{}.txt", std::process::id(), nonce()));
    let work_log = report.with_extension("work");
    let mut child = Command::new(&exe)
        .args([test, "--exact", "--nocapture", "--test-threads", "1"])
        .env(CHILD_ENV, "1")
        .env(REPORT_ENV, &report)
        .env(WORK_LOG_ENV, &work_log)
        .env("LD_LIBRARY_PATH", fake_library_path(tools))
        .env("GRADSYNC_PTXAS", &tools.ptxas)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::Child(format!("cannot run {}: {e}", exe.display())))?;
    // Both pipes are drained on threads so a chatty child cannot block on a full pipe.
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = child.stdout.take().map(|o| drain(Box::new(o)));
    let err = child.stderr.take().map(|e| drain(Box::new(e)));
    let t0 = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Ok(s),
            Ok(None) if t0.elapsed() < CHILD_LIMIT => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                break Err(format!("killed after {} s", CHILD_LIMIT.as_secs()));
            }
            Err(e) => break Err(format!("cannot wait for it: {e}")),
        }
    };
    let stdout = out.and_then(|h| h.join().ok()).unwrap_or_default();
    let stderr = err.and_then(|h| h.join().ok()).unwrap_or_default();
    eprintln!("---- {test} against the fake CUDA ----\n{stdout}{stderr}---- end of {test} ----");
    let counters = Counters::parse(&std::fs::read_to_string(&report).unwrap_or_default());
    let _ = std::fs::remove_file(&report);
    let _ = std::fs::remove_file(&work_log);
    let status = status.map_err(|e| Error::Child(format!("the child test {e}")))?;
    if !status.success() {
        return Err(Error::Child(format!("failed against the fake CUDA ({status}); its output is above")));
    }
    if !stdout.contains("test result: ok. 1 passed") {
        return Err(Error::Child(format!("no test named exactly '{test}' ran in the child")));
    }
    if counters.alive_at_exit > 0 {
        return Err(Error::Child(format!("allocations alive at exit: {counters}")));
    }
    Ok(counters)
}

/// One kernel launch as the fake CUDA saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// The kernel's name.
    pub kernel: String,
    /// Blocks in the grid (x, y, z).
    pub grid: [u32; 3],
    /// Threads in a block (x, y, z).
    pub block: [u32; 3],
}

impl Launch {
    /// Threads launched in all.
    pub fn threads(&self) -> u64 {
        self.grid.iter().chain(&self.block).map(|&d| u64::from(d)).product()
    }
}

/// The direction of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyKind {
    /// Device to host.
    DtoH,
    /// Host to device.
    HtoD,
    /// Device to device.
    DtoD,
}

/// One piece of device work, in the order the fake CUDA ran it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Work {
    /// A kernel launch.
    Kernel(Launch),
    /// A cuBLAS GEMM.
    Gemm,
    /// An allocation of `bytes` bytes (device or pinned host memory).
    Alloc {
        /// Its size.
        bytes: u64,
    },
    /// A wait of the host for the device (a stream, event or context synchronised).
    Sync,
    /// A copy of `bytes` bytes.
    Copy {
        /// Its direction.
        kind: CopyKind,
        /// Its size.
        bytes: u64,
    },
}

impl Work {
    /// One line of the log: the process id, then `kernel NAME GX GY GZ BX BY BZ`, `gemm`,
    /// `copy dtoh|htod|dtod BYTES`, `alloc BYTES` or `sync`.
    fn parse(line: &str) -> Option<(u32, Work)> {
        let mut words = line.split_whitespace();
        let pid = words.next()?.parse().ok()?;
        let work = match words.next()? {
            "kernel" => {
                let kernel = words.next()?.to_owned();
                let dims: Vec<u32> = words.map(|w| w.parse().ok()).collect::<Option<_>>()?;
                let [gx, gy, gz, bx, by, bz] = dims[..] else { return None };
                Work::Kernel(Launch { kernel, grid: [gx, gy, gz], block: [bx, by, bz] })
            }
            "gemm" => words.next().is_none().then_some(Work::Gemm)?,
            "sync" => words.next().is_none().then_some(Work::Sync)?,
            "alloc" => {
                let bytes = words.next()?.parse().ok()?;
                words.next().is_none().then_some(Work::Alloc { bytes })?
            }
            "copy" => {
                let kind = match words.next()? {
                    "dtoh" => CopyKind::DtoH,
                    "htod" => CopyKind::HtoD,
                    "dtod" => CopyKind::DtoD,
                    _ => return None,
                };
                let bytes = words.next()?.parse().ok()?;
                words.next().is_none().then_some(Work::Copy { kind, bytes })?
            }
            _ => return None,
        };
        Some((pid, work))
    }
}

/// The device work of this process (kernel launches with their grids, copies), in order, as
/// the fake CUDA records it: available in the child process of a [`gpu_test`] (on a real GPU
/// nothing records it).
#[derive(Debug)]
pub struct WorkLog(std::path::PathBuf);

impl WorkLog {
    /// This process's log, when it runs against the fake CUDA.
    pub fn here() -> Option<WorkLog> {
        let path = std::env::var_os(WORK_LOG_ENV)?;
        (std::env::var_os(CHILD_ENV).is_some() && !path.is_empty()).then(|| WorkLog(path.into()))
    }

    /// The log of the processes a test starts: pass it on as `(name, value)` in their
    /// environment (e.g. with [`WorkLog::env`]) to record their work too.
    pub fn at(path: &Path) -> WorkLog {
        WorkLog(path.to_path_buf())
    }

    /// The environment variable that makes a process started by a test write `path`.
    pub fn env(path: &Path) -> (&'static str, std::ffi::OsString) {
        (WORK_LOG_ENV, path.as_os_str().to_owned())
    }

    /// Everything this process recorded so far (panics, failing the test, on a line the fake
    /// cannot have written).
    pub fn all(&self) -> Vec<Work> {
        let me = std::process::id();
        self.by_process().into_iter().find(|(pid, _)| *pid == me).map(|(_, w)| w).unwrap_or_default()
    }

    /// Everything recorded so far, per process in the order each first appears.
    pub fn by_process(&self) -> Vec<(u32, Vec<Work>)> {
        let text = std::fs::read_to_string(&self.0).unwrap_or_default();
        let mut out: Vec<(u32, Vec<Work>)> = Vec::new();
        for line in text.lines() {
            let (pid, work) = Work::parse(line).unwrap_or_else(|| panic!("bad work log line {line:?}"));
            match out.iter_mut().find(|(p, _)| *p == pid) {
                Some((_, v)) => v.push(work),
                None => out.push((pid, vec![work])),
            }
        }
        out
    }

    /// How much has been recorded: a mark for [`WorkLog::since`].
    pub fn mark(&self) -> usize {
        self.all().len()
    }

    /// The work recorded after `mark`.
    pub fn since(&self, mark: usize) -> Vec<Work> {
        self.all().split_off(mark)
    }

    /// The kernel launches recorded after `mark`.
    pub fn launches_since(&self, mark: usize) -> Vec<Launch> {
        self.since(mark)
            .into_iter()
            .filter_map(|w| match w {
                Work::Kernel(l) => Some(l),
                _ => None,
            })
            .collect()
    }
}

/// A value distinct between calls in one process.
fn nonce() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scratch_directory_is_gone_after_its_test_passed_or_failed() {
        let kept = {
            let d = Scratch::made("scratch-ok", false);
            std::fs::create_dir_all(d.join("sub")).unwrap();
            std::fs::write(d.join("sub/file"), b"x").unwrap();
            assert!(
                d.is_dir() && d.file_name().unwrap().to_string_lossy().starts_with("gradsync-scratch-ok-")
            );
            d.to_path_buf()
        };
        assert!(!kept.exists(), "{} left behind", kept.display());

        let seen = std::sync::Mutex::new(None);
        let failed = std::panic::catch_unwind(|| {
            let d = Scratch::made("scratch-panic", false);
            std::fs::write(d.join("file"), b"x").unwrap();
            *seen.lock().unwrap() = Some(d.to_path_buf());
            panic!("the test fails here");
        });
        assert!(failed.is_err());
        let kept = seen.lock().unwrap().take().unwrap();
        assert!(!kept.exists(), "{} left behind by a failing test", kept.display());
        assert_ne!(Scratch::new("same").path(), Scratch::new("same").path(), "two tests, one directory");

        // Asked to keep it: still there after the test.
        let kept = Scratch::made("scratch-keep", true).to_path_buf();
        assert!(kept.is_dir(), "{} not kept", kept.display());
        std::fs::remove_dir_all(&kept).unwrap();
    }

    #[test]
    fn work_log_lines_are_read() {
        let launch = Launch { kernel: "bias_grad".into(), grid: [4, 1, 1], block: [256, 1, 1] };
        assert_eq!(launch.threads(), 1024);
        assert_eq!(Work::parse("7 kernel bias_grad 4 1 1 256 1 1"), Some((7, Work::Kernel(launch))));
        assert_eq!(Work::parse("7 kernel bias_grad 4 1 1 256 1"), None);
        assert_eq!(Work::parse("7 kernel bias_grad 4 1 1 256 1 x"), None);
        assert_eq!(Work::parse("kernel bias_grad 4 1 1 256 1 1"), None, "no process id");
        assert_eq!(Work::parse("8 gemm"), Some((8, Work::Gemm)));
        assert_eq!(Work::parse("8 sync"), Some((8, Work::Sync)));
        assert_eq!(Work::parse("8 alloc 64"), Some((8, Work::Alloc { bytes: 64 })));
        assert_eq!(Work::parse("8 alloc"), None);
        assert_eq!(
            Work::parse("8 copy dtoh 4096"),
            Some((8, Work::Copy { kind: CopyKind::DtoH, bytes: 4096 }))
        );
        assert_eq!(Work::parse("8 copy sideways 4096"), None);
        assert_eq!(Work::parse("8 copy htod 4096 7"), None);
    }

    #[test]
    fn counters_sum_every_process() {
        let report = "pid=1 launches=3 gemms=2 collectives=0 allocations=5 peak_live=4 alive_at_exit=0 host_copies=2\n\
                      pid=2 launches=1 gemms=4 collectives=6 allocations=2 peak_live=2 alive_at_exit=1\n";
        let c = Counters::parse(report);
        assert_eq!(
            c,
            Counters {
                processes: 2,
                launches: 4,
                gemms: 6,
                collectives: 6,
                allocations: 7,
                peak_live: 4,
                alive_at_exit: 1,
                host_copies: 2
            }
        );
    }
}
