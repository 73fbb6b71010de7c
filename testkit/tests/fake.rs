//! The fake CUDA catches what it promises to catch. Each scenario runs in a child process (the
//! fake ends a process on a bad access), calling the fake libraries directly as cudarc would,
//! and the parent checks how the child ended and what the fake said.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ffi::c_void;
use std::process::Command;

use gradsync_testkit::fake_cuda_dir;
use libloading::{Library, Symbol};

const SCENARIO: &str = "GRADSYNC_FAKE_SCENARIO";

type Res = i32;

/// The fake driver with a context current on device 0.
struct Driver {
    lib: Library,
}

impl Driver {
    fn open() -> Driver {
        // SAFETY: the fake's initialisers expect nothing.
        let lib = unsafe { Library::new(fake_cuda_dir().join("libcuda.so.1")) }.unwrap();
        let d = Driver { lib };
        assert_eq!(unsafe { d.f::<unsafe extern "C" fn(u32) -> Res>("cuInit")(0) }, 0);
        let mut ctx: *mut c_void = std::ptr::null_mut();
        assert_eq!(
            unsafe {
                d.f::<unsafe extern "C" fn(*mut *mut c_void, i32) -> Res>("cuDevicePrimaryCtxRetain")(
                    &mut ctx, 0,
                )
            },
            0
        );
        assert_eq!(unsafe { d.f::<unsafe extern "C" fn(*mut c_void) -> Res>("cuCtxSetCurrent")(ctx) }, 0);
        d
    }

    /// # Safety
    /// `T` is the function's C signature.
    unsafe fn f<T>(&self, name: &str) -> Symbol<'_, T> {
        unsafe { self.lib.get(name.as_bytes()) }.unwrap()
    }

    fn alloc(&self, bytes: usize) -> u64 {
        let mut p = 0u64;
        assert_eq!(
            unsafe { self.f::<unsafe extern "C" fn(*mut u64, usize) -> Res>("cuMemAlloc_v2")(&mut p, bytes) },
            0
        );
        p
    }

    fn free(&self, p: u64) {
        assert_eq!(unsafe { self.f::<unsafe extern "C" fn(u64) -> Res>("cuMemFree_v2")(p) }, 0);
    }

    fn htod(&self, p: u64, src: &[u8]) -> Res {
        unsafe {
            self.f::<unsafe extern "C" fn(u64, *const c_void, usize) -> Res>("cuMemcpyHtoD_v2")(
                p,
                src.as_ptr().cast(),
                src.len(),
            )
        }
    }

    fn dtoh(&self, dst: &mut [u8], p: u64) -> Res {
        unsafe {
            self.f::<unsafe extern "C" fn(*mut c_void, u64, usize) -> Res>("cuMemcpyDtoH_v2")(
                dst.as_mut_ptr().cast(),
                p,
                dst.len(),
            )
        }
    }
}

/// Run `scenario` in a child; returns (exit code, stderr).
fn child(scenario: &str) -> (Option<i32>, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["run_scenario", "--exact", "--nocapture", "--test-threads", "1"])
        .env(SCENARIO, scenario)
        .output()
        .unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The scenario named by the environment (only in the child).
#[test]
fn run_scenario() {
    let Ok(scenario) = std::env::var(SCENARIO) else { return };
    let d = Driver::open();
    match scenario.as_str() {
        "clean" => {
            let p = d.alloc(64);
            assert_eq!(d.htod(p, &[1; 64]), 0);
            let mut back = [0u8; 64];
            assert_eq!(d.dtoh(&mut back, p), 0);
            assert_eq!(back, [1; 64]);
            d.free(p);
        }
        "out_of_bounds_copy" => {
            let p = d.alloc(16);
            d.htod(p + 4, &[0; 16]);
        }
        "use_after_free" => {
            let p = d.alloc(16);
            d.free(p);
            d.dtoh(&mut [0; 4], p);
        }
        "double_free" => {
            let p = d.alloc(16);
            d.free(p);
            d.free(p);
        }
        "leak" => {
            d.alloc(16);
        }
        "kernel_past_the_end" => {
            // The project's `scale` kernel told the buffer is longer than it is.
            let ptx = c".version 8.0\n.entry scale(\n";
            let mut module: *mut c_void = std::ptr::null_mut();
            let load = unsafe {
                d.f::<unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> Res>("cuModuleLoadData")
            };
            assert_eq!(unsafe { load(&mut module, ptx.as_ptr().cast()) }, 0);
            let mut f: *mut c_void = std::ptr::null_mut();
            let get = unsafe {
                d.f::<unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const i8) -> Res>(
                    "cuModuleGetFunction",
                )
            };
            assert_eq!(unsafe { get(&mut f, module, c"scale".as_ptr()) }, 0);
            let (v, n, factor) = (d.alloc(40), 11u64, 2.0f32);
            let mut params: [*mut c_void; 3] = [
                (&v as *const u64).cast_mut().cast(),
                (&n as *const u64).cast_mut().cast(),
                (&factor as *const f32).cast_mut().cast(),
            ];
            type Launch = unsafe extern "C" fn(
                *mut c_void,
                u32,
                u32,
                u32,
                u32,
                u32,
                u32,
                u32,
                *mut c_void,
                *mut *mut c_void,
                *mut *mut c_void,
            ) -> Res;
            let launch = unsafe { d.f::<Launch>("cuLaunchKernel") };
            unsafe {
                launch(
                    f,
                    1,
                    1,
                    1,
                    32,
                    1,
                    1,
                    0,
                    std::ptr::null_mut(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
        }
        "gemm_bad_lda" => {
            // SAFETY: the fake cuBLAS' initialisers expect nothing.
            let blas = unsafe { Library::new(fake_cuda_dir().join("libcublas.so.13")) }.unwrap();
            let mut h: *mut c_void = std::ptr::null_mut();
            let create: Symbol<unsafe extern "C" fn(*mut *mut c_void) -> Res> =
                unsafe { blas.get(b"cublasCreate_v2") }.unwrap();
            assert_eq!(unsafe { create(&mut h) }, 0);
            type Sgemm = unsafe extern "C" fn(
                *mut c_void,
                i32,
                i32,
                i32,
                i32,
                i32,
                *const f32,
                u64,
                i32,
                u64,
                i32,
                *const f32,
                u64,
                i32,
            ) -> Res;
            let sgemm: Symbol<Sgemm> = unsafe { blas.get(b"cublasSgemm_v2") }.unwrap();
            let (a, b, c) = (d.alloc(4 * 12), d.alloc(4 * 12), d.alloc(4 * 12));
            let (one, zero) = (1.0f32, 0.0f32);
            // m = 4, n = 3, k = 3, op N: lda must be at least 4.
            let r = unsafe { sgemm(h, 0, 0, 4, 3, 3, &one, a, 3, b, 3, &zero, c, 4) };
            assert_eq!(r, 7, "CUBLAS_STATUS_INVALID_VALUE");
            for p in [a, b, c] {
                d.free(p);
            }
        }
        other => panic!("unknown scenario {other}"),
    }
}

#[test]
fn a_clean_run_passes_and_reports_its_counters() {
    let (code, err) = child("clean");
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("allocations=1 ") && err.contains("alive_at_exit=0"), "{err}");
}

#[test]
fn bad_accesses_end_the_process_naming_the_allocation() {
    for (scenario, says) in [
        ("out_of_bounds_copy", "out of bounds: 16 bytes at offset 4 of allocation #1, which holds 16 bytes"),
        ("use_after_free", "use after free"),
        ("double_free", "double free"),
        ("kernel_past_the_end", "past the end of allocation #1 (40 bytes)"),
    ] {
        let (code, err) = child(scenario);
        assert_ne!(code, Some(0), "{scenario}: the child should have died\n{err}");
        assert!(err.contains("fake-cuda: FATAL") && err.contains(says), "{scenario}: {err}");
    }
}

#[test]
fn an_allocation_alive_at_exit_fails_the_process() {
    let (code, err) = child("leak");
    assert_eq!(code, Some(86), "{err}");
    assert!(err.contains("LEAK: allocation #1 (16 bytes) was never freed"), "{err}");
}

#[test]
fn blas_argument_rules_are_enforced() {
    let (code, err) = child("gemm_bad_lda");
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("lda < max(1, rows of A) (3 < 4)"), "{err}");
}
