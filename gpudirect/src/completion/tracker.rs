//! The process-wide [`Tracker`]: what could not be proven complete when its owner let go.

use super::fence::Fence;
use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

type Parked = (Box<dyn Fence>, Box<dyn Any + Send>);

/// Resources whose operations could not be proven complete when their owner let go.
pub struct Tracker {
    parked: Mutex<Vec<Parked>>,
    count: AtomicUsize,
    pid: u32,
}

impl Tracker {
    /// The process-wide tracker.
    #[inline]
    pub fn global() -> &'static Tracker {
        static T: OnceLock<Tracker> = OnceLock::new();
        T.get_or_init(Tracker::new)
    }

    fn new() -> Tracker {
        Tracker {
            parked: Mutex::new(Vec::new()),
            count: AtomicUsize::new(0),
            pid: std::process::id(),
        }
    }

    /// Whether this is a forked child of the process that created the tracker.
    pub fn in_forked_child(&self) -> bool {
        forked(self.pid)
    }

    /// Keep `resources` until `fence` completes and a later [`reap`](Self::reap) sees it.
    pub fn park<F: Fence, R: Send + 'static>(&self, fence: F, resources: R) {
        let entry: Parked = (Box::new(fence), Box::new(resources));
        self.count.fetch_add(1, Ordering::AcqRel);
        self.lock().push(entry);
    }

    /// Drop parked resources whose fence has completed; returns how many were released. In a
    /// forked child nothing is released (no FFI frees after fork). On one of the crate's threads
    /// that free nothing (a stream proxy's, an endpoint's progress thread: a waker may run code
    /// there that reaps), they are dropped on another thread of the crate's.
    ///
    /// Fences are polled outside the lock (polling may call the driver), so a host callback
    /// parking what it owned never waits behind a driver call. A fence whose poll panics (a
    /// user's [`Fence`] implementation) is taken as never complete: its entry is leaked, never
    /// freed, and every other entry is kept or released as its own fence says.
    #[inline]
    pub fn reap(&self) -> usize {
        // The count first: asking for the pid is a system call, on every wait.
        if self.count.load(Ordering::Acquire) == 0 {
            return 0;
        }
        self.reap_parked()
    }

    #[cold]
    fn reap_parked(&self) -> usize {
        if self.in_forked_child() {
            return 0;
        }
        let taken = std::mem::take(&mut *self.lock());
        let mut done = Vec::new();
        let mut keep = Vec::with_capacity(taken.len());
        let mut leaked = 0;
        for entry in taken {
            match poll_caught(|| entry.0.is_complete()) {
                Some(true) => done.push(entry),
                Some(false) => keep.push(entry),
                None => {
                    leaked += 1;
                    std::mem::forget(entry);
                }
            }
        }
        self.lock().extend(keep);
        let n = done.len();
        self.count.fetch_sub(n + leaked, Ordering::AcqRel);
        // Dropped outside the lock: resources' destructors may call into CUDA or verbs.
        if !done.is_empty() {
            super::elsewhere::drop_freely(done);
        }
        n
    }

    /// How many entries are parked (including any a concurrent [`reap`](Self::reap) is
    /// examining).
    pub fn parked(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Parked>> {
        self.parked.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Whether this process is not the one with id `pid` (a forked child of it): then nothing that
/// process made may be freed through a driver (the child's CUDA, cuFile and verbs state is
/// unusable), so it is leaked instead.
pub(crate) fn forked(pid: u32) -> bool {
    std::process::id() != pid
}

/// Run `poll` (a user's fence code), catching a panic: `None` when it panicked. A fence that
/// panics can prove nothing, so its resources are leaked, never freed.
pub(super) fn poll_caught<T>(poll: impl FnOnce() -> T) -> Option<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(poll)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completion::testing::{Counted, Panics};
    use crate::completion::{CompletionFlag, Done};
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    /// A fence that parks something in the global tracker when polled (as a host callback
    /// finishing during a reap would).
    struct ParksWhenPolled(Arc<AtomicBool>);
    impl Fence for ParksWhenPolled {
        fn is_complete(&self) -> bool {
            if !self.0.swap(true, Ordering::SeqCst) {
                Tracker::global().park(Done, ());
            }
            true
        }
    }

    #[test]
    fn reap_polls_fences_outside_the_lock() {
        let t = Tracker::global();
        let drops = Arc::new(AtomicUsize::new(0));
        t.park(
            ParksWhenPolled(Arc::new(AtomicBool::new(false))),
            Counted(drops.clone()),
        );
        // Would deadlock if fences were polled under the tracker's lock.
        while drops.load(Ordering::SeqCst) == 0 {
            t.reap();
        }
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_panicking_fence_frees_nothing_early_in_reap() {
        let t = Tracker::new();
        let drops = Arc::new(AtomicUsize::new(0));
        let pending = CompletionFlag::new();
        let done = CompletionFlag::new();
        done.set();
        // Entries before and after the panicking one, complete and not.
        t.park(done.clone(), Counted(drops.clone()));
        t.park(pending.clone(), Counted(drops.clone()));
        t.park(Panics, Counted(drops.clone()));
        t.park(pending.clone(), Counted(drops.clone()));
        t.park(done.clone(), Counted(drops.clone()));
        assert_eq!(t.parked(), 5);
        assert_eq!(t.reap(), 2, "the two complete entries");
        assert_eq!(drops.load(Ordering::SeqCst), 2);
        assert_eq!(
            t.parked(),
            2,
            "the two pending entries stay; the panicking one is leaked"
        );
        assert_eq!(t.reap(), 0);
        assert_eq!(drops.load(Ordering::SeqCst), 2);
        pending.set();
        assert_eq!(t.reap(), 2);
        assert_eq!(
            drops.load(Ordering::SeqCst),
            4,
            "the panicking entry is never freed"
        );
        assert_eq!(t.parked(), 0);
    }

    #[test]
    fn parked_resources_freed_by_reap_after_completion() {
        let t = Tracker::new();
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

    /// A reap on a thread that frees nothing (a waker's code on a stream proxy) releases what
    /// completed on the crate's drop thread, never there.
    #[test]
    fn a_reap_on_a_thread_that_frees_nothing_frees_elsewhere() {
        struct Where(Arc<std::sync::Mutex<Option<String>>>);
        impl Drop for Where {
            fn drop(&mut self) {
                let name = std::thread::current().name().map(str::to_string);
                *self.0.lock().unwrap() = name;
            }
        }
        let t = Arc::new(Tracker::new());
        let seen = Arc::new(std::sync::Mutex::new(None));
        t.park(Done, Where(seen.clone()));
        let t2 = t.clone();
        let reaped = std::thread::Builder::new()
            .name("frees-nothing".into())
            .spawn(move || {
                crate::completion::elsewhere::frees_nothing();
                t2.reap()
            })
            .unwrap()
            .join()
            .unwrap();
        assert_eq!((reaped, t.parked()), (1, 0), "released");
        crate::completion::testing::until("dropped", || seen.lock().unwrap().is_some());
        assert_eq!(seen.lock().unwrap().as_deref(), Some("gpudirect-drop"));
    }
}
