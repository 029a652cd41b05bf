//! One rail of an endpoint: its queue pair, completion queues and channel, its rdma_cm link,
//! the messages queued and posted on it, and its counters.

use crate::rdma::{
    BoundWindow, CmLink, CompletionChannel, CompletionQueue, ErrorState, Local, MemoryRegion,
    MrSlice, QueuePair, RemoteSlice, Rts,
};
use crate::transfer::engine::PeerAccess;
use crate::transfer::request::Direction;
use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// Tag of the notification receives.
pub(super) const RECV_TAG: u64 = u64::MAX - 7;
/// The notification rail: notifications and credit returns travel on rail 0, so they arrive in
/// the order they were sent.
pub(super) const NOTIFY_RAIL: usize = 0;
/// The longest sleep of the progress thread between looks at the deadlines.
pub(super) const TICK: Duration = Duration::from_millis(20);
/// Messages in flight or queued on an endpoint's rails above which waiting threads do not spin
/// (they sleep until the progress thread wakes them): a wait behind that much work is long
/// next to a thread hand-off, and the CPU a spinning thread takes is better left to the NIC
/// (on a software NIC, the NIC is the CPU).
pub(super) const SPIN_DEPTH: usize = 16;
/// The longest sleep of the progress thread while a waiting thread polls the CQs: a waiter
/// that stops may leave them unarmed (no event to wake anyone) when nothing else waits, and
/// the progress thread then looks within this.
pub(super) const LINGER: Duration = Duration::from_millis(1);

/// Counters of one rail (cumulative over reconnects).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RailStats {
    /// The local verbs device.
    pub device: String,
    /// Bytes written to the peer.
    pub bytes_written: u64,
    /// Bytes read from the peer.
    pub bytes_read: u64,
    /// RDMA writes completed.
    pub writes: u64,
    /// RDMA reads completed.
    pub reads: u64,
    /// Notifications sent.
    pub notifications_sent: u64,
    /// Notifications received.
    pub notifications_received: u64,
}

#[derive(Default)]
pub(super) struct RailCounters {
    pub(super) bytes_written: AtomicU64,
    pub(super) bytes_read: AtomicU64,
    pub(super) writes: AtomicU64,
    pub(super) reads: AtomicU64,
    pub(super) notes_sent: AtomicU64,
    pub(super) notes_received: AtomicU64,
}

/// A message waiting to be posted.
pub(super) enum Wr {
    Write {
        local: MrSlice,
        remote: RemoteSlice,
        imm: Option<u32>,
        signaled: bool,
    },
    Read {
        local: MrSlice,
        remote: RemoteSlice,
        signaled: bool,
    },
    /// Return notification credits (a send with immediate, no payload).
    Credits(u32),
}

impl Wr {
    pub(super) fn bytes(&self) -> u64 {
        match self {
            Wr::Write { local, .. } | Wr::Read { local, .. } => local.len() as u64,
            Wr::Credits(_) => 0,
        }
    }
}

/// A message posted: its sequence number on the rail (its tag), its request (0: internal).
pub(super) struct Posted {
    pub(super) seq: u64,
    pub(super) req: u64,
    pub(super) bytes: u64,
    pub(super) dir: Option<Direction>,
    pub(super) imm: bool,
}

pub(super) enum QpSlot {
    Rts(QueuePair<Rts>),
    /// In the error state, kept until the rail goes (its drop drains and destroys it).
    Error {
        _qp: QueuePair<ErrorState>,
    },
    Gone,
}

/// One rail: its queue pair, CQs, channel, the rdma_cm link, and its message queues.
pub(super) struct Rail {
    /// The peer's windows bound through `qp`: first, so they are deallocated before it goes (a
    /// queue pair dropped with windows bound is leaked).
    pub(super) windows: Vec<BoundWindow>,
    /// What the peer's descriptors of this rail give it.
    pub(super) access: PeerAccess,
    pub(super) qp: QpSlot,
    pub(super) send_cq: CompletionQueue,
    pub(super) recv_cq: CompletionQueue,
    pub(super) channel: CompletionChannel,
    pub(super) link: CmLink,
    /// Engine device of this rail; the peer's device for it.
    pub(super) device: usize,
    pub(super) peer_device: usize,
    pub(super) window: u32,
    pub(super) next_seq: u64,
    pub(super) inflight: VecDeque<Posted>,
    pub(super) pending: VecDeque<(u64, Wr)>,
    /// The first message, kept while the peer may read it.
    pub(super) _hello: MemoryRegion<Local>,
}

impl Rail {
    pub(super) fn outstanding(&self) -> usize {
        self.inflight.len()
    }
}
