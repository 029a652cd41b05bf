//! Windows granted after connect ([`Endpoint::grant`](crate::transfer::Endpoint::grant)): one
//! per rail over a region, bound through that rail's queue pair while requests flow, kept with
//! the peer's other windows and revoked with them.

use super::rail::{Posted, QpSlot};
use super::state::Link;
use super::windows::{WINDOW_ACCESS, count_bound};
use crate::error::{Error, Result};
use crate::rdma::{BindOutcome, PendingBind, WindowBind};
use crate::transfer::descriptor::MemoryDescriptor;
use crate::transfer::engine::PeerAccess;
use crate::transfer::plan::deadline_after;
use crate::transfer::region::Region;
use std::time::{Duration, Instant};

/// Bind a window over `region` through every rail of `link` (its peer's descriptors give it
/// windows), each bind posted as an internal message of its rail (within the rail's window of
/// messages in flight), completed within the engine's `connect_timeout`; the descriptor with
/// each rail's window rkey as the rkey of its device. Under region rkeys, the region's own
/// descriptor.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a region of another engine, or one no rail can reach
/// (staged memory); the endpoint's failure once it has failed or closed (also while binding);
/// [`Error::Timeout`] when the binds did not complete in time; a failed bind's
/// [`Error::WorkCompletion`].
pub(super) fn grant(link: &Link, region: &Region) -> Result<MemoryDescriptor> {
    let e = &link.ep.engine.inner;
    if region.entry.engine != e.engine_id {
        return Err(Error::invalid(
            "region",
            "of another engine",
            "a region of this endpoint's engine",
        ));
    }
    let whole = region.descriptor()?;
    let deadline = deadline_after(Instant::now(), e.config.connect_timeout);
    let started = Instant::now();
    // (rail, device, the bind), posted once every rail has room for one more message.
    let mut pending: Vec<(usize, usize, PendingBind)> = Vec::new();
    loop {
        let mut st = link.lock();
        if let Some((b, _)) = &st.broken {
            return Err(b.to_error());
        }
        if st
            .rails
            .first()
            .is_none_or(|r| r.access != PeerAccess::Windows)
        {
            return Ok(whole);
        }
        if st
            .rails
            .iter()
            .all(|r| r.inflight.len() < r.window as usize)
        {
            for (i, rail) in st.rails.iter_mut().enumerate() {
                let Some(mr) = region.entry.mrs.get(rail.device) else {
                    return Err(Error::invalid(
                        "region",
                        &region.entry.path,
                        "registered with the rails' devices (staged memory has no window)",
                    ));
                };
                let range = mr.slice(region.at as usize, region.len())?;
                let QpSlot::Rts(qp) = &mut rail.qp else {
                    return Err(Error::invalid("endpoint", "closed", "an open endpoint"));
                };
                let w = e.devices[rail.device].pd.alloc_mw()?;
                let seq = rail.next_seq;
                let p = qp.bind_window(w, WindowBind::new(range, WINDOW_ACCESS).tag(seq))?;
                rail.next_seq += 1;
                rail.inflight.push_back(Posted {
                    seq,
                    req: 0,
                    bytes: 0,
                    dir: None,
                    imm: false,
                    wr: None,
                    note: None,
                });
                pending.push((i, rail.device, p));
            }
            link.gauge(&st);
            break;
        }
        drop(st);
        if Instant::now() >= deadline {
            return Err(timeout(started));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    link.poke();
    // The binds' completions are polled with the rails' others (the progress thread, or a
    // waiting thread), which writes each pending window's status.
    while !pending.iter().all(|(_, _, p)| p.is_complete()) {
        if Instant::now() >= deadline {
            return Err(timeout(started));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let mut st = link.lock();
    let mut granted = whole.only_rkey(usize::MAX, 0);
    let mut bound = Vec::with_capacity(pending.len());
    for (i, dev, p) in pending {
        match p.finish() {
            BindOutcome::Bound(w) => {
                granted = granted.with_rkey(dev, w.rkey());
                bound.push((i, w));
            }
            BindOutcome::Failed { error, .. } => return Err(error),
            BindOutcome::Pending(_) => {
                return Err(Error::invalid("bind", "pending", "completion not seen"));
            }
        }
    }
    if let Some((b, _)) = &st.broken {
        // Its windows were revoked: these go too (dropped here, before the queue pairs).
        return Err(b.to_error());
    }
    // A reconnect since the post would have new queue pairs: these windows are not theirs.
    let same = bound.iter().all(|(i, w)| {
        matches!(&st.rails.get(*i).map(|r| &r.qp), Some(QpSlot::Rts(q)) if q.qp_num() == w.qp_num())
    });
    if !same {
        return Err(Error::invalid(
            "endpoint",
            "reconnected while binding",
            "the same connection throughout",
        ));
    }
    count_bound(e, bound.len());
    for (i, w) in bound {
        st.rails[i].windows.push(w);
    }
    Ok(granted)
}

fn timeout(started: Instant) -> Error {
    Error::Timeout {
        what: "binding a granted region's memory windows",
        after: started.elapsed(),
    }
}
