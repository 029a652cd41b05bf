//! A request armed on a stream queue: the queue's words it shares, its outcome as the proxy
//! leaves it, and [`StreamTransfer`], the request as users see it.

use super::window::{DONE, geq_releases, trigger_slot};
use super::words::{STREAM_ERROR_BIT, WordMemory, drop_words_freely};
use crate::completion::capture::Refused;
use crate::completion::deferred::Woken;
use crate::completion::elsewhere::drop_freely;
use crate::completion::{CompletionFlag, Fence, InFlight, Line, poll_until};
use crate::cuda::{MemopFlags, Stream, WaitCondition};
use crate::error::{Error, Result};
use crate::transfer::request::TransferReport;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// One queue's words.
pub(crate) struct Queue {
    pub(super) id: u64,
    pub(super) words: Box<dyn WordMemory>,
    /// The proxy's bell, nudged while the host waits ([`StreamTransfer::wait`]).
    pub(super) bell: Arc<dyn Nudge>,
    /// At most the lowest seq whose trigger has not been seen (the proxy publishes it):
    /// arming checks its window against it without the proxy's lock. On lines of its own: the
    /// proxy stores it every round, and callers take and let go of the queue (its reference
    /// count) at every request.
    pub(super) low: Line<AtomicU64>,
    /// The highest seq a waiter asked for ([`StreamTransfer::wait_on`], `.await`,
    /// [`StreamTransfer::wait`], [`StreamTransfer::completion_word`]; 0: none): while a request
    /// up to it is armed behind a fence the proxy looks without napping. Its own allocation:
    /// the proxy holds it, never the words.
    pub(super) waited: Arc<AtomicU64>,
    /// The proxy whose round a host waiter runs itself ([`Helper`]); weak: the proxy's words
    /// must not keep it.
    pub(super) helper: Weak<dyn Helper>,
    /// How the proxy ended lean requests ([`End::Lean`]) that the word does not tell: failed
    /// ones, and successes past the word's prefix (dropped once the prefix covers them). Taken
    /// by their hosts.
    pub(super) decided: Mutex<BTreeMap<u64, Result<()>>>,
}

impl Queue {
    pub(super) fn new(id: u64, words: Box<dyn WordMemory>, bell: Arc<dyn Nudge>) -> Queue {
        Queue {
            id,
            words,
            bell,
            low: Line(AtomicU64::new(1)),
            waited: Arc::new(AtomicU64::new(0)),
            helper: Weak::<NoHelper>::new(),
            decided: Mutex::new(BTreeMap::new()),
        }
    }

    /// Whether the word's prefix covers `seq` (it and every earlier request succeeded).
    pub(super) fn covers(&self, seq: u64) -> bool {
        geq_releases(self.words.load(DONE) & !STREAM_ERROR_BIT, seq)
    }

    fn decided(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Result<()>>> {
        self.decided.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The same queue, its host waiters running `helper`'s rounds.
    pub(super) fn helped_by(mut self, helper: Weak<dyn Helper>) -> Queue {
        self.helper = helper;
        self
    }
}

/// A proxy whose round a caller's thread can run: a host that waits for (or looks at) a request
/// finishes what is done itself, without waking the proxy thread.
pub(crate) trait Helper: Send + Sync {
    /// One round on this thread, unless another thread is in one (or this is a proxy thread):
    /// what fired is started, what finished ended. Whether it ran.
    fn help(&self) -> bool;
    /// Decide the lean requests of queue `id` that can be now (their fences completed, their
    /// deadlines passed), waiting for the proxy's lock; whether the proxy still knows the
    /// queue (a queue it let go of decided everything it knew).
    fn decide(&self, id: u64) -> bool;
}

/// No proxy to help (a queue made alone, in tests).
struct NoHelper;

impl Helper for NoHelper {
    fn help(&self) -> bool {
        false
    }
    fn decide(&self, _: u64) -> bool {
        false
    }
}

impl Drop for Queue {
    /// Let go of on a thread that frees nothing (its last handle dropped by code a waker ran on
    /// a stream proxy), the words go to a thread that may wait for the streams that used them.
    fn drop(&mut self) {
        drop_words_freely(&mut self.words);
    }
}

/// A request's result as the proxy leaves it, with what it held (dropped by whoever takes the
/// result, or with the outcome; never on a thread that frees nothing, as the proxy's).
pub(super) struct Outcome {
    pub(super) flag: CompletionFlag,
    pub(super) slot: Mutex<Option<(Result<TransferReport>, Option<Keep>)>>,
}

impl Drop for Outcome {
    fn drop(&mut self) {
        // A result never taken: what the request held goes with it.
        let slot = self.slot.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some((_, Some(keep))) = slot.take() {
            drop_freely(keep);
        }
    }
}

/// What a finished request still holds (its memory regions): dropped off the proxy thread.
pub(crate) type Keep = Box<dyn Send>;

impl Outcome {
    /// Store the result; the flag goes to `woken`, set once the proxy's lock is let go.
    pub(super) fn set(&self, r: Result<TransferReport>, keep: Option<Keep>, woken: &mut Woken) {
        let mut g = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            *g = Some((r, keep));
        }
        drop(g);
        woken.push(self.flag.clone());
    }
}

/// Where a stream request's trigger goes, given to the maker of its work once its sequence
/// number is taken: work that queues its own copies on the stream may store the trigger itself
/// (the intra-node copy kernel does, after its bytes).
#[cfg_attr(
    not(feature = "p2p"),
    allow(dead_code, reason = "the intra-node path stores its own triggers")
)]
pub(crate) struct Mark<'a> {
    pub(super) queue: &'a Arc<Queue>,
    pub(crate) seq: u64,
}

#[cfg_attr(
    not(feature = "p2p"),
    allow(dead_code, reason = "the intra-node path stores its own triggers")
)]
impl Mark<'_> {
    /// The queue's CUDA words (a stream's queue always has them).
    pub(crate) fn flags(&self) -> Result<&MemopFlags> {
        self.queue
            .words
            .flags()
            .ok_or_else(|| Error::invalid("stream", "a host-triggered queue", "has no CUDA words"))
    }

    /// The slot of the trigger word.
    pub(crate) fn slot(&self) -> usize {
        trigger_slot(self.seq)
    }

    /// Queue `cuStreamWriteValue64(trigger, seq)` on `stream` (the capture-checked path, a use
    /// of the queue's words), after whatever the stream has queued before: `keep` is what that
    /// work reaches, given back as the enqueue path gives it.
    pub(crate) fn queue_trigger<R>(
        &self,
        stream: &Stream,
        keep: R,
    ) -> std::result::Result<((), R), Refused<R>> {
        let flags = match self.flags() {
            Ok(f) => f,
            Err(error) => {
                return Err(Refused {
                    error,
                    kept: Some(keep),
                });
            }
        };
        let seq = self.seq;
        flags.enqueue_writing(
            stream,
            self.slot(),
            "cuStreamWriteValue64_v2",
            keep,
            |raw, word, _| {
                // SAFETY: the queue's trigger word, live while the queue is (freed only once
                // every stream that used it passed its operations); a stream's queue is made
                // only where 64-bit stream memory operations work.
                unsafe { crate::driver::memop::write_value64(raw, word, seq) }
            },
        )
    }

    /// Complete once the stream has stored the trigger.
    pub(crate) fn fence(&self) -> TriggerFence {
        TriggerFence {
            queue: self.queue.clone(),
            seq: self.seq,
        }
    }
}

/// Complete once the request's trigger word was stored by its stream, so once the work queued
/// before the trigger on that stream is done (no driver call: a load of the word). A later
/// value in the slot counts too: a slot is taken again only after its trigger was seen, and
/// never once its queue retired (which a request whose trigger was late retires). Only made
/// for a trigger that was queued.
#[cfg_attr(
    not(feature = "p2p"),
    allow(dead_code, reason = "the intra-node path stores its own triggers")
)]
pub(crate) struct TriggerFence {
    queue: Arc<Queue>,
    seq: u64,
}

impl Fence for TriggerFence {
    fn is_complete(&self) -> bool {
        self.queue.words.load(trigger_slot(self.seq)) >= self.seq
    }
}

/// A request armed on a stream queue ([`Endpoint::write_on`](crate::transfer::Endpoint::write_on), [`Endpoint::read_on`](crate::transfer::Endpoint::read_on), or the
/// host-triggered [`Endpoint::write_triggered`](crate::transfer::Endpoint::write_triggered), [`Endpoint::read_triggered`](crate::transfer::Endpoint::read_triggered)): its sequence
/// number, the queue's completion word, and the host's view of its result.
///
/// It holds the queue's words (an `Arc` shared with the queue): the memory stays while any
/// stream operation may still reach it, and leaks if this is leaked.
#[must_use = "a stream transfer runs when its trigger fires; wait for it (on a stream or the host)"]
pub struct StreamTransfer {
    pub(super) queue: Arc<Queue>,
    pub(super) seq: u64,
    pub(super) end: End,
    pub(super) host: bool,
    pub(super) limit: Instant,
}

/// How the host learns a request's end.
pub(super) enum End {
    /// The proxy ends it and leaves the result.
    Proxy(Arc<Outcome>),
    /// A lean request: its result was known when it was queued, and it is done once its fence
    /// completes. The proxy only decides its place in the queue's word: the word's prefix,
    /// or the queue's record of decisions the word does not tell ([`Queue::decided`]).
    #[cfg_attr(
        not(feature = "p2p"),
        allow(dead_code, reason = "the intra-node path makes lean requests")
    )]
    Lean(Lean),
}

/// A lean request's own part ([`End::Lean`]).
pub(super) struct Lean {
    /// Complete once the stream passed the request's work.
    pub(super) fence: Box<dyn Fence>,
    /// The report and what the work reaches (freed once the fence completed: see the work's
    /// own drop), until taken.
    pub(super) held: Mutex<Option<(TransferReport, Keep)>>,
    /// When the request began (its report's `elapsed` counts from here).
    pub(super) started: Instant,
}

impl Drop for Lean {
    /// A result never taken: what the copies reach goes as an [`Outcome`]'s does, never freed
    /// on a thread that frees nothing (a waker's code on the proxy thread letting go of it).
    fn drop(&mut self) {
        let held = self.held.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some((_, keep)) = held.take() {
            drop_freely(keep);
        }
    }
}

/// How a lean request stands, as its host sees it.
enum Seen {
    /// Succeeded: the word's prefix covers it.
    Done,
    /// Succeeded, as the record says (taken with the result).
    Recorded,
    /// Failed, as the record says (taken with the result).
    Failed,
    /// Ended without a record: the proxy or its queue is gone.
    Ended(Error),
}

impl Lean {
    /// How it stands now, `None` while undecided; asks the proxy (waiting for its lock) only
    /// once its fence completed or the queue failed.
    fn seen(&self, queue: &Queue, seq: u64) -> Option<Seen> {
        // Taken: its record is gone, and the word may never cover it (a failure, a success
        // past a gap). It stays complete, and a second take says it was taken.
        if self
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
        {
            return Some(Seen::Ended(taken_error()));
        }
        let recorded = || {
            if queue.covers(seq) {
                return Some(Seen::Done);
            }
            queue.decided().get(&seq).map(|r| match r {
                Ok(()) => Seen::Recorded,
                Err(_) => Seen::Failed,
            })
        };
        if let Some(s) = recorded() {
            return Some(s);
        }
        if !self.fence.is_complete() && queue.words.load(DONE) & STREAM_ERROR_BIT == 0 {
            return None;
        }
        let Some(h) = queue.helper.upgrade() else {
            return recorded().or_else(|| Some(Seen::Ended(closed_error())));
        };
        let known = h.decide(queue.id);
        recorded().or_else(|| {
            (!known).then(|| {
                Seen::Ended(Error::invalid(
                    "stream transfer",
                    seq,
                    "its stream queue ended (a request failed, or the endpoint closed) before \
                     it was known",
                ))
            })
        })
    }

    /// Its result, once seen placed ([`seen`](Self::seen); an error while it is not).
    fn result(&self, queue: &Queue, seq: u64) -> Result<TransferReport> {
        match self.seen(queue, seq) {
            Some(seen) => self.take(queue, seq, seen),
            None => Err(Error::invalid("stream transfer", seq, "not seen done")),
        }
    }

    /// Take the result as `seen` tells it.
    fn take(&self, queue: &Queue, seq: u64, seen: Seen) -> Result<TransferReport> {
        let Some((mut report, keep)) = self.held.lock().unwrap_or_else(|e| e.into_inner()).take()
        else {
            return Err(taken_error());
        };
        // Freed here unless its fence is still open (then parked behind it), on the caller's
        // thread (a waker's code on the proxy thread hands it to another).
        drop_freely(keep);
        match seen {
            Seen::Done | Seen::Recorded => {
                if matches!(seen, Seen::Recorded) {
                    queue.decided().remove(&seq);
                }
                report.elapsed = self.started.elapsed();
                Ok(report)
            }
            Seen::Failed => match queue.decided().remove(&seq) {
                Some(Err(e)) => Err(e),
                _ => Err(Error::invalid("stream transfer", seq, "failed")),
            },
            Seen::Ended(e) => Err(e),
        }
    }
}

/// A stream request's error once its result was taken.
fn taken_error() -> Error {
    Error::invalid("stream transfer", "its result", "already taken")
}

/// A stream request's error when its endpoint (its proxy) closed before it finished.
pub(crate) fn closed_error() -> Error {
    Error::invalid(
        "endpoint",
        "closed",
        "the endpoint was closed before the stream transfer finished",
    )
}

/// Wakes the proxy for a look at once, if it naps between looks at armed requests (not when
/// it sleeps with nothing armed: a running request rings it when it ends), at most once every
/// [`NUDGE_EVERY`] whoever asks (a loop of `wait(Duration::ZERO)` does not keep it busy).
pub(crate) trait Nudge: Send + Sync {
    fn nudge(&self);
    /// A waiter came (its seq is in [`Queue::waited`]): a proxy napping over fences looks at
    /// once, and without naps while the request is armed.
    fn waiter(&self);
}

/// While the host waits for a request, the proxy is nudged at most this often: a nap of its (up
/// to 64 µs) then ends within about this much of the request's stream passing it.
pub(crate) const NUDGE_EVERY: Duration = Duration::from_micros(8);

impl StreamTransfer {
    /// The request's sequence number in its queue (from 1).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The outcome the proxy leaves (a request that is not lean).
    #[cfg(test)]
    pub(super) fn outcome(&self) -> &Arc<Outcome> {
        match &self.end {
            End::Proxy(o) => o,
            End::Lean(_) => panic!("a lean request has no outcome"),
        }
    }

    /// Run the proxy's round on this thread (see [`Helper`]); whether it ran.
    fn help(&self) -> bool {
        self.queue.helper.upgrade().is_some_and(|h| h.help())
    }

    /// Whether the request finished, after a round of the proxy's run here if not.
    fn finished(&self) -> bool {
        match &self.end {
            End::Proxy(o) => o.flag.is_complete() || (self.help() && o.flag.is_complete()),
            End::Lean(l) => l.seen(&self.queue, self.seq).is_some(),
        }
    }

    /// Mark the request waited for (and every earlier one of its queue), ringing the proxy
    /// the first time (a loop of `wait(Duration::ZERO)` rings once).
    fn waited(&self) {
        if self.queue.waited.fetch_max(self.seq, Ordering::SeqCst) < self.seq {
            self.queue.bell.waiter();
        }
    }

    /// Fire the trigger from the host: what the stream's `cuStreamWriteValue64` does for a
    /// request made with [`Endpoint::write_on`](crate::transfer::Endpoint::write_on). Only for host-triggered requests
    /// ([`Endpoint::write_triggered`](crate::transfer::Endpoint::write_triggered), [`Endpoint::read_triggered`](crate::transfer::Endpoint::read_triggered)); firing twice is harmless.
    /// The slot is only ever raised: once the request fired, its slot may hold a later request's
    /// seq (`seq + TRIGGER_SLOTS`, stored by a stream), which a late second fire must not
    /// overwrite.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a request a stream triggers.
    pub fn trigger(&self) -> Result<()> {
        if !self.host {
            return Err(Error::invalid(
                "trigger",
                "a stream's request",
                "the stream fires it when it reaches the trigger write",
            ));
        }
        self.queue.words.raise(trigger_slot(self.seq), self.seq);
        Ok(())
    }

    /// `cuStreamWaitValue64(completion word, seq, GEQ)` on `stream`: its later work waits until
    /// this request and every earlier one of its queue are done, or one failed (then the word
    /// has [`STREAM_ERROR_BIT`](super::STREAM_ERROR_BIT): work after the wait must check it, see the module docs).
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] when the queue's words are plain host memory (host-triggered
    /// requests made before any stream request) or the device lacks 64-bit stream memory
    /// operations; [`Error::StreamCapturing`] while the stream captures a graph (nothing is
    /// enqueued); [`Error::Cuda`].
    #[doc(alias = "cuStreamWaitValue64_v2")]
    pub fn wait_on(&self, stream: &Stream) -> Result<()> {
        let flags = self.cuda_words()?;
        // Marked first: the proxy may see the request end while the wait is queued. (A
        // refused enqueue leaves it marked: the proxy looks a little harder for nothing.)
        self.waited();
        stream.wait_value64(flags, DONE, self.seq, WaitCondition::Geq)
    }

    /// The completion word for a kernel that polls it: its device address (8 bytes, aligned,
    /// in pinned host memory mapped for the device) and the value to wait for (the request is
    /// done when `word >= seq` or `word & STREAM_ERROR_BIT != 0`; see the module docs for what
    /// the bit means).
    ///
    /// The address stays valid only while `self` lives: the words' drop waits for the streams
    /// that used them through this crate, not for a kernel given the address. Keep `self` until
    /// every such kernel has finished (launching it is `unsafe`, and this is part of its
    /// contract).
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] when the queue's words are plain host memory.
    pub fn completion_word(&self) -> Result<(u64, u64)> {
        let word = self.cuda_words()?.device_ptr(DONE)?;
        // A kernel will poll it: waited for, as by `wait_on`.
        self.waited();
        Ok((word, self.seq))
    }

    /// The completion word now, as the host reads it.
    pub fn completion_value(&self) -> u64 {
        self.queue.words.load(DONE)
    }

    /// Whether the word releases a wait for this request now (done, or a failure in the
    /// queue). When it does not, this thread first runs a round of the proxy's (what the stream
    /// passed is ended here) and looks again.
    pub fn is_released(&self) -> bool {
        let released = || geq_releases(self.completion_value(), self.seq);
        released() || (self.help() && released())
    }

    fn cuda_words(&self) -> Result<&MemopFlags> {
        self.queue.words.flags().ok_or_else(|| Error::Unsupported {
            what: "a stream wait on a host-triggered queue".into(),
            reason: "the endpoint's stream queue is in plain host memory (made for host \
                     triggers without CUDA)"
                .into(),
        })
    }

    /// Whether the request has finished (the host's view; the word is written before). When
    /// it has not, this thread first runs a round of the proxy's, as [`wait`](Self::wait) does.
    pub fn is_complete(&self) -> bool {
        self.finished()
    }

    /// Wait on the host, up to `timeout`, for the request to finish, and take its result.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when it has not finished within `timeout` (call again); what ended the
    /// request (as [`Transfer::wait`](crate::transfer::Transfer::wait), plus [`Error::Timeout`] when the
    /// stream never reached the trigger and [`Error::InvalidArgument`] when the endpoint was
    /// closed first or an earlier request of the queue failed); [`Error::InvalidArgument`] once
    /// the result was taken.
    pub fn wait(&self, timeout: Duration) -> Result<TransferReport> {
        // This thread ends what is done itself (a round of the proxy's, when no other thread is
        // in one): the proxy thread, napping over requests nobody waited for, need not wake.
        // Only a request not done yet marks the queue waited, so that the proxy then looks
        // without napping while this thread sleeps between looks.
        let done = self.finished() || {
            self.waited();
            poll_until(
                || {
                    if self.finished() {
                        return true;
                    }
                    self.queue.bell.nudge();
                    false
                },
                timeout,
            )
        };
        if !done {
            return Err(Error::Timeout {
                what: "a stream transfer",
                after: timeout,
            });
        }
        match &self.end {
            End::Proxy(o) => take(o),
            End::Lean(l) => l.result(&self.queue, self.seq),
        }
    }
}

fn take(o: &Outcome) -> Result<TransferReport> {
    let got = o.slot.lock().unwrap_or_else(|e| e.into_inner()).take();
    match got {
        // What the request held is dropped here, on the caller's thread (a waker's code on the
        // proxy thread hands it to another).
        Some((r, keep)) => {
            if let Some(keep) = keep {
                drop_freely(keep);
            }
            r
        }
        None => Err(taken_error()),
    }
}

/// Awaiting a stream transfer awaits its completion flag (set by the proxy) up to the
/// request's bound (twice its deadline from the call, plus the NIC's flush after a failure);
/// past it the future ends with [`Error::Timeout`].
impl std::future::IntoFuture for StreamTransfer {
    type Output = Result<TransferReport>;
    type IntoFuture =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<TransferReport>> + Send>>;

    fn into_future(self) -> Self::IntoFuture {
        // Done already (ended here, if the stream passed it): no waiter to mark.
        if !self.finished() {
            self.waited();
        }
        let StreamTransfer {
            queue,
            seq,
            end,
            limit,
            ..
        } = self;
        match end {
            End::Proxy(outcome) => {
                let op = InFlight::new("stream transfer", outcome.flag.clone(), outcome);
                let f = op.deadline(limit);
                Box::pin(async move {
                    let o = f.await?;
                    let r = take(&o);
                    drop(queue);
                    r
                })
            }
            End::Lean(mut lean) => {
                // Awaits its fence, or a failure in its queue (the word's bit; the completion
                // thread looks at both), then how the proxy placed it (asked at once).
                let fence = std::mem::replace(&mut lean.fence, Box::new(crate::completion::Done));
                let ended = FenceOrFailure {
                    fence,
                    queue: queue.clone(),
                };
                let f = InFlight::new("stream transfer", ended, ()).deadline(limit);
                Box::pin(async move {
                    let r = match f.await {
                        Ok(()) => lean.result(&queue, seq),
                        Err(e) => Err(e),
                    };
                    drop(lean);
                    drop(queue);
                    r
                })
            }
        }
    }
}

/// Complete once a lean request's fence completes or its queue's word carries the error bit
/// (a failure there places the request at once, a failure too if it was not done).
struct FenceOrFailure {
    fence: Box<dyn Fence>,
    queue: Arc<Queue>,
}

impl Fence for FenceOrFailure {
    fn is_complete(&self) -> bool {
        self.fence.is_complete() || self.queue.words.load(DONE) & STREAM_ERROR_BIT != 0
    }
}

impl std::fmt::Debug for StreamTransfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamTransfer")
            .field("seq", &self.seq)
            .field("queue", &self.queue.id)
            .field("word", &self.completion_value())
            .field(
                "complete",
                &match &self.end {
                    End::Proxy(o) => o.flag.is_complete(),
                    End::Lean(l) => l.fence.is_complete(),
                },
            )
            .finish()
    }
}
