//! Completion queues, the lending poll cursor, completion channels, and work completions.

use super::context::{Context, CtxInner, set_nonblocking};
use super::ffi::{free_in_parent, nonnull, rc, verbs};
use super::posted::{PostedTables, Room, WrId};
use super::srq::SrqInner;
use super::teardown::{COUNTERS, Counters};
use crate::completion::deferred::Woken;
use crate::error::{Error, Result, WcStatus};
use gpudirect_sys::ibverbs as ibv;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// How many completions one [`CompletionQueue::poll`] fetches at most.
pub const POLL_BATCH: usize = 32;

impl Context {
    /// `ibv_create_comp_channel`—a completion channel (an fd that becomes readable on events).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `ibv_create_comp_channel`.
    #[doc(alias = "ibv_create_comp_channel")]
    pub fn create_comp_channel(&self) -> Result<CompletionChannel> {
        CompletionChannel::new(self)
    }

    /// `ibv_create_cq(ctx, cqe, NULL, channel, 0)`—a completion queue with room for at least `cqe`
    /// completions, optionally reporting to `channel`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for `cqe` 0; [`Error::Os`] naming `ibv_create_cq`.
    #[doc(alias = "ibv_create_cq")]
    pub fn create_cq(
        &self,
        cqe: u32,
        channel: Option<&CompletionChannel>,
    ) -> Result<CompletionQueue> {
        CompletionQueue::new(self, cqe, channel)
    }
}

pub(crate) struct ChannelInner {
    ch: NonNull<ibv::ibv_comp_channel>,
    _ctx: Arc<CtxInner>,
}

// SAFETY: completion channels are used through thread-safe libibverbs calls.
unsafe impl Send for ChannelInner {}
// SAFETY: as above.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        free_in_parent(ibv::lib, |l| {
            // SAFETY: every CQ using the channel holds an Arc to it, so none is alive.
            unsafe { (l.ibv_destroy_comp_channel)(self.ch.as_ptr()) };
        });
    }
}

/// `ibv_create_comp_channel`—an fd that becomes readable when an armed CQ gets a completion.
/// Cheap to clone.
#[derive(Clone)]
#[doc(alias = "ibv_comp_channel")]
pub struct CompletionChannel {
    inner: Arc<ChannelInner>,
}

/// One completion event, already acknowledged (`ibv_ack_cq_events`). Say which CQ it was for with
/// [`CompletionQueue::is_event_for`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CqEvent {
    cq: usize,
}

impl CompletionChannel {
    fn new(ctx: &Context) -> Result<Self> {
        let l = verbs()?;
        // SAFETY: a live context.
        let ch = nonnull("ibv_create_comp_channel", unsafe {
            (l.ibv_create_comp_channel)(ctx.as_raw())
        })?;
        Ok(CompletionChannel {
            inner: Arc::new(ChannelInner {
                ch,
                _ctx: ctx.inner.clone(),
            }),
        })
    }

    /// Make [`get_event`](Self::get_event) answer `EAGAIN` instead of blocking (or block again).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `fcntl`.
    pub fn set_nonblocking(&self, nonblocking: bool) -> Result<()> {
        set_nonblocking(self.as_fd(), nonblocking)
    }

    /// `ibv_get_cq_event` then `ibv_ack_cq_events(cq, 1)`—wait for the next event of any CQ on
    /// this channel. Every event is acknowledged before this returns, so destroying a CQ never
    /// waits on unacknowledged events. Re-arm with [`CompletionQueue::req_notify`].
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `ibv_get_cq_event` (`EAGAIN` when non-blocking and none is ready).
    #[doc(alias = "ibv_get_cq_event")]
    #[doc(alias = "ibv_ack_cq_events")]
    pub fn get_event(&self) -> Result<CqEvent> {
        let l = verbs()?;
        let mut cq = std::ptr::null_mut();
        let mut ctx = std::ptr::null_mut();
        // SAFETY: a live channel and two out-pointers.
        rc("ibv_get_cq_event", unsafe {
            (l.ibv_get_cq_event)(self.inner.ch.as_ptr(), &mut cq, &mut ctx)
        })?;
        // SAFETY: the CQ the event reported; ibv_destroy_cq waits for this ack, so it is live.
        unsafe { (l.ibv_ack_cq_events)(cq, 1) };
        Ok(CqEvent { cq: cq as usize })
    }

    /// [`get_event`](Self::get_event) for a non-blocking channel, answering
    /// [`io::ErrorKind::WouldBlock`](std::io::ErrorKind::WouldBlock) when no event is queued.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn try_get_event(&self) -> std::io::Result<CqEvent> {
        self.get_event().map_err(|e| match e {
            Error::Os { source, .. } => source,
            other => std::io::Error::other(other.to_string()),
        })
    }

    /// How many handles share this channel (its CQs hold one each).
    pub(crate) fn handles(&self) -> usize {
        Arc::strong_count(&self.inner)
    }
}

impl AsFd for CompletionChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the channel owns its fd for as long as it lives; the borrow is tied to `self`.
        unsafe { BorrowedFd::borrow_raw((*self.inner.ch.as_ptr()).fd) }
    }
}

impl fmt::Debug for CompletionChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionChannel")
            .field("fd", &self.as_fd())
            .finish()
    }
}

struct CqState {
    /// Queue pairs using this CQ, by QP number: their posted-request tables.
    qps: HashMap<u32, Arc<PostedTables>>,
    /// Shared receive queues whose receives may complete here, by id (their room is reserved for
    /// the CQ's life: completions may outlive the queue pairs that took them).
    srqs: HashMap<u32, Weak<SrqInner>>,
    /// Completions polled on behalf of someone else (a dropped QP's drain), not yet returned.
    pending: VecDeque<WorkCompletion>,
}

pub(crate) struct CqInner {
    cq: NonNull<ibv::ibv_cq>,
    _channel: Option<Arc<ChannelInner>>,
    _ctx: Arc<CtxInner>,
    state: Mutex<CqState>,
    /// Completions that posted work may still produce here, against the granted capacity.
    room: Room,
}

// SAFETY: ibv_poll_cq is thread-safe in rdma-core providers; our state is behind a Mutex.
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        free_in_parent(ibv::lib, |l| {
            // SAFETY: every QP using the CQ holds an Arc to it, so none is alive; all events were
            // acknowledged when they were read. Failure leaks the CQ.
            if unsafe { (l.ibv_destroy_cq)(self.cq.as_ptr()) } == 0 {
                Counters::count(&COUNTERS.cq_destroyed);
            } else {
                Counters::count(&COUNTERS.cq_leaked);
            }
        });
    }
}

impl CqInner {
    fn lock(&self) -> MutexGuard<'_, CqState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn register(&self, qp_num: u32, posted: Arc<PostedTables>) {
        self.lock().qps.insert(qp_num, posted);
    }

    /// Forget the tables `posted` registered under `qp_num`, and the destroyed queue pair's
    /// completions held back here: a queue pair made since may get that number, and they are
    /// not its own (a queue pair made since the destroy that holds it already keeps its tables).
    pub(crate) fn unregister(&self, qp_num: u32, posted: &Arc<PostedTables>) {
        forget_qp(&mut self.lock(), qp_num, posted);
    }

    pub(crate) fn room(&self) -> &Room {
        &self.room
    }

    /// Let receives of `srq` complete here: the first time, reserve room for its whole depth (kept
    /// for the CQ's life, since its completions may outlive the queue pairs that took them).
    ///
    /// # Errors
    ///
    /// [`Error::QueueFull`] naming the completion queue when that room is not there.
    pub(crate) fn link_srq(&self, srq: &Arc<SrqInner>) -> Result<()> {
        let mut st = self.lock();
        if st.srqs.get(&srq.id()).is_some_and(|w| w.strong_count() > 0) {
            return Ok(());
        }
        self.room.reserve(srq.depth())?;
        st.srqs.insert(srq.id(), Arc::downgrade(srq));
        Ok(())
    }

    pub(crate) fn as_ptr(&self) -> *mut ibv::ibv_cq {
        self.cq.as_ptr()
    }

    /// Poll up to `out.len()` completions: first those held back, then the CQ's. Each one's
    /// posted resources are released (its request's slices dropped) before it is returned.
    pub(crate) fn poll_into(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        // Dropped after the call: the released requests' flags are set once its lock is let go.
        let mut woken = Woken::default();
        self.poll_deferred(out, &mut woken)
    }

    /// [`poll_into`](Self::poll_into), the released requests' flags put in `woken` (for a
    /// caller that holds a lock of its own while it polls: it sets them once that is let go).
    pub(crate) fn poll_deferred(
        &self,
        out: &mut [WorkCompletion],
        woken: &mut Woken,
    ) -> Result<usize> {
        self.poll_from(out, woken, true)
    }

    /// Poll the CQ itself, leaving the completions held back where they are (a drain that
    /// holds back what it polls for others would otherwise take them again, and only them).
    pub(crate) fn poll_fresh(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let mut woken = Woken::default();
        self.poll_from(out, &mut woken, false)
    }

    /// Poll up to `out.len()` completions: those held back first when `held`, then the CQ's.
    fn poll_from(
        &self,
        out: &mut [WorkCompletion],
        woken: &mut Woken,
        held: bool,
    ) -> Result<usize> {
        let mut st = self.lock();
        let mut n = 0;
        while held && n < out.len() {
            match st.pending.pop_front() {
                Some(w) => {
                    out[n] = w;
                    n += 1;
                }
                None => break,
            }
        }
        if n < out.len() {
            let want = (out.len() - n).min(i32::MAX as usize);
            // WorkCompletion is a transparent ibv_wc: the provider writes straight into `out`.
            let dst = out[n..].as_mut_ptr().cast::<ibv::ibv_wc>();
            // SAFETY: a live CQ and room for `want` entries.
            let got = unsafe { ibv::ibv_poll_cq(self.cq.as_ptr(), want as i32, dst) };
            if got < 0 {
                return Err(Error::errno("ibv_poll_cq", got.saturating_neg()));
            }
            // A provider never reports more than asked; if one did, the rest is not ours to read.
            let got = (got as usize).min(want);
            let mut freed = 0u32;
            for w in &mut out[n..n + got] {
                // The library's wr_id becomes the caller's tag once the request is released.
                let (tag, f) = match WrId::decode(w.0.wr_id) {
                    WrId::Srq { srq, slot } => match st.srqs.get(&srq).and_then(Weak::upgrade) {
                        Some(s) => (s.complete(slot, woken), 0),
                        None => (0, 0),
                    },
                    _ => match st.qps.get(&w.0.qp_num) {
                        Some(posted) => posted.complete(&w.0, woken),
                        None => (0, 0),
                    },
                };
                freed = freed.saturating_add(f);
                w.0.wr_id = tag;
            }
            self.room.release(freed);
            n += got;
        }
        Ok(n)
    }

    /// Hold back completions polled for someone else.
    pub(crate) fn hold(&self, w: WorkCompletion) {
        self.lock().pending.push_back(w);
    }
}

#[cfg(test)]
impl CqInner {
    /// A CQ over `cq` (a fake provider's), with `qps` registered and completions of the QPs
    /// `held` held back (tagged with their index); it must be leaked (`mem::forget`): its drop
    /// would destroy `cq`.
    pub(crate) fn fake(
        cq: NonNull<ibv::ibv_cq>,
        qps: HashMap<u32, Arc<PostedTables>>,
        held: &[u32],
    ) -> Arc<CqInner> {
        let pending = held
            .iter()
            .enumerate()
            .map(|(i, &qp_num)| {
                let mut w = WorkCompletion::default();
                w.0.qp_num = qp_num;
                w.0.wr_id = i as u64;
                w
            })
            .collect();
        Arc::new(CqInner {
            cq,
            _channel: None,
            _ctx: super::context::CtxInner::fake(),
            state: Mutex::new(CqState {
                qps,
                srqs: HashMap::new(),
                pending,
            }),
            room: Room::new(64),
        })
    }

    /// The completions held back: their QP numbers and tags, in order.
    pub(crate) fn held(&self) -> Vec<(u32, u64)> {
        let st = self.lock();
        st.pending.iter().map(|w| (w.0.qp_num, w.0.wr_id)).collect()
    }
}

/// Remove `qp_num`'s entry if it is `posted`, with the completions of `qp_num` held back (what
/// they released was released when they were polled).
fn forget_qp(st: &mut CqState, qp_num: u32, posted: &Arc<PostedTables>) {
    if st.qps.get(&qp_num).is_some_and(|p| Arc::ptr_eq(p, posted)) {
        st.qps.remove(&qp_num);
        st.pending.retain(|w| w.0.qp_num != qp_num);
    }
}

/// `ibv_create_cq`—a completion queue. Poll it with [`CompletionQueue::poll`], which lends its
/// completions until the next poll. Queue pairs using it keep it alive.
#[doc(alias = "ibv_cq")]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
    buf: Box<[WorkCompletion; POLL_BATCH]>,
    cqe: u32,
}

impl CompletionQueue {
    fn new(ctx: &Context, cqe: u32, channel: Option<&CompletionChannel>) -> Result<Self> {
        let max = ctx.query_device().map(|a| a.max_cqe).ok();
        check_cqe(cqe, max)?;
        let l = verbs()?;
        let ch = channel.map_or(std::ptr::null_mut(), |c| c.inner.ch.as_ptr());
        // SAFETY: a live context, and a live channel of it or NULL; `cqe` fits an int (checked).
        let p = unsafe { (l.ibv_create_cq)(ctx.as_raw(), cqe as i32, std::ptr::null_mut(), ch, 0) };
        let cq = nonnull("ibv_create_cq", p)?;
        // SAFETY: a CQ just created.
        let actual = unsafe { (*p).cqe }.max(0) as u32;
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                cq,
                _channel: channel.map(|c| c.inner.clone()),
                _ctx: ctx.inner.clone(),
                state: Mutex::new(CqState {
                    qps: HashMap::new(),
                    srqs: HashMap::new(),
                    pending: VecDeque::new(),
                }),
                room: Room::new(actual),
            }),
            buf: Box::new([WorkCompletion::default(); POLL_BATCH]),
            cqe: actual,
        })
    }

    /// A second handle of the same CQ (its own poll buffer), for a connection whose send and
    /// receive completions go to one CQ.
    pub(crate) fn share(&self) -> CompletionQueue {
        CompletionQueue {
            inner: self.inner.clone(),
            buf: Box::new([WorkCompletion::default(); POLL_BATCH]),
            cqe: self.cqe,
        }
    }

    /// Entries, as the provider rounded them up: the most completions it ever holds.
    pub fn capacity(&self) -> u32 {
        self.cqe
    }

    /// Completions the work posted so far may still produce here: every request not yet known
    /// complete on the queue pairs using this CQ (signaled or not), one per queue pair for its
    /// teardown, and the depth of each shared receive queue served here. Never above
    /// [`capacity`](Self::capacity): posting beyond it is refused.
    pub fn reserved(&self) -> u32 {
        self.inner.room.reserved()
    }

    /// `capacity() - reserved()`: how many more requests may be posted to queue pairs reporting
    /// here right now.
    pub fn available(&self) -> u32 {
        self.inner
            .room
            .capacity()
            .saturating_sub(self.inner.room.reserved())
    }

    /// The raw `ibv_cq`, valid while `self` is.
    pub fn as_raw(&self) -> *mut ibv::ibv_cq {
        self.inner.as_ptr()
    }

    pub(crate) fn ctx_ptr(&self) -> *mut ibv::ibv_context {
        self.inner._ctx.ctx.as_ptr()
    }

    /// `ibv_poll_cq`—fetch up to [`POLL_BATCH`] completions. They are lent: each borrows the CQ
    /// and is gone at the next poll. Each completion's request has released what it held (its
    /// slices) by the time it is seen, and its [`CompletionFlag`](crate::completion::CompletionFlag),
    /// if any, is set.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `ibv_poll_cq` when the provider reports an error.
    #[doc(alias = "ibv_poll_cq")]
    pub fn poll(&mut self) -> Result<Completions<'_>> {
        let n = self.inner.poll_into(&mut self.buf[..])?;
        Ok(Completions {
            items: self.buf[..n].iter(),
        })
    }

    /// `ibv_req_notify_cq`—arm the channel: the next completion (or next solicited one) makes it
    /// readable. Poll after arming to catch completions that raced with it.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `ibv_req_notify_cq`.
    #[doc(alias = "ibv_req_notify_cq")]
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        verbs()?;
        // SAFETY: a live CQ.
        rc("ibv_req_notify_cq", unsafe {
            ibv::ibv_req_notify_cq(self.inner.as_ptr(), solicited_only as i32)
        })
    }

    /// Whether this CQ reports to `channel`.
    pub(crate) fn reports_to(&self, channel: &CompletionChannel) -> bool {
        self.inner
            ._channel
            .as_ref()
            .is_some_and(|c| Arc::ptr_eq(c, &channel.inner))
    }

    /// Whether `ev` was reported for this CQ.
    pub fn is_event_for(&self, ev: &CqEvent) -> bool {
        ev.cq == self.inner.as_ptr() as usize
    }
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("cqe", &self.cqe)
            .field("reserved", &self.reserved())
            .finish()
    }
}

/// A CQ size is 1..=`max` (the device's `max_cqe`, where known) and fits a C `int`.
pub(crate) fn check_cqe(cqe: u32, max: Option<u32>) -> Result<()> {
    if cqe == 0 {
        return Err(Error::invalid(
            "cqe",
            0,
            "a completion queue needs at least one entry",
        ));
    }
    let limit = max
        .filter(|&m| m > 0)
        .unwrap_or(i32::MAX as u32)
        .min(i32::MAX as u32);
    if cqe > limit {
        return Err(Error::invalid(
            "cqe",
            cqe,
            format!("the device allows at most {limit} entries per completion queue"),
        ));
    }
    Ok(())
}

/// The completions of one [`CompletionQueue::poll`]; each borrows the CQ.
#[derive(Debug)]
pub struct Completions<'cq> {
    items: std::slice::Iter<'cq, WorkCompletion>,
}

impl<'cq> Iterator for Completions<'cq> {
    type Item = &'cq WorkCompletion;
    fn next(&mut self) -> Option<Self::Item> {
        self.items.next()
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        self.items.size_hint()
    }
}

impl ExactSizeIterator for Completions<'_> {}

/// `struct ibv_wc`: one work completion. Its `wr_id` holds the request's tag (the library's own
/// `wr_id` is resolved and replaced when the completion is polled).
#[derive(Clone, Copy, Default)]
#[repr(transparent)]
#[doc(alias = "ibv_wc")]
pub struct WorkCompletion(ibv::ibv_wc);

impl WorkCompletion {
    /// Report `tag` as the request's tag.
    pub(crate) fn set_tag(&mut self, tag: u64) {
        self.0.wr_id = tag;
    }

    /// The tag given to the request ([`SendRequest::tag`](super::SendRequest::tag),
    /// [`RecvRequest::tag`](super::RecvRequest::tag)); 0 by default.
    pub fn tag(&self) -> u64 {
        self.0.wr_id
    }

    /// The status.
    pub fn status(&self) -> WcStatus {
        WcStatus::from_raw(self.0.status)
    }

    /// Whether it succeeded.
    pub fn is_ok(&self) -> bool {
        self.0.status == ibv::IBV_WC_SUCCESS
    }

    /// `Ok` on success, else [`Error::WorkCompletion`] with the status and vendor error.
    ///
    /// # Errors
    ///
    /// As above.
    pub fn result(&self) -> Result<()> {
        if self.is_ok() {
            Ok(())
        } else {
            Err(Error::WorkCompletion {
                status: self.status(),
                vendor_err: self.0.vendor_err,
                qp_num: self.0.qp_num,
            })
        }
    }

    /// What completed (valid only on success: flushed completions carry no opcode).
    pub fn opcode(&self) -> WcOpcode {
        WcOpcode::from_raw(self.0.opcode)
    }

    /// Bytes received (receives), or read/atomic results.
    pub fn byte_len(&self) -> u32 {
        self.0.byte_len
    }

    /// The immediate data of a send or RDMA write with immediate (converted from wire big-endian).
    pub fn imm(&self) -> Option<u32> {
        if self.0.wc_flags & ibv::IBV_WC_WITH_IMM != 0 {
            // SAFETY: the union holds imm_data when IBV_WC_WITH_IMM is set.
            Some(u32::from_be(unsafe { self.0.__bindgen_anon_1.imm_data }))
        } else {
            None
        }
    }

    /// The local QP number.
    pub fn qp_num(&self) -> u32 {
        self.0.qp_num
    }

    /// The remote QP number (UD), or the local one's peer where the provider reports it.
    pub fn src_qp(&self) -> u32 {
        self.0.src_qp
    }

    /// Vendor-specific error syndrome.
    pub fn vendor_err(&self) -> u32 {
        self.0.vendor_err
    }
}

impl fmt::Debug for WorkCompletion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkCompletion")
            .field("tag", &self.tag())
            .field("status", &self.status())
            .field("opcode", &self.opcode())
            .field("byte_len", &self.0.byte_len)
            .field("imm", &self.imm())
            .field("qp_num", &self.0.qp_num)
            .finish()
    }
}

/// `enum ibv_wc_opcode`: what a successful completion was for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
#[allow(missing_docs)]
pub enum WcOpcode {
    Send,
    RdmaWrite,
    RdmaRead,
    CompareSwap,
    FetchAdd,
    /// `IBV_WC_BIND_MW`: a memory window was bound.
    #[doc(alias = "IBV_WC_BIND_MW")]
    BindMw,
    /// `IBV_WC_LOCAL_INV`: a memory window (or region) was invalidated.
    #[doc(alias = "IBV_WC_LOCAL_INV")]
    LocalInv,
    Recv,
    RecvRdmaWithImm,
    Other(u32),
}

impl WcOpcode {
    fn from_raw(v: u32) -> Self {
        match v {
            ibv::IBV_WC_SEND => WcOpcode::Send,
            ibv::IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
            ibv::IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
            ibv::IBV_WC_COMP_SWAP => WcOpcode::CompareSwap,
            ibv::IBV_WC_FETCH_ADD => WcOpcode::FetchAdd,
            ibv::IBV_WC_BIND_MW => WcOpcode::BindMw,
            ibv::IBV_WC_LOCAL_INV => WcOpcode::LocalInv,
            ibv::IBV_WC_RECV => WcOpcode::Recv,
            ibv::IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
            o => WcOpcode::Other(o),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tables() -> Arc<PostedTables> {
        use super::super::posted::{RecvTable, SendTable};
        Arc::new(PostedTables::new(SendTable::new(4, 1), RecvTable::new(4)))
    }

    fn state(held: &[u32]) -> CqState {
        CqState {
            qps: HashMap::new(),
            srqs: HashMap::new(),
            pending: held
                .iter()
                .map(|&qp_num| {
                    let mut w = WorkCompletion::default();
                    w.0.qp_num = qp_num;
                    w
                })
                .collect(),
        }
    }

    fn held(st: &CqState) -> Vec<u32> {
        st.pending.iter().map(|w| w.0.qp_num).collect()
    }

    /// A destroyed queue pair's number may go to a new one (on this CQ) before the old one
    /// unregisters: the new one's tables stay, so its completions still release its requests.
    #[test]
    fn a_destroyed_qp_unregisters_only_its_own_tables() {
        let (old, new) = (tables(), tables());
        let mut st = state(&[]);
        st.qps.insert(5, old.clone());
        // Destroyed; number 5 is taken again by a new queue pair, which registers.
        st.qps.insert(5, new.clone());
        forget_qp(&mut st, 5, &old);
        assert!(st.qps.get(&5).is_some_and(|p| Arc::ptr_eq(p, &new)));
        forget_qp(&mut st, 5, &new);
        assert!(st.qps.is_empty());
    }

    /// Completions of a destroyed queue pair held back for its next poll (by another's drain)
    /// go with it: a queue pair that gets its number must not be handed them.
    #[test]
    fn a_destroyed_qps_held_completions_go_with_it() {
        let (five, six) = (tables(), tables());
        let mut st = state(&[5, 6, 5, 6]);
        st.qps.insert(5, five.clone());
        st.qps.insert(6, six.clone());
        forget_qp(&mut st, 5, &five);
        assert_eq!(held(&st), [6, 6]);
    }

    #[test]
    fn window_opcodes_are_named() {
        assert_eq!(WcOpcode::from_raw(ibv::IBV_WC_BIND_MW), WcOpcode::BindMw);
        assert_eq!(
            WcOpcode::from_raw(ibv::IBV_WC_LOCAL_INV),
            WcOpcode::LocalInv
        );
        assert_eq!(WcOpcode::from_raw(ibv::IBV_WC_TSO), WcOpcode::Other(7));
    }

    #[test]
    fn immediate_is_big_endian_on_the_wire() {
        let mut w = WorkCompletion::default();
        assert_eq!(w.imm(), None);
        w.0.wc_flags = ibv::IBV_WC_WITH_IMM;
        w.0.__bindgen_anon_1.imm_data = 0x1234_5678u32.to_be();
        assert_eq!(w.imm(), Some(0x1234_5678));
        w.0.status = ibv::IBV_WC_REM_ACCESS_ERR;
        w.0.qp_num = 7;
        let e = w.result().unwrap_err();
        assert!(
            matches!(
                e,
                Error::WorkCompletion {
                    status: WcStatus::RemoteAccess,
                    qp_num: 7,
                    ..
                }
            ),
            "{e}"
        );
    }
}
