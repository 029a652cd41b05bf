//! The send side of an [`AsyncQueuePair`](super::AsyncQueuePair) as plain logic: who waits for
//! which completion, and the bounded backlog of requests that found no room in the send queue or
//! its completion queue. No verbs here: posting is a closure, so the rules are tested on their
//! own.

use crate::error::{Error, Result};
use std::collections::{HashMap, VecDeque};

/// What a post attempt did with a request.
#[derive(Debug)]
pub(crate) enum Offer<T> {
    /// Handed to the NIC: its completion will come.
    Posted,
    /// No room in the send queue or its completion queue: the request comes back untouched.
    NoRoom(T),
    /// Refused for good (the post call failed): nothing of it reached the NIC.
    Failed(Error),
}

/// Where a submitted request went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placed {
    /// Posted at once.
    Posted,
    /// Waiting in the backlog, behind earlier requests, for room.
    Queued,
}

/// Requests by id: those posted, waiting for their completion, and those in the backlog, waiting
/// for room, in submission order. `S` is what a completion is handed to (a sender), `T` a
/// request not yet posted.
///
/// Rules: a request never overtakes an earlier one (while the backlog holds anything, new
/// requests join it); the backlog holds at most `cap` requests and a request that would make it
/// longer is refused with [`Error::QueueFull`] naming the backlog (nothing is kept of it); every
/// request submitted successfully is handed to exactly one of: its completion
/// ([`complete`](Self::complete)), a failed post ([`drain`](Self::drain)), or the close
/// ([`take_backlog`](Self::take_backlog)).
pub(crate) struct SendSide<T, S> {
    backlog: VecDeque<(u64, T)>,
    cap: usize,
    waiting: HashMap<u64, S>,
}

impl<T, S> SendSide<T, S> {
    /// A send side whose backlog holds at most `cap` requests.
    pub(crate) fn new(cap: usize) -> Self {
        SendSide {
            backlog: VecDeque::new(),
            cap,
            waiting: HashMap::new(),
        }
    }

    fn full(&self) -> Error {
        Error::QueueFull {
            queue: "backlog",
            depth: u32::try_from(self.cap).unwrap_or(u32::MAX),
        }
    }

    /// Submit request `item` under `id` (unique), its completion to go to `sender`: posted now
    /// through `post` when nothing waits before it, else queued.
    ///
    /// # Errors
    ///
    /// [`Error::QueueFull`] naming the backlog when it is full (and the request found no room);
    /// the error of a failed post. Either way nothing of the request is kept.
    pub(crate) fn submit(
        &mut self,
        id: u64,
        item: T,
        sender: S,
        post: impl FnOnce(u64, T) -> Offer<T>,
    ) -> Result<Placed> {
        if !self.backlog.is_empty() {
            if self.backlog.len() >= self.cap {
                return Err(self.full());
            }
            self.waiting.insert(id, sender);
            self.backlog.push_back((id, item));
            return Ok(Placed::Queued);
        }
        // Waiting before it is posted: its completion may be polled the moment it is.
        self.waiting.insert(id, sender);
        match post(id, item) {
            Offer::Posted => Ok(Placed::Posted),
            Offer::NoRoom(item) if self.cap > 0 => {
                self.backlog.push_back((id, item));
                Ok(Placed::Queued)
            }
            Offer::NoRoom(_) => {
                self.waiting.remove(&id);
                Err(self.full())
            }
            Offer::Failed(e) => {
                self.waiting.remove(&id);
                Err(e)
            }
        }
    }

    /// The sender of the request `id`, whose completion was polled (`None` for an id this side
    /// does not know: a receive's, or one already handed out).
    pub(crate) fn complete(&mut self, id: u64) -> Option<S> {
        self.waiting.remove(&id)
    }

    /// Post from the front of the backlog while `post` takes requests; a request whose post
    /// failed goes to `failed` with its id and sender. Returns how many were posted.
    pub(crate) fn drain(
        &mut self,
        mut post: impl FnMut(u64, T) -> Offer<T>,
        failed: &mut Vec<(u64, S, Error)>,
    ) -> usize {
        let mut posted = 0;
        while let Some((id, item)) = self.backlog.pop_front() {
            match post(id, item) {
                Offer::Posted => posted += 1,
                Offer::NoRoom(item) => {
                    self.backlog.push_front((id, item));
                    break;
                }
                Offer::Failed(e) => {
                    if let Some(s) = self.waiting.remove(&id) {
                        failed.push((id, s, e));
                    }
                }
            }
        }
        posted
    }

    /// Every request still in the backlog, with its sender, in order: none of them reached the
    /// NIC (for a close).
    pub(crate) fn take_backlog(&mut self) -> Vec<(u64, T, S)> {
        let mut out = Vec::with_capacity(self.backlog.len());
        while let Some((id, item)) = self.backlog.pop_front() {
            if let Some(s) = self.waiting.remove(&id) {
                out.push((id, item, s));
            }
        }
        out
    }

    /// Requests submitted and not yet handed out: posted ones and queued ones.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Every sender still waiting (posted or in the backlog), in no order.
    pub(crate) fn senders(&self) -> impl Iterator<Item = &S> {
        self.waiting.values()
    }

    /// Requests in the backlog.
    pub(crate) fn queued(&self) -> usize {
        self.backlog.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A NIC that holds `room` requests; completes them in order.
    struct Nic {
        room: usize,
        posted: VecDeque<u64>,
        /// Every id, in the order it was posted.
        order: Vec<u64>,
        /// Ids whose post fails.
        fail: Vec<u64>,
    }

    impl Nic {
        fn post(&mut self, id: u64, item: u64) -> Offer<u64> {
            assert_eq!(
                id, item,
                "the request posted is the one submitted under that id"
            );
            if self.posted.len() >= self.room {
                return Offer::NoRoom(item);
            }
            if self.fail.contains(&id) {
                return Offer::Failed(Error::errno("ibv_post_send", libc::ENOMEM));
            }
            self.posted.push_back(id);
            self.order.push(id);
            Offer::Posted
        }
    }

    #[test]
    fn a_full_backlog_refuses_and_keeps_nothing() {
        let mut nic = Nic {
            room: 1,
            posted: VecDeque::new(),
            order: vec![],
            fail: vec![],
        };
        let mut s = SendSide::<u64, u64>::new(2);
        assert_eq!(
            s.submit(1, 1, 1, |i, t| nic.post(i, t)).unwrap(),
            Placed::Posted
        );
        assert_eq!(
            s.submit(2, 2, 2, |i, t| nic.post(i, t)).unwrap(),
            Placed::Queued
        );
        assert_eq!(
            s.submit(3, 3, 3, |i, t| nic.post(i, t)).unwrap(),
            Placed::Queued
        );
        let e = s.submit(4, 4, 4, |i, t| nic.post(i, t)).unwrap_err();
        assert!(
            matches!(
                e,
                Error::QueueFull {
                    queue: "backlog",
                    depth: 2
                }
            ),
            "{e}"
        );
        assert_eq!((s.waiting(), s.queued()), (3, 2));
        // A completion frees room: the oldest queued request goes first.
        assert_eq!(nic.posted.pop_front(), Some(1));
        assert_eq!(s.complete(1), Some(1));
        let mut failed = vec![];
        assert_eq!(s.drain(|i, t| nic.post(i, t), &mut failed), 1);
        assert_eq!(nic.order, [1, 2]);
        assert_eq!(s.complete(1), None, "handed out once");
        // A backlog of 0: no room means QueueFull at once.
        let mut s = SendSide::<u64, u64>::new(0);
        let e = s.submit(9, 9, 9, |_, t| Offer::NoRoom(t)).unwrap_err();
        assert!(matches!(e, Error::QueueFull { depth: 0, .. }));
        assert_eq!(s.waiting(), 0);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Submit,
        Complete(usize),
        Room(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => Just(Op::Submit),
            2 => (0usize..6).prop_map(Op::Complete),
            1 => (0usize..6).prop_map(Op::Room),
        ]
    }

    proptest! {
        /// Random submissions, completions and changes of room against a NIC model: requests
        /// reach the NIC in submission order, never more than it holds; the backlog never passes
        /// its bound, and refuses exactly when full; every accepted request is handed out
        /// exactly once (its completion or its failed post), and nothing is left at the end.
        #[test]
        fn requests_are_posted_in_order_and_handed_out_once(
            cap in 0usize..8, room in 1usize..6,
            fail in proptest::collection::vec(0u64..60, 0..4),
            ops in proptest::collection::vec(op(), 1..120),
        ) {
            let mut nic = Nic { room, posted: VecDeque::new(), order: vec![], fail };
            let mut s = SendSide::<u64, u64>::new(cap);
            let mut accepted = vec![];
            let mut handed = vec![];
            let mut failed = vec![];
            let mut next = 0u64;
            let mut max_room = room;
            for op in ops {
                match op {
                    Op::Submit => {
                        next += 1;
                        let id = next;
                        let queued_before = s.queued();
                        let nic_full = nic.posted.len() >= nic.room;
                        match s.submit(id, id, id, |i, t| nic.post(i, t)) {
                            Ok(_) => accepted.push(id),
                            Err(Error::QueueFull { queue: "backlog", .. }) => {
                                prop_assert!(queued_before >= cap || (queued_before == 0 && nic_full && cap == 0));
                            }
                            Err(_) => {
                                prop_assert!(nic.fail.contains(&id));
                            }
                        }
                        prop_assert!(s.queued() <= cap);
                    }
                    Op::Complete(n) => {
                        for _ in 0..n {
                            if let Some(id) = nic.posted.pop_front() {
                                let sender = s.complete(id);
                                prop_assert_eq!(sender, Some(id));
                                handed.push(id);
                            }
                        }
                        s.drain(|i, t| nic.post(i, t), &mut failed);
                    }
                    Op::Room(r) => {
                        nic.room = r.max(1);
                        max_room = max_room.max(nic.room);
                        s.drain(|i, t| nic.post(i, t), &mut failed);
                    }
                }
                prop_assert!(nic.posted.len() <= max_room);
                prop_assert_eq!(s.waiting(), s.queued() + nic.posted.len());
            }
            // Everything completes.
            nic.room = usize::MAX;
            s.drain(|i, t| nic.post(i, t), &mut failed);
            while let Some(id) = nic.posted.pop_front() {
                prop_assert_eq!(s.complete(id), Some(id));
                handed.push(id);
            }
            prop_assert_eq!(s.waiting(), 0);
            // The NIC saw the accepted requests that did not fail, in order.
            let ok: Vec<u64> = accepted.iter().copied().filter(|i| !failed.iter().any(|f: &(u64, u64, Error)| f.0 == *i)).collect();
            prop_assert_eq!(&nic.order, &ok);
            let mut all: Vec<u64> = handed.iter().copied().chain(failed.iter().map(|f| f.1)).collect();
            all.sort_unstable();
            prop_assert_eq!(all, accepted);
        }
    }

    #[test]
    fn a_close_hands_back_the_backlog_in_order() {
        let mut s = SendSide::<u64, u64>::new(8);
        assert_eq!(
            s.submit(1, 1, 10, |_, _| Offer::Posted).unwrap(),
            Placed::Posted
        );
        for id in 2..5 {
            assert_eq!(
                s.submit(id, id, id * 10, |_, t| Offer::NoRoom(t)).unwrap(),
                Placed::Queued
            );
        }
        let back = s.take_backlog();
        assert_eq!(
            back.iter().map(|b| (b.0, b.2)).collect::<Vec<_>>(),
            [(2, 20), (3, 30), (4, 40)]
        );
        assert_eq!(
            (s.waiting(), s.queued()),
            (1, 0),
            "the posted one still waits"
        );
        assert_eq!(s.complete(1), Some(10));
    }
}
