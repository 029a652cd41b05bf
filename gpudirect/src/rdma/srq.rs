//! Shared receive queues.

use super::pd::{PdInner, ProtectionDomain};
use super::qp::RecvTable;
use super::wr::RecvRequest;
use super::{in_forked_child, nonnull, verbs};
use crate::error::{Error, Result};
use gpudirect_sys::ibverbs as ibv;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};

/// `wr_id` tag of SRQ receives (see `qp.rs`).
const KIND_SRQ: u64 = 2;

pub(crate) struct SrqInner {
    srq: NonNull<ibv::ibv_srq>,
    pd: Arc<PdInner>,
    table: Mutex<RecvTable>,
    max_sge: u32,
}

// SAFETY: verbs SRQs are thread-safe; the table is behind a Mutex.
unsafe impl Send for SrqInner {}
// SAFETY: as above.
unsafe impl Sync for SrqInner {}

impl SrqInner {
    pub(crate) fn table(&self) -> MutexGuard<'_, RecvTable> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for SrqInner {
    fn drop(&mut self) {
        if in_forked_child() {
            return;
        }
        let Ok(l) = ibv::lib() else { return };
        // SAFETY: every QP using the SRQ holds an Arc to it, so none is alive. Only after the SRQ
        // is destroyed may the receive buffers still posted in it be freed; on failure, leak them.
        if unsafe { (l.ibv_destroy_srq)(self.srq.as_ptr()) } != 0 {
            let t = std::mem::replace(&mut *self.table(), RecvTable::new(0));
            std::mem::forget(t);
        }
    }
}

/// `ibv_create_srq`—a shared receive queue: receives posted here serve every QP created with it.
/// Cheap to clone.
#[derive(Clone)]
#[doc(alias = "ibv_srq")]
pub struct SharedReceiveQueue {
    pub(crate) inner: Arc<SrqInner>,
}

impl SharedReceiveQueue {
    /// `ibv_create_srq(pd, {max_wr, max_sge})`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a zero depth; [`Error::Os`] naming `ibv_create_srq`
    /// (`EOPNOTSUPP`/`ENOSYS` where the device has no SRQs).
    #[doc(alias = "ibv_create_srq")]
    pub fn new(pd: &ProtectionDomain, max_wr: u32, max_sge: u32) -> Result<Self> {
        if max_wr == 0 {
            return Err(Error::invalid(
                "max_wr",
                0,
                "an SRQ needs at least one entry",
            ));
        }
        let l = verbs()?;
        let mut a = ibv::ibv_srq_init_attr {
            attr: ibv::ibv_srq_attr {
                max_wr,
                max_sge: max_sge.max(1),
                srq_limit: 0,
            },
            ..Default::default()
        };
        // SAFETY: a live PD and a valid init struct, updated with the granted sizes.
        let srq = nonnull("ibv_create_srq", unsafe {
            (l.ibv_create_srq)(pd.as_raw(), &mut a)
        })?;
        Ok(SharedReceiveQueue {
            inner: Arc::new(SrqInner {
                srq,
                pd: pd.inner.clone(),
                table: Mutex::new(RecvTable::new(a.attr.max_wr.max(max_wr))),
                max_sge: a.attr.max_sge,
            }),
        })
    }

    /// The raw `ibv_srq`, valid while `self` is.
    pub fn as_raw(&self) -> *mut ibv::ibv_srq {
        self.inner.srq.as_ptr()
    }

    /// Receives posted and not yet completed.
    pub fn outstanding(&self) -> u32 {
        self.inner.table().live()
    }

    /// `ibv_post_srq_recv`—post receives, chained in one call; each keeps its slices until its
    /// completion is polled (on the CQ of the QP the message arrived on).
    ///
    /// # Errors
    ///
    /// As [`QueuePair::post_recv`](super::QueuePair::post_recv), naming `ibv_post_srq_recv`.
    #[doc(alias = "ibv_post_srq_recv")]
    pub fn post_recv(&self, reqs: impl IntoIterator<Item = RecvRequest>) -> Result<usize> {
        verbs()?;
        let reqs: Vec<RecvRequest> = reqs.into_iter().collect();
        let pd = self.inner.pd.pd.as_ptr();
        for r in &reqs {
            r.validate(self.inner.max_sge)?;
            if let Some(s) = r.sg.slices().iter().find(|s| s.pd_ptr() != pd) {
                return Err(Error::invalid(
                    "local",
                    format!("{s:?}"),
                    "the region belongs to another protection domain than the SRQ",
                ));
            }
        }
        let srq = self.inner.srq.as_ptr();
        self.inner.table().post(
            reqs,
            KIND_SRQ,
            "shared receive queue",
            "ibv_post_srq_recv",
            |wr, bad| {
                // SAFETY: a live SRQ; the chain lives for the call and the memory it references is
                // owned by the table until completion.
                unsafe { ibv::ibv_post_srq_recv(srq, wr, bad) }
            },
        )
    }
}

impl std::fmt::Debug for SharedReceiveQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedReceiveQueue")
            .field("outstanding", &self.outstanding())
            .finish()
    }
}
