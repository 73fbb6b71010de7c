//! Devices: which one to use (`--device auto|cpu|cuda[:N]`), and the [`Backend`] trait each
//! implements. CUDA code is always compiled; cudarc loads the driver and libraries at run time,
//! so a machine without CUDA builds, runs on the CPU, and gets an error value (never a panic)
//! when it asks for a GPU. Which CUDA libraries are loaded is decided in one place, [`libs`].

mod backend;
mod cpu;
#[cfg(target_arch = "x86_64")]
mod cpu_conv;
mod cpu_gemm;
mod cpu_layers;
mod cpu_winograd;
pub mod cuda;
pub mod libs;
pub mod nvrtc;
pub(crate) mod staging;

use std::fmt;
use std::str::FromStr;

pub use backend::{Backend, ChannelSum, NormConfig, Window};
pub use cpu::{CPU_CONV_VAR, Cpu, WINOGRAD_FROM, cpu_conv_products};
pub use cuda::{Cuda, GpuBuf, GpuEvent, GpuLabels, GpuStream, GpuView, GpuViewMut, HalfCast, RawStream};

use crate::error::{Error, Result};

/// What the user asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceRequest {
    /// The first GPU if one can be used, else the CPU (with a one-line notice).
    #[default]
    Auto,
    /// The CPU.
    Cpu,
    /// CUDA device `N`; an error if it cannot be used.
    Cuda(usize),
}

impl FromStr for DeviceRequest {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(DeviceRequest::Auto),
            "cpu" => Ok(DeviceRequest::Cpu),
            "cuda" | "gpu" => Ok(DeviceRequest::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceRequest::Cuda(n)),
                _ => Err(Error::invalid("device", format!("'{s}' (expected auto, cpu, cuda or cuda:N)"))),
            },
        }
    }
}

impl fmt::Display for DeviceRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceRequest::Auto => f.write_str("auto"),
            DeviceRequest::Cpu => f.write_str("cpu"),
            DeviceRequest::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// A resolved device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The CPU with a pool of this many threads.
    Cpu {
        /// Worker threads for GEMMs and elementwise kernels.
        threads: usize,
    },
    /// CUDA device `ordinal`.
    Cuda {
        /// The device's index.
        ordinal: usize,
    },
}

impl Device {
    /// The devices of `replicas` replicas started from this one, as DataParallel spreads
    /// them: every replica on the CPU's pool, or one GPU after another from this one, around
    /// the GPUs that open (several replicas share a GPU when there are fewer).
    pub fn spread(self, replicas: usize) -> Vec<Device> {
        match self {
            Device::Cpu { threads } => vec![Device::Cpu { threads }; replicas],
            Device::Cuda { ordinal } => {
                let opened = (0..64).take_while(|&i| cuda::probe(i).is_ok()).count();
                let n = opened.max(ordinal + 1);
                (0..replicas).map(|k| Device::Cuda { ordinal: (ordinal + k) % n }).collect()
            }
        }
    }

    /// The CUDA device's index (for a library that opens the GPU itself, such as NCCL); `None`
    /// on the CPU.
    pub fn cuda_ordinal(self) -> Option<usize> {
        match self {
            Device::Cpu { .. } => None,
            Device::Cuda { ordinal } => Some(ordinal),
        }
    }

    /// Resolve a request. `Auto` falls back to the CPU, and says so on stderr in one line.
    pub fn resolve(req: DeviceRequest, threads: usize) -> Result<Device> {
        match req {
            DeviceRequest::Cpu => Ok(Device::Cpu { threads }),
            DeviceRequest::Cuda(ordinal) => {
                cuda::probe(ordinal)?;
                Ok(Device::Cuda { ordinal })
            }
            DeviceRequest::Auto => match cuda::probe(0) {
                Ok(_) => Ok(Device::Cuda { ordinal: 0 }),
                Err(e) => {
                    eprintln!("gradsync: no usable GPU ({e}); using the CPU");
                    Ok(Device::Cpu { threads })
                }
            },
        }
    }

    /// `cpu` or `cuda:N`.
    pub fn label(&self) -> String {
        match self {
            Device::Cpu { .. } => "cpu".into(),
            Device::Cuda { ordinal } => format!("cuda:{ordinal}"),
        }
    }

    /// Whether this is a GPU.
    pub fn is_cuda(&self) -> bool {
        matches!(self, Device::Cuda { .. })
    }
}
