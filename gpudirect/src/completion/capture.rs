//! The one place where gpudirect queues work on a CUDA stream, and its graph-capture check.
//!
//! Work queued on a stream that is capturing a CUDA graph does not run now: it runs when the
//! graph is launched, and again at every launch. A fence taken after it (an event, a host
//! callback) completes when the capture ends, long before any launch, so the library would hand
//! back or free memory the graph still uses. Every path that queues work on a stream therefore
//! goes through [`enqueue`] (or [`enqueue_raw`] on a raw stream whose context is current), which:
//!
//! 1. binds the stream's context;
//! 2. asks `cuStreamIsCapturing`: a capturing stream (active or invalidated capture) is refused
//!    with [`Error::StreamCapturing`] (`enqueued: false`) before any work is queued, and the
//!    caller drops its arguments normally;
//! 3. queues the work;
//! 4. asks again. If the stream is capturing now, another thread began a capture while the work
//!    was being queued, so the work may be in a graph: the capture is invalidated (a
//!    `cuStreamQuery` on a capturing stream is an illegal operation in capture, after which
//!    `cuStreamEndCapture` returns no graph), and whatever the work may touch is leaked, never
//!    freed ([`Error::StreamCapturing`] with `enqueued: true`).
//!
//! Residual race: a capture that another thread both begins and ends between steps 2 and 4 is
//! not seen (the stream is not capturing at either check). Such a graph holds the work, and its
//! launches may touch memory the library has already handed back. Beginning and ending a capture
//! on a stream while another thread queues work on that same stream is a data race on the
//! stream in the CUDA programming model as well; the library cannot close it without a lock
//! every user of the stream would have to take.
//!
//! A [`PrivateStream`] (one the library creates for itself and never hands out) skips the
//! driver's questions: it cannot be capturing. Its [`enqueue`](PrivateStream::enqueue) is the
//! only way to queue work without them.

use super::tracker::forked;
use crate::driver;
use crate::error::{Error, Result, from_driver};
use cudarc::driver::{CudaContext, CudaStream, sys};
use std::sync::Arc;

/// A refusal or failure from [`enqueue`]: the error, and what was to be kept alive, back when
/// nothing can still use it (`None` when it was leaked because the work may be in a graph).
pub(crate) struct Refused<R> {
    pub(crate) error: Error,
    pub(crate) kept: Option<R>,
}

impl<R> Refused<R> {
    /// Whether what the work uses was leaked (the work may sit in a graph).
    pub(crate) fn leaked(&self) -> bool {
        self.kept.is_none()
    }
}

impl<R> From<Refused<R>> for Error {
    fn from(r: Refused<R>) -> Error {
        r.error
    }
}

/// `cuStreamIsCapturing(raw)`: whether the stream is in capture mode (an active capture, or an
/// invalidated one not yet ended). The caller makes the stream's context current.
///
/// Every queueing path asks this first, so the per-thread default stream is refused here,
/// before anything is queued on it.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for the per-thread default stream (`CU_STREAM_PER_THREAD`, as
/// cudarc's `per_thread_stream`); [`Error::Cuda`] naming `cuStreamIsCapturing`
/// (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` for the legacy default stream while a blocking stream
/// captures).
#[inline]
pub(crate) fn is_capturing(raw: sys::CUstream) -> Result<bool> {
    refuse_per_thread(raw)?;
    // SAFETY: a live stream handle (or the legacy stream) whose context the caller made current.
    unsafe { driver::stream::is_capturing(raw) }
}

/// Refuse the per-thread default stream. Its handle names another stream on every thread: an
/// event the completion thread or a waiter records there, or a synchronize it calls, would
/// look at that thread's own stream, and a fence could complete while the work it stands for
/// still runs (what it holds then freed early).
pub(crate) fn refuse_per_thread(raw: sys::CUstream) -> Result<()> {
    if raw as usize == driver::stream::PER_THREAD {
        return Err(Error::invalid(
            "stream",
            "the per-thread default stream (CU_STREAM_PER_THREAD)",
            "another stream on every thread, where the library records its events; use a stream of its own",
        ));
    }
    Ok(())
}

/// What [`enqueue_with`] asks of the driver; tests answer it without a GPU.
pub(crate) trait Probe {
    /// Whether the stream is capturing.
    fn capturing(&self) -> Result<bool>;
    /// Make a capture the work may be part of produce no graph.
    fn invalidate(&self);
}

/// The driver's answers for a raw stream of the current context.
struct Driver {
    raw: sys::CUstream,
    /// Whether a capture found after queueing is invalidated (work) or left alone (an internal
    /// event record, which puts nothing into the graph).
    invalidate: bool,
}

impl Probe for Driver {
    #[inline]
    fn capturing(&self) -> Result<bool> {
        is_capturing(self.raw)
    }

    fn invalidate(&self) {
        if self.invalidate {
            // SAFETY: a live stream. Querying a capturing stream is illegal in capture: the
            // driver answers CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the capture.
            let _ = unsafe { driver::stream::query(self.raw) };
        }
    }
}

/// Queue work on `stream` through `f` (given the raw stream and `keep`, what the work may touch),
/// with the capture checks of the module docs. `call` names the C function for errors.
///
/// On success returns `f`'s value and `keep`. On refusal or failure returns the error and `keep`
/// back (`kept: Some`) when no work can be in a graph; when the stream was capturing after `f`
/// ran (or that could not be checked), `keep` and `f`'s value are leaked (`kept: None`).
#[inline]
pub(crate) fn enqueue<R, T>(
    stream: &CudaStream,
    call: &'static str,
    keep: R,
    f: impl FnOnce(sys::CUstream, &R) -> Result<T>,
) -> Result<(T, R), Refused<R>> {
    if let Err(error) = driver::ctx::bind(stream.context()) {
        return Err(Refused {
            error,
            kept: Some(keep),
        });
    }
    enqueue_raw(stream.cu_stream(), call, keep, f)
}

/// [`enqueue`] on a raw stream whose context is current.
#[inline]
pub(crate) fn enqueue_raw<R, T>(
    raw: sys::CUstream,
    call: &'static str,
    keep: R,
    f: impl FnOnce(sys::CUstream, &R) -> Result<T>,
) -> Result<(T, R), Refused<R>> {
    let probe = Driver {
        raw,
        invalidate: true,
    };
    enqueue_with(&probe, call, keep, |k| f(raw, k))
}

/// [`enqueue_raw`] for an event record of the library's own: checked like any work, but a
/// capture found after the record is left alone (an internal event puts nothing into the
/// user's graph).
pub(crate) fn enqueue_record<R, T>(
    raw: sys::CUstream,
    call: &'static str,
    keep: R,
    f: impl FnOnce(&R) -> Result<T>,
) -> Result<(T, R), Refused<R>> {
    let probe = Driver {
        raw,
        invalidate: false,
    };
    enqueue_with(&probe, call, keep, f)
}

/// The calling thread in `CU_STREAM_CAPTURE_MODE_RELAXED` while this lives; its mode before is
/// put back when dropped. A blocking call on a library-private stream made meanwhile (a
/// `cuStreamSynchronize`) is then neither refused nor invalidates a capture that another thread
/// began in global mode. (Leaked, the thread stays relaxed: less checking, nothing unsound.)
pub(crate) struct Relaxed(Option<sys::CUstreamCaptureMode>);

impl Relaxed {
    /// Relax the calling thread; `None` when the driver refuses (nothing changed).
    ///
    /// # Safety
    ///
    /// libcuda passed the crate's presence check (`cuda::init`).
    pub(crate) unsafe fn new() -> Option<Relaxed> {
        // SAFETY: the caller's.
        unsafe {
            driver::stream::exchange_capture_mode(
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            )
        }
        .ok()
        .map(|m| Relaxed(Some(m)))
    }
}

impl Drop for Relaxed {
    fn drop(&mut self) {
        if let Some(m) = self.0.take() {
            // SAFETY: `new` succeeded, so libcuda passed the presence check.
            let _ = unsafe { driver::stream::exchange_capture_mode(m) };
        }
    }
}

/// The answers for a [`PrivateStream`]: never capturing, so nothing to invalidate. Private to
/// this module: [`PrivateStream::enqueue`] is the only way to queue work with them.
struct Private;

impl Probe for Private {
    fn capturing(&self) -> Result<bool> {
        Ok(false)
    }

    fn invalidate(&self) {}
}

/// A stream the library created for itself and never hands out, which never waits on an event
/// of a stream it does not own: nobody can begin a capture on it, and a capture cannot spread to
/// it (a capture spreads only to a stream that waits on an event recorded in the capturing one).
/// Asking the driver would cost two calls per operation for an answer that is always "no", so
/// [`enqueue`](Self::enqueue) does not ask.
///
/// [`new`](Self::new) is the one way to make one, and it creates the stream itself: no stream a
/// user holds (a [`cuda::Stream`](crate::cuda::Stream), a cudarc [`CudaStream`], a raw
/// `CUstream`) can become one. Whoever holds it must keep the rule: never hand the stream (or
/// its raw handle) out, and never make it wait on an event of a stream the library does not own.
///
/// `S` is how it holds the stream: a cudarc [`CudaStream`] (the default: for a
/// [`Timeline`](super::Timeline) and a `cuda::Stream`) or a [`DriverStream`] (cudarc never sees
/// it: the bounce engine's lanes).
#[derive(Debug)]
pub(crate) struct PrivateStream<S: Owned = Arc<CudaStream>> {
    stream: S,
}

/// How a [`PrivateStream`] holds the stream it made.
pub(crate) trait Owned: Send + Sync + Sized + 'static {
    /// A new non-blocking stream on `ctx`.
    ///
    /// # Errors
    ///
    /// [`Error::Cuda`] from `cuStreamCreate` (or from making `ctx` current).
    fn create(ctx: &Arc<CudaContext>) -> Result<Self>;

    /// The raw handle.
    fn raw(&self) -> sys::CUstream;
}

impl Owned for Arc<CudaStream> {
    /// cudarc's `new_stream` (`CU_STREAM_NON_BLOCKING`).
    fn create(ctx: &Arc<CudaContext>) -> Result<Self> {
        ctx.new_stream()
            .map_err(|e| from_driver("cuStreamCreate", e))
    }

    fn raw(&self) -> sys::CUstream {
        self.cu_stream()
    }
}

/// A stream made with `cuStreamCreate(CU_STREAM_NON_BLOCKING)` directly, which cudarc does not
/// count among its context's streams. Destroyed when dropped (the driver finishes its queued work
/// first); leaked in a forked child or where its context cannot be made current.
#[derive(Debug)]
pub(crate) struct DriverStream {
    ctx: Arc<CudaContext>,
    raw: sys::CUstream,
    pid: u32,
}

// SAFETY: a driver handle, usable from any thread.
unsafe impl Send for DriverStream {}
// SAFETY: as above; `&self` only reads the handle.
unsafe impl Sync for DriverStream {}

impl Owned for DriverStream {
    fn create(ctx: &Arc<CudaContext>) -> Result<Self> {
        driver::ctx::bind(ctx)?;
        // SAFETY: the context is current.
        let raw = unsafe { driver::stream::create(sys::CUstream_flags::CU_STREAM_NON_BLOCKING) }?;
        Ok(DriverStream {
            ctx: ctx.clone(),
            raw,
            pid: std::process::id(),
        })
    }

    fn raw(&self) -> sys::CUstream {
        self.raw
    }
}

impl Drop for DriverStream {
    fn drop(&mut self) {
        if forked(self.pid) || driver::ctx::bind(&self.ctx).is_err() {
            return; // leak
        }
        // SAFETY: created by `create`, destroyed once; the driver finishes queued work first.
        let _ = unsafe { driver::stream::destroy(self.raw) };
    }
}

impl<S: Owned> PrivateStream<S> {
    /// A new private stream on `ctx`, created here.
    ///
    /// # Errors
    ///
    /// As [`Owned::create`].
    #[doc(alias = "cuStreamCreate")]
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        S::create(ctx).map(|stream| PrivateStream { stream })
    }

    /// The raw stream, for the library's own calls on it (never to be handed out).
    pub(crate) fn cu_stream(&self) -> sys::CUstream {
        self.stream.raw()
    }

    /// Whether the stream is capturing a graph: never (see the type), and the driver is not
    /// asked.
    pub(crate) fn is_capturing(&self) -> bool {
        false
    }

    /// [`enqueue_raw`] without the driver's questions: queue work through `f` (given the raw
    /// stream and `keep`) with the capture protocol's bookkeeping. The caller makes the stream's
    /// context current.
    pub(crate) fn enqueue<R, T>(
        &self,
        call: &'static str,
        keep: R,
        f: impl FnOnce(sys::CUstream, &R) -> Result<T>,
    ) -> Result<(T, R), Refused<R>> {
        let raw = self.cu_stream();
        enqueue_with(&Private, call, keep, |k| f(raw, k))
    }
}

impl PrivateStream {
    /// The cudarc stream.
    pub(crate) fn cuda(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

/// [`enqueue_with`] for tests, which answer the driver's questions themselves.
#[cfg(test)]
pub(crate) fn enqueue_probed<P: Probe, R, T>(
    probe: &P,
    call: &'static str,
    keep: R,
    f: impl FnOnce(&R) -> Result<T>,
) -> Result<(T, R), Refused<R>> {
    enqueue_with(probe, call, keep, f)
}

/// The capture protocol itself, over any [`Probe`]. Private: the crate queues work through
/// [`enqueue`], [`enqueue_raw`], [`enqueue_record`] (which ask the driver) or
/// [`PrivateStream::enqueue`] (the one path that does not).
#[inline]
fn enqueue_with<P: Probe, R, T>(
    probe: &P,
    call: &'static str,
    keep: R,
    f: impl FnOnce(&R) -> Result<T>,
) -> Result<(T, R), Refused<R>> {
    match probe.capturing() {
        Ok(false) => {}
        Ok(true) => {
            return Err(Refused {
                error: Error::StreamCapturing {
                    call,
                    enqueued: false,
                },
                kept: Some(keep),
            });
        }
        Err(error) => {
            return Err(Refused {
                error,
                kept: Some(keep),
            });
        }
    }
    let r = f(&keep);
    let after = probe.capturing();
    if matches!(after, Ok(false)) {
        return match r {
            Ok(t) => Ok((t, keep)),
            Err(error) => Err(Refused {
                error,
                kept: Some(keep),
            }),
        };
    }
    // The work may be in a graph that runs later, any number of times: nothing it touches may
    // ever be freed.
    probe.invalidate();
    std::mem::forget(keep);
    if let Ok(t) = r {
        std::mem::forget(t);
    }
    Err(Refused {
        error: match after {
            Err(e) => e,
            Ok(_) => Error::StreamCapturing {
                call,
                enqueued: true,
            },
        },
        kept: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completion::testing::Counted;
    use std::cell::{Cell, RefCell};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Answers from a script: one answer per `capturing` call.
    struct Script {
        answers: RefCell<Vec<Result<bool>>>,
        invalidated: Cell<usize>,
    }

    impl Script {
        fn new(answers: Vec<Result<bool>>) -> Self {
            Script {
                answers: RefCell::new(answers.into_iter().rev().collect()),
                invalidated: Cell::new(0),
            }
        }
    }

    impl Probe for Script {
        fn capturing(&self) -> Result<bool> {
            self.answers.borrow_mut().pop().expect("asked too often")
        }
        fn invalidate(&self) {
            self.invalidated.set(self.invalidated.get() + 1);
        }
    }

    fn err() -> Error {
        Error::invalid("test", 1, "scripted failure")
    }

    #[test]
    fn capturing_stream_is_refused_before_anything_is_queued() {
        let drops = Arc::new(AtomicUsize::new(0));
        let p = Script::new(vec![Ok(true)]);
        let ran = Cell::new(false);
        let r = enqueue_with(&p, "cuMemcpyAsync", Counted(drops.clone()), |_| {
            ran.set(true);
            Ok(())
        });
        let refused = r.expect_err("refused");
        assert!(matches!(
            refused.error,
            Error::StreamCapturing {
                call: "cuMemcpyAsync",
                enqueued: false
            }
        ));
        assert!(!ran.get(), "nothing queued");
        assert!(!refused.leaked());
        assert_eq!(p.invalidated.get(), 0, "the user's capture is left alone");
        drop(refused);
        assert_eq!(drops.load(Ordering::SeqCst), 1, "dropped normally");
    }

    #[test]
    fn capture_seen_after_queueing_leaks_and_invalidates() {
        let drops = Arc::new(AtomicUsize::new(0));
        let p = Script::new(vec![Ok(false), Ok(true)]);
        let made = Arc::new(AtomicUsize::new(0));
        let r = enqueue_with(&p, "cuLaunchHostFunc", Counted(drops.clone()), |_| {
            Ok(Counted(made.clone()))
        });
        let refused = r.expect_err("refused");
        assert!(matches!(
            refused.error,
            Error::StreamCapturing {
                call: "cuLaunchHostFunc",
                enqueued: true
            }
        ));
        assert!(refused.leaked());
        assert_eq!(p.invalidated.get(), 1);
        drop(refused);
        assert_eq!(
            drops.load(Ordering::SeqCst),
            0,
            "what the work uses is never freed"
        );
        assert_eq!(made.load(Ordering::SeqCst), 0, "nor what the call made");
        // The same when the queueing call itself failed: part of it may be in the graph.
        let p = Script::new(vec![Ok(false), Ok(true)]);
        let r = enqueue_with(&p, "x", Counted(drops.clone()), |_| Err::<(), _>(err()));
        assert!(r.err().unwrap().leaked());
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        // And when the second check cannot answer: leak, report the driver's error.
        let p = Script::new(vec![Ok(false), Err(err())]);
        let r = enqueue_with(&p, "x", Counted(drops.clone()), |_| Ok(()));
        let refused = r.err().unwrap();
        assert!(refused.leaked());
        assert!(matches!(refused.error, Error::InvalidArgument { .. }));
        assert_eq!(drops.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn failures_hand_the_resources_back() {
        let drops = Arc::new(AtomicUsize::new(0));
        // The first check cannot answer: nothing queued, resources back.
        let p = Script::new(vec![Err(err())]);
        let r = enqueue_with(&p, "x", Counted(drops.clone()), |_| Ok(()));
        let refused = r.err().unwrap();
        assert!(!refused.leaked());
        drop(refused);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        // The call fails on a stream that is not capturing: resources back.
        let p = Script::new(vec![Ok(false), Ok(false)]);
        let r = enqueue_with(&p, "x", Counted(drops.clone()), |_| Err::<(), _>(err()));
        let refused = r.err().unwrap();
        assert!(matches!(refused.error, Error::InvalidArgument { .. }));
        assert!(refused.kept.is_some());
        drop(refused);
        assert_eq!(drops.load(Ordering::SeqCst), 2);
        // Success: the value and the resources.
        let p = Script::new(vec![Ok(false), Ok(false)]);
        let (v, k) = enqueue_with(&p, "x", Counted(drops.clone()), |_| Ok(7))
            .ok()
            .unwrap();
        assert_eq!(v, 7);
        assert_eq!(p.invalidated.get(), 0);
        drop(k);
        assert_eq!(drops.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn a_private_stream_asks_nothing_and_invalidates_nothing() {
        // The protocol `PrivateStream::enqueue` runs: the work runs once and what it keeps comes
        // back, on success and on failure alike; nothing is ever leaked.
        let drops = Arc::new(AtomicUsize::new(0));
        let runs = Cell::new(0);
        let (v, k) = enqueue_with(&Private, "x", Counted(drops.clone()), |_| {
            runs.set(runs.get() + 1);
            Ok(7)
        })
        .ok()
        .unwrap();
        assert_eq!((v, runs.get()), (7, 1));
        drop(k);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        let refused = enqueue_with(&Private, "x", Counted(drops.clone()), |_| {
            Err::<(), _>(err())
        })
        .err()
        .unwrap();
        assert!(!refused.leaked());
        drop(refused);
        assert_eq!(drops.load(Ordering::SeqCst), 2);
    }

    /// Compiles only while `T` has no `From<S>`: with one, both impls below apply to `T` and
    /// the call naming `NoFrom<S, _>` is ambiguous (the `assert_not_impl_any` construction).
    trait NoFrom<S, A> {
        fn check() {}
    }
    impl<T, S> NoFrom<S, ()> for T {}
    struct IfFrom;
    impl<T: From<S>, S> NoFrom<S, IfFrom> for T {}

    #[test]
    fn no_stream_a_user_holds_becomes_a_private_one() {
        // `PrivateStream::new` creates the stream itself; nothing converts an existing one.
        <PrivateStream as NoFrom<Arc<CudaStream>, _>>::check();
        <PrivateStream as NoFrom<sys::CUstream, _>>::check();
        <PrivateStream as NoFrom<crate::cuda::Stream, _>>::check();
        <PrivateStream<DriverStream> as NoFrom<Arc<CudaStream>, _>>::check();
        <PrivateStream<DriverStream> as NoFrom<sys::CUstream, _>>::check();
        <PrivateStream<DriverStream> as NoFrom<crate::cuda::Stream, _>>::check();
        <DriverStream as NoFrom<sys::CUstream, _>>::check();
    }
}
