//! RDMA verbs on host memory: devices, contexts, protection domains, memory regions, completion
//! queues and channels, shared receive queues, reliable-connected queue pairs, work requests, and
//! [connections through rdma_cm](#connections-through-rdma_cm); and GPUDirect RDMA regions over GPU
//! memory ([GPU memory regions](#gpu-memory-regions): dma-buf or nvidia-peermem,
//! [`ProtectionDomain::register_gpu`]).
//!
//! libibverbs and librdmacm are opened at run time: without them every entry point answers
//! [`Error::Load`](crate::Error::Load); without a device, [`Error::NoDevice`](crate::Error::NoDevice).
//!
//! # Ownership of posted memory
//!
//! Work requests ([`SendRequest`], [`RecvRequest`]) take [`MrSlice`]s by value: a slice keeps its
//! [`MemoryRegion`] (registration and memory) alive. A posted request's slices are kept by its
//! queue pair, keyed by a `wr_id` the library chooses, until its completion is polled (or
//! flushed); only then are they released. A dropped queue pair is moved to the error state, given
//! one signaled request whose flushed completion proves that everything posted before it is
//! finished (unsignaled requests included), and drained for a bounded time ([`DRAIN_TIMEOUT`]);
//! if the completions do not all arrive, the QP and everything it holds are leaked, never freed
//! early ([`teardown_stats`] counts both outcomes). [`QueuePair::into_error`] does the same
//! without dropping: every outstanding request completes as [`WcStatus::Flushed`], and
//! [`QueuePair::reset`] ([`ErrorState`] → [`Reset`]) drains what is left before the queue pair
//! can be connected again. Memory a NIC may write (remote-writable regions, receive and RDMA-read
//! targets) is never handed out as a Rust reference while it can be written: see
//! [`MemoryRegion`].
//!
//! # Capacity
//!
//! A completion queue never receives more completions than it holds: every request posted to a
//! queue pair counts against the CQ its completion goes to (signaled or not: in the error state
//! every outstanding request completes) until its completion, or a later one that covers it, is
//! polled. A chain that does not fit is refused whole with
//! [`Error::QueueFull`](crate::Error::QueueFull) naming the completion queue. Each queue pair
//! keeps one entry of its send CQ for its teardown, and a CQ serving queue pairs of a
//! [`SharedReceiveQueue`] keeps room for that queue's whole depth.
//!
//! ```no_run
//! use gpudirect::rdma::{AccessFlags, Context, HostBuffer};
//! # fn main() -> gpudirect::Result<()> {
//! let ctx = Context::open_by_name(None)?; // the first verbs device, or Error::NoDevice
//! let pd = ctx.alloc_pd()?;
//! let mr = pd.register(HostBuffer::zeroed(4096)?, AccessFlags::LOCAL_WRITE)?;
//! println!("lkey {:#x}", mr.lkey());
//! # Ok(()) }
//! ```
//!
//! # Awaiting completions
//!
//! [`AsyncCq`] takes a completion queue over: one dispatcher polls it and routes each completion,
//! by a tag the library chooses, to the future or stream waiting for it. A queue pair attached
//! to it ([`AsyncCq::attach`], an [`AsyncQueuePair`]) gives a [`WcFuture`] for each send, RDMA
//! write or read it posts (with a deadline: [`WcFuture::timeout`]); received messages arrive as
//! a [`Messages`] stream of filled buffers, RDMA writes with immediate as an [`Immediates`]
//! stream of `(immediate, length)`. A request that finds the send queue or the CQ full waits in
//! a bounded backlog and is posted when room frees up; a full backlog answers
//! [`Error::QueueFull`](crate::Error::QueueFull). Wake-ups come from the completion channel
//! through tokio's reactor (feature `tokio`), or from the completion thread, which polls (see
//! [`AsyncCq`] for what each costs).
//!
//! ```no_run
//! use gpudirect::rdma::{AccessFlags, AsyncCq, HostBuffer, QpCaps, QueuePair, Rts};
//! # async fn demo(ctx: gpudirect::rdma::Context, pd: gpudirect::rdma::ProtectionDomain,
//! #     connect: impl FnOnce(QueuePair<gpudirect::rdma::Init>) -> gpudirect::Result<QueuePair<Rts>>)
//! #     -> gpudirect::Result<()> {
//! use std::time::Duration;
//! let channel = ctx.create_comp_channel()?;
//! let cq = ctx.create_cq(1024, Some(&channel))?;
//! let qp = QueuePair::create(&pd, &cq, &cq, None, QpCaps::default())?
//!     .to_init(1, AccessFlags::empty())?;
//! let qp = connect(qp)?; // to RTS with the peer's endpoint
//! let acq = AsyncCq::new(cq, Some(channel))?; // inside a tokio runtime: woken by the channel
//! let qp = acq.attach(qp, 1024)?;
//! let mr = pd.register(HostBuffer::from_slice(b"ping")?, AccessFlags::empty())?;
//! let done = qp.send(mr.slice(..)?)?.timeout(Duration::from_secs(1)).await?;
//! println!("{:?}", done.wc().status());
//! # Ok(()) }
//! ```
//!
//! # Memory windows
//!
//! A type 2 memory window ([`ProtectionDomain::alloc_mw`], where
//! [`DeviceAttr::memory_windows`] reports them) gives the peer of one queue pair, and no other,
//! access to a range of a region registered with [`AccessFlags::MW_BIND`], under an rkey of its
//! own that can be revoked while the region stays registered for others. Its states are types:
//! [`MemoryWindow`] (unbound) → [`QueuePair::bind_window`] → [`PendingBind`] → (the bind's
//! completion polled) [`BoundWindow`], whose rkey alone is reachable →
//! [`QueuePair::invalidate_window`] → [`PendingInvalidate`] → (its completion polled) an unbound
//! [`MemoryWindow`] again. A window holds its range (so the region stays registered and its
//! memory alive) until it is known unbound: its invalidation completed, or it was deallocated
//! (dropped). docs/memory-windows.md says what this relies on and what Soft-RoCE does.
//!
//! # GPU memory regions
//!
//! [`ProtectionDomain::register_gpu`] registers device memory with the NIC one of two ways, or
//! picks one ([`GpuRegistration::Auto`]):
//!
//! 1. **dma-buf** ([`GpuMrPath::DmaBuf`]): the enclosing 4 KiB-aligned range is exported with
//!    `cuMemGetHandleForAddressRange`, then `ibv_reg_dmabuf_mr(pd, offset, len, iova, fd,
//!    access)` with `offset` = pointer − exported base, `len` = the requested bytes and `iova` =
//!    the pointer. The region's bounds are exactly the requested bytes, and
//!    [`GpuMemoryRegion::remote`] advertises `addr = iova`, the address the NIC expects.
//!    Needs the device's `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` and a NIC driver that imports
//!    dma-bufs (Linux 5.12+, rdma-core 34+; not Soft-RoCE, which answers `EOPNOTSUPP`).
//! 2. **nvidia-peermem** ([`GpuMrPath::Peermem`]): only when the `nvidia_peermem` (or older
//!    `nv_peer_mem`) kernel module is loaded; plain `ibv_reg_mr` on the device pointer. The
//!    module pins whole 64 KiB GPU pages ([`gpudirect_sys::peermem::GPU_PAGE`]); the region's
//!    bounds are still the requested bytes.
//!
//! **Automatic order**: dma-buf first, then nvidia-peermem. A path is skipped with a recorded
//! [`GpuMrRefusal`] when its precondition is missing (the device reports no dma-buf support; no
//! peer-memory module is loaded) or when its registration fails; the next path is tried. The
//! successful region keeps the refusals of the paths tried before it
//! ([`GpuMemoryRegion::attempts`]); when every path is refused the error is
//! [`Error::NoGpuRegistrationPath`](crate::Error::NoGpuRegistrationPath) carrying all of them.
//! Failures happen at registration, never at the first transfer, and no region ever wraps a NULL
//! `ibv_mr`.
//!
//! Before any verbs call, memory that is not GPUDirect RDMA capable is refused with
//! [`Error::NotRdmaCapable`](crate::Error::NotRdmaCapable): stream-ordered pool memory
//! (`cuMemAllocAsync`, cudarc's `CudaSlice`, [`PoolBuffer`](crate::memory::PoolBuffer)) reports
//! `CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE = 0` ([`check_rdma_capable`]). Registration
//! also sets `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` on the memory ([`set_sync_memops`]), so
//! synchronous CUDA copies to and from it complete before they return (what a NIC reading or
//! writing it next relies on).
//!
//! A consumer on the GPU that reads what a NIC wrote may need [`flush_gpudirect_rdma_writes`]
//! first.
//!
//! The region owns the memory and, for dma-buf, the exported fd: `ibv_dereg_mr` runs when the
//! region and every [`MrSlice`] of it (work requests hold slices until completion) are gone, and
//! only after it succeeds are the fd closed and the memory freed. If it fails, both are leaked.
//!
//! # Connections through rdma_cm
//!
//! A [`Listener`] and [`Connection::connect`] return connected queue pairs, and
//! [`Connection::exchange`] swaps [`RemoteMemory`] descriptors in a first message over the new
//! connection (connect private data holds only 56 bytes, so it is not used).
//!
//! The library creates the queue pair itself (on its own [`Context`] for the device rdma_cm
//! picked) and moves it through INIT, RTR and RTS with the attributes `rdma_init_qp_attr` gives,
//! so the result is an ordinary [`QueuePair<Rts>`].

// Bottom up, each module imports only those before it: ffi, teardown, device, context, pd, mr,
// gpu_mr, wr, posted (the posted-request tables and CQ room), mw (memory windows), srq, cq, qp,
// cm, async_backlog, async_qp.
mod async_backlog;
mod async_qp;
mod cm;
mod context;
mod cq;
mod device;
mod ffi;
mod gpu_mr;
mod mr;
mod mw;
mod pd;
mod posted;
mod qp;
mod srq;
mod teardown;
mod wr;

pub use crate::error::{GpuMrAttempts, GpuMrPath, GpuMrRefusal, WcStatus};
pub use async_qp::{AsyncCq, AsyncQueuePair, Completed, Immediates, Messages, Received, WcFuture};
pub use cm::{
    CmLink, CmLinkEvent, ConnectOptions, ConnectRequest, Connection, ConnectionBinding,
    ConnectionParts, HANDSHAKE_BYTES, Listener, QpResources,
};
pub use context::{
    AsyncEvent, AsyncEventKind, Context, DeviceAttr, Gid, GidEntry, GidType, LinkLayer, Mtu,
    PortAttr, PortState,
};
pub use cq::{
    CompletionChannel, CompletionQueue, Completions, CqEvent, POLL_BATCH, WcOpcode, WorkCompletion,
};
pub use device::{Device, DeviceList};
pub use ffi::{ForkStatus, fork_status};
pub use gpu_mr::{
    FlushOutcome, FlushScope, GpuMemoryRegion, GpuMrSource, GpuRegistration, check_rdma_capable,
    flush_gpudirect_rdma_writes, flush_plan, set_sync_memops,
};
pub use mr::{
    AccessFlags, DmabufRegArgs, DmabufRegion, HostBuffer, HostMemory, Local, MemoryRegion, MrMode,
    MrSlice, Remote, RemoteMemory, RemoteSlice,
};
pub use mw::{
    BindOutcome, BoundWindow, InvalidateOutcome, MemoryWindow, MemoryWindowTypes, PendingBind,
    PendingInvalidate, WindowBind, WindowRefused,
};
pub use pd::ProtectionDomain;
pub use qp::{
    CanRecv, DRAIN_TIMEOUT, Endpoint, ErrorState, Init, QpCaps, QpState, QpStateKind, QueuePair,
    Reset, Rtr, RtrAttr, Rts, RtsAttr,
};
pub use srq::SharedReceiveQueue;
pub use teardown::{TeardownStats, teardown_stats};
pub use wr::{RecvRequest, SendRequest};
