//! GPUDirect P2P: peer access, P2P attributes and the link matrix, typed peer copies with a
//! staged fallback, and CUDA IPC for peers in other processes.
//!
//! | file | what | C functions |
//! | --- | --- | --- |
//! | [`access`] | can-access query, idempotent enable, pool and VMM grants | `cuDeviceCanAccessPeer`, `cuCtxEnablePeerAccess`, `cuMemPoolSetAccess`, `cuMemSetAccess` |
//! | [`attributes`] | performance rank, access, native atomics, CUDA array access | `cuDeviceGetP2PAttribute` |
//! | [`link`] | every ordered pair: access, rank, atomics, NVLink (links) or PCIe | NVML `nvmlDeviceGetNvLinkState`, `nvmlDeviceGetNvLinkRemotePciInfo_v2` |
//! | [`copy`](mod@copy) | typed copies, blocking and in flight, on the path that really ran | `cuMemcpyPeerAsync`, `cuMemcpyDtoDAsync`, `cuMemcpyDtoHAsync`/`cuMemcpyHtoDAsync` |
//! | [`ipc`] | memory and event handles for other processes | `cuIpcGetMemHandle`, `cuIpcOpenMemHandle`, `cuIpcGetEventHandle`, `cuMemExportToShareableHandle` |
//!
//! Peer access is process-global: it is enabled on demand and never disabled (least of all by a
//! destructor). Pool memory (cudarc's `CudaSlice`) and VMM memory (each mapping) need their own
//! grants, which the copier makes; a copy that the driver stages is reported as [`CopyPath::DriverStaged`], never as `Peer`.
//!
//! ```no_run
//! # fn main() -> gpudirect::Result<()> {
//! use gpudirect::p2p::{LinkMatrix, Copier, CopyOptions};
//! let matrix = LinkMatrix::probe()?;
//! print!("{}", matrix.table());
//! let copier = Copier::new(0, 1, CopyOptions::default())?;
//! println!("0 -> 1 runs {}", copier.path());
//! # Ok(()) }
//! ```

pub mod access;
pub mod attributes;
pub mod copy;
pub mod ipc;
pub mod link;
#[cfg(test)]
mod proptests;
pub(crate) mod staging;

pub use access::{
    Enabled, Refusal, can_access_peer, enable_peer_access, enable_peer_access_both,
    grant_pool_access, grant_vmm_access, grant_vmm_mapping, grant_vmm_memory,
    is_peer_access_enabled,
};
pub use attributes::{P2pAttributes, p2p_attributes};
pub use copy::{
    Copied, Copier, CopyFence, CopyOptions, CopyPath, MAX_CHUNK_BYTES, MAX_SLOTS,
    MAX_STAGING_BYTES, PathChoice, PeerCopyInFlight, copy, copy_async,
};
pub use link::{DeviceInfo, Interconnect, Link, LinkMatrix};
