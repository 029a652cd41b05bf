//! A request in flight, whatever carries it: [`Transfer`] (waited for, awaited, or handed on
//! as an `InFlight`), the state it shares with whoever finishes it ([`ReqShared`]), and the
//! finisher a waiting caller can help ([`Finisher`]).

use super::plan::deadline_after;
use super::region::Regions;
use super::request::{Broken, FLUSH_WAIT, TransferReport};
use crate::completion::{CompletionFlag, Fence, InFlight, Tracker};
use crate::error::Result;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

pub(crate) struct ReqShared {
    /// By when the request is surely finished: its deadline plus the flush wait and slack.
    limit: Instant,
    flag: CompletionFlag,
    done: Mutex<Option<Result<TransferReport>>>,
    cv: Condvar,
    /// Threads asleep on `cv` (counted under `done`'s lock): finishing wakes only when some
    /// are (a wake-up is a system call).
    sleepers: AtomicUsize,
    /// Who finishes the request, when a waiting caller can help (the intra-node path).
    finisher: OnceLock<Weak<dyn Finisher>>,
}

/// Who finishes a request that a waiting caller can help with (an intra-node endpoint's issue lane,
/// the verbs rails' completion queues).
pub(crate) trait Finisher: Send + Sync {
    /// Called by a blocking wait while it spins: finish what is done, in order, if no one else
    /// is finishing.
    fn help(&self);
    /// Ask the thread that finishes requests when nobody waits blocking (the intra-node worker)
    /// to look: a request nobody else can see finished (no notification) does not wake it when
    /// issued, so that a caller that waits finishes it alone.
    fn wake(&self);
    /// The transfer was made a future ([`Transfer::spin`], `.await`): by default as
    /// [`wake`](Self::wake). A finisher whose future's polls look for the end themselves (and
    /// leave the end watched when they stop) needs nothing here.
    fn wake_for_future(&self) {
        self.wake();
    }
    /// How long a blocking wait looks for the end before it sleeps until it is woken.
    fn spin(&self) -> Duration {
        HELP_SPIN
    }
    /// One look of a blocking wait while it spins; `l` is that wait's own, kept between its
    /// looks (by default: [`help`](Self::help)). Returns whether to go on looking (`false`:
    /// sleep now, the wait is not worth a CPU).
    fn look(&self, l: &mut Looking) -> bool {
        let _ = l;
        self.help();
        true
    }
    /// The blocking wait stops looking (`done`: its request finished): let go of what its looks
    /// took.
    fn stop(&self, l: &mut Looking, done: bool) {
        let _ = (l, done);
    }
    /// A poll of the transfer's future, not finished: a look that makes no CUDA call and never
    /// waits long (by default none).
    fn poll_look(&self) {}
}

/// What a blocking wait holds while it looks ([`Finisher::look`]), kept by the wait and set by
/// the finisher.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Looking {
    /// Not looking.
    #[default]
    Not,
    /// Looking, ready to take over what another waiter does for everyone.
    Spins,
    /// Looking, and doing it (the verbs rails: polling their completion queues).
    Polls,
}

impl ReqShared {
    /// The state of a request that is surely finished by `limit` (its deadline plus the flush
    /// wait and slack), not finished yet.
    pub(crate) fn new(limit: Instant) -> Arc<ReqShared> {
        Arc::new(ReqShared {
            limit,
            flag: CompletionFlag::new(),
            done: Mutex::new(None),
            cv: Condvar::new(),
            sleepers: AtomicUsize::new(0),
            finisher: OnceLock::new(),
        })
    }

    pub(crate) fn finish(self: Arc<Self>, r: Result<TransferReport>) {
        drop(self.settle(r));
    }

    /// Store the result (the first one stays) and set the flag; its waiters are woken when
    /// what is returned is dropped (once the caller let its own locks go).
    fn settle(self: Arc<Self>, r: Result<TransferReport>) -> Settled {
        let mut g = self.done.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            *g = Some(r);
        }
        // Set under the lock: whoever sees the result sees the flag set (`wait` takes the
        // resources with a zero timeout once the result is there), and whoever is woken by the
        // flag finds the result. Woken after it: a waker that polls the transfer takes it.
        self.flag.mark();
        drop(g);
        Settled(self)
    }
}

/// A finished request's wake-up ([`Transfer::pending`]): its futures and blocked waits are
/// woken when this is dropped.
pub(crate) struct Settled(Arc<ReqShared>);

impl Drop for Settled {
    fn drop(&mut self) {
        // Set already: this wakes.
        self.0.flag.set();
        if self.0.sleepers.load(Ordering::Acquire) > 0 {
            self.0.cv.notify_all();
        }
    }
}

/// A request in flight: wait for it ([`wait`](Self::wait)), or hand it on as an
/// [`InFlight`] ([`into_in_flight`](Self::into_in_flight)) whose fence is the request's
/// [`CompletionFlag`].
#[must_use = "a transfer runs until it completes or fails; wait for it to see which"]
pub struct Transfer {
    op: InFlight<Transferred, CompletionFlag>,
    shared: Arc<ReqShared>,
    /// Wakes the finisher when the transfer goes unfinished (dropped, or made a future or an
    /// `InFlight`).
    _finisher: WakeFinisher,
}

/// Dropped with its [`Transfer`]: asks the finisher to look if the request is not finished.
struct WakeFinisher(Arc<ReqShared>);

impl WakeFinisher {
    fn wake(&self) {
        if let Some(f) = self.unfinished() {
            f.wake();
        }
    }

    /// The request's finisher, while it lives.
    fn finisher(&self) -> Option<Arc<dyn Finisher>> {
        self.0.finisher.get().and_then(Weak::upgrade)
    }

    /// The finisher, while it lives and the request is not finished.
    fn unfinished(&self) -> Option<Arc<dyn Finisher>> {
        if self.0.flag.is_complete() {
            None
        } else {
            self.finisher()
        }
    }

    /// The transfer was made a future: [`Finisher::wake_for_future`] if not finished.
    fn wake_for_future(&self) {
        if let Some(f) = self.unfinished() {
            f.wake_for_future();
        }
    }
}

impl Drop for WakeFinisher {
    fn drop(&mut self) {
        self.wake();
    }
}

/// What a finished transfer hands back: its result, and the regions it used.
pub struct Transferred {
    shared: Arc<ReqShared>,
    _regions: Regions,
}

impl Transferred {
    /// The transfer's result, leaving the regions held (the stream proxy hands them to a
    /// thread that may free memory).
    pub(crate) fn take_result(&self) -> Result<TransferReport> {
        self.shared
            .done
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_else(|| Err(Broken::Closed.to_error()))
    }

    /// The transfer's result.
    ///
    /// # Errors
    ///
    /// What ended the transfer: [`Error::Timeout`](crate::Error::Timeout) when its deadline passed,
    /// [`Error::WorkCompletion`](crate::Error::WorkCompletion) (a remote access error for a wrong rkey or range, flushed
    /// messages), [`Error::CmEvent`](crate::Error::CmEvent) when the peer disconnected, [`Error::InvalidArgument`](crate::Error::InvalidArgument)
    /// when the peer broke the protocol or the endpoint was closed (reconnected or dropped).
    /// Inside a node: [`Error::Os`](crate::Error::Os) when the socket to the peer closed, [`Error::Cuda`](crate::Error::Cuda) when a
    /// copy failed.
    pub fn result(self) -> Result<TransferReport> {
        self.take_result()
    }
}

/// How long [`Transfer::wait`] looks for the end of a request that can be helped before it
/// sleeps until its finisher wakes it (the intra-node side's; the rails' is
/// [`EngineConfig::spin`](crate::transfer::EngineConfig::spin)).
const HELP_SPIN: Duration = Duration::from_millis(10);

/// While it looks, a waiting caller yields its CPU once in this many looks.
const HELP_YIELD: u32 = 8;

impl Transfer {
    /// Let a blocking [`wait`](Self::wait) (and a poll of the transfer's future) help `f`
    /// finish the request, and let the transfer wake `f` whenever it is looked at without a
    /// blocking wait, or goes unfinished (once).
    pub(crate) fn set_finisher(&self, f: Weak<dyn Finisher>) {
        let _ = self.shared.finisher.set(f);
    }

    /// A transfer finished by someone else (the staged path's worker): the transfer, and the
    /// function that finishes it.
    /// The function stores the result and sets the flag; the waiters are woken when the
    /// [`Settled`] it returns is dropped (once the finisher let its own locks go).
    pub(crate) fn pending(
        timeout: Duration,
        regions: Regions,
    ) -> (
        Transfer,
        impl FnOnce(Result<TransferReport>) -> Settled + Send + 'static,
    ) {
        let limit = deadline_after(deadline_after(Instant::now(), timeout), timeout) + FLUSH_WAIT;
        let shared = ReqShared::new(limit);
        let s = shared.clone();
        (
            Transfer::started("staged transfer", shared, regions),
            move |r| s.settle(r),
        )
    }

    /// The transfer of a request whose state is `shared` (`what` names it in errors), holding
    /// `regions` until it is taken.
    pub(crate) fn started(
        what: &'static str,
        shared: Arc<ReqShared>,
        regions: Regions,
    ) -> Transfer {
        Transfer {
            op: InFlight::new(
                what,
                shared.flag.clone(),
                Transferred {
                    shared: shared.clone(),
                    _regions: regions,
                },
            ),
            _finisher: WakeFinisher(shared.clone()),
            shared,
        }
    }

    /// Whether it has finished.
    pub fn is_complete(&self) -> bool {
        if self.op.is_complete() {
            return true;
        }
        // Someone polling: the finisher looks from now on. (No help here: a poll makes no CUDA
        // call and never blocks, so it is fine in a host function or an executor's poll.)
        self._finisher.wake();
        false
    }

    /// The flag the progress thread sets when the request finishes.
    pub(crate) fn flag(&self) -> &CompletionFlag {
        &self.shared.flag
    }

    /// Block until it finishes (it always does by its deadline, plus the time the NIC takes to
    /// flush after a failure) and give its result.
    ///
    /// # Errors
    ///
    /// As [`Transferred::result`].
    pub fn wait(self) -> Result<TransferReport> {
        // What finished requests left parked (their regions and imports) goes here, on the
        // caller's thread.
        Tracker::global().reap();
        if self.shared.finisher.get().is_some() {
            // Look for the end ourselves for a while, as a synchronize would: no hand-off from
            // another thread when it comes soon.
            let spin = self
                ._finisher
                .finisher()
                .map_or(Duration::ZERO, |f| f.spin());
            look_until(&self.shared, deadline_after(Instant::now(), spin));
        }
        // Sleeping from now on: the finisher looks instead.
        self._finisher.wake();
        {
            let mut g = self.shared.done.lock().unwrap_or_else(|e| e.into_inner());
            while g.is_none() {
                let left = self.shared.limit.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                // Counted under the lock, before sleeping: a finisher that sets the result
                // after sees it.
                self.shared.sleepers.fetch_add(1, Ordering::AcqRel);
                g = self
                    .shared
                    .cv
                    .wait_timeout(g, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
                self.shared.sleepers.fetch_sub(1, Ordering::AcqRel);
            }
        }
        // Finished (its flag is set): at once. Otherwise (the progress thread is gone) the
        // resources are parked, never freed early.
        match self.op.wait_timeout(Duration::ZERO) {
            Ok(t) => t.result(),
            Err((e, op)) => {
                drop(op);
                Err(e)
            }
        }
    }

    /// The request as an [`InFlight`]: its fence is the [`CompletionFlag`] the progress thread
    /// sets when the request finishes.
    pub fn into_in_flight(self) -> InFlight<Transferred, CompletionFlag> {
        self.op
    }
}

/// Look for the end of the request of `shared` (helping its finisher) until it finished, the
/// finisher is gone or says the look is not worth a CPU, or `until` passed; then let go of
/// what the looks took. A look is a driver query or a completion-queue poll: the thread yields
/// once in [`HELP_YIELD`] looks, not after each (a yield at every look made the end of a short
/// copy seen later than a stream synchronize sees it; the rails' look yields itself when it
/// found nothing, as a software NIC needs the CPU). A look that panics is stopped too before
/// the panic goes on (a rails waiter would otherwise keep the polling taken for good).
fn look_until(shared: &ReqShared, until: Instant) {
    let finisher = || shared.finisher.get().and_then(Weak::upgrade);
    let mut l = Looking::Not;
    let looked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut looks = 0u32;
        while !shared.flag.is_complete() && Instant::now() < until {
            let Some(f) = finisher() else {
                break;
            };
            if !f.look(&mut l) || shared.flag.is_complete() {
                break;
            }
            looks = looks.wrapping_add(1);
            if looks.is_multiple_of(HELP_YIELD) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }));
    if let Some(f) = finisher() {
        f.stop(&mut l, shared.flag.is_complete());
    }
    if let Err(panic) = looked {
        std::panic::resume_unwind(panic);
    }
}

/// An awaited transfer ([`Transfer::spin`], `transfer.await`).
pub type TransferFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<TransferReport>> + Send>>;

impl Transfer {
    /// Await the transfer, each poll first looking for the end itself for up to `spin` in all
    /// (at most [`InFlightFuture::MAX_SPIN`](crate::completion::InFlightFuture::MAX_SPIN), 1 ms,
    /// counted from the first poll), as [`wait`](Self::wait) looks before it sleeps: inside a
    /// node it finishes what is done on its lane (driver queries), over verbs it polls the
    /// rails' completion queues when no other thread does. A short request is then seen
    /// finished without a hand-off from the finishing thread, for that much CPU of the
    /// executor's thread. `transfer.await` is `spin(Duration::ZERO)`: one look per poll that
    /// makes no driver call.
    pub fn spin(self, spin: Duration) -> TransferFuture {
        let spin = spin.min(crate::completion::InFlightFuture::<()>::MAX_SPIN);
        let shared = self.shared.clone();
        let f = self.op.deadline(self.shared.limit);
        // Kept by the future: dropped unfinished, it wakes the finisher then.
        let finisher = self._finisher;
        finisher.wake_for_future();
        let mut until: Option<Instant> = None;
        Box::pin(async move {
            let _finisher = finisher;
            let mut f = std::pin::pin!(f);
            std::future::poll_fn(|cx| {
                if !spin.is_zero() && !shared.flag.is_complete() {
                    let now = Instant::now();
                    let end = *until.get_or_insert_with(|| deadline_after(now, spin));
                    if now < end {
                        look_until(&shared, end);
                    }
                }
                if !shared.flag.is_complete()
                    && let Some(h) = shared.finisher.get().and_then(Weak::upgrade)
                {
                    h.poll_look();
                }
                f.as_mut().poll(cx)
            })
            .await?
            .result()
        })
    }
}

/// Awaiting a transfer awaits its [`InFlight`] (woken by the [`CompletionFlag`] the progress
/// thread sets) with the same bound as [`Transfer::wait`] as its deadline, then gives its result.
/// Each poll first looks for the end itself where that costs no CUDA call (the verbs rails:
/// their completion queues, when no other thread polls them). Past that bound (the progress
/// thread gone) it ends with [`Error::Timeout`](crate::Error::Timeout) and the resources
/// stay parked in the completion tracker, never freed early.
impl std::future::IntoFuture for Transfer {
    type Output = Result<TransferReport>;
    type IntoFuture = TransferFuture;

    fn into_future(self) -> TransferFuture {
        self.spin(Duration::ZERO)
    }
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("complete", &self.is_complete())
            .finish()
    }
}

impl std::fmt::Debug for Transferred {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transferred").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::transfer::region::MemoryPath;
    use crate::transfer::request::Direction;
    use std::future::IntoFuture;
    use std::task::{Context, Poll, Wake, Waker};

    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }

    fn report() -> TransferReport {
        TransferReport {
            direction: Direction::Write,
            bytes: 42,
            messages: 1,
            rail_bytes: vec![42],
            paths: vec![MemoryPath::Host],
            elapsed: Duration::ZERO,
            notified: None,
            reposted: 0,
        }
    }

    #[test]
    fn a_transfer_is_awaitable_and_woken_by_its_completion() {
        let (t, done) = Transfer::pending(Duration::from_secs(5), Regions::new());
        let mut f = t.into_future();
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut cx = Context::from_waker(&waker);
        assert!(f.as_mut().poll(&mut cx).is_pending());
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            done(Ok(report()));
        });
        let r = loop {
            match f.as_mut().poll(&mut cx) {
                Poll::Ready(r) => break r,
                Poll::Pending => std::thread::park_timeout(Duration::from_secs(5)),
            }
        };
        h.join().unwrap();
        assert_eq!(r.unwrap().bytes, 42);
    }

    #[test]
    fn a_finished_transfers_waker_runs_with_its_result_unlocked() {
        use crate::completion::testing::WokenFree;
        let (t, done) = Transfer::pending(Duration::from_secs(5), Regions::new());
        let shared = t.shared.clone();
        // A waker that polls the transfer inline takes the result's lock.
        let probe = WokenFree::new(move || shared.done.try_lock().is_ok());
        let mut f = t.into_future();
        let waker = Waker::from(probe.clone());
        assert!(
            f.as_mut()
                .poll(&mut Context::from_waker(&waker))
                .is_pending()
        );
        done(Ok(report()));
        assert_eq!(probe.count(), 1, "woken once, the result unlocked");
        match f.as_mut().poll(&mut Context::from_waker(&waker)) {
            Poll::Ready(r) => assert_eq!(r.unwrap().bytes, 42),
            Poll::Pending => panic!("finished"),
        }
    }

    #[test]
    fn an_awaited_transfer_nobody_finishes_ends_with_a_timeout_at_its_bound() {
        let (t, _done) = Transfer::pending(Duration::from_millis(10), Regions::new());
        let mut f = t.into_future();
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut cx = Context::from_waker(&waker);
        let r = loop {
            match f.as_mut().poll(&mut cx) {
                Poll::Ready(r) => break r,
                Poll::Pending => std::thread::park_timeout(Duration::from_secs(10)),
            }
        };
        assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    }

    #[test]
    fn a_transfer_finished_while_its_waiter_arrives_is_never_a_timeout() {
        // `wait` found the result but not yet the flag ("timed out after 0ns") when the flag
        // was set after the lock was let go.
        for _ in 0..2000 {
            let (t, done) = Transfer::pending(Duration::from_secs(5), Regions::new());
            let h = std::thread::spawn(move || drop(done(Ok(report()))));
            let r = t.wait();
            h.join().unwrap();
            assert_eq!(r.unwrap().bytes, 42);
        }
    }

    /// A finisher that finishes its request at its `at`th look; counts looks and stops.
    struct NthLook {
        looks: AtomicUsize,
        stops: AtomicUsize,
        at: usize,
        finish: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    }
    impl Finisher for NthLook {
        fn help(&self) {}
        fn wake(&self) {}
        fn look(&self, l: &mut Looking) -> bool {
            *l = Looking::Spins;
            if self.looks.fetch_add(1, Ordering::SeqCst) + 1 == self.at
                && let Some(f) = self.finish.lock().unwrap().take()
            {
                f();
            }
            true
        }
        fn stop(&self, l: &mut Looking, _done: bool) {
            assert_eq!(*l, Looking::Spins, "stopped once, after looking");
            *l = Looking::Not;
            self.stops.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn finished_at_look(at: usize) -> (Transfer, Arc<NthLook>) {
        let (t, done) = Transfer::pending(Duration::from_secs(5), Regions::new());
        let f = Arc::new(NthLook {
            looks: AtomicUsize::new(0),
            stops: AtomicUsize::new(0),
            at,
            finish: Mutex::new(Some(Box::new(move || drop(done(Ok(report())))))),
        });
        let weak: Weak<NthLook> = Arc::downgrade(&f);
        t.set_finisher(weak);
        (t, f)
    }

    #[test]
    fn a_spinning_await_looks_itself_and_finishes_without_a_wake_up() {
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        // A plain await looks once per poll with no driver call: no look, pending.
        let (t, fin) = finished_at_look(5);
        let mut f = t.into_future();
        assert!(
            f.as_mut()
                .poll(&mut Context::from_waker(&waker))
                .is_pending()
        );
        assert_eq!(fin.looks.load(Ordering::SeqCst), 0);
        drop(f);
        // A spinning one looks until the finisher finished it, then lets go of its looks.
        // (Fewer looks than make the thread yield: a yield on a loaded machine can outlast
        // the spin.)
        let (t, fin) = finished_at_look(5);
        let mut f = t.spin(Duration::from_secs(60));
        match f.as_mut().poll(&mut Context::from_waker(&waker)) {
            Poll::Ready(r) => assert_eq!(r.unwrap().bytes, 42),
            Poll::Pending => panic!("finished within the spin"),
        }
        assert_eq!(fin.looks.load(Ordering::SeqCst), 5);
        assert_eq!(fin.stops.load(Ordering::SeqCst), 1);
    }

    /// A finisher counting its wakes; `for_future`: whether a future asks it to look.
    struct Wakes {
        wakes: AtomicUsize,
        for_future: bool,
    }
    impl Finisher for Wakes {
        fn help(&self) {}
        fn wake(&self) {
            self.wakes.fetch_add(1, Ordering::SeqCst);
        }
        fn wake_for_future(&self) {
            if self.for_future {
                self.wake();
            }
        }
    }

    #[test]
    fn a_future_wakes_its_finisher_as_the_finisher_asks_and_again_if_dropped_unfinished() {
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        for for_future in [false, true] {
            let at_start = usize::from(for_future);
            // Dropped unfinished: woken once more then.
            let fin = Arc::new(Wakes {
                wakes: AtomicUsize::new(0),
                for_future,
            });
            let (t, _done) = Transfer::pending(Duration::from_secs(5), Regions::new());
            t.set_finisher(Arc::downgrade(&fin) as Weak<dyn Finisher>);
            let mut f = t.into_future();
            assert_eq!(fin.wakes.load(Ordering::SeqCst), at_start, "made a future");
            assert!(
                f.as_mut()
                    .poll(&mut Context::from_waker(&waker))
                    .is_pending()
            );
            assert_eq!(fin.wakes.load(Ordering::SeqCst), at_start, "polled");
            drop(f);
            assert_eq!(fin.wakes.load(Ordering::SeqCst), at_start + 1, "dropped");
            // Finished: nothing more when it ends.
            let (t, done) = Transfer::pending(Duration::from_secs(5), Regions::new());
            let fin = Arc::new(Wakes {
                wakes: AtomicUsize::new(0),
                for_future,
            });
            t.set_finisher(Arc::downgrade(&fin) as Weak<dyn Finisher>);
            let mut f = t.into_future();
            drop(done(Ok(report())));
            match f.as_mut().poll(&mut Context::from_waker(&waker)) {
                Poll::Ready(r) => assert_eq!(r.unwrap().bytes, 42),
                Poll::Pending => panic!("finished"),
            }
            drop(f);
            assert_eq!(fin.wakes.load(Ordering::SeqCst), at_start, "finished");
        }
    }

    /// A finisher whose look finishes the request, then panics; counts stops.
    struct PanicLook {
        stops: AtomicUsize,
        finish: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    }
    impl Finisher for PanicLook {
        fn help(&self) {}
        fn wake(&self) {}
        fn look(&self, l: &mut Looking) -> bool {
            *l = Looking::Polls;
            // Finished first: the unwinding drop of the transfer does not wait for it.
            if let Some(f) = self.finish.lock().unwrap().take() {
                f();
            }
            panic!("a look that panics");
        }
        fn stop(&self, l: &mut Looking, _done: bool) {
            assert_eq!(
                *l,
                Looking::Polls,
                "stopped after the look took the polling"
            );
            *l = Looking::Not;
            self.stops.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_look_that_panics_is_stopped_before_the_panic_goes_on() {
        let (t, done) = Transfer::pending(Duration::from_secs(5), Regions::new());
        let fin = Arc::new(PanicLook {
            stops: AtomicUsize::new(0),
            finish: Mutex::new(Some(Box::new(move || drop(done(Ok(report())))))),
        });
        t.set_finisher(Arc::downgrade(&fin) as Weak<dyn Finisher>);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| t.wait()));
        assert!(r.is_err(), "the look's panic goes on");
        assert_eq!(fin.stops.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_spinning_await_spends_its_spin_once() {
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        let (t, fin) = finished_at_look(usize::MAX);
        let spin = Duration::from_micros(300);
        let mut f = t.spin(spin);
        let t0 = Instant::now();
        assert!(
            f.as_mut()
                .poll(&mut Context::from_waker(&waker))
                .is_pending()
        );
        assert!(t0.elapsed() >= spin);
        let (looks, stops) = (
            fin.looks.load(Ordering::SeqCst),
            fin.stops.load(Ordering::SeqCst),
        );
        assert!(looks > 0);
        assert_eq!(stops, 1);
        // The next poll does not look again: the spin is spent.
        assert!(
            f.as_mut()
                .poll(&mut Context::from_waker(&waker))
                .is_pending()
        );
        assert_eq!(fin.looks.load(Ordering::SeqCst), looks);
    }

    #[test]
    fn a_failed_transfer_gives_its_error_blocking_or_awaited() {
        let (t, done) = Transfer::pending(Duration::from_secs(5), Regions::new());
        done(Err(Broken::Deadline(Duration::from_secs(3)).to_error()));
        assert!(matches!(t.wait(), Err(Error::Timeout { .. })));
        let (t, done) = Transfer::pending(Duration::from_secs(5), Regions::new());
        done(Err(
            Broken::Disconnected("RDMA_CM_EVENT_DISCONNECTED", 0).to_error()
        ));
        let mut f = t.into_future();
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        match f.as_mut().poll(&mut Context::from_waker(&waker)) {
            Poll::Ready(Err(Error::CmEvent { got, .. })) => {
                assert_eq!(got, "RDMA_CM_EVENT_DISCONNECTED")
            }
            other => panic!("{other:?}"),
        }
    }
}
