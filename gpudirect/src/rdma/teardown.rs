//! Counts of verbs objects destroyed and leaked by teardown.

use std::sync::atomic::{AtomicU64, Ordering};

/// How this process's verbs objects were torn down: destroyed, or leaked because the library could
/// not prove the NIC was done with them (a queue pair whose flushed completions did not arrive in
/// time, or that memory windows were still bound through; a failing destroy, deregistration or
/// deallocation). Counts since the process started; leaking is the safe failure, and a growing
/// leak count is worth a look.
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
    /// Memory windows deallocated (`ibv_dealloc_mw` succeeded), and the region ranges they held
    /// released.
    pub windows_deallocated: u64,
    /// Memory windows whose `ibv_dealloc_mw` failed: the window and the range it held leaked.
    pub windows_leaked: u64,
}

pub(crate) struct Counters {
    pub(crate) qp_destroyed: AtomicU64,
    pub(crate) qp_leaked: AtomicU64,
    pub(crate) cq_destroyed: AtomicU64,
    pub(crate) cq_leaked: AtomicU64,
    pub(crate) mr_deregistered: AtomicU64,
    pub(crate) mr_leaked: AtomicU64,
    pub(crate) mw_deallocated: AtomicU64,
    pub(crate) mw_leaked: AtomicU64,
}

pub(crate) static COUNTERS: Counters = Counters {
    qp_destroyed: AtomicU64::new(0),
    qp_leaked: AtomicU64::new(0),
    cq_destroyed: AtomicU64::new(0),
    cq_leaked: AtomicU64::new(0),
    mr_deregistered: AtomicU64::new(0),
    mr_leaked: AtomicU64::new(0),
    mw_deallocated: AtomicU64::new(0),
    mw_leaked: AtomicU64::new(0),
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
        windows_deallocated: g(&c.mw_deallocated),
        windows_leaked: g(&c.mw_leaked),
    }
}
