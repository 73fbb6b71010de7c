//! The CUDA device through cudarc, with the driver, cuBLAS and NVRTC loaded at run time.

use crate::error::{Error, Result};

/// Check that CUDA device `ordinal` can be used, without letting cudarc panic on a machine
/// that lacks the driver library. Returns the device's name.
pub fn probe(ordinal: usize) -> Result<String> {
    // SAFETY: only tries to dlopen the driver library; no CUDA call is made.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(Error::NoCuda("libcuda (the NVIDIA driver library) was not found".into()));
    }
    let attempt = std::panic::catch_unwind(|| -> Result<String> {
        let ctx = cudarc::driver::CudaContext::new(ordinal)
            .map_err(|e| Error::NoCuda(format!("cannot open cuda:{ordinal}: {e}")))?;
        ctx.name().map_err(|e| Error::NoCuda(format!("cuda:{ordinal}: {e}")))
    });
    attempt.unwrap_or_else(|_| Err(Error::NoCuda("the CUDA driver failed to load".into())))
}
