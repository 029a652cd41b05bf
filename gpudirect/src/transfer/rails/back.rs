//! Taking a failed rail back: the dialing side connects that rail alone to the peer's address
//! for it, greeted as a rail coming back (the endpoint's group id, the rail's generation) and,
//! with a key, authenticated with the endpoint's session secret; the listener that accepted
//! the endpoint routes it there by the group id. Each side binds again the windows it had
//! bound through that rail, the window messages are swapped, and each side puts the new rail
//! in the failed one's place once that one is free ([`not_free`]).

use super::handshake::{Back, Greet, Greeted, Home, conn_opts, greet, greeting, rebind};
use super::progress::poll_all;
use super::rail::Rail;
use super::state::{ENDPOINT_FAILED, Link, Origin, install, not_free};
use crate::error::{Error, Result};
use crate::rdma::Connection;
use crate::transfer::auth::Role;
use crate::transfer::plan::deadline_after;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Take back every failed rail of a dialed endpoint that can come back now, each within the
/// engine's `connect_timeout`. Returns the rails that came back, in order.
///
/// # Errors
///
/// [`Error::InvalidArgument`] on the accepting side, or while another thread takes this
/// endpoint's rails back; when no failed rail came back, the first one's error (connecting,
/// authentication, [`Error::InvalidArgument`] while it cannot come back yet: see
/// [`not_free`]).
pub(super) fn restore(link: &Link) -> Result<Vec<usize>> {
    let Origin::Dialed { peers, .. } = &link.origin else {
        return Err(Error::invalid(
            "endpoint",
            "accepted",
            "only the side that connected takes a rail back; the listener routes it",
        ));
    };
    if link.restoring.swap(true, Ordering::AcqRel) {
        return Err(Error::invalid(
            "rails",
            "being taken back",
            "one thread at a time takes an endpoint's rails back",
        ));
    }
    let r = restore_failed(link, peers);
    link.restoring.store(false, Ordering::Release);
    r
}

/// [`restore`]'s work, while this thread is the one taking rails back.
fn restore_failed(link: &Link, peers: &[std::net::SocketAddr]) -> Result<Vec<usize>> {
    let failed: Vec<usize> = {
        let st = link.lock();
        if let Some((b, _)) = &st.broken {
            return Err(b.to_error());
        }
        (0..st.lanes.len()).filter(|&r| !st.lanes[r].up()).collect()
    };
    let mut back = Vec::new();
    let mut first = None;
    for r in failed {
        match restore_one(link, r, peers[r]) {
            Ok(()) => back.push(r),
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }
    match first {
        Some(e) if back.is_empty() => Err(e),
        _ => Ok(back),
    }
}

/// What a failed rail had: its windows' ranges (with the rkeys the peer's descriptors name),
/// the access policy, devices, generation; and the endpoint's group id and session secret.
fn snapshot(link: &Link, r: usize) -> Result<Snapshot> {
    let st = link.lock();
    if let Some(why) = not_free(&st, r) {
        return Err(not_yet(r, why));
    }
    Ok(take(&st, r))
}

/// [`snapshot`] of rail `r` whether or not it is free (`InvalidArgument` for no such rail).
fn snapshot_any(link: &Link, r: usize) -> Result<Snapshot> {
    let st = link.lock();
    if r >= st.rails.len() {
        return Err(not_yet(r, "the endpoint has no such rail"));
    }
    Ok(take(&st, r))
}

fn take(st: &super::state::State, r: usize) -> Snapshot {
    let rail = &st.rails[r];
    Snapshot {
        lost: rail.lost.clone(),
        access: rail.access,
        device: rail.device,
        peer_device: rail.peer_device,
        generation: st.lanes[r].generation,
        rails: st.lanes.len(),
        group: st.group,
        session: st.session.clone(),
        peer_devices: st.peer_devices,
        max_message: st.max_message,
    }
}

struct Snapshot {
    lost: Vec<(crate::rdma::MrSlice, u32)>,
    access: crate::transfer::engine::PeerAccess,
    device: usize,
    peer_device: usize,
    generation: u32,
    rails: usize,
    group: [u8; 16],
    session: Option<crate::transfer::auth::AuthKey>,
    peer_devices: usize,
    max_message: u32,
}

impl Snapshot {
    /// The rail's next generation as this side proposes it: one more than its own (never 0,
    /// which marks a rail of a new endpoint).
    fn proposed(&self) -> u32 {
        self.generation.wrapping_add(1).max(1)
    }
}

fn not_yet(r: usize, why: &str) -> Error {
    Error::invalid("rail", r, format!("cannot come back now: {why}"))
}

/// The rail came back the way it went: through the same device here and at the peer, the
/// peer's device count and largest message as they were. (The rail count is the dialer's: the
/// listener checks it when it looks the endpoint up.)
fn same_path(g: &Greeted, s: &Snapshot, r: usize) -> Result<()> {
    let h = &g.theirs;
    if g.device != s.device
        || h.device as usize != s.peer_device
        || h.devices as usize != s.peer_devices
        || h.max_message < s.max_message
    {
        return Err(Error::invalid(
            "rail",
            r,
            format!(
                "came back through device {} here and {} of {} at the peer; it went through {} \
                 and {} of {}",
                g.device, h.device, h.devices, s.device, s.peer_device, s.peer_devices
            ),
        ));
    }
    Ok(())
}

/// Failed rail `r` of a dialed endpoint connected again to `addr` and put back.
fn restore_one(link: &Link, r: usize, addr: std::net::SocketAddr) -> Result<()> {
    let e = &link.ep.engine.inner;
    let deadline = deadline_after(Instant::now(), e.config.connect_timeout);
    let s = snapshot(link, r)?;
    let proposed = s.proposed();
    let mut home = Home::new(e, r);
    let conn = Connection::connect_until(addr, &conn_opts(e), |dev| home.resources(dev), deadline)?;
    let g = greet(
        e,
        conn,
        home,
        greeting(e, s.group, r, s.rails, proposed),
        &Greet {
            role: Role::Dialer,
            peer: addr.to_string(),
            deadline,
            stop: None,
            authenticated: None,
            back: Back::Dial(s.session.as_ref()),
        },
    )?;
    same_path(&g, &s, r)?;
    let (rail, generation, theirs) = rebind(e, g, &s.lost, s.access, proposed, deadline, None)?;
    put_back(link, &s, r, rail, generation, theirs.credits)
}

/// At the listener: rail `g` (greeted, authenticated with the session secret of `link`'s
/// endpoint) takes that endpoint's rail back, once the rail is free here ([`not_free`]): a
/// rail still up here is not given up for it (the peer's question about it gives it up; a
/// peer cannot end a rail by dialing), and its flushes and any question about it are waited
/// for, by `deadline` (or `stop`).
///
/// # Errors
///
/// [`Error::Timeout`] when the rail is not free by `deadline`; [`Error::InvalidArgument`] when
/// it came back another way than it went, or the endpoint failed; as [`rebind`].
pub(super) fn accept_back(
    link: &Link,
    g: Greeted,
    deadline: Instant,
    stop: &AtomicBool,
) -> Result<()> {
    let r = g.theirs.rail as usize;
    let started = Instant::now();
    // Checked before anything waits: a rail that could never fit is refused at once.
    same_path(&g, &snapshot_any(link, r)?, r)?;
    loop {
        match not_free(&link.lock(), r) {
            None => break,
            Some(w) if w == ENDPOINT_FAILED => return Err(not_yet(r, w)),
            Some(_) => {}
        }
        link.poke();
        if Instant::now() >= deadline || stop.load(Ordering::Acquire) {
            return Err(Error::Timeout {
                what: "a failed rail's flushes and questions, before it comes back",
                after: started.elapsed(),
            });
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let s = snapshot(link, r)?;
    let proposed = s.proposed();
    let (rail, generation, theirs) = rebind(
        &link.ep.engine.inner,
        g,
        &s.lost,
        s.access,
        proposed,
        deadline,
        Some(stop),
    )?;
    put_back(link, &s, r, rail, generation, theirs.credits)
}

/// Put `rail` in failed rail `r`'s place, unless the endpoint is no longer the one `s` was
/// taken from (a reconnect since); what the old rail's completion queues still hold is taken
/// first (a notification received there is delivered). The old rail is dropped once the lock
/// is let go, and the progress thread woken (it polls the new rail's channel and link from its
/// next round).
fn put_back(
    link: &Link,
    s: &Snapshot,
    r: usize,
    rail: Rail,
    generation: u32,
    credits: u16,
) -> Result<()> {
    let old = {
        let mut st = link.lock();
        if st.group != s.group {
            return Err(not_yet(r, "the endpoint reconnected meanwhile"));
        }
        poll_all(link, &mut st);
        install(link, &mut st, r, rail, generation, credits)?
    };
    link.poke();
    drop(old);
    Ok(())
}
