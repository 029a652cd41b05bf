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
pub(crate) mod kind;
pub(crate) mod pod;
mod pool;
#[cfg(test)]
mod proptests;
mod registered;
#[cfg(all(test, any(feature = "rdma", feature = "storage")))]
pub(crate) mod testing;
mod vmm;

pub use attributes::{MemoryType, PointerAttributes, pointer_attributes};
#[cfg(feature = "transfer")]
pub(crate) use bounce::HostChunk;
pub use bounce::{
    BOUNCE_ALIGN, BounceChunk, BouncePool, ChunkCopy, CopyEngine, MAX_CHUNK_BYTES, MAX_LANES,
};
#[cfg(feature = "p2p")]
pub(crate) use bounce::{Dir, Leg, SHARED_LANES, check_chunk_bytes};
pub use copy::{CopyInFlight, copy, copy_async, copy_from_host, copy_to_host};
pub use device::DeviceBuffer;
pub use dmabuf::{DmaBuf, check_dmabuf_export, export_dmabuf};
pub use host::{HostAllocFlags, PinnedHostBuffer};
#[cfg(feature = "rdma")]
pub(crate) use kind::refuse_pool;
pub use kind::{DeviceMemory, DeviceMemoryMut};
pub use pod::Pod;
pub use pool::PoolBuffer;
pub use registered::{HostRegisterFlags, RegisteredHost};
#[cfg(feature = "p2p")]
pub(crate) use vmm::VmmMapping;
pub use vmm::{MAX_VMM_CHUNKS, VmmBuffer, VmmChunk, plan_chunks};

pub use crate::error::MemoryKind;
