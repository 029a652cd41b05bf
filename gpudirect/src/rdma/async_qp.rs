//! Verbs completions as futures: [`AsyncCq`] (one dispatcher per completion queue) and
//! [`AsyncQueuePair`] (futures of work completions, streams of received messages and
//! immediates, and a bounded backlog).

use super::async_backlog::{Offer, SendSide};
use super::cm::{CmLink, Connection};
use super::cq::{CompletionChannel, CompletionQueue, POLL_BATCH, WcOpcode, WorkCompletion};
use super::mr::{MrSlice, RemoteSlice};
use super::qp::{QueuePair, Rts};
use super::wr::{RecvRequest, SendRequest};
use crate::completion::deferred::{Wakers, Woken};
use crate::completion::thread::{self, Watch, Watched};
use crate::completion::{Fence, InFlight, InFlightFuture};
use crate::error::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// Tags of receives have this bit set; tags of send-queue requests do not.
const RECV_BIT: u64 = 1 << 63;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where one send-queue request's completion is delivered.
#[derive(Default)]
struct Slot {
    st: Mutex<SlotState>,
    done: AtomicBool,
}

#[derive(Default)]
struct SlotState {
    result: Option<Result<WorkCompletion>>,
    waker: Option<Waker>,
}

impl Slot {
    /// Store the outcome (the first one only) and wake the waiter.
    fn fill(&self, r: Result<WorkCompletion>) {
        let mut wakers = Wakers::default();
        self.fill_deferred(r, &mut wakers);
    }

    /// Store the outcome (the first one only); the waiter's waker goes to `wakers`.
    fn fill_deferred(&self, r: Result<WorkCompletion>, wakers: &mut Wakers) {
        let mut st = lock(&self.st);
        if self.done.load(Ordering::Acquire) {
            return;
        }
        st.result = Some(r);
        self.done.store(true, Ordering::Release);
        wakers.extend(st.waker.take());
    }

    fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Keep `waker` for the fill (checked under the same lock: a fill is never missed).
    fn register(&self, waker: &Waker) {
        let old = {
            let mut st = lock(&self.st);
            if self.is_done() {
                return;
            }
            st.waker.replace(waker.clone())
        };
        drop(old);
    }

    fn take(&self) -> Option<Result<WorkCompletion>> {
        lock(&self.st).result.take()
    }
}

/// Tells the completion-channel task to end (the dispatcher is gone).
#[cfg(feature = "tokio")]
#[derive(Default)]
struct Stop {
    stopped: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

#[cfg(feature = "tokio")]
impl Stop {
    fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        if let Some(w) = lock(&self.waker).take() {
            w.wake();
        }
    }

    fn is_stopped(&self, cx: &Context<'_>) -> bool {
        *lock(&self.waker) = Some(cx.waker().clone());
        self.stopped.load(Ordering::Acquire)
    }
}

/// One per completion queue: polls it, routes each completion by its tag to the future or stream
/// waiting for it, and posts backlogged requests as room frees up.
struct Dispatcher {
    cq: CompletionQueue,
    /// One poller at a time: completions are routed in the order the CQ gave them.
    poll_lock: Mutex<()>,
    /// Held from the room check to the post, so that no other queue pair takes the CQ room seen.
    room_lock: Mutex<()>,
    qps: Mutex<HashMap<u32, Weak<QpShared>>>,
    /// The completion-channel task runs (feature `tokio`).
    driven: AtomicBool,
    /// The completion thread holds a watch of this dispatcher.
    watched: AtomicBool,
    /// How long a wait polls the CQ before it sleeps, in nanoseconds ([`AsyncCq::spin`]).
    spin_ns: AtomicU64,
    #[cfg(feature = "tokio")]
    stop: Arc<Stop>,
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        #[cfg(feature = "tokio")]
        self.stop.stop();
    }
}

impl Dispatcher {
    /// Poll the CQ until it is empty, routing every completion; then post from the backlogs.
    /// Returns how many completions were polled.
    fn progress(&self) -> Result<usize> {
        let total = poll_routed(
            &self.poll_lock,
            |buf, woken| self.cq.inner.poll_deferred(buf, woken),
            |w, wakers| self.route(w, wakers),
        )?;
        if total > 0 {
            for qp in self.attached() {
                qp.drain();
            }
        }
        Ok(total)
    }

    fn attached(&self) -> Vec<Arc<QpShared>> {
        lock(&self.qps).values().filter_map(Weak::upgrade).collect()
    }

    /// Hand `w` to the future or stream waiting for it; their wakers go to `wakers`.
    fn route(&self, w: WorkCompletion, wakers: &mut Wakers) {
        let qp = lock(&self.qps).get(&w.qp_num()).and_then(Weak::upgrade);
        // A queue pair not attached here: its request released what it held; nobody waits.
        let Some(qp) = qp else { return };
        if w.tag() & RECV_BIT != 0 {
            qp.recv_done(w, wakers);
        } else {
            qp.send_done(w, wakers);
        }
    }

    /// Wake every future and stream of every attached queue pair: each polls again, and meets
    /// the CQ's error itself (its fence's `check` polls the CQ) or registers again.
    fn wake_all(&self) {
        let mut wakers = Vec::new();
        for qp in self.attached() {
            {
                let st = lock(&qp.send);
                for (slot, _) in st.side.senders() {
                    wakers.extend(lock(&slot.st).waker.take());
                }
            }
            let mut r = lock(&qp.recv);
            wakers.extend(r.msg_waker.take());
            wakers.extend(r.imm_waker.take());
        }
        for w in wakers {
            w.wake();
        }
    }

    /// Whether anyone waits for a completion of this CQ.
    fn needs_polling(&self) -> bool {
        self.attached().iter().any(|q| q.needs_polling())
    }

    /// Poll the CQ until `done` or the spin time ([`AsyncCq::spin`]) has passed.
    fn spin(&self, done: impl Fn() -> bool) {
        let ns = self.spin_ns.load(Ordering::Relaxed);
        if ns == 0 {
            return;
        }
        let start = Instant::now();
        while !done() && start.elapsed().as_nanos() < ns as u128 {
            if self.progress().is_err() {
                return;
            }
            std::hint::spin_loop();
        }
    }

    /// Make sure a waker registered now is woken: by the completion-channel task when it runs,
    /// else by the completion thread, which polls the CQ while anyone waits.
    fn ensure_source(self: &Arc<Self>) -> Result<()> {
        if self.driven.load(Ordering::Acquire) || self.watched.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        thread::watch(Arc::new(ThreadWatch(Arc::downgrade(self)))).inspect_err(|_| {
            self.watched.store(false, Ordering::Release);
        })
    }
}

/// Poll with `poll` until it gives less than a full batch, routing each completion with
/// `route`, one poller at a time (`poll_lock`: completions are routed in the order the CQ gave
/// them). The wake-ups decided meanwhile (the released requests' flags, the routed futures' and
/// streams' wakers) run once `poll_lock` is let go: a waker may poll a future inline, and every
/// poll of a future or stream polls the CQ, taking `poll_lock`. Returns how many were polled.
fn poll_routed(
    poll_lock: &Mutex<()>,
    mut poll: impl FnMut(&mut [WorkCompletion], &mut Woken) -> Result<usize>,
    mut route: impl FnMut(WorkCompletion, &mut Wakers),
) -> Result<usize> {
    // Declared before the lock: dropped (woken) after it, also on an error.
    let mut woken = Woken::default();
    let mut wakers = Wakers::default();
    let _one = lock(poll_lock);
    let mut buf = [WorkCompletion::default(); POLL_BATCH];
    let mut total = 0;
    loop {
        let n = poll(&mut buf, &mut woken)?;
        for w in &buf[..n] {
            route(*w, &mut wakers);
        }
        total += n;
        if n < buf.len() {
            return Ok(total);
        }
    }
}

/// The completion thread's view of a dispatcher without a completion-channel task.
struct ThreadWatch(Weak<Dispatcher>);

impl Watch for ThreadWatch {
    fn poll(&self) -> Watched {
        let Some(d) = self.0.upgrade() else {
            return Watched::Done;
        };
        let got = match d.progress() {
            Ok(n) => n,
            Err(_) => {
                // The CQ cannot be polled: hand the error to the waiters, whose own polls meet
                // it (or succeed and register again, starting a new watch), and stop watching.
                d.watched.store(false, Ordering::Release);
                d.wake_all();
                return Watched::Done;
            }
        };
        if d.needs_polling() {
            return if got > 0 {
                Watched::Progress
            } else {
                Watched::Pending
            };
        }
        d.watched.store(false, Ordering::Release);
        // A waiter that came in since registers a watch of its own unless this one goes on.
        if d.needs_polling() && !d.watched.swap(true, Ordering::AcqRel) {
            return Watched::Pending;
        }
        Watched::Done
    }
}

/// The wake-up source of a completion channel: a tokio task per dispatcher that arms the CQ,
/// polls it, and waits for the channel's fd.
#[cfg(feature = "tokio")]
mod channel_task {
    use super::*;
    use crate::completion::fd::Readable;
    use std::os::fd::{AsFd, AsRawFd, RawFd};

    pub(super) struct ChanFd(pub(super) CompletionChannel);

    impl AsRawFd for ChanFd {
        fn as_raw_fd(&self) -> RawFd {
            self.0.as_fd().as_raw_fd()
        }
    }

    /// Start the task on the current tokio runtime; `false` outside one (or when the fd cannot
    /// be registered), leaving wake-ups to the completion thread.
    pub(super) fn start(d: &Arc<Dispatcher>, channel: CompletionChannel) -> bool {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return false;
        };
        if channel.set_nonblocking(true).is_err() {
            return false;
        }
        // SAFETY: ChanFd owns a handle of the channel, which keeps its fd open and the same
        // until the last handle is dropped.
        let Ok(fd) = (unsafe { Readable::new(ChanFd(channel)) }) else {
            return false;
        };
        d.driven.store(true, Ordering::Release);
        let weak = Arc::downgrade(d);
        let stop = d.stop.clone();
        rt.spawn(run(weak, fd, stop));
        true
    }

    async fn run(d: Weak<Dispatcher>, fd: Readable<ChanFd>, stop: Arc<Stop>) {
        loop {
            {
                let Some(d) = d.upgrade() else { return };
                // Arm, then poll: a completion that came before the arm is found by the poll,
                // one after it makes the fd readable.
                if d.cq.req_notify(false).is_err() || d.progress().is_err() {
                    return fail(&d);
                }
            }
            let ev = std::future::poll_fn(|cx| {
                if stop.is_stopped(cx) {
                    return Poll::Ready(None);
                }
                // Every event read is acknowledged (ibv_ack_cq_events) before it is returned.
                fd.poll_read_with(cx, "ibv_get_cq_event", |c| c.0.try_get_event())
                    .map(Some)
            })
            .await;
            match ev {
                None => return,
                Some(Ok(_)) => {}
                Some(Err(_)) => {
                    if let Some(d) = d.upgrade() {
                        fail(&d);
                    }
                    return;
                }
            }
        }
    }

    /// The channel failed: the completion thread takes over the wake-ups.
    fn fail(d: &Arc<Dispatcher>) {
        d.driven.store(false, Ordering::Release);
        let _ = d.ensure_source();
        // Waiters poll again: they meet the error, or register with the completion thread.
        d.wake_all();
    }
}

/// A completion queue whose completions are awaited: one dispatcher that polls it and routes
/// every completion by its tag to the future or stream waiting for it. Attach queue pairs with
/// [`attach`](Self::attach). Cheap to clone.
///
/// **Wake-ups.** Given a [`CompletionChannel`] that the CQ reports to, and made inside a tokio
/// runtime with the `tokio` feature, a task on that runtime arms the CQ (`ibv_req_notify_cq`),
/// polls it (so a completion that came before the arm is not missed), and waits for the
/// channel's fd through tokio's reactor; each event is read (`ibv_get_cq_event`) and
/// acknowledged (`ibv_ack_cq_events`) at once. Cost: one event, one wake of that task and one
/// re-arm per burst of completions, no CPU while nothing completes. Without a channel, without
/// the feature or outside a runtime, the process's completion thread polls the CQ while anyone
/// waits, pausing 64 µs, doubling up to 1 ms, between empty polls (see
/// [`completion`](crate::completion)): up to that pause in added latency, and a poll per pause
/// while work is pending. Every poll of a future or stream also polls the CQ first, so a
/// completion already there is seen without waiting for either source.
///
/// Completions of queue pairs that use this CQ but were not attached are released (their
/// requests drop what they held) and discarded.
#[derive(Clone)]
pub struct AsyncCq {
    disp: Arc<Dispatcher>,
}

impl AsyncCq {
    /// Take over `cq`, woken through `channel` (see [wake-ups](Self#wake-ups)).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `cq` does not report to `channel`, or the channel has
    /// other handles (it must serve this CQ alone: its events are consumed here).
    pub fn new(cq: CompletionQueue, channel: Option<CompletionChannel>) -> Result<AsyncCq> {
        if let Some(ch) = &channel {
            if !cq.reports_to(ch) {
                return Err(Error::invalid(
                    "channel",
                    format!("{ch:?}"),
                    "the completion queue was not created on this channel",
                ));
            }
            // One handle here and one held by the CQ.
            if ch.handles() > 2 {
                return Err(Error::invalid(
                    "channel",
                    format!("{ch:?}"),
                    "the channel must serve this completion queue alone (drop its other handles)",
                ));
            }
        }
        let disp = Arc::new(Dispatcher {
            cq,
            poll_lock: Mutex::new(()),
            room_lock: Mutex::new(()),
            qps: Mutex::new(HashMap::new()),
            driven: AtomicBool::new(false),
            watched: AtomicBool::new(false),
            spin_ns: AtomicU64::new(0),
            #[cfg(feature = "tokio")]
            stop: Arc::default(),
        });
        #[cfg(feature = "tokio")]
        if let Some(ch) = channel {
            channel_task::start(&disp, ch);
        }
        #[cfg(not(feature = "tokio"))]
        drop(channel);
        Ok(AsyncCq { disp })
    }

    /// The completion queue, to create queue pairs on it (then [`attach`](Self::attach) them).
    pub fn cq(&self) -> &CompletionQueue {
        &self.disp.cq
    }

    /// Before a wait sleeps, poll the CQ for up to `spin` (default zero): a completion that comes
    /// within it is seen without a wake-up (no channel event, no task switch), at the cost of
    /// that much CPU of the polling thread (an executor thread) per wait. At most 1 ms.
    ///
    /// A spin brings an awaited round trip closer to the blocking poll's (`tests/rdma_async.rs`
    /// measures both; `docs/benches.md` has the figures).
    pub fn spin(&self, spin: Duration) {
        let ns = spin.min(Duration::from_millis(1)).as_nanos() as u64;
        self.disp.spin_ns.store(ns, Ordering::Relaxed);
    }

    /// Whether a completion-channel task wakes the futures (else the completion thread polls).
    pub fn channel_driven(&self) -> bool {
        self.disp.driven.load(Ordering::Acquire)
    }

    /// Await the completions of `qp`, whose send and receive completions both go to this CQ.
    /// Up to `backlog` requests that find the send queue or the CQ full wait, in order, and
    /// are posted as room frees up.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `qp` reports to another CQ or uses a shared receive
    /// queue.
    pub fn attach(&self, qp: QueuePair<Rts>, backlog: usize) -> Result<AsyncQueuePair> {
        if !qp.uses_only(&self.disp.cq) {
            return Err(Error::invalid(
                "qp",
                qp.qp_num(),
                "an awaited queue pair reports its send and receive completions to this \
                 completion queue and has no shared receive queue",
            ));
        }
        let qp_num = qp.qp_num();
        let shared = Arc::new(QpShared {
            disp: self.disp.clone(),
            qp_num,
            send: Mutex::new(SendState {
                qp,
                side: SendSide::new(backlog),
            }),
            recv: Mutex::new(RecvState::default()),
        });
        lock(&self.disp.qps).insert(qp_num, Arc::downgrade(&shared));
        Ok(AsyncQueuePair { shared })
    }
}

impl Connection {
    /// Await this connection's completions: its CQ taken over by an [`AsyncCq`] (woken through
    /// the receive channel when [`ConnectOptions::recv_channel`](super::ConnectOptions) was set,
    /// else by the completion thread) and its queue pair attached with a backlog of `backlog`
    /// requests. The [`CmLink`] reports the peer's disconnect and disconnects when dropped.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the connection was made without
    /// [`ConnectOptions::one_cq`](super::ConnectOptions) (an awaited queue pair reports to one
    /// CQ) or on the caller's CQs (`connect_with`, `accept_with`).
    pub fn into_async(mut self, backlog: usize) -> Result<(AsyncCq, AsyncQueuePair, CmLink)> {
        let (qp, _, recv_cq) = self.parts();
        if !qp.uses_only(recv_cq) {
            return Err(Error::invalid(
                "connection",
                qp.qp_num(),
                "made with two completion queues: connect with ConnectOptions::one_cq",
            ));
        }
        let mut p = self.into_parts();
        let channel = p.link.take_channel();
        let cq = AsyncCq::new(p.recv_cq, channel)?;
        let qp = cq.attach(p.qp, backlog)?;
        Ok((cq, qp, p.link))
    }
}

impl std::fmt::Debug for AsyncCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncCq")
            .field("cq", &self.disp.cq)
            .field("channel_driven", &self.channel_driven())
            .finish()
    }
}

type Sender = (Arc<Slot>, u64);

struct SendState {
    qp: QueuePair<Rts>,
    side: SendSide<SendRequest<'static>, Sender>,
}

#[derive(Default)]
struct RecvState {
    posted: HashMap<u64, MrSlice>,
    msgs: VecDeque<Result<Received>>,
    imms: VecDeque<Result<(u32, u32)>>,
    msg_waker: Option<Waker>,
    imm_waker: Option<Waker>,
}

struct QpShared {
    disp: Arc<Dispatcher>,
    qp_num: u32,
    send: Mutex<SendState>,
    recv: Mutex<RecvState>,
}

impl Drop for QpShared {
    fn drop(&mut self) {
        // Never posted, and nobody can await them any more (a future keeps its queue pair):
        // answered all the same.
        let left = lock(&self.send).side.take_backlog();
        for (_, _, (slot, _)) in left {
            slot.fill(Err(Error::Unsupported {
                what: "an RDMA work request".into(),
                reason: "its queue pair was dropped before the request was posted".into(),
            }));
        }
        let mut qps = lock(&self.disp.qps);
        if qps.get(&self.qp_num).is_some_and(|w| w.strong_count() == 0) {
            qps.remove(&self.qp_num);
        }
    }
}

/// Post `req` under `id` if the send queue and the CQ have room for it.
fn offer(
    disp: &Dispatcher,
    qp: &mut QueuePair<Rts>,
    id: u64,
    mut req: SendRequest<'static>,
) -> Offer<SendRequest<'static>> {
    let _room = lock(&disp.room_lock);
    if qp.send_outstanding() >= qp.caps().max_send_wr as usize || disp.cq.available() == 0 {
        return Offer::NoRoom(req);
    }
    req.tag = id;
    req.signaled = true;
    match qp.post_send([req]) {
        Ok(_) => Offer::Posted,
        Err(e) => Offer::Failed(e),
    }
}

/// The error a failed completion stands for.
fn wc_error(w: &WorkCompletion) -> Error {
    Error::WorkCompletion {
        status: w.status(),
        vendor_err: w.vendor_err(),
        qp_num: w.qp_num(),
    }
}

/// The tag of a new request (send or receive), unique in the process: a completion that reaches
/// a queue pair other than its own (one that got a destroyed queue pair's number) matches none
/// of its requests.
fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed) & !RECV_BIT
}

impl QpShared {
    fn send_done(&self, mut w: WorkCompletion, wakers: &mut Wakers) {
        let sender = lock(&self.send).side.complete(w.tag());
        if let Some((slot, tag)) = sender {
            w.set_tag(tag);
            slot.fill_deferred(Ok(w), wakers);
        }
    }

    fn recv_done(&self, mut w: WorkCompletion, wakers: &mut Wakers) {
        let mut st = lock(&self.recv);
        let Some(buf) = st.posted.remove(&w.tag()) else {
            return;
        };
        w.set_tag(0);
        let (mut m, mut i) = (None, None);
        if !w.is_ok() {
            // Failed or flushed: both streams hear of it.
            st.msgs.push_back(Err(wc_error(&w)));
            st.imms.push_back(Err(wc_error(&w)));
            m = st.msg_waker.take();
            i = st.imm_waker.take();
        } else if w.opcode() == WcOpcode::RecvRdmaWithImm {
            st.imms
                .push_back(Ok((w.imm().unwrap_or_default(), w.byte_len())));
            i = st.imm_waker.take();
        } else {
            st.msgs.push_back(Ok(Received { wc: w, buf }));
            m = st.msg_waker.take();
        }
        drop(st);
        wakers.extend([m, i].into_iter().flatten());
    }

    /// Post what the backlog holds while there is room.
    fn drain(&self) {
        let mut failed = Vec::new();
        {
            let mut st = lock(&self.send);
            if st.side.queued() == 0 {
                return;
            }
            let SendState { qp, side } = &mut *st;
            side.drain(|id, req| offer(&self.disp, qp, id, req), &mut failed);
        }
        for (_, (slot, _), e) in failed {
            slot.fill(Err(e));
        }
    }

    fn needs_polling(&self) -> bool {
        if lock(&self.send).side.waiting() > 0 {
            return true;
        }
        let r = lock(&self.recv);
        r.msg_waker.is_some() || r.imm_waker.is_some()
    }
}

/// A queue pair in RTS whose work completions are awaited ([`AsyncCq::attach`]). Cheap to
/// clone; every clone posts to the same queue pair, from any thread.
///
/// [`post`](Self::post) (and [`send`](Self::send), [`write`](Self::write),
/// [`read`](Self::read)) give a [`WcFuture`] of the request's work completion; receives posted
/// with [`post_recv`](Self::post_recv) arrive through [`messages`](Self::messages) (a
/// [`Stream`](futures_core::Stream) of filled buffers) and [`immediates`](Self::immediates)
/// (RDMA writes with immediate: a stream of `(immediate, length)`).
///
/// # Backlog
///
/// A request that finds the send queue or the CQ full waits in the queue pair's backlog (of the
/// size given to [`AsyncCq::attach`]) and is posted, in order, when a completion frees room; a
/// request never overtakes an earlier one. When the backlog is full too, posting answers
/// [`Error::QueueFull`] naming `backlog`, and nothing of the request is kept. Every request
/// accepted is answered exactly once: its completion, or the error of its post.
///
/// # Ownership
///
/// A posted request's slices are held by the queue pair until its completion is polled, as with
/// [`QueuePair::post_send`]. Dropping a [`WcFuture`] cancels the wait, never the request: its
/// memory stays owned until the NIC is done with it (see [`WcFuture`]). Dropping the last
/// handle (and every future) drops the queue pair, with its bounded teardown.
#[derive(Clone)]
pub struct AsyncQueuePair {
    shared: Arc<QpShared>,
}

impl AsyncQueuePair {
    /// The queue pair's number.
    pub fn qp_num(&self) -> u32 {
        self.shared.qp_num
    }

    /// `ibv_post_send` of one request (made signaled), now or from the backlog; a future of its
    /// work completion. The request's [`tag`](SendRequest::tag) comes back in the completion.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a request that breaks a rule (see [`SendRequest`]; checked
    /// before anything is queued); [`Error::QueueFull`] naming `backlog` when the send queue
    /// (or CQ) and the backlog are full; [`Error::Os`] naming `ibv_post_send`.
    #[doc(alias = "ibv_post_send")]
    pub fn post(&self, req: SendRequest<'static>) -> Result<WcFuture> {
        let s = &self.shared;
        let slot = Arc::new(Slot::default());
        let slices = req.sg.slices().to_vec();
        {
            let mut st = lock(&s.send);
            st.qp.check_send(&req)?;
            let id = next_id();
            let user_tag = req.tag;
            let SendState { qp, side } = &mut *st;
            side.submit(id, req, (slot.clone(), user_tag), |id, req| {
                offer(&s.disp, qp, id, req)
            })?;
        }
        let fence = WcFence {
            slot: slot.clone(),
            qp: s.clone(),
        };
        Ok(WcFuture {
            inner: InFlight::new("an RDMA work request", fence, Held { slices, slot })
                .into_future(),
        })
    }

    /// [`post`](Self::post) of [`SendRequest::send`].
    ///
    /// # Errors
    ///
    /// As [`post`](Self::post).
    #[doc(alias = "ibv_post_send")]
    pub fn send(&self, local: MrSlice) -> Result<WcFuture> {
        self.post(SendRequest::send(local))
    }

    /// [`post`](Self::post) of [`SendRequest::write`].
    ///
    /// # Errors
    ///
    /// As [`post`](Self::post).
    #[doc(alias = "ibv_post_send")]
    pub fn write(&self, local: MrSlice, remote: RemoteSlice) -> Result<WcFuture> {
        self.post(SendRequest::write(local, remote))
    }

    /// [`post`](Self::post) of [`SendRequest::read`].
    ///
    /// # Errors
    ///
    /// As [`post`](Self::post).
    #[doc(alias = "ibv_post_send")]
    pub fn read(&self, local: MrSlice, remote: RemoteSlice) -> Result<WcFuture> {
        self.post(SendRequest::read(local, remote))
    }

    /// `ibv_post_recv` of one receive into `buf`; its completion arrives on
    /// [`messages`](Self::messages) (a send) or [`immediates`](Self::immediates) (an RDMA
    /// write with immediate). Receives have no backlog.
    ///
    /// # Errors
    ///
    /// As [`QueuePair::post_recv`]: [`Error::QueueFull`] when the receive queue or the CQ is
    /// full.
    #[doc(alias = "ibv_post_recv")]
    pub fn post_recv(&self, buf: MrSlice) -> Result<()> {
        let s = &self.shared;
        let id = next_id() | RECV_BIT;
        let mut st = lock(&s.send);
        lock(&s.recv).posted.insert(id, buf.clone());
        let _room = lock(&s.disp.room_lock);
        match st.qp.post_recv([RecvRequest::new(buf).tag(id)]) {
            Ok(_) => Ok(()),
            Err(e) => {
                lock(&s.recv).posted.remove(&id);
                Err(e)
            }
        }
    }

    /// The received messages, in order. One consumer at a time: each item goes to one poller,
    /// and only the last poller's waker is kept.
    pub fn messages(&self) -> Messages {
        Messages {
            shared: self.shared.clone(),
        }
    }

    /// The RDMA writes with immediate received, as `(immediate, length)`, in order (their
    /// receive buffers are released). One consumer at a time.
    pub fn immediates(&self) -> Immediates {
        Immediates {
            shared: self.shared.clone(),
        }
    }

    /// Requests accepted and not yet answered (posted or in the backlog).
    pub fn in_flight(&self) -> usize {
        lock(&self.shared.send).side.waiting()
    }

    /// Requests waiting in the backlog.
    pub fn backlogged(&self) -> usize {
        lock(&self.shared.send).side.queued()
    }
}

impl std::fmt::Debug for AsyncQueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncQueuePair")
            .field("qp_num", &self.shared.qp_num)
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

/// The fence of a send-queue request: complete once its completion (or the error of its post)
/// was delivered. Asking polls the CQ.
struct WcFence {
    slot: Arc<Slot>,
    qp: Arc<QpShared>,
}

impl Fence for WcFence {
    fn is_complete(&self) -> bool {
        if !self.slot.is_done() {
            let _ = self.qp.disp.progress();
        }
        self.slot.is_done()
    }

    fn check(&self) -> Result<bool> {
        if !self.slot.is_done() {
            self.qp.disp.progress()?;
        }
        Ok(self.slot.is_done())
    }

    fn register_waker(&self, waker: &Waker) -> bool {
        self.qp.disp.spin(|| self.slot.is_done());
        self.slot.register(waker);
        self.qp.disp.ensure_source().is_ok()
    }
}

/// What an awaited request owns: its slices (also held by the queue pair until the completion),
/// and where the completion lands.
struct Held {
    slices: Vec<MrSlice>,
    slot: Arc<Slot>,
}

/// The work completion of one request posted with [`AsyncQueuePair::post`].
///
/// Output: the [`Completed`] request (its completion and its slices), or
/// [`Error::WorkCompletion`] when the NIC reported a failure, or the error of a post from the
/// backlog.
///
/// **Deadline**: [`deadline`](Self::deadline) / [`timeout`](Self::timeout) end the wait with
/// [`Error::Timeout`] naming the operation and the time waited; the request stays posted and
/// the queue pair usable, and what it holds stays owned until its completion.
///
/// **Cancellation**: dropping the future cancels the wait, not the request: the queue pair
/// keeps the request's slices until its completion is polled (and the future's own copies are
/// parked in the [`Tracker`](crate::completion::Tracker) until then); nothing is freed early and
/// the completion is still consumed, so nothing is lost for later requests.
#[must_use = "futures do nothing unless awaited; dropping it cancels the wait, not the request"]
pub struct WcFuture {
    inner: InFlightFuture<Held, WcFence>,
}

impl WcFuture {
    /// End with [`Error::Timeout`] if the completion has not come by `at`.
    pub fn deadline(self, at: Instant) -> Self {
        WcFuture {
            inner: self.inner.deadline(at),
        }
    }

    /// [`deadline`](Self::deadline) `timeout` from now.
    pub fn timeout(self, timeout: Duration) -> Self {
        WcFuture {
            inner: self.inner.timeout(timeout),
        }
    }
}

impl Future for WcFuture {
    type Output = Result<Completed>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Completed>> {
        match Pin::new(&mut self.inner).poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Ready(Ok(held)) => {
                let r = held.slot.take().unwrap_or_else(|| {
                    Err(Error::Unsupported {
                        what: "an RDMA work completion".into(),
                        reason: "taken twice".into(),
                    })
                });
                Poll::Ready(r.and_then(|wc| {
                    wc.result()?;
                    Ok(Completed {
                        wc,
                        slices: held.slices,
                    })
                }))
            }
        }
    }
}

impl std::fmt::Debug for WcFuture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WcFuture")
            .field("inner", &self.inner)
            .finish()
    }
}

/// A request that completed successfully: its work completion and the slices it used.
#[derive(Debug)]
pub struct Completed {
    wc: WorkCompletion,
    slices: Vec<MrSlice>,
}

impl Completed {
    /// The work completion (with the request's tag).
    pub fn wc(&self) -> &WorkCompletion {
        &self.wc
    }

    /// The slices the request used (an RDMA read's target now holds the data).
    pub fn into_slices(self) -> Vec<MrSlice> {
        self.slices
    }
}

/// A message received: its completion and the filled buffer.
#[derive(Debug)]
pub struct Received {
    wc: WorkCompletion,
    buf: MrSlice,
}

impl Received {
    /// Bytes received.
    pub fn len(&self) -> u32 {
        self.wc.byte_len()
    }

    /// Whether the message was empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The immediate data of a send with immediate.
    pub fn imm(&self) -> Option<u32> {
        self.wc.imm()
    }

    /// The bytes received (a copy of the first [`len`](Self::len) bytes of the buffer).
    pub fn bytes(&self) -> Vec<u8> {
        self.buf.to_vec(self.len() as usize)
    }

    /// The work completion.
    pub fn wc(&self) -> &WorkCompletion {
        &self.wc
    }

    /// The buffer, to read or to post again.
    pub fn into_buf(self) -> MrSlice {
        self.buf
    }
}

fn poll_stream<T>(
    shared: &Arc<QpShared>,
    cx: &Context<'_>,
    pick: impl Fn(&mut RecvState) -> (&mut VecDeque<Result<T>>, &mut Option<Waker>),
) -> Poll<Option<Result<T>>> {
    if let Err(e) = shared.disp.progress() {
        return Poll::Ready(Some(Err(e)));
    }
    shared
        .disp
        .spin(|| !pick(&mut lock(&shared.recv)).0.is_empty());
    {
        let mut st = lock(&shared.recv);
        let (q, w) = pick(&mut st);
        if let Some(item) = q.pop_front() {
            return Poll::Ready(Some(item));
        }
        *w = Some(cx.waker().clone());
    }
    if let Err(e) = shared.disp.ensure_source() {
        return Poll::Ready(Some(Err(e)));
    }
    Poll::Pending
}

/// The messages a queue pair receives ([`AsyncQueuePair::messages`]): each item is the filled
/// buffer, or the error of a failed receive (a flush when the queue pair failed). Never ends.
#[derive(Debug)]
pub struct Messages {
    shared: Arc<QpShared>,
}

impl futures_core::Stream for Messages {
    type Item = Result<Received>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        poll_stream(&self.shared, cx, |st| (&mut st.msgs, &mut st.msg_waker))
    }
}

/// RDMA writes with immediate received ([`AsyncQueuePair::immediates`]): `(immediate, length)`
/// of each, or the error of a failed receive. Never ends.
#[derive(Debug)]
pub struct Immediates {
    shared: Arc<QpShared>,
}

impl futures_core::Stream for Immediates {
    type Item = Result<(u32, u32)>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        poll_stream(&self.shared, cx, |st| (&mut st.imms, &mut st.imm_waker))
    }
}

impl std::fmt::Debug for QpShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncQueuePair")
            .field("qp_num", &self.qp_num)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completion::testing::CountWakes;

    #[test]
    fn wake_ups_decided_while_polling_run_once_the_poll_lock_is_let_go() {
        use crate::completion::CompletionFlag;
        use std::sync::atomic::AtomicU32;
        use std::task::Wake;
        // Counts wake-ups that found the poll lock free: a waker that polls a future inline
        // polls the CQ, which takes it (held, it waited for itself).
        struct Probe(Arc<Mutex<()>>, AtomicU32);
        impl Wake for Probe {
            fn wake(self: Arc<Self>) {
                self.wake_by_ref()
            }
            fn wake_by_ref(self: &Arc<Self>) {
                if self.0.try_lock().is_ok() {
                    self.1.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
        let poll_lock = Arc::new(Mutex::new(()));
        let probe = Arc::new(Probe(poll_lock.clone(), AtomicU32::new(0)));
        let waker = Waker::from(probe.clone());
        // A future's slot, a stream's waker, and a request's own flag (SendRequest::notify).
        let slot = Slot::default();
        slot.register(&waker);
        let flag = CompletionFlag::new();
        assert!(flag.register_waker(&waker));
        let mut polls = 0;
        let n = poll_routed(
            &poll_lock,
            |buf, woken| {
                polls += 1;
                if polls > 1 {
                    return Ok(0);
                }
                woken.push(flag.clone());
                buf[0] = WorkCompletion::default();
                buf[1] = WorkCompletion::default();
                Ok(buf.len())
            },
            |w, wakers| {
                if slot.is_done() {
                    wakers.extend([waker.clone()]);
                } else {
                    slot.fill_deferred(Ok(w), wakers);
                }
            },
        )
        .unwrap();
        assert_eq!(n, POLL_BATCH);
        assert!(slot.is_done() && flag.is_complete());
        assert_eq!(
            probe.1.load(Ordering::SeqCst),
            POLL_BATCH as u32 + 1,
            "every wake-up ran with the poll lock free"
        );
        // An error of the poll: what was decided before it still runs, unlocked.
        let flag = CompletionFlag::new();
        assert!(flag.register_waker(&waker));
        let r = poll_routed(
            &poll_lock,
            |_, woken| {
                woken.push(flag.clone());
                Err(Error::errno("ibv_poll_cq", libc::EIO))
            },
            |_, _| unreachable!("nothing polled"),
        );
        assert!(r.is_err());
        assert!(flag.is_complete());
        assert_eq!(probe.1.load(Ordering::SeqCst), POLL_BATCH as u32 + 2);
    }

    #[test]
    fn a_slot_is_filled_once_and_wakes_its_waiter_once() {
        let wakes = Arc::new(CountWakes::default());
        let waker = Waker::from(wakes.clone());
        let slot = Slot::default();
        slot.register(&waker);
        assert!(!slot.is_done());
        slot.fill(Ok(WorkCompletion::default()));
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
        // A second outcome is ignored: the first stays.
        slot.fill(Err(Error::QueueFull {
            queue: "backlog",
            depth: 1,
        }));
        assert!(slot.is_done());
        assert!(matches!(slot.take(), Some(Ok(_))));
        assert!(slot.take().is_none());
        // Registering after the fill keeps nothing (the poller sees it done).
        slot.register(&waker);
        assert!(lock(&slot.st).waker.is_none());
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn fills_racing_registrations_are_never_lost() {
        for _ in 0..200 {
            let wakes = Arc::new(CountWakes::default());
            let waker = Waker::from(wakes.clone());
            let slot = Arc::new(Slot::default());
            let s2 = slot.clone();
            let t = std::thread::spawn(move || s2.fill(Ok(WorkCompletion::default())));
            slot.register(&waker);
            let done_after_register = slot.is_done();
            t.join().unwrap();
            // Either the poller saw it done right after registering, or the fill woke it.
            assert!(done_after_register || wakes.0.load(Ordering::SeqCst) == 1);
        }
    }
}
