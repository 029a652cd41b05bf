//! An engine's membership: the store it uses, the record it publishes ([`Advertise`]), and the
//! peers its named endpoints reach. A thread watches the store; when a tracked peer's record
//! leaves and does not come back within half its TTL (time for a node cut off from the store,
//! not from its peers, to publish again), every endpoint to it ends with
//! [`Error::PeerLeft`]. A peer that publishes again under a new node identity (it restarted)
//! ends the old one's endpoints at once.

use super::name::{HostId, NodeId, SegmentName};
use super::record::MemberRecord;
use super::store::{MemberEvent, MemberWatch, MetadataStore, Publication};
use crate::completion::thread::join_unless_current;
use crate::error::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The lease TTL a publication has unless told otherwise.
pub(super) const DEFAULT_TTL: Duration = Duration::from_secs(5);
/// How often the watching thread looks at its deadlines and whether to stop.
const TICK: Duration = Duration::from_millis(50);
/// How long a departed node is remembered (an endpoint made to it meanwhile ends at once).
const REMEMBER: Duration = Duration::from_secs(600);
/// The most departed nodes remembered: past it the oldest are forgotten first (a churn of
/// node identities by another job costs bounded memory).
const REMEMBER_MAX: usize = 1 << 16;
/// The longest wait before watching again after a watch ended (it doubles from [`TICK`]).
const REWATCH_MAX: Duration = Duration::from_secs(5);

/// What an engine publishes about itself ([`Engine::publish_as`](crate::transfer::Engine::publish_as)):
/// where peers reach it, and its lease's TTL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Advertise {
    /// The rails' `host:port` addresses peers connect to, in rail order (where the engine's
    /// [`TransferListener`](crate::transfer::TransferListener) listens, as reachable from
    /// peers: not `0.0.0.0`).
    pub rails: Vec<String>,
    /// The Unix socket of the engine's
    /// [`LocalListener`](crate::transfer::Engine::connect_local), for peers on this host.
    pub local: Option<PathBuf>,
    /// This host's identity; `None`: [`HostId::this_host`].
    pub host: Option<HostId>,
    /// The lease's TTL (default 5 s, 1 s to 1 h): a member is gone this long after it stopped
    /// renewing it, and its peers' endpoints end within twice this.
    pub ttl: Duration,
}

impl Advertise {
    /// Reachable at these rail addresses (`host:port`, rail order).
    pub fn rails<S: AsRef<str>>(addrs: impl IntoIterator<Item = S>) -> Advertise {
        Advertise {
            rails: addrs.into_iter().map(|a| a.as_ref().to_string()).collect(),
            local: None,
            host: None,
            ttl: DEFAULT_TTL,
        }
    }

    /// Reachable only inside this host, at the local listener's socket `path`.
    pub fn local_only(path: impl Into<PathBuf>) -> Advertise {
        Advertise {
            local: Some(path.into()),
            ..Advertise::rails(Vec::<String>::new())
        }
    }

    /// Also reachable inside this host at the local listener's socket `path`.
    pub fn local(mut self, path: impl Into<PathBuf>) -> Advertise {
        self.local = Some(path.into());
        self
    }

    /// With this lease TTL.
    pub fn ttl(mut self, ttl: Duration) -> Advertise {
        self.ttl = ttl;
        self
    }

    /// With this host identity.
    pub fn host(mut self, host: HostId) -> Advertise {
        self.host = Some(host);
        self
    }
}

/// An endpoint the roster ends when its peer leaves.
pub(crate) trait Tracked: Send + Sync {
    /// Whether the endpoint is still open somewhere.
    fn alive(&self) -> bool;
    /// The peer (segment `name`, node `node`) left: end the endpoint with
    /// [`Error::PeerLeft`].
    fn peer_left(&self, name: &SegmentName, node: NodeId);
}

struct Peer {
    name: SegmentName,
    ttl: Duration,
    endpoints: Vec<Box<dyn Tracked>>,
    /// Its record left: the endpoints end at this time unless it comes back.
    leaving: Option<Instant>,
}

#[derive(Default)]
struct Peers {
    by_node: HashMap<NodeId, Peer>,
    /// Who holds each name, as the watch said.
    view: HashMap<SegmentName, NodeId>,
    /// Nodes whose record left, and when.
    departed: HashMap<NodeId, Instant>,
    /// `departed` in the order they left (an entry whose time differs from the map's is stale:
    /// the node left again later), for forgetting the oldest.
    departures: VecDeque<(Instant, NodeId)>,
    /// When `departed` was last pruned.
    pruned: Option<Instant>,
}

impl Peers {
    /// `node` left at `at`.
    fn depart(&mut self, node: NodeId, at: Instant) {
        self.departed.insert(node, at);
        self.departures.push_back((at, node));
    }

    /// Forget departures older than [`REMEMBER`], and the oldest past [`REMEMBER_MAX`]: at
    /// most once a [`TICK`], not at every event.
    fn prune(&mut self, now: Instant) {
        // Stale entries (nodes that left again, or came back) behind a front that stays: kept
        // no more than about twice the map.
        if self.departures.len() > 2 * self.departed.len() + 1024 {
            let departed = &self.departed;
            self.departures
                .retain(|(at, n)| departed.get(n) == Some(at));
        }
        if self
            .pruned
            .is_some_and(|t| now.saturating_duration_since(t) < TICK)
            && self.departures.len() <= 2 * REMEMBER_MAX
        {
            return;
        }
        self.pruned = Some(now);
        while let Some(&(at, node)) = self.departures.front() {
            let live = self.departed.get(&node) == Some(&at);
            let old = now.saturating_duration_since(at) >= REMEMBER;
            if live && !old && self.departed.len() <= REMEMBER_MAX {
                break;
            }
            self.departures.pop_front();
            if live {
                self.departed.remove(&node);
            }
        }
    }
}

#[derive(Default)]
struct Shared {
    peers: Mutex<Peers>,
    stop: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Peers> {
        self.peers.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Default)]
struct State {
    store: Option<Arc<dyn MetadataStore>>,
    own: Option<Publication>,
    /// A publish is under way (outside the lock): another is refused, as once `own` is set.
    publishing: bool,
    /// An unpublish came while a publish was under way: that publish withdraws what it made.
    withdraw: bool,
    node: Option<NodeId>,
    watcher: Option<JoinHandle<()>>,
}

/// An engine's membership (see the file's docs). Nothing runs until a store is attached.
#[derive(Default)]
pub(crate) struct Roster {
    state: Mutex<State>,
    shared: Arc<Shared>,
}

fn membership_event(event: &'static str) {
    metrics::counter!("gpudirect_membership_events_total", "event" => event).increment(1);
}

impl Roster {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Use `store` (made by `make` unless one is attached): the first store attached stays;
    /// the same store again is fine.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for another store; the store's errors from starting its
    /// watch; as [`spawn_thread`](crate::driver::ctx::spawn_thread).
    pub(crate) fn attach(
        &self,
        instance: usize,
        make: impl FnOnce() -> Arc<dyn MetadataStore>,
    ) -> Result<Arc<dyn MetadataStore>> {
        let mut st = self.lock();
        if let Some(s) = &st.store {
            if s.instance() != instance {
                return Err(Error::invalid(
                    "store",
                    s.kind(),
                    "an engine uses one metadata store: the one it was first given",
                ));
            }
            return Ok(s.clone());
        }
        let store = make();
        let watch = store.watch()?;
        let shared = self.shared.clone();
        let s = store.clone();
        st.watcher = Some(crate::driver::ctx::spawn_thread(
            "gpudirect-membership",
            move || watch_loop(&shared, &*s, watch),
        )?);
        st.store = Some(store.clone());
        Ok(store)
    }

    /// The store attached.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when none is.
    pub(crate) fn store(&self) -> Result<Arc<dyn MetadataStore>> {
        self.lock().store.clone().ok_or_else(|| {
            Error::invalid(
                "store",
                "none",
                "give the engine a metadata store first (Engine::publish_as or Engine::use_store)",
            )
        })
    }

    /// This engine's node identity, drawn on first use.
    ///
    /// # Errors
    ///
    /// As [`NodeId::random`].
    pub(crate) fn node(&self) -> Result<NodeId> {
        let mut st = self.lock();
        if let Some(n) = st.node {
            return Ok(n);
        }
        let n = NodeId::random()?;
        st.node = Some(n);
        Ok(n)
    }

    /// Publish `rec` in the attached store.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the engine already publishes a name; as
    /// [`MetadataStore::publish`].
    pub(crate) fn publish(&self, rec: &MemberRecord) -> Result<()> {
        let store = self.store()?;
        {
            let mut st = self.lock();
            if let Some(p) = &st.own {
                return Err(Error::invalid(
                    "segment name",
                    rec.name.as_str(),
                    format!(
                        "the engine publishes {:?} already: unpublish first",
                        p.record().name.as_str()
                    ),
                ));
            }
            // Two publishes at once would both put the record (the same node may), and the
            // one that lost, dropped, would withdraw the other's.
            if st.publishing {
                return Err(Error::invalid(
                    "segment name",
                    rec.name.as_str(),
                    "the engine is publishing a name already (another thread's publish_as)",
                ));
            }
            st.publishing = true;
        }
        // Let go of the mark whatever happens in the store, a panic included.
        struct Done<'a>(&'a Roster);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                let mut st = self.0.lock();
                st.publishing = false;
                st.withdraw = false;
            }
        }
        let done = Done(self);
        let p = store.publish(rec)?;
        let mut st = self.lock();
        if st.withdraw {
            drop(st);
            // Withdrawn as an unpublish would (dropping it revokes it), before the mark goes:
            // a publish or unpublish meanwhile still sees this one under way.
            drop(p);
            drop(done);
            return Err(Error::invalid(
                "segment name",
                rec.name.as_str(),
                "unpublished while it was being published",
            ));
        }
        st.own = Some(p);
        drop(st);
        drop(done);
        Ok(())
    }

    /// The record published, if any.
    pub(crate) fn published(&self) -> Option<MemberRecord> {
        self.lock().own.as_ref().map(|p| p.record().clone())
    }

    /// Withdraw the published record (peers see it leave). A publish under way on another
    /// thread withdraws what it made as soon as the store answers it (and fails).
    ///
    /// # Errors
    ///
    /// As [`Publication::revoke`].
    pub(crate) fn unpublish(&self, timeout: Duration) -> Result<()> {
        let own = {
            let mut st = self.lock();
            if st.publishing {
                st.withdraw = true;
                return Ok(());
            }
            st.own.take()
        };
        own.map_or(Ok(()), |p| p.revoke(timeout))
    }

    /// End `ep` when `rec`'s node leaves (at once if it left already).
    pub(crate) fn track(&self, rec: &MemberRecord, ep: Box<dyn Tracked>) {
        let mut p = self.shared.lock();
        let gone = p.departed.get(&rec.node).copied();
        let peer = p.by_node.entry(rec.node).or_insert_with(|| Peer {
            name: rec.name.clone(),
            ttl: rec.ttl,
            endpoints: Vec::new(),
            leaving: None,
        });
        peer.endpoints.retain(|e| e.alive());
        peer.endpoints.push(ep);
        if let Some(at) = gone {
            peer.leaving.get_or_insert(at + rec.ttl / 2);
        }
    }
}

impl Drop for Roster {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = st.watcher.take() {
            join_unless_current(t);
        }
        // Dropping the publication revokes it.
        st.own = None;
    }
}

/// Apply one event.
fn apply(p: &mut Peers, ev: MemberEvent, now: Instant) {
    match ev {
        MemberEvent::Joined(r) => {
            membership_event("joined");
            if let Some(old) = p.view.insert(r.name.clone(), r.node)
                && old != r.node
            {
                p.depart(old, now);
            }
            // The name is held by another node now: any other node under it is gone.
            for (n, peer) in &mut p.by_node {
                if peer.name == r.name && *n != r.node {
                    peer.leaving = Some(now);
                }
            }
            p.departed.remove(&r.node);
            if let Some(peer) = p.by_node.get_mut(&r.node) {
                peer.leaving = None;
                peer.ttl = r.ttl;
            }
        }
        MemberEvent::Left { name, node } => {
            membership_event("left");
            if p.view.get(&name) == Some(&node) {
                p.view.remove(&name);
            }
            p.depart(node, now);
            if let Some(peer) = p.by_node.get_mut(&node) {
                peer.leaving.get_or_insert(now + peer.ttl / 2);
            }
        }
    }
}

/// The peers whose time to leave has come, taken out; the earliest deadline left.
fn due(p: &mut Peers, now: Instant) -> (Vec<(NodeId, Peer)>, Option<Instant>) {
    let nodes: Vec<NodeId> = p
        .by_node
        .iter()
        .filter(|(_, peer)| peer.leaving.is_some_and(|t| t <= now))
        .map(|(n, _)| *n)
        .collect();
    let gone = nodes
        .into_iter()
        .filter_map(|n| p.by_node.remove(&n).map(|peer| (n, peer)))
        .collect();
    p.by_node.retain(|_, peer| {
        peer.endpoints.retain(|e| e.alive());
        !peer.endpoints.is_empty() || peer.leaving.is_some()
    });
    p.prune(now);
    let next = p.by_node.values().filter_map(|peer| peer.leaving).min();
    (gone, next)
}

/// Lookups of at most this many tracked peers per round of the watching thread (the rest
/// wait for the next round: events and deadlines are not held up by a long recheck).
const RECHECK_BATCH: usize = 64;

/// The tracked peers to look up after a watch ended and a new one began: the events between
/// the two watches are lost, and the new watch's first list says only who is there. Looked up
/// after the new watch listed (a leave after that comes as its event).
struct Recheck {
    pending: VecDeque<(SegmentName, NodeId)>,
    /// Not before this (after a store error: a pause that doubles to [`REWATCH_MAX`]).
    at: Instant,
    pause: Duration,
}

impl Recheck {
    /// Every tracked peer not already leaving.
    fn of(shared: &Shared, now: Instant) -> Recheck {
        let pending = shared
            .lock()
            .by_node
            .iter()
            .filter(|(_, peer)| peer.leaving.is_none())
            .map(|(n, peer)| (peer.name.clone(), *n))
            .collect();
        Recheck {
            pending,
            at: now,
            pause: TICK,
        }
    }

    /// Look up the next [`RECHECK_BATCH`] peers: one whose record is gone, another node's, or
    /// not a record this library reads (as a list would leave it out) counts as left. A store
    /// error puts the rest off. Returns whether every peer was looked up.
    fn round(&mut self, shared: &Shared, store: &dyn MetadataStore, now: Instant) -> bool {
        if now < self.at {
            return false;
        }
        let mut gone = Vec::new();
        for _ in 0..RECHECK_BATCH {
            let Some((name, node)) = self.pending.pop_front() else {
                break;
            };
            match store.lookup(&name) {
                Ok(Some(r)) if r.node == node => {}
                Err(Error::Store { .. }) => {
                    // Last in line (the next round starts with the others), after a pause.
                    self.pending.push_back((name, node));
                    self.at = now + self.pause;
                    self.pause = (self.pause * 2).min(REWATCH_MAX);
                    break;
                }
                _ => gone.push((name, node)),
            }
        }
        let mut p = shared.lock();
        for (name, node) in gone {
            apply(&mut p, MemberEvent::Left { name, node }, now);
        }
        self.pending.is_empty()
    }
}

/// The watching thread: events in, endpoints of departed peers ended (outside the lock). A
/// watch that ends (its events left unread past its queue) is watched again after a pause
/// that doubles, from [`TICK`] to [`REWATCH_MAX`], while watches keep ending, and the tracked
/// peers are looked up ([`Recheck`]).
fn watch_loop(shared: &Shared, store: &dyn MetadataStore, mut watch: MemberWatch) {
    let mut next: Option<Instant> = None;
    let mut pause = TICK;
    let mut recheck: Option<Recheck> = None;
    while !shared.stop.load(Ordering::Relaxed) {
        let wait = next
            .map(|t| t.saturating_duration_since(Instant::now()))
            .unwrap_or(TICK)
            .min(TICK);
        match watch.next_timeout(wait) {
            Ok(Some(ev)) => apply(&mut shared.lock(), ev, Instant::now()),
            // Caught up: a watch that ends after this is watched again soon.
            Ok(None) => pause = TICK,
            Err(_) => {
                let until = Instant::now() + pause;
                while Instant::now() < until && !shared.stop.load(Ordering::Relaxed) {
                    std::thread::sleep(TICK.min(until.saturating_duration_since(Instant::now())));
                }
                pause = (pause * 2).min(REWATCH_MAX);
                if let Ok(w) = store.watch() {
                    watch = w;
                    recheck = Some(Recheck::of(shared, Instant::now()));
                }
            }
        }
        if let Some(r) = &mut recheck
            && r.round(shared, store, Instant::now())
        {
            recheck = None;
        }
        let (gone, n) = due(&mut shared.lock(), Instant::now());
        next = n;
        for (node, peer) in gone {
            membership_event("peer_ended");
            for ep in peer.endpoints {
                ep.peer_left(&peer.name, node);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::embedded::EmbeddedStore;
    use super::super::record::sample;
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[derive(Clone, Default)]
    struct Probe(Arc<(AtomicUsize, Mutex<Option<Instant>>)>);

    impl Tracked for Probe {
        fn alive(&self) -> bool {
            true
        }
        fn peer_left(&self, _: &SegmentName, _: NodeId) {
            self.0.0.fetch_add(1, Ordering::Relaxed);
            *self.0.1.lock().unwrap() = Some(Instant::now());
        }
    }

    fn roster(store: &EmbeddedStore) -> Roster {
        let r = Roster::default();
        let s = store.clone();
        r.attach(s.instance(), move || Arc::new(s)).unwrap();
        r
    }

    fn wait_for(probe: &Probe, within: Duration) -> Option<Instant> {
        let until = Instant::now() + within;
        while Instant::now() < until {
            if let Some(t) = *probe.0.1.lock().unwrap() {
                return Some(t);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    }

    #[test]
    fn a_peer_whose_lease_expires_ends_within_twice_its_ttl() {
        let store = EmbeddedStore::new();
        let mut rec = sample("peer");
        rec.ttl = Duration::from_secs(1);
        let _p = store.publish(&rec).unwrap();
        let me = roster(&store);
        let probe = Probe::default();
        me.track(&rec, Box::new(probe.clone()));
        let t0 = Instant::now();
        store.suspend("peer").unwrap();
        let ended = wait_for(&probe, Duration::from_secs(5)).expect("ended");
        let took = ended - t0;
        assert!(took >= rec.ttl && took <= 2 * rec.ttl, "{took:?}");
        assert_eq!(probe.0.0.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_peer_back_within_the_grace_keeps_its_endpoints() {
        let store = EmbeddedStore::new();
        let mut rec = sample("peer");
        rec.ttl = Duration::from_secs(2);
        let _p = store.publish(&rec).unwrap();
        let me = roster(&store);
        let probe = Probe::default();
        me.track(&rec, Box::new(probe.clone()));
        // Cut off from the store just long enough to lose its lease, then back.
        store.expire("peer");
        std::thread::sleep(Duration::from_millis(300));
        assert!(store.resume("peer"));
        assert!(wait_for(&probe, Duration::from_secs(2)).is_none());
    }

    #[test]
    fn a_restart_under_the_same_name_ends_the_old_node_at_once() {
        let store = EmbeddedStore::new();
        let rec = sample("peer");
        let p = store.publish(&rec).unwrap();
        let me = roster(&store);
        let probe = Probe::default();
        me.track(&rec, Box::new(probe.clone()));
        // Revoked and published again by a new process: gone for half the TTL, then at once.
        drop(p);
        let mut again = sample("peer");
        again.node = NodeId::random().unwrap();
        let _p2 = store.publish(&again).unwrap();
        assert!(wait_for(&probe, Duration::from_secs(1)).is_some());
    }

    #[test]
    fn an_endpoint_made_to_a_departed_node_ends() {
        let store = EmbeddedStore::new();
        let mut rec = sample("peer");
        rec.ttl = Duration::from_secs(1);
        let p = store.publish(&rec).unwrap();
        let me = roster(&store);
        drop(p);
        std::thread::sleep(Duration::from_millis(100));
        let probe = Probe::default();
        me.track(&rec, Box::new(probe.clone()));
        assert!(wait_for(&probe, Duration::from_secs(2)).is_some());
    }

    /// Other members come and go, one more than half of what a watch holds unread each: a
    /// watch not read meanwhile ends.
    fn churn(store: &EmbeddedStore) {
        for i in 0..=super::super::feed::MAX_QUEUED / 2 {
            drop(store.publish(&sample(&format!("churn-{i}"))).unwrap());
        }
    }

    /// A tracked peer (TTL 1 s) that leaves while the watching thread is held up (here on its
    /// lock) and other members come and go past what its watch holds unread: the watch ends.
    /// `then` runs before the thread goes on.
    fn leave_in_an_overflow(then: impl FnOnce(&EmbeddedStore)) -> (EmbeddedStore, Roster, Probe) {
        let store = EmbeddedStore::new();
        let mut rec = sample("peer");
        rec.ttl = Duration::from_secs(1);
        let p = store.publish(&rec).unwrap();
        let me = roster(&store);
        let probe = Probe::default();
        me.track(&rec, Box::new(probe.clone()));
        {
            let _held = me.shared.lock();
            churn(&store);
            drop(p);
            then(&store);
        }
        (store, me, probe)
    }

    #[test]
    fn a_leave_while_the_watch_overflowed_still_ends_the_endpoints() {
        let (_store, _me, probe) = leave_in_an_overflow(|_| {});
        assert!(wait_for(&probe, Duration::from_secs(5)).is_some());
        assert_eq!(probe.0.0.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_peer_whose_name_turned_unreadable_while_the_watch_overflowed_ends() {
        // Another format version under the name now: no record this library reads.
        let gets = std::cell::Cell::new(0);
        let (store, _me, probe) = leave_in_an_overflow(|s| {
            s.put_raw("peer", b"gpudirect-member/2\nname=peer\n");
            gets.set(s.ops().gets);
        });
        assert!(wait_for(&probe, Duration::from_secs(5)).is_some());
        std::thread::sleep(Duration::from_millis(300));
        // Looked up once, not at every round.
        assert_eq!(store.ops().gets - gets.get(), 1);
    }

    #[test]
    fn stale_departures_stay_within_a_bound() {
        let mut p = Peers::default();
        let t0 = Instant::now();
        let (a, b) = (NodeId::random().unwrap(), NodeId::random().unwrap());
        // One node gone at the front; another leaving and coming back behind it.
        p.depart(a, t0);
        for i in 0..(4 * REMEMBER_MAX) {
            let at = t0 + Duration::from_millis(i as u64);
            p.depart(b, at);
            p.departed.remove(&b);
            p.prune(at);
        }
        assert_eq!(p.departed.len(), 1);
        assert!(
            p.departures.len() <= 2 * p.departed.len() + 1025,
            "{}",
            p.departures.len()
        );
    }

    #[test]
    fn departed_nodes_are_remembered_within_a_bound() {
        let mut p = Peers::default();
        let t0 = Instant::now();
        let nodes: Vec<NodeId> = (0..REMEMBER_MAX + 100)
            .map(|_| NodeId::random().unwrap())
            .collect();
        for (i, n) in nodes.iter().enumerate() {
            p.depart(*n, t0 + Duration::from_micros(i as u64));
        }
        // A node that left twice: its first departure is stale.
        p.depart(nodes[0], t0 + Duration::from_secs(1));
        p.prune(t0 + Duration::from_secs(2));
        assert_eq!(p.departed.len(), REMEMBER_MAX);
        // The oldest went first; the one that left again stays.
        assert!(!p.departed.contains_key(&nodes[1]));
        assert!(p.departed.contains_key(&nodes[0]));
        assert!(p.departed.contains_key(&nodes[REMEMBER_MAX + 99]));
        // And all of them once REMEMBER has passed.
        p.prune(t0 + REMEMBER + Duration::from_secs(3));
        assert!(p.departed.is_empty() && p.departures.is_empty());
    }

    /// The embedded store, its publishes taking 200 ms, its lookups of the name "bad" failing
    /// as a store that cannot be reached.
    #[derive(Clone)]
    struct Slow(EmbeddedStore);

    impl MetadataStore for Slow {
        fn kind(&self) -> &'static str {
            "slow"
        }
        fn publish(&self, r: &MemberRecord) -> Result<Publication> {
            std::thread::sleep(Duration::from_millis(200));
            self.0.publish(r)
        }
        fn lookup(&self, n: &SegmentName) -> Result<Option<MemberRecord>> {
            if n.as_str() == "bad" {
                return Err(Error::Store {
                    store: "slow",
                    op: "lookup",
                    reason: "no answer".into(),
                });
            }
            self.0.lookup(n)
        }
        fn members(&self) -> Result<Vec<MemberRecord>> {
            self.0.members()
        }
        fn watch(&self) -> Result<MemberWatch> {
            self.0.watch()
        }
        fn ops(&self) -> super::super::store::StoreOps {
            self.0.ops()
        }
        fn instance(&self) -> usize {
            self.0.instance()
        }
    }

    #[test]
    fn an_unpublish_during_a_publish_withdraws_it() {
        let store = Slow(EmbeddedStore::new());
        let r = Arc::new(Roster::default());
        let s = store.clone();
        r.attach(s.instance(), move || Arc::new(s)).unwrap();
        let mut rec = sample("me");
        rec.node = r.node().unwrap();
        let (r2, rec2) = (r.clone(), rec.clone());
        let publishing = std::thread::spawn(move || r2.publish(&rec2));
        std::thread::sleep(Duration::from_millis(50));
        r.unpublish(Duration::from_secs(1)).unwrap();
        // The publish withdraws what it made, and says so.
        assert!(matches!(
            publishing.join().unwrap(),
            Err(Error::InvalidArgument { .. })
        ));
        assert_eq!(r.published(), None);
        assert_eq!(store.lookup(&rec.name).unwrap(), None);
        // And the name can be published again.
        r.publish(&rec).unwrap();
        assert_eq!(store.lookup(&rec.name).unwrap(), Some(rec.clone()));
    }

    #[test]
    fn one_failing_lookup_does_not_hold_up_the_others() {
        let store = Slow(EmbeddedStore::new());
        let me = Roster::default();
        let s = store.clone();
        me.attach(s.instance(), move || Arc::new(s)).unwrap();
        let (mut pubs, mut probes) = (Vec::new(), Vec::new());
        for name in std::iter::once("bad".to_string()).chain((0..16).map(|i| format!("p{i}"))) {
            let mut rec = sample(&name);
            rec.ttl = Duration::from_secs(1);
            pubs.push(store.0.publish(&rec).unwrap());
            let probe = Probe::default();
            me.track(&rec, Box::new(probe.clone()));
            if name != "bad" {
                probes.push(probe);
            }
        }
        {
            // All of them leave while the watch overflows.
            let _held = me.shared.lock();
            churn(&store.0);
            pubs.clear();
        }
        for p in &probes {
            assert!(wait_for(p, Duration::from_secs(8)).is_some());
        }
    }

    #[test]
    fn one_store_per_engine() {
        let (a, b) = (EmbeddedStore::new(), EmbeddedStore::new());
        let r = roster(&a);
        let a2 = a.clone();
        assert!(r.attach(a2.instance(), move || Arc::new(a2)).is_ok());
        let b2 = b.clone();
        assert!(r.attach(b2.instance(), move || Arc::new(b2)).is_err());
        let mut rec = sample("me");
        rec.node = r.node().unwrap();
        r.publish(&rec).unwrap();
        assert!(r.publish(&rec).is_err());
        assert_eq!(r.published(), Some(rec.clone()));
        r.unpublish(Duration::from_secs(1)).unwrap();
        assert!(a.members().unwrap().is_empty());
    }
}
