//! Protection domains.

use super::context::{Context, CtxInner};
use super::ffi::{free_in_parent, nonnull, verbs};
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
        free_in_parent(ibv::lib, |l| {
            // SAFETY: every MR, QP and SRQ of this PD holds an Arc to it, so none is alive.
            // Failure (EBUSY) leaves the PD allocated: a leak, which is safe.
            unsafe { (l.ibv_dealloc_pd)(self.pd.as_ptr()) };
        });
    }
}

/// `ibv_alloc_pd`—a protection domain: memory regions and queue pairs of one PD may be used together.
/// Cheap to clone.
#[derive(Clone)]
#[doc(alias = "ibv_pd")]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

impl Context {
    /// `ibv_alloc_pd`—a protection domain.
    ///
    /// # Errors
    ///
    /// [`Error::Os`](crate::Error::Os) naming `ibv_alloc_pd`.
    #[doc(alias = "ibv_alloc_pd")]
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        let l = verbs()?;
        // SAFETY: a live context.
        let pd = nonnull("ibv_alloc_pd", unsafe { (l.ibv_alloc_pd)(self.as_raw()) })?;
        Ok(ProtectionDomain {
            inner: Arc::new(PdInner {
                pd,
                ctx: self.inner.clone(),
            }),
        })
    }
}

impl ProtectionDomain {
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
}

impl std::fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("pd", &self.inner.pd)
            .finish()
    }
}
