//! The copy kernels (`kernels/copy_fire.ptx`), with [`EngineConfig::copy_kernel`]: for a
//! stream-ordered request, one launch copies a pair's bytes and then stores the request's
//! trigger word, where copy-engine copies take a copy and a trigger write, two submissions to
//! the stream of some microseconds of host time each; for small requests, one launch copies
//! the pieces of one or of several ([`CopyKernel::gather`]), where the copy engines take a
//! submission each. Loaded once per context (serialized, process-wide) and never unloaded.
//!
//! [`EngineConfig::copy_kernel`]: crate::transfer::EngineConfig::copy_kernel

use super::copies::{Events, Keep, Piece};
use super::graphs::CopyGraphs;
use crate::completion::Tracker;
use crate::cuda::Stream;
use crate::driver::ctx::bind;
use crate::driver::module::{self, MODULE_SYMBOLS};
use crate::error::{Error, Result, from_driver};
use cudarc::driver::{CudaContext, sys};
use std::ffi::{CString, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

const PTX: &str = include_str!("../../../kernels/copy_fire.ptx");

/// Threads of a block.
const THREADS: u32 = 256;

/// Bytes a block copies in one round of its loop (four 16-byte vectors a thread).
const BLOCK_BYTES: u64 = THREADS as u64 * 16 * 4;

/// Blocks per multiprocessor at most.
const BLOCKS_PER_SM: u32 = 8;

/// Pieces one [`CopyKernel::gather`] launch copies at most (the kernel's parameter holds 24
/// bytes each).
pub(super) const GATHER_PIECES: usize = 32;

/// The pieces of one gather launch as its parameter holds them: (dst, src, bytes) each.
#[repr(C, align(8))]
struct Table([u64; 3 * GATHER_PIECES]);

/// The copy kernel of one context, and the counters its launches count their blocks in.
pub(super) struct CopyKernel {
    func: sys::CUfunction,
    /// `copy_gather`.
    gather: sys::CUfunction,
    /// Device address of the module's counters (`u32` each).
    counters: u64,
    /// Counters no launch in flight holds.
    free: Mutex<Vec<u32>>,
    max_blocks: u32,
    /// Holds the context, and so the module, for the process's life.
    _ctx: Arc<CudaContext>,
}

// SAFETY: `func` is a driver handle of a module that is never unloaded; the driver takes it
// from any thread where its context is current (`Lease::launch` binds it through the
// enqueue path, `launch_gathers` itself).
unsafe impl Send for CopyKernel {}
// SAFETY: as above; the free list is behind its lock.
unsafe impl Sync for CopyKernel {}

impl CopyKernel {
    /// The kernel of `ctx`, loaded on its first use; `None` where it cannot be (a driver
    /// without the symbols, or one that refused the module: the copy engines then copy).
    pub(super) fn of(ctx: &Arc<CudaContext>) -> Option<Arc<CopyKernel>> {
        type Found = Option<(usize, Option<Arc<CopyKernel>>)>;
        thread_local! {
            /// The last context this thread asked for, and its answer: no process-wide lock
            /// per request.
            static LAST: std::cell::RefCell<Found> = const { std::cell::RefCell::new(None) };
        }
        let key = ctx.cu_ctx() as usize;
        if let Some(k) = LAST.with_borrow(|l| match l {
            Some((c, k)) if *c == key => Some(k.clone()),
            _ => None,
        }) {
            return k;
        }
        let k = Self::loaded(ctx, key);
        LAST.with_borrow_mut(|l| *l = Some((key, k.clone())));
        k
    }

    /// [`of`](Self::of) through the process-wide list (serialized: one load per context).
    fn loaded(ctx: &Arc<CudaContext>, key: usize) -> Option<Arc<CopyKernel>> {
        // Each entry holds its context, so no other context can come at its address; a
        // refusal is kept too (the copy engines copy for that context from then on).
        type Loaded = Vec<(usize, Arc<CudaContext>, Option<Arc<CopyKernel>>)>;
        static LOADED: Mutex<Loaded> = Mutex::new(Vec::new());
        let mut g = LOADED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, _, k)) = g.iter().find(|(c, _, _)| *c == key) {
            return k.clone();
        }
        let k = Self::load(ctx).ok().map(Arc::new);
        g.push((key, ctx.clone(), k.clone()));
        k
    }

    fn load(ctx: &Arc<CudaContext>) -> Result<CopyKernel> {
        gpudirect_sys::cuda::require_symbols(MODULE_SYMBOLS)?;
        bind(ctx)?;
        let image =
            CString::new(PTX).map_err(|_| Error::invalid("PTX", "copy_fire", "has a NUL"))?;
        // SAFETY: symbols checked; the context is current; a NUL-terminated image.
        let m = unsafe { module::load_data(&image) }?;
        // SAFETY: the module just loaded, never unloaded.
        let func = unsafe { module::function(m, c"copy_fire") }?;
        // SAFETY: as above.
        let gather = unsafe { module::function(m, c"copy_gather") }?;
        // Loaded now, not at their first launch (lazy loading may wait for the context there).
        // SAFETY: functions of the live module.
        unsafe {
            module::load_function(func)?;
            module::load_function(gather)?;
        }
        // SAFETY: as above.
        let (counters, bytes) = unsafe { module::global(m, c"copy_fire_counters") }?;
        let n = u32::try_from(bytes / 4).unwrap_or(0);
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| from_driver("cuDeviceGetAttribute", e))?;
        Ok(CopyKernel {
            func,
            gather,
            counters,
            free: Mutex::new((0..n).rev().collect()),
            max_blocks: u32::try_from(sms).unwrap_or(1).max(1) * BLOCKS_PER_SM,
            _ctx: ctx.clone(),
        })
    }

    /// Queue on `stream` the copies of `pieces` (1 to [`GATHER_PIECES`]) in one launch: a row
    /// of blocks per piece, as many in each as the longest piece takes.
    ///
    /// # Safety
    ///
    /// `stream` is live in the kernel's context, which is current; every piece [`fits`]; both
    /// ranges of each are memory the kernel's GPU reaches, valid until the stream has passed
    /// the launch.
    pub(super) unsafe fn gather(&self, stream: sys::CUstream, pieces: &[Piece]) -> Result<()> {
        if pieces.is_empty() || pieces.len() > GATHER_PIECES {
            return Err(Error::invalid(
                "pieces",
                pieces.len(),
                format!("one gather launch copies 1 to {GATHER_PIECES}"),
            ));
        }
        let mut table = Table([0; 3 * GATHER_PIECES]);
        for (row, p) in table.0.chunks_exact_mut(3).zip(pieces) {
            row.copy_from_slice(&[p.dst, p.src, p.len]);
        }
        let longest = pieces.iter().map(|p| p.len).max().unwrap_or(1);
        // At most GATHER_PIECES: fits u32.
        let mut count = pieces.len() as u32;
        let mut params: [*mut c_void; 2] = [(&raw mut count).cast(), (&raw mut table).cast()];
        // SAFETY: the kernel's parameters (a u32, then the 768-byte table), matched by
        // `params`; the memory is the caller's promise.
        unsafe {
            module::launch_rows(
                self.gather,
                blocks(longest, self.max_blocks),
                count,
                THREADS,
                stream,
                &mut params,
            )
        }
    }

    /// A counter for one launch; `None` while every counter is held (the copy engines copy).
    pub(super) fn lease(self: &Arc<Self>) -> Option<Lease> {
        let index = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop()?;
        Some(Lease {
            kernel: self.clone(),
            index,
        })
    }
}

/// Whether the kernel copies `p`: some bytes, both ends 16-byte aligned.
pub(super) fn fits(p: &Piece) -> bool {
    p.len > 0 && (p.dst | p.src).is_multiple_of(16)
}

/// Blocks for `len` bytes: one per round of [`BLOCK_BYTES`], at most `max`.
fn blocks(len: u64, max: u32) -> u32 {
    u32::try_from(len.div_ceil(BLOCK_BYTES).clamp(1, u64::from(max.max(1)))).unwrap_or(1)
}

/// A counter of the kernel held by one launch, given back when dropped: kept with what the
/// launch reaches until its trigger word was seen (the last block resets the counter before
/// it stores the word), or forever.
pub(super) struct Lease {
    kernel: Arc<CopyKernel>,
    index: u32,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.kernel
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(self.index);
    }
}

impl Lease {
    /// Queue on `stream` the copy of `p`, then the store of `seq` into the 64-bit word at
    /// device address `trigger`.
    ///
    /// # Safety
    ///
    /// `stream` is live in the kernel's context, which is current; [`fits`]`(p)`; both ranges
    /// of `p` are memory the kernel's GPU reaches, valid until `trigger` holds `seq`, and
    /// `trigger` a word mapped for that GPU, valid as long; this lease is kept until then.
    pub(super) unsafe fn launch(
        &self,
        stream: sys::CUstream,
        p: &Piece,
        trigger: u64,
        seq: u64,
    ) -> Result<()> {
        let k = &self.kernel;
        let (mut dst, mut src, mut n) = (p.dst, p.src, p.len);
        let mut counter = k.counters + 4 * u64::from(self.index);
        let (mut trigger, mut seq) = (trigger, seq);
        let mut params: [*mut c_void; 6] = [
            (&raw mut dst).cast(),
            (&raw mut src).cast(),
            (&raw mut n).cast(),
            (&raw mut counter).cast(),
            (&raw mut trigger).cast(),
            (&raw mut seq).cast(),
        ];
        // SAFETY: the kernel's six u64 parameters, matched by `params`; the memory is the
        // caller's promise.
        unsafe {
            module::launch(
                k.func,
                blocks(n, k.max_blocks),
                THREADS,
                stream,
                &mut params,
            )
        }
    }
}

/// What copies the pieces of a gather launch: the copy kernel (`EngineConfig::copy_kernel`), or
/// a graph of copy nodes on the copy engines (`EngineConfig::copy_graphs`).
#[derive(Clone)]
pub(super) enum Launcher {
    Kernel(Arc<CopyKernel>),
    Graphs(Arc<CopyGraphs>),
}

impl Launcher {
    /// The driver call a launch makes.
    fn call(&self) -> &'static str {
        match self {
            Launcher::Kernel(_) => "cuLaunchKernel",
            Launcher::Graphs(_) => "cuGraphLaunch",
        }
    }

    /// Queue the copies of `pieces` (1 to [`GATHER_PIECES`]) in one launch; an error queued
    /// nothing.
    ///
    /// # Safety
    ///
    /// `stream` is live in the launcher's context, which is current; every piece has some
    /// bytes (for the kernel, it [`fits`]), both its ranges memory the context's GPU reaches,
    /// valid until the stream has passed the launch.
    unsafe fn gather(&self, stream: sys::CUstream, pieces: &[Piece]) -> Result<()> {
        match self {
            // SAFETY: the caller's promises.
            Launcher::Kernel(k) => unsafe { k.gather(stream, pieces) },
            // SAFETY: the caller's promises.
            Launcher::Graphs(g) => unsafe { g.gather(stream, pieces) },
        }
    }
}

/// The most bytes a request may move and still wait for a gather launch; a larger one is
/// queued at once (its copies outlast a submission's host time).
pub(super) const GATHER_REQUEST_BYTES: u64 = 2 << 20;

/// The longest piece the kernel's gather launch copies; a request with a longer one goes on the
/// copy engines (they copy it as fast, off the multiprocessors). A graph's nodes take any.
pub(super) const GATHER_PIECE_BYTES: u64 = 2 << 20;

/// The most bytes a request may move in gather launches queued at once ([`launch_now`]).
pub(super) const GATHER_NOW_BYTES: u64 = 64 << 20;

/// A [`launch_now`] that failed: the driver's error, and what the request holds when nothing was
/// queued by graphs.
pub(super) type NotLaunched = (Error, Option<Box<Keep>>);

/// Queue a request's `pieces` on `stream` at once, in launches of up to [`GATHER_PIECES`] (a
/// launch's pieces run at once, the launches one after another): the request's epoch taken
/// after the last, with an event recorded behind it when `mark` (as the copy engines' path
/// does for a request that [`runs_long`](super::copies::runs_long)). On a failure the driver's
/// error, and `keep` back when nothing was queued by graphs (the caller may queue the pieces on
/// the copy engines instead); otherwise what `keep` holds is parked behind an epoch taken after
/// the launches that went.
///
/// # Safety
///
/// As [`Gather::add`]: `stream` is one of the endpoint's private streams, `kernel` its
/// context's, every piece has some bytes (for the kernel, it [`fits`]) and both its ranges are
/// memory the stream's GPU reaches, which `keep` holds.
pub(super) unsafe fn launch_now(
    stream: &Stream,
    kernel: &Launcher,
    pieces: &[Piece],
    keep: Keep,
    mark: bool,
) -> std::result::Result<(Events, Keep), NotLaunched> {
    // SAFETY: the caller's promises.
    if let Err((e, went)) = unsafe { launch_gathers(stream, kernel, pieces) } {
        if went == 0 && matches!(kernel, Launcher::Graphs(_)) {
            return Err((e, Some(Box::new(keep))));
        }
        // Earlier launches may run: what they reach stays until they are done.
        Tracker::global().park(Events::of(vec![stream.timeline().issue()]), keep);
        return Err((e, None));
    }
    // Taken after the launches: the epoch covers them.
    let epoch = stream.timeline().issue();
    if mark {
        stream.timeline().mark();
    }
    Ok((Events::of(vec![epoch]), keep))
}

/// Queue `pieces` on `stream` in launches of up to [`GATHER_PIECES`], one after another,
/// binding the stream's context first (the calling thread may have any current: a waiter's,
/// the worker's). A failure stops at the launch that failed, and says how many went before it.
///
/// # Safety
///
/// As [`launch_now`]; the memory stays valid until the stream has passed the launches.
unsafe fn launch_gathers(
    stream: &Stream,
    kernel: &Launcher,
    pieces: &[Piece],
) -> std::result::Result<(), (Error, usize)> {
    let Some(p) = stream.as_private() else {
        return Err((
            Error::invalid(
                "stream",
                "not the endpoint's own",
                "only a lane's private stream gathers",
            ),
            0,
        ));
    };
    bind(stream.context()).map_err(|e| (e, 0))?;
    for (went, chunk) in pieces.chunks(GATHER_PIECES).enumerate() {
        // SAFETY: the caller's promises for every piece; the stream's context made current
        // above, the kernel of that context.
        p.enqueue(kernel.call(), (), |raw, ()| unsafe {
            kernel.gather(raw, chunk)
        })
        .map_err(|r| (r.error, went))?;
    }
    Ok(())
}

/// The most bytes one gather launch waits for: past them, the launch goes at once.
const GATHER_BYTES: u64 = 8 << 20;

/// Whether a piece of `new` writes a byte a piece of `old` reads or writes, or reads one it
/// writes (by address: the peer's allocations are mapped once in the process). The same copy
/// again does not clash: run at once, both write the same bytes, read from memory no piece of
/// the launch writes.
fn clash(old: &[Piece], new: &[Piece]) -> bool {
    let meet = |a: u64, b: u64, n: u64, m: u64| a < b.saturating_add(m) && b < a.saturating_add(n);
    new.iter().any(|p| {
        old.iter().any(|q| {
            p != q && meet(p.dst, q.dst, p.len, q.len)
                || meet(p.dst, q.src, p.len, q.len)
                || meet(p.src, q.dst, p.len, q.len)
        })
    })
}

/// The requests of a busy lane whose copies wait to go in one gather launch: held under the
/// lane's issue lock. They go when a request of the lane is queued that cannot wait here, when
/// [`GATHER_PIECES`] or [`GATHER_BYTES`] are reached, when a waiting caller or the worker looks
/// at the lane, and when the endpoint reconnects or closes. A request of an endpoint epoch that
/// has ended (a failure, a reconnect, a close) never goes: it was ended already.
pub(super) struct Gather {
    pieces: Vec<Piece>,
    /// Each waiting request, in order.
    waiting: Vec<Waiting>,
    bytes: u64,
    /// Where they go: the lane's one stream of their GPU, and what copies them.
    to: Option<(Stream, Launcher)>,
    /// The endpoint's epoch now.
    epoch: Arc<AtomicU64>,
    /// The lane's copy graphs, one per context it gathered on.
    graphs: Vec<Arc<CopyGraphs>>,
}

/// A request waiting in a [`Gather`].
struct Waiting {
    /// Its epochs, set when its pieces go (or once they never will).
    fence: Arc<Events>,
    /// The endpoint epoch it belongs to.
    epoch: u64,
    /// How many of the gather's pieces are its own (they follow the earlier requests').
    pieces: usize,
}

impl Gather {
    /// Nothing waiting, for the lanes of an endpoint whose epoch is `epoch`.
    pub(super) fn new(epoch: Arc<AtomicU64>) -> Gather {
        Gather {
            pieces: Vec::new(),
            waiting: Vec::new(),
            bytes: 0,
            to: None,
            epoch,
            graphs: Vec::new(),
        }
    }

    /// The lane's copy graphs for `ctx`, made on first use; `None` where the driver has no
    /// graph calls or refused to make one of them.
    pub(super) fn graphs(&mut self, ctx: &Arc<CudaContext>) -> Option<Arc<CopyGraphs>> {
        let key = ctx.cu_ctx();
        if let Some(g) = self.graphs.iter().find(|g| g.context().cu_ctx() == key) {
            return (!g.refused()).then(|| g.clone());
        }
        let g = CopyGraphs::new(ctx, GATHER_PIECES)?;
        self.graphs.push(g.clone());
        Some(g)
    }

    /// Whether no request waits.
    pub(super) fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Whether a request of `pieces` queued on `stream` can go in the same launch as those
    /// waiting: room left, the same stream, and no byte that one of them writes and another
    /// reads or writes (the pieces of one launch run at once; the lane's requests must land in
    /// order).
    pub(super) fn takes(&self, stream: &Stream, pieces: &[Piece]) -> bool {
        self.pieces.len() + pieces.len() <= GATHER_PIECES
            && self
                .to
                .as_ref()
                .is_none_or(|(s, _)| s.cu_stream() == stream.cu_stream())
            && !clash(&self.pieces, pieces)
    }

    /// Let a request of endpoint epoch `epoch` wait with its `pieces` (after
    /// [`takes`](Self::takes) said they can), its epochs set in `fence` when they go; they go
    /// at once when the launch is full.
    ///
    /// # Safety
    ///
    /// `stream` is one of the endpoint's private streams; `kernel` is its context's; every piece
    /// has some bytes (for the kernel, it [`fits`]) and both its ranges are memory the stream's
    /// GPU reaches, held (by the request `fence` belongs to) until `fence` is complete.
    pub(super) unsafe fn add(
        &mut self,
        stream: &Stream,
        kernel: Launcher,
        pieces: &[Piece],
        fence: Arc<Events>,
        epoch: u64,
    ) {
        self.to.get_or_insert_with(|| (stream.clone(), kernel));
        self.pieces.extend_from_slice(pieces);
        self.bytes = self
            .bytes
            .saturating_add(pieces.iter().map(|p| p.len).sum());
        self.waiting.push(Waiting {
            fence,
            epoch,
            pieces: pieces.len(),
        });
        if self.pieces.len() >= GATHER_PIECES || self.bytes >= GATHER_BYTES {
            self.flush();
        }
    }

    /// Let every waiting request go with nothing queued for it (its epochs complete at once):
    /// for an endpoint that closed, whose requests have all ended.
    pub(super) fn cancel(&mut self) {
        self.pieces.clear();
        self.bytes = 0;
        self.to = None;
        for w in self.waiting.drain(..) {
            w.fence.gathered(Ok(None));
        }
    }

    /// Queue the waiting requests' copies of the endpoint's current epoch in one launch and set
    /// their epochs (to the launch's failure if it failed: nothing was queued for them). Those
    /// of an older epoch ended already: nothing is queued for them (their bytes would land after
    /// the request was reported ended, and in the memory of a peer since gone), and their
    /// epochs complete at once.
    pub(super) fn flush(&mut self) {
        let waiting = std::mem::take(&mut self.waiting);
        let pieces = std::mem::take(&mut self.pieces);
        self.bytes = 0;
        let to = self.to.take();
        let (pieces, current) = current_only(pieces, waiting, self.epoch.load(Ordering::Acquire));
        let Some((stream, kernel)) = to else {
            return;
        };
        if current.is_empty() {
            return;
        }
        // SAFETY: `add`'s promises for every piece (at most GATHER_PIECES: one launch, so a
        // failure queued nothing).
        let launched = unsafe { launch_gathers(&stream, &kernel, &pieces) }.map_err(|(e, _)| e);
        // Taken after the launch: the epoch covers it.
        let gone = launched.map(|()| Some(stream.timeline().issue()));
        for f in current {
            f.gathered(gone.as_ref().map(Clone::clone));
        }
    }
}

/// The pieces and fences of the waiting requests of endpoint epoch `now`; the others' fences
/// are set complete with nothing queued (`Ok(None)`).
fn current_only(
    pieces: Vec<Piece>,
    waiting: Vec<Waiting>,
    now: u64,
) -> (Vec<Piece>, Vec<Arc<Events>>) {
    if waiting.iter().all(|w| w.epoch == now) {
        return (pieces, waiting.into_iter().map(|w| w.fence).collect());
    }
    let mut kept = Vec::with_capacity(pieces.len());
    let mut fences = Vec::with_capacity(waiting.len());
    let mut at = 0;
    for w in waiting {
        let end = (at + w.pieces).min(pieces.len());
        if w.epoch == now {
            kept.extend_from_slice(&pieces[at..end]);
            fences.push(w.fence);
        } else {
            w.fence.gathered(Ok(None));
        }
        at = end;
    }
    (kept, fences)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completion::Fence;

    #[test]
    fn blocks_cover_the_bytes_up_to_the_limit() {
        assert_eq!(blocks(1, 1056), 1);
        assert_eq!(blocks(BLOCK_BYTES, 1056), 1);
        assert_eq!(blocks(BLOCK_BYTES + 1, 1056), 2);
        assert_eq!(blocks(1 << 20, 1056), 64);
        assert_eq!(blocks(1 << 30, 1056), 1056);
        assert_eq!(blocks(u64::MAX, 0), 1);
    }

    #[test]
    fn only_aligned_pieces_with_bytes_fit() {
        let p = |dst, src, len| Piece {
            dst,
            src,
            len,
            device: 0,
        };
        assert!(fits(&p(0x1000, 0x2000, 3)));
        assert!(!fits(&p(0x1000, 0x2000, 0)));
        assert!(!fits(&p(0x1008, 0x2000, 64)));
        assert!(!fits(&p(0x1000, 0x2001, 64)));
    }

    #[test]
    fn pieces_that_share_a_written_byte_clash() {
        let p = |dst, src, len| Piece {
            dst,
            src,
            len,
            device: 0,
        };
        let old = [p(0x1000, 0x9000, 0x100)];
        // Apart, touching, or reading what the other reads: no clash.
        assert!(!clash(&old, &[p(0x1100, 0xA000, 0x10)]));
        assert!(!clash(&old, &[p(0x0F00, 0xA000, 0x100)]));
        assert!(!clash(&old, &[p(0x5000, 0x9000, 0x100)]));
        // A write over a write, over a read, and a read of a write.
        assert!(clash(&old, &[p(0x10F0, 0xA000, 0x20)]));
        assert!(clash(&old, &[p(0x90FF, 0xA000, 0x1)]));
        assert!(clash(&old, &[p(0x5000, 0x0FFF, 0x2)]));
        // The same copy again: both may run at once; its source written, not.
        assert!(!clash(&old, &old));
        assert!(clash(&[old[0], p(0x9000, 0x4000, 0x10)], &old));
        // Only the last of several.
        assert!(clash(&old, &[p(0x5000, 0x6000, 8), p(0x1000, 0x6000, 8)]));
        // At the top of the address space: no wrap.
        let top = [p(u64::MAX - 0x10, 0x9000, 0x10)];
        assert!(!clash(&top, &[p(0, 0xA000, 0x10)]));
        assert!(clash(&top, &[p(u64::MAX - 1, 0xA000, 1)]));
    }

    /// Requests of an ended endpoint epoch waiting for a launch: their pieces are left out and
    /// their epochs complete with nothing queued; the current ones keep their pieces, in order.
    #[test]
    fn only_the_current_epoch_s_waiting_pieces_go() {
        let p = |n: u64| Piece {
            dst: 0x1000 * n,
            src: 0x10_0000 + 0x1000 * n,
            len: 16 * n,
            device: 0,
        };
        let pieces: Vec<Piece> = (1..=6).map(p).collect();
        // Three requests: two pieces of epoch 3, three of epoch 2 (ended), one of epoch 3.
        let fences: Vec<Arc<Events>> = (0..3).map(|_| Arc::new(Events::later())).collect();
        let waiting = |fences: &[Arc<Events>]| {
            [(3, 2), (2, 3), (3, 1)]
                .iter()
                .zip(fences)
                .map(|(&(epoch, pieces), f)| Waiting {
                    fence: f.clone(),
                    epoch,
                    pieces,
                })
                .collect::<Vec<_>>()
        };
        let (kept, current) = current_only(pieces.clone(), waiting(&fences), 3);
        assert_eq!(kept, vec![p(1), p(2), p(6)]);
        assert_eq!(current.len(), 2);
        assert!(Arc::ptr_eq(&current[0], &fences[0]) && Arc::ptr_eq(&current[1], &fences[2]));
        assert!(
            fences[1].is_complete(),
            "the ended request's epochs complete"
        );
        assert!(matches!(fences[1].check(), Ok(true)) && fences[1].refused().is_none());
        assert!(
            !fences[0].is_complete() && !fences[2].is_complete(),
            "still to go"
        );
        // All current: everything goes, as it came.
        let fresh: Vec<Arc<Events>> = (0..3).map(|_| Arc::new(Events::later())).collect();
        let all = waiting(&fresh)
            .into_iter()
            .map(|w| Waiting { epoch: 7, ..w })
            .collect();
        let (kept, current) = current_only(pieces.clone(), all, 7);
        assert_eq!((kept, current.len()), (pieces, 3));
        assert!(fresh.iter().all(|f| !f.is_complete()));
    }

    #[test]
    fn the_kernel_text_names_what_the_host_asks_for() {
        assert!(PTX.contains(".visible .entry copy_fire("));
        assert!(PTX.contains("copy_fire_counters[65536]"));
        assert_eq!(PTX.matches(".param .u64").count(), 6);
        assert!(PTX.contains(".visible .entry copy_gather("));
        let table = 3 * 8 * GATHER_PIECES;
        assert_eq!(std::mem::size_of::<Table>(), table);
        assert!(PTX.contains(&format!(".param .align 8 .b8 copy_gather_pieces[{table}]")));
        assert!(!PTX.contains('\0'));
    }
}
