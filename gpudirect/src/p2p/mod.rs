//! GPUDirect P2P: peer access, P2P attributes and the link matrix, typed peer copies with a
//! staged fallback, and CUDA IPC for peers in other processes.
//!
//! | what | items | C functions |
//! | --- | --- | --- |
//! | peer access: can-access query, idempotent enable, pool and VMM grants | [`can_access_peer`], [`enable_peer_access`], [`grant_pool_access`], [`grant_vmm_memory`], [`PeerAccessRefusal`] | `cuDeviceCanAccessPeer`, `cuCtxEnablePeerAccess`, `cuMemPoolSetAccess`, `cuMemSetAccess` |
//! | performance rank, access, native atomics, CUDA array access | [`p2p_attributes`] | `cuDeviceGetP2PAttribute` |
//! | every ordered pair: access, rank, atomics, NVLink (links) or PCIe | [`LinkMatrix`] | NVML `nvmlDeviceGetNvLinkState`, `nvmlDeviceGetNvLinkRemotePciInfo_v2` |
//! | typed copies, blocking and in flight, on the path that really ran | [`Copier`], [`copy()`], [`copy_async`], [`CopyPath`] | `cuMemcpyPeerAsync`, `cuMemcpyDtoDAsync`, `cuMemcpyDtoHAsync`/`cuMemcpyHtoDAsync` |
//! | many copies between borrowed buffers, one wait when the scope ends | [`Copier::scope`], [`CopyScope`] | `cuMemcpyPeerAsync`, `cuStreamSynchronize` |
//! | CUDA IPC: memory and event handles for other processes | below | `cuIpcGetMemHandle`, `cuIpcOpenMemHandle`, `cuIpcGetEventHandle`, `cuMemExportToShareableHandle` |
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
//!
//! # CUDA IPC
//!
//! Device memory and events shared with other processes (the usual one-process-per-GPU layout):
//!
//! | memory kind | export | import | handle |
//! | --- | --- | --- | --- |
//! | `cuMemAlloc` ([`DeviceBuffer`](crate::memory::DeviceBuffer)) | [`IpcExport::new`] (`cuIpcGetMemHandle`) | [`IpcMemory::open`] (`cuIpcOpenMemHandle`) | [`IpcMemHandle`], serde |
//! | VMM ([`VmmBuffer`](crate::memory::VmmBuffer)) | [`export_vmm`] (`cuMemExportToShareableHandle`, POSIX fd) | [`VmmImport::open`] (`cuMemImportFromShareableHandle`, `cuMemMap`) | [`VmmHandle`], serde, plus the fd sent with [`send_fd`] (SCM_RIGHTS) |
//! | pool memory from an [`IpcPool`] | [`PoolAlloc::export`] (`cuMemPoolExportPointer`) after [`IpcPool::export_fd`] | [`PoolImport::open`] (`cuMemPoolImportPointer`) after [`IpcPool::import`] | [`PoolPtrHandle`], serde, plus the pool's fd |
//! | events | [`IpcEvent::new`] (`cuIpcGetEventHandle`) | [`IpcEvent::open`] (`cuIpcOpenEventHandle`) | [`IpcEventHandle`], serde |
//!
//! Stream-ordered pool memory from the device's default pool (cudarc's `CudaSlice`) is not
//! exportable: [`IpcExport::new`] answers [`crate::Error::Unsupported`] for it, naming
//! `cuMemPoolExportPointer` and the exportable pool ([`IpcPool`]) to allocate from instead. For
//! memory of an [`IpcPool`] it answers the same error naming [`PoolAlloc::export`], the API
//! that shares it.
//!
//! Handles are plain data: send them out of band (a file, a socket, an RDMA exchange) as JSON or
//! any serde format. Imported memory is mapped on the device it lives on (found by the PCI
//! address the handle carries, which every process on the node shares), so a copy from it to
//! another device runs peer to peer at the link's speed and says so; mapped for another device
//! (`open_on`), copies of it on that device's side cross the link and are reported as
//! [`CopyPath::Peer`], never as a same-device copy. Imported mappings own their mapping, and
//! data paths hold it in their [`InFlight`](crate::completion::InFlight) until their work
//! completes; so dropping one unmaps at once, without synchronizing the device (no unbounded
//! `cuCtxSynchronize` in a destructor).

mod access;
mod attributes;
mod copy;
mod home;
mod ipc;
mod lane;
mod path;
// Crate-visible for the node report, which opens NVML the way the link matrix does.
pub(crate) mod link;
#[cfg(test)]
mod proptests;
mod scope;
mod staging;

pub use access::{
    Enabled, PeerAccessRefusal, can_access_peer, enable_peer_access, enable_peer_access_both,
    grant_pool_access, grant_vmm_access, grant_vmm_mapping, grant_vmm_memory,
    is_peer_access_enabled,
};
pub use attributes::{P2pAttributes, p2p_attributes};
pub use copy::{
    Copied, Copier, CopyOptions, MAX_SLOTS, MAX_STAGING_BYTES, PathChoice, PeerCopyInFlight, copy,
    copy_async,
};
pub use ipc::{
    IpcEvent, IpcEventHandle, IpcExport, IpcMemHandle, IpcMemory, IpcPool, PoolAlloc, PoolImport,
    PoolPtrHandle, VmmHandle, VmmImport, export_vmm, recv_fd, send_fd,
};
#[cfg(feature = "transfer")]
pub(crate) use ipc::{MAX_FDS_PER_MSG, exportable_pool_at, recv_fds, send_fds};
pub use link::{Interconnect, Link, LinkMatrix};
pub use path::CopyPath;
pub use scope::CopyScope;
