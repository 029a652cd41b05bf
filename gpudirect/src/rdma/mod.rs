//! RDMA verbs on host memory: devices, contexts, protection domains, memory regions, completion
//! queues and channels, shared receive queues, reliable-connected queue pairs, work requests, and
//! [`cm`] connections through rdma_cm; and GPUDirect RDMA regions over GPU memory ([`gpu_mr`]:
//! dma-buf or nvidia-peermem, [`ProtectionDomain::register_gpu`]).
//!
//! libibverbs and librdmacm are opened at run time: without them every entry point answers
//! [`Error::Load`]; without a device, [`Error::NoDevice`].
//!
//! # Ownership of posted memory
//!
//! Work requests take [`MrSlice`]s by value: a slice keeps its [`MemoryRegion`] (registration and
//! memory) alive. A posted request's slices are kept by its queue pair, keyed by a `wr_id` the
//! library chooses, until its completion is polled (or flushed); only then are they released. A
//! dropped queue pair is moved to the error state, given one signaled request whose flushed
//! completion proves that everything posted before it is finished (unsignaled requests included),
//! and drained for a bounded time ([`qp::DRAIN_TIMEOUT`]); if the completions do not all arrive,
//! the QP and everything it holds are leaked, never freed early ([`teardown_stats`] counts both
//! outcomes). Memory a NIC may write (remote-writable regions, receive and RDMA-read targets) is
//! never handed out as a Rust reference while it can be written: see [`MemoryRegion`].
//!
//! # Capacity
//!
//! A completion queue never receives more completions than it holds: every request posted to a
//! queue pair counts against the CQ its completion goes to (signaled or not: in the error state
//! every outstanding request completes) until its completion, or a later one that covers it, is
//! polled. A chain that does not fit is refused whole with [`Error::QueueFull`] naming the
//! completion queue. Each queue pair keeps one entry of its send CQ for its teardown, and a CQ
//! serving queue pairs of a [`SharedReceiveQueue`] keeps room for that queue's whole depth.
//!
//! ```no_run
//! use gpudirect::rdma::{AccessFlags, Context, HostBuffer};
//! # fn main() -> gpudirect::Result<()> {
//! let ctx = Context::open_by_name(None)?; // the first verbs device, or Error::NoDevice
//! let pd = ctx.alloc_pd()?;
//! let mr = pd.register(HostBuffer::zeroed(4096)?, AccessFlags::LOCAL_WRITE)?;
//! println!("lkey {:#x}", mr.lkey());
//! # Ok(()) }
//! ```

use crate::error::{Error, Result};
use gpudirect_sys::ibverbs as ibv;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

pub mod cm;
mod context;
mod cq;
mod device;
pub mod gpu_mr;
mod mr;
mod pd;
pub mod qp;
mod srq;
mod wr;

pub use context::{
    AsyncEvent, AsyncEventKind, Context, DeviceAttr, Gid, GidEntry, GidType, LinkLayer, Mtu,
    PortAttr, PortState,
};
pub use cq::{
    CompletionChannel, CompletionQueue, Completions, CqEvent, POLL_BATCH, WcOpcode, WcStatus,
    WorkCompletion,
};
pub use device::{Device, DeviceList};
pub use gpu_mr::{
    FlushOutcome, FlushScope, GpuMemoryRegion, GpuMrAttempts, GpuMrPath, GpuMrSource,
    GpuRegistration, Refusal, flush_gpudirect_rdma_writes,
};
pub use mr::{
    AccessFlags, DmabufRegion, HostBuffer, HostMemory, Local, MemoryRegion, MrMode, MrSlice,
    Remote, RemoteMemory, RemoteSlice,
};
pub use pd::ProtectionDomain;
pub use qp::{
    Endpoint, ErrorState, Init, QpCaps, QpState, QpStateKind, QueuePair, Reset, Rtr, RtrAttr, Rts,
    RtsAttr,
};
pub use srq::SharedReceiveQueue;
pub use wr::{RecvRequest, WorkRequest};

/// How this process's verbs objects were torn down: destroyed, or leaked because the library could
/// not prove the NIC was done with them (a queue pair whose flushed completions did not arrive in
/// time, a failing destroy or deregistration). Counts since the process started; leaking is the
/// safe failure, and a growing leak count is worth a look.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TeardownStats {
    /// Queue pairs destroyed (`ibv_destroy_qp` succeeded after the drain).
    pub queue_pairs_destroyed: u64,
    /// Queue pairs leaked with everything their requests hold.
    pub queue_pairs_leaked: u64,
    /// Completion queues destroyed.
    pub completion_queues_destroyed: u64,
    /// Completion queues whose `ibv_destroy_cq` failed (left allocated).
    pub completion_queues_leaked: u64,
    /// Memory regions deregistered and their memory freed (host, GPU and dma-buf regions).
    pub regions_deregistered: u64,
    /// Memory regions whose `ibv_dereg_mr` failed: registration and memory leaked.
    pub regions_leaked: u64,
}

pub(crate) struct Counters {
    pub(crate) qp_destroyed: AtomicU64,
    pub(crate) qp_leaked: AtomicU64,
    pub(crate) cq_destroyed: AtomicU64,
    pub(crate) cq_leaked: AtomicU64,
    pub(crate) mr_deregistered: AtomicU64,
    pub(crate) mr_leaked: AtomicU64,
}

pub(crate) static COUNTERS: Counters = Counters {
    qp_destroyed: AtomicU64::new(0),
    qp_leaked: AtomicU64::new(0),
    cq_destroyed: AtomicU64::new(0),
    cq_leaked: AtomicU64::new(0),
    mr_deregistered: AtomicU64::new(0),
    mr_leaked: AtomicU64::new(0),
};

impl Counters {
    pub(crate) fn count(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// The teardown counts of this process so far.
pub fn teardown_stats() -> TeardownStats {
    let c = &COUNTERS;
    let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
    TeardownStats {
        queue_pairs_destroyed: g(&c.qp_destroyed),
        queue_pairs_leaked: g(&c.qp_leaked),
        completion_queues_destroyed: g(&c.cq_destroyed),
        completion_queues_leaked: g(&c.cq_leaked),
        regions_deregistered: g(&c.mr_deregistered),
        regions_leaked: g(&c.mr_leaked),
    }
}

/// libibverbs, loaded, with fork support checked ([`fork_status`]).
pub(crate) fn verbs() -> Result<&'static ibv::Lib> {
    let l = ibv::lib()?;
    fork_status()?;
    Ok(l)
}

/// Process that first loaded verbs: FFI frees are skipped in a forked child (docs/soundness.md).
fn creator_pid() -> u32 {
    static PID: OnceLock<u32> = OnceLock::new();
    *PID.get_or_init(std::process::id)
}

/// Whether this is a child forked after verbs were first used: destructors then leak instead of
/// calling into libibverbs.
pub(crate) fn in_forked_child() -> bool {
    std::process::id() != creator_pid()
}

/// Fork support, as `ibv_is_fork_initialized` reports it after this library made sure of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForkStatus {
    /// `ibv_fork_init` has run (by us or by the application, or `RDMAV_FORK_SAFE` was set).
    Enabled,
    /// The kernel keeps registered pages across `fork` by itself (Linux 5.13+); nothing to do.
    Unneeded,
    /// The library is too old to say (no `ibv_is_fork_initialized`); `ibv_fork_init` was called.
    Assumed,
}

/// `ibv_is_fork_initialized`, then `ibv_fork_init` when it answers "disabled". Runs once, before
/// the first registration; every verbs entry point calls it.
///
/// # Errors
///
/// [`Error::Os`] naming `ibv_fork_init` when it fails (typically `EINVAL`: memory was already
/// registered by other code in this process before fork support could be enabled).
#[doc(alias = "ibv_fork_init")]
#[doc(alias = "ibv_is_fork_initialized")]
pub fn fork_status() -> Result<ForkStatus> {
    static STATUS: OnceLock<std::result::Result<ForkStatus, i32>> = OnceLock::new();
    let l = ibv::lib()?;
    creator_pid();
    let r = STATUS.get_or_init(|| {
        if let Some(is_init) = l.ibv_is_fork_initialized {
            // SAFETY: no arguments; reads library state.
            match unsafe { is_init() } {
                ibv::IBV_FORK_ENABLED => return Ok(ForkStatus::Enabled),
                ibv::IBV_FORK_UNNEEDED => return Ok(ForkStatus::Unneeded),
                _ => {}
            }
        }
        // SAFETY: no arguments; called before any registration made by this library.
        match unsafe { (l.ibv_fork_init)() } {
            0 if l.ibv_is_fork_initialized.is_some() => Ok(ForkStatus::Enabled),
            0 => Ok(ForkStatus::Assumed),
            e => Err(e),
        }
    });
    r.map_err(|e| Error::errno("ibv_fork_init", e))
}

/// An `Err` from a verbs return code: positive values are errnos (the modern convention), negative
/// ones mean "see errno".
pub(crate) fn rc(call: &'static str, rc: i32) -> Result<()> {
    match rc {
        0 => Ok(()),
        e if e > 0 => Err(Error::errno(call, e)),
        _ => {
            let os = std::io::Error::last_os_error();
            match os.raw_os_error() {
                Some(0) | None => Err(Error::errno(call, rc.saturating_neg())),
                _ => Err(Error::Os { call, source: os }),
            }
        }
    }
}

/// A non-NULL pointer, or the errno the call left (no handle ever wraps NULL).
pub(crate) fn nonnull<T>(call: &'static str, p: *mut T) -> Result<std::ptr::NonNull<T>> {
    match std::ptr::NonNull::new(p) {
        Some(p) => Ok(p),
        None => {
            let os = std::io::Error::last_os_error();
            // Some providers fail without setting errno; say so rather than "Success".
            let source = match os.raw_os_error() {
                Some(0) | None => std::io::Error::other("returned NULL without setting errno"),
                _ => os,
            };
            Err(Error::Os { call, source })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_is_an_error_with_errno_never_a_handle() {
        // SAFETY: sets the calling thread's errno, as a failing verb would.
        unsafe { *libc::__errno_location() = libc::ENOMEM };
        let e = nonnull::<u8>("ibv_reg_mr", std::ptr::null_mut()).unwrap_err();
        match &e {
            Error::Os { call, source } => {
                assert_eq!(*call, "ibv_reg_mr");
                assert_eq!(source.raw_os_error(), Some(libc::ENOMEM));
            }
            other => panic!("unexpected {other:?}"),
        }
        // SAFETY: as above.
        unsafe { *libc::__errno_location() = 0 };
        let e = nonnull::<u8>("ibv_alloc_pd", std::ptr::null_mut()).unwrap_err();
        assert!(e.to_string().contains("without setting errno"), "{e}");
    }

    #[test]
    fn return_codes_are_errnos() {
        assert!(rc("ibv_modify_qp", 0).is_ok());
        let e = rc("ibv_modify_qp", libc::EINVAL).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "ibv_modify_qp failed: {}",
                std::io::Error::from_raw_os_error(libc::EINVAL)
            )
        );
    }
}
