//! The one place where gpudirect queues work on a CUDA stream, and its graph-capture check.
//!
//! Work queued on a stream that is capturing a CUDA graph does not run now: it runs when the
//! graph is launched, and again at every launch. A fence taken after it (an event, a host
//! callback) completes when the capture ends, long before any launch, so the library would hand
//! back or free memory the graph still uses. Every path that queues work on a stream therefore
//! goes through [`enqueue`] (or [`enqueue_raw`] for private streams), which:
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

use crate::driver;
use crate::error::{Error, Result};
use cudarc::driver::{CudaStream, sys};

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
/// # Errors
///
/// [`Error::Cuda`] naming `cuStreamIsCapturing` (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` for the
/// legacy default stream while a blocking stream captures).
pub(crate) fn is_capturing(raw: sys::CUstream) -> Result<bool> {
    // SAFETY: a live stream handle (or the legacy stream) whose context the caller made current.
    unsafe { driver::stream::is_capturing(raw) }
}

/// What [`enqueue_with`] asks of the driver; tests answer it without a GPU.
pub(crate) trait Probe {
    /// Whether the stream is capturing.
    fn capturing(&self) -> Result<bool>;
    /// Make a capture the work may be part of produce no graph.
    fn invalidate(&self);
}

/// The driver's answers for a raw stream of the current context.
pub(crate) struct Driver {
    pub(crate) raw: sys::CUstream,
    /// Whether a capture found after queueing is invalidated (work) or left alone (an internal
    /// event record, which puts nothing into the graph).
    pub(crate) invalidate: bool,
}

impl Probe for Driver {
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

/// The calling thread in `CU_STREAM_CAPTURE_MODE_RELAXED` while this lives; its mode before is
/// put back when dropped. A blocking call on a library-private stream made meanwhile (a
/// `cuStreamSynchronize`) is then neither refused nor invalidates a capture that another thread
/// began in global mode. (Leaked, the thread stays relaxed: less checking, nothing unsound.)
#[cfg(any(feature = "storage", feature = "p2p"))]
pub(crate) struct Relaxed(Option<sys::CUstreamCaptureMode>);

#[cfg(any(feature = "storage", feature = "p2p"))]
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

#[cfg(any(feature = "storage", feature = "p2p"))]
impl Drop for Relaxed {
    fn drop(&mut self) {
        if let Some(m) = self.0.take() {
            // SAFETY: `new` succeeded, so libcuda passed the presence check.
            let _ = unsafe { driver::stream::exchange_capture_mode(m) };
        }
    }
}

/// A stream the library created for itself and never hands out, which never waits on an event
/// of a stream it does not own: nobody can begin a capture on it, and a capture cannot spread to
/// it (a capture spreads only to a stream that waits on an event recorded in the capturing one).
/// Asking the driver would cost two calls per operation for an answer that is always "no".
pub(crate) struct Private;

impl Probe for Private {
    fn capturing(&self) -> Result<bool> {
        Ok(false)
    }

    fn invalidate(&self) {}
}

/// [`enqueue_raw`] on a [`Private`] stream (the bounce engine's lanes): the protocol without
/// the driver's questions. Use it only for streams that meet [`Private`]'s rule.
pub(crate) fn enqueue_private<R, T>(
    raw: sys::CUstream,
    call: &'static str,
    keep: R,
    f: impl FnOnce(sys::CUstream, &R) -> Result<T>,
) -> Result<(T, R), Refused<R>> {
    enqueue_with(&Private, call, keep, |k| f(raw, k))
}

/// The capture protocol itself, over any [`Probe`].
#[inline]
pub(crate) fn enqueue_with<P: Probe, R, T>(
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
    use std::sync::Arc;
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
}
