//! The one completion tracker: CUDA events and host callbacks, cuFile, and verbs work completions.
//!
//! An asynchronous operation returns an [`InFlight`] that owns everything the operation may still
//! touch. [`InFlight::wait`] gives the resources back once its [`Fence`] reports completion.
//! Dropping an `InFlight` waits a bounded time; if completion still cannot be proven the resources
//! are parked in the process-wide [`Tracker`] and freed by a later [`Tracker::reap`] after the fence
//! completes, or never. `mem::forget` of an `InFlight` leaks the resources, which is safe.
//!
//! Fences for CUDA work:
//! - [`StreamFence`] (from [`crate::cuda::Stream::fence`]): amortised per-stream epochs. Issuing
//!   costs one atomic increment; a CUDA event is recorded only when someone asks whether the work
//!   is done, and one event answers for every earlier epoch of that stream.
//! - [`EventFence`]: one CUDA event recorded now (`cuEventRecord`), polled with `cuEventQuery`.
//! - [`HostFnFence`]: a host callback (`cuLaunchHostFunc`) that sets a [`CompletionFlag`]; the
//!   callback makes no CUDA calls and frees nothing (what it owned is freed by [`Tracker::reap`]).
//!
//! Fork safety: the tracker records the pid that created it; in a forked child an `InFlight`
//! dropped or reaped leaks what it owns (no driver calls, no frees).

use crate::error::{Error, Result};
use cudarc::driver::{CudaEvent, CudaStream, sys};
use std::any::Any;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a drop waits for completion before parking what it owns.
pub const DROP_WAIT: Duration = Duration::from_secs(5);

/// Something that can tell whether an operation has finished.
///
/// The trait is open: implement it for your own completion sources. The library calls your code
/// while it decides whether to free what an operation owns, so a panic there is caught and taken
/// as "never complete": the resources that fence guards are leaked (never freed), and nothing
/// else the tracker holds is affected. An [`InFlight`] whose fence panicked in
/// [`InFlight::wait`], [`InFlight::wait_timeout`] or [`InFlight::try_take`] passes the panic on
/// after leaking its resources.
pub trait Fence: Send + Sync + 'static {
    /// Whether completion has been observed. Must not block.
    fn is_complete(&self) -> bool;

    /// Wait up to `timeout` for completion; `true` once complete. The default polls with back-off.
    fn wait_timeout(&self, timeout: Duration) -> bool {
        let start = Instant::now();
        let mut nap = Duration::from_micros(1);
        loop {
            if self.is_complete() {
                return true;
            }
            if start.elapsed() >= timeout {
                return false;
            }
            if nap < Duration::from_micros(50) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(nap);
            }
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }
}

/// A flag set once by whoever observes completion: a host callback, a polled work completion, an
/// I/O thread. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct CompletionFlag(Arc<AtomicBool>);

impl CompletionFlag {
    /// A new, unset flag.
    pub fn new() -> Self {
        Self::default()
    }

    /// Mark the operation complete (Release: writes before this are visible to the waiter).
    pub fn set(&self) {
        self.0.store(true, Ordering::Release);
    }
}

impl Fence for CompletionFlag {
    fn is_complete(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// A fence that is complete from the start (for operations that finished synchronously).
#[derive(Debug, Clone, Copy, Default)]
pub struct Done;

impl Fence for Done {
    fn is_complete(&self) -> bool {
        true
    }
}

type Parked = (Box<dyn Fence>, Box<dyn Any + Send>);

/// Resources whose operations could not be proven complete when their owner let go.
pub struct Tracker {
    parked: Mutex<Vec<Parked>>,
    count: AtomicUsize,
    pid: u32,
}

impl Tracker {
    /// The process-wide tracker.
    pub fn global() -> &'static Tracker {
        static T: OnceLock<Tracker> = OnceLock::new();
        T.get_or_init(Tracker::new)
    }

    fn new() -> Tracker {
        Tracker {
            parked: Mutex::new(Vec::new()),
            count: AtomicUsize::new(0),
            pid: std::process::id(),
        }
    }

    /// Whether this is a forked child of the process that created the tracker.
    pub fn in_forked_child(&self) -> bool {
        std::process::id() != self.pid
    }

    /// Keep `resources` until `fence` completes and a later [`reap`](Self::reap) sees it.
    pub fn park<F: Fence, R: Send + 'static>(&self, fence: F, resources: R) {
        let entry: Parked = (Box::new(fence), Box::new(resources));
        self.count.fetch_add(1, Ordering::AcqRel);
        self.lock().push(entry);
    }

    /// Drop parked resources whose fence has completed; returns how many were released. In a
    /// forked child nothing is released (no FFI frees after fork).
    ///
    /// Fences are polled outside the lock (polling may call the driver), so a host callback
    /// parking what it owned never waits behind a driver call. A fence whose poll panics (a
    /// user's [`Fence`] implementation) is taken as never complete: its entry is leaked, never
    /// freed, and every other entry is kept or released as its own fence says.
    pub fn reap(&self) -> usize {
        if self.in_forked_child() || self.count.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let taken = std::mem::take(&mut *self.lock());
        let mut done = Vec::new();
        let mut keep = Vec::with_capacity(taken.len());
        let mut leaked = 0;
        for entry in taken {
            match poll_caught(|| entry.0.is_complete()) {
                Some(true) => done.push(entry),
                Some(false) => keep.push(entry),
                None => {
                    leaked += 1;
                    std::mem::forget(entry);
                }
            }
        }
        self.lock().extend(keep);
        let n = done.len();
        self.count.fetch_sub(n + leaked, Ordering::AcqRel);
        // Dropped outside the lock: resources' destructors may call into CUDA or verbs.
        drop(done);
        n
    }

    /// How many entries are parked (including any a concurrent [`reap`](Self::reap) is
    /// examining).
    pub fn parked(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Parked>> {
        self.parked.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Run `poll` (a user's fence code), catching a panic: `None` when it panicked. A fence that
/// panics can prove nothing, so its resources are leaked, never freed.
fn poll_caught<T>(poll: impl FnOnce() -> T) -> Option<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(poll)).ok()
}

/// An operation in flight, owning what it may still touch until its fence completes.
#[must_use = "dropping an InFlight blocks until the operation completes (bounded), then parks its resources"]
pub struct InFlight<R: Send + 'static, F: Fence = Box<dyn Fence>> {
    fence: Option<F>,
    resources: Option<R>,
    what: &'static str,
}

impl Fence for Box<dyn Fence> {
    fn is_complete(&self) -> bool {
        (**self).is_complete()
    }
    fn wait_timeout(&self, timeout: Duration) -> bool {
        (**self).wait_timeout(timeout)
    }
}

impl<R: Send + 'static, F: Fence> InFlight<R, F> {
    /// Track `resources` until `fence` completes. `what` names the operation in errors.
    pub fn new(what: &'static str, fence: F, resources: R) -> Self {
        InFlight {
            fence: Some(fence),
            resources: Some(resources),
            what,
        }
    }

    /// Whether the operation has completed (non-blocking).
    pub fn is_complete(&self) -> bool {
        self.fence.as_ref().is_none_or(Fence::is_complete)
    }

    /// Wait for completion and take the resources back. Also reaps the [`Tracker`].
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when the fence can never prove completion (a [`StreamFence`] or
    /// [`EventFence`] whose synchronization failed: a sticky error); the resources are then
    /// parked in the [`Tracker`], never freed early.
    pub fn wait(self) -> Result<R> {
        Tracker::global().reap();
        // Duration::MAX never runs out; the wait ends early only when the fence cannot prove
        // completion, and then dropping the op parks it.
        self.wait_timeout(Duration::MAX).map_err(|(e, _op)| e)
    }

    /// Wait up to `timeout`; on time-out the operation stays in flight and is handed back in
    /// `Err`, never freed.
    ///
    /// # Panics
    ///
    /// When the fence's own code panics (a user's [`Fence`]); the resources are then leaked.
    pub fn wait_timeout(mut self, timeout: Duration) -> Result<R, (Error, Self)> {
        let ok = self.poll(|f| f.wait_timeout(timeout));
        if ok {
            self.fence = None;
            Ok(self
                .resources
                .take()
                .expect("resources present until taken"))
        } else {
            let what = self.what;
            Err((
                Error::Timeout {
                    what,
                    after: timeout,
                },
                self,
            ))
        }
    }

    /// Wait without a time limit, but give up when `failed` reports an error (it is asked after
    /// every `slice` of waiting, e.g. `cuStreamQuery` on the stream a host callback waits on,
    /// whose callback never runs once the stream has failed). Giving up parks the operation in the
    /// [`Tracker`] (its resources are never freed early) and returns that error.
    pub(crate) fn wait_unless(
        mut self,
        slice: Duration,
        failed: impl Fn() -> Result<()>,
    ) -> Result<R> {
        Tracker::global().reap();
        loop {
            match self.wait_timeout(slice) {
                Ok(r) => return Ok(r),
                Err((_, op)) => self = op,
            }
            if let Err(e) = failed() {
                return match self.try_take() {
                    Ok(r) => Ok(r),
                    Err(mut op) => {
                        if let (Some(f), Some(r)) = (op.fence.take(), op.resources.take()) {
                            if Tracker::global().in_forked_child() {
                                std::mem::forget(f);
                                std::mem::forget(r);
                            } else {
                                Tracker::global().park(f, r);
                            }
                        }
                        Err(e)
                    }
                };
            }
        }
    }

    /// The resources, if the operation has completed; otherwise `Err(self)`.
    ///
    /// # Panics
    ///
    /// As [`wait_timeout`](Self::wait_timeout).
    pub fn try_take(mut self) -> Result<R, Self> {
        if self.poll(Fence::is_complete) {
            self.fence = None;
            Ok(self
                .resources
                .take()
                .expect("resources present until taken"))
        } else {
            Err(self)
        }
    }
}

impl<R: Send + 'static, F: Fence> InFlight<R, F> {
    /// Ask the fence (`true` when there is none left). If its code panics, the fence and the
    /// resources are leaked (nothing can prove the work done) and the panic goes on.
    fn poll(&mut self, ask: impl FnOnce(&F) -> bool) -> bool {
        let Some(f) = self.fence.as_ref() else {
            return true;
        };
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ask(f))) {
            Ok(done) => done,
            Err(panic) => {
                std::mem::forget(self.fence.take());
                std::mem::forget(self.resources.take());
                std::panic::resume_unwind(panic)
            }
        }
    }
}

impl<R: Send + 'static, F: Fence> Drop for InFlight<R, F> {
    fn drop(&mut self) {
        let (Some(fence), Some(res)) = (self.fence.take(), self.resources.take()) else {
            return;
        };
        if Tracker::global().in_forked_child() {
            // No driver calls and no frees in a forked child: leak both.
            std::mem::forget(fence);
            std::mem::forget(res);
            return;
        }
        match poll_caught(|| fence.wait_timeout(DROP_WAIT)) {
            Some(true) => drop(res),
            Some(false) => Tracker::global().park(fence, res),
            None => {
                // The fence panicked: it proves nothing, now or later. Leak both.
                std::mem::forget(fence);
                std::mem::forget(res);
            }
        }
    }
}

impl<R: Send + 'static, F: Fence> std::fmt::Debug for InFlight<R, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlight")
            .field("what", &self.what)
            .field("complete", &self.is_complete())
            .finish()
    }
}

/// A fence on one CUDA event, recorded when the fence is made (`cuEventRecord`) and polled with
/// `cuEventQuery`. For many small operations on one stream prefer [`StreamFence`].
#[derive(Debug)]
pub struct EventFence(CudaEvent);

impl EventFence {
    /// `cuEventRecord` a new event (timing disabled) on `stream`: complete once the work queued
    /// on `stream` so far has finished.
    #[doc(alias = "cuEventRecord")]
    ///
    /// # Errors
    ///
    /// [`Error::StreamCapturing`] while `stream` captures a CUDA graph (an event recorded in a
    /// capture completes with the capture, not with the work); [`Error::Cuda`].
    pub fn record(stream: &CudaStream) -> Result<Self> {
        let (ev, ()) = crate::cuda::capture::enqueue(stream, "cuEventRecord", (), |_, ()| {
            stream
                .record_event(None)
                .map_err(|e| crate::error::from_driver("cuEventRecord", e))
        })?;
        Ok(EventFence(ev))
    }

    /// Wrap an event already recorded after the work to track.
    pub fn from_event(event: CudaEvent) -> Self {
        EventFence(event)
    }

    /// The event.
    pub fn event(&self) -> &CudaEvent {
        &self.0
    }
}

impl Fence for EventFence {
    fn is_complete(&self) -> bool {
        // A query error (a sticky context error) is "not complete": the resources are kept.
        matches!(self.0.try_is_complete(), Ok(true))
    }

    fn wait_timeout(&self, timeout: Duration) -> bool {
        if timeout >= LONG_WAIT {
            return self.0.synchronize().is_ok() && self.is_complete();
        }
        poll_until(|| self.is_complete(), timeout)
    }
}

/// Waits at least this long block in the driver (`cuEventSynchronize`) instead of polling.
const LONG_WAIT: Duration = Duration::from_secs(3600);

fn poll_until(done: impl Fn() -> bool, timeout: Duration) -> bool {
    let start = Instant::now();
    let mut nap = Duration::from_micros(1);
    loop {
        if done() {
            return true;
        }
        if start.elapsed() >= timeout {
            return false;
        }
        if nap < Duration::from_micros(50) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(nap);
        }
        nap = (nap * 2).min(Duration::from_millis(1));
    }
}

/// A fence set by a host callback (`cuLaunchHostFunc`) once the stream reaches it, made by
/// [`crate::cuda::Stream::launch_host_fn`] or [`crate::cuda::Stream::host_fence`].
#[derive(Debug, Clone, Default)]
pub struct HostFnFence {
    flag: CompletionFlag,
    panicked: Arc<AtomicBool>,
}

impl HostFnFence {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    pub(crate) fn complete(&self, panicked: bool) {
        if panicked {
            self.panicked.store(true, Ordering::Relaxed);
        }
        self.flag.set();
    }

    /// Whether the callback's function panicked (the panic was caught; the fence is complete).
    pub fn panicked(&self) -> bool {
        self.panicked.load(Ordering::Relaxed)
    }
}

impl Fence for HostFnFence {
    fn is_complete(&self) -> bool {
        self.flag.is_complete()
    }
}

/// Completion state of one stream, shared by its [`StreamFence`]s.
///
/// Every operation issued on the stream takes the next epoch ([`Timeline::issue`], one atomic
/// add). Nothing is recorded per operation: when a fence is polled and no recorded event covers
/// its epoch yet, one event is recorded then, covering every epoch issued so far (stream order
/// makes a later event complete only after all earlier work). Events are recycled.
#[derive(Debug)]
pub struct Timeline {
    stream: Arc<CudaStream>,
    issued: AtomicU64,
    completed: AtomicU64,
    events: Mutex<Events>,
}

#[derive(Debug, Default)]
struct Events {
    /// Recorded events and the last epoch each covers, oldest first.
    pending: VecDeque<(u64, CudaEvent)>,
    /// Completed events, ready to be recorded again.
    free: Vec<CudaEvent>,
}

impl Timeline {
    /// A timeline for `stream`.
    pub fn new(stream: Arc<CudaStream>) -> Arc<Self> {
        Arc::new(Timeline {
            stream,
            issued: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            events: Mutex::new(Events::default()),
        })
    }

    /// The stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A fence for everything queued on the stream so far. Call it after queueing the work.
    pub fn issue(self: &Arc<Self>) -> StreamFence {
        let epoch = self.issued.fetch_add(1, Ordering::AcqRel) + 1;
        StreamFence {
            timeline: self.clone(),
            epoch,
        }
    }

    /// The highest epoch known complete.
    pub fn completed(&self) -> u64 {
        self.completed.load(Ordering::Acquire)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Events> {
        self.events.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Retire completed events; make sure one covers `epoch`. Returns whether `epoch` is done,
    /// and otherwise the raw event that covers it (`None` when none could be recorded: the
    /// stream is capturing a graph, or the driver refused).
    ///
    /// Never records while the stream captures a graph: an event recorded in a capture is a
    /// captured event, which completes with the capture rather than with the work (and which
    /// `cuEventQuery` refuses with `CUDA_ERROR_CAPTURED_EVENT`). One that was recorded anyway (a
    /// capture that began during the record) is dropped from the timeline and leaked, so later
    /// polls record a real one instead of waiting on it forever.
    fn poll(&self, epoch: u64) -> (bool, Option<sys::CUevent>) {
        let mut g = self.lock();
        while let Some((covered, ev)) = g.pending.front() {
            match ev.try_is_complete() {
                Ok(true) => {
                    self.completed.fetch_max(*covered, Ordering::AcqRel);
                    let (_, ev) = g.pending.pop_front().expect("front exists");
                    g.free.push(ev);
                }
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_CAPTURED_EVENT => {
                    // Proves nothing: forget it (destroying a captured event is not worth the
                    // risk) and look at the next one.
                    let (_, ev) = g.pending.pop_front().expect("front exists");
                    std::mem::forget(ev);
                }
                _ => break,
            }
        }
        if self.completed() >= epoch {
            return (true, None);
        }
        if let Some((_, ev)) = g.pending.iter().find(|(c, _)| *c >= epoch) {
            return (false, Some(ev.cu_event()));
        }
        // No event covers `epoch` yet: record one covering everything issued so far. Epochs are
        // handed out after their work is queued, so this record comes after that work.
        let covered = self.issued.load(Ordering::Acquire);
        let ev = match g.free.pop() {
            Some(ev) => ev,
            None => match self.stream.context().new_event(None) {
                Ok(ev) => ev,
                Err(_) => return (false, None),
            },
        };
        // Checked like any work queued on the stream, but a capture found after the record is
        // left alone: an internal event puts nothing into the user's graph.
        let probe = crate::cuda::capture::Driver {
            raw: self.stream.cu_stream(),
            invalidate: false,
        };
        if self.stream.context().bind_to_thread().is_err() {
            g.free.push(ev);
            return (false, None);
        }
        match crate::cuda::capture::enqueue_with(&probe, "cuEventRecord", ev, |ev| {
            ev.record(&self.stream)
                .map_err(|e| crate::error::from_driver("cuEventRecord", e))
        }) {
            Ok(((), ev)) => {
                let raw = ev.cu_event();
                g.pending.push_back((covered, ev));
                (false, Some(raw))
            }
            Err(r) => {
                if let Some(ev) = r.kept {
                    g.free.push(ev); // not recorded: reusable
                }
                (false, None)
            }
        }
    }

    /// Whether the stream is capturing a graph (or that cannot be told).
    fn capturing(&self) -> bool {
        self.stream.context().bind_to_thread().is_err()
            || crate::cuda::capture::is_capturing(self.stream.cu_stream()).unwrap_or(true)
    }
}

/// A fence on an epoch of a stream's [`Timeline`]: complete once all work queued on the stream
/// before the fence was made has finished. Cheap to make (no driver call) and to clone.
#[derive(Debug, Clone)]
pub struct StreamFence {
    timeline: Arc<Timeline>,
    epoch: u64,
}

impl StreamFence {
    /// The epoch this fence waits for.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The stream's timeline.
    pub fn timeline(&self) -> &Arc<Timeline> {
        &self.timeline
    }
}

impl Fence for StreamFence {
    fn is_complete(&self) -> bool {
        self.timeline.completed() >= self.epoch || self.timeline.poll(self.epoch).0
    }

    fn wait_timeout(&self, timeout: Duration) -> bool {
        if self.timeline.completed() >= self.epoch {
            return true;
        }
        if timeout >= LONG_WAIT {
            let tl = &self.timeline;
            if tl.capturing() {
                // cuStreamSynchronize is illegal on a capturing stream (and would invalidate the
                // user's capture). Wait on an event recorded before the capture, if one covers
                // the epoch; without one, completion cannot be observed now: answer `false` (the
                // caller gets an error and the resources stay parked, freed by a later reap once
                // the capture has ended) rather than waiting for a capture that this very thread
                // may be holding open.
                let mut nap = Duration::from_micros(1);
                loop {
                    match tl.poll(self.epoch) {
                        (true, _) => return true,
                        (false, None) => return false,
                        (false, Some(_)) => {}
                    }
                    if !tl.capturing() {
                        break; // the capture ended: synchronize below
                    }
                    std::thread::sleep(nap);
                    nap = (nap * 2).min(Duration::from_millis(1));
                }
            }
            // Unbounded wait: one cuStreamSynchronize (what a hand-written loop would do) covers
            // every epoch issued before it, including this one.
            // If it fails (a sticky error, or a capture that began just now), completion cannot
            // be proven: answer `false` (the caller gets an error, the resources stay parked)
            // instead of polling forever.
            let covered = self.timeline.issued.load(Ordering::Acquire);
            if tl.stream.context().bind_to_thread().is_err() {
                return tl.completed() >= self.epoch;
            }
            // SAFETY: a live stream (the timeline holds it), its context current.
            let r = unsafe { crate::driver::stream::synchronize(tl.stream.cu_stream()) };
            if r.is_ok() {
                tl.completed.fetch_max(covered, Ordering::AcqRel);
                return true;
            }
            return tl.completed() >= self.epoch;
        }
        poll_until(|| self.is_complete(), timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[derive(Debug)]
    struct Counted(Arc<AtomicUsize>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn resources_come_back_only_after_completion() {
        let flag = CompletionFlag::new();
        let drops = Arc::new(AtomicUsize::new(0));
        let op = InFlight::new("test op", flag.clone(), Counted(drops.clone()));
        let op = op.try_take().unwrap_err();
        let (err, op) = op.wait_timeout(Duration::from_millis(5)).unwrap_err();
        assert!(matches!(
            err,
            Error::Timeout {
                what: "test op",
                ..
            }
        ));
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        flag.set();
        let r = op.wait().unwrap();
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        drop(r);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn wait_unless_gives_up_on_error_and_parks() {
        let flag = CompletionFlag::new();
        let drops = Arc::new(AtomicUsize::new(0));
        let op = InFlight::new("never completes", flag.clone(), Counted(drops.clone()));
        let asked = AtomicUsize::new(0);
        let e = op
            .wait_unless(Duration::from_millis(1), || {
                if asked.fetch_add(1, Ordering::SeqCst) < 2 {
                    Ok(())
                } else {
                    Err(Error::invalid("stream", "failed", "test"))
                }
            })
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { arg: "stream", .. }));
        assert_eq!(asked.load(Ordering::SeqCst), 3);
        assert_eq!(drops.load(Ordering::SeqCst), 0, "parked, not freed");
        // Parked: freed by a reap once the fence completes.
        flag.set();
        while drops.load(Ordering::SeqCst) == 0 {
            Tracker::global().reap();
        }
        // Completed before the error check: the resources come back.
        let flag = CompletionFlag::new();
        flag.set();
        let op = InFlight::new("done", flag, 7u32);
        assert_eq!(
            op.wait_unless(Duration::from_millis(1), || Ok(())).unwrap(),
            7
        );
    }

    #[test]
    fn forget_leaks_never_frees() {
        let drops = Arc::new(AtomicUsize::new(0));
        let op = InFlight::new("forgotten", CompletionFlag::new(), Counted(drops.clone()));
        std::mem::forget(op);
        assert_eq!(drops.load(Ordering::SeqCst), 0);
    }

    /// A fence that parks something in the global tracker when polled (as a host callback
    /// finishing during a reap would).
    struct ParksWhenPolled(Arc<AtomicBool>);
    impl Fence for ParksWhenPolled {
        fn is_complete(&self) -> bool {
            if !self.0.swap(true, Ordering::SeqCst) {
                Tracker::global().park(Done, ());
            }
            true
        }
    }

    #[test]
    fn reap_polls_fences_outside_the_lock() {
        let t = Tracker::global();
        let drops = Arc::new(AtomicUsize::new(0));
        t.park(
            ParksWhenPolled(Arc::new(AtomicBool::new(false))),
            Counted(drops.clone()),
        );
        // Would deadlock if fences were polled under the tracker's lock.
        while drops.load(Ordering::SeqCst) == 0 {
            t.reap();
        }
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn in_flight_dropped_in_a_forked_child_leaks() {
        let _ = Tracker::global(); // created in the parent, as crate::cuda::init does
        let drops = Arc::new(AtomicUsize::new(0));
        let op = InFlight::new("fork test", Done, Counted(drops.clone()));
        // SAFETY: the child only drops `op` (no locks, no allocation on the leak path) and
        // calls `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            drop(op);
            let code = if drops.load(Ordering::SeqCst) == 0 {
                0
            } else {
                1
            };
            // SAFETY: ends the child without running the parent's exit handlers.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(r, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "child freed"
        );
        drop(op); // the parent frees normally
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    /// A user's fence whose poll panics.
    struct Panics;
    impl Fence for Panics {
        fn is_complete(&self) -> bool {
            panic!("user fence panics while polled")
        }
    }

    #[test]
    fn a_panicking_fence_frees_nothing_early_in_reap() {
        let t = Tracker::new();
        let drops = Arc::new(AtomicUsize::new(0));
        let pending = CompletionFlag::new();
        let done = CompletionFlag::new();
        done.set();
        // Entries before and after the panicking one, complete and not.
        t.park(done.clone(), Counted(drops.clone()));
        t.park(pending.clone(), Counted(drops.clone()));
        t.park(Panics, Counted(drops.clone()));
        t.park(pending.clone(), Counted(drops.clone()));
        t.park(done.clone(), Counted(drops.clone()));
        assert_eq!(t.parked(), 5);
        assert_eq!(t.reap(), 2, "the two complete entries");
        assert_eq!(drops.load(Ordering::SeqCst), 2);
        assert_eq!(
            t.parked(),
            2,
            "the two pending entries stay; the panicking one is leaked"
        );
        assert_eq!(t.reap(), 0);
        assert_eq!(drops.load(Ordering::SeqCst), 2);
        pending.set();
        assert_eq!(t.reap(), 2);
        assert_eq!(
            drops.load(Ordering::SeqCst),
            4,
            "the panicking entry is never freed"
        );
        assert_eq!(t.parked(), 0);
    }

    #[test]
    fn a_panicking_fence_frees_nothing_through_in_flight() {
        let drops = Arc::new(AtomicUsize::new(0));
        // Dropped: the panic is caught, the resources leak.
        drop(InFlight::new("panics", Panics, Counted(drops.clone())));
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        // Waited on: the panic reaches the caller, the resources leak.
        for how in 0..3 {
            let op = InFlight::new("panics", Panics, Counted(drops.clone()));
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match how {
                0 => drop(op.wait_timeout(Duration::from_millis(1))),
                1 => drop(op.try_take()),
                _ => drop(op.wait()),
            }));
            assert!(r.is_err(), "the fence's panic goes on to the caller");
            assert_eq!(drops.load(Ordering::SeqCst), 0);
        }
        // A `Box<dyn Fence>` that panics behaves the same.
        let boxed: Box<dyn Fence> = Box::new(Panics);
        drop(InFlight::new("boxed", boxed, Counted(drops.clone())));
        assert_eq!(drops.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn parked_resources_freed_by_reap_after_completion() {
        let t = Tracker::new();
        let flag = CompletionFlag::new();
        let drops = Arc::new(AtomicUsize::new(0));
        t.park(flag.clone(), Counted(drops.clone()));
        assert_eq!(t.reap(), 0);
        assert_eq!(t.parked(), 1);
        flag.set();
        assert_eq!(t.reap(), 1);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        assert_eq!(t.parked(), 0);
    }
}
