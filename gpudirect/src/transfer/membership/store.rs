//! The store behind named segments: one trait ([`MetadataStore`]) that the engine publishes to
//! and looks names up in, what a publication holds ([`Publication`]), the events of a watch
//! ([`MemberEvent`], [`MemberWatch`]) and the store's operation counters ([`StoreOps`]).

use super::feed::{Got, Receiver};
use super::name::{NodeId, SegmentName};
use super::record::MemberRecord;
use crate::error::{Error, Result};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

/// A membership change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemberEvent {
    /// A member published its record (or published it again under another node identity).
    Joined(MemberRecord),
    /// A member's record is gone: its lease expired or it withdrew.
    Left {
        /// The segment name.
        name: SegmentName,
        /// The node that held it.
        node: NodeId,
    },
}

/// Where named segments are published and found: a segment name maps to a member's record and
/// its lease. The engine needs nothing else, so another store (Redis, a Kubernetes lease) is
/// one more implementation of this trait.
///
/// Everything an implementation reads from its backend is checked
/// ([`MemberRecord::from_bytes`]) before it is handed on; a record that fails is left out of
/// [`members`](Self::members) and the watch, and is an error from [`lookup`](Self::lookup). A
/// valid record that no lease holds (put by hand, or copied by a tool) would never expire: it
/// is no live member's, left out of all three.
pub trait MetadataStore: Send + Sync + 'static {
    /// The store's kind, for errors and metrics: `embedded`, `etcd`.
    fn kind(&self) -> &'static str;

    /// Publish `record` under its segment name with a lease of `record.ttl`, kept alive until
    /// the returned [`Publication`] is revoked or dropped. When the lease is lost (the store
    /// restarted without its data, the node was cut off for longer than the TTL), or the
    /// record was removed or changed under it by someone else, the publication grants a new
    /// one and publishes again. A publish that fails leaves no record behind.
    ///
    /// # Errors
    ///
    /// [`Error::NameTaken`] when another live node holds the name; [`Error::Store`] when the
    /// store cannot be reached; [`Error::InvalidArgument`] for a record that breaks a rule.
    fn publish(&self, record: &MemberRecord) -> Result<Publication>;

    /// The live record of segment `name`, if any.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot be reached; [`Error::InvalidArgument`] /
    /// [`Error::UnknownVersion`] for a record that is not valid.
    fn lookup(&self, name: &SegmentName) -> Result<Option<MemberRecord>>;

    /// Every live member's record (valid ones), by name.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot be reached.
    fn members(&self) -> Result<Vec<MemberRecord>>;

    /// Watch the membership: first a [`MemberEvent::Joined`] for every live member, then each
    /// change as it happens. A watch that loses its connection to the store connects again and
    /// reports what changed meanwhile; it reports a member as gone only when its record is
    /// (never because the store was unreachable). It ends once more than 65,536 events past
    /// its first list are left unread: a new watch starts with the live members again.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store cannot be reached.
    fn watch(&self) -> Result<MemberWatch>;

    /// The operations this store handle has made so far.
    fn ops(&self) -> StoreOps;

    /// An id of the store's shared state: clones of one store answer the same, other stores
    /// another (an engine keeps one store).
    fn instance(&self) -> usize;
}

/// What keeps a published record alive (a store's lease and its keep-alive): revoked when the
/// [`Publication`] holding it is revoked or dropped.
pub trait Lease: Send + Sync {
    /// The store's id of the current lease.
    fn id(&self) -> u64;
    /// How many times the record was published again after its lease was lost.
    fn republished(&self) -> u64;
    /// Withdraw the record and end the lease, waiting at most `timeout` for the store.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store did not answer in time (the lease then expires by
    /// itself within its TTL).
    fn revoke(&self, timeout: Duration) -> Result<()>;
}

/// A published record, kept alive by its lease until [`revoke`](Self::revoke) or drop (which
/// revokes it, waiting at most a second for the store).
pub struct Publication {
    record: MemberRecord,
    lease: Option<Box<dyn Lease>>,
}

impl Publication {
    /// A publication of `record` kept by `lease` (for implementations of [`MetadataStore`]).
    pub fn new(record: MemberRecord, lease: Box<dyn Lease>) -> Publication {
        Publication {
            record,
            lease: Some(lease),
        }
    }

    /// The record published.
    pub fn record(&self) -> &MemberRecord {
        &self.record
    }

    /// The store's id of the current lease.
    pub fn lease_id(&self) -> u64 {
        self.lease.as_ref().map_or(0, |l| l.id())
    }

    /// How many times the record was published again after its lease was lost (or the record
    /// was removed or changed under it).
    pub fn republished(&self) -> u64 {
        self.lease.as_ref().map_or(0, |l| l.republished())
    }

    /// Withdraw the record now: peers watching see it leave.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store did not answer within `timeout` (the lease expires by
    /// itself within its TTL).
    pub fn revoke(mut self, timeout: Duration) -> Result<()> {
        match self.lease.take() {
            Some(l) => l.revoke(timeout),
            None => Ok(()),
        }
    }
}

impl Drop for Publication {
    fn drop(&mut self) {
        if let Some(l) = self.lease.take() {
            let _ = l.revoke(Duration::from_secs(1));
        }
    }
}

impl std::fmt::Debug for Publication {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publication")
            .field("name", &self.record.name)
            .field("node", &self.record.node)
            .field("lease", &self.lease_id())
            .finish()
    }
}

/// A watch of the membership ([`MetadataStore::watch`]): a blocking
/// [`next_timeout`](Self::next_timeout), an [`Iterator`] that blocks, and a
/// [`Stream`](futures_core::Stream) woken by the store's side (no runtime needed). Dropping it
/// ends the watch in the store.
pub struct MemberWatch {
    rx: Receiver<MemberEvent>,
}

impl MemberWatch {
    pub(super) fn new(rx: Receiver<MemberEvent>) -> MemberWatch {
        MemberWatch { rx }
    }

    /// The next event, waiting up to `timeout`; `None` when none came.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] once the watch has ended (the store was dropped, or more than 65,536
    /// events past the first list were left unread).
    pub fn next_timeout(&mut self, timeout: Duration) -> Result<Option<MemberEvent>> {
        match self.rx.recv(timeout) {
            Got::Item(e) => Ok(Some(e)),
            Got::Empty => Ok(None),
            Got::Ended(e) => Err(e),
            Got::Done => Err(ended()),
        }
    }
}

fn ended() -> Error {
    Error::Store {
        store: "watch",
        op: "watch",
        reason: "the watch has ended".into(),
    }
}

impl Iterator for MemberWatch {
    type Item = Result<MemberEvent>;

    /// The next event, waiting for it; `None` once the watch has ended and said why.
    fn next(&mut self) -> Option<Result<MemberEvent>> {
        loop {
            match self.rx.recv(Duration::from_secs(3600)) {
                Got::Item(e) => return Some(Ok(e)),
                Got::Empty => {}
                Got::Ended(e) => return Some(Err(e)),
                Got::Done => return None,
            }
        }
    }
}

impl futures_core::Stream for MemberWatch {
    type Item = Result<MemberEvent>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match self.rx.poll(cx.waker()) {
            Got::Item(e) => Poll::Ready(Some(Ok(e))),
            Got::Empty => Poll::Pending,
            Got::Ended(e) => Poll::Ready(Some(Err(e))),
            Got::Done => Poll::Ready(None),
        }
    }
}

impl std::fmt::Debug for MemberWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemberWatch").finish_non_exhaustive()
    }
}

/// Operations a store handle made (cumulative): what a publish, a lookup and a lease cost in
/// round trips.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreOps {
    /// Reads of one key (lookups; a publication's read of its own key as its watch of it
    /// starts).
    pub gets: u64,
    /// Reads of every member (a list; a watch's start and resync).
    pub lists: u64,
    /// Writes of a record (each a transaction that checks who holds the name).
    pub puts: u64,
    /// Leases granted.
    pub grants: u64,
    /// Lease keep-alives sent.
    pub keepalives: u64,
    /// Leases revoked.
    pub revokes: u64,
    /// Watches started (again after a lost connection, too; a publication's watch of its own
    /// key).
    pub watches: u64,
}

/// [`StoreOps`] as atomics, for a store to count into.
#[derive(Default)]
pub(super) struct OpCounters {
    pub(super) gets: AtomicU64,
    pub(super) lists: AtomicU64,
    pub(super) puts: AtomicU64,
    pub(super) grants: AtomicU64,
    pub(super) keepalives: AtomicU64,
    pub(super) revokes: AtomicU64,
    pub(super) watches: AtomicU64,
}

impl OpCounters {
    pub(super) fn count(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn snapshot(&self) -> StoreOps {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StoreOps {
            gets: l(&self.gets),
            lists: l(&self.lists),
            puts: l(&self.puts),
            grants: l(&self.grants),
            keepalives: l(&self.keepalives),
            revokes: l(&self.revokes),
            watches: l(&self.watches),
        }
    }
}
