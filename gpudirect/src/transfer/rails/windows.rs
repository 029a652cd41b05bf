//! Per-peer memory windows: bound at connect through one rail's queue pair over the range of
//! each descriptor published to its peer, their rkeys put in the descriptors that peer
//! receives, deallocated (which unbinds them) when the endpoint closes or breaks.

use crate::error::{Error, Result};
use crate::rdma::{AccessFlags, BindOutcome, BoundWindow, Connection, PendingBind, WindowBind};
use crate::transfer::descriptor::MemoryDescriptor;
use crate::transfer::engine::EngineInner;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// What a peer may do through its windows: what the engine's registrations grant remotely.
const WINDOW_ACCESS: AccessFlags = AccessFlags::REMOTE_READ.union(AccessFlags::REMOTE_WRITE);
/// Tag of the bind requests (the handshake's read is tag 1).
const BIND_TAG: u64 = 2;

/// Windows bound for one peer, and the descriptors naming them.
pub(super) struct Granted {
    pub(super) descriptors: Vec<MemoryDescriptor>,
    pub(super) windows: Vec<BoundWindow>,
}

/// Bind a window through `conn`'s queue pair (on engine device `dev`) over each descriptor of
/// `publish`, at most `batch` binds posted at a time, every bind completed by `deadline` (or
/// `stop`). Each descriptor comes back with the window's rkey for `dev` and no other rkey.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a descriptor that names no live registration of this engine
/// on `dev`, before anything is posted; [`Error::Timeout`] when binds are still pending at
/// `deadline`; a failed bind's [`Error::WorkCompletion`]; as
/// [`ProtectionDomain::alloc_mw`](crate::rdma::ProtectionDomain::alloc_mw) and
/// [`QueuePair::bind_window`](crate::rdma::QueuePair::bind_window).
pub(super) fn bind_for_peer(
    e: &EngineInner,
    dev: usize,
    conn: &mut Connection,
    publish: &[MemoryDescriptor],
    batch: usize,
    deadline: Instant,
    stop: Option<&AtomicBool>,
) -> Result<Granted> {
    // Every range found before anything is posted.
    let mut ranges = Vec::with_capacity(publish.len());
    {
        let mut cache = e.cache.lock().unwrap_or_else(|p| p.into_inner());
        for (i, d) in publish.iter().enumerate() {
            let entry = d
                .rkeys()
                .get(dev)
                .and_then(|&k| cache.by_rkey(dev, k, d.addr(), d.len()))
                .ok_or_else(|| {
                    Error::invalid(
                        "publish",
                        i,
                        "names no live region of this engine: with per-peer windows only the \
                         engine's own regions are published",
                    )
                })?;
            let at = usize::try_from(d.addr() - entry.start)
                .map_err(|_| Error::invalid("publish", i, "offset fits no usize"))?;
            let len = usize::try_from(d.len())
                .map_err(|_| Error::invalid("publish", i, "length fits no usize"))?;
            ranges.push(entry.mrs[dev].slice(at, len)?);
        }
    }
    let started = Instant::now();
    let mut descriptors = Vec::with_capacity(publish.len());
    let mut windows = Vec::with_capacity(publish.len());
    let batch = batch.max(1);
    for (ds, rs) in publish.chunks(batch).zip(ranges.chunks(batch)) {
        let mut pending: Vec<PendingBind> = Vec::with_capacity(rs.len());
        for r in rs {
            let w = conn.pd().alloc_mw()?;
            let bind = WindowBind::new(r.clone(), WINDOW_ACCESS).tag(BIND_TAG);
            pending.push(conn.qp().bind_window(w, bind)?);
        }
        while !pending.iter().all(PendingBind::is_complete) {
            // The binds' completions write their pending windows' status as they are polled.
            let _ = conn.send_cq().poll()?;
            if pending.iter().all(PendingBind::is_complete) {
                break;
            }
            if Instant::now() >= deadline || stop.is_some_and(|s| s.load(Ordering::Acquire)) {
                return Err(Error::Timeout {
                    what: "binding the peer's memory windows",
                    after: started.elapsed(),
                });
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        for (d, p) in ds.iter().zip(pending) {
            match p.finish() {
                BindOutcome::Bound(w) => {
                    descriptors.push(d.only_rkey(dev, w.rkey()));
                    windows.push(w);
                }
                BindOutcome::Failed { error, .. } => return Err(error),
                BindOutcome::Pending(_) => {
                    return Err(Error::invalid("bind", "pending", "completion not seen"));
                }
            }
        }
    }
    e.window_counts
        .bound
        .fetch_add(windows.len() as u64, Ordering::Relaxed);
    Ok(Granted {
        descriptors,
        windows,
    })
}

/// Deallocate `windows` (each unbinds as it goes: its rkey is refused from then on), counted as
/// revoked.
pub(super) fn revoke(e: &EngineInner, windows: &mut Vec<BoundWindow>) {
    if windows.is_empty() {
        return;
    }
    let n = windows.len() as u64;
    windows.clear();
    e.window_counts.revoked.fetch_add(n, Ordering::Relaxed);
}
