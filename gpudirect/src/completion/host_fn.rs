//! [`HostFnFence`]: set by a host callback.

use super::fence::{CompletionFlag, Fence};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Waker;

/// A fence set by a host callback (`cuLaunchHostFunc`) once the stream reaches it, made by
/// [`crate::cuda::Stream::launch_host_fn`] or [`crate::cuda::Stream::host_fence`].
///
/// Awaited, it is its own wake-up source: the callback wakes the future's waker (by reference,
/// on CUDA's host-function thread, with no CUDA call) the moment the stream passes it. If the
/// stream fails before reaching the callback (a sticky error), the callback never runs and
/// nothing wakes the future: give such awaits a deadline.
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

    fn register_waker(&self, waker: &Waker) -> bool {
        self.flag.register_waker(waker)
    }
}
