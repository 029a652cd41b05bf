//! [`Timeline`] and [`StreamFence`]: amortised completion epochs of one stream.

use super::backoff::{Backoff, LONG_WAIT, poll_until};
use super::capture::PrivateStream;
use super::fence::Fence;
use super::thread::{self, Watch, Watched};
use crate::error::{Error, Result};
use cudarc::driver::{CudaEvent, CudaStream, sys};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Waker;
use std::time::Duration;

/// Completion state of one stream, shared by its [`StreamFence`]s.
///
/// Every operation issued on the stream takes the next epoch ([`Timeline::issue`], one atomic
/// add). Nothing is recorded per operation: when a fence is asked again (or waited for, or
/// watched by the completion thread) and no recorded event covers its epoch yet, one event is
/// recorded then, covering every epoch issued so far (stream order makes a later event complete
/// only after all earlier work). Events are recycled. The
/// exceptions are the intra-node endpoint's: its lanes record an event right behind a long
/// request's copies, and a stream-ordered request one right behind its copies on the caller's
/// stream.
///
/// Futures awaiting its fences wait in one list per stream: the shared completion thread polls
/// the stream's oldest pending event (`cuEventQuery`) once per round, whatever the number of
/// futures, and wakes every future whose epoch that event covers.
#[derive(Debug)]
pub struct Timeline {
    stream: Queue,
    issued: Line<AtomicU64>,
    completed: Line<AtomicU64>,
    events: Mutex<Events>,
    waiters: Mutex<Waiters>,
}

/// The stream of a [`Timeline`].
#[derive(Debug)]
enum Queue {
    /// A stream anybody may hold: the driver is asked whether it captures.
    Shared(Arc<CudaStream>),
    /// One of the library's own: it never captures, and the driver is not asked.
    Private(PrivateStream),
}

/// A value on lines of its own (128 bytes: x86 fetches lines in adjacent pairs). A timeline's
/// epoch counters are written on every issue and every wait, often by different threads: on a
/// shared line each write would pull the line away from the other thread, or from whatever
/// unrelated data the allocator put beside it. (The p2p bench, which issues and waits on one
/// thread, showed no difference either way.)
#[repr(align(128))]
pub(crate) struct Line<T>(pub(crate) T);

impl<T: std::fmt::Debug> std::fmt::Debug for Line<T> {
    /// As the value itself: the padding is no part of what a timeline shows.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Futures waiting on epochs of a timeline.
#[derive(Debug, Default)]
struct Waiters {
    /// Epoch and the waker to wake once it completes.
    list: Vec<(u64, Waker)>,
    /// Whether the completion thread watches the timeline.
    watched: bool,
}

/// At most this many events pending on a stream for [`Timeline::mark`]: beyond, marks are
/// skipped and a later poll's event covers more work at once.
#[cfg_attr(
    not(all(feature = "transfer", feature = "p2p")),
    allow(dead_code, reason = "the intra-node endpoint's lanes")
)]
const MARKS: usize = 64;

#[derive(Debug, Default)]
struct Events {
    /// Recorded events and the last epoch each covers, oldest first.
    pending: VecDeque<(u64, CudaEvent)>,
    /// Completed events, ready to be recorded again.
    free: Vec<CudaEvent>,
    /// The error `cuEventQuery` answered for a pending event (a sticky error: the stream's work
    /// will never be seen complete).
    failed: Option<sys::CUresult>,
}

impl Timeline {
    /// A timeline for `stream`.
    pub fn new(stream: Arc<CudaStream>) -> Arc<Self> {
        Self::on(Queue::Shared(stream))
    }

    /// A timeline for a [`PrivateStream`]: its waits and event records ask the driver no
    /// capture questions (a `cuStreamIsCapturing` before each `cuStreamSynchronize`, two around
    /// each `cuEventRecord`).
    #[cfg_attr(
        not(feature = "p2p"),
        allow(dead_code, reason = "p2p's private streams")
    )]
    pub(crate) fn new_private(stream: PrivateStream) -> Arc<Self> {
        Self::on(Queue::Private(stream))
    }

    fn on(stream: Queue) -> Arc<Self> {
        Arc::new(Timeline {
            stream,
            issued: Line(AtomicU64::new(0)),
            completed: Line(AtomicU64::new(0)),
            events: Mutex::new(Events::default()),
            waiters: Mutex::new(Waiters::default()),
        })
    }

    /// The stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        match &self.stream {
            Queue::Shared(s) => s,
            Queue::Private(p) => p.cuda(),
        }
    }

    /// The stream, when it is one of the library's own ([`new_private`](Self::new_private)).
    #[cfg_attr(
        not(all(feature = "transfer", feature = "p2p")),
        allow(dead_code, reason = "the local endpoint's streams")
    )]
    pub(crate) fn private_stream(&self) -> Option<&PrivateStream> {
        match &self.stream {
            Queue::Shared(_) => None,
            Queue::Private(p) => Some(p),
        }
    }

    /// A fence for everything queued on the stream so far. Call it after queueing the work.
    #[inline]
    pub fn issue(self: &Arc<Self>) -> StreamFence {
        let epoch = self.issued.0.fetch_add(1, Ordering::AcqRel) + 1;
        StreamFence {
            timeline: self.clone(),
            state: AtomicU64::new(epoch),
        }
    }

    /// The highest epoch known complete.
    #[inline]
    pub fn completed(&self) -> u64 {
        self.completed.0.load(Ordering::Acquire)
    }

    /// The highest epoch issued.
    pub fn issued(&self) -> u64 {
        self.issued.0.load(Ordering::Acquire)
    }

    /// Every epoch up to `epoch` is complete: the caller saw the stream finish the work before
    /// it (a `cuStreamSynchronize` that returned success after that work was queued).
    pub(crate) fn completed_through(&self, epoch: u64) {
        self.completed.0.fetch_max(epoch, Ordering::AcqRel);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Events> {
        self.events.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Retire completed events; make sure one covers `epoch` (`eager`), or that one is pending
    /// at all (not `eager`: a later one covers `epoch` once that one completed, so many futures
    /// polled while work is still being queued record one event at a time, not one each).
    /// Returns whether `epoch` is done, and whether an event covers it (`false` when none could
    /// be recorded: the stream is capturing a graph, or the driver refused; or, not `eager`, when
    /// an older one is pending).
    ///
    /// Never records while the stream captures a graph: an event recorded in a capture is a
    /// captured event, which completes with the capture rather than with the work (and which
    /// `cuEventQuery` refuses with `CUDA_ERROR_CAPTURED_EVENT`). One that was recorded anyway (a
    /// capture that began during the record) is dropped from the timeline and leaked, so later
    /// polls record a real one instead of waiting on it forever.
    fn poll(&self, epoch: u64, eager: bool) -> (bool, bool) {
        // Queries and records need the stream's context current on this thread (a completion
        // or executor thread may never have had it); a query error is then the stream's own.
        let stream = self.stream();
        if crate::driver::ctx::bind(stream.context()).is_err() {
            return (self.completed() >= epoch, false);
        }
        self.retire();
        if self.completed() >= epoch {
            return (true, true);
        }
        let mut g = self.lock();
        if g.pending.iter().any(|(c, _)| *c >= epoch) {
            return (false, true);
        }
        if !eager && !g.pending.is_empty() {
            return (false, false);
        }
        // No event covers `epoch` yet: record one covering everything issued so far.
        (false, self.record(&mut g))
    }

    /// Record an event now, covering every epoch issued so far, unless the newest pending one
    /// covers them already or [`MARKS`] are pending. For work that runs long on the stream
    /// behind other work: a poll records only when asked, covering all issued by then, so a
    /// wait for the first of many long requests would see it done only once the last is, and
    /// then finish them all while the stream sits idle. Returns whether an event covers the
    /// newest epoch. The stream's context must be current.
    #[cfg_attr(
        not(all(feature = "transfer", feature = "p2p")),
        allow(dead_code, reason = "the intra-node endpoint's lanes")
    )]
    pub(crate) fn mark(&self) -> bool {
        let mut g = self.lock();
        let issued = self.issued();
        if g.pending.back().is_some_and(|(c, _)| *c >= issued) {
            return true;
        }
        if g.pending.len() >= MARKS {
            return false;
        }
        self.record(&mut g)
    }

    /// Issue the next epoch and record an event covering it on `raw`, this timeline's stream,
    /// right behind the work the caller just queued there: for a caller inside its own
    /// capture-checked enqueue (`capture::enqueue`), whose checks then cover the record too.
    /// The epoch, or `None` when no event could be made or recorded (the epoch is issued all
    /// the same). An epoch, not a fence: a capture found after the record leaks what the
    /// closure returned, and a fence would hold the timeline (and the stream) forever.
    ///
    /// # Safety
    ///
    /// `raw` is this timeline's stream, and its context is current.
    #[cfg_attr(
        not(all(feature = "transfer", feature = "p2p")),
        allow(dead_code, reason = "the intra-node endpoint's stream requests")
    )]
    pub(crate) unsafe fn issue_recorded(&self, raw: sys::CUstream) -> Option<u64> {
        let epoch = self.issued.0.fetch_add(1, Ordering::AcqRel) + 1;
        let mut g = self.lock();
        // Read before the record, as `record` does: every epoch issued by then had its work
        // queued before it (epochs are issued after their work). Read after, it could cover
        // another thread's work queued behind this event.
        let covered = self.issued();
        let ev = self.pooled_event(&mut g)?;
        // SAFETY: a live event of this timeline; the stream and its context are the caller's.
        match unsafe { crate::driver::event::record(ev.cu_event(), raw) } {
            Ok(()) => {
                g.pending.push_back((covered, ev));
                Some(epoch)
            }
            Err(_) => {
                g.free.push(ev);
                None
            }
        }
    }

    /// The fence of `epoch`, an epoch this timeline issued.
    #[cfg_attr(
        not(all(feature = "transfer", feature = "p2p")),
        allow(dead_code, reason = "the intra-node endpoint's stream requests")
    )]
    pub(crate) fn fence_at(self: &Arc<Self>, epoch: u64) -> StreamFence {
        debug_assert!(epoch <= self.issued());
        StreamFence {
            timeline: self.clone(),
            state: AtomicU64::new(epoch),
        }
    }

    /// Whether `epoch` is seen complete, retiring completed events, recording none (a query
    /// of the pending ones only).
    pub(crate) fn query(&self, epoch: u64) -> bool {
        if self.completed() >= epoch {
            return true;
        }
        if crate::driver::ctx::bind(self.stream().context()).is_err() {
            return false;
        }
        self.retire();
        self.completed() >= epoch
    }

    /// Retire the completed events at the front of the pending ones (the stream's context
    /// current), asking the driver without the lock held: a thread recording the next event
    /// (the one queueing work on the stream) then never waits for a query. The
    /// front is looked at under the lock, asked outside it, and retired only if it is still
    /// the front (the same event covering the same epoch) once the lock is taken again. An
    /// event retired and recorded again meanwhile covers a later epoch (epochs only grow), so
    /// its answer is dropped; one recorded again covering the same epoch stands for the same
    /// work, so either answer is true of it. Events are destroyed only with the timeline, so
    /// the handle asked is live.
    fn retire(&self) {
        loop {
            let (covered, raw) = match self.lock().pending.front() {
                Some((c, ev)) => (*c, ev.cu_event()),
                None => return,
            };
            // SAFETY: as above: a live event of this timeline.
            let answer = unsafe { crate::driver::event::query_code(raw) };
            let mut g = self.lock();
            let same = g
                .pending
                .front()
                .is_some_and(|(c, ev)| *c == covered && ev.cu_event() == raw);
            if !same || !Self::apply(&mut g, covered, answer, &self.completed.0) {
                return;
            }
        }
    }

    /// Apply the driver's answer about the front pending event (covering `covered`): retire it
    /// when complete, or forget it when it was captured (both `true`: look at the next one);
    /// record a sticky error.
    fn apply(
        g: &mut std::sync::MutexGuard<'_, Events>,
        covered: u64,
        answer: std::result::Result<bool, sys::CUresult>,
        completed: &AtomicU64,
    ) -> bool {
        match answer {
            Ok(true) => {
                completed.fetch_max(covered, Ordering::AcqRel);
                let (_, ev) = g.pending.pop_front().expect("front exists");
                g.free.push(ev);
                true
            }
            Err(sys::CUresult::CUDA_ERROR_CAPTURED_EVENT) => {
                // Proves nothing: forget it (destroying a captured event is not worth the
                // risk) and look at the next one.
                let (_, ev) = g.pending.pop_front().expect("front exists");
                std::mem::forget(ev);
                true
            }
            Ok(false) => false,
            Err(e) => {
                g.failed = Some(e);
                false
            }
        }
    }

    /// Record one event covering everything issued so far (epochs are handed out after their
    /// work is queued, so the record comes after that work); `false` when none could be
    /// recorded.
    fn record(&self, g: &mut std::sync::MutexGuard<'_, Events>) -> bool {
        let stream = self.stream();
        let covered = self.issued.0.load(Ordering::Acquire);
        let Some(ev) = self.pooled_event(g) else {
            return false;
        };
        // Checked like any work queued on the stream, but a capture found after the record is
        // left alone: an internal event puts nothing into the user's graph.
        let record = |ev: &CudaEvent| {
            ev.record(stream)
                .map_err(|e| crate::error::from_driver("cuEventRecord", e))
        };
        let recorded = match &self.stream {
            Queue::Private(p) => p.enqueue("cuEventRecord", ev, |_, ev| record(ev)),
            Queue::Shared(s) => {
                super::capture::enqueue_record(s.cu_stream(), "cuEventRecord", ev, record)
            }
        };
        match recorded {
            Ok(((), ev)) => {
                g.pending.push_back((covered, ev));
                true
            }
            Err(r) => {
                if let Some(ev) = r.kept {
                    g.free.push(ev); // not recorded: reusable
                }
                false
            }
        }
    }

    /// A completed event to record again, or a new one; `None` when none can be made.
    fn pooled_event(&self, g: &mut std::sync::MutexGuard<'_, Events>) -> Option<CudaEvent> {
        g.free
            .pop()
            .or_else(|| self.stream().context().new_event(None).ok())
    }

    /// The error that stops completion from ever being observed, if a query answered one.
    fn failed(&self) -> Option<sys::CUresult> {
        self.lock().failed
    }

    fn lock_waiters(&self) -> std::sync::MutexGuard<'_, Waiters> {
        self.waiters.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wake `waker` once `epoch` completes (or the stream fails); `false` when the completion
    /// thread could not be started.
    fn register(self: &Arc<Self>, epoch: u64, waker: &Waker) -> bool {
        let start_watch = {
            let mut w = self.lock_waiters();
            w.list.push((epoch, waker.clone()));
            !std::mem::replace(&mut w.watched, true)
        };
        if start_watch && thread::watch(Arc::new(TimelineWatch(self.clone()))).is_err() {
            let mut w = self.lock_waiters();
            w.watched = false;
            w.list.retain(|(e, k)| !(*e == epoch && k.will_wake(waker)));
            return false;
        }
        true
    }

    /// Whether the stream is capturing a graph (or that cannot be told).
    fn capturing(&self) -> bool {
        match &self.stream {
            Queue::Private(p) => p.is_capturing(),
            Queue::Shared(s) => {
                crate::driver::ctx::bind(s.context()).is_err()
                    || super::capture::is_capturing(s.cu_stream()).unwrap_or(true)
            }
        }
    }
}

/// The completion thread's watch over one timeline's waiting futures.
struct TimelineWatch(Arc<Timeline>);

impl Watch for TimelineWatch {
    fn poll(&self) -> Watched {
        let tl = &self.0;
        let newest = {
            let mut w = tl.lock_waiters();
            match w.list.iter().map(|(e, _)| *e).max() {
                Some(e) => e,
                None => {
                    w.watched = false;
                    return Watched::Done;
                }
            }
        };
        // Retires completed events, and records one covering `newest` once none is pending.
        let _ = tl.poll(newest, false);
        let completed = tl.completed();
        let failed = tl.failed().is_some();
        let woken: Vec<(u64, Waker)> = tl
            .lock_waiters()
            .list
            .extract_if(.., |(e, _)| failed || *e <= completed)
            .collect();
        if woken.is_empty() {
            return Watched::Pending;
        }
        for (_, w) in woken {
            thread::contained(|| w.wake());
        }
        Watched::Progress
    }
}

/// A fence on an epoch of a stream's [`Timeline`]: complete once all work queued on the stream
/// before the fence was made has finished. Cheap to make (no driver call) and to clone.
pub struct StreamFence {
    timeline: Arc<Timeline>,
    /// The epoch, and [`ASKED`] once [`check`](Fence::check) was asked (it may then record an
    /// event): one word, so that a fence stays two words (futures move it often).
    state: AtomicU64,
}

/// [`StreamFence::state`]'s bit for a fence asked before. Epochs never reach it: one a
/// nanosecond would take 292 years.
const ASKED: u64 = 1 << 63;

impl Clone for StreamFence {
    /// The same epoch, counted as asked: a caller that checks a new clone each time still sees
    /// an event recorded.
    fn clone(&self) -> Self {
        StreamFence {
            timeline: self.timeline.clone(),
            state: AtomicU64::new(self.epoch() | ASKED),
        }
    }
}

impl std::fmt::Debug for StreamFence {
    /// The timeline and the epoch (not the asked bit).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamFence")
            .field("timeline", &self.timeline)
            .field("epoch", &self.epoch())
            .finish()
    }
}

impl StreamFence {
    /// The epoch this fence waits for.
    pub fn epoch(&self) -> u64 {
        self.state.load(Ordering::Relaxed) & !ASKED
    }

    /// The stream's timeline. Crate-private: a fence of a stream the library owns (a copier's
    /// lane) must not hand that stream out, since only the library may queue work on it (see
    /// `p2p::lane`'s capture argument).
    pub(crate) fn timeline(&self) -> &Arc<Timeline> {
        &self.timeline
    }
}

impl Fence for StreamFence {
    fn is_complete(&self) -> bool {
        self.timeline.completed() >= self.epoch() || self.timeline.poll(self.epoch(), true).0
    }

    /// Complete, not yet, or [`Error::Cuda`] naming `cuEventQuery` once the stream's events
    /// answer an error (a sticky error: the work will never be seen complete). Records an event
    /// only when none is pending on the stream, and not at the first ask, so that asking again
    /// and again still ends. A future asks once before it registers, and the completion
    /// thread then records for every future waiting on the stream: an event recorded at each
    /// future's first poll contends with the thread queueing work on the stream.
    fn check(&self) -> Result<bool> {
        let state = self.state.load(Ordering::Relaxed);
        if state & ASKED == 0 {
            self.state.store(state | ASKED, Ordering::Relaxed);
        }
        self.check_recording(state & ASKED != 0)
    }

    /// Joins the stream's list of waiting futures, which the completion thread serves with one
    /// event query per round.
    fn register_waker(&self, waker: &Waker) -> bool {
        self.timeline.register(self.epoch(), waker)
    }

    #[inline]
    fn wait_timeout(&self, timeout: Duration) -> bool {
        // Every wait after the one that synchronized the stream ends here.
        self.timeline.completed() >= self.epoch() || self.wait_slow(timeout)
    }
}

impl StreamFence {
    /// [`check`](Fence::check), recording an event when none is pending (`record`) or only
    /// asking the pending ones: for a caller that looks again and again with nothing else
    /// watching the stream (the intra-node endpoint's worker), which must record from the first
    /// look.
    pub(crate) fn check_recording(&self, record: bool) -> Result<bool> {
        let tl = &self.timeline;
        if tl.completed() >= self.epoch() {
            return Ok(true);
        }
        if let Some(code) = tl.failed() {
            return Err(Error::cuda("cuEventQuery", code));
        }
        // While the completion thread watches the stream it queries for every future waiting
        // on it: a future's own poll adds no driver call (which would contend with the thread
        // queueing work on the stream).
        if tl.lock_waiters().watched {
            return Ok(false);
        }
        let done = if record {
            tl.poll(self.epoch(), false).0
        } else {
            tl.query(self.epoch())
        };
        if done {
            return Ok(true);
        }
        match tl.failed() {
            Some(code) => Err(Error::cuda("cuEventQuery", code)),
            None => Ok(false),
        }
    }

    #[cold]
    fn wait_slow(&self, timeout: Duration) -> bool {
        if timeout >= LONG_WAIT {
            let tl = &self.timeline;
            if tl.capturing() {
                // cuStreamSynchronize is illegal on a capturing stream (and would invalidate the
                // user's capture). Wait on an event recorded before the capture, if one covers
                // the epoch; without one, completion cannot be observed now: answer `false` (the
                // caller gets an error and the resources stay parked, freed by a later reap once
                // the capture has ended) rather than waiting for a capture that this very thread
                // may be holding open.
                let mut backoff = Backoff::new();
                loop {
                    match tl.poll(self.epoch(), true) {
                        (true, _) => return true,
                        (false, false) => return false,
                        (false, true) => {}
                    }
                    if !tl.capturing() {
                        break; // the capture ended: synchronize below
                    }
                    backoff.snooze();
                }
            }
            // Unbounded wait: one cuStreamSynchronize (what a hand-written loop would do) covers
            // every epoch issued before it, including this one.
            // If it fails (a sticky error, or a capture that began just now), completion cannot
            // be proven: answer `false` (the caller gets an error, the resources stay parked)
            // instead of polling forever.
            let covered = self.timeline.issued.0.load(Ordering::Acquire);
            if crate::driver::ctx::bind(tl.stream().context()).is_err() {
                return tl.completed() >= self.epoch();
            }
            // SAFETY: a live stream (the timeline holds it), its context current.
            let r = unsafe { crate::driver::stream::synchronize(tl.stream().cu_stream()) };
            if r.is_ok() {
                tl.completed_through(covered);
                return true;
            }
            return tl.completed() >= self.epoch();
        }
        poll_until(|| self.is_complete(), timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A mark records one event per long piece of work (not when the newest covers it, not
    /// past [`MARKS`]), so that each epoch is seen complete by its own event; without marks a
    /// poll records one covering everything issued.
    #[test]
    #[cfg(any(feature = "p2p", feature = "transfer"))]
    fn a_mark_records_an_event_behind_each_piece_of_work() {
        use crate::testing::Hardware;
        let ctx = crate::require!(Hardware::Gpu, crate::cuda::context(0));
        let stream = crate::require!(Hardware::Gpu, crate::cuda::Stream::new(&ctx));
        crate::driver::ctx::bind(&ctx).unwrap();
        let tl = stream.timeline();
        let covered =
            |tl: &Timeline| -> Vec<u64> { tl.lock().pending.iter().map(|(c, _)| *c).collect() };
        let a = tl.issue();
        assert!(tl.mark());
        assert!(tl.mark(), "covered already");
        let b = tl.issue();
        assert!(tl.mark());
        assert_eq!(covered(tl), [a.epoch(), b.epoch()]);
        let more: Vec<StreamFence> = (0..2 * MARKS)
            .map(|_| {
                let f = tl.issue();
                tl.mark();
                f
            })
            .collect();
        assert_eq!(covered(tl).len(), MARKS, "bounded");
        let last = more.last().unwrap();
        assert!(last.wait_timeout(Duration::from_secs(10)));
        assert!(a.is_complete() && b.is_complete());

        // Unmarked: one event, recorded by the poll, covers every epoch issued by then.
        let plain = crate::require!(Hardware::Gpu, crate::cuda::Stream::new(&ctx));
        let tl = plain.timeline();
        let (a, _b) = (tl.issue(), tl.issue());
        assert!(!tl.poll(a.epoch(), false).0 || tl.completed() >= 2);
        assert!(covered(tl).iter().all(|&c| c == 2), "{:?}", covered(tl));
    }

    /// A fence's first check records no event (a future registers right after it, and the
    /// completion thread records); from the second on it records one when none is pending, so
    /// that checking in a loop ends. A clone counts as asked: checking a new clone each time
    /// ends too.
    #[test]
    #[cfg(any(feature = "p2p", feature = "transfer"))]
    fn a_first_check_records_nothing_and_a_second_does() {
        use crate::testing::Hardware;
        let ctx = crate::require!(Hardware::Gpu, crate::cuda::context(0));
        let stream = crate::require!(Hardware::Gpu, crate::cuda::Stream::new(&ctx));
        let tl = stream.timeline();
        let pending = |tl: &Timeline| tl.lock().pending.len();
        let f = tl.issue();
        assert!(!f.check().unwrap(), "no event covers it yet");
        assert_eq!(pending(tl), 0, "the first check recorded");
        let g = tl.issue();
        let start = std::time::Instant::now();
        while !g.clone().check().unwrap() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "clones never complete"
            );
        }
        while !f.check().unwrap() {
            assert!(start.elapsed() < Duration::from_secs(10), "never complete");
        }
        assert_eq!((f.epoch(), g.epoch()), (1, 2));
        assert!(format!("{g:?}").contains("epoch: 2"), "{g:?}");
        assert!(f.is_complete());
    }

    #[test]
    fn a_padded_counter_prints_as_its_value() {
        let l = Line(AtomicU64::new(7));
        assert_eq!(format!("{l:?}"), "7");
        assert_eq!(std::mem::align_of::<Line<AtomicU64>>(), 128);
    }
}
