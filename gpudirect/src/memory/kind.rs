//! The contract between memory kinds and the data paths ([`DeviceMemory`], [`DeviceMemoryMut`]),
//! and the one refusal of a kind by what it cannot do ([`refuse_pool`]).

use super::attributes::{PointerAttributes, pointer_attributes};
use crate::error::{MemoryKind, Result};
use std::sync::Arc;

/// Memory that a CUDA device (or a NIC through it) can address: a device pointer and a length.
///
/// This is the contract between memory kinds and the data paths (copies, cuFile, verbs): they
/// take owned values (or `Arc`s) implementing it, so in-flight memory is owned by the tracker.
/// Storage and RDMA get the address range as `device_ptr()..device_ptr() + byte_len()`.
///
/// # Safety
///
/// Implementors guarantee that `device_ptr()..device_ptr() + byte_len()` is memory of
/// [`kind`](DeviceMemory::kind), addressable by device [`ordinal`](DeviceMemory::ordinal), valid
/// and not freed or remapped while `self` is alive; and that moving `self` does not move it.
/// [`host_ptr`](DeviceMemory::host_ptr), when `Some`, points at the same bytes in the host's
/// address space. [`vmm_mappings`](DeviceMemory::vmm_mappings), when `Some`, lists whole VMM
/// mappings (each one `cuMemMap` of this memory, alive while `self` is) that together cover the
/// buffer's range.
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
    ///
    /// Saturates at `usize::MAX` rather than wrap, for an implementation whose `len` breaks the
    /// contract; data paths check their ranges against it before any FFI call.
    fn byte_len(&self) -> usize {
        self.len().saturating_mul(std::mem::size_of::<Self::Elem>())
    }

    /// The CUDA device ordinal the memory belongs to (for host kinds: the device it was mapped
    /// for).
    fn ordinal(&self) -> usize;

    /// How it was allocated.
    fn kind(&self) -> MemoryKind;

    /// For host kinds, the host address of the first element; `None` for device memory.
    fn host_ptr(&self) -> Option<*mut u8> {
        None
    }

    /// `cuPointerGetAttributes` on [`device_ptr`](DeviceMemory::device_ptr).
    ///
    /// # Errors
    ///
    /// As [`pointer_attributes`].
    #[doc(alias = "cuPointerGetAttributes")]
    fn attributes(&self) -> Result<PointerAttributes> {
        pointer_attributes(self.device_ptr())
    }

    /// The VMM mappings behind the buffer, for memory that knows its layout: `(base, bytes)` of
    /// each whole mapping (one `cuMemMap` each), in address order, together covering
    /// `device_ptr()..device_ptr() + byte_len()` (they may reach past it). `None`, the default,
    /// for memory that is not VMM memory or does not know how it was mapped.
    ///
    /// Every mapping carries its own access list, so peer access to VMM memory is granted per
    /// mapping (`cuMemSetAccess` on exactly these ranges, as PyTorch's expandable segments do).
    /// [`VmmBuffer`](super::VmmBuffer) answers its chunks, [`VmmImport`](crate::p2p::VmmImport)
    /// its mapping, and wrappers (`Arc`, [`BufRegistration`](crate::storage::BufRegistration))
    /// forward. For VMM memory that answers `None` the data paths look the mapping up with
    /// `cuMemGetAddressRange`, which the driver does not answer for every VMM mapping (then a
    /// peer copy reports that it was staged by the driver).
    fn vmm_mappings(&self) -> Option<Vec<(u64, usize)>> {
        None
    }
}

/// Memory that nobody else can read or reference while the holder owns it, so a data path may
/// write into it: every owned buffer type, never an `Arc`.
///
/// # Safety
///
/// While a value is owned by a data path, no Rust reference to its bytes may exist elsewhere.
pub unsafe trait DeviceMemoryMut: DeviceMemory {}

// SAFETY: the Arc keeps the inner value (and so its memory) alive and does not move it; shared
// holders can only read, so an Arc is never `DeviceMemoryMut`.
unsafe impl<M: DeviceMemory + Sync> DeviceMemory for Arc<M> {
    type Elem = M::Elem;
    fn device_ptr(&self) -> u64 {
        (**self).device_ptr()
    }
    fn len(&self) -> usize {
        (**self).len()
    }
    fn ordinal(&self) -> usize {
        (**self).ordinal()
    }
    fn kind(&self) -> MemoryKind {
        (**self).kind()
    }
    fn host_ptr(&self) -> Option<*mut u8> {
        (**self).host_ptr()
    }
    fn vmm_mappings(&self) -> Option<Vec<(u64, usize)>> {
        (**self).vmm_mappings()
    }
}

/// The one typed refusal for stream-ordered pool memory (`cuMemAllocAsync`: cudarc's
/// `CudaSlice`, [`PoolBuffer`](super::PoolBuffer), an [`IpcPool`](crate::p2p::IpcPool)'s
/// allocations) where `what` needs GPUDirect RDMA capable memory (a NIC registration, a dma-buf
/// export). Answered from the kind alone, before any FFI call.
pub(crate) fn refuse_pool(kind: MemoryKind, ptr: u64, what: &str) -> Result<()> {
    if kind == MemoryKind::Pool {
        return Err(crate::Error::NotRdmaCapable {
            ptr,
            kind,
            reason: format!(
                "stream-ordered pool memory (cuMemAllocAsync, cudarc's CudaSlice) is not \
                 GPUDirect RDMA capable, so {what} refuses it; allocate a DeviceBuffer or VmmBuffer"
            ),
        });
    }
    Ok(())
}
