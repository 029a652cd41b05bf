//! Making endpoints over the rails: an rdma_cm listener that accepts them (grouping the rails
//! of each, bounded), and connecting one rail to each of the peer's addresses.

use super::handle::Rails;
use super::handshake::{Home, conn_opts, dial, greet, resolve};
use super::rail::Rail;
use super::state::Origin;
use crate::error::{Error, Result};
use crate::rdma::Listener as CmListener;
use crate::transfer::descriptor::{MAX_RAILS, MemoryDescriptor};
use crate::transfer::engine::Engine;
use crate::transfer::plan::deadline_after;
use crate::transfer::wire::Hello;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// An rdma_cm listener of a transfer [`Engine`]: accepts endpoints, grouping the rails of each
/// (what a [`TransferListener`](crate::transfer::TransferListener) holds).
pub(crate) struct Listener {
    engine: Engine,
    cm: CmListener,
    /// Rails of endpoints not complete yet, by nonce, with when the group's first rail came.
    /// Bounded (a peer that never completes a group must not hold QPs and memory forever):
    /// groups older than [`PARTIAL_AGE`] connect timeouts are dropped, and past
    /// [`MAX_PARTIAL`] groups the oldest goes.
    partial: Mutex<HashMap<u64, (Instant, Vec<RailSetup>)>>,
}

/// The most endpoints whose rails are partly connected that a listener keeps.
pub(crate) const MAX_PARTIAL: usize = 64;
/// A partly connected endpoint is dropped after this many connect timeouts.
pub(crate) const PARTIAL_AGE: u32 = 4;

/// Drop the groups that began before `stale` (none when `None`), then the oldest while `max` or
/// more remain, making room for one more. Returns how many groups were dropped.
fn prune_partial<T>(
    groups: &mut HashMap<u64, (Instant, T)>,
    stale: Option<Instant>,
    max: usize,
) -> usize {
    let before = groups.len();
    if let Some(stale) = stale {
        groups.retain(|_, (since, _)| *since >= stale);
    }
    while groups.len() >= max.max(1) {
        let Some(oldest) = groups.iter().min_by_key(|(_, (t, _))| *t).map(|(k, _)| *k) else {
            break;
        };
        groups.remove(&oldest);
    }
    before - groups.len()
}

/// A rail connected and greeted, not yet part of an endpoint.
struct RailSetup {
    rail: Rail,
    hello: Hello,
}

/// Listen for endpoints on `addr` (`host:port`; port 0 picks one).
///
/// # Errors
///
/// [`Error::InvalidArgument`] for an address that does not resolve, or an engine without
/// rails; as [`CmListener::bind`].
pub(crate) fn listen(engine: &Engine, addr: &str) -> Result<Listener> {
    engine.inner.require_rails()?;
    Ok(Listener {
        engine: engine.clone(),
        cm: CmListener::bind(resolve(addr)?)?,
        partial: Mutex::new(HashMap::new()),
    })
}

/// Connect one rail to each of `peers`, in rail order; the first messages carry `publish`.
///
/// # Errors
///
/// As [`Engine::connect`].
pub(crate) fn connect(
    engine: &Engine,
    peers: &[&str],
    publish: &[MemoryDescriptor],
) -> Result<Rails> {
    engine.inner.require_rails()?;
    if peers.is_empty() || peers.len() > MAX_RAILS {
        return Err(Error::invalid(
            "peers",
            peers.len(),
            "one address per rail: 1 to 16",
        ));
    }
    let peers: Vec<SocketAddr> = peers.iter().map(|p| resolve(p)).collect::<Result<_>>()?;
    let origin = Origin::Dialed {
        peers,
        publish: publish.to_vec(),
    };
    let (rails, hellos) = dial(&engine.inner, &origin)?;
    Rails::start(engine.clone(), rails, hellos, origin)
}

impl Listener {
    /// The port listened on.
    pub(crate) fn port(&self) -> u16 {
        self.cm.port()
    }

    /// Accept the next endpoint: its rails' connections, whose first messages carry `publish`
    /// (on rail 0) and the peer's descriptors. Rails of other endpoints arriving meanwhile are
    /// kept for a later call.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when no complete endpoint arrives within `timeout`; errors of
    /// connecting and of the first messages (the failing connection is dropped).
    pub(crate) fn accept(&self, publish: &[MemoryDescriptor], timeout: Duration) -> Result<Rails> {
        let e = &self.engine.inner;
        let deadline = deadline_after(Instant::now(), timeout);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    what: "an endpoint to accept",
                    after: timeout,
                });
            }
            let mut opts = conn_opts(e);
            opts.timeout = left.min(e.config.connect_timeout);
            let mut home = Home::new(e, 0);
            let conn = self.cm.accept_with(&opts, |dev| home.resources(dev))?;
            // The rail's index is the peer's: known only from its first message, so ours
            // carries the descriptors on every rail (the peer reads what it needs).
            let (rail, hello) = greet(
                e,
                conn,
                home,
                Hello {
                    nonce: 0,
                    rail: 0,
                    rails: 1,
                    device: 0,
                    devices: e.devices.len() as u8,
                    credits: e.config.notify_depth as u16,
                    max_message: e.max_message(),
                    descriptors: publish.to_vec(),
                },
            )?;
            let mut partial = self.partial.lock().unwrap_or_else(|e| e.into_inner());
            if !partial.contains_key(&hello.nonce) {
                let age = e.config.connect_timeout.saturating_mul(PARTIAL_AGE);
                let stale = Instant::now().checked_sub(age);
                prune_partial(&mut partial, stale, MAX_PARTIAL);
            }
            let (_, group) = partial
                .entry(hello.nonce)
                .or_insert_with(|| (Instant::now(), Vec::new()));
            if group.iter().any(|r| r.hello.rail == hello.rail)
                || group.first().is_some_and(|r| r.hello.rails != hello.rails)
            {
                return Err(Error::invalid(
                    "peer",
                    format!("rail {} of {}", hello.rail, hello.rails),
                    "a rail already connected, or a different rail count",
                ));
            }
            group.push(RailSetup { rail, hello });
            if group.len() == group[0].hello.rails as usize {
                let nonce = hello_nonce(group);
                let (_, mut group) = partial.remove(&nonce).expect("present");
                drop(partial);
                group.sort_by_key(|r| r.hello.rail);
                let (rails, hellos): (Vec<Rail>, Vec<Hello>) =
                    group.into_iter().map(|r| (r.rail, r.hello)).unzip();
                return Rails::start(self.engine.clone(), rails, hellos, Origin::Accepted);
            }
        }
    }
}

fn hello_nonce(group: &[RailSetup]) -> u64 {
    group[0].hello.nonce
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_rail_groups_are_bounded_by_age_and_count() {
        use std::time::Duration;
        let t0 = Instant::now();
        let mut g: HashMap<u64, (Instant, ())> = HashMap::new();
        for k in 0..10u64 {
            g.insert(k, (t0 + Duration::from_millis(k), ()));
        }
        // Nothing stale, room for one more under a cap of 20: nothing goes.
        assert_eq!(prune_partial(&mut g, None, 20), 0);
        // Groups that began before t0 + 3 ms are stale.
        assert_eq!(
            prune_partial(&mut g, Some(t0 + Duration::from_millis(3)), 20),
            3
        );
        assert!(!g.contains_key(&2) && g.contains_key(&3));
        // A cap of 4: the oldest go until three remain (room for the one being added).
        assert_eq!(prune_partial(&mut g, None, 4), 4);
        let mut left: Vec<u64> = g.keys().copied().collect();
        left.sort();
        assert_eq!(left, vec![7, 8, 9]);
        // A cap of 0 counts as 1: every group goes, none is kept waiting forever.
        assert_eq!(prune_partial(&mut g, None, 0), 3);
        assert!(g.is_empty());
    }
}
