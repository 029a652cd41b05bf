//! Reliable-connected queue pairs with typed state transitions, their posted-request tables, and
//! the drop that drains before it destroys.

use super::context::{Gid, Mtu};
use super::cq::{CompletionQueue, CqInner, WorkCompletion};
use super::mr::AccessFlags;
use super::pd::{PdInner, ProtectionDomain};
use super::srq::{SharedReceiveQueue, SrqInner};
use super::wr::{RecvRequest, Sg, WorkRequest};
use super::{in_forked_child, nonnull, rc, verbs};
use crate::error::{Error, Result};
use crate::memory::{CompletionFlag, Fence, Tracker};
use gpudirect_sys::ibverbs as ibv;
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long dropping a queue pair waits for its flushed completions before leaking it (and all
/// the memory its requests hold) instead of freeing anything early.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

const KIND_SHIFT: u32 = 62;
const KIND_SEND: u64 = 0;
const KIND_RECV: u64 = 1;
const KIND_SRQ: u64 = 2;
const ID_MASK: u64 = (1 << KIND_SHIFT) - 1;

/// What one posted request holds until its completion.
pub(crate) struct Entry {
    pub(crate) tag: u64,
    /// Held, never read: keeps the slices' regions registered and alive until completion.
    #[allow(dead_code)]
    pub(crate) sg: Sg,
    pub(crate) flag: Option<CompletionFlag>,
}

impl Entry {
    fn release(self) -> u64 {
        // Slices dropped here, after the completion was seen: the NIC is done with them.
        if let Some(f) = &self.flag {
            f.set();
        }
        self.tag
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
    fn complete_through(&mut self, seq: u64) -> u64 {
        let mut tag = 0;
        while let Some((s, _)) = self.entries.front() {
            if *s > seq {
                break;
            }
            let (s, e) = self.entries.pop_front().expect("front exists");
            let t = e.release();
            if s == seq {
                tag = t;
            }
        }
        tag
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

    pub(crate) fn take(&mut self, slot: u32) -> u64 {
        match self.slots.get_mut(slot as usize).and_then(Option::take) {
            Some(e) => {
                self.live -= 1;
                self.free.push(slot);
                e.release()
            }
            None => 0,
        }
    }

    /// Remove an entry that was never posted (the post failed): dropped, not released.
    pub(crate) fn unpost(&mut self, slot: u32) {
        if self
            .slots
            .get_mut(slot as usize)
            .and_then(Option::take)
            .is_some()
        {
            self.live -= 1;
            self.free.push(slot);
        }
    }

    pub(crate) fn live(&self) -> u32 {
        self.live
    }

    /// Post `reqs` through `post` (ibv_post_recv or ibv_post_srq_recv), keeping each request's
    /// slices in this table under the library's `wr_id` (`kind` tags the queue).
    pub(crate) fn post(
        &mut self,
        reqs: Vec<RecvRequest>,
        kind: u64,
        queue: &'static str,
        call: &'static str,
        post: impl FnOnce(*mut ibv::ibv_recv_wr, *mut *mut ibv::ibv_recv_wr) -> i32,
    ) -> Result<usize> {
        let n = reqs.len();
        if n == 0 {
            return Ok(0);
        }
        if self.live as usize + n > self.depth as usize {
            return Err(Error::QueueFull {
                queue,
                depth: self.depth,
            });
        }
        let total_sge: usize = reqs.iter().map(|r| r.sg.slices().len()).sum();
        let mut sges: Vec<ibv::ibv_sge> = Vec::with_capacity(total_sge);
        let mut wrs: Vec<ibv::ibv_recv_wr> = Vec::with_capacity(n);
        let mut slots = Vec::with_capacity(n);
        for r in reqs {
            let start = sges.len();
            sges.extend(r.sg.slices().iter().map(|s| s.sge()));
            let cnt = sges.len() - start;
            let slot = self.insert(Entry {
                tag: r.tag,
                sg: r.sg,
                flag: r.flag,
            });
            slots.push(slot);
            wrs.push(ibv::ibv_recv_wr {
                wr_id: (kind << KIND_SHIFT) | slot as u64,
                next: std::ptr::null_mut(),
                sg_list: start as *mut ibv::ibv_sge, // patched below
                num_sge: cnt as i32,
            });
        }
        let base = sges.as_mut_ptr();
        for i in 0..n {
            wrs[i].sg_list = if wrs[i].num_sge == 0 {
                std::ptr::null_mut()
            } else {
                // SAFETY: `start` offsets are within `sges`, which no longer grows.
                unsafe { base.add(wrs[i].sg_list as usize) }
            };
            if i + 1 < n {
                wrs[i].next = &mut wrs[i + 1];
            }
        }
        let mut bad = std::ptr::null_mut();
        let r = post(wrs.as_mut_ptr(), &mut bad);
        if r != 0 {
            // Requests from `bad` on were not posted: drop their entries (never seen by the NIC).
            let first_bad = if bad.is_null() {
                0
            } else {
                (bad as usize - wrs.as_ptr() as usize) / size_of::<ibv::ibv_recv_wr>()
            };
            for &slot in &slots[first_bad.min(n)..] {
                self.unpost(slot);
            }
            return Err(Error::errno(call, r.abs()));
        }
        Ok(n)
    }
}

/// Per-QP state shared with the CQs that report its completions.
pub(crate) struct QpShared {
    sq: Mutex<SendTable>,
    rq: Mutex<RecvTable>,
    srq: Option<Arc<SrqInner>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl QpShared {
    /// Release what the request behind `wc` held; returns its tag.
    pub(crate) fn complete(&self, wc: &ibv::ibv_wc) -> u64 {
        let id = wc.wr_id & ID_MASK;
        match wc.wr_id >> KIND_SHIFT {
            KIND_SEND => lock(&self.sq).complete_through(id),
            KIND_RECV => lock(&self.rq).take(id as u32),
            KIND_SRQ => self.srq.as_ref().map_or(0, |s| s.table().take(id as u32)),
            _ => 0,
        }
    }

    fn outstanding(&self) -> usize {
        self.send_outstanding() + lock(&self.rq).live() as usize
    }

    fn send_outstanding(&self) -> usize {
        lock(&self.sq).entries.len()
    }
}

/// Sizes of a queue pair's queues. Providers may round them up; [`QueuePair::caps`] says what was
/// granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send-queue depth (requests).
    pub max_send_wr: u32,
    /// Receive-queue depth (ignored with an SRQ).
    pub max_recv_wr: u32,
    /// Scatter-gather entries per send request.
    pub max_send_sge: u32,
    /// Scatter-gather entries per receive request.
    pub max_recv_sge: u32,
    /// Largest inline payload, in bytes.
    pub max_inline_data: u32,
    /// Force a signaled request after this many unsignaled ones (0: half the send-queue depth).
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

mod sealed {
    pub trait Sealed {}
}

/// A queue pair state, at the type level.
pub trait QpState: sealed::Sealed {}
/// A state in which receives may be posted (INIT, RTR, RTS).
pub trait CanRecv: QpState {}

/// `IBV_QPS_RESET`: just created.
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
impl sealed::Sealed for Reset {}
impl sealed::Sealed for Init {}
impl sealed::Sealed for Rtr {}
impl sealed::Sealed for Rts {}
impl QpState for Reset {}
impl QpState for Init {}
impl QpState for Rtr {}
impl QpState for Rts {}
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
        let mut attr = ibv::ibv_qp_attr {
            qp_state: ibv::IBV_QPS_ERR,
            ..Default::default()
        };
        // SAFETY: a live QP and a valid attribute struct.
        let to_err =
            unsafe { (l.ibv_modify_qp)(self.qp.as_ptr(), &mut attr, ibv::IBV_QP_STATE as i32) };
        // 2. Drain (bounded) until every posted request's completion has been seen.
        let drained = to_err == 0 && self.drain(DRAIN_TIMEOUT);
        // 3. Destroy, or leak everything the NIC might still touch.
        // SAFETY: a live QP; after success the NIC no longer touches its requests' memory.
        if drained && unsafe { (l.ibv_destroy_qp)(self.qp.as_ptr()) } == 0 {
            self.send_cq.unregister(self.qp_num);
            self.recv_cq.unregister(self.qp_num);
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
                ),
            );
        }
    }
}

impl QpInner {
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
/// [`to_rtr`](QueuePair::to_rtr), [`to_rts`](QueuePair::to_rts). Receives may be posted from
/// INIT on, sends only in RTS. Requests own their slices until their completions are polled.
///
/// Dropping the QP moves it to the error state, drains the flushed completions of everything
/// still posted for up to [`DRAIN_TIMEOUT`], then destroys it; if the completions do not all
/// arrive, the QP and the memory its requests hold are leaked rather than freed early.
#[doc(alias = "ibv_qp")]
#[doc(alias = "ibv_destroy_qp")]
pub struct QueuePair<S: QpState = Rts> {
    inner: Box<QpInner>,
    _state: PhantomData<S>,
}

impl QueuePair<Reset> {
    /// `ibv_create_qp(pd, {RC, send_cq, recv_cq, srq, caps})`—a new RC queue pair.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when a CQ or the SRQ belongs to another device, or a depth is 0;
    /// [`Error::Os`] naming `ibv_create_qp` (`EINVAL`/`ENOMEM` for caps the device refuses).
    #[doc(alias = "ibv_create_qp")]
    pub fn create(
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        srq: Option<&SharedReceiveQueue>,
        caps: QpCaps,
    ) -> Result<Self> {
        if caps.max_send_wr == 0 || (srq.is_none() && caps.max_recv_wr == 0) {
            return Err(Error::invalid(
                "caps",
                format!("{caps:?}"),
                "queue depths must be at least 1",
            ));
        }
        let l = verbs()?;
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
        let qp = nonnull("ibv_create_qp", unsafe {
            (l.ibv_create_qp)(pd.as_raw(), &mut init)
        })?;
        // SAFETY: a QP just created.
        let qp_num = unsafe { qp.as_ref().qp_num };
        let c = init.cap;
        let granted = QpCaps {
            max_send_wr: c.max_send_wr,
            max_recv_wr: c.max_recv_wr,
            max_send_sge: c.max_send_sge,
            max_recv_sge: c.max_recv_sge,
            max_inline_data: c.max_inline_data,
            signal_every: if caps.signal_every == 0 {
                (c.max_send_wr / 2).max(1)
            } else {
                caps.signal_every.min(c.max_send_wr).max(1)
            },
        };
        let shared = Arc::new(QpShared {
            sq: Mutex::new(SendTable {
                next_seq: 0,
                entries: VecDeque::with_capacity(granted.max_send_wr as usize),
                depth: granted.max_send_wr,
                unsignaled_run: 0,
                signal_every: granted.signal_every,
            }),
            rq: Mutex::new(RecvTable::new(granted.max_recv_wr)),
            srq: srq.map(|s| s.inner.clone()),
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
    /// [`Error::Os`] naming `ibv_modify_qp`.
    #[doc(alias = "IBV_QPS_INIT")]
    pub fn to_init(self, port: u8, access: AccessFlags) -> Result<QueuePair<Init>> {
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
    /// [`Error::Os`] naming `ibv_modify_qp` (`EINVAL` for a bad GID index or MTU).
    #[doc(alias = "IBV_QPS_RTR")]
    pub fn to_rtr(self, attr: &RtrAttr) -> Result<QueuePair<Rtr>> {
        let mut a = ibv::ibv_qp_attr {
            qp_state: ibv::IBV_QPS_RTR,
            path_mtu: attr.mtu.raw(),
            dest_qp_num: attr.dest_qp_num,
            rq_psn: attr.rq_psn & 0xff_ffff,
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
    /// [`Error::Os`] naming `ibv_modify_qp`.
    #[doc(alias = "IBV_QPS_RTS")]
    pub fn to_rts(self, attr: &RtsAttr) -> Result<QueuePair<Rts>> {
        let mut a = ibv::ibv_qp_attr {
            qp_state: ibv::IBV_QPS_RTS,
            sq_psn: attr.sq_psn & 0xff_ffff,
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
    /// [`WcStatus::Flushed`](super::WcStatus::Flushed) (poll them to get the memory back).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `ibv_modify_qp`.
    #[doc(alias = "IBV_QPS_ERR")]
    pub fn into_error(self) -> Result<QueuePair<Reset>> {
        let mut a = ibv::ibv_qp_attr {
            qp_state: ibv::IBV_QPS_ERR,
            ..Default::default()
        };
        // Typed as Reset: only destruction (or the drop's drain) is useful from here.
        self.modify(&mut a, ibv::IBV_QP_STATE)
    }
}

impl<S: CanRecv> QueuePair<S> {
    /// `ibv_post_recv`—post receives, chained in one call. Each keeps its slices until its
    /// completion is polled. Returns how many were posted.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the QP uses an SRQ or a slice lacks local write or belongs
    /// to another PD; [`Error::QueueFull`]; [`Error::Os`] naming `ibv_post_recv` (requests before
    /// the failing one were posted).
    #[doc(alias = "ibv_post_recv")]
    pub fn post_recv(&mut self, reqs: impl IntoIterator<Item = RecvRequest>) -> Result<usize> {
        verbs()?;
        if self.inner.shared.srq.is_some() {
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
            KIND_RECV,
            "receive queue",
            "ibv_post_recv",
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
    /// completion (or the signaled completion after it) is polled. Returns how many were posted.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a request that breaks a rule (see [`WorkRequest`]);
    /// [`Error::QueueFull`] when the send queue has no room for the whole chain; [`Error::Os`]
    /// naming `ibv_post_send` (requests before the failing one were posted).
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
        if t.entries.len() + n > t.depth as usize {
            return Err(Error::QueueFull {
                queue: "send queue",
                depth: t.depth,
            });
        }
        inner.wr_scratch.clear();
        inner.sge_scratch.clear();
        let first_seq = t.next_seq;
        for (i, w) in reqs.iter().enumerate() {
            let mut signaled = w.signaled || t.unsignaled_run + 1 >= t.signal_every;
            // The last request of a chain that fills the queue must be signaled, or nothing
            // would ever free the queue.
            if !signaled && t.entries.len() + i + 1 == t.depth as usize {
                signaled = true;
            }
            t.unsignaled_run = if signaled { 0 } else { t.unsignaled_run + 1 };
            let mut wr = ibv::ibv_send_wr {
                wr_id: (KIND_SEND << KIND_SHIFT) | (first_seq + i as u64),
                ..Default::default()
            };
            w.fill(&mut wr, signaled);
            let start = inner.sge_scratch.len();
            if let Some(d) = w.inline_data() {
                inner.sge_scratch.push(ibv::ibv_sge {
                    addr: d.as_ptr() as u64,
                    length: d.len() as u32,
                    lkey: 0,
                });
            } else {
                inner
                    .sge_scratch
                    .extend(w.sg.slices().iter().map(|s| s.sge()));
            }
            wr.num_sge = (inner.sge_scratch.len() - start) as i32;
            wr.sg_list = start as *mut ibv::ibv_sge; // patched below
            inner.wr_scratch.push(wr);
        }
        let base = inner.sge_scratch.as_mut_ptr();
        let wrp = inner.wr_scratch.as_mut_ptr();
        for i in 0..n {
            // SAFETY: indices within the scratch vectors, which no longer grow.
            unsafe {
                let wr = &mut *wrp.add(i);
                wr.sg_list = if wr.num_sge == 0 {
                    std::ptr::null_mut()
                } else {
                    base.add(wr.sg_list as usize)
                };
                wr.next = if i + 1 < n {
                    wrp.add(i + 1)
                } else {
                    std::ptr::null_mut()
                };
            }
        }
        for (i, w) in reqs.into_iter().enumerate() {
            t.entries.push_back((
                first_seq + i as u64,
                Entry {
                    tag: w.tag,
                    sg: w.sg,
                    flag: w.flag,
                },
            ));
        }
        t.next_seq += n as u64;
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live QP in RTS; the chain, its SGEs and inline data live for the call; the
        // memory non-inline SGEs reference is owned by the table until completion.
        let r = unsafe { ibv::ibv_post_send(inner.qp.as_ptr(), wrp, &mut bad) };
        if r != 0 {
            let first_bad = if bad.is_null() {
                0
            } else {
                (bad as usize - wrp as usize) / size_of::<ibv::ibv_send_wr>()
            };
            // Not posted: dropped, never seen by the NIC.
            for _ in first_bad.min(n)..n {
                t.entries.pop_back();
            }
            t.next_seq = first_seq + first_bad.min(n) as u64;
            return Err(Error::errno("ibv_post_send", r.abs()));
        }
        Ok(n)
    }
}

impl<S: QpState> std::fmt::Debug for QueuePair<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &self.inner.qp_num)
            .field(
                "state",
                &std::any::type_name::<S>()
                    .rsplit("::")
                    .next()
                    .unwrap_or("?"),
            )
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

impl RtrAttr {
    /// The peer's QP number, the PSN its first request will carry, and the path MTU (at most both
    /// ports' active MTU).
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

    /// Receiver-not-ready NAK delay code (default 12: 0.64 ms).
    pub fn min_rnr_timer(mut self, code: u8) -> Self {
        self.min_rnr_timer = code;
        self
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
    /// The PSN of our first request (the peer's `rq_psn`).
    pub fn new(sq_psn: u32) -> Self {
        RtsAttr {
            sq_psn,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 1,
        }
    }

    /// Local ACK timeout code: 4.096 µs × 2^code (default 14: about 67 ms).
    pub fn timeout(mut self, code: u8) -> Self {
        self.timeout = code;
        self
    }

    /// Transport retries (default 7).
    pub fn retry_cnt(mut self, n: u8) -> Self {
        self.retry_cnt = n;
        self
    }

    /// Receiver-not-ready retries (default 7: infinite).
    pub fn rnr_retry(mut self, n: u8) -> Self {
        self.rnr_retry = n;
        self
    }

    /// RDMA reads and atomics we may have outstanding (default 1).
    pub fn max_rd_atomic(mut self, n: u8) -> Self {
        self.max_rd_atomic = n;
        self
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
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn entry(tag: u64, flag: Option<CompletionFlag>) -> Entry {
        Entry {
            tag,
            sg: Sg::None,
            flag,
        }
    }

    #[test]
    fn a_signaled_completion_releases_every_earlier_request() {
        let mut t = SendTable {
            next_seq: 0,
            entries: VecDeque::new(),
            depth: 8,
            unsignaled_run: 0,
            signal_every: 4,
        };
        let flags: Vec<CompletionFlag> = (0..5).map(|_| CompletionFlag::new()).collect();
        for (i, f) in flags.iter().enumerate() {
            t.entries
                .push_back((i as u64, entry(100 + i as u64, Some(f.clone()))));
        }
        assert_eq!(t.complete_through(2), 102);
        assert_eq!(t.entries.len(), 2);
        assert!(flags[..3].iter().all(|f| f.is_complete()));
        assert!(!flags[3].is_complete());
        assert_eq!(t.complete_through(4), 104);
        assert!(t.entries.is_empty());
    }

    #[test]
    fn recv_slots_are_reused_and_released_once() {
        let mut t = RecvTable::new(4);
        let a = t.insert(entry(1, None));
        let b = t.insert(entry(2, None));
        assert_eq!(t.live(), 2);
        assert_eq!(t.take(a), 1);
        assert_eq!(t.take(a), 0, "a slot releases once");
        let c = t.insert(entry(3, None));
        assert_eq!(c, a);
        t.unpost(b);
        assert_eq!(t.live(), 1);
    }

    #[test]
    fn wr_ids_encode_the_queue() {
        let wc = |id: u64| ibv::ibv_wc {
            wr_id: id,
            ..Default::default()
        };
        let shared = QpShared {
            sq: Mutex::new(SendTable {
                next_seq: 0,
                entries: VecDeque::new(),
                depth: 4,
                unsignaled_run: 0,
                signal_every: 2,
            }),
            rq: Mutex::new(RecvTable::new(4)),
            srq: None,
        };
        lock(&shared.sq).entries.push_back((0, entry(7, None)));
        let slot = lock(&shared.rq).insert(entry(9, None));
        assert_eq!(shared.outstanding(), 2);
        assert_eq!(
            shared.complete(&wc((KIND_RECV << KIND_SHIFT) | slot as u64)),
            9
        );
        assert_eq!(shared.complete(&wc(KIND_SEND << KIND_SHIFT)), 7);
        assert_eq!(shared.outstanding(), 0);
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
}
