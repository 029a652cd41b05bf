//! Streams with a completion timeline, cross-stream events and host callbacks.

use crate::completion::capture::{self, PrivateStream, Refused};
use crate::completion::elsewhere::freeing_nothing;
use crate::completion::{Done, EventFence, HostFnFence, StreamFence, Timeline, Tracker};
use crate::error::{Result, from_driver};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, sys};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

/// A CUDA stream (cudarc's [`CudaStream`]) with the completion [`Timeline`] that gpudirect's
/// asynchronous operations use to track what they own. Cheap to clone (two `Arc`s).
///
/// Everything queued through gpudirect on this stream takes an epoch of the timeline
/// ([`fence`](Self::fence)), which costs no driver call; an event is recorded only when a fence
/// is polled.
#[derive(Debug, Clone)]
pub struct Stream {
    timeline: Arc<Timeline>,
}

impl Stream {
    /// `cuStreamCreate` a new non-default stream on `ctx` (through cudarc).
    ///
    /// # Errors
    ///
    /// As [`crate::cuda::init`]; [`crate::Error::Cuda`] from `cuStreamCreate`.
    #[doc(alias = "cuStreamCreate")]
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        Ok(Self::wrap(Self::create(ctx)?))
    }

    /// `cuStreamCreate` on `ctx`, past the presence check.
    fn create(ctx: &Arc<CudaContext>) -> Result<Arc<CudaStream>> {
        crate::cuda::init()?;
        ctx.new_stream()
            .map_err(|e| from_driver("cuStreamCreate", e))
    }

    /// A new stream on `ctx` for the library's own use, a [`PrivateStream`]: the caller keeps
    /// its rule (never hands it, or its raw handle, out, and never makes it wait on an event of a
    /// stream the library does not own). Its fences' waits then ask the driver no capture
    /// questions, nor does work queued through [`as_private`](Self::as_private).
    #[cfg_attr(
        not(feature = "p2p"),
        allow(dead_code, reason = "the copier's and the local endpoint's streams")
    )]
    pub(crate) fn private(ctx: &Arc<CudaContext>) -> Result<Self> {
        crate::cuda::init()?;
        Ok(Stream {
            timeline: Timeline::new_private(PrivateStream::new(ctx)?),
        })
    }

    /// The [`PrivateStream`] of a stream made by [`private`](Self::private) (its `enqueue`
    /// skips the capture questions); `None` for any other.
    #[cfg_attr(
        not(all(feature = "transfer", feature = "p2p")),
        allow(dead_code, reason = "the local endpoint's streams")
    )]
    pub(crate) fn as_private(&self) -> Option<&PrivateStream> {
        self.timeline.private_stream()
    }

    /// Track work on an existing cudarc stream. Each `wrap` makes its own timeline: fences of
    /// two wrappers of one stream are both correct, they just do not share events.
    ///
    /// The per-thread default stream (`CU_STREAM_PER_THREAD`, cudarc's `per_thread_stream`)
    /// names another stream on every thread, where the library would record and wait for its
    /// events from other threads: every call that queues work on it is refused with
    /// [`crate::Error::InvalidArgument`], and its fences are never seen complete.
    pub fn wrap(stream: Arc<CudaStream>) -> Self {
        Stream {
            timeline: Timeline::new(stream),
        }
    }

    /// The cudarc stream.
    pub fn cuda(&self) -> &Arc<CudaStream> {
        self.timeline.stream()
    }

    /// The raw `CUstream` (do not destroy it).
    pub fn cu_stream(&self) -> sys::CUstream {
        self.cuda().cu_stream()
    }

    /// The stream's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.cuda().context()
    }

    /// The completion timeline.
    pub fn timeline(&self) -> &Arc<Timeline> {
        &self.timeline
    }

    /// A fence for all work queued on this stream so far (no driver call). Data paths call it
    /// right after queueing their work and put it in an [`crate::completion::InFlight`].
    #[inline]
    pub fn fence(&self) -> StreamFence {
        self.timeline.issue()
    }

    /// Queue work on this stream through the capture-checked path (see [`capture`]): `f` gets
    /// the raw stream and `keep`, everything the work may touch.
    #[inline]
    pub(crate) fn enqueue<R, T>(
        &self,
        call: &'static str,
        keep: R,
        f: impl FnOnce(sys::CUstream, &R) -> Result<T>,
    ) -> Result<(T, R), Refused<R>> {
        capture::enqueue(self.cuda(), call, keep, f)
    }

    /// `cuEventRecord` now, as an [`EventFence`].
    ///
    /// # Errors
    ///
    /// [`crate::Error::StreamCapturing`] while the stream captures a graph; [`crate::Error::Cuda`].
    #[doc(alias = "cuEventRecord")]
    pub fn event_fence(&self) -> Result<EventFence> {
        EventFence::record(self.cuda())
    }

    /// `cuStreamSynchronize`: block until everything queued on the stream has finished.
    ///
    /// # Errors
    ///
    /// [`crate::Error::Cuda`]: an error of the work itself (sticky: the context is unusable
    /// afterwards), or `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` on a capturing stream.
    #[doc(alias = "cuStreamSynchronize")]
    pub fn synchronize(&self) -> Result<()> {
        self.cuda()
            .synchronize()
            .map_err(|e| from_driver("cuStreamSynchronize", e))
    }

    /// `cuEventRecord` a new event on this stream, for other streams to [`wait`](Self::wait).
    ///
    /// # Errors
    ///
    /// [`crate::Error::StreamCapturing`] while the stream captures a graph (an event recorded in
    /// a capture says nothing about the work's completion); [`crate::Error::Cuda`].
    #[doc(alias = "cuEventRecord")]
    pub fn record_event(&self) -> Result<CudaEvent> {
        let (ev, ()) = self.enqueue("cuEventRecord", (), |_, ()| {
            self.cuda()
                .record_event(None)
                .map_err(|e| from_driver("cuEventRecord", e))
        })?;
        Ok(ev)
    }

    /// `cuStreamWaitEvent`: work queued here after this call starts only after `event`'s work.
    ///
    /// # Errors
    ///
    /// [`crate::Error::StreamCapturing`] while this stream captures a graph, or when waiting made
    /// it join one (`event` was recorded in a capture: the capture is then invalidated);
    /// [`crate::Error::Cuda`].
    #[doc(alias = "cuStreamWaitEvent")]
    pub fn wait(&self, event: &CudaEvent) -> Result<()> {
        self.enqueue("cuStreamWaitEvent", (), |_, ()| {
            self.cuda()
                .wait(event)
                .map_err(|e| from_driver("cuStreamWaitEvent", e))
        })?;
        Ok(())
    }

    /// Order this stream after everything queued on `other` so far (record an event there, wait
    /// on it here).
    ///
    /// # Errors
    ///
    /// As [`record_event`](Self::record_event) and [`wait`](Self::wait).
    #[doc(alias = "cuEventRecord")]
    #[doc(alias = "cuStreamWaitEvent")]
    pub fn wait_for(&self, other: &Stream) -> Result<()> {
        let ev = other.record_event()?;
        self.wait(&ev)
    }

    /// `cuLaunchHostFunc`: run `f` on a driver thread once the stream reaches this point.
    ///
    /// `f` must make no CUDA calls (the driver forbids them in host functions, and they may
    /// deadlock): that includes dropping, inside `f`, a value that owns CUDA resources (a buffer,
    /// an event, a stream, e.g. one taken out of a `Mutex` or `Option` it captured). A panic in
    /// `f` is caught and reported by [`HostFnFence::panicked`]; its payload is leaked, never
    /// dropped in the callback (a payload's destructor could panic there, which would abort).
    /// `f` itself (and whatever it captured) is not dropped in the callback: it is dropped on an
    /// ordinary thread (this one, or a later [`Tracker::reap`]), so a capture that frees CUDA
    /// memory is safe. `f` runs at most once.
    ///
    /// # Errors
    ///
    /// [`crate::Error::StreamCapturing`] while the stream captures a graph (a captured host
    /// function would run at every launch of the graph); [`crate::Error::Cuda`] when the callback
    /// could not be queued. Then `f` never runs.
    #[doc(alias = "cuLaunchHostFunc")]
    pub fn launch_host_fn<F>(&self, f: F) -> Result<HostFnFence>
    where
        F: Fn() + Send + Sync + 'static,
    {
        let fence = HostFnFence::new();
        let payload: Box<HostFnPayload> = Box::new(HostFnPayload {
            f: Box::new(f),
            fence: fence.clone(),
            state: AtomicU8::new(PENDING),
        });
        let raw = Box::into_raw(payload);
        // The pointer travels as an integer so that the closure is not tied to the Box's type.
        let addr = raw as usize;
        let queued = self.enqueue("cuLaunchHostFunc", (), |s, ()| {
            // SAFETY: a live stream; `addr` is the leaked payload, which the protocol of
            // `HostFnPayload::state` frees exactly once, or never (so it outlives every run,
            // however many graph launches there are); the trampoline catches unwinds and makes
            // no CUDA calls.
            unsafe {
                crate::driver::stream::launch_host_func(
                    s,
                    host_fn_trampoline,
                    addr as *mut std::ffi::c_void,
                )
            }
        });
        match queued {
            Ok(((), ())) => {
                // SAFETY: the payload is live: only the one who sees the other's mark frees it,
                // and the callback marks it last of all its accesses.
                let state = unsafe { &(*raw).state };
                if let Err(prev) =
                    state.compare_exchange(PENDING, QUEUED, Ordering::AcqRel, Ordering::Acquire)
                {
                    debug_assert_eq!(prev, RAN);
                    // The callback has run and left the payload to us.
                    // SAFETY: handed over by the callback's mark; freed once, here.
                    drop(unsafe { Box::from_raw(raw) });
                }
                Ok(fence)
            }
            Err(Refused { error, kept: None }) => {
                // The callback may sit in a graph and run at every launch: it must find the
                // payload alive and do nothing, forever.
                // SAFETY: never freed from now on.
                unsafe { &(*raw).state }.store(LEAKED, Ordering::Release);
                Err(error)
            }
            Err(Refused {
                error,
                kept: Some(()),
            }) => {
                // SAFETY: not queued, so the callback will never see it.
                drop(unsafe { Box::from_raw(raw) });
                Err(error)
            }
        }
    }

    /// Wait until everything queued on this stream so far has completed, for work on memory
    /// the caller borrowed and gets back when it returns (a blocking copy, a copy scope): a
    /// fence of the stream waited for with the calling thread relaxed to
    /// `CU_STREAM_CAPTURE_MODE_RELAXED` (so a graph another thread captures in global mode is
    /// neither refused nor invalidated by the wait), then a refusal asked again with
    /// `cuStreamSynchronize` six times, over about 0.6 s, before it is believed.
    ///
    /// # Errors
    ///
    /// The driver's last answer when completion could not be proven (a sticky error, a call
    /// from a CUDA host function, the driver shutting down, a capture begun on the stream):
    /// the work may still be running, so the caller must not let the borrows end
    /// ([`unprovable`]).
    pub(crate) fn settle(&self) -> Result<()> {
        let last = self.fence();
        // SAFETY: the stream exists, so libcuda passed the crate's presence check.
        let _relaxed = unsafe { capture::Relaxed::new() };
        let mut attempt = 0;
        loop {
            if crate::completion::Fence::wait_timeout(&last, Duration::MAX) {
                return Ok(());
            }
            // Refused: ask once more, directly, to learn why.
            let again = crate::driver::ctx::bind(self.context())
                // SAFETY: a live stream, its context current.
                .and_then(|()| unsafe { crate::driver::stream::synchronize(self.cu_stream()) });
            match again {
                Ok(()) => return Ok(()),
                Err(e) if attempt >= 6 => return Err(e),
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(10 << attempt));
                    attempt += 1;
                }
            }
        }
    }

    /// After work on borrowed memory was queued (`queued`, the enqueue's answer), wait until it
    /// has completed ([`settle`](Self::settle)). A refusal that queued nothing is returned;
    /// where completion cannot be proven (a capture began on the stream while the work was
    /// queued, or the stream cannot be synchronized), [`unprovable`] aborts: the borrows end
    /// when this returns.
    pub(crate) fn settle_borrowed(
        &self,
        what: &str,
        queued: std::result::Result<(), Refused<()>>,
    ) -> Result<()> {
        match queued {
            Ok(()) => {}
            Err(Refused {
                error,
                kept: Some(()),
            }) => return Err(error),
            Err(Refused { error, kept: None }) => unprovable(what, &error.to_string()),
        }
        if let Err(e) = self.settle() {
            unprovable(what, &format!("the stream cannot be synchronized: {e}"));
        }
        Ok(())
    }

    /// A [`HostFnFence`] for the work queued so far: a host callback that only sets a flag.
    ///
    /// # Errors
    ///
    /// As [`launch_host_fn`](Self::launch_host_fn).
    #[doc(alias = "cuLaunchHostFunc")]
    pub fn host_fence(&self) -> Result<HostFnFence> {
        self.launch_host_fn(|| {})
    }
}

/// The payload is queued with the callback and not yet marked by either side.
const PENDING: u8 = 0;
/// The queueing thread saw the callback queued on a stream that is not capturing: the callback
/// frees the payload after running.
const QUEUED: u8 = 1;
/// The callback ran before the queueing thread marked it: the queueing thread frees it.
const RAN: u8 = 2;
/// The callback may be in a CUDA graph: it never runs `f` and nobody ever frees the payload.
const LEAKED: u8 = 3;

struct HostFnPayload {
    f: Box<dyn Fn() + Send + Sync>,
    fence: HostFnFence,
    /// Who frees the payload: [`PENDING`], [`QUEUED`], [`RAN`] or [`LEAKED`]. Whichever side
    /// marks second frees it (the callback parks it in the tracker, the queueing thread drops
    /// it), so it is freed exactly once; a leaked payload is never freed, however often a graph
    /// launch runs the callback.
    state: AtomicU8,
}

/// Runs in a driver thread: no CUDA calls and no frees of CUDA resources here.
unsafe extern "C" fn host_fn_trampoline(user: *mut std::ffi::c_void) {
    let raw = user.cast::<HostFnPayload>();
    // SAFETY: `user` is the payload leaked by `launch_host_fn`; it stays allocated until the
    // state protocol hands it to one side, which happens only after our last access below.
    let payload = unsafe { &*raw };
    if payload.state.load(Ordering::Acquire) == LEAKED {
        return; // possibly a graph launch: run nothing, free nothing
    }
    // `f` and the wakers run with the thread marked as freeing nothing: what the crate lets go
    // of there (in code a waker runs inline) is dropped on the crate's drop thread.
    freeing_nothing(|| {
        let panicked =
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (payload.f)())) {
                Ok(()) => false,
                Err(p) => {
                    // Dropping the payload here could run a destructor that panics, and
                    // unwinding out of this extern "C" function aborts: leak it (the fence
                    // records the panic).
                    std::mem::forget(p);
                    true
                }
            };
        // Complete the fence through the payload's own handle, before the mark below hands the
        // payload over: no handle of the fence (nor any waker it keeps) is dropped on this
        // thread. The fence wakes its futures' wakers by reference. If the payload was marked
        // LEAKED meanwhile, the fence was never handed out, so completing it tells nobody
        // anything.
        payload.fence.complete(panicked);
    });
    // The last access to the payload: from here on the queueing thread may free it.
    match payload
        .state
        .compare_exchange(PENDING, RAN, Ordering::AcqRel, Ordering::Acquire)
    {
        Ok(_) => {}
        Err(QUEUED) => {
            // SAFETY: the queueing thread marked it QUEUED and will never touch it again: ours.
            let owned = unsafe { Box::from_raw(raw) };
            // Whatever `f` captured is dropped by `Tracker::reap` on an ordinary thread. The
            // boxes themselves are plain heap memory.
            Tracker::global().park(Done, owned);
        }
        Err(_) => {} // LEAKED meanwhile: never freed
    }
}

/// Abort: work queued on memory `what` borrowed cannot be proven complete (`why`), and the
/// borrows cannot be kept from their owners the way owned buffers are parked, so returning could
/// let the work write memory its owner reads, reuses or frees. The message is written without
/// any step that could panic (a closed standard error is ignored).
#[cold]
pub(crate) fn unprovable(what: &str, why: &str) -> ! {
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "gpudirect: {what} cannot prove that its copies have completed ({why}); the buffers it \
         borrowed could still be written, so the process aborts"
    );
    std::process::abort()
}

impl From<Arc<CudaStream>> for Stream {
    fn from(s: Arc<CudaStream>) -> Self {
        Stream::wrap(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A payload as `launch_host_fn` leaks it, with a closure whose captures count drops and
    /// whose calls count runs.
    fn payload(
        runs: &Arc<std::sync::atomic::AtomicUsize>,
        drops: &Arc<std::sync::atomic::AtomicUsize>,
    ) -> (*mut HostFnPayload, HostFnFence) {
        struct Counted(Arc<std::sync::atomic::AtomicUsize>);
        impl Drop for Counted {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let fence = HostFnFence::new();
        let (runs, c) = (runs.clone(), Counted(drops.clone()));
        let raw = Box::into_raw(Box::new(HostFnPayload {
            f: Box::new(move || {
                let _keep = &c;
                runs.fetch_add(1, Ordering::SeqCst);
            }),
            fence: fence.clone(),
            state: AtomicU8::new(PENDING),
        }));
        (raw, fence)
    }

    fn reap_until(drops: &std::sync::atomic::AtomicUsize, n: usize) {
        let start = std::time::Instant::now();
        while drops.load(Ordering::SeqCst) < n {
            Tracker::global().reap();
            assert!(start.elapsed().as_secs() < 10, "never reaped");
            std::thread::yield_now();
        }
    }

    #[test]
    fn host_fn_payload_is_freed_once_whoever_marks_second() {
        use std::sync::atomic::AtomicUsize;
        // The queueing thread marks first (QUEUED), the callback frees (through the tracker).
        let (runs, drops) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (raw, fence) = payload(&runs, &drops);
        // SAFETY: the payload is live until the protocol frees it.
        unsafe { &(*raw).state }.store(QUEUED, Ordering::SeqCst);
        // SAFETY: the leaked payload, handed to the callback as cuLaunchHostFunc would.
        unsafe { host_fn_trampoline(raw.cast()) };
        assert!(crate::completion::Fence::is_complete(&fence));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        reap_until(&drops, 1);
        assert_eq!(drops.load(Ordering::SeqCst), 1);

        // The callback runs first (RAN): it leaves the payload; the queueing side frees it.
        let (runs, drops) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (raw, fence) = payload(&runs, &drops);
        // SAFETY: as above.
        unsafe { host_fn_trampoline(raw.cast()) };
        assert!(crate::completion::Fence::is_complete(&fence));
        // SAFETY: the callback marked RAN and never touches the payload again.
        let state = unsafe { &(*raw).state };
        assert_eq!(
            state.compare_exchange(PENDING, QUEUED, Ordering::AcqRel, Ordering::Acquire),
            Err(RAN)
        );
        assert_eq!(drops.load(Ordering::SeqCst), 0, "not freed by the callback");
        // SAFETY: ours now, as `launch_host_fn` would take it.
        drop(unsafe { Box::from_raw(raw) });
        assert_eq!(
            (runs.load(Ordering::SeqCst), drops.load(Ordering::SeqCst)),
            (1, 1)
        );
    }

    #[test]
    fn a_leaked_host_fn_never_runs_and_is_never_freed_however_often_launched() {
        use std::sync::atomic::AtomicUsize;
        let (runs, drops) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (raw, fence) = payload(&runs, &drops);
        // SAFETY: live; the queueing thread saw a capture after queueing.
        unsafe { &(*raw).state }.store(LEAKED, Ordering::SeqCst);
        for _ in 0..5 {
            // SAFETY: a leaked payload stays allocated forever; graph launches call it again.
            unsafe { host_fn_trampoline(raw.cast()) };
        }
        Tracker::global().reap();
        assert_eq!(runs.load(Ordering::SeqCst), 0);
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        assert!(!crate::completion::Fence::is_complete(&fence));
        // A capture seen while the callback was already running: the callback's mark fails and
        // it frees nothing (it may have completed the fence, which was never handed out).
        let (runs, drops) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (raw, fence) = payload(&runs, &drops);
        // SAFETY: live.
        let state = unsafe { &(*raw).state };
        state.store(LEAKED, Ordering::SeqCst);
        // (The run itself was checked above; here the mark after a run is.)
        assert_eq!(
            state.compare_exchange(PENDING, RAN, Ordering::AcqRel, Ordering::Acquire),
            Err(LEAKED)
        );
        assert!(!crate::completion::Fence::is_complete(&fence));
        assert_eq!(
            (runs.load(Ordering::SeqCst), drops.load(Ordering::SeqCst)),
            (0, 0)
        );
    }

    /// A waker that notes whether the thread waking it was marked as freeing nothing.
    struct NotesMark(std::sync::Mutex<Vec<bool>>);
    impl std::task::Wake for NotesMark {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            let here = crate::completion::elsewhere::frees_nothing_here();
            self.0.lock().unwrap().push(here);
        }
    }

    #[test]
    fn the_callback_and_its_wakers_run_marked_as_freeing_nothing() {
        let seen = Arc::new(NotesMark(std::sync::Mutex::new(Vec::new())));
        let fence = HostFnFence::new();
        let waker = std::task::Waker::from(seen.clone());
        assert!(crate::completion::Fence::register_waker(&fence, &waker));
        let in_f = Arc::new(NotesMark(std::sync::Mutex::new(Vec::new())));
        let noted = in_f.clone();
        let raw = Box::into_raw(Box::new(HostFnPayload {
            f: Box::new(move || std::task::Wake::wake_by_ref(&noted)),
            fence: fence.clone(),
            state: AtomicU8::new(PENDING),
        }));
        assert!(!crate::completion::elsewhere::frees_nothing_here());
        // SAFETY: the leaked payload, handed to the callback as cuLaunchHostFunc would.
        unsafe { host_fn_trampoline(raw.cast()) };
        // SAFETY: the callback marked RAN: the queueing side frees it.
        drop(unsafe { Box::from_raw(raw) });
        assert_eq!(*in_f.0.lock().unwrap(), [true], "f ran marked");
        assert_eq!(*seen.0.lock().unwrap(), [true], "the waker ran marked");
        assert!(
            !crate::completion::elsewhere::frees_nothing_here(),
            "the thread's own mark is back"
        );
    }

    #[test]
    fn the_callback_wakes_futures_by_reference_and_drops_no_waker() {
        use crate::completion::testing::CountWakes;
        use std::sync::atomic::AtomicUsize;
        for first in [QUEUED, PENDING] {
            let (runs, drops) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
            let (raw, fence) = payload(&runs, &drops);
            let wakes = Arc::new(CountWakes::default());
            let waker = std::task::Waker::from(wakes.clone());
            assert!(crate::completion::Fence::register_waker(&fence, &waker));
            drop(waker);
            // SAFETY: live until the protocol frees it.
            unsafe { &(*raw).state }.store(first, Ordering::SeqCst);
            // SAFETY: the leaked payload, handed to the callback as cuLaunchHostFunc would.
            unsafe { host_fn_trampoline(raw.cast()) };
            assert_eq!(wakes.0.load(Ordering::SeqCst), 1, "woken once");
            assert_eq!(
                Arc::strong_count(&wakes),
                2,
                "the fence still keeps its waker"
            );
            if first == PENDING {
                // SAFETY: the callback marked RAN: the queueing side frees it.
                drop(unsafe { Box::from_raw(raw) });
            }
            reap_until(&drops, 1);
            assert_eq!(Arc::strong_count(&wakes), 2);
            drop(fence);
            assert_eq!(
                Arc::strong_count(&wakes),
                1,
                "dropped with the last fence handle"
            );
        }
    }

    #[test]
    fn trampoline_leaks_a_panic_payload_instead_of_dropping_it() {
        struct PanicsOnDrop;
        impl Drop for PanicsOnDrop {
            fn drop(&mut self) {
                panic!("panic payload dropped inside the host callback");
            }
        }
        let fence = HostFnFence::new();
        let raw = Box::into_raw(Box::new(HostFnPayload {
            f: Box::new(|| std::panic::panic_any(PanicsOnDrop)),
            fence: fence.clone(),
            state: AtomicU8::new(QUEUED),
        }));
        // SAFETY: a leaked payload box, handed over once, as cuLaunchHostFunc would. Dropping
        // the panic payload in there would abort the test process (a panic out of extern "C").
        unsafe { host_fn_trampoline(raw.cast()) };
        assert!(crate::completion::Fence::is_complete(&fence));
        assert!(fence.panicked());
    }

    #[test]
    fn streams_are_send_and_sync() {
        fn is<T: Send + Sync>() {}
        is::<Stream>();
        is::<HostFnFence>();
        is::<StreamFence>();
    }

    #[test]
    fn only_streams_made_private_enqueue_without_the_capture_questions() {
        let ctx = match crate::cuda::context(0) {
            Ok(c) => c,
            Err(e) => {
                println!("SKIPPED: no GPU: {e}");
                return;
            }
        };
        let private = Stream::private(&ctx).unwrap();
        let p = private.as_private().expect("made private");
        crate::driver::ctx::bind(&ctx).unwrap();
        let ((), ()) = p.enqueue("test", (), |_, ()| Ok(())).ok().unwrap();
        private.synchronize().unwrap();
        assert!(Stream::new(&ctx).unwrap().as_private().is_none());
        assert!(
            Stream::wrap(ctx.new_stream().unwrap())
                .as_private()
                .is_none()
        );
        let lane = PrivateStream::<crate::completion::capture::DriverStream>::new(&ctx).unwrap();
        let ((), ()) = lane.enqueue("test", (), |_, ()| Ok(())).ok().unwrap();
    }
}
