//! [`HostFnFence`]: set by a host callback.

use super::fence::{CompletionFlag, Fence};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

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
