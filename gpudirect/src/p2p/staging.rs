//! The staged path: device → pinned host chunk → device, for pairs without peer access, on the
//! crate's one bounce pool and its copy engines ([`BouncePool`], [`CopyEngine`]).
//!
//! A copier keeps a ring of `slots` chunks of the source device's shared pool, each behind the
//! last copy that went through it ([`ChunkCopy`], which owns the chunk until its event has
//! completed). Chunk `k` of a copy takes the ring's next chunk: the source device's engine
//! copies it device-to-host on the copier's first lane, after a stream wait on that chunk's
//! previous host-to-device copy; the destination device's engine copies it host-to-device on the
//! copier's second lane, after a stream wait on the first copy. All device-to-host copies of a
//! copier run in order on one lane and all host-to-device copies on the other, so chunk `k + 1`
//! leaves the source while chunk `k` enters the destination, and nothing blocks the host. The
//! ring's cursor runs on from copy to copy, so small copies in a row use different chunks and
//! overlap as well.
//!
//! A copy ends with a stream wait of the copier's stream on its last host-to-device copy: the
//! last on its lane, after the last device-to-host copy on the other, so a fence of that stream
//! covers the whole copy.
//!
//! Sizes: the ring holds `slots` chunks of `chunk_bytes` (by default 4 of 8 MiB, 32 MiB pinned
//! per copier). Two chunks keep both directions busy; the other two absorb the jitter of the
//! stream waits, so a direction never idles while the other finishes. An 8 MiB chunk takes far
//! longer on the host link than the few microseconds of driver calls that queue it, and a 256
//! MiB copy fills and drains the two-stage pipeline in one chunk's time (1/32 of the copy; see
//! docs/p2p.md).

use crate::completion::StreamFence;
use crate::completion::capture::Refused;
use crate::cuda::Stream;
use crate::error::{Error, Result};
use crate::memory::{BouncePool, ChunkCopy, CopyEngine, Dir, Leg, SHARED_LANES};
use std::sync::Mutex;

#[cfg(test)]
thread_local! {
    /// Tests: make `enqueue` fail right after queueing chunk `k`'s D2H, before its H2D.
    pub(crate) static FAIL_AFTER_D2H: std::cell::Cell<Option<usize>> =
        const { std::cell::Cell::new(None) };
}

/// A staged copy that failed: the error, and a fence of the copier's stream after which nothing
/// queued for the copy runs (`None`: no fence can say so, or the work may sit in a CUDA graph:
/// the caller leaks what the copy uses).
pub(crate) struct Failed {
    pub(crate) error: Error,
    pub(crate) fence: Option<StreamFence>,
}

/// The chunks of a copier and where the next copy starts.
struct Ring {
    /// The last copy through each chunk; `None` where a failure lost the chunk (a new one is
    /// taken from the pool at its next use).
    slots: Vec<Option<ChunkCopy>>,
    next: usize,
}

/// The staged path of one ordered device pair: the shared pool and engines, the copier's lanes
/// and its ring of chunks.
pub(crate) struct Stager {
    pool: BouncePool,
    src: CopyEngine,
    dst: CopyEngine,
    /// The device-to-host lane (source engine) and the host-to-device lane (destination engine).
    lanes: (usize, usize),
    chunk: usize,
    ring: Mutex<Ring>,
}

impl Stager {
    /// The staged path from device `src` to device `dst`: a ring of `slots` chunks of
    /// `chunk_bytes` (a valid pool chunk size) taken now from `src`'s shared pool.
    ///
    /// # Errors
    ///
    /// As [`BouncePool::take`] and [`CopyEngine::new`] (the engines' first use).
    pub(crate) fn new(src: usize, dst: usize, chunk_bytes: usize, slots: usize) -> Result<Stager> {
        let pool = BouncePool::shared(src, chunk_bytes)?;
        let slots = (0..slots)
            .map(|_| pool.take().map(|c| Some(ChunkCopy::idle(c))))
            .collect::<Result<Vec<_>>>()?;
        Ok(Stager {
            pool,
            src: CopyEngine::shared(src)?,
            dst: CopyEngine::shared(dst)?,
            lanes: lanes_of(next_copier()),
            chunk: chunk_bytes,
            ring: Mutex::new(Ring { slots, next: 0 }),
        })
    }

    /// Queue the copy of `bytes` bytes from device address `src` to device address `dst`, and
    /// make `stream` wait for it; a fence of `stream` for it.
    ///
    /// # Errors
    ///
    /// As [`BouncePool::take`] and [`ChunkCopy::then`], with a fence that covers what was
    /// queued before the failure, or none (see [`Failed`]).
    ///
    /// # Safety
    ///
    /// `src..src + bytes` is readable by the source device and `dst..dst + bytes` writable by the
    /// destination device, neither range wraps, and both stay valid and untouched by anyone else
    /// until the returned fence (or the failure's) completes.
    pub(crate) unsafe fn enqueue(
        &self,
        stream: &Stream,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> std::result::Result<StreamFence, Failed> {
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let ring = &mut *ring;
        let n = ring.slots.len();
        let mut last = None;
        for ((off, len), s) in schedule(bytes, self.chunk, n, ring.next) {
            ring.next = (s + 1) % n;
            let prev = match ring.slots[s].take() {
                Some(c) => c,
                None => match self.pool.take() {
                    Ok(c) => ChunkCopy::idle(c),
                    Err(error) => return Err(cover(ring, stream, Cause::Error(error))),
                },
            };
            // In range: the caller's ranges are `bytes` long and do not wrap.
            let (from, to) = (src + off as u64, dst + off as u64);
            let leg = Leg {
                dir: Dir::D2h,
                lane: self.lanes.0,
                offset: 0,
                len,
                addr: from,
            };
            // SAFETY: `from..from + len` lies in the caller's source range (the spans cover
            // `0..bytes`) and `len` is at most the chunk's size.
            let d2h = unsafe { prev.then(&self.src, leg) };
            let c = step(ring, s, d2h).map_err(|e| cover(ring, stream, e))?;
            #[cfg(test)]
            if FAIL_AFTER_D2H.with(|f| f.get()) == Some(off / self.chunk) {
                ring.slots[s] = Some(c);
                let error = Error::invalid("test", off, "injected failure after a D2H");
                return Err(cover(ring, stream, Cause::Error(error)));
            }
            let leg = Leg {
                dir: Dir::H2d,
                lane: self.lanes.1,
                offset: 0,
                len,
                addr: to,
            };
            // SAFETY: as above, for the destination range.
            let h2d = unsafe { c.then(&self.dst, leg) };
            let c = step(ring, s, h2d).map_err(|e| cover(ring, stream, e))?;
            ring.slots[s] = Some(c);
            last = Some(s);
        }
        if let Some(c) = last.and_then(|s| ring.slots[s].as_ref())
            && let Err(error) = c.order_before(stream)
        {
            return Err(cover(ring, stream, Cause::Error(error)));
        }
        Ok(stream.fence())
    }

    /// Tests: whether the copy through chunk `s` has completed (`None`: no chunk there).
    #[cfg(test)]
    pub(crate) fn slot_complete(&self, s: usize) -> Option<bool> {
        let ring = self.ring.lock().unwrap();
        ring.slots[s].as_ref().map(|c| c.is_complete())
    }
}

/// The failure of a copy: `stream` made to wait for every chunk's last copy, so that its
/// fence covers everything queued for the copy (a device-to-host copy whose host-to-device
/// half never was, too). No fence when that fails or when work may sit unfenced.
fn cover(ring: &Ring, stream: &Stream, cause: Cause) -> Failed {
    match cause {
        Cause::Error(error) => {
            let joined = ring
                .slots
                .iter()
                .flatten()
                .try_for_each(|c| c.order_before(stream));
            Failed {
                error,
                fence: joined.ok().map(|()| stream.fence()),
            }
        }
        Cause::Leaked(error) => Failed { error, fence: None },
    }
}

/// The chunks of a `bytes`-long staged copy through `chunk`-byte bounce chunks: `(offset, len)`
/// each, in order, covering `0..bytes` exactly. A `chunk` of 0 yields nothing.
pub(crate) fn chunk_spans(bytes: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let step = chunk.max(1);
    (0..if chunk == 0 { 0 } else { bytes })
        .step_by(step)
        .map(move |off| (off, chunk.min(bytes - off)))
}

/// Why a step failed.
enum Cause {
    /// Nothing queued uses the caller's memory without a fence.
    Error(Error),
    /// Queued work may use the caller's memory with no fence to say when it ends.
    Leaked(Error),
}

/// The copy a step queued; on refusal, the copy before it back in slot `s` (still owning the
/// chunk), or the slot emptied when the chunk was leaked.
fn step(
    ring: &mut Ring,
    s: usize,
    r: std::result::Result<ChunkCopy, Box<Refused<ChunkCopy>>>,
) -> std::result::Result<ChunkCopy, Cause> {
    r.map_err(|refused| {
        let Refused { error, kept } = *refused;
        let leaked = kept.is_none();
        ring.slots[s] = kept;
        if leaked {
            Cause::Leaked(error)
        } else {
            Cause::Error(error)
        }
    })
}

/// The chunks of a copy (as [`chunk_spans`]), each with the ring slot it goes through: `slots`
/// slots in turn from slot `next % slots`. No slots, no chunks.
pub(crate) fn schedule(
    bytes: usize,
    chunk: usize,
    slots: usize,
    next: usize,
) -> impl Iterator<Item = ((usize, usize), usize)> {
    let n = slots.max(1);
    let spans = chunk_spans(bytes, if slots == 0 { 0 } else { chunk });
    spans.zip((next % n..).map(move |i| i % n))
}

/// How many copiers have been made: each takes the next pair of lanes.
fn next_copier() -> usize {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The lanes of copier `n` on the shared engines: `(device-to-host, host-to-device)`, two
/// distinct lanes (one engine serves both on a device copied to itself). Pairs are given out
/// from the last lanes down, so that the first `SHARED_LANES / 2` copiers share no lane and
/// meet the storage path's threads (which count up from the first lanes) last.
pub(crate) fn lanes_of(n: usize) -> (usize, usize) {
    let d2h = SHARED_LANES - 1 - 2 * (n % (SHARED_LANES / 2));
    (d2h, d2h - 1)
}
