//! The completion word of a stream queue as its requests finish ([`Window`]), the driver's
//! comparison a stream wait makes, and the proxy's pace.

use super::words::STREAM_ERROR_BIT;
use std::collections::BTreeSet;
use std::time::Duration;

/// Armed requests one stream queue holds at once (its trigger words).
pub const TRIGGER_SLOTS: usize = 4096;

/// The longest sleep of the proxy thread between looks at armed trigger words.
pub const PROXY_NAP: Duration = Duration::from_micros(64);

/// The proxy's nap between looks while what it watches is only fences (events recorded after
/// copies the caller's own stream runs) and nobody waits on them: it starts no bytes then, and
/// each look (a driver query) slows the caller's own submissions, which take the driver's locks
/// it takes (docs/transfer.md: 100 µs against 10 µs). A waiter rings it; a waiter's thread
/// finds a lean request's end itself.
pub(super) const FENCE_NAP: Duration = Duration::from_micros(100);

/// Rounds of the proxy's poll that only yield before it sleeps.
pub(super) const SPIN_ROUNDS: u32 = 32;

/// The completion word's slot.
pub(super) const DONE: usize = 0;

/// The trigger slot of `seq`.
pub(super) fn trigger_slot(seq: u64) -> usize {
    1 + (seq % TRIGGER_SLOTS as u64) as usize
}

/// The pause after `idle` rounds without progress: `None` to yield, else a sleep doubling from
/// one microsecond up to [`PROXY_NAP`].
pub(crate) fn proxy_pause(idle: u32) -> Option<Duration> {
    if idle < SPIN_ROUNDS {
        return None;
    }
    let shift = (idle - SPIN_ROUNDS).min(16);
    Some(Duration::from_micros(1u64 << shift).min(PROXY_NAP))
}

/// The completion word of a queue as requests finish, in any order (a pure function of the
/// finishes so far).
#[derive(Debug, Default, Clone)]
pub(crate) struct Window {
    /// Every request up to this one finished successfully.
    ok: u64,
    /// The first request that failed.
    failed: Option<u64>,
    /// Successes past `ok` (waiting for a gap to close).
    ahead: BTreeSet<u64>,
}

impl Window {
    /// Request `seq` (from 1) finished; the word to publish.
    pub(crate) fn finish(&mut self, seq: u64, ok: bool) -> u64 {
        if ok {
            if seq == self.ok + 1 && self.ahead.is_empty() {
                // In order, nothing ahead: the common case, no set touched.
                self.ok = seq;
                return self.word();
            }
            if seq > self.ok {
                self.ahead.insert(seq);
            }
            while self.ahead.remove(&(self.ok + 1)) {
                self.ok += 1;
            }
        } else {
            self.failed = Some(self.failed.map_or(seq, |f| f.min(seq)));
        }
        self.word()
    }

    /// The word: `ok`, with [`STREAM_ERROR_BIT`] once a request failed.
    pub(crate) fn word(&self) -> u64 {
        self.ok
            | if self.failed.is_some() {
                STREAM_ERROR_BIT
            } else {
                0
            }
    }

    /// The first failed request.
    pub(crate) fn failed(&self) -> Option<u64> {
        self.failed
    }
}

/// Whether the driver's `cuStreamWaitValue64(GEQ, value)` lets a stream pass `word`: the
/// cyclic comparison `(int64_t)(word - value) >= 0`.
pub(crate) fn geq_releases(word: u64, value: u64) -> bool {
    (word.wrapping_sub(value) as i64) >= 0
}

#[cfg(test)]
mod tests {
    use super::super::words::MAX_SEQ;
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_word_advances_in_order_only() {
        let mut w = Window::default();
        assert_eq!(w.finish(2, true), 0);
        assert_eq!(w.finish(3, true), 0);
        assert_eq!(w.finish(1, true), 3);
        assert_eq!(w.finish(5, true), 3);
        assert_eq!(w.finish(4, true), 5);
    }

    #[test]
    fn a_failure_sets_the_bit_and_freezes_the_prefix() {
        let mut w = Window::default();
        assert_eq!(w.finish(1, true), 1);
        assert_eq!(w.finish(3, false), 1 | STREAM_ERROR_BIT);
        assert_eq!(w.finish(2, true), 2 | STREAM_ERROR_BIT);
        assert_eq!(w.finish(4, true), 2 | STREAM_ERROR_BIT);
        assert_eq!(w.failed(), Some(3));
    }

    #[test]
    fn the_error_bit_releases_every_wait_and_bit_63_would_not() {
        for seq in [1u64, 2, 1000, MAX_SEQ] {
            assert!(geq_releases(STREAM_ERROR_BIT, seq), "{seq}");
            assert!(geq_releases(seq | STREAM_ERROR_BIT, seq));
            assert!(!geq_releases(seq - 1, seq));
            // The driver's GEQ is cyclic: bit 63 makes the difference negative.
            assert!(!geq_releases(seq | (1 << 63), seq));
        }
    }

    #[test]
    fn the_proxy_sleeps_at_most_its_nap() {
        assert_eq!(proxy_pause(0), None);
        assert_eq!(proxy_pause(SPIN_ROUNDS - 1), None);
        assert_eq!(proxy_pause(SPIN_ROUNDS), Some(Duration::from_micros(1)));
        assert_eq!(proxy_pause(SPIN_ROUNDS + 3), Some(Duration::from_micros(8)));
        assert_eq!(proxy_pause(u32::MAX), Some(PROXY_NAP));
    }

    proptest! {
        /// Requests finishing in any order, some failing: the word only grows (also as the
        /// driver compares), its low bits are exactly the successful prefix, the bit is set
        /// iff something failed, and a wait for `s` is released iff every request up to `s`
        /// succeeded or something failed.
        #[test]
        fn words_follow_the_prefix_in_any_order(
            order in Just((1u64..=64).collect::<Vec<u64>>()).prop_shuffle(),
            fails in proptest::collection::vec(any::<bool>(), 64),
            fail_rate in 0u8..4,
        ) {
            let mut w = Window::default();
            let failing = |s: u64| fail_rate == 0 && fails[(s - 1) as usize];
            let mut finished = BTreeSet::new();
            let mut last = 0u64;
            for &s in &order {
                let word = w.finish(s, !failing(s));
                finished.insert(s);
                prop_assert!(word >= last && geq_releases(word, last));
                last = word;
                let mut prefix = 0;
                while finished.contains(&(prefix + 1)) && !failing(prefix + 1) {
                    prefix += 1;
                }
                let any_failed = finished.iter().any(|&f| failing(f));
                prop_assert_eq!(word & !STREAM_ERROR_BIT, prefix);
                prop_assert_eq!(word & STREAM_ERROR_BIT != 0, any_failed);
                for q in 1..=64u64 {
                    prop_assert_eq!(geq_releases(word, q), q <= prefix || any_failed);
                }
            }
        }
    }
}
