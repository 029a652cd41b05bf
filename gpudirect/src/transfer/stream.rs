//! Stream-ordered transfers: a CUDA stream starts a request when it reaches it and waits for
//! its completion word; the host takes part only through one proxy thread per endpoint, never
//! through a stream synchronize.
//!
//! # Words
//!
//! Each endpoint has a stream queue: 64-bit words that both the host and the GPU reach
//! (pinned host memory mapped for the device, [`MemopFlags::pinned_host`], when a stream is
//! involved; plain host memory for host-triggered requests on a node without CUDA). Word 0 is
//! the queue's completion word; the others are trigger words, one per armed request in a ring
//! of [`TRIGGER_SLOTS`].
//!
//! - [`Endpoint::write_on`] / [`Endpoint::read_on`] check the request (the same checks as
//!   [`Endpoint::write`], typed errors before anything is enqueued), give it the queue's next
//!   sequence number `seq`, arm it, and enqueue `cuStreamWriteValue64(trigger, seq)` on the
//!   stream through the crate's capture-checked path (a capturing stream is refused with
//!   [`Error::StreamCapturing`] and nothing is enqueued).
//! - The proxy thread sees the trigger word reach `seq`, posts the request through the
//!   engine ([`Endpoint::transfer`]: planned then, with the endpoint's rails at that moment), and
//!   when it finishes writes the completion word.
//! - [`StreamTransfer::wait_on`] enqueues `cuStreamWaitValue64(completion, seq, GEQ)`;
//!   [`StreamTransfer::completion_word`] gives the word's device address and `seq` for a kernel
//!   that polls it.
//!
//! # The completion word
//!
//! The completion word holds `done`: the highest sequence number such that every request of
//! the queue up to it finished successfully, so it only grows, and a wait for `seq` (GEQ) is
//! released exactly when `seq` and everything before it are done, whatever order the requests
//! finish in.
//!
//! **Failure never hangs a stream.** When a request fails (the endpoint broke, a deadline
//! passed, a bad completion, the trigger never came, the endpoint was dropped before the stream
//! reached the trigger), the proxy sets [`STREAM_ERROR_BIT`] (bit 62) in the word:
//! `done | STREAM_ERROR_BIT`, where `done` stops at the last request before the first failure.
//! The driver's GEQ is a cyclic comparison (`(int64_t)(*word - seq) >= 0`), so with bit 62 set
//! every wait on the queue, now or later, is released (bit 63 would not do: `seq | 1 << 63`
//! compares as negative and the stream would wait forever). A queue with the bit starts nothing
//! more: its armed requests fail at once, and the endpoint's next stream request gets a fresh
//! queue (new words). **Kernels and streams must check the bit**: after a wait for `seq`, the
//! request succeeded iff `word & STREAM_ERROR_BIT == 0`, or `word & !STREAM_ERROR_BIT >= seq`;
//! otherwise its data (and that of every later request of the queue) must not be used. The
//! host gets the typed error from [`StreamTransfer::wait`].
//!
//! # Ordering: what is visible to which stream when the word is set
//!
//! - `cuStreamWriteValue64` (without `NO_MEMORY_BARRIER`) writes the trigger after the
//!   stream's earlier work and makes that work's memory writes visible first: the NIC reads
//!   source bytes the stream produced before the trigger.
//! - RDMA write: the word is set once every message's completion was polled, that is once the
//!   peer's NIC acknowledged the last message. The local source may then be reused by any stream
//!   that waited on the word. The bytes being visible at the peer is what a notification says
//!   (the peer's [`notification counter`](Endpoint::notification_counter)), not this word.
//! - RDMA read into GPU memory: the engine flushes the NIC's writes to the GPU
//!   (`cuFlushGPUDirectRDMAWrites`, skipped where the device already orders them) before the
//!   request finishes, and the word is set after that: a stream that waited on the word reads
//!   the bytes. Into host memory: the completion orders the bytes before the word.
//! - The notification counter ([`Endpoint::notification_counter`]) is incremented by the
//!   receiver's progress thread after it flushed the GPUs whose memory peers may write, once per
//!   notification delivered: a stream that waited for `counter >= n` sees the bytes of the
//!   first `n` notified requests.
//!
//! # The proxy thread
//!
//! One per endpoint, started by the first stream request. While a request is armed it polls
//! the armed trigger words: a short run of yields, then sleeps that double from 1 µs to
//! [`PROXY_NAP`] (64 µs), so an armed request costs at most about 64 µs of latency and the
//! thread wakes about 15,000 times a second while the stream has not reached a trigger. With
//! nothing armed it sleeps on a condition variable: woken by a new request, by the completion
//! of a request it posted (a waker on the request's completion flag), or at the endpoint's close.
//!
//! # Deadlines
//!
//! A request's deadline ([`TransferOptions::deadline`], or the engine's) counts twice: the
//! stream must reach the trigger within it of the call (else the request fails with
//! [`Error::Timeout`] and its word is released with the error bit), and the transfer then has
//! its deadline again from the moment the trigger fired (the engine's bound: a deadline that
//! passes ends the endpoint). So every request ends within twice its deadline plus the NIC's
//! flush after a failure (2 s); [`StreamTransfer::wait`] and `.await` are bounded by that.
//!
//! # Lifetimes
//!
//! The words are owned by an `Arc` that the queue and every [`StreamTransfer`] share; the CUDA
//! words free themselves only once every stream that used them has passed its operations
//! (bounded wait, else leaked; never freed while a graph may hold an operation on them), and a
//! leaked `StreamTransfer` leaks them. Dropping the endpoint releases the words of
//! armed-but-unfired requests with the error bit before anything is freed.
//!
//! `cuMemFree` and `cuMemFreeHost` synchronize the device (seen on the H200), so a thread that
//! frees CUDA memory while a stream waits on a word only that thread sets never returns. The
//! proxy thread therefore frees nothing: what finished requests held (their memory regions, the
//! queue's words) is dropped by the endpoint's next stream request, by
//! [`StreamTransfer::wait`], or when the endpoint goes. Your own threads: do not free CUDA memory
//! on the thread that must make progress for a stream wait to pass.
//!
//! # A second backend
//!
//! The proxy is generic over what carries the data ([`Backend`]): the RDMA backend posts
//! through the engine. A backend whose data moves on the stream itself (a copy enqueued before
//! the trigger) plugs in the same way, with the proxy only sending what follows (a
//! notification).
//!
//! # Not tested on these machines
//!
//! The GPU half (stream write and wait, capture refusal) is tested on a GPU without a NIC, and
//! the proxy's RDMA half on Soft-RoCE with host-side triggers; a GPU and a NIC together
//! (streams starting RDMA requests, the flush before the word) are not.

use super::descriptor::RemoteRange;
use super::endpoint::{Companion, Endpoint, NoteSink, WeakEndpoint};
use super::pending::{Transfer, Transferred};
use super::plan::deadline_after;
use super::region::LocalRange;
use super::request::{Direction, TransferOptions, TransferReport};
use crate::completion::deferred::{Defers, Locked, Woken};
use crate::completion::{CompletionFlag, Fence, InFlight};
use crate::cuda::{MemopFlags, Stream, WaitCondition};
use crate::error::{Error, Result};
use cudarc::driver::CudaContext;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};

/// Bit 62 of a completion word or notification counter: a request of the queue failed (or the
/// endpoint failed, for the counter). Set, it releases every GEQ wait on the word (the driver
/// compares cyclically); kernels must check it. The other bits keep their meaning.
pub const STREAM_ERROR_BIT: u64 = 1 << 62;

/// Armed requests one stream queue holds at once (its trigger words).
pub const TRIGGER_SLOTS: usize = 4096;

/// The longest sleep of the proxy thread between looks at armed trigger words.
pub const PROXY_NAP: Duration = Duration::from_micros(64);

/// Rounds of the proxy's poll that only yield before it sleeps.
const SPIN_ROUNDS: u32 = 32;

/// The completion word's slot.
const DONE: usize = 0;

/// Sequence numbers stay below the error bit.
const MAX_SEQ: u64 = STREAM_ERROR_BIT - 1;

/// The slack a host wait gives past a request's bound (the NIC's flush after a failure and the
/// proxy's pace).
const HOST_SLACK: Duration = Duration::from_secs(7);

/// How long a closing proxy waits for requests already posted before it releases their words
/// anyway (the engine ends them within its own flush bound first).
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// The trigger slot of `seq`.
fn trigger_slot(seq: u64) -> usize {
    1 + (seq % TRIGGER_SLOTS as u64) as usize
}

/// The pause after `idle` rounds without progress: `None` to yield, else a sleep doubling from
/// 1 µs up to [`PROXY_NAP`].
pub(crate) fn proxy_pause(idle: u32) -> Option<Duration> {
    if idle < SPIN_ROUNDS {
        return None;
    }
    let shift = (idle - SPIN_ROUNDS).min(16);
    Some(Duration::from_micros(1u64 << shift).min(PROXY_NAP))
}

/// The completion word of a queue as requests finish, in any order (a pure function of the
/// finishes so far).
#[derive(Debug, Default, Clone)]
pub(crate) struct Window {
    /// Every request up to this one finished successfully.
    ok: u64,
    /// The first request that failed.
    failed: Option<u64>,
    /// Successes past `ok` (waiting for a gap to close).
    ahead: BTreeSet<u64>,
}

impl Window {
    /// Request `seq` (from 1) finished; the word to publish.
    pub(crate) fn finish(&mut self, seq: u64, ok: bool) -> u64 {
        if ok {
            if seq > self.ok {
                self.ahead.insert(seq);
            }
            while self.ahead.remove(&(self.ok + 1)) {
                self.ok += 1;
            }
        } else {
            self.failed = Some(self.failed.map_or(seq, |f| f.min(seq)));
        }
        self.word()
    }

    /// The word: `ok`, with [`STREAM_ERROR_BIT`] once a request failed.
    pub(crate) fn word(&self) -> u64 {
        self.ok
            | if self.failed.is_some() {
                STREAM_ERROR_BIT
            } else {
                0
            }
    }

    /// The first failed request.
    pub(crate) fn failed(&self) -> Option<u64> {
        self.failed
    }
}

/// Whether the driver's `cuStreamWaitValue64(GEQ, value)` lets a stream pass `word`: the
/// cyclic comparison `(int64_t)(word - value) >= 0`.
pub(crate) fn geq_releases(word: u64, value: u64) -> bool {
    (word.wrapping_sub(value) as i64) >= 0
}

/// Where a queue's words live: the host reaches them atomically; with CUDA a stream reaches
/// them too.
pub(crate) trait WordMemory: Send + Sync + 'static {
    /// Word `slot` (Acquire).
    fn load(&self, slot: usize) -> u64;
    /// Set word `slot` (Release).
    fn store(&self, slot: usize, value: u64);
    /// The CUDA words, when a stream can reach them.
    fn flags(&self) -> Option<&MemopFlags>;
}

/// Words in plain host memory: host-triggered requests without CUDA.
pub(crate) struct HostWords(Box<[AtomicU64]>);

impl HostWords {
    pub(crate) fn new(slots: usize) -> Self {
        HostWords((0..slots).map(|_| AtomicU64::new(0)).collect())
    }
}

impl WordMemory for HostWords {
    fn load(&self, slot: usize) -> u64 {
        self.0[slot].load(Ordering::Acquire)
    }
    fn store(&self, slot: usize, value: u64) {
        self.0[slot].store(value, Ordering::Release)
    }
    fn flags(&self) -> Option<&MemopFlags> {
        None
    }
}

/// Pinned host words mapped for the device (only built by [`MemopFlags::pinned_host`] here,
/// whose loads and stores are host atomics that cannot fail for a slot in range; every slot
/// used is below the count allocated).
impl WordMemory for MemopFlags {
    fn load(&self, slot: usize) -> u64 {
        self.load_u64(slot).unwrap_or(0)
    }
    fn store(&self, slot: usize, value: u64) {
        let _ = self.store_u64(slot, value);
    }
    fn flags(&self) -> Option<&MemopFlags> {
        Some(self)
    }
}

/// One queue's words.
pub(crate) struct Queue {
    id: u64,
    words: Box<dyn WordMemory>,
}

/// A request's result as the proxy leaves it, with what it held (dropped by whoever takes the
/// result, never by the proxy thread).
struct Outcome {
    flag: CompletionFlag,
    slot: Mutex<Option<(Result<TransferReport>, Option<Keep>)>>,
}

/// What a finished request still holds (its memory regions): dropped off the proxy thread.
type Keep = Box<dyn Send>;

impl Outcome {
    /// Store the result; the flag goes to `woken`, set once the proxy's lock is let go.
    fn set(&self, r: Result<TransferReport>, keep: Option<Keep>, woken: &mut Woken) {
        let mut g = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            *g = Some((r, keep));
        }
        drop(g);
        woken.push(self.flag.clone());
    }
}

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
    /// Its seq is taken; the stream write is being enqueued.
    Reserved(W),
    /// Waiting for its trigger word.
    Armed(W),
    /// Fired; being started outside the lock.
    Starting,
    /// Started; polled until it finishes.
    Running(W, Box<dyn Running>),
}

struct Entry<W> {
    queue: Arc<Queue>,
    stage: Stage<W>,
    outcome: Arc<Outcome>,
    /// The request's deadline.
    timeout: Duration,
    /// The trigger must have fired by then.
    until: Instant,
}

struct QState {
    queue: Arc<Queue>,
    cuda: bool,
    window: Window,
    next_seq: u64,
    /// Requests of the queue not finished.
    outstanding: usize,
    /// Requests whose trigger has not been seen (their slots are not reusable).
    unfired: BTreeSet<u64>,
    /// No new requests (a request failed, or the words were given to a graph).
    retired: bool,
}

struct PState<W> {
    /// By (queue id, seq).
    entries: BTreeMap<(u64, u64), Entry<W>>,
    queues: HashMap<u64, QState>,
    /// The queue new requests go to.
    current: Option<u64>,
    next_queue: u64,
    closing: Option<Instant>,
    /// What finished requests held, dropped by a caller's thread (never the proxy's).
    graveyard: Vec<Box<dyn Send>>,
    /// The flags of requests finished under the lock, set once it is let go ([`Locked`]).
    woken: Woken,
}

impl<W> Defers for PState<W> {
    type Wakes = Woken;
    fn wakes(&mut self) -> &mut Woken {
        &mut self.woken
    }
}

/// Rung by new work, completions and the close.
#[derive(Default)]
struct Bell {
    rung: Mutex<bool>,
    cv: Condvar,
}

impl Bell {
    fn ring(&self) {
        *self.rung.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.cv.notify_all();
    }

    /// Sleep until rung or `timeout` passed (`None`: until rung).
    fn sleep(&self, timeout: Option<Duration>) {
        let mut g = self.rung.lock().unwrap_or_else(|e| e.into_inner());
        if !*g {
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
        *g = false;
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

struct Core<B: Backend> {
    backend: B,
    state: Mutex<PState<B::Work>>,
    bell: Arc<Bell>,
}

/// The stream proxy of one endpoint over one backend: its queues, armed and running requests,
/// and its thread (started by the first request).
pub(crate) struct Proxy<B: Backend> {
    core: Arc<Core<B>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

fn closed_error() -> Error {
    Error::invalid(
        "endpoint",
        "closed",
        "the endpoint was closed before the stream transfer finished",
    )
}

impl<B: Backend> Core<B> {
    fn lock(&self) -> Locked<'_, PState<B::Work>> {
        Locked::new(&self.state)
    }

    /// End entry `key` with `r`: publish the queue's word, hand the result over, and put what
    /// it held in the graveyard. A failure retires the queue and fails its armed requests.
    fn finish(
        st: &mut PState<B::Work>,
        key: (u64, u64),
        r: Result<TransferReport>,
        keep: Option<Keep>,
    ) {
        let Some(e) = st.entries.remove(&key) else {
            return;
        };
        let ok = r.is_ok();
        let mut poisoned = None;
        if let Some(q) = st.queues.get_mut(&key.0) {
            let word = q.window.finish(key.1, ok);
            e.queue.words.store(DONE, word);
            q.outstanding = q.outstanding.saturating_sub(1);
            q.unfired.remove(&key.1);
            if !ok && !q.retired {
                q.retired = true;
                poisoned = q.window.failed();
            }
        }
        e.outcome.set(r, keep, &mut st.woken);
        let work = match e.stage {
            Stage::Reserved(w) | Stage::Armed(w) | Stage::Running(w, _) => Some(w),
            Stage::Starting => None,
        };
        st.graveyard.push(Box::new((e.queue, work, e.outcome)));
        if let Some(first) = poisoned {
            if st.current == Some(key.0) {
                st.current = None;
            }
            let armed: Vec<(u64, u64)> = st
                .entries
                .range((key.0, 0)..=(key.0, u64::MAX))
                .filter(|(_, e)| matches!(e.stage, Stage::Armed(_) | Stage::Reserved(_)))
                .map(|(k, _)| *k)
                .collect();
            for k in armed {
                let err = Error::invalid(
                    "stream transfer",
                    k.1,
                    format!(
                        "request {first} of its stream queue failed first; a queue starts \
                         nothing after a failure"
                    ),
                );
                Self::finish(st, k, Err(err), None);
            }
        }
        Self::forget_idle(st, key.0);
    }

    /// A retired queue with nothing outstanding goes to the graveyard.
    fn forget_idle(st: &mut PState<B::Work>, id: u64) {
        if st
            .queues
            .get(&id)
            .is_some_and(|q| q.retired && q.outstanding == 0)
        {
            let q = st.queues.remove(&id).expect("present");
            st.graveyard.push(Box::new(q.queue));
        }
    }

    /// Entry `key` was never enqueued: its seq completes as nothing to do.
    fn void(st: &mut PState<B::Work>, key: (u64, u64)) {
        let Some(e) = st.entries.remove(&key) else {
            return;
        };
        if let Some(q) = st.queues.get_mut(&key.0) {
            let word = q.window.finish(key.1, true);
            e.queue.words.store(DONE, word);
            q.outstanding = q.outstanding.saturating_sub(1);
            q.unfired.remove(&key.1);
        }
        let work = match e.stage {
            Stage::Reserved(w) | Stage::Armed(w) | Stage::Running(w, _) => Some(w),
            Stage::Starting => None,
        };
        e.outcome.set(Err(closed_error()), None, &mut st.woken);
        st.graveyard.push(Box::new((e.queue, work, e.outcome)));
        Self::forget_idle(st, key.0);
    }

    /// The endpoint is closing: every request not yet started fails (its word released with
    /// the error bit); started ones finish as the engine ends them.
    fn close(&self) {
        let mut st = self.lock();
        if st.closing.is_none() {
            st.closing = Some(Instant::now());
        }
        st.current = None;
        for q in st.queues.values_mut() {
            q.retired = true;
        }
        let waiting: Vec<(u64, u64)> = st
            .entries
            .iter()
            .filter(|(_, e)| matches!(e.stage, Stage::Armed(_) | Stage::Reserved(_)))
            .map(|(k, _)| *k)
            .collect();
        for k in waiting {
            Self::finish(&mut st, k, Err(closed_error()), None);
        }
        let ids: Vec<u64> = st.queues.keys().copied().collect();
        for id in ids {
            Self::forget_idle(&mut st, id);
        }
        drop(st);
        self.bell.ring();
    }

    /// One round: fired triggers are taken (to start outside the lock), running requests
    /// polled, passed trigger deadlines failed. Returns what fired and whether anything moved.
    #[allow(clippy::type_complexity)]
    fn round(&self, waker: &Waker) -> (Vec<((u64, u64), B::Work)>, bool) {
        let mut st = self.lock();
        let now = Instant::now();
        let mut fired = Vec::new();
        let mut late = Vec::new();
        let mut done = Vec::new();
        let mut moved = false;
        for (k, e) in st.entries.iter_mut() {
            match &mut e.stage {
                Stage::Armed(_) => {
                    if e.queue.words.load(trigger_slot(k.1)) == k.1 {
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
                Stage::Reserved(_) | Stage::Starting => {}
            }
        }
        for (k, _) in &fired {
            if let Some(q) = st.queues.get_mut(&k.0) {
                q.unfired.remove(&k.1);
            }
        }
        moved |= !fired.is_empty() || !late.is_empty() || !done.is_empty();
        for (k, r, keep) in done {
            Self::finish(&mut st, k, r, Some(keep));
        }
        for (k, after) in late {
            let e = Error::Timeout {
                what: "a stream transfer's trigger (the stream did not reach it)",
                after,
            };
            Self::finish(&mut st, k, Err(e), None);
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
                Self::finish(&mut st, k, Err(e), None);
            }
        }
        (fired, moved)
    }

    /// Start what fired (outside the lock: the backend takes the endpoint's).
    fn start(&self, fired: Vec<((u64, u64), B::Work)>) {
        for (k, w) in fired {
            let r = self.backend.start(&w);
            let mut st = self.lock();
            match r {
                Ok(run) => {
                    if let Some(e) = st.entries.get_mut(&k) {
                        e.stage = Stage::Running(w, run);
                    } else {
                        st.graveyard.push(Box::new((w, run)));
                    }
                }
                Err(e) => {
                    if let Some(entry) = st.entries.get_mut(&k) {
                        entry.stage = Stage::Armed(w);
                    } else {
                        st.graveyard.push(Box::new(w));
                    }
                    Self::finish(&mut st, k, Err(e), None);
                }
            }
        }
    }

    fn run(self: &Arc<Self>) {
        let waker = Waker::from(self.bell.clone());
        let mut idle = 0u32;
        loop {
            let (fired, moved) = self.round(&waker);
            let started = !fired.is_empty();
            self.start(fired);
            if moved || started {
                idle = 0;
                continue;
            }
            let (armed, any, closing) = {
                let st = self.lock();
                (
                    st.entries
                        .values()
                        .any(|e| matches!(e.stage, Stage::Armed(_))),
                    !st.entries.is_empty(),
                    st.closing.is_some(),
                )
            };
            if closing && !any {
                return;
            }
            if armed {
                match proxy_pause(idle) {
                    None => std::thread::yield_now(),
                    Some(d) => self.bell.sleep(Some(d)),
                }
                idle = idle.saturating_add(1);
            } else if any {
                // Running requests wake the bell when they finish; the bound covers trigger
                // deadlines and the close.
                self.bell.sleep(Some(Duration::from_millis(20)));
            } else {
                self.bell.sleep(None);
            }
        }
    }

    /// The queue a new request goes to, made (outside the lock) when there is none that fits.
    fn queue_for(&self, trig: &Trigger<'_>) -> Result<u64> {
        let want_cuda = matches!(trig, Trigger::Stream(_));
        loop {
            {
                let mut st = self.lock();
                if st.closing.is_some() {
                    return Err(closed_error());
                }
                if let Some(id) = st.current {
                    let q = st.queues.get_mut(&id).expect("current queue is kept");
                    let usable = q.next_seq < MAX_SEQ && !q.retired;
                    if usable && (q.cuda || !want_cuda) {
                        return Ok(id);
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
                    st.current = None;
                    Self::forget_idle(&mut st, id);
                }
            }
            let words: Box<dyn WordMemory> = match trig {
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
                Trigger::Host => Box::new(HostWords::new(1 + TRIGGER_SLOTS)),
            };
            let mut st = self.lock();
            if st.current.is_some() {
                continue; // another caller made one meanwhile; ours is dropped here
            }
            let id = st.next_queue;
            st.next_queue += 1;
            st.queues.insert(
                id,
                QState {
                    queue: Arc::new(Queue { id, words }),
                    cuda: want_cuda,
                    window: Window::default(),
                    next_seq: 1,
                    outstanding: 0,
                    unfired: BTreeSet::new(),
                    retired: false,
                },
            );
            st.current = Some(id);
            return Ok(id);
        }
    }
}

impl<B: Backend> Proxy<B> {
    pub(crate) fn new(backend: B) -> Self {
        Proxy {
            core: Arc::new(Core {
                backend,
                state: Mutex::new(PState {
                    entries: BTreeMap::new(),
                    queues: HashMap::new(),
                    current: None,
                    next_queue: 1,
                    closing: None,
                    graveyard: Vec::new(),
                    woken: Woken::default(),
                }),
                bell: Arc::new(Bell::default()),
            }),
            thread: Mutex::new(None),
        }
    }

    /// Drop what finished requests held (on the caller's thread).
    fn bury(&self) {
        let dead = std::mem::take(&mut self.core.lock().graveyard);
        drop(dead);
    }

    fn ensure_thread(&self) -> Result<()> {
        let mut t = self.thread.lock().unwrap_or_else(|e| e.into_inner());
        if t.is_none() {
            let core = self.core.clone();
            *t = Some(crate::driver::ctx::spawn_thread(
                "gpudirect-stream-proxy",
                move || core.run(),
            )?);
        }
        Ok(())
    }

    /// Arm `work`: a seq on the endpoint's queue, then (for a stream) the trigger write
    /// enqueued on it. `timeout` is the request's deadline.
    pub(crate) fn arm(
        &self,
        trig: Trigger<'_>,
        work: B::Work,
        timeout: Duration,
    ) -> Result<StreamTransfer> {
        self.arm_with(trig, || Ok(work), timeout)
    }

    /// [`arm`](Self::arm) with the work made once the queue is chosen and has a free trigger
    /// slot (work that queues copies on the stream makes them only when arming can go on).
    pub(crate) fn arm_with(
        &self,
        trig: Trigger<'_>,
        make: impl FnOnce() -> Result<B::Work>,
        timeout: Duration,
    ) -> Result<StreamTransfer> {
        self.bury();
        self.ensure_thread()?;
        let id = self.core.queue_for(&trig)?;
        {
            let mut st = self.core.lock();
            let q = st.queues.get_mut(&id).ok_or_else(closed_error)?;
            if let Some(&low) = q.unfired.first()
                && q.next_seq - low >= TRIGGER_SLOTS as u64
            {
                return Err(Error::invalid(
                    "stream transfers",
                    q.next_seq - low,
                    format!("at most {TRIGGER_SLOTS} armed at once on one endpoint"),
                ));
            }
        }
        let work = make()?;
        let now = Instant::now();
        let until = deadline_after(now, timeout);
        let limit = deadline_after(until, timeout) + HOST_SLACK;
        let outcome = Arc::new(Outcome {
            flag: CompletionFlag::new(),
            slot: Mutex::new(None),
        });
        let (queue, seq) = {
            let mut st = self.core.lock();
            let q = st.queues.get_mut(&id).ok_or_else(closed_error)?;
            let seq = q.next_seq;
            if let Some(&low) = q.unfired.first()
                && seq - low >= TRIGGER_SLOTS as u64
            {
                return Err(Error::invalid(
                    "stream transfers",
                    seq - low,
                    format!("at most {TRIGGER_SLOTS} armed at once on one endpoint"),
                ));
            }
            q.next_seq += 1;
            q.outstanding += 1;
            q.unfired.insert(seq);
            let queue = q.queue.clone();
            let stage = match trig {
                Trigger::Host => Stage::Armed(work),
                Trigger::Stream(_) => Stage::Reserved(work),
            };
            st.entries.insert(
                (id, seq),
                Entry {
                    queue: queue.clone(),
                    stage,
                    outcome: outcome.clone(),
                    timeout,
                    until,
                },
            );
            (queue, seq)
        };
        let host = matches!(trig, Trigger::Host);
        if let Trigger::Stream(stream) = trig {
            let flags = queue
                .words
                .flags()
                .expect("a stream's queue has CUDA words");
            let r = stream.write_value64(flags, trigger_slot(seq), seq);
            let mut st = self.core.lock();
            match r {
                Ok(()) => {
                    if let Some(e) = st.entries.get_mut(&(id, seq))
                        && let Stage::Reserved(_) = e.stage
                    {
                        let Stage::Reserved(w) = std::mem::replace(&mut e.stage, Stage::Starting)
                        else {
                            unreachable!("matched above")
                        };
                        e.stage = Stage::Armed(w);
                    }
                }
                Err(e @ Error::StreamCapturing { enqueued: true, .. }) => {
                    // The write may sit in a graph, whose launches write the slot at any time:
                    // the queue is never used again (its words are never freed: see
                    // `MemopFlags`).
                    let err = Error::StreamCapturing {
                        call: "cuStreamWriteValue64_v2",
                        enqueued: true,
                    };
                    Core::<B>::finish(&mut st, (id, seq), Err(err), None);
                    return Err(e);
                }
                Err(e) => {
                    Core::<B>::void(&mut st, (id, seq));
                    return Err(e);
                }
            }
        }
        self.core.bell.ring();
        Ok(StreamTransfer {
            queue,
            seq,
            outcome,
            host,
            limit,
        })
    }

    /// Requests not finished (armed, starting or running).
    #[cfg(test)]
    fn pending(&self) -> usize {
        self.core.lock().entries.len()
    }
}

impl<B: Backend> Companion for Proxy<B> {
    fn closing(&self) {
        self.core.close();
    }

    fn closed(&self) {
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

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A request armed on a stream queue ([`Endpoint::write_on`], [`Endpoint::read_on`], or the
/// host-triggered [`Endpoint::write_triggered`], [`Endpoint::read_triggered`]): its sequence
/// number, the queue's completion word, and the host's view of its result.
///
/// It holds the queue's words (an `Arc` shared with the queue): the memory stays while any
/// stream operation may still reach it, and leaks if this is leaked.
#[must_use = "a stream transfer runs when its trigger fires; wait for it (on a stream or the host)"]
pub struct StreamTransfer {
    queue: Arc<Queue>,
    seq: u64,
    outcome: Arc<Outcome>,
    host: bool,
    limit: Instant,
}

impl StreamTransfer {
    /// The request's sequence number in its queue (from 1).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Fire the trigger from the host: what the stream's `cuStreamWriteValue64` does for a
    /// request made with [`Endpoint::write_on`]. Only for host-triggered requests
    /// ([`Endpoint::write_triggered`], [`Endpoint::read_triggered`]); firing twice is harmless.
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
        self.queue.words.store(trigger_slot(self.seq), self.seq);
        Ok(())
    }

    /// `cuStreamWaitValue64(completion word, seq, GEQ)` on `stream`: its later work waits until
    /// this request and every earlier one of its queue are done, or one failed (then the word
    /// has [`STREAM_ERROR_BIT`]: work after the wait must check it, see the module docs).
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
        stream.wait_value64(flags, DONE, self.seq, WaitCondition::Geq)
    }

    /// The completion word for a kernel that polls it: its device address (8 bytes, aligned,
    /// in pinned host memory mapped for the device) and the value to wait for (the request is
    /// done when `word >= seq` or `word & STREAM_ERROR_BIT != 0`; see the module docs for what
    /// the bit means).
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] when the queue's words are plain host memory.
    pub fn completion_word(&self) -> Result<(u64, u64)> {
        Ok((self.cuda_words()?.device_ptr(DONE)?, self.seq))
    }

    /// The completion word now, as the host reads it.
    pub fn completion_value(&self) -> u64 {
        self.queue.words.load(DONE)
    }

    /// Whether the word releases a wait for this request now (done, or a failure in the
    /// queue).
    pub fn is_released(&self) -> bool {
        geq_releases(self.completion_value(), self.seq)
    }

    fn cuda_words(&self) -> Result<&MemopFlags> {
        self.queue.words.flags().ok_or_else(|| Error::Unsupported {
            what: "a stream wait on a host-triggered queue".into(),
            reason: "the endpoint's stream queue is in plain host memory (made for host \
                     triggers without CUDA)"
                .into(),
        })
    }

    /// Whether the request has finished (the host's view; the word is written before).
    pub fn is_complete(&self) -> bool {
        self.outcome.flag.is_complete()
    }

    /// Wait on the host, up to `timeout`, for the request to finish, and take its result.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when it has not finished within `timeout` (call again); what ended the
    /// request (as [`Transfer::wait`](super::Transfer::wait), plus [`Error::Timeout`] when the
    /// stream never reached the trigger and [`Error::InvalidArgument`] when the endpoint was
    /// closed first or an earlier request of the queue failed); [`Error::InvalidArgument`] once
    /// the result was taken.
    pub fn wait(&self, timeout: Duration) -> Result<TransferReport> {
        if !self.outcome.flag.wait_timeout(timeout) {
            return Err(Error::Timeout {
                what: "a stream transfer",
                after: timeout,
            });
        }
        take(&self.outcome)
    }
}

fn take(o: &Outcome) -> Result<TransferReport> {
    let got = o.slot.lock().unwrap_or_else(|e| e.into_inner()).take();
    match got {
        // What the request held is dropped here, on the caller's thread.
        Some((r, keep)) => {
            drop(keep);
            r
        }
        None => Err(Error::invalid(
            "stream transfer",
            "its result",
            "already taken",
        )),
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
        let op = InFlight::new(
            "stream transfer",
            self.outcome.flag.clone(),
            self.outcome.clone(),
        );
        let f = op.deadline(self.limit);
        let keep = self.queue;
        Box::pin(async move {
            let o = f.await?;
            let r = take(&o);
            drop(keep);
            r
        })
    }
}

impl std::fmt::Debug for StreamTransfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamTransfer")
            .field("seq", &self.seq)
            .field("queue", &self.queue.id)
            .field("word", &self.completion_value())
            .field("complete", &self.is_complete())
            .finish()
    }
}

/// The RDMA backend: posts through the engine.
pub(crate) struct Rdma {
    ep: WeakEndpoint,
}

/// A request of a stream queue.
pub(crate) enum RdmaWork {
    /// Started through [`Endpoint::transfer`] when the trigger fires (RDMA; intra-node with a
    /// host trigger).
    Post {
        dir: Direction,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    },
    /// Intra-node: the copies were queued on the stream before the trigger, so they are done
    /// when it fires; only the notification is left.
    #[cfg(feature = "p2p")]
    Queued(super::local::Queued),
}

/// A request that was finished when it started (queued copies).
#[cfg(feature = "p2p")]
struct Finished(Option<Result<TransferReport>>);

#[cfg(feature = "p2p")]
impl Running for Finished {
    fn poll(&mut self, _: &Waker) -> Option<(Result<TransferReport>, Keep)> {
        Some((self.0.take()?, Box::new(())))
    }
}

struct RdmaRunning {
    flag: CompletionFlag,
    op: Option<InFlight<Transferred, CompletionFlag>>,
}

impl Running for RdmaRunning {
    fn poll(&mut self, waker: &Waker) -> Option<(Result<TransferReport>, Keep)> {
        if !self.flag.is_complete() {
            self.flag.register_waker(waker);
            if !self.flag.is_complete() {
                return None;
            }
        }
        // Complete: `try_take` answers at once and neither waits nor reaps the tracker (which
        // could free CUDA memory on this thread).
        match self.op.take()?.try_take() {
            Ok(done) => {
                let r = done.take_result();
                Some((r, Box::new(done)))
            }
            Err(op) => {
                self.op = Some(op);
                None
            }
        }
    }
}

impl Backend for Rdma {
    type Work = RdmaWork;

    fn start(&self, w: &RdmaWork) -> Result<Box<dyn Running>> {
        let ep = self.ep.upgrade().ok_or_else(closed_error)?;
        let (dir, pairs, opts) = match w {
            RdmaWork::Post { dir, pairs, opts } => (*dir, pairs, *opts),
            #[cfg(feature = "p2p")]
            RdmaWork::Queued(q) => {
                // The stream passed the copies before it wrote the trigger: they are done.
                let side = ep
                    .local_side()
                    .and_then(|s| s.as_any().downcast_ref::<super::local::Side>())
                    .ok_or_else(closed_error)?;
                let r = match q.report.notified {
                    Some(tag) => super::local::notify_peer(side, q, tag),
                    None => Ok(()),
                };
                let mut report = q.report.clone();
                report.elapsed = q.started.elapsed();
                return Ok(Box::new(Finished(Some(r.map(|()| report)))));
            }
        };
        // Clones: the proxy keeps the originals until the request finished, so nothing the
        // request uses is freed on this thread.
        let t: Transfer = ep.transfer(dir, pairs.clone(), opts)?;
        let flag = t.flag().clone();
        Ok(Box::new(RdmaRunning {
            flag,
            op: Some(t.into_in_flight()),
        }))
    }
}

/// The notification counter of an endpoint ([`Endpoint::notification_counter`]).
struct Counter {
    words: Box<dyn WordMemory>,
    failed: AtomicBool,
}

impl NoteSink for Counter {
    fn delivered(&self, total: u64) {
        let bit = if self.failed.load(Ordering::Acquire) {
            STREAM_ERROR_BIT
        } else {
            0
        };
        self.words.store(0, (total & MAX_SEQ) | bit);
    }

    fn failed(&self) {
        self.failed.store(true, Ordering::Release);
        self.words.store(0, self.words.load(0) | STREAM_ERROR_BIT);
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A word that counts the notifications an endpoint delivered ([`Endpoint::notification_counter`]):
/// the endpoint's progress thread adds one per notification, after the flush that makes its
/// bytes visible, so a stream that waits for `counter >= n` may use the data of the first `n`
/// notified requests. It counts: it does not consume the notifications, which
/// [`Endpoint::next_notification`] and [`Endpoint::notification`] still deliver.
///
/// When the endpoint fails or closes (reconnecting included), [`STREAM_ERROR_BIT`] is set and
/// stays: every wait on the counter is released (no stream waits forever for a notification
/// that cannot come), and work after the wait must check the bit (the other bits still count
/// the notifications delivered). The memory is shared with the endpoint by an `Arc`.
#[derive(Clone)]
pub struct StreamWord {
    sink: Arc<dyn NoteSink>,
}

impl StreamWord {
    fn counter(&self) -> &Counter {
        self.sink
            .as_any()
            .downcast_ref::<Counter>()
            .expect("the endpoint's only sink is a counter")
    }

    /// The counter now, as the host reads it.
    pub fn value(&self) -> u64 {
        self.counter().words.load(0)
    }

    /// The counter's device address (8 bytes in pinned host memory mapped for the device), for
    /// a kernel that polls it.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for a counter in plain host memory.
    pub fn device_address(&self) -> Result<u64> {
        self.flags()?.device_ptr(0)
    }

    fn flags(&self) -> Result<&MemopFlags> {
        self.counter()
            .words
            .flags()
            .ok_or_else(|| Error::Unsupported {
                what: "a stream wait on a host counter".into(),
                reason: "the counter was made in plain host memory".into(),
            })
    }

    /// `cuStreamWaitValue64(counter, n, GEQ)` on `stream`: its later work waits until `n`
    /// notifications were delivered (or the endpoint failed: then the word has
    /// [`STREAM_ERROR_BIT`]).
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for a counter in plain host memory; [`Error::StreamCapturing`]
    /// while the stream captures (nothing enqueued); [`Error::Cuda`].
    #[doc(alias = "cuStreamWaitValue64_v2")]
    pub fn wait_on(&self, stream: &Stream, n: u64) -> Result<()> {
        stream.wait_value64(self.flags()?, 0, n, WaitCondition::Geq)
    }
}

impl std::fmt::Debug for StreamWord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamWord")
            .field("value", &self.value())
            .finish()
    }
}

impl Endpoint {
    fn proxy(&self) -> Result<&Proxy<Rdma>> {
        let weak = self.downgrade();
        self.companion(|| Proxy::new(Rdma { ep: weak }))
            .ok_or_else(|| {
                Error::invalid(
                    "endpoint",
                    "another stream backend",
                    "this endpoint's stream proxy is not the RDMA one",
                )
            })
    }

    /// A request armed on the endpoint's stream queue.
    fn arm(
        &self,
        trig: Trigger<'_>,
        dir: Direction,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<StreamTransfer> {
        self.check_request(dir, &pairs, &opts)?;
        let timeout = opts.deadline.unwrap_or(self.engine().config().deadline);
        let proxy = self.proxy()?;
        // Intra-node on a stream: the copies go on the stream itself, before the trigger.
        #[cfg(feature = "p2p")]
        if let Trigger::Stream(stream) = &trig
            && let Some(side) = self.local_side()
            && let Some(side) = side.as_any().downcast_ref::<super::local::Side>()
        {
            let make = || {
                super::local::on_stream(self, side, stream, dir, &pairs, &opts)
                    .map(RdmaWork::Queued)
            };
            return proxy.arm_with(trig, make, timeout);
        }
        proxy.arm(trig, RdmaWork::Post { dir, pairs, opts }, timeout)
    }

    /// [`write`](Self::write) ordered on `stream`: the request starts when the stream reaches
    /// it, and its completion word is set when it finishes (see
    /// [`StreamTransfer::wait_on`]). Checked now, before anything is enqueued; posted by the
    /// endpoint's proxy thread when the trigger fires.
    ///
    /// # Errors
    ///
    /// As [`transfer`](Self::transfer)'s checks; [`Error::StreamCapturing`] while the stream
    /// captures a graph (nothing enqueued; `enqueued: true` if a capture began meanwhile: the
    /// queue is then retired and its words never freed); [`Error::Unsupported`] without 64-bit
    /// stream memory operations; [`Error::InvalidArgument`] with [`TRIGGER_SLOTS`] requests
    /// armed or after host-triggered requests still outstanding in host memory; [`Error::Cuda`],
    /// [`Error::Load`].
    #[doc(alias = "cuStreamWriteValue64_v2")]
    pub fn write_on(
        &self,
        stream: &Stream,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<StreamTransfer> {
        self.arm(Trigger::Stream(stream), Direction::Write, pairs, opts)
    }

    /// [`read`](Self::read) ordered on `stream`, as [`write_on`](Self::write_on). Reads into
    /// GPU memory are flushed before the completion word is set.
    ///
    /// # Errors
    ///
    /// As [`write_on`](Self::write_on).
    #[doc(alias = "cuStreamWriteValue64_v2")]
    pub fn read_on(
        &self,
        stream: &Stream,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<StreamTransfer> {
        self.arm(Trigger::Stream(stream), Direction::Read, pairs, opts)
    }

    /// A write armed on the stream queue and fired from the host ([`StreamTransfer::trigger`]:
    /// what a stream's trigger write does), for code without CUDA and for tests of the proxy.
    /// The queue's words are plain host memory when no stream request made them CUDA memory.
    ///
    /// # Errors
    ///
    /// As [`transfer`](Self::transfer)'s checks; [`Error::InvalidArgument`] with
    /// [`TRIGGER_SLOTS`] requests armed.
    pub fn write_triggered(
        &self,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<StreamTransfer> {
        self.arm(Trigger::Host, Direction::Write, pairs, opts)
    }

    /// A read armed on the stream queue and fired from the host, as
    /// [`write_triggered`](Self::write_triggered).
    ///
    /// # Errors
    ///
    /// As [`write_triggered`](Self::write_triggered).
    pub fn read_triggered(
        &self,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<StreamTransfer> {
        self.arm(Trigger::Host, Direction::Read, pairs, opts)
    }

    /// The endpoint's notification counter in pinned host memory mapped for `ctx`'s device
    /// (made on the first call, the same word after), starting at the notifications delivered
    /// so far. See [`StreamWord`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the counter was made in plain host memory first;
    /// [`Error::Load`], [`Error::Cuda`] from allocating it; [`Error::Unsupported`] without
    /// 64-bit stream memory operations.
    #[doc(alias = "cuMemHostAlloc")]
    pub fn notification_counter(&self, ctx: &Arc<CudaContext>) -> Result<StreamWord> {
        let f = MemopFlags::pinned_host(ctx, 1)?;
        if !f.supports_64_bit() {
            return Err(Error::Unsupported {
                what: "a stream-visible notification counter".into(),
                reason: "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS is 0".into(),
            });
        }
        let w = self.counter_with(Box::new(f))?;
        w.flags().map_err(|_| {
            Error::invalid(
                "notification counter",
                "host memory",
                "the endpoint's counter was made in plain host memory first",
            )
        })?;
        Ok(w)
    }

    /// The endpoint's notification counter in plain host memory (for code without CUDA), or
    /// the counter already made. See [`StreamWord`].
    ///
    /// # Errors
    ///
    /// None today (the signature leaves room).
    pub fn notification_counter_host(&self) -> Result<StreamWord> {
        self.counter_with(Box::new(HostWords::new(1)))
    }

    fn counter_with(&self, words: Box<dyn WordMemory>) -> Result<StreamWord> {
        let sink = self.note_sink(move |delivered| {
            words.store(0, delivered & MAX_SEQ);
            Ok(Arc::new(Counter {
                words,
                failed: AtomicBool::new(false),
            }))
        })?;
        Ok(StreamWord { sink })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_word_advances_in_order_only() {
        let mut w = Window::default();
        assert_eq!(w.finish(2, true), 0);
        assert_eq!(w.finish(3, true), 0);
        assert_eq!(w.finish(1, true), 3);
        assert_eq!(w.finish(5, true), 3);
        assert_eq!(w.finish(4, true), 5);
    }

    #[test]
    fn a_failure_sets_the_bit_and_freezes_the_prefix() {
        let mut w = Window::default();
        assert_eq!(w.finish(1, true), 1);
        assert_eq!(w.finish(3, false), 1 | STREAM_ERROR_BIT);
        assert_eq!(w.finish(2, true), 2 | STREAM_ERROR_BIT);
        assert_eq!(w.finish(4, true), 2 | STREAM_ERROR_BIT);
        assert_eq!(w.failed(), Some(3));
    }

    #[test]
    fn the_error_bit_releases_every_wait_and_bit_63_would_not() {
        for seq in [1u64, 2, 1000, MAX_SEQ] {
            assert!(geq_releases(STREAM_ERROR_BIT, seq), "{seq}");
            assert!(geq_releases(seq | STREAM_ERROR_BIT, seq));
            assert!(!geq_releases(seq - 1, seq));
            // The driver's GEQ is cyclic: bit 63 makes the difference negative.
            assert!(!geq_releases(seq | (1 << 63), seq));
        }
    }

    #[test]
    fn the_proxy_sleeps_at_most_its_nap() {
        assert_eq!(proxy_pause(0), None);
        assert_eq!(proxy_pause(SPIN_ROUNDS - 1), None);
        assert_eq!(proxy_pause(SPIN_ROUNDS), Some(Duration::from_micros(1)));
        assert_eq!(proxy_pause(SPIN_ROUNDS + 3), Some(Duration::from_micros(8)));
        assert_eq!(proxy_pause(u32::MAX), Some(PROXY_NAP));
    }

    proptest! {
        /// Requests finishing in any order, some failing: the word only grows (also as the
        /// driver compares), its low bits are exactly the successful prefix, the bit is set
        /// iff something failed, and a wait for `s` is released iff every request up to `s`
        /// succeeded or something failed.
        #[test]
        fn words_follow_the_prefix_in_any_order(
            order in Just((1u64..=64).collect::<Vec<u64>>()).prop_shuffle(),
            fails in proptest::collection::vec(any::<bool>(), 64),
            fail_rate in 0u8..4,
        ) {
            let mut w = Window::default();
            let failing = |s: u64| fail_rate == 0 && fails[(s - 1) as usize];
            let mut finished = BTreeSet::new();
            let mut last = 0u64;
            for &s in &order {
                let word = w.finish(s, !failing(s));
                finished.insert(s);
                prop_assert!(word >= last && geq_releases(word, last));
                last = word;
                let mut prefix = 0;
                while finished.contains(&(prefix + 1)) && !failing(prefix + 1) {
                    prefix += 1;
                }
                let any_failed = finished.iter().any(|&f| failing(f));
                prop_assert_eq!(word & !STREAM_ERROR_BIT, prefix);
                prop_assert_eq!(word & STREAM_ERROR_BIT != 0, any_failed);
                for q in 1..=64u64 {
                    prop_assert_eq!(geq_releases(word, q), q <= prefix || any_failed);
                }
            }
        }
    }

    /// A fake backend: requests finish when the test says so, or at once.
    #[derive(Default)]
    struct Fake {
        started: Mutex<Vec<u64>>,
        /// Results the test released, by work id.
        release: Arc<Mutex<HashMap<u64, bool>>>,
    }

    struct FakeRun {
        id: u64,
        release: Arc<Mutex<HashMap<u64, bool>>>,
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
            Some((r, Box::new(())))
        }
    }

    impl Backend for Fake {
        type Work = u64;
        fn start(&self, w: &u64) -> Result<Box<dyn Running>> {
            self.started.lock().unwrap().push(*w);
            Ok(Box::new(FakeRun {
                id: *w,
                release: self.release.clone(),
            }))
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

    #[test]
    fn a_finished_requests_waker_runs_with_the_proxy_unlocked() {
        use crate::completion::testing::WokenFree;
        let p = Proxy::new(Fake::default());
        let rel = p.core.backend.release.clone();
        let core = p.core.clone();
        // A waker that calls back into the proxy inline takes its lock.
        let probe = WokenFree::new(move || core.state.try_lock().is_ok());
        let t = p.arm(Trigger::Host, 9, Duration::from_secs(30)).unwrap();
        assert!(t.outcome.flag.register_waker(&Waker::from(probe.clone())));
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
}
