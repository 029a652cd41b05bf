//! The proxy thread of one endpoint's stream queues: it watches the armed requests' trigger
//! words, starts each through its [`Backend`] when the stream reaches it, and publishes the
//! queue's completion word as they finish.

use super::armed::{
    End, Helper, Keep, Lean, Mark, NUDGE_EVERY, Nudge, Outcome, Queue, StreamTransfer, closed_error,
};
use super::window::{
    DONE, FENCE_NAP, TRIGGER_SLOTS, Window, geq_releases, proxy_pause, trigger_slot,
};
use super::words::{HostWords, MAX_SEQ, STREAM_ERROR_BIT, WordMemory};
use crate::completion::capture::Refused;
use crate::completion::deferred::{Defers, Locked, Woken};
use crate::completion::elsewhere::{
    drop_elsewhere, drop_freely, frees_nothing, frees_nothing_here,
};
use crate::completion::{CompletionFlag, Fence, StreamFence};
use crate::cuda::{MemopFlags, Stream};
use crate::error::{Error, Result};
use crate::transfer::plan::deadline_after;
use crate::transfer::request::TransferReport;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};

/// The slack a host wait gives past a request's bound (the NIC's flush after a failure and the
/// proxy's pace).
const HOST_SLACK: Duration = Duration::from_secs(7);

/// How long the proxy stays awake with nothing armed before it sleeps until rung.
const PROXY_LINGER: Duration = Duration::from_micros(100);

/// How long a closing proxy waits for requests already posted before it releases their words
/// anyway (the engine ends them within its own flush bound first).
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// A request started by a [`Backend`], polled by the proxy.
pub(crate) trait Running: Send {
    /// The result once finished, with what the request held; else `None` after arranging for
    /// `waker` to be woken at its completion (or relying on the proxy's poll).
    fn poll(&mut self, waker: &Waker) -> Option<(Result<TransferReport>, Keep)>;
}

/// What carries a stream transfer's data once its trigger fired.
pub(crate) trait Backend: Send + Sync + 'static {
    /// A request's description, kept by the proxy until the request finished.
    type Work: Send + 'static;
    /// Start `work` now (the proxy thread; its deadline counts from now).
    ///
    /// # Errors
    ///
    /// Why it could not start (the request fails with it).
    fn start(&self, work: &Self::Work) -> Result<Box<dyn Running>>;

    /// For work that is done once its trigger fired (copies queued before it): its result,
    /// taken from it, in place of [`start`](Self::start). `None` (the default): started.
    fn done_at_fire(&self, _work: &mut Self::Work) -> Option<Result<TransferReport>> {
        None
    }

    /// What fires work whose stream stores no trigger word.
    type Fired: FiredBy;
    /// For work whose stream stores no trigger word (it recorded an event behind the work
    /// instead): a fence complete once the stream passed the work, which then counts as its
    /// trigger having fired. `None` (the default): the trigger word alone says so.
    fn fired_by(&self, _work: &Self::Work) -> Option<Self::Fired> {
        None
    }

    /// `f` of [`fired_by`](Self::fired_by)'s fence, where a backend can lend it without a clone
    /// (the proxy looks at every armed request's fence each round; a clone writes a count the
    /// caller's thread writes too).
    fn with_fence<R>(&self, work: &Self::Work, f: impl FnOnce(&Self::Fired) -> R) -> Option<R> {
        self.fired_by(work).map(|x| f(&x))
    }

    /// Whether work fired by a fence tells the peer when it ends (a waiter in another
    /// process): the proxy then looks for its fence without napping. `false` by default.
    fn notifies(&self, _work: &Self::Work) -> bool {
        false
    }
}

/// A fence that fires a request in place of its trigger word ([`Backend::fired_by`]).
pub(crate) trait FiredBy: Fence + Clone {
    /// Its stream, and its place there: fences of one stream complete in that order.
    fn place(&self) -> (usize, u64);
    /// Whether it is seen complete, asking the driver without queueing anything on the stream
    /// (the proxy looks under its lock, and from its own thread).
    fn fired(&self) -> bool;
}

/// Whether `f` fired, looked at once per stream: `open` holds, per stream, the earliest place
/// seen not fired (one at or after it is not fired either, and is not asked), and learns `f`'s
/// place when it has not fired.
fn looked_fired<F: FiredBy>(f: &F, open: &mut Vec<(usize, u64)>) -> bool {
    let (stream, at) = f.place();
    let seen = open.iter_mut().find(|(s, _)| *s == stream);
    if seen.as_ref().is_some_and(|(_, first)| at >= *first) {
        return false;
    }
    let fired = f.fired();
    if !fired {
        match seen {
            Some(o) => o.1 = at,
            None => open.push((stream, at)),
        }
    }
    fired
}

/// Keep in `fences` one fence per stream, the earliest there (the first to complete): `f`
/// cloned only when kept.
fn keep_earliest<F: FiredBy>(fences: &mut Vec<F>, f: &F) {
    let (stream, at) = f.place();
    match fences.iter_mut().find(|g| g.place().0 == stream) {
        Some(g) if at < g.place().1 => *g = f.clone(),
        Some(_) => {}
        None => fences.push(f.clone()),
    }
}

impl FiredBy for StreamFence {
    fn place(&self) -> (usize, u64) {
        (Arc::as_ptr(self.timeline()) as usize, self.epoch())
    }
    fn fired(&self) -> bool {
        self.timeline().query(self.epoch())
    }
}

/// The `Running` of work finished when it fired ([`Backend::done_at_fire`]): never polled.
struct NoRun;

impl Running for NoRun {
    fn poll(&mut self, _: &Waker) -> Option<(Result<TransferReport>, Keep)> {
        None
    }
}

/// Why a request's work was not made: the error, and whether something of it may be queued
/// on the stream anyway (a trigger that may store its seq later: the queue must retire, as
/// its slot could otherwise be taken again under that store).
pub(crate) struct Unmade {
    pub(crate) error: Error,
    pub(crate) queued: bool,
}

impl Unmade {
    /// A refused enqueue's error, queued when what it was given may have been (leaked), and
    /// that back when not.
    pub(crate) fn of<R>(refused: Refused<R>) -> (Unmade, Option<R>) {
        let queued = refused.leaked();
        let unmade = Unmade {
            error: refused.error,
            queued,
        };
        (unmade, refused.kept)
    }
}

impl From<Error> for Unmade {
    fn from(error: Error) -> Unmade {
        let queued = matches!(error, Error::StreamCapturing { enqueued: true, .. });
        Unmade { error, queued }
    }
}

/// Where a request's trigger comes from.
#[derive(Clone)]
pub(crate) enum Trigger<'a> {
    /// The host ([`StreamTransfer::trigger`]); the words may be host memory.
    Host,
    /// A `cuStreamWriteValue64` enqueued on this stream.
    Stream(&'a Stream),
}

enum Stage<W> {
    /// Its seq is taken; its work is being made and its trigger queued (the work comes with
    /// `Armed`).
    Reserved,
    /// Waiting for its trigger word.
    Armed(W),
    /// Fired; being started outside the lock.
    Starting,
    /// Started; polled until it finishes.
    Running(W, Box<dyn Running>),
}

/// A request the proxy knows of. Its queue's words are its [`QState`]'s (kept while any
/// request of the queue is outstanding): an entry takes no reference of its own, whose count
/// callers write at every request.
struct Entry<W> {
    stage: Stage<W>,
    outcome: Arc<Outcome>,
    /// The request's deadline.
    timeout: Duration,
    /// The trigger must have fired by then.
    until: Instant,
}

impl<W> Entry<W> {
    /// What the ended request held, for a caller's thread to drop: a running request's
    /// handle too (an RDMA request still in flight waits and frees when dropped).
    fn into_dead(self) -> Dead<W> {
        let (work, run) = match self.stage {
            Stage::Armed(w) => (Some(w), None),
            Stage::Running(w, run) => (Some(w), Some(run)),
            Stage::Reserved | Stage::Starting => (None, None),
        };
        Dead::Ended(work, run, self.outcome)
    }
}

struct QState {
    queue: Arc<Queue>,
    window: Window,
    /// Requests of the queue not finished.
    outstanding: usize,
    /// Requests whose trigger has not been seen (their slots are not reusable).
    unfired: BTreeSet<u64>,
    /// The highest seq reserved that the proxy's state knows of.
    known: u64,
    /// No new requests (a request failed, or the words were given to a graph).
    retired: bool,
    /// The last request to finish was waited for before it did ([`Queue::waited`]): its
    /// caller waits on each request, so the proxy looks for the next one's fence without
    /// napping (a waiter waking a nap pays the wake-up).
    eager: bool,
    /// Lean successes are in [`Queue::decided`] (past the word's prefix when placed).
    recorded: bool,
}

impl QState {
    /// Request `seq` finished with `ok`: the word published, the waiter rule updated. A
    /// failure retires the queue; the queue's first failure is returned when this retired it
    /// (its requests not started are to fail with it).
    fn finished(&mut self, seq: u64, ok: bool) -> Option<u64> {
        let word = self.window.finish(seq, ok);
        self.queue.words.store(DONE, word);
        self.eager = self.queue.waited.load(Ordering::SeqCst) >= seq;
        self.outstanding = self.outstanding.saturating_sub(1);
        if self.recorded {
            // Successes the prefix now covers need no record.
            let prefix = word & !STREAM_ERROR_BIT;
            let mut d = self.queue.decided.lock().unwrap_or_else(|e| e.into_inner());
            d.retain(|&k, r| r.is_err() || !geq_releases(prefix, k));
            self.recorded = d.values().any(Result::is_ok);
        }
        if ok || self.retired {
            return None;
        }
        self.retired = true;
        self.window.failed()
    }

    /// Tell callers the lowest seq whose trigger may not have fired ([`Queue::low`]): every
    /// seq the state does not know of yet is above `known`.
    fn publish_low(&self) {
        let low = self.unfired.first().copied().unwrap_or(self.known + 1);
        self.queue.low.0.store(low, Ordering::Release);
    }
}

/// What a caller hands the proxy's state through [`Front::inbox`], applied in order before the
/// state is looked at ([`Core::drain`]).
enum Msg<W, F> {
    /// A seq was taken on the current queue; its work is being made. `until`: when its
    /// trigger must have fired (counted from the call, once its checks were done).
    Reserved {
        key: (u64, u64),
        outcome: Arc<Outcome>,
        timeout: Duration,
        until: Instant,
    },
    /// Its work was made and its trigger queued.
    Armed { key: (u64, u64), work: W },
    /// A lean request ([`End::Lean`]): its work is queued, done once `fence` completes.
    Lean {
        key: (u64, u64),
        fence: F,
        timeout: Duration,
        until: Instant,
    },
}

/// What a caller asks of a seq: a request the proxy ends, or a lean one.
enum Ask<F> {
    Reserve {
        outcome: Arc<Outcome>,
        timeout: Duration,
        until: Instant,
    },
    #[cfg_attr(
        not(feature = "p2p"),
        allow(dead_code, reason = "the intra-node path makes lean requests")
    )]
    Lean {
        fence: F,
        timeout: Duration,
        until: Instant,
    },
}

/// A lean request the proxy has not placed yet: done once its fence completes, failed if its
/// deadline passes first.
struct LeanEntry<F> {
    fence: F,
    timeout: Duration,
    until: Instant,
}

/// The queue new requests go to, as callers see it.
struct Current {
    id: u64,
    queue: Arc<Queue>,
    cuda: bool,
    next_seq: u64,
}

/// What arming takes, under a lock of its own that the proxy takes only to collect what
/// callers handed over: a request is armed without touching the state the proxy's rounds
/// write (each of whose lines costs a cross-core miss).
struct Front<W, F> {
    /// The queue new requests go to (only while it is usable as far as callers know).
    current: Option<Current>,
    closing: bool,
    /// A slow path is making the state exact: new reservations wait for it (on the state
    /// lock) instead of joining the inbox it drains.
    slow: bool,
    next_queue: u64,
    inbox: Vec<Msg<W, F>>,
    /// What finished requests held, dropped by a caller's thread (never the proxy's).
    graveyard: Vec<Dead<W>>,
}

/// A seq taken: the queue's id, its words, the seq, and what finished requests held (for the
/// caller to drop once its trigger is queued).
type Reservation<W> = (u64, Arc<Queue>, u64, Vec<Dead<W>>);

impl<W, F> Front<W, F> {
    /// Whether the current queue takes a request (on a stream: `want_cuda`) as far as callers
    /// know: no slow path running, a seq left, the right words, a trigger slot in the window.
    ///
    /// # Errors
    ///
    /// The endpoint is closing.
    fn fast(&self, want_cuda: bool) -> Result<bool> {
        if self.closing {
            return Err(closed_error());
        }
        Ok(!self.slow
            && self.current.as_ref().is_some_and(|cur| {
                cur.next_seq < MAX_SEQ
                    && (cur.cuda || !want_cuda)
                    && cur
                        .next_seq
                        .saturating_sub(cur.queue.low.0.load(Ordering::Acquire))
                        < (TRIGGER_SLOTS as u64)
            }))
    }

    /// The current queue's next seq, handed to the proxy's state through the inbox (the
    /// caller checked that the queue can take it).
    fn take_seq(&mut self, ask: Ask<F>) -> Reservation<W> {
        let cur = self.current.as_mut().expect("checked by the caller");
        let seq = cur.next_seq;
        cur.next_seq += 1;
        let (id, queue) = (cur.id, cur.queue.clone());
        let key = (id, seq);
        self.inbox.push(match ask {
            Ask::Reserve {
                outcome,
                timeout,
                until,
            } => Msg::Reserved {
                key,
                outcome,
                timeout,
                until,
            },
            Ask::Lean {
                fence,
                timeout,
                until,
            } => Msg::Lean {
                key,
                fence,
                timeout,
                until,
            },
        });
        (id, queue, seq, std::mem::take(&mut self.graveyard))
    }
}

/// What a finished request held (its queue's words, its work, its outcome), or anything else
/// a caller's thread must drop; unboxed for the one that comes with every request. Only
/// dropped.
#[allow(dead_code, reason = "held to be dropped, never read")]
enum Dead<W> {
    Ended(Option<W>, Option<Box<dyn Running>>, Arc<Outcome>),
    Other(Box<dyn Send>),
}

/// The proxy's state: every request it knows of, by queue.
struct PState<W, F> {
    /// By (queue id, seq).
    entries: BTreeMap<(u64, u64), Entry<W>>,
    /// Lean requests not placed yet, by (queue id, seq).
    lean: BTreeMap<(u64, u64), LeanEntry<F>>,
    queues: HashMap<u64, QState, foldhash::fast::RandomState>,
    closing: Option<Instant>,
    /// What finished requests held, handed to [`Front::graveyard`] at the next drain.
    graveyard: Vec<Dead<W>>,
    /// The inbox's buffer, swapped with the front's at each drain.
    spare: Vec<Msg<W, F>>,
    /// The flags of requests finished under the lock, set once it is let go ([`Locked`]).
    woken: Woken,
}

impl<W, F> Defers for PState<W, F> {
    type Wakes = Woken;
    fn wakes(&mut self) -> &mut Woken {
        &mut self.woken
    }
}

/// Rung by new work, completions and the close. A ring sets a flag the proxy takes before it
/// looks at its state; it costs a wake-up (a system call) only while the proxy sleeps on the
/// condition variable (a soft ring: only while it sleeps with nothing armed to look at).
#[derive(Default)]
struct Bell {
    rung: AtomicBool,
    /// How the proxy sleeps now: [`AWAKE`], [`NAP`] or [`DEEP`] (set under `lock`).
    sleeping: AtomicU8,
    lock: Mutex<()>,
    cv: Condvar,
    /// When a waiter last nudged it ([`Nudge`]), in nanoseconds since [`nudge_clock`]'s start.
    nudged: AtomicU64,
}

/// Nanoseconds since the first call (at least 1), for [`Bell::nudged`].
fn nudge_clock() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    (START.get_or_init(Instant::now).elapsed().as_nanos() as u64).max(1)
}

/// The proxy is not sleeping on the condition variable.
const AWAKE: u8 = 0;
/// It naps between looks at armed triggers (at most [`PROXY_NAP`]).
const NAP: u8 = 1;
/// It sleeps with nothing armed.
const DEEP: u8 = 2;

impl Nudge for Bell {
    fn nudge(&self) {
        // Only a nap: a proxy that sleeps with nothing armed has nothing a waiter could hurry
        // (a running request rings it when it ends), and one that is awake looks by itself.
        if self.sleeping.load(Ordering::SeqCst) != NAP {
            return;
        }
        let now = nudge_clock();
        // 0: never nudged (the clock reads at least 1).
        let last = self.nudged.load(Ordering::Relaxed);
        if last != 0 && now.saturating_sub(last) < NUDGE_EVERY.as_nanos() as u64
            || self
                .nudged
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        self.ring_if(NAP);
    }

    fn waiter(&self) {
        // Rung, not nudged: a proxy about to nap finds the ring (no lost wake-up). Woken only
        // from a nap, as a nudge: one asleep with nothing armed, or only running requests,
        // is rung by their ends.
        self.ring_when(|sleeping| sleeping == NAP);
    }
}

impl Bell {
    fn ring(&self) {
        self.ring_if(NAP);
    }

    /// Ring, waking the proxy only if it sleeps at least as deeply as `depth`.
    fn ring_if(&self, depth: u8) {
        self.ring_when(|sleeping| sleeping >= depth);
    }

    /// Ring, waking the proxy only if how it sleeps now passes `wakes`.
    fn ring_when(&self, wakes: impl FnOnce(u8) -> bool) {
        // The flag, then the depth; a sleeper sets the depth, then looks at the flag (both
        // SeqCst): one of the two sees the other's store. The lock is taken only to wake one,
        // so the wake-up cannot fall between its look and its wait.
        self.rung.store(true, Ordering::SeqCst);
        if wakes(self.sleeping.load(Ordering::SeqCst)) {
            let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.cv.notify_all();
        }
    }

    /// Take the ring, if any.
    fn take(&self) -> bool {
        // Looked at first: a spinning proxy writes the line only when it was rung.
        self.rung.load(Ordering::SeqCst) && self.rung.swap(false, Ordering::SeqCst)
    }

    /// Sleep as deeply as `depth` until rung or `timeout` passed (`None`: until rung);
    /// whether it was rung (taken).
    fn sleep(&self, timeout: Option<Duration>, depth: u8) -> bool {
        let mut g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.sleeping.store(depth, Ordering::SeqCst);
        if !self.rung.load(Ordering::SeqCst) {
            g = match timeout {
                Some(t) => {
                    self.cv
                        .wait_timeout(g, t)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                None => self.cv.wait(g).unwrap_or_else(|e| e.into_inner()),
            };
        }
        self.sleeping.store(AWAKE, Ordering::SeqCst);
        drop(g);
        self.take()
    }
}

impl Wake for Bell {
    fn wake(self: Arc<Self>) {
        self.ring();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.ring();
    }
}

/// The armed triggers as a round left them, looked at without the lock until one fires or
/// its deadline passes.
struct Watch<F> {
    /// Weak: the proxy thread never holds the last reference to a queue's words (freeing
    /// them waits for streams).
    armed: Vec<(Weak<Queue>, u64)>,
    /// Of armed work whose stream stores no trigger ([`Backend::fired_by`]): per stream, a
    /// fence of the earliest such request.
    fences: Vec<F>,
    /// Per queue with requests armed behind fences: its waiter watermark
    /// ([`Queue::waited`]), the lowest such seq, and whether its last request was waited for.
    waits: Vec<(Arc<AtomicU64>, u64, bool)>,
    /// A request armed behind a fence notifies the peer when it ends ([`Backend::notifies`]).
    notified: bool,
    /// The earliest trigger deadline.
    until: Option<Instant>,
    /// Entries of any stage.
    any: bool,
    closing: bool,
}

impl<F: FiredBy> Watch<F> {
    /// Whether a request armed behind a fence is waited for (here or by the peer), or likely
    /// to be (its queue's last one was).
    fn waited(&self) -> bool {
        self.notified
            || self
                .waits
                .iter()
                .any(|(w, low, eager)| *eager || w.load(Ordering::SeqCst) >= *low)
    }

    /// Whether a trigger fired (or its queue is gone). A queue whose last other holder let it
    /// go while this looked is handed to `graveyard` (a caller's thread frees its words).
    fn fired<W, G>(&self, graveyard: &Mutex<Front<W, G>>) -> bool {
        self.fences.iter().any(|f| f.fired())
            || self.armed.iter().any(|(q, seq)| {
                let Some(q) = q.upgrade() else {
                    return true;
                };
                let fired = q.words.load(trigger_slot(*seq)) == *seq;
                if let Some(last) = Arc::into_inner(q) {
                    let mut front = graveyard.lock().unwrap_or_else(|e| e.into_inner());
                    front.graveyard.push(Dead::Other(Box::new(last)));
                    return true;
                }
                fired
            })
    }
}

struct Core<B: Backend> {
    /// Itself, for the queues' host waiters ([`Helper`]).
    me: Weak<Core<B>>,
    backend: B,
    /// The proxy's state; taken by callers only on the slow paths (a new queue, a refused
    /// arm, a full window). Lock order: `state`, then `front`.
    state: Mutex<PState<B::Work, B::Fired>>,
    front: Mutex<Front<B::Work, B::Fired>>,
    bell: Arc<Bell>,
    /// The bell as a waker, for running requests (whichever thread polls them).
    waker: Waker,
    /// Naps over unwaited fences taken so far.
    #[cfg(test)]
    fence_naps: AtomicU64,
}

impl<B: Backend> Drop for Core<B> {
    /// Dropped on a thread that frees nothing (a proxy thread: an endpoint whose last holder
    /// let go there, the endpoint a request's start upgraded or a waker's code), what requests
    /// held and the queues' words go to the crate's drop thread: their drops may wait for
    /// streams, which a proxy thread never does.
    fn drop(&mut self) {
        if !frees_nothing_here() {
            return;
        }
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        let front = self.front.get_mut().unwrap_or_else(|e| e.into_inner());
        let held: Box<dyn Send> = Box::new((
            std::mem::take(&mut st.entries),
            std::mem::take(&mut st.lean),
            std::mem::take(&mut st.queues),
            std::mem::take(&mut st.graveyard),
            std::mem::take(&mut st.spare),
            front.current.take(),
            std::mem::take(&mut front.inbox),
            std::mem::take(&mut front.graveyard),
        ));
        drop_elsewhere(held);
    }
}

/// The stream proxy of one endpoint over one backend: its queues, armed and running requests,
/// and its thread (started by the first request).
pub(crate) struct Proxy<B: Backend> {
    core: Arc<Core<B>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The thread was started (looked at without its lock on every arm).
    started: AtomicBool,
}

/// Request `seq`'s error when request `first` of its queue failed before it started.
fn failed_first(seq: u64, first: u64) -> Error {
    Error::invalid(
        "stream transfer",
        seq,
        format!(
            "request {first} of its stream queue failed first; a queue starts nothing after a \
             failure"
        ),
    )
}

impl<B: Backend> Core<B> {
    fn lock(&self) -> Locked<'_, PState<B::Work, B::Fired>> {
        Locked::new(&self.state)
    }

    fn front(&self) -> std::sync::MutexGuard<'_, Front<B::Work, B::Fired>> {
        self.front.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Apply what callers handed over, in order, and hand the front what finished requests
    /// held; with `closing`, the front takes no more requests from then on (in the same
    /// critical section: nothing reserved after the drain).
    fn drain(&self, st: &mut PState<B::Work, B::Fired>, closing: bool) {
        let mut msgs = std::mem::take(&mut st.spare);
        {
            let mut front = self.front();
            std::mem::swap(&mut msgs, &mut front.inbox);
            if !st.graveyard.is_empty() {
                front.graveyard.append(&mut st.graveyard);
            }
            if closing {
                front.closing = true;
                front.current = None;
            }
        }
        for m in msgs.drain(..) {
            match m {
                Msg::Reserved {
                    key,
                    outcome,
                    timeout,
                    until,
                } => self.take_reserved(st, key, outcome, timeout, until),
                Msg::Armed { key, work } => match st.entries.get_mut(&key) {
                    Some(e) => e.stage = Stage::Armed(work),
                    // Ended meanwhile (a close, an earlier failure): what the work holds is
                    // dropped by a caller's thread.
                    None => st.graveyard.push(Dead::Other(Box::new(work))),
                },
                Msg::Lean {
                    key,
                    fence,
                    timeout,
                    until,
                } => self.take_lean(
                    st,
                    key,
                    LeanEntry {
                        fence,
                        timeout,
                        until,
                    },
                ),
            }
        }
        st.spare = msgs;
    }

    /// A lean request a caller queued: kept until placed. A queue let go of meanwhile placed
    /// nothing more: its host learns so from [`Helper::decide`].
    fn take_lean(
        &self,
        st: &mut PState<B::Work, B::Fired>,
        key: (u64, u64),
        entry: LeanEntry<B::Fired>,
    ) {
        let Some(q) = st.queues.get_mut(&key.0) else {
            return;
        };
        q.outstanding += 1;
        q.known = q.known.max(key.1);
        let failed = if q.retired { q.window.failed() } else { None };
        st.lean.insert(key, entry);
        if st.closing.is_some() {
            self.end_lean(st, key, Err(closed_error()));
        } else if let Some(first) = failed {
            self.end_lean(st, key, Err(failed_first(key.1, first)));
        }
    }

    /// Place lean request `key` with `r`: the word published, a decision the word does not
    /// tell recorded for its host. A failure retires the queue, as [`finish`](Self::finish).
    fn end_lean(&self, st: &mut PState<B::Work, B::Fired>, key: (u64, u64), r: Result<()>) {
        if st.lean.remove(&key).is_none() {
            return;
        }
        let ok = r.is_ok();
        let mut poisoned = None;
        if let Some(q) = st.queues.get_mut(&key.0) {
            poisoned = q.finished(key.1, ok);
            if !q.queue.covers(key.1) {
                q.recorded |= ok;
                q.queue
                    .decided
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(key.1, r);
            }
        }
        if let Some(first) = poisoned {
            self.poison(st, key.0, first);
        }
        Self::forget_idle(st, key.0);
    }

    /// Place every lean request that can be: done where its fence completed, failed where its
    /// deadline passed first. `open`: per stream, the earliest place seen not done (later
    /// ones there are not done either). Whether any was placed.
    fn settle_lean(
        &self,
        st: &mut PState<B::Work, B::Fired>,
        open: &mut Vec<(usize, u64)>,
        now: Instant,
    ) -> bool {
        if st.lean.is_empty() {
            return false;
        }
        let mut done = Vec::new();
        let mut late = Vec::new();
        for (k, l) in &st.lean {
            if looked_fired(&l.fence, open) {
                done.push(*k);
            } else if now >= l.until {
                late.push((*k, l.timeout));
            }
        }
        let moved = !done.is_empty() || !late.is_empty();
        for k in done {
            self.end_lean(st, k, Ok(()));
        }
        for (k, after) in late {
            let e = Error::Timeout {
                what: "a stream transfer's trigger (the stream did not reach it)",
                after,
            };
            self.end_lean(st, k, Err(e));
        }
        moved
    }

    /// A seq a caller took: its entry, or its end when its queue can take nothing more.
    fn take_reserved(
        &self,
        st: &mut PState<B::Work, B::Fired>,
        key: (u64, u64),
        outcome: Arc<Outcome>,
        timeout: Duration,
        until: Instant,
    ) {
        let Some(q) = st.queues.get_mut(&key.0) else {
            // The queue ended (a failure, the close) and was let go before this seq was known:
            // its word carries the failure already.
            let err = Error::invalid(
                "stream transfer",
                key.1,
                "its stream queue ended (a request failed, or the endpoint closed) before it \
                 was armed",
            );
            outcome.set(Err(err), None, &mut st.woken);
            st.graveyard.push(Dead::Other(Box::new(outcome)));
            return;
        };
        q.outstanding += 1;
        q.unfired.insert(key.1);
        q.known = q.known.max(key.1);
        let failed = if q.retired { q.window.failed() } else { None };
        st.entries.insert(
            key,
            Entry {
                stage: Stage::Reserved,
                outcome,
                timeout,
                until,
            },
        );
        if st.closing.is_some() {
            self.finish(st, key, Err(closed_error()), None);
        } else if let Some(first) = failed {
            self.finish(st, key, Err(failed_first(key.1, first)), None);
        }
    }

    /// End entry `key` with `r`: publish the queue's word, hand the result over, and put what
    /// it held in the graveyard. A failure retires the queue and fails its armed requests.
    fn finish(
        &self,
        st: &mut PState<B::Work, B::Fired>,
        key: (u64, u64),
        r: Result<TransferReport>,
        keep: Option<Keep>,
    ) {
        let Some(e) = st.entries.remove(&key) else {
            return;
        };
        let mut poisoned = None;
        if let Some(q) = st.queues.get_mut(&key.0) {
            poisoned = q.finished(key.1, r.is_ok());
            q.unfired.remove(&key.1);
        }
        e.outcome.set(r, keep, &mut st.woken);
        st.graveyard.push(e.into_dead());
        if let Some(first) = poisoned {
            self.poison(st, key.0, first);
        }
        Self::forget_idle(st, key.0);
    }

    /// Request `first` of queue `id` failed: new requests go to a new queue, and the queue's
    /// requests not started (armed, reserved, lean not placed) fail with it.
    fn poison(&self, st: &mut PState<B::Work, B::Fired>, id: u64, first: u64) {
        // Lock order: the state, then the front.
        let mut front = self.front();
        if front.current.as_ref().is_some_and(|c| c.id == id) {
            front.current = None;
        }
        drop(front);
        let armed: Vec<(u64, u64)> = st
            .entries
            .range((id, 0)..=(id, u64::MAX))
            .filter(|(_, e)| matches!(e.stage, Stage::Armed(_) | Stage::Reserved))
            .map(|(k, _)| *k)
            .collect();
        for k in armed {
            self.finish(st, k, Err(failed_first(k.1, first)), None);
        }
        let lean: Vec<(u64, u64)> = st
            .lean
            .range((id, 0)..=(id, u64::MAX))
            .map(|(k, _)| *k)
            .collect();
        for k in lean {
            self.end_lean(st, k, Err(failed_first(k.1, first)));
        }
    }

    /// A retired queue with nothing outstanding goes to the graveyard.
    fn forget_idle(st: &mut PState<B::Work, B::Fired>, id: u64) {
        if st
            .queues
            .get(&id)
            .is_some_and(|q| q.retired && q.outstanding == 0)
        {
            let q = st.queues.remove(&id).expect("present");
            st.graveyard.push(Dead::Other(Box::new(q.queue)));
        }
    }

    /// Entry `key` was never enqueued: its seq completes as nothing to do.
    fn void(st: &mut PState<B::Work, B::Fired>, key: (u64, u64)) {
        let Some(e) = st.entries.remove(&key) else {
            return;
        };
        if let Some(q) = st.queues.get_mut(&key.0) {
            let word = q.window.finish(key.1, true);
            q.queue.words.store(DONE, word);
            q.outstanding = q.outstanding.saturating_sub(1);
            q.unfired.remove(&key.1);
        }
        e.outcome.set(Err(closed_error()), None, &mut st.woken);
        st.graveyard.push(e.into_dead());
        Self::forget_idle(st, key.0);
    }

    /// The endpoint is closing: every request not yet started fails (its word released with
    /// the error bit); started ones finish as the engine ends them.
    fn close(&self) {
        let mut st = self.lock();
        if st.closing.is_none() {
            st.closing = Some(Instant::now());
        }
        // The front takes nothing more; what callers reserved before ends below.
        self.drain(&mut st, true);
        for q in st.queues.values_mut() {
            q.retired = true;
        }
        let waiting: Vec<(u64, u64)> = st
            .entries
            .iter()
            .filter(|(_, e)| matches!(e.stage, Stage::Armed(_) | Stage::Reserved))
            .map(|(k, _)| *k)
            .collect();
        for k in waiting {
            self.finish(&mut st, k, Err(closed_error()), None);
        }
        let lean: Vec<(u64, u64)> = st.lean.keys().copied().collect();
        for k in lean {
            self.end_lean(&mut st, k, Err(closed_error()));
        }
        let ids: Vec<u64> = st.queues.keys().copied().collect();
        for id in ids {
            Self::forget_idle(&mut st, id);
        }
        drop(st);
        self.bell.ring();
    }

    /// One round under `st` (the proxy thread's, or a host waiter's: [`Helper`]): fired
    /// triggers are taken (to start outside the lock), running requests polled, passed trigger
    /// deadlines failed. Returns what fired, whether anything moved, and the triggers still
    /// armed.
    #[allow(clippy::type_complexity)]
    fn round(
        &self,
        mut st: Locked<'_, PState<B::Work, B::Fired>>,
    ) -> (Vec<((u64, u64), B::Work)>, bool, Watch<B::Fired>) {
        let waker = &self.waker;
        self.drain(&mut st, false);
        let now = Instant::now();
        let mut fired = Vec::new();
        let mut late = Vec::new();
        let mut done = Vec::new();
        let mut moved = false;
        // Per stream, the earliest place found not done this round: a request at or after it
        // is not done either, and is not asked (about one query per stream a round). By place,
        // not by seq: two threads on one stream may take seqs in the other order than their
        // places.
        let mut open: Vec<(usize, u64)> = Vec::new();
        let PState {
            entries, queues, ..
        } = &mut *st;
        for (k, e) in entries.iter_mut() {
            match &mut e.stage {
                Stage::Armed(w) => {
                    let mut by_fence = || {
                        self.backend
                            .with_fence(w, |f| looked_fired(f, &mut open))
                            .unwrap_or(false)
                    };
                    // Every entry's queue is kept while the entry is (it counts as outstanding).
                    let word = queues
                        .get(&k.0)
                        .map(|q| q.queue.words.load(trigger_slot(k.1)));
                    if word == Some(k.1) || by_fence() {
                        let Stage::Armed(w) = std::mem::replace(&mut e.stage, Stage::Starting)
                        else {
                            unreachable!("matched above")
                        };
                        fired.push((*k, w));
                    } else if now >= e.until {
                        late.push((*k, e.timeout));
                    }
                }
                Stage::Running(_, run) => {
                    if let Some((r, keep)) = run.poll(waker) {
                        done.push((*k, r, keep));
                    }
                }
                Stage::Reserved | Stage::Starting => {}
            }
        }
        for (k, _) in &fired {
            if let Some(q) = st.queues.get_mut(&k.0) {
                q.unfired.remove(&k.1);
            }
        }
        moved |= !fired.is_empty() || !late.is_empty() || !done.is_empty();
        moved |= self.settle_lean(&mut st, &mut open, now);
        for (k, r, keep) in done {
            self.finish(&mut st, k, r, Some(keep));
        }
        for (k, after) in late {
            let e = Error::Timeout {
                what: "a stream transfer's trigger (the stream did not reach it)",
                after,
            };
            self.finish(&mut st, k, Err(e), None);
        }
        if let Some(since) = st.closing
            && since.elapsed() >= CLOSE_WAIT
        {
            let left: Vec<(u64, u64)> = st.entries.keys().copied().collect();
            for k in left {
                let e = Error::Timeout {
                    what: "a stream transfer at the endpoint's close",
                    after: CLOSE_WAIT,
                };
                self.finish(&mut st, k, Err(e), None);
            }
        }
        for q in st.queues.values() {
            q.publish_low();
        }
        let mut watch: Watch<B::Fired> = Watch {
            armed: Vec::new(),
            fences: Vec::new(),
            waits: Vec::new(),
            notified: false,
            until: None,
            any: !st.entries.is_empty() || !st.lean.is_empty(),
            closing: st.closing.is_some(),
        };
        let mut last_queue = None;
        for e in st.entries.iter().filter_map(|(k, e)| match &e.stage {
            Stage::Armed(w) => Some((*k, e, w)),
            _ => None,
        }) {
            let fences = &mut watch.fences;
            let by_fence = self.backend.with_fence(e.2, |f| keep_earliest(fences, f));
            match by_fence {
                Some(()) => {
                    // Entries go by (queue, seq): a queue's first is its lowest.
                    if last_queue != Some(e.0.0)
                        && let Some(q) = st.queues.get(&e.0.0)
                    {
                        watch.waits.push((q.queue.waited.clone(), e.0.1, q.eager));
                    }
                    last_queue = Some(e.0.0);
                    watch.notified |= self.backend.notifies(e.2);
                }
                None => {
                    if let Some(q) = st.queues.get(&e.0.0) {
                        watch.armed.push((Arc::downgrade(&q.queue), e.0.1));
                    }
                }
            }
            watch.until = Some(watch.until.map_or(e.1.until, |u| u.min(e.1.until)));
        }
        // Lean requests not placed: their fences, as armed work fired by one.
        let mut last_queue = None;
        for (k, l) in &st.lean {
            keep_earliest(&mut watch.fences, &l.fence);
            if last_queue != Some(k.0)
                && let Some(q) = st.queues.get(&k.0)
            {
                watch.waits.push((q.queue.waited.clone(), k.1, q.eager));
            }
            last_queue = Some(k.0);
            watch.until = Some(watch.until.map_or(l.until, |u| u.min(l.until)));
        }
        (fired, moved, watch)
    }

    /// Start what fired, and poll each once, outside the lock (the backend takes the
    /// endpoint's); then one lock for all of them.
    fn start(&self, fired: Vec<((u64, u64), B::Work)>) {
        if fired.is_empty() {
            return;
        }
        let waker = &self.waker;
        let started: Vec<_> = fired
            .into_iter()
            .map(|(k, mut w)| {
                let r = match self.backend.done_at_fire(&mut w) {
                    // Nothing to poll: no `Running` made (nor allocated), the result at once.
                    Some(r) => Ok((
                        Box::new(NoRun) as Box<dyn Running>,
                        Some((r, Box::new(()) as Keep)),
                    )),
                    None => self.backend.start(&w).map(|mut run| {
                        let done = run.poll(waker);
                        (run, done)
                    }),
                };
                (k, w, r)
            })
            .collect();
        let mut st = self.lock();
        for (k, w, r) in started {
            match r {
                Ok((run, done)) => match st.entries.get_mut(&k) {
                    Some(e) => {
                        e.stage = Stage::Running(w, run);
                        if let Some((r, keep)) = done {
                            self.finish(&mut st, k, r, Some(keep));
                        }
                    }
                    None => {
                        st.graveyard
                            .push(Dead::Other(Box::new((w, run, done.map(|(_, k)| k)))))
                    }
                },
                Err(e) => {
                    if let Some(entry) = st.entries.get_mut(&k) {
                        entry.stage = Stage::Armed(w);
                    } else {
                        st.graveyard.push(Dead::Other(Box::new(w)));
                    }
                    self.finish(&mut st, k, Err(e), None);
                }
            }
        }
    }

    fn run(self: &Arc<Self>) {
        // Streams wait for this thread: what code run here lets go of is freed elsewhere.
        frees_nothing();
        let mut idle = 0u32;
        loop {
            // Taken before the state is looked at: a ring after this is seen next time.
            self.bell.take();
            let (fired, moved, watch) = self.round(self.lock());
            let started = !fired.is_empty();
            self.start(fired);
            if moved || started {
                idle = 0;
                continue;
            }
            if watch.closing && !watch.any {
                return;
            }
            if !watch.armed.is_empty() || !watch.fences.is_empty() {
                // While it yields, look at the armed words (and the fences that stand for
                // some) without the lock (which callers arming take) until one fires, a
                // trigger deadline passes or the bell rings; after a nap, a whole round
                // (running requests may rely on being polled). Watching only fences nobody
                // waits on, it naps from the first look: their copies are already queued on
                // the callers' streams, whose submissions a busy look slows; a waiter rings.
                let fences_only = watch.armed.is_empty();
                loop {
                    let napping = fences_only && !watch.waited();
                    #[cfg(test)]
                    if napping {
                        self.fence_naps.fetch_add(1, Ordering::Relaxed);
                    }
                    let rung = match proxy_pause(idle) {
                        None if napping => self.bell.sleep(Some(FENCE_NAP), NAP),
                        None => {
                            std::thread::yield_now();
                            self.bell.take()
                        }
                        Some(d) => {
                            // Over unwaited fences, never shorter than their nap.
                            let d = if napping { d.max(FENCE_NAP) } else { d };
                            self.bell.sleep(Some(d), NAP);
                            true
                        }
                    };
                    idle = idle.saturating_add(1);
                    if rung
                        || watch.fired(&self.front)
                        || watch.until.is_some_and(|u| Instant::now() >= u)
                    {
                        break;
                    }
                }
            } else if self.linger() {
                // Rung (a request armed) while it stayed awake: a round at once.
            } else if watch.any {
                // Running requests wake the bell when they finish; the bound covers trigger
                // deadlines and the close.
                self.bell.sleep(Some(Duration::from_millis(20)), DEEP);
            } else {
                self.bell.sleep(None, DEEP);
            }
        }
    }

    /// With nothing armed, stay awake (yielding, no lock taken) for [`PROXY_LINGER`] or until
    /// rung (then `true`): a caller arming its next request meanwhile rings without a system
    /// call, and its trigger is looked at without a wake-up.
    fn linger(&self) -> bool {
        let end = Instant::now() + PROXY_LINGER;
        loop {
            if self.bell.take() {
                return true;
            }
            if Instant::now() >= end {
                return false;
            }
            std::thread::yield_now();
        }
    }

    /// A seq on the queue new requests go to, handed to the proxy's state through the inbox,
    /// with what finished requests held (for the caller to drop). Only the front's lock
    /// unless the current queue cannot take it as far as the front knows
    /// ([`reserve_slow`](Self::reserve_slow)).
    fn reserve(&self, trig: &Trigger<'_>, ask: Ask<B::Fired>) -> Result<Reservation<B::Work>> {
        let want_cuda = matches!(trig, Trigger::Stream(_));
        {
            let mut front = self.front();
            if front.fast(want_cuda)? {
                return Ok(front.take_seq(ask));
            }
        }
        self.reserve_slow(trig, Some(ask))
            .map(|r| r.expect("a seq was asked for"))
    }

    /// [`reserve`](Self::reserve) with the proxy's state drained and locked: the current
    /// queue retired when it cannot take the request, a new one made (its words allocated
    /// outside the locks), the window checked exactly.
    /// With `ask` `None`, no seq is taken: the current queue is made ready for `trig` (the
    /// errors a reservation would give, given before a lean request queues its work).
    fn reserve_slow(
        &self,
        trig: &Trigger<'_>,
        ask: Option<Ask<B::Fired>>,
    ) -> Result<Option<Reservation<B::Work>>> {
        let want_cuda = matches!(trig, Trigger::Stream(_));
        let mut made: Option<Box<dyn WordMemory>> = None;
        hook("slow_entry");
        loop {
            {
                let mut st = self.lock();
                // Drained until no reservation is left outside the state: what the fast path
                // took between the drain and the front's lock would be missing from the
                // window and the outstanding count (seen from the second look on, new ones
                // wait for this).
                let mut guard = loop {
                    self.drain(&mut st, false);
                    hook("slow_gap");
                    let mut front = self.front();
                    // A lean seq counts too: its queue is kept only once it is outstanding.
                    if !front
                        .inbox
                        .iter()
                        .any(|m| matches!(m, Msg::Reserved { .. } | Msg::Lean { .. }))
                    {
                        front.slow = false;
                        break front;
                    }
                    front.slow = true;
                };
                let front = &mut *guard;
                if front.closing {
                    return Err(closed_error());
                }
                if let Some(cur) = front.current.as_mut() {
                    let id = cur.id;
                    let q = st.queues.get_mut(&id).expect("the current queue is kept");
                    let usable = cur.next_seq < MAX_SEQ && !q.retired;
                    if usable && (cur.cuda || !want_cuda) {
                        let seq = cur.next_seq;
                        if let Some(&low) = q.unfired.first()
                            && seq - low >= TRIGGER_SLOTS as u64
                        {
                            return Err(Error::invalid(
                                "stream transfers",
                                seq - low,
                                format!("at most {TRIGGER_SLOTS} armed at once on one endpoint"),
                            ));
                        }
                        q.publish_low();
                        let Some(ask) = ask else {
                            // Words made for a queue another caller made first are dropped
                            // after the locks.
                            return Ok(None);
                        };
                        let mut r = front.take_seq(ask);
                        // Words made for a queue another caller made first: dropped with the
                        // rest, after this request's trigger is queued.
                        if let Some(words) = made.take() {
                            r.3.push(Dead::Other(Box::new(words)));
                        }
                        return Ok(Some(r));
                    }
                    if usable && q.outstanding > 0 {
                        return Err(Error::invalid(
                            "stream",
                            "a host-triggered queue",
                            "the endpoint's stream queue is in plain host memory with \
                             host-triggered requests outstanding: finish them before \
                             enqueueing on a stream",
                        ));
                    }
                    q.retired = true;
                    front.current = None;
                    Self::forget_idle(&mut st, id);
                }
                if let Some(words) = made.take() {
                    let id = front.next_queue;
                    front.next_queue += 1;
                    let queue = Arc::new(
                        Queue::new(id, words, self.bell.clone()).helped_by(self.me.clone()),
                    );
                    st.queues.insert(
                        id,
                        QState {
                            queue: queue.clone(),
                            window: Window::default(),
                            outstanding: 0,
                            unfired: BTreeSet::new(),
                            known: 0,
                            retired: false,
                            eager: false,
                            recorded: false,
                        },
                    );
                    front.current = Some(Current {
                        id,
                        queue,
                        cuda: want_cuda,
                        next_seq: 1,
                    });
                    continue;
                }
            }
            made = Some(match trig {
                Trigger::Stream(s) => {
                    // Asked before allocating: an allocation during a capture may invalidate
                    // it (the enqueue path asks again, race-free).
                    crate::driver::ctx::bind(s.context())?;
                    if crate::completion::capture::is_capturing(s.cu_stream())? {
                        return Err(Error::StreamCapturing {
                            call: "cuStreamWriteValue64_v2",
                            enqueued: false,
                        });
                    }
                    let f = MemopFlags::pinned_host(s.context(), 1 + TRIGGER_SLOTS)?;
                    if !f.supports_64_bit() {
                        return Err(Error::Unsupported {
                            what: "stream-ordered transfers (64-bit stream memory operations)"
                                .into(),
                            reason: "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS is 0".into(),
                        });
                    }
                    Box::new(f)
                }
                Trigger::Host => host_words(),
            });
        }
    }
}

/// A seq taken whose work is being made: dropped only by an unwind (a panic while the work was
/// made; on the normal path it is forgotten), it ends the seq as a failure that may have queued
/// its trigger, so that the queue's completion word and window do not wait for it forever (the
/// queue is not used again).
struct Unwound<'a, B: Backend> {
    core: &'a Core<B>,
    key: (u64, u64),
}

impl<B: Backend> Drop for Unwound<'_, B> {
    fn drop(&mut self) {
        let mut st = self.core.lock();
        self.core.drain(&mut st, false);
        let err = Error::invalid(
            "stream transfer",
            self.key.1,
            "arming it panicked (its trigger may be queued)",
        );
        self.core.finish(&mut st, self.key, Err(err), None);
        drop(st);
        self.core.bell.ring_if(DEEP);
    }
}

/// Test-only pauses at named points of a thread: what a test runs there, once.
#[cfg(test)]
type Hooks = std::cell::RefCell<HashMap<&'static str, Box<dyn FnOnce()>>>;

#[cfg(test)]
thread_local! {
    static HOOKS: Hooks = Default::default();
}

/// Run this thread's test hook at `at`, if any (nothing outside tests).
#[cfg(test)]
fn hook(at: &'static str) {
    let f = HOOKS.with(|h| h.borrow_mut().remove(at));
    if let Some(f) = f {
        f();
    }
}

#[cfg(not(test))]
#[inline(always)]
fn hook(_: &'static str) {}

impl<B: Backend> Helper for Core<B> {
    fn help(&self) -> bool {
        // A thread streams wait for (the proxy's own, where a waker's code runs) leaves rounds
        // to the proxy's loop.
        if frees_nothing_here() {
            return false;
        }
        let Some(st) = Locked::try_new(&self.state) else {
            return false;
        };
        let (fired, _, _) = self.round(st);
        self.start(fired);
        true
    }

    fn decide(&self, id: u64) -> bool {
        let mut st = self.lock();
        self.drain(&mut st, false);
        self.settle_lean(&mut st, &mut Vec::new(), Instant::now());
        st.queues.contains_key(&id)
    }
}

#[cfg(test)]
thread_local! {
    /// The words of this thread's next host-triggered queue, if a test gives them.
    static TEST_WORDS: std::cell::RefCell<Option<Box<dyn WordMemory>>> = Default::default();
}

/// The words of a new host-triggered queue (a test may give its own).
fn host_words() -> Box<dyn WordMemory> {
    #[cfg(test)]
    if let Some(w) = TEST_WORDS.with(|w| w.borrow_mut().take()) {
        return w;
    }
    Box::new(HostWords::new(1 + TRIGGER_SLOTS))
}

impl<B: Backend> Proxy<B> {
    pub(crate) fn new(backend: B) -> Self {
        let bell = Arc::new(Bell::default());
        Proxy {
            core: Arc::new_cyclic(|me| Core {
                me: me.clone(),
                backend,
                state: Mutex::new(PState {
                    entries: BTreeMap::new(),
                    lean: BTreeMap::new(),
                    queues: HashMap::default(),
                    closing: None,
                    graveyard: Vec::new(),
                    spare: Vec::new(),
                    woken: Woken::default(),
                }),
                front: Mutex::new(Front {
                    current: None,
                    closing: false,
                    slow: false,
                    next_queue: 1,
                    inbox: Vec::new(),
                    graveyard: Vec::new(),
                }),
                waker: Waker::from(bell.clone()),
                bell,
                #[cfg(test)]
                fence_naps: AtomicU64::new(0),
            }),
            thread: Mutex::new(None),
            started: AtomicBool::new(false),
        }
    }

    /// Drop what finished requests held (on the caller's thread).
    fn bury(&self) {
        let mut st = self.core.lock();
        self.core.drain(&mut st, false);
        let mut dead = std::mem::take(&mut st.graveyard);
        drop(st);
        dead.append(&mut self.core.front().graveyard);
        // On a proxy thread (another endpoint's, whose waker's code closed this one): elsewhere.
        if !dead.is_empty() {
            drop_freely(dead);
        }
    }

    fn ensure_thread(&self) -> Result<()> {
        if self.started.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut t = self.thread.lock().unwrap_or_else(|e| e.into_inner());
        if t.is_none() && !self.started.load(Ordering::Acquire) {
            let core = self.core.clone();
            *t = Some(crate::driver::ctx::spawn_thread(
                "gpudirect-stream-proxy",
                move || core.run(),
            )?);
            self.started.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// Arm `work`: a seq on the endpoint's queue, then (for a stream) the trigger write
    /// enqueued on it. `timeout` is the request's deadline, counted from now.
    pub(crate) fn arm(
        &self,
        trig: Trigger<'_>,
        work: B::Work,
        timeout: Duration,
    ) -> Result<StreamTransfer> {
        self.arm_with(trig, |_| Ok((work, false)), timeout, Instant::now())
    }

    /// [`arm`](Self::arm) with the work made once the request's seq is taken (work that queues
    /// copies on the stream makes them only when arming can go on). For a stream, `make` gets
    /// where the trigger goes and says whether it queued the trigger itself; else the trigger
    /// write is queued after it. The trigger deadline counts from `started`, when the request
    /// began (its caller read the clock already: this reads it no more).
    pub(crate) fn arm_with(
        &self,
        trig: Trigger<'_>,
        make: impl FnOnce(Option<Mark<'_>>) -> std::result::Result<(B::Work, bool), Unmade>,
        timeout: Duration,
        started: Instant,
    ) -> Result<StreamTransfer> {
        self.ensure_thread()?;
        let outcome = Arc::new(Outcome {
            flag: CompletionFlag::new(),
            slot: Mutex::new(None),
        });
        let until = deadline_after(started, timeout);
        // With what finished requests held, dropped below on this thread (as `bury` does).
        let ask = Ask::Reserve {
            outcome: outcome.clone(),
            timeout,
            until,
        };
        let (id, queue, seq, dead) = self.core.reserve(&trig, ask)?;
        let stream = match trig {
            Trigger::Stream(s) => Some(s),
            Trigger::Host => None,
        };
        let mark = stream.map(|_| Mark { queue: &queue, seq });
        // Until the work is made and handed over, an unwind (a panic in making it) ends the seq.
        let unwound = Unwound {
            core: &self.core,
            key: (id, seq),
        };
        let mut made = make(mark);
        if let (Some(stream), Ok((_, false))) = (stream, &made)
            && let Err(refused) = (Mark { queue: &queue, seq }).queue_trigger(stream, ())
        {
            made = Err(Unmade::of(refused).0);
        }
        std::mem::forget(unwound);
        let work = match made {
            Ok((work, _)) => work,
            Err(Unmade { error: e, queued }) => {
                let mut st = self.core.lock();
                self.core.drain(&mut st, false);
                if queued {
                    // The trigger may be queued (in a graph, whose launches write the slot at
                    // any time, or on the stream, which may still reach it): the queue is
                    // never used again (its words are never freed while a graph may hold
                    // them: see `MemopFlags`).
                    let err = Error::invalid(
                        "stream transfer",
                        seq,
                        format!("its trigger may be queued, but arming failed: {e}"),
                    );
                    self.core.finish(&mut st, (id, seq), Err(err), None);
                } else {
                    Core::<B>::void(&mut st, (id, seq));
                }
                drop(st);
                self.core.bell.ring_if(DEEP);
                return Err(e);
            }
        };
        let limit = deadline_after(until, timeout) + HOST_SLACK;
        // Handed over: the proxy's next round takes it (a close meanwhile: the work is
        // dropped by a caller's thread).
        self.core.front().inbox.push(Msg::Armed {
            key: (id, seq),
            work,
        });
        // A proxy napping between looks at armed triggers finds this one at its next look.
        self.core.bell.ring_if(DEEP);
        // Last: dropping what finished requests held may wait for streams (a queue's words),
        // which must not come between a seq and its trigger; and not on a proxy thread (a
        // waker's code arming there), which the streams wait for.
        if !dead.is_empty() {
            drop_freely(dead);
        }
        Ok(StreamTransfer {
            queue,
            seq,
            end: End::Proxy(outcome),
            host: stream.is_none(),
            limit,
        })
    }

    /// Before a lean request queues its work: the errors its seq would meet (the endpoint
    /// closed, a queue in host memory with host-triggered requests outstanding, the window of
    /// armed requests full, a capturing stream, the queue's words not made), with the queue
    /// made ready for it. Only a close or a failure racing the work then fails the request
    /// after its work is queued.
    ///
    /// # Errors
    ///
    /// As [`arm_lean`](Self::arm_lean).
    #[cfg_attr(
        not(feature = "p2p"),
        allow(dead_code, reason = "the intra-node path makes lean requests")
    )]
    pub(crate) fn ready_lean(&self, trig: Trigger<'_>) -> Result<()> {
        self.ensure_thread()?;
        let want_cuda = matches!(trig, Trigger::Stream(_));
        if self.core.front().fast(want_cuda)? {
            return Ok(());
        }
        self.core.reserve_slow(&trig, None).map(|_| ())
    }

    /// A lean request: its work is queued on the stream of `trig` already (a host trigger:
    /// tests, in plain host words), done once `fence` completes, with `held` (its report, and
    /// what the work reaches) its result. The proxy only places it in the queue's word (see
    /// [`End::Lean`]); `timeout` is its deadline, counted from `started`.
    #[cfg_attr(
        not(feature = "p2p"),
        allow(dead_code, reason = "the intra-node path makes lean requests")
    )]
    pub(crate) fn arm_lean(
        &self,
        trig: Trigger<'_>,
        fence: B::Fired,
        held: (TransferReport, Keep),
        timeout: Duration,
        started: Instant,
    ) -> Result<StreamTransfer> {
        self.ensure_thread()?;
        let until = deadline_after(started, timeout);
        let ask = Ask::Lean {
            fence: fence.clone(),
            timeout,
            until,
        };
        let (_, queue, seq, dead) = self.core.reserve(&trig, ask)?;
        // A proxy asleep with nothing armed learns of it (its deadline, a stream's wait).
        self.core.bell.ring_if(DEEP);
        // Not on a proxy thread (a waker's code arming there), which the streams wait for.
        if !dead.is_empty() {
            drop_freely(dead);
        }
        Ok(StreamTransfer {
            queue,
            seq,
            end: End::Lean(Lean {
                fence: Box::new(fence),
                held: Mutex::new(Some(held)),
                started,
            }),
            host: false,
            limit: deadline_after(until, timeout) + HOST_SLACK,
        })
    }

    /// Requests not finished (armed, starting or running, lean not placed).
    #[cfg(test)]
    fn pending(&self) -> usize {
        let mut st = self.core.lock();
        self.core.drain(&mut st, false);
        st.entries.len() + st.lean.len()
    }

    /// The endpoint is closing: take no more work, release what waits on it. Called before
    /// the endpoint's requests are ended.
    pub(crate) fn closing(&self) {
        self.core.close();
    }

    /// The endpoint's progress thread has stopped and every request has ended.
    pub(crate) fn closed(&self) {
        self.core.close();
        let t = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = t {
            if t.thread().id() == std::thread::current().id() {
                return; // the endpoint was dropped on the proxy thread: it ends by itself
            }
            let _ = t.join();
        }
        self.bury();
    }
}

#[cfg(test)]
mod tests {
    use super::super::words::STREAM_ERROR_BIT;
    use super::*;
    use crate::completion::Fence;
    use crate::cuda::WaitCondition;
    use crate::transfer::request::Direction;

    /// A fake backend: requests finish when the test says so, or at once.
    #[derive(Default)]
    struct Fake {
        started: Mutex<Vec<u64>>,
        /// Results the test released, by work id.
        release: Arc<Mutex<HashMap<u64, bool>>>,
        /// Work fired by a fence the test completes, by work id.
        by_fence: Mutex<HashMap<u64, FakeFence>>,
        /// Where what finished requests held (their keeps) was dropped.
        drops: Drops,
    }

    /// A fence the test completes, in place of a trigger word; at a place the test sets (a
    /// stream and a position there), or alone on a stream of its own.
    #[derive(Clone, Default)]
    struct FakeFence(Arc<AtomicBool>, Option<(usize, u64)>);

    impl Fence for FakeFence {
        fn is_complete(&self) -> bool {
            self.0.load(Ordering::Acquire)
        }
    }

    impl FiredBy for FakeFence {
        fn place(&self) -> (usize, u64) {
            self.1.unwrap_or((Arc::as_ptr(&self.0) as usize, 0))
        }
        fn fired(&self) -> bool {
            self.is_complete()
        }
    }

    struct FakeRun {
        id: u64,
        release: Arc<Mutex<HashMap<u64, bool>>>,
        drops: Drops,
    }

    fn report() -> TransferReport {
        TransferReport {
            direction: Direction::Write,
            bytes: 8,
            messages: 1,
            rail_bytes: vec![8],
            paths: vec![],
            elapsed: Duration::ZERO,
            notified: None,
            reposted: 0,
        }
    }

    impl Running for FakeRun {
        fn poll(&mut self, _: &Waker) -> Option<(Result<TransferReport>, Keep)> {
            let ok = self.release.lock().unwrap().remove(&self.id)?;
            let r = if ok {
                Ok(report())
            } else {
                Err(Error::invalid("fake", self.id, "failed on purpose"))
            };
            Some((r, Box::new(Tracked(self.drops.clone()))))
        }
    }

    impl Backend for Fake {
        type Work = u64;
        type Fired = FakeFence;
        fn start(&self, w: &u64) -> Result<Box<dyn Running>> {
            self.started.lock().unwrap().push(*w);
            Ok(Box::new(FakeRun {
                id: *w,
                release: self.release.clone(),
                drops: self.drops.clone(),
            }))
        }
        fn fired_by(&self, w: &u64) -> Option<FakeFence> {
            self.by_fence.lock().unwrap().get(w).cloned()
        }
    }

    fn until(what: &str, f: impl Fn() -> bool) {
        let t = Instant::now();
        while !f() {
            assert!(t.elapsed() < Duration::from_secs(10), "{what}");
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn finish(release: &Arc<Mutex<HashMap<u64, bool>>>, id: u64, ok: bool) {
        release.lock().unwrap().insert(id, ok);
    }

    /// A backend whose work is done at once: fired by a fence complete from the start, done
    /// when it fires (the shape of an intra-node stream request), for the bookkeeping's cost.
    struct Quick(FakeFence);

    impl Backend for Quick {
        type Work = u64;
        type Fired = FakeFence;
        fn start(&self, _: &u64) -> Result<Box<dyn Running>> {
            Ok(Box::new(NoRun))
        }
        fn done_at_fire(&self, _: &mut u64) -> Option<Result<TransferReport>> {
            Some(Ok(report()))
        }
        fn fired_by(&self, _: &u64) -> Option<FakeFence> {
            Some(self.0.clone())
        }
    }

    /// The proxy's own cost per request: bursts of 32 armed, then each waited for (as the
    /// `transfer_local` bench's stream-ordered cells, without CUDA). `cargo test --release --lib
    /// bookkeeping -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement"]
    fn bookkeeping_per_request() {
        let fence = FakeFence::default();
        fence.0.store(true, Ordering::Release);
        let p = Proxy::new(Quick(fence));
        let burst = || {
            let ts: Vec<_> = (0..32)
                .map(|i| p.arm(Trigger::Host, i, Duration::from_secs(30)).unwrap())
                .collect();
            for t in ts {
                t.wait(Duration::from_secs(10)).unwrap();
            }
        };
        for _ in 0..1000 {
            burst();
        }
        for _ in 0..3 {
            let t0 = Instant::now();
            let n = 20_000;
            for _ in 0..n {
                burst();
            }
            let ns = t0.elapsed().as_nanos() as f64 / (n * 32) as f64;
            println!("bookkeeping: {ns:.0} ns a request");
        }
        p.closed();
    }

    /// A host waiter runs the proxy's round itself: with no proxy thread at all (never
    /// started), waits, looks and futures still end what fired, in order, and only what fired.
    #[test]
    fn a_host_waiter_ends_requests_without_the_proxy_thread() {
        let p = Proxy::new(Fake::default());
        p.started.store(true, Ordering::Release); // no thread
        let rel = p.core.backend.release.clone();
        let (f1, t1) = armed_behind_a_fence(&p, 1);
        let (f2, t2) = armed_behind_a_fence(&p, 2);
        let (f3, t3) = armed_behind_a_fence(&p, 3);
        assert!(!t1.is_complete() && !t2.is_released());
        assert!(
            t1.wait(Duration::from_millis(5)).is_err(),
            "its fence is open"
        );
        for (f, id) in [(&f1, 1), (&f2, 2)] {
            f.0.store(true, Ordering::Release);
            finish(&rel, id, true);
        }
        assert_eq!(t2.wait(Duration::from_secs(10)).unwrap().bytes, 8);
        assert!(t1.is_complete() && t1.is_released() && t2.is_released());
        assert_eq!(t1.completion_value(), 2);
        assert!(!t3.is_complete(), "its fence is still open");
        assert_eq!(*p.core.backend.started.lock().unwrap(), vec![1, 2]);
        f3.0.store(true, Ordering::Release);
        finish(&rel, 3, true);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        assert_eq!(rt.block_on(t3.into_future()).unwrap().bytes, 8);
        assert_eq!(p.pending(), 0);
        p.closed();
    }

    /// A lean request done once `fence` completes (its report: `bytes` = `id`).
    fn lean(p: &Proxy<Fake>, id: u64, fence: &FakeFence, timeout: Duration) -> StreamTransfer {
        let mut r = report();
        r.bytes = id;
        p.arm_lean(
            Trigger::Host,
            fence.clone(),
            (r, Box::new(())),
            timeout,
            Instant::now(),
        )
        .unwrap()
    }

    fn decided(t: &StreamTransfer) -> usize {
        t.queue.decided.lock().unwrap().len()
    }

    /// Lean requests are placed in the word in order, whichever fence completes first; one
    /// done past the prefix is told by the queue's record until the prefix covers it; the host
    /// takes each result once, the future too.
    #[test]
    fn lean_requests_take_their_place_in_the_word_in_order() {
        let p = Proxy::new(Fake::default());
        let f: Vec<FakeFence> = (0..3).map(|_| FakeFence::default()).collect();
        let t: Vec<StreamTransfer> = (0..3)
            .map(|i| lean(&p, 10 + i as u64, &f[i], Duration::from_secs(30)))
            .collect();
        assert_eq!(
            t.iter().map(StreamTransfer::seq).collect::<Vec<_>>(),
            [1, 2, 3]
        );
        assert!(
            t[0].wait(Duration::from_millis(5)).is_err(),
            "its fence is open"
        );
        f[1].0.store(true, Ordering::Release);
        assert_eq!(t[1].wait(Duration::from_secs(10)).unwrap().bytes, 11);
        assert!(!t[1].is_released(), "request 1 is not done");
        assert!(t[1].wait(Duration::ZERO).is_err(), "taken once");
        f[0].0.store(true, Ordering::Release);
        assert!(t[0].is_complete());
        until("the prefix", || t[0].completion_value() == 2);
        assert!(t[1].is_released());
        assert_eq!(decided(&t[0]), 0, "the prefix covers what the record told");
        assert_eq!(t[0].wait(Duration::from_secs(10)).unwrap().bytes, 10);
        f[2].0.store(true, Ordering::Release);
        let mut t = t;
        let last = t.pop().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        assert_eq!(rt.block_on(last.into_future()).unwrap().bytes, 12);
        assert_eq!(t[0].completion_value(), 3);
        assert_eq!(p.pending(), 0);
        p.closed();
    }

    /// A lean request whose fence stays open past its deadline fails, with the error bit in
    /// the word; the queue's later requests, lean or not, fail with it, and new requests go to a
    /// new queue.
    #[test]
    fn a_late_lean_request_fails_its_queue() {
        let p = Proxy::new(Fake::default());
        let never = FakeFence::default();
        let late = lean(&p, 1, &never, Duration::from_millis(20));
        let later_fence = FakeFence::default();
        let later = lean(&p, 2, &later_fence, Duration::from_secs(30));
        let (f3, armed) = armed_behind_a_fence(&p, 3);
        let e = late.wait(Duration::from_secs(10)).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(late.is_released() && later.is_released() && armed.is_released());
        assert_ne!(late.completion_value() & STREAM_ERROR_BIT, 0);
        later_fence.0.store(true, Ordering::Release);
        f3.0.store(true, Ordering::Release);
        let e = later.wait(Duration::from_secs(10)).unwrap_err();
        assert!(e.to_string().contains("failed first"), "{e}");
        let e = armed.wait(Duration::from_secs(10)).unwrap_err();
        assert!(e.to_string().contains("failed first"), "{e}");
        let ok = FakeFence::default();
        ok.0.store(true, Ordering::Release);
        let next = lean(&p, 4, &ok, Duration::from_secs(30));
        assert_ne!(next.queue.id, late.queue.id, "a new queue");
        assert_eq!(next.wait(Duration::from_secs(10)).unwrap().bytes, 4);
        p.closed();
    }

    /// The errors a lean request's seq would meet come before its work is queued: a closed
    /// proxy, a window of armed requests full.
    #[test]
    fn a_lean_request_is_refused_before_its_work_is_queued() {
        let p = Proxy::new(Fake::default());
        let held: Vec<StreamTransfer> = (0..TRIGGER_SLOTS as u64)
            .map(|i| p.arm(Trigger::Host, i, Duration::from_secs(30)).unwrap())
            .collect();
        let e = p.ready_lean(Trigger::Host).unwrap_err();
        assert!(e.to_string().contains("armed at once"), "{e}");
        p.closing();
        let e = p.ready_lean(Trigger::Host).unwrap_err();
        assert!(e.to_string().contains("closed"), "{e}");
        drop(held);
        p.closed();
    }

    /// An awaited lean request whose queue fails while its fence stays open ends with that
    /// failure at once, not at its bound.
    #[test]
    fn an_awaited_lean_request_ends_with_its_queues_failure() {
        let p = Proxy::new(Fake::default());
        let open = FakeFence::default();
        let t = lean(&p, 1, &open, Duration::from_secs(30));
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            let _ = tx.send(rt.block_on(t.into_future()));
        });
        std::thread::sleep(Duration::from_millis(20));
        p.closing();
        let r = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the future ends with the close, not at its bound");
        let e = r.unwrap_err();
        assert!(e.to_string().contains("closed"), "{e}");
        waiter.join().unwrap();
        p.closed();
    }

    /// Lean requests and requests the proxy ends share one word; a lean one not placed at the
    /// close fails with it; with no proxy thread, the host places them itself.
    #[test]
    fn lean_and_proxy_requests_share_the_word_and_the_close() {
        let p = Proxy::new(Fake::default());
        p.started.store(true, Ordering::Release); // no thread: the host places them
        let rel = p.core.backend.release.clone();
        let (f1, t1) = armed_behind_a_fence(&p, 1);
        let f2 = FakeFence::default();
        let t2 = lean(&p, 2, &f2, Duration::from_secs(30));
        f2.0.store(true, Ordering::Release);
        assert_eq!(t2.wait(Duration::from_secs(10)).unwrap().bytes, 2);
        assert_eq!(t2.completion_value(), 0, "request 1 runs");
        f1.0.store(true, Ordering::Release);
        finish(&rel, 1, true);
        t1.wait(Duration::from_secs(10)).unwrap();
        assert_eq!(t1.completion_value(), 2);
        let open = FakeFence::default();
        let t3 = lean(&p, 3, &open, Duration::from_secs(30));
        p.closing();
        let e = t3.wait(Duration::from_secs(10)).unwrap_err();
        assert!(e.to_string().contains("closed"), "{e}");
        assert!(t3.is_released());
        p.closed();
    }

    /// A lean request's result taken (a success the record told, a failure the record told):
    /// it stays complete, and a second wait says at once that it was taken (not a timeout
    /// after asking the proxy again and again).
    #[test]
    fn a_lean_result_taken_stays_complete_and_a_second_wait_says_so() {
        let p = Proxy::new(Fake::default());
        let rel = p.core.backend.release.clone();
        // A request the proxy runs keeps the queue known after the failure below.
        let (f1, running) = armed_behind_a_fence(&p, 1);
        f1.0.store(true, Ordering::Release);
        until("started", || {
            p.core.backend.started.lock().unwrap().contains(&1)
        });
        let f2 = FakeFence::default();
        let f3 = FakeFence::default();
        let gap = lean(&p, 2, &f2, Duration::from_millis(300));
        let ok = lean(&p, 3, &f3, Duration::from_secs(30));
        f3.0.store(true, Ordering::Release);
        // Done past the prefix (request 1 runs): told by the record.
        assert_eq!(ok.wait(Duration::from_secs(10)).unwrap().bytes, 3);
        assert!(ok.is_complete(), "taken, still complete");
        let at = Instant::now();
        let e = ok.wait(Duration::from_secs(2)).unwrap_err();
        assert!(e.to_string().contains("already taken"), "{e}");
        assert!(at.elapsed() < Duration::from_secs(1), "{:?}", at.elapsed());
        // Late: failed, told by the record; the queue is still known (request 1 runs).
        let e = gap.wait(Duration::from_secs(10)).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(gap.is_complete(), "taken, still complete");
        let at = Instant::now();
        let e = gap.wait(Duration::from_secs(2)).unwrap_err();
        assert!(e.to_string().contains("already taken"), "{e}");
        assert!(at.elapsed() < Duration::from_secs(1), "{:?}", at.elapsed());
        finish(&rel, 1, true);
        running.wait(Duration::from_secs(10)).unwrap();
        p.closed();
    }

    /// A lean request let go of untaken by code a waker runs on the proxy thread: what its
    /// copies reach is dropped on another thread (as a full request's outcome does).
    #[test]
    fn a_lean_request_let_go_of_on_the_proxy_thread_drops_what_it_holds_elsewhere() {
        let p = Proxy::new(Fake::default());
        let rel = p.core.backend.release.clone();
        let drops = Drops::default();
        let f = FakeFence::default();
        let a = p
            .arm_lean(
                Trigger::Host,
                f.clone(),
                (report(), Box::new(Tracked(drops.clone()))),
                Duration::from_secs(30),
                Instant::now(),
            )
            .unwrap();
        let b = p.arm(Trigger::Host, 2, Duration::from_secs(30)).unwrap();
        let w = Arc::new(DropsOnWake(Mutex::new(Some(a))));
        assert!(b.outcome().flag.register_waker(&Waker::from(w.clone())));
        f.0.store(true, Ordering::Release);
        b.trigger().unwrap();
        finish(&rel, 2, true);
        until("the waker ran", || w.0.lock().unwrap().is_none());
        until("dropped", || !drops.0.lock().unwrap().is_empty());
        none_dropped_on_the_proxy(&drops.0.lock().unwrap());
        p.closed();
    }

    /// A lean seq the fast path takes while a slow reservation drains is drained before the
    /// slow path looks: the queue it retires (its last seq taken) is kept until the lean
    /// request is placed, and its host gets its success.
    #[test]
    fn a_lean_seq_taken_while_a_slow_reservation_drains_is_kept() {
        let p = Arc::new(Proxy::new(Fake::default()));
        p.started.store(true, Ordering::Release); // no thread: only callers drain
        let done = FakeFence::default();
        done.0.store(true, Ordering::Release);
        let first = lean(&p, 1, &done, Duration::from_secs(30));
        first.wait(Duration::from_secs(10)).unwrap();
        // The next caller goes slow; after its drain, before the front's lock, another thread
        // takes the queue's last seq on the fast path.
        p.core.front().slow = true;
        let f = FakeFence::default();
        let got: Arc<Mutex<Option<StreamTransfer>>> = Default::default();
        let (p2, g2, f2) = (p.clone(), got.clone(), f.clone());
        set_hook("slow_gap", move || {
            {
                let mut front = p2.core.front();
                front.slow = false;
                let cur = front.current.as_mut().unwrap();
                cur.next_seq = MAX_SEQ - 1;
                cur.queue.low.0.store(MAX_SEQ - 1, Ordering::Release);
            }
            let t = std::thread::spawn(move || lean(&p2, 2, &f2, Duration::from_secs(30)))
                .join()
                .unwrap();
            *g2.lock().unwrap() = Some(t);
        });
        let next = lean(&p, 3, &done, Duration::from_secs(30));
        let last = got.lock().unwrap().take().expect("the hook ran");
        assert_eq!(last.seq(), MAX_SEQ - 1);
        assert_ne!(next.queue.id, last.queue.id, "the full queue retired");
        f.0.store(true, Ordering::Release);
        let r = last.wait(Duration::from_secs(10));
        assert_eq!(r.map(|r| r.bytes).map_err(|e| e.to_string()), Ok(2));
        assert_eq!(next.wait(Duration::from_secs(10)).unwrap().bytes, 3);
        p.closed();
    }

    /// Threads arming lean and full requests on one proxy, completing their fences in random
    /// orders, some late (deadline) or failing, with a close racing them: every wait ends,
    /// every result is taken once (and stays complete), each queue's word only grows, a seq
    /// its prefix covers was Ok, a failure shows the error bit, and a queue without the bit
    /// has every request in its prefix.
    #[test]
    fn threads_mixing_lean_and_full_requests_with_failures_and_a_close_agree_with_the_word() {
        for round in 0..6u64 {
            let p = Arc::new(Proxy::new(Fake::default()));
            let rel = p.core.backend.release.clone();
            let stop = Arc::new(AtomicBool::new(false));
            // Each queue's words sampled while the workers run: never smaller, bit never lost.
            let watcher = {
                let (p, stop) = (p.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut seen: HashMap<u64, (Arc<Queue>, u64)> = HashMap::new();
                    let mut bad = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        for (id, q) in p.core.lock().queues.iter() {
                            seen.entry(*id).or_insert((q.queue.clone(), 0));
                        }
                        for (id, (q, last)) in seen.iter_mut() {
                            let w = q.words.load(DONE);
                            let grew = (w & !STREAM_ERROR_BIT) >= (*last & !STREAM_ERROR_BIT)
                                && (w & STREAM_ERROR_BIT) >= (*last & STREAM_ERROR_BIT);
                            if !grew {
                                bad.push((*id, *last, w));
                            }
                            *last = w;
                        }
                        std::thread::yield_now();
                    }
                    bad
                })
            };
            let workers: Vec<_> = (0..4u64)
                .map(|w| {
                    let (p, rel) = (p.clone(), rel.clone());
                    std::thread::spawn(move || {
                        let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (round * 131 + w + 1);
                        let mut next = move |n: u64| {
                            rng ^= rng << 13;
                            rng ^= rng >> 7;
                            rng ^= rng << 17;
                            rng % n
                        };
                        let mut out = Vec::new();
                        for b in 0..30u64 {
                            // (transfer, fence, full request's id and result)
                            let mut batch = Vec::new();
                            for i in 0..(1 + next(6)) {
                                let id = 1 + (w << 32) + (b << 8) + i;
                                if next(4) == 0 {
                                    let fence = FakeFence::default();
                                    p.core
                                        .backend
                                        .by_fence
                                        .lock()
                                        .unwrap()
                                        .insert(id, fence.clone());
                                    if let Ok(t) = p.arm(Trigger::Host, id, Duration::from_secs(30))
                                    {
                                        batch.push((t, fence, Some((id, next(8) != 0))));
                                    }
                                } else {
                                    let fence = FakeFence::default();
                                    let timeout = if next(16) == 0 {
                                        Duration::from_millis(1)
                                    } else {
                                        Duration::from_secs(30)
                                    };
                                    let mut r = report();
                                    r.bytes = id;
                                    if let Ok(t) = p.arm_lean(
                                        Trigger::Host,
                                        fence.clone(),
                                        (r, Box::new(())),
                                        timeout,
                                        Instant::now(),
                                    ) {
                                        batch.push((t, fence, None));
                                    }
                                }
                            }
                            // Fences complete in a random order (a late one maybe never).
                            let mut order: Vec<usize> = (0..batch.len()).collect();
                            for k in (1..order.len()).rev() {
                                order.swap(k, next(k as u64 + 1) as usize);
                            }
                            for &k in &order {
                                let (_, f, full) = &batch[k];
                                if next(20) != 0 {
                                    f.0.store(true, Ordering::Release);
                                }
                                if let Some((id, ok)) = full {
                                    finish(&rel, *id, *ok);
                                }
                                if next(3) == 0 {
                                    std::thread::yield_now();
                                }
                            }
                            for (t, f, _) in batch {
                                let r = t.wait(Duration::from_secs(10));
                                let done = t.is_complete();
                                let again = t.wait(Duration::from_millis(500));
                                f.0.store(true, Ordering::Release);
                                out.push((
                                    t,
                                    r.map(|_| ()).map_err(|e| e.to_string()),
                                    done,
                                    again,
                                ));
                            }
                        }
                        out
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_millis(5 + round * 7));
            p.closing();
            let got: Vec<_> = workers
                .into_iter()
                .flat_map(|w| w.join().unwrap())
                .collect();
            stop.store(true, Ordering::Relaxed);
            let bad = watcher.join().unwrap();
            assert!(bad.is_empty(), "round {round}: words that shrank: {bad:?}");
            let mut by_queue: HashMap<u64, Vec<(u64, bool)>> = HashMap::new();
            for (t, r, done, again) in &got {
                let word = t.completion_value();
                let tag = format!(
                    "round {round}: queue {} seq {} word {word:#x}",
                    t.queue.id,
                    t.seq()
                );
                assert!(
                    !matches!(r, Err(e) if e.ends_with("waiting for a stream transfer")),
                    "{tag}: the wait did not end: {r:?}"
                );
                assert!(*done, "{tag}: taken, not complete");
                let again = again.as_ref().map(|_| ()).map_err(|e| e.to_string());
                assert!(
                    matches!(&again, Err(e) if e.contains("already taken")),
                    "{tag}: a second wait: {again:?}"
                );
                if t.queue.covers(t.seq()) {
                    assert!(r.is_ok(), "{tag}: in the prefix, yet {r:?}");
                }
                if r.is_err() {
                    assert_ne!(
                        word & STREAM_ERROR_BIT,
                        0,
                        "{tag}: failed ({r:?}) without the bit"
                    );
                }
                by_queue
                    .entry(t.queue.id)
                    .or_default()
                    .push((t.seq(), r.is_ok()));
            }
            for (t, _, _, _) in &got {
                let word = t.completion_value();
                if word & STREAM_ERROR_BIT == 0 {
                    let all = &by_queue[&t.queue.id];
                    assert!(
                        all.iter().all(|&(s, ok)| ok && geq_releases(word, s)),
                        "round {round}: queue {} word {word:#x} without the bit: {all:?}",
                        t.queue.id
                    );
                }
            }
            let oks = got.iter().filter(|g| g.1.is_ok()).count();
            assert!(oks > 0, "round {round}: some requests succeeded");
            drop(got);
            p.closed();
        }
    }

    /// Work `id` armed with a host trigger and fired by a fence of its own, still open.
    fn armed_behind_a_fence(p: &Proxy<Fake>, id: u64) -> (FakeFence, StreamTransfer) {
        let fence = FakeFence::default();
        p.core
            .backend
            .by_fence
            .lock()
            .unwrap()
            .insert(id, fence.clone());
        let t = p.arm(Trigger::Host, id, Duration::from_secs(30)).unwrap();
        (fence, t)
    }

    #[test]
    fn a_late_trigger_starts_the_request_then_the_word_is_set() {
        let p = Proxy::new(Fake::default());
        let rel = p.core.backend.release.clone();
        let t = p.arm(Trigger::Host, 7, Duration::from_secs(30)).unwrap();
        std::thread::sleep(Duration::from_millis(30));
        assert!(p.core.backend.started.lock().unwrap().is_empty());
        assert!(!t.is_released() && !t.is_complete());
        t.trigger().unwrap();
        until("started", || {
            !p.core.backend.started.lock().unwrap().is_empty()
        });
        assert!(!t.is_released());
        finish(&rel, 7, true);
        assert_eq!(t.wait(Duration::from_secs(10)).unwrap().bytes, 8);
        assert_eq!(t.completion_value(), 1);
        assert!(t.wait(Duration::ZERO).is_err(), "taken once");
        p.closed();
    }

    /// Work whose stream stores no trigger (an event behind it instead) starts once its fence
    /// completes, and the proxy keeps looking while it waits: it naps between looks, never
    /// sleeping until rung (which would leave the fence unseen until the next request).
    #[test]
    fn work_fired_by_a_fence_starts_when_it_completes_and_the_proxy_keeps_looking() {
        let p = Proxy::new(Fake::default());
        let rel = p.core.backend.release.clone();
        let (fence, t) = armed_behind_a_fence(&p, 9);
        until("napping", || {
            p.core.bell.sleeping.load(Ordering::SeqCst) == NAP
        });
        let look = Instant::now();
        while look.elapsed() < Duration::from_millis(30) {
            assert_ne!(
                p.core.bell.sleeping.load(Ordering::SeqCst),
                DEEP,
                "asleep with work armed"
            );
            std::thread::yield_now();
        }
        assert!(
            p.core.backend.started.lock().unwrap().is_empty(),
            "no word, fence open"
        );
        fence.0.store(true, Ordering::Release);
        until("started", || {
            !p.core.backend.started.lock().unwrap().is_empty()
        });
        finish(&rel, 9, true);
        assert_eq!(t.wait(Duration::from_secs(10)).unwrap().bytes, 8);
        assert_eq!(t.completion_value(), 1);
        p.closed();
    }

    /// A waiter ([`StreamTransfer::wait`], `.await`, `wait_on`) raises its queue's watermark
    /// and rings the proxy once per raise: a loop of `wait(Duration::ZERO)` rings once.
    #[test]
    fn a_waiter_marks_its_seq_and_rings_once_per_raise() {
        #[derive(Default)]
        struct Count(
            std::sync::atomic::AtomicUsize,
            std::sync::atomic::AtomicUsize,
        );
        impl Nudge for Count {
            fn nudge(&self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
            fn waiter(&self) {
                self.1.fetch_add(1, Ordering::SeqCst);
            }
        }
        let bell = Arc::new(Count::default());
        let queue = Arc::new(Queue::new(1, Box::new(HostWords::new(8)), bell.clone()));
        let transfer = |seq| StreamTransfer {
            queue: queue.clone(),
            seq,
            end: End::Proxy(Arc::new(Outcome {
                flag: CompletionFlag::new(),
                slot: Mutex::new(None),
            })),
            host: true,
            limit: Instant::now() + Duration::from_secs(30),
        };
        let t3 = transfer(3);
        for _ in 0..5 {
            assert!(matches!(
                t3.wait(Duration::ZERO),
                Err(Error::Timeout { .. })
            ));
        }
        assert_eq!(queue.waited.load(Ordering::SeqCst), 3);
        assert_eq!(bell.1.load(Ordering::SeqCst), 1, "rung once for seq 3");
        // An earlier request is covered by the watermark already: no ring.
        let t2 = transfer(2);
        assert!(t2.wait(Duration::ZERO).is_err());
        assert_eq!(bell.1.load(Ordering::SeqCst), 1);
        assert_eq!(queue.waited.load(Ordering::SeqCst), 3, "never lowered");
        // A later one raises it; so does awaiting one (at once, before any poll).
        let _f = transfer(5).into_future();
        assert_eq!(queue.waited.load(Ordering::SeqCst), 5);
        assert_eq!(bell.1.load(Ordering::SeqCst), 2);
    }

    /// A waiter wakes a proxy napping between looks, not one asleep with nothing armed (a
    /// running request rings that one when it ends); the sleep's end finds the ring either
    /// way.
    #[test]
    fn a_waiter_wakes_a_nap_but_not_a_deep_sleep() {
        for (depth, wakes) in [(NAP, true), (DEEP, false)] {
            let bell = Arc::new(Bell::default());
            let b = bell.clone();
            let sleeper = std::thread::spawn(move || {
                let t = Instant::now();
                let rung = b.sleep(Some(Duration::from_millis(500)), depth);
                (t.elapsed(), rung)
            });
            until("asleep", || bell.sleeping.load(Ordering::SeqCst) == depth);
            bell.waiter();
            let (slept, rung) = sleeper.join().unwrap();
            assert_eq!(
                slept < Duration::from_millis(400),
                wakes,
                "depth {depth}: slept {slept:?}"
            );
            assert!(rung, "the sleep's end finds the ring");
        }
    }

    /// Over a fence nobody waits on the proxy naps between looks; once the request is waited
    /// for it looks without those naps (until it would nap over armed work anyway).
    #[test]
    fn the_proxy_naps_over_an_unwaited_fence_and_stops_once_it_is_waited() {
        let p = Proxy::new(Fake::default());
        let rel = p.core.backend.release.clone();
        let (fence, t) = armed_behind_a_fence(&p, 4);
        until("naps over the fence", || {
            p.core.fence_naps.load(Ordering::Relaxed) >= 5
        });
        assert!(t.wait(Duration::ZERO).is_err(), "its fence is open");
        // The nap in progress ends; then no more of them.
        let naps = || p.core.fence_naps.load(Ordering::Relaxed);
        until("stops napping", || {
            let before = naps();
            std::thread::sleep(Duration::from_millis(5));
            naps() == before
        });
        let naps = naps();
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(
            p.core.fence_naps.load(Ordering::Relaxed),
            naps,
            "napped over a waited fence"
        );
        fence.0.store(true, Ordering::Release);
        finish(&rel, 4, true);
        t.wait(Duration::from_secs(10)).unwrap();
        p.closed();
    }

    /// What decides the proxy's pace over fences: a queue's watermark at or past its lowest
    /// request armed behind a fence, or its last request waited for.
    #[test]
    fn a_watch_over_fences_is_waited_when_a_waiter_reaches_its_lowest_seq_or_the_last_was() {
        let w = Arc::new(AtomicU64::new(0));
        let watch = |waits: Vec<(Arc<AtomicU64>, u64, bool)>| Watch::<FakeFence> {
            armed: Vec::new(),
            fences: vec![FakeFence::default()],
            waits,
            notified: false,
            until: None,
            any: true,
            closing: false,
        };
        assert!(!watch(vec![(w.clone(), 4, false)]).waited(), "nobody waits");
        w.store(3, Ordering::SeqCst);
        assert!(
            !watch(vec![(w.clone(), 4, false)]).waited(),
            "a wait below seq 4"
        );
        w.store(4, Ordering::SeqCst);
        assert!(watch(vec![(w.clone(), 4, false)]).waited());
        let other = Arc::new(AtomicU64::new(0));
        assert!(
            watch(vec![(other.clone(), 1, true)]).waited(),
            "its last one was waited"
        );
        assert!(
            watch(vec![(other.clone(), 1, false), (w, 4, false)]).waited(),
            "any queue"
        );
        let mut told = watch(vec![(other, 1, false)]);
        assert!(!told.waited());
        told.notified = true;
        assert!(told.waited(), "the peer waits for a notification");
    }

    /// The proxy remembers whether a queue's last request was waited for before it finished
    /// (its caller waits on each: the next fence is looked for without naps), and forgets it
    /// when one finishes unwaited (a burst).
    #[test]
    fn a_queue_is_eager_after_a_waited_request_and_not_after_an_unwaited_one() {
        let p = Proxy::new(Fake::default());
        let rel = p.core.backend.release.clone();
        let eager = |p: &Proxy<Fake>| p.core.lock().queues.values().any(|q| q.eager);
        let (f1, t1) = armed_behind_a_fence(&p, 1);
        // Waited for while its fence is open.
        assert!(t1.wait(Duration::ZERO).is_err());
        f1.0.store(true, Ordering::Release);
        finish(&rel, 1, true);
        t1.wait(Duration::from_secs(10)).unwrap();
        assert!(eager(&p), "the last request was waited for");
        let (f2, t2) = armed_behind_a_fence(&p, 2);
        f2.0.store(true, Ordering::Release);
        finish(&rel, 2, true);
        until("finished unwaited", || t2.is_complete());
        assert!(!eager(&p), "the last request finished with nobody waiting");
        t2.wait(Duration::from_secs(10)).unwrap();
        p.closed();
    }

    #[test]
    fn a_fence_done_earlier_on_its_stream_fires_whatever_the_seqs_order() {
        // Two threads on one stream can take seqs in the other order than their places: seq 1
        // sits later on the stream than seq 2. Seq 2's fence is done, seq 1's is not.
        let p = Proxy::new(Fake::default());
        let rel = p.core.backend.release.clone();
        let late = FakeFence(Arc::default(), Some((7, 20)));
        let early = FakeFence(Arc::default(), Some((7, 10)));
        early.0.store(true, Ordering::Release);
        {
            let mut by = p.core.backend.by_fence.lock().unwrap();
            by.insert(1, late.clone());
            by.insert(2, early.clone());
        }
        let t1 = p.arm(Trigger::Host, 1, Duration::from_secs(30)).unwrap();
        let t2 = p.arm(Trigger::Host, 2, Duration::from_secs(30)).unwrap();
        assert_eq!((t1.seq(), t2.seq()), (1, 2));
        until("the earlier place started", || {
            p.core.backend.started.lock().unwrap().contains(&2)
        });
        finish(&rel, 2, true);
        t2.wait(Duration::from_secs(10)).unwrap();
        assert!(
            !p.core.backend.started.lock().unwrap().contains(&1),
            "its fence is open"
        );
        late.0.store(true, Ordering::Release);
        until("the later place started", || {
            p.core.backend.started.lock().unwrap().contains(&1)
        });
        finish(&rel, 1, true);
        t1.wait(Duration::from_secs(10)).unwrap();
        assert_eq!(t1.completion_value(), 2);
        p.closed();
    }

    #[test]
    fn work_is_made_with_its_seq_taken_and_a_refused_make_counts_as_nothing() {
        let p = Proxy::new(Fake::default());
        let rel = p.core.backend.release.clone();
        let e = p
            .arm_with(
                Trigger::Host,
                |mark| {
                    assert!(mark.is_none(), "a host trigger has no mark");
                    Err(Error::invalid("make", 1, "refused on purpose").into())
                },
                Duration::from_secs(30),
                Instant::now(),
            )
            .unwrap_err();
        assert!(e.to_string().contains("refused on purpose"), "{e}");
        let t = p.arm(Trigger::Host, 5, Duration::from_secs(30)).unwrap();
        assert_eq!(t.seq(), 2, "the refused request took seq 1");
        t.trigger().unwrap();
        until("started", || {
            !p.core.backend.started.lock().unwrap().is_empty()
        });
        finish(&rel, 5, true);
        t.wait(Duration::from_secs(10)).unwrap();
        assert_eq!(t.completion_value(), 2, "seq 1 counted as nothing to do");
        p.closed();
    }

    #[test]
    fn a_close_while_work_is_made_ends_the_request_and_buries_the_work() {
        let p = Proxy::new(Fake::default());
        let core = p.core.clone();
        let t = p
            .arm_with(
                Trigger::Host,
                |_| {
                    core.close();
                    Ok((3, false))
                },
                Duration::from_secs(30),
                Instant::now(),
            )
            .unwrap();
        let e = t.wait(Duration::from_secs(10)).unwrap_err();
        assert!(e.to_string().contains("closed"), "{e}");
        assert_eq!(p.pending(), 0);
        assert!(
            p.core.backend.started.lock().unwrap().is_empty(),
            "never started"
        );
        let buried = p.core.lock().graveyard.len() + p.core.front().graveyard.len();
        assert_eq!(buried, 3, "the entry's, the retired queue and the work");
        p.closed();
    }

    #[test]
    fn a_soft_ring_wakes_a_deep_sleep_and_is_kept_for_a_nap() {
        let bell = Arc::new(Bell::default());
        // Rung before: the sleep returns at once, the ring taken.
        bell.ring_if(DEEP);
        assert!(bell.sleep(None, DEEP));
        assert!(!bell.take());
        // A deep sleep is woken by a soft ring.
        let b = bell.clone();
        let sleeper = std::thread::spawn(move || b.sleep(None, DEEP));
        until("asleep", || bell.sleeping.load(Ordering::SeqCst) == DEEP);
        bell.ring_if(DEEP);
        assert!(sleeper.join().unwrap());
        // A nap is not woken by a soft ring, which is still there when it ends.
        let b = bell.clone();
        let napper = std::thread::spawn(move || {
            let t = Instant::now();
            let rung = b.sleep(Some(Duration::from_millis(300)), NAP);
            (rung, t.elapsed())
        });
        until("napping", || bell.sleeping.load(Ordering::SeqCst) == NAP);
        bell.ring_if(DEEP);
        let (rung, slept) = napper.join().unwrap();
        assert!(rung && slept >= Duration::from_millis(250), "{slept:?}");
        // A full ring wakes a nap.
        let b = bell.clone();
        let napper = std::thread::spawn(move || b.sleep(Some(Duration::from_secs(30)), NAP));
        until("napping again", || {
            bell.sleeping.load(Ordering::SeqCst) == NAP
        });
        bell.ring();
        assert!(napper.join().unwrap());
    }

    #[test]
    fn a_nudge_wakes_only_a_nap_and_at_most_once_every_few_microseconds() {
        // The first nudge of a bell rings (whenever the process's clock started).
        let first = Bell::default();
        first.sleeping.store(NAP, Ordering::SeqCst);
        first.nudge();
        assert!(first.take(), "a bell's first nudge was dropped");
        let bell = Arc::new(Bell::default());
        // Awake: nothing is rung (the proxy looks by itself).
        bell.nudge();
        assert!(!bell.take(), "a nudge rang an awake proxy");
        // A deep sleep (nothing armed) is not woken.
        let b = bell.clone();
        let sleeper = std::thread::spawn(move || b.sleep(Some(Duration::from_millis(200)), DEEP));
        until("asleep", || bell.sleeping.load(Ordering::SeqCst) == DEEP);
        for _ in 0..1000 {
            bell.nudge();
        }
        assert!(!sleeper.join().unwrap(), "a nudge woke a deep sleep");
        // A nap is woken.
        let b = bell.clone();
        let napper = std::thread::spawn(move || b.sleep(Some(Duration::from_secs(30)), NAP));
        until("napping", || bell.sleeping.load(Ordering::SeqCst) == NAP);
        let t = Instant::now();
        while !napper.is_finished() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "a nudge did not wake a nap"
            );
            bell.nudge();
            std::thread::yield_now();
        }
        assert!(napper.join().unwrap());
        // Two nudges of one instant ring once: the second, within NUDGE_EVERY, leaves the
        // stamp alone.
        bell.sleeping.store(NAP, Ordering::SeqCst);
        bell.nudged.store(nudge_clock(), Ordering::Relaxed);
        let stamp = bell.nudged.load(Ordering::Relaxed);
        bell.rung.store(false, Ordering::SeqCst);
        bell.nudge();
        assert!(
            bell.nudged.load(Ordering::Relaxed) == stamp && !bell.take(),
            "a nudge within {NUDGE_EVERY:?} of the last rang again"
        );
        std::thread::sleep(NUDGE_EVERY * 2);
        bell.nudge();
        assert!(bell.take(), "a nudge after {NUDGE_EVERY:?} did not ring");
        bell.sleeping.store(AWAKE, Ordering::SeqCst);
    }

    #[test]
    fn a_trigger_fence_completes_once_its_slot_holds_its_seq_or_later() {
        let queue = Arc::new(Queue::new(
            1,
            Box::new(HostWords::new(1 + TRIGGER_SLOTS)),
            Arc::new(Bell::default()),
        ));
        let seq = TRIGGER_SLOTS as u64 + 3;
        let mark = Mark { queue: &queue, seq };
        let (a, b) = (mark.fence(), mark.fence());
        assert!(!a.is_complete());
        queue.words.store(mark.slot(), seq - TRIGGER_SLOTS as u64);
        assert!(!a.is_complete(), "the slot's earlier seq");
        queue.words.store(mark.slot(), seq);
        assert!(a.is_complete());
        queue.words.store(mark.slot(), seq + TRIGGER_SLOTS as u64);
        assert!(b.is_complete(), "the slot's later seq");
    }

    /// A host request fired again after it finished leaves its slot alone once a later
    /// request of the slot stored its seq there: that request's trigger (and the fence of an
    /// intra-node request's copies) stays seen.
    #[test]
    fn a_second_fire_never_lowers_a_later_requests_trigger() {
        let p = Proxy::new(Fake::default());
        let rel = p.core.backend.release.clone();
        let t = p.arm(Trigger::Host, 1, Duration::from_secs(30)).unwrap();
        t.trigger().unwrap();
        finish(&rel, 1, true);
        t.wait(Duration::from_secs(10)).unwrap();
        // The stream of request `seq + TRIGGER_SLOTS` reached its trigger in the same slot.
        let later = t.seq() + TRIGGER_SLOTS as u64;
        let mark = Mark {
            queue: &t.queue,
            seq: later,
        };
        t.queue.words.store(mark.slot(), later);
        let fence = mark.fence();
        t.trigger().unwrap();
        assert_eq!(t.queue.words.load(mark.slot()), later);
        assert!(fence.is_complete(), "the later trigger stays seen");
        p.closed();
    }

    #[test]
    fn a_finished_requests_waker_runs_with_the_proxy_unlocked() {
        use crate::completion::testing::WokenFree;
        let p = Proxy::new(Fake::default());
        let rel = p.core.backend.release.clone();
        let core = p.core.clone();
        // A waker that calls back into the proxy inline takes its lock.
        let probe = WokenFree::new(move || core.state.try_lock().is_ok());
        let t = p.arm(Trigger::Host, 9, Duration::from_secs(30)).unwrap();
        assert!(t.outcome().flag.register_waker(&Waker::from(probe.clone())));
        t.trigger().unwrap();
        finish(&rel, 9, true);
        until("woken", || probe.count() > 0 || t.is_complete());
        until("woken with the proxy unlocked", || probe.count() == 1);
        assert_eq!(t.wait(Duration::from_secs(10)).unwrap().bytes, 8);
        p.closed();
    }

    #[test]
    fn out_of_order_triggers_and_finishes_publish_in_order() {
        let p = Proxy::new(Fake::default());
        let rel = p.core.backend.release.clone();
        let ts: Vec<StreamTransfer> = (0..200u64)
            .map(|i| p.arm(Trigger::Host, i, Duration::from_secs(30)).unwrap())
            .collect();
        for t in ts.iter().rev() {
            t.trigger().unwrap();
        }
        until("all started", || {
            p.core.backend.started.lock().unwrap().len() == 200
        });
        for i in (0..200u64).rev() {
            finish(&rel, i, true);
            if i > 0 {
                std::thread::sleep(Duration::from_micros(50));
                assert_eq!(ts[0].completion_value(), 0, "published before request 1");
            }
        }
        until("all released", || ts[0].completion_value() == 200);
        for t in &ts {
            assert!(t.wait(Duration::from_secs(10)).is_ok());
        }
        p.closed();
    }

    #[test]
    fn a_failure_releases_every_wait_with_the_bit_and_fails_the_armed() {
        let p = Proxy::new(Fake::default());
        let rel = p.core.backend.release.clone();
        let a = p.arm(Trigger::Host, 1, Duration::from_secs(30)).unwrap();
        let b = p.arm(Trigger::Host, 2, Duration::from_secs(30)).unwrap();
        let c = p.arm(Trigger::Host, 3, Duration::from_secs(30)).unwrap();
        a.trigger().unwrap();
        until("a started", || {
            !p.core.backend.started.lock().unwrap().is_empty()
        });
        finish(&rel, 1, false);
        assert!(a.wait(Duration::from_secs(10)).is_err());
        for t in [&a, &b, &c] {
            assert!(t.is_released());
            assert_eq!(t.completion_value(), STREAM_ERROR_BIT);
        }
        // Never triggered: failed with the queue, never started.
        assert!(matches!(
            b.wait(Duration::from_secs(10)),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(c.wait(Duration::from_secs(10)).is_err());
        assert_eq!(p.core.backend.started.lock().unwrap().len(), 1);
        // The next request gets a fresh queue.
        let d = p.arm(Trigger::Host, 4, Duration::from_secs(30)).unwrap();
        assert_eq!((d.seq(), d.completion_value()), (1, 0));
        d.trigger().unwrap();
        until("d started", || {
            p.core.backend.started.lock().unwrap().len() == 2
        });
        finish(&rel, 4, true);
        assert!(d.wait(Duration::from_secs(10)).is_ok());
        assert_eq!(d.completion_value(), 1);
        p.closed();
    }

    #[test]
    fn a_trigger_that_never_fires_is_released_at_its_deadline() {
        let p = Proxy::new(Fake::default());
        let t = p.arm(Trigger::Host, 1, Duration::from_millis(50)).unwrap();
        let e = t.wait(Duration::from_secs(10)).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert_eq!(t.completion_value(), STREAM_ERROR_BIT);
        assert!(p.core.backend.started.lock().unwrap().is_empty());
        p.closed();
    }

    #[test]
    fn closing_with_triggers_never_fired_releases_their_words() {
        let p = Proxy::new(Fake::default());
        let rel = p.core.backend.release.clone();
        let running = p.arm(Trigger::Host, 1, Duration::from_secs(30)).unwrap();
        let armed: Vec<StreamTransfer> = (2..10u64)
            .map(|i| p.arm(Trigger::Host, i, Duration::from_secs(30)).unwrap())
            .collect();
        running.trigger().unwrap();
        until("started", || {
            !p.core.backend.started.lock().unwrap().is_empty()
        });
        p.closing();
        for t in &armed {
            assert!(t.is_released(), "released at the close");
            assert_ne!(t.completion_value() & STREAM_ERROR_BIT, 0);
            assert!(t.wait(Duration::from_secs(10)).is_err());
        }
        // The running one finishes as its backend ends it, then the thread stops.
        finish(&rel, 1, false);
        p.closed();
        assert_eq!(p.pending(), 0);
        assert!(running.is_complete());
        // A closed proxy takes nothing more.
        assert!(p.arm(Trigger::Host, 20, Duration::from_secs(1)).is_err());
    }

    #[test]
    fn a_forgotten_transfer_keeps_the_words() {
        let p = Proxy::new(Fake::default());
        let t = p.arm(Trigger::Host, 1, Duration::from_secs(30)).unwrap();
        let words = Arc::downgrade(&t.queue);
        std::mem::forget(t);
        p.closing();
        p.closed();
        drop(p);
        assert!(
            words.upgrade().is_some(),
            "leaked with the transfer, never freed"
        );
    }

    /// A backend whose requests finish as soon as they start.
    struct AtOnce;

    struct Over(Option<TransferReport>);

    impl Running for Over {
        fn poll(&mut self, _: &Waker) -> Option<(Result<TransferReport>, Keep)> {
            self.0.take().map(|r| (Ok(r), Box::new(()) as Keep))
        }
    }

    impl Backend for AtOnce {
        type Work = u64;
        type Fired = StreamFence;
        fn start(&self, _: &u64) -> Result<Box<dyn Running>> {
            Ok(Box::new(Over(Some(report()))))
        }
    }

    #[test]
    fn threads_arming_at_once_each_finish_once_and_the_word_counts_them_all() {
        let p = Arc::new(Proxy::new(AtOnce));
        let (threads, each) = (4u64, 400u64);
        let seqs: Vec<Vec<u64>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|t| {
                    let p = p.clone();
                    s.spawn(move || {
                        let (mut seqs, mut held) = (Vec::new(), None::<StreamTransfer>);
                        let end = |x: StreamTransfer| {
                            x.trigger().unwrap();
                            assert_eq!(x.wait(Duration::from_secs(10)).unwrap().bytes, 8);
                            assert!(x.wait(Duration::ZERO).is_err(), "taken once");
                        };
                        for i in 0..each {
                            let x = p
                                .arm(Trigger::Host, t * each + i, Duration::from_secs(30))
                                .unwrap();
                            seqs.push(x.seq());
                            // Every other one fired only after the next is armed.
                            if let Some(h) = held.take() {
                                end(h);
                            }
                            if i % 2 == 0 {
                                end(x);
                            } else {
                                held = Some(x);
                            }
                        }
                        held.map(end);
                        seqs
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut all: Vec<u64> = seqs.concat();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len() as u64, threads * each, "every seq taken once");
        assert_eq!(all, (1..=threads * each).collect::<Vec<_>>());
        until("every request finished", || p.pending() == 0);
        let last = p.arm(Trigger::Host, 0, Duration::from_secs(30)).unwrap();
        last.trigger().unwrap();
        last.wait(Duration::from_secs(10)).unwrap();
        assert_eq!(
            last.completion_value(),
            threads * each + 1,
            "the word counts them all"
        );
        p.closed();
    }

    #[test]
    fn the_ring_bounds_armed_requests() {
        let p = Proxy::new(Fake::default());
        let ts: Vec<StreamTransfer> = (0..TRIGGER_SLOTS as u64)
            .map(|i| p.arm(Trigger::Host, i, Duration::from_secs(30)).unwrap())
            .collect();
        let e = p
            .arm(Trigger::Host, 99_999, Duration::from_secs(30))
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        // The first fires: its slot becomes free.
        ts[0].trigger().unwrap();
        until("fired", || {
            !p.core.backend.started.lock().unwrap().is_empty()
        });
        assert!(
            p.arm(Trigger::Host, 99_999, Duration::from_secs(30))
                .is_ok()
        );
        p.closing();
        p.closed();
    }

    /// The stream half on a GPU, with the fake backend (no NIC needed): a stream's trigger
    /// write starts the request only when the stream gets there, another stream's wait is
    /// released by the word (also on failure, with the bit), and a capturing stream is refused
    /// with nothing enqueued.
    #[test]
    fn streams_fire_the_proxy_and_wait_on_its_word_on_a_gpu() {
        let Ok(ctx) = crate::cuda::context(0) else {
            crate::testing::skip(crate::testing::Hardware::Gpu, "no CUDA device");
            return;
        };
        let (s1, s2) = (Stream::new(&ctx).unwrap(), Stream::new(&ctx).unwrap());
        // Slot 0: a gate s1 waits on; slots 1, 2: markers s2 writes after its waits.
        let gate = Arc::new(MemopFlags::pinned_host(&ctx, 3).unwrap());
        if !gate.supports_64_bit() {
            crate::testing::skip(crate::testing::Hardware::Gpu, "no 64-bit stream memops");
            return;
        }
        let p = Proxy::new(Fake::default());
        let rel = p.core.backend.release.clone();
        s1.wait_value64(&gate, 0, 1, WaitCondition::Geq).unwrap();
        let t = p
            .arm(Trigger::Stream(&s1), 5, Duration::from_secs(30))
            .unwrap();
        assert!(t.trigger().is_err(), "the stream fires it");
        let (addr, seq) = t.completion_word().unwrap();
        assert_eq!(
            (addr, seq),
            (t.queue.words.flags().unwrap().device_ptr(DONE).unwrap(), 1)
        );
        t.wait_on(&s2).unwrap();
        s2.write_value64(&gate, 1, 77).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            p.core.backend.started.lock().unwrap().is_empty(),
            "started before the stream got there"
        );
        gate.store_u64(0, 1).unwrap();
        until("fired by the stream", || {
            !p.core.backend.started.lock().unwrap().is_empty()
        });
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            gate.load_u64(1).unwrap(),
            0,
            "s2 passed before the request finished"
        );
        finish(&rel, 5, true);
        until("s2 released by the word", || {
            gate.load_u64(1).unwrap() == 77
        });
        assert!(t.wait(Duration::from_secs(10)).is_ok());

        // A failure releases s2 too, with the bit.
        let f = p
            .arm(Trigger::Stream(&s1), 6, Duration::from_secs(30))
            .unwrap();
        f.wait_on(&s2).unwrap();
        s2.write_value64(&gate, 2, 88).unwrap();
        until("fired", || {
            p.core.backend.started.lock().unwrap().len() == 2
        });
        finish(&rel, 6, false);
        until("s2 released by the error bit", || {
            gate.load_u64(2).unwrap() == 88
        });
        assert_eq!(f.completion_value(), 1 | STREAM_ERROR_BIT);

        // Under capture: refused, nothing enqueued, no request left armed.
        let s3 = Stream::new(&ctx).unwrap();
        let before = p.pending();
        s3.cuda()
            .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .unwrap();
        let e = p
            .arm(Trigger::Stream(&s3), 9, Duration::from_secs(30))
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::StreamCapturing {
                    enqueued: false,
                    ..
                }
            ),
            "{e}"
        );
        let e = t.wait_on(&s3).unwrap_err();
        assert!(
            matches!(
                e,
                Error::StreamCapturing {
                    enqueued: false,
                    ..
                }
            ),
            "{e}"
        );
        let graph = s3
            .cuda()
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .expect("the refusals did not invalidate the capture");
        drop(graph);
        assert_eq!(p.pending(), before);
        s1.synchronize().unwrap();
        s2.synchronize().unwrap();
        p.closed();
    }

    #[test]
    fn awaited_stream_transfers_are_woken_by_the_proxy() {
        use std::future::IntoFuture;
        use std::task::{Context, Poll};
        struct Unpark(std::thread::Thread);
        impl Wake for Unpark {
            fn wake(self: Arc<Self>) {
                self.0.unpark();
            }
        }
        let p = Proxy::new(Fake::default());
        let rel = p.core.backend.release.clone();
        let t = p.arm(Trigger::Host, 1, Duration::from_secs(30)).unwrap();
        t.trigger().unwrap();
        let mut f = t.into_future();
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut cx = Context::from_waker(&waker);
        assert!(f.as_mut().poll(&mut cx).is_pending());
        until("started", || {
            !p.core.backend.started.lock().unwrap().is_empty()
        });
        finish(&rel, 1, true);
        let r = loop {
            match f.as_mut().poll(&mut cx) {
                Poll::Ready(r) => break r,
                Poll::Pending => std::thread::park_timeout(Duration::from_secs(5)),
            }
        };
        assert_eq!(r.unwrap().bytes, 8);
        p.closed();
    }

    fn set_hook(at: &'static str, f: impl FnOnce() + 'static) {
        HOOKS.with(|h| h.borrow_mut().insert(at, Box::new(f)));
    }

    /// A slow path's window check counts the seqs the fast path took after its drain (they
    /// are drained before it looks): no new seq shares a trigger slot with an unfired one.
    #[test]
    fn a_slow_reservation_sees_the_seqs_taken_while_it_drained() {
        let p = Arc::new(Proxy::new(Fake::default()));
        let rel = p.core.backend.release.clone();
        let n = TRIGGER_SLOTS as u64;
        let first: Vec<StreamTransfer> = (1..=n)
            .map(|i| p.arm(Trigger::Host, i, Duration::from_secs(30)).unwrap())
            .collect();
        let queue = first[0].queue.clone();
        assert_eq!(queue.low.0.load(Ordering::Acquire), 1, "the window is full");
        // This caller's fast check failed on low 1; before it takes the state, every trigger
        // fires and the proxy publishes low = n + 1.
        let q = queue.clone();
        set_hook("slow_entry", move || {
            for s in 1..=n {
                q.words.store(trigger_slot(s), s);
            }
            until("low published", || q.low.0.load(Ordering::Acquire) == n + 1);
        });
        // Preempted after its drain, before the front lock: another thread arms n requests on
        // the fast path (seqs n+1 ..= 2n, each within the window of low n + 1).
        let gap: Arc<Mutex<Vec<StreamTransfer>>> = Default::default();
        let (p2, g2) = (p.clone(), gap.clone());
        set_hook("slow_gap", move || {
            let ts = std::thread::spawn(move || {
                (0..n)
                    .map(|i| {
                        p2.arm(Trigger::Host, 100_000 + i, Duration::from_secs(30))
                            .unwrap()
                    })
                    .collect::<Vec<_>>()
            })
            .join()
            .unwrap();
            *g2.lock().unwrap() = ts;
        });
        let r = p.arm(Trigger::Host, 999_999, Duration::from_secs(30));
        let gap = std::mem::take(&mut *gap.lock().unwrap());
        assert_eq!(gap.len(), n as usize);
        let clash = r.as_ref().ok().map(|t| (t.seq(), gap[0].seq()));
        drop(r);
        for i in 1..=n {
            finish(&rel, i, true);
        }
        p.closing();
        p.closed();
        drop(first);
        assert_eq!(
            clash, None,
            "(new seq, live unfired seq): both armed on one trigger slot"
        );
    }

    /// Many threads arming (some refused makes, some failures), triggering, finishing and
    /// waiting, with a close racing them: nothing hangs, every result is taken once, a
    /// finished request's word releases it, and no two unfired seqs share a slot.
    #[test]
    fn threads_arming_and_failing_with_a_racing_close_end_each_request_once() {
        use std::sync::atomic::AtomicU64;
        let (batch_max, close_ms, batches) = (40u64, 50u64, 400u64);
        for round in 0..4u64 {
            let p = Arc::new(Proxy::new(Fake::default()));
            let stop = Arc::new(AtomicBool::new(false));
            let violations = Arc::new(AtomicU64::new(0));
            let checker = {
                let (p, stop, v) = (p.clone(), stop.clone(), violations.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        {
                            let st = p.core.lock();
                            for q in st.queues.values() {
                                if let (Some(a), Some(b)) = (q.unfired.first(), q.unfired.last())
                                    && b - a >= TRIGGER_SLOTS as u64
                                {
                                    v.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                        std::thread::yield_now();
                    }
                })
            };
            let workers: Vec<_> = (0..6u64)
                .map(|w| {
                    let p = p.clone();
                    std::thread::spawn(move || {
                        let rel = p.core.backend.release.clone();
                        let mut rng = w * 7919 + round * 104_729 + 1;
                        let mut next = || {
                            rng ^= rng << 13;
                            rng ^= rng >> 7;
                            rng ^= rng << 17;
                            rng
                        };
                        let (mut ok, mut err) = (0u64, 0u64);
                        let mut kept = Vec::new();
                        'outer: for b in 0..batches {
                            let mut batch = Vec::new();
                            for i in 0..(1 + next() % batch_max) {
                                let id = (w << 40) | (b << 20) | i;
                                let r = match next() % 200 {
                                    0 => p.arm_with(
                                        Trigger::Host,
                                        |_| Err(Error::invalid("make", id, "refused").into()),
                                        Duration::from_secs(30),
                                        Instant::now(),
                                    ),
                                    1 => p.arm_with(
                                        Trigger::Host,
                                        |_| {
                                            Err(Unmade {
                                                error: Error::invalid("make", id, "queued"),
                                                queued: true,
                                            })
                                        },
                                        Duration::from_secs(30),
                                        Instant::now(),
                                    ),
                                    _ => p.arm(Trigger::Host, id, Duration::from_secs(30)),
                                };
                                match r {
                                    Ok(t) => batch.push((id, t)),
                                    Err(e) if e.to_string().contains("closed") => break 'outer,
                                    Err(_) => {}
                                }
                            }
                            for (id, t) in &batch {
                                finish(&rel, *id, next() % 300 != 0);
                                t.trigger().unwrap();
                            }
                            for (_, t) in &batch {
                                match t.wait(Duration::from_secs(20)) {
                                    Ok(_) => ok += 1,
                                    Err(Error::Timeout { .. }) => {
                                        panic!("hung: seq {} word {:#x}", t.seq(), t.completion_value())
                                    }
                                    Err(e) => {
                                        err += 1;
                                        assert!(
                                            t.is_released(),
                                            "failed ({e}), but its word {:#x} does not release seq {}",
                                            t.completion_value(),
                                            t.seq()
                                        );
                                    }
                                }
                                assert!(t.wait(Duration::ZERO).is_err(), "taken twice");
                            }
                            kept.extend(batch.into_iter().map(|(_, t)| t));
                        }
                        (ok, err, kept)
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_millis(close_ms + 100 * round));
            p.closing();
            let mut total = (0, 0);
            let mut all = Vec::new();
            for w in workers {
                let (o, e, k) = w.join().unwrap();
                total = (total.0 + o, total.1 + e);
                all.extend(k);
            }
            for t in &all {
                assert!(
                    t.is_released(),
                    "every request ended, but the word {:#x} does not release seq {}",
                    t.completion_value(),
                    t.seq()
                );
            }
            stop.store(true, Ordering::Relaxed);
            checker.join().unwrap();
            p.closed();
            assert_eq!(p.pending(), 0);
            assert_eq!(
                violations.load(Ordering::Relaxed),
                0,
                "two unfired seqs on one slot"
            );
            assert!(total.0 > 0, "round {round}: some requests finished");
        }
    }

    /// What a request held, dropped where? (thread names)
    #[derive(Clone, Default)]
    struct Drops(Arc<Mutex<Vec<String>>>);
    struct Tracked(Drops);
    impl Drop for Tracked {
        fn drop(&mut self) {
            let name = std::thread::current().name().unwrap_or("?").to_string();
            self.0.0.lock().unwrap().push(name);
        }
    }
    /// None of what `d` lists was dropped on a proxy thread.
    fn none_dropped_on_the_proxy(d: &[String]) {
        assert!(
            !d.iter().any(|n| n == "gpudirect-stream-proxy"),
            "dropped on: {d:?}"
        );
    }

    struct Spy(Drops);
    struct SpyRun(#[allow(dead_code)] Tracked);
    impl Running for SpyRun {
        fn poll(&mut self, _: &Waker) -> Option<(Result<TransferReport>, Keep)> {
            None
        }
    }
    impl Backend for Spy {
        type Work = Tracked;
        type Fired = StreamFence;
        fn start(&self, _: &Tracked) -> Result<Box<dyn Running>> {
            Ok(Box::new(SpyRun(Tracked(self.0.clone()))))
        }
    }

    /// A running request the close's bound ends: its `Running` (for RDMA, the request still in
    /// flight, whose drop waits and frees) and its work are dropped by a caller's thread, not
    /// the proxy's.
    #[test]
    fn a_running_request_the_close_ends_is_dropped_off_the_proxy_thread() {
        let drops = Drops::default();
        let p = Proxy::new(Spy(drops.clone()));
        let t = p
            .arm(
                Trigger::Host,
                Tracked(drops.clone()),
                Duration::from_secs(30),
            )
            .unwrap();
        t.trigger().unwrap();
        until("started", || {
            p.pending() == 1 && {
                let st = p.core.lock();
                st.entries
                    .values()
                    .any(|e| matches!(e.stage, Stage::Running(..)))
            }
        });
        p.closing();
        assert!(t.wait(Duration::from_secs(15)).is_err());
        p.closed();
        let d = drops.0.lock().unwrap().clone();
        none_dropped_on_the_proxy(&d);
    }

    /// A host request the fast path takes while a stream request's slow path drains counts as
    /// outstanding: the stream request is refused and the host queue kept, and the host
    /// request finishes (a GPU: a stream request needs CUDA words).
    #[test]
    fn a_host_request_taken_while_a_stream_request_drains_counts_as_outstanding() {
        let Ok(ctx) = crate::cuda::context(0) else {
            crate::testing::skip(crate::testing::Hardware::Gpu, "no CUDA device");
            return;
        };
        let s = Stream::new(&ctx).unwrap();
        let p = Arc::new(Proxy::new(Fake::default()));
        let rel = p.core.backend.release.clone();
        let h1 = p.arm(Trigger::Host, 1, Duration::from_secs(30)).unwrap();
        h1.trigger().unwrap();
        finish(&rel, 1, true);
        h1.wait(Duration::from_secs(10)).unwrap();
        let got: Arc<Mutex<Option<StreamTransfer>>> = Default::default();
        let (p2, g2) = (p.clone(), got.clone());
        set_hook("slow_gap", move || {
            let t = std::thread::spawn(move || {
                p2.arm(Trigger::Host, 2, Duration::from_secs(30)).unwrap()
            })
            .join()
            .unwrap();
            *g2.lock().unwrap() = Some(t);
        });
        let r = p.arm(Trigger::Stream(&s), 3, Duration::from_secs(30));
        let h2 = got.lock().unwrap().take().unwrap();
        finish(&rel, 2, true);
        finish(&rel, 3, true);
        h2.trigger().unwrap();
        let h2r = h2.wait(Duration::from_secs(10));
        let word = h2.completion_value();
        s.synchronize().unwrap();
        drop(r.as_ref().map(|t| t.wait(Duration::from_secs(10))));
        p.closed();
        assert!(h2r.is_ok(), "{:?} (word {word:#x})", h2r.err());
        assert!(r.is_err(), "a host-triggered request was outstanding");
    }

    /// Work done at its fire (as intra-node queued copies): its report taken by `done_at_fire`.
    struct AtFire {
        started: AtomicU64,
        taken: AtomicU64,
        /// Work ids whose `done_at_fire` fails.
        fail: Mutex<Vec<u64>>,
        /// Run once at the next fire, on the proxy thread (as the last endpoint clone dropped
        /// there: `Rdma::done_at_fire`'s upgraded `ep`).
        on_fire: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    }
    struct AtFireWork(u64, Option<TransferReport>, #[allow(dead_code)] Tracked);
    impl Backend for AtFire {
        type Work = AtFireWork;
        type Fired = StreamFence;
        fn start(&self, _: &AtFireWork) -> Result<Box<dyn Running>> {
            self.started.fetch_add(1, Ordering::SeqCst);
            Err(closed_error())
        }
        fn done_at_fire(&self, w: &mut AtFireWork) -> Option<Result<TransferReport>> {
            self.taken.fetch_add(1, Ordering::SeqCst);
            let f = self.on_fire.lock().unwrap().take();
            if let Some(f) = f {
                f();
            }
            if self.fail.lock().unwrap().contains(&w.0) {
                return Some(Err(Error::invalid("notify", w.0, "failed on purpose")));
            }
            Some(
                w.1.take()
                    .ok_or_else(|| Error::invalid("report", w.0, "taken twice")),
            )
        }
    }

    fn at_fire() -> (Proxy<AtFire>, Drops) {
        let drops = Drops::default();
        let p = Proxy::new(AtFire {
            started: AtomicU64::new(0),
            taken: AtomicU64::new(0),
            fail: Mutex::new(vec![]),
            on_fire: Mutex::new(None),
        });
        (p, drops)
    }

    /// Work `id` armed on `p` for a host trigger, with `report` to be taken at its fire and its
    /// drop tracked in `drops`.
    fn arm_at_fire(
        p: &Proxy<AtFire>,
        drops: &Drops,
        id: u64,
        report: TransferReport,
    ) -> StreamTransfer {
        let work = AtFireWork(id, Some(report), Tracked(drops.clone()));
        p.arm(Trigger::Host, work, Duration::from_secs(30)).unwrap()
    }

    #[test]
    fn a_request_done_at_its_fire_finishes_once_and_drops_off_the_proxy_thread() {
        let (p, drops) = at_fire();
        let n = 200u64;
        let ts: Vec<_> = (1..=n)
            .map(|i| {
                let mut r = report();
                r.bytes = i;
                arm_at_fire(&p, &drops, i, r)
            })
            .collect();
        for t in ts.iter().rev() {
            t.trigger().unwrap();
        }
        for (i, t) in ts.iter().enumerate() {
            assert_eq!(t.wait(Duration::from_secs(10)).unwrap().bytes, i as u64 + 1);
            assert!(t.wait(Duration::ZERO).is_err(), "taken once");
        }
        assert_eq!(ts[0].completion_value(), n);
        assert_eq!(p.pending(), 0);
        assert_eq!(p.core.backend.started.load(Ordering::SeqCst), 0);
        assert_eq!(p.core.backend.taken.load(Ordering::SeqCst), n);
        p.closed();
        let d = drops.0.lock().unwrap().clone();
        assert_eq!(d.len() as u64, n);
        none_dropped_on_the_proxy(&d);
    }

    #[test]
    fn a_request_failed_at_its_fire_fails_its_queue_and_the_armed() {
        let (p, drops) = at_fire();
        p.core.backend.fail.lock().unwrap().push(1);
        let t1 = arm_at_fire(&p, &drops, 1, report());
        let t2 = arm_at_fire(&p, &drops, 2, report());
        // Both known to the proxy before the first fails (else the second's seq, drained after
        // its queue was let go, ends as "its stream queue ended").
        assert_eq!(p.pending(), 2);
        t1.trigger().unwrap();
        let e = t1.wait(Duration::from_secs(10)).unwrap_err();
        assert!(e.to_string().contains("on purpose"), "{e}");
        let e2 = t2.wait(Duration::from_secs(10)).unwrap_err();
        assert!(e2.to_string().contains("failed first"), "{e2}");
        assert!(t2.is_released());
        assert_ne!(t1.completion_value() & STREAM_ERROR_BIT, 0);
        // a new queue serves the next
        let t3 = arm_at_fire(&p, &drops, 3, report());
        assert_eq!(t3.seq(), 1);
        t3.trigger().unwrap();
        t3.wait(Duration::from_secs(10)).unwrap();
        assert_eq!(p.pending(), 0);
        p.closed();
        let d = drops.0.lock().unwrap().clone();
        assert_eq!(d.len(), 3);
        none_dropped_on_the_proxy(&d);
        assert_eq!(p.core.backend.started.load(Ordering::SeqCst), 0);
    }

    /// The endpoint's last clone dropped on the proxy thread (the `ep` that `done_at_fire` or
    /// `start` upgraded): `Handle::drop` runs `closing`/`closed` there, `closed` returns without
    /// joining or burying, and the core (its graveyards: finished work, retired queues) is
    /// dropped when the proxy thread ends, on that thread.
    #[test]
    fn an_endpoint_dropped_on_its_proxy_thread_drops_what_requests_held_elsewhere() {
        let (p, drops) = at_fire();
        let core = p.core.clone();
        let t1 = arm_at_fire(&p, &drops, 1, report());
        t1.trigger().unwrap();
        t1.wait(Duration::from_secs(10)).unwrap();
        let t2 = arm_at_fire(&p, &drops, 2, report());
        let queue = Arc::downgrade(&t2.queue);
        // The endpoint's last clone: handed to the proxy thread's fire, as an upgraded Weak.
        let cell: Arc<Mutex<Option<Proxy<AtFire>>>> = Arc::new(Mutex::new(Some(p)));
        let c2 = cell.clone();
        *core.backend.on_fire.lock().unwrap() = Some(Box::new(move || {
            let p = c2.lock().unwrap().take().unwrap();
            p.closing();
            p.closed();
            drop(p);
        }));
        drop(cell);
        drop(core); // as an endpoint: the proxy's only other holder is its thread
        t2.trigger().unwrap();
        let _ = t2.wait(Duration::from_secs(10));
        drop((t1, t2));
        until("the queue freed", || queue.upgrade().is_none());
        until("what the requests held dropped", || {
            drops.0.lock().unwrap().len() == 2
        });
        let d = drops.0.lock().unwrap().clone();
        none_dropped_on_the_proxy(&d);
    }

    /// A maker that panics after its seq was taken ends that seq: nothing stays reserved, and
    /// the next request is served and released (a new queue: the old one is not used again).
    #[test]
    fn a_maker_that_panics_ends_its_seq() {
        let p = Proxy::new(Fake::default());
        let rel = p.core.backend.release.clone();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            p.arm_with(
                Trigger::Host,
                |_| -> std::result::Result<(u64, bool), Unmade> { panic!("a maker that panics") },
                Duration::from_secs(30),
                Instant::now(),
            )
        }));
        assert!(r.is_err(), "the panic went through");
        assert_eq!(p.pending(), 0, "nothing stays reserved");
        let t = p.arm(Trigger::Host, 2, Duration::from_secs(30)).unwrap();
        t.trigger().unwrap();
        until("started", || {
            !p.core.backend.started.lock().unwrap().is_empty()
        });
        finish(&rel, 2, true);
        t.wait(Duration::from_secs(10)).unwrap();
        assert!(t.is_released(), "word {:#x}", t.completion_value());
        p.closed();
    }

    /// A queue's words whose drop waits, as freeing stream words waits for the streams that
    /// used them (which may wait for the proxy): until `until` holds a flag that is set, at most
    /// 5 s. They record where they were dropped, and whether the wait ended by the flag.
    struct WaitingWords {
        words: HostWords,
        until: Arc<Mutex<Option<CompletionFlag>>>,
        seen: Arc<Mutex<Option<(String, bool)>>>,
    }
    impl WordMemory for WaitingWords {
        fn load(&self, slot: usize) -> u64 {
            self.words.load(slot)
        }
        fn store(&self, slot: usize, value: u64) {
            self.words.store(slot, value)
        }
        fn raise(&self, slot: usize, value: u64) {
            self.words.raise(slot, value)
        }
        fn flags(&self) -> Option<&MemopFlags> {
            None
        }
    }
    impl Drop for WaitingWords {
        fn drop(&mut self) {
            let t = Instant::now();
            let released = loop {
                let f = self.until.lock().unwrap().clone();
                if f.is_some_and(|f| f.is_complete()) {
                    break true;
                }
                if t.elapsed() >= Duration::from_secs(5) {
                    break false;
                }
                std::thread::sleep(Duration::from_millis(1));
            };
            let name = std::thread::current().name().unwrap_or("?").to_string();
            *self.seen.lock().unwrap() = Some((name, released));
        }
    }

    /// A waker that drops what it holds when woken (a task that let go of a transfer once
    /// another one finished, run inline: a callback-style executor).
    struct DropsOnWake(Mutex<Option<StreamTransfer>>);
    impl Wake for DropsOnWake {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            let t = self.0.lock().unwrap().take();
            drop(t);
        }
    }

    /// Code a waker runs on the proxy thread lets go of the last handle of a retired queue and
    /// of a result never taken: the words and what the request held are dropped on another
    /// thread. Dropped on the proxy, the words' drop would wait for the proxy itself (here
    /// bounded: the next request's finish).
    #[test]
    fn what_a_wakers_code_lets_go_of_on_the_proxy_thread_is_dropped_elsewhere() {
        let p = Proxy::new(Fake::default());
        let rel = p.core.backend.release.clone();
        let until_flag: Arc<Mutex<Option<CompletionFlag>>> = Default::default();
        let seen: Arc<Mutex<Option<(String, bool)>>> = Default::default();
        let words = WaitingWords {
            words: HostWords::new(1 + TRIGGER_SLOTS),
            until: until_flag.clone(),
            seen: seen.clone(),
        };
        TEST_WORDS.with(|w| *w.borrow_mut() = Some(Box::new(words)));
        // Fails: its queue retires, and is let go by the next request's caller (the graveyard).
        let a = p.arm(Trigger::Host, 1, Duration::from_secs(30)).unwrap();
        a.trigger().unwrap();
        finish(&rel, 1, false);
        until("the first request failed", || a.is_complete());
        let b = p.arm(Trigger::Host, 2, Duration::from_secs(30)).unwrap();
        assert!(!Arc::ptr_eq(&a.queue, &b.queue), "a new queue");
        assert_eq!(
            (Arc::strong_count(&a.queue), Arc::strong_count(a.outcome())),
            (1, 1),
            "the first request holds the last handles of its queue and outcome"
        );
        let w = Arc::new(DropsOnWake(Mutex::new(Some(a))));
        assert!(b.outcome().flag.register_waker(&Waker::from(w.clone())));
        b.trigger().unwrap();
        finish(&rel, 2, true);
        until("the waker ran", || w.0.lock().unwrap().is_none());
        // The proxy goes on: the next request finishes (which the words' drop waits for).
        let c = p.arm(Trigger::Host, 3, Duration::from_secs(30)).unwrap();
        *until_flag.lock().unwrap() = Some(c.outcome().flag.clone());
        c.trigger().unwrap();
        finish(&rel, 3, true);
        let r = c.wait(Duration::from_secs(3));
        assert!(
            r.is_ok(),
            "the proxy hung: a queue's words let go of by a waker's code were dropped on the \
             proxy thread, waiting for it ({:?})",
            r.err()
        );
        until("the words dropped", || seen.lock().unwrap().is_some());
        let (at, released) = seen.lock().unwrap().clone().unwrap();
        assert_ne!(
            at, "gpudirect-stream-proxy",
            "the words were dropped on the proxy"
        );
        assert!(
            released,
            "the words' drop waited for nothing (dropped on {at})"
        );
        // The first request's keep (never taken) and the third's (taken here).
        until("the untaken keep dropped", || {
            p.core.backend.drops.0.lock().unwrap().len() == 2
        });
        none_dropped_on_the_proxy(&p.core.backend.drops.0.lock().unwrap());
        b.wait(Duration::from_secs(10)).unwrap();
        p.closed();
    }

    /// The notification counter's last handle let go on a thread that frees nothing (a
    /// waker's code on an endpoint's progress thread): its word is dropped on another thread.
    #[test]
    fn a_counter_let_go_on_a_thread_that_frees_nothing_drops_its_word_elsewhere() {
        let set = CompletionFlag::new();
        set.set();
        let seen: Arc<Mutex<Option<(String, bool)>>> = Default::default();
        let words = WaitingWords {
            words: HostWords::new(1),
            until: Arc::new(Mutex::new(Some(set))),
            seen: seen.clone(),
        };
        let counter = Arc::new(super::super::words::Counter::new(Box::new(words), 0));
        std::thread::Builder::new()
            .name("frees-nothing".into())
            .spawn(move || {
                frees_nothing();
                drop(counter);
            })
            .unwrap()
            .join()
            .unwrap();
        until("the word dropped", || seen.lock().unwrap().is_some());
        let at = seen.lock().unwrap().clone().unwrap().0;
        assert_eq!(at, "gpudirect-drop");
    }

    /// An awaited transfer whose waker polls it inline on the proxy thread: the future ends
    /// there, and what the request held is dropped on another thread.
    #[test]
    fn an_awaited_transfer_finished_on_the_proxy_thread_drops_its_keep_elsewhere() {
        use std::future::{Future, IntoFuture};
        use std::task::{Context, Poll};
        type Fut = std::pin::Pin<Box<dyn Future<Output = Result<TransferReport>> + Send>>;
        /// Polls the future when woken, on the waking thread.
        struct PollsOnWake {
            fut: Mutex<Option<Fut>>,
            out: Mutex<Option<(Result<TransferReport>, String)>>,
        }
        impl Wake for PollsOnWake {
            fn wake(self: Arc<Self>) {
                self.wake_by_ref();
            }
            fn wake_by_ref(self: &Arc<Self>) {
                let waker = Waker::from(self.clone());
                let mut g = self.fut.lock().unwrap();
                let Some(f) = g.as_mut() else {
                    return;
                };
                if let Poll::Ready(r) = f.as_mut().poll(&mut Context::from_waker(&waker)) {
                    let f = g.take();
                    drop(g);
                    drop(f);
                    let name = std::thread::current().name().unwrap_or("?").to_string();
                    *self.out.lock().unwrap() = Some((r, name));
                }
            }
        }
        let p = Proxy::new(Fake::default());
        let rel = p.core.backend.release.clone();
        let t = p.arm(Trigger::Host, 1, Duration::from_secs(30)).unwrap();
        t.trigger().unwrap();
        let w = Arc::new(PollsOnWake {
            fut: Mutex::new(Some(t.into_future())),
            out: Mutex::new(None),
        });
        // The first poll: pending, its waker registered.
        w.wake_by_ref();
        assert!(w.out.lock().unwrap().is_none(), "not released yet");
        finish(&rel, 1, true);
        until("the future ended", || w.out.lock().unwrap().is_some());
        let (r, on) = w.out.lock().unwrap().take().unwrap();
        assert_eq!(r.unwrap().bytes, 8);
        assert_eq!(
            on, "gpudirect-stream-proxy",
            "polled inline by the proxy's wake-up"
        );
        until("the keep dropped", || {
            p.core.backend.drops.0.lock().unwrap().len() == 1
        });
        none_dropped_on_the_proxy(&p.core.backend.drops.0.lock().unwrap());
        p.closed();
    }
}
