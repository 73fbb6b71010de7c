//! The CUDA libraries gradsync uses (cuBLAS with its cuBLASLt, NVRTC, NCCL): one consistent
//! set, chosen here and nowhere else, loaded by absolute path, and recorded.
//!
//! Why: with PyTorch's library folders first on `LD_LIBRARY_PATH`, a worker once ran the CUDA
//! toolkit's `libcublas.so` and `libnvrtc.so` (cudarc asks for the unversioned names first,
//! and only the toolkit has them) with PyTorch's `libcublasLt.so.13` (what the dynamic linker
//! found for cuBLAS's own dependency, searching `LD_LIBRARY_PATH` first): two releases in one
//! process.
//!
//! How each library is found ([`plan`]):
//! 1. `GRADSYNC_CUDA_LIBS` ([`ENV`]), a folder, when set: cuBLAS must be there, and cuBLASLt
//!    beside it; NVRTC and NCCL are taken from it when there, else found as below.
//! 2. The folders of `LD_LIBRARY_PATH` in order, then the usual toolkit folders
//!    ([`TOOLKIT_DIRS`]). cuBLAS and NVRTC are looked for as the dynamic linker looks for the
//!    names cudarc opens: each name in cudarc's order (`libcublas.so` before `libcublas.so.13`)
//!    in every folder before the next name, so that the file chosen is the file cudarc's own
//!    `dlopen` by name reaches. cuBLASLt must be in cuBLAS's folder: a folder with cuBLAS and
//!    without cuBLASLt is refused, by name. NCCL (`libnccl.so.2`) is the first found, folder by
//!    folder.
//!
//! [`load`] then opens cuBLASLt, cuBLAS, NVRTC's builtins, NVRTC and NCCL by absolute path
//! (`RTLD_NOW | RTLD_GLOBAL`) before cudarc opens anything: a later `dlopen` by a name that is
//! one of these libraries' sonames (cuBLAS's dependency `libcublasLt.so.13`, NVRTC's
//! `libnvrtc-builtins.so.13.0`, NCCL's `libnccl.so.2`) resolves to the library already loaded.
//! cudarc's first names are unversioned, though, and those the linker looks up by file; so
//! [`load`] finally opens them exactly as cudarc will and checks that they reach the same
//! library, refusing, with both paths named, a set that would come from two places.
//!
//! The result ([`CudaLibs`]: each library's path and version) goes into the worker's start
//! line and the metrics header. Loading is once per process, as the dynamic linker's state is.

use std::ffi::{CString, c_int, c_void};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The environment variable naming the folder to take the CUDA libraries from.
pub const ENV: &str = "GRADSYNC_CUDA_LIBS";

/// Where CUDA toolkits and distributions put the libraries, searched after `LD_LIBRARY_PATH`.
pub const TOOLKIT_DIRS: &[&str] = &[
    "/usr/local/cuda/lib64",
    "/usr/local/cuda/targets/x86_64-linux/lib",
    "/usr/local/cuda/targets/sbsa-linux/lib",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
];

/// One library of the set.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LibInfo {
    /// The file opened.
    pub path: PathBuf,
    /// Its version as the library reports it (`cublasGetProperty`, `cublasLtGetVersion`,
    /// `nvrtcVersion`, `ncclGetVersion`), else the file's own version suffix; `None` if
    /// neither says.
    pub version: Option<String>,
}

impl fmt::Display for LibInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.version {
            Some(v) => write!(f, "{v} ({})", self.path.display()),
            None => write!(f, "version unknown ({})", self.path.display()),
        }
    }
}

/// The CUDA libraries this process loaded.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CudaLibs {
    /// cuBLAS.
    pub cublas: LibInfo,
    /// cuBLASLt, from cuBLAS's folder.
    pub cublas_lt: LibInfo,
    /// NVRTC.
    pub nvrtc: LibInfo,
    /// NCCL, when one was found.
    pub nccl: Option<LibInfo>,
}

impl fmt::Display for CudaLibs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cuBLAS {}, cuBLASLt {}, NVRTC {}", self.cublas, self.cublas_lt, self.nvrtc)?;
        match &self.nccl {
            Some(n) => write!(f, ", NCCL {n}"),
            None => f.write_str(", no NCCL"),
        }
    }
}

/// What the search looks at (a value, so that tests make their own).
#[derive(Debug, Clone, Default)]
pub struct Search {
    /// [`ENV`], when set.
    pub explicit: Option<PathBuf>,
    /// `LD_LIBRARY_PATH`'s folders in order, then [`TOOLKIT_DIRS`].
    pub dirs: Vec<PathBuf>,
}

impl Search {
    /// This process's search.
    pub fn current() -> Search {
        let explicit = std::env::var_os(ENV).filter(|v| !v.is_empty()).map(PathBuf::from);
        let mut dirs: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
            .map(|v| std::env::split_paths(&v).filter(|p| !p.as_os_str().is_empty()).collect())
            .unwrap_or_default();
        dirs.extend(TOOLKIT_DIRS.iter().map(PathBuf::from));
        Search { explicit, dirs }
    }
}

/// The files chosen, not yet loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// cuBLAS.
    pub cublas: PathBuf,
    /// cuBLASLt, in cuBLAS's folder.
    pub cublas_lt: PathBuf,
    /// NVRTC.
    pub nvrtc: PathBuf,
    /// NVRTC's builtins, in NVRTC's folder, when there (NVRTC opens them by soname).
    pub nvrtc_builtins: Option<PathBuf>,
    /// NCCL.
    pub nccl: Option<PathBuf>,
}

/// The names cudarc opens `lib` by, in its order (`libcublas.so`, ..., `libcublas.so.13`, ...).
fn names(lib: &str) -> Vec<String> {
    cudarc::get_lib_name_candidates(lib)
}

/// The first of `names` present in `dir`.
fn in_dir(dir: &Path, names: &[String]) -> Option<PathBuf> {
    names.iter().map(|n| dir.join(n)).find(|p| p.is_file())
}

/// Each name in turn, in every folder before the next name: the dynamic linker's order for
/// the names cudarc tries one after the other.
fn as_the_linker_would(dirs: &[PathBuf], names: &[String]) -> Option<PathBuf> {
    names.iter().find_map(|n| dirs.iter().map(|d| d.join(n)).find(|p| p.is_file()))
}

fn refused(why: String) -> Error {
    Error::NoCuda(format!("CUDA libraries: {why}"))
}

/// Choose the files, by the order in the module's documentation.
pub fn plan(s: &Search) -> Result<Plan> {
    let blas_names = names("cublas");
    let (cublas, how) = match &s.explicit {
        Some(dir) => {
            let found = in_dir(dir, &blas_names).ok_or_else(|| {
                refused(format!(
                    "{ENV}={} holds no cuBLAS (looked for {})",
                    dir.display(),
                    blas_names.join(", ")
                ))
            })?;
            (found, format!("{ENV}={}", dir.display()))
        }
        None => {
            let found = as_the_linker_would(&s.dirs, &blas_names).ok_or_else(|| {
                refused(format!(
                    "no cuBLAS (libcublas.so or libcublas.so.N) in {} (set {ENV} to the folder holding it)",
                    list(&s.dirs)
                ))
            })?;
            (found, "the search".to_string())
        }
    };
    let dir = cublas.parent().map(Path::to_path_buf).unwrap_or_default();
    let cublas_lt = in_dir(&dir, &names("cublasLt")).ok_or_else(|| {
        refused(format!(
            "{} (chosen by {how}) holds {} but no libcublasLt beside it; cuBLAS and cuBLASLt must \
             come from one folder (set {ENV} to a folder holding both)",
            dir.display(),
            file_name(&cublas)
        ))
    })?;
    let explicit: Vec<PathBuf> = s.explicit.iter().cloned().collect();
    let nvrtc_names = names("nvrtc");
    let nvrtc = in_dir_list(&explicit, &nvrtc_names)
        .or_else(|| as_the_linker_would(&s.dirs, &nvrtc_names))
        .ok_or_else(|| {
        refused(format!("no NVRTC (libnvrtc.so or libnvrtc.so.N) in {}", list(&s.dirs)))
    })?;
    let nvrtc_builtins = nvrtc.parent().and_then(builtins_in);
    let nccl_names = ["libnccl.so.2".to_string(), "libnccl.so".to_string()];
    let nccl = explicit.iter().chain(&s.dirs).find_map(|d| in_dir(d, &nccl_names));
    Ok(Plan { cublas, cublas_lt, nvrtc, nvrtc_builtins, nccl })
}

/// The NCCL file the search chooses, if any (the NCCL loader tries it first).
pub fn find_nccl(s: &Search) -> Option<PathBuf> {
    let nccl_names = ["libnccl.so.2".to_string(), "libnccl.so".to_string()];
    s.explicit.iter().chain(&s.dirs).find_map(|d| in_dir(d, &nccl_names))
}

fn in_dir_list(dirs: &[PathBuf], names: &[String]) -> Option<PathBuf> {
    dirs.iter().find_map(|d| in_dir(d, names))
}

/// `libnvrtc-builtins.so.X.Y` in `dir` (not the `.alt` variant), else the unversioned name.
fn builtins_in(dir: &Path) -> Option<PathBuf> {
    let mut versioned: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| file_name(p).starts_with("libnvrtc-builtins.so.") && p.is_file())
        .collect();
    versioned.sort();
    versioned.pop().or_else(|| Some(dir.join("libnvrtc-builtins.so")).filter(|p| p.is_file()))
}

fn file_name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

fn list(dirs: &[PathBuf]) -> String {
    if dirs.is_empty() {
        return "no folder".into();
    }
    dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
}

/// The version in a library file's name once links are followed (`libcublas.so.13.1.0.3`:
/// `13.1.0.3`).
fn version_of_file(path: &Path) -> Option<String> {
    let real = std::fs::canonicalize(path).ok()?;
    let name = file_name(&real);
    let (_, v) = name.split_once(".so.")?;
    (!v.is_empty()).then(|| v.to_string())
}

/// The libraries, kept open for the life of the process, and what they are.
struct Loaded {
    _libs: Vec<libloading::Library>,
    info: CudaLibs,
}

/// Open `path` with `RTLD_NOW | RTLD_GLOBAL`, so that later lookups by soname find it.
fn open_global(path: &Path) -> Result<libloading::Library> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading a CUDA library runs its initialisers, which expect nothing of us.
    unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }
        .map(libloading::Library::from)
        .map_err(|e| refused(format!("cannot load {}: {e}", path.display())))
}

/// The address of `symbol` in `lib`, if it has one.
fn address(lib: &libloading::Library, symbol: &str) -> Option<usize> {
    let name = CString::new(symbol).ok()?;
    // SAFETY: only the symbol's address is read, never called through.
    unsafe { lib.get::<*const c_void>(name.as_bytes_with_nul()) }.ok().map(|s| *s as usize)
}

/// The file the object holding `addr` was loaded from.
fn file_holding(addr: usize) -> Option<PathBuf> {
    let mut info: libc::Dl_info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: dladdr only reads the loader's tables and fills `info`.
    let found = unsafe { libc::dladdr(addr as *const c_void, &mut info) };
    if found == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated string owned by the loader, valid while the object is loaded.
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(name.to_string_lossy().into_owned()))
}

/// Check that cudarc, opening `lib` by its names in its order, reaches `ours` (loaded from
/// `path`): the first name that opens at all is the library cudarc will use.
fn reached_by_name(lib: &str, symbol: &str, ours: &libloading::Library, path: &Path) -> Result<()> {
    let Some(want) = address(ours, symbol) else {
        return Err(refused(format!("{} lacks {symbol}", path.display())));
    };
    for name in names(lib) {
        // SAFETY: as cudarc itself will; the library is already loaded or its initialisers
        // expect nothing of us.
        let Ok(other) = (unsafe { libloading::Library::new(&name) }) else { continue };
        let got = address(&other, symbol);
        if got == Some(want) {
            return Ok(());
        }
        let elsewhere =
            got.and_then(file_holding).map_or_else(|| "another file".into(), |p| p.display().to_string());
        return Err(refused(format!(
            "{} was chosen, but cudarc opens {lib} by the name {name} first and the dynamic linker \
             finds {elsewhere} for it: two {lib} libraries in one process. Put the chosen folder first \
             on LD_LIBRARY_PATH with a {name} link in it, or set {ENV} to the folder of {elsewhere}",
            path.display()
        )));
    }
    Ok(())
}

/// `cublasGetProperty(MAJOR_VERSION|MINOR_VERSION|PATCH_LEVEL)`.
fn cublas_version(lib: &libloading::Library) -> Option<String> {
    // SAFETY: the signature of cublasGetProperty in cublas_api.h.
    let get = unsafe { lib.get::<unsafe extern "C" fn(c_int, *mut c_int) -> c_int>(b"cublasGetProperty\0") }
        .ok()?;
    let mut v = [0 as c_int; 3];
    for (t, out) in v.iter_mut().enumerate() {
        // SAFETY: a property type (0, 1, 2) and a live out-pointer.
        if unsafe { get(t as c_int, out) } != 0 {
            return None;
        }
    }
    Some(format!("{}.{}.{}", v[0], v[1], v[2]))
}

/// `cublasLtGetVersion()`: major * 10000 + minor * 100 + patch.
fn cublas_lt_version(lib: &libloading::Library) -> Option<String> {
    // SAFETY: the signature of cublasLtGetVersion in cublasLt.h.
    let get = unsafe { lib.get::<unsafe extern "C" fn() -> usize>(b"cublasLtGetVersion\0") }.ok()?;
    // SAFETY: no arguments.
    let v = unsafe { get() };
    Some(format!("{}.{}.{}", v / 10000, v % 10000 / 100, v % 100))
}

/// `nvrtcVersion(&major, &minor)`.
fn nvrtc_version(lib: &libloading::Library) -> Option<String> {
    // SAFETY: the signature of nvrtcVersion in nvrtc.h.
    let get = unsafe { lib.get::<unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int>(b"nvrtcVersion\0") }
        .ok()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two live out-pointers.
    (unsafe { get(&mut major, &mut minor) } == 0).then(|| format!("{major}.{minor}"))
}

/// `ncclGetVersion(&code)`: major * 10000 + minor * 100 + patch since NCCL 2.9.
fn nccl_version(lib: &libloading::Library) -> Option<String> {
    // SAFETY: the signature of ncclGetVersion in nccl.h.
    let get = unsafe { lib.get::<unsafe extern "C" fn(*mut c_int) -> c_int>(b"ncclGetVersion\0") }.ok()?;
    let mut code = 0;
    // SAFETY: a live out-pointer.
    if unsafe { get(&mut code) } != 0 {
        return None;
    }
    let (major, rest) = if code >= 10000 { (code / 10000, code % 10000) } else { (code / 1000, code % 1000) };
    Some(format!("{major}.{}.{}", rest / 100, rest % 100))
}

/// Load `plan`'s files, record them, and check that cudarc's own opening by name reaches them.
fn load_plan(plan: &Plan) -> Result<Loaded> {
    let info = |path: &Path, lib: &libloading::Library, v: fn(&libloading::Library) -> Option<String>| {
        LibInfo { path: path.to_path_buf(), version: v(lib).or_else(|| version_of_file(path)) }
    };
    let lt = open_global(&plan.cublas_lt)?;
    let blas = open_global(&plan.cublas)?;
    let builtins = plan.nvrtc_builtins.as_deref().map(open_global).transpose()?;
    let nvrtc = open_global(&plan.nvrtc)?;
    // NCCL is only needed by DDP over NCCL, whose loader names a file that will not load.
    let nccl = plan.nccl.as_deref().and_then(|p| open_global(p).ok().map(|l| (p, l)));
    reached_by_name("cublas", "cublasCreate_v2", &blas, &plan.cublas)?;
    reached_by_name("nvrtc", "nvrtcVersion", &nvrtc, &plan.nvrtc)?;
    let record = CudaLibs {
        cublas: info(&plan.cublas, &blas, cublas_version),
        cublas_lt: info(&plan.cublas_lt, &lt, cublas_lt_version),
        nvrtc: info(&plan.nvrtc, &nvrtc, nvrtc_version),
        nccl: nccl.as_ref().map(|(p, l)| info(p, l, nccl_version)),
    };
    let mut libs = vec![lt, blas, nvrtc];
    libs.extend(builtins);
    libs.extend(nccl.map(|(_, l)| l));
    Ok(Loaded { _libs: libs, info: record })
}

/// The outcome of the one attempt per process: the set, or why there is none.
static LOADED: OnceLock<std::result::Result<Loaded, String>> = OnceLock::new();

/// Choose and load the set (once per process; later calls return the first outcome).
pub fn load() -> Result<&'static CudaLibs> {
    LOADED
        .get_or_init(|| {
            plan(&Search::current()).and_then(|p| load_plan(&p)).map_err(|e| match e {
                Error::NoCuda(why) => why,
                other => other.to_string(),
            })
        })
        .as_ref()
        .map(|l| &l.info)
        .map_err(|why| Error::NoCuda(why.clone()))
}

/// The set, when [`load`] has loaded it.
pub fn loaded() -> Option<&'static CudaLibs> {
    LOADED.get().and_then(|r| r.as_ref().ok()).map(|l| &l.info)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(p: &Path) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, b"").unwrap();
    }

    #[test]
    fn a_folder_with_cublas_and_no_cublaslt_is_refused_by_name() {
        let root = gradsync_testkit::Scratch::new("libs-no-lt");
        let half = root.join("half");
        touch(&half.join("libcublas.so.13"));
        touch(&half.join("libnvrtc.so.13"));
        for s in [
            Search { explicit: Some(half.clone()), dirs: vec![] },
            Search { explicit: None, dirs: vec![half.clone()] },
        ] {
            let e = plan(&s).unwrap_err().to_string();
            assert!(
                e.contains(&half.display().to_string())
                    && e.contains("libcublas.so.13")
                    && e.contains("libcublasLt"),
                "{e}"
            );
        }
    }

    #[test]
    fn the_set_follows_the_names_cudarc_opens_folder_by_folder() {
        let root = gradsync_testkit::Scratch::new("libs-order");
        // As on the first GPU machine: PyTorch's wheel folder first, with versioned names only;
        // the toolkit later, with the unversioned names cudarc tries first.
        let (wheel, toolkit, nccl) = (root.join("wheel"), root.join("toolkit"), root.join("nccl"));
        for f in ["libcublas.so.13", "libcublasLt.so.13", "libnvrtc.so.13", "libnvrtc-builtins.so.13.0"] {
            touch(&wheel.join(f));
            touch(&toolkit.join(f));
        }
        for f in ["libcublas.so", "libcublasLt.so", "libnvrtc.so"] {
            touch(&toolkit.join(f));
        }
        touch(&nccl.join("libnccl.so.2"));
        let dirs = vec![wheel.clone(), nccl.clone(), toolkit.clone()];
        let p = plan(&Search { explicit: None, dirs: dirs.clone() }).unwrap();
        // cudarc's dlopen("libcublas.so") reaches the toolkit's: the whole set comes from there.
        assert_eq!(p.cublas, toolkit.join("libcublas.so"));
        assert_eq!(p.cublas_lt.parent(), Some(toolkit.as_path()));
        assert_eq!(p.nvrtc, toolkit.join("libnvrtc.so"));
        assert_eq!(p.nvrtc_builtins, Some(toolkit.join("libnvrtc-builtins.so.13.0")));
        assert_eq!(p.nccl, Some(nccl.join("libnccl.so.2")));
        // Without unversioned names anywhere, the first folder holding the versioned one.
        for f in ["libcublas.so", "libcublasLt.so", "libnvrtc.so"] {
            std::fs::remove_file(toolkit.join(f)).unwrap();
        }
        let p = plan(&Search { explicit: None, dirs: dirs.clone() }).unwrap();
        assert_eq!((p.cublas.parent(), p.cublas_lt.parent()), (Some(wheel.as_path()), Some(wheel.as_path())));
        assert_eq!(p.nvrtc, wheel.join("libnvrtc.so.13"));
        // The folder given comes first, for every library it holds.
        touch(&toolkit.join("libnccl.so.2"));
        let p = plan(&Search { explicit: Some(toolkit.clone()), dirs }).unwrap();
        for f in [&p.cublas, &p.cublas_lt, &p.nvrtc, p.nccl.as_ref().unwrap()] {
            assert_eq!(f.parent(), Some(toolkit.as_path()), "{f:?}");
        }
    }

    #[test]
    fn nothing_found_names_every_folder() {
        let root = gradsync_testkit::Scratch::new("libs-none");
        let e = plan(&Search { explicit: None, dirs: vec![root.join("a"), root.join("b")] })
            .unwrap_err()
            .to_string();
        assert!(e.contains(&root.join("a").display().to_string()) && e.contains(ENV), "{e}");
    }

    #[test]
    fn a_file_names_its_version() {
        let root = gradsync_testkit::Scratch::new("libs-version");
        touch(&root.join("libcublas.so.13.1.0.3"));
        std::os::unix::fs::symlink(root.join("libcublas.so.13.1.0.3"), root.join("libcublas.so")).unwrap();
        assert_eq!(version_of_file(&root.join("libcublas.so")).as_deref(), Some("13.1.0.3"));
    }
}
