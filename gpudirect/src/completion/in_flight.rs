//! [`InFlight`]: an operation that owns what it may still touch until its fence completes.

use super::fence::{Fence, Outcome};
use super::tracker::{Tracker, poll_caught};
use crate::error::{Error, Result};
use std::time::Duration;

/// How long a drop waits for completion before parking what it owns.
pub const DROP_WAIT: Duration = Duration::from_secs(5);

/// An operation in flight, owning what it may still touch until its fence completes.
#[must_use = "dropping an InFlight blocks until the operation completes (bounded), then parks its resources"]
pub struct InFlight<R: Send + 'static, F: Fence = Box<dyn Fence>> {
    fence: Option<F>,
    resources: Option<R>,
    what: &'static str,
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

    /// Wait for completion and take the resources back. Also reaps the [`Tracker`].
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when the fence can never prove completion (a [`StreamFence`](super::StreamFence) or
    /// [`EventFence`](super::EventFence) whose synchronization failed: a sticky error); the resources are then
    /// parked in the [`Tracker`], never freed early.
    pub fn wait(mut self) -> Result<R> {
        Tracker::global().reap();
        // Duration::MAX never runs out; the wait ends early only when the fence cannot prove
        // completion, and then dropping the op parks it. (Taken in place: a small copy's wait
        // should not move the operation around.)
        if self.poll(|f| f.wait_timeout(Duration::MAX)) {
            return Ok(self.take_resources());
        }
        Err(Error::Timeout {
            what: self.what,
            after: Duration::MAX,
        })
    }

    /// Wait up to `timeout`; on time-out the operation stays in flight and is handed back in
    /// `Err`, never freed.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] with the operation when completion was not seen within `timeout` (or
    /// cannot be proven: a fence whose synchronization failed).
    ///
    /// # Panics
    ///
    /// When the fence's own code panics (a user's [`Fence`]); the resources are then leaked.
    pub fn wait_timeout(mut self, timeout: Duration) -> Result<R, (Error, Self)> {
        let ok = self.poll(|f| f.wait_timeout(timeout));
        if ok {
            Ok(self.take_resources())
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

    /// Wait without a time limit, but give up when `failed` reports an error (it is asked after
    /// every `slice` of waiting, e.g. `cuStreamQuery` on the stream a host callback waits on,
    /// whose callback never runs once the stream has failed). Giving up parks the operation in the
    /// [`Tracker`] (its resources are never freed early) and returns that error.
    #[cfg(any(test, feature = "storage"))]
    pub(crate) fn wait_unless(
        mut self,
        slice: Duration,
        failed: impl Fn() -> Result<()>,
    ) -> Result<R> {
        Tracker::global().reap();
        loop {
            match self.wait_timeout(slice) {
                Ok(r) => return Ok(r),
                Err((_, op)) => self = op,
            }
            if let Err(e) = failed() {
                return match self.try_take() {
                    Ok(r) => Ok(r),
                    Err(mut op) => {
                        if let (Some(f), Some(r)) = (op.fence.take(), op.resources.take()) {
                            if Tracker::global().in_forked_child() {
                                std::mem::forget(f);
                                std::mem::forget(r);
                            } else {
                                Tracker::global().park(f, r);
                            }
                        }
                        Err(e)
                    }
                };
            }
        }
    }

    /// The resources, if the operation has completed; otherwise `Err(self)`.
    ///
    /// # Errors
    ///
    /// The operation itself, still in flight, when its fence does not report completion yet.
    ///
    /// # Panics
    ///
    /// As [`wait_timeout`](Self::wait_timeout).
    pub fn try_take(mut self) -> Result<R, Self> {
        if self.poll(Fence::is_complete) {
            Ok(self.take_resources())
        } else {
            Err(self)
        }
    }
}

impl<R: Send + 'static, T: Send + 'static> InFlight<R, Outcome<T>> {
    /// Wait for completion; the resources and the operation's result (what the
    /// [`OutcomeSender`](super::OutcomeSender) sent). Also reaps the [`Tracker`].
    ///
    /// # Errors
    ///
    /// As [`wait`](Self::wait).
    pub fn wait_outcome(mut self) -> Result<(R, T)> {
        Tracker::global().reap();
        if !self.poll(|f| f.wait_timeout(Duration::MAX)) {
            return Err(Error::Timeout {
                what: self.what,
                after: Duration::MAX,
            });
        }
        let fence = self.fence.take().expect("fence present until taken");
        let r = self
            .resources
            .take()
            .expect("resources present until taken");
        let value = fence
            .take()
            .expect("an outcome completes only once its value is stored, and is taken once");
        Ok((r, value))
    }
}

impl<R: Send + 'static, F: Fence> InFlight<R, F> {
    /// The name, the fence and the resources, leaving nothing for `Drop` (for the future).
    pub(super) fn into_parts(mut self) -> (&'static str, F, R) {
        let fence = self.fence.take().expect("fence present until taken");
        let r = self
            .resources
            .take()
            .expect("resources present until taken");
        (self.what, fence, r)
    }

    /// The resources of a completed operation (its fence is dropped first), leaving nothing for
    /// `Drop`.
    fn take_resources(&mut self) -> R {
        self.fence = None;
        self.resources
            .take()
            .expect("resources present until taken")
    }

    /// Ask the fence (`true` when there is none left). If its code panics, the fence and the
    /// resources are leaked (nothing can prove the work done) and the panic goes on.
    fn poll(&mut self, ask: impl FnOnce(&F) -> bool) -> bool {
        let Some(f) = self.fence.as_ref() else {
            return true;
        };
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ask(f))) {
            Ok(done) => done,
            Err(panic) => {
                std::mem::forget(self.fence.take());
                std::mem::forget(self.resources.take());
                std::panic::resume_unwind(panic)
            }
        }
    }
}

impl<R: Send + 'static, F: Fence> Drop for InFlight<R, F> {
    #[inline]
    fn drop(&mut self) {
        // A waited-for operation has nothing left: the common case, kept to one check.
        if self.resources.is_some() {
            self.drop_in_flight();
        }
    }
}

impl<R: Send + 'static, F: Fence> InFlight<R, F> {
    /// Dropped while in flight: wait a bounded time, then park what is not proven done.
    #[cold]
    fn drop_in_flight(&mut self) {
        let (Some(fence), Some(res)) = (self.fence.take(), self.resources.take()) else {
            return;
        };
        if Tracker::global().in_forked_child() {
            // No driver calls and no frees in a forked child: leak both.
            std::mem::forget(fence);
            std::mem::forget(res);
            return;
        }
        match poll_caught(|| fence.wait_timeout(DROP_WAIT)) {
            Some(true) => drop(res),
            Some(false) => Tracker::global().park(fence, res),
            None => {
                // The fence panicked: it proves nothing, now or later. Leak both.
                std::mem::forget(fence);
                std::mem::forget(res);
            }
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
    use crate::completion::testing::{Counted, Panics};
    use crate::completion::{CompletionFlag, Done};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

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
    fn wait_unless_gives_up_on_error_and_parks() {
        let flag = CompletionFlag::new();
        let drops = Arc::new(AtomicUsize::new(0));
        let op = InFlight::new("never completes", flag.clone(), Counted(drops.clone()));
        let asked = AtomicUsize::new(0);
        let e = op
            .wait_unless(Duration::from_millis(1), || {
                if asked.fetch_add(1, Ordering::SeqCst) < 2 {
                    Ok(())
                } else {
                    Err(Error::invalid("stream", "failed", "test"))
                }
            })
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { arg: "stream", .. }));
        assert_eq!(asked.load(Ordering::SeqCst), 3);
        assert_eq!(drops.load(Ordering::SeqCst), 0, "parked, not freed");
        // Parked: freed by a reap once the fence completes.
        flag.set();
        while drops.load(Ordering::SeqCst) == 0 {
            Tracker::global().reap();
        }
        // Completed before the error check: the resources come back.
        let flag = CompletionFlag::new();
        flag.set();
        let op = InFlight::new("done", flag, 7u32);
        assert_eq!(
            op.wait_unless(Duration::from_millis(1), || Ok(())).unwrap(),
            7
        );
    }

    /// Never proves completion through a wait; complete once `done` is set.
    struct Unprovable(Arc<std::sync::atomic::AtomicBool>);

    impl Fence for Unprovable {
        fn is_complete(&self) -> bool {
            self.0.load(Ordering::SeqCst)
        }
        fn wait_timeout(&self, _: Duration) -> bool {
            false
        }
    }

    #[test]
    fn a_wait_that_cannot_prove_completion_parks_and_names_the_op() {
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let drops = Arc::new(AtomicUsize::new(0));
        let op = InFlight::new(
            "unprovable",
            Unprovable(done.clone()),
            Counted(drops.clone()),
        );
        let e = op.wait().unwrap_err();
        assert!(matches!(
            e,
            Error::Timeout {
                what: "unprovable",
                after: Duration::MAX
            }
        ));
        assert_eq!(drops.load(Ordering::SeqCst), 0, "parked, not freed");
        done.store(true, Ordering::SeqCst);
        while drops.load(Ordering::SeqCst) == 0 {
            Tracker::global().reap();
        }
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
    fn in_flight_dropped_in_a_forked_child_leaks() {
        let _ = Tracker::global(); // created in the parent, as crate::cuda::init does
        let drops = Arc::new(AtomicUsize::new(0));
        let op = InFlight::new("fork test", Done, Counted(drops.clone()));
        // SAFETY: the child only drops `op` (no locks, no allocation on the leak path) and
        // calls `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            drop(op);
            let code = if drops.load(Ordering::SeqCst) == 0 {
                0
            } else {
                1
            };
            // SAFETY: ends the child without running the parent's exit handlers.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(r, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "child freed"
        );
        drop(op); // the parent frees normally
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_panicking_fence_frees_nothing_through_in_flight() {
        let drops = Arc::new(AtomicUsize::new(0));
        // Dropped: the panic is caught, the resources leak.
        drop(InFlight::new("panics", Panics, Counted(drops.clone())));
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        // Waited on: the panic reaches the caller, the resources leak.
        for how in 0..3 {
            let op = InFlight::new("panics", Panics, Counted(drops.clone()));
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match how {
                0 => drop(op.wait_timeout(Duration::from_millis(1))),
                1 => drop(op.try_take()),
                _ => drop(op.wait()),
            }));
            assert!(r.is_err(), "the fence's panic goes on to the caller");
            assert_eq!(drops.load(Ordering::SeqCst), 0);
        }
        // A `Box<dyn Fence>` that panics behaves the same.
        let boxed: Box<dyn Fence> = Box::new(Panics);
        drop(InFlight::new("boxed", boxed, Counted(drops.clone())));
        assert_eq!(drops.load(Ordering::SeqCst), 0);
    }
}
