//! Type 2 memory windows: a range of a region that peers reach through one queue pair only,
//! bound and invalidated by work requests on that queue pair ([`QueuePair::bind_window`],
//! [`QueuePair::invalidate_window`]), each state a type of its own.
//!
//! [`QueuePair::bind_window`]: super::QueuePair::bind_window
//! [`QueuePair::invalidate_window`]: super::QueuePair::invalidate_window

use super::context::DeviceAttr;
use super::ffi::{free_in_parent, nonnull, verbs};
use super::mr::{AccessFlags, MrSlice, RemoteMemory};
use super::pd::{PdInner, ProtectionDomain};
use super::posted::{PostedTables, Reported, StatusSlot};
use super::teardown::{COUNTERS, Counters};
use crate::error::{Error, Result, WcStatus};
use gpudirect_sys::ibverbs as ibv;
use std::fmt;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::Arc;

bitflags::bitflags! {
    /// The memory windows a device supports, from `ibv_device_attr.device_cap_flags`
    /// ([`DeviceAttr::memory_windows`]).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct MemoryWindowTypes: u32 {
        /// `IBV_DEVICE_MEM_WINDOW`: type 1 windows (bound by a verb, to a protection domain).
        const TYPE_1 = ibv::IBV_DEVICE_MEM_WINDOW;
        /// `IBV_DEVICE_MEM_WINDOW_TYPE_2A`: type 2 windows bound to a queue pair.
        const TYPE_2A = ibv::IBV_DEVICE_MEM_WINDOW_TYPE_2A;
        /// `IBV_DEVICE_MEM_WINDOW_TYPE_2B`: type 2 windows bound to a queue pair and its
        /// protection domain.
        const TYPE_2B = ibv::IBV_DEVICE_MEM_WINDOW_TYPE_2B;
    }
}

impl MemoryWindowTypes {
    /// Whether type 2 windows (2A or 2B), the kind [`ProtectionDomain::alloc_mw`] makes, are
    /// supported.
    pub fn type_2(self) -> bool {
        self.intersects(Self::TYPE_2A | Self::TYPE_2B)
    }
}

impl DeviceAttr {
    /// The memory window types the device reports (`device_cap_flags`); none when it allows no
    /// window at all (`max_mw` 0).
    #[doc(alias = "IBV_DEVICE_MEM_WINDOW_TYPE_2B")]
    pub fn memory_windows(&self) -> MemoryWindowTypes {
        if self.max_mw == 0 {
            return MemoryWindowTypes::empty();
        }
        MemoryWindowTypes::from_bits_truncate(self.device_cap_flags)
    }
}

/// The access a window may give: remote read, write and atomics.
const WINDOW_ACCESS: AccessFlags = AccessFlags::REMOTE_READ
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_ATOMIC);

/// A queue pair a window is bound (or being bound, or invalidated) through, counted in its
/// tables while linked: a queue pair is not destroyed under a window (see the queue pair's drop).
struct QpLink {
    tables: Arc<PostedTables>,
    qp_num: u32,
}

impl QpLink {
    fn new(tables: &Arc<PostedTables>, qp_num: u32) -> Self {
        tables.window_linked();
        QpLink {
            tables: tables.clone(),
            qp_num,
        }
    }
}

impl Drop for QpLink {
    fn drop(&mut self) {
        self.tables.window_unlinked();
    }
}

/// What a window is bound to: the range it holds and the queue pair it is bound through.
struct Binding {
    /// Held, never read: keeps the region registered and its memory alive while peers may
    /// reach it through the window.
    #[allow(dead_code)]
    range: MrSlice,
    qp: QpLink,
}

struct MwInner {
    mw: NonNull<ibv::ibv_mw>,
    /// Held, never read: a window never outlives its protection domain.
    #[allow(dead_code)]
    pd: Arc<PdInner>,
    /// While the window may be bound: dropped only once it is known unbound (its invalidation
    /// or failed bind completed, or `ibv_dealloc_mw` succeeded), leaked otherwise.
    binding: ManuallyDrop<Option<Binding>>,
}

// SAFETY: verbs objects are thread-safe; the window's `rkey` field is written only by its owner
// (`&mut` or by value), and the binding is only dropped.
unsafe impl Send for MwInner {}
// SAFETY: shared access reads only the window pointer and the rkey field, never written then.
unsafe impl Sync for MwInner {}

impl Drop for MwInner {
    fn drop(&mut self) {
        // ibv_dealloc_mw unbinds the window: only after it succeeded is the range let go. If it
        // fails, or in a forked child, the window and its range are leaked.
        free_in_parent(ibv::lib, |_| {
            // SAFETY: allocated by ibv_alloc_mw, deallocated once, here.
            if unsafe { ibv::ibv_dealloc_mw(self.mw.as_ptr()) } == 0 {
                // SAFETY: taken once, here, after the window lost its binding.
                drop(unsafe { ManuallyDrop::take(&mut self.binding) });
                Counters::count(&COUNTERS.mw_deallocated);
            } else {
                Counters::count(&COUNTERS.mw_leaked);
            }
        });
    }
}

impl MwInner {
    fn rkey(&self) -> u32 {
        // SAFETY: a live window; its rkey is written only by its owner.
        unsafe { (*self.mw.as_ptr()).rkey }
    }

    fn set_rkey(&mut self, rkey: u32) {
        // SAFETY: a live window, owned here; providers read the field when a bind is posted.
        unsafe { (*self.mw.as_ptr()).rkey = rkey };
    }

    /// The window is known unbound: let its range and queue pair go.
    fn unbind(&mut self) {
        drop(self.binding.take());
    }

    fn qp_num(&self) -> Option<u32> {
        self.binding.as_ref().map(|b| b.qp.qp_num)
    }
}

impl ProtectionDomain {
    /// `ibv_alloc_mw(pd, IBV_MW_TYPE_2)`—an unbound type 2 memory window. Bind it to a range of
    /// a region of this PD with [`QueuePair::bind_window`](super::QueuePair::bind_window).
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`](crate::Error::Unsupported) (a missing capability,
    /// [`Absence::Capability`](crate::Absence::Capability)) when the device reports no type 2
    /// windows ([`DeviceAttr::memory_windows`]) or the provider has none (`EOPNOTSUPP`);
    /// [`Error::Os`](crate::Error::Os) naming `ibv_query_device` or `ibv_alloc_mw`.
    #[doc(alias = "ibv_alloc_mw")]
    #[doc(alias = "IBV_MW_TYPE_2")]
    pub fn alloc_mw(&self) -> Result<MemoryWindow> {
        verbs()?;
        let ctx = self.context();
        if let Some(e) = no_type_2(ctx.name(), &ctx.query_device()?) {
            return Err(e);
        }
        // SAFETY: a live PD.
        let p = unsafe { ibv::ibv_alloc_mw(self.as_raw(), ibv::IBV_MW_TYPE_2) };
        let mw = nonnull("ibv_alloc_mw", p).map_err(|e| alloc_error(e, ctx.name()))?;
        Ok(MemoryWindow {
            inner: Box::new(MwInner {
                mw,
                pd: self.inner.clone(),
                binding: ManuallyDrop::new(None),
            }),
        })
    }
}

/// The refusal of `device`, whose attributes `attr` report no type 2 windows.
fn no_type_2(device: &str, attr: &DeviceAttr) -> Option<Error> {
    let types = attr.memory_windows();
    (!types.type_2()).then(|| Error::Unsupported {
        what: "type 2 memory windows".into(),
        reason: format!(
            "device {device} reports {types:?} (device_cap_flags {:#x}, max_mw {})",
            attr.device_cap_flags, attr.max_mw
        ),
    })
}

/// An `ibv_alloc_mw` failure as the typed error: `EOPNOTSUPP` (the provider has no windows) and
/// `ENOSYS` become [`Error::Unsupported`]; anything else stays [`Error::Os`].
fn alloc_error(e: Error, device: &str) -> Error {
    match e {
        Error::Os { source, .. }
            if matches!(source.raw_os_error(), Some(libc::EOPNOTSUPP | libc::ENOSYS)) =>
        {
            Error::Unsupported {
                what: "type 2 memory windows".into(),
                reason: format!("device {device} answered {source}"),
            }
        }
        e => e,
    }
}

/// `ibv_alloc_mw` (type 2)—a memory window, not bound: it gives no access. Bind it with
/// [`QueuePair::bind_window`](super::QueuePair::bind_window) ([`PendingBind`], then
/// [`BoundWindow`]); an invalidated window comes back as a `MemoryWindow` and can be bound again,
/// with a new rkey.
///
/// Dropping it deallocates it (`ibv_dealloc_mw`); if that fails, it is leaked. A window keeps
/// its protection domain alive.
#[doc(alias = "ibv_mw")]
#[doc(alias = "ibv_dealloc_mw")]
pub struct MemoryWindow {
    inner: Box<MwInner>,
}

impl MemoryWindow {
    /// The raw `ibv_mw`, valid while `self` is.
    pub fn as_raw(&self) -> *mut ibv::ibv_mw {
        self.inner.mw.as_ptr()
    }

    /// The protection domain's `ibv_pd`.
    pub(crate) fn pd_ptr(&self) -> *mut ibv::ibv_pd {
        self.inner.pd.pd.as_ptr()
    }

    /// The rkey the next bind gives the window: its tag byte stepped (`ibv_inc_rkey`).
    pub(crate) fn next_rkey(&self) -> u32 {
        ibv::ibv_inc_rkey(self.inner.rkey())
    }

    /// The bind posted as `wr` through the queue pair of `tables`: the window takes `rkey` (as
    /// providers expect once a bind is posted) and holds the range until it is known unbound.
    pub(crate) fn into_pending(
        mut self,
        bind: WindowBind,
        rkey: u32,
        status: StatusSlot,
        tables: &Arc<PostedTables>,
        qp_num: u32,
    ) -> PendingBind {
        let old_rkey = self.inner.rkey();
        self.inner.set_rkey(rkey);
        let access = bind.access;
        *self.inner.binding = Some(Binding {
            range: bind.range,
            qp: QpLink::new(tables, qp_num),
        });
        PendingBind {
            inner: self.inner,
            status,
            rkey,
            old_rkey,
            access,
        }
    }
}

impl fmt::Debug for MemoryWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryWindow")
            .field("mw", &self.inner.mw)
            .finish()
    }
}

/// What [`QueuePair::bind_window`](super::QueuePair::bind_window) gives peers: `range` of a
/// region (registered with [`AccessFlags::MW_BIND`]) with `access`, any of
/// [`AccessFlags::REMOTE_READ`], [`REMOTE_WRITE`](AccessFlags::REMOTE_WRITE) and
/// [`REMOTE_ATOMIC`](AccessFlags::REMOTE_ATOMIC) (write and atomics need a region with
/// [`AccessFlags::LOCAL_WRITE`]). Peers address the window with the region's addresses.
#[derive(Debug, Clone)]
#[must_use = "a bind does nothing until posted"]
#[doc(alias = "ibv_mw_bind_info")]
pub struct WindowBind {
    range: MrSlice,
    access: AccessFlags,
    tag: u64,
}

impl WindowBind {
    /// `range` with `access`.
    pub fn new(range: MrSlice, access: AccessFlags) -> Self {
        WindowBind {
            range,
            access,
            tag: 0,
        }
    }

    /// A value reported back by [`WorkCompletion::tag`](super::WorkCompletion::tag) for the
    /// bind's completion.
    pub fn tag(mut self, tag: u64) -> Self {
        self.tag = tag;
        self
    }

    pub(crate) fn range(&self) -> &MrSlice {
        &self.range
    }

    pub(crate) fn tag_value(&self) -> u64 {
        self.tag
    }
}

/// The rules of a type 2 bind the library checks before posting: the window, the queue pair
/// (`qp_pd`) and the region in one protection domain; a region with `MW_BIND`; remote access only,
/// write and atomics over a region with local write.
pub(crate) fn check_bind(
    window_pd: *mut ibv::ibv_pd,
    qp_pd: *mut ibv::ibv_pd,
    bind: &WindowBind,
) -> Result<()> {
    if window_pd != qp_pd {
        return Err(Error::invalid(
            "window",
            format!("{window_pd:p}"),
            "the window belongs to another protection domain than the QP",
        ));
    }
    let r = &bind.range;
    if r.pd_ptr() != window_pd {
        return Err(Error::invalid(
            "range",
            format!("{r:?}"),
            "the region belongs to another protection domain than the window",
        ));
    }
    let region = r.access();
    if !region.contains(AccessFlags::MW_BIND) {
        return Err(Error::invalid(
            "range",
            format!("{r:?} with {region:?}"),
            "windows bind only to regions registered with AccessFlags::MW_BIND",
        ));
    }
    if !WINDOW_ACCESS.contains(bind.access) {
        return Err(Error::invalid(
            "access",
            format!("{:?}", bind.access),
            "a window gives remote read, write or atomic access only",
        ));
    }
    if bind.access.remote_writable() && !region.contains(AccessFlags::LOCAL_WRITE) {
        return Err(Error::invalid(
            "access",
            format!("{:?} over {region:?}", bind.access),
            "remote write or atomics through a window need a region with LOCAL_WRITE",
        ));
    }
    Ok(())
}

/// The `IBV_WR_BIND_MW` request binding `mw` with `bind`, giving it `rkey` (all but `wr_id`,
/// which the send table sets, and the signaled flag, which it adds).
pub(crate) fn bind_wr(mw: *mut ibv::ibv_mw, rkey: u32, bind: &WindowBind) -> ibv::ibv_send_wr {
    let mut wr = ibv::ibv_send_wr {
        opcode: ibv::IBV_WR_BIND_MW,
        ..Default::default()
    };
    wr.__bindgen_anon_2.bind_mw = ibv::ibv_send_wr__bindgen_ty_4__bindgen_ty_1 {
        mw,
        rkey,
        bind_info: ibv::ibv_mw_bind_info {
            mr: bind.range.mr.as_raw(),
            addr: bind.range.addr(),
            length: bind.range.len() as u64,
            mw_access_flags: bind.access.bits(),
        },
    };
    wr
}

/// The `IBV_WR_LOCAL_INV` request invalidating `rkey`.
pub(crate) fn invalidate_wr(rkey: u32) -> ibv::ibv_send_wr {
    let mut wr = ibv::ibv_send_wr {
        opcode: ibv::IBV_WR_LOCAL_INV,
        ..Default::default()
    };
    wr.__bindgen_anon_1.invalidate_rkey = rkey;
    wr
}

/// The error a failed completion stands for.
fn wc_error(r: &Reported) -> Error {
    Error::WorkCompletion {
        status: WcStatus::from_raw(r.status),
        vendor_err: r.vendor_err,
        qp_num: r.qp_num,
    }
}

/// A bind posted, its completion not yet seen: its rkey is not reachable, since a peer using it
/// before the bind completed may be refused. Poll the completion queue the bind's completion
/// goes to (the queue pair's send CQ), then [`finish`](Self::finish).
///
/// Dropping it deallocates the window (which unbinds it), then lets its range go.
#[must_use = "the window is bound only once the bind's completion was polled and `finish` says so"]
pub struct PendingBind {
    inner: Box<MwInner>,
    status: StatusSlot,
    rkey: u32,
    old_rkey: u32,
    access: AccessFlags,
}

impl PendingBind {
    /// Whether the bind's completion was polled.
    pub fn is_complete(&self) -> bool {
        self.status.get().is_some()
    }

    /// The bound window once the bind's completion was polled and it succeeded; the window
    /// back, not bound, with the completion's error when it failed (or was flushed); `self`
    /// while its completion has not been polled.
    pub fn finish(mut self) -> BindOutcome {
        match self.status.get() {
            None => BindOutcome::Pending(self),
            // A failure is known only from the bind's own completion; a later completion that
            // covered it (never for a signaled request on RC) leaves it taken as bound.
            Some(r) if r.own && !r.is_ok() => {
                // The bind did not happen: the provider's rkey goes back, as verbs ask.
                self.inner.set_rkey(self.old_rkey);
                self.inner.unbind();
                BindOutcome::Failed {
                    error: wc_error(&r),
                    window: MemoryWindow { inner: self.inner },
                }
            }
            Some(_) => BindOutcome::Bound(BoundWindow {
                inner: self.inner,
                rkey: self.rkey,
                access: self.access,
            }),
        }
    }
}

impl fmt::Debug for PendingBind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PendingBind")
            .field("qp_num", &self.inner.qp_num())
            .field("complete", &self.is_complete())
            .finish()
    }
}

/// What [`PendingBind::finish`] found.
#[derive(Debug)]
#[must_use]
pub enum BindOutcome {
    /// The bind completed: the window is bound, its rkey may be handed out.
    Bound(BoundWindow),
    /// The bind's completion has not been polled yet.
    Pending(PendingBind),
    /// The bind completed with an error, or was flushed: the window is not bound.
    Failed {
        /// [`Error::WorkCompletion`](crate::Error::WorkCompletion) with the completion's status.
        error: Error,
        /// The window, unbound.
        window: MemoryWindow,
    },
}

/// A window bound to a range of a region through one queue pair: peers connected to that queue
/// pair reach the range with [`rkey`](Self::rkey) (and [`remote`](Self::remote)); no other queue
/// pair does, nor anyone once it is invalidated
/// ([`QueuePair::invalidate_window`](super::QueuePair::invalidate_window)) or deallocated.
///
/// It holds the range, so the region stays registered and its memory alive while the window may
/// give access. Dropping it deallocates the window (which unbinds it) and only then lets the
/// range go; if deallocation fails, both are leaked.
#[doc(alias = "IBV_WR_BIND_MW")]
pub struct BoundWindow {
    inner: Box<MwInner>,
    rkey: u32,
    access: AccessFlags,
}

impl BoundWindow {
    /// The rkey peers use: the window's, as the bind set it.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// The access the window gives.
    pub fn access(&self) -> AccessFlags {
        self.access
    }

    /// The descriptor a peer needs: the range's address and length, the window's rkey.
    pub fn remote(&self) -> RemoteMemory {
        let (addr, len) = self
            .inner
            .binding
            .as_ref()
            .map_or((0, 0), |b| (b.range.addr(), b.range.len() as u64));
        RemoteMemory {
            addr,
            rkey: self.rkey,
            len,
        }
    }

    /// The number of the queue pair the window is bound through.
    pub fn qp_num(&self) -> u32 {
        self.inner.qp_num().unwrap_or_default()
    }

    /// Whether the window is bound through the queue pair of `tables`.
    pub(crate) fn bound_through(&self, tables: &Arc<PostedTables>) -> bool {
        self.inner
            .binding
            .as_ref()
            .is_some_and(|b| Arc::ptr_eq(&b.qp.tables, tables))
    }

    /// The range the window holds (for the invalidation request to hold as well).
    pub(crate) fn range(&self) -> Option<&MrSlice> {
        self.inner.binding.as_ref().map(|b| &b.range)
    }

    /// The invalidation of the window posted; its completion goes to `status`.
    pub(crate) fn into_pending(self, status: StatusSlot) -> PendingInvalidate {
        PendingInvalidate {
            inner: self.inner,
            status,
            rkey: self.rkey,
            access: self.access,
        }
    }
}

impl fmt::Debug for BoundWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BoundWindow")
            .field("remote", &self.remote())
            .field("access", &self.access)
            .field("qp_num", &self.qp_num())
            .finish()
    }
}

/// An invalidation posted (`IBV_WR_LOCAL_INV`), its completion not yet seen: the window may still
/// give access, so it keeps holding its range. Poll the send CQ, then [`finish`](Self::finish).
///
/// Dropping it deallocates the window (which unbinds it), then lets its range go.
#[must_use = "the window is unbound only once the invalidation's completion was polled"]
pub struct PendingInvalidate {
    inner: Box<MwInner>,
    status: StatusSlot,
    rkey: u32,
    access: AccessFlags,
}

impl PendingInvalidate {
    /// Whether the invalidation's completion was polled.
    pub fn is_complete(&self) -> bool {
        self.status.get().is_some()
    }

    /// The window, unbound (its range let go), once the invalidation completed; the window
    /// still bound, with the completion's error, when it failed (or was flushed); `self` while
    /// its completion has not been polled.
    pub fn finish(mut self) -> InvalidateOutcome {
        match self.status.get() {
            None => InvalidateOutcome::Pending(self),
            Some(r) if r.is_ok() => {
                self.inner.unbind();
                InvalidateOutcome::Unbound(MemoryWindow { inner: self.inner })
            }
            Some(r) => InvalidateOutcome::Failed {
                error: wc_error(&r),
                window: BoundWindow {
                    inner: self.inner,
                    rkey: self.rkey,
                    access: self.access,
                },
            },
        }
    }
}

impl fmt::Debug for PendingInvalidate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PendingInvalidate")
            .field("qp_num", &self.inner.qp_num())
            .field("complete", &self.is_complete())
            .finish()
    }
}

/// What [`PendingInvalidate::finish`] found.
#[derive(Debug)]
#[must_use]
pub enum InvalidateOutcome {
    /// The invalidation completed: the rkey is dead, the range let go.
    Unbound(MemoryWindow),
    /// The invalidation's completion has not been polled yet.
    Pending(PendingInvalidate),
    /// The invalidation completed with an error, or was flushed: the window may still be bound
    /// (drop it to deallocate it).
    Failed {
        /// [`Error::WorkCompletion`](crate::Error::WorkCompletion) with the completion's status.
        error: Error,
        /// The window, still holding its range.
        window: BoundWindow,
    },
}

/// A window a queue pair did not post a bind or invalidation for, handed back with why: nothing
/// was posted. Converts into its [`Error`] (dropping the window) for `?`.
#[derive(Debug)]
pub struct WindowRefused<W> {
    /// Why.
    pub error: Error,
    /// The window, as it was.
    pub window: W,
}

impl<W> From<WindowRefused<W>> for Error {
    fn from(r: WindowRefused<W>) -> Error {
        r.error
    }
}

impl<W> fmt::Display for WindowRefused<W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "memory window refused: {}", self.error)
    }
}

impl<W: fmt::Debug> std::error::Error for WindowRefused<W> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::mr::fake_region;

    /// A device without type 2 windows, or a provider without them, is a missing capability.
    #[test]
    fn missing_windows_are_a_typed_capability_refusal() {
        let mut a = attr(ibv::IBV_DEVICE_MEM_WINDOW, 16);
        let e = no_type_2("rxe0", &a).expect("type 1 only: refused");
        assert_eq!(e.absence(), Some(crate::Absence::Capability));
        assert!(e.to_string().contains("TYPE_1"), "{e}");
        a.device_cap_flags |= ibv::IBV_DEVICE_MEM_WINDOW_TYPE_2B;
        assert!(no_type_2("rxe0", &a).is_none());
        a.max_mw = 0;
        assert!(no_type_2("rxe0", &a).is_some(), "no window at all");
        let e = alloc_error(Error::errno("ibv_alloc_mw", libc::EOPNOTSUPP), "mlx5_0");
        assert_eq!(e.absence(), Some(crate::Absence::Capability));
        let e = alloc_error(Error::errno("ibv_alloc_mw", libc::ENOMEM), "mlx5_0");
        assert!(
            matches!(
                e,
                Error::Os {
                    call: "ibv_alloc_mw",
                    ..
                }
            ),
            "{e}"
        );
    }

    fn attr(device_cap_flags: u32, max_mw: u32) -> DeviceAttr {
        DeviceAttr {
            device_cap_flags,
            max_mw,
            ..DeviceAttr::minimal()
        }
    }

    #[test]
    fn window_types_come_from_the_cap_flags() {
        let flags = ibv::IBV_DEVICE_MEM_WINDOW
            | ibv::IBV_DEVICE_MEM_WINDOW_TYPE_2B
            | ibv::IBV_DEVICE_RC_RNR_NAK_GEN;
        let mut a = attr(flags, 0);
        assert_eq!(a.memory_windows(), MemoryWindowTypes::empty(), "max_mw 0");
        a.max_mw = 1 << 16;
        let t = a.memory_windows();
        assert_eq!(t, MemoryWindowTypes::TYPE_1 | MemoryWindowTypes::TYPE_2B);
        assert!(t.type_2());
        a.device_cap_flags = ibv::IBV_DEVICE_MEM_WINDOW;
        assert!(!a.memory_windows().type_2(), "type 1 only");
        a.device_cap_flags = ibv::IBV_DEVICE_MEM_WINDOW_TYPE_2A;
        assert!(a.memory_windows().type_2());
    }

    /// Every rule, broken one at a time: refused with the argument named, before any post.
    #[test]
    fn binds_are_checked_before_posting() {
        let all = AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND;
        let mr = fake_region(0x10_000, 4096, all);
        let pd = mr.pd.pd.as_ptr();
        let other = 0x1000 as *mut ibv::ibv_pd;
        let rw = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
        let bind = |mr, access| WindowBind::new(MrSlice::of(mr, 64..128).unwrap(), access);
        let arg = |r: Result<()>| match r {
            Ok(()) => "",
            Err(Error::InvalidArgument { arg, .. }) => arg,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(arg(check_bind(pd, pd, &bind(&mr, rw))), "");
        let atomic = AccessFlags::REMOTE_ATOMIC;
        assert_eq!(arg(check_bind(pd, pd, &bind(&mr, atomic))), "");
        assert_eq!(arg(check_bind(other, pd, &bind(&mr, rw))), "window");
        assert_eq!(arg(check_bind(other, other, &bind(&mr, rw))), "range");
        let no_bind = fake_region(0x10_000, 4096, AccessFlags::LOCAL_WRITE);
        assert_eq!(arg(check_bind(pd, pd, &bind(&no_bind, rw))), "range");
        let local = AccessFlags::LOCAL_WRITE;
        assert_eq!(arg(check_bind(pd, pd, &bind(&mr, local))), "access");
        assert_eq!(
            arg(check_bind(pd, pd, &bind(&mr, AccessFlags::MW_BIND))),
            "access"
        );
        let read_only = fake_region(0x10_000, 4096, AccessFlags::MW_BIND);
        let read = AccessFlags::REMOTE_READ;
        assert_eq!(arg(check_bind(pd, pd, &bind(&read_only, read))), "");
        assert_eq!(arg(check_bind(pd, pd, &bind(&read_only, rw))), "access");
        assert_eq!(arg(check_bind(pd, pd, &bind(&read_only, atomic))), "access");
    }

    #[test]
    fn bind_and_invalidate_requests_carry_the_window() {
        let mr = fake_region(0x10_000, 4096, AccessFlags::MW_BIND);
        let b = WindowBind::new(
            MrSlice::of(&mr, 256..1280).unwrap(),
            AccessFlags::REMOTE_READ,
        );
        let mw = 0x4000 as *mut ibv::ibv_mw;
        let wr = bind_wr(mw, 0x0004_0102, &b);
        assert_eq!((wr.opcode, wr.num_sge), (ibv::IBV_WR_BIND_MW, 0));
        // SAFETY: the union member just written.
        let m = unsafe { wr.__bindgen_anon_2.bind_mw };
        assert_eq!((m.mw, m.rkey), (mw, 0x0004_0102));
        let i = m.bind_info;
        assert_eq!(
            (i.mr, i.addr, i.length, i.mw_access_flags),
            (mr.as_raw(), 0x10_100, 1024, ibv::IBV_ACCESS_REMOTE_READ)
        );
        let wr = invalidate_wr(0x0004_0102);
        assert_eq!(wr.opcode, ibv::IBV_WR_LOCAL_INV);
        // SAFETY: the union member just written.
        assert_eq!(unsafe { wr.__bindgen_anon_1.invalidate_rkey }, 0x0004_0102);
    }

    #[test]
    fn a_refused_window_converts_into_its_error() {
        let r = WindowRefused {
            error: Error::invalid("window", "w", "a rule"),
            window: (),
        };
        assert!(r.to_string().contains("a rule"));
        assert!(std::error::Error::source(&r).is_some());
        let e: Error = r.into();
        assert!(matches!(e, Error::InvalidArgument { arg: "window", .. }));
    }
}
