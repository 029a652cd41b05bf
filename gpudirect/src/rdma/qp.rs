//! Reliable-connected queue pairs with typed state transitions, their posted-request tables, the
//! completion-queue accounting of what they post, and the teardown that proves completion before
//! it destroys.

use super::context::{DeviceAttr, Gid, Mtu};
use super::cq::{CompletionQueue, CqInner, Room, WorkCompletion};
use super::mr::AccessFlags;
use super::pd::{PdInner, ProtectionDomain};
use super::srq::{SharedReceiveQueue, SrqInner};
use super::wr::{RecvRequest, Sg, WorkRequest};
use super::{COUNTERS, Counters, in_forked_child, nonnull, rc, verbs};
use crate::completion::{CompletionFlag, Fence, Tracker};
use crate::error::{Error, Result};
use gpudirect_sys::ibverbs as ibv;
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long dropping a queue pair (or [`QueuePair::reset`]) waits for its flushed completions
/// before giving up: a drop then leaks the QP and all the memory its requests hold instead of
/// freeing anything early.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

const KIND_SHIFT: u32 = 62;
const KIND_SEND: u64 = 0;
const KIND_RECV: u64 = 1;
const KIND_SRQ: u64 = 2;
const ID_MASK: u64 = (1 << KIND_SHIFT) - 1;
const SRQ_SHIFT: u32 = 32;
/// Shared receive queues are told apart in `wr_id` by an id of this many bits.
pub(crate) const SRQ_ID_MASK: u32 = (1 << (KIND_SHIFT - SRQ_SHIFT)) - 1;

/// What the library puts in a request's `wr_id`: the queue, and the request's sequence number
/// (send queue) or slot (receive queue, SRQ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WrId {
    Send { seq: u64 },
    Recv { slot: u32 },
    Srq { srq: u32, slot: u32 },
    Other,
}

impl WrId {
    pub(crate) fn encode(self) -> u64 {
        match self {
            WrId::Send { seq } => (KIND_SEND << KIND_SHIFT) | (seq & ID_MASK),
            WrId::Recv { slot } => (KIND_RECV << KIND_SHIFT) | slot as u64,
            WrId::Srq { srq, slot } => {
                (KIND_SRQ << KIND_SHIFT) | (((srq & SRQ_ID_MASK) as u64) << SRQ_SHIFT) | slot as u64
            }
            WrId::Other => 3 << KIND_SHIFT,
        }
    }

    pub(crate) fn decode(v: u64) -> Self {
        let id = v & ID_MASK;
        match v >> KIND_SHIFT {
            KIND_SEND => WrId::Send { seq: id },
            KIND_RECV if id <= u32::MAX as u64 => WrId::Recv { slot: id as u32 },
            KIND_SRQ => WrId::Srq {
                srq: (id >> SRQ_SHIFT) as u32,
                slot: id as u32,
            },
            _ => WrId::Other,
        }
    }
}

/// What one posted request holds until its completion.
pub(crate) struct Entry {
    pub(crate) tag: u64,
    /// Held, never read: keeps the slices' regions registered and alive until completion.
    #[allow(dead_code)]
    pub(crate) sg: Sg,
    pub(crate) flag: Option<CompletionFlag>,
    /// Whether releasing it gives a completion-queue slot back (not for the teardown request,
    /// which uses the QP's own slot, nor for SRQ receives, whose room is reserved per SRQ).
    pub(crate) cq_slot: bool,
    /// Whether the NIC reports its completion on success (receives always do).
    pub(crate) signaled: bool,
}

impl Entry {
    pub(crate) fn new(tag: u64, sg: Sg, flag: Option<CompletionFlag>, cq_slot: bool) -> Self {
        Entry {
            tag,
            sg,
            flag,
            cq_slot,
            signaled: true,
        }
    }

    /// Release what the request held; returns its tag and the CQ slots freed (0 or 1).
    fn release(self) -> (u64, u32) {
        // Slices dropped here, after the completion was seen: the NIC is done with them.
        if let Some(f) = &self.flag {
            f.set();
        }
        (self.tag, self.cq_slot as u32)
    }
}

/// Send-queue requests in post order, keyed by a sequence number: on RC a completion for request
/// `n` means every earlier request (signaled or not) has completed too.
pub(crate) struct SendTable {
    next_seq: u64,
    entries: VecDeque<(u64, Entry)>,
    depth: u32,
    unsignaled_run: u32,
    signal_every: u32,
}

impl SendTable {
    pub(crate) fn new(depth: u32, signal_every: u32) -> Self {
        SendTable {
            next_seq: 0,
            entries: VecDeque::new(),
            depth,
            unsignaled_run: 0,
            signal_every: signal_every.max(1),
        }
    }

    /// Release every request up to and including the one posted as `id` (its `wr_id` value);
    /// returns that request's tag and the CQ slots freed. An id no entry carries releases nothing.
    fn complete_through(&mut self, id: u64) -> (u64, u32) {
        let Some(k) = self
            .entries
            .iter()
            .position(|(s, _)| *s & ID_MASK == id & ID_MASK)
        else {
            return (0, 0);
        };
        let (mut tag, mut freed) = (0, 0u32);
        for (i, (_, e)) in self.entries.drain(..=k).enumerate() {
            let (t, f) = e.release();
            freed += f;
            if i == k {
                tag = t;
            }
        }
        (tag, freed)
    }

    /// Whether the next request is signaled: when asked (`want`), once in every `signal_every`,
    /// or when `force`d (it leaves the send queue or the completion queue more than half full:
    /// only a completion can free them).
    fn decide(&mut self, want: bool, force: bool) -> bool {
        let signaled = want || force || self.unsignaled_run + 1 >= self.signal_every;
        self.unsignaled_run = if signaled { 0 } else { self.unsignaled_run + 1 };
        signaled
    }

    /// Whether the last request posted is unsignaled: nothing the NIC reports would then release
    /// it, and teardown needs a signaled request after it.
    fn needs_marker(&self) -> bool {
        self.entries.back().is_some_and(|(_, e)| !e.signaled)
    }

    fn len(&self) -> usize {
        self.entries.len()
    }
}

/// Receive requests by slot (receive queue or SRQ).
pub(crate) struct RecvTable {
    slots: Vec<Option<Entry>>,
    free: Vec<u32>,
    live: u32,
    pub(crate) depth: u32,
}

impl RecvTable {
    pub(crate) fn new(depth: u32) -> Self {
        RecvTable {
            slots: Vec::new(),
            free: Vec::new(),
            live: 0,
            depth,
        }
    }

    pub(crate) fn insert(&mut self, e: Entry) -> u32 {
        self.live += 1;
        match self.free.pop() {
            Some(i) => {
                self.slots[i as usize] = Some(e);
                i
            }
            None => {
                self.slots.push(Some(e));
                (self.slots.len() - 1) as u32
            }
        }
    }

    /// Release the request in `slot`: its tag and the CQ slots freed; `(0, 0)` for an empty slot.
    pub(crate) fn take(&mut self, slot: u32) -> (u64, u32) {
        match self.slots.get_mut(slot as usize).and_then(Option::take) {
            Some(e) => {
                self.live -= 1;
                self.free.push(slot);
                e.release()
            }
            None => (0, 0),
        }
    }

    /// Remove an entry that was never posted (the post failed): dropped, not released. Returns
    /// the CQ slots it held.
    pub(crate) fn unpost(&mut self, slot: u32) -> u32 {
        match self.slots.get_mut(slot as usize).and_then(Option::take) {
            Some(e) => {
                self.live -= 1;
                self.free.push(slot);
                e.cq_slot as u32
            }
            None => 0,
        }
    }

    pub(crate) fn live(&self) -> u32 {
        self.live
    }

    /// Post `reqs` through `post` (ibv_post_recv or ibv_post_srq_recv), keeping each request's
    /// slices in this table under the library's `wr_id` (`wr_id` of a slot). When `room` is given
    /// (a QP's own receive queue), each request also takes a slot of that CQ. All or nothing
    /// before the call; after a failing call, the requests before the failing one stay posted.
    pub(crate) fn post(
        &mut self,
        reqs: Vec<RecvRequest>,
        wr_id: impl Fn(u32) -> u64,
        queue: &'static str,
        call: &'static str,
        room: Option<&Room>,
        post: impl FnOnce(*mut ibv::ibv_recv_wr, *mut *mut ibv::ibv_recv_wr) -> i32,
    ) -> Result<usize> {
        let n = reqs.len();
        if n == 0 {
            return Ok(0);
        }
        if (self.live as usize).saturating_add(n) > self.depth as usize {
            return Err(Error::QueueFull {
                queue,
                depth: self.depth,
            });
        }
        // n <= depth (a u32) here.
        if let Some(r) = room {
            r.reserve(n as u32)?;
        }
        let total_sge: usize = reqs.iter().map(|r| r.sg.slices().len()).sum();
        let mut sges: Vec<ibv::ibv_sge> = Vec::with_capacity(total_sge);
        let mut wrs: Vec<ibv::ibv_recv_wr> = Vec::with_capacity(n);
        let mut starts = Vec::with_capacity(n);
        let mut slots = Vec::with_capacity(n);
        for r in reqs {
            let start = sges.len();
            sges.extend(r.sg.slices().iter().map(|s| s.sge()));
            let cnt = sges.len() - start;
            let slot = self.insert(Entry::new(r.tag, r.sg, r.flag, room.is_some()));
            slots.push(slot);
            starts.push(start);
            wrs.push(ibv::ibv_recv_wr {
                wr_id: wr_id(slot),
                next: std::ptr::null_mut(),
                sg_list: std::ptr::null_mut(),
                // At most the queue's max_sge (validated), an int.
                num_sge: cnt as i32,
            });
        }
        let base = sges.as_mut_ptr();
        let wrp = wrs.as_mut_ptr();
        for (i, &start) in starts.iter().enumerate() {
            // SAFETY: i < n entries of `wrs`, which no longer grows; `start` indexes `sges` (or is
            // its length when the request has no SGE, and then num_sge is 0 and it is not used).
            unsafe {
                let wr = &mut *wrp.add(i);
                if wr.num_sge > 0 {
                    wr.sg_list = base.add(start);
                }
                if i + 1 < n {
                    wr.next = wrp.add(i + 1);
                }
            }
        }
        let mut bad = std::ptr::null_mut();
        let r = post(wrp, &mut bad);
        if r != 0 {
            // Requests from `bad` on were not posted: drop their entries (never seen by the NIC).
            let first_bad = posted_before(wrp, bad, n);
            let mut freed = 0;
            for &slot in &slots[first_bad..] {
                freed += self.unpost(slot);
            }
            if let Some(room) = room {
                room.release(freed);
            }
            return Err(Error::errno(call, r.unsigned_abs() as i32));
        }
        Ok(n)
    }
}

/// How many requests of a chain of `n` at `base` were posted when the call failed at `bad`. When
/// `bad` does not point at one of them, all are taken as posted: they stay held until a later
/// completion releases them, never freed early.
fn posted_before<T>(base: *const T, bad: *const T, n: usize) -> usize {
    let size = size_of::<T>();
    match (bad as usize).checked_sub(base as usize) {
        Some(off) if off % size == 0 && off / size < n => off / size,
        _ => n,
    }
}

/// Per-QP state shared with the CQs that report its completions.
pub(crate) struct QpShared {
    sq: Mutex<SendTable>,
    rq: Mutex<RecvTable>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl QpShared {
    /// Release what the request behind `wc` held: its tag and the CQ slots freed.
    pub(crate) fn complete(&self, wc: &ibv::ibv_wc) -> (u64, u32) {
        match WrId::decode(wc.wr_id) {
            WrId::Send { seq } => lock(&self.sq).complete_through(seq),
            WrId::Recv { slot } => lock(&self.rq).take(slot),
            WrId::Srq { .. } | WrId::Other => (0, 0),
        }
    }

    fn outstanding(&self) -> usize {
        self.send_outstanding() + lock(&self.rq).live() as usize
    }

    fn send_outstanding(&self) -> usize {
        lock(&self.sq).len()
    }
}

/// Sizes of a queue pair's queues. Providers may round them up; [`QueuePair::caps`] says what was
/// granted.
///
/// Each request posted also takes an entry of the completion queue its completion goes to (see
/// [Capacity](super#capacity)): a send queue deeper than its CQ's room is refused at post time,
/// not overrun.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send-queue depth (requests): 1 to the device's `max_qp_wr`.
    pub max_send_wr: u32,
    /// Receive-queue depth (ignored with an SRQ): 1 to the device's `max_qp_wr`.
    pub max_recv_wr: u32,
    /// Scatter-gather entries per send request (0 means 1), at most the device's `max_sge`.
    pub max_send_sge: u32,
    /// Scatter-gather entries per receive request (0 means 1), at most the device's `max_sge`.
    pub max_recv_sge: u32,
    /// Largest inline payload, in bytes (the provider refuses sizes it cannot hold).
    pub max_inline_data: u32,
    /// Force a signaled request after this many unsignaled ones (0: half the send-queue depth;
    /// larger than the granted depth: the depth).
    pub signal_every: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
            signal_every: 0,
        }
    }
}

impl QpCaps {
    /// Check the sizes against the rules and, where known, the device's limits.
    pub(crate) fn check(&self, dev: Option<&DeviceAttr>, with_srq: bool) -> Result<()> {
        let bad = |rule: String| Err(Error::invalid("caps", format!("{self:?}"), rule));
        if self.max_send_wr == 0 || (!with_srq && self.max_recv_wr == 0) {
            return bad("queue depths must be at least 1".into());
        }
        if let Some(d) = dev {
            let wr = d.max_qp_wr;
            if wr > 0 && (self.max_send_wr > wr || (!with_srq && self.max_recv_wr > wr)) {
                return bad(format!(
                    "queue depths are at most the device's max_qp_wr {wr}"
                ));
            }
            let sge = d.max_sge;
            if sge > 0 && (self.max_send_sge > sge || self.max_recv_sge > sge) {
                return bad(format!(
                    "scatter-gather entries are at most the device's max_sge {sge}"
                ));
            }
        }
        Ok(())
    }

    /// The granted caps, with `signal_every` settled against the granted send depth.
    fn granted(&self, c: &ibv::ibv_qp_cap) -> QpCaps {
        QpCaps {
            max_send_wr: c.max_send_wr,
            max_recv_wr: c.max_recv_wr,
            max_send_sge: c.max_send_sge,
            max_recv_sge: c.max_recv_sge,
            max_inline_data: c.max_inline_data,
            signal_every: if self.signal_every == 0 {
                (c.max_send_wr / 2).max(1)
            } else {
                self.signal_every.min(c.max_send_wr).max(1)
            },
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A queue pair's state as the hardware reports it (`enum ibv_qp_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
#[doc(alias = "ibv_qp_state")]
pub enum QpStateKind {
    /// `IBV_QPS_RESET`.
    Reset,
    /// `IBV_QPS_INIT`.
    Init,
    /// `IBV_QPS_RTR`.
    Rtr,
    /// `IBV_QPS_RTS`.
    Rts,
    /// `IBV_QPS_SQD`.
    Sqd,
    /// `IBV_QPS_SQE`.
    Sqe,
    /// `IBV_QPS_ERR`.
    Error,
    /// Another value.
    Other(u32),
}

impl QpStateKind {
    fn from_raw(v: u32) -> Self {
        match v {
            ibv::IBV_QPS_RESET => QpStateKind::Reset,
            ibv::IBV_QPS_INIT => QpStateKind::Init,
            ibv::IBV_QPS_RTR => QpStateKind::Rtr,
            ibv::IBV_QPS_RTS => QpStateKind::Rts,
            ibv::IBV_QPS_SQD => QpStateKind::Sqd,
            ibv::IBV_QPS_SQE => QpStateKind::Sqe,
            ibv::IBV_QPS_ERR => QpStateKind::Error,
            o => QpStateKind::Other(o),
        }
    }
}

/// A queue pair state, at the type level.
pub trait QpState: sealed::Sealed {
    /// The hardware state this type stands for.
    const KIND: QpStateKind;
}
/// A state in which receives may be posted (INIT, RTR, RTS).
pub trait CanRecv: QpState {}

/// `IBV_QPS_RESET`: just created, or reset after the error state.
#[derive(Debug)]
pub enum Reset {}
/// `IBV_QPS_INIT`: receives may be posted.
#[derive(Debug)]
pub enum Init {}
/// `IBV_QPS_RTR`: ready to receive.
#[derive(Debug)]
pub enum Rtr {}
/// `IBV_QPS_RTS`: ready to send.
#[derive(Debug)]
pub enum Rts {}
/// `IBV_QPS_ERR`: stopped; every outstanding request completes as flushed. From here only
/// [`QueuePair::reset`] (then INIT, RTR, RTS again) or drop.
#[derive(Debug)]
#[doc(alias = "IBV_QPS_ERR")]
pub enum ErrorState {}
impl sealed::Sealed for Reset {}
impl sealed::Sealed for Init {}
impl sealed::Sealed for Rtr {}
impl sealed::Sealed for Rts {}
impl sealed::Sealed for ErrorState {}
impl QpState for Reset {
    const KIND: QpStateKind = QpStateKind::Reset;
}
impl QpState for Init {
    const KIND: QpStateKind = QpStateKind::Init;
}
impl QpState for Rtr {
    const KIND: QpStateKind = QpStateKind::Rtr;
}
impl QpState for Rts {
    const KIND: QpStateKind = QpStateKind::Rts;
}
impl QpState for ErrorState {
    const KIND: QpStateKind = QpStateKind::Error;
}
impl CanRecv for Init {}
impl CanRecv for Rtr {}
impl CanRecv for Rts {}

pub(crate) struct QpInner {
    qp: NonNull<ibv::ibv_qp>,
    qp_num: u32,
    shared: Arc<QpShared>,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    pd: Arc<PdInner>,
    srq: Option<Arc<SrqInner>>,
    caps: QpCaps,
    port: u8,
    wr_scratch: Vec<ibv::ibv_send_wr>,
    sge_scratch: Vec<ibv::ibv_sge>,
}

// SAFETY: verbs QPs may be used from any thread; posting needs `&mut QueuePair`.
unsafe impl Send for QpInner {}
// SAFETY: shared access only reads immutable fields.
unsafe impl Sync for QpInner {}

struct Never;
impl Fence for Never {
    fn is_complete(&self) -> bool {
        false
    }
}

impl Drop for QpInner {
    fn drop(&mut self) {
        if in_forked_child() {
            return;
        }
        let Ok(l) = ibv::lib() else { return };
        // 1. Error state: the NIC stops and flushes every outstanding request.
        // 2. A signaled request after the last unsignaled one, then drain (bounded) until every
        //    posted request's completion (or one covering it) has been seen.
        let drained = self.set_state(l, ibv::IBV_QPS_ERR) && self.quiesce(DRAIN_TIMEOUT);
        // 3. Destroy, or leak everything the NIC might still touch.
        // SAFETY: a live QP; after success the NIC no longer touches its requests' memory.
        if drained && unsafe { (l.ibv_destroy_qp)(self.qp.as_ptr()) } == 0 {
            self.send_cq.unregister(self.qp_num);
            self.recv_cq.unregister(self.qp_num);
            // The send-CQ entry kept for the teardown request.
            self.send_cq.room().release(1);
            Counters::count(&COUNTERS.qp_destroyed);
        } else {
            // The QP stays registered with its CQs, so completions polled later still release
            // its requests' memory; the QP itself, its CQs and PD are never freed.
            Tracker::global().park(
                Never,
                (
                    self.send_cq.clone(),
                    self.recv_cq.clone(),
                    self.pd.clone(),
                    self.shared.clone(),
                    self.srq.clone(),
                ),
            );
            Counters::count(&COUNTERS.qp_leaked);
        }
    }
}

impl QpInner {
    fn set_state(&self, l: &ibv::Lib, state: u32) -> bool {
        let mut attr = ibv::ibv_qp_attr {
            qp_state: state,
            ..Default::default()
        };
        // SAFETY: a live QP and a valid attribute struct.
        unsafe { (l.ibv_modify_qp)(self.qp.as_ptr(), &mut attr, ibv::IBV_QP_STATE as i32) == 0 }
    }

    /// In the error state: make sure a signaled request follows the last unsignaled one (its
    /// flushed completion proves everything before it finished), then drain.
    fn quiesce(&self, timeout: Duration) -> bool {
        self.post_marker() && self.drain(timeout)
    }

    /// Post one signaled, empty send after an unsignaled tail. Its CQ entry is the one the QP
    /// reserved at creation. Returns false when it could not be posted.
    fn post_marker(&self) -> bool {
        let mut t = lock(&self.shared.sq);
        if !t.needs_marker() {
            return true;
        }
        // An unsignaled tail leaves the queue at most half full (see `post_send`): there is room.
        if t.len() >= t.depth as usize {
            return false;
        }
        let seq = t.next_seq;
        let mut wr = ibv::ibv_send_wr {
            wr_id: WrId::Send { seq }.encode(),
            opcode: ibv::IBV_WR_SEND,
            send_flags: ibv::IBV_SEND_SIGNALED,
            ..Default::default()
        };
        t.entries
            .push_back((seq, Entry::new(0, Sg::None, None, false)));
        t.next_seq += 1;
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live QP (in the error state); one request without SGEs, living for the call.
        let r = unsafe { ibv::ibv_post_send(self.qp.as_ptr(), &mut wr, &mut bad) };
        if r != 0 {
            t.entries.pop_back();
            t.next_seq = seq;
            return false;
        }
        true
    }

    /// Poll this QP's CQs until every request it posted has been released (completions of
    /// other QPs found on a shared CQ are held for their next poll), or `timeout` passes.
    fn drain(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut buf = [WorkCompletion::default(); 16];
        loop {
            if self.shared.outstanding() == 0 {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            let mut any = false;
            for cq in [&self.send_cq, &self.recv_cq] {
                let Ok(n) = cq.poll_into(&mut buf) else {
                    continue;
                };
                any |= n > 0;
                for w in &buf[..n] {
                    if w.qp_num() != self.qp_num {
                        cq.hold(*w); // someone else's: returned by their next poll
                    }
                }
                if Arc::ptr_eq(&self.send_cq, &self.recv_cq) {
                    break;
                }
            }
            if !any {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }
}

/// `ibv_create_qp` (`IBV_QPT_RC`)—a reliable-connected queue pair in state `S`.
///
/// Transitions consume the QP and return it in the next state: [`QueuePair::to_init`],
/// [`to_rtr`](QueuePair::to_rtr), [`to_rts`](QueuePair::to_rts); [`into_error`](QueuePair::into_error)
/// from any state, then [`reset`](QueuePair::reset) to start over. Receives may be posted from
/// INIT on, sends only in RTS. Requests own their slices until their completions are polled.
///
/// Dropping the QP moves it to the error state, posts one signaled request if the last one posted
/// was unsignaled (its flushed completion proves that everything before it is done), drains the
/// completions for up to [`DRAIN_TIMEOUT`], then destroys it; if the completions do not all
/// arrive, the QP and the memory its requests hold are leaked rather than freed early
/// ([`teardown_stats`](super::teardown_stats) counts both).
#[doc(alias = "ibv_qp")]
#[doc(alias = "ibv_destroy_qp")]
pub struct QueuePair<S: QpState = Rts> {
    inner: Box<QpInner>,
    _state: PhantomData<S>,
}

impl QueuePair<Reset> {
    /// `ibv_create_qp(pd, {RC, send_cq, recv_cq, srq, caps})`—a new RC queue pair.
    ///
    /// Takes one entry of `send_cq` for the request its teardown may post; with an SRQ, `recv_cq`
    /// keeps room for the SRQ's whole depth (once per CQ and SRQ, for the CQ's life).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when a CQ or the SRQ belongs to another device, or `caps` break
    /// a rule ([`QpCaps`]); [`Error::QueueFull`] naming the completion queue when it lacks that
    /// room; [`Error::Os`] naming `ibv_create_qp` (`EINVAL`/`ENOMEM` for caps the device refuses).
    #[doc(alias = "ibv_create_qp")]
    pub fn create(
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        srq: Option<&SharedReceiveQueue>,
        caps: QpCaps,
    ) -> Result<Self> {
        caps.check(None, srq.is_some())?;
        let ctx = pd.inner.ctx.ctx.as_ptr();
        for (arg, c) in [
            ("send_cq", send_cq.ctx_ptr()),
            ("recv_cq", recv_cq.ctx_ptr()),
        ] {
            if c != ctx {
                return Err(Error::invalid(
                    arg,
                    format!("{c:p}"),
                    "the completion queue belongs to another device context than the PD",
                ));
            }
        }
        if let Some(s) = srq
            && s.inner.ctx_ptr() != ctx
        {
            return Err(Error::invalid(
                "srq",
                format!("{s:?}"),
                "the shared receive queue belongs to another device context than the PD",
            ));
        }
        let dev = pd.context().query_device().ok();
        caps.check(dev.as_ref(), srq.is_some())?;
        let l = verbs()?;
        send_cq.inner.room().reserve(1)?;
        if let Some(s) = srq
            && let Err(e) = recv_cq.inner.link_srq(&s.inner)
        {
            send_cq.inner.room().release(1);
            return Err(e);
        }
        let mut init = ibv::ibv_qp_init_attr {
            send_cq: send_cq.as_raw(),
            recv_cq: recv_cq.as_raw(),
            srq: srq.map_or(std::ptr::null_mut(), |s| s.as_raw()),
            cap: ibv::ibv_qp_cap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr: if srq.is_some() { 0 } else { caps.max_recv_wr },
                max_send_sge: caps.max_send_sge.max(1),
                max_recv_sge: caps.max_recv_sge.max(1),
                max_inline_data: caps.max_inline_data,
            },
            qp_type: ibv::IBV_QPT_RC,
            sq_sig_all: 0,
            ..Default::default()
        };
        // SAFETY: live PD, CQs and SRQ; a valid init struct the provider updates with the caps.
        let qp = match nonnull("ibv_create_qp", unsafe {
            (l.ibv_create_qp)(pd.as_raw(), &mut init)
        }) {
            Ok(qp) => qp,
            Err(e) => {
                send_cq.inner.room().release(1);
                return Err(e);
            }
        };
        // SAFETY: a QP just created.
        let qp_num = unsafe { qp.as_ref().qp_num };
        let granted = caps.granted(&init.cap);
        let shared = Arc::new(QpShared {
            sq: Mutex::new(SendTable::new(granted.max_send_wr, granted.signal_every)),
            rq: Mutex::new(RecvTable::new(granted.max_recv_wr)),
        });
        send_cq.inner.register(qp_num, shared.clone());
        recv_cq.inner.register(qp_num, shared.clone());
        Ok(QueuePair {
            inner: Box::new(QpInner {
                qp,
                qp_num,
                shared,
                send_cq: send_cq.inner.clone(),
                recv_cq: recv_cq.inner.clone(),
                pd: pd.inner.clone(),
                srq: srq.map(|s| s.inner.clone()),
                caps: granted,
                port: 1,
                wr_scratch: Vec::new(),
                sge_scratch: Vec::new(),
            }),
            _state: PhantomData,
        })
    }

    /// RESET → INIT: bind to `port` (from 1) with pkey index 0, and allow peers `access`
    /// (remote read, write, atomic) through this QP.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for port 0; [`Error::Os`] naming `ibv_modify_qp`.
    #[doc(alias = "IBV_QPS_INIT")]
    pub fn to_init(self, port: u8, access: AccessFlags) -> Result<QueuePair<Init>> {
        if port == 0 {
            return Err(Error::invalid("port", 0, "ports are numbered from 1"));
        }
        let mut a = ibv::ibv_qp_attr {
            qp_state: ibv::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: port,
            qp_access_flags: (access - AccessFlags::LOCAL_WRITE).bits(),
            ..Default::default()
        };
        let mut qp = self.modify(
            &mut a,
            ibv::IBV_QP_STATE
                | ibv::IBV_QP_PKEY_INDEX
                | ibv::IBV_QP_PORT
                | ibv::IBV_QP_ACCESS_FLAGS,
        )?;
        qp.inner.port = port;
        Ok(qp)
    }
}

impl QueuePair<Init> {
    /// INIT → RTR: connect the receive side to the peer described by `attr`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a field out of its range (see [`RtrAttr`]: QP numbers and
    /// PSNs are 24 bits, the RNR timer code 5 bits); [`Error::Os`] naming `ibv_modify_qp`
    /// (`EINVAL` for a bad GID index or MTU).
    #[doc(alias = "IBV_QPS_RTR")]
    pub fn to_rtr(self, attr: &RtrAttr) -> Result<QueuePair<Rtr>> {
        attr.check()?;
        let mut a = ibv::ibv_qp_attr {
            qp_state: ibv::IBV_QPS_RTR,
            path_mtu: attr.mtu.raw(),
            dest_qp_num: attr.dest_qp_num,
            rq_psn: attr.rq_psn,
            max_dest_rd_atomic: attr.max_dest_rd_atomic,
            min_rnr_timer: attr.min_rnr_timer,
            ..Default::default()
        };
        a.ah_attr.dlid = attr.dlid;
        a.ah_attr.port_num = self.inner.port;
        if let Some(g) = attr.dgid {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = g.to_raw();
            a.ah_attr.grh.sgid_index = attr.sgid_index;
            a.ah_attr.grh.hop_limit = attr.hop_limit;
        }
        self.modify(
            &mut a,
            ibv::IBV_QP_STATE
                | ibv::IBV_QP_AV
                | ibv::IBV_QP_PATH_MTU
                | ibv::IBV_QP_DEST_QPN
                | ibv::IBV_QP_RQ_PSN
                | ibv::IBV_QP_MAX_DEST_RD_ATOMIC
                | ibv::IBV_QP_MIN_RNR_TIMER,
        )
    }
}

impl QueuePair<Rtr> {
    /// RTR → RTS: start the send side.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a field out of its range (see [`RtsAttr`]); [`Error::Os`]
    /// naming `ibv_modify_qp`.
    #[doc(alias = "IBV_QPS_RTS")]
    pub fn to_rts(self, attr: &RtsAttr) -> Result<QueuePair<Rts>> {
        attr.check()?;
        let mut a = ibv::ibv_qp_attr {
            qp_state: ibv::IBV_QPS_RTS,
            sq_psn: attr.sq_psn,
            timeout: attr.timeout,
            retry_cnt: attr.retry_cnt,
            rnr_retry: attr.rnr_retry,
            max_rd_atomic: attr.max_rd_atomic,
            ..Default::default()
        };
        self.modify(
            &mut a,
            ibv::IBV_QP_STATE
                | ibv::IBV_QP_SQ_PSN
                | ibv::IBV_QP_TIMEOUT
                | ibv::IBV_QP_RETRY_CNT
                | ibv::IBV_QP_RNR_RETRY
                | ibv::IBV_QP_MAX_QP_RD_ATOMIC,
        )
    }
}

impl QueuePair<ErrorState> {
    /// ERR → RESET: after every outstanding request is known complete, reset the QP so it can
    /// go through INIT, RTR and RTS again (with a new peer or PSNs).
    ///
    /// Posts one signaled request if the last one posted was unsignaled, then drains this QP's
    /// completions for up to [`DRAIN_TIMEOUT`]: completions of it still in its CQs are consumed
    /// here (their requests release what they held and set their flags), so poll the flushes
    /// first to see them.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when the completions do not all arrive (the QP is dropped, which waits
    /// again and then leaks it with everything it holds); [`Error::Os`] naming `ibv_modify_qp`.
    #[doc(alias = "IBV_QPS_RESET")]
    pub fn reset(self) -> Result<QueuePair<Reset>> {
        verbs()?;
        if !self.inner.quiesce(DRAIN_TIMEOUT) {
            return Err(Error::Timeout {
                what: "the flushed completions of a queue pair before IBV_QPS_RESET",
                after: DRAIN_TIMEOUT,
            });
        }
        let mut a = ibv::ibv_qp_attr {
            qp_state: ibv::IBV_QPS_RESET,
            ..Default::default()
        };
        let qp: QueuePair<Reset> = self.modify(&mut a, ibv::IBV_QP_STATE)?;
        lock(&qp.inner.shared.sq).unsignaled_run = 0;
        Ok(qp)
    }
}

impl<S: QpState> QueuePair<S> {
    /// The QP number the peer addresses.
    pub fn qp_num(&self) -> u32 {
        self.inner.qp_num
    }

    /// The queue sizes the provider granted.
    pub fn caps(&self) -> QpCaps {
        self.inner.caps
    }

    /// The raw `ibv_qp`, valid while `self` is.
    pub fn as_raw(&self) -> *mut ibv::ibv_qp {
        self.inner.qp.as_ptr()
    }

    /// The state the type says the QP is in (`S::KIND`).
    pub fn state(&self) -> QpStateKind {
        S::KIND
    }

    /// `ibv_query_qp(qp, IBV_QP_STATE)`—the state the hardware reports. It differs from
    /// [`state`](Self::state) only when the NIC moved the QP itself (to the error state after a
    /// failed request).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `ibv_query_qp`.
    #[doc(alias = "ibv_query_qp")]
    pub fn query_state(&self) -> Result<QpStateKind> {
        let l = verbs()?;
        let mut a = ibv::ibv_qp_attr::default();
        let mut init = ibv::ibv_qp_init_attr::default();
        // SAFETY: a live QP and valid out-structs.
        rc("ibv_query_qp", unsafe {
            (l.ibv_query_qp)(
                self.inner.qp.as_ptr(),
                &mut a,
                ibv::IBV_QP_STATE as i32,
                &mut init,
            )
        })?;
        Ok(QpStateKind::from_raw(a.qp_state))
    }

    /// Requests posted whose completions have not been polled yet (send and receive queue).
    pub fn outstanding(&self) -> usize {
        self.inner.shared.outstanding()
    }

    /// Send-queue requests not yet known complete: the queue's occupancy, as posting sees it
    /// (unsignaled requests count until a later signaled completion is polled).
    pub fn send_outstanding(&self) -> usize {
        self.inner.shared.send_outstanding()
    }

    /// `ibv_modify_qp` with attributes from elsewhere (rdma_cm's `rdma_init_qp_attr`), into the
    /// state `T` the attributes name.
    pub(crate) fn modify_raw<T: QpState>(
        self,
        attr: &mut ibv::ibv_qp_attr,
        mask: i32,
    ) -> Result<QueuePair<T>> {
        self.modify(attr, mask as u32)
    }

    fn modify<T: QpState>(self, attr: &mut ibv::ibv_qp_attr, mask: u32) -> Result<QueuePair<T>> {
        let l = verbs()?;
        // SAFETY: a live QP and a valid attribute struct with `mask` naming its valid fields.
        rc("ibv_modify_qp", unsafe {
            (l.ibv_modify_qp)(self.inner.qp.as_ptr(), attr, mask as i32)
        })?;
        Ok(QueuePair {
            inner: self.inner,
            _state: PhantomData,
        })
    }

    /// Move to the error state: every outstanding request completes with
    /// [`WcStatus::Flushed`](super::WcStatus::Flushed) (poll them to get the memory back). From
    /// there, [`reset`](QueuePair::reset) or drop.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `ibv_modify_qp`.
    #[doc(alias = "IBV_QPS_ERR")]
    pub fn into_error(self) -> Result<QueuePair<ErrorState>> {
        let mut a = ibv::ibv_qp_attr {
            qp_state: ibv::IBV_QPS_ERR,
            ..Default::default()
        };
        self.modify(&mut a, ibv::IBV_QP_STATE)
    }
}

impl<S: CanRecv> QueuePair<S> {
    /// `ibv_post_recv`—post receives, chained in one call. Each keeps its slices until its
    /// completion is polled, and takes an entry of the receive CQ until then. Returns how many
    /// were posted.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the QP uses an SRQ or a slice lacks local write or belongs
    /// to another PD; [`Error::QueueFull`] when the receive queue, or the receive CQ, has no room
    /// for them all (nothing is posted); [`Error::Os`] naming `ibv_post_recv` (requests before
    /// the failing one were posted).
    #[doc(alias = "ibv_post_recv")]
    pub fn post_recv(&mut self, reqs: impl IntoIterator<Item = RecvRequest>) -> Result<usize> {
        verbs()?;
        if self.inner.srq.is_some() {
            return Err(Error::invalid(
                "qp",
                self.qp_num(),
                "receives of a QP with an SRQ go to the SRQ",
            ));
        }
        let reqs: Vec<RecvRequest> = reqs.into_iter().collect();
        let pd = self.inner.pd.pd.as_ptr();
        for r in &reqs {
            r.validate(self.inner.caps.max_recv_sge)?;
            check_pd(r.sg.slices(), pd)?;
        }
        let qp = self.inner.qp.as_ptr();
        let mut t = lock(&self.inner.shared.rq);
        t.post(
            reqs,
            |slot| WrId::Recv { slot }.encode(),
            "receive queue",
            "ibv_post_recv",
            Some(self.inner.recv_cq.room()),
            |wr, bad| {
                // SAFETY: a live QP; the chain and its SGEs live for the call, and the memory they
                // reference is owned by the table until the completions are polled.
                unsafe { ibv::ibv_post_recv(qp, wr, bad) }
            },
        )
    }
}

fn check_pd(slices: &[super::MrSlice], pd: *mut ibv::ibv_pd) -> Result<()> {
    match slices.iter().find(|s| s.pd_ptr() != pd) {
        Some(s) => Err(Error::invalid(
            "local",
            format!("{s:?}"),
            "the region belongs to another protection domain than the QP",
        )),
        None => Ok(()),
    }
}

impl QueuePair<Rts> {
    /// `ibv_post_send`—post a chain of work requests in one call. Each keeps its slices until its
    /// completion (or the signaled completion after it) is polled, and takes an entry of the send
    /// CQ until then, signaled or not. Returns how many were posted.
    ///
    /// Unsignaled requests are signaled anyway once in every
    /// [`signal_every`](QpCaps::signal_every), and the last request of a chain is signaled when
    /// it leaves the send queue or the send CQ more than half full: only a completion frees
    /// them, and this way polling always frees at least half of both, so a chain of up to half
    /// the send depth (and half the CQ's room) is always accepted again once completions are
    /// polled.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a request that breaks a rule (see [`WorkRequest`]);
    /// [`Error::QueueFull`] when the send queue, or the send CQ (shared with every QP using it),
    /// has no room for the whole chain: nothing is posted; [`Error::Os`] naming `ibv_post_send`
    /// (requests before the failing one were posted).
    #[doc(alias = "ibv_post_send")]
    pub fn post_send<'a>(
        &mut self,
        wrs: impl IntoIterator<Item = WorkRequest<'a>>,
    ) -> Result<usize> {
        let inner = &mut *self.inner;
        let caps = inner.caps;
        let pd = inner.pd.pd.as_ptr();
        let mut reqs: smallvec_lite::Small<WorkRequest<'a>> = smallvec_lite::Small::new();
        for w in wrs {
            w.validate(caps.max_send_sge, caps.max_inline_data)?;
            check_pd(w.sg.slices(), pd)?;
            reqs.push(w);
        }
        let n = reqs.len();
        if n == 0 {
            return Ok(0);
        }
        let mut t = lock(&inner.shared.sq);
        if t.len().saturating_add(n) > t.depth as usize {
            return Err(Error::QueueFull {
                queue: "send queue",
                depth: t.depth,
            });
        }
        // n <= depth (a u32) here. All or nothing: the whole chain's CQ entries, or none.
        let room = inner.send_cq.room();
        let cq_over_half = room.reserve(n as u32)? > room.capacity() / 2;
        inner.wr_scratch.clear();
        inner.sge_scratch.clear();
        let mut starts = Vec::with_capacity(n);
        let mut signals = Vec::with_capacity(n);
        let first_seq = t.next_seq;
        let sq_over_half = t.len() + n > t.depth as usize / 2;
        for (i, w) in reqs.iter().enumerate() {
            // A chain that leaves either queue more than half full ends signaled: then polling
            // always frees at least half of both, and a chain of up to half fits again.
            let last = i + 1 == n;
            let signaled = t.decide(w.signaled, last && (sq_over_half || cq_over_half));
            signals.push(signaled);
            let mut wr = ibv::ibv_send_wr {
                wr_id: WrId::Send {
                    seq: first_seq + i as u64,
                }
                .encode(),
                ..Default::default()
            };
            w.fill(&mut wr, signaled);
            let start = inner.sge_scratch.len();
            if let Some(d) = w.inline_data() {
                inner.sge_scratch.push(ibv::ibv_sge {
                    addr: d.as_ptr() as u64,
                    // At most max_inline_data (a u32): validated.
                    length: d.len() as u32,
                    lkey: 0,
                });
            } else {
                inner
                    .sge_scratch
                    .extend(w.sg.slices().iter().map(|s| s.sge()));
            }
            // At most max_send_sge entries: validated.
            wr.num_sge = (inner.sge_scratch.len() - start) as i32;
            starts.push(start);
            inner.wr_scratch.push(wr);
        }
        let base = inner.sge_scratch.as_mut_ptr();
        let wrp = inner.wr_scratch.as_mut_ptr();
        for (i, &start) in starts.iter().enumerate() {
            // SAFETY: i < n entries of the scratch vectors, which no longer grow; `start` indexes
            // the SGEs (used only when num_sge > 0).
            unsafe {
                let wr = &mut *wrp.add(i);
                wr.sg_list = if wr.num_sge == 0 {
                    std::ptr::null_mut()
                } else {
                    base.add(start)
                };
                wr.next = if i + 1 < n {
                    wrp.add(i + 1)
                } else {
                    std::ptr::null_mut()
                };
            }
        }
        for (i, (w, signaled)) in reqs.into_iter().zip(signals).enumerate() {
            let mut e = Entry::new(w.tag, w.sg, w.flag, true);
            e.signaled = signaled;
            t.entries.push_back((first_seq + i as u64, e));
        }
        t.next_seq += n as u64;
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live QP in RTS; the chain, its SGEs and inline data live for the call; the
        // memory non-inline SGEs reference is owned by the table until completion.
        let r = unsafe { ibv::ibv_post_send(inner.qp.as_ptr(), wrp, &mut bad) };
        if r != 0 {
            let first_bad = posted_before(wrp, bad, n);
            // Not posted: dropped, never seen by the NIC.
            for _ in first_bad..n {
                t.entries.pop_back();
            }
            t.next_seq = first_seq + first_bad as u64;
            room.release((n - first_bad) as u32);
            return Err(Error::errno("ibv_post_send", r.unsigned_abs() as i32));
        }
        Ok(n)
    }
}

impl<S: QpState> std::fmt::Debug for QueuePair<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &self.inner.qp_num)
            .field("state", &S::KIND)
            .field("outstanding", &self.outstanding())
            .finish()
    }
}

/// Attributes of the INIT → RTR transition: who the peer is and how to reach it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtrAttr {
    dest_qp_num: u32,
    rq_psn: u32,
    mtu: Mtu,
    dgid: Option<Gid>,
    sgid_index: u8,
    hop_limit: u8,
    dlid: u16,
    max_dest_rd_atomic: u8,
    min_rnr_timer: u8,
}

/// The largest QP number and PSN: both are 24-bit fields on the wire.
const MAX_24: u32 = 0xff_ffff;

impl RtrAttr {
    /// The peer's QP number and the PSN its first request will carry (both 24 bits, checked by
    /// [`QueuePair::to_rtr`]), and the path MTU (at most both ports' active MTU).
    pub fn new(dest_qp_num: u32, rq_psn: u32, mtu: Mtu) -> Self {
        RtrAttr {
            dest_qp_num,
            rq_psn,
            mtu,
            dgid: None,
            sgid_index: 0,
            hop_limit: 64,
            dlid: 0,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
        }
    }

    /// Route by GID (required on RoCE): the peer's GID and our GID table index.
    pub fn gid(mut self, dgid: Gid, sgid_index: u8) -> Self {
        self.dgid = Some(dgid);
        self.sgid_index = sgid_index;
        self
    }

    /// The peer's LID (InfiniBand).
    pub fn lid(mut self, dlid: u16) -> Self {
        self.dlid = dlid;
        self
    }

    /// RDMA reads and atomics the peer may have outstanding against us (default 1).
    pub fn max_dest_rd_atomic(mut self, n: u8) -> Self {
        self.max_dest_rd_atomic = n;
        self
    }

    /// Receiver-not-ready NAK delay code, 0 to 31 (default 12: 0.64 ms).
    pub fn min_rnr_timer(mut self, code: u8) -> Self {
        self.min_rnr_timer = code;
        self
    }

    /// The fields' ranges (a peer's [`Endpoint`] is untrusted input).
    pub(crate) fn check(&self) -> Result<()> {
        if self.dest_qp_num > MAX_24 {
            return Err(Error::invalid(
                "dest_qp_num",
                self.dest_qp_num,
                "a QP number is 24 bits",
            ));
        }
        if self.rq_psn > MAX_24 {
            return Err(Error::invalid("rq_psn", self.rq_psn, "a PSN is 24 bits"));
        }
        if self.min_rnr_timer > 31 {
            return Err(Error::invalid(
                "min_rnr_timer",
                self.min_rnr_timer,
                "the RNR timer code is 0 to 31",
            ));
        }
        Ok(())
    }
}

/// Attributes of the RTR → RTS transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtsAttr {
    sq_psn: u32,
    timeout: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    max_rd_atomic: u8,
}

impl RtsAttr {
    /// The PSN of our first request (the peer's `rq_psn`; 24 bits, checked by
    /// [`QueuePair::to_rts`]).
    pub fn new(sq_psn: u32) -> Self {
        RtsAttr {
            sq_psn,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 1,
        }
    }

    /// Local ACK timeout code, 0 to 31: 4.096 µs × 2^code (default 14: about 67 ms; 0: none).
    pub fn timeout(mut self, code: u8) -> Self {
        self.timeout = code;
        self
    }

    /// Transport retries, 0 to 7 (default 7).
    pub fn retry_cnt(mut self, n: u8) -> Self {
        self.retry_cnt = n;
        self
    }

    /// Receiver-not-ready retries, 0 to 7 (default 7: infinite).
    pub fn rnr_retry(mut self, n: u8) -> Self {
        self.rnr_retry = n;
        self
    }

    /// RDMA reads and atomics we may have outstanding (default 1).
    pub fn max_rd_atomic(mut self, n: u8) -> Self {
        self.max_rd_atomic = n;
        self
    }

    /// The fields' ranges.
    pub(crate) fn check(&self) -> Result<()> {
        let bad = |arg, v: u32, rule| Err(Error::invalid(arg, v, rule));
        if self.sq_psn > MAX_24 {
            return bad("sq_psn", self.sq_psn, "a PSN is 24 bits");
        }
        if self.timeout > 31 {
            return bad(
                "timeout",
                self.timeout as u32,
                "the timeout code is 0 to 31",
            );
        }
        if self.retry_cnt > 7 {
            return bad("retry_cnt", self.retry_cnt as u32, "retries are 0 to 7");
        }
        if self.rnr_retry > 7 {
            return bad("rnr_retry", self.rnr_retry as u32, "RNR retries are 0 to 7");
        }
        Ok(())
    }
}

/// What a peer needs to connect to a queue pair out of band: exchange these, then
/// [`RtrAttr::from_endpoint`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Endpoint {
    /// QP number.
    pub qp_num: u32,
    /// First PSN.
    pub psn: u32,
    /// GID (RoCE) and its table index.
    pub gid: Gid,
    /// GID table index on the owner's side.
    pub gid_index: u8,
    /// LID (InfiniBand).
    pub lid: u16,
}

impl RtrAttr {
    /// Attributes to reach `peer` with our GID index `sgid_index`.
    pub fn from_endpoint(peer: &Endpoint, mtu: Mtu, sgid_index: u8) -> Self {
        let a = RtrAttr::new(peer.qp_num, peer.psn, mtu).lid(peer.lid);
        if peer.gid.is_zero() {
            a
        } else {
            a.gid(peer.gid, sgid_index)
        }
    }
}

/// A few requests without a heap allocation (chains are usually short).
mod smallvec_lite {
    pub(crate) enum Small<T> {
        Inline([Option<T>; 4], usize),
        Heap(Vec<T>),
    }

    impl<T> Small<T> {
        pub(crate) fn new() -> Self {
            Small::Inline([None, None, None, None], 0)
        }
        pub(crate) fn push(&mut self, v: T) {
            match self {
                Small::Inline(a, n) if *n < 4 => {
                    a[*n] = Some(v);
                    *n += 1;
                }
                Small::Inline(a, _) => {
                    let mut vec: Vec<T> = a.iter_mut().filter_map(Option::take).collect();
                    vec.push(v);
                    *self = Small::Heap(vec);
                }
                Small::Heap(vec) => vec.push(v),
            }
        }
        pub(crate) fn len(&self) -> usize {
            match self {
                Small::Inline(_, n) => *n,
                Small::Heap(v) => v.len(),
            }
        }
        pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
            let (a, b) = match self {
                Small::Inline(a, n) => (Some(a[..*n].iter().filter_map(Option::as_ref)), None),
                Small::Heap(v) => (None, Some(v.iter())),
            };
            a.into_iter().flatten().chain(b.into_iter().flatten())
        }
        pub(crate) fn into_iter(self) -> impl Iterator<Item = T> {
            let (a, b) = match self {
                Small::Inline(a, n) => (Some(a.into_iter().take(n).flatten()), None),
                Small::Heap(v) => (None, Some(v.into_iter())),
            };
            a.into_iter().flatten().chain(b.into_iter().flatten())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn entry(tag: u64, flag: Option<CompletionFlag>) -> Entry {
        Entry::new(tag, Sg::None, flag, true)
    }

    fn wc(id: u64) -> ibv::ibv_wc {
        ibv::ibv_wc {
            wr_id: id,
            ..Default::default()
        }
    }

    #[test]
    fn a_signaled_completion_releases_every_earlier_request() {
        let mut t = SendTable::new(8, 4);
        let flags: Vec<CompletionFlag> = (0..5).map(|_| CompletionFlag::new()).collect();
        for (i, f) in flags.iter().enumerate() {
            t.entries
                .push_back((i as u64, entry(100 + i as u64, Some(f.clone()))));
        }
        assert_eq!(t.complete_through(2), (102, 3));
        assert_eq!(t.entries.len(), 2);
        assert!(flags[..3].iter().all(|f| f.is_complete()));
        assert!(!flags[3].is_complete());
        assert_eq!(
            t.complete_through(9),
            (0, 0),
            "an unknown id releases nothing"
        );
        assert_eq!(t.complete_through(4), (104, 2));
        assert!(t.entries.is_empty());
    }

    #[test]
    fn the_teardown_request_gives_back_no_cq_entry() {
        let mut t = SendTable::new(8, 8);
        let mut e = entry(1, None);
        e.signaled = false;
        t.entries.push_back((0, e));
        assert!(t.needs_marker());
        t.entries
            .push_back((1, Entry::new(0, Sg::None, None, false)));
        assert!(!t.needs_marker());
        assert_eq!(t.complete_through(1), (0, 1), "only the write's entry");
    }

    #[test]
    fn recv_slots_are_reused_and_released_once() {
        let mut t = RecvTable::new(4);
        let a = t.insert(entry(1, None));
        let b = t.insert(entry(2, None));
        assert_eq!(t.live(), 2);
        assert_eq!(t.take(a), (1, 1));
        assert_eq!(t.take(a), (0, 0), "a slot releases once");
        let c = t.insert(entry(3, None));
        assert_eq!(c, a);
        assert_eq!(t.unpost(b), 1);
        assert_eq!(t.live(), 1);
    }

    #[test]
    fn wr_ids_encode_the_queue() {
        let shared = QpShared {
            sq: Mutex::new(SendTable::new(4, 2)),
            rq: Mutex::new(RecvTable::new(4)),
        };
        lock(&shared.sq).entries.push_back((0, entry(7, None)));
        let slot = lock(&shared.rq).insert(entry(9, None));
        assert_eq!(shared.outstanding(), 2);
        assert_eq!(shared.complete(&wc(WrId::Recv { slot }.encode())), (9, 1));
        assert_eq!(shared.complete(&wc(WrId::Send { seq: 0 }.encode())), (7, 1));
        assert_eq!(shared.outstanding(), 0);
        assert_eq!(
            WrId::decode(WrId::Srq { srq: 5, slot: 7 }.encode()),
            WrId::Srq { srq: 5, slot: 7 }
        );
        assert_eq!(WrId::decode(u64::MAX), WrId::Other);
    }

    #[test]
    fn a_failed_post_with_an_unknown_bad_pointer_keeps_everything() {
        let a = [0u64; 4];
        let base = a.as_ptr();
        assert_eq!(posted_before(base, base.wrapping_add(2), 4), 2);
        assert_eq!(posted_before(base, std::ptr::null(), 4), 4);
        assert_eq!(posted_before(base, base.wrapping_add(9), 4), 4);
        assert_eq!(
            posted_before(base, (base as usize + 3) as *const u64, 4),
            4,
            "misaligned"
        );
    }

    #[test]
    fn small_chain_keeps_order() {
        let n = AtomicUsize::new(0);
        let mut s = smallvec_lite::Small::new();
        for i in 0..6 {
            s.push(i);
            n.fetch_add(1, Ordering::Relaxed);
        }
        assert_eq!(s.len(), 6);
        assert_eq!(
            s.iter().copied().collect::<Vec<_>>(),
            vec![0, 1, 2, 3, 4, 5]
        );
        assert_eq!(s.into_iter().collect::<Vec<_>>(), vec![0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn state_kinds_match_the_types() {
        assert_eq!(<ErrorState as QpState>::KIND, QpStateKind::Error);
        assert_eq!(<Reset as QpState>::KIND, QpStateKind::Reset);
        assert_eq!(QpStateKind::from_raw(ibv::IBV_QPS_ERR), QpStateKind::Error);
        assert_eq!(QpStateKind::from_raw(99), QpStateKind::Other(99));
    }

    fn dev(max_qp_wr: u32, max_sge: u32) -> DeviceAttr {
        DeviceAttr {
            fw_ver: String::new(),
            node_guid: 0,
            max_mr_size: 0,
            page_size_cap: 0,
            max_qp: 1,
            max_qp_wr,
            max_sge,
            max_cq: 1,
            max_cqe: 1,
            max_mr: 1,
            max_pd: 1,
            max_qp_rd_atom: 1,
            max_qp_init_rd_atom: 1,
            max_srq: 1,
            max_srq_wr: 1,
            max_srq_sge: 1,
            atomic_cap: 0,
            phys_port_cnt: 1,
        }
    }

    proptest! {
        /// Any caps: refused or accepted exactly by the rules, never a panic.
        #[test]
        fn caps_are_checked_against_the_device(
            send in any::<u32>(), recv in any::<u32>(), ssge in any::<u32>(), rsge in any::<u32>(),
            inline in any::<u32>(), every in any::<u32>(), srq in any::<bool>(),
            wr_max in 0u32..100_000, sge_max in 0u32..64,
        ) {
            let caps = QpCaps {
                max_send_wr: send, max_recv_wr: recv, max_send_sge: ssge, max_recv_sge: rsge,
                max_inline_data: inline, signal_every: every,
            };
            let d = dev(wr_max, sge_max);
            let ok = send >= 1
                && (srq || recv >= 1)
                && (wr_max == 0 || (send <= wr_max && (srq || recv <= wr_max)))
                && (sge_max == 0 || (ssge <= sge_max && rsge <= sge_max));
            prop_assert_eq!(caps.check(Some(&d), srq).is_ok(), ok);
            let g = caps.granted(&ibv::ibv_qp_cap {
                max_send_wr: send, max_recv_wr: recv, max_send_sge: ssge, max_recv_sge: rsge,
                max_inline_data: inline,
            });
            prop_assert!(g.signal_every >= 1 && g.signal_every <= send.max(1));
        }

        /// Any QP number, PSN and timer codes: refused unless within their bit widths.
        #[test]
        fn transition_attributes_are_range_checked(
            qpn in any::<u32>(), rpsn in any::<u32>(), rnr in any::<u8>(),
            spsn in any::<u32>(), timeout in any::<u8>(), retry in any::<u8>(), rnr_retry in any::<u8>(),
        ) {
            let r = RtrAttr::new(qpn, rpsn, Mtu::Mtu1024).min_rnr_timer(rnr);
            prop_assert_eq!(r.check().is_ok(), qpn <= MAX_24 && rpsn <= MAX_24 && rnr <= 31);
            let s = RtsAttr::new(spsn).timeout(timeout).retry_cnt(retry).rnr_retry(rnr_retry);
            prop_assert_eq!(
                s.check().is_ok(),
                spsn <= MAX_24 && timeout <= 31 && retry <= 7 && rnr_retry <= 7
            );
        }

        /// Chains of random signaling wishes against a queue and a CQ of random sizes: the CQ
        /// never holds more than it can, a chain that leaves either queue over half full ends
        /// signaled, no run of unsignaled requests reaches `signal_every`, polling what was
        /// reported leaves both at most half full, and after teardown everything is released and
        /// the CQ room is back where it started.
        #[test]
        fn posting_never_outgrows_the_queue_or_the_cq(
            depth in 1u32..40, every in 1u32..50, cap in 1u32..64,
            ops in proptest::collection::vec((0usize..12, any::<bool>(), any::<u8>()), 1..60),
        ) {
            let room = Room::new(cap);
            // The QP's teardown entry, taken at creation.
            prop_assume!(room.reserve(1).is_ok());
            let mut t = SendTable::new(depth, every.min(depth));
            let mut hw: VecDeque<u64> = VecDeque::new(); // signaled completions not yet polled
            for (n, want, poll) in ops {
                if n > 0 && t.len() + n <= depth as usize {
                    match room.reserve(n as u32) {
                        Ok(after) => {
                            prop_assert!(after <= cap);
                            let full = t.len() + n > depth as usize / 2 || after > cap / 2;
                            let mut run = 0;
                            for i in 0..n {
                                let s = t.decide(want, i + 1 == n && full);
                                let seq = t.next_seq;
                                t.next_seq += 1;
                                let mut e = Entry::new(seq, Sg::None, None, true);
                                e.signaled = s;
                                t.entries.push_back((seq, e));
                                if s { hw.push_back(seq); run = 0 } else { run += 1 }
                                prop_assert!(run < t.signal_every);
                            }
                            if full {
                                prop_assert!(t.entries.back().unwrap().1.signaled);
                            }
                        }
                        Err(Error::QueueFull { queue: "completion queue", depth: d }) => {
                            prop_assert_eq!(d, cap);
                            prop_assert!(room.reserved() + n as u32 > cap);
                        }
                        Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
                    }
                }
                // Hardware may hold one CQE per entry in the table: never more than the room.
                prop_assert!((t.len() as u32) < room.reserved(), "one per entry plus the teardown entry");
                prop_assert!(room.reserved() <= cap);
                for _ in 0..(poll % 4) {
                    if let Some(seq) = hw.pop_front() {
                        let (tag, freed) = t.complete_through(seq);
                        prop_assert_eq!(tag, seq);
                        room.release(freed);
                    }
                }
            }
            // Everything reported is polled: what stays is an unsignaled tail left by chains
            // that kept both queues at most half full, so a chain of half fits again.
            while let Some(seq) = hw.pop_front() {
                let (_, freed) = t.complete_through(seq);
                room.release(freed);
            }
            prop_assert!(t.len() <= depth as usize / 2, "{} of {}", t.len(), depth);
            prop_assert!(room.reserved() - 1 <= cap / 2, "{} of {}", room.reserved(), cap);
            // Teardown: a marker after an unsignaled tail, then every completion.
            if t.needs_marker() {
                let seq = t.next_seq;
                t.next_seq += 1;
                t.entries.push_back((seq, Entry::new(seq, Sg::None, None, false)));
                hw.push_back(seq);
            }
            while let Some(seq) = hw.pop_front() {
                let (_, freed) = t.complete_through(seq);
                room.release(freed);
            }
            prop_assert_eq!(t.len(), 0);
            prop_assert_eq!(room.reserved(), 1);
        }

        /// Receive tables under random posts and completions: the live count and the CQ room
        /// always agree, and a refused post changes nothing.
        #[test]
        fn receive_accounting_balances(
            depth in 1u32..32, cap in 1u32..48,
            ops in proptest::collection::vec((0usize..10, any::<u8>()), 1..60),
        ) {
            let room = Room::new(cap);
            let mut t = RecvTable::new(depth);
            let mut live: Vec<u32> = Vec::new();
            for (n, polls) in ops {
                let before = (t.live(), room.reserved());
                let fits_q = t.live() as usize + n <= depth as usize;
                let fits_cq = room.reserved() as usize + n <= cap as usize;
                let r = t.post(
                    (0..n).map(|_| RecvRequest::empty()).collect(),
                    |slot| WrId::Recv { slot }.encode(),
                    "receive queue",
                    "ibv_post_recv",
                    Some(&room),
                    |_, _| 0,
                );
                if n == 0 || (fits_q && fits_cq) {
                    prop_assert_eq!(r.unwrap(), n);
                } else {
                    prop_assert!(matches!(r, Err(Error::QueueFull { .. })), "{:?}", r);
                    prop_assert_eq!((t.live(), room.reserved()), before);
                }
                live = (0..t.slots.len() as u32)
                    .filter(|&s| t.slots[s as usize].is_some())
                    .collect();
                for s in live.iter().take(polls as usize % 5) {
                    let (_, f) = t.take(*s);
                    room.release(f);
                }
                prop_assert_eq!(t.live(), room.reserved());
                prop_assert!(room.reserved() <= cap);
            }
            drop(live);
        }

        /// A failing post keeps exactly the requests before the one the provider names.
        #[test]
        fn a_failed_receive_post_unposts_the_rest(n in 1usize..8, fail_at in 0usize..8) {
            let room = Room::new(64);
            let mut t = RecvTable::new(16);
            let r = t.post(
                (0..n).map(|_| RecvRequest::empty()).collect(),
                |slot| WrId::Recv { slot }.encode(),
                "receive queue",
                "ibv_post_recv",
                Some(&room),
                |wr, bad| {
                    if fail_at >= n {
                        return 0;
                    }
                    // SAFETY: the chain has n > fail_at entries.
                    unsafe { *bad = wr.add(fail_at) };
                    libc::ENOMEM
                },
            );
            let kept = if fail_at >= n { n } else { fail_at };
            prop_assert_eq!(r.is_ok(), fail_at >= n);
            prop_assert_eq!(t.live() as usize, kept);
            prop_assert_eq!(room.reserved() as usize, kept);
        }
    }
}
