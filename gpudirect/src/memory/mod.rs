//! Memory kinds and the completion tracker.
//!
//! Not all device memory is equal for GPUDirect, and the type says which it is (see
//! [`MemoryKind`]). Whatever a copy engine, a NIC or cuFile may still touch is owned by an
//! [`tracker::InFlight`] (or parked in the [`tracker::Tracker`]) until completion is observed.

pub mod tracker;

pub use tracker::{CompletionFlag, Fence, InFlight, Tracker};

/// How a buffer was allocated, which decides what GPUDirect can do with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum MemoryKind {
    /// `cuMemAlloc`: GPUDirect RDMA capable, exportable by dma-buf and cuIpc.
    Device,
    /// `cuMemCreate` with the GPUDirect RDMA flag, mapped with `cuMemMap`: RDMA capable,
    /// exportable as a POSIX fd.
    Vmm,
    /// Stream-ordered pool memory (`cuMemAllocAsync`, cudarc's `CudaSlice`): not GPUDirect RDMA
    /// capable; peers need `cuMemPoolSetAccess`.
    Pool,
    /// `cuMemHostAlloc` pinned host memory.
    PinnedHost,
    /// Host memory pinned in place with `cuMemHostRegister`.
    RegisteredHost,
}

impl MemoryKind {
    /// Whether the memory lives on a GPU (as opposed to pinned host memory).
    pub fn is_device(self) -> bool {
        matches!(
            self,
            MemoryKind::Device | MemoryKind::Vmm | MemoryKind::Pool
        )
    }
}

/// Memory that a CUDA device (or a NIC through it) can address: a device pointer and a length.
///
/// This is the contract between memory kinds and the data paths (copies, cuFile, verbs): they
/// take owned values (or `Arc`s) implementing it, so in-flight memory is owned by the tracker.
///
/// # Safety
///
/// Implementors guarantee that `device_ptr()..device_ptr() + byte_len()` is memory of
/// [`kind`](DeviceMemory::kind), addressable by device [`ordinal`](DeviceMemory::ordinal), valid
/// and not freed or remapped while `self` is alive; and that moving `self` does not move it.
pub unsafe trait DeviceMemory: Send + 'static {
    /// The element type.
    type Elem: Copy + Send + 'static;

    /// The device address of the first element (a `CUdeviceptr`; for host kinds, the mapped
    /// device pointer).
    fn device_ptr(&self) -> u64;

    /// Length in elements.
    fn len(&self) -> usize;

    /// Whether the buffer holds no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Length in bytes.
    fn byte_len(&self) -> usize {
        self.len() * std::mem::size_of::<Self::Elem>()
    }

    /// The CUDA device ordinal the memory belongs to (for host kinds: the device it was mapped
    /// for).
    fn ordinal(&self) -> usize;

    /// How it was allocated.
    fn kind(&self) -> MemoryKind;
}
