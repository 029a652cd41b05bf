//! What a request is and how it ends, shared by every transport: its direction, options and
//! report, the checks every request passes before anything is queued, and why an endpoint
//! stopped ([`Broken`]).

use super::descriptor::RemoteRange;
use super::region::{LocalRange, MemoryPath};
use crate::error::{Error, Result, WcStatus};
use std::time::Duration;

/// How long requests of a broken endpoint wait for their flushed completions before they are
/// finished anyway (the queue pairs keep what the NIC may still touch).
pub(super) const FLUSH_WAIT: Duration = Duration::from_secs(2);

/// Which way a request moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// RDMA write: local bytes to the peer.
    Write,
    /// RDMA read: the peer's bytes to local memory.
    Read,
}

/// Options of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TransferOptions {
    /// Notify the peer with this tag once every byte of the request is visible there (writes
    /// only).
    pub notify: Option<u32>,
    /// Finish (with [`Error::Timeout`]) if not done within this time of the call; `None` takes
    /// the engine's [`deadline`](super::EngineConfig::deadline). A deadline that passes ends the
    /// endpoint: on a reliable connection nothing behind a stuck message moves either.
    pub deadline: Option<Duration>,
}

impl TransferOptions {
    /// Notify the peer with `tag`.
    pub fn notify(tag: u32) -> Self {
        TransferOptions {
            notify: Some(tag),
            deadline: None,
        }
    }

    /// With this deadline.
    pub fn deadline(mut self, d: Duration) -> Self {
        self.deadline = Some(d);
        self
    }
}

/// What a finished request did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferReport {
    /// Write or read.
    pub direction: Direction,
    /// Bytes moved.
    pub bytes: u64,
    /// Messages posted (after splitting and striping).
    pub messages: u64,
    /// Bytes per rail of the endpoint (rail order).
    pub rail_bytes: Vec<u64>,
    /// How each pair's local memory reached the NIC, in pair order.
    pub paths: Vec<MemoryPath>,
    /// From the call to the last completion.
    pub elapsed: Duration,
    /// The notification tag sent, if any.
    pub notified: Option<u32>,
    /// Messages posted again on another rail after theirs failed (0: no rail failed under
    /// this request; `Endpoint::rail_stats` says which and why).
    pub reposted: u64,
}

impl TransferReport {
    /// Rails that carried bytes.
    pub fn rails_used(&self) -> Vec<usize> {
        (0..self.rail_bytes.len())
            .filter(|&r| self.rail_bytes[r] > 0)
            .collect()
    }

    /// Throughput in 10⁹ bytes per second.
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9) / 1e9
    }
}

/// A notification from the peer: the tag it gave, delivered only once the bytes of its request
/// are visible here (for GPU memory, after the flush the device needs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Notification {
    /// The peer's tag.
    pub tag: u32,
}

/// Why an endpoint stopped.
#[derive(Debug, Clone)]
pub(crate) enum Broken {
    Deadline(Duration),
    Disconnected(&'static str, i32),
    Completion {
        status: WcStatus,
        vendor_err: u32,
        qp_num: u32,
    },
    Protocol(String),
    Closed,
    Os(&'static str, i32),
    /// The peer (segment name, node) left the membership (`transfer::membership`).
    PeerLeft(String, String),
    /// The peer gave up one rail (it found it failed first); never the endpoint's cause.
    RailGivenUp,
}

impl Broken {
    pub(super) fn to_error(&self) -> Error {
        match self {
            Broken::Deadline(after) => Error::Timeout {
                what: "transfer (the endpoint was closed: a message got no answer in time)",
                after: *after,
            },
            Broken::Disconnected(got, status) => Error::CmEvent {
                call: "transfer",
                expected: "RDMA_CM_EVENT_ESTABLISHED",
                got: got.to_string(),
                status: *status,
            },
            Broken::Completion {
                status,
                vendor_err,
                qp_num,
            } => Error::WorkCompletion {
                status: *status,
                vendor_err: *vendor_err,
                qp_num: *qp_num,
            },
            Broken::Protocol(why) => Error::invalid("peer", "its messages", why.clone()),
            Broken::Closed => Error::invalid(
                "endpoint",
                "closed",
                "the endpoint was closed; reconnect or connect again",
            ),
            Broken::Os(call, errno) => Error::errno(call, *errno),
            Broken::PeerLeft(name, node) => Error::PeerLeft {
                name: name.clone(),
                node: node.clone(),
            },
            Broken::RailGivenUp => Error::invalid("rail", "given up", "the peer found it failed"),
        }
    }

    pub(super) fn of(e: &Error) -> Broken {
        match e {
            Error::WorkCompletion {
                status,
                vendor_err,
                qp_num,
            } => Broken::Completion {
                status: *status,
                vendor_err: *vendor_err,
                qp_num: *qp_num,
            },
            Error::Os { call, source } => Broken::Os(call, source.raw_os_error().unwrap_or(0)),
            e => Broken::Protocol(e.to_string()),
        }
    }
}

/// The bytes of all pairs' ranges, checked.
///
/// # Errors
///
/// [`Error::InvalidArgument`] when they add up past 2^64.
pub(crate) fn pairs_bytes(pairs: &[(LocalRange, RemoteRange)]) -> Result<u64> {
    pairs.iter().try_fold(0u64, |t, (l, _)| {
        t.checked_add(l.len)
            .ok_or_else(|| Error::invalid("pairs", pairs.len(), "the lengths add up past 2^64"))
    })
}

/// The checks every request passes before anything is queued: at least one pair, the lengths of
/// each pair equal, notifications only with writes.
pub(crate) fn check_pairs(
    dir: Direction,
    pairs: &[(LocalRange, RemoteRange)],
    opts: &TransferOptions,
) -> Result<()> {
    if pairs.is_empty() {
        return Err(Error::invalid(
            "pairs",
            0,
            "a request moves at least one range",
        ));
    }
    if dir == Direction::Read && opts.notify.is_some() {
        return Err(Error::invalid(
            "notify",
            "a read",
            "notifications go with writes",
        ));
    }
    for (i, (l, r)) in pairs.iter().enumerate() {
        if l.len != r.len() {
            return Err(Error::invalid(
                "pairs",
                i,
                format!(
                    "local {} bytes, remote {} bytes: must match",
                    l.len,
                    r.len()
                ),
            ));
        }
    }
    Ok(())
}

/// Every local range is registered with the endpoint's engine: its registrations have one
/// region per device of that engine, in that engine's protection domains. (A region of another
/// engine indexed past its registrations, or its slices were refused by the queue pair, which
/// broke the whole endpoint.)
pub(super) fn check_same_engine(engine: u64, pairs: &[(LocalRange, RemoteRange)]) -> Result<()> {
    if let Some(i) = pairs
        .iter()
        .position(|(l, _)| l.region.entry.engine != engine)
    {
        return Err(Error::invalid(
            "pairs",
            i,
            "the local region was registered with another engine: register it with this \
             endpoint's engine",
        ));
    }
    Ok(())
}

/// The most notifications kept unread (`next_notification`, `notification`): a peer that
/// sends more ends the endpoint instead of growing this process's memory without bound.
pub const MAX_UNREAD_NOTIFICATIONS: usize = 1 << 20;

pub(super) fn unread_overflow() -> String {
    format!(
        "the peer sent more than {MAX_UNREAD_NOTIFICATIONS} notifications that were not read \
         (read them with next_notification, even when a notification counter is what waits)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_peer_that_left_ends_requests_typed() {
        let e = Broken::PeerLeft("decode-3".into(), "n1".into()).to_error();
        assert!(
            matches!(&e, Error::PeerLeft { name, node } if name == "decode-3" && node == "n1"),
            "{e:?}"
        );
    }

    #[test]
    fn regions_of_another_engine_are_refused_before_anything_is_queued() {
        use crate::transfer::region::{Buffer, Entry, Identity, Region};
        use crate::transfer::{DescribedKind, MemoryDescriptor};
        let region = |engine| {
            let buf = Buffer::host(vec![7u8; 64]).unwrap();
            Region {
                entry: Arc::new(Entry {
                    id: Identity::Host { backing: 1 },
                    engine,
                    start: 0,
                    len: 64,
                    mrs: Vec::new(),
                    path: MemoryPath::Host,
                    cached: false,
                    ordinal: None,
                    preferred: vec![0],
                    _keep: Vec::new(),
                    ipc: Err("a test".into()),
                }),
                buf,
                at: 0,
            }
        };
        let remote = MemoryDescriptor::new(0x1000, 64, DescribedKind::Host, &[1])
            .unwrap()
            .all();
        let pairs = vec![(region(3).all(), remote), (region(4).all(), remote)];
        let e = check_same_engine(3, &pairs).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "pairs", .. }) && e.to_string().contains('1'),
            "{e}"
        );
        assert!(check_same_engine(3, &pairs[..1]).is_ok());
    }
}
