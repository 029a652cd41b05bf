//! [`Signal`]: a completion bit and the wakers of the futures waiting on it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::task::Waker;

/// Set once by whoever observes completion; wakes the futures that registered a waker.
///
/// Setting wakes every kept waker by reference and drops none: a signal may be set on CUDA's
/// host-function thread, where a waker's drop (possibly the last reference to a task, whose
/// destructor could call CUDA) must not run. Kept wakers are dropped with the signal, on the
/// thread that drops its last owner.
#[derive(Debug, Default)]
pub(crate) struct Signal {
    done: AtomicBool,
    wakers: Mutex<Vec<Waker>>,
}

impl Signal {
    /// Whether it is set (Acquire: what the setter wrote before setting is visible).
    pub(crate) fn is_set(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Set it and wake every kept waker (by reference). A waker that panics is ignored (its
    /// payload leaked, never dropped here).
    pub(crate) fn set(&self) {
        self.mark();
        self.wake();
    }

    /// Set it without waking anyone yet: [`wake`](Self::wake) follows, once the caller let its
    /// own locks go (a waker may call back into the code that holds them).
    pub(crate) fn mark(&self) {
        self.done.store(true, Ordering::Release);
    }

    /// Wake every kept waker (by reference), after [`mark`](Self::mark).
    pub(crate) fn wake(&self) {
        // Taking the lock after the store: a registration either happened before (its waker is
        // woken here) or sees `done` when it re-checks (the lock orders the two).
        let wakers = self.lock();
        for w in wakers.iter() {
            if let Err(p) =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.wake_by_ref()))
            {
                std::mem::forget(p);
            }
        }
    }

    /// Keep `waker` until the signal is dropped, unless it is set already (the caller re-checks
    /// after registering) or a kept waker wakes the same task.
    pub(crate) fn register(&self, waker: &Waker) {
        let mut wakers = self.lock();
        if self.done.load(Ordering::Acquire) || wakers.iter().any(|w| w.will_wake(waker)) {
            return;
        }
        wakers.push(waker.clone());
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Waker>> {
        self.wakers.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completion::testing::CountWakes;
    use std::sync::Arc;
    use std::task::Wake;

    #[test]
    fn set_wakes_each_task_once_and_keeps_the_wakers() {
        let s = Signal::default();
        let a = Arc::new(CountWakes::default());
        let b = Arc::new(CountWakes::default());
        let wa = Waker::from(a.clone());
        s.register(&wa);
        s.register(&wa.clone()); // the same task: kept once
        s.register(&Waker::from(b.clone()));
        assert_eq!(Arc::strong_count(&a), 3, "ours, `wa` and the signal's");
        s.set();
        assert!(s.is_set());
        assert_eq!(a.0.load(Ordering::SeqCst), 1);
        assert_eq!(b.0.load(Ordering::SeqCst), 1);
        assert_eq!(
            Arc::strong_count(&a),
            3,
            "woken by reference: not dropped by set"
        );
        // Registering after the set keeps nothing.
        let c = Arc::new(CountWakes::default());
        s.register(&Waker::from(c.clone()));
        assert_eq!(Arc::strong_count(&c), 1);
        drop(s);
        assert_eq!(Arc::strong_count(&a), 2, "dropped with the signal");
    }

    #[test]
    fn a_panicking_waker_is_contained() {
        struct Panics;
        impl Wake for Panics {
            fn wake(self: Arc<Self>) {
                panic!("waker panics")
            }
            fn wake_by_ref(self: &Arc<Self>) {
                panic!("waker panics")
            }
        }
        let s = Signal::default();
        let ok = Arc::new(CountWakes::default());
        s.register(&Waker::from(Arc::new(Panics)));
        s.register(&Waker::from(ok.clone()));
        s.set();
        assert_eq!(ok.0.load(Ordering::SeqCst), 1, "later wakers still woken");
    }
}
