//! Fixtures shared by the tests of this module's files.

use super::fence::Fence;
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

/// A waker that counts the wakes in which `free` held: whether the locks a waker calling
/// back into the library would take were free.
#[cfg(feature = "rdma")]
pub(crate) struct WokenFree<F>(F, AtomicUsize);

#[cfg(feature = "rdma")]
impl<F: Fn() -> bool + Send + Sync + 'static> WokenFree<F> {
    pub(crate) fn new(free: F) -> Arc<Self> {
        Arc::new(WokenFree(free, AtomicUsize::new(0)))
    }

    /// Wakes in which the locks were free.
    pub(crate) fn count(&self) -> usize {
        self.1.load(Ordering::SeqCst)
    }
}

#[cfg(feature = "rdma")]
impl<F: Fn() -> bool + Send + Sync + 'static> std::task::Wake for WokenFree<F> {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        if (self.0)() {
            self.1.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Wait until `f` holds, checking every 100 µs; fail the test naming `what` after 10 s.
pub(crate) fn until(what: &str, f: impl Fn() -> bool) {
    let t = std::time::Instant::now();
    while !f() {
        assert!(t.elapsed() < std::time::Duration::from_secs(10), "{what}");
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
}

/// A user's fence whose poll panics.
pub(crate) struct Panics;

impl Fence for Panics {
    fn is_complete(&self) -> bool {
        panic!("user fence panics while polled")
    }
}
