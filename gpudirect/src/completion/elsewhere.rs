//! Threads that free nothing, and the one thread that frees for them.
//!
//! Some of the crate's threads make progress a stream may wait for: a stream proxy publishes the
//! completion words `cuStreamWaitValue64` waits on, an endpoint's progress thread counts
//! notifications into a word and ends the requests those words wait for. Such a thread must not
//! free CUDA memory (`cuMemFree` and `cuMemFreeHost` synchronize the device) nor a stream word
//! (its drop waits for the streams that used it): it would wait for itself. It marks itself
//! ([`frees_nothing`]); what the crate lets go of there (also in code a user's waker runs there
//! inline, a callback-style executor) goes to the "gpudirect-drop" thread ([`drop_freely`]), and
//! the [`Tracker`](super::Tracker) frees nothing there either.
#![cfg_attr(
    not(feature = "transfer"),
    allow(dead_code, reason = "the transfer engine's threads mark themselves")
)]

use std::cell::Cell;
use std::sync::{Condvar, Mutex, OnceLock};

thread_local! {
    /// Whether this thread frees nothing ([`frees_nothing`]).
    static FREES_NOTHING: Cell<bool> = const { Cell::new(false) };
}

/// Mark this thread, for good, as one that frees nothing (see the module docs).
pub(crate) fn frees_nothing() {
    FREES_NOTHING.with(|c| c.set(true));
}

/// Run `f` with this thread marked as one that frees nothing, then restore its mark: for a
/// callback on a thread the crate does not own (CUDA's host-function thread, where no CUDA call
/// is allowed), whose wakers may run a user's code inline.
pub(crate) fn freeing_nothing<T>(f: impl FnOnce() -> T) -> T {
    let was = FREES_NOTHING.with(|c| c.replace(true));
    let out = f();
    FREES_NOTHING.with(|c| c.set(was));
    out
}

/// Whether this thread frees nothing ([`frees_nothing`]).
#[inline]
pub(crate) fn frees_nothing_here() -> bool {
    FREES_NOTHING.with(Cell::get)
}

/// Drop `held` here, or on the "gpudirect-drop" thread where this thread frees nothing
/// ([`drop_elsewhere`]). Elsewhere, one thread-local read.
#[inline]
pub(crate) fn drop_freely<T: Send + 'static>(held: T) {
    if frees_nothing_here() {
        drop_elsewhere(Box::new(held));
    }
}

/// The thread that drops what [`drop_elsewhere`] is given, and what waits for it.
struct Dropper {
    pid: u32,
    st: Mutex<Queued>,
    cv: Condvar,
}

#[derive(Default)]
struct Queued {
    held: Vec<Box<dyn Send>>,
    started: bool,
    asleep: bool,
}

static DROPPER: OnceLock<Dropper> = OnceLock::new();

/// Drop `held` on the "gpudirect-drop" thread (one per process, started by the first call),
/// where a drop may wait for streams and the device: it waits for nothing this crate's other
/// threads do, only for the streams, which those threads release. Leaked where that thread
/// cannot be started, and in a forked child (which frees nothing of its parent's).
#[cold]
pub(crate) fn drop_elsewhere(held: Box<dyn Send>) {
    let d = DROPPER.get_or_init(|| Dropper {
        pid: std::process::id(),
        st: Mutex::default(),
        cv: Condvar::new(),
    });
    if std::process::id() != d.pid {
        // The parent's thread does not run here, and its lock may be held for good.
        std::mem::forget(held);
        return;
    }
    let mut st = d.st.lock().unwrap_or_else(|e| e.into_inner());
    if !st.started {
        if crate::driver::ctx::spawn_thread("gpudirect-drop", move || drops(d)).is_err() {
            drop(st);
            std::mem::forget(held);
            return;
        }
        st.started = true;
    }
    st.held.push(held);
    if st.asleep {
        st.asleep = false;
        d.cv.notify_one();
    }
}

fn drops(d: &'static Dropper) {
    loop {
        let held = {
            let mut st = d.st.lock().unwrap_or_else(|e| e.into_inner());
            while st.held.is_empty() {
                st.asleep = true;
                st = d.cv.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            st.asleep = false;
            std::mem::take(&mut st.held)
        };
        for h in held {
            // A drop that panics leaks the rest of its value (and its payload), nothing else.
            if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(h)))
            {
                std::mem::forget(p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completion::testing::until;
    use std::sync::Arc;

    /// Records the name of the thread it is dropped on.
    struct Where(Arc<Mutex<Vec<String>>>);
    impl Drop for Where {
        fn drop(&mut self) {
            let name = std::thread::current().name().unwrap_or("?").to_string();
            self.0.lock().unwrap().push(name);
        }
    }

    #[test]
    fn a_thread_that_frees_nothing_has_its_drops_done_by_the_drop_thread() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        drop_freely(Where(seen.clone()));
        assert_eq!(seen.lock().unwrap().len(), 1, "dropped at once elsewhere");
        let s = seen.clone();
        std::thread::Builder::new()
            .name("frees-nothing".into())
            .spawn(move || {
                frees_nothing();
                assert!(frees_nothing_here());
                drop_freely(Where(s.clone()));
                drop_freely(vec![Where(s.clone()), Where(s)]);
            })
            .unwrap()
            .join()
            .unwrap();
        assert!(!frees_nothing_here(), "only the thread that said so");
        until("dropped by the drop thread", || {
            seen.lock().unwrap().len() == 4
        });
        let seen = seen.lock().unwrap().clone();
        assert_ne!(seen[0], "gpudirect-drop");
        assert!(seen[1..].iter().all(|n| n == "gpudirect-drop"), "{seen:?}");
    }
}
