//! The one back-off for everything that polls for completion.

use std::time::{Duration, Instant};

/// Waits at least this long block in the driver (`cuEventSynchronize`, `cuStreamSynchronize`)
/// instead of polling.
pub(crate) const LONG_WAIT: Duration = Duration::from_secs(3600);

/// Pauses between polls that grow from 1 µs to 1 ms, doubling: below 50 µs the thread only
/// yields, longer pauses sleep.
#[derive(Debug)]
pub(crate) struct Backoff {
    nap: Duration,
}

impl Backoff {
    /// The shortest pause first.
    pub(crate) fn new() -> Self {
        Backoff {
            nap: Duration::from_micros(1),
        }
    }

    /// Pause once, and lengthen the next pause.
    pub(crate) fn snooze(&mut self) {
        if self.nap < Duration::from_micros(50) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(self.nap);
        }
        self.nap = (self.nap * 2).min(Duration::from_millis(1));
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
