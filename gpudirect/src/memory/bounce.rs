//! The pinned bounce-buffer pool and its copy engine: how the crate moves data between device
//! memory and something the GPU cannot reach directly (a file read with `pread`, another GPU
//! without peer access).
//!
//! # Pieces
//!
//! - [`BouncePool`]: pinned host chunks of one size (portable to every context, page aligned, so
//!   `O_DIRECT` can read into them; from 2 MiB up on transparent huge pages where the kernel gives
//!   them, so that a read into a chunk is a few physically contiguous DMA segments, not hundreds),
//!   allocated on first use and recycled: a
//!   [`BounceChunk`] goes back to its pool when dropped, so a steady stream of transfers allocates
//!   no pinned memory after warming up.
//! - [`CopyEngine`]: a few streams ("lanes") of one device, each with its own recycled events.
//!   A copy between a chunk and device memory is queued on a lane, an event is recorded after
//!   it, and the chunk is owned by the returned [`ChunkCopy`] until that event has completed:
//!   only then does [`ChunkCopy::wait`] hand it back (dropping a `ChunkCopy` waits a bounded time
//!   and then parks the chunk in the [`Tracker`](crate::completion::Tracker); forgetting it leaks
//!   the chunk). No lock is taken per copy beyond the lane's own event list.
//!
//! Work is queued only on the engine's own streams, created non-blocking and never handed out,
//! so nobody can begin a graph capture on them (every copy passes the crate's capture check all
//! the same) and they never wait for the legacy default stream: a fence on a lane is always about
//! the copies queued there.
//!
//! How the storage path and the staged peer copy use them: [`CopyEngine`]'s docs.

use super::host::{HostAllocFlags, PinnedHostBuffer};
use super::huge::{HUGE_PAGE, HugePinned};
use super::kind::{DeviceMemory, DeviceMemoryMut};
use crate::completion::capture::{DriverStream, PrivateStream, Refused};
use crate::completion::{Fence, InFlight, LONG_WAIT, forked, poll_until};
#[cfg(any(test, feature = "p2p"))]
use crate::cuda::Stream;
use crate::driver;
use crate::driver::ctx::bind;
use crate::error::{Error, MemoryKind, Result};
use cudarc::driver::{CudaContext, sys};
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The alignment of every chunk's first byte (pinned allocations are page aligned).
pub const BOUNCE_ALIGN: usize = 4096;

/// The largest chunk a [`BouncePool`] hands out, in bytes (1 GiB).
pub const MAX_CHUNK_BYTES: usize = 1 << 30;

/// The most lanes (streams) one [`CopyEngine`] may have.
pub const MAX_LANES: usize = 256;

/// How long a wait polls `cuEventQuery` (yielding) before it waits in `cuEventSynchronize`.
const SPIN: Duration = Duration::from_micros(50);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A pool of pinned host chunks of one size, recycled. Cheap to clone (one `Arc`).
///
/// Chunks are pinned for every context of the process (so any device's copy engine may use them)
/// and page aligned. From 2 MiB up they are anonymous memory at a 2 MiB boundary, advised to
/// transparent huge pages (`MADV_HUGEPAGE`) and wiped in forked children (`MADV_WIPEONFORK`),
/// and pinned with `cuMemHostRegister(CU_MEMHOSTREGISTER_PORTABLE)`: an `O_DIRECT` read of up to
/// 2 MiB into a huge page is usually one DMA segment, where `cuMemHostAlloc` memory may be split
/// into hundreds, and reads into it are slower (`docs/storage.md`, "Physically contiguous
/// buffers"). Smaller chunks are
/// `cuMemHostAlloc(chunk_bytes, CU_MEMHOSTALLOC_PORTABLE)` memory, and so is every chunk after
/// the huge-page path failed once (a pool may then hold chunks of both kinds). They are
/// allocated when [`take`](Self::take) finds no idle one, and go back to the pool when the
/// [`BounceChunk`] is dropped; the pool keeps as many idle chunks as were ever in use at once, or
/// [`max_idle`](Self::max_idle) if that is more, and frees the rest (so a transfer that needs
/// more chunks than `max_idle` finds them again next time instead of pinning them anew: pinning
/// costs far more than the copy; [`trim`](Self::trim) gives them back). Idle chunks are freed when the last clone of the pool and the last chunk
/// are gone.
#[derive(Clone)]
#[doc(alias = "cuMemHostAlloc")]
pub struct BouncePool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    ctx: Arc<CudaContext>,
    chunk: usize,
    max_idle: usize,
    pid: u32,
    idle: Mutex<Vec<HostChunk>>,
    /// The huge-page path failed once: later chunks go straight to `cuMemHostAlloc`.
    no_huge: AtomicBool,
    /// Chunks taken and not yet back, and the most ever at once.
    out: AtomicUsize,
    peak: AtomicUsize,
}

impl std::fmt::Debug for BouncePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BouncePool")
            .field("ordinal", &self.inner.ctx.ordinal())
            .field("chunk_bytes", &self.inner.chunk)
            .field("idle", &self.idle())
            .finish()
    }
}

/// Check a chunk size: a non-zero multiple of [`BOUNCE_ALIGN`] of at most [`MAX_CHUNK_BYTES`].
pub(crate) fn check_chunk_bytes(chunk_bytes: usize) -> Result<()> {
    if chunk_bytes == 0
        || chunk_bytes > MAX_CHUNK_BYTES
        || !chunk_bytes.is_multiple_of(BOUNCE_ALIGN)
    {
        return Err(Error::invalid(
            "chunk_bytes",
            chunk_bytes,
            format!("must be a non-zero multiple of {BOUNCE_ALIGN} of at most {MAX_CHUNK_BYTES}"),
        ));
    }
    Ok(())
}

impl BouncePool {
    /// A pool of `chunk_bytes`-byte chunks pinned in `ctx`, keeping at most `max_idle` idle
    /// chunks. Allocates nothing yet.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `chunk_bytes` is 0, above [`MAX_CHUNK_BYTES`] or not a
    /// multiple of [`BOUNCE_ALIGN`]; as [`crate::cuda::init`].
    pub fn new(ctx: &Arc<CudaContext>, chunk_bytes: usize, max_idle: usize) -> Result<Self> {
        check_chunk_bytes(chunk_bytes)?;
        crate::cuda::init()?;
        Ok(BouncePool {
            inner: Arc::new(PoolInner {
                ctx: ctx.clone(),
                chunk: chunk_bytes,
                max_idle,
                pid: std::process::id(),
                idle: Mutex::new(Vec::new()),
                no_huge: AtomicBool::new(false),
                out: AtomicUsize::new(0),
                peak: AtomicUsize::new(0),
            }),
        })
    }

    /// The process-wide pool of `chunk_bytes`-byte chunks of device `ordinal`'s primary context
    /// (the one the storage path uses), created on first use; it keeps up to 512 MiB or 64
    /// chunks idle, whichever is more, and more after a larger peak (see the type).
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new) and [`crate::cuda::context`].
    #[cfg(any(test, feature = "p2p", feature = "storage"))]
    pub(crate) fn shared(ordinal: usize, chunk_bytes: usize) -> Result<Self> {
        static ALL: Mutex<Vec<(usize, usize, BouncePool)>> = Mutex::new(Vec::new());
        check_chunk_bytes(chunk_bytes)?;
        let mut all = lock(&ALL);
        if let Some((_, _, p)) = all
            .iter()
            .find(|(o, c, _)| *o == ordinal && *c == chunk_bytes)
        {
            return Ok(p.clone());
        }
        let ctx = crate::cuda::context(ordinal)?;
        let max_idle = ((512 << 20) / chunk_bytes).max(64);
        let p = BouncePool::new(&ctx, chunk_bytes, max_idle)?;
        all.push((ordinal, chunk_bytes, p.clone()));
        Ok(p)
    }

    /// The size of every chunk, in bytes.
    pub fn chunk_bytes(&self) -> usize {
        self.inner.chunk
    }

    /// The most idle chunks the pool keeps at least (more after a peak above it: see the type).
    pub fn max_idle(&self) -> usize {
        self.inner.max_idle
    }

    /// The idle chunks held now.
    pub fn idle(&self) -> usize {
        lock(&self.inner.idle).len()
    }

    /// The context the chunks are pinned in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// An idle chunk, or a new one when none is idle (zero-filled: on huge pages from 2 MiB up,
    /// `cuMemHostAlloc` below or once that failed, see the type). Its contents are whatever its
    /// last user left there.
    ///
    /// # Errors
    ///
    /// As [`PinnedHostBuffer::alloc`] (`CUDA_ERROR_OUT_OF_MEMORY` when no more memory can be
    /// pinned); [`Error::Unsupported`] in a forked child of the process that made the pool.
    #[doc(alias = "cuMemHostAlloc")]
    #[doc(alias = "cuMemHostRegister")]
    pub fn take(&self) -> Result<BounceChunk> {
        if forked(self.inner.pid) {
            return Err(Error::Unsupported {
                what: "a bounce chunk".into(),
                reason: "in a forked child of the process that made the pool".into(),
            });
        }
        let idle = lock(&self.inner.idle).pop();
        let buf = match idle {
            Some(b) => b,
            None => HostChunk::alloc(&self.inner.ctx, self.inner.chunk, &self.inner.no_huge)?,
        };
        let out = self.inner.out.fetch_add(1, Ordering::Relaxed) + 1;
        self.inner.peak.fetch_max(out, Ordering::Relaxed);
        Ok(BounceChunk {
            buf: ManuallyDrop::new(buf),
            pool: self.inner.clone(),
        })
    }

    /// The most chunks ever in use at once (the pool keeps up to this many idle).
    pub fn peak(&self) -> usize {
        self.inner.peak.load(Ordering::Relaxed)
    }

    /// Free every idle chunk now (`cuMemFreeHost`, or `cuMemHostUnregister` and `munmap`).
    pub fn trim(&self) {
        // The peak starts again from what is in use now.
        self.inner
            .peak
            .store(self.inner.out.load(Ordering::Relaxed), Ordering::Relaxed);
        let idle = std::mem::take(&mut *lock(&self.inner.idle));
        drop(idle);
    }
}

/// One pinned chunk of a [`BouncePool`], owned: the host reads and writes it through `Deref`
/// (`&[u8]`, `&mut [u8]`), and copies take it by value ([`CopyEngine`]), so no reference to it
/// exists while a copy uses it. Dropping it gives it back to its pool.
///
/// It is also [`DeviceMemory`], of kind [`MemoryKind::RegisteredHost`] (huge pages pinned in
/// place) or [`MemoryKind::PinnedHost`] (`cuMemHostAlloc`), so every copy of the crate accepts it.
pub struct BounceChunk {
    buf: ManuallyDrop<HostChunk>,
    pool: Arc<PoolInner>,
}

/// Pinned host memory for a device to read and write (a bounce chunk, the transfer engine's
/// staging ring): huge pages pinned in place from [`HUGE_PAGE`] up, where the kernel and the
/// driver allow; `cuMemHostAlloc` otherwise.
#[derive(Debug)]
pub(crate) enum HostChunk {
    Alloc(PinnedHostBuffer<u8>),
    Huge(HugePinned<u8>),
}

impl HostChunk {
    /// `bytes` bytes, zero-filled: [`HugePinned`] from [`HUGE_PAGE`] up (a huge page usually
    /// keeps a read of up to 2 MiB one physically contiguous DMA segment) unless `no_huge`,
    /// else, or when that fails (which sets `no_huge`), `cuMemHostAlloc(PORTABLE)`.
    ///
    /// # Errors
    ///
    /// As [`PinnedHostBuffer::alloc`].
    pub(crate) fn alloc(
        ctx: &Arc<CudaContext>,
        bytes: usize,
        no_huge: &AtomicBool,
    ) -> Result<HostChunk> {
        if bytes >= HUGE_PAGE && !no_huge.load(Ordering::Relaxed) {
            match HugePinned::alloc(ctx, bytes) {
                Ok(h) => return Ok(HostChunk::Huge(h)),
                // Not again: a host that refuses it would pay for mapping and filling every
                // chunk before the fallback.
                Err(_) => no_huge.store(true, Ordering::Relaxed),
            }
        }
        PinnedHostBuffer::alloc(ctx, bytes, HostAllocFlags::PORTABLE).map(HostChunk::Alloc)
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            HostChunk::Alloc(b) => b.as_slice(),
            HostChunk::Huge(b) => b.as_slice(),
        }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            HostChunk::Alloc(b) => b.as_mut_slice(),
            HostChunk::Huge(b) => b.as_mut_slice(),
        }
    }

    /// The memory, either kind.
    fn mem(&self) -> &dyn DeviceMemory<Elem = u8> {
        match self {
            HostChunk::Alloc(b) => b,
            HostChunk::Huge(b) => b,
        }
    }
}

// SAFETY: forwards to the allocation it owns, of either kind (each meets the trait's contract).
unsafe impl DeviceMemory for HostChunk {
    type Elem = u8;
    fn device_ptr(&self) -> u64 {
        self.mem().device_ptr()
    }
    fn len(&self) -> usize {
        self.mem().len()
    }
    fn ordinal(&self) -> usize {
        self.mem().ordinal()
    }
    fn kind(&self) -> MemoryKind {
        self.mem().kind()
    }
    fn host_ptr(&self) -> Option<*mut u8> {
        self.mem().host_ptr()
    }
}

// SAFETY: references to the bytes exist only through `&self`/`&mut self` of the owner, which a
// data path holding the value by value excludes.
unsafe impl DeviceMemoryMut for HostChunk {}

impl std::fmt::Debug for BounceChunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BounceChunk")
            .field("bytes", &self.buf.len())
            .finish()
    }
}

impl BounceChunk {
    /// The host address of the first byte ([`BOUNCE_ALIGN`]-aligned).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.buf.as_mut_slice().as_mut_ptr()
    }
}

impl std::ops::Deref for BounceChunk {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.buf.as_slice()
    }
}

impl std::ops::DerefMut for BounceChunk {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.buf.as_mut_slice()
    }
}

impl Drop for BounceChunk {
    fn drop(&mut self) {
        // SAFETY: taken once, here, in the drop.
        let buf = unsafe { ManuallyDrop::take(&mut self.buf) };
        if forked(self.pool.pid) {
            // No locks and no frees in a forked child: leak.
            std::mem::forget(buf);
            return;
        }
        self.pool.out.fetch_sub(1, Ordering::Relaxed);
        let keep = self
            .pool
            .max_idle
            .max(self.pool.peak.load(Ordering::Relaxed));
        let mut idle = lock(&self.pool.idle);
        if idle.len() < keep {
            idle.push(buf);
        } else {
            drop(idle);
            drop(buf); // cuMemFreeHost, or cuMemHostUnregister and munmap
        }
    }
}

// SAFETY: forwards to the pinned buffer it owns, which stays allocated (it is only given back
// to the pool, never freed, while the chunk lives) and does not move with the chunk.
unsafe impl DeviceMemory for BounceChunk {
    type Elem = u8;
    fn device_ptr(&self) -> u64 {
        self.buf.device_ptr()
    }
    fn len(&self) -> usize {
        self.buf.len()
    }
    fn ordinal(&self) -> usize {
        self.buf.ordinal()
    }
    fn kind(&self) -> MemoryKind {
        self.buf.kind()
    }
    fn host_ptr(&self) -> Option<*mut u8> {
        self.buf.host_ptr()
    }
}

// SAFETY: the chunk hands out references to its bytes only through `&self`/`&mut self`, which a
// data path that owns it excludes.
unsafe impl DeviceMemoryMut for BounceChunk {}

/// One stream of a [`CopyEngine`] and its idle events.
struct Lane {
    ctx: Arc<CudaContext>,
    stream: PrivateStream<DriverStream>,
    events: Mutex<Vec<sys::CUevent>>,
    pid: u32,
}

// SAFETY: the stream and events are driver handles, usable from any thread; the event list is
// behind a mutex.
unsafe impl Send for Lane {}
// SAFETY: as above.
unsafe impl Sync for Lane {}

impl Lane {
    /// Record an event (an idle one, or a new one) after the work queued so far.
    ///
    /// # Safety
    ///
    /// The lane's context is current.
    unsafe fn record(self: &Arc<Self>) -> Result<CopyFence> {
        let idle = lock(&self.events).pop();
        let event = match idle {
            Some(e) => e,
            // SAFETY: the context is current (the caller's).
            None => unsafe { driver::event::create(EVENT_FLAGS)? },
        };
        let fence = CopyFence {
            lane: self.clone(),
            event,
        };
        // SAFETY: a live event and stream of the current context.
        unsafe { driver::event::record(event, self.stream.cu_stream()) }?;
        Ok(fence)
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        if forked(self.pid) || bind(&self.ctx).is_err() {
            return; // leak
        }
        // Every fence holds the lane, so none is left: the idle events are all there is.
        for e in std::mem::take(&mut *lock(&self.events)) {
            // SAFETY: created by this lane, destroyed once.
            let _ = unsafe { driver::event::destroy(e) };
        }
        // The stream is destroyed after this, by its own drop.
    }
}

/// `CU_EVENT_DISABLE_TIMING`, without `CU_EVENT_BLOCKING_SYNC`: a wait past [`SPIN`] is a
/// `cuEventSynchronize` that follows the context's scheduling (under the default
/// `CU_CTX_SCHED_AUTO` it spins while the process has fewer active contexts than cores, and
/// yields otherwise), so a reader thread takes its chunk back as soon as the copy ends. Such a
/// wait lasts until the lane has finished this copy and whatever was queued on it before (lanes
/// are shared: another transfer's readers or a staged peer copy may queue there too). With
/// `CU_EVENT_BLOCKING_SYNC` the thread slept until an interrupt woke it, and hot reads were
/// slower; polling `cuEventQuery` for 2 ms first (16 readers querying at once) was slower either
/// way (`docs/storage.md`, "Where a hot read's time goes").
const EVENT_FLAGS: u32 = sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32;

/// A fence on one event of a lane: complete once the copy recorded before it has finished.
/// Dropping it gives the event back to its lane (re-recording an event that a stream wait has
/// already captured does not change that wait).
pub(crate) struct CopyFence {
    lane: Arc<Lane>,
    event: sys::CUevent,
}

// SAFETY: the event is a driver handle usable from any thread.
unsafe impl Send for CopyFence {}
// SAFETY: as above; `&self` only queries it.
unsafe impl Sync for CopyFence {}

impl CopyFence {
    fn query(&self) -> bool {
        if bind(&self.lane.ctx).is_err() {
            return false;
        }
        // SAFETY: a live event (the lane outlives the fence); an error is "not complete".
        matches!(unsafe { driver::event::query(self.event) }, Ok(true))
    }
}

impl Fence for CopyFence {
    fn is_complete(&self) -> bool {
        self.query()
    }

    fn wait_timeout(&self, timeout: Duration) -> bool {
        if poll_until(|| self.query(), timeout.min(SPIN)) {
            return true;
        }
        if timeout >= LONG_WAIT {
            // SAFETY: a live event; its context is current after `query`.
            return unsafe { driver::event::synchronize(self.event) }.is_ok() && self.query();
        }
        poll_until(|| self.query(), timeout)
    }
}

impl Drop for CopyFence {
    fn drop(&mut self) {
        if forked(self.lane.pid) {
            return; // no locks in a forked child: the event leaks
        }
        lock(&self.lane.events).push(self.event);
    }
}

/// Streams ("lanes") of one device for copies between [`BounceChunk`]s and device memory, each
/// with its own recycled events. Cheap to clone (one `Arc`).
///
/// A copy is queued on lane `lane % lanes()` through the graph-capture check that all of the
/// crate's stream work passes (a capturing stream gets no copy), an event is recorded after it,
/// and the chunk is owned by the returned [`ChunkCopy`] until that event has completed. The lanes are the engine's own
/// non-blocking streams, never handed out, so nobody begins a capture on them (the check refuses
/// one all the same), and they never wait for the legacy default stream.
///
/// # How the crate uses it
///
/// **A pipeline that reads a file into device memory** (the storage module's POSIX path): each
/// reader thread keeps a few chunks. For chunk *n* of the file it takes back a chunk whose copy
/// has completed ([`ChunkCopy::wait`]), `pread`s into it, and queues the host-to-device copy on
/// its lane right away; while that copy runs, it reads chunk *n + 1* into its other buffer.
/// Writes run the other way: a device-to-host copy into a chunk, a wait, a `pwrite`.
///
/// **A staged copy between two GPUs** (no peer access; the P2P module's staged path): a copier
/// keeps a ring of chunks, each behind the last copy that went through it. Chunk *k* of the data
/// takes the ring's next chunk: a device-to-host copy on the copier's lane of the source device's
/// engine, after a stream wait on that chunk's previous host-to-device copy, then a
/// host-to-device copy on its lane of the destination device's engine, after a stream wait on
/// the first. The host never blocks, and with one lane per direction the source's copy of chunk
/// *k + 1* runs while chunk *k* enters the destination:
///
/// ```text
/// let c = ChunkCopy::idle(pool.take()?);                           // or the ring's last copy
/// let c = c.then(Dir::D2h, &src_engine, d2h_lane, 0, len, src_k)?;  // waits on the chunk's last copy
/// let c = c.then(Dir::H2d, &dst_engine, h2d_lane, 0, len, dst_k)?;  // waits on the D2H's event
/// c.order_before(&copier_stream)?;                                 // a fence for the whole copy
/// ```
///
/// The raw forms (`*_raw`, `then`) take device addresses and are crate-private and `unsafe`:
/// the caller owns the device memory until the copies complete. The public forms
/// ([`CopyEngine::h2d`], [`CopyEngine::d2h`]) take the device buffer by value and hand it back
/// with the chunk:
///
/// ```no_run
/// use gpudirect::memory::{BouncePool, CopyEngine, DeviceBuffer};
///
/// # fn main() -> gpudirect::Result<()> {
/// let ctx = gpudirect::cuda::context(0)?;
/// let pool = BouncePool::new(&ctx, 1 << 20, 4)?;
/// let engine = CopyEngine::new(&ctx, 2)?;
/// let mut chunk = pool.take()?;
/// chunk.fill(7);
/// let dst = DeviceBuffer::<u8>::alloc(&ctx, 1 << 20)?;
/// let (chunk, dst) = engine.h2d(0, chunk, 0, dst, 0, 1 << 20)?.wait()?;
/// # drop((chunk, dst));
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct CopyEngine {
    inner: Arc<EngineInner>,
}

struct EngineInner {
    ctx: Arc<CudaContext>,
    lanes: Vec<Arc<Lane>>,
}

impl std::fmt::Debug for CopyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyEngine")
            .field("ordinal", &self.inner.ctx.ordinal())
            .field("lanes", &self.inner.lanes.len())
            .finish()
    }
}

/// Which way a chunk copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dir {
    /// From the chunk to device memory.
    H2d,
    /// From device memory into the chunk.
    D2h,
}

/// One copy through a chunk: `len` bytes between byte `offset` of the chunk and device address
/// `addr`, in direction `dir`, on lane `lane % lanes` of the engine that queues it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Leg {
    pub(crate) dir: Dir,
    pub(crate) lane: usize,
    pub(crate) offset: usize,
    pub(crate) len: usize,
    pub(crate) addr: u64,
}

impl CopyEngine {
    /// `lanes` new non-blocking streams on `ctx` (`cuStreamCreate`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for `lanes` outside `1..=`[`MAX_LANES`]; as
    /// [`crate::cuda::init`]; [`Error::Cuda`] from `cuStreamCreate`.
    #[doc(alias = "cuStreamCreate")]
    pub fn new(ctx: &Arc<CudaContext>, lanes: usize) -> Result<Self> {
        if lanes == 0 || lanes > MAX_LANES {
            return Err(Error::invalid(
                "lanes",
                lanes,
                format!("must be between 1 and {MAX_LANES}"),
            ));
        }
        crate::cuda::init()?;
        bind(ctx)?;
        let mut v = Vec::with_capacity(lanes);
        for _ in 0..lanes {
            let stream = PrivateStream::new(ctx)?;
            // Pushed at once, so that a later failure destroys the streams made so far.
            v.push(Arc::new(Lane {
                ctx: ctx.clone(),
                stream,
                events: Mutex::new(Vec::new()),
                pid: std::process::id(),
            }));
        }
        Ok(CopyEngine {
            inner: Arc::new(EngineInner {
                ctx: ctx.clone(),
                lanes: v,
            }),
        })
    }

    /// The process-wide engine of device `ordinal`'s primary context, with [`SHARED_LANES`]
    /// lanes, created on first use.
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new) and [`crate::cuda::context`].
    #[cfg(any(test, feature = "p2p", feature = "storage"))]
    pub(crate) fn shared(ordinal: usize) -> Result<Self> {
        static ALL: Mutex<Vec<(usize, CopyEngine)>> = Mutex::new(Vec::new());
        let mut all = lock(&ALL);
        if let Some((_, e)) = all.iter().find(|(o, _)| *o == ordinal) {
            return Ok(e.clone());
        }
        let ctx = crate::cuda::context(ordinal)?;
        let e = CopyEngine::new(&ctx, SHARED_LANES)?;
        all.push((ordinal, e.clone()));
        Ok(e)
    }

    /// The number of lanes.
    pub fn lanes(&self) -> usize {
        self.inner.lanes.len()
    }

    /// The device's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    fn lane(&self, lane: usize) -> &Arc<Lane> {
        &self.inner.lanes[lane % self.inner.lanes.len()]
    }

    /// Queue `leg`, one copy of `len` bytes between byte `offset` of the chunk `prev` owns and
    /// device address `addr` on lane `lane % lanes`, after `prev` (a stream wait on its fence, when it
    /// has one), through the graph-capture protocol for a private stream
    /// ([`PrivateStream::enqueue`]), and record its
    /// fence. `prev`'s own fence goes back to its lane: the stream wait keeps the record it saw.
    ///
    /// On error `prev` comes back (`kept: Some`) when no work queued here can still use the
    /// chunk; it is leaked (`kept: None`) when queued work may use the chunk and `addr`'s memory
    /// with no fence to say when it ends (a graph may hold it, or the stream failed): the caller
    /// must then leak that memory too.
    ///
    /// # Safety
    ///
    /// `addr..addr + len` is memory this device's copies may read (`D2h`) or write (`H2d`),
    /// valid and not accessed by anyone else until the returned copy has completed.
    unsafe fn queue(
        &self,
        prev: ChunkCopy,
        leg: Leg,
    ) -> std::result::Result<ChunkCopy, Box<Refused<ChunkCopy>>> {
        let Leg {
            dir,
            lane,
            offset,
            len,
            addr,
        } = leg;
        let (after, chunk, ()) = prev.parts.as_ref().expect("parts present until taken");
        let after = after.as_ref().map(|f| f.event);
        // The host address, not a slice: the chunk's previous copy may still be writing it.
        let base = chunk.buf.host_ptr();
        let host = base
            .unwrap_or(std::ptr::null_mut())
            .cast_const()
            .wrapping_add(offset);
        let checked = check_span(offset, len, chunk.len(), addr).and_then(|()| match base {
            Some(_) => Ok(()),
            None => Err(Error::invalid(
                "chunk",
                "no host address",
                "a chunk is host memory",
            )),
        });
        let lane = self.lane(lane).clone();
        if let Err(error) = checked.and_then(|()| bind(&lane.ctx)) {
            return Err(Box::new(Refused {
                error,
                kept: Some(prev),
            }));
        }
        let call = match dir {
            Dir::H2d => "cuMemcpyHtoDAsync_v2",
            Dir::D2h => "cuMemcpyDtoHAsync_v2",
        };
        // The lanes are the engine's own streams, never handed out, and they wait only on
        // events of other lanes: they meet `PrivateStream`'s rule, so the per-chunk capture
        // questions are skipped (with many readers they contend in the driver).
        let ((), prev) = lane
            .stream
            .enqueue(call, prev, |raw, _| {
                if let Some(event) = after {
                    // SAFETY: a live stream and event; the wait takes the event's latest record now.
                    unsafe { driver::stream::wait_event(raw, event) }?;
                }
                // SAFETY: `host..host + len` lies in the chunk (checked), which the returned copy
                // owns until its fence completes; `addr..addr + len` is the caller's; the stream is
                // live.
                unsafe {
                    match dir {
                        Dir::H2d => driver::mem::copy_htod_async(addr, host.cast(), len, raw),
                        Dir::D2h => {
                            driver::mem::copy_dtoh_async(host.cast_mut().cast(), addr, len, raw)
                        }
                    }
                }
            })
            .map_err(Box::new)?;
        // SAFETY: the lane's context is current.
        match unsafe { lane.record() } {
            Ok(fence) => Ok(prev.refenced(fence)),
            // The copy is queued but has no fence: wait for the stream, or leak the chunk.
            // SAFETY: a live stream.
            Err(error) => match unsafe { driver::stream::synchronize(lane.stream.cu_stream()) } {
                Ok(()) => Err(Box::new(Refused {
                    error,
                    kept: Some(prev),
                })),
                Err(_) => {
                    std::mem::forget(prev);
                    Err(Box::new(Refused { error, kept: None }))
                }
            },
        }
    }

    /// Queue a copy of `len` bytes at byte `offset` of `chunk` to device address `dst`, on lane
    /// `lane % lanes`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the range leaves the chunk or `dst + len` wraps (the chunk
    /// goes back to its pool); [`Error::Cuda`] from the driver (the chunk goes back to its pool
    /// once nothing can use it, or leaks when that cannot be proven).
    ///
    /// # Safety
    ///
    /// `dst..dst + len` is device memory this engine's device may write, valid and neither read
    /// nor written by anyone else until the returned copy has completed.
    #[doc(alias = "cuMemcpyHtoDAsync")]
    #[cfg(feature = "storage")]
    pub(crate) unsafe fn h2d_raw(
        &self,
        lane: usize,
        chunk: BounceChunk,
        offset: usize,
        len: usize,
        dst: u64,
    ) -> Result<ChunkCopy> {
        let idle = ChunkCopy::idle(chunk);
        let leg = Leg {
            dir: Dir::H2d,
            lane,
            offset,
            len,
            addr: dst,
        };
        // SAFETY: forwarded from the caller.
        unsafe { self.queue(idle, leg) }.map_err(|r| r.error)
    }

    /// Queue a copy of `len` bytes from device address `src` into `chunk` at byte `offset`, on
    /// lane `lane % lanes`.
    ///
    /// # Errors
    ///
    /// As [`h2d_raw`](Self::h2d_raw).
    ///
    /// # Safety
    ///
    /// `src..src + len` is device memory this engine's device may read, valid and not written by
    /// anyone else until the returned copy has completed.
    #[doc(alias = "cuMemcpyDtoHAsync")]
    #[cfg(feature = "storage")]
    pub(crate) unsafe fn d2h_raw(
        &self,
        lane: usize,
        chunk: BounceChunk,
        offset: usize,
        len: usize,
        src: u64,
    ) -> Result<ChunkCopy> {
        let idle = ChunkCopy::idle(chunk);
        let leg = Leg {
            dir: Dir::D2h,
            lane,
            offset,
            len,
            addr: src,
        };
        // SAFETY: forwarded from the caller.
        unsafe { self.queue(idle, leg) }.map_err(|r| r.error)
    }

    /// Check that `mem` belongs to this engine's device and that `offset..offset + len` lies in
    /// it; its address there.
    fn device_range<M: DeviceMemory>(&self, mem: &M, offset: usize, len: usize) -> Result<u64> {
        if mem.ordinal() != self.inner.ctx.ordinal() {
            return Err(Error::invalid(
                "buffer",
                format!("device {}", mem.ordinal()),
                format!(
                    "must be on the engine's device {}",
                    self.inner.ctx.ordinal()
                ),
            ));
        }
        match offset.checked_add(len) {
            Some(end) if end <= mem.byte_len() => {}
            _ => {
                return Err(Error::invalid(
                    "len",
                    format!("{offset}+{len}"),
                    format!("must lie within the buffer's {} bytes", mem.byte_len()),
                ));
            }
        }
        mem.device_ptr().checked_add(offset as u64).ok_or_else(|| {
            Error::invalid(
                "offset",
                offset,
                "the buffer's address + offset passes 2^64",
            )
        })
    }

    /// Queue a copy of `len` bytes at byte `chunk_offset` of `chunk` into `dst` at byte
    /// `dst_offset`, on lane `lane % lanes`. The returned copy owns both until it has completed.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when a range leaves its buffer or `dst` is on another device
    /// (before any driver call); [`Error::StreamCapturing`] or [`Error::Cuda`] from the driver.
    /// The chunk and `dst` are dropped, or leaked when a copy that no fence covers may still use
    /// them.
    #[doc(alias = "cuMemcpyHtoDAsync")]
    pub fn h2d<M: DeviceMemoryMut>(
        &self,
        lane: usize,
        chunk: BounceChunk,
        chunk_offset: usize,
        dst: M,
        dst_offset: usize,
        len: usize,
    ) -> Result<ChunkCopy<M>> {
        let addr = self.device_range(&dst, dst_offset, len)?;
        let idle = ChunkCopy::idle(chunk);
        let leg = Leg {
            dir: Dir::H2d,
            lane,
            offset: chunk_offset,
            len,
            addr,
        };
        // SAFETY: the range lies in `dst` (checked), which the returned copy owns until it has
        // completed (or which is leaked); `DeviceMemoryMut` means nobody else references it.
        holding(unsafe { self.queue(idle, leg) }, dst)
    }

    /// Queue a copy of `len` bytes of `src` from byte `src_offset` into `chunk` at byte
    /// `chunk_offset`, on lane `lane % lanes`. The returned copy owns both until it has completed.
    ///
    /// # Errors
    ///
    /// As [`h2d`](Self::h2d).
    #[doc(alias = "cuMemcpyDtoHAsync")]
    pub fn d2h<M: DeviceMemory>(
        &self,
        lane: usize,
        src: M,
        src_offset: usize,
        chunk: BounceChunk,
        chunk_offset: usize,
        len: usize,
    ) -> Result<ChunkCopy<M>> {
        let addr = self.device_range(&src, src_offset, len)?;
        let idle = ChunkCopy::idle(chunk);
        let leg = Leg {
            dir: Dir::D2h,
            lane,
            offset: chunk_offset,
            len,
            addr,
        };
        // SAFETY: the range lies in `src` (checked), which the returned copy owns until it has
        // completed (or which is leaked); shared holders (`Arc`) only read it.
        holding(unsafe { self.queue(idle, leg) }, src)
    }
}

/// A queued copy that owns `m` as well; on refusal the error, and `m` leaked when the copy may
/// still use it with no fence (dropped otherwise).
fn holding<M: Send + 'static>(
    queued: std::result::Result<ChunkCopy, Box<Refused<ChunkCopy>>>,
    m: M,
) -> Result<ChunkCopy<M>> {
    match queued {
        Ok(c) => Ok(c.holding(m)),
        Err(r) => {
            if r.leaked() {
                std::mem::forget(m);
            }
            Err(r.error)
        }
    }
}

/// The lanes of the process-wide engine of each device ([`CopyEngine::shared`]).
#[cfg(any(test, feature = "p2p", feature = "storage"))]
pub(crate) const SHARED_LANES: usize = 32;

/// A copy between a [`BounceChunk`] and device memory in flight: owns the chunk (and `M`, the
/// device buffer of the public forms) until the copy has completed. Dropping it waits a bounded
/// time ([`DROP_WAIT`](crate::completion::DROP_WAIT)) and then parks what it owns in the
/// [`Tracker`](crate::completion::Tracker), as an [`InFlight`] does; forgetting it leaks them.
#[must_use = "dropping a ChunkCopy blocks until the copy completes (bounded), then parks the chunk"]
pub struct ChunkCopy<M: Send + 'static = ()> {
    /// `None` once taken apart. The fence is `None` for a chunk no copy has used yet.
    parts: Option<(Option<CopyFence>, BounceChunk, M)>,
}

impl<M: Send + 'static> std::fmt::Debug for ChunkCopy<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkCopy")
            .field("complete", &self.is_complete())
            .finish()
    }
}

impl<M: Send + 'static> ChunkCopy<M> {
    /// Whether the copy has completed (`cuEventQuery`).
    #[doc(alias = "cuEventQuery")]
    pub fn is_complete(&self) -> bool {
        self.fence().is_none_or(|f| f.is_complete())
    }

    /// The fence of the copy, while it has one.
    fn fence(&self) -> Option<&CopyFence> {
        self.parts.as_ref().and_then(|(f, _, _)| f.as_ref())
    }

    /// Wait for the copy (polling briefly, then `cuEventSynchronize`, which spins under the
    /// default context scheduling) and take the chunk and the buffer back.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when completion cannot be proven (the event's synchronization failed:
    /// a sticky error of the context); the chunk and the buffer are then leaked, never freed.
    #[doc(alias = "cuEventSynchronize")]
    pub fn wait(mut self) -> Result<(BounceChunk, M)> {
        let (fence, chunk, m) = self.parts.take().expect("parts present until taken");
        if fence.as_ref().is_none_or(|f| f.wait_timeout(Duration::MAX)) {
            drop(fence);
            Ok((chunk, m))
        } else {
            std::mem::forget((fence, chunk, m));
            Err(Error::Timeout {
                what: "bounce chunk copy",
                after: Duration::MAX,
            })
        }
    }
}

impl<M: Send + 'static> Drop for ChunkCopy<M> {
    fn drop(&mut self) {
        match self.parts.take() {
            // The InFlight's drop: a bounded wait, then the tracker.
            Some((Some(fence), chunk, m)) => {
                drop(InFlight::new("bounce chunk copy", fence, (chunk, m)))
            }
            Some((None, chunk, m)) => drop((chunk, m)),
            None => {}
        }
    }
}

impl ChunkCopy {
    /// A chunk no copy uses: complete at once, the start of a chain of [`then`](Self::then).
    pub(crate) fn idle(chunk: BounceChunk) -> ChunkCopy {
        ChunkCopy {
            parts: Some((None, chunk, ())),
        }
    }

    /// The same chunk under `fence` (of a copy queued after this one's); this one's fence goes
    /// back to its lane.
    fn refenced(mut self, fence: CopyFence) -> ChunkCopy {
        let (_, chunk, ()) = self.parts.take().expect("parts present until taken");
        ChunkCopy {
            parts: Some((Some(fence), chunk, ())),
        }
    }

    /// Own `m` as well, until the copy completes.
    fn holding<M: Send + 'static>(mut self, m: M) -> ChunkCopy<M> {
        let (fence, chunk, ()) = self.parts.take().expect("parts present until taken");
        ChunkCopy {
            parts: Some((fence, chunk, m)),
        }
    }

    /// Wait and take the chunk back.
    ///
    /// # Errors
    ///
    /// As [`wait`](ChunkCopy::wait).
    #[cfg(any(test, feature = "storage"))]
    pub(crate) fn wait_chunk(self) -> Result<BounceChunk> {
        self.wait().map(|(c, ())| c)
    }

    /// Queue the next copy through this chunk, `leg`: `len` bytes between byte `offset` of the
    /// chunk and device address `addr`, in direction `dir`, on lane `lane` of `engine` (any
    /// device's: the chunk is pinned for every context), after this copy (a stream wait on its event: the
    /// host does not block). The returned copy owns the chunk until its own fence completes.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the range leaves the chunk or `addr + len` wraps;
    /// [`Error::StreamCapturing`] or [`Error::Cuda`] from the driver. The refusal gives this copy
    /// back (`kept: Some`, still owning the chunk) when nothing new that uses the chunk was
    /// queued, and `kept: None` when work may have been queued that no fence covers (the caller
    /// then leaks `addr`'s memory).
    ///
    /// # Safety
    ///
    /// `addr..addr + len` is memory `engine`'s device may read (`D2h`) or write (`H2d`), valid
    /// and not accessed by anyone else until the returned copy has completed.
    #[cfg(any(test, feature = "p2p"))]
    pub(crate) unsafe fn then(
        self,
        engine: &CopyEngine,
        leg: Leg,
    ) -> std::result::Result<ChunkCopy, Box<Refused<ChunkCopy>>> {
        // SAFETY: forwarded from the caller.
        unsafe { engine.queue(self, leg) }
    }

    /// Make `stream` wait for this copy (`cuStreamWaitEvent`, through the graph-capture check):
    /// work queued there afterwards runs after it, so a fence of `stream` taken then covers it.
    /// Nothing for a chunk no copy has used.
    ///
    /// # Errors
    ///
    /// As [`Stream::wait`](crate::cuda::Stream::wait).
    #[doc(alias = "cuStreamWaitEvent")]
    #[cfg(any(test, feature = "p2p"))]
    pub(crate) fn order_before(&self, stream: &Stream) -> Result<()> {
        let Some(event) = self.fence().map(|f| f.event) else {
            return Ok(());
        };
        stream
            .enqueue("cuStreamWaitEvent", (), |raw, ()| {
                // SAFETY: a live stream and event (the lane outlives the fence, which `self`
                // holds); the wait takes the event's latest record now, this copy's.
                unsafe { driver::stream::wait_event(raw, event) }
            })
            .map(drop)
            .map_err(|r| r.error)
    }
}

/// Check a chunk copy: `offset..offset + len` lies in a chunk of `chunk_len` bytes, and
/// `addr + len` does not wrap.
fn check_span(offset: usize, len: usize, chunk_len: usize, addr: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= chunk_len => {}
        _ => {
            return Err(Error::invalid(
                "len",
                format!("{offset}+{len}"),
                format!("must lie within the chunk's {chunk_len} bytes"),
            ));
        }
    }
    if addr.checked_add(len as u64).is_none() {
        return Err(Error::invalid(
            "addr",
            format!("{addr:#x}+{len}"),
            "the device range must not wrap the address space",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_sizes_are_checked_before_any_allocation() {
        assert!(check_chunk_bytes(4096).is_ok());
        assert!(check_chunk_bytes(MAX_CHUNK_BYTES).is_ok());
        for bad in [0, 1, 4095, 4097, MAX_CHUNK_BYTES + 4096, usize::MAX - 4095] {
            let e = check_chunk_bytes(bad).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::InvalidArgument {
                        arg: "chunk_bytes",
                        ..
                    }
                ),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn chunk_copies_stay_in_the_chunk_and_never_wrap() {
        assert!(check_span(0, 4096, 4096, 0x1000).is_ok());
        assert!(check_span(4095, 1, 4096, 0x1000).is_ok());
        assert!(check_span(4095, 2, 4096, 0x1000).is_err());
        assert!(check_span(usize::MAX, 2, 4096, 0x1000).is_err());
        assert!(check_span(0, 16, 4096, u64::MAX - 8).is_err());
    }

    #[test]
    fn event_flags_are_the_c_values() {
        // CU_EVENT_DISABLE_TIMING, not CU_EVENT_BLOCKING_SYNC (0x1)
        assert_eq!(EVENT_FLAGS, 0x2);
    }

    /// A device's context, or `None` (a skip) without a GPU.
    fn gpu() -> Option<Arc<CudaContext>> {
        match crate::cuda::context(0) {
            Ok(c) => Some(c),
            Err(e) => {
                println!("SKIPPED: no GPU: {e}");
                None
            }
        }
    }

    #[test]
    fn chained_copies_stage_through_one_chunk_without_host_waits() {
        // The staged peer copy's shape on one device: device A -> chunk (lane 0), chunk ->
        // device B (lane 1, after a stream wait), then the same chunk takes A's second half
        // (lane 0, after a stream wait on the H2D) and goes to B's second half.
        let Some(ctx) = gpu() else { return };
        let half = 1 << 20;
        let stream = crate::cuda::Stream::new(&ctx).unwrap();
        let data: Vec<u8> = (0..2 * half).map(|i| (i * 7 + 3) as u8).collect();
        let a = crate::memory::DeviceBuffer::from_slice(&stream, &data).unwrap();
        let b = crate::memory::DeviceBuffer::from_slice(&stream, &vec![0xCDu8; 2 * half]).unwrap();
        stream.synchronize().unwrap();
        let pool = BouncePool::new(&ctx, half, 1).unwrap();
        let engine = CopyEngine::new(&ctx, 2).unwrap();
        let (pa, pb) = (a.device_ptr(), b.device_ptr());
        let steps = [
            (Dir::D2h, 0, pa),
            (Dir::H2d, 1, pb),
            (Dir::D2h, 0, pa + half as u64),
            (Dir::H2d, 1, pb + half as u64),
        ];
        let mut c = ChunkCopy::idle(pool.take().unwrap());
        for (dir, lane, addr) in steps {
            let leg = Leg {
                dir,
                lane,
                offset: 0,
                len: half,
                addr,
            };
            // SAFETY: `a` and `b` outlive the copies (waited below) and nothing else touches
            // them.
            c = unsafe { c.then(&engine, leg) }
                .map_err(|r| r.error)
                .unwrap();
        }
        // A stream ordered after the last copy passes it only once it is done.
        c.order_before(&stream).unwrap();
        stream.synchronize().unwrap();
        assert!(c.is_complete(), "the stream waited for the chain");
        let chunk = c.wait_chunk().unwrap();
        assert_eq!(&chunk[..], &data[half..]);
        drop(chunk);
        assert_eq!(pool.idle(), 1, "the chunk went back to its pool");
        assert_eq!(b.to_vec(&stream).unwrap(), data);
    }

    #[test]
    fn no_gpu_is_a_typed_error() {
        if crate::cuda::init().is_ok() {
            return; // a GPU node: tests/storage_bounce.rs covers the engine
        }
        assert!(CopyEngine::shared(0).is_err());
        assert!(BouncePool::shared(0, 1 << 20).is_err());
    }
}
