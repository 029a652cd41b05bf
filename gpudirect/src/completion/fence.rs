//! The [`Fence`] trait and the fences that need no driver: [`CompletionFlag`], [`Outcome`] and
//! [`Done`].

use super::backoff::poll_until;
use super::signal::Signal;
use crate::error::Result;
use std::sync::{Arc, Mutex};
use std::task::Waker;
use std::time::Duration;

/// Something that can tell whether an operation has finished.
///
/// The trait is open: implement it for your own completion sources. The library calls your code
/// while it decides whether to free what an operation owns, so a panic there is caught and taken
/// as "never complete": the resources that fence guards are leaked (never freed), and nothing
/// else the tracker holds is affected. An [`InFlight`](super::InFlight) whose fence panicked in
/// [`InFlight::wait`](super::InFlight::wait), [`InFlight::wait_timeout`](super::InFlight::wait_timeout) or [`InFlight::try_take`](super::InFlight::try_take) passes the panic on
/// after leaking its resources; so does an awaited one ([`InFlightFuture`](super::InFlightFuture)),
/// also when the fence panicked on the completion thread.
pub trait Fence: Send + Sync + 'static {
    /// Whether completion has been observed. Must not block.
    fn is_complete(&self) -> bool;

    /// Wait up to `timeout` for completion; `true` once complete. The default polls
    /// [`is_complete`](Fence::is_complete) with back-off: yielding at first, then sleeping up to
    /// 1 ms between polls.
    fn wait_timeout(&self, timeout: Duration) -> bool {
        poll_until(|| self.is_complete(), timeout)
    }

    /// Whether completion has been observed, or an error when it never can be (the stream the
    /// work was queued on has failed: a sticky CUDA error). Must not block. The default answers
    /// `Ok(self.is_complete())`.
    ///
    /// A future awaiting the operation ends with that error, and the resources are parked in
    /// the [`Tracker`](super::Tracker), never freed early.
    ///
    /// # Errors
    ///
    /// The error that makes completion unobservable.
    fn check(&self) -> Result<bool> {
        Ok(self.is_complete())
    }

    /// Arrange for `waker` to be woken once [`check`](Fence::check) may answer something other
    /// than `Ok(false)`; `true` when this fence does so itself, `false` (the default) to leave
    /// it to the shared completion thread, which then polls [`check`](Fence::check) with
    /// back-off on the future's behalf. Must not block.
    ///
    /// A future calls this after `check` answered `Ok(false)`, and calls `check` again right
    /// after it, so a completion between the two is never lost. It calls it again when its
    /// waker changes; a fence may keep every waker it was given until it completes or is
    /// dropped. The waker may be woken from any thread (including CUDA's host-function thread
    /// for [`HostFnFence`](super::HostFnFence)). The crate's own fences and requests wake with
    /// none of the locks held that a poll of theirs, a post or a call on the same endpoint
    /// takes, so a waker may call back into the library inline (on the crate's threads that
    /// streams wait for, a stream queue's words or a transfer's memory it lets go of are freed
    /// on another thread; CUDA memory of your own is not); a fence you write may wake while it
    /// holds a lock of its own, and then its waker should only schedule its task.
    fn register_waker(&self, waker: &Waker) -> bool {
        let _ = waker;
        false
    }
}

/// A flag set once by whoever observes completion: a host callback, a polled work completion, an
/// I/O thread. Cheap to clone. A future awaiting it is woken by [`set`](Self::set) itself.
#[derive(Debug, Clone, Default)]
pub struct CompletionFlag(Arc<Signal>);

impl CompletionFlag {
    /// A new, unset flag.
    pub fn new() -> Self {
        Self::default()
    }

    /// Mark the operation complete (Release: writes before this are visible to the waiter) and
    /// wake the futures waiting on it.
    pub fn set(&self) {
        self.0.set();
    }

    /// Set it without waking anyone: under the caller's lock, so that whoever sees what it
    /// guards sees the flag set. [`set`](Self::set) follows once that lock is let go (it wakes;
    /// a waker may call back into the code that holds the lock).
    #[cfg_attr(
        not(feature = "transfer"),
        allow(dead_code, reason = "the transfer engine's requests use it")
    )]
    pub(crate) fn mark(&self) {
        self.0.mark();
    }
}

impl Fence for CompletionFlag {
    fn is_complete(&self) -> bool {
        self.0.is_set()
    }

    fn register_waker(&self, waker: &Waker) -> bool {
        self.0.register(waker);
        true
    }
}

/// A completion that carries the operation's result (a work completion, an I/O status): the
/// fence half of [`Outcome::pair`]. The [`OutcomeSender`] stores the result once; the fence is
/// complete from then on, and [`InFlight::with_outcome`](super::InFlight::with_outcome) or
/// [`InFlight::wait_outcome`](super::InFlight::wait_outcome) hand it back beside the resources.
#[derive(Debug)]
pub struct Outcome<T: Send + 'static>(Arc<OutcomeInner<T>>);

/// The sending half of [`Outcome::pair`]: whoever observes completion calls
/// [`send`](Self::send). Dropping it unsent leaves the outcome incomplete forever (its resources
/// stay owned: parked, never freed early).
#[derive(Debug)]
pub struct OutcomeSender<T: Send + 'static>(Arc<OutcomeInner<T>>);

#[derive(Debug)]
struct OutcomeInner<T> {
    value: Mutex<Option<T>>,
    signal: Signal,
}

impl<T: Send + 'static> Outcome<T> {
    /// A sender and its outcome.
    pub fn pair() -> (OutcomeSender<T>, Outcome<T>) {
        let inner = Arc::new(OutcomeInner {
            value: Mutex::new(None),
            signal: Signal::default(),
        });
        (OutcomeSender(inner.clone()), Outcome(inner))
    }

    /// The result, once sent (`None` before, and after it was taken).
    pub fn take(&self) -> Option<T> {
        if !self.0.signal.is_set() {
            return None;
        }
        self.0
            .value
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }
}

impl<T: Send + 'static> OutcomeSender<T> {
    /// Store the result and complete the outcome, waking the future that awaits it.
    pub fn send(self, value: T) {
        *self.0.value.lock().unwrap_or_else(|e| e.into_inner()) = Some(value);
        self.0.signal.set();
    }
}

impl<T: Send + 'static> Fence for Outcome<T> {
    fn is_complete(&self) -> bool {
        self.0.signal.is_set()
    }

    fn register_waker(&self, waker: &Waker) -> bool {
        self.0.signal.register(waker);
        true
    }
}

/// A fence that is complete from the start (for operations that finished synchronously).
#[derive(Debug, Clone, Copy, Default)]
pub struct Done;

impl Fence for Done {
    fn is_complete(&self) -> bool {
        true
    }
}

impl Fence for Box<dyn Fence> {
    fn is_complete(&self) -> bool {
        (**self).is_complete()
    }
    fn wait_timeout(&self, timeout: Duration) -> bool {
        (**self).wait_timeout(timeout)
    }
    fn check(&self) -> Result<bool> {
        (**self).check()
    }
    fn register_waker(&self, waker: &Waker) -> bool {
        (**self).register_waker(waker)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completion::testing::CountWakes;
    use std::sync::atomic::Ordering;

    #[test]
    fn outcome_completes_with_its_value_and_wakes() {
        let (tx, rx) = Outcome::<Vec<u8>>::pair();
        let w = Arc::new(CountWakes::default());
        assert!(!rx.is_complete());
        assert!(rx.take().is_none());
        assert!(rx.register_waker(&Waker::from(w.clone())));
        tx.send(vec![1, 2, 3]);
        assert!(rx.is_complete());
        assert_eq!(w.0.load(Ordering::SeqCst), 1);
        assert_eq!(rx.take(), Some(vec![1, 2, 3]));
        assert_eq!(rx.take(), None, "taken once");
        assert!(rx.is_complete(), "still complete");
    }

    #[test]
    fn boxed_fences_forward_registration() {
        let flag = CompletionFlag::new();
        let boxed: Box<dyn Fence> = Box::new(flag.clone());
        let w = Arc::new(CountWakes::default());
        assert!(boxed.register_waker(&Waker::from(w.clone())));
        assert!(!boxed.check().unwrap());
        flag.set();
        assert!(boxed.check().unwrap());
        assert_eq!(w.0.load(Ordering::SeqCst), 1);
        // A fence without its own wake-up source says so.
        struct Plain;
        impl Fence for Plain {
            fn is_complete(&self) -> bool {
                false
            }
        }
        let boxed: Box<dyn Fence> = Box::new(Plain);
        assert!(!boxed.register_waker(&Waker::from(w)));
    }
}
