//! The arithmetic of a transfer, as pure functions: how a request is cut into messages and spread
//! over rails, how many messages a rail may have outstanding, the notification credits, and which
//! rails a GPU prefers.

use crate::error::{Error, Result};
use crate::topology::Affinity;
use smallvec::SmallVec;

/// Stripe units are multiples of this many bytes.
pub(crate) const STRIPE_ALIGN: u64 = 4096;

/// The most messages one request may be cut into.
pub(crate) const MAX_MESSAGES: u64 = 1 << 22;

pub(crate) use crate::completion::deadline_after;

/// One message of a planned request: `len` bytes at `offset` into pair `pair`, on rail `rail`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub(crate) pair: usize,
    pub(crate) offset: u64,
    pub(crate) len: u32,
    pub(crate) rail: usize,
    /// The request's last message on its rail: signaled, so its completion covers the others.
    pub(crate) last_on_rail: bool,
    /// Carries the notification (write with immediate): the request's last message, on the
    /// notification rail, posted only once the messages on other rails have completed.
    pub(crate) imm: bool,
}

/// A request's messages, in order (a small request's on the stack).
pub(crate) type Chunks = SmallVec<[Chunk; 4]>;

/// What a request is planned from.
#[derive(Debug, Clone)]
pub(crate) struct PlanInput<'a> {
    /// Bytes of each (local, remote) pair, in order.
    pub(crate) lens: &'a [u64],
    /// The largest message, in bytes (at least 1).
    pub(crate) max_message: u32,
    /// Rails the request may use (positions of the endpoint's rails), at least one.
    pub(crate) rails: &'a [usize],
    /// Requests of at least this many bytes are striped over `rails`.
    pub(crate) stripe_min: u64,
    /// The notification rail, when the request carries a notification.
    pub(crate) notify_rail: Option<usize>,
    /// Which of `rails` an unstriped request without notification takes (round robin).
    pub(crate) turn: usize,
}

/// Cut a request into messages: every byte of every pair exactly once, in order, each message
/// at most `max_message` bytes. Requests of at least `stripe_min` bytes on several rails are cut
/// into stripe units (the share of each rail, rounded up to 4 KiB, at most `max_message`) given
/// to the rail with the fewest bytes so far; others go whole to one rail. With a notification,
/// the last message carries it on the notification rail.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for no pairs, an empty pair, no rails, a zero `max_message`, or
/// byte counts whose sum overflows.
pub(crate) fn plan(inp: &PlanInput<'_>) -> Result<Chunks> {
    if inp.lens.is_empty() {
        return Err(Error::invalid(
            "pairs",
            0,
            "a request moves at least one range",
        ));
    }
    if inp.rails.is_empty() {
        return Err(Error::invalid("rails", 0, "a request needs a rail"));
    }
    if inp.max_message == 0 {
        return Err(Error::invalid(
            "max_message",
            0,
            "a message holds at least one byte",
        ));
    }
    let mut total = 0u64;
    for (i, &l) in inp.lens.iter().enumerate() {
        if l == 0 {
            return Err(Error::invalid(
                "pairs",
                i,
                "a range holds at least one byte",
            ));
        }
        total = total.checked_add(l).ok_or_else(|| {
            Error::invalid("pairs", inp.lens.len(), "the byte counts add up past 2^64")
        })?;
    }
    let max = inp.max_message as u64;
    let n = inp.rails.len() as u64;
    let striped = n > 1 && total >= inp.stripe_min;
    let unit = if striped {
        // ceil(total / n) rounded up to STRIPE_ALIGN, within 1..=max.
        let share = total.div_ceil(n);
        share
            .div_ceil(STRIPE_ALIGN)
            .saturating_mul(STRIPE_ALIGN)
            .clamp(1, max)
    } else {
        max
    };
    // One message per unit at most; refused before anything is built when that is absurd.
    let per_pair_max = inp.lens.iter().map(|l| l.div_ceil(unit)).sum::<u64>();
    if per_pair_max > MAX_MESSAGES {
        return Err(Error::invalid(
            "pairs",
            format!("{total} bytes"),
            format!("more than {MAX_MESSAGES} messages of at most {unit} bytes"),
        ));
    }
    let single = match inp.notify_rail {
        Some(r) => r,
        None => inp.rails[inp.turn % inp.rails.len()],
    };
    let mut load: SmallVec<[u64; 8]> = smallvec::smallvec![0u64; inp.rails.len()];
    // A striped notification's last message goes to the notification rail: count it there
    // from the start, so the others balance around it.
    let pinned = match (striped, inp.notify_rail) {
        (true, Some(r)) => inp.rails.iter().position(|&x| x == r),
        _ => None,
    };
    let last_pair = inp.lens.len() - 1;
    let last_len = (inp.lens[last_pair] - 1) % unit + 1;
    if let Some(k) = pinned {
        load[k] += last_len;
    }
    let mut out = Chunks::new();
    for (pair, &l) in inp.lens.iter().enumerate() {
        let mut off = 0u64;
        while off < l {
            let len = (l - off).min(unit);
            let is_last = pair == last_pair && off + len == l;
            let rail = if let (true, Some(k)) = (is_last, pinned) {
                inp.rails[k]
            } else if striped {
                // The least loaded rail; ties go to the earlier one.
                let (k, _) = load
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, b)| **b)
                    .expect("at least one rail");
                load[k] += len;
                inp.rails[k]
            } else {
                single
            };
            out.push(Chunk {
                pair,
                offset: off,
                // len <= unit <= max_message (a u32).
                len: len as u32,
                rail,
                last_on_rail: false,
                imm: false,
            });
            off += len;
        }
    }
    if let Some(r) = inp.notify_rail {
        let last = out.last_mut().expect("at least one chunk");
        last.rail = r;
        last.imm = true;
    }
    let mut seen: SmallVec<[usize; 8]> = SmallVec::new();
    for c in out.iter_mut().rev() {
        if !seen.contains(&c.rail) {
            seen.push(c.rail);
            c.last_on_rail = true;
        }
    }
    Ok(out)
}

/// How many messages one rail may have outstanding: at most its send-queue depth, and at most
/// its send completion queue's capacity less the entry the queue pair keeps for its teardown.
/// Every message posted holds an entry of both until a completion covering it is polled, so
/// posting within the window never finds either full.
pub(crate) fn send_window(sq_depth: u32, send_cq_capacity: u32) -> u32 {
    sq_depth.min(send_cq_capacity.saturating_sub(1))
}

/// Notification credits of one endpoint's notification rail: how many receives the peer has
/// posted for our messages (notifications and credit returns), and how many of ours we have
/// posted again since we last told the peer. Every message that consumes a receive is sent only
/// against a credit, so the peer never sees one without a receive posted (no receiver-not-ready
/// retries). One credit is kept back for returning credits, which is what keeps both sides from
/// waiting on each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Credits {
    /// Receives the peer has posted for us that we have not used.
    peer: u32,
    /// The most the peer may hold for us (its depth).
    peer_depth: u32,
    /// Our receives, used by the peer and posted again, not yet reported to it.
    owed: u32,
    /// Report once this many are owed.
    threshold: u32,
}

impl Credits {
    /// `peer_depth`: receives the peer posted for us; `my_depth`: ours for it (both at least 4:
    /// returns go once half, and at least 2, are owed, so a return never answers a return at
    /// once, and a notification always finds 2 credits once the other side has returned).
    pub(crate) fn new(peer_depth: u32, my_depth: u32) -> Self {
        Credits {
            peer: peer_depth,
            peer_depth,
            owed: 0,
            threshold: (my_depth / 2).max(2),
        }
    }

    /// Whether a notification may be sent now (one credit stays for returns).
    pub(crate) fn can_notify(&self) -> bool {
        self.peer >= 2
    }

    /// Spend a credit on a notification ([`can_notify`](Self::can_notify) must have said yes).
    pub(crate) fn take_notify(&mut self) {
        debug_assert!(self.can_notify());
        self.peer = self.peer.saturating_sub(1);
    }

    /// The peer used one of our receives; we posted it again.
    pub(crate) fn on_received(&mut self) {
        self.owed = self.owed.saturating_add(1);
    }

    /// If enough are owed and a credit is there to carry the message: the count to return
    /// (the credit is spent, the count reset).
    pub(crate) fn take_return(&mut self) -> Option<u32> {
        if self.owed >= self.threshold && self.peer >= 1 {
            self.peer -= 1;
            Some(std::mem::take(&mut self.owed))
        } else {
            None
        }
    }

    /// Spend a credit on a control message, if one is there (like a return, it may take the
    /// last one).
    pub(crate) fn take_control(&mut self) -> bool {
        if self.peer >= 1 {
            self.peer -= 1;
            true
        } else {
            false
        }
    }

    /// The peer returned `n` credits (an untrusted count).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the count would give more credits than the peer has
    /// receives posted: the peer is not following the protocol.
    pub(crate) fn on_returned(&mut self, n: u32) -> Result<()> {
        match self.peer.checked_add(n) {
            Some(p) if p <= self.peer_depth => {
                self.peer = p;
                Ok(())
            }
            _ => Err(Error::invalid(
                "credits",
                n,
                format!(
                    "the peer returned more receive credits than it posted ({} held of {})",
                    self.peer, self.peer_depth
                ),
            )),
        }
    }

    /// Credits held now.
    #[cfg(test)]
    pub(crate) fn held(&self) -> u32 {
        self.peer
    }
}

/// The rails a GPU prefers, from each rail's affinity to it: those of the nearest class known;
/// every rail when none is known (software devices, a host without the PCIe tree in sysfs).
pub(crate) fn preferred_rails(affinity: &[Affinity]) -> Vec<usize> {
    let best = affinity.iter().copied().min();
    match best {
        Some(b) if b != Affinity::Unknown => {
            (0..affinity.len()).filter(|&i| affinity[i] == b).collect()
        }
        _ => (0..affinity.len()).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;
    use std::time::{Duration, Instant};

    #[test]
    fn a_striped_request_spreads_and_notifies_last_on_its_rail() {
        let lens = [4 << 20];
        let c = plan(&PlanInput {
            lens: &lens,
            max_message: 1 << 20,
            rails: &[0, 1],
            stripe_min: 256 << 10,
            notify_rail: Some(0),
            turn: 0,
        })
        .unwrap();
        assert_eq!(c.len(), 4);
        let on = |r| {
            c.iter()
                .filter(|x| x.rail == r)
                .map(|x| x.len as u64)
                .sum::<u64>()
        };
        assert_eq!((on(0), on(1)), (2 << 20, 2 << 20));
        assert!(c[3].imm && c[3].rail == 0 && c[3].last_on_rail);
        // Small and unstriped: one rail, round robin without notification.
        let c = plan(&PlanInput {
            lens: &[100, 200],
            max_message: 150,
            rails: &[0, 1],
            stripe_min: 1 << 20,
            notify_rail: None,
            turn: 1,
        })
        .unwrap();
        assert!(c.iter().all(|x| x.rail == 1));
        assert_eq!(
            c.iter().map(|x| x.len).collect::<Vec<_>>(),
            vec![100, 150, 50]
        );
    }

    #[test]
    fn deadlines_of_any_timeout_are_instants() {
        // A caller's `Duration::MAX` (a request's deadline, the engine's connect timeout, an
        // accept's wait) must not panic ("overflow when adding duration to instant"): the
        // staged path's worker thread panicked there and its transfer never finished.
        let now = Instant::now();
        for t in [
            Duration::MAX,
            Duration::from_secs(u64::MAX),
            Duration::from_secs(1 << 40),
        ] {
            let d = deadline_after(now, t);
            assert!(d > now + Duration::from_secs(100 * 365 * 86400), "{t:?}");
        }
        assert_eq!(
            deadline_after(now, Duration::from_secs(3)),
            now + Duration::from_secs(3)
        );
    }

    #[test]
    fn preferred_rails_are_the_nearest_known() {
        use Affinity::*;
        assert_eq!(
            preferred_rails(&[AcrossCpu, SamePcieSwitch, SamePcieSwitch]),
            vec![1, 2]
        );
        assert_eq!(preferred_rails(&[Unknown, Unknown]), vec![0, 1]);
        assert_eq!(preferred_rails(&[Unknown, SameNumaNode]), vec![1]);
        assert_eq!(preferred_rails(&[]), Vec::<usize>::new());
    }

    proptest! {
        /// Any request: every byte exactly once and in order, messages within the largest
        /// message, rails from the allowed set, balanced within one unit when striped, one
        /// signaled last message per rail used, the notification last on its rail.
        #[test]
        fn plans_cover_every_byte_once(
            lens in proptest::collection::vec(prop_oneof![1u64..200, 1u64..(3 << 20)], 1..6),
            max_message in prop_oneof![1u32..64, 4096u32..(2 << 20)],
            nrails in 1usize..5, stripe_min in 0u64..(8 << 20),
            notify in any::<bool>(), turn in any::<usize>(),
        ) {
            prop_assume!(lens.iter().map(|l| l.div_ceil(max_message as u64)).sum::<u64>() <= 100_000);
            let rails: Vec<usize> = (0..nrails).map(|i| i * 3 + 1).collect();
            let notify_rail = notify.then_some(rails[0]);
            let c = plan(&PlanInput {
                lens: &lens, max_message, rails: &rails, stripe_min, notify_rail, turn,
            }).unwrap();
            let mut next = vec![0u64; lens.len()];
            let mut last_pair = 0;
            for x in &c {
                prop_assert!(x.len >= 1 && x.len <= max_message);
                prop_assert!(rails.contains(&x.rail));
                prop_assert!(x.pair >= last_pair);
                last_pair = x.pair;
                prop_assert_eq!(x.offset, next[x.pair]);
                next[x.pair] += x.len as u64;
            }
            prop_assert_eq!(&next, &lens);
            for r in &rails {
                let mine: Vec<_> = c.iter().filter(|x| x.rail == *r).collect();
                let lasts = mine.iter().filter(|x| x.last_on_rail).count();
                prop_assert_eq!(lasts, usize::from(!mine.is_empty()));
                if let Some(l) = mine.last() { prop_assert!(l.last_on_rail); }
            }
            prop_assert_eq!(c.iter().filter(|x| x.imm).count(), usize::from(notify));
            if notify {
                let l = c.last().unwrap();
                prop_assert!(l.imm && l.rail == rails[0]);
            }
            let total: u64 = lens.iter().sum();
            if nrails > 1 && total >= stripe_min {
                let loads: Vec<u64> = rails.iter()
                    .map(|r| c.iter().filter(|x| x.rail == *r).map(|x| x.len as u64).sum())
                    .collect();
                let unit = c.iter().map(|x| x.len as u64).max().unwrap();
                let (lo, hi) = (loads.iter().min().unwrap(), loads.iter().max().unwrap());
                // Greedy balance within one unit, plus the notification moved to its rail.
                prop_assert!(hi - lo <= 2 * unit, "{:?} unit {}", loads, unit);
            } else {
                let r0 = c[0].rail;
                prop_assert!(c.iter().all(|x| x.rail == r0));
            }
        }

        /// Bad input of any shape: a typed refusal, never a panic or a wrapped sum.
        #[test]
        fn bad_plans_are_refused(
            lens in proptest::collection::vec(prop_oneof![Just(0u64), Just(u64::MAX), any::<u64>()], 0..4),
            max_message in prop_oneof![Just(0u32), any::<u32>()],
            nrails in 0usize..3,
        ) {
            let rails: Vec<usize> = (0..nrails).collect();
            let r = plan(&PlanInput {
                lens: &lens, max_message, rails: &rails, stripe_min: 0, notify_rail: None, turn: 0,
            });
            let sum = lens.iter().try_fold(0u64, |a, &l| a.checked_add(l));
            let ok = !lens.is_empty() && lens.iter().all(|&l| l > 0) && nrails > 0
                && max_message > 0 && sum.is_some();
            if !ok {
                let refused = matches!(r, Err(Error::InvalidArgument { .. }));
                prop_assert!(refused);
            } else if sum.unwrap() / max_message as u64 <= 1 << 16 {
                prop_assert!(r.is_ok());
            }
        }

        /// The window never lets a rail post more than its send queue or send completion queue
        /// (less the teardown entry) holds.
        #[test]
        fn the_window_fits_both_queues(sq in any::<u32>(), cq in any::<u32>()) {
            let w = send_window(sq, cq);
            prop_assert!(w <= sq);
            prop_assert!((w as u64) < (cq as u64).max(1));
            if sq >= 1 && cq >= 2 { prop_assert!(w >= 1); }
        }

        /// Two peers notifying each other at random, their messages delivered in order at random
        /// times: every message finds a receive posted (no receiver-not-ready), credits never
        /// exceed what the peer posted, and once the wire drains, each side can notify again.
        #[test]
        fn credits_never_overrun_and_never_deadlock(
            da in 4u32..12, db in 4u32..12,
            steps in proptest::collection::vec((0u8..4, any::<bool>()), 1..300),
        ) {
            // side[i]: its credits towards the other; posted[i]: receives it has posted.
            let mut side = [Credits::new(db, da), Credits::new(da, db)];
            let mut posted = [da, db];
            // In flight towards side i: Some(n) a credit return, None a notification.
            let mut wire: [VecDeque<Option<u32>>; 2] = [VecDeque::new(), VecDeque::new()];
            let deliver = |i: usize, side: &mut [Credits; 2], posted: &mut [u32; 2],
                           wire: &mut [VecDeque<Option<u32>>; 2]| -> Result<(), TestCaseError> {
                if let Some(m) = wire[i].pop_front() {
                    prop_assert!(posted[i] >= 1, "a message found no receive posted");
                    posted[i] -= 1;
                    posted[i] += 1; // posted again at once
                    side[i].on_received();
                    if let Some(n) = m {
                        prop_assert!(side[i].on_returned(n).is_ok());
                    }
                }
                Ok(())
            };
            for (what, who) in steps {
                let i = usize::from(who);
                let o = 1 - i;
                match what {
                    0 => if side[i].can_notify() {
                        side[i].take_notify();
                        wire[o].push_back(None);
                    },
                    1 => deliver(i, &mut side, &mut posted, &mut wire)?,
                    _ => if let Some(n) = side[i].take_return() {
                        wire[o].push_back(Some(n));
                    },
                }
                for k in 0..2 {
                    let depth = if k == 0 { db } else { da };
                    prop_assert!(side[k].held() <= depth);
                    // Credits held plus messages in flight never exceed the peer's receives.
                    prop_assert!(side[k].held() as usize + wire[1 - k].len() <= depth as usize);
                }
            }
            // Drain: deliver and return until quiet; then both can notify.
            for _ in 0..1000 {
                for i in 0..2 {
                    deliver(i, &mut side, &mut posted, &mut wire)?;
                    if let Some(n) = side[i].take_return() { wire[1 - i].push_back(Some(n)); }
                }
                if wire[0].is_empty() && wire[1].is_empty() { break; }
            }
            prop_assert!(wire[0].is_empty() && wire[1].is_empty());
            prop_assert!(side[0].can_notify() && side[1].can_notify(), "{:?}", side);
        }

        /// A peer returning more than it could: refused, credits unchanged.
        #[test]
        fn over_returns_are_refused(depth in 4u32..100, spent in 0u32..100, n in any::<u32>()) {
            let mut c = Credits::new(depth, depth);
            for _ in 0..spent.min(depth - 2) { c.take_notify(); }
            let before = c.held();
            let r = c.on_returned(n);
            prop_assert_eq!(r.is_ok(), before as u64 + n as u64 <= depth as u64);
            if r.is_err() { prop_assert_eq!(c.held(), before); }
        }
    }
}
