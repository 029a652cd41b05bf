//! The shared completion thread.
//!
//! One thread per process, started by the first future that needs it. It polls, with the one
//! back-off of this module, whatever has no wake-up source of its own: the CUDA events of
//! stream fences (one `cuEventQuery` per stream per round, whatever the number of futures
//! waiting on that stream), [`EventFence`](super::EventFence)s and users' fences through their
//! [`Fence::check`](super::Fence::check); and it fires the deadlines of awaits. Between rounds it
//! only yields for the first 64 µs after a registration or a completion, then sleeps from 64 µs
//! up to 1 ms; a new registration or a completion starts that again. With nothing left to watch
//! it keeps yielding for the rest of those 64 µs (a next await, common right after one ends,
//! then costs no wake-up of the thread), then sleeps until woken or its next deadline. Its timer
//! slack is 1 ns (as every thread the crate starts), so short sleeps stay short.
//!
//! Whatever it polls is a [`Watch`]: a crate-internal trait, so that other completion sources
//! that must be polled (cuFile batch status) plug into the same thread.

use super::backoff::{Backoff, Pause};
use crate::error::Result;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::Waker;
use std::time::{Duration, Instant};

/// What the completion thread polls on behalf of futures.
pub(crate) trait Watch: Send + Sync + 'static {
    /// Look for completions without blocking, and wake the futures they concern.
    fn poll(&self) -> Watched;
}

/// A [`Watch`]'s answer to a poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Watched {
    /// Nothing new: poll again after a pause.
    Pending,
    /// Something completed and more is left: poll again soon.
    Progress,
    /// Nothing left to watch: the thread drops the watch.
    Done,
    /// The watch must never be dropped (it holds a fence that panicked): the thread forgets it.
    Leak,
}

/// A deadline set with [`set_timer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TimerKey {
    at: Instant,
    id: u64,
}

struct Shared {
    pid: u32,
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Default)]
struct State {
    /// Watches registered since the thread last looked.
    incoming: Vec<Arc<dyn Watch>>,
    /// Deadlines, earliest first.
    timers: BTreeMap<(Instant, u64), Waker>,
    next_id: u64,
    /// Whether the thread waits on `wake` (then a registration notifies it).
    asleep: bool,
    /// Whether the thread has been started.
    running: bool,
}

/// This process's completion thread state. Leaked, never freed: the thread lives as long as the
/// process.
static CURRENT: AtomicPtr<Shared> = AtomicPtr::new(std::ptr::null_mut());

fn shared() -> &'static Shared {
    loop {
        let p = CURRENT.load(Ordering::Acquire);
        if !p.is_null() {
            // SAFETY: every pointer stored in CURRENT comes from `Box::into_raw` below and is
            // never freed.
            let s = unsafe { &*p };
            if s.pid == std::process::id() {
                return s;
            }
        }
        // None yet, or the parent's (this is a forked child: that thread does not run here and
        // its lock may be held forever): make this process's own, leaving the other untouched.
        let new = Box::into_raw(Box::new(Shared {
            pid: std::process::id(),
            state: Mutex::default(),
            wake: Condvar::new(),
        }));
        match CURRENT.compare_exchange(p, new, Ordering::AcqRel, Ordering::Acquire) {
            // SAFETY: published just now, never freed.
            Ok(_) => return unsafe { &*new },
            // SAFETY: not published: nobody else saw it.
            Err(_) => drop(unsafe { Box::from_raw(new) }),
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Run `f` on the state, starting the thread first if needed, and wake it if it sleeps.
    fn with<T>(&'static self, f: impl FnOnce(&mut State) -> T) -> Result<T> {
        let mut st = self.lock();
        if !st.running {
            crate::driver::ctx::spawn_thread("gpudirect-completion", move || run(self))?;
            st.running = true;
        }
        let out = f(&mut st);
        if st.asleep {
            st.asleep = false;
            self.wake.notify_one();
        }
        Ok(out)
    }
}

/// Join `t`, unless this is that thread (its last handle was dropped on it, e.g. by a waker
/// run there): then it is let go, to end by itself. A thread joining itself makes `join` panic
/// (`EDEADLK`).
#[cfg_attr(
    not(feature = "transfer"),
    allow(dead_code, reason = "the transfer engine's threads use it")
)]
pub(crate) fn join_unless_current(t: std::thread::JoinHandle<()>) {
    if t.thread().id() != std::thread::current().id() {
        let _ = t.join();
    }
}

/// Have the completion thread poll `w` until it answers [`Watched::Done`] or [`Watched::Leak`].
///
/// # Errors
///
/// [`Error::Os`] when the thread could not be started (then `w` is dropped here).
pub(crate) fn watch(w: Arc<dyn Watch>) -> Result<()> {
    shared().with(|st| st.incoming.push(w))
}

/// Wake `waker` once `at` has passed, unless [`cancel_timer`] comes first.
///
/// # Errors
///
/// As [`watch`].
pub(crate) fn set_timer(at: Instant, waker: &Waker) -> Result<TimerKey> {
    shared().with(|st| {
        let id = st.next_id;
        st.next_id += 1;
        st.timers.insert((at, id), waker.clone());
        TimerKey { at, id }
    })
}

/// Forget a deadline (its waker is dropped here, not on the completion thread).
pub(crate) fn cancel_timer(key: TimerKey) {
    let waker = shared().lock().timers.remove(&(key.at, key.id));
    drop(waker);
}

/// How many deadlines are pending (for tests).
#[cfg(test)]
pub(crate) fn timers() -> usize {
    shared().lock().timers.len()
}

/// Run `f`, containing a panic (its payload is leaked, never dropped: dropping it could panic).
pub(crate) fn contained(f: impl FnOnce()) {
    if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        std::mem::forget(p);
    }
}

fn run(shared: &'static Shared) {
    // Its short sleeps stay short: `spawn_thread` set its timer slack.
    let mut active: Vec<Arc<dyn Watch>> = Vec::new();
    let mut due: Vec<Waker> = Vec::new();
    let mut backoff = Backoff::new();
    loop {
        {
            let mut st = shared.lock();
            if !st.incoming.is_empty() {
                active.append(&mut st.incoming);
                backoff.reset();
            }
            let now = Instant::now();
            while let Some(e) = st.timers.first_entry() {
                if e.key().0 > now {
                    break;
                }
                due.push(e.remove());
            }
        }
        for w in due.drain(..) {
            contained(|| w.wake());
        }
        let mut progress = false;
        let mut i = 0;
        while i < active.len() {
            let w = &active[i];
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.poll())) {
                Ok(Watched::Pending) => i += 1,
                Ok(Watched::Progress) => {
                    progress = true;
                    i += 1;
                }
                Ok(Watched::Done) => {
                    progress = true;
                    let w = active.swap_remove(i);
                    // What the watch holds may be a user's fence, whose drop could panic.
                    contained(move || drop(w));
                }
                Ok(Watched::Leak) => {
                    progress = true;
                    std::mem::forget(active.swap_remove(i));
                }
                Err(p) => {
                    // Crate code does not panic here; if it did, what it watched proves nothing.
                    std::mem::forget(p);
                    std::mem::forget(active.swap_remove(i));
                }
            }
        }
        if progress {
            backoff.reset();
        }
        let mut st = shared.lock();
        if !st.incoming.is_empty() {
            continue;
        }
        let next_timer = st
            .timers
            .first_key_value()
            .map(|(k, _)| k.0.saturating_duration_since(Instant::now()));
        if next_timer == Some(Duration::ZERO) {
            continue;
        }
        let sleep = if active.is_empty() {
            if backoff.yielding() {
                // Linger: a registration now finds the thread awake.
                drop(st);
                std::thread::yield_now();
                continue;
            }
            next_timer
        } else {
            match backoff.next() {
                Pause::Yield => {
                    drop(st);
                    std::thread::yield_now();
                    continue;
                }
                Pause::Sleep(d) => Some(next_timer.map_or(d, |t| t.min(d))),
            }
        };
        st.asleep = true;
        let mut st = match sleep {
            None => shared.wake.wait(st).unwrap_or_else(|e| e.into_inner()),
            Some(d) => {
                shared
                    .wake
                    .wait_timeout(st, d)
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
        };
        st.asleep = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completion::testing::{CountWakes, until};
    use std::sync::atomic::{AtomicBool, AtomicUsize};

    #[test]
    fn a_thread_given_its_own_handle_lets_itself_go_and_others_are_joined() {
        let (tx, rx) = std::sync::mpsc::channel::<std::thread::JoinHandle<()>>();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            let me = rx.recv().unwrap();
            // `me.join()` would panic here.
            join_unless_current(me);
            done_tx.send(()).unwrap();
        });
        tx.send(t).unwrap();
        done_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the thread went on after letting itself go");
        let ran = Arc::new(AtomicBool::new(false));
        let r = ran.clone();
        let other = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            r.store(true, Ordering::SeqCst);
        });
        join_unless_current(other);
        assert!(ran.load(Ordering::SeqCst), "another thread is joined");
    }

    #[test]
    fn timers_fire_in_order_and_cancelled_ones_never() {
        let a = Arc::new(CountWakes::default());
        let b = Arc::new(CountWakes::default());
        let c = Arc::new(CountWakes::default());
        let now = Instant::now();
        set_timer(now + Duration::from_millis(30), &Waker::from(b.clone())).unwrap();
        set_timer(now + Duration::from_millis(5), &Waker::from(a.clone())).unwrap();
        let k = set_timer(now + Duration::from_millis(10), &Waker::from(c.clone())).unwrap();
        cancel_timer(k);
        assert_eq!(
            Arc::strong_count(&c),
            1,
            "a cancelled timer's waker is dropped"
        );
        until("first timer", || a.0.load(Ordering::SeqCst) == 1);
        assert!(now.elapsed() >= Duration::from_millis(5));
        until("second timer", || b.0.load(Ordering::SeqCst) == 1);
        assert!(now.elapsed() >= Duration::from_millis(30));
        assert_eq!(c.0.load(Ordering::SeqCst), 0);
        until("fired wakers dropped", || {
            Arc::strong_count(&a) == 1 && Arc::strong_count(&b) == 1
        });
    }

    /// Done after `left` polls; counts its polls.
    struct Countdown {
        left: AtomicUsize,
        polls: AtomicUsize,
        dropped: Arc<AtomicBool>,
    }
    impl Watch for Countdown {
        fn poll(&self) -> Watched {
            self.polls.fetch_add(1, Ordering::SeqCst);
            if self.left.fetch_sub(1, Ordering::SeqCst) == 1 {
                Watched::Done
            } else {
                Watched::Pending
            }
        }
    }
    impl Drop for Countdown {
        fn drop(&mut self) {
            self.dropped.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn watches_are_polled_until_done_then_dropped() {
        let dropped = Arc::new(AtomicBool::new(false));
        let w = Arc::new(Countdown {
            left: AtomicUsize::new(50),
            polls: AtomicUsize::new(0),
            dropped: dropped.clone(),
        });
        watch(w.clone()).unwrap();
        until("polled to the end", || w.polls.load(Ordering::SeqCst) == 50);
        drop(w);
        until("dropped by the thread", || dropped.load(Ordering::SeqCst));
    }

    struct PanicsInPoll(Arc<AtomicBool>);
    impl Watch for PanicsInPoll {
        fn poll(&self) -> Watched {
            panic!("watch panics")
        }
    }
    impl Drop for PanicsInPoll {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_panicking_watch_is_leaked_and_the_thread_goes_on() {
        let dropped = Arc::new(AtomicBool::new(false));
        watch(Arc::new(PanicsInPoll(dropped.clone()))).unwrap();
        // The thread still serves others after the panic.
        let a = Arc::new(CountWakes::default());
        set_timer(
            Instant::now() + Duration::from_millis(20),
            &Waker::from(a.clone()),
        )
        .unwrap();
        until("timer after a panicking watch", || {
            a.0.load(Ordering::SeqCst) == 1
        });
        assert!(!dropped.load(Ordering::SeqCst), "leaked, never dropped");
    }
}
