//! The one back-off for everything that polls for completion.

use std::time::{Duration, Instant};

/// Waits at least this long block in the driver (`cuEventSynchronize`, `cuStreamSynchronize`)
/// instead of polling.
pub(crate) const LONG_WAIT: Duration = Duration::from_secs(3600);

/// For this long after a start (or [`Backoff::reset`]) the pauses only yield the thread: a
/// completion that comes within it is seen within a poll, not after a sleep.
const YIELD_FOR: Duration = Duration::from_micros(64);

/// The first sleep after the yielding phase; each next one doubles.
const FIRST_NAP: Duration = Duration::from_micros(64);

/// The longest pause.
pub(crate) const MAX_NAP: Duration = Duration::from_millis(1);

/// Pauses between polls: only yields for the first [`YIELD_FOR`] of wall time, then sleeps that
/// grow from 64 µs to 1 ms, doubling.
#[derive(Debug)]
pub(crate) struct Backoff {
    since: Instant,
    nap: Duration,
}

/// One pause of a [`Backoff`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pause {
    /// Yield the thread once.
    Yield,
    /// Sleep this long (or less, when woken for new work).
    Sleep(Duration),
}

impl Backoff {
    /// The yielding phase first.
    pub(crate) fn new() -> Self {
        Backoff {
            since: Instant::now(),
            nap: FIRST_NAP,
        }
    }

    /// Start again with the yielding phase (progress was made: more is likely soon).
    pub(crate) fn reset(&mut self) {
        *self = Backoff::new();
    }

    /// Whether the yielding phase is still on.
    pub(crate) fn yielding(&self) -> bool {
        self.since.elapsed() < YIELD_FOR
    }

    /// The next pause, lengthening the one after it once the yielding phase is over; for a
    /// caller that pauses its own way (the completion thread sleeps on a condition variable so
    /// that new work wakes it).
    pub(crate) fn next(&mut self) -> Pause {
        if self.yielding() {
            return Pause::Yield;
        }
        let pause = Pause::Sleep(self.nap);
        self.nap = (self.nap * 2).min(MAX_NAP);
        pause
    }

    /// Pause once, and lengthen the next pause.
    pub(crate) fn snooze(&mut self) {
        match self.next() {
            Pause::Yield => std::thread::yield_now(),
            Pause::Sleep(d) => std::thread::sleep(d),
        }
    }
}

/// Ask `done` with [`Backoff`] pauses until it answers `true` (then `true`) or `timeout` has
/// passed (then `false`). `done` is asked at least once.
pub(crate) fn poll_until(mut done: impl FnMut() -> bool, timeout: Duration) -> bool {
    let start = Instant::now();
    let mut backoff = Backoff::new();
    loop {
        if done() {
            return true;
        }
        if start.elapsed() >= timeout {
            return false;
        }
        backoff.snooze();
    }
}

/// `start + timeout`: the instant a wait that began at `start` ends. A timeout of more than a
/// century counts as a century (an `Instant` cannot hold every `Duration`: a plain addition
/// panics for `Duration::MAX`). Every wait of the crate with a caller's timeout uses it.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))] // rdma_cm's and the transfer engine's waits
pub(crate) fn deadline_after(start: Instant, timeout: Duration) -> Instant {
    start + timeout.min(Duration::from_secs(1 << 32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_grow_to_a_millisecond() {
        let mut b = Backoff::new();
        while b.yielding() {
            b.snooze();
        }
        // 64 µs, then doubling: the sixth sleep is the first of 1 ms.
        for _ in 0..6 {
            b.snooze();
        }
        assert_eq!(b.nap, MAX_NAP);
    }

    #[test]
    fn pauses_yield_for_a_while_then_sleep_and_reset() {
        // Taken before the back-off starts its clock: it yields until its own 64 µs passed.
        let start = Instant::now();
        let mut b = Backoff::new();
        let mut yields = 0;
        while b.next() == Pause::Yield {
            yields += 1;
            std::thread::yield_now();
        }
        assert!(
            start.elapsed() >= YIELD_FOR,
            "yielded only {:?}",
            start.elapsed()
        );
        assert!(yields > 0);
        let pauses: Vec<Pause> = (0..5).map(|_| b.next()).collect();
        // The first sleep was taken by the loop's last `next`: 128 µs on, capped at 1 ms.
        assert_eq!(pauses[0], Pause::Sleep(Duration::from_micros(128)));
        assert_eq!(pauses[4], Pause::Sleep(MAX_NAP));
        b.reset();
        assert_eq!(b.next(), Pause::Yield);
    }

    #[test]
    fn polls_until_done_or_timeout() {
        let mut n = 0;
        assert!(poll_until(
            || {
                n += 1;
                n == 5
            },
            Duration::from_secs(10)
        ));
        assert_eq!(n, 5);
        let mut asked = 0;
        assert!(!poll_until(
            || {
                asked += 1;
                false
            },
            Duration::ZERO
        ));
        assert_eq!(asked, 1, "asked once even with no time at all");
    }
}
