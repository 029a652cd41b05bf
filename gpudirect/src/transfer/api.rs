//! The entry points a user starts from: the engine's methods (registering memory, listening
//! and connecting, across nodes or inside one), and the listeners that accept endpoints. Each
//! delegates to the transport that does the work.

use super::descriptor::MemoryDescriptor;
use super::endpoint::Endpoint;
use super::engine::{self, Engine, EngineConfig, WindowStats};
#[cfg(feature = "p2p")]
use super::local;
use super::membership::{Advertise, MemberRecord, MemberWatch, MetadataStore, StoreOps};
use super::named;
use super::rails::{self, ListenerStats};
use super::region::{Buffer, CacheCounters, Region};
use super::registry;
use crate::error::Result;
#[cfg(feature = "p2p")]
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

impl Engine {
    /// Open the rails' devices and allocate a protection domain on each; with
    /// [`EngineConfig::local_only`], an engine without rails (no verbs library is loaded).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for settings out of range ([`EngineConfig::check`]) or a
    /// device named twice; [`Error::Load`](crate::Error::Load) without libibverbs; [`Error::NoDevice`](crate::Error::NoDevice) without a
    /// verbs device or for a name no device has; [`Error::Os`](crate::Error::Os) from opening a device.
    #[doc(alias = "ibv_open_device")]
    #[doc(alias = "ibv_alloc_pd")]
    pub fn new(config: EngineConfig) -> Result<Engine> {
        engine::open(config)
    }

    /// The rails' device names, in rail order (the order of every descriptor's rkeys); empty
    /// for an engine without rails.
    pub fn devices(&self) -> Vec<String> {
        self.inner.devices.iter().map(|d| d.name.clone()).collect()
    }

    /// The settings.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    /// Register `buf` on every rail, or reuse a registration that already covers it: one whose
    /// memory has the same identity (the same buffer, or for GPU memory the same allocation by
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID`) and whose range holds this one. A new allocation at a
    /// reused address is a new identity: it never finds a stale registration.
    ///
    /// GPU memory is registered through dma-buf or nvidia-peermem (automatic order); a VMM
    /// buffer of several physical chunks only whole, through dma-buf. Memory that cannot be
    /// registered (pool memory; a node without dma-buf or nvidia-peermem) is
    /// [staged](super::MemoryPath::Staged) when [`EngineConfig::staging`](super::EngineConfig::staging)
    /// allows.
    ///
    /// # Errors
    ///
    /// [`Error::NotRdmaCapable`](crate::Error::NotRdmaCapable) naming the chunk for a VMM range of several chunks that dma-buf
    /// cannot register whole; [`Error::NoGpuRegistrationPath`](crate::Error::NoGpuRegistrationPath) / [`Error::NotRdmaCapable`](crate::Error::NotRdmaCapable) when
    /// staging is off; [`Error::Os`](crate::Error::Os) from `ibv_reg_mr` (`ENOMEM`: the memlock limit); errors of
    /// the pointer-attribute query.
    #[doc(alias = "ibv_reg_mr")]
    #[doc(alias = "ibv_reg_dmabuf_mr")]
    pub fn register(&self, buf: Buffer) -> Result<Region> {
        Ok(registry::register(self, vec![buf], false)?
            .pop()
            .expect("one region"))
    }

    /// Register many buffers in one call: as [`register`](Self::register) for each, with the
    /// cache lookups under one lock, the ranges of one memory identity that overlap or touch
    /// coalesced into one registration (each rkey then reaches the whole coalesced range:
    /// register separately to keep ranges apart), and the rails registered in parallel. All or
    /// nothing.
    ///
    /// # Errors
    ///
    /// As [`register`](Self::register), for the first buffer that fails (nothing is kept).
    pub fn register_all(&self, bufs: Vec<Buffer>) -> Result<Vec<Region>> {
        registry::register(self, bufs, true)
    }

    /// Per-peer memory windows bound and revoked so far
    /// ([`EngineConfig::peer_access`](super::EngineConfig::peer_access)).
    pub fn window_stats(&self) -> WindowStats {
        let c = &self.inner.window_counts;
        WindowStats {
            bound: c.bound.load(Ordering::Relaxed),
            revoked: c.revoked.load(Ordering::Relaxed),
        }
    }

    /// What the registration cache has done so far.
    pub fn cache_stats(&self) -> CacheCounters {
        registry::cache_stats(&self.inner)
    }

    /// Listen for endpoints on `addr` (`host:port`; port 0 picks one).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for an address that does not resolve, or an engine without
    /// rails; [`Error::Timeout`](crate::Error::Timeout) when resolving a name takes longer than
    /// [`EngineConfig::connect_timeout`](crate::transfer::EngineConfig::connect_timeout) (also
    /// when 16 names were being resolved throughout it: the process resolves at most 16 at
    /// once); as [`Listener::bind`](crate::rdma::Listener::bind).
    #[doc(alias = "rdma_listen")]
    pub fn listen(&self, addr: &str) -> Result<TransferListener> {
        Ok(TransferListener {
            inner: rails::listen(self, addr)?,
        })
    }

    /// Connect an endpoint: one rail to each of `peers` (`host:port`, names resolved, each within
    /// [`EngineConfig::connect_timeout`](crate::transfer::EngineConfig::connect_timeout)), in rail
    /// order, each through the local device rdma_cm routes it to (which must be one of the
    /// engine's). The first message of each rail's connection carries `publish` (on every rail,
    /// each with that rail's rkeys) and the peer's sends back its own
    /// ([`Endpoint::peer_descriptors`]; every rail's list must be the same).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for an engine without rails, no peers, more than 16, a name
    /// that does not resolve, a
    /// route to a device that is not one of the engine's, or a first message that is not valid;
    /// [`Error::Timeout`](crate::Error::Timeout) from resolving a name (at most 16 at once in
    /// the process, as [`listen`](Self::listen)) or connecting;
    /// [`Error::CmEvent`](crate::Error::CmEvent) from connecting; any verbs error.
    #[doc(alias = "rdma_connect")]
    pub fn connect(&self, peers: &[&str], publish: &[MemoryDescriptor]) -> Result<Endpoint> {
        Ok(Endpoint::over_rails(rails::connect(self, peers, publish)?))
    }

    /// Listen for intra-node endpoints on the Unix domain socket at `path` (made here; it must
    /// not exist). Works on an engine with or without rails.
    ///
    /// # Errors
    ///
    /// [`Error::Os`](crate::Error::Os) from `bind` (`EADDRINUSE` when the path exists: remove a stale socket
    /// first) or `listen`.
    #[doc(alias = "bind")]
    #[cfg(feature = "p2p")]
    pub fn listen_local(&self, path: impl AsRef<Path>) -> Result<LocalListener> {
        Ok(LocalListener {
            inner: local::listen(self, path.as_ref())?,
        })
    }

    /// Connect an intra-node endpoint to the local listener at `path`: the first messages
    /// carry `publish` and the peer's descriptors ([`Endpoint::peer_descriptors`](Endpoint::peer_descriptors)),
    /// each followed by the file descriptors of the VMM memory and memory pools its descriptors
    /// name (`SCM_RIGHTS`): VMM and pool memory are reachable only through descriptors
    /// published here. It has no rails: its requests ([`Endpoint::write`](Endpoint::write),
    /// [`read`](Endpoint::read), with the same options) map each remote allocation from
    /// its descriptor's [`IpcPart`](super::IpcPart) (`cuIpcOpenMemHandle`; for VMM memory
    /// `cuMemImportFromShareableHandle` of the file descriptor received and `cuMemMap`; on the
    /// local memory's GPU, or GPU 0 for host memory; once per allocation and GPU in the process,
    /// until nothing holds it; for pool memory `cuMemPoolImportFromShareableHandle` of the
    /// pool's file descriptor received, once per pool, and `cuMemPoolImportPointer`, once per
    /// allocation) and copy by a graph launch of copy nodes
    /// ([`EngineConfig::copy_graphs`](crate::transfer::EngineConfig::copy_graphs), on by
    /// default), else with `cuMemcpyAsync`, on the endpoint's streams; each report's path
    /// is [`MemoryPath::CudaIpc`](super::MemoryPath::CudaIpc) with the link crossed.
    ///
    /// The owner of published pool memory keeps its region until the peer's endpoints are
    /// closed: CUDA wants an imported pool pointer freed (here, when the last endpoint and
    /// request holding it go) before its owner frees the allocation.
    ///
    /// # Errors
    ///
    /// [`Error::Os`](crate::Error::Os) from `connect` (`ENOENT`: nobody listens at `path`; `ECONNREFUSED`);
    /// [`Error::Timeout`](crate::Error::Timeout) when the peer's first message or file descriptors do not come
    /// within [`EngineConfig::connect_timeout`](super::EngineConfig::connect_timeout);
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a first message that is not valid, file descriptors
    /// that do not match the peer's descriptors (all of them closed again), too many
    /// descriptors to publish, or a published VMM or pool descriptor whose region is gone or
    /// that describes its export otherwise (refused before connecting).
    #[doc(alias = "connect")]
    #[doc(alias = "cuIpcOpenMemHandle")]
    #[doc(alias = "cuMemImportFromShareableHandle")]
    #[doc(alias = "cuMemPoolImportFromShareableHandle")]
    #[doc(alias = "cuMemPoolImportPointer")]
    #[doc(alias = "SCM_RIGHTS")]
    #[doc(alias = "cuMemcpyAsync")]
    #[cfg(feature = "p2p")]
    pub fn connect_local(
        &self,
        path: impl AsRef<Path>,
        publish: &[MemoryDescriptor],
    ) -> Result<Endpoint> {
        Endpoint::inside_node(local::connect(self, path.as_ref(), publish)?)
    }

    /// Give the engine a metadata store to find peers by name in
    /// ([`connect_name`](Self::connect_name), [`members`](Self::members)) without publishing
    /// itself. An engine keeps the first store it is given; a thread of its own watches the
    /// store's membership from then on.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for another store than the
    /// engine's; [`Error::Store`](crate::Error::Store) when the store cannot be reached.
    pub fn use_store<S: MetadataStore + Clone>(&self, store: &S) -> Result<()> {
        named::attach(self, store)
    }

    /// Publish the engine under segment `name` in `store` ([`use_store`](Self::use_store)),
    /// reachable as `at` says (its rails' addresses, its local socket), with a lease kept
    /// alive until [`unpublish`](Self::unpublish) or the engine's last clone goes. The record
    /// carries a node identity drawn for this engine, never memory descriptors. What `at` says
    /// is published as given, not checked against the engine's listeners: listen there
    /// ([`listen`](Self::listen), or `listen_local` with `p2p`) before peers look the
    /// name up, or their connects find nobody.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a name or advertised
    /// address that breaks its rule, more addresses than rails, a second name (or one being
    /// published on another thread), another store, an [`unpublish`](Self::unpublish) while it
    /// was under way (what it made is withdrawn);
    /// [`Error::NameTaken`](crate::Error::NameTaken) when another live node holds `name`;
    /// [`Error::Store`](crate::Error::Store) when the store cannot be reached.
    pub fn publish_as<S: MetadataStore + Clone>(
        &self,
        name: &str,
        store: &S,
        at: Advertise,
    ) -> Result<()> {
        named::attach(self, store)?;
        named::publish(self, name, &at)
    }

    /// The record the engine publishes, if it does.
    pub fn published(&self) -> Option<MemberRecord> {
        self.inner.roster.published()
    }

    /// Withdraw the engine's name (peers watching see it leave), waiting at most a second for
    /// the store. A [`publish_as`](Self::publish_as) under way on another thread withdraws
    /// what it made as soon as the store answers it, and fails.
    ///
    /// # Errors
    ///
    /// [`Error::Store`](crate::Error::Store) when the store did not answer in time (the lease
    /// then expires by itself within its TTL).
    pub fn unpublish(&self) -> Result<()> {
        self.inner.roster.unpublish(Duration::from_secs(1))
    }

    /// Connect an endpoint to segment `name`: its record is looked up in the engine's store
    /// and dialled as [`connect_local`](Self::connect_local) does when the record says the
    /// peer is on this host and listens locally (with the `p2p` feature), else as
    /// [`connect`](Self::connect) does to its rails' addresses; `publish` as there. When the
    /// peer's record leaves the store (its lease expired: killed, stopped, cut off; or it
    /// withdrew) and does not come back within half its TTL, the endpoint ends: its requests
    /// end, [`Endpoint::failure`] says [`Error::PeerLeft`](crate::Error::PeerLeft) — within
    /// twice the peer's TTL of its last renewal.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a name that breaks the
    /// rule or an engine without a store; [`Error::UnknownName`](crate::Error::UnknownName)
    /// when no live member has it; the record's checks
    /// ([`MemberRecord::from_bytes`]); [`Error::Store`](crate::Error::Store); errors of
    /// connecting.
    #[doc(alias = "rdma_connect")]
    pub fn connect_name(&self, name: &str, publish: &[MemoryDescriptor]) -> Result<Endpoint> {
        named::connect(self, name, publish)
    }

    /// End `ep` (an accepted endpoint, say) when the node now publishing segment `name` leaves,
    /// as [`connect_name`](Self::connect_name)'s endpoints end.
    ///
    /// # Errors
    ///
    /// As [`connect_name`](Self::connect_name)'s lookup.
    pub fn watch_peer(&self, ep: &Endpoint, name: &str) -> Result<()> {
        named::watch(self, ep, name)
    }

    /// Every live member of the engine's store.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) without a store;
    /// [`Error::Store`](crate::Error::Store).
    pub fn members(&self) -> Result<Vec<MemberRecord>> {
        self.inner.roster.store()?.members()
    }

    /// Watch members join and leave: a [`Joined`](super::membership::MemberEvent::Joined)
    /// for each live member first, then each change (a blocking iterator and a `Stream`).
    ///
    /// # Errors
    ///
    /// As [`members`](Self::members).
    pub fn watch_members(&self) -> Result<MemberWatch> {
        self.inner.roster.store()?.watch()
    }

    /// The operations the engine's store made so far.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) without a store.
    pub fn store_ops(&self) -> Result<StoreOps> {
        Ok(self.inner.roster.store()?.ops())
    }
}

/// An rdma_cm listener of a transfer [`Engine`]: accepts endpoints, grouping the rails of each.
pub struct TransferListener {
    inner: rails::Listener,
}

impl TransferListener {
    /// The port listened on.
    pub fn port(&self) -> u16 {
        self.inner.port()
    }

    /// Accept the next endpoint, returning by `timeout`: its rails' connections, whose first
    /// messages carry `publish` (on every rail) and the peer's descriptors. Rails of other
    /// endpoints arriving meanwhile are kept for a later call.
    ///
    /// Each connection's handshake runs on its own thread, bounded by
    /// [`EngineConfig::handshake_timeout`], so a silent or slow peer delays no other; at most
    /// [`EngineConfig::max_pending`] run at once (the oldest not yet authenticated is ended to
    /// make room). With [`EngineConfig::key`], a peer proves it holds the key before anything
    /// is published to it or its descriptors are read. A handshake that fails does not end the
    /// call: it is counted ([`stats`](Self::stats)) and its error kept
    /// ([`take_refusals`](Self::take_refusals)). Handshakes started by a call that returned go
    /// on (with that call's `publish`) and are accepted by a later one.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`](crate::Error::Timeout) when no complete endpoint arrives within
    /// `timeout`; [`Error::InvalidArgument`](crate::Error::InvalidArgument) for rails whose
    /// first messages disagree; [`Error::Os`](crate::Error::Os) from `poll`, `eventfd` or
    /// starting the endpoint's thread.
    #[doc(alias = "rdma_accept")]
    pub fn accept(&self, publish: &[MemoryDescriptor], timeout: Duration) -> Result<Endpoint> {
        Ok(Endpoint::over_rails(self.inner.accept(publish, timeout)?))
    }

    /// What the listener has done and holds now: handshakes running (and the most at once),
    /// endpoints partly or wholly connected, and the handshakes dropped, timed out or refused.
    pub fn stats(&self) -> ListenerStats {
        self.inner.stats()
    }

    /// Why handshakes were refused lately (at most the last 16, oldest first), taken: for
    /// example [`Error::Authentication`](crate::Error::Authentication) for a peer without the
    /// key, with another key, or replaying a recorded handshake.
    pub fn take_refusals(&self) -> Vec<crate::Error> {
        self.inner.take_refusals()
    }
}

impl std::fmt::Debug for TransferListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferListener")
            .field("port", &self.port())
            .finish()
    }
}

/// A listener for intra-node endpoints on a Unix domain socket ([`Engine::listen_local`]).
/// Dropping it removes the socket file.
#[cfg(feature = "p2p")]
pub struct LocalListener {
    inner: local::Listener,
}

#[cfg(feature = "p2p")]
impl LocalListener {
    /// The socket's path.
    pub fn path(&self) -> &Path {
        self.inner.path()
    }

    /// Accept the next intra-node endpoint within `timeout`; the first messages carry
    /// `publish` and the peer's descriptors, each followed by the file descriptors of the VMM
    /// memory and memory pools its descriptors name (as [`Engine::connect_local`]).
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`](crate::Error::Timeout) when nobody connects (or sends its first message and file
    /// descriptors) in time; [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a first message that is not valid,
    /// file descriptors that do not match the peer's descriptors (all of them closed again), or
    /// a published VMM or pool descriptor whose region is gone or that describes its export
    /// otherwise; [`Error::Os`](crate::Error::Os) from `accept` or the socket.
    pub fn accept(&self, publish: &[MemoryDescriptor], timeout: Duration) -> Result<Endpoint> {
        Endpoint::inside_node(self.inner.accept(publish, timeout)?)
    }
}

#[cfg(feature = "p2p")]
impl std::fmt::Debug for LocalListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalListener")
            .field("path", &self.inner.path())
            .finish()
    }
}
