//! Making endpoints over the rails: an rdma_cm listener that accepts them (handshakes run
//! concurrently, each on its own thread and bounded; the rails of each endpoint grouped once
//! authenticated; a failed rail coming back routed to the endpoint it accepted), and
//! connecting one rail to each of the peer's addresses.

use super::back::accept_back;
use super::handle::Rails;
use super::handshake::{
    Back, Greet, Greeted, Home, conn_opts, dial, greet, greeting, publish_all, resolve,
};
use super::state::{Connected, Link, Origin, eventfd};
use crate::error::{Error, Result};
use crate::rdma::{ConnectRequest, ConnectionBinding, Listener as CmListener};
use crate::transfer::auth::{AuthKey, Role, random};
use crate::transfer::descriptor::{MAX_RAILS, MemoryDescriptor};
use crate::transfer::engine::Engine;
use crate::transfer::plan::deadline_after;
use crate::transfer::wire::Hello;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// An rdma_cm listener of a transfer [`Engine`]: accepts endpoints, grouping the rails of each
/// (what a [`TransferListener`](crate::transfer::TransferListener) holds).
pub(crate) struct Listener {
    engine: Engine,
    cm: CmListener,
    hub: Arc<Hub>,
}

/// The most endpoints whose rails are partly connected that a listener keeps (and the most
/// complete ones waiting for an accept).
pub(crate) const MAX_PARTIAL: usize = 64;
/// A partly connected endpoint is dropped after this many connect timeouts.
pub(crate) const PARTIAL_AGE: u32 = 4;
/// The refusals a listener keeps for [`Listener::take_refusals`].
const KEPT_REFUSALS: usize = 16;

/// What a listener's handshakes share with it: its state, and the eventfd that wakes an accept
/// when a handshake ends.
struct Hub {
    st: Mutex<HubState>,
    wake: OwnedFd,
    /// This listener's group id in its greetings (the dialer groups nothing by it).
    id: [u8; 16],
}

#[derive(Default)]
struct HubState {
    /// Handshakes running, by number.
    running: HashMap<u64, Running>,
    next: u64,
    threads: Vec<JoinHandle<()>>,
    /// Authenticated rails of endpoints not complete yet (greeted, nothing published), by group,
    /// with when the group's first rail came. Bounded (a peer that never completes a group must not hold QPs and memory
    /// forever): groups older than [`PARTIAL_AGE`] connect timeouts are dropped, and past
    /// [`MAX_PARTIAL`] groups the oldest goes.
    partial: HashMap<[u8; 16], (Instant, Vec<RailSetup>)>,
    /// Complete endpoints waiting for an accept (at most [`MAX_PARTIAL`]).
    ready: VecDeque<Connected>,
    /// Endpoints accepted, by group id: where a failed rail coming back goes.
    accepted: HashMap<[u8; 16], Weak<Link>>,
    refusals: VecDeque<Error>,
    stats: ListenerStats,
}

/// A handshake running on its own thread.
struct Running {
    since: Instant,
    authenticated: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

/// What a [`TransferListener`](crate::transfer::TransferListener) has done and holds
/// ([`TransferListener::stats`](crate::transfer::TransferListener::stats)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListenerStats {
    /// Handshakes running now (each holds one queue pair and a few KiB; at most
    /// [`EngineConfig::max_pending`](crate::transfer::EngineConfig::max_pending)).
    pub pending: usize,
    /// The most handshakes that ran at once.
    pub peak_pending: usize,
    /// Endpoints some of whose rails are connected and authenticated, waiting for the others.
    pub partial: usize,
    /// Endpoints complete, waiting for an accept.
    pub ready: usize,
    /// Endpoints handed out by accept.
    pub accepted: u64,
    /// Handshakes ended before they were authenticated to make room for newer ones.
    pub dropped: u64,
    /// Handshakes that ran past
    /// [`EngineConfig::handshake_timeout`](crate::transfer::EngineConfig::handshake_timeout).
    pub timed_out: u64,
    /// Handshakes refused: authentication, a greeting or message that is not valid, a
    /// connection error ([`TransferListener::take_refusals`](crate::transfer::TransferListener::take_refusals)
    /// says why).
    pub refused: u64,
    /// Connection requests rejected at once: every running handshake was authenticated.
    pub turned_away: u64,
    /// Rails or endpoints dropped unaccepted: a group that never completed, or past the bounds.
    pub abandoned: u64,
    /// Failed rails of accepted endpoints taken back (their peer connected them again).
    pub rails_restored: u64,
}

impl Hub {
    fn lock(&self) -> MutexGuard<'_, HubState> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn poke(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes to our eventfd; a full counter (EAGAIN) is fine.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes from our non-blocking eventfd into `v`.
        unsafe { libc::read(self.wake.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }

    /// An authenticated rail joins its endpoint's group: the whole group when that completes
    /// it (the caller publishes on its rails), else `None` (the rail is kept in the group).
    fn join(&self, setup: RailSetup, connect_timeout: Duration) -> Result<Option<Vec<RailSetup>>> {
        group(&mut self.lock(), setup, connect_timeout)
    }

    /// A handshake ended: its endpoint complete (to `ready`), its rail kept in a group (`None`),
    /// or its error counted and kept.
    fn finish(&self, n: u64, r: Result<Option<Ready>>) {
        let mut st = self.lock();
        let stopped = st
            .running
            .remove(&n)
            .is_some_and(|h| h.stop.load(Ordering::Acquire));
        match r {
            Ok(Some(ready)) => {
                if st.ready.len() >= MAX_PARTIAL {
                    st.ready.pop_front();
                    st.stats.abandoned += 1;
                }
                st.ready.push_back(ready);
            }
            Ok(None) => {}
            Err(_) if stopped => {}
            Err(Error::Timeout { .. }) => st.stats.timed_out += 1,
            Err(e) => refused(&mut st, e),
        }
        drop(st);
        self.poke();
    }
}

/// An endpoint's rails and the peer's messages, ready for an accept.
type Ready = Connected;

fn refused(st: &mut HubState, e: Error) {
    st.stats.refused += 1;
    if st.refusals.len() == KEPT_REFUSALS {
        st.refusals.pop_front();
    }
    st.refusals.push_back(e);
}

/// Add an authenticated rail to its endpoint's group; a complete group is taken out and
/// returned, in rail order.
fn group(
    st: &mut HubState,
    setup: RailSetup,
    connect_timeout: Duration,
) -> Result<Option<Vec<RailSetup>>> {
    let key = setup.hello().group;
    if !st.partial.contains_key(&key) {
        let age = connect_timeout.saturating_mul(PARTIAL_AGE);
        let stale = Instant::now().checked_sub(age);
        st.stats.abandoned += prune_partial(&mut st.partial, stale, MAX_PARTIAL) as u64;
    }
    let (_, group) = st
        .partial
        .entry(key)
        .or_insert_with(|| (Instant::now(), Vec::new()));
    let h = setup.hello();
    if group.iter().any(|r| r.hello().rail == h.rail)
        || group.first().is_some_and(|r| r.hello().rails != h.rails)
    {
        return Err(Error::invalid(
            "peer",
            format!("rail {} of {}", h.rail, h.rails),
            "a rail already connected, or a different rail count",
        ));
    }
    group.push(setup);
    if group.len() < group[0].hello().rails as usize {
        return Ok(None);
    }
    let (_, mut group) = st.partial.remove(&key).expect("present");
    group.sort_by_key(|r| r.hello().rail);
    Ok(Some(group))
}

/// Drop the groups that began before `stale` (none when `None`), then the oldest while `max` or
/// more remain, making room for one more. Returns how many groups were dropped.
fn prune_partial<K: Copy + Eq + std::hash::Hash, T>(
    groups: &mut HashMap<K, (Instant, T)>,
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

/// A rail connected, authenticated and greeted, not yet part of an endpoint.
struct RailSetup {
    greeted: Greeted,
}

impl RailSetup {
    fn hello(&self) -> &Hello {
        &self.greeted.theirs
    }
}

/// Listen for endpoints on `addr` (`host:port`; port 0 picks one).
///
/// # Errors
///
/// [`Error::InvalidArgument`] for an address that does not resolve, or an engine without
/// rails; [`Error::Timeout`] when a name's resolver takes longer than the engine's
/// `connect_timeout`, or the process's resolver threads stay busy that long (see
/// `handshake::resolve`); as [`CmListener::bind`].
pub(crate) fn listen(engine: &Engine, addr: &str) -> Result<Listener> {
    engine.inner.require_rails()?;
    Ok(Listener {
        engine: engine.clone(),
        cm: CmListener::bind(resolve(addr, engine.inner.config.connect_timeout)?)?,
        hub: Arc::new(Hub {
            st: Mutex::new(HubState::default()),
            wake: eventfd()?,
            id: random()?,
        }),
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
    // Each name within the connect bound (a store's record may name hosts).
    let bound = engine.inner.config.connect_timeout;
    let peers: Vec<SocketAddr> = peers
        .iter()
        .map(|p| resolve(p, bound))
        .collect::<Result<_>>()?;
    let origin = Origin::Dialed {
        peers,
        publish: publish.to_vec(),
    };
    let connected = dial(&engine.inner, &origin)?;
    Rails::start(engine.clone(), connected, origin)
}

/// The peer of a connection, in words: its address (the GID's IPv4 form where it has one) and
/// queue pair.
fn describe(b: &ConnectionBinding) -> String {
    let g = b.peer_gid;
    if g.is_ipv4_mapped() {
        let a = std::net::Ipv4Addr::new(g.0[12], g.0[13], g.0[14], g.0[15]);
        format!("{a} (qp {:#x})", b.peer_qpn)
    } else {
        format!("{g} (qp {:#x})", b.peer_qpn)
    }
}

/// One handshake at the listener, on its own thread: the connection accepted, greeted and
/// authenticated by `deadline`, ended early by `stop`; its rail then joins its endpoint's
/// group, and the handshake completing a group publishes on all its rails.
fn handshake(
    engine: &Engine,
    hub: &Hub,
    req: ConnectRequest,
    publish: &[MemoryDescriptor],
    deadline: Instant,
    stop: &AtomicBool,
    authenticated: &AtomicBool,
) -> Result<Option<Ready>> {
    let e = &engine.inner;
    let mut opts = conn_opts(e);
    opts.timeout = e.config.handshake_timeout;
    let mut home = Home::new(e, 0);
    // A rail coming back: the endpoint its greeting names, whose session secret it proves.
    let endpoint = std::cell::Cell::new(None);
    let session_of = |h: &Hello| -> Result<Option<AuthKey>> {
        let link = hub.lock().accepted.get(&h.group).and_then(Weak::upgrade);
        let Some(link) = link else {
            return Err(Error::invalid(
                "hello.group",
                "no endpoint",
                "a rail comes back to an endpoint this listener accepted, still open",
            ));
        };
        let session = {
            let st = link.lock();
            if st.lanes.len() != h.rails as usize {
                return Err(Error::invalid(
                    "hello.rail",
                    format!("{} of {}", h.rail, h.rails),
                    format!("a rail of the endpoint's {}", st.lanes.len()),
                ));
            }
            st.session.clone()
        };
        endpoint.set(Some(link));
        Ok(session)
    };
    let conn = req.accept_until(&opts, |dev| home.resources(dev), deadline, stop)?;
    let peer = describe(&conn.binding());
    // The rail's index is the peer's: known only from its greeting.
    let greeted = greet(
        e,
        conn,
        home,
        greeting(e, hub.id, 0, 1, 0),
        &Greet {
            role: Role::Listener,
            peer,
            deadline,
            stop: Some(stop),
            authenticated: Some(authenticated),
            back: Back::Accept(&session_of),
        },
    )?;
    if greeted.theirs.back != 0 {
        let link = endpoint
            .take()
            .ok_or_else(|| Error::invalid("hello.group", "no endpoint", "looked up"))?;
        accept_back(&link, greeted, deadline, stop)?;
        hub.lock().stats.rails_restored += 1;
        return Ok(None);
    }
    let Some(group) = hub.join(RailSetup { greeted }, e.config.connect_timeout)? else {
        return Ok(None);
    };
    // Every rail of the endpoint is here: publish on each, in the dialer's rail order.
    let id = group[0].hello().group;
    let greeted = group.into_iter().map(|r| r.greeted).collect();
    publish_all(e, greeted, id, publish, deadline, Some(stop)).map(Some)
}

impl Listener {
    /// The port listened on.
    pub(crate) fn port(&self) -> u16 {
        self.cm.port()
    }

    /// What the listener has done and holds.
    pub(crate) fn stats(&self) -> ListenerStats {
        let st = self.hub.lock();
        ListenerStats {
            pending: st.running.len(),
            partial: st.partial.len(),
            ready: st.ready.len(),
            ..st.stats
        }
    }

    /// The errors of the handshakes refused lately (at most 16, oldest first), taken.
    pub(crate) fn take_refusals(&self) -> Vec<Error> {
        self.hub.lock().refusals.drain(..).collect()
    }

    /// Accept the next endpoint, by `timeout`: rails whose handshakes (started here, or by an
    /// earlier call) authenticated and completed an endpoint. Handshakes run on their own
    /// threads, each bounded by `handshake_timeout`; their first messages carry the `publish`
    /// of the call that started them. A handshake that fails does not end the call: it is
    /// counted ([`stats`](Self::stats)) and its error kept.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when no complete endpoint arrives within `timeout`; as
    /// [`Rails::start`]; [`Error::Os`] naming `poll`.
    pub(crate) fn accept(&self, publish: &[MemoryDescriptor], timeout: Duration) -> Result<Rails> {
        let deadline = deadline_after(Instant::now(), timeout);
        let publish = Arc::new(publish.to_vec());
        loop {
            let ready = {
                let mut st = self.hub.lock();
                reap(&mut st.threads);
                let age = self
                    .engine
                    .inner
                    .config
                    .connect_timeout
                    .saturating_mul(PARTIAL_AGE);
                let stale = Instant::now().checked_sub(age);
                st.stats.abandoned += prune_partial(&mut st.partial, stale, usize::MAX) as u64;
                let r = st.ready.pop_front();
                if r.is_some() {
                    st.stats.accepted += 1;
                }
                r
            };
            if let Some(connected) = ready {
                let group = connected.group;
                let rails = Rails::start(self.engine.clone(), connected, Origin::Accepted)?;
                let mut st = self.hub.lock();
                st.accepted.retain(|_, l| l.strong_count() > 0);
                // A group id already taken by a live endpoint keeps routing there (a new
                // endpoint naming it cannot take another's rails).
                st.accepted
                    .entry(group)
                    .or_insert_with(|| Arc::downgrade(rails.link()));
                return Ok(rails);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    what: "an endpoint to accept",
                    after: timeout,
                });
            }
            let (request, _) = self.wait(left)?;
            if request {
                // Another event than a request (none is expected): nothing to do.
                if let Ok(req) = self.cm.next_request(Duration::ZERO) {
                    self.start(req, &publish, deadline)?;
                }
            }
        }
    }

    /// Wait up to `left` for a connection request or a handshake's end: (a request is waiting,
    /// a handshake ended).
    fn wait(&self, left: Duration) -> Result<(bool, bool)> {
        let mut p = [
            libc::pollfd {
                fd: self.cm.as_fd().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.hub.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: two valid pollfds for the call.
        let r = unsafe { libc::poll(p.as_mut_ptr(), 2, ms) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok((false, false));
            }
            return Err(Error::Os {
                call: "poll",
                source: e,
            });
        }
        let ended = p[1].revents & libc::POLLIN != 0;
        if ended {
            self.hub.drain();
        }
        Ok((p[0].revents & libc::POLLIN != 0, ended))
    }

    /// Start a handshake for `req` on its own thread, making room first: with `max_pending`
    /// running, the oldest not authenticated yet is ended (and its end waited for, by
    /// `deadline`); when every one is authenticated, `req` is rejected.
    fn start(
        &self,
        req: ConnectRequest,
        publish: &Arc<Vec<MemoryDescriptor>>,
        deadline: Instant,
    ) -> Result<()> {
        let max = self.engine.inner.config.max_pending;
        loop {
            {
                let mut st = self.hub.lock();
                if st.running.len() < max {
                    let n = st.next;
                    st.next += 1;
                    let stop = Arc::new(AtomicBool::new(false));
                    let authenticated = Arc::new(AtomicBool::new(false));
                    st.running.insert(
                        n,
                        Running {
                            since: Instant::now(),
                            authenticated: authenticated.clone(),
                            stop: stop.clone(),
                        },
                    );
                    st.stats.peak_pending = st.stats.peak_pending.max(st.running.len());
                    let (engine, hub, publish) =
                        (self.engine.clone(), self.hub.clone(), publish.clone());
                    let deadline =
                        deadline_after(Instant::now(), self.engine.inner.config.handshake_timeout);
                    let spawned =
                        crate::driver::ctx::spawn_thread("gpudirect-handshake", move || {
                            let r = handshake(
                                &engine,
                                &hub,
                                req,
                                &publish,
                                deadline,
                                &stop,
                                &authenticated,
                            );
                            hub.finish(n, r);
                        });
                    match spawned {
                        Ok(t) => st.threads.push(t),
                        Err(e) => {
                            // The request went with the closure: rejected.
                            st.running.remove(&n);
                            refused(&mut st, e);
                        }
                    }
                    return Ok(());
                }
                let ending = st.running.values().any(|h| h.stop.load(Ordering::Acquire));
                let oldest = st
                    .running
                    .values()
                    .filter(|h| !h.authenticated.load(Ordering::Acquire))
                    .filter(|h| !h.stop.load(Ordering::Acquire))
                    .min_by_key(|h| h.since);
                match oldest {
                    Some(h) => {
                        h.stop.store(true, Ordering::Release);
                        st.stats.dropped += 1;
                    }
                    None if !ending => {
                        st.stats.turned_away += 1;
                        return Ok(()); // `req` rejected as it goes
                    }
                    None => {}
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                self.hub.lock().stats.turned_away += 1;
                return Ok(());
            }
            // A handshake ended (or 20 ms passed): look again.
            let mut p = libc::pollfd {
                fd: self.hub.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().clamp(1, 20) as i32;
            // SAFETY: one valid pollfd for the call.
            unsafe { libc::poll(&mut p, 1, ms) };
            self.hub.drain();
        }
    }
}

/// Join the handshake threads that ended.
fn reap(threads: &mut Vec<JoinHandle<()>>) {
    let mut i = 0;
    while i < threads.len() {
        if threads[i].is_finished() {
            let _ = threads.swap_remove(i).join();
        } else {
            i += 1;
        }
    }
}

impl Drop for Listener {
    /// Every running handshake ended and its thread joined; the rails kept are dropped.
    fn drop(&mut self) {
        let threads = {
            let mut st = self.hub.lock();
            for h in st.running.values() {
                h.stop.store(true, Ordering::Release);
            }
            std::mem::take(&mut st.threads)
        };
        for t in threads {
            let _ = t.join();
        }
        let mut st = self.hub.lock();
        st.partial.clear();
        st.ready.clear();
        st.accepted.clear();
    }
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
