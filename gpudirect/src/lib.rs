//! Safe Rust bindings for NVIDIA's GPUDirect stack.
//!
//! | path | module | what |
//! | --- | --- | --- |
//! | Async | [`completion`], [`cuda`], [`memory`] | the completion tracker and fences, presence-checked CUDA, memory kinds |
//! | P2P | [`p2p`] | peer access, link matrix, peer copies (staged fallback), CUDA IPC |
//! | Storage | [`storage`] | cuFile driver, handles, sync/async/batch I/O, the automatic POSIX path |
//! | RDMA | [`rdma`] | verbs: devices, PDs, MRs on host and GPU memory (dma-buf, nvidia-peermem), CQs, QPs, work requests, rdma_cm |
//! | RDMA | [`dmabuf`] | dma-buf export of device memory |
//! | all | [`device`], [`topology`] | GPU attributes; the node report the `probe` example prints |
//! | tests | [`testing`] | `SKIPPED: reason`, or a failure where `GPUDIRECT_REQUIRE` names the hardware |
//!
//! Everything is loaded at run time: a program built with gpudirect starts on a machine without
//! CUDA, cuFile or rdma-core, and each entry point answers a typed [`Error`].
#![deny(missing_docs, unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod completion;
pub mod cuda;
pub mod device;
pub mod dmabuf;
mod driver;
mod error;
pub mod memory;
pub mod p2p;
pub mod rdma;
pub mod storage;
pub mod testing;
pub mod topology;

/// The cudarc crate gpudirect is built on, re-exported so callers use the same version and features.
pub use cudarc;
pub use error::{Absence, Error, Result};
pub use gpudirect_sys as sys;
