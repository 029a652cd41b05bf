//! Wake-ups decided under a lock and run once it is let go.
//!
//! A flag's futures have the caller's wakers. A waker may call back into the library inline (a
//! callback-style executor, a waker that polls, one that drops the last clone of an endpoint):
//! run under a lock the library holds, it would take that lock again and wait for itself. So
//! code that finishes requests under a lock collects their wake-ups in the locked state, and
//! [`Locked`] runs them after letting the lock go.
#![cfg_attr(
    not(feature = "transfer"),
    allow(
        dead_code,
        reason = "the transfer engine's locked states use all of it"
    )
)]

use super::fence::CompletionFlag;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::task::Waker;
use std::time::Duration;

/// Flags to set once the lock they were collected under is let go: set when dropped.
#[derive(Debug, Default)]
pub(crate) struct Woken(Vec<CompletionFlag>);

impl Woken {
    pub(crate) fn push(&mut self, f: CompletionFlag) {
        self.0.push(f);
    }
}

impl Extend<CompletionFlag> for Woken {
    fn extend<I: IntoIterator<Item = CompletionFlag>>(&mut self, it: I) {
        self.0.extend(it);
    }
}

impl Drop for Woken {
    fn drop(&mut self) {
        for f in self.0.drain(..) {
            f.set();
        }
    }
}

/// Wakers to wake once the locks they were taken under are let go: woken when dropped, each
/// on its own (one waker's panic does not keep the others asleep).
#[derive(Default)]
pub(crate) struct Wakers(Vec<Waker>);

impl Extend<Waker> for Wakers {
    fn extend<I: IntoIterator<Item = Waker>>(&mut self, it: I) {
        self.0.extend(it);
    }
}

impl Drop for Wakers {
    fn drop(&mut self) {
        for w in self.0.drain(..) {
            super::thread::contained(|| w.wake());
        }
    }
}

/// Wake-ups kept in a locked state: run when dropped.
pub(crate) trait Wakes: Default {
    fn is_empty(&self) -> bool;
}

impl Wakes for Woken {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A state behind a [`Mutex`] that keeps the wake-ups its lock holders decide.
pub(crate) trait Defers {
    type Wakes: Wakes;
    fn wakes(&mut self) -> &mut Self::Wakes;
}

/// `T` locked. Dropping it lets the lock go, then runs the wake-ups decided under it.
pub(crate) struct Locked<'a, T: Defers> {
    mutex: &'a Mutex<T>,
    g: Option<MutexGuard<'a, T>>,
}

impl<'a, T: Defers> Locked<'a, T> {
    /// Lock `mutex` (a poisoned lock is taken as it is).
    pub(crate) fn new(mutex: &'a Mutex<T>) -> Self {
        let g = mutex.lock().unwrap_or_else(|e| e.into_inner());
        Locked { mutex, g: Some(g) }
    }

    /// Lock `mutex` if no other thread holds it (a poisoned lock is taken as it is).
    pub(crate) fn try_new(mutex: &'a Mutex<T>) -> Option<Self> {
        let g = match mutex.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(Locked { mutex, g: Some(g) })
    }

    /// Wait on `cv` up to `left` with the lock let go, as [`Condvar::wait_timeout`]. When
    /// wake-ups are pending they run instead, the lock let go and taken again: the caller looks
    /// again before it waits, as after any spurious wake-up.
    pub(crate) fn wait_timeout(mut self, cv: &Condvar, left: Duration) -> Self {
        let mut g = self.g.take().expect("held until dropped");
        if !g.wakes().is_empty() {
            let_go(g);
            return Locked::new(self.mutex);
        }
        let g = cv
            .wait_timeout(g, left)
            .unwrap_or_else(|e| e.into_inner())
            .0;
        Locked {
            mutex: self.mutex,
            g: Some(g),
        }
    }
}

impl<T: Defers> std::ops::Deref for Locked<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.g.as_deref().expect("held until dropped")
    }
}

impl<T: Defers> std::ops::DerefMut for Locked<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.g.as_deref_mut().expect("held until dropped")
    }
}

impl<T: Defers> Drop for Locked<'_, T> {
    fn drop(&mut self) {
        if let Some(g) = self.g.take() {
            let_go(g);
        }
    }
}

/// Let `g` go, then run the wake-ups decided under it.
fn let_go<T: Defers>(mut g: MutexGuard<'_, T>) {
    // Most unlocks have nothing to run: nothing moved then.
    if g.wakes().is_empty() {
        return;
    }
    let w = std::mem::take(g.wakes());
    drop(g);
    drop(w);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completion::Fence;
    use crate::completion::testing::WokenFree;
    use std::sync::Arc;
    use std::task::Waker;

    #[derive(Default)]
    struct S {
        n: u32,
        woken: Woken,
    }

    impl Defers for S {
        type Wakes = Woken;
        fn wakes(&mut self) -> &mut Woken {
            &mut self.woken
        }
    }

    #[test]
    fn wake_ups_run_once_the_lock_is_let_go() {
        let m = Arc::new(Mutex::new(S::default()));
        let m2 = m.clone();
        // Takes the lock, as a waker that calls back would.
        let probe = WokenFree::new(move || m2.try_lock().map(|mut s| s.n += 1).is_ok());
        let flags: Vec<CompletionFlag> = (0..3).map(|_| CompletionFlag::new()).collect();
        for f in &flags {
            assert!(f.register_waker(&Waker::from(probe.clone())));
        }
        {
            let mut st = Locked::new(&m);
            st.woken.extend(flags[..2].iter().cloned());
            assert!(flags.iter().all(|f| !f.is_complete()));
        }
        assert!(flags[..2].iter().all(CompletionFlag::is_complete));
        assert_eq!(probe.count(), 2, "each found the lock free");
        // Pending wake-ups run instead of a wait, the lock let go.
        let cv = Condvar::new();
        let mut st = Locked::new(&m);
        st.woken.push(flags[2].clone());
        let t = std::time::Instant::now();
        let st = st.wait_timeout(&cv, Duration::from_secs(30));
        assert!(t.elapsed() < Duration::from_secs(10));
        assert!(flags[2].is_complete());
        assert_eq!((st.n, probe.count()), (3, 3));
        // Nothing pending: a plain wait.
        let st = st.wait_timeout(&cv, Duration::from_millis(5));
        assert_eq!(st.n, 3);
    }
}
