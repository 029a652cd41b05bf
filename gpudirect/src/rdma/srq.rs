//! Shared receive queues.

use super::ffi::{free_in_parent, nonnull, verbs};
use super::pd::{PdInner, ProtectionDomain};
use super::posted::smallvec_lite::Small;
use super::posted::{RecvTable, SRQ_ID_MASK, WrId};
use super::wr::RecvRequest;
use crate::error::{Error, Result};
use gpudirect_sys::ibverbs as ibv;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

pub(crate) struct SrqInner {
    srq: NonNull<ibv::ibv_srq>,
    pd: Arc<PdInner>,
    table: Mutex<RecvTable>,
    max_sge: u32,
    /// Tells this SRQ's receives apart in `wr_id`, so a CQ releases them without the QP.
    id: u32,
    /// Receives it holds at most (the table's depth).
    depth: u32,
}

// SAFETY: verbs SRQs are thread-safe; the table is behind a Mutex.
unsafe impl Send for SrqInner {}
// SAFETY: as above.
unsafe impl Sync for SrqInner {}

impl SrqInner {
    pub(crate) fn table(&self) -> MutexGuard<'_, RecvTable> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn id(&self) -> u32 {
        self.id
    }

    pub(crate) fn depth(&self) -> u32 {
        self.depth
    }

    /// Release the receive in `slot` (its completion was polled); returns its tag. Its flag
    /// goes to `woken`.
    pub(crate) fn complete(
        &self,
        slot: u32,
        woken: &mut crate::completion::deferred::Woken,
    ) -> u64 {
        self.table().take(slot, woken).0
    }

    pub(crate) fn ctx_ptr(&self) -> *mut ibv::ibv_context {
        self.pd.ctx.ctx.as_ptr()
    }
}

impl Drop for SrqInner {
    fn drop(&mut self) {
        free_in_parent(ibv::lib, |l| {
            // SAFETY: every QP using the SRQ holds an Arc to it, so none is alive. Only after the
            // SRQ is destroyed may the receive buffers still posted in it be freed; on failure,
            // leak them.
            if unsafe { (l.ibv_destroy_srq)(self.srq.as_ptr()) } != 0 {
                let t = std::mem::replace(&mut *self.table(), RecvTable::new(0));
                std::mem::forget(t);
            }
        });
    }
}

/// `ibv_create_srq`—a shared receive queue: receives posted here serve every QP created with it.
/// Cheap to clone.
///
/// Its receives may complete on the receive CQ of any of those QPs, so each such CQ keeps room
/// for the SRQ's whole depth ([`QueuePair::create`](super::QueuePair::create) reserves it).
#[derive(Clone)]
#[doc(alias = "ibv_srq")]
pub struct SharedReceiveQueue {
    pub(crate) inner: Arc<SrqInner>,
}

impl SharedReceiveQueue {
    /// `ibv_create_srq(pd, {max_wr, max_sge})`: `max_wr` receives (1 to the device's
    /// `max_srq_wr`) of `max_sge` entries each (0 means 1; at most the device's `max_srq_sge`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a zero depth or sizes over the device's limits;
    /// [`Error::LimitExceeded`] once the process has made 2^30 - 1 SRQs (their ids in `wr_id`
    /// are never reused); [`Error::Os`] naming `ibv_create_srq` (`EOPNOTSUPP`/`ENOSYS` where
    /// the device has no SRQs).
    #[doc(alias = "ibv_create_srq")]
    pub fn new(pd: &ProtectionDomain, max_wr: u32, max_sge: u32) -> Result<Self> {
        let dev = pd.context().query_device().ok();
        check_srq(
            max_wr,
            max_sge,
            dev.as_ref().map(|d| (d.max_srq_wr, d.max_srq_sge)),
        )?;
        let l = verbs()?;
        static NEXT_ID: AtomicU32 = AtomicU32::new(1);
        let id = next_srq_id(&NEXT_ID)?;
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
        // The larger of asked and granted: CQ room is reserved for all of it.
        let depth = a.attr.max_wr.max(max_wr);
        Ok(SharedReceiveQueue {
            inner: Arc::new(SrqInner {
                srq,
                pd: pd.inner.clone(),
                table: Mutex::new(RecvTable::new(depth)),
                max_sge: a.attr.max_sge,
                id,
                depth,
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

    /// Receives it holds at most (what each CQ serving it keeps room for).
    pub fn depth(&self) -> u32 {
        self.inner.depth
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
        let mut reqs: Small<RecvRequest> = reqs.into_iter().collect();
        let pd = self.inner.pd.pd.as_ptr();
        for r in reqs.iter() {
            r.validate(self.inner.max_sge)?;
            r.sg.check_pd(pd, "SRQ")?;
        }
        let srq = self.inner.srq.as_ptr();
        let id = self.inner.id;
        self.inner.table().post(
            &mut reqs,
            |slot| WrId::Srq { srq: id, slot }.encode(),
            "shared receive queue",
            "ibv_post_srq_recv",
            None,
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

/// An SRQ's sizes against the rules and, where known, the device's `(max_srq_wr, max_srq_sge)`.
fn check_srq(max_wr: u32, max_sge: u32, dev: Option<(u32, u32)>) -> Result<()> {
    if max_wr == 0 {
        return Err(Error::invalid(
            "max_wr",
            0,
            "an SRQ needs at least one entry",
        ));
    }
    if let Some((wr, sge)) = dev {
        if wr > 0 && max_wr > wr {
            return Err(Error::invalid(
                "max_wr",
                max_wr,
                format!("the device allows at most {wr} receives per SRQ"),
            ));
        }
        if sge > 0 && max_sge > sge {
            return Err(Error::invalid(
                "max_sge",
                max_sge,
                format!("the device allows at most {sge} entries per SRQ receive"),
            ));
        }
    }
    Ok(())
}

/// The id of the next SRQ, from `next`: never one given before, since a live SRQ's receives are
/// told apart by it in `wr_id` (a CQ would release another SRQ's receives by a repeated one),
/// and a CQ may still hold completions of a destroyed SRQ. Past [`SRQ_ID_MASK`] SRQs, refused.
fn next_srq_id(next: &AtomicU32) -> Result<u32> {
    next.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
        (n <= SRQ_ID_MASK).then(|| n + 1)
    })
    .map_err(|n| Error::LimitExceeded {
        what: "shared receive queues made by one process",
        requested: n as usize,
        limit: SRQ_ID_MASK as usize,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Ids are never given twice: past the last one that fits `wr_id`, SRQs are refused.
    #[test]
    fn srq_ids_are_never_reused() {
        let next = AtomicU32::new(SRQ_ID_MASK - 1);
        let mut seen = vec![next_srq_id(&next).unwrap(), next_srq_id(&next).unwrap()];
        assert_eq!(seen, [SRQ_ID_MASK - 1, SRQ_ID_MASK]);
        for _ in 0..3 {
            match next_srq_id(&next) {
                Ok(id) => seen.push(id),
                Err(e) => assert!(matches!(e, Error::LimitExceeded { .. }), "{e}"),
            }
        }
        let mut unique = seen.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), seen.len(), "{seen:?}");
        assert_eq!(seen.len(), 2);
    }

    proptest! {
        /// Any sizes against any limits: refused or accepted exactly by the rules.
        #[test]
        fn srq_sizes_are_checked(
            wr in any::<u32>(), sge in any::<u32>(),
            dev in proptest::option::of((0u32..100_000, 0u32..64)),
        ) {
            let ok = wr >= 1
                && dev.is_none_or(|(w, s)| (w == 0 || wr <= w) && (s == 0 || sge <= s));
            prop_assert_eq!(check_srq(wr, sge, dev).is_ok(), ok);
        }
    }
}
