//! Protection domains.

use super::context::{Context, CtxInner};
use super::mr::{AccessFlags, DmabufRegion, HostMemory, Local, MemoryRegion, Remote};
use super::{in_forked_child, nonnull, verbs};
use crate::error::Result;
use gpudirect_sys::ibverbs as ibv;
use std::ptr::NonNull;
use std::sync::Arc;

pub(crate) struct PdInner {
    pub(crate) pd: NonNull<ibv::ibv_pd>,
    pub(crate) ctx: Arc<CtxInner>,
}

// SAFETY: verbs objects are thread-safe; the PD is only freed in Drop.
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        if in_forked_child() {
            return;
        }
        if let Ok(l) = ibv::lib() {
            // SAFETY: every MR, QP and SRQ of this PD holds an Arc to it, so none is alive.
            // Failure (EBUSY) leaves the PD allocated: a leak, which is safe.
            unsafe { (l.ibv_dealloc_pd)(self.pd.as_ptr()) };
        }
    }
}

/// `ibv_alloc_pd`—a protection domain: memory regions and queue pairs of one PD may be used together.
/// Cheap to clone.
#[derive(Clone)]
#[doc(alias = "ibv_pd")]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

impl ProtectionDomain {
    pub(crate) fn new(ctx: &Context) -> Result<Self> {
        let l = verbs()?;
        // SAFETY: a live context.
        let pd = nonnull("ibv_alloc_pd", unsafe { (l.ibv_alloc_pd)(ctx.as_raw()) })?;
        Ok(ProtectionDomain {
            inner: Arc::new(PdInner {
                pd,
                ctx: ctx.inner.clone(),
            }),
        })
    }

    /// The context this PD belongs to.
    pub fn context(&self) -> Context {
        Context {
            inner: self.inner.ctx.clone(),
        }
    }

    /// The raw `ibv_pd`, valid while `self` is.
    pub fn as_raw(&self) -> *mut ibv::ibv_pd {
        self.inner.pd.as_ptr()
    }

    /// `ibv_reg_mr(pd, buf, len, access)`—register host memory that only this node's NIC writes
    /// (receives, RDMA-read targets) and that remote peers may at most read.
    ///
    /// `access` may hold [`AccessFlags::LOCAL_WRITE`] and [`AccessFlags::REMOTE_READ`]; the default
    /// (empty) is the least privilege: the NIC may only read it, for sends and RDMA writes. Use
    /// [`register_remote`](Self::register_remote) for remote write or atomic access.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for remote write or atomic flags, or
    /// an empty buffer; [`Error::Os`](crate::Error::Os) naming `ibv_reg_mr` (`ENOMEM` over the
    /// locked-memory limit, `EINVAL` for flags the device refuses); [`Error::Os`](crate::Error::Os) naming
    /// `ibv_fork_init` when fork support could not be set up.
    #[doc(alias = "ibv_reg_mr")]
    pub fn register<B: HostMemory>(
        &self,
        buf: B,
        access: AccessFlags,
    ) -> Result<MemoryRegion<Local>> {
        MemoryRegion::<Local>::new(self, Box::new(buf), access)
    }

    /// `ibv_reg_mr(pd, buf, len, access)`—register host memory that remote peers may write
    /// ([`AccessFlags::REMOTE_WRITE`]) or update atomically ([`AccessFlags::REMOTE_ATOMIC`]). Local
    /// write, which verbs require for both, is added.
    ///
    /// Such a region never hands out `&`/`&mut` to its bytes: copy them with
    /// [`MemoryRegion::read_at`] / [`MemoryRegion::write_at`] (and [`MemoryRegion::read_u64`] for
    /// atomic targets).
    ///
    /// # Errors
    ///
    /// As [`register`](Self::register).
    #[doc(alias = "ibv_reg_mr")]
    pub fn register_remote<B: HostMemory>(
        &self,
        buf: B,
        access: AccessFlags,
    ) -> Result<MemoryRegion<Remote>> {
        MemoryRegion::<Remote>::new(self, Box::new(buf), access)
    }
}

impl ProtectionDomain {
    /// `ibv_reg_dmabuf_mr(pd, offset, len, iova, fd, access)`—register `len` bytes at `offset`
    /// of the dma-buf `fd` of any exporter; peers address them from `iova`. The region keeps
    /// `fd`. For CUDA memory use the safe
    /// [`register_dmabuf`](ProtectionDomain::register_dmabuf), which takes the owning export.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`](crate::Error::Unsupported) saying dma-buf when libibverbs lacks the
    /// call or the device answers `EOPNOTSUPP` (Soft-RoCE, kernels before 5.12): the caller's
    /// automatic mode then tries the next path; [`Error::Os`](crate::Error::Os) naming
    /// `ibv_reg_dmabuf_mr` otherwise (`EINVAL` for an fd that is no dma-buf).
    ///
    /// # Safety
    ///
    /// The NIC may read and (with write access) write the registered bytes until the region is
    /// dropped: the memory behind `fd` must stay allocated, and not be reused for anything else,
    /// until then. An fd does not guarantee that (a CUDA dma-buf does not keep its memory alive).
    #[doc(alias = "ibv_reg_dmabuf_mr")]
    pub unsafe fn register_dmabuf_fd(
        &self,
        fd: std::os::fd::OwnedFd,
        offset: u64,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<DmabufRegion> {
        DmabufRegion::new(self, fd, offset, len, iova, access)
    }
}

impl std::fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("pd", &self.inner.pd)
            .finish()
    }
}
