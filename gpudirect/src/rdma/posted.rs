//! What posted requests hold until their completions are polled: the send and receive tables,
//! keyed by the `wr_id` the library chooses, and the completion-queue room every request takes.
//! Queue pairs and shared receive queues post through these tables; completion queues release
//! from them when they poll.

use super::wr::{RecvRequest, SendRequest, Sg};
use crate::completion::deferred::Woken;
use crate::completion::{CompletionFlag, Fence};
use crate::error::{Error, Result};
use gpudirect_sys::ibverbs as ibv;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

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

/// Completion-queue accounting: how many completions the work posted so far may still produce,
/// never above the CQ's capacity. Lock-free, so posting (under a queue's lock) and polling (under
/// the CQ's lock) never wait on each other.
#[derive(Debug)]
pub(crate) struct Room {
    capacity: u32,
    reserved: AtomicU32,
}

impl Room {
    pub(crate) fn new(capacity: u32) -> Self {
        Room {
            capacity,
            reserved: AtomicU32::new(0),
        }
    }

    /// Reserve `n` completions, all or none; returns the total reserved after.
    ///
    /// # Errors
    ///
    /// [`Error::QueueFull`] naming the completion queue when `n` more do not fit.
    pub(crate) fn reserve(&self, n: u32) -> Result<u32> {
        let cap = self.capacity;
        self.reserved
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| {
                r.checked_add(n).filter(|&t| t <= cap)
            })
            .map(|r| r + n)
            .map_err(|_| Error::QueueFull {
                queue: "completion queue",
                depth: cap,
            })
    }

    /// Give back `n` reserved completions (their requests were released).
    pub(crate) fn release(&self, n: u32) {
        if n > 0 {
            // Saturating: a release never wraps the count (it would only hide a bookkeeping bug).
            let _ = self
                .reserved
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| {
                    Some(r.saturating_sub(n))
                });
        }
    }

    pub(crate) fn reserved(&self) -> u32 {
        self.reserved.load(Ordering::Acquire)
    }

    pub(crate) fn capacity(&self) -> u32 {
        self.capacity
    }
}

/// What the completion that released a request reported: its status, and whether it was the
/// request's own completion or a later one that covered it (on RC, completions come in posting
/// order: a later one means the request finished, but not how).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reported {
    /// `enum ibv_wc_status` (`IBV_WC_SUCCESS` for a request covered by a successful completion).
    pub(crate) status: u32,
    pub(crate) vendor_err: u32,
    pub(crate) qp_num: u32,
    pub(crate) own: bool,
}

impl Reported {
    fn of(wc: &ibv::ibv_wc, own: bool) -> Self {
        Reported {
            status: wc.status,
            vendor_err: wc.vendor_err,
            qp_num: wc.qp_num,
            own,
        }
    }

    pub(crate) fn is_ok(&self) -> bool {
        self.status == ibv::IBV_WC_SUCCESS
    }
}

/// Where the completion of a request that asks for it is written, once, when the request is
/// released: memory-window binds and invalidations, whose effect on the NIC only their
/// completion tells. Complete (as a [`Fence`]) from then on.
#[derive(Debug, Clone, Default)]
pub(crate) struct StatusSlot(Arc<OnceLock<Reported>>);

impl StatusSlot {
    /// What was reported, once the request was released.
    pub(crate) fn get(&self) -> Option<Reported> {
        self.0.get().copied()
    }

    fn set(&self, r: Reported) {
        // Written once: a request is released once.
        let _ = self.0.set(r);
    }
}

impl Fence for StatusSlot {
    fn is_complete(&self) -> bool {
        self.0.get().is_some()
    }
}

/// What one posted request holds until its completion.
pub(crate) struct Entry {
    tag: u64,
    /// Held, never read: keeps the slices' regions registered and alive until completion.
    #[allow(dead_code)]
    sg: Sg,
    flag: Option<CompletionFlag>,
    /// Whether releasing it gives a completion-queue slot back (not for the teardown request,
    /// which uses the QP's own slot, nor for SRQ receives, whose room is reserved per SRQ).
    cq_slot: bool,
    /// Whether the NIC reports its completion on success (receives always do).
    signaled: bool,
    /// Where the releasing completion's status goes, for requests that ask.
    status: Option<StatusSlot>,
}

impl Entry {
    fn new(tag: u64, sg: Sg, flag: Option<CompletionFlag>, cq_slot: bool) -> Self {
        Entry {
            tag,
            sg,
            flag,
            cq_slot,
            signaled: true,
            status: None,
        }
    }

    /// Release what the request held; returns its tag and the CQ slots freed (0 or 1). Its
    /// flag goes to `woken`, set once the caller let the table's and the CQ's locks go (a
    /// waker that posts or polls inline takes them).
    fn release(self, woken: &mut Woken) -> (u64, u32) {
        // Slices dropped here, after the completion was seen: the NIC is done with them.
        let Entry {
            tag,
            sg,
            flag,
            cq_slot,
            ..
        } = self;
        drop(sg);
        woken.extend(flag);
        (tag, cq_slot as u32)
    }
}

/// A verbs request as chained in one post: `ibv_send_wr` or `ibv_recv_wr`.
trait Chained {
    fn num_sge(&self) -> i32;
    /// Point the request at its first SGE and at the next request (NULL for none).
    fn link(&mut self, sg_list: *mut ibv::ibv_sge, next: *mut Self);
}

/// Both request structs name their chain fields alike.
macro_rules! chained {
    ($($wr:ty),*) => {$(
        impl Chained for $wr {
            fn num_sge(&self) -> i32 {
                self.num_sge
            }
            fn link(&mut self, sg_list: *mut ibv::ibv_sge, next: *mut Self) {
                self.sg_list = sg_list;
                self.next = next;
            }
        }
    )*};
}
chained!(ibv::ibv_send_wr, ibv::ibv_recv_wr);

/// Chain `wrs` in order, each pointing at its `num_sge` entries of `sges` (laid out one request
/// after the other); returns the head. Neither vector may grow while the chain is in use.
fn link_chain<W: Chained>(wrs: &mut [W], sges: &mut [ibv::ibv_sge]) -> *mut W {
    let n = wrs.len();
    let base = sges.as_mut_ptr();
    let wrp = wrs.as_mut_ptr();
    let mut start = 0usize;
    for i in 0..n {
        // SAFETY: i < n entries of `wrs`; the request's SGEs are `sges[start..start + num_sge]`
        // (the caller laid them out so), and the pointer is taken only when there is one.
        unsafe {
            let wr = &mut *wrp.add(i);
            let cnt = wr.num_sge().max(0) as usize;
            let sg = if cnt > 0 {
                base.add(start)
            } else {
                std::ptr::null_mut()
            };
            let next = if i + 1 < n {
                wrp.add(i + 1)
            } else {
                std::ptr::null_mut()
            };
            wr.link(sg, next);
            start += cnt;
        }
    }
    wrp
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

/// The arrays a send chain is built in, kept by the queue pair so posting does not allocate.
#[derive(Default)]
pub(crate) struct SendScratch {
    wrs: Vec<ibv::ibv_send_wr>,
    sges: Vec<ibv::ibv_sge>,
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
    /// `wc`, the completion polled, goes to the status slots of the requests released.
    fn complete_through(
        &mut self,
        id: u64,
        wc: Option<&ibv::ibv_wc>,
        woken: &mut Woken,
    ) -> (u64, u32) {
        let Some(k) = self
            .entries
            .iter()
            .position(|(s, _)| *s & ID_MASK == id & ID_MASK)
        else {
            return (0, 0);
        };
        let (mut tag, mut freed) = (0, 0u32);
        for (i, (_, e)) in self.entries.drain(..=k).enumerate() {
            if let (Some(slot), Some(wc)) = (&e.status, wc) {
                let mut r = Reported::of(wc, i == k);
                if !r.own && r.is_ok() {
                    r.status = ibv::IBV_WC_SUCCESS;
                }
                slot.set(r);
            }
            let (t, f) = e.release(woken);
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

    /// Start counting unsignaled requests afresh (the QP was reset).
    pub(crate) fn restart_signaling(&mut self) {
        self.unsignaled_run = 0;
    }

    /// Whether the last request posted is unsignaled: nothing the NIC reports would then release
    /// it, and teardown needs a signaled request after it.
    fn needs_marker(&self) -> bool {
        self.entries.back().is_some_and(|(_, e)| !e.signaled)
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Add a request under the next sequence number.
    fn push(&mut self, e: Entry) {
        self.entries.push_back((self.next_seq, e));
        self.next_seq += 1;
    }

    /// Take back the last `k` requests added (never posted): dropped, not released.
    fn unpush(&mut self, k: usize) {
        for _ in 0..k {
            self.entries.pop_back();
        }
        self.next_seq -= k as u64;
    }

    /// Post `reqs` (validated) as one chain through `post` (`ibv_post_send`), keeping each
    /// request's slices here under its sequence number. Each request takes an entry of `room`
    /// (the send CQ), signaled or not. All or nothing before the call: the send queue and the CQ
    /// must have room for the whole chain; after a failing call, the requests before the failing
    /// one stay posted.
    ///
    /// Unsignaled requests are signaled anyway once in every `signal_every`, and the last of a
    /// chain that leaves the send queue or the CQ more than half full: then polling always frees
    /// at least half of both, and a chain of up to half fits again.
    pub(crate) fn post<'a>(
        &mut self,
        reqs: &mut smallvec_lite::Small<SendRequest<'a>>,
        room: &Room,
        scratch: &mut SendScratch,
        post: impl FnOnce(*mut ibv::ibv_send_wr, *mut *mut ibv::ibv_send_wr) -> i32,
    ) -> Result<usize> {
        let n = reqs.len();
        self.post_iter(reqs.drain(), n, room, scratch, post)
    }

    /// [`post`](Self::post) of the `n` requests `reqs` yields (exactly `n`).
    fn post_iter<'a>(
        &mut self,
        reqs: impl Iterator<Item = SendRequest<'a>>,
        n: usize,
        room: &Room,
        scratch: &mut SendScratch,
        post: impl FnOnce(*mut ibv::ibv_send_wr, *mut *mut ibv::ibv_send_wr) -> i32,
    ) -> Result<usize> {
        if n == 0 {
            return Ok(0);
        }
        if self.len().saturating_add(n) > self.depth as usize {
            return Err(Error::QueueFull {
                queue: "send queue",
                depth: self.depth,
            });
        }
        // n <= depth (a u32) here. All or nothing: the whole chain's CQ entries, or none.
        let cq_over_half = room.reserve(n as u32)? > room.capacity() / 2;
        let sq_over_half = self.len() + n > self.depth as usize / 2;
        scratch.wrs.clear();
        scratch.sges.clear();
        for (i, w) in reqs.take(n).enumerate() {
            let last = i + 1 == n;
            let signaled = self.decide(w.signaled, last && (sq_over_half || cq_over_half));
            let mut wr = ibv::ibv_send_wr {
                wr_id: WrId::Send { seq: self.next_seq }.encode(),
                ..Default::default()
            };
            w.fill(&mut wr, signaled);
            let start = scratch.sges.len();
            if let Some(d) = w.inline_data() {
                scratch.sges.push(ibv::ibv_sge {
                    addr: d.as_ptr() as u64,
                    // At most max_inline_data (a u32): validated.
                    length: d.len() as u32,
                    lkey: 0,
                });
            } else {
                scratch.sges.extend(w.sg.slices().iter().map(|s| s.sge()));
            }
            // At most max_send_sge entries: validated.
            wr.num_sge = (scratch.sges.len() - start) as i32;
            scratch.wrs.push(wr);
            let mut e = Entry::new(w.tag, w.sg, w.flag, true);
            e.signaled = signaled;
            self.push(e);
        }
        let wrp = link_chain(&mut scratch.wrs, &mut scratch.sges);
        let mut bad = std::ptr::null_mut();
        let r = post(wrp, &mut bad);
        if r != 0 {
            // Requests from `bad` on were not posted: drop their entries (never seen by the NIC).
            let not_posted = n - posted_before(wrp, bad, n);
            self.unpush(not_posted);
            room.release(not_posted as u32);
            return Err(Error::errno("ibv_post_send", r.unsigned_abs() as i32));
        }
        Ok(n)
    }

    /// Post one signaled request the caller built without SGEs (a memory-window bind or
    /// invalidation) through `post`: it holds `held` until its completion, whose status goes to
    /// `status`, and takes an entry of the send queue and of `room` (the send CQ) as every
    /// request does. Nothing is kept when the post fails.
    pub(crate) fn post_one(
        &mut self,
        mut wr: ibv::ibv_send_wr,
        held: Sg,
        tag: u64,
        status: StatusSlot,
        room: &Room,
        post: impl FnOnce(*mut ibv::ibv_send_wr, *mut *mut ibv::ibv_send_wr) -> i32,
    ) -> Result<()> {
        if self.len() >= self.depth as usize {
            return Err(Error::QueueFull {
                queue: "send queue",
                depth: self.depth,
            });
        }
        room.reserve(1)?;
        self.decide(true, false);
        wr.wr_id = WrId::Send { seq: self.next_seq }.encode();
        wr.send_flags |= ibv::IBV_SEND_SIGNALED;
        wr.next = std::ptr::null_mut();
        wr.sg_list = std::ptr::null_mut();
        wr.num_sge = 0;
        let mut e = Entry::new(tag, held, None, true);
        e.status = Some(status);
        self.push(e);
        let mut bad = std::ptr::null_mut();
        let r = post(&mut wr, &mut bad);
        if r != 0 {
            self.unpush(1);
            room.release(1);
            return Err(Error::errno("ibv_post_send", r.unsigned_abs() as i32));
        }
        Ok(())
    }

    /// For teardown in the error state: post one signaled, empty send through `post` after an
    /// unsignaled tail (its flushed completion proves everything before it finished). Its CQ
    /// entry is the one the QP reserved at creation. Returns false when it could not be posted.
    pub(crate) fn post_marker(
        &mut self,
        post: impl FnOnce(*mut ibv::ibv_send_wr, *mut *mut ibv::ibv_send_wr) -> i32,
    ) -> bool {
        if !self.needs_marker() {
            return true;
        }
        // An unsignaled tail leaves the queue at most half full (see `post`): there is room.
        if self.len() >= self.depth as usize {
            return false;
        }
        let mut wr = ibv::ibv_send_wr {
            wr_id: WrId::Send { seq: self.next_seq }.encode(),
            opcode: ibv::IBV_WR_SEND,
            send_flags: ibv::IBV_SEND_SIGNALED,
            ..Default::default()
        };
        self.push(Entry::new(0, Sg::None, None, false));
        let mut bad = std::ptr::null_mut();
        if post(&mut wr, &mut bad) != 0 {
            self.unpush(1);
            return false;
        }
        true
    }
}

/// Receive requests by slot (receive queue or SRQ).
pub(crate) struct RecvTable {
    slots: Vec<Option<Entry>>,
    free: Vec<u32>,
    live: u32,
    depth: u32,
    scratch: RecvScratch,
}

/// The arrays a receive chain is built in, kept by its table so that posting does not allocate.
#[derive(Default)]
struct RecvScratch {
    wrs: Vec<ibv::ibv_recv_wr>,
    sges: Vec<ibv::ibv_sge>,
    slots: Vec<u32>,
}

// SAFETY: the raw pointers in `wrs` (into `sges`, and to the next request) are written and used
// only within one post, by the thread that holds the table; between posts they are dead values,
// never dereferenced, and rewritten before the next use.
unsafe impl Send for RecvScratch {}

impl RecvTable {
    pub(crate) fn new(depth: u32) -> Self {
        RecvTable {
            slots: Vec::new(),
            free: Vec::new(),
            live: 0,
            depth,
            scratch: RecvScratch::default(),
        }
    }

    fn insert(&mut self, e: Entry) -> u32 {
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
    pub(crate) fn take(&mut self, slot: u32, woken: &mut Woken) -> (u64, u32) {
        match self.slots.get_mut(slot as usize).and_then(Option::take) {
            Some(e) => {
                self.live -= 1;
                self.free.push(slot);
                e.release(woken)
            }
            None => (0, 0),
        }
    }

    /// Remove an entry that was never posted (the post failed): dropped, not released. Returns
    /// the CQ slots it held.
    fn unpost(&mut self, slot: u32) -> u32 {
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
        reqs: &mut smallvec_lite::Small<RecvRequest>,
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
        let RecvScratch {
            mut wrs,
            mut sges,
            mut slots,
        } = std::mem::take(&mut self.scratch);
        sges.clear();
        wrs.clear();
        slots.clear();
        for r in reqs.drain() {
            let start = sges.len();
            sges.extend(r.sg.slices().iter().map(|s| s.sge()));
            let cnt = sges.len() - start;
            let slot = self.insert(Entry::new(r.tag, r.sg, r.flag, room.is_some()));
            slots.push(slot);
            wrs.push(ibv::ibv_recv_wr {
                wr_id: wr_id(slot),
                next: std::ptr::null_mut(),
                sg_list: std::ptr::null_mut(),
                // At most the queue's max_sge (validated), an int.
                num_sge: cnt as i32,
            });
        }
        let wrp = link_chain(&mut wrs, &mut sges);
        let mut bad = std::ptr::null_mut();
        let r = post(wrp, &mut bad);
        let out = if r != 0 {
            // Requests from `bad` on were not posted: drop their entries (never seen by the NIC).
            let first_bad = posted_before(wrp, bad, n);
            let mut freed = 0;
            for &slot in &slots[first_bad..] {
                freed += self.unpost(slot);
            }
            if let Some(room) = room {
                room.release(freed);
            }
            Err(Error::errno(call, r.unsigned_abs() as i32))
        } else {
            Ok(n)
        };
        self.scratch = RecvScratch { wrs, sges, slots };
        out
    }
}

/// Check every request of `wrs` (against the queue pair's `max_sge`, `max_inline` and its
/// protection domain `pd`), then post them all as one chain through `post` (all or none: a
/// request that breaks a rule posts nothing). One request, the usual case, goes without being
/// gathered first. The send table is locked only once every request is checked: the caller's
/// iterator never runs under it (it may poll the CQ, which takes that lock).
pub(crate) fn post_send_checked<'a>(
    tables: &PostedTables,
    limits: (u32, u32),
    pd: *mut ibv::ibv_pd,
    room: &Room,
    scratch: &mut SendScratch,
    wrs: impl IntoIterator<Item = SendRequest<'a>>,
    post: impl FnOnce(*mut ibv::ibv_send_wr, *mut *mut ibv::ibv_send_wr) -> i32,
) -> Result<usize> {
    let (max_sge, max_inline) = limits;
    let check = |w: &SendRequest<'_>| -> Result<()> {
        w.validate(max_sge, max_inline)?;
        w.sg.check_pd(pd, "QP")
    };
    let mut it = wrs.into_iter();
    let Some(first) = it.next() else {
        return Ok(0);
    };
    check(&first)?;
    let Some(second) = it.next() else {
        return tables
            .send()
            .post_iter(std::iter::once(first), 1, room, scratch, post);
    };
    check(&second)?;
    let mut reqs = smallvec_lite::Small::new();
    reqs.push(first);
    reqs.push(second);
    for w in it {
        check(&w)?;
        reqs.push(w);
    }
    tables.send().post(&mut reqs, room, scratch, post)
}

/// A queue pair's posted-request tables, shared with the CQs that report its completions.
pub(crate) struct PostedTables {
    sq: Mutex<SendTable>,
    rq: Mutex<RecvTable>,
    /// Memory windows bound, or being bound or invalidated, through the queue pair.
    windows: AtomicUsize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl PostedTables {
    pub(crate) fn new(send: SendTable, recv: RecvTable) -> Self {
        PostedTables {
            sq: Mutex::new(send),
            rq: Mutex::new(recv),
            windows: AtomicUsize::new(0),
        }
    }

    /// Count a memory window bound (or being bound) through the queue pair.
    pub(crate) fn window_linked(&self) {
        self.windows.fetch_add(1, Ordering::AcqRel);
    }

    /// A window counted by [`window_linked`](Self::window_linked) is unbound or deallocated.
    pub(crate) fn window_unlinked(&self) {
        self.windows.fetch_sub(1, Ordering::AcqRel);
    }

    /// Memory windows bound, or being bound or invalidated, through the queue pair.
    pub(crate) fn windows(&self) -> usize {
        self.windows.load(Ordering::Acquire)
    }

    pub(crate) fn send(&self) -> MutexGuard<'_, SendTable> {
        lock(&self.sq)
    }

    pub(crate) fn recv(&self) -> MutexGuard<'_, RecvTable> {
        lock(&self.rq)
    }

    /// Release what the request behind `wc` held: its tag and the CQ slots freed. Its flags go
    /// to `woken`.
    pub(crate) fn complete(&self, wc: &ibv::ibv_wc, woken: &mut Woken) -> (u64, u32) {
        match WrId::decode(wc.wr_id) {
            WrId::Send { seq } => self.send().complete_through(seq, Some(wc), woken),
            WrId::Recv { slot } => self.recv().take(slot, woken),
            WrId::Srq { .. } | WrId::Other => (0, 0),
        }
    }

    pub(crate) fn outstanding(&self) -> usize {
        self.send_outstanding() + self.recv().live() as usize
    }

    pub(crate) fn send_outstanding(&self) -> usize {
        self.send().len()
    }
}

/// A few requests without a heap allocation (chains are usually short).
pub(crate) mod smallvec_lite {
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

        /// The elements, in order.
        pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
            let (a, b) = match self {
                Small::Inline(a, n) => (&a[..*n], &[][..]),
                Small::Heap(v) => (&[][..], &v[..]),
            };
            a.iter().flatten().chain(b)
        }
        /// Take every element out, in order, leaving it empty; nothing is moved but the
        /// elements themselves (the inline array stays where it is).
        pub(crate) fn drain(&mut self) -> Drain<'_, T> {
            match self {
                Small::Inline(a, n) => {
                    let k = std::mem::take(n);
                    Drain::Inline(a[..k].iter_mut())
                }
                Small::Heap(v) => Drain::Heap(v.drain(..)),
            }
        }
    }

    impl<T> FromIterator<T> for Small<T> {
        fn from_iter<I: IntoIterator<Item = T>>(it: I) -> Self {
            let mut s = Small::new();
            for v in it {
                s.push(v);
            }
            s
        }
    }

    /// [`Small::drain`]'s iterator.
    pub(crate) enum Drain<'s, T> {
        Inline(std::slice::IterMut<'s, Option<T>>),
        Heap(std::vec::Drain<'s, T>),
    }

    impl<T> Iterator for Drain<'_, T> {
        type Item = T;

        fn next(&mut self) -> Option<T> {
            match self {
                // Every slot below the length holds one; a hole would be skipped, not end it.
                Drain::Inline(it) => it.find_map(Option::take),
                Drain::Heap(d) => d.next(),
            }
        }
    }

    impl<T> Drop for Drain<'_, T> {
        fn drop(&mut self) {
            // What was not taken is dropped now, as a consumed vector's rest would be.
            for _ in self.by_ref() {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completion::Fence;
    use crate::rdma::mr::{AccessFlags, MrSlice, RemoteSlice};
    use proptest::prelude::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn entry(tag: u64, flag: Option<CompletionFlag>) -> Entry {
        Entry::new(tag, Sg::None, flag, true)
    }

    /// A peer's 64 bytes at 0x9000 (rkey 3).
    fn remote_slice() -> RemoteSlice {
        RemoteSlice {
            addr: 0x9000,
            rkey: 3,
            len: 64,
        }
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
        assert_eq!(t.complete_through(2, None, &mut Woken::default()), (102, 3));
        assert_eq!(t.entries.len(), 2);
        assert!(flags[..3].iter().all(|f| f.is_complete()));
        assert!(!flags[3].is_complete());
        assert_eq!(
            t.complete_through(9, None, &mut Woken::default()),
            (0, 0),
            "an unknown id releases nothing"
        );
        assert_eq!(t.complete_through(4, None, &mut Woken::default()), (104, 2));
        assert!(t.entries.is_empty());
    }

    /// A bind or an invalidation: one signaled request without SGEs that holds its slice until
    /// its completion, which writes its status slot. A later completion that covers it writes
    /// success only when that one succeeded, and says it was not the request's own.
    #[test]
    fn a_request_with_a_status_slot_hears_its_completion() {
        let mr = crate::rdma::mr::fake_region(0x10_000, 4096, AccessFlags::MW_BIND);
        let base = Arc::strong_count(&mr);
        let mut t = SendTable::new(3, 3);
        let room = Room::new(8);
        let post = |t: &mut SendTable, held: Sg, slot: &StatusSlot, seen: &mut Vec<_>| {
            let wr = ibv::ibv_send_wr {
                opcode: ibv::IBV_WR_BIND_MW,
                num_sge: 3,
                ..Default::default()
            };
            t.post_one(wr, held, 9, slot.clone(), &room, |wr, _| {
                // SAFETY: one request, alive for the call.
                let w = unsafe { &*wr };
                seen.push((w.wr_id, w.opcode, w.send_flags, w.num_sge));
                assert!(w.next.is_null() && w.sg_list.is_null());
                0
            })
        };
        let (a, b, c) = (
            StatusSlot::default(),
            StatusSlot::default(),
            StatusSlot::default(),
        );
        let mut seen = Vec::new();
        let slice = MrSlice::of(&mr, 0..64).unwrap();
        post(&mut t, Sg::One(slice), &a, &mut seen).unwrap();
        post(&mut t, Sg::None, &b, &mut seen).unwrap();
        let id = |seq| WrId::Send { seq }.encode();
        let bind = (ibv::IBV_WR_BIND_MW, ibv::IBV_SEND_SIGNALED, 0);
        assert_eq!(
            seen,
            vec![
                (id(0), bind.0, bind.1, bind.2),
                (id(1), bind.0, bind.1, bind.2)
            ]
        );
        assert_eq!((t.len(), room.reserved()), (2, 2));
        assert_eq!(Arc::strong_count(&mr), base + 1, "the slice is held");
        assert!(!a.is_complete() && !b.is_complete());
        // The second one's completion, failed: the first is covered, not told it failed.
        let mut failed = wc(id(1));
        (failed.status, failed.qp_num) = (ibv::IBV_WC_MW_BIND_ERR, 7);
        assert_eq!(
            t.complete_through(1, Some(&failed), &mut Woken::default()),
            (9, 2)
        );
        room.release(2);
        let r = |status, own| Reported {
            status,
            vendor_err: 0,
            qp_num: 7,
            own,
        };
        assert_eq!(a.get(), Some(r(ibv::IBV_WC_MW_BIND_ERR, false)));
        assert_eq!(b.get(), Some(r(ibv::IBV_WC_MW_BIND_ERR, true)));
        assert_eq!(Arc::strong_count(&mr), base, "released with the request");
        // Covered by a success: success.
        post(&mut t, Sg::None, &a, &mut seen).unwrap();
        post(&mut t, Sg::None, &c, &mut seen).unwrap();
        let mut ok = wc(id(3));
        ok.qp_num = 7;
        room.release(t.complete_through(3, Some(&ok), &mut Woken::default()).1);
        assert_eq!(
            a.get(),
            Some(r(ibv::IBV_WC_MW_BIND_ERR, false)),
            "written once"
        );
        assert_eq!(c.get(), Some(r(ibv::IBV_WC_SUCCESS, true)));
        // A full queue, or a failed post, keeps nothing.
        for _ in 0..3 {
            post(&mut t, Sg::None, &StatusSlot::default(), &mut seen).unwrap();
        }
        let full = post(&mut t, Sg::None, &StatusSlot::default(), &mut seen);
        assert!(matches!(
            full,
            Err(Error::QueueFull {
                queue: "send queue",
                depth: 3
            })
        ));
        room.release(t.complete_through(6, None, &mut Woken::default()).1);
        let wr = ibv::ibv_send_wr::default();
        let r = t.post_one(wr, Sg::None, 0, StatusSlot::default(), &room, |_, _| {
            libc::EINVAL
        });
        assert!(matches!(
            r,
            Err(Error::Os {
                call: "ibv_post_send",
                ..
            })
        ));
        assert_eq!((t.len(), room.reserved()), (0, 0));
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
        assert_eq!(
            t.complete_through(1, None, &mut Woken::default()),
            (0, 1),
            "only the write's entry"
        );
    }

    #[test]
    fn recv_slots_are_reused_and_released_once() {
        let mut t = RecvTable::new(4);
        let a = t.insert(entry(1, None));
        let b = t.insert(entry(2, None));
        assert_eq!(t.live(), 2);
        assert_eq!(t.take(a, &mut Woken::default()), (1, 1));
        assert_eq!(
            t.take(a, &mut Woken::default()),
            (0, 0),
            "a slot releases once"
        );
        let c = t.insert(entry(3, None));
        assert_eq!(c, a);
        assert_eq!(t.unpost(b), 1);
        assert_eq!(t.live(), 1);
    }

    #[test]
    fn a_released_requests_flag_is_set_once_the_tables_are_unlocked() {
        use crate::completion::Fence;
        use crate::completion::testing::WokenFree;
        use std::sync::Arc;
        use std::task::Waker;
        let tables = Arc::new(PostedTables::new(SendTable::new(4, 2), RecvTable::new(4)));
        let t = tables.clone();
        let probe = WokenFree::new(move || t.sq.try_lock().is_ok() && t.rq.try_lock().is_ok());
        let (sent, received) = (CompletionFlag::new(), CompletionFlag::new());
        for f in [&sent, &received] {
            assert!(f.register_waker(&Waker::from(probe.clone())));
        }
        tables.send().push(entry(7, Some(sent.clone())));
        let slot = tables.recv().insert(entry(9, Some(received.clone())));
        let mut woken = Woken::default();
        assert_eq!(
            tables.complete(&wc(WrId::Send { seq: 0 }.encode()), &mut woken),
            (7, 1)
        );
        assert_eq!(
            tables.complete(&wc(WrId::Recv { slot }.encode()), &mut woken),
            (9, 1)
        );
        assert!(
            !sent.is_complete() && !received.is_complete(),
            "not set by the tables"
        );
        drop(woken);
        assert!(sent.is_complete() && received.is_complete());
        assert_eq!(probe.count(), 2, "both woken with the tables free");
    }

    #[test]
    fn wr_ids_encode_the_queue() {
        let shared = PostedTables::new(SendTable::new(4, 2), RecvTable::new(4));
        shared.send().push(entry(7, None));
        let slot = shared.recv().insert(entry(9, None));
        assert_eq!(shared.outstanding(), 2);
        assert_eq!(
            shared.complete(&wc(WrId::Recv { slot }.encode()), &mut Woken::default()),
            (9, 1)
        );
        assert_eq!(
            shared.complete(&wc(WrId::Send { seq: 0 }.encode()), &mut Woken::default()),
            (7, 1)
        );
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

    /// Post `n` empty receives to a queue pair's receive table through `post`.
    fn post_empty_recvs(
        t: &mut RecvTable,
        n: usize,
        room: &Room,
        post: impl FnOnce(*mut ibv::ibv_recv_wr, *mut *mut ibv::ibv_recv_wr) -> i32,
    ) -> Result<usize> {
        t.post(
            &mut (0..n).map(|_| RecvRequest::empty()).collect(),
            |slot| WrId::Recv { slot }.encode(),
            "receive queue",
            "ibv_post_recv",
            Some(room),
            post,
        )
    }

    /// One request as the provider sees it: its `wr_id` (or another field the caller picks) and
    /// its SGEs as (addr, length, lkey).
    type Seen = (u64, Vec<(u64, u32, u32)>);

    /// The requests of a chain as the provider walks it.
    ///
    /// # Safety
    ///
    /// `wr` heads a chain built by `link_chain` whose arrays are still alive.
    unsafe fn walk<W: Chained>(
        mut wr: *mut W,
        parts: impl Fn(&W) -> (u64, *mut ibv::ibv_sge, *mut W),
    ) -> Vec<Seen> {
        let mut out = Vec::new();
        while !wr.is_null() {
            // SAFETY: a live request of the chain (the caller's contract).
            let w = unsafe { &*wr };
            let (id, sg, next) = parts(w);
            let n = w.num_sge() as usize;
            assert_eq!(
                sg.is_null(),
                n == 0,
                "an SGE list exactly when there are entries"
            );
            let sges = (0..n)
                .map(|i| {
                    // SAFETY: `n` entries at `sg`, laid out by the post.
                    let s = unsafe { *sg.add(i) };
                    (s.addr, s.length, s.lkey)
                })
                .collect();
            out.push((id, sges));
            wr = next;
        }
        out
    }

    #[test]
    fn a_checked_post_refuses_a_bad_chain_whole_and_never_runs_the_callers_iterator_locked() {
        let tables = PostedTables::new(SendTable::new(8, 4), RecvTable::new(4));
        let room = Room::new(16);
        let mut scratch = SendScratch::default();
        let remote = remote_slice();
        let data = [7u8; 32];
        let unlocked = || tables.sq.try_lock().is_ok();
        // The third request's inline data passes the QP's 16 bytes: nothing is posted.
        let mut called = false;
        let chain = (0..3).map(|i| {
            assert!(
                unlocked(),
                "the caller's iterator ran under the send table's lock"
            );
            SendRequest::write_inline(if i == 2 { &data[..] } else { &data[..8] }, remote)
        });
        let e = post_send_checked(
            &tables,
            (1, 16),
            std::ptr::null_mut(),
            &room,
            &mut scratch,
            chain,
            |_, _| {
                called = true;
                0
            },
        )
        .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        assert!(!called, "posted after a refusal");
        assert_eq!((tables.send_outstanding(), room.reserved()), (0, 0));
        // One request and a chain of two, each checked with the table unlocked, then posted.
        for n in [1usize, 2] {
            let reqs = (0..n).map(|_| {
                assert!(
                    unlocked(),
                    "the caller's iterator ran under the send table's lock"
                );
                SendRequest::write_inline(&data[..8], remote)
            });
            let posted = post_send_checked(
                &tables,
                (1, 16),
                std::ptr::null_mut(),
                &room,
                &mut scratch,
                reqs,
                |wr, _| {
                    // SAFETY: the chain the post built, alive for the call.
                    let seen = unsafe { walk(wr, |w| (w.wr_id, w.sg_list, w.next)) };
                    assert_eq!(seen.len(), n);
                    0
                },
            );
            assert_eq!(posted.unwrap(), n);
        }
        assert_eq!(tables.send_outstanding(), 3);
    }

    #[test]
    fn a_refused_chain_drops_its_requests_and_leaves_the_list_empty() {
        let mr = crate::rdma::mr::fake_region(0x30_000, 4096, AccessFlags::LOCAL_WRITE);
        let before = std::sync::Arc::strong_count(&mr);
        let remote = remote_slice();
        let mut t = SendTable::new(2, 2);
        let room = Room::new(16);
        let mut scratch = SendScratch::default();
        for n in [3usize, 6] {
            // Inline (3) and on the heap (6): the queue holds 2, so nothing is posted.
            let mut reqs: smallvec_lite::Small<SendRequest<'_>> = (0..n)
                .map(|i| SendRequest::write(MrSlice::of(&mr, i * 8..i * 8 + 8).unwrap(), remote))
                .collect();
            assert!(std::sync::Arc::strong_count(&mr) > before);
            let e = t
                .post(&mut reqs, &room, &mut scratch, |_, _| panic!("posted"))
                .unwrap_err();
            assert!(matches!(e, Error::QueueFull { .. }), "{e}");
            assert_eq!(reqs.len(), 0);
            assert_eq!(
                std::sync::Arc::strong_count(&mr),
                before,
                "a refused request was kept"
            );
            assert_eq!((t.len(), room.reserved()), (0, 0));
        }
    }

    #[test]
    fn receive_chains_are_rebuilt_in_the_kept_arrays_after_any_post() {
        let mr = crate::rdma::mr::fake_region(0x20_000, 4096, AccessFlags::LOCAL_WRITE);
        let sl = |o: usize, l: usize| MrSlice::of(&mr, o..o + l).unwrap();
        let lkey = 1; // fake_region's
        let room = Room::new(16);
        let mut rt = RecvTable::new(8);
        // Post `reqs`; the provider fails at request `fail_at` when given. Returns the result
        // and the chain as the provider saw it.
        let post = |rt: &mut RecvTable, reqs: Vec<RecvRequest>, fail_at: Option<usize>| {
            let mut seen = Vec::new();
            let r = rt.post(
                &mut reqs.into_iter().collect(),
                |slot| WrId::Recv { slot }.encode(),
                "receive queue",
                "ibv_post_recv",
                Some(&room),
                |wr, bad| {
                    // SAFETY: the chain the post built, alive for the call.
                    seen = unsafe { walk(wr, |w| (w.wr_id, w.sg_list, w.next)) };
                    match fail_at {
                        None => 0,
                        Some(k) => {
                            // SAFETY: the chain has more than `k` requests, laid out in order.
                            unsafe { *bad = wr.add(k) };
                            -libc::EINVAL
                        }
                    }
                },
            );
            (r, seen)
        };
        let sges = |seen: &[Seen]| seen.iter().map(|(_, s)| s.clone()).collect::<Vec<_>>();
        let (r, seen) = post(
            &mut rt,
            vec![
                RecvRequest::sg(vec![sl(0, 8), sl(8, 8)]),
                RecvRequest::empty(),
                RecvRequest::new(sl(64, 4)),
            ],
            None,
        );
        assert_eq!(r.unwrap(), 3);
        assert_eq!(
            sges(&seen),
            vec![
                vec![(0x20_000, 8, lkey), (0x20_008, 8, lkey)],
                vec![],
                vec![(0x20_040, 4, lkey)]
            ]
        );
        // A failed post after it: the requests from the failing one on are dropped again.
        let (r, _) = post(
            &mut rt,
            vec![RecvRequest::new(sl(128, 8)), RecvRequest::new(sl(136, 8))],
            Some(1),
        );
        assert!(r.is_err());
        assert_eq!((rt.live(), room.reserved()), (4, 4));
        // A longer chain after both: every pointer is its own again.
        let (r, seen) = post(
            &mut rt,
            vec![
                RecvRequest::sg(vec![sl(256, 4), sl(260, 4), sl(264, 4)]),
                RecvRequest::new(sl(512, 16)),
            ],
            None,
        );
        assert_eq!(r.unwrap(), 2);
        assert_eq!(
            sges(&seen),
            vec![
                vec![
                    (0x20_100, 4, lkey),
                    (0x20_104, 4, lkey),
                    (0x20_108, 4, lkey)
                ],
                vec![(0x20_200, 16, lkey)]
            ]
        );
        let ids: std::collections::HashSet<u64> = seen.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids.len(), 2);
        assert_eq!(rt.live(), 6);
    }

    /// Instruction probe of the posting path a latency loop takes (one inline 8-byte write a
    /// call, one in 32 signaled and its completion released), without a NIC: the verbs call is a
    /// stub. Run by hand under callgrind with two counts and take the difference, e.g.
    /// `PROBE_N=1000` and `PROBE_N=11000`, then divide by 10,000: about 1,430 instructions a post
    /// when every chain was gathered in an inline array and moved out through a chained
    /// iterator, about 620 with one request posted without gathering.
    #[test]
    #[ignore = "an instruction probe, run by hand under callgrind (PROBE_N iterations)"]
    fn post_path_probe() {
        let n: u64 = std::env::var("PROBE_N")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1000);
        let remote = remote_slice();
        let posted = PostedTables::new(SendTable::new(128, 32), RecvTable::new(64));
        let room = Room::new(192);
        let mut scratch = SendScratch::default();
        let mut buf = [0u8; 8];
        for i in 1..=n {
            buf.copy_from_slice(&i.to_ne_bytes());
            let w = SendRequest::write_inline(&buf, remote).tag(i);
            let signaled = i % 32 == 0;
            let w = if signaled { w } else { w.unsignaled() };
            let seq = posted.send().next_seq;
            post_send_checked(
                &posted,
                (1, 128),
                std::ptr::null_mut(),
                &room,
                &mut scratch,
                [w],
                |wr, _| {
                    std::hint::black_box(wr);
                    0
                },
            )
            .unwrap();
            if signaled {
                let (_, f) =
                    posted.complete(&wc(WrId::Send { seq }.encode()), &mut Woken::default());
                room.release(f);
            }
        }
    }

    #[test]
    fn chains_point_each_request_at_its_own_entries() {
        let mr = crate::rdma::mr::fake_region(0x10_000, 8192, AccessFlags::LOCAL_WRITE);
        let sl = |o: usize, l: usize| MrSlice::of(&mr, o..o + l).unwrap();
        let remote = remote_slice();
        let data = *b"inline";
        let mut reqs = smallvec_lite::Small::new();
        reqs.push(SendRequest::send_sg(vec![sl(0, 16), sl(100, 8)]));
        reqs.push(SendRequest::send_inline(&data));
        reqs.push(SendRequest::write(sl(200, 32), remote).tag(5));
        let mut t = SendTable::new(8, 8);
        let room = Room::new(16);
        let mut scratch = SendScratch::default();
        let mut seen = Vec::new();
        let r = t.post(&mut reqs, &room, &mut scratch, |wr, _| {
            // SAFETY: the chain the post built, alive for the call.
            seen = unsafe { walk(wr, |w| (w.wr_id, w.sg_list, w.next)) };
            0
        });
        assert_eq!(r.unwrap(), 3);
        let lkey = 1; // fake_region's
        assert_eq!(
            seen,
            vec![
                (
                    WrId::Send { seq: 0 }.encode(),
                    vec![(0x10_000, 16, lkey), (0x10_000 + 100, 8, lkey)]
                ),
                (
                    WrId::Send { seq: 1 }.encode(),
                    vec![(data.as_ptr() as u64, 6, 0)]
                ),
                (
                    WrId::Send { seq: 2 }.encode(),
                    vec![(0x10_000 + 200, 32, lkey)]
                ),
            ]
        );
        assert_eq!((t.len(), room.reserved()), (3, 3));
        assert_eq!(
            t.complete_through(WrId::Send { seq: 2 }.encode(), None, &mut Woken::default()),
            (5, 3)
        );

        let mut rt = RecvTable::new(8);
        let mut seen = Vec::new();
        let r = rt.post(
            &mut [
                RecvRequest::sg(vec![sl(0, 8), sl(8, 8)]),
                RecvRequest::empty(),
                RecvRequest::new(sl(64, 4)),
            ]
            .into_iter()
            .collect(),
            |slot| WrId::Recv { slot }.encode(),
            "receive queue",
            "ibv_post_recv",
            Some(&room),
            |wr, _| {
                // SAFETY: as above.
                seen = unsafe { walk(wr, |w| (w.wr_id, w.sg_list, w.next)) };
                0
            },
        );
        assert_eq!(r.unwrap(), 3);
        assert_eq!(
            seen,
            vec![
                (
                    WrId::Recv { slot: 0 }.encode(),
                    vec![(0x10_000, 8, lkey), (0x10_008, 8, lkey)]
                ),
                (WrId::Recv { slot: 1 }.encode(), vec![]),
                (
                    WrId::Recv { slot: 2 }.encode(),
                    vec![(0x10_000 + 64, 4, lkey)]
                ),
            ]
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
        assert_eq!(s.drain().collect::<Vec<_>>(), vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(s.len(), 0);
    }

    proptest! {
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
            let mut scratch = SendScratch::default();
            let mut hw: VecDeque<u64> = VecDeque::new(); // signaled completions not yet polled
            for (n, want, poll) in ops {
                if n > 0 && t.len() + n <= depth as usize {
                    let (len0, seq0, before) = (t.len(), t.next_seq, room.reserved());
                    let mut reqs = smallvec_lite::Small::new();
                    for i in 0..n {
                        let r = SendRequest::send_inline(b"x").tag(seq0 + i as u64);
                        reqs.push(if want { r } else { r.unsignaled() });
                    }
                    // Each request's send flags, as the provider is handed them.
                    let mut flags = Vec::new();
                    let r = t.post(&mut reqs, &room, &mut scratch, |wr, _| {
                        // SAFETY: the chain the post built, alive for the call.
                        flags = unsafe { walk(wr, |w| (w.send_flags as u64, w.sg_list, w.next)) };
                        0
                    });
                    match r {
                        Ok(_) => {
                            let after = room.reserved();
                            prop_assert_eq!(after, before + n as u32);
                            prop_assert!(after <= cap);
                            let full = len0 + n > depth as usize / 2 || after > cap / 2;
                            let mut run = 0;
                            for (i, (f, _)) in flags.iter().enumerate() {
                                let s = *f as u32 & ibv::IBV_SEND_SIGNALED != 0;
                                if s { hw.push_back(seq0 + i as u64); run = 0 } else { run += 1 }
                                prop_assert!(run < t.signal_every);
                            }
                            if full {
                                prop_assert!(t.entries.back().unwrap().1.signaled);
                            }
                        }
                        Err(Error::QueueFull { queue: "completion queue", depth: d }) => {
                            prop_assert_eq!(d, cap);
                            prop_assert!(before + n as u32 > cap);
                            prop_assert_eq!((t.len(), room.reserved()), (len0, before));
                        }
                        Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
                    }
                }
                // Hardware may hold one CQE per entry in the table: never more than the room.
                prop_assert!((t.len() as u32) < room.reserved(), "one per entry plus the teardown entry");
                prop_assert!(room.reserved() <= cap);
                for _ in 0..(poll % 4) {
                    if let Some(seq) = hw.pop_front() {
                        let (tag, freed) = t.complete_through(seq, None, &mut Woken::default());
                        prop_assert_eq!(tag, seq);
                        room.release(freed);
                    }
                }
            }
            // Everything reported is polled: what stays is an unsignaled tail left by chains
            // that kept both queues at most half full, so a chain of half fits again.
            while let Some(seq) = hw.pop_front() {
                let (_, freed) = t.complete_through(seq, None, &mut Woken::default());
                room.release(freed);
            }
            prop_assert!(t.len() <= depth as usize / 2, "{} of {}", t.len(), depth);
            prop_assert!(room.reserved() - 1 <= cap / 2, "{} of {}", room.reserved(), cap);
            // Teardown: a marker after an unsignaled tail, then every completion.
            let marked = t.post_marker(|wr, _| {
                // SAFETY: one request, alive for the call.
                hw.push_back(unsafe { (*wr).wr_id });
                0
            });
            prop_assert!(marked);
            while let Some(seq) = hw.pop_front() {
                let (_, freed) = t.complete_through(seq, None, &mut Woken::default());
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
                let r = post_empty_recvs(&mut t, n, &room, |_, _| 0);
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
                    let (_, f) = t.take(*s, &mut Woken::default());
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
            let r = post_empty_recvs(&mut t, n, &room, |wr, bad| {
                if fail_at >= n {
                    return 0;
                }
                // SAFETY: the chain has n > fail_at entries.
                unsafe { *bad = wr.add(fail_at) };
                libc::ENOMEM
            });
            let kept = if fail_at >= n { n } else { fail_at };
            prop_assert_eq!(r.is_ok(), fail_at >= n);
            prop_assert_eq!(t.live() as usize, kept);
            prop_assert_eq!(room.reserved() as usize, kept);
        }

        /// A failing send post keeps exactly the requests before the one the provider names,
        /// gives back the CQ room of the rest, and numbers the next post on from them.
        #[test]
        fn a_failed_send_post_unposts_the_rest(n in 1usize..8, fail_at in 0usize..8) {
            let room = Room::new(64);
            prop_assert!(room.reserve(1).is_ok()); // the QP's teardown entry
            let mut t = SendTable::new(16, 16);
            let mut scratch = SendScratch::default();
            let mut reqs = smallvec_lite::Small::new();
            for _ in 0..n {
                reqs.push(SendRequest::send_inline(b"x"));
            }
            let r = t.post(&mut reqs, &room, &mut scratch, |wr, bad| {
                if fail_at >= n {
                    return 0;
                }
                // SAFETY: the chain has n > fail_at entries.
                unsafe { *bad = wr.add(fail_at) };
                libc::ENOMEM
            });
            let kept = fail_at.min(n);
            prop_assert_eq!(r.is_ok(), fail_at >= n);
            prop_assert_eq!(t.len(), kept);
            prop_assert_eq!(room.reserved() as usize, 1 + kept);
            let mut next = smallvec_lite::Small::new();
            next.push(SendRequest::send_inline(b"y"));
            let mut first = 0;
            t.post(&mut next, &room, &mut scratch, |wr, _| {
                // SAFETY: a chain of one, alive for the call.
                first = unsafe { (*wr).wr_id };
                0
            })
            .unwrap();
            prop_assert_eq!(WrId::decode(first), WrId::Send { seq: kept as u64 });
        }
    }
}
