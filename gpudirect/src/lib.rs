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
//! | RDMA | `transfer` (feature `transfer`) | a transfer engine: endpoints over rdma_cm, descriptors, a registration cache, batched one-sided writes and reads with notifications, several NICs |
//!
//! Everything is loaded at run time: a program built with gpudirect starts on a machine without
//! CUDA, cuFile or rdma-core, and each entry point answers a typed [`Error`].
#![deny(missing_docs, unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod completion;
pub mod cuda;
mod driver;
mod error;
pub mod memory;
pub mod p2p;
pub mod rdma;
pub mod report;
pub mod storage;
#[cfg(test)]
mod testing;
pub mod topology;
#[cfg(feature = "transfer")]
pub mod transfer;

/// The cudarc crate gpudirect is built on, re-exported so callers use the same version and features.
pub use cudarc;
pub use error::{Absence, Error, Result};
pub use gpudirect_sys as sys;

/// Strategies and checks the property tests of several modules share.
#[cfg(test)]
pub(crate) mod proptest_support {
    use crate::Error;
    use crate::memory::MemoryKind;
    use proptest::prelude::*;

    pub(crate) fn invalid<T: std::fmt::Debug>(r: &crate::Result<T>) -> bool {
        matches!(r, Err(Error::InvalidArgument { .. }))
    }

    pub(crate) fn is_invalid(e: &Error) -> bool {
        matches!(e, Error::InvalidArgument { .. })
    }

    pub(crate) fn not_rdma<T>(r: &crate::Result<T>) -> bool {
        matches!(r, Err(Error::NotRdmaCapable { .. }))
    }

    pub(crate) fn kind() -> impl Strategy<Value = MemoryKind> {
        prop_oneof![
            Just(MemoryKind::Device),
            Just(MemoryKind::Vmm),
            Just(MemoryKind::Pool),
            Just(MemoryKind::PinnedHost),
            Just(MemoryKind::RegisteredHost),
        ]
    }

    /// Sizes near the edges as well as anywhere.
    pub(crate) fn size() -> impl Strategy<Value = usize> {
        prop_oneof![
            0usize..=8192,
            Just(usize::MAX),
            (usize::MAX - 8192)..=usize::MAX,
            any::<usize>(),
        ]
    }

    pub(crate) fn addr() -> impl Strategy<Value = u64> {
        prop_oneof![
            0u64..=(1 << 20),
            (u64::MAX - (1 << 20))..=u64::MAX,
            any::<u64>(),
        ]
    }
}
