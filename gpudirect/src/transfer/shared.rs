//! What an endpoint's transports share: its engine, the one lock over its state, the
//! notifications delivered and the threads and futures waiting for them, its failure, and its
//! notification counter. Each transport keeps its own state under that lock ([`Mailbox`]: the
//! part every state has); the transports call down into this file, never into each other.

use super::descriptor::MemoryDescriptor;
use super::engine::Engine;
use super::pending::ReqShared;
use super::plan::deadline_after;
use super::request::{Broken, Notification, TransferReport};
use super::stream::Counter;
use crate::completion::deferred::{self, Defers, Locked, Woken};
use crate::completion::{CompletionFlag, Fence};
use crate::error::Result;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Wake-ups decided under the state lock, run once it is let go ([`Locked`]): a future's
/// waker is the caller's code, and one that calls the endpoint (or drops its last clone) would
/// take the lock again. Run when dropped.
#[derive(Default)]
pub(crate) struct Wakes {
    /// Requests finished, with their results (taken at the next unlock: a few on the stack).
    pub(crate) finished: smallvec::SmallVec<[(Arc<ReqShared>, Result<TransferReport>); 2]>,
    /// Notification waiters (a notification came, the endpoint failed, or their deadline
    /// passed).
    pub(crate) notes: Woken,
}

impl deferred::Wakes for Wakes {
    fn is_empty(&self) -> bool {
        self.finished.is_empty() && deferred::Wakes::is_empty(&self.notes)
    }
}

impl Drop for Wakes {
    fn drop(&mut self) {
        for (shared, r) in self.finished.drain(..) {
            shared.finish(r);
        }
    }
}

/// The part of a transport's endpoint state that every transport has: why the endpoint
/// stopped, the notifications not read yet, the peer's descriptors, and the wake-ups to run
/// once the lock is let go.
pub(crate) trait Mailbox: Defers<Wakes = Wakes> + Send + 'static {
    /// Why the endpoint stopped and when, if it has.
    fn broken(&self) -> Option<&(Broken, Instant)>;
    /// The notifications delivered and not read yet.
    fn notes(&mut self) -> &mut VecDeque<Notification>;
    /// The descriptors the peer published when the endpoints met.
    fn peer_descriptors(&self) -> &[MemoryDescriptor];
}

/// One look for a notification ([`EpInner::look_for_note`]).
pub(crate) enum Look {
    /// A notification, the endpoint's failure, or `None` past the deadline.
    Found(Result<Option<Notification>>),
    /// None yet: this flag is set at the next notification or failure, or at the deadline.
    Wait(CompletionFlag),
}

/// The state of one endpoint that its transport shares with the endpoint: `S` is the
/// transport's state, under the endpoint's one lock.
pub(crate) struct EpInner<S> {
    pub(crate) engine: Engine,
    state: Mutex<S>,
    notes_cv: Condvar,
    /// Awaiting [`Endpoint::notification`](crate::transfer::Endpoint::notification) futures:
    /// each flag is set at the next notification or failure (or once its deadline has passed),
    /// then dropped from the list. Locked only under `state`.
    note_waiters: Mutex<Vec<(Instant, CompletionFlag)>>,
    /// Notifications delivered so far (what the counter counts).
    delivered: AtomicU64,
    /// The word counting delivered notifications, once someone asked for it. Set and told
    /// only under `state`.
    note_sink: OnceLock<Arc<Counter>>,
    /// Threads asleep in [`next_notification`](Self::next_notification) (counted under
    /// `state`).
    note_sleepers: AtomicUsize,
}

impl<S: Mailbox> EpInner<S> {
    /// The shared state of a new endpoint of `engine` whose transport's state is `state`.
    pub(crate) fn new(engine: Engine, state: S) -> EpInner<S> {
        EpInner {
            engine,
            state: Mutex::new(state),
            notes_cv: Condvar::new(),
            note_waiters: Mutex::new(Vec::new()),
            delivered: AtomicU64::new(0),
            note_sink: OnceLock::new(),
            note_sleepers: AtomicUsize::new(0),
        }
    }

    pub(crate) fn lock(&self) -> Locked<'_, S> {
        Locked::new(&self.state)
    }

    /// Wake every thread and future waiting for a notification (one came, or the endpoint
    /// failed): the futures once `st`'s lock is let go.
    pub(crate) fn wake_notes(&self, st: &mut S) {
        // Only when a thread sleeps on it (counted under the lock, held here): a wake-up is a
        // system call, at every notification of a ping-pong otherwise.
        if self.note_sleepers.load(Ordering::Acquire) > 0 {
            self.notes_cv.notify_all();
        }
        let waiters =
            std::mem::take(&mut *self.note_waiters.lock().unwrap_or_else(|e| e.into_inner()));
        st.wakes().notes.extend(waiters.into_iter().map(|(_, f)| f));
    }

    /// `notes` (`n` of them) arrived, their bytes visible: queue them to be read, count them,
    /// and wake whoever waits. Under `st`'s lock.
    pub(crate) fn deliver(
        &self,
        st: &mut S,
        notes: impl IntoIterator<Item = Notification>,
        n: u64,
    ) {
        st.notes().extend(notes);
        let total = self.delivered.fetch_add(n, Ordering::Relaxed) + n;
        if let Some(s) = self.note_sink.get() {
            s.delivered(total);
        }
        self.wake_notes(st);
    }

    /// The endpoint has just failed (its state says why): tell the counter and wake whoever
    /// waits for a notification. Under `st`'s lock.
    pub(crate) fn failed(&self, st: &mut S) {
        if let Some(s) = self.note_sink.get() {
            s.failed();
        }
        self.wake_notes(st);
    }

    /// The endpoint's failure, if it has failed.
    pub(crate) fn failure(&self) -> Option<crate::Error> {
        self.lock().broken().map(|(b, _)| b.to_error())
    }

    /// The descriptors the peer published.
    pub(crate) fn peer_descriptors(&self) -> Vec<MemoryDescriptor> {
        self.lock().peer_descriptors().to_vec()
    }

    /// The next notification, waiting up to `timeout`; `None` when none came. With the
    /// engine's `spin`, `poll` (the transport's own look for completions) runs here first, the
    /// lock let go between looks.
    ///
    /// # Errors
    ///
    /// The endpoint's failure, once it has failed and no notification is left.
    #[cfg_attr(
        not(feature = "p2p"),
        allow(dead_code, reason = "the intra-node path (feature p2p) uses it")
    )]
    pub(crate) fn next_notification(
        &self,
        timeout: Duration,
        poll: impl FnMut(&mut S),
    ) -> Result<Option<Notification>> {
        let spin = self.engine.inner.config.spin;
        self.next_notification_with(timeout, spin, poll, |_, _| {}, || {})
    }

    /// [`next_notification`](Self::next_notification) looking for `spin` first: `look` runs
    /// under the lock at each look, and `stop` once when the looking ends (`true` when a
    /// notification or the failure was found), under the lock; `asleep` each time the thread
    /// is about to sleep, counted as asleep (under the lock: a transport's waiter that stops
    /// after sees it waiting; `asleep` covers one that stopped before).
    ///
    /// # Errors
    ///
    /// The endpoint's failure, once it has failed and no notification is left.
    pub(crate) fn next_notification_with(
        &self,
        timeout: Duration,
        spin: Duration,
        mut look: impl FnMut(&mut S),
        stop: impl FnOnce(&mut S, bool),
        asleep: impl Fn(),
    ) -> Result<Option<Notification>> {
        let deadline = deadline_after(Instant::now(), timeout);
        // With `spin`, poll the completion queues here first (the lock is let go between
        // polls): no thread hand-off for a notification that comes soon.
        let mut st = if spin.is_zero() {
            self.lock()
        } else {
            let until = deadline_after(Instant::now(), spin.min(timeout));
            loop {
                let mut st = self.lock();
                if let Some(n) = st.notes().pop_front() {
                    stop(&mut st, true);
                    return Ok(Some(n));
                }
                let broken = st.broken().is_some();
                if broken || Instant::now() >= until {
                    stop(&mut st, broken);
                    // Kept: this thread is counted asleep below before anyone else takes the
                    // lock, so a waiter that stops after sees it waiting.
                    break st;
                }
                // A look that panics is stopped before the panic goes on (a rails waiter would
                // otherwise keep the polling taken for good).
                if let Err(panic) =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| look(&mut st)))
                {
                    stop(&mut st, false);
                    drop(st);
                    std::panic::resume_unwind(panic);
                }
                // What the look delivered, before the lock is let go and the CPU yielded.
                if let Some(n) = st.notes().pop_front() {
                    stop(&mut st, true);
                    return Ok(Some(n));
                }
                drop(st);
                // Let the kernel's side of a software NIC run on a busy CPU.
                std::thread::yield_now();
            }
        };
        loop {
            if let Some(n) = st.notes().pop_front() {
                return Ok(Some(n));
            }
            if let Some((b, _)) = st.broken() {
                return Err(b.to_error());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            // Counted under the lock, as the transport reads it.
            self.note_sleepers.fetch_add(1, Ordering::AcqRel);
            asleep();
            st = st.wait_timeout(&self.notes_cv, left);
            self.note_sleepers.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Whether someone waits for a notification without looking for it: a thread asleep in
    /// [`next_notification`](Self::next_notification), a future, the notification counter.
    /// Under the state lock.
    pub(crate) fn watched(&self) -> bool {
        self.note_sleepers.load(Ordering::Acquire) > 0
            || self.note_sink.get().is_some()
            || !self
                .note_waiters
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty()
    }

    /// One look for a notification by `deadline`, for a future: the notification, the
    /// failure, `None` past the deadline, or a flag set at the next notification or failure
    /// (registered under the state lock: a notification pushed after the look sets it).
    pub(crate) fn look_for_note(&self, deadline: Instant) -> Look {
        let mut st = self.lock();
        if let Some(n) = st.notes().pop_front() {
            return Look::Found(Ok(Some(n)));
        }
        if let Some((b, _)) = st.broken() {
            return Look::Found(Err(b.to_error()));
        }
        let now = Instant::now();
        if now >= deadline {
            return Look::Found(Ok(None));
        }
        let flag = CompletionFlag::new();
        // Registered under the state lock: a notification pushed after the look above sets
        // this flag.
        let mut w = self.note_waiters.lock().unwrap_or_else(|e| e.into_inner());
        prune_waiters(&mut w, now, &mut st.wakes().notes);
        w.push((deadline, flag.clone()));
        Look::Wait(flag)
    }

    /// The endpoint's notification counter, made by `make` (given the notifications delivered
    /// so far) on first use, under the endpoint's lock so that no delivery is missed; a counter
    /// made on a failed endpoint is told so at once.
    ///
    /// # Errors
    ///
    /// What `make` returns.
    pub(crate) fn counter(
        &self,
        make: impl FnOnce(u64) -> Result<Arc<Counter>>,
    ) -> Result<Arc<Counter>> {
        let st = self.lock();
        if let Some(s) = self.note_sink.get() {
            return Ok(s.clone());
        }
        let s = make(self.delivered.load(Ordering::Relaxed))?;
        if st.broken().is_some() {
            s.failed();
        }
        let _ = self.note_sink.set(s.clone());
        drop(st);
        Ok(s)
    }
}

/// Sets its flag when dropped (a notification future that ends or is dropped).
pub(crate) struct SetOnDrop(pub(crate) CompletionFlag);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.set();
    }
}

/// Drop the notification waiters that are gone: set (their future ended or was dropped), or
/// past their deadline (then put in `expired`, to be set once the lock is let go, so what the
/// completion tracker parked for them is freed).
fn prune_waiters(w: &mut Vec<(Instant, CompletionFlag)>, now: Instant, expired: &mut Woken) {
    w.retain(|(d, f)| {
        if f.is_complete() {
            return false;
        }
        let live = *d > now;
        if !live {
            expired.push(f.clone());
        }
        live
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_notification_waiters_do_not_pile_up() {
        // A `select!` loop creates and drops a notification future per turn: each left its
        // waiter (and a parked tracker entry) until a notification came or a later call found
        // its deadline passed (hours, for a long timeout).
        let mut w = Vec::new();
        let far = Instant::now() + Duration::from_secs(3600);
        for _ in 0..1000 {
            let f = CompletionFlag::new();
            w.push((far, f.clone()));
            drop(SetOnDrop(f));
            prune_waiters(&mut w, Instant::now(), &mut Woken::default());
        }
        assert!(w.len() <= 1, "{} waiters left", w.len());
        // A live waiter stays; an expired one is set and dropped.
        let (live, old) = (CompletionFlag::new(), CompletionFlag::new());
        let now = Instant::now();
        w = vec![(far, live.clone()), (now, old.clone())];
        let mut expired = Woken::default();
        prune_waiters(&mut w, now, &mut expired);
        assert_eq!(w.len(), 1);
        assert!(
            !old.is_complete() && !live.is_complete(),
            "set once the lock is let go"
        );
        drop(expired);
        assert!(old.is_complete() && !live.is_complete());
    }
}
