//! One rail of an endpoint: its queue pair, completion queues and channel, its rdma_cm link,
//! the messages queued and posted on it, and its counters.

use crate::error::{Error, Result, WcStatus};
use crate::rdma::{
    BoundWindow, CmLink, CompletionChannel, CompletionQueue, ErrorState, Local, MemoryRegion,
    MrSlice, QueuePair, RecvRequest, RemoteSlice, Rts,
};
use crate::transfer::engine::PeerAccess;
use crate::transfer::plan::Credits;
use crate::transfer::region::{Entry, RailMr};
use crate::transfer::request::{Broken, Direction};
use smallvec::SmallVec;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

/// Tag of the notification receives.
pub(super) const RECV_TAG: u64 = u64::MAX - 7;
/// The notification rail while it is up: notifications travel on rail 0 (then the first rail
/// up), so they arrive in the order they were sent.
pub(super) const NOTIFY_RAIL: usize = 0;
/// A control message's immediate (a send; a credit return's count never has this bit).
pub(super) const CTL: u32 = 1 << 31;
/// A control message that answers (else it asks).
pub(super) const CTL_ANSWER: u32 = 1 << 30;
/// Bits of a control message's count (notifications received on its rail, modulo).
pub(super) const CTL_COUNT: u32 = (1 << 20) - 1;
/// The most bytes a rail's queue pair sends inline (`max_inline_data`): small writes of host
/// memory go that way.
pub(super) const INLINE_MAX: u32 = 64;

/// Where a control message puts the generation of the rail it names (4 bits, modulo): a
/// question or answer about another connection of that rail than the current one is stale.
const CTL_GEN_SHIFT: u32 = 20;

/// Rails a control message can name (6 bits).
pub(super) const MAX_RAILS: usize = 64;
/// The longest sleep of the progress thread between looks at the deadlines.
pub(super) const TICK: Duration = Duration::from_millis(20);
/// Messages in flight or queued on an endpoint's rails above which waiting threads do not spin
/// (they sleep until the progress thread wakes them): a wait behind that much work is long
/// next to a thread hand-off, and the CPU a spinning thread takes is better left to the NIC
/// (on a software NIC, the NIC is the CPU).
pub(super) const SPIN_DEPTH: usize = 16;
/// How long a rail the peer gave up keeps its queue pair while messages posted on it are
/// unfinished. The peer sees only its queue pair err, not which message did it: a message it
/// refused (a wrong rkey) completes here in error a little after, and is then known to be its
/// request's fault rather than posted again on the rails left (where it would be refused too).
pub(super) const GIVEN_UP_GRACE: Duration = Duration::from_millis(50);
/// The first sleep of the progress thread while a waiting thread polls the CQs (doubled while
/// it keeps polling alone, up to [`LINGER_MAX`]): a waiter that stops may leave them unarmed
/// (no event to wake anyone) when nothing else waits, and the progress thread then looks
/// within its sleep; a waiter that stopped within this long counts as polling.
pub(super) const LINGER: Duration = Duration::from_millis(1);
/// The longest the progress thread sleeps while waiters keep polling the CQs ([`LINGER`],
/// doubled at each of its passes that finds them still looking).
pub(super) const LINGER_MAX: Duration = Duration::from_millis(8);

/// The question: how many notifications arrived on rail `about` (its generation `generation`)?
pub(super) fn ctl_ask(about: usize, generation: u32) -> u32 {
    CTL | ((about as u32) << 24) | ((generation & 0xf) << CTL_GEN_SHIFT)
}

/// The answer: `n` notifications arrived on rail `about` (generation `generation`).
pub(super) fn ctl_answer(about: usize, generation: u32, n: u32) -> u32 {
    ctl_ask(about, generation) | CTL_ANSWER | (n & CTL_COUNT)
}

/// A control message's parts: (answer, the rail it names, that rail's generation modulo 16,
/// the count).
pub(super) fn ctl_parts(c: u32) -> (bool, usize, u32, u32) {
    (
        c & CTL_ANSWER != 0,
        ((c >> 24) & 0x3f) as usize,
        (c >> CTL_GEN_SHIFT) & 0xf,
        c & CTL_COUNT,
    )
}

/// `n` notification receives (tagged [`RECV_TAG`]), to post on a rail's queue pair.
pub(super) fn note_receives(n: usize) -> impl Iterator<Item = RecvRequest> {
    (0..n).map(|_| RecvRequest::empty().tag(RECV_TAG))
}

/// Whether a rail carries messages.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum RailState {
    /// Up since the endpoint connected (or reconnected), or since the rail came back.
    #[default]
    Up,
    /// Failed: its messages went to the rails left (the endpoint fails with its last rail).
    Failed(RailFailure),
}

/// Why a rail failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RailFailure {
    /// A message completed in error: `RetryExceeded` when the link stopped answering for the
    /// ACK timeout times 8 ([`EngineConfig::ack_timeout`](crate::transfer::EngineConfig::ack_timeout)).
    Completion {
        /// Its status.
        status: WcStatus,
        /// The device's own code.
        vendor_err: u32,
    },
    /// rdma_cm ended the rail's connection.
    Disconnected {
        /// The event (`RDMA_CM_EVENT_DISCONNECTED`, `RDMA_CM_EVENT_DEVICE_REMOVAL`).
        event: &'static str,
        /// Its status.
        status: i32,
    },
    /// The peer found it failed first and said so over another rail.
    PeerGaveUp,
    /// Another error (posting, polling), as text.
    Other(String),
}

impl RailFailure {
    pub(super) fn of(b: &Broken) -> RailFailure {
        match b {
            Broken::Completion {
                status, vendor_err, ..
            } => RailFailure::Completion {
                status: *status,
                vendor_err: *vendor_err,
            },
            Broken::Disconnected(event, status) => RailFailure::Disconnected {
                event,
                status: *status,
            },
            Broken::RailGivenUp => RailFailure::PeerGaveUp,
            other => RailFailure::Other(other.to_error().to_string()),
        }
    }
}

/// Counters of one rail (cumulative over reconnects).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RailStats {
    /// The local verbs device.
    pub device: String,
    /// Up, or failed and why.
    pub state: RailState,
    /// Times it failed (while another rail was up, or with the endpoint).
    pub failures: u64,
    /// Times it came back after failing (reconnected alone, authenticated as at connect).
    pub restored: u64,
    /// Messages it had not completed when it failed, posted again on the rails left.
    pub reposted: u64,
    /// Notifications posted on it without a completion when it failed: the peer was asked
    /// whether they arrived.
    pub notifications_in_doubt: u64,
    /// Of those, the ones the peer had not received: sent again on another rail.
    pub notifications_resent: u64,
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
    pub(super) failures: AtomicU64,
    pub(super) restored: AtomicU64,
    pub(super) reposted: AtomicU64,
    pub(super) in_doubt: AtomicU64,
    pub(super) resent: AtomicU64,
}

/// What an endpoint knows of one rail beyond its connection: whether it failed, its
/// notification credits, and its notifications counted each way since it connected.
pub(super) struct Lane {
    /// Failed: why, and when (its posted memory is released once flushed, or this plus
    /// `FLUSH_WAIT`).
    pub(super) failed: Option<(Broken, Instant)>,
    pub(super) credits: Credits,
    /// Notifications posted on this rail (the next one's index).
    pub(super) notes_out: u32,
    /// Notifications received on it.
    pub(super) notes_in: u32,
    /// Control messages to send on it ([`CTL`]), against its credits.
    pub(super) ctl: VecDeque<u32>,
    /// This side asked (on another rail) how many notifications arrived on this failed rail
    /// and has no answer yet: the rail does not come back before it has one.
    pub(super) asked: bool,
    /// Times the rail came back on this endpoint, as both sides agreed when it did.
    pub(super) generation: u32,
    /// The peer gave this rail up while messages posted on it were unfinished (since then):
    /// nothing more is posted on it, and it fails once their completions are seen or
    /// [`GIVEN_UP_GRACE`] passed, whichever comes first.
    pub(super) given_up: Option<Instant>,
    /// Receives the peer used here, to be posted again at the next look for completions
    /// (not in the look that found them: a notification's answer goes first); owed to the
    /// peer as credits only once posted.
    pub(super) used: usize,
}

impl Lane {
    pub(super) fn new(credits: Credits) -> Lane {
        Lane {
            failed: None,
            credits,
            notes_out: 0,
            notes_in: 0,
            ctl: VecDeque::new(),
            asked: false,
            generation: 0,
            given_up: None,
            used: 0,
        }
    }

    pub(super) fn up(&self) -> bool {
        self.failed.is_none()
    }

    /// Up, and not given up by the peer: messages may go on it.
    pub(super) fn usable(&self) -> bool {
        self.up() && self.given_up.is_none()
    }
}

/// Where a data message's bytes are, whatever the rail: what makes it again on another rail
/// when its own fails.
#[derive(Clone)]
pub(super) struct Again {
    pub(super) entry: Arc<Entry>,
    /// Offset in the registration.
    pub(super) off: usize,
    /// The remote descriptor's rkeys, one per device of the peer.
    pub(super) rkeys: SmallVec<[u32; 8]>,
}

impl Again {
    /// The registration on `rail`'s device.
    fn mr<'a>(&'a self, rail: &Rail) -> Result<&'a RailMr> {
        self.entry.mrs.get(rail.device).ok_or_else(|| {
            Error::invalid("rail", rail.device, "the memory is not registered there")
        })
    }

    /// The remote memory's rkey on `rail`'s peer device (before the rail's renaming).
    fn rkey(&self, rail: &Rail) -> Result<u32> {
        self.rkeys.get(rail.peer_device).copied().ok_or_else(|| {
            Error::invalid(
                "rail",
                rail.peer_device,
                "the remote memory has no rkey there",
            )
        })
    }
}

/// A message waiting to be posted.
#[derive(Clone)]
pub(super) enum Wr {
    Write {
        local: MrSlice,
        remote: RemoteSlice,
        imm: Option<u32>,
        signaled: bool,
        again: Again,
    },
    Read {
        local: MrSlice,
        remote: RemoteSlice,
        signaled: bool,
        again: Again,
    },
    /// Return notification credits (a send with immediate, no payload).
    Credits(u32),
    /// A control message ([`CTL`]): a send with immediate, no payload.
    Ctl(u32),
}

impl Wr {
    pub(super) fn bytes(&self) -> u64 {
        match self {
            Wr::Write { local, .. } | Wr::Read { local, .. } => local.len() as u64,
            Wr::Credits(_) | Wr::Ctl(_) => 0,
        }
    }

    /// A data message (a write or a read, with or without immediate).
    pub(super) fn is_data(&self) -> bool {
        matches!(self, Wr::Write { .. } | Wr::Read { .. })
    }

    /// A write carrying a notification.
    pub(super) fn is_note(&self) -> bool {
        matches!(self, Wr::Write { imm: Some(_), .. })
    }

    /// Whether [`on`](Self::on) would give the message for `rail`, building nothing.
    pub(super) fn fits(&self, rail: &Rail) -> Result<()> {
        match self {
            Wr::Write { local, again, .. } | Wr::Read { local, again, .. } => {
                again
                    .mr(rail)?
                    .check_slice(again.off, local.len() as usize)?;
                again.rkey(rail).map(|_| ())
            }
            Wr::Credits(_) | Wr::Ctl(_) => Ok(()),
        }
    }

    /// The same data message for `rail` (its device's registration, the peer device's rkey),
    /// signaled: it may be a rail's last. `None` for other messages.
    pub(super) fn on(&self, rail: &Rail) -> Option<Result<Wr>> {
        let remake = |local: &MrSlice, remote: &RemoteSlice, again: &Again| -> Result<_> {
            let local = again.mr(rail)?.slice(again.off, local.len() as usize)?;
            let rkey = rail.peer_rkey(again.rkey(rail)?);
            Ok((local, RemoteSlice { rkey, ..*remote }))
        };
        Some(match self {
            Wr::Write {
                local,
                remote,
                imm,
                again,
                ..
            } => remake(local, remote, again).map(|(local, remote)| Wr::Write {
                local,
                remote,
                imm: *imm,
                signaled: true,
                again: again.clone(),
            }),
            Wr::Read {
                local,
                remote,
                again,
                ..
            } => remake(local, remote, again).map(|(local, remote)| Wr::Read {
                local,
                remote,
                signaled: true,
                again: again.clone(),
            }),
            Wr::Credits(_) | Wr::Ctl(_) => return None,
        })
    }
}

/// A message posted: its sequence number on the rail (its tag), its request (0: internal).
pub(super) struct Posted {
    pub(super) seq: u64,
    pub(super) req: u64,
    pub(super) bytes: u64,
    pub(super) dir: Option<Direction>,
    pub(super) imm: bool,
    /// A data message, kept to be posted again elsewhere if this rail fails before its
    /// completion.
    pub(super) wr: Option<Wr>,
    /// A notification: its index among the rail's ([`Lane::notes_out`]).
    pub(super) note: Option<u32>,
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
    /// A rail that came back under windows: the peer's windows through it, by the rkey its
    /// descriptors name (the first window over that range), as the peer bound them again.
    pub(super) renamed: HashMap<u32, u32>,
    /// A rail that came back under windows: this side's windows through it (their rkeys), by
    /// the rkey the peer's descriptors name for their range.
    pub(super) firsts: HashMap<u32, u32>,
    /// The windows revoked when the rail failed: each one's range and the rkey the peer's
    /// descriptors name for it (bound again if the rail comes back).
    pub(super) lost: Vec<(MrSlice, u32)>,
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

    /// The rkey to use through this rail for the peer's memory its descriptors name `k`.
    pub(super) fn peer_rkey(&self, k: u32) -> u32 {
        self.renamed.get(&k).copied().unwrap_or(k)
    }
}
