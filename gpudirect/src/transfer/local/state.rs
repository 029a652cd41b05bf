//! The state of an intra-node endpoint under the endpoint's lock ([`State`]: no rails; the
//! peer's descriptors, its notifications, its failure), and what the side does to it: fail it,
//! deliver a notification, start it afresh after a reconnect.

use crate::completion::deferred::{Defers, Locked};
use crate::transfer::descriptor::MemoryDescriptor;
use crate::transfer::request::{Broken, MAX_UNREAD_NOTIFICATIONS, Notification, unread_overflow};
use crate::transfer::shared::{EpInner, Mailbox, Wakes};
use std::collections::VecDeque;
use std::time::Instant;

/// The state of an intra-node endpoint under its lock: no rails; the peer's descriptors, the
/// notifications not read yet, and why it stopped.
pub(crate) struct State {
    pub(super) broken: Option<(Broken, Instant)>,
    pub(super) notes: VecDeque<Notification>,
    peer_descriptors: Vec<MemoryDescriptor>,
    /// What to wake once the lock is let go ([`Locked`]).
    wakes: Wakes,
}

impl State {
    /// The state of a new (or reconnected) endpoint whose peer published `peer_descriptors`.
    pub(super) fn new(peer_descriptors: Vec<MemoryDescriptor>) -> State {
        State {
            broken: None,
            notes: VecDeque::new(),
            peer_descriptors,
            wakes: Wakes::default(),
        }
    }
}

impl Mailbox for State {
    fn broken(&self) -> Option<&(Broken, Instant)> {
        self.broken.as_ref()
    }

    fn notes(&mut self) -> &mut VecDeque<Notification> {
        &mut self.notes
    }

    fn peer_descriptors(&self) -> &[MemoryDescriptor] {
        &self.peer_descriptors
    }
}

impl Defers for State {
    type Wakes = Wakes;
    fn wakes(&mut self) -> &mut Wakes {
        &mut self.wakes
    }
}

/// End the endpoint with `cause` (the first cause stays): no more notifications; whoever waits
/// for one is woken once `st`'s lock is let go.
pub(super) fn fail(ep: &EpInner<State>, st: &mut State, cause: Broken) {
    if st.broken.is_some() {
        return;
    }
    st.broken = Some((cause, Instant::now()));
    ep.failed(st);
}

/// [`fail`], then `under` with the lock still held; the wake-ups it decides returned, to be run
/// (dropped) once the caller let its own locks go.
pub(super) fn fail_later(ep: &EpInner<State>, cause: Broken, under: impl FnOnce()) -> Wakes {
    let mut st = ep.lock();
    fail(ep, &mut st, cause);
    under();
    std::mem::take(&mut st.wakes)
}

/// Deliver a notification that arrived (the reader).
pub(super) fn deliver(ep: &EpInner<State>, n: Notification) {
    let mut st: Locked<'_, State> = ep.lock();
    if st.notes.len() >= MAX_UNREAD_NOTIFICATIONS {
        fail(ep, &mut st, Broken::Protocol(unread_overflow()));
        return;
    }
    ep.deliver(&mut st, [n], 1);
    drop(st);
}

/// A fresh state for a reconnected endpoint, with the peer's new descriptors.
pub(super) fn restart(ep: &EpInner<State>, peer_descriptors: Vec<MemoryDescriptor>) {
    let fresh = State::new(peer_descriptors);
    let old = std::mem::replace(&mut *ep.lock(), fresh);
    drop(old);
}
