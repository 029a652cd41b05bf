//! Named segments and leased membership: an engine publishes itself under a segment name in a
//! metadata store, peers connect to the name
//! ([`Engine::connect_name`](crate::transfer::Engine::connect_name)), and a member whose lease
//! ends (its process died, it was stopped or cut off for longer than its TTL) leaves: lookups
//! no longer find it and the endpoints to it end.
//!
//! ```no_run
//! use gpudirect::transfer::membership::{Advertise, EmbeddedStore};
//! use gpudirect::transfer::{Engine, EngineConfig};
//! # fn main() -> gpudirect::Result<()> {
//! let store = EmbeddedStore::new(); // or EtcdStore::connect(..) with the `etcd` feature
//! let engine = Engine::new(EngineConfig::with_devices(&["mlx5_0"]))?;
//! let listener = engine.listen("0.0.0.0:7400")?;
//! engine.publish_as("decode-3", &store, Advertise::rails(["10.0.0.3:7400"]))?;
//! # let _ = listener;
//! // Elsewhere: `other.connect_name("decode-3", &descriptors)?`, as `connect` gives.
//! # Ok(()) }
//! ```
//!
//! # The record
//!
//! A segment name maps to a [`MemberRecord`]: the node's identity (random per engine), its
//! host's identity, its rails' `host:port` addresses, the Unix socket where it listens for
//! intra-node endpoints (if it does), its lease's TTL and the format's version. Never rkeys or
//! memory descriptors: those travel per peer, over the endpoint's own connection. Everything
//! read from a store is checked as a peer's descriptor is: names by their charset and length,
//! addresses parse, sizes are bounded, another format version is refused
//! ([`Error::UnknownVersion`](crate::Error::UnknownVersion)).
//!
//! # Stores
//!
//! [`MetadataStore`] is the one trait the engine uses; two implementations:
//!
//! - [`EmbeddedStore`]: no server, names resolved inside one process (the default; one node and
//!   the examples need nothing more). Tests can stop a lease from being renewed.
//! - `EtcdStore` (feature `etcd`): keys under a namespace (`/gpudirect/v1/` by default), one
//!   lease per publication with a keep-alive every third of its TTL, watches for membership; a
//!   lease lost to an etcd that restarted without its data, or to an outage longer than the
//!   TTL, is granted again and the record put again.
//!
//! # Where things live
//!
//! Bottom up, each file imports only those before it:
//!
//! - `name`: the checked names (segment, node, host), rail addresses and socket paths.
//! - `record`: [`MemberRecord`] and its bytes.
//! - `feed`: the queue from a store's side to a watch.
//! - `store`: [`MetadataStore`], [`Publication`], [`MemberWatch`], [`StoreOps`].
//! - `embedded`: [`EmbeddedStore`].
//! - `etcd`: `EtcdStore` and its runtime (feature `etcd`).
//! - `roster`: an engine's membership: its publication, and the peers its endpoints reach,
//!   ended when they leave.

mod embedded;
#[cfg(feature = "etcd")]
mod etcd;
mod feed;
mod name;
mod record;
mod roster;
mod store;

pub use embedded::EmbeddedStore;
#[cfg(feature = "etcd")]
pub use etcd::{EtcdConfig, EtcdStore};
pub use name::{HostId, MAX_NAME, NodeId, SegmentName};
pub use record::{MAX_RECORD, MemberRecord, RECORD_VERSION};
pub use roster::Advertise;
pub(crate) use roster::{Roster, Tracked};
pub use store::{Lease, MemberEvent, MemberWatch, MetadataStore, Publication, StoreOps};
