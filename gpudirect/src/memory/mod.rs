//! Memory kinds, pointer attributes and typed copies.
//!
//! Not all device memory is equal for GPUDirect, and the type says which it is (see
//! [`MemoryKind`]):
//!
//! | type | C allocator | kind |
//! | --- | --- | --- |
//! | [`DeviceBuffer`] | `cuMemAlloc` | [`MemoryKind::Device`] |
//! | [`VmmBuffer`] | `cuMemCreate` + `cuMemMap` (GPUDirect RDMA flag) | [`MemoryKind::Vmm`] |
//! | [`PoolBuffer`] | `cuMemAllocAsync` (cudarc's `CudaSlice`) | [`MemoryKind::Pool`] |
//! | [`PinnedHostBuffer`] | `cuMemHostAlloc` | [`MemoryKind::PinnedHost`] |
//! | [`RegisteredHost`] | `cuMemHostRegister` | [`MemoryKind::RegisteredHost`] |
//!
//! Pinned bounce buffers for data the GPU cannot reach directly (a file read with `pread`, a GPU
//! without peer access) come from a [`BouncePool`] (pinned chunks of one size, recycled) and move
//! to and from device memory through a [`CopyEngine`] (a few streams of one device, one event
//! fence per copy, [`ChunkCopy`]); the storage module's POSIX path and the staged peer copy use
//! them ([`CopyEngine`] says how).
//!
//! Device memory exports as a dma-buf with [`export_dmabuf`]: the [`DmaBuf`] owns the memory and
//! never lends its fd, so no duplicate can outlive what it reaches.
//!
//! Whatever a copy engine, a NIC or cuFile may still touch is owned by an
//! [`InFlight`](crate::completion::InFlight) (or parked in the
//! [`Tracker`](crate::completion::Tracker)) until completion is observed. Data paths take owned
//! values implementing [`DeviceMemory`] (or `Arc`s of them, for memory they only read); memory they
//! write must implement [`DeviceMemoryMut`], which `Arc` does not.
//!
//! # For data paths (storage, P2P, RDMA)
//!
//! Take buffers as `M: DeviceMemory` (read) or `M: DeviceMemoryMut` (written), by value; the
//! address range is `m.device_ptr()..m.device_ptr() + m.byte_len()` (bytes), on device
//! `m.ordinal()`, of kind `m.kind()`. Queue the work, then hand everything it may still touch to
//! an [`InFlight`](crate::completion::InFlight) with a fence from the stream:
//!
//! ```no_run
//! use gpudirect::completion::{InFlight, StreamFence};
//! use gpudirect::cuda::Stream;
//! use gpudirect::memory::{DeviceBuffer, DeviceMemoryMut};
//!
//! fn start_read<M: DeviceMemoryMut>(stream: &Stream, buf: M) -> gpudirect::Result<InFlight<M, StreamFence>> {
//!     let (ptr, bytes) = (buf.device_ptr(), buf.byte_len());
//!     // ... queue driver work on `stream.cu_stream()` writing `ptr..ptr + bytes` ...
//!     # let _ = (ptr, bytes);
//!     Ok(InFlight::new("my read", stream.fence(), buf))
//! }
//!
//! # fn main() -> gpudirect::Result<()> {
//! let ctx = gpudirect::cuda::context(0)?;
//! let stream = Stream::new(&ctx)?;
//! let op = start_read(&stream, DeviceBuffer::<u8>::alloc(&ctx, 1 << 20)?)?;
//! let buf = op.wait()?; // readable again only now
//! # drop(buf);
//! # Ok(())
//! # }
//! ```
//!
//! Other fences (all in [`crate::completion`]): [`crate::cuda::Stream::event_fence`]
//! (`EventFence`, one `cuEventRecord` now), [`crate::cuda::Stream::host_fence`] (`HostFnFence`,
//! a `cuLaunchHostFunc` callback), `CompletionFlag` (set by whoever observes completion: a polled
//! work completion, an I/O thread).
//!
//! # Copies
//!
//! [`copy`], [`copy_async`], [`copy_from_host`], [`copy_to_host`]. Every copy checks, before any
//! driver call, that source and destination hold the same element type (at compile time) and the
//! same number of elements, and that device memory belongs to the stream's device (copies between
//! devices are the `p2p` module's). Host kinds take the `cuMemcpyHtoDAsync`/`cuMemcpyDtoHAsync`
//! paths with their host address, device kinds `cuMemcpyDtoDAsync`.
//!
//! Asynchronous copies take both buffers by value (or the source as an `Arc`) and return an
//! [`InFlight`](crate::completion::InFlight) that owns them until the copy has completed:
//! `mem::forget` of it leaks them, and the destination can be read only after
//! [`InFlight::wait`](crate::completion::InFlight::wait) hands it back.
//!
//! No copy is queued on a stream that is capturing a CUDA graph
//! ([`Error::StreamCapturing`](crate::Error::StreamCapturing)).
//!
//! # Fork safety
//!
//! Every allocation records the process id that made it. A value dropped in a forked child frees
//! nothing through the driver (the child's CUDA state is unusable); it leaks instead.

pub(crate) mod alloc;
mod attributes;
mod bounce;
mod copy;
mod device;
pub(crate) mod dmabuf;
mod host;
mod huge;
mod pod;
mod pool;
#[cfg(test)]
mod proptests;
mod registered;
mod vmm;

pub use attributes::{MemoryType, PointerAttributes, pointer_attributes};
#[cfg(feature = "transfer")]
pub(crate) use bounce::HostChunk;
pub use bounce::{
    BOUNCE_ALIGN, BounceChunk, BouncePool, ChunkCopy, CopyEngine, MAX_CHUNK_BYTES, MAX_LANES,
};
#[cfg(feature = "p2p")]
pub(crate) use bounce::{Dir, SHARED_LANES, check_chunk_bytes};
pub use copy::{CopyInFlight, copy, copy_async, copy_from_host, copy_to_host};
pub use device::DeviceBuffer;
pub use dmabuf::{DmaBuf, check_dmabuf_export, export_dmabuf};
pub use host::{HostAllocFlags, PinnedHostBuffer};
pub use pod::Pod;
pub use pool::PoolBuffer;
pub use registered::{HostRegisterFlags, RegisteredHost};
#[cfg(feature = "p2p")]
pub(crate) use vmm::VmmMapping;
pub use vmm::{MAX_VMM_CHUNKS, VmmBuffer, VmmChunk, plan_chunks};

pub use crate::error::MemoryKind;

use crate::error::Result;
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
    /// [`VmmBuffer`] answers its chunks, [`VmmImport`](crate::p2p::VmmImport) its mapping,
    /// and wrappers (`Arc`, [`BufRegistration`](crate::storage::BufRegistration)) forward. For VMM
    /// memory that answers `None` the data paths look the mapping up with
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
/// `CudaSlice`, [`PoolBuffer`], an [`IpcPool`](crate::p2p::IpcPool)'s allocations) where
/// `what` needs GPUDirect RDMA capable memory (a NIC registration, a dma-buf export). Answered
/// from the kind alone, before any FFI call.
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

/// `len * size_of::<T>()`, or an [`crate::Error::InvalidArgument`] on overflow or zero.
pub(crate) fn byte_size<T>(len: usize) -> Result<usize> {
    let bytes = len
        .checked_mul(std::mem::size_of::<T>())
        .ok_or_else(|| crate::Error::invalid("len", len, "len * size_of::<T>() overflows usize"))?;
    if bytes == 0 {
        return Err(crate::Error::invalid(
            "len",
            len,
            "allocations must hold at least one byte (len > 0 and T not zero-sized)",
        ));
    }
    Ok(bytes)
}

/// Fixtures shared by the tests of the crate's modules (the RDMA and storage paths').
#[cfg(all(test, any(feature = "rdma", feature = "storage")))]
pub(crate) mod testing {
    use super::{DeviceMemory, DeviceMemoryMut, MemoryKind};

    /// `len` bytes of `kind` at a made-up address on device 0: for checks that must refuse it
    /// before any FFI call. Never dereferenced.
    pub(crate) struct FakeDevice(pub(crate) MemoryKind, pub(crate) usize);

    // SAFETY: never dereferenced or handed to any library: tests use it only where the checks
    // refuse it first.
    unsafe impl DeviceMemory for FakeDevice {
        type Elem = u8;
        fn device_ptr(&self) -> u64 {
            0x1000
        }
        fn len(&self) -> usize {
            self.1
        }
        fn ordinal(&self) -> usize {
            0
        }
        fn kind(&self) -> MemoryKind {
            self.0
        }
    }
    // SAFETY: as above.
    unsafe impl DeviceMemoryMut for FakeDevice {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_size_checks_before_ffi() {
        assert_eq!(byte_size::<u32>(4).unwrap(), 16);
        assert!(matches!(
            byte_size::<u32>(0),
            Err(crate::Error::InvalidArgument { arg: "len", .. })
        ));
        assert!(byte_size::<u64>(usize::MAX / 4).is_err());
    }
}
