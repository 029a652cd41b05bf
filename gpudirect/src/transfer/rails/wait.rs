//! A waiting thread doing the progress thread's work: a thread waiting for a request
//! ([`Transfer::wait`], a poll of its future) or for a notification polls the rails' CQs itself
//! when no other thread does, so what it waits for is seen without a hand-off from the progress
//! thread. A request waited for behind more than `SPIN_DEPTH` messages is left to the progress
//! thread: the hand-off is hidden behind the work in flight. One waiter at a time polls ([`Link::polled`], taken and let go under the state lock:
//! nothing is taken twice, and the progress thread leaves the CQs alone meanwhile); others
//! spin, ready to take over. When the last waiter stops, the CQs are left watched: armed (a
//! completion wakes the progress thread), or, when nothing is waited for any more and the
//! progress thread looks within its linger anyway ([`LINGER`](super::rail::LINGER) to
//! [`LINGER_MAX`](super::rail::LINGER_MAX)), left as they are (no arming, and no wake-up of the
//! progress thread at the next completion).

use super::post::{Ready, direct, post_ready, pump};
use super::progress::{arm_all, poll_all};
use super::state::{Link, State, long_ago};
use crate::error::Result;
use crate::transfer::descriptor::RemoteRange;
use crate::transfer::pending::{Finisher, Looking, Transfer};
use crate::transfer::region::LocalRange;
use crate::transfer::request::{Direction, Notification, TransferOptions};
use std::cell::Cell;
use std::sync::Weak;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// A request on registered memory ([`direct`]) whose blocking wait polls the CQs itself.
pub(super) fn request(
    inner: &Link,
    dir: Direction,
    pairs: Vec<(LocalRange, RemoteRange)>,
    opts: TransferOptions,
) -> Result<Transfer> {
    Ok(finished_by(inner, direct(inner, dir, pairs, opts)?))
}

/// A prepared request posted again ([`post_ready`]), waited for as [`request`]'s.
pub(super) fn request_ready(inner: &Link, ready: &Ready) -> Result<Transfer> {
    Ok(finished_by(inner, post_ready(inner, ready)?))
}

/// `t`, its blocking wait polling `inner`'s CQs itself.
fn finished_by(inner: &Link, t: Transfer) -> Transfer {
    let me: Weak<dyn Finisher> = inner.me.clone();
    t.set_finisher(me);
    t
}

/// One look by a waiter, under the lock: it starts spinning, takes the polling when it is free,
/// and, holding it, polls the CQs and posts what that made room for. Returns whether it found
/// a completion.
fn look_locked(inner: &Link, st: &mut State, l: &mut Looking) -> bool {
    if *l == Looking::Not {
        inner.spinners.fetch_add(1, Ordering::AcqRel);
        *l = Looking::Spins;
    }
    if *l == Looking::Spins && !inner.polled.swap(true, Ordering::AcqRel) {
        *l = Looking::Polls;
    }
    if *l != Looking::Polls {
        return false;
    }
    // Counted, not timed: a clock read at every look costs a system call where the clock
    // source has no vDSO (a VM's HPET).
    st.looks = st.looks.wrapping_add(1);
    let found = poll_all(inner, st);
    if found {
        pump(inner, st);
    }
    found
}

/// One look ([`look_locked`]) of a blocking wait for a request, the lock taken only to poll.
/// Yields the CPU after a look that found nothing (a software NIC's kernel side needs it on a
/// busy machine; after one that found a completion, the caller sees at once whether it was
/// its own). Returns
/// whether to go on: not while more than `SPIN_DEPTH` messages are in flight (the wait is
/// behind that much work; the thread sleeps and the progress thread wakes it).
fn look(inner: &Link, l: &mut Looking) -> bool {
    if inner.deep.load(Ordering::Relaxed) {
        return false;
    }
    if *l != Looking::Polls && inner.polled.load(Ordering::Acquire) {
        if *l == Looking::Not {
            inner.spinners.fetch_add(1, Ordering::AcqRel);
            *l = Looking::Spins;
        }
        std::thread::yield_now();
        return true;
    }
    let mut st = inner.lock();
    let found = look_locked(inner, &mut st, l);
    drop(st);
    if !found {
        std::thread::yield_now();
    }
    true
}

/// The waiter stops spinning (`done`: what it waited for came), under the lock: it lets the
/// polling go and leaves the CQs watched. They are armed (then looked at once more, as the
/// progress thread does before it sleeps) unless another waiter polls or spins (it takes over),
/// or the waiter got what it waited for, nothing else is waited for (no request in flight, no
/// thread or future waiting for a notification, no notification counter) and the progress
/// thread lingers (it looks within its linger, `LINGER` to `LINGER_MAX`).
fn stop_locked(inner: &Link, st: &mut State, l: &mut Looking, done: bool) {
    if *l == Looking::Not {
        return;
    }
    let others = inner.spinners.fetch_sub(1, Ordering::AcqRel) - 1;
    if *l == Looking::Polls {
        inner.polled.store(false, Ordering::Release);
        st.looked = Instant::now();
    }
    *l = Looking::Not;
    if !st.unarmed || inner.polled.load(Ordering::Acquire) || others > 0 {
        return;
    }
    if done && st.lingering && st.requests.is_empty() && !inner.ep.watched() {
        // Whatever starts waiting without polling from now on asks the thread to look.
        inner.left_unarmed.store(true, Ordering::Release);
        return;
    }
    // Then one more look: a completion that came before the arming raises no event (one that
    // came after it does, and the progress thread looks).
    let armed = arm_all(inner, st);
    // Armed, or to be (it goes to sleep, or left requests in flight): the progress thread is
    // to watch the CQs from now on, not leave them to this waiter as one that polled lately.
    st.looked = long_ago();
    if poll_all(inner, st) {
        pump(inner, st);
        // Receives that look used are posted by the next one (their credits then go back):
        // completions that came before the arming raise no event for the progress thread.
        if poll_all(inner, st) {
            pump(inner, st);
        }
    }
    if !armed {
        inner.poke();
    }
}

impl Finisher for Link {
    /// A poll of a transfer's future: one look when no other thread polls.
    fn help(&self) {
        self.poll_look();
    }

    /// Whenever no waiter polls, the CQs are armed or the progress thread lingers; when the
    /// last waiter left them unarmed, the thread is asked to look now ([`Link::watch`]).
    fn wake(&self) {
        self.watch();
    }

    /// Nothing: the future's first poll looks ([`poll_look`](Finisher::poll_look)) and, as it
    /// stops, arms the CQs (or the waiter polling them sees the request in flight and arms them
    /// as it stops). Waking here cost an eventfd write per request in a loop of awaits.
    fn wake_for_future(&self) {}

    fn spin(&self) -> Duration {
        self.ep.engine.inner.config.spin
    }

    fn look(&self, l: &mut Looking) -> bool {
        look(self, l)
    }

    fn stop(&self, l: &mut Looking, done: bool) {
        if *l != Looking::Not {
            let mut st = self.lock();
            stop_locked(self, &mut st, l, done);
        }
    }

    fn poll_look(&self) {
        if self.polled.load(Ordering::Acquire) {
            return;
        }
        let mut l = Looking::Not;
        let mut st = self.lock();
        // Stopped even if the look panics: the polling is never left taken.
        let looked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            look_locked(self, &mut st, &mut l)
        }));
        stop_locked(self, &mut st, &mut l, false);
        if let Err(panic) = looked {
            drop(st);
            std::panic::resume_unwind(panic);
        }
    }
}

/// The next notification, waiting up to `timeout`: for the engine's `spin` this thread looks
/// for it and polls the CQs itself (when no other thread does), then sleeps until the progress
/// thread delivers one.
///
/// # Errors
///
/// The endpoint's failure, once it has failed and no notification is left.
pub(super) fn next_notification(inner: &Link, timeout: Duration) -> Result<Option<Notification>> {
    let l = Cell::new(Looking::Not);
    inner.ep.next_notification_with(
        timeout,
        inner.ep.engine.inner.config.spin,
        |st| {
            let mut k = l.get();
            // Kept even if the look panics: the stop that follows then lets go of what it took.
            let looked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                look_locked(inner, st, &mut k)
            }));
            l.set(k);
            if let Err(panic) = looked {
                std::panic::resume_unwind(panic);
            }
        },
        |st, got| {
            let mut k = l.get();
            stop_locked(inner, st, &mut k, got);
            l.set(k);
        },
        // Counted asleep: a waiter that left the CQs unarmed before asks the thread to look.
        || inner.watch(),
    )
}

/// One look for a notification by `deadline`, for a future: the CQs polled first when no
/// other thread polls them.
pub(super) fn look_for_note(inner: &Link, deadline: Instant) -> crate::transfer::shared::Look {
    inner.poll_look();
    let look = inner.ep.look_for_note(deadline);
    if matches!(look, crate::transfer::shared::Look::Wait(_)) {
        // Registered: a waiter that stops from now on sees it watched; one that stopped
        // before left the CQs unarmed, and the thread is asked to look.
        inner.watch();
    }
    look
}
