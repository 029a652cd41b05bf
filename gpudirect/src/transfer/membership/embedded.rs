//! The store that needs no server: names resolved inside one process ([`EmbeddedStore`]). Its
//! leases live as long as their publications, and tests can stop one from being renewed
//! ([`EmbeddedStore::suspend`]: the record expires after its TTL, as a stopped node's does in
//! etcd) and let it publish again ([`EmbeddedStore::resume`]).

use super::feed::{Sender, channel};
use super::name::{NodeId, SegmentName};
use super::record::MemberRecord;
use super::store::{
    Lease, MemberEvent, MemberWatch, MetadataStore, OpCounters, Publication, StoreOps,
};
use crate::error::{Error, Result};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

/// One publisher: its record and its current lease.
struct Publisher {
    record: MemberRecord,
    bytes: Vec<u8>,
    lease: AtomicU64,
    republished: AtomicU64,
    revoked: AtomicBool,
}

/// A live record.
struct Entry {
    /// The record as published: read back through the same checks as any store's bytes.
    bytes: Vec<u8>,
    node: NodeId,
    publisher: Arc<Publisher>,
    /// Not renewed since then ([`EmbeddedStore::suspend`]).
    suspended: Option<Instant>,
}

#[derive(Default)]
struct State {
    entries: BTreeMap<String, Entry>,
    /// Publishers whose lease expired while suspended: [`EmbeddedStore::resume`] publishes them
    /// again.
    lost: HashMap<String, Arc<Publisher>>,
    watchers: Vec<Sender<MemberEvent>>,
    next_lease: u64,
    reaper: bool,
}

#[derive(Default)]
struct Inner {
    state: Mutex<State>,
    ops: OpCounters,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl State {
    fn tell(&mut self, ev: MemberEvent) {
        self.watchers.retain(|w| w.send(ev.clone()));
    }

    fn lease(&mut self) -> u64 {
        self.next_lease += 1;
        self.next_lease
    }

    /// Put `p`'s record under a new lease; `false` when another node holds the name.
    fn put(&mut self, p: &Arc<Publisher>) -> bool {
        let name = p.record.name.as_str();
        if self
            .entries
            .get(name)
            .is_some_and(|e| e.node != p.record.node)
        {
            return false;
        }
        let lease = self.lease();
        p.lease.store(lease, Ordering::Relaxed);
        let fresh = !self.entries.contains_key(name);
        self.entries.insert(
            name.to_string(),
            Entry {
                bytes: p.bytes.clone(),
                node: p.record.node,
                publisher: p.clone(),
                suspended: None,
            },
        );
        if fresh {
            self.tell(MemberEvent::Joined(p.record.clone()));
        }
        true
    }

    /// Remove `name`'s record (its lease ended) and tell the watchers.
    fn remove(&mut self, name: &str) -> Option<Entry> {
        let e = self.entries.remove(name)?;
        self.tell(MemberEvent::Left {
            name: e.publisher.record.name.clone(),
            node: e.node,
        });
        Some(e)
    }

    /// Expire the suspended records whose TTL has passed; the earliest expiry left.
    fn reap(&mut self, now: Instant) -> Option<Instant> {
        let due: Vec<String> = self
            .entries
            .iter()
            .filter(|(_, e)| {
                e.suspended
                    .is_some_and(|s| s + e.publisher.record.ttl <= now)
            })
            .map(|(k, _)| k.clone())
            .collect();
        for k in due {
            if let Some(e) = self.remove(&k) {
                self.lost.insert(k, e.publisher);
            }
        }
        self.entries
            .values()
            .filter_map(|e| e.suspended.map(|s| s + e.publisher.record.ttl))
            .min()
    }
}

/// A metadata store inside this process: engines of one process find each other by name with
/// no server (and a single node needs nothing more). Cheap to clone: clones share the names.
///
/// Each record's lease lives as long as its [`Publication`]. For tests of failure,
/// [`suspend`](Self::suspend) stops a lease from being renewed (the record expires after its
/// TTL and watchers see it leave, as in etcd when a node is stopped or cut off) and
/// [`resume`](Self::resume) lets its publisher publish again.
#[derive(Clone, Default)]
pub struct EmbeddedStore {
    inner: Arc<Inner>,
}

impl EmbeddedStore {
    /// An empty store.
    pub fn new() -> EmbeddedStore {
        EmbeddedStore::default()
    }

    /// Stop renewing `name`'s lease, as if its node were stopped or cut off: the record
    /// expires one TTL from now. `false` when no record has that name.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `pthread_create` when the thread that expires leases cannot start.
    pub fn suspend(&self, name: &str) -> Result<bool> {
        let mut st = self.inner.lock();
        let Some(e) = st.entries.get_mut(name) else {
            return Ok(false);
        };
        e.suspended.get_or_insert_with(Instant::now);
        if !st.reaper {
            let weak = Arc::downgrade(&self.inner);
            crate::driver::ctx::spawn_thread("gpudirect-embedded-leases", move || reaper(weak))?;
            st.reaper = true;
        }
        Ok(true)
    }

    /// Expire `name`'s lease now (its publisher stays suspended until
    /// [`resume`](Self::resume)). `false` when no record has that name.
    pub fn expire(&self, name: &str) -> bool {
        let mut st = self.inner.lock();
        match st.remove(name) {
            Some(e) => {
                st.lost.insert(name.to_string(), e.publisher);
                true
            }
            None => false,
        }
    }

    /// Renew `name`'s lease again, as its node does when it runs again: a record not yet
    /// expired stays; an expired one is published again under a new lease (if the name is
    /// still free). `false` when `name` has no suspended or expired publisher.
    pub fn resume(&self, name: &str) -> bool {
        let mut st = self.inner.lock();
        if let Some(e) = st.entries.get_mut(name) {
            return e.suspended.take().is_some();
        }
        let Some(p) = st.lost.remove(name) else {
            return false;
        };
        if p.revoked.load(Ordering::Relaxed) {
            return false;
        }
        if st.put(&p) {
            p.republished.fetch_add(1, Ordering::Relaxed);
            OpCounters::count(&self.inner.ops.grants);
            OpCounters::count(&self.inner.ops.puts);
            true
        } else {
            st.lost.insert(name.to_string(), p);
            false
        }
    }

    /// Put `bytes` under `name` as if another program had (tests of the checks on read).
    #[cfg(test)]
    pub(crate) fn put_raw(&self, name: &str, bytes: &[u8]) {
        let mut st = self.inner.lock();
        let lease = st.lease();
        let record = super::record::sample("raw");
        let publisher = Arc::new(Publisher {
            bytes: bytes.to_vec(),
            record,
            lease: AtomicU64::new(lease),
            republished: AtomicU64::new(0),
            revoked: AtomicBool::new(false),
        });
        st.entries.insert(
            name.to_string(),
            Entry {
                bytes: bytes.to_vec(),
                node: publisher.record.node,
                publisher,
                suspended: None,
            },
        );
    }
}

/// Expire suspended leases until none is left (or the store is gone).
fn reaper(store: Weak<Inner>) {
    loop {
        let Some(inner) = store.upgrade() else { return };
        let next = {
            let mut st = inner.lock();
            let next = st.reap(Instant::now());
            if next.is_none() {
                st.reaper = false;
                return;
            }
            next
        };
        drop(inner);
        let wait = next
            .map(|t| t.saturating_duration_since(Instant::now()))
            .unwrap_or_default();
        std::thread::sleep(wait.clamp(Duration::from_millis(1), Duration::from_millis(50)));
    }
}

/// A record read back: the checks every store's bytes pass.
fn read(name: &str, e: &Entry) -> Result<MemberRecord> {
    MemberRecord::from_bytes_at(name, &e.bytes)
}

impl MetadataStore for EmbeddedStore {
    fn kind(&self) -> &'static str {
        "embedded"
    }

    fn publish(&self, record: &MemberRecord) -> Result<Publication> {
        let bytes = record.to_bytes()?;
        let p = Arc::new(Publisher {
            record: record.clone(),
            bytes,
            lease: AtomicU64::new(0),
            republished: AtomicU64::new(0),
            revoked: AtomicBool::new(false),
        });
        let mut st = self.inner.lock();
        let name = record.name.as_str();
        // One publication of a name per store (two of one record would each hold it, and the
        // one dropped would withdraw the other's).
        let live = |q: &Arc<Publisher>| !q.revoked.load(Ordering::Relaxed);
        if st
            .entries
            .get(name)
            .is_some_and(|e| e.node == record.node && live(&e.publisher))
            || st
                .lost
                .get(name)
                .is_some_and(|q| q.record.node == record.node && live(q))
        {
            return Err(Error::invalid(
                "record",
                name,
                "this store publishes the name already: revoke that publication first",
            ));
        }
        OpCounters::count(&self.inner.ops.grants);
        OpCounters::count(&self.inner.ops.puts);
        if !st.put(&p) {
            let node = st.entries[record.name.as_str()].node;
            return Err(Error::NameTaken {
                name: record.name.to_string(),
                node: node.to_string(),
            });
        }
        drop(st);
        Ok(Publication::new(
            record.clone(),
            Box::new(EmbeddedLease {
                store: self.inner.clone(),
                p,
            }),
        ))
    }

    fn lookup(&self, name: &SegmentName) -> Result<Option<MemberRecord>> {
        OpCounters::count(&self.inner.ops.gets);
        let st = self.inner.lock();
        st.entries
            .get(name.as_str())
            .map(|e| read(name.as_str(), e))
            .transpose()
    }

    fn members(&self) -> Result<Vec<MemberRecord>> {
        OpCounters::count(&self.inner.ops.lists);
        let st = self.inner.lock();
        Ok(st
            .entries
            .iter()
            .filter_map(|(k, e)| read(k, e).ok())
            .collect())
    }

    fn watch(&self) -> Result<MemberWatch> {
        OpCounters::count(&self.inner.ops.watches);
        OpCounters::count(&self.inner.ops.lists);
        let (tx, rx) = channel();
        let mut st = self.inner.lock();
        let now: Vec<MemberEvent> = st
            .entries
            .iter()
            .filter_map(|(k, e)| read(k, e).ok())
            .map(MemberEvent::Joined)
            .collect();
        tx.start(now);
        st.watchers.push(tx);
        Ok(MemberWatch::new(rx))
    }

    fn ops(&self) -> StoreOps {
        self.inner.ops.snapshot()
    }

    fn instance(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }
}

impl std::fmt::Debug for EmbeddedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedStore")
            .field("members", &self.inner.lock().entries.len())
            .finish()
    }
}

struct EmbeddedLease {
    store: Arc<Inner>,
    p: Arc<Publisher>,
}

impl Lease for EmbeddedLease {
    fn id(&self) -> u64 {
        self.p.lease.load(Ordering::Relaxed)
    }

    fn republished(&self) -> u64 {
        self.p.republished.load(Ordering::Relaxed)
    }

    fn revoke(&self, _timeout: Duration) -> Result<()> {
        self.p.revoked.store(true, Ordering::Relaxed);
        OpCounters::count(&self.store.ops.revokes);
        let mut st = self.store.lock();
        let name = self.p.record.name.as_str();
        if st
            .entries
            .get(name)
            .is_some_and(|e| Arc::ptr_eq(&e.publisher, &self.p))
        {
            st.remove(name);
        }
        if st.lost.get(name).is_some_and(|p| Arc::ptr_eq(p, &self.p)) {
            st.lost.remove(name);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::record::sample;
    use super::*;

    fn next(w: &mut MemberWatch) -> MemberEvent {
        w.next_timeout(Duration::from_secs(5))
            .unwrap()
            .expect("an event")
    }

    #[test]
    fn publish_lookup_list_revoke() {
        let s = EmbeddedStore::new();
        let a = sample("a");
        let p = s.publish(&a).unwrap();
        assert_eq!(s.lookup(&a.name).unwrap(), Some(a.clone()));
        assert_eq!(s.members().unwrap(), vec![a.clone()]);
        let mut other = sample("a");
        other.node = NodeId::random().unwrap();
        assert!(matches!(s.publish(&other), Err(Error::NameTaken { .. })));
        p.revoke(Duration::from_secs(1)).unwrap();
        assert_eq!(s.lookup(&a.name).unwrap(), None);
        // The name is free again.
        drop(s.publish(&other).unwrap());
        assert!(s.members().unwrap().is_empty(), "dropping revokes");
    }

    #[test]
    fn a_watch_sees_joins_and_leaves() {
        let s = EmbeddedStore::new();
        let a = sample("a");
        let _pa = s.publish(&a).unwrap();
        let mut w = s.watch().unwrap();
        assert_eq!(next(&mut w), MemberEvent::Joined(a.clone()));
        let b = sample("b");
        let pb = s.publish(&b).unwrap();
        assert_eq!(next(&mut w), MemberEvent::Joined(b.clone()));
        drop(pb);
        assert_eq!(
            next(&mut w),
            MemberEvent::Left {
                name: b.name.clone(),
                node: b.node
            }
        );
        assert_eq!(w.next_timeout(Duration::ZERO).unwrap(), None);
    }

    #[test]
    fn a_suspended_lease_expires_and_resumes() {
        let s = EmbeddedStore::new();
        let mut a = sample("a");
        a.ttl = Duration::from_secs(1);
        let p = s.publish(&a).unwrap();
        let lease = p.lease_id();
        let mut w = s.watch().unwrap();
        next(&mut w);
        let t = Instant::now();
        assert!(s.suspend("a").unwrap());
        assert!(matches!(next(&mut w), MemberEvent::Left { .. }));
        let took = t.elapsed();
        assert!(
            took >= Duration::from_millis(990) && took < Duration::from_secs(3),
            "{took:?}"
        );
        assert_eq!(s.lookup(&a.name).unwrap(), None);
        assert!(s.resume("a"));
        assert_eq!(next(&mut w), MemberEvent::Joined(a.clone()));
        assert_ne!(p.lease_id(), lease);
        assert_eq!(p.republished(), 1);
        // Suspended and resumed within the TTL: nothing changes.
        assert!(s.suspend("a").unwrap());
        assert!(s.resume("a"));
        std::thread::sleep(Duration::from_millis(1200));
        assert_eq!(w.next_timeout(Duration::ZERO).unwrap(), None);
        assert!(s.expire("a"));
        assert!(matches!(next(&mut w), MemberEvent::Left { .. }));
    }

    #[test]
    fn bad_bytes_are_refused_on_read() {
        let s = EmbeddedStore::new();
        let good = sample("x").to_bytes().unwrap();
        s.put_raw("x", &good);
        s.put_raw("y", &good);
        s.put_raw("z", b"gpudirect-member/7\n");
        s.put_raw("w", b"junk");
        let name = |n: &str| SegmentName::new(n).unwrap();
        assert!(s.lookup(&name("x")).unwrap().is_some());
        assert!(matches!(
            s.lookup(&name("y")),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(matches!(
            s.lookup(&name("z")),
            Err(Error::UnknownVersion { found: 7, .. })
        ));
        assert!(s.lookup(&name("w")).is_err());
        assert_eq!(s.members().unwrap().len(), 1);
    }
}
