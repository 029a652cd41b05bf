//! Where a transfer's bounce buffers come from and how they are copied to and from the device:
//! the [`Staging`] trait and the GPU's staging (the memory module's bounce chunks and copy engine).

use super::sys::DIRECT_ALIGN;
use crate::error::{Error, Result};
use crate::memory::{BounceChunk, BouncePool, ChunkCopy, CopyEngine};

/// How a transfer's threads get bounce chunks and copy them to and from the device.
///
/// # Safety
///
/// [`take`](Self::take) returns buffers of at least the `bounce_len` bytes the staging was made
/// for, whose [`ptr`](Self::ptr) is [`DIRECT_ALIGN`]-aligned, writable and used by nothing else;
/// a buffer handed to [`h2d`](Self::h2d) or [`d2h`](Self::d2h) is not touched by the host until
/// [`wait`](Self::wait) gives it back, and `wait` returning `Ok` means its copy has finished.
/// The POSIX path writes and reads the buffers through `ptr` with `pread` and `pwrite`.
pub(crate) unsafe trait Staging: Send + Sync + 'static {
    /// A bounce buffer.
    type Buf: Send;
    /// A copy in flight, owning its buffer.
    type Pending: Send;
    /// Prepare the calling thread (make the device's context current). Every participant calls
    /// it first.
    fn begin(&self) -> Result<()>;
    /// The caller's thread in the relaxed stream-capture mode for the transfer (its waits for
    /// copies must not break a graph capture that another thread runs in global mode); `None`
    /// where nothing needs it.
    fn relax_caller(&self) -> Option<crate::completion::capture::Relaxed> {
        None
    }
    /// A free bounce buffer.
    fn take(&self) -> Result<Self::Buf>;
    /// The host address of `buf`'s first byte.
    fn ptr(buf: &mut Self::Buf) -> *mut u8;
    /// Queue a copy of `len` bytes at `ptr(buf) + offset` to device address `dst`, on lane `lane`.
    ///
    /// # Safety
    ///
    /// `dst..dst + len` is device memory that stays valid, and is touched by nothing else, until
    /// the copy has been waited for.
    unsafe fn h2d(
        &self,
        lane: usize,
        buf: Self::Buf,
        offset: usize,
        len: usize,
        dst: u64,
    ) -> Result<Self::Pending>;
    /// Queue a copy of `len` bytes from device address `src` to the start of `buf`, on lane
    /// `lane`.
    ///
    /// # Safety
    ///
    /// `src..src + len` is device memory that stays valid, and is not written by anything else,
    /// until the copy has been waited for.
    unsafe fn d2h(
        &self,
        lane: usize,
        buf: Self::Buf,
        len: usize,
        src: u64,
    ) -> Result<Self::Pending>;
    /// Wait for a copy; its buffer back.
    fn wait(&self, p: Self::Pending) -> Result<Self::Buf>;
}

/// The GPU's staging: chunks of the device's process-wide [`BouncePool`] of that size, copies
/// on the lanes of its process-wide [`CopyEngine`] (participant `p` on lane `p`).
#[derive(Debug, Clone)]
pub(crate) struct GpuStaging {
    pool: BouncePool,
    engine: CopyEngine,
}

impl GpuStaging {
    /// The staging of device `ordinal` for bounce chunks of `bounce_len` bytes.
    ///
    /// # Errors
    ///
    /// As [`crate::cuda::context`]; [`Error::Cuda`] creating the engine's streams.
    pub(crate) fn for_device(ordinal: usize, bounce_len: usize) -> Result<GpuStaging> {
        let bytes = bounce_len
            .checked_next_multiple_of(DIRECT_ALIGN)
            .ok_or_else(|| Error::invalid("bounce_len", bounce_len, "overflows"))?;
        Ok(GpuStaging {
            pool: BouncePool::shared(ordinal, bytes)?,
            engine: CopyEngine::shared(ordinal)?,
        })
    }
}

// SAFETY: chunks are pinned, page-aligned allocations of at least `bounce_len` bytes (rounded
// up to pages), owned by one holder; an in-flight copy owns its chunk until its event has
// completed, and `wait` hands it back only then.
unsafe impl Staging for GpuStaging {
    type Buf = BounceChunk;
    type Pending = ChunkCopy;

    fn begin(&self) -> Result<()> {
        crate::driver::ctx::bind(self.engine.context())
    }

    fn relax_caller(&self) -> Option<crate::completion::capture::Relaxed> {
        // SAFETY: the engine holds a context: libcuda passed the presence check.
        unsafe { crate::completion::capture::Relaxed::new() }
    }

    fn take(&self) -> Result<BounceChunk> {
        self.pool.take()
    }

    fn ptr(buf: &mut BounceChunk) -> *mut u8 {
        buf.as_mut_ptr()
    }

    unsafe fn h2d(
        &self,
        lane: usize,
        buf: BounceChunk,
        offset: usize,
        len: usize,
        dst: u64,
    ) -> Result<ChunkCopy> {
        // SAFETY: forwarded from the caller.
        unsafe { self.engine.h2d_raw(lane, buf, offset, len, dst) }
    }

    unsafe fn d2h(&self, lane: usize, buf: BounceChunk, len: usize, src: u64) -> Result<ChunkCopy> {
        // SAFETY: forwarded from the caller.
        unsafe { self.engine.d2h_raw(lane, buf, 0, len, src) }
    }

    fn wait(&self, p: ChunkCopy) -> Result<BounceChunk> {
        p.wait_chunk()
    }
}
