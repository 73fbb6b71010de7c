//! gradsync's shared core: what every process (server, worker, bench) agrees on.
//!
//! # Layout
//! - [`device`]: `--device auto|cpu|cuda[:N]`, the [`device::Backend`] trait, the CPU (gemm +
//!   rayon) and CUDA (cuBLAS + NVRTC through cudarc) backends, whose fp16/bf16 kernels
//!   ([`device::HalfCast`]) NCCL's half-precision all-reduce also queues, on a stream of its
//!   own ([`device::GpuStream`]: core's handles to a GPU's streams, buffers and events, so no
//!   cudarc type leaves core); `device::nvrtc` picks and compiles the kernels' target (the
//!   device's cubin, PTX as the fallback).
//! - [`dilation`]: dilated time (`--dilate D`): the factor, and the pacing that makes each
//!   training compute phase last D times its thread's CPU time.
//! - [`model`]: the presets (MLPs, ResNets, VGG, a small conv net, the sparse embedding model
//!   with its [`model::Table`]), the layer graph they
//!   compile to, the flat parameter [`model::Layout`] with PyTorch's tensor names, gradient
//!   buckets, the [`model::Fingerprint`] and deterministic initialisation.
//! - [`net`]: forward, backward (handing out finished buckets) and update of any model,
//!   written once over any backend.
//! - [`engine`]: [`Engine`], the model on the chosen device; the one place that matches on it.
//! - [`compress`]: `--compress none|fp16|bf16|topk:RATIO`, the half-precision and top-k
//!   codecs (top-k with its error-feedback residual), the sparse wire format's checks.
//! - [`profile`]: model profiles for replay (a model's tensors in gradient-ready order and
//!   each layer's compute), the file format and the built-in ResNet-50, VGG-16, BERT-base and
//!   GPT-2, estimated at a stated device rate.
//! - [`optim`]: SGD with momentum and weight decay (host version, shared with the server), and
//!   its lazy step of a table's row.
//! - [`data`]: the built-in UCI digits (real data, embedded), synthetic datasets and click logs
//!   (bags of ids), MNIST, CIFAR-10 and LIBSVM loaders, the distributed sampler.
//! - [`metrics`]: the per-step metrics schema and its JSON-lines writer.
//! - [`heap`]: allocator thresholds that keep freed buffers (GEMM packing, HTTP/2 frames), and
//!   one malloc arena for the parameter-server processes.
//! - [`checkpoint`]: parameter files with a fingerprint, written atomically.
//! - [`state_dict`]: a model's state in safetensors under PyTorch's names, both ways.
//! - [`rng`]: the version-stable generator behind every seed.
//! - [`trace`]: Chrome trace-event timelines (`--trace`).

pub mod checkpoint;
pub mod compress;
pub mod data;
pub mod device;
pub mod dilation;
pub mod engine;
mod error;
pub mod heap;
pub mod metrics;
pub mod model;
pub mod net;
pub mod optim;
pub mod profile;
pub mod rng;
pub mod state_dict;
pub mod trace;

pub use engine::Engine;
pub use error::{Error, Result};

/// gradsync's version, as recorded in metrics headers and checkpoints.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
