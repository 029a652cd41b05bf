//! Completion: what every asynchronous path of the crate rests on.
//!
//! An asynchronous operation returns an [`InFlight`] that owns everything the operation may still
//! touch. [`InFlight::wait`] gives the resources back once its [`Fence`] reports completion.
//! Dropping an `InFlight` waits a bounded time ([`DROP_WAIT`]); if completion still cannot be
//! proven the resources are parked in the process-wide [`Tracker`] and freed by a later
//! [`Tracker::reap`] after the fence completes, or never. `mem::forget` of an `InFlight` leaks
//! the resources, which is safe. One tracker serves CUDA work, cuFile and verbs.
//!
//! Fences:
//! - [`StreamFence`] (from [`crate::cuda::Stream::fence`]): amortised per-stream epochs of a
//!   [`Timeline`]. Issuing costs one atomic increment; a CUDA event is recorded only when someone
//!   asks whether the work is done, and one event answers for every earlier epoch of that stream.
//! - [`EventFence`]: one CUDA event recorded now (`cuEventRecord`), polled with `cuEventQuery`.
//! - [`HostFnFence`]: a host callback (`cuLaunchHostFunc`) that sets a [`CompletionFlag`]; the
//!   callback makes no CUDA calls and frees nothing (what it owned is freed by [`Tracker::reap`]).
//! - [`CompletionFlag`]: set by whoever observes completion (a polled work completion, an I/O
//!   thread); [`Done`]: complete from the start.
//!
//! Work is queued on a CUDA stream only through the graph-capture check of this module (a
//! capturing stream is refused, see [`crate::cuda`]), so that a fence never completes before the
//! work it stands for.
//!
//! Fork safety: the tracker records the pid that created it; in a forked child an `InFlight`
//! dropped or reaped leaks what it owns (no driver calls, no frees).

mod backoff;
pub(crate) mod capture;
mod event_fence;
#[cfg(feature = "tokio")]
pub(crate) mod fd;
mod fence;
mod future;
mod host_fn;
mod in_flight;
#[cfg(test)]
mod proptests;
mod signal;
pub(crate) mod thread;
mod timeline;
mod tracker;

pub use event_fence::EventFence;
pub use fence::{CompletionFlag, Done, Fence, Outcome, OutcomeSender};
pub use future::InFlightFuture;
pub use host_fn::HostFnFence;
pub use in_flight::{DROP_WAIT, InFlight};
pub use timeline::{StreamFence, Timeline};
pub use tracker::Tracker;

pub(crate) use tracker::forked;

pub(crate) use backoff::{LONG_WAIT, poll_until};

/// Fixtures shared by the tests of this module's files.
#[cfg(test)]
pub(crate) mod testing {
    use super::Fence;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts its drops.
    #[derive(Debug)]
    pub(crate) struct Counted(pub(crate) Arc<AtomicUsize>);

    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A waker that counts its wakes.
    #[derive(Default)]
    pub(crate) struct CountWakes(pub(crate) AtomicUsize);

    impl std::task::Wake for CountWakes {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A user's fence whose poll panics.
    pub(crate) struct Panics;

    impl Fence for Panics {
        fn is_complete(&self) -> bool {
            panic!("user fence panics while polled")
        }
    }
}
