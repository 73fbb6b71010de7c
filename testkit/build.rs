//! Builds the fake CUDA libraries (fake/*.c, and core's kernels compiled for the host) into
//! `$OUT_DIR/fake-cuda`, under the names cudarc and gradsync look for: `libcuda.so.1`,
//! `libcublas.so.13` with the `libcublasLt.so.13` it needs, and `libnccl.so.2` (the name NCCL
//! really has; gradsync must find it).

use std::path::{Path, PathBuf};
use std::process::Command;

fn run(mut cmd: Command) {
    let shown = format!("{cmd:?}");
    let status = cmd.status().unwrap_or_else(|e| panic!("cannot run {shown}: {e}"));
    assert!(status.success(), "{shown} failed ({status})");
}

/// Compile `sources` into the shared library `dir/soname`, linked against `libs` (paths).
fn shared(dir: &Path, soname: &str, sources: &[PathBuf], libs: &[PathBuf], defines: &[String]) {
    let out = dir.join(soname);
    let mut objects = Vec::new();
    for src in sources {
        let cpp = src.extension().is_some_and(|e| e == "cpp");
        let compiler = cc::Build::new().cpp(cpp).get_compiler();
        let obj = dir.join(format!("{}.o", src.file_name().and_then(|n| n.to_str()).unwrap_or("src")));
        let mut cmd = compiler.to_command();
        cmd.args(["-O2", "-g", "-fPIC", "-pthread", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"]);
        // The CPU backend rounds every multiply and add separately; so must the host kernels.
        cmd.arg("-ffp-contract=off");
        cmd.arg(if cpp { "-std=c++20" } else { "-std=gnu11" });
        cmd.args(defines).arg("-c").arg(src).arg("-o").arg(&obj);
        run(cmd);
        objects.push(obj);
    }
    let mut link = cc::Build::new().cpp(true).get_compiler().to_command();
    link.args(["-shared", "-pthread", &format!("-Wl,-soname,{soname}"), "-o"]).arg(&out);
    link.args(&objects).args(libs);
    // Find the fake libcuda next to the library that needs it.
    link.arg("-Wl,-rpath,$ORIGIN");
    run(link);
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("fake-cuda");
    std::fs::create_dir_all(&out).expect("create the fake-cuda folder");
    let fake = manifest.join("fake");
    let kernels = manifest.join("../core/src/device/cuda_kernels.cu");
    for f in
        ["fake.h", "kernels.h", "cuda_host.h", "cuda.c", "kernels.cpp", "cublas.c", "cublaslt.c", "nccl.c"]
    {
        println!("cargo::rerun-if-changed={}", fake.join(f).display());
    }
    println!("cargo::rerun-if-changed={}", kernels.display());

    let kernels = kernels.canonicalize().expect("core/src/device/cuda_kernels.cu exists");
    let include = format!("-I{}", fake.display());
    let defines = vec![include, format!("-DGRADSYNC_KERNELS_SOURCE=\"{}\"", kernels.display())];
    shared(&out, "libcuda.so.1", &[fake.join("cuda.c"), fake.join("kernels.cpp")], &[], &defines);
    let cuda = vec![out.join("libcuda.so.1")];
    shared(&out, "libcublasLt.so.13", &[fake.join("cublaslt.c")], &[], &defines);
    let blas_needs = vec![out.join("libcuda.so.1"), out.join("libcublasLt.so.13")];
    shared(&out, "libcublas.so.13", &[fake.join("cublas.c")], &blas_needs, &defines);
    shared(&out, "libnccl.so.2", &[fake.join("nccl.c")], &cuda, &defines);
    // cudarc tries the unversioned names first; they must find the fake, not a system library.
    // NCCL deliberately has no such link: gradsync itself must find libnccl.so.2.
    for (link, target) in [
        ("libcuda.so", "libcuda.so.1"),
        ("libcublas.so", "libcublas.so.13"),
        ("libcublasLt.so", "libcublasLt.so.13"),
    ] {
        let link = out.join(link);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(target, &link).expect("link the fake library's unversioned name");
    }
    println!("cargo::rustc-env=GRADSYNC_FAKE_CUDA_DIR={}", out.display());
}
