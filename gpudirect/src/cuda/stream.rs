//! Streams with a completion timeline, cross-stream events and host callbacks.

use crate::error::{Result, cu, from_driver};
use crate::memory::tracker::{Done, EventFence, HostFnFence, StreamFence, Timeline, Tracker};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, sys};
use std::sync::Arc;

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
    #[doc(alias = "cuStreamCreate")]
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        crate::cuda::init()?;
        let s = ctx
            .new_stream()
            .map_err(|e| from_driver("cuStreamCreate", e))?;
        Ok(Self::wrap(s))
    }

    /// Track work on an existing cudarc stream. Each `wrap` makes its own timeline: fences of
    /// two wrappers of one stream are both correct, they just do not share events.
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
    /// right after queueing their work and put it in an [`crate::memory::InFlight`].
    pub fn fence(&self) -> StreamFence {
        self.timeline.issue()
    }

    /// `cuEventRecord` now, as an [`EventFence`].
    #[doc(alias = "cuEventRecord")]
    pub fn event_fence(&self) -> Result<EventFence> {
        EventFence::record(self.cuda())
    }

    /// `cuStreamSynchronize`.
    #[doc(alias = "cuStreamSynchronize")]
    pub fn synchronize(&self) -> Result<()> {
        self.cuda()
            .synchronize()
            .map_err(|e| from_driver("cuStreamSynchronize", e))
    }

    /// `cuEventRecord` a new event on this stream, for other streams to [`wait`](Self::wait).
    #[doc(alias = "cuEventRecord")]
    pub fn record_event(&self) -> Result<CudaEvent> {
        self.cuda()
            .record_event(None)
            .map_err(|e| from_driver("cuEventRecord", e))
    }

    /// `cuStreamWaitEvent`: work queued here after this call starts only after `event`'s work.
    #[doc(alias = "cuStreamWaitEvent")]
    pub fn wait(&self, event: &CudaEvent) -> Result<()> {
        self.cuda()
            .wait(event)
            .map_err(|e| from_driver("cuStreamWaitEvent", e))
    }

    /// Order this stream after everything queued on `other` so far (record an event there, wait
    /// on it here).
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
    /// `f` itself (and whatever it captured) is not dropped in the callback: it is handed to the
    /// [`Tracker`] and dropped by a later [`Tracker::reap`] on an ordinary thread, so a capture
    /// that frees CUDA memory is safe.
    ///
    /// # Errors
    ///
    /// [`crate::Error::Cuda`] when the callback could not be queued (then `f` never runs).
    #[doc(alias = "cuLaunchHostFunc")]
    pub fn launch_host_fn<F>(&self, f: F) -> Result<HostFnFence>
    where
        F: Fn() + Send + Sync + 'static,
    {
        let fence = HostFnFence::new();
        let payload: Box<HostFnPayload> = Box::new(HostFnPayload {
            f: Box::new(f),
            fence: fence.clone(),
        });
        let raw = Box::into_raw(payload);
        crate::memory::bind(self.context())?;
        // SAFETY: `host_fn_trampoline` matches CUhostFn and takes ownership of `raw` exactly
        // once when it runs.
        let r = unsafe {
            sys::cuLaunchHostFunc(self.cu_stream(), Some(host_fn_trampoline), raw.cast())
        };
        if let Err(e) = cu("cuLaunchHostFunc", r) {
            // SAFETY: not queued, so the callback will never take it.
            drop(unsafe { Box::from_raw(raw) });
            return Err(e);
        }
        Ok(fence)
    }

    /// A [`HostFnFence`] for the work queued so far: a host callback that only sets a flag.
    pub fn host_fence(&self) -> Result<HostFnFence> {
        self.launch_host_fn(|| {})
    }
}

struct HostFnPayload {
    f: Box<dyn Fn() + Send + Sync>,
    fence: HostFnFence,
}

/// Runs in a driver thread: no CUDA calls and no frees of CUDA resources here.
unsafe extern "C" fn host_fn_trampoline(user: *mut std::ffi::c_void) {
    // SAFETY: `user` is the Box leaked by `launch_host_fn`, handed to us exactly once.
    let payload = unsafe { Box::from_raw(user.cast::<HostFnPayload>()) };
    let panicked = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (payload.f)())) {
        Ok(()) => false,
        Err(p) => {
            // Dropping the payload here could run a destructor that panics, and unwinding out
            // of this extern "C" function aborts: leak it (the fence records the panic).
            std::mem::forget(p);
            true
        }
    };
    let fence = payload.fence.clone();
    // Whatever `f` captured is dropped by `Tracker::reap` on an ordinary thread. The boxes
    // themselves are plain heap memory.
    Tracker::global().park(Done, payload);
    fence.complete(panicked);
}

impl From<Arc<CudaStream>> for Stream {
    fn from(s: Arc<CudaStream>) -> Self {
        Stream::wrap(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        }));
        // SAFETY: a leaked payload box, handed over once, as cuLaunchHostFunc would. Dropping
        // the payload in there would abort the test process (a panic out of extern "C").
        unsafe { host_fn_trampoline(raw.cast()) };
        assert!(crate::memory::Fence::is_complete(&fence));
        assert!(fence.panicked());
    }

    #[test]
    fn streams_are_send_and_sync() {
        fn is<T: Send + Sync>() {}
        is::<Stream>();
        is::<HostFnFence>();
        is::<StreamFence>();
    }
}
