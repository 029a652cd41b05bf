//! The [`Fence`] trait and the fences that need no driver: [`CompletionFlag`] and [`Done`].

use super::backoff::poll_until;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Something that can tell whether an operation has finished.
///
/// The trait is open: implement it for your own completion sources. The library calls your code
/// while it decides whether to free what an operation owns, so a panic there is caught and taken
/// as "never complete": the resources that fence guards are leaked (never freed), and nothing
/// else the tracker holds is affected. An [`InFlight`](super::InFlight) whose fence panicked in
/// [`InFlight::wait`](super::InFlight::wait), [`InFlight::wait_timeout`](super::InFlight::wait_timeout) or [`InFlight::try_take`](super::InFlight::try_take) passes the panic on
/// after leaking its resources.
pub trait Fence: Send + Sync + 'static {
    /// Whether completion has been observed. Must not block.
    fn is_complete(&self) -> bool;

    /// Wait up to `timeout` for completion; `true` once complete. The default polls
    /// [`is_complete`](Fence::is_complete) with back-off: yielding at first, then sleeping up to
    /// 1 ms between polls.
    fn wait_timeout(&self, timeout: Duration) -> bool {
        poll_until(|| self.is_complete(), timeout)
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

impl Fence for Box<dyn Fence> {
    fn is_complete(&self) -> bool {
        (**self).is_complete()
    }
    fn wait_timeout(&self, timeout: Duration) -> bool {
        (**self).wait_timeout(timeout)
    }
}
