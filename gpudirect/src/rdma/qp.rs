//! Reliable-connected queue pairs with typed state transitions, and the teardown that proves
//! completion before it destroys.

use super::context::{DeviceAttr, Gid, Mtu};
use super::cq::{CompletionQueue, CqInner, WorkCompletion};
use super::ffi::{free_in_parent, nonnull, rc, verbs};
use super::mr::AccessFlags;
use super::mw::{
    BoundWindow, MemoryWindow, PendingBind, PendingInvalidate, WindowBind, WindowRefused, bind_wr,
    check_bind, invalidate_wr,
};
use super::pd::{PdInner, ProtectionDomain};
use super::posted::smallvec_lite::Small;
use super::posted::{
    PostedTables, RecvTable, SendScratch, SendTable, StatusSlot, WrId, post_send_checked,
};
use super::srq::{SharedReceiveQueue, SrqInner};
use super::teardown::{COUNTERS, Counters};
use super::wr::{RecvRequest, SendRequest, Sg};
use crate::completion::{Fence, Tracker};
use crate::error::{Error, Result};
use gpudirect_sys::ibverbs as ibv;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long dropping a queue pair (or [`QueuePair::reset`]) waits for its flushed completions
/// before giving up: a drop then leaks the QP and all the memory its requests hold instead of
/// freeing anything early.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

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
    posted: Arc<PostedTables>,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    pd: Arc<PdInner>,
    srq: Option<Arc<SrqInner>>,
    caps: QpCaps,
    port: u8,
    scratch: SendScratch,
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
        free_in_parent(ibv::lib, |l| self.tear_down(l));
    }
}

impl QpInner {
    fn tear_down(&mut self, l: &ibv::Lib) {
        // 1. Error state (unless nothing is outstanding): the NIC stops and flushes every
        //    outstanding request.
        // 2. A signaled request after the last unsignaled one, then drain (bounded) until every
        //    posted request's completion (or one covering it) has been seen.
        // Nothing outstanding (never used, or every request covered by a polled completion):
        // the NIC holds none of our memory, so the QP is destroyed as it is (some providers,
        // rxe among them, refuse RESET -> ERR). With memory windows bound through it, the error
        // state is what ends the peer's access through them.
        let idle = self.posted.outstanding() == 0 && self.posted.windows() == 0;
        let drained = idle || (self.set_state(l, ibv::IBV_QPS_ERR) && self.quiesce(DRAIN_TIMEOUT));
        // 3. Destroy, or leak everything the NIC might still touch. A QP that windows are still
        //    bound through is leaked too: they hold it on the NIC (rxe's destroy would wait for
        //    them, then free the QP they still point to).
        let windows = self.posted.windows() > 0;
        // SAFETY: a live QP; after success the NIC no longer touches its requests' memory.
        if drained && !windows && unsafe { (l.ibv_destroy_qp)(self.qp.as_ptr()) } == 0 {
            self.send_cq.unregister(self.qp_num, &self.posted);
            self.recv_cq.unregister(self.qp_num, &self.posted);
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
                    self.posted.clone(),
                    self.srq.clone(),
                ),
            );
            Counters::count(&COUNTERS.qp_leaked);
        }
    }

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

    /// Post one signaled, empty send after an unsignaled tail. Returns false when it could not
    /// be posted.
    fn post_marker(&self) -> bool {
        let qp = self.qp.as_ptr();
        self.posted.send().post_marker(|wr, bad| {
            // SAFETY: a live QP (in the error state); one request without SGEs, living for the call.
            unsafe { ibv::ibv_post_send(qp, wr, bad) }
        })
    }

    /// Poll this QP's CQs until every request it posted has been released (completions of
    /// other QPs found on a shared CQ are held for their next poll), or `timeout` passes.
    fn drain(&self, timeout: Duration) -> bool {
        drain(
            &self.posted,
            [&self.send_cq, &self.recv_cq],
            self.qp_num,
            timeout,
        )
    }
}

/// Poll the CQs of queue pair `qp_num` until every request in `posted` has been released, or
/// `timeout` passes. Completions of other QPs are held back for their next poll; those held
/// back already are left alone (the releases they stand for were made when they were polled).
fn drain(posted: &PostedTables, cqs: [&Arc<CqInner>; 2], qp_num: u32, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let mut buf = [WorkCompletion::default(); 16];
    loop {
        if posted.outstanding() == 0 {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        let mut any = false;
        for cq in cqs {
            let Ok(n) = cq.poll_fresh(&mut buf) else {
                continue;
            };
            any |= n > 0;
            for w in &buf[..n] {
                if w.qp_num() != qp_num {
                    cq.hold(*w); // someone else's: returned by their next poll
                }
            }
            if Arc::ptr_eq(cqs[0], cqs[1]) {
                break;
            }
        }
        if !any {
            std::thread::sleep(Duration::from_micros(200));
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
/// ([`teardown_stats`](super::teardown_stats) counts both). A QP that memory windows are still
/// bound through is leaked too, after the error state ended the peer's access through them (see
/// [`bind_window`](QueuePair::bind_window)).
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
        let posted = Arc::new(PostedTables::new(
            SendTable::new(granted.max_send_wr, granted.signal_every),
            RecvTable::new(granted.max_recv_wr),
        ));
        send_cq.inner.register(qp_num, posted.clone());
        recv_cq.inner.register(qp_num, posted.clone());
        Ok(QueuePair {
            inner: Box::new(QpInner {
                qp,
                qp_num,
                posted,
                send_cq: send_cq.inner.clone(),
                recv_cq: recv_cq.inner.clone(),
                pd: pd.inner.clone(),
                srq: srq.map(|s| s.inner.clone()),
                caps: granted,
                port: 1,
                scratch: SendScratch::default(),
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
    #[doc(alias = "ibv_modify_qp")]
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
    #[doc(alias = "ibv_modify_qp")]
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
    #[doc(alias = "ibv_modify_qp")]
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
    /// again and then leaks it with everything it holds); [`Error::InvalidArgument`] while memory
    /// windows are bound through the QP (it is dropped, and leaked: see
    /// [`bind_window`](QueuePair::bind_window)); [`Error::Os`] naming `ibv_modify_qp`.
    #[doc(alias = "IBV_QPS_RESET")]
    #[doc(alias = "ibv_modify_qp")]
    pub fn reset(self) -> Result<QueuePair<Reset>> {
        verbs()?;
        let windows = self.inner.posted.windows();
        if windows > 0 {
            return Err(Error::invalid(
                "qp",
                format!("{} with {windows} memory windows bound", self.qp_num()),
                "invalidate or drop the windows bound through a queue pair before resetting it: \
                 it may be connected to another peer next",
            ));
        }
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
        qp.inner.posted.send().restart_signaling();
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
        self.inner.posted.outstanding()
    }

    /// Whether the QP reports its send and receive completions to `cq` alone and has no SRQ.
    pub(crate) fn uses_only(&self, cq: &CompletionQueue) -> bool {
        Arc::ptr_eq(&self.inner.send_cq, &cq.inner)
            && Arc::ptr_eq(&self.inner.recv_cq, &cq.inner)
            && self.inner.srq.is_none()
    }

    /// Send-queue requests not yet known complete: the queue's occupancy, as posting sees it
    /// (unsignaled requests count until a later signaled completion is polled).
    pub fn send_outstanding(&self) -> usize {
        self.inner.posted.send_outstanding()
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
    #[doc(alias = "ibv_modify_qp")]
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
        let mut reqs: Small<RecvRequest> = reqs.into_iter().collect();
        let pd = self.inner.pd.pd.as_ptr();
        for r in reqs.iter() {
            r.validate(self.inner.caps.max_recv_sge)?;
            r.sg.check_pd(pd, "QP")?;
        }
        let qp = self.inner.qp.as_ptr();
        self.inner.posted.recv().post(
            &mut reqs,
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

impl QueuePair<Rts> {
    /// Check `w` as [`post_send`](Self::post_send) would, without posting.
    pub(crate) fn check_send(&self, w: &SendRequest<'_>) -> Result<()> {
        w.validate(
            self.inner.caps.max_send_sge,
            self.inner.caps.max_inline_data,
        )?;
        w.sg.check_pd(self.inner.pd.pd.as_ptr(), "QP")
    }

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
    /// [`Error::InvalidArgument`] for a request that breaks a rule (see [`SendRequest`]);
    /// [`Error::QueueFull`] when the send queue, or the send CQ (shared with every QP using it),
    /// has no room for the whole chain: nothing is posted; [`Error::Os`] naming `ibv_post_send`
    /// (requests before the failing one were posted).
    #[doc(alias = "ibv_post_send")]
    pub fn post_send<'a>(
        &mut self,
        wrs: impl IntoIterator<Item = SendRequest<'a>>,
    ) -> Result<usize> {
        let inner = &mut *self.inner;
        let caps = inner.caps;
        let qp = inner.qp.as_ptr();
        post_send_checked(
            &inner.posted,
            (caps.max_send_sge, caps.max_inline_data),
            inner.pd.pd.as_ptr(),
            inner.send_cq.room(),
            &mut inner.scratch,
            wrs,
            |wr, bad| {
                // SAFETY: a live QP in RTS; the chain, its SGEs and inline data live for the
                // call; the memory non-inline SGEs reference is owned by the table until
                // completion.
                unsafe { ibv::ibv_post_send(qp, wr, bad) }
            },
        )
    }
}

impl QueuePair<Rts> {
    /// Post `IBV_WR_BIND_MW` (signaled): bind the type 2 `window` to `bind`'s range of a region
    /// with its access, through this queue pair only: the peer connected to it reaches the range
    /// with the window's new rkey (`ibv_inc_rkey` of the old one), no other queue pair does.
    ///
    /// The rkey is reachable once the bind's completion was polled from the send CQ and
    /// [`PendingBind::finish`] says it succeeded ([`BoundWindow::rkey`]). The bind takes an entry
    /// of the send queue and of the send CQ, as every request does, until its completion is
    /// polled. From the post on, the window holds the range (so the region stays registered)
    /// until it is known unbound: its invalidation ([`invalidate_window`](Self::invalidate_window))
    /// completed, or it was deallocated (dropped).
    ///
    /// While windows are bound through it, a queue pair cannot be reset, and dropping it moves it
    /// to the error state (which ends the peer's access) but leaks it rather than destroying it
    /// ([`teardown_stats`](super::teardown_stats)): drop or invalidate the windows first.
    ///
    /// # Errors
    ///
    /// The window comes back in [`WindowRefused`], nothing posted, with
    /// [`Error::InvalidArgument`] when the window, the QP and the region are not of one
    /// protection domain, the region lacks [`AccessFlags::MW_BIND`], the access is not remote
    /// read, write or atomics, or write and atomics meet a region without local write;
    /// [`Error::QueueFull`] when the send queue or the send CQ is full; [`Error::Os`] naming
    /// `ibv_post_send`.
    #[doc(alias = "IBV_WR_BIND_MW")]
    #[doc(alias = "ibv_bind_mw")]
    #[doc(alias = "ibv_inc_rkey")]
    #[doc(alias = "ibv_post_send")]
    pub fn bind_window(
        &mut self,
        window: MemoryWindow,
        bind: WindowBind,
    ) -> std::result::Result<PendingBind, WindowRefused<MemoryWindow>> {
        let inner = &*self.inner;
        let checked =
            verbs().and_then(|_| check_bind(window.pd_ptr(), inner.pd.pd.as_ptr(), &bind));
        if let Err(error) = checked {
            return Err(WindowRefused { error, window });
        }
        let rkey = window.next_rkey();
        let wr = bind_wr(window.as_raw(), rkey, &bind);
        let status = StatusSlot::default();
        let qp = inner.qp.as_ptr();
        let posted = inner.posted.send().post_one(
            wr,
            Sg::One(bind.range().clone()),
            bind.tag_value(),
            status.clone(),
            inner.send_cq.room(),
            |wr, bad| {
                // SAFETY: a live QP in RTS; one request without SGEs, living for the call; the
                // window, the region and its slice stay alive until the completion is polled.
                unsafe { ibv::ibv_post_send(qp, wr, bad) }
            },
        );
        match posted {
            Ok(()) => Ok(window.into_pending(bind, rkey, status, &inner.posted, inner.qp_num)),
            Err(error) => Err(WindowRefused { error, window }),
        }
    }

    /// Post `IBV_WR_LOCAL_INV` (signaled) of `window`'s rkey on this queue pair, the one it is
    /// bound through: once its completion was polled and [`PendingInvalidate::finish`] says it
    /// succeeded, the rkey is dead (a peer using it gets a remote access error) and the window
    /// comes back unbound, its range let go. The window keeps its range until then.
    ///
    /// # Errors
    ///
    /// The window comes back in [`WindowRefused`], nothing posted, with
    /// [`Error::InvalidArgument`] when it is bound through another queue pair;
    /// [`Error::QueueFull`] when the send queue or the send CQ is full; [`Error::Os`] naming
    /// `ibv_post_send`.
    #[doc(alias = "IBV_WR_LOCAL_INV")]
    #[doc(alias = "ibv_post_send")]
    pub fn invalidate_window(
        &mut self,
        window: BoundWindow,
        tag: u64,
    ) -> std::result::Result<PendingInvalidate, WindowRefused<BoundWindow>> {
        let inner = &*self.inner;
        if let Err(error) = verbs() {
            return Err(WindowRefused { error, window });
        }
        let held = match window.range() {
            Some(r) if window.bound_through(&inner.posted) => r.clone(),
            _ => {
                let error = Error::invalid(
                    "window",
                    format!("bound through QP {:#x}", window.qp_num()),
                    format!(
                        "a window is invalidated on the queue pair it is bound through, not QP {:#x}",
                        inner.qp_num
                    ),
                );
                return Err(WindowRefused { error, window });
            }
        };
        let status = StatusSlot::default();
        let qp = inner.qp.as_ptr();
        let posted = inner.posted.send().post_one(
            invalidate_wr(window.rkey()),
            Sg::One(held),
            tag,
            status.clone(),
            inner.send_cq.room(),
            |wr, bad| {
                // SAFETY: a live QP in RTS; one request without SGEs, living for the call.
                unsafe { ibv::ibv_post_send(qp, wr, bad) }
            },
        );
        match posted {
            Ok(()) => Ok(window.into_pending(status)),
            Err(error) => Err(WindowRefused { error, window }),
        }
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// The fake provider's CQ has one completion to give: request 0 of QP 9.
    static ONE_LEFT: AtomicBool = AtomicBool::new(false);

    unsafe extern "C" fn poll_one(_cq: *mut ibv::ibv_cq, n: i32, wc: *mut ibv::ibv_wc) -> i32 {
        if n < 1 || !ONE_LEFT.swap(false, Ordering::SeqCst) {
            return 0;
        }
        // SAFETY: the caller gives room for `n` entries.
        unsafe {
            *wc = ibv::ibv_wc {
                wr_id: WrId::Send { seq: 0 }.encode(),
                status: ibv::IBV_WC_SUCCESS,
                qp_num: 9,
                ..Default::default()
            };
        }
        1
    }

    /// A QP's drain while a full poll's worth of another QP's completions is held back on its
    /// CQ: it polls the CQ for its own, and leaves the others' held, in their order.
    #[test]
    fn a_drain_reaches_its_own_completions_past_others_held_back() {
        let ctx = Box::leak(Box::new(ibv::ibv_context::default()));
        ctx.ops.poll_cq = Some(poll_one);
        let raw = Box::leak(Box::new(ibv::ibv_cq {
            context: ctx,
            ..Default::default()
        }));
        let posted = Arc::new(PostedTables::new(SendTable::new(4, 1), RecvTable::new(4)));
        let room = super::super::posted::Room::new(4);
        posted
            .send()
            .post_one(
                ibv::ibv_send_wr::default(),
                Sg::None,
                0,
                StatusSlot::default(),
                &room,
                |_, _| 0,
            )
            .unwrap();
        let held = [7u32; 20];
        let cq = CqInner::fake(
            NonNull::from(raw),
            [(9, posted.clone())].into_iter().collect(),
            &held,
        );
        ONE_LEFT.store(true, Ordering::SeqCst);
        assert!(drain(&posted, [&cq, &cq], 9, Duration::from_millis(300)));
        assert_eq!(posted.outstanding(), 0);
        let expect: Vec<(u32, u64)> = (0..held.len() as u64).map(|i| (7, i)).collect();
        assert_eq!(cq.held(), expect, "held back, in their order");
        // Its drop would destroy the fake CQ.
        std::mem::forget(cq);
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
            max_qp_wr,
            max_sge,
            ..DeviceAttr::minimal()
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
    }
}
