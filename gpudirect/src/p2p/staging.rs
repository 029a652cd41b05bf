//! The staged path: device → pinned host bounce buffers → device, chunked and pipelined over two
//! streams, for pairs without peer access.
//!
//! Chunk `k` goes through slot `k % slots`: the source device's stream copies it into the slot's
//! pinned buffer and records the slot's `d2h` event; the destination device's stream waits for that
//! event, copies the slot out and records the slot's `h2d` event; before chunk `k + slots` reuses
//! the slot, the source stream waits for that `h2d` event. Nothing blocks the host, and the two
//! directions run on the two devices' copy engines at once.

use crate::completion::capture::{self, Refused};
use crate::driver;
use crate::error::{Result, from_driver};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, sys};
use std::sync::Arc;

#[cfg(test)]
thread_local! {
    /// Tests: make `enqueue` fail right after queueing chunk `k`'s D2H, before its H2D.
    pub(crate) static FAIL_AFTER_D2H: std::cell::Cell<Option<usize>> =
        const { std::cell::Cell::new(None) };
}

/// A pinned host buffer (`cuMemHostAlloc`, portable to every context) used only as a bounce
/// buffer by device copies; never exposed as a Rust reference.
struct Bounce {
    ptr: *mut std::ffi::c_void,
    bytes: usize,
    ctx: Arc<CudaContext>,
    pid: u32,
}

// SAFETY: the buffer is plain pinned host memory addressed only by the driver's copies; the
// pointer is never dereferenced by Rust.
unsafe impl Send for Bounce {}
// SAFETY: as above; no Rust access to the bytes.
unsafe impl Sync for Bounce {}

impl Bounce {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Bounce> {
        driver::ctx::bind(ctx)?;
        // SAFETY: a context is current; PORTABLE makes the memory pinned for every context, so
        // both devices' streams may copy through it.
        let ptr = unsafe { driver::mem::host_alloc(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }?;
        Ok(Bounce {
            ptr,
            bytes,
            ctx: ctx.clone(),
            pid: std::process::id(),
        })
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        // Dropped only when the last copy through it has completed: the stager is owned by every
        // in-flight copy that uses it. In a forked child, leak (no FFI frees after fork).
        if crate::completion::forked(self.pid) || self.ptr.is_null() {
            return;
        }
        let _ = driver::ctx::bind(&self.ctx);
        // SAFETY: allocated by cuMemHostAlloc above and not freed before; no copy uses it now.
        let _ = unsafe { driver::mem::free_host(self.ptr) };
    }
}

struct Slot {
    host: Bounce,
    d2h: CudaEvent,
    h2d: CudaEvent,
}

/// Bounce buffers, streams and events of one ordered device pair's staged path.
pub(crate) struct Stager {
    src_stream: Arc<CudaStream>,
    dst_stream: Arc<CudaStream>,
    slots: Vec<Slot>,
    /// Recorded on the source stream and waited on by the destination stream by [`join`](Self::join).
    join: CudaEvent,
    chunk: usize,
}

impl Stager {
    /// `slots` pinned buffers of `chunk` bytes each, and one stream per device.
    pub(crate) fn new(
        src_ctx: Arc<CudaContext>,
        dst_ctx: Arc<CudaContext>,
        chunk: usize,
        slots: usize,
    ) -> Result<Stager> {
        let src_stream = src_ctx
            .new_stream()
            .map_err(|e| from_driver("cuStreamCreate", e))?;
        let dst_stream = dst_ctx
            .new_stream()
            .map_err(|e| from_driver("cuStreamCreate", e))?;
        let slots = (0..slots)
            .map(|_| {
                Ok(Slot {
                    host: Bounce::new(&src_ctx, chunk)?,
                    d2h: src_ctx
                        .new_event(None)
                        .map_err(|e| from_driver("cuEventCreate", e))?,
                    h2d: dst_ctx
                        .new_event(None)
                        .map_err(|e| from_driver("cuEventCreate", e))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let join = src_ctx
            .new_event(None)
            .map_err(|e| from_driver("cuEventCreate", e))?;
        Ok(Stager {
            src_stream,
            dst_stream,
            slots,
            join,
            chunk,
        })
    }

    /// The stream the last step of every staged copy runs on (record the completion event here).
    pub(crate) fn final_stream(&self) -> &Arc<CudaStream> {
        &self.dst_stream
    }

    /// Tests: the source and destination streams.
    #[cfg(test)]
    pub(crate) fn streams(&self) -> (&Arc<CudaStream>, &Arc<CudaStream>) {
        (&self.src_stream, &self.dst_stream)
    }

    /// Make the final stream wait for everything queued on the source stream so far, so that an
    /// event recorded on [`final_stream`](Self::final_stream) afterwards also covers a D2H whose
    /// H2D half was never queued (an [`enqueue`](Self::enqueue) that failed midway). If this
    /// fails, such an event proves nothing about the source stream.
    pub(crate) fn join(&self) -> Result<()> {
        capture::enqueue(&self.src_stream, "cuEventRecord", (), |raw, ()| {
            // SAFETY: a live event and stream of the current context.
            unsafe { driver::event::record(self.join.cu_event(), raw) }
        })?;
        capture::enqueue(&self.dst_stream, "cuStreamWaitEvent", (), |raw, ()| {
            // SAFETY: a live stream and event; the wait captures the event's state now.
            unsafe { driver::stream::wait_event(raw, self.join.cu_event()) }
        })?;
        Ok(())
    }

    /// Enqueue `bytes` from device address `src` to device address `dst`, through the
    /// capture-checked path on each stream.
    ///
    /// # Safety
    ///
    /// `src..src + bytes` must be readable by the source device and `dst..dst + bytes` writable by
    /// the destination device until the work completes (the caller owns both until an event
    /// recorded on [`final_stream`](Self::final_stream) afterwards completes), and `self` must be
    /// kept alive as long. On `Err`, a D2H may be queued with no H2D after it: call
    /// [`join`](Self::join) before recording that event. A refusal that says the work may sit in
    /// a graph ([`Refused::leaked`]) means the caller must leak what the copy uses.
    pub(crate) unsafe fn enqueue(
        &self,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> Result<(), Refused<()>> {
        let n = self.slots.len();
        for (k, (off, len)) in chunk_spans(bytes, self.chunk).enumerate() {
            let slot = &self.slots[k % n];
            debug_assert!(len <= slot.host.bytes);
            // In range: the caller's ranges are `bytes` long and do not wrap (checked).
            let (s, d) = (src + off as u64, dst + off as u64);
            capture::enqueue(&self.src_stream, "cuMemcpyDtoHAsync_v2", (), |raw, ()| {
                // SAFETY: events and streams are live; waiting on a never-recorded event is a
                // no-op. The slot's previous H2D (chunk k - n) must finish before the slot is
                // overwritten.
                unsafe {
                    driver::stream::wait_event(raw, slot.h2d.cu_event())?;
                    driver::mem::copy_dtoh_async(slot.host.ptr, s, len, raw)?;
                    driver::event::record(slot.d2h.cu_event(), raw)
                }
            })?;
            #[cfg(test)]
            if FAIL_AFTER_D2H.with(|f| f.get()) == Some(k) {
                return Err(Refused {
                    error: crate::Error::invalid("test", k, "injected failure after a D2H"),
                    kept: Some(()),
                });
            }
            capture::enqueue(&self.dst_stream, "cuMemcpyHtoDAsync_v2", (), |raw, ()| {
                // SAFETY: as above; the H2D reads the slot only after its D2H (event wait).
                unsafe {
                    driver::stream::wait_event(raw, slot.d2h.cu_event())?;
                    driver::mem::copy_htod_async(d, slot.host.ptr, len, raw)?;
                    driver::event::record(slot.h2d.cu_event(), raw)
                }
            })?;
        }
        Ok(())
    }
}

/// The chunks of a `bytes`-long staged copy through `chunk`-byte bounce buffers: `(offset, len)`
/// each, in order, covering `0..bytes` exactly. A `chunk` of 0 yields nothing.
pub(crate) fn chunk_spans(bytes: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let step = chunk.max(1);
    (0..if chunk == 0 { 0 } else { bytes })
        .step_by(step)
        .map(move |off| (off, chunk.min(bytes - off)))
}
