//! A transfer engine: one-sided reads and writes between nodes, with notifications, a
//! registration cache and several NICs (rails).
//!
//! ```no_run
//! use gpudirect::transfer::{Buffer, Engine, EngineConfig, TransferOptions};
//! use std::time::Duration;
//! # fn main() -> gpudirect::Result<()> {
//! let engine = Engine::new(EngineConfig::with_devices(&["mlx5_0", "mlx5_1"]))?;
//! let src = engine.register(Buffer::host(vec![7u8; 4 << 20])?)?;
//! // The peer listens (`engine.listen("0.0.0.0:7400")?.accept(&[its descriptors], timeout)`).
//! let ep = engine.connect(&["node1-rail0:7400", "node1-rail1:7400"], &[])?;
//! let dst = ep.peer_descriptors()[0];
//! let done = ep
//!     .write(vec![(src.all(), dst.range(0, 4 << 20)?)], TransferOptions::notify(42))?
//!     .wait()?;
//! println!("{} bytes over rails {:?} in {:?} via {}", done.bytes, done.rails_used(),
//!          done.elapsed, done.paths[0]);
//! # Ok(()) }
//! ```
//!
//! # The pieces
//!
//! - An [`Engine`] opens the rails' verbs devices (a protection domain on each) and holds the
//!   registration cache. [`Engine::register`] takes a [`Buffer`] (host memory or GPU memory, by
//!   value, or a view of one) and gives a [`Region`] registered on every rail; it reuses a
//!   registration that already covers the range (same memory identity: the buffer, or for GPU
//!   memory the allocation's `CU_POINTER_ATTRIBUTE_BUFFER_ID`, so a new allocation at a reused
//!   address never finds a stale one). Registrations are reference counted: they go with the
//!   last region and transfer using them, and hold the memory until then.
//!   [`Engine::register_all`] registers many in one call.
//! - A [`MemoryDescriptor`] says how a peer reaches a region: address, length, memory kind, one
//!   rkey per rail. It travels in an endpoint's first message or through any channel (serde, or
//!   [`MemoryDescriptor::to_bytes`]); from a peer it is untrusted and checked field by field.
//! - An [`Endpoint`] connects to one peer through rdma_cm ([`Engine::connect`] to `host:port`
//!   per rail, [`Engine::listen`] + [`TransferListener::accept`]): one reliable queue pair per
//!   rail, each on its own device, and a progress thread that sleeps on the rails' completion
//!   channels (a bounded `poll(2)`: it wakes for completions, the peer's disconnect, a deadline,
//!   or a request that waits for room), never spinning. A thread waiting for a request or a
//!   notification polls the completion queues itself for a while first
//!   ([`EngineConfig::spin`]), when no other thread does: what it waits for is then seen
//!   without a hand-off from the progress thread.
//! - A request ([`Endpoint::write`], [`Endpoint::read`]) is a batch of (local range, remote
//!   range) pairs; it returns a [`Transfer`] to wait on (with the request's deadline), to
//!   `.await` (it is `IntoFuture`), or to hand on as an
//!   [`InFlight`](crate::completion::InFlight) whose fence is the request's
//!   [`CompletionFlag`](crate::completion::CompletionFlag).
//!
//! # Messages, rails and the window
//!
//! A request is cut into messages of at most the largest message (the smaller of
//! [`EngineConfig::max_message`], the ports' `max_msg_sz` and the peer's). Requests of at least
//! [`EngineConfig::stripe_min`] bytes are striped: cut into stripe units (each rail's share,
//! rounded up to 4 KiB) spread over the rails, each to the least loaded. GPU memory prefers the
//! rails whose NICs are nearest its GPU (same PCIe switch, then same NUMA node; every rail when
//! the placement is unknown, as for software devices). Per-rail byte and message counters:
//! [`Endpoint::rail_stats`].
//!
//! Each rail has at most its window of messages outstanding: its send-queue depth, and its send
//! completion queue's entries less the one its queue pair keeps for teardown. What does not fit
//! waits in the endpoint's queue, in order, and is posted as completions come back, so a
//! queue or completion queue is never found full.
//!
//! # Notifications
//!
//! With [`TransferOptions::notify`], the request's last message is an RDMA write with immediate
//! data carrying the tag, on rail 0. RDMA writes on one queue pair are placed in order, so the
//! bytes of the request's messages on rail 0 are in memory before the peer sees the immediate;
//! the messages on other rails are waited for first (their completions mean the peer's NIC
//! acknowledged them). Notifications leave in request order on one rail, so they arrive in
//! order. The receiving side delivers them ([`Endpoint::next_notification`], or awaited:
//! [`Endpoint::notification`]) only after flushing the GPUs whose memory it registered for peers
//! (`cuFlushGPUDirectRDMAWrites`, skipped where the device already orders such writes).
//!
//! A write with immediate consumes a receive at the peer. Each side posts `notify_depth` receives
//! on every rail and tells the other how many (credits are per rail); a notification is sent only against a credit, and credits come back
//! in a send with immediate once half are used (one credit is always kept for that message), so
//! the peer never finds no receive posted: no receiver-not-ready retries.
//!
//! # Memory paths
//!
//! Each [`TransferReport`] says, per pair, how the local memory reached the NIC
//! ([`MemoryPath`]): host memory; GPU memory registered directly (dma-buf or nvidia-peermem);
//! or GPU memory staged through pinned host bounce buffers, when it cannot be registered (pool
//! memory; a node with neither dma-buf nor nvidia-peermem): the copy of one chunk overlaps the
//! network transfer of the chunk before. A VMM buffer made of several physical chunks is
//! registered whole through dma-buf, or refused at registration with an error naming the chunk.
//!
//! # Inside a node: CUDA IPC
//!
//! With the `p2p` feature, two processes on one node meet over a Unix domain socket
//! ([`Engine::listen_local`] + [`LocalListener::accept`], [`Engine::connect_local`]) and get the
//! same [`Endpoint`]: the same requests, options, notifications and [`TransferReport`]. An engine
//! without rails ([`EngineConfig::local`]) never loads libibverbs; an engine with rails makes
//! these endpoints too. A GPU region's [`MemoryDescriptor`] carries an [`IpcPart`] when its
//! memory can be exported, made once per registration: for `cuMemAlloc` memory the
//! `cuIpcGetMemHandle` handle of the allocation; for VMM memory inside one physical allocation
//! (a [`VmmBuffer`](crate::memory::VmmBuffer) of one chunk) the id of its POSIX file descriptor
//! (`cuMemExportToShareableHandle`); for an allocation of an exportable pool (a
//! [`PoolAlloc`](crate::p2p::PoolAlloc) of an [`IpcPool`](crate::p2p::IpcPool)) the id of the
//! pool's POSIX file descriptor (exported once per pool) and the allocation's
//! `cuMemPoolExportPointer` data. The endpoints send each other those file descriptors by
//! `SCM_RIGHTS` when they meet, for the descriptors they publish then; the part has the
//! allocation's length, the offset in it, the owning GPU's UUID. A request maps the peer's
//! allocation once (`cuIpcOpenMemHandle`, or `cuMemImportFromShareableHandle` and `cuMemMap`;
//! cached process-wide per allocation and local GPU; for pool memory the pool imported once
//! with `cuMemPoolImportFromShareableHandle` and the pointer once with
//! `cuMemPoolImportPointer`; closed when no endpoint and no copy holds it),
//! checks each range against the allocation
//! length the peer claims and the mapping's real size, and copies by a graph launch of copy nodes
//! ([`EngineConfig::copy_graphs`], on by default), else with `cuMemcpyAsync`, on a
//! stream the endpoint owns on the local memory's GPU ([`EngineConfig::copy_streams`]), one set
//! per issue lane: each thread that submits issues on its own lane
//! ([`EngineConfig::copy_lanes`]), so threads sharing an endpoint copy side by side; a caller
//! blocked in [`Transfer::wait`], or else the endpoint's worker thread, sees the copies done (an
//! event recorded only when someone looks) and finishes the request. A notification
//! leaves on the socket only then, so when the peer receives it the bytes are in its memory, visible to
//! any work it queues afterwards. Each pair's path is [`MemoryPath::CudaIpc`] with the link
//! ([`IpcLink`]: NVLink, PCIe, the same device). Memory that cannot be exported (host memory,
//! memory of a pool without a shareable handle type such as cudarc's `CudaSlice`, a VMM range
//! across physical allocations) has no IPC part and is refused as a remote target, saying why;
//! so is VMM or pool memory whose descriptor was not published when the endpoints met.
//!
//! # Who may connect
//!
//! With [`EngineConfig::key`] (an [`AuthKey`]), both sides of every rail, and of the socket
//! inside a node, prove they hold the key before anything is published: HMAC-SHA-256 over both
//! sides' random challenges and what binds the connection (queue pairs and GIDs, or pids). A
//! peer without it, with another key, or replaying or relaying a handshake is refused with
//! [`Error::Authentication`](crate::Error::Authentication) and learns no descriptor; until it is
//! authenticated its queue pair reaches no registration. Inside a node the peer's user must
//! also pass [`EngineConfig::local_peers`]. [`Endpoint::authentication`] says how a peer was
//! authenticated. A listener runs each handshake on its own thread, bounded by
//! [`EngineConfig::handshake_timeout`], at most [`EngineConfig::max_pending`] at once
//! ([`TransferListener::stats`]). Payloads are not encrypted: see `docs/security.md`.
//!
//! # Failure
//!
//! A request ends within its deadline: when it passes, the endpoint is closed (on a reliable
//! connection nothing behind a stuck message moves), every queue pair goes to the error state,
//! and every request ends with a typed error once the NIC has flushed its messages (or a short
//! bound later: the queue pairs keep the memory the NIC may still reach). A peer that
//! disconnects (its process ended) ends the endpoint with [`Error::CmEvent`](crate::Error::CmEvent);
//! a wrong rkey or range with [`Error::WorkCompletion`](crate::Error::WorkCompletion). Other
//! endpoints carry on. [`Endpoint::reconnect`] connects the side that dialled again.
//!
//! # Stream-ordered transfers
//!
//! [`Endpoint::write_on`] and [`Endpoint::read_on`] enqueue a request on a CUDA stream: it
//! starts when the stream reaches it (a `cuStreamWriteValue64` to a trigger word that the
//! endpoint's proxy thread watches) and sets a completion word that a later stream wait
//! ([`StreamTransfer::wait_on`], `cuStreamWaitValue64`) or a kernel consumes; the host never
//! synchronizes a stream. A failure releases the word with [`STREAM_ERROR_BIT`] set, which
//! kernels must check. [`Endpoint::notification_counter`] counts delivered notifications in a
//! word a receiving stream can wait on. Host-triggered forms ([`Endpoint::write_triggered`])
//! run the same proxy without CUDA. The ordering (what is visible to which stream when a word
//! is set) is in the docs of `StreamTransfer` and of `docs/transfer.md`.
//!
//! # Where things live
//!
//! Bottom up, each file or folder imports only those before it; the two transports never
//! import each other.
//!
//! - What every transport shares: `auth` (the key, the user rule, the handshake's challenge,
//!   transcript and tags), `descriptor` (memory descriptors and their bytes), `plan`
//!   (splitting and striping, the window, credits), `wire` (the rails' greeting and descriptor
//!   message), `copy`,
//!   `region` (buffers, regions, the cache's entries), `engine` (the engine, its config and
//!   devices), `export` (CUDA IPC exports made at registration), `registry` (registering through
//!   the cache), `request` (a request's types and checks, why an endpoint broke),
//!   `pending` (the [`Transfer`] future and the state it shares with its finisher).
//! - `stream/`: stream-ordered transfers: words (the notification counter, [`StreamWord`]), the
//!   completion window, [`StreamTransfer`], the proxy thread over a backend.
//! - `shared`: what an endpoint's transport shares with the endpoint and calls back into
//!   (notifications, failure, the state lock).
//! - `rails/`: the verbs transport (rdma_cm handshake, posting within the windows, the progress
//!   thread, the staged bounce ring, [`TransferListener`]'s accepting).
//! - `local/`: the intra-node transport (the Unix socket, fd passing, the peer check, meeting,
//!   the worker side, CUDA IPC imports and copies).
//! - `transport`: `enum Transport { Rails, Local }`, matched where the transport matters.
//! - `endpoint`: [`Endpoint`] (its transport and stream proxy) and every request method on it;
//!   `prepared`: [`PreparedTransfer`]; `api`: the [`Engine`]'s methods and the listeners.

mod api;
mod auth;
mod copy;
mod descriptor;
mod endpoint;
mod engine;
#[cfg(feature = "p2p")]
mod export;
#[cfg(feature = "p2p")]
mod local;
pub mod membership;
mod meter;
mod named;
mod pending;
mod plan;
mod prepared;
mod rails;
mod region;
mod registry;
mod request;
mod shared;
mod stream;
mod transport;
mod wire;

#[cfg(feature = "p2p")]
pub use api::LocalListener;
pub use api::TransferListener;
pub use auth::{AuthKey, Authentication, LocalPeers};
pub use descriptor::{
    DESCRIPTOR_VERSION, DescribedKind, IpcKind, IpcPart, MAX_DESCRIPTORS, MAX_RAILS,
    MemoryDescriptor, RemoteRange, decode_list, encode_list,
};
pub use endpoint::Endpoint;
pub use engine::{Engine, EngineConfig, PeerAccess, WindowStats};
pub use pending::{Transfer, TransferFuture, Transferred};
pub use prepared::PreparedTransfer;
pub use rails::{ListenerStats, RailFailure, RailState, RailStats};
pub use region::{Buffer, CacheCounters, IpcLink, LocalRange, MemoryPath, Region};
pub use request::{
    Direction, MAX_UNREAD_NOTIFICATIONS, Notification, TransferOptions, TransferReport,
};
pub use stream::{PROXY_NAP, STREAM_ERROR_BIT, StreamTransfer, StreamWord, TRIGGER_SLOTS};
