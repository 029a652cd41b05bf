//! The copies of an intra-node request: pieces cut and spread over the streams of the issuing
//! lane, queued (`cuMemcpyBatchAsync` or `cuMemcpyAsync`) with an epoch of each stream taken
//! after them, and what they reach held until those epochs complete (parked, never freed early).

use super::import::{Import, link};
use crate::completion::{CompletionFlag, Fence, StreamFence, Tracker, capture};
use crate::cuda::Stream;
use crate::error::{Error, Result};
use crate::transfer::descriptor::RemoteRange;
use crate::transfer::region::{IpcLink, LocalRange, MemoryPath};
use std::sync::{Arc, OnceLock};

/// One copy: destination, source (unified addresses), bytes, the local GPU it runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Piece {
    pub(super) dst: u64,
    pub(super) src: u64,
    pub(super) len: u64,
    pub(super) device: usize,
}

/// What a pair's copy crosses, told once its copies are queued.
pub(super) fn path_of(local_gpu: Option<usize>, peer_gpu: usize) -> MemoryPath {
    MemoryPath::CudaIpc {
        link: link(local_gpu, Some(peer_gpu)),
    }
}

/// Whether a request of `bytes` over the links of `gpus` (per pair: the local GPU, `None` for
/// host memory, and the peer's) runs on its stream for about [`LONG_RUN_US`] or more, by a rough
/// rate per link (bytes per microsecond, the slowest pair's; docs/transfer.md gives them). Then
/// an event recorded behind its copies as they are queued costs the caller one driver call
/// beside the copies' run, and lets a wait see the request done while later requests still
/// run ([`Timeline::mark`](crate::completion::Timeline::mark)). Shorter requests are queued
/// faster than they run only when the host is the limit, where an event each would cost the
/// caller's time.
pub(super) fn runs_long(bytes: u64, gpus: &[(Option<usize>, usize)]) -> bool {
    // Short even at the slowest rate (one NVLink link): no link looked up.
    if bytes < LONG_RUN_US * PER_NVLINK {
        return false;
    }
    let rate = gpus
        .iter()
        .map(|&(l, p)| match link(l, Some(p)) {
            IpcLink::SameDevice => SAME_DEVICE,
            IpcLink::Nvlink { links } => PER_NVLINK * u64::from(links.max(1)),
            IpcLink::LocalHost => HOST_LINK,
            IpcLink::Pcie | IpcLink::Unknown { .. } => PCIE,
        })
        .min();
    rate.is_some_and(|r| bytes / r >= LONG_RUN_US)
}

/// Whether every pair's local memory is on GPU `device` (none in host memory).
pub(super) fn all_local_on(gpus: &[(Option<usize>, usize)], device: usize) -> bool {
    gpus.iter().all(|&(local, _)| local == Some(device))
}

/// [`runs_long`]'s rough rates, bytes per microsecond: a copy inside one GPU, one NVLink link (the
/// slowest of them), the GPU's host link, PCIe (or a link that could not be told).
const SAME_DEVICE: u64 = 2_000_000;
const PER_NVLINK: u64 = 20_000;
const HOST_LINK: u64 = 50_000;
const PCIE: u64 = 25_000;

/// How long a request's run on its stream must be for [`runs_long`], in microseconds: about
/// what queueing one costs the caller (docs/transfer.md).
const LONG_RUN_US: u64 = 6;

/// Cut copies into chunks of at most `chunk` bytes spread over `streams` streams, in turn;
/// with one stream nothing is cut. Pure: the chunks of each copy cover it exactly, in order.
fn spread(copies: &[Piece], streams: usize, chunk: u64) -> Vec<Vec<Piece>> {
    let n = streams.max(1);
    let mut out = vec![Vec::new(); n];
    let mut turn = 0;
    for c in copies {
        if n == 1 || c.len <= chunk {
            out[turn % n].push(*c);
            turn += 1;
            continue;
        }
        let mut at = 0;
        while at < c.len {
            let len = chunk.min(c.len - at);
            out[turn % n].push(Piece {
                dst: c.dst + at,
                src: c.src + at,
                len,
                device: c.device,
            });
            turn += 1;
            at += len;
        }
    }
    out
}

/// The peer's allocations a request reaches: one or two for most (inline, nothing allocated).
pub(super) type Imports = smallvec::SmallVec<[Arc<Import>; 2]>;

/// What a copy in flight reaches: the local regions (by the request's own pairs) and the
/// peer's imports (its streams are held by the stream epochs that track it).
pub(super) struct Keep {
    pub(super) _pairs: Vec<(LocalRange, RemoteRange)>,
    pub(super) _imports: Imports,
    /// A prepared request's pairs and imports, shared by every post of it.
    pub(super) _held: Option<Arc<Held>>,
}

/// What a prepared request's copies reach: its pairs (their regions) and the peer's imports.
pub(super) struct Held {
    pub(super) _pairs: Vec<(LocalRange, RemoteRange)>,
    pub(super) _imports: Imports,
}

impl Keep {
    /// What a post of a prepared request holds: the request's shared pairs and imports.
    pub(super) fn posted(held: &Arc<Held>) -> Keep {
        Keep {
            _pairs: Vec::new(),
            _imports: Imports::new(),
            _held: Some(held.clone()),
        }
    }
}

impl Drop for Held {
    /// The imports are parked, closed by a later reap on a caller's thread (as a refused
    /// request's are): the last holder may be the worker, or a waker.
    fn drop(&mut self) {
        park_imports(std::mem::take(&mut self._imports));
    }
}

/// The stream epochs of one request (one per stream it used): complete when all are.
pub(super) struct Events(pub(super) Vec<StreamFence>, Option<Gathered>);

/// The epoch of a request whose copies wait to go in a gather launch, set once they went:
/// `None` when nothing was queued for it, the launch's failure when it failed (nothing queued
/// either).
type Gathered = OnceLock<std::result::Result<Option<StreamFence>, Failed>>;

/// A failed launch as its requests report it.
#[derive(Debug, Clone)]
pub(super) struct Failed {
    call: &'static str,
    code: u32,
    name: String,
}

impl Failed {
    fn of(e: &Error) -> Failed {
        match e {
            Error::Cuda { call, code, name } => Failed {
                call,
                code: *code,
                name: name.clone(),
            },
            other => Failed {
                call: "cuLaunchKernel",
                code: u32::MAX,
                name: other.to_string(),
            },
        }
    }

    fn error(&self) -> Error {
        Error::Cuda {
            call: self.call,
            code: self.code,
            name: self.name.clone(),
        }
    }
}

impl Events {
    /// The epochs taken after a request's copies.
    pub(super) fn of(fences: Vec<StreamFence>) -> Events {
        Events(fences, None)
    }

    /// For a request whose copies wait for a gather launch: incomplete until
    /// [`gathered`](Self::gathered).
    pub(super) fn later() -> Events {
        Events(Vec::new(), Some(OnceLock::new()))
    }

    /// Its copies went (the epoch taken after them), nothing did (`Ok(None)`: complete), or
    /// their launch failed (complete too: nothing was queued). Once; later calls change
    /// nothing.
    pub(super) fn gathered(&self, r: std::result::Result<Option<StreamFence>, &Error>) {
        if let Some(cell) = &self.1 {
            let _ = cell.set(r.map_err(Failed::of));
        }
    }

    /// The failure of the launch its copies were to go in: nothing was queued for it.
    pub(super) fn refused(&self) -> Option<Error> {
        match self.1.as_ref()?.get()? {
            Err(f) => Some(f.error()),
            Ok(_) => None,
        }
    }
}

impl Fence for Arc<Events> {
    fn is_complete(&self) -> bool {
        (**self).is_complete()
    }

    fn check(&self) -> Result<bool> {
        (**self).check()
    }
}

impl Fence for Events {
    fn is_complete(&self) -> bool {
        let later = match &self.1 {
            None => true,
            Some(cell) => match cell.get() {
                Some(Ok(f)) => f.as_ref().is_none_or(Fence::is_complete),
                // A failed launch queued nothing: what it would have reached may go.
                Some(Err(_)) => true,
                None => false,
            },
        };
        later && self.0.iter().all(Fence::is_complete)
    }

    fn check(&self) -> Result<bool> {
        if let Some(cell) = &self.1 {
            match cell.get() {
                None => return Ok(false),
                Some(Err(f)) => return Err(f.error()),
                Some(Ok(Some(f))) if !f.check_recording(true)? => return Ok(false),
                Some(Ok(_)) => {}
            }
        }
        // The worker looks again and again with nobody else watching: from the first look.
        for e in &self.0 {
            if !e.check_recording(true)? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// Hand imports to the completion tracker, to be closed by a later reap on a caller's thread
/// instead of here: `cuIpcCloseMemHandle` waits for the work queued on the device (see
/// docs/transfer.md), which may wait on a word only this thread (the proxy, the worker) lets
/// through.
pub(super) fn park_imports(v: impl Into<Imports>) {
    let v = v.into();
    if !v.is_empty() {
        let done = CompletionFlag::new();
        done.set();
        Tracker::global().park(done, v);
    }
}

/// Imports taken while a request is prepared: parked (not closed here) if it is refused.
pub(super) struct Parking(pub(super) Imports);

impl Drop for Parking {
    fn drop(&mut self) {
        park_imports(std::mem::take(&mut self.0));
    }
}

/// Queue `work` on `raw` in order: one `cuMemcpyBatchAsync` for two pieces or more where the
/// driver has it (one driver call instead of one per piece), else `cuMemcpyAsync` per piece.
/// On an error some pieces may be queued.
///
/// # Safety
///
/// Every piece's ranges are live device (or mapped) memory for as long as the stream may run
/// the copies; `raw` is a live stream of the current context.
pub(super) unsafe fn queue_copies(
    work: &[Piece],
    raw: cudarc::driver::sys::CUstream,
) -> Result<()> {
    let len = |c: &Piece| {
        usize::try_from(c.len).map_err(|_| Error::invalid("len", c.len, "fits no usize"))
    };
    if work.len() >= 2 {
        let mut dsts: Vec<u64> = work.iter().map(|c| c.dst).collect();
        let mut srcs: Vec<u64> = work.iter().map(|c| c.src).collect();
        let mut sizes = work.iter().map(len).collect::<Result<Vec<_>>>()?;
        // SAFETY: forwarded from the caller; three arrays of one length.
        if unsafe { crate::driver::mem::copy_batch_async(&mut dsts, &mut srcs, &mut sizes, raw) }? {
            return Ok(());
        }
    }
    for c in work {
        // SAFETY: forwarded from the caller.
        unsafe { crate::driver::mem::copy_async(c.dst, c.src, len(c)?, raw) }?;
    }
    Ok(())
}

/// Queue the copies (each on the streams of its GPU, cut as [`spread`] says) and take an epoch
/// of each stream used (after its copies: the epoch covers them). On a failure after some copies
/// were queued, what they reach is parked behind the epochs taken: never freed early.
pub(super) fn enqueue(
    streams: &[(usize, Arc<[Stream]>)],
    copies: &[Piece],
    chunk: u64,
    keep: Keep,
    mark: bool,
) -> Result<(Events, Keep, u64)> {
    let mut keep = Some(keep);
    let mut fences = Vec::with_capacity(1);
    let mut messages = 0u64;
    for (d, mine) in streams {
        if let ([_], [s]) = (streams, &mine[..]) {
            // One GPU, one stream (the defaults): every copy goes there as it is.
            queue_on(s, copies, &mut keep, &mut fences, mark)?;
            messages += copies.len() as u64;
            continue;
        }
        let list: Vec<Piece> = copies.iter().filter(|c| c.device == *d).copied().collect();
        for (s, work) in mine.iter().zip(spread(&list, mine.len(), chunk)) {
            if work.is_empty() {
                continue;
            }
            queue_on(s, &work, &mut keep, &mut fences, mark)?;
            messages += work.len() as u64;
        }
    }
    Ok((
        Events::of(fences),
        keep.take().expect("kept to the end"),
        messages,
    ))
}

/// Queue `work` on `s` and take an epoch of it (after the copies: the epoch covers them), with
/// an event recorded behind it when `mark` ([`runs_long`]). On a failure `keep` is parked behind
/// the epochs taken so far (or dropped when nothing was queued), never freed early.
fn queue_on(
    s: &Stream,
    work: &[Piece],
    keep: &mut Option<Keep>,
    fences: &mut Vec<StreamFence>,
    mark: bool,
) -> Result<()> {
    // The stream's context current for the copy (the caller's thread may have another).
    if let Err(e) = crate::driver::ctx::bind(s.cuda().context()) {
        if let Some(k) = keep.take() {
            if fences.is_empty() {
                drop(k); // nothing queued yet
            } else {
                Tracker::global().park(Events::of(std::mem::take(fences)), k);
            }
        }
        return Err(e);
    }
    let k = keep.take().expect("kept between streams");
    // A lane's streams are the endpoint's own: made in `streams_of`, never handed out, and made
    // to wait only on events of other lanes' streams (a reconnect's join), so no capture can
    // reach them (the private protocol: no driver questions).
    let copies = |raw, _: &Keep| {
        // SAFETY: both ranges of every piece were checked: the local range inside its region,
        // which `keep` holds; the remote range inside the peer's allocation and the mapping,
        // which `keep` holds too. The copies are tracked by the stream epoch taken after them,
        // and nothing is freed before that epoch completes.
        unsafe { queue_copies(work, raw) }
    };
    let r = match s.as_private() {
        Some(private) => private.enqueue("cuMemcpyAsync", k, copies),
        // Not made by `streams_of` (never so today): the probing protocol.
        None => capture::enqueue_raw(s.cu_stream(), "cuMemcpyAsync", k, copies),
    };
    // Taken after the copies (some may be queued even when the call failed): the epoch covers
    // them.
    fences.push(s.timeline().issue());
    match r {
        Ok(((), k)) => {
            if mark {
                // Not recorded (the driver refused): a later wait records one, as without.
                s.timeline().mark();
            }
            *keep = Some(k);
            Ok(())
        }
        Err(refused) => {
            if let Some(k) = refused.kept {
                Tracker::global().park(Events::of(std::mem::take(fences)), k);
            }
            Err(refused.error)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_gathered_request_is_complete_only_once_its_launch_is_known() {
        let waiting = Events::later();
        assert!(!waiting.is_complete());
        assert!(!waiting.check().unwrap());
        waiting.gathered(Ok(None));
        assert!(waiting.is_complete() && waiting.check().unwrap());
        // Set once: a later answer changes nothing.
        waiting.gathered(Err(&Error::cuda(
            "cuLaunchKernel",
            cudarc::driver::sys::CUresult::CUDA_ERROR_LAUNCH_FAILED,
        )));
        assert!(waiting.is_complete());

        let failed = Events::later();
        failed.gathered(Err(&Error::cuda(
            "cuLaunchKernel",
            cudarc::driver::sys::CUresult::CUDA_ERROR_LAUNCH_FAILED,
        )));
        // Complete (nothing was queued: what it reaches may go), and refused with the
        // driver's failure.
        assert!(failed.is_complete());
        assert!(matches!(
            failed.refused(),
            Some(Error::Cuda {
                call: "cuLaunchKernel",
                ..
            })
        ));
        assert!(waiting.refused().is_none() && Events::later().refused().is_none());
        let e = failed.check().unwrap_err();
        assert!(
            matches!(
                e,
                Error::Cuda {
                    call: "cuLaunchKernel",
                    ..
                }
            ),
            "{e}"
        );
        assert!(Events::of(Vec::new()).is_complete());
    }

    #[test]
    fn a_request_runs_long_by_its_slowest_link() {
        const MIB: u64 = 1 << 20;
        let same = [(Some(0), 0)];
        assert!(runs_long(16 * MIB, &same));
        assert!(!runs_long(4 * MIB, &same));
        // Host memory.
        assert!(runs_long(MIB, &[(None, 0)]));
        assert!(!runs_long(64 << 10, &[(None, 0)]));
        // The slowest pair decides.
        assert!(runs_long(MIB, &[(Some(0), 0), (None, 0)]));
        assert!(!runs_long(u64::MAX, &[]));
        assert!(!runs_long(100_000, &[(None, 0)]));
    }

    proptest! {
        /// Copies spread over streams: every byte of every copy once, chunks at most `chunk`
        /// bytes (one stream: nothing cut).
        #[test]
        fn spreading_covers_every_byte_once(
            lens in proptest::collection::vec(1u64..5_000_000, 1..6),
            streams in 1usize..5, chunk in 65_536u64..2_000_000,
        ) {
            let copies: Vec<Piece> = lens.iter().enumerate().map(|(i, &len)| Piece {
                dst: (i as u64) << 40, src: ((i as u64) << 40) + (1 << 39), len, device: 0,
            }).collect();
            let out = spread(&copies, streams, chunk);
            prop_assert_eq!(out.len(), streams);
            let mut all: Vec<Piece> = out.concat();
            if streams == 1 {
                prop_assert_eq!(&all, &copies);
            }
            all.sort_by_key(|c| c.dst);
            for c in &copies {
                let mut at = c.dst;
                for p in all.iter().filter(|p| p.dst >> 40 == c.dst >> 40) {
                    prop_assert_eq!(p.dst, at);
                    prop_assert_eq!(p.src - c.src, p.dst - c.dst);
                    prop_assert!(streams == 1 || p.len <= chunk);
                    at += p.len;
                }
                prop_assert_eq!(at, c.dst + c.len);
            }
        }
    }
}
