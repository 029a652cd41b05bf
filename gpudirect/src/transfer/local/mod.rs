//! Intra-node endpoints: two processes on one node meet over a Unix domain socket and move GPU
//! memory with CUDA IPC and stream-ordered copies, not through a NIC.
//!
//! Each side sends a first message (magic, version, its pid, the descriptors it publishes), then
//! the file descriptors of the VMM allocations and memory pools those descriptors name
//! (`SCM_RIGHTS`, at most [`MAX_FDS_PER_MSG`](crate::p2p::MAX_FDS_PER_MSG) a message, each message listing their export ids),
//! and checks the peer's: the same deadline bounds it all, and a peer that sends fewer, more or
//! other file descriptors than its descriptors name (each export once) is refused (every one
//! received closed). A request maps each remote range's allocation from its descriptor's
//! [`IpcPart`](crate::transfer::IpcPart): `cuIpcOpenMemHandle` of its handle; for VMM memory
//! `cuMemImportFromShareableHandle` of the file descriptor that came when the endpoints met
//! (once per allocation and local GPU, shared process-wide); for pool memory
//! `cuMemPoolImportFromShareableHandle` of the pool's file descriptor that came then (once per
//! pool, on the GPU holding it, with `cuMemPoolSetAccess` for each local GPU that copies) and
//! `cuMemPoolImportPointer` of the allocation's export data (once per allocation; freed before
//! its pool goes). It checks the range against the allocation length the peer claims and the
//! mapping's real size, and queues the copies (a launch of a CUDA graph of copy nodes by default,
//! else `cuMemcpyAsync`) on the stream(s) of the local memory's GPU of the calling thread's issue
//! lane (each lane its own streams and lock; a small request on a busy lane waits to go with the
//! next ones in one launch), then takes an epoch of
//! each stream's completion timeline (no driver call: an event is recorded only when someone
//! looks, covering every request queued before, and events are recycled). A lane's requests
//! finish in the order they were made, each only once its epochs complete, and those with a
//! notification in request order across lanes; only then is a notification sent over the
//! socket, so the peer sees a notification only once its bytes are in its memory. A caller
//! blocked in [`Transfer::wait`](crate::transfer::Transfer::wait) finishes what is done on its
//! request's lane itself; a worker thread does it for requests with a notification, and for the others once
//! they are polled, awaited, made an `InFlight` or dropped unfinished, or at its next look
//! (at least every 100 ms), so that a waiting caller is not slowed by the worker's wake-up and
//! queries beside its own copies. A reader thread
//! delivers the peer's notifications and ends the endpoint when the socket closes.
//!
//! # Where things live
//!
//! Bottom up, each file imports only those before it:
//!
//! - `import`: peers' allocations and pools mapped here (process-wide caches), GPUs by UUID,
//!   the link between two GPUs.
//! - `socket`: bounded sends and reads on the socket, the frames after the first messages.
//! - `hello`: the first message.
//! - `peer`: the peer's pid as the kernel gives it (the peer check).
//! - `fds`: the exported file descriptors (VMM, pool) that cross when the endpoints meet.
//! - `meet`: the meeting (first messages and file descriptors, one deadline), dialing.
//! - `state`: the endpoint's state under its lock; failing it, delivering a notification.
//! - `copies`: pieces spread over the streams, queued, and what they reach held.
//! - `kernel`: the copy kernels: a stream-ordered request's copy and trigger in one launch; the
//!   copies of requests waiting on a busy lane gathered into one launch.
//! - `side`: the socket, its reader, the copy streams and the worker that finishes requests.
//! - `request`: a request checked, mapped and issued; prepared requests; stream-ordered copies.
//! - `handle`: the transport as the endpoint holds it ([`Local`]).
//! - `listen`: the listener and connecting.
//!
//! The exports of registered memory (what a peer maps) are made at registration, in
//! `transfer/export.rs`.

mod copies;
mod fds;
mod graphs;
mod handle;
mod hello;
mod import;
mod kernel;
mod listen;
mod meet;
mod peer;
mod request;
mod side;
mod socket;
mod state;

pub(crate) use handle::Local;
pub(crate) use listen::{Listener, connect, listen};
pub(crate) use request::{Queued, Ready, Staged};
