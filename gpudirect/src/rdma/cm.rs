//! Connections through rdma_cm (described on the [`rdma`](super) module page).

use super::context::{Context, Gid};
use super::cq::{CompletionChannel, CompletionQueue, WcOpcode, WorkCompletion};
use super::device::DeviceList;
use super::ffi::{free_in_parent, nonnull, rc, verbs};
use super::mr::{AccessFlags, HostBuffer, Local, MemoryRegion, RemoteMemory};
use super::pd::ProtectionDomain;
use super::qp::{Init, QpCaps, QueuePair, Reset, Rtr, Rts};
use super::wr::{RecvRequest, SendRequest};
use crate::error::{Error, Result};
use gpudirect_sys::ibverbs as ibv;
use gpudirect_sys::rdmacm as cm;
use std::ffi::CStr;
use std::net::SocketAddr;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// `now + timeout`, for any timeout (see [`crate::completion::deadline_after`]).
fn deadline_after(timeout: Duration) -> Instant {
    crate::completion::deadline_after(Instant::now(), timeout)
}

fn cmlib() -> Result<&'static cm::Lib> {
    verbs()?;
    Ok(cm::lib()?)
}

/// Options for [`Listener::accept`] and [`Connection::connect`].
#[derive(Debug, Clone, Copy)]
pub struct ConnectOptions {
    /// Queue sizes of the new QP.
    pub caps: QpCaps,
    /// Entries of each of its two CQs (0: send depth + receive depth). Every request posted
    /// takes an entry of its CQ until its completion is polled, and the QP keeps one of the send
    /// CQ for its teardown: a CQ smaller than the depth refuses posts beyond its room.
    pub cq_depth: u32,
    /// What the peer may do through this QP (remote read, write, atomic).
    pub access: AccessFlags,
    /// RDMA reads and atomics outstanding in each direction (capped by the device).
    pub rd_atomic: u8,
    /// Bound on each connection step.
    pub timeout: Duration,
    /// Give the receive CQ a completion channel, so [`Connection::wait_recv`] can block instead
    /// of spinning.
    pub recv_channel: bool,
    /// Send and receive completions on one CQ (of the entries above), which the channel (with
    /// `recv_channel`) serves: what an awaited queue pair needs
    /// ([`Connection::into_async`](Connection::into_async)). The CQ's entries are shared by both
    /// queues: posts beyond its room are refused.
    pub one_cq: bool,
    /// The local ACK timeout's exponent: a message unacknowledged for 4.096 µs × 2^t is sent
    /// again, up to 6 times, then fails (`IBV_WC_RETRY_EXC_ERR`); 1 to 31. `None`: rdma_cm's,
    /// from the route (on RoCE about a second a try), and 7 retries, which rxe takes as
    /// "without end".
    pub ack_timeout: Option<u8>,
}

impl ConnectOptions {
    /// Entries of each CQ: `cq_depth`, or the send plus receive depth.
    fn cq_entries(&self) -> Result<u32> {
        match self.cq_depth {
            0 => self
                .caps
                .max_send_wr
                .checked_add(self.caps.max_recv_wr)
                .ok_or_else(|| {
                    Error::invalid(
                        "caps",
                        format!("{:?}", self.caps),
                        "the send and receive depths add up past 2^32: set cq_depth",
                    )
                }),
            d => Ok(d),
        }
    }
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            caps: QpCaps::default(),
            cq_depth: 0,
            access: AccessFlags::REMOTE_READ
                | AccessFlags::REMOTE_WRITE
                | AccessFlags::REMOTE_ATOMIC,
            rd_atomic: 16,
            timeout: Duration::from_secs(10),
            recv_channel: false,
            one_cq: false,
            ack_timeout: None,
        }
    }
}

struct Channel(NonNull<cm::rdma_event_channel>);

// SAFETY: librdmacm event channels are used through thread-safe calls.
unsafe impl Send for Channel {}
// SAFETY: as above.
unsafe impl Sync for Channel {}

impl Channel {
    fn new() -> Result<Channel> {
        let l = cmlib()?;
        // SAFETY: no arguments.
        nonnull("rdma_create_event_channel", unsafe {
            (l.rdma_create_event_channel)()
        })
        .map(Channel)
    }

    /// The next event if one is waiting (acknowledged), without blocking.
    fn try_next(&self) -> Result<Option<Event>> {
        let l = cmlib()?;
        // SAFETY: a live channel.
        let fd = unsafe { self.0.as_ref().fd };
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; no waiting.
        let r = unsafe { libc::poll(&mut p, 1, 0) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(None);
            }
            return Err(Error::Os {
                call: "poll",
                source: e,
            });
        }
        if r == 0 || p.revents & libc::POLLIN == 0 {
            return Ok(None);
        }
        self.take(l).map(Some)
    }

    /// `rdma_get_cm_event` (blocking until one is there) and its ack: the event, read before
    /// the ack.
    fn take(&self, l: &cm::Lib) -> Result<Event> {
        let mut ev = std::ptr::null_mut();
        // SAFETY: a live channel and an out-pointer.
        rc("rdma_get_cm_event", unsafe {
            (l.rdma_get_cm_event)(self.0.as_ptr(), &mut ev)
        })?;
        // SAFETY: an event just returned, read before the ack below.
        let e = unsafe {
            Event {
                kind: (*ev).event,
                status: (*ev).status,
                id: (*ev).id,
                listen_id: (*ev).listen_id,
            }
        };
        // SAFETY: acknowledges that event once.
        unsafe { (l.rdma_ack_cm_event)(ev) };
        Ok(e)
    }

    /// The next event, within `timeout`, acknowledged; it must be `expected`.
    fn wait(
        &self,
        call: &'static str,
        expected: cm::rdma_cm_event_type,
        timeout: Duration,
    ) -> Result<Event> {
        let l = cmlib()?;
        let deadline = deadline_after(timeout);
        // SAFETY: a live channel.
        let fd = unsafe { self.0.as_ref().fd };
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut p = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            let r = unsafe { libc::poll(&mut p, 1, left.as_millis().min(i32::MAX as u128) as i32) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(Error::Os {
                    call: "poll",
                    source: e,
                });
            }
            if r == 0 {
                return Err(Error::Timeout {
                    what: call,
                    after: timeout,
                });
            }
            break;
        }
        let e = self.take(l)?;
        if e.kind != expected {
            if e.kind == cm::RDMA_CM_EVENT_CONNECT_REQUEST && !e.listen_id.is_null() {
                // A request we do not take: refuse it so the peer does not wait.
                // SAFETY: the new id from the event; rejected and destroyed once.
                unsafe {
                    (l.rdma_reject)(e.id, std::ptr::null(), 0);
                    (l.rdma_destroy_id)(e.id);
                }
            }
            return Err(Error::CmEvent {
                call,
                expected: event_name(expected),
                got: event_name(e.kind).to_string(),
                status: e.status,
            });
        }
        if e.status != 0 {
            return Err(Error::CmEvent {
                call,
                expected: event_name(expected),
                got: format!("{} with an error", event_name(e.kind)),
                status: e.status,
            });
        }
        Ok(e)
    }
}

impl Channel {
    /// [`wait`](Self::wait) by `deadline`, looking at `stop` every 20 ms (set: a timeout).
    fn wait_until(
        &self,
        call: &'static str,
        expected: cm::rdma_cm_event_type,
        deadline: Instant,
        stop: Option<&AtomicBool>,
    ) -> Result<Event> {
        let start = Instant::now();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let stopped = stop.is_some_and(|s| s.load(Ordering::Acquire));
            if left.is_zero() || stopped {
                return Err(Error::Timeout {
                    what: call,
                    after: start.elapsed(),
                });
            }
            let slice = if stop.is_some() {
                left.min(Duration::from_millis(20))
            } else {
                left
            };
            match self.wait(call, expected, slice) {
                Err(Error::Timeout { .. }) => continue,
                r => return r,
            }
        }
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        free_in_parent(cm::lib, |l| {
            // SAFETY: every id on the channel was destroyed before (field order).
            unsafe { (l.rdma_destroy_event_channel)(self.0.as_ptr()) };
        });
    }
}

struct Event {
    kind: cm::rdma_cm_event_type,
    status: i32,
    id: *mut cm::rdma_cm_id,
    listen_id: *mut cm::rdma_cm_id,
}

fn event_name(t: cm::rdma_cm_event_type) -> &'static str {
    match t {
        cm::RDMA_CM_EVENT_ADDR_RESOLVED => "RDMA_CM_EVENT_ADDR_RESOLVED",
        cm::RDMA_CM_EVENT_ADDR_ERROR => "RDMA_CM_EVENT_ADDR_ERROR",
        cm::RDMA_CM_EVENT_ROUTE_RESOLVED => "RDMA_CM_EVENT_ROUTE_RESOLVED",
        cm::RDMA_CM_EVENT_ROUTE_ERROR => "RDMA_CM_EVENT_ROUTE_ERROR",
        cm::RDMA_CM_EVENT_CONNECT_REQUEST => "RDMA_CM_EVENT_CONNECT_REQUEST",
        cm::RDMA_CM_EVENT_CONNECT_RESPONSE => "RDMA_CM_EVENT_CONNECT_RESPONSE",
        cm::RDMA_CM_EVENT_CONNECT_ERROR => "RDMA_CM_EVENT_CONNECT_ERROR",
        cm::RDMA_CM_EVENT_UNREACHABLE => "RDMA_CM_EVENT_UNREACHABLE",
        cm::RDMA_CM_EVENT_REJECTED => "RDMA_CM_EVENT_REJECTED",
        cm::RDMA_CM_EVENT_ESTABLISHED => "RDMA_CM_EVENT_ESTABLISHED",
        cm::RDMA_CM_EVENT_DISCONNECTED => "RDMA_CM_EVENT_DISCONNECTED",
        cm::RDMA_CM_EVENT_DEVICE_REMOVAL => "RDMA_CM_EVENT_DEVICE_REMOVAL",
        cm::RDMA_CM_EVENT_TIMEWAIT_EXIT => "RDMA_CM_EVENT_TIMEWAIT_EXIT",
        _ => "another rdma_cm event",
    }
}

struct Id(NonNull<cm::rdma_cm_id>);

// SAFETY: librdmacm ids are used through thread-safe calls.
unsafe impl Send for Id {}
// SAFETY: as above.
unsafe impl Sync for Id {}

impl Drop for Id {
    fn drop(&mut self) {
        free_in_parent(cm::lib, |l| {
            // SAFETY: created by rdma_create_id (or a connect request), destroyed once, after its
            // QP (ours, not rdma_cm's) was destroyed.
            unsafe { (l.rdma_destroy_id)(self.0.as_ptr()) };
        });
    }
}

impl Id {
    fn new(ch: &Channel) -> Result<Id> {
        let l = cmlib()?;
        let mut id = std::ptr::null_mut();
        // SAFETY: a live channel and an out-pointer.
        rc("rdma_create_id", unsafe {
            (l.rdma_create_id)(
                ch.0.as_ptr(),
                &mut id,
                std::ptr::null_mut(),
                cm::RDMA_PS_TCP,
            )
        })?;
        nonnull("rdma_create_id", id).map(Id)
    }

    /// The verbs device rdma_cm bound the id to.
    fn device_name(&self) -> Result<String> {
        let l = verbs()?;
        // SAFETY: a live id; `verbs` is set once the address is resolved or a request arrived.
        let ctx = unsafe { self.0.as_ref().verbs };
        if ctx.is_null() {
            return Err(Error::NoDevice {
                what: "verbs device",
                reason: "rdma_cm bound no device to the connection".into(),
            });
        }
        // SAFETY: a live context owned by librdmacm; the name is NUL-terminated.
        let name = unsafe { CStr::from_ptr((l.ibv_get_device_name)((*ctx).device)) };
        Ok(name.to_string_lossy().into_owned())
    }

    /// INIT → RTR → RTS with the attributes rdma_cm gives for this id, and where they route
    /// to (the peer's queue pair and GID).
    fn to_rts(
        &self,
        qp: QueuePair<Init>,
        ack_timeout: Option<u8>,
    ) -> Result<(QueuePair<Rts>, Route)> {
        let (mut a, m) = self.qp_attr(ibv::IBV_QPS_RTR)?;
        let route = Route {
            peer_qpn: a.dest_qp_num,
            global: a.ah_attr.is_global != 0,
            // SAFETY: every bit pattern of the union is a valid byte array.
            peer_gid: Gid(unsafe { a.ah_attr.grh.dgid.raw }),
            sgid_index: a.ah_attr.grh.sgid_index,
            port: a.ah_attr.port_num,
        };
        let qp = qp.modify_raw::<Rtr>(&mut a, m)?;
        let (mut a, mut m) = self.qp_attr(ibv::IBV_QPS_RTS)?;
        if let Some(t) = ack_timeout {
            if !(1..=31).contains(&t) {
                return Err(Error::invalid(
                    "ack_timeout",
                    t,
                    "the ACK timeout exponent is 1 to 31",
                ));
            }
            a.timeout = t;
            // 7 is "retry without end" to rxe: a dead link would never be reported.
            a.retry_cnt = 6;
            m |= (ibv::IBV_QP_TIMEOUT | ibv::IBV_QP_RETRY_CNT) as i32;
        }
        Ok((qp.modify_raw::<Rts>(&mut a, m)?, route))
    }

    fn qp_attr(&self, state: u32) -> Result<(ibv::ibv_qp_attr, i32)> {
        let l = cmlib()?;
        let mut a = ibv::ibv_qp_attr {
            qp_state: state,
            ..Default::default()
        };
        let mut mask = 0;
        // SAFETY: a live id and valid out-structs.
        rc("rdma_init_qp_attr", unsafe {
            (l.rdma_init_qp_attr)(self.0.as_ptr(), &mut a, &mut mask)
        })?;
        Ok((a, mask))
    }
}

fn sockaddr(addr: &SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as u16,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in fits in sockaddr_storage.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as u16,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_in6 fits in sockaddr_storage.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
        }
    }
    ss
}

/// `rdma_listen`—a bound, listening rdma_cm id.
#[doc(alias = "rdma_listen")]
pub struct Listener {
    id: Id,
    ch: Channel,
}

impl Listener {
    /// `rdma_create_id` + `rdma_bind_addr(addr)` + `rdma_listen`. Port 0 picks a free port
    /// ([`Listener::port`]).
    ///
    /// # Errors
    ///
    /// [`Error::Load`] without librdmacm; [`Error::Os`] naming the call (`EADDRINUSE`,
    /// `EADDRNOTAVAIL` when no RDMA device has that address).
    #[doc(alias = "rdma_bind_addr")]
    #[doc(alias = "rdma_create_id")]
    #[doc(alias = "rdma_listen")]
    pub fn bind(addr: SocketAddr) -> Result<Listener> {
        let l = cmlib()?;
        let ch = Channel::new()?;
        let id = Id::new(&ch)?;
        let mut ss = sockaddr(&addr);
        // SAFETY: a live id and a valid address.
        rc("rdma_bind_addr", unsafe {
            (l.rdma_bind_addr)(
                id.0.as_ptr(),
                (&mut ss as *mut libc::sockaddr_storage).cast(),
            )
        })?;
        // SAFETY: a bound id.
        rc("rdma_listen", unsafe { (l.rdma_listen)(id.0.as_ptr(), 16) })?;
        Ok(Listener { id, ch })
    }

    /// The port listened on (host order).
    pub fn port(&self) -> u16 {
        // The source address is the first member of `route.addr`: a sockaddr_in or sockaddr_in6,
        // whose port field is at the same offset.
        // SAFETY: a bound id; only the address of the field is taken.
        let sin = unsafe { std::ptr::addr_of!((*self.id.0.as_ptr()).route.addr) }
            .cast::<libc::sockaddr_in>();
        // SAFETY: as above.
        u16::from_be(unsafe { (*sin).sin_port })
    }

    /// Wait for a connection request and accept it: a connected QP in RTS, with one receive
    /// already posted for [`Connection::exchange`].
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`]; [`Error::CmEvent`] for an unexpected event; any error of creating the
    /// PD, CQs or QP, or of the transitions.
    #[doc(alias = "rdma_accept")]
    #[doc(alias = "rdma_get_cm_event")]
    #[doc(alias = "rdma_migrate_id")]
    pub fn accept(&self, opts: &ConnectOptions) -> Result<Connection> {
        self.accept_inner(opts, None)
    }

    /// [`accept`](Self::accept) on the caller's protection domain and completion queues: `home`
    /// is called with the name of the verbs device the request arrived on and returns the
    /// [`QpResources`] on that device (`opts.cq_depth` and `opts.recv_channel` are then not used).
    ///
    /// # Errors
    ///
    /// As [`accept`](Self::accept); whatever `home` returns; [`Error::InvalidArgument`] when the
    /// protection domain is on another device.
    #[doc(alias = "rdma_accept")]
    #[doc(alias = "rdma_get_cm_event")]
    #[doc(alias = "rdma_migrate_id")]
    pub fn accept_with(
        &self,
        opts: &ConnectOptions,
        mut home: impl FnMut(&str) -> Result<QpResources>,
    ) -> Result<Connection> {
        self.accept_inner(opts, Some(&mut home))
    }

    fn accept_inner(&self, opts: &ConnectOptions, home: HomeFn<'_>) -> Result<Connection> {
        self.next_request(opts.timeout)?.accept_inner(
            opts,
            home,
            deadline_after(opts.timeout),
            None,
        )
    }

    /// Wait for the next connection request, within `timeout`, without answering it: the
    /// request can be accepted elsewhere ([`ConnectRequest::accept_with`], on another thread),
    /// while this listener takes the next. The listener's fd ([`AsFd`](std::os::fd::AsFd)) is
    /// readable while a request waits.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`]; [`Error::CmEvent`] for another event.
    #[doc(alias = "rdma_get_cm_event")]
    #[doc(alias = "rdma_migrate_id")]
    pub fn next_request(&self, timeout: Duration) -> Result<ConnectRequest> {
        let l = cmlib()?;
        let ev = self
            .ch
            .wait("rdma_listen", cm::RDMA_CM_EVENT_CONNECT_REQUEST, timeout)?;
        let id = Id(nonnull("rdma_get_cm_event", ev.id)?);
        let ch = match Channel::new() {
            Ok(ch) => ch,
            Err(e) => {
                reject(&id);
                return Err(e);
            }
        };
        // SAFETY: a new id whose events were acknowledged; moved to its own channel.
        let moved = rc("rdma_migrate_id", unsafe {
            (l.rdma_migrate_id)(id.0.as_ptr(), ch.0.as_ptr())
        });
        let req = ConnectRequest {
            inner: Some((id, ch)),
        };
        moved.map(|()| req)
    }
}

impl std::os::fd::AsFd for Listener {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        // SAFETY: the channel owns its fd for as long as it lives; the borrow is tied to `self`.
        unsafe { std::os::fd::BorrowedFd::borrow_raw(self.ch.0.as_ref().fd) }
    }
}

/// A connection request taken from a [`Listener`] ([`Listener::next_request`]), on its own
/// event channel, not answered yet. Dropping it rejects it (`rdma_reject`), so the peer does
/// not wait.
pub struct ConnectRequest {
    /// The request's id and its own event channel, until accepted or dropped (the id goes
    /// first).
    inner: Option<(Id, Channel)>,
}

/// `rdma_reject` of a request not answered.
fn reject(id: &Id) {
    free_in_parent(cm::lib, |l| {
        // SAFETY: a live id of a request not answered; rejected once.
        unsafe { (l.rdma_reject)(id.0.as_ptr(), std::ptr::null(), 0) };
    });
}

impl ConnectRequest {
    /// Accept the request on the caller's protection domain and completion queues, as
    /// [`Listener::accept_with`] does, within `opts.timeout`.
    ///
    /// # Errors
    ///
    /// As [`Listener::accept_with`].
    #[doc(alias = "rdma_accept")]
    pub fn accept_with(
        self,
        opts: &ConnectOptions,
        mut home: impl FnMut(&str) -> Result<QpResources>,
    ) -> Result<Connection> {
        self.accept_inner(opts, Some(&mut home), deadline_after(opts.timeout), None)
    }

    /// [`accept_with`](Self::accept_with) by `deadline`, ended early (with
    /// [`Error::Timeout`]) once `stop` is set. The queue pair allows the peer exactly
    /// `opts.access` (rdma_cm's defaults not added): widen it later with
    /// [`Connection::set_remote_access`].
    #[cfg_attr(not(feature = "transfer"), allow(dead_code))]
    pub(crate) fn accept_until(
        self,
        opts: &ConnectOptions,
        mut home: impl FnMut(&str) -> Result<QpResources>,
        deadline: Instant,
        stop: &AtomicBool,
    ) -> Result<Connection> {
        self.accept_inner(opts, Some(&mut home), deadline, Some(stop))
    }

    fn accept_inner(
        mut self,
        opts: &ConnectOptions,
        home: HomeFn<'_>,
        deadline: Instant,
        stop: Option<&AtomicBool>,
    ) -> Result<Connection> {
        let l = cmlib()?;
        let (id, _) = self
            .inner
            .as_ref()
            .expect("present until accepted or dropped");
        let (parts, qp) = Parts::new(id, opts, home, stop.is_some())?;
        let (qp, route) = id.to_rts(qp, opts.ack_timeout)?;
        let mut param = parts.conn_param(qp.qp_num());
        // SAFETY: a live id and a valid parameter struct.
        rc("rdma_accept", unsafe {
            (l.rdma_accept)(id.0.as_ptr(), &mut param)
        })?;
        // Answered: from here the id is disconnected (not rejected) when it goes.
        let (id, ch) = self.inner.take().expect("present");
        let conn = parts.finish(qp, id, ch, route)?;
        let p = conn.parts.as_ref().expect("present until drop");
        p.link
            .ch
            .wait_until("rdma_accept", cm::RDMA_CM_EVENT_ESTABLISHED, deadline, stop)?;
        Ok(conn)
    }
}

impl Drop for ConnectRequest {
    fn drop(&mut self) {
        if let Some((id, ch)) = self.inner.take() {
            reject(&id);
            drop(id);
            drop(ch);
        }
    }
}

impl std::fmt::Debug for ConnectRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectRequest").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("port", &self.port())
            .finish()
    }
}

const HS_TAG: u64 = u64::MAX - 1;
/// One slot of the handshake buffer: two for receiving (rounds alternate), one for sending.
const HS_SLOT: usize = HANDSHAKE_BYTES;

/// The largest message of [`Connection::exchange_bytes`].
pub const HANDSHAKE_BYTES: usize = 256;

/// What rdma_cm routed a connection to ([`Id::to_rts`]).
struct Route {
    peer_qpn: u32,
    global: bool,
    peer_gid: Gid,
    sgid_index: u8,
    port: u8,
}

/// What identifies a connection, as this side sees it ([`Connection::binding`]): both queue
/// pair numbers and both GIDs (all zero without a global route, as on an InfiniBand subnet
/// without GRH). A handshake that authenticates it makes a relay between two peers fail: each
/// of them sees the relay's queue pair and GID.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnectionBinding {
    /// This side's queue pair number.
    pub local_qpn: u32,
    /// The peer's queue pair number, as rdma_cm gave it.
    pub peer_qpn: u32,
    /// This side's GID (the source GID of the route).
    pub local_gid: Gid,
    /// The peer's GID (the route's destination).
    pub peer_gid: Gid,
}

/// What a connection's queue pair is built on when the caller brings it
/// ([`Connection::connect_with`], [`Listener::accept_with`]): a protection domain whose
/// registrations the connection can use (several connections share them), and the two completion
/// queues, which may report to a completion channel of the caller's.
///
/// The queue pair takes one entry of `send_cq` for its teardown and one receive of its receive
/// queue for the descriptor exchange, two while [`Connection::exchange_bytes`] rounds run (see
/// [Capacity](super#capacity)).
#[derive(Debug)]
pub struct QpResources {
    /// The protection domain, on the device rdma_cm picked for the connection.
    pub pd: ProtectionDomain,
    /// The CQ of sends, RDMA and atomics, on the same device.
    pub send_cq: CompletionQueue,
    /// The CQ of receives, on the same device.
    pub recv_cq: CompletionQueue,
}

/// The caller's choice of resources for a connection ([`QpResources`]), if any.
type HomeFn<'a> = Option<&'a mut dyn FnMut(&str) -> Result<QpResources>>;

struct Parts {
    ctx: Context,
    pd: ProtectionDomain,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    channel: Option<CompletionChannel>,
    hs: MemoryRegion<Local>,
    rd_atomic: u8,
}

impl Parts {
    /// The objects of a connection on the device rdma_cm bound `id` to, and its queue pair in
    /// INIT (with the access `opts` allows peers) with the descriptor exchange's receive posted.
    /// `home` gives the PD and CQs for the device's name; `None` opens the device and makes
    /// them here.
    fn new(
        id: &Id,
        opts: &ConnectOptions,
        home: HomeFn<'_>,
        exact: bool,
    ) -> Result<(Parts, QueuePair<Init>)> {
        let name = id.device_name()?;
        let (ctx, pd, send_cq, recv_cq, channel) = match home {
            Some(home) => {
                let r = home(&name)?;
                let ctx = r.pd.context();
                if ctx.name() != name {
                    return Err(Error::invalid(
                        "resources",
                        ctx.name(),
                        format!(
                            "rdma_cm routed the connection through device {name}: the protection domain must be on it"
                        ),
                    ));
                }
                (ctx, r.pd, r.send_cq, r.recv_cq, None)
            }
            None => {
                let list = DeviceList::non_empty()?;
                let ctx = Context::open(&list.find(&name)?)?;
                let pd = ctx.alloc_pd()?;
                let depth = opts.cq_entries()?;
                let channel = if opts.recv_channel {
                    Some(ctx.create_comp_channel()?)
                } else {
                    None
                };
                let recv_cq = ctx.create_cq(depth, channel.as_ref())?;
                let send_cq = if opts.one_cq {
                    recv_cq.share()
                } else {
                    ctx.create_cq(depth, None)?
                };
                (ctx, pd, send_cq, recv_cq, channel)
            }
        };
        let dev = ctx.query_device()?;
        let qp: QueuePair<Reset> = QueuePair::create(&pd, &send_cq, &recv_cq, None, opts.caps)?;
        let hs = pd.register(HostBuffer::zeroed(3 * HS_SLOT)?, AccessFlags::LOCAL_WRITE)?;
        let rd_atomic = (opts.rd_atomic as u32)
            .min(dev.max_qp_rd_atom)
            .min(dev.max_qp_init_rd_atom)
            .max(1) as u8;
        let (mut a, m) = id.qp_attr(ibv::IBV_QPS_INIT)?;
        // rdma_cm's own choice (remote write, and read with responder resources) plus
        // `opts.access`; or, for the crate's handshakes, `opts.access` alone.
        let bits = opts.access.bits() & !ibv::IBV_ACCESS_LOCAL_WRITE;
        if exact {
            a.qp_access_flags = bits;
        } else {
            a.qp_access_flags |= bits;
        }
        let mut qp = qp.modify_raw::<Init>(&mut a, m | ibv::IBV_QP_ACCESS_FLAGS as i32)?;
        qp.post_recv([RecvRequest::new(hs.slice(..HS_SLOT)?).tag(HS_TAG)])?;
        let parts = Parts {
            ctx,
            pd,
            send_cq,
            recv_cq,
            channel,
            hs,
            rd_atomic,
        };
        Ok((parts, qp))
    }

    fn conn_param(&self, qp_num: u32) -> cm::rdma_conn_param {
        cm::rdma_conn_param {
            responder_resources: self.rd_atomic,
            initiator_depth: self.rd_atomic,
            retry_count: 7,
            rnr_retry_count: 7,
            qp_num,
            ..Default::default()
        }
    }

    fn finish(self, qp: QueuePair<Rts>, id: Id, ch: Channel, route: Route) -> Result<Connection> {
        let local_gid = if route.global {
            self.ctx.gid(route.port, u32::from(route.sgid_index))?
        } else {
            Gid::default()
        };
        let binding = ConnectionBinding {
            local_qpn: qp.qp_num(),
            peer_qpn: route.peer_qpn,
            local_gid,
            peer_gid: if route.global {
                route.peer_gid
            } else {
                Gid::default()
            },
        };
        Ok(Connection {
            parts: Some(ConnectionParts {
                qp,
                send_cq: self.send_cq,
                recv_cq: self.recv_cq,
                pd: self.pd,
                link: CmLink {
                    hs: self.hs,
                    channel: self.channel,
                    ctx: self.ctx,
                    disconnected: false,
                    id,
                    ch,
                },
            }),
            hs_round: 0,
            hs_done: false,
            binding,
        })
    }
}

/// A connected RC queue pair with its two CQs, from [`Listener::accept`] or
/// [`Connection::connect`]. Dropping it disconnects, then drops the QP (which drains).
pub struct Connection {
    /// Present until drop or [`Connection::into_parts`].
    parts: Option<ConnectionParts>,
    /// Handshake rounds done: the next message arrives in receive slot `hs_round % 2`.
    hs_round: u32,
    /// [`Connection::exchange`] was called: no more rounds.
    hs_done: bool,
    binding: ConnectionBinding,
}

/// A connection taken apart ([`Connection::into_parts`]): the queue pair and its CQs for the
/// caller to drive, and the rdma_cm side ([`CmLink`]), which disconnects when dropped. Dropped as
/// a whole, the queue pair goes first (error state, drain, destroy), then the CQs, the PD and the
/// link.
#[derive(Debug)]
pub struct ConnectionParts {
    /// The queue pair, in RTS.
    pub qp: QueuePair<Rts>,
    /// The CQ of sends, RDMA and atomics.
    pub send_cq: CompletionQueue,
    /// The CQ of receives.
    pub recv_cq: CompletionQueue,
    /// The protection domain.
    pub pd: ProtectionDomain,
    /// The rdma_cm id and its event channel.
    pub link: CmLink,
}

/// The rdma_cm side of a connection: its id and event channel, through which the peer's
/// disconnect arrives ([`CmLink::next_event`]). Dropping it disconnects (`rdma_disconnect`) and
/// destroys the id.
pub struct CmLink {
    hs: MemoryRegion<Local>,
    channel: Option<CompletionChannel>,
    ctx: Context,
    disconnected: bool,
    id: Id,
    ch: Channel,
}

/// An rdma_cm event on an established connection ([`CmLink::next_event`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmLinkEvent {
    /// The event's C name, such as `RDMA_CM_EVENT_DISCONNECTED`.
    pub name: &'static str,
    /// Its status (a negative errno, or 0).
    pub status: i32,
}

impl CmLinkEvent {
    /// Whether the connection is gone: the peer disconnected (or its process ended) or the
    /// device was removed.
    pub fn ends_connection(&self) -> bool {
        matches!(
            self.name,
            "RDMA_CM_EVENT_DISCONNECTED" | "RDMA_CM_EVENT_DEVICE_REMOVAL"
        )
    }
}

impl CmLink {
    /// Take the receive CQ's completion channel ([`ConnectOptions::recv_channel`]), to wait on it
    /// elsewhere (an [`AsyncCq`](super::AsyncCq)); `None` without one or once taken.
    pub fn take_channel(&mut self) -> Option<CompletionChannel> {
        self.channel.take()
    }

    /// The verbs device of the connection.
    pub fn device(&self) -> &str {
        self.ctx.name()
    }

    /// `rdma_get_cm_event` without blocking: the next event of the connection (acknowledged), or
    /// `None` when none is waiting. The link's fd ([`AsFd`](std::os::fd::AsFd)) is readable while
    /// one is.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `poll` or `rdma_get_cm_event`.
    #[doc(alias = "rdma_get_cm_event")]
    pub fn next_event(&self) -> Result<Option<CmLinkEvent>> {
        Ok(self.ch.try_next()?.map(|e| CmLinkEvent {
            name: event_name(e.kind),
            status: e.status,
        }))
    }

    /// `rdma_disconnect`, once (dropping the link does it too). Errors (already disconnected)
    /// are ignored.
    #[doc(alias = "rdma_disconnect")]
    pub fn disconnect(&mut self) {
        if std::mem::replace(&mut self.disconnected, true) {
            return;
        }
        free_in_parent(cm::lib, |l| {
            // SAFETY: a live id. Errors (already disconnected) are ignored.
            unsafe { (l.rdma_disconnect)(self.id.0.as_ptr()) };
        });
    }
}

impl std::os::fd::AsFd for CmLink {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        // SAFETY: the channel owns its fd for as long as it lives; the borrow is tied to `self`.
        unsafe { std::os::fd::BorrowedFd::borrow_raw(self.ch.0.as_ref().fd) }
    }
}

impl Drop for CmLink {
    fn drop(&mut self) {
        self.disconnect();
        // Then, in field order: the exchange region, the channel, the context, the id and its
        // event channel.
    }
}

impl std::fmt::Debug for CmLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmLink")
            .field("device", &self.ctx.name())
            .field("disconnected", &self.disconnected)
            .finish()
    }
}

impl Connection {
    /// `rdma_resolve_addr` + `rdma_resolve_route` + `rdma_connect` to `addr`, then
    /// `rdma_establish`: a connected QP in RTS, with one receive posted for
    /// [`Connection::exchange`].
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`]; [`Error::CmEvent`] (for example `RDMA_CM_EVENT_REJECTED` or
    /// `RDMA_CM_EVENT_UNREACHABLE`); [`Error::Unsupported`] when librdmacm lacks `rdma_establish`.
    #[doc(alias = "rdma_connect")]
    #[doc(alias = "rdma_resolve_addr")]
    #[doc(alias = "rdma_create_id")]
    #[doc(alias = "rdma_resolve_route")]
    #[doc(alias = "rdma_establish")]
    pub fn connect(addr: SocketAddr, opts: &ConnectOptions) -> Result<Connection> {
        Self::connect_inner(addr, opts, None, None)
    }

    /// [`connect`](Self::connect) on the caller's protection domain and completion queues:
    /// `home` is called once the route is resolved, with the name of the verbs device rdma_cm
    /// picked, and returns the [`QpResources`] on that device (`opts.cq_depth` and
    /// `opts.recv_channel` are then not used).
    ///
    /// # Errors
    ///
    /// As [`connect`](Self::connect); whatever `home` returns; [`Error::InvalidArgument`] when
    /// the protection domain is on another device.
    #[doc(alias = "rdma_connect")]
    #[doc(alias = "rdma_resolve_addr")]
    #[doc(alias = "rdma_resolve_route")]
    pub fn connect_with(
        addr: SocketAddr,
        opts: &ConnectOptions,
        mut home: impl FnMut(&str) -> Result<QpResources>,
    ) -> Result<Connection> {
        Self::connect_inner(addr, opts, Some(&mut home), None)
    }

    /// [`connect_with`](Self::connect_with), every step bounded by what is left before `until`
    /// too (so the whole connection is). The queue pair allows the peer exactly `opts.access`
    /// (rdma_cm's defaults not added): widen it later with [`set_remote_access`](Self::set_remote_access).
    #[cfg_attr(not(feature = "transfer"), allow(dead_code))]
    pub(crate) fn connect_until(
        addr: SocketAddr,
        opts: &ConnectOptions,
        mut home: impl FnMut(&str) -> Result<QpResources>,
        until: Instant,
    ) -> Result<Connection> {
        let mut o = *opts;
        o.timeout = until
            .saturating_duration_since(Instant::now())
            .min(opts.timeout);
        if o.timeout.is_zero() {
            return Err(Error::Timeout {
                what: "rdma_connect",
                after: opts.timeout,
            });
        }
        Self::connect_inner(addr, &o, Some(&mut home), Some(until))
    }

    fn connect_inner(
        addr: SocketAddr,
        opts: &ConnectOptions,
        home: HomeFn<'_>,
        until: Option<Instant>,
    ) -> Result<Connection> {
        // Each step within `opts.timeout`, and all of them by `until` when given.
        let step = || match until {
            Some(u) => u
                .saturating_duration_since(Instant::now())
                .min(opts.timeout),
            None => opts.timeout,
        };
        let l = cmlib()?;
        let establish = l.rdma_establish.ok_or_else(|| Error::Unsupported {
            what: "rdma_cm with an application-created QP".into(),
            reason: format!(
                "{} has no rdma_establish (rdma-core older than 20)",
                l.path()
            ),
        })?;
        let ch = Channel::new()?;
        let id = Id::new(&ch)?;
        let mut dst = sockaddr(&addr);
        let ms = opts.timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: a live id and a valid destination.
        rc("rdma_resolve_addr", unsafe {
            (l.rdma_resolve_addr)(
                id.0.as_ptr(),
                std::ptr::null_mut(),
                (&mut dst as *mut libc::sockaddr_storage).cast(),
                ms,
            )
        })?;
        ch.wait("rdma_resolve_addr", cm::RDMA_CM_EVENT_ADDR_RESOLVED, step())?;
        // SAFETY: an id with a resolved address.
        rc("rdma_resolve_route", unsafe {
            (l.rdma_resolve_route)(id.0.as_ptr(), ms)
        })?;
        ch.wait(
            "rdma_resolve_route",
            cm::RDMA_CM_EVENT_ROUTE_RESOLVED,
            step(),
        )?;
        let (parts, qp) = Parts::new(&id, opts, home, until.is_some())?;
        let mut param = parts.conn_param(qp.qp_num());
        // SAFETY: a live id with a resolved route and a valid parameter struct.
        rc("rdma_connect", unsafe {
            (l.rdma_connect)(id.0.as_ptr(), &mut param)
        })?;
        ch.wait("rdma_connect", cm::RDMA_CM_EVENT_CONNECT_RESPONSE, step())?;
        let (qp, route) = id.to_rts(qp, opts.ack_timeout)?;
        // SAFETY: a live id whose QP is in RTS: sends the RTU.
        rc("rdma_establish", unsafe { establish(id.0.as_ptr()) })?;
        parts.finish(qp, id, ch, route)
    }

    fn p(&mut self) -> &mut ConnectionParts {
        self.parts.as_mut().expect("present until drop")
    }

    /// The queue pair.
    pub fn qp(&mut self) -> &mut QueuePair<Rts> {
        &mut self.p().qp
    }

    /// The CQ of sends, RDMA and atomics.
    pub fn send_cq(&mut self) -> &mut CompletionQueue {
        &mut self.p().send_cq
    }

    /// The CQ of receives.
    pub fn recv_cq(&mut self) -> &mut CompletionQueue {
        &mut self.p().recv_cq
    }

    /// Split borrows: the QP and both CQs at once.
    pub fn parts(
        &mut self,
    ) -> (
        &mut QueuePair<Rts>,
        &mut CompletionQueue,
        &mut CompletionQueue,
    ) {
        let p = self.p();
        (&mut p.qp, &mut p.send_cq, &mut p.recv_cq)
    }

    /// Take the connection apart: the queue pair and CQs to drive directly (with a progress
    /// thread, across error states), and the rdma_cm link that reports the peer's disconnect.
    pub fn into_parts(mut self) -> ConnectionParts {
        self.parts.take().expect("present until drop")
    }

    /// Block until the receive CQ has something to poll, or `timeout` passes: arms the CQ
    /// (`ibv_req_notify_cq`), re-checks it, then waits on its completion channel. Returns whether
    /// a completion is ready. Needs [`ConnectOptions::recv_channel`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] without a channel; [`Error::Os`] naming `ibv_req_notify_cq`,
    /// `poll` or `ibv_get_cq_event`.
    #[doc(alias = "ibv_req_notify_cq")]
    #[doc(alias = "ibv_get_cq_event")]
    pub fn wait_recv(&mut self, timeout: Duration) -> Result<bool> {
        use std::os::fd::{AsFd, AsRawFd};
        let p = self.parts.as_mut().expect("present until drop");
        let Some(ch) = &p.link.channel else {
            return Err(Error::invalid(
                "recv_channel",
                false,
                "wait_recv needs ConnectOptions::recv_channel",
            ));
        };
        p.recv_cq.req_notify(false)?;
        // A completion that arrived before arming raises no event: look once more, keeping what
        // is found for the caller's next poll.
        let mut buf = [WorkCompletion::default(); 4];
        let n = p.recv_cq.inner.poll_into(&mut buf)?;
        if n > 0 {
            for w in &buf[..n] {
                p.recv_cq.inner.hold(*w);
            }
            return Ok(true);
        }
        let mut pfd = libc::pollfd {
            fd: ch.as_fd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let r = unsafe {
            libc::poll(
                &mut pfd,
                1,
                timeout.as_millis().min(i32::MAX as u128) as i32,
            )
        };
        if r < 0 {
            return Err(Error::last_os("poll"));
        }
        if r == 0 {
            return Ok(false);
        }
        ch.get_event()?;
        Ok(true)
    }

    /// The protection domain: register memory here to use it on this connection.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.parts.as_ref().expect("present until drop").pd
    }

    /// The device context.
    pub fn context(&self) -> &Context {
        &self.parts.as_ref().expect("present until drop").link.ctx
    }

    /// What the peer may do through this queue pair from now on (remote read, write, atomic):
    /// `ibv_modify_qp` of its access flags, in RTS. A handshake can thus keep a peer away from
    /// every registration until it has said who it is.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `ibv_modify_qp`.
    #[doc(alias = "ibv_modify_qp")]
    #[doc(alias = "IBV_QP_ACCESS_FLAGS")]
    pub fn set_remote_access(&mut self, access: AccessFlags) -> Result<()> {
        let l = verbs()?;
        let mut a = ibv::ibv_qp_attr {
            qp_access_flags: access.bits() & !ibv::IBV_ACCESS_LOCAL_WRITE,
            ..Default::default()
        };
        let qp = self.qp().as_raw();
        // SAFETY: a live QP in RTS; the mask names the one field set (no state change).
        rc("ibv_modify_qp", unsafe {
            (l.ibv_modify_qp)(qp, &mut a, ibv::IBV_QP_ACCESS_FLAGS as i32)
        })
    }

    /// What identifies this connection as this side sees it: both queue pair numbers and GIDs
    /// (what an authenticated handshake binds, so that it cannot be relayed).
    pub fn binding(&self) -> ConnectionBinding {
        self.binding
    }

    /// Send `mine` to the peer as the first message and return the peer's. Both sides call it
    /// once, right after connecting (and after any [`exchange_bytes`](Self::exchange_bytes)
    /// rounds) and before posting anything else. The peer's descriptor is untrusted: it is
    /// checked ([`RemoteMemory::validate`]) before it is returned, and every slice of it is
    /// checked again.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when called twice, or when the peer's message is not a valid
    /// descriptor (short, empty, or its address plus length overflows); [`Error::Timeout`] after
    /// `timeout`; [`Error::WorkCompletion`] when the send or receive fails.
    pub fn exchange(&mut self, mine: RemoteMemory, timeout: Duration) -> Result<RemoteMemory> {
        self.exchange_until(mine, deadline_after(timeout), None)
    }

    /// [`exchange`](Self::exchange) by `deadline`, ended early (with [`Error::Timeout`]) once
    /// `stop` is set.
    pub(crate) fn exchange_until(
        &mut self,
        mine: RemoteMemory,
        deadline: Instant,
        stop: Option<&AtomicBool>,
    ) -> Result<RemoteMemory> {
        if self.hs_done {
            return Err(Error::invalid(
                "exchange",
                "second call",
                "descriptors are exchanged once per connection",
            ));
        }
        self.hs_done = true;
        let got = self.hs_round_trip(&mine.to_bytes(), false, deadline, stop)?;
        RemoteMemory::from_bytes(&got[..decoded_len(got.len() as u32)])
    }

    /// A handshake round before [`exchange`](Self::exchange): send `mine` (1 to
    /// [`HANDSHAKE_BYTES`] bytes) and return the peer's message of the same round (at most
    /// [`HANDSHAKE_BYTES`]; longer ones are cut). Both sides make the same number of rounds,
    /// then call [`exchange`](Self::exchange): each round posts the receive of the next one
    /// before it sends, so the peer's next message, sent once it has this one, always finds it
    /// (the receive queue needs room for that one receive more).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty or longer message, or after
    /// [`exchange`](Self::exchange); [`Error::Timeout`] after `timeout`; [`Error::QueueFull`]
    /// without room for the next receive; [`Error::WorkCompletion`] when the send or receive
    /// fails.
    pub fn exchange_bytes(&mut self, mine: &[u8], timeout: Duration) -> Result<Vec<u8>> {
        self.exchange_bytes_until(mine, deadline_after(timeout), None)
    }

    /// [`exchange_bytes`](Self::exchange_bytes) by `deadline`, ended early (with
    /// [`Error::Timeout`]) once `stop` is set.
    pub(crate) fn exchange_bytes_until(
        &mut self,
        mine: &[u8],
        deadline: Instant,
        stop: Option<&AtomicBool>,
    ) -> Result<Vec<u8>> {
        if self.hs_done || mine.is_empty() || mine.len() > HANDSHAKE_BYTES {
            return Err(Error::invalid(
                "exchange_bytes",
                format!("{} bytes", mine.len()),
                format!("1 to {HANDSHAKE_BYTES} bytes a round, before exchange"),
            ));
        }
        self.hs_round_trip(mine, true, deadline, stop)
    }

    /// One round: (with `more`, the next round's receive posted, then) `mine` sent, and the
    /// peer's message of this round received.
    fn hs_round_trip(
        &mut self,
        mine: &[u8],
        more: bool,
        deadline: Instant,
        stop: Option<&AtomicBool>,
    ) -> Result<Vec<u8>> {
        let start = Instant::now();
        let slot = (self.hs_round % 2) as usize * HS_SLOT;
        let next = ((self.hs_round + 1) % 2) as usize * HS_SLOT;
        self.hs_round += 1;
        let p = self.parts.as_mut().expect("present until drop");
        if more {
            p.qp.post_recv([RecvRequest::new(p.link.hs.slice(next..next + HS_SLOT)?).tag(HS_TAG)])?;
        }
        p.link.hs.write_at(2 * HS_SLOT, mine)?;
        let s = p.link.hs.slice(2 * HS_SLOT..2 * HS_SLOT + mine.len())?;
        p.qp.post_send([SendRequest::send(s).tag(HS_TAG)])?;
        let (mut sent, mut got) = (false, None);
        let one_cq = Arc::ptr_eq(&p.send_cq.inner, &p.recv_cq.inner);
        // Completions that are not the handshake's go back to their own CQ afterwards.
        let mut others: Vec<(bool, WorkCompletion)> = Vec::new();
        // Yields at first, then naps growing to 1 ms, and 5 ms once the round took 50 ms: a peer
        // that takes long (or a listener's many silent ones) costs little CPU.
        let mut idle = 0u32;
        let res = (|| {
            while !(sent && got.is_some()) {
                if Instant::now() >= deadline || stop.is_some_and(|s| s.load(Ordering::Acquire)) {
                    return Err(Error::Timeout {
                        what: "descriptor exchange",
                        after: start.elapsed(),
                    });
                }
                let mut seen = false;
                for (cq, from_send_cq) in [(&mut p.send_cq, true), (&mut p.recv_cq, false)] {
                    if one_cq && !from_send_cq {
                        break; // the same CQ: polled once
                    }
                    for w in cq.poll()? {
                        seen = true;
                        if w.tag() != HS_TAG {
                            others.push((from_send_cq, *w));
                            continue;
                        }
                        // One CQ for both queues: a successful completion's opcode says which.
                        if one_cq {
                            w.result()?;
                        }
                        let is_send = if one_cq {
                            !matches!(w.opcode(), WcOpcode::Recv | WcOpcode::RecvRdmaWithImm)
                        } else {
                            from_send_cq
                        };
                        if is_send {
                            w.result()?;
                            sent = true;
                        } else if got.is_some() {
                            // The peer's next round, already here: held for that round.
                            others.push((from_send_cq, *w));
                        } else {
                            w.result()?;
                            got = Some(w.byte_len());
                        }
                    }
                }
                if seen {
                    idle = 0;
                } else {
                    idle += 1;
                    if idle < 64 {
                        std::thread::yield_now();
                    } else if start.elapsed() < Duration::from_millis(50) {
                        let us = 10u64 << ((idle - 64) / 16).min(7);
                        std::thread::sleep(Duration::from_micros(us.min(1000)));
                    } else {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
            }
            Ok(())
        })();
        for (is_send, w) in others {
            let cq = if is_send { &p.send_cq } else { &p.recv_cq };
            cq.inner.hold(w);
        }
        res?;
        let n = (got.unwrap_or(0) as usize).min(HS_SLOT);
        let mut b = vec![0u8; n];
        p.link.hs.read_at(slot, &mut b)?;
        Ok(b)
    }
}

/// How many of the received bytes to decode: what arrived, at most one descriptor.
fn decoded_len(byte_len: u32) -> usize {
    (byte_len as usize).min(RemoteMemory::WIRE_LEN)
}

impl Drop for Connection {
    fn drop(&mut self) {
        if let Some(mut p) = self.parts.take() {
            // Disconnect first, so the peer learns at once; then the QP goes (error state,
            // drain, destroy), then CQs, PD and the link, in field order.
            p.link.disconnect();
            drop(p);
        }
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = self.parts.as_ref();
        f.debug_struct("Connection")
            .field("device", &p.map(|p| p.link.ctx.name()))
            .field("qp", &p.map(|p| &p.qp))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever the peer sent (any length, any bytes): a checked descriptor or a typed error.
        #[test]
        fn a_peer_descriptor_is_decoded_as_untrusted(
            got in any::<u32>(), bytes in proptest::collection::vec(any::<u8>(), 20),
        ) {
            let b = &bytes[..decoded_len(got)];
            match RemoteMemory::from_bytes(b) {
                Ok(r) => {
                    prop_assert!(b.len() == 20 && r.len > 0);
                    prop_assert!(r.addr.checked_add(r.len).is_some());
                }
                Err(Error::InvalidArgument { .. }) => {}
                Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
            }
        }
    }

    #[test]
    fn any_timeout_gives_a_deadline() {
        assert!(deadline_after(Duration::MAX) > Instant::now());
        assert!(deadline_after(Duration::ZERO) <= Instant::now());
    }

    proptest! {
        /// Any depths: the CQ size is their checked sum (or `cq_depth`), never a wrapped one.
        #[test]
        fn cq_entries_never_wrap(send in any::<u32>(), recv in any::<u32>(), cq in any::<u32>()) {
            let opts = ConnectOptions {
                caps: QpCaps { max_send_wr: send, max_recv_wr: recv, ..QpCaps::default() },
                cq_depth: cq,
                ..ConnectOptions::default()
            };
            let want = if cq == 0 { send.checked_add(recv) } else { Some(cq) };
            prop_assert_eq!(opts.cq_entries().ok(), want);
        }
    }
}
