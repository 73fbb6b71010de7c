//! Compiling `cuda_kernels.cu` with NVRTC, and choosing what to compile it to.
//!
//! PTX is not enough on its own: the driver JIT-compiles PTX and refuses a PTX ISA newer than
//! itself, and NVRTC writes the newest ISA it knows (NVRTC 13.2 writes PTX 9.2, which a CUDA
//! 13.0 driver refuses). Machine code (a cubin) for the device's own architecture needs no JIT,
//! and CUDA's minor-version compatibility lets a 13.0 driver run cubins from any 13.x NVRTC. So
//! [`targets`] asks for a cubin for the device's `sm_XY` first, and PTX for the newest
//! architecture NVRTC knows that the device can run as the fallback (a device newer than
//! NVRTC, or a cubin the driver refuses).

use std::ffi::{CStr, CString, c_char, c_int};

use cudarc::nvrtc::result;
use cudarc::nvrtc::sys;

use crate::error::{Error, Result};

/// The kernels' source.
pub(crate) const KERNELS_SRC: &str = include_str!("cuda_kernels.cu");

/// What NVRTC is asked to produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelTarget {
    /// Machine code for this architecture (`90` is `sm_90`); loaded without JIT.
    Cubin(u32),
    /// PTX for this virtual architecture (`compute_90`), JIT-compiled by the driver on load.
    Ptx(u32),
}

impl std::fmt::Display for KernelTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KernelTarget::Cubin(a) => write!(f, "cubin for sm_{a}"),
            KernelTarget::Ptx(a) => write!(f, "PTX for compute_{a}"),
        }
    }
}

/// What to compile for a device of compute capability `arch` (`major * 10 + minor`), given the
/// architectures NVRTC supports, in the order to try: the device's own cubin when NVRTC knows
/// its architecture, then PTX for the newest supported architecture not above the device's
/// (PTX runs on any device at least as new as its target). Empty when NVRTC knows nothing the
/// device can run.
pub fn targets(arch: u32, supported: &[u32]) -> Vec<KernelTarget> {
    let mut v = Vec::new();
    if supported.contains(&arch) {
        v.push(KernelTarget::Cubin(arch));
    }
    if let Some(&ptx) = supported.iter().filter(|&&a| a <= arch).max() {
        v.push(KernelTarget::Ptx(ptx));
    }
    v
}

fn nvrtc_err(op: &'static str) -> impl FnOnce(result::NvrtcError) -> Error {
    move |e| Error::Cuda { op, msg: format!("{e:?}") }
}

/// NVRTC's version, `(major, minor)`.
pub fn version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-pointers to live integers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }.result().map_err(nvrtc_err("nvrtcVersion"))?;
    Ok((major, minor))
}

/// The real architectures NVRTC can compile for (`[75, 80, ..., 120]`).
pub fn supported_archs() -> Result<Vec<u32>> {
    let mut n: c_int = 0;
    // SAFETY: an out-pointer to a live integer.
    unsafe { sys::nvrtcGetNumSupportedArchs(&mut n) }.result().map_err(nvrtc_err("nvrtc archs"))?;
    let mut archs = vec![0 as c_int; usize::try_from(n).unwrap_or(0)];
    // SAFETY: `archs` holds the number of entries NVRTC just reported.
    unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }.result().map_err(nvrtc_err("nvrtc archs"))?;
    Ok(archs.into_iter().filter_map(|a| u32::try_from(a).ok()).collect())
}

/// A compiled module: the image to load (PTX text with its NUL, or a cubin) and NVRTC's log.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The image for `cuModuleLoadData`.
    pub image: Vec<u8>,
    /// NVRTC's log (warnings, and ptxas' report when asked for with `-Xptxas -v`).
    pub log: String,
}

/// An NVRTC program, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by create_program and is destroyed once, here.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

impl Program {
    fn log(&self) -> String {
        // SAFETY: a live program.
        match unsafe { result::get_program_log(self.0) } {
            // SAFETY: NVRTC's log is NUL-terminated.
            Ok(log) if !log.is_empty() => {
                unsafe { CStr::from_ptr(log.as_ptr()) }.to_string_lossy().into_owned()
            }
            _ => String::new(),
        }
    }

    /// The output of a finished compile, through the size and copy functions given.
    fn output(
        &self,
        op: &'static str,
        size: unsafe fn(sys::nvrtcProgram, *mut usize) -> sys::nvrtcResult,
        copy: unsafe fn(sys::nvrtcProgram, *mut c_char) -> sys::nvrtcResult,
    ) -> Result<Vec<u8>> {
        let mut n = 0usize;
        // SAFETY: a live, compiled program and an out-pointer to a live usize.
        unsafe { size(self.0, &mut n) }.result().map_err(nvrtc_err(op))?;
        let mut buf = vec![0u8; n];
        // SAFETY: `buf` holds the size NVRTC just reported.
        unsafe { copy(self.0, buf.as_mut_ptr().cast()) }.result().map_err(nvrtc_err(op))?;
        Ok(buf)
    }
}

/// Compile the kernels for `target`, with `extra` options after gradsync's own. Needs libnvrtc
/// (not a GPU); the caller checks that it can be loaded.
pub fn compile(target: KernelTarget, extra: &[&str]) -> Result<Compiled> {
    let src = CString::new(KERNELS_SRC).map_err(|_| Error::invalid("kernels", "NUL in cuda_kernels.cu"))?;
    let name = c"gradsync_kernels.cu";
    let prog = Program(result::create_program(&src, Some(name)).map_err(nvrtc_err("nvrtc create"))?);
    let arch = match target {
        KernelTarget::Cubin(a) => format!("--gpu-architecture=sm_{a}"),
        KernelTarget::Ptx(a) => format!("--gpu-architecture=compute_{a}"),
    };
    // No FMA contraction: the kernels then round exactly as the CPU backend does.
    let mut opts = vec![arch.as_str(), "--fmad=false"];
    opts.extend_from_slice(extra);
    // SAFETY: a live program; the options are plain strings.
    let compiled = unsafe { result::compile_program(prog.0, &opts) };
    let log = prog.log();
    if let Err(e) = compiled {
        return Err(Error::Cuda { op: "nvrtc compile", msg: format!("{target}: {e:?}: {log}") });
    }
    let image = match target {
        KernelTarget::Cubin(_) => prog.output("nvrtc cubin", sys::nvrtcGetCUBINSize, sys::nvrtcGetCUBIN)?,
        KernelTarget::Ptx(_) => prog.output("nvrtc ptx", sys::nvrtcGetPTXSize, sys::nvrtcGetPTX)?,
    };
    Ok(Compiled { image, log })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_known_device_gets_its_cubin_then_ptx() {
        let nvrtc_13 = [75, 80, 86, 87, 89, 90, 100, 103, 110, 120, 121];
        assert_eq!(targets(90, &nvrtc_13), [KernelTarget::Cubin(90), KernelTarget::Ptx(90)]);
        assert_eq!(targets(80, &nvrtc_13), [KernelTarget::Cubin(80), KernelTarget::Ptx(80)]);
    }

    #[test]
    fn a_device_newer_than_nvrtc_gets_the_newest_ptx_it_can_run() {
        // A compute capability 13.0 device with NVRTC 13: no cubin, PTX for sm_121 runs there.
        assert_eq!(targets(130, &[75, 80, 90, 120, 121]), [KernelTarget::Ptx(121)]);
        // An sm_91 device: not in the list, so PTX for the newest below it.
        assert_eq!(targets(91, &[80, 90, 100]), [KernelTarget::Ptx(90)]);
    }

    #[test]
    fn a_device_older_than_every_supported_arch_gets_nothing() {
        assert_eq!(targets(70, &[75, 80, 90]), []);
    }
}
