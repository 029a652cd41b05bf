//! The one completion tracker: CUDA events and host callbacks, cuFile, and verbs work completions.
//!
//! An asynchronous operation returns an [`InFlight`] that owns everything the operation may still
//! touch. [`InFlight::wait`] gives the resources back once its [`Fence`] reports completion.
//! Dropping an `InFlight` waits a bounded time; if completion still cannot be proven the resources
//! are parked in the process-wide [`Tracker`] and freed by a later [`Tracker::reap`] after the fence
//! completes, or never. `mem::forget` of an `InFlight` leaks the resources, which is safe.

use crate::error::{Error, Result};
use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a drop waits for completion before parking what it owns.
pub const DROP_WAIT: Duration = Duration::from_secs(5);

/// Something that can tell whether an operation has finished.
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
    pid: u32,
}

impl Tracker {
    /// The process-wide tracker.
    pub fn global() -> &'static Tracker {
        static T: OnceLock<Tracker> = OnceLock::new();
        T.get_or_init(|| Tracker {
            parked: Mutex::new(Vec::new()),
            pid: std::process::id(),
        })
    }

    /// Keep `resources` until `fence` completes and a later [`reap`](Self::reap) sees it.
    pub fn park<F: Fence, R: Send + 'static>(&self, fence: F, resources: R) {
        self.lock().push((Box::new(fence), Box::new(resources)));
    }

    /// Drop parked resources whose fence has completed; returns how many were released. In a
    /// forked child nothing is released (no FFI frees after fork).
    pub fn reap(&self) -> usize {
        if std::process::id() != self.pid {
            return 0;
        }
        let done: Vec<Parked> = {
            let mut g = self.lock();
            let (done, keep): (Vec<_>, Vec<_>) = g.drain(..).partition(|(f, _)| f.is_complete());
            *g = keep;
            done
        };
        // Dropped outside the lock: resources' destructors may call into CUDA or verbs.
        let n = done.len();
        drop(done);
        n
    }

    /// How many entries are parked.
    pub fn parked(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Parked>> {
        self.parked.lock().unwrap_or_else(|e| e.into_inner())
    }
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

    /// Wait for completion and take the resources back.
    pub fn wait(self) -> Result<R> {
        // Duration::MAX never runs out; if it did, dropping the op parks it.
        self.wait_timeout(Duration::MAX).map_err(|(e, _op)| e)
    }

    /// Wait up to `timeout`; on time-out the operation stays in flight and is handed back in
    /// `Err`, never freed.
    pub fn wait_timeout(mut self, timeout: Duration) -> Result<R, (Error, Self)> {
        let ok = self.fence.as_ref().is_none_or(|f| f.wait_timeout(timeout));
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

    /// The resources, if the operation has completed; otherwise `Err(self)`.
    pub fn try_take(mut self) -> Result<R, Self> {
        if self.is_complete() {
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

impl<R: Send + 'static, F: Fence> Drop for InFlight<R, F> {
    fn drop(&mut self) {
        let (Some(fence), Some(res)) = (self.fence.take(), self.resources.take()) else {
            return;
        };
        if fence.wait_timeout(DROP_WAIT) {
            drop(res);
        } else {
            Tracker::global().park(fence, res);
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
    fn forget_leaks_never_frees() {
        let drops = Arc::new(AtomicUsize::new(0));
        let op = InFlight::new("forgotten", CompletionFlag::new(), Counted(drops.clone()));
        std::mem::forget(op);
        assert_eq!(drops.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn parked_resources_freed_by_reap_after_completion() {
        let t = Tracker {
            parked: Mutex::new(Vec::new()),
            pid: std::process::id(),
        };
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
