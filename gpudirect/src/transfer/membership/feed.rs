//! A one-consumer queue of events from a store's side (a thread or a task) to whoever watches:
//! a blocking look with a timeout, and a waker for a `Stream`. The consumer dropping it tells
//! the producer to stop; the producer ending (or overflowing it) ends the consumer's stream
//! with an error.

use crate::error::Error;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::Waker;
use std::time::{Duration, Instant};

/// Events kept for a consumer that does not read (beyond a watch's first list, which
/// [`Sender::start`] queues): past this the watch ends with an error.
pub(super) const MAX_QUEUED: usize = 1 << 16;

struct State<T> {
    items: VecDeque<T>,
    /// Items held before the queue overflows: [`MAX_QUEUED`], and the first list's items not
    /// yet read.
    room: usize,
    waker: Option<Waker>,
    /// The consumer is gone.
    dropped: bool,
    /// The producer ended: the consumer gets this once the items are read.
    ended: Option<Error>,
}

struct Shared<T> {
    state: Mutex<State<T>>,
    cv: Condvar,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The producer's end.
pub(super) struct Sender<T> {
    shared: Arc<Shared<T>>,
}

/// The consumer's end.
pub(super) struct Receiver<T> {
    shared: Arc<Shared<T>>,
}

/// A new queue.
pub(super) fn channel<T>() -> (Sender<T>, Receiver<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            items: VecDeque::new(),
            room: MAX_QUEUED,
            waker: None,
            dropped: false,
            ended: None,
        }),
        cv: Condvar::new(),
    });
    (
        Sender {
            shared: shared.clone(),
        },
        Receiver { shared },
    )
}

impl<T> Sender<T> {
    /// Queue `items`; `false` when the consumer is gone or the queue ended (then stop).
    pub(super) fn send_all(&self, items: impl IntoIterator<Item = T>) -> bool {
        let waker = {
            let mut st = self.shared.lock();
            if st.dropped || st.ended.is_some() {
                return false;
            }
            st.items.extend(items);
            if st.items.len() > st.room {
                st.items.clear();
                st.ended = Some(overflow());
            }
            st.waker.take()
        };
        self.shared.cv.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
        true
    }

    /// Queue a watch's first list (every live member, as many as the store holds): the queue
    /// then holds [`MAX_QUEUED`] events more than it before it overflows.
    pub(super) fn start(&self, items: Vec<T>) -> bool {
        {
            let mut st = self.shared.lock();
            st.room = MAX_QUEUED.saturating_add(items.len());
        }
        self.send_all(items)
    }

    /// Queue `item`; as [`send_all`](Self::send_all).
    pub(super) fn send(&self, item: T) -> bool {
        self.send_all([item])
    }

    /// Whether the consumer is gone.
    #[cfg_attr(
        not(feature = "etcd"),
        allow(dead_code, reason = "the etcd store's tasks ask")
    )]
    pub(super) fn closed(&self) -> bool {
        let st = self.shared.lock();
        st.dropped || st.ended.is_some()
    }

    /// End the queue with `why` (read after the items queued).
    pub(super) fn end(&self, why: Error) {
        let waker = {
            let mut st = self.shared.lock();
            if st.ended.is_none() {
                st.ended = Some(why);
            }
            st.waker.take()
        };
        self.shared.cv.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        self.end(Error::Store {
            store: "watch",
            op: "watch",
            reason: "the store stopped watching (it was dropped or its runtime ended)".into(),
        });
    }
}

/// `timeout` from now; far in the future when that overflows.
pub(super) fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(1 << 30))
}

fn overflow() -> Error {
    Error::Store {
        store: "watch",
        op: "watch",
        reason: format!("more than {MAX_QUEUED} events were not read"),
    }
}

/// What one look found.
pub(super) enum Got<T> {
    Item(T),
    /// The queue ended: this error, once (then [`Got::Done`]).
    Ended(Error),
    Done,
    Empty,
}

impl<T> Receiver<T> {
    fn take(st: &mut State<T>) -> Got<T> {
        if let Some(i) = st.items.pop_front() {
            // The room the first list made goes as it is read.
            st.room = st.room.saturating_sub(1).max(MAX_QUEUED);
            return Got::Item(i);
        }
        match st.ended.take() {
            Some(e) => {
                // Ended once: the next look says done.
                st.dropped = true;
                Got::Ended(e)
            }
            None if st.dropped => Got::Done,
            None => Got::Empty,
        }
    }

    /// The next item, waiting up to `timeout`.
    pub(super) fn recv(&self, timeout: Duration) -> Got<T> {
        let until = deadline_after(timeout);
        let mut st = self.shared.lock();
        loop {
            match Self::take(&mut st) {
                Got::Empty => {}
                g => return g,
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Got::Empty;
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The next item without waiting; with none, `waker` is woken at the next.
    pub(super) fn poll(&self, waker: &Waker) -> Got<T> {
        let mut st = self.shared.lock();
        let g = Self::take(&mut st);
        if matches!(g, Got::Empty) {
            st.waker = Some(waker.clone());
        }
        g
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.dropped = true;
        st.items.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_then_the_end() {
        let (tx, rx) = channel();
        assert!(tx.send(1) && tx.send(2));
        tx.end(Error::invalid("x", 1, "y"));
        assert!(!tx.send(3));
        assert!(matches!(rx.recv(Duration::ZERO), Got::Item(1)));
        assert!(matches!(rx.recv(Duration::ZERO), Got::Item(2)));
        assert!(matches!(rx.recv(Duration::ZERO), Got::Ended(_)));
        assert!(matches!(rx.recv(Duration::ZERO), Got::Done));
    }

    #[test]
    fn a_dropped_consumer_stops_the_producer() {
        let (tx, rx) = channel::<u8>();
        assert!(!tx.closed());
        drop(rx);
        assert!(tx.closed() && !tx.send(1));
    }

    #[test]
    fn an_unread_queue_overflows_into_an_error() {
        let (tx, rx) = channel();
        assert!(tx.send_all(0..=MAX_QUEUED));
        assert!(matches!(
            rx.recv(Duration::ZERO),
            Got::Ended(Error::Store { .. })
        ));
    }

    #[test]
    fn a_first_list_larger_than_the_queue_does_not_overflow_it() {
        let (tx, rx) = channel();
        assert!(tx.start((0..MAX_QUEUED + 10).collect()));
        assert!(tx.send_all(0..MAX_QUEUED - 10));
        assert!(matches!(rx.recv(Duration::ZERO), Got::Item(0)));
        // Past the first list and MAX_QUEUED more unread: the end.
        assert!(tx.send_all(0..30));
        assert!(matches!(rx.recv(Duration::ZERO), Got::Ended(_)));
        // Once the first list is read, the bound is MAX_QUEUED again.
        let (tx, rx) = channel();
        assert!(tx.start((0..100).collect()));
        for _ in 0..100 {
            assert!(matches!(rx.recv(Duration::ZERO), Got::Item(_)));
        }
        assert!(tx.send_all(0..=MAX_QUEUED));
        assert!(matches!(rx.recv(Duration::ZERO), Got::Ended(_)));
    }

    #[test]
    fn recv_waits_for_the_producer() {
        let (tx, rx) = channel();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            tx.send(7);
            tx
        });
        assert!(matches!(rx.recv(Duration::from_secs(5)), Got::Item(7)));
        drop(t.join());
    }
}
