//! Safe Rust bindings for NVIDIA's GPUDirect stack.
//!
//! | path | module | what |
//! | --- | --- | --- |
//! | Async | [`completion`], [`cuda`], [`memory`] | the completion tracker and fences, futures for every operation (with deadlines), presence-checked CUDA, memory kinds |
//! | P2P | [`p2p`] | peer access, link matrix, peer copies (staged fallback), CUDA IPC |
//! | Storage | [`storage`] | cuFile driver, handles, sync/async/batch I/O, the automatic POSIX path |
//! | RDMA | [`rdma`] | verbs: devices, PDs, MRs on host and GPU memory (dma-buf, nvidia-peermem), CQs, QPs, work requests, rdma_cm |
//! | RDMA | [`memory`] | dma-buf export of device memory ([`memory::export_dmabuf`]) |
//! | all | [`cuda`], [`topology`], [`report`] | GPU attributes ([`cuda::DeviceInfo`]); where GPUs and NICs sit (PCIe, NUMA, the NIC nearest each GPU); the node report the `probe` example prints |
//! | RDMA, P2P | [`transfer`] | a transfer engine: endpoints over rdma_cm (or, inside a node, a Unix socket and CUDA IPC), descriptors, a registration cache, batched one-sided writes and reads with notifications, several NICs |
//!
//! Everything is loaded at run time: a program built with gpudirect starts on a machine without
//! CUDA, cuFile or rdma-core, and each entry point answers a typed [`Error`].
//!
//! # Features
//!
//! Each data path is a feature, all on by default: `p2p`, `rdma`, `storage`, and `report` (the
//! node report; it builds with any set of paths and reports a path whose feature is off as not
//! built). `serde` (on by default; `report` turns it on) derives `Serialize`/`Deserialize` on what
//! crosses processes or is written out (IPC handles, remote memory descriptors, queue-pair
//! endpoints, device attributes, the report). `transfer` (on by default; it turns on `rdma` and
//! `serde`) is the transfer engine over the rdma path. A program that uses only some paths builds
//! only those: `default-features = false, features = ["rdma", ...]`. [`completion`], [`cuda`],
//! [`memory`] and [`topology`] are always built. `tokio` (off by default) adds file-descriptor
//! readiness through tokio's reactor. `etcd` (off by default; it turns on `transfer`) adds the
//! etcd store of named segments (`transfer::membership::EtcdStore`); building it needs `protoc`.
//! The CUDA version features (`cuda-12000` ... `cuda-13040`) only forward to cudarc;
//! `dynamic-linking` links libcuda at build time instead of opening it at run time.
#![deny(missing_docs, unsafe_op_in_unsafe_fn)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod completion;
pub mod cuda;
mod driver;
mod error;
pub mod memory;
#[cfg(feature = "p2p")]
pub mod p2p;
#[cfg(test)]
mod proptest_support;
#[cfg(feature = "rdma")]
pub mod rdma;
#[cfg(feature = "report")]
pub mod report;
#[cfg(feature = "storage")]
pub mod storage;
// SKIPPED / GPUDIRECT_REQUIRE for the unit tests that need a GPU (the P2P path's, the transfer
// engine's staging).
#[cfg(all(test, any(feature = "p2p", feature = "transfer")))]
mod testing;
pub mod topology;
#[cfg(feature = "transfer")]
pub mod transfer;

/// The cudarc crate gpudirect is built on, re-exported so callers use the same version and features.
pub use cudarc;
pub use error::{Absence, Error, Result};
pub use gpudirect_sys as sys;
