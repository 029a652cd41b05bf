//! The one back-off for everything that polls for completion.

use std::time::{Duration, Instant};

/// Waits at least this long block in the driver (`cuEventSynchronize`, `cuStreamSynchronize`)
/// instead of polling.
pub(crate) const LONG_WAIT: Duration = Duration::from_secs(3600);

/// Pauses below this only yield the thread; longer ones sleep.
const YIELD_BELOW: Duration = Duration::from_micros(50);

/// The longest pause.
pub(crate) const MAX_NAP: Duration = Duration::from_millis(1);

/// Pauses between polls that grow from 1 µs to 1 ms, doubling: below 50 µs the thread only
/// yields, longer pauses sleep.
#[derive(Debug)]
pub(crate) struct Backoff {
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
    /// The shortest pause first.
    pub(crate) fn new() -> Self {
        Backoff {
            nap: Duration::from_micros(1),
        }
    }

    /// Start again from the shortest pause (progress was made: more is likely soon).
    pub(crate) fn reset(&mut self) {
        self.nap = Duration::from_micros(1);
    }

    /// The next pause, lengthening the one after it; for a caller that pauses its own way (the
    /// completion thread sleeps on a condition variable so that new work wakes it).
    pub(crate) fn next(&mut self) -> Pause {
        let pause = if self.nap < YIELD_BELOW {
            Pause::Yield
        } else {
            Pause::Sleep(self.nap)
        };
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
        for _ in 0..20 {
            b.snooze();
        }
        assert_eq!(b.nap, Duration::from_millis(1));
    }

    #[test]
    fn pauses_yield_first_then_sleep_and_reset() {
        let mut b = Backoff::new();
        let pauses: Vec<Pause> = (0..12).map(|_| b.next()).collect();
        // 1, 2, 4, 8, 16, 32 µs yield; 64 µs on sleep, capped at 1 ms.
        assert!(pauses[..6].iter().all(|p| *p == Pause::Yield), "{pauses:?}");
        assert_eq!(pauses[6], Pause::Sleep(Duration::from_micros(64)));
        assert_eq!(pauses[11], Pause::Sleep(MAX_NAP));
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
