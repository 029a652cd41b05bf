//! Taking a failed rail back: the dialing side connects that rail alone to the peer's address
//! for it, greeted as a rail coming back (the endpoint's group id, the rail's generation) and,
//! with a key, authenticated with the endpoint's session secret; the listener that accepted
//! the endpoint routes it there by the group id. Each side binds again the windows it had
//! bound through that rail, the window messages are swapped, and each side puts the new rail
//! in the failed one's place once that one is free ([`not_free`]).

use super::handshake::{Back, Greet, Greeted, Home, conn_opts, greet, rebind};
use super::rail::Rail;
use super::state::{Link, Origin, fail_rail, install, not_free};
use crate::error::{Error, Result};
use crate::rdma::Connection;
use crate::transfer::auth::Role;
use crate::transfer::plan::deadline_after;
use crate::transfer::request::Broken;
use crate::transfer::wire::Hello;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Take back every failed rail of a dialed endpoint that can come back now, each within the
/// engine's `connect_timeout`. Returns the rails that came back, in order.
///
/// # Errors
///
/// [`Error::InvalidArgument`] on the accepting side; when no failed rail came back, the first
/// one's error (connecting, authentication, [`Error::InvalidArgument`] while it cannot come
/// back yet: see [`not_free`]).
pub(super) fn restore(link: &Link) -> Result<Vec<usize>> {
    let Origin::Dialed { peers, .. } = &link.origin else {
        return Err(Error::invalid(
            "endpoint",
            "accepted",
            "only the side that connected takes a rail back; the listener routes it",
        ));
    };
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
    let rail = &st.rails[r];
    Ok(Snapshot {
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
    })
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

fn not_yet(r: usize, why: &str) -> Error {
    Error::invalid("rail", r, format!("cannot come back now: {why}"))
}

/// The rail came back the way it went: through the same device here and at the peer, the
/// peer's device count and largest message as they were.
fn same_path(g: &Greeted, s: &Snapshot, r: usize) -> Result<()> {
    let h = &g.theirs;
    if g.device != s.device
        || h.device as usize != s.peer_device
        || h.devices as usize != s.peer_devices
        || h.max_message < s.max_message
        || h.rails as usize != s.rails
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
    let proposed = s.generation.wrapping_add(1).max(1);
    let mut home = Home::new(e, r);
    let conn = Connection::connect_until(addr, &conn_opts(e), |dev| home.resources(dev), deadline)?;
    let g = greet(
        e,
        conn,
        home,
        Hello {
            group: s.group,
            rail: r as u8,
            rails: s.rails as u8,
            back: proposed,
            device: 0,
            devices: e.devices.len() as u8,
            credits: e.config.notify_depth as u16,
            max_message: e.max_message(),
            descriptors: Vec::new(),
        },
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
    put_back(link, r, rail, generation, theirs.credits)
}

/// At the listener: rail `g` (greeted, authenticated with the session secret of `link`'s
/// endpoint) takes that endpoint's rail back. The rail is given up here first if it was still
/// up (the peer dials it again: it gave the old one up); its flushes and any question about it
/// are waited for, by `deadline` (or `stop`).
///
/// # Errors
///
/// [`Error::Timeout`] when the rail is not free by `deadline`; [`Error::InvalidArgument`] when
/// it came back another way than it went; as [`rebind`].
pub(super) fn accept_back(
    link: &Link,
    g: Greeted,
    deadline: Instant,
    stop: &AtomicBool,
) -> Result<()> {
    let r = g.theirs.rail as usize;
    let started = Instant::now();
    loop {
        let why = {
            let mut st = link.lock();
            if st.lanes.get(r).is_some_and(|l| l.up()) && st.broken.is_none() {
                fail_rail(link, &mut st, r, Broken::RailGivenUp);
            }
            not_free(&st, r)
        };
        match why {
            None => break,
            Some(w) if st_final(w) => return Err(not_yet(r, w)),
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
    same_path(&g, &s, r)?;
    let proposed = s.generation.wrapping_add(1).max(1);
    let (rail, generation, theirs) = rebind(
        &link.ep.engine.inner,
        g,
        &s.lost,
        s.access,
        proposed,
        deadline,
        Some(stop),
    )?;
    put_back(link, r, rail, generation, theirs.credits)
}

/// Whether a rail that is not free never will be (the endpoint failed).
fn st_final(why: &str) -> bool {
    why == super::state::ENDPOINT_FAILED
}

/// Put `rail` in failed rail `r`'s place; the old one is dropped once the lock is let go, and
/// the progress thread woken (it polls the new rail's channel and link from its next round).
fn put_back(link: &Link, r: usize, rail: Rail, generation: u32, credits: u16) -> Result<()> {
    let old = {
        let mut st = link.lock();
        install(link, &mut st, r, rail, generation, credits)?
    };
    link.poke();
    drop(old);
    Ok(())
}
