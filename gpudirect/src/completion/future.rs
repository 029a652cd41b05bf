//! Awaiting an [`InFlight`]: [`InFlightFuture`], its deadline, and cancellation by drop.

use super::fence::{Fence, Outcome};
use super::in_flight::InFlight;
use super::thread::{self, TimerKey, Watch, Watched};
use super::tracker::{Tracker, poll_caught};
use crate::error::{Error, Result};
use std::any::Any;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

type Payload = Box<dyn Any + Send>;

/// A fence without a wake-up source of its own, shared with the completion thread, which polls
/// it for the future.
struct Polled<F> {
    fence: F,
    /// Whether the completion thread holds an entry for it.
    watched: AtomicBool,
    /// The future is gone (finished, or parked what it owned): the thread stops polling.
    abandoned: AtomicBool,
    /// The fence panicked on the completion thread: it proves nothing, ever.
    poisoned: AtomicBool,
    panic: Mutex<Option<Payload>>,
    waker: Mutex<Option<Waker>>,
}

impl<F: Fence> Polled<F> {
    fn new(fence: F) -> Self {
        Polled {
            fence,
            watched: AtomicBool::new(false),
            abandoned: AtomicBool::new(false),
            poisoned: AtomicBool::new(false),
            panic: Mutex::new(None),
            waker: Mutex::new(None),
        }
    }

    fn wake(&self) {
        let waker = self.waker.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = waker.as_ref()
            && let Err(p) =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.wake_by_ref()))
        {
            std::mem::forget(p);
        }
    }

    /// Keep `waker` for the next wake (the one it replaces is dropped outside the lock).
    fn set_waker(&self, waker: &Waker) {
        let old = self
            .waker
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replace(waker.clone());
        drop(old);
    }
}

impl<F: Fence> Watch for Polled<F> {
    fn poll(&self) -> Watched {
        if self.abandoned.load(Ordering::Acquire) {
            return Watched::Done;
        }
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.fence.check())) {
            Ok(Ok(false)) => Watched::Pending,
            Ok(_) => {
                // Complete (or failed for good): the future checks again itself. The entry ends
                // here; a future that still finds it incomplete registers it again.
                self.watched.store(false, Ordering::Release);
                self.wake();
                Watched::Done
            }
            Err(p) => {
                *self.panic.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
                self.poisoned.store(true, Ordering::Release);
                self.wake();
                // The thread's handle is forgotten: the fence is never dropped.
                Watched::Leak
            }
        }
    }
}

/// A [`Polled`] fence parked in the tracker by a future that let go of it.
struct ParkedPolled<F>(Arc<Polled<F>>);

impl<F: Fence> Fence for ParkedPolled<F> {
    fn is_complete(&self) -> bool {
        if self.0.poisoned.load(Ordering::Acquire) {
            // Proves nothing: the tracker leaks the entry (no panic hook runs for this).
            std::panic::resume_unwind(Box::new("fence panicked on the completion thread"));
        }
        self.0.fence.is_complete()
    }
}

/// Where the fence of a future is.
enum Holder<F> {
    /// Owned by the future (a fence with its own wake-up source, or not registered yet).
    Owned(F),
    /// Shared with the completion thread.
    Polled(Arc<Polled<F>>),
    /// Gone: the future has finished.
    Gone,
}

/// An [`InFlight`] being awaited: made by `op.await` ([`IntoFuture`]), [`InFlight::deadline`],
/// [`InFlight::timeout`] or [`InFlight::with_outcome`]. Its output is the resources (and the
/// operation's result, with [`with_outcome`](InFlight::with_outcome)), once completion is
/// observed.
///
/// Wake-ups come from the fence ([`Fence::register_waker`]): a [`CompletionFlag`](super::CompletionFlag),
/// [`Outcome`] or [`HostFnFence`](super::HostFnFence) wakes the future when it is set; a
/// [`StreamFence`](super::StreamFence), an [`EventFence`](super::EventFence) and any fence
/// without a source of its own are polled by the shared completion thread. A future never
/// blocks, and spins only when told to ([`spin`](Self::spin)).
///
/// # Spinning
///
/// A wake-up from another thread costs the task a thread hand-off, which a blocking
/// `cuEventSynchronize` (it spins) does not pay (`benches/futures.rs` measures both). With
/// [`spin`](Self::spin) the future asks the fence itself, in a loop, for up to that long from
/// its first poll before it registers for a wake-up: work that completes within it is seen
/// within a fence check (`cuEventQuery` for an event fence, a load for a flag), as
/// `cuEventSynchronize` sees it, at the cost of that much CPU of the polling thread (an
/// executor's thread, which runs no other task meanwhile). A stream fence whose stream the
/// completion thread already watches for other futures is left to that thread.
///
/// # Deadlines
///
/// With a deadline ([`deadline`](Self::deadline), [`timeout`](Self::timeout)) the future ends with
/// [`Error::Timeout`] (naming the operation and the time waited since the future was made) once
/// the deadline passes before completion; the completion thread wakes it then. The resources
/// are parked in the [`Tracker`] until the work is done, never freed early. To keep waiting
/// instead, race `&mut future` against your own timer: the future is [`Unpin`], and keeps
/// owning the resources until it is dropped.
///
/// # Cancellation
///
/// Dropping the future before it finished cancels the wait, not the work: if the fence reports
/// completion at that moment the resources are dropped there; otherwise they are parked in the
/// [`Tracker`] at once and freed by a later [`Tracker::reap`] (every await reaps on its first
/// poll) after the work is done. Unlike dropping an [`InFlight`], which waits up to
/// [`DROP_WAIT`](super::DROP_WAIT), a future's drop never blocks: it runs on an executor's
/// thread, which must not stall for seconds.
///
/// A fence that panics (a user's [`Fence`]) proves nothing: the resources are leaked, never
/// freed, and the panic reaches the task polling the future (when the fence panicked on the
/// completion thread, its payload is passed on). In a forked child a dropped future leaks what
/// it owns, as an [`InFlight`] does.
#[must_use = "futures do nothing unless awaited; dropping it parks what the operation owns until it completes"]
pub struct InFlightFuture<R: Send + 'static, F: Fence = Box<dyn Fence>, O = R> {
    what: &'static str,
    fence: Holder<F>,
    resources: Option<R>,
    finish: fn(R, &F) -> O,
    deadline: Option<Instant>,
    started: Instant,
    /// The waker the fence (or the completion thread) will wake.
    registered: Option<Waker>,
    /// The deadline's timer and the waker it wakes.
    timer: Option<(TimerKey, Waker)>,
    reaped: bool,
    /// How long to ask the fence before registering ([`spin`](Self::spin)); zero: not at all.
    spin: Duration,
    /// The end of the spin, set at the first poll that spins.
    spin_until: Option<Instant>,
}

// No field is pinned: the future moves freely between polls.
impl<R: Send + 'static, F: Fence, O> Unpin for InFlightFuture<R, F, O> {}

impl<R: Send + 'static, F: Fence, O> InFlightFuture<R, F, O> {
    fn new(op: InFlight<R, F>, finish: fn(R, &F) -> O) -> Self {
        let (what, fence, resources) = op.into_parts();
        InFlightFuture {
            what,
            fence: Holder::Owned(fence),
            resources: Some(resources),
            finish,
            deadline: None,
            started: Instant::now(),
            registered: None,
            timer: None,
            reaped: false,
            spin: Duration::ZERO,
            spin_until: None,
        }
    }

    /// The longest [`spin`](Self::spin).
    pub const MAX_SPIN: Duration = Duration::from_millis(1);

    /// Before registering for a wake-up, ask the fence in a loop for up to `spin` (at most
    /// [`MAX_SPIN`](Self::MAX_SPIN), 1 ms), counted from the first poll; default zero (no
    /// spin). See "Spinning" above: completion within the spin is seen without a thread
    /// hand-off, for that much CPU of the polling thread. A deadline ends the spin too.
    pub fn spin(mut self, spin: Duration) -> Self {
        self.spin = spin.min(Self::MAX_SPIN);
        self.spin_until = None;
        self
    }

    /// Ask the fence until it answers or the spin ends (`None`: still pending).
    fn spin_step(&mut self) -> Option<Result<O>> {
        if self.spin.is_zero() {
            return None;
        }
        let now = Instant::now();
        let mut end = *self
            .spin_until
            .get_or_insert_with(|| now.checked_add(self.spin).unwrap_or(now));
        if let Some(at) = self.deadline {
            end = end.min(at);
        }
        while Instant::now() < end {
            std::hint::spin_loop();
            if let Some(out) = self.step() {
                return Some(out);
            }
        }
        None
    }

    /// End with [`Error::Timeout`] if the operation has not completed by `at` (the resources are
    /// then parked, never freed early). Replaces an earlier deadline.
    pub fn deadline(mut self, at: Instant) -> Self {
        self.cancel_timer();
        self.deadline = Some(at);
        self
    }

    /// [`deadline`](Self::deadline) `timeout` from now (none if that overflows `Instant`).
    pub fn timeout(self, timeout: Duration) -> Self {
        match Instant::now().checked_add(timeout) {
            Some(at) => self.deadline(at),
            None => self,
        }
    }

    /// The operation's name, as errors give it.
    pub fn what(&self) -> &'static str {
        self.what
    }

    fn fence(&self) -> Option<&F> {
        match &self.fence {
            Holder::Owned(f) => Some(f),
            Holder::Polled(p) => Some(&p.fence),
            Holder::Gone => None,
        }
    }

    /// Complete, failed or still pending (`None`).
    fn step(&mut self) -> Option<Result<O>> {
        if let Holder::Polled(p) = &self.fence
            && p.poisoned.load(Ordering::Acquire)
        {
            let payload = p.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
            self.leak_and_resume(payload.unwrap_or_else(|| Box::new("fence panicked")));
        }
        let f = self.fence()?;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f.check())) {
            Ok(Ok(true)) => Some(Ok(self.finish())),
            Ok(Ok(false)) => None,
            Ok(Err(e)) => {
                self.park();
                Some(Err(e))
            }
            Err(p) => self.leak_and_resume(p),
        }
    }

    /// The output of a completed operation; the fence is let go.
    fn finish(&mut self) -> O {
        self.cancel_timer();
        let r = self
            .resources
            .take()
            .expect("resources present until taken");
        let f = self.fence().expect("fence present until finished");
        let out = (self.finish)(r, f);
        if let Holder::Polled(p) = std::mem::replace(&mut self.fence, Holder::Gone) {
            p.abandoned.store(true, Ordering::Release);
        }
        out
    }

    /// Hand the resources and the fence to the [`Tracker`] (leak them in a forked child).
    fn park(&mut self) {
        self.cancel_timer();
        let fence = std::mem::replace(&mut self.fence, Holder::Gone);
        let Some(r) = self.resources.take() else {
            return;
        };
        if Tracker::global().in_forked_child() {
            std::mem::forget(fence);
            std::mem::forget(r);
            return;
        }
        match fence {
            Holder::Owned(f) => Tracker::global().park(f, r),
            Holder::Polled(p) => {
                p.abandoned.store(true, Ordering::Release);
                Tracker::global().park(ParkedPolled(p), r);
            }
            Holder::Gone => std::mem::forget(r),
        }
    }

    /// The fence panicked: it proves nothing, so the resources and the fence are leaked, and the
    /// panic goes on.
    fn leak_and_resume(&mut self, payload: Payload) -> ! {
        self.cancel_timer();
        std::mem::forget(self.resources.take());
        std::mem::forget(std::mem::replace(&mut self.fence, Holder::Gone));
        std::panic::resume_unwind(payload)
    }

    /// Make sure `waker` is woken when the fence may have completed.
    fn register(&mut self, waker: &Waker) -> Result<()> {
        let same = self.registered.as_ref().is_some_and(|w| w.will_wake(waker));
        if let Holder::Owned(f) = &self.fence {
            if same {
                return Ok(());
            }
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f.register_waker(waker)))
            {
                Ok(true) => {
                    self.registered = Some(waker.clone());
                    return Ok(());
                }
                Ok(false) => {
                    let Holder::Owned(f) = std::mem::replace(&mut self.fence, Holder::Gone) else {
                        unreachable!("matched Owned above")
                    };
                    self.fence = Holder::Polled(Arc::new(Polled::new(f)));
                }
                Err(p) => self.leak_and_resume(p),
            }
        }
        if let Holder::Polled(p) = &self.fence {
            if !same {
                p.set_waker(waker);
            }
            // Watched again if the thread let go of it (it saw completion, or an error, that
            // this future has not acted on yet).
            if !p.watched.swap(true, Ordering::AcqRel)
                && let Err(e) = thread::watch(p.clone())
            {
                p.watched.store(false, Ordering::Release);
                return Err(e);
            }
        }
        self.registered = Some(waker.clone());
        Ok(())
    }

    /// Have the completion thread wake `waker` at `at`.
    fn arm_timer(&mut self, at: Instant, waker: &Waker) -> Result<()> {
        if self.timer.as_ref().is_some_and(|(_, w)| w.will_wake(waker)) {
            return Ok(());
        }
        self.cancel_timer();
        let key = thread::set_timer(at, waker)?;
        self.timer = Some((key, waker.clone()));
        Ok(())
    }

    fn cancel_timer(&mut self) {
        if let Some((key, _)) = self.timer.take() {
            thread::cancel_timer(key);
        }
    }
}

impl<R: Send + 'static, F: Fence, O> Future for InFlightFuture<R, F, O> {
    type Output = Result<O>;

    /// # Panics
    ///
    /// When polled after it returned `Ready`, and when the fence's own code panics (a user's
    /// [`Fence`]; the resources are then leaked).
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<O>> {
        let this = self.get_mut();
        assert!(
            this.resources.is_some(),
            "InFlightFuture polled after it completed"
        );
        if !this.reaped {
            this.reaped = true;
            Tracker::global().reap();
        }
        if let Some(out) = this.step() {
            return Poll::Ready(out);
        }
        if let Some(out) = this.spin_step() {
            return Poll::Ready(out);
        }
        if let Err(e) = this.register(cx.waker()) {
            this.park();
            return Poll::Ready(Err(e));
        }
        // Completion between the first check and the registration has woken nobody: look again.
        if let Some(out) = this.step() {
            return Poll::Ready(out);
        }
        if let Some(at) = this.deadline {
            if Instant::now() >= at {
                let after = this.started.elapsed();
                this.park();
                return Poll::Ready(Err(Error::Timeout {
                    what: this.what,
                    after,
                }));
            }
            if let Err(e) = this.arm_timer(at, cx.waker()) {
                this.park();
                return Poll::Ready(Err(e));
            }
        }
        Poll::Pending
    }
}

impl<R: Send + 'static, F: Fence, O> Drop for InFlightFuture<R, F, O> {
    fn drop(&mut self) {
        self.cancel_timer();
        if self.resources.is_none() {
            return; // finished (or leaked)
        }
        if Tracker::global().in_forked_child() {
            // No driver calls and no frees in a forked child: leaked.
            self.park();
            return;
        }
        let poisoned =
            matches!(&self.fence, Holder::Polled(p) if p.poisoned.load(Ordering::Acquire));
        let checked = if poisoned {
            None
        } else {
            self.fence().and_then(|f| poll_caught(|| f.check()))
        };
        match checked {
            Some(Ok(true)) => drop(self.finish_drop()),
            Some(_) => self.park(),
            None => {
                std::mem::forget(self.resources.take());
                std::mem::forget(std::mem::replace(&mut self.fence, Holder::Gone));
            }
        }
    }
}

impl<R: Send + 'static, F: Fence, O> InFlightFuture<R, F, O> {
    /// The resources of a completed operation, the fence let go (for a drop: no result taken).
    fn finish_drop(&mut self) -> Option<R> {
        let r = self.resources.take();
        if let Holder::Polled(p) = std::mem::replace(&mut self.fence, Holder::Gone) {
            p.abandoned.store(true, Ordering::Release);
        }
        r
    }
}

impl<R: Send + 'static, F: Fence, O> std::fmt::Debug for InFlightFuture<R, F, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlightFuture")
            .field("what", &self.what)
            .field("deadline", &self.deadline)
            .field(
                "polled_by_completion_thread",
                &matches!(self.fence, Holder::Polled(_)),
            )
            .finish_non_exhaustive()
    }
}

fn resources_only<R, F>(r: R, _fence: &F) -> R {
    r
}

fn with_result<R, T: Send + 'static>(r: R, fence: &Outcome<T>) -> (R, T) {
    let value = fence
        .take()
        .expect("an outcome completes only once its value is stored, and is taken once");
    (r, value)
}

impl<R: Send + 'static, F: Fence> IntoFuture for InFlight<R, F> {
    type Output = Result<R>;
    type IntoFuture = InFlightFuture<R, F>;

    /// Await the operation: the resources back once it has completed.
    fn into_future(self) -> InFlightFuture<R, F> {
        InFlightFuture::new(self, resources_only)
    }
}

impl<R: Send + 'static, F: Fence> InFlight<R, F> {
    /// Await with a deadline: [`Error::Timeout`] once `at` passes before completion, the
    /// resources then parked in the [`Tracker`] (never freed early). See [`InFlightFuture`].
    pub fn deadline(self, at: Instant) -> InFlightFuture<R, F> {
        self.into_future().deadline(at)
    }

    /// Await with a deadline `timeout` from now; as [`deadline`](Self::deadline).
    pub fn timeout(self, timeout: Duration) -> InFlightFuture<R, F> {
        self.into_future().timeout(timeout)
    }

    /// Await, asking the fence in a loop for up to `spin` before registering for a wake-up
    /// ([`InFlightFuture::spin`]).
    pub fn spin(self, spin: Duration) -> InFlightFuture<R, F> {
        self.into_future().spin(spin)
    }
}

impl<R: Send + 'static, T: Send + 'static> InFlight<R, Outcome<T>> {
    /// Await the resources and the operation's result (what the [`OutcomeSender`](super::OutcomeSender)
    /// sent).
    pub fn with_outcome(self) -> InFlightFuture<R, Outcome<T>, (R, T)> {
        InFlightFuture::new(self, with_result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completion::testing::CountWakes;
    use crate::completion::testing::{Counted, Panics, until};
    use crate::completion::{CompletionFlag, Done};
    use std::sync::atomic::AtomicUsize;

    /// A user's fence with no wake-up source of its own.
    #[derive(Clone, Default)]
    struct UserFence(Arc<AtomicBool>);
    impl Fence for UserFence {
        fn is_complete(&self) -> bool {
            self.0.load(Ordering::Acquire)
        }
    }

    fn counting_waker() -> (Arc<CountWakes>, Waker) {
        let c = Arc::new(CountWakes::default());
        (c.clone(), Waker::from(c))
    }

    fn poll_once<Fut: Future + Unpin>(f: &mut Fut, w: &Waker) -> Poll<Fut::Output> {
        Pin::new(f).poll(&mut Context::from_waker(w))
    }

    #[test]
    fn a_flag_wakes_its_future_directly() {
        let flag = CompletionFlag::new();
        let drops = Arc::new(AtomicUsize::new(0));
        let mut fut = InFlight::new("flag op", flag.clone(), Counted(drops.clone())).into_future();
        let (wakes, w) = counting_waker();
        assert!(poll_once(&mut fut, &w).is_pending());
        assert!(
            matches!(fut.fence, Holder::Owned(_)),
            "no completion thread"
        );
        flag.set();
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
        let Poll::Ready(Ok(r)) = poll_once(&mut fut, &w) else {
            panic!("complete")
        };
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        drop(r);
        drop(fut);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_user_fence_is_polled_by_the_completion_thread() {
        let fence = UserFence::default();
        let mut fut = InFlight::new("user op", fence.clone(), 7u32).into_future();
        let (wakes, w) = counting_waker();
        assert!(poll_once(&mut fut, &w).is_pending());
        assert!(matches!(fut.fence, Holder::Polled(_)));
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(
            wakes.0.load(Ordering::SeqCst),
            0,
            "no wake before completion"
        );
        fence.0.store(true, Ordering::Release);
        until("woken by the completion thread", || {
            wakes.0.load(Ordering::SeqCst) == 1
        });
        assert!(matches!(poll_once(&mut fut, &w), Poll::Ready(Ok(7))));
    }

    /// A user's fence that answers "complete" from its `n`th check on; counts its checks.
    #[derive(Clone)]
    struct NthCheck(Arc<AtomicUsize>, usize);
    impl Fence for NthCheck {
        fn is_complete(&self) -> bool {
            self.0.fetch_add(1, Ordering::SeqCst) + 1 >= self.1
        }
    }

    #[test]
    fn a_spinning_future_sees_completion_without_a_wake_up() {
        // Without a spin the first poll checks twice (before and after registering): pending.
        let fence = NthCheck(Arc::new(AtomicUsize::new(0)), 50);
        let mut fut = InFlight::new("plain", fence.clone(), 1u8).into_future();
        let (_, w) = counting_waker();
        assert!(poll_once(&mut fut, &w).is_pending());
        drop(fut);
        let (wakes, w) = counting_waker();
        // With one, the first poll asks until the fence answers: no registration, no wake.
        let fence = NthCheck(Arc::new(AtomicUsize::new(0)), 50);
        let mut fut = InFlight::new("spun", fence.clone(), 2u8)
            .spin(InFlightFuture::<u8, NthCheck>::MAX_SPIN);
        let Poll::Ready(Ok(2)) = poll_once(&mut fut, &w) else {
            panic!("seen complete within the spin")
        };
        assert_eq!(fence.0.load(Ordering::SeqCst), 50);
        assert!(
            matches!(fut.fence, Holder::Gone),
            "never handed to the completion thread"
        );
        assert_eq!(wakes.0.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_spin_is_spent_once_and_capped() {
        let never = NthCheck(Arc::new(AtomicUsize::new(0)), usize::MAX);
        let spin = Duration::from_micros(300);
        let mut fut = InFlight::new("never", never.clone(), ()).spin(spin);
        let (_, w) = counting_waker();
        let t = Instant::now();
        assert!(poll_once(&mut fut, &w).is_pending());
        assert!(t.elapsed() >= spin, "spun for the whole spin");
        assert!(matches!(fut.fence, Holder::Polled(_)), "then registered");
        // A later poll does not spin again: it checks as a plain poll does (the completion
        // thread's checks of the shared fence counted apart).
        let before = never.0.load(Ordering::SeqCst);
        let t = Instant::now();
        assert!(poll_once(&mut fut, &w).is_pending());
        let quick = t.elapsed() < spin;
        let checks = never.0.load(Ordering::SeqCst) - before;
        assert!(quick || checks < 1000, "no second spin ({checks} checks)");
        drop(fut);
        let capped = InFlight::new("capped", never, ()).spin(Duration::from_secs(60));
        assert_eq!(capped.spin, InFlightFuture::<(), NthCheck>::MAX_SPIN);
    }

    #[test]
    fn a_deadline_ends_the_spin_typed() {
        let never = NthCheck(Arc::new(AtomicUsize::new(0)), usize::MAX);
        let drops = Arc::new(AtomicUsize::new(0));
        let mut fut = InFlight::new("spun past its deadline", never, Counted(drops.clone()))
            .spin(InFlightFuture::<Counted, NthCheck>::MAX_SPIN)
            .timeout(Duration::from_micros(200));
        let (_, w) = counting_waker();
        let Poll::Ready(Err(Error::Timeout { what, .. })) = poll_once(&mut fut, &w) else {
            panic!("the deadline ends the first poll's spin")
        };
        assert_eq!(what, "spun past its deadline");
        drop(fut);
        assert_eq!(drops.load(Ordering::SeqCst), 0, "parked, not freed");
    }

    #[test]
    fn an_outcome_future_gives_the_result_beside_the_resources() {
        let (tx, rx) = Outcome::pair();
        let mut fut = InFlight::new("with result", rx, vec![9u8; 3]).with_outcome();
        let (_, w) = counting_waker();
        assert!(poll_once(&mut fut, &w).is_pending());
        tx.send(42u64);
        let Poll::Ready(Ok((r, v))) = poll_once(&mut fut, &w) else {
            panic!("complete")
        };
        assert_eq!((r, v), (vec![9u8; 3], 42));
    }

    #[test]
    fn a_deadline_expires_typed_and_parks() {
        for polled_by_thread in [false, true] {
            let drops = Arc::new(AtomicUsize::new(0));
            let user = UserFence::default();
            let flag = CompletionFlag::new();
            let fence: Box<dyn Fence> = if polled_by_thread {
                Box::new(user.clone())
            } else {
                Box::new(flag.clone())
            };
            let mut fut = InFlight::new("slow op", fence, Counted(drops.clone()))
                .timeout(Duration::from_millis(20));
            let (wakes, w) = counting_waker();
            assert!(poll_once(&mut fut, &w).is_pending());
            until("woken by the deadline", || {
                wakes.0.load(Ordering::SeqCst) >= 1
            });
            let Poll::Ready(Err(Error::Timeout { what, after })) = poll_once(&mut fut, &w) else {
                panic!("timed out")
            };
            assert_eq!(what, "slow op");
            assert!(after >= Duration::from_millis(20), "{after:?}");
            drop(fut);
            assert_eq!(drops.load(Ordering::SeqCst), 0, "parked, not freed");
            user.0.store(true, Ordering::Release);
            flag.set();
            until("freed by a reap after completion", || {
                Tracker::global().reap();
                drops.load(Ordering::SeqCst) == 1
            });
        }
    }

    #[test]
    fn dropping_a_pending_future_parks_and_never_blocks() {
        let drops = Arc::new(AtomicUsize::new(0));
        let flag = CompletionFlag::new();
        let (_, w) = counting_waker();
        let mut fut = InFlight::new("cancelled", flag.clone(), Counted(drops.clone()))
            .timeout(Duration::from_secs(60));
        assert!(poll_once(&mut fut, &w).is_pending());
        let t = Instant::now();
        drop(fut);
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "a future's drop does not wait"
        );
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        flag.set();
        until("freed by a reap", || {
            Tracker::global().reap();
            drops.load(Ordering::SeqCst) == 1
        });
        // Complete when dropped: freed at once.
        let drops = Arc::new(AtomicUsize::new(0));
        drop(InFlight::new("done", Done, Counted(drops.clone())).into_future());
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn timers_are_cancelled_when_the_future_ends() {
        let flag = CompletionFlag::new();
        let (_, w) = counting_waker();
        let mut fut = InFlight::new("timed", flag.clone(), ()).timeout(Duration::from_secs(3600));
        assert!(poll_once(&mut fut, &w).is_pending());
        let key = fut.timer.as_ref().map(|(k, _)| *k).expect("armed");
        flag.set();
        assert!(matches!(poll_once(&mut fut, &w), Poll::Ready(Ok(()))));
        assert!(fut.timer.is_none());
        // Cancelling again finds nothing (the key is gone from the thread's map).
        thread::cancel_timer(key);
        let _ = thread::timers();
    }

    #[test]
    fn a_fence_panicking_on_the_completion_thread_leaks_and_reaches_the_task() {
        /// Pending for the future itself, panics on the completion thread.
        struct LatePanic;
        impl Fence for LatePanic {
            fn is_complete(&self) -> bool {
                if std::thread::current().name() == Some("gpudirect-completion") {
                    panic!("user fence panics on the completion thread")
                }
                false
            }
        }
        let drops = Arc::new(AtomicUsize::new(0));
        let mut fut = InFlight::new("late panic", LatePanic, Counted(drops.clone())).into_future();
        let (wakes, w) = counting_waker();
        // The thread may panic before the first poll's second look (which then passes the panic
        // on), or after it (then the thread wakes the task and the next poll does).
        let first =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| poll_once(&mut fut, &w)));
        if let Ok(p) = first {
            assert!(p.is_pending());
            until("woken after the panic", || {
                wakes.0.load(Ordering::SeqCst) >= 1
            });
            let r =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| poll_once(&mut fut, &w)));
            assert!(r.is_err(), "the panic reaches the task");
        }
        drop(fut);
        assert_eq!(drops.load(Ordering::SeqCst), 0, "leaked, never freed");

        // Panicking in the future's own poll, and in its drop.
        let mut fut = InFlight::new("panics", Panics, Counted(drops.clone())).into_future();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| poll_once(&mut fut, &w)));
        assert!(r.is_err());
        drop(fut);
        drop(InFlight::new("panics", Panics, Counted(drops.clone())).into_future());
        assert_eq!(drops.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_failed_fence_ends_the_future_with_its_error_and_parks() {
        struct Failed(Arc<AtomicBool>);
        impl Fence for Failed {
            fn is_complete(&self) -> bool {
                self.0.load(Ordering::Acquire)
            }
            fn check(&self) -> Result<bool> {
                Err(Error::invalid("stream", "failed", "sticky"))
            }
        }
        let done = Arc::new(AtomicBool::new(false));
        let drops = Arc::new(AtomicUsize::new(0));
        let mut fut =
            InFlight::new("fails", Failed(done.clone()), Counted(drops.clone())).into_future();
        let (_, w) = counting_waker();
        assert!(matches!(
            poll_once(&mut fut, &w),
            Poll::Ready(Err(Error::InvalidArgument { arg: "stream", .. }))
        ));
        drop(fut);
        assert_eq!(drops.load(Ordering::SeqCst), 0, "parked");
        done.store(true, Ordering::Release);
        until("freed once the parked fence completes", || {
            Tracker::global().reap();
            drops.load(Ordering::SeqCst) == 1
        });
    }
}
