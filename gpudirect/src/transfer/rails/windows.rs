//! Per-peer memory windows: bound at connect through one rail's queue pair over the range of
//! each descriptor published to its peer, their rkeys put in the descriptors that peer
//! receives, deallocated (which unbinds them) when the endpoint closes or breaks.

use crate::error::{Error, Result};
use crate::rdma::{
    AccessFlags, BindOutcome, BoundWindow, Connection, MrSlice, PendingBind, WindowBind,
};
use crate::transfer::descriptor::MemoryDescriptor;
use crate::transfer::engine::EngineInner;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// What a peer may do through its windows: what the engine's registrations grant remotely.
pub(super) const WINDOW_ACCESS: AccessFlags =
    AccessFlags::REMOTE_READ.union(AccessFlags::REMOTE_WRITE);
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
    let windows = bind_ranges(conn, ranges, batch, deadline, stop)?;
    let descriptors = publish
        .iter()
        .zip(&windows)
        .map(|(d, w)| d.only_rkey(dev, w.rkey()))
        .collect();
    count_bound(e, windows.len());
    Ok(Granted {
        descriptors,
        windows,
    })
}

/// Bind a window through `conn`'s queue pair over each of `ranges`, in order, at most `batch`
/// binds posted at a time, every bind completed by `deadline` (or `stop`). Not counted.
///
/// # Errors
///
/// As [`bind_for_peer`], but for the lookups.
pub(super) fn bind_ranges(
    conn: &mut Connection,
    ranges: Vec<MrSlice>,
    batch: usize,
    deadline: Instant,
    stop: Option<&AtomicBool>,
) -> Result<Vec<BoundWindow>> {
    let started = Instant::now();
    let mut windows = Vec::with_capacity(ranges.len());
    for rs in ranges.chunks(batch.max(1)) {
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
        for p in pending {
            match p.finish() {
                BindOutcome::Bound(w) => windows.push(w),
                BindOutcome::Failed { error, .. } => return Err(error),
                BindOutcome::Pending(_) => {
                    return Err(Error::invalid("bind", "pending", "completion not seen"));
                }
            }
        }
    }
    Ok(windows)
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
    metrics::counter!("gpudirect_windows_revoked_total").increment(n);
}

/// `n` windows bound for a peer: counted in the engine's
/// [`WindowStats`](crate::transfer::WindowStats) and through the metrics facade.
pub(super) fn count_bound(e: &EngineInner, n: usize) {
    e.window_counts.bound.fetch_add(n as u64, Ordering::Relaxed);
    metrics::counter!("gpudirect_windows_bound_total").increment(n as u64);
}

/// The peer's descriptors of an endpoint from its rails' descriptor messages: `per_rail[r]` is
/// rail `r`'s peer device (its rkey slot) and the list that rail's message carried. Every
/// list must describe the same memory (count, address, length, kind, IPC part, rkey count);
/// slot `d_r` of each descriptor is rail `r`'s rkey for it, every other slot rail 0's. Rails
/// that share a peer device must agree on its rkey (a window serves one queue pair only: a
/// peer binding one per rail through one device sent two).
///
/// # Errors
///
/// [`Error::InvalidArgument`] (`peer.descriptors`) naming the rail and the descriptor that differ; none for no rails.
pub(super) fn merge_descriptors(
    per_rail: &[(usize, &[MemoryDescriptor])],
) -> Result<Vec<MemoryDescriptor>> {
    let Some(&(_, first)) = per_rail.first() else {
        return Ok(Vec::new());
    };
    let mut merged = first.to_vec();
    // The rail that set each slot, per slot: a second rail on one slot must agree.
    let mut set_by: Vec<Option<usize>> = vec![None; crate::transfer::descriptor::MAX_RAILS];
    for (r, &(dev, list)) in per_rail.iter().enumerate() {
        if list.len() != merged.len() {
            return Err(protocol(format!(
                "rail {r} published {} descriptors, rail 0 {}",
                list.len(),
                merged.len()
            )));
        }
        for (i, (m, d)) in merged.iter_mut().zip(list).enumerate() {
            if m.only_rkey(0, 0) != d.only_rkey(0, 0) {
                return Err(protocol(format!(
                    "descriptor {i} of rail {r} ({d:?}) differs from rail 0's ({m:?})"
                )));
            }
            let Some(&k) = d.rkeys().get(dev) else {
                return Err(protocol(format!(
                    "rail {r}'s device {dev} has no rkey in descriptor {i}"
                )));
            };
            match set_by[dev] {
                Some(o) if m.rkeys()[dev] != k => {
                    return Err(protocol(format!(
                        "rails {o} and {r} share the peer's device {dev} but give descriptor \
                         {i} different rkeys"
                    )));
                }
                _ => *m = m.with_rkey(dev, k),
            }
        }
        set_by[dev].get_or_insert(r);
    }
    Ok(merged)
}

fn protocol(value: String) -> Error {
    Error::invalid(
        "peer.descriptors",
        value,
        "every rail's descriptor message lists the same descriptors, and rails through one \
         device of the peer give each the same rkey",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::descriptor::DescribedKind;
    use proptest::prelude::*;

    fn d(addr: u64, len: u64, rkeys: &[u32]) -> MemoryDescriptor {
        MemoryDescriptor::new(addr, len, DescribedKind::Host, rkeys).unwrap()
    }

    #[test]
    fn each_rails_rkey_fills_its_peer_devices_slot() {
        let r0 = [d(0x1000, 64, &[7, 0]), d(0x9000, 8, &[9, 0])];
        let r1 = [d(0x1000, 64, &[0, 70]), d(0x9000, 8, &[0, 90])];
        let m = merge_descriptors(&[(0, &r0[..]), (1, &r1[..])]).unwrap();
        assert_eq!(m, vec![d(0x1000, 64, &[7, 70]), d(0x9000, 8, &[9, 90])]);
        // Region rkeys on every rail (the same lists): unchanged.
        let full = [d(0x1000, 64, &[5, 6])];
        let m = merge_descriptors(&[(0, &full[..]), (1, &full[..])]).unwrap();
        assert_eq!(m, full.to_vec());
        // Two rails on one peer device agreeing: fine (region rkeys).
        let m = merge_descriptors(&[(1, &full[..]), (1, &full[..])]).unwrap();
        assert_eq!(m, full.to_vec());
        assert!(merge_descriptors(&[]).unwrap().is_empty());
    }

    #[test]
    fn rails_that_disagree_are_refused_typed() {
        let base = [d(0x1000, 64, &[7, 0])];
        let cases: [(&str, Vec<MemoryDescriptor>, usize); 6] = [
            ("count", vec![], 1),
            ("count", vec![base[0], base[0]], 1),
            ("addr", vec![d(0x1008, 64, &[0, 1])], 1),
            ("len", vec![d(0x1000, 65, &[0, 1])], 1),
            (
                "kind",
                vec![MemoryDescriptor::new(0x1000, 64, DescribedKind::Device, &[0, 1]).unwrap()],
                1,
            ),
            ("shared device, other rkey", vec![d(0x1000, 64, &[8, 0])], 0),
        ];
        for (what, other, dev) in cases {
            let e = merge_descriptors(&[(0, &base[..]), (dev, &other[..])]).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::InvalidArgument {
                        arg: "peer.descriptors",
                        ..
                    }
                ),
                "{what}: {e}"
            );
        }
        // An rkey count that does not reach the rail's device.
        let e = merge_descriptors(&[(0, &base[..]), (2, &base[..])]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidArgument {
                    arg: "peer.descriptors",
                    ..
                }
            ),
            "{e}"
        );
    }

    proptest! {
        /// Any rails with distinct peer devices merge into descriptors whose slot d_r is rail
        /// r's rkey; changing one descriptor's address on one rail is refused.
        #[test]
        fn merge_takes_each_slot_from_its_rail(
            n in 1usize..5,
            ranges in proptest::collection::vec((0u64..1 << 40, 1u64..1 << 20), 0..6),
            keys in proptest::collection::vec(any::<u32>(), 30),
            bad in any::<prop::sample::Index>(),
        ) {
            let lists: Vec<Vec<MemoryDescriptor>> = (0..n)
                .map(|r| {
                    ranges
                        .iter()
                        .enumerate()
                        .map(|(i, &(a, l))| {
                            d(a, l, &vec![0; n]).only_rkey(r, keys[i * 5 + r])
                        })
                        .collect()
                })
                .collect();
            let per: Vec<(usize, &[MemoryDescriptor])> =
                lists.iter().enumerate().map(|(r, l)| (r, &l[..])).collect();
            let m = merge_descriptors(&per).unwrap();
            prop_assert_eq!(m.len(), ranges.len());
            for (i, x) in m.iter().enumerate() {
                prop_assert_eq!((x.addr(), x.len()), ranges[i]);
                for r in 0..n {
                    prop_assert_eq!(x.rkeys()[r], keys[i * 5 + r]);
                }
            }
            if !ranges.is_empty() && n > 1 {
                let mut lists = lists.clone();
                let r = 1 + bad.index(n - 1);
                let i = bad.index(ranges.len());
                let x = lists[r][i];
                lists[r][i] = d(x.addr() ^ 1, x.len(), x.rkeys());
                let per: Vec<(usize, &[MemoryDescriptor])> =
                    lists.iter().enumerate().map(|(r, l)| (r, &l[..])).collect();
                let refused = matches!(
                    merge_descriptors(&per),
                    Err(Error::InvalidArgument { arg: "peer.descriptors", .. })
                );
                prop_assert!(refused);
            }
        }
    }
}
