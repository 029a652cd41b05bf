//! The entry points a user starts from: the engine's methods (registering memory, listening
//! and connecting, across nodes or inside one), and the listeners that accept endpoints. Each
//! delegates to the transport that does the work.

use super::descriptor::MemoryDescriptor;
use super::endpoint::Endpoint;
use super::engine::Engine;
#[cfg(feature = "p2p")]
use super::local;
use super::rails;
use crate::error::Result;
#[cfg(feature = "p2p")]
use std::path::Path;
use std::time::Duration;

impl Engine {
    /// Listen for endpoints on `addr` (`host:port`; port 0 picks one).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for an address that does not resolve, or an engine without
    /// rails; as [`Listener::bind`](crate::rdma::Listener::bind).
    #[doc(alias = "rdma_listen")]
    pub fn listen(&self, addr: &str) -> Result<TransferListener> {
        Ok(TransferListener {
            inner: rails::listen(self, addr)?,
        })
    }

    /// Connect an endpoint: one rail to each of `peers` (`host:port`, names resolved), in rail
    /// order, each through the local device rdma_cm routes it to (which must be one of the
    /// engine's). The first message of each rail's connection carries `publish` (on rail 0) and
    /// the peer's sends back its own ([`Endpoint::peer_descriptors`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for an engine without rails, no peers, more than 16, a name
    /// that does not resolve, a
    /// route to a device that is not one of the engine's, or a first message that is not valid;
    /// [`Error::Timeout`](crate::Error::Timeout) and [`Error::CmEvent`](crate::Error::CmEvent) from connecting; any verbs error.
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
    /// allocation) and copy with `cuMemcpyAsync` on the endpoint's streams; each report's path
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

    /// Accept the next endpoint: its rails' connections, whose first messages carry `publish`
    /// (on rail 0) and the peer's descriptors. Rails of other endpoints arriving meanwhile are
    /// kept for a later call.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`](crate::Error::Timeout) when no complete endpoint arrives within `timeout`; errors of
    /// connecting and of the first messages (the failing connection is dropped).
    #[doc(alias = "rdma_accept")]
    pub fn accept(&self, publish: &[MemoryDescriptor], timeout: Duration) -> Result<Endpoint> {
        Ok(Endpoint::over_rails(self.inner.accept(publish, timeout)?))
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
