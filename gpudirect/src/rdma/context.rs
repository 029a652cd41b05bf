//! An open device: attributes, ports, GIDs, asynchronous events.

use super::device::{Device, DeviceList};
use super::ffi::{free_in_parent, nonnull, rc, verbs};
use crate::error::{Error, Result};
use gpudirect_sys::ibverbs as ibv;
use std::ffi::CStr;
use std::fmt;
use std::os::fd::{BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;

pub(crate) struct CtxInner {
    pub(crate) ctx: NonNull<ibv::ibv_context>,
    name: String,
}

// SAFETY: libibverbs contexts are thread-safe (the library and providers lock internally).
unsafe impl Send for CtxInner {}
// SAFETY: as above.
unsafe impl Sync for CtxInner {}

#[cfg(test)]
impl CtxInner {
    /// A context that was never opened, for tests of logic above it; leaked, so it is never
    /// closed.
    pub(crate) fn fake() -> Arc<CtxInner> {
        let c = Arc::new(CtxInner {
            ctx: NonNull::dangling(),
            name: "fake".into(),
        });
        std::mem::forget(c.clone());
        c
    }
}

impl Drop for CtxInner {
    fn drop(&mut self) {
        free_in_parent(ibv::lib, |l| {
            // SAFETY: opened by ibv_open_device; every child object holds an Arc to this, so
            // none is alive any more. Errors are ignored (nothing can be done in a destructor).
            unsafe { (l.ibv_close_device)(self.ctx.as_ptr()) };
        });
    }
}

/// `ibv_open_device(dev)`—an open verbs device. Cheap to clone; closed when the last clone and the
/// last object made from it are gone.
#[derive(Clone)]
#[doc(alias = "ibv_context")]
pub struct Context {
    pub(crate) inner: Arc<CtxInner>,
}

impl Context {
    /// `ibv_open_device(dev)`.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `ibv_open_device` with the errno.
    #[doc(alias = "ibv_open_device")]
    pub fn open(dev: &Device<'_>) -> Result<Context> {
        let l = verbs()?;
        // SAFETY: a device of a live list.
        let ctx = nonnull("ibv_open_device", unsafe {
            (l.ibv_open_device)(dev.as_ptr())
        })?;
        Ok(Context {
            inner: Arc::new(CtxInner {
                ctx,
                name: dev.name(),
            }),
        })
    }

    /// Open the device called `name`, or the first device when `name` is `None`.
    ///
    /// # Errors
    ///
    /// [`Error::NoDevice`] when there is no (such) device; see also [`Context::open`].
    #[doc(alias = "ibv_get_device_list")]
    #[doc(alias = "ibv_open_device")]
    pub fn open_by_name(name: Option<&str>) -> Result<Context> {
        let list = DeviceList::non_empty()?;
        match name {
            Some(n) => Context::open(&list.find(n)?),
            None => Context::open(&list.iter().next().expect("non_empty")),
        }
    }

    /// The device's kernel name, such as `rxe0`.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The raw `ibv_context`, for calls this crate does not wrap. It stays valid while `self` does.
    pub fn as_raw(&self) -> *mut ibv::ibv_context {
        self.inner.ctx.as_ptr()
    }

    /// `ibv_query_device`—the device's limits and capabilities.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `ibv_query_device`.
    #[doc(alias = "ibv_query_device")]
    pub fn query_device(&self) -> Result<DeviceAttr> {
        let l = verbs()?;
        let mut a = ibv::ibv_device_attr::default();
        // SAFETY: a live context and a valid out-struct.
        rc("ibv_query_device", unsafe {
            (l.ibv_query_device)(self.as_raw(), &mut a)
        })?;
        let fw = a
            .fw_ver
            .iter()
            .take_while(|c| **c != 0)
            .map(|c| *c as u8 as char)
            .collect();
        // The provider's counts are C ints: a negative one (never expected) reads as 0, "unknown".
        let n = |v: i32| v.max(0) as u32;
        Ok(DeviceAttr {
            fw_ver: fw,
            node_guid: u64::from_be(a.node_guid),
            max_mr_size: a.max_mr_size,
            page_size_cap: a.page_size_cap,
            max_qp: n(a.max_qp),
            max_qp_wr: n(a.max_qp_wr),
            max_sge: n(a.max_sge),
            max_cq: n(a.max_cq),
            max_cqe: n(a.max_cqe),
            max_mr: n(a.max_mr),
            max_pd: n(a.max_pd),
            max_qp_rd_atom: n(a.max_qp_rd_atom),
            max_qp_init_rd_atom: n(a.max_qp_init_rd_atom),
            max_srq: n(a.max_srq),
            max_srq_wr: n(a.max_srq_wr),
            max_srq_sge: n(a.max_srq_sge),
            atomic_cap: a.atomic_cap,
            phys_port_cnt: a.phys_port_cnt,
            device_cap_flags: a.device_cap_flags,
            max_mw: n(a.max_mw),
        })
    }

    /// `ibv_query_port(ctx, port)`—a port's state, MTU and link layer. Ports count from 1.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `ibv_query_port` (`EINVAL` for a port that does not exist).
    #[doc(alias = "ibv_query_port")]
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        verbs()?;
        let mut a = ibv::ibv_port_attr::default();
        // SAFETY: a live context and a valid out-struct (the inline verb's semantics).
        rc("ibv_query_port", unsafe {
            ibv::ibv_query_port(self.as_raw(), port, &mut a)
        })?;
        Ok(PortAttr {
            state: PortState::from_raw(a.state),
            max_mtu: Mtu::from_raw(a.max_mtu),
            active_mtu: Mtu::from_raw(a.active_mtu),
            gid_tbl_len: a.gid_tbl_len.max(0) as u32,
            max_msg_sz: a.max_msg_sz,
            lid: a.lid,
            link_layer: match a.link_layer as u32 {
                ibv::IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
                ibv::IBV_LINK_LAYER_INFINIBAND => LinkLayer::Infiniband,
                _ => LinkLayer::Unspecified,
            },
            active_width: a.active_width,
            active_speed: a.active_speed,
        })
    }

    /// `ibv_query_gid(ctx, port, index)`—one GID.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an index over `i32::MAX` (the C call takes an int);
    /// [`Error::Os`] naming `ibv_query_gid`.
    #[doc(alias = "ibv_query_gid")]
    pub fn gid(&self, port: u8, index: u32) -> Result<Gid> {
        let Ok(index) = i32::try_from(index) else {
            return Err(Error::invalid(
                "index",
                index,
                "a GID table index fits a C int",
            ));
        };
        let l = verbs()?;
        let mut g = ibv::ibv_gid::default();
        // SAFETY: a live context and a valid out-union.
        rc("ibv_query_gid", unsafe {
            (l.ibv_query_gid)(self.as_raw(), port, index, &mut g)
        })?;
        // SAFETY: every bit pattern of the union is a valid byte array.
        Ok(Gid(unsafe { g.raw }))
    }

    /// `ibv_query_gid_ex(ctx, port, index)`—one GID with its type (IB, RoCE v1, RoCE v2). Falls back
    /// to `ibv_query_gid` plus sysfs' `gid_attrs/types` where the library is older than rdma-core
    /// 32.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `ibv_query_gid_ex` (`ENODATA` for an empty entry).
    #[doc(alias = "ibv_query_gid_ex")]
    #[doc(alias = "_ibv_query_gid_ex")]
    pub fn gid_entry(&self, port: u8, index: u32) -> Result<GidEntry> {
        let l = verbs()?;
        if let Some(q) = l._ibv_query_gid_ex {
            let mut e = ibv::ibv_gid_entry::default();
            // SAFETY: a live context and a valid out-struct of the size passed.
            let r = unsafe {
                q(
                    self.as_raw(),
                    port as u32,
                    index,
                    &mut e,
                    0,
                    size_of::<ibv::ibv_gid_entry>(),
                )
            };
            rc("ibv_query_gid_ex", r)?;
            return Ok(GidEntry {
                index,
                port,
                // SAFETY: every bit pattern is a valid byte array.
                gid: Gid(unsafe { e.gid.raw }),
                gid_type: match e.gid_type {
                    ibv::IBV_GID_TYPE_IB => GidType::Ib,
                    ibv::IBV_GID_TYPE_ROCE_V1 => GidType::RoceV1,
                    ibv::IBV_GID_TYPE_ROCE_V2 => GidType::RoceV2,
                    _ => GidType::Unknown,
                },
                ndev_ifindex: e.ndev_ifindex,
            });
        }
        let gid = self.gid(port, index)?;
        if gid.is_zero() {
            return Err(Error::errno("ibv_query_gid", libc::ENODATA));
        }
        let path = format!(
            "/sys/class/infiniband/{}/ports/{port}/gid_attrs/types/{index}",
            self.name()
        );
        let gid_type = match std::fs::read_to_string(path).unwrap_or_default().trim() {
            "RoCE v2" => GidType::RoceV2,
            "IB/RoCE v1" => match self.query_port(port).map(|p| p.link_layer) {
                Ok(LinkLayer::Ethernet) => GidType::RoceV1,
                _ => GidType::Ib,
            },
            _ => GidType::Unknown,
        };
        Ok(GidEntry {
            index,
            port,
            gid,
            gid_type,
            ndev_ifindex: 0,
        })
    }

    /// Every populated GID of `port`, in index order (empty entries skipped).
    ///
    /// # Errors
    ///
    /// As [`Context::query_port`].
    #[doc(alias = "ibv_query_port")]
    #[doc(alias = "ibv_query_gid_ex")]
    pub fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        let p = self.query_port(port)?;
        Ok((0..p.gid_tbl_len)
            .filter_map(|i| self.gid_entry(port, i).ok())
            .filter(|e| !e.gid.is_zero())
            .collect())
    }

    /// The GID to use for RoCE: the first RoCE v2 entry with an IPv4-mapped address, else the
    /// first RoCE v2 entry, else index 0. On InfiniBand, index 0.
    ///
    /// # Errors
    ///
    /// As [`Context::gid_table`]; [`Error::NoDevice`] when the table is empty.
    pub fn preferred_gid(&self, port: u8) -> Result<GidEntry> {
        let t = self.gid_table(port)?;
        t.iter()
            .find(|e| e.gid_type == GidType::RoceV2 && e.gid.is_ipv4_mapped())
            .or_else(|| t.iter().find(|e| e.gid_type == GidType::RoceV2))
            .or_else(|| t.first())
            .copied()
            .ok_or_else(|| Error::NoDevice {
                what: "verbs device",
                reason: format!("{} port {port} has an empty GID table", self.name()),
            })
    }

    /// The fd `ibv_get_async_event` reads; poll it for readability to wait without blocking.
    pub fn async_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the context is live and owns the fd for as long as it lives.
        let fd: RawFd = unsafe { (*self.as_raw()).async_fd };
        // SAFETY: as above; the borrow is tied to `self`.
        unsafe { BorrowedFd::borrow_raw(fd) }
    }

    /// Make [`Context::get_async_event`] return `EAGAIN` instead of blocking (or block again).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `fcntl`.
    pub fn set_async_nonblocking(&self, nonblocking: bool) -> Result<()> {
        set_nonblocking(self.async_fd(), nonblocking)
    }

    /// `ibv_get_async_event` then `ibv_ack_async_event`—the next asynchronous event (port up or
    /// down, QP fatal, ...). Blocks unless [`Context::set_async_nonblocking`] was set.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `ibv_get_async_event` (`EAGAIN` when non-blocking and none is ready).
    #[doc(alias = "ibv_get_async_event")]
    #[doc(alias = "ibv_ack_async_event")]
    pub fn get_async_event(&self) -> Result<AsyncEvent> {
        let l = verbs()?;
        let mut ev = ibv::ibv_async_event::default();
        // SAFETY: a live context and a valid out-struct.
        rc("ibv_get_async_event", unsafe {
            (l.ibv_get_async_event)(self.as_raw(), &mut ev)
        })?;
        let kind = AsyncEventKind::from_raw(ev.event_type);
        // SAFETY: the union member read matches the event type, as the man page lists; the object
        // is alive until the ack below.
        let (port, qp_num) = unsafe {
            match kind.element() {
                Element::Port => (Some(ev.element.port_num as u8), None),
                Element::Qp if !ev.element.qp.is_null() => (None, Some((*ev.element.qp).qp_num)),
                _ => (None, None),
            }
        };
        // SAFETY: acknowledges the event just read, once.
        unsafe { (l.ibv_ack_async_event)(&mut ev) };
        Ok(AsyncEvent {
            kind,
            raw: ev.event_type,
            port,
            qp_num,
        })
    }
}

pub(crate) fn set_nonblocking(fd: BorrowedFd<'_>, nonblocking: bool) -> Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: fcntl on a live fd.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(Error::last_os("fcntl"));
    }
    let new = if nonblocking {
        flags | libc::O_NONBLOCK
    } else {
        flags & !libc::O_NONBLOCK
    };
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, new) } < 0 {
        return Err(Error::last_os("fcntl"));
    }
    Ok(())
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("name", &self.name())
            .finish()
    }
}

/// `struct ibv_device_attr`, the parts that matter here. Counts are per device.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceAttr {
    /// Firmware version string.
    pub fw_ver: String,
    /// Node GUID (host byte order).
    pub node_guid: u64,
    /// Largest memory region, in bytes.
    pub max_mr_size: u64,
    /// Supported page sizes (bit n set: 2^n bytes).
    pub page_size_cap: u64,
    /// Queue pairs.
    pub max_qp: u32,
    /// Work requests per queue.
    pub max_qp_wr: u32,
    /// Scatter-gather entries per work request.
    pub max_sge: u32,
    /// Completion queues.
    pub max_cq: u32,
    /// Entries per completion queue.
    pub max_cqe: u32,
    /// Memory regions.
    pub max_mr: u32,
    /// Protection domains.
    pub max_pd: u32,
    /// Outstanding RDMA reads and atomics a QP can be the target of.
    pub max_qp_rd_atom: u32,
    /// Outstanding RDMA reads and atomics a QP can initiate.
    pub max_qp_init_rd_atom: u32,
    /// Shared receive queues (0: not supported).
    pub max_srq: u32,
    /// Work requests per shared receive queue.
    pub max_srq_wr: u32,
    /// Scatter-gather entries per shared-receive-queue request.
    pub max_srq_sge: u32,
    /// `enum ibv_atomic_cap`: 0 none, 1 HCA-local, 2 global.
    pub atomic_cap: u32,
    /// Physical ports (numbered from 1).
    pub phys_port_cnt: u8,
    /// `enum ibv_device_cap_flags`, as reported (the memory window types:
    /// `DeviceAttr::memory_windows`).
    pub device_cap_flags: u32,
    /// Memory windows (0: none).
    pub max_mw: u32,
}

#[cfg(test)]
impl DeviceAttr {
    /// A device of one of everything and no capability flags, for unit tests that set the
    /// fields they test.
    pub(crate) fn minimal() -> DeviceAttr {
        DeviceAttr {
            fw_ver: String::new(),
            node_guid: 0,
            max_mr_size: 0,
            page_size_cap: 0,
            max_qp: 1,
            max_qp_wr: 1,
            max_sge: 1,
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
            device_cap_flags: 0,
            max_mw: 0,
        }
    }
}

/// `struct ibv_port_attr`, the parts that matter here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PortAttr {
    /// Logical state.
    pub state: PortState,
    /// Largest MTU the port supports.
    pub max_mtu: Mtu,
    /// MTU in use: the largest a QP on this port may use.
    pub active_mtu: Mtu,
    /// Entries in the GID table.
    pub gid_tbl_len: u32,
    /// Largest message, in bytes.
    pub max_msg_sz: u32,
    /// Local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// InfiniBand or Ethernet (RoCE).
    pub link_layer: LinkLayer,
    /// `active_width` code.
    pub active_width: u8,
    /// `active_speed` code.
    pub active_speed: u8,
}

/// `enum ibv_port_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum PortState {
    Nop,
    Down,
    Init,
    Armed,
    Active,
    ActiveDefer,
    /// A value this crate does not know.
    Other(u32),
}

impl PortState {
    fn from_raw(v: u32) -> Self {
        match v {
            ibv::IBV_PORT_NOP => PortState::Nop,
            ibv::IBV_PORT_DOWN => PortState::Down,
            ibv::IBV_PORT_INIT => PortState::Init,
            ibv::IBV_PORT_ARMED => PortState::Armed,
            ibv::IBV_PORT_ACTIVE => PortState::Active,
            ibv::IBV_PORT_ACTIVE_DEFER => PortState::ActiveDefer,
            o => PortState::Other(o),
        }
    }
}

/// `enum ibv_mtu`: a path MTU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes.
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes.
    Mtu4096 = 5,
}

impl Mtu {
    fn from_raw(v: u32) -> Self {
        match v {
            1 => Mtu::Mtu256,
            2 => Mtu::Mtu512,
            3 => Mtu::Mtu1024,
            4 => Mtu::Mtu2048,
            _ => Mtu::Mtu4096,
        }
    }

    /// In bytes.
    pub fn bytes(self) -> u32 {
        128 << (self as u32)
    }

    pub(crate) fn raw(self) -> u32 {
        self as u32
    }
}

/// A port's link layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// Not reported (treated as InfiniBand).
    Unspecified,
    /// InfiniBand.
    Infiniband,
    /// Ethernet: RoCE (including Soft-RoCE).
    Ethernet,
}

/// A 128-bit GID, in wire (network) byte order.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[doc(alias = "ibv_gid")]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// All zero: an empty table entry.
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// `::ffff:a.b.c.d`, a RoCE GID of an IPv4 address.
    pub fn is_ipv4_mapped(&self) -> bool {
        self.0[..10] == [0; 10] && self.0[10..12] == [0xff, 0xff]
    }

    /// As an IPv6 address (RoCE GIDs are the interface's addresses).
    pub fn to_ipv6(&self) -> std::net::Ipv6Addr {
        std::net::Ipv6Addr::from(self.0)
    }

    pub(crate) fn to_raw(self) -> ibv::ibv_gid {
        ibv::ibv_gid { raw: self.0 }
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The sysfs form: eight groups of four hex digits.
        for (i, c) in self.0.chunks(2).enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", c[0], c[1])?;
        }
        Ok(())
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// `enum ibv_gid_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidType {
    /// InfiniBand.
    Ib,
    /// RoCE v1 (Ethernet, not routable).
    RoceV1,
    /// RoCE v2 (UDP/IP, routable).
    RoceV2,
    /// Not reported.
    Unknown,
}

/// One GID table entry: `struct ibv_gid_entry`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[doc(alias = "ibv_gid_entry")]
pub struct GidEntry {
    /// Index in the port's table (the `sgid_index` of an address vector).
    pub index: u32,
    /// Port number.
    pub port: u8,
    /// The GID.
    pub gid: Gid,
    /// Its type.
    pub gid_type: GidType,
    /// The net device's ifindex (RoCE), 0 when unknown.
    pub ndev_ifindex: u32,
}

/// `enum ibv_event_type`: what an asynchronous event reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
#[non_exhaustive]
pub enum AsyncEventKind {
    CqErr,
    QpFatal,
    QpReqErr,
    QpAccessErr,
    CommEst,
    SqDrained,
    PathMig,
    PathMigErr,
    DeviceFatal,
    PortActive,
    PortErr,
    LidChange,
    PkeyChange,
    SmChange,
    SrqErr,
    SrqLimitReached,
    QpLastWqeReached,
    ClientReregister,
    GidChange,
    /// Another value; see [`AsyncEvent::raw`].
    Other,
}

enum Element {
    Port,
    Qp,
    Other,
}

impl AsyncEventKind {
    fn from_raw(v: u32) -> Self {
        use AsyncEventKind::*;
        match v {
            ibv::IBV_EVENT_CQ_ERR => CqErr,
            ibv::IBV_EVENT_QP_FATAL => QpFatal,
            ibv::IBV_EVENT_QP_REQ_ERR => QpReqErr,
            ibv::IBV_EVENT_QP_ACCESS_ERR => QpAccessErr,
            ibv::IBV_EVENT_COMM_EST => CommEst,
            ibv::IBV_EVENT_SQ_DRAINED => SqDrained,
            ibv::IBV_EVENT_PATH_MIG => PathMig,
            ibv::IBV_EVENT_PATH_MIG_ERR => PathMigErr,
            ibv::IBV_EVENT_DEVICE_FATAL => DeviceFatal,
            ibv::IBV_EVENT_PORT_ACTIVE => PortActive,
            ibv::IBV_EVENT_PORT_ERR => PortErr,
            ibv::IBV_EVENT_LID_CHANGE => LidChange,
            ibv::IBV_EVENT_PKEY_CHANGE => PkeyChange,
            ibv::IBV_EVENT_SM_CHANGE => SmChange,
            ibv::IBV_EVENT_SRQ_ERR => SrqErr,
            ibv::IBV_EVENT_SRQ_LIMIT_REACHED => SrqLimitReached,
            ibv::IBV_EVENT_QP_LAST_WQE_REACHED => QpLastWqeReached,
            ibv::IBV_EVENT_CLIENT_REREGISTER => ClientReregister,
            ibv::IBV_EVENT_GID_CHANGE => GidChange,
            _ => Other,
        }
    }

    fn element(self) -> Element {
        use AsyncEventKind::*;
        match self {
            PortActive | PortErr | LidChange | PkeyChange | SmChange | ClientReregister
            | GidChange => Element::Port,
            QpFatal | QpReqErr | QpAccessErr | CommEst | SqDrained | PathMig | PathMigErr
            | QpLastWqeReached => Element::Qp,
            _ => Element::Other,
        }
    }
}

/// An asynchronous event, already acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[doc(alias = "ibv_async_event")]
pub struct AsyncEvent {
    /// What happened.
    pub kind: AsyncEventKind,
    /// The raw `ibv_event_type`.
    pub raw: u32,
    /// The port, for port events.
    pub port: Option<u8>,
    /// The QP number, for QP events.
    pub qp_num: Option<u32>,
}

impl fmt::Display for AsyncEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = ibv::lib()
            .ok()
            // SAFETY: returns a static string for any value.
            .map(|l| unsafe { (l.ibv_event_type_str)(self.raw) })
            .filter(|p| !p.is_null())
            // SAFETY: non-NULL static NUL-terminated string.
            .map(|p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
            .unwrap_or_else(|| format!("{:?}", self.kind));
        write!(f, "{name}")?;
        if let Some(p) = self.port {
            write!(f, " (port {p})")?;
        }
        if let Some(q) = self.qp_num {
            write!(f, " (QP {q:#x})")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gid_forms() {
        let mut g = Gid::default();
        assert!(g.is_zero());
        g.0[10] = 0xff;
        g.0[11] = 0xff;
        g.0[12..].copy_from_slice(&[10, 0, 0, 1]);
        assert!(g.is_ipv4_mapped());
        assert_eq!(g.to_string(), "0000:0000:0000:0000:0000:ffff:0a00:0001");
        assert_eq!(
            g.to_ipv6().to_ipv4_mapped(),
            Some(std::net::Ipv4Addr::new(10, 0, 0, 1))
        );
    }

    #[test]
    fn mtu_bytes() {
        assert_eq!(Mtu::Mtu256.bytes(), 256);
        assert_eq!(Mtu::Mtu4096.bytes(), 4096);
        assert_eq!(Mtu::from_raw(3), Mtu::Mtu1024);
    }

    #[test]
    fn event_kinds_map() {
        assert_eq!(
            AsyncEventKind::from_raw(ibv::IBV_EVENT_QP_FATAL),
            AsyncEventKind::QpFatal
        );
        assert_eq!(
            AsyncEventKind::from_raw(ibv::IBV_EVENT_PORT_ERR),
            AsyncEventKind::PortErr
        );
        assert_eq!(AsyncEventKind::from_raw(9999), AsyncEventKind::Other);
    }
}
