//! The NCCL library, found and loaded by gradsync itself, and the few of its functions
//! gradsync calls.
//!
//! cudarc looks for `libnccl.so` and `libnccl.so.{13,12,11,10,9,1}` only, never `libnccl.so.2`,
//! which is the name NCCL has everywhere users get it: PyTorch's wheels
//! (`site-packages/nvidia/nccl/lib`), Debian and Ubuntu's `libnccl2`, NVIDIA's own packages.
//! So gradsync loads NCCL here: first the file `gradsync_core::device::libs` chooses with the
//! other CUDA libraries (`GRADSYNC_CUDA_LIBS`, `LD_LIBRARY_PATH`, the toolkit's folders), then
//! ([`candidates`]) by name through the dynamic linker's own search (`LD_LIBRARY_PATH`, the
//! system's cache), then inside the Python environments it can
//! see (an active virtualenv or conda environment, the user's and the system's site-packages),
//! where `pip install torch` puts it. Every function is resolved when the library is loaded, so
//! a missing one is an error naming it, never a panic in the middle of training.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::error::{CollectiveError, Result};

/// An NCCL communicator handle.
pub type RawComm = *mut c_void;
/// A CUDA stream handle, as NCCL takes it (core's [`GpuStream::raw`](gradsync_core::device::GpuStream::raw)).
pub use gradsync_core::device::RawStream;

/// `ncclSuccess`.
pub const SUCCESS: c_int = 0;
/// `ncclInProgress`: a nonblocking call has not finished yet.
pub const IN_PROGRESS: c_int = 7;
/// `ncclFloat16` (IEEE binary16).
pub const FLOAT16: c_int = 6;
/// `ncclFloat32`.
pub const FLOAT32: c_int = 7;
/// `ncclBfloat16` (NCCL 2.10 and later).
pub const BFLOAT16: c_int = 9;
/// `ncclSum`.
pub const SUM: c_int = 0;
/// Bytes in an NCCL unique id.
pub const ID_BYTES: usize = 128;

/// `ncclConfig_t` as NCCL 2.17 defined it. NCCL reads `size`, `magic` and `version` first and
/// only the fields that version had, so later libraries accept it.
#[repr(C)]
#[derive(Debug)]
pub struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

impl Config {
    /// A configuration with every field left to NCCL except `blocking`.
    pub fn nonblocking() -> Config {
        // NCCL_CONFIG_UNDEF_INT: "let NCCL choose".
        const UNDEF: c_int = c_int::MIN;
        Config {
            size: size_of::<Config>(),
            magic: 0xcafe_beef,
            version: 2 * 10000 + 17 * 100,
            blocking: 0,
            cga_cluster_size: UNDEF,
            min_ctas: UNDEF,
            max_ctas: UNDEF,
            net_name: std::ptr::null(),
            split_share: UNDEF,
        }
    }
}

type Res = c_int;

/// The functions gradsync calls, resolved once.
#[allow(missing_docs)]
pub struct Lib {
    /// Where it was loaded from (for messages).
    pub path: String,
    pub get_unique_id: unsafe extern "C" fn(*mut [u8; ID_BYTES]) -> Res,
    pub comm_init_rank_config:
        unsafe extern "C" fn(*mut RawComm, c_int, [u8; ID_BYTES], c_int, *mut Config) -> Res,
    pub comm_get_async_error: unsafe extern "C" fn(RawComm, *mut Res) -> Res,
    pub comm_abort: unsafe extern "C" fn(RawComm) -> Res,
    pub comm_destroy: unsafe extern "C" fn(RawComm) -> Res,
    pub get_error_string: unsafe extern "C" fn(Res) -> *const c_char,
    pub get_last_error: unsafe extern "C" fn(RawComm) -> *const c_char,
    pub group_start: unsafe extern "C" fn() -> Res,
    pub group_end: unsafe extern "C" fn() -> Res,
    pub all_reduce:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> Res,
    pub broadcast:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> Res,
    pub reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        c_int,
        RawComm,
        RawStream,
    ) -> Res,
    pub all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, RawStream) -> Res,
    pub reduce_scatter:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> Res,
    pub send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, RawStream) -> Res,
    pub recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, RawStream) -> Res,
    /// Keeps the functions above valid; never unloaded.
    _lib: libloading::Library,
}

impl std::fmt::Debug for Lib {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NCCL from {}", self.path)
    }
}

impl Lib {
    /// Load NCCL from `path` (a file, or a bare name for the dynamic linker to find) and
    /// resolve every function.
    fn open(path: &str) -> std::result::Result<Lib, String> {
        // SAFETY: loading NCCL runs its initialisers, which expect nothing of the caller.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| format!("{path}: {e}"))?;
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: the type is the function's C signature in nccl.h.
                let f = unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("{path} lacks {} (NCCL older than 2.17?): {e}", $name))?;
                *f
            }};
        }
        Ok(Lib {
            path: path.to_owned(),
            get_unique_id: sym!("ncclGetUniqueId"),
            comm_init_rank_config: sym!("ncclCommInitRankConfig"),
            comm_get_async_error: sym!("ncclCommGetAsyncError"),
            comm_abort: sym!("ncclCommAbort"),
            comm_destroy: sym!("ncclCommDestroy"),
            get_error_string: sym!("ncclGetErrorString"),
            get_last_error: sym!("ncclGetLastError"),
            group_start: sym!("ncclGroupStart"),
            group_end: sym!("ncclGroupEnd"),
            all_reduce: sym!("ncclAllReduce"),
            broadcast: sym!("ncclBroadcast"),
            reduce: sym!("ncclReduce"),
            all_gather: sym!("ncclAllGather"),
            reduce_scatter: sym!("ncclReduceScatter"),
            send: sym!("ncclSend"),
            recv: sym!("ncclRecv"),
            _lib: lib,
        })
    }

    /// Turn an NCCL result into an error naming `op`, with NCCL's own last message.
    pub fn check(&self, op: &'static str, r: Res, comm: Option<RawComm>) -> Result<()> {
        if r == SUCCESS {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for any code.
        let what = unsafe { cstr((self.get_error_string)(r)) };
        // SAFETY: a live communicator (or null, which NCCL accepts) and a static string.
        let last = unsafe { cstr((self.get_last_error)(comm.unwrap_or(std::ptr::null_mut()))) };
        let msg = if last.is_empty() { format!("{what} ({r})") } else { format!("{what} ({r}): {last}") };
        Err(CollectiveError::Nccl { op, msg })
    }
}

/// A C string NCCL returned, or "" for null.
///
/// # Safety
/// `p` is null or a NUL-terminated string that outlives the call.
unsafe fn cstr(p: *const c_char) -> String {
    if p.is_null() { String::new() } else { unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned() }
}

/// The library, loaded on first use; the error lists every place that was tried.
pub fn lib() -> Result<&'static Lib> {
    static LIB: OnceLock<std::result::Result<Lib, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        let mut tried = Vec::new();
        // The file the one choice of CUDA libraries makes (already loaded, when the device
        // loaded the set), then the dynamic linker's names and the Python environments.
        let chosen = gradsync_core::device::libs::find_nccl(&gradsync_core::device::libs::Search::current());
        for c in chosen.into_iter().chain(candidates(&Env::current())) {
            let c = c.display().to_string();
            match Lib::open(&c) {
                Ok(lib) => return Ok(lib),
                Err(e) => tried.push(e),
            }
        }
        Err(format!(
            "libnccl.so.2 was not found (install NCCL, e.g. `pip install nvidia-nccl-cu13` or Debian's \
             libnccl2, or put its folder on LD_LIBRARY_PATH); tried: {}",
            tried.join("; ")
        ))
    })
    .as_ref()
    .map_err(|msg| CollectiveError::Nccl { op: "load", msg: msg.clone() })
}

/// What the search looks at, read from the environment (a value so tests can make their own).
#[derive(Debug, Clone, Default)]
pub struct Env {
    /// `$VIRTUAL_ENV`.
    pub virtual_env: Option<PathBuf>,
    /// `$CONDA_PREFIX`.
    pub conda_prefix: Option<PathBuf>,
    /// `$HOME`.
    pub home: Option<PathBuf>,
    /// Prefixes of system Pythons (`/usr/local`, `/usr`).
    pub system: Vec<PathBuf>,
}

impl Env {
    fn current() -> Env {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        Env {
            virtual_env: var("VIRTUAL_ENV"),
            conda_prefix: var("CONDA_PREFIX"),
            home: var("HOME"),
            system: vec![PathBuf::from("/usr/local"), PathBuf::from("/usr")],
        }
    }
}

/// Where to look for NCCL, in order: the names the dynamic linker resolves itself, then
/// `nvidia/nccl/lib/libnccl.so.2` in every site-packages of the Python environments in `env`
/// (a virtualenv, a conda environment, the user's `~/.local`, the system's), newest Python
/// first.
pub fn candidates(env: &Env) -> Vec<PathBuf> {
    let mut v = vec![PathBuf::from("libnccl.so.2"), PathBuf::from("libnccl.so")];
    let mut prefixes: Vec<PathBuf> = Vec::new();
    prefixes.extend(env.virtual_env.iter().cloned());
    prefixes.extend(env.conda_prefix.iter().cloned());
    prefixes.extend(env.home.iter().map(|h| h.join(".local")));
    prefixes.extend(env.system.iter().cloned());
    for prefix in prefixes {
        for site in site_packages(&prefix) {
            let lib = site.join("nvidia").join("nccl").join("lib").join("libnccl.so.2");
            if lib.is_file() && !v.contains(&lib) {
                v.push(lib);
            }
        }
    }
    v
}

/// `prefix/lib/python3.X/{site,dist}-packages` and Debian's `prefix/lib/python3/dist-packages`,
/// newest Python first.
fn site_packages(prefix: &Path) -> Vec<PathBuf> {
    let lib = prefix.join("lib");
    let mut pythons: Vec<(u32, PathBuf)> = std::fs::read_dir(&lib)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let minor = match name.strip_prefix("python3") {
                Some("") => 0,
                Some(rest) => rest.strip_prefix('.')?.parse().ok()?,
                None => return None,
            };
            Some((minor, e.path()))
        })
        .collect();
    pythons.sort_by_key(|p| std::cmp::Reverse(p.0));
    pythons
        .into_iter()
        .flat_map(|(_, p)| [p.join("site-packages"), p.join("dist-packages")])
        .filter(|p| p.is_dir())
        .collect()
}

/// An open NCCL group (`ncclGroupStart`); it is ended on every path, including an early
/// return in between, since an open group would hold back every later call of the thread.
#[derive(Debug)]
pub struct Group {
    lib: &'static Lib,
    open: bool,
}

impl Group {
    /// `ncclGroupStart`.
    pub fn start(lib: &'static Lib) -> Result<Group> {
        // SAFETY: no arguments.
        lib.check("ncclGroupStart", unsafe { (lib.group_start)() }, None)?;
        Ok(Group { lib, open: true })
    }

    /// `ncclGroupEnd`, with its result.
    pub fn end(mut self) -> Result<c_int> {
        self.open = false;
        // SAFETY: this thread's group, opened by `start`.
        let r = unsafe { (self.lib.group_end)() };
        if r == IN_PROGRESS { Ok(r) } else { self.lib.check("ncclGroupEnd", r, None).map(|()| r) }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if self.open {
            // SAFETY: as in `end`. Its result is moot: the caller is already returning an
            // error, which aborts the communicator.
            let _ = unsafe { (self.lib.group_end)() };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch folder, removed on drop.
    fn touch(p: &Path) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, b"").unwrap();
    }

    #[test]
    #[allow(clippy::unwrap_used)]
    fn nccl_is_looked_for_as_libnccl_so_2_and_in_python_environments() {
        let root = gradsync_testkit::Scratch::new("nccl-search");
        let venv = root.join("venv");
        let home = root.join("home");
        let sys = root.join("usr");
        // PyTorch's wheel layout in a virtualenv, two Pythons in ~/.local, Debian's layout.
        let in_venv = venv.join("lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2");
        let user_old = home.join(".local/lib/python3.9/site-packages/nvidia/nccl/lib/libnccl.so.2");
        let user_new = home.join(".local/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2");
        let debian = sys.join("lib/python3/dist-packages/nvidia/nccl/lib/libnccl.so.2");
        for p in [&in_venv, &user_old, &user_new, &debian] {
            touch(p);
        }
        // Not NCCL's layout: ignored.
        touch(&venv.join("lib/python3.11/site-packages/nvidia/cublas/lib/libnccl.so.2"));
        let env = Env { virtual_env: Some(venv), conda_prefix: None, home: Some(home), system: vec![sys] };
        let found = candidates(&env);
        assert_eq!(
            found,
            [PathBuf::from("libnccl.so.2"), PathBuf::from("libnccl.so"), in_venv, user_new, user_old, debian]
        );
    }

    #[test]
    fn a_missing_library_is_an_error_naming_what_was_tried() {
        let err = Lib::open("/nonexistent/libnccl.so.2").err().unwrap_or_default();
        assert!(err.contains("/nonexistent/libnccl.so.2"), "{err}");
    }
}
