//! An endpoint's metrics through the `metrics` facade (the program installs the exporter):
//! per peer, requests and bytes asked for by direction, requests refused, failures, reconnects;
//! per rail, the rails' own counters (bytes, messages, notifications) copied over. The handles
//! are registered once per endpoint, so a request only adds to atomics; the rails' counters are
//! copied at most every [`RAIL_SAMPLE`] when requests are made, and when the endpoint closes.
//! Labels: `peer` (the segment name for an endpoint found by name, else `unnamed`) and `rail`
//! (its index) with `device`.

use super::rails::RailStats;
use super::request::Direction;
use metrics::{Counter, counter};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// How often at most the rails' counters are copied while requests are made.
pub(crate) const RAIL_SAMPLE: std::time::Duration = std::time::Duration::from_millis(100);

/// One rail's metrics.
struct Rail {
    bytes_written: Counter,
    bytes_read: Counter,
    writes: Counter,
    reads: Counter,
    notes_sent: Counter,
    notes_received: Counter,
    failures: Counter,
}

/// One endpoint's metrics.
pub(crate) struct Meter {
    peer: String,
    requests: [Counter; 2],
    bytes: [Counter; 2],
    refused: Counter,
    rails: Mutex<Vec<Rail>>,
    /// Nanoseconds since `born` at the last copy of the rails' counters.
    sampled: AtomicU64,
    born: Instant,
}

fn dir_index(d: Direction) -> usize {
    match d {
        Direction::Write => 0,
        Direction::Read => 1,
    }
}

impl Meter {
    /// The metrics of an endpoint to `peer`.
    pub(crate) fn new(peer: &str) -> Meter {
        let p = peer.to_string();
        let per_dir = |name: &'static str| {
            ["write", "read"].map(|d| counter!(name, "peer" => p.clone(), "direction" => d))
        };
        Meter {
            requests: per_dir("gpudirect_transfer_requests_total"),
            bytes: per_dir("gpudirect_transfer_request_bytes_total"),
            refused: counter!("gpudirect_transfer_requests_refused_total", "peer" => p.clone()),
            peer: p,
            rails: Mutex::new(Vec::new()),
            sampled: AtomicU64::new(0),
            born: Instant::now(),
        }
    }

    /// A request of `bytes` bytes was queued (`Ok`) or refused.
    pub(crate) fn request(&self, dir: Direction, bytes: u64, queued: bool) {
        if queued {
            self.requests[dir_index(dir)].increment(1);
            self.bytes[dir_index(dir)].increment(bytes);
        } else {
            self.refused.increment(1);
        }
    }

    /// Whether the rails' counters are due to be copied (at most every [`RAIL_SAMPLE`]).
    pub(crate) fn rails_due(&self) -> bool {
        let now = self.born.elapsed().as_nanos() as u64;
        let last = self.sampled.load(Ordering::Relaxed);
        now.saturating_sub(last) >= RAIL_SAMPLE.as_nanos() as u64
            && self
                .sampled
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// Copy the rails' cumulative counters.
    pub(crate) fn rails(&self, stats: &[RailStats]) {
        let mut rails = self.rails.lock().unwrap_or_else(|e| e.into_inner());
        while rails.len() < stats.len() {
            let i = rails.len();
            let (p, r, d) = (self.peer.clone(), i.to_string(), stats[i].device.clone());
            let c = |name: &'static str| counter!(name, "peer" => p.clone(), "rail" => r.clone(), "device" => d.clone());
            rails.push(Rail {
                bytes_written: c("gpudirect_rail_bytes_written_total"),
                bytes_read: c("gpudirect_rail_bytes_read_total"),
                writes: c("gpudirect_rail_writes_total"),
                reads: c("gpudirect_rail_reads_total"),
                notes_sent: c("gpudirect_rail_notifications_sent_total"),
                notes_received: c("gpudirect_rail_notifications_received_total"),
                failures: c("gpudirect_rail_failures_total"),
            });
        }
        for (m, s) in rails.iter().zip(stats) {
            m.bytes_written.absolute(s.bytes_written);
            m.bytes_read.absolute(s.bytes_read);
            m.writes.absolute(s.writes);
            m.reads.absolute(s.reads);
            m.notes_sent.absolute(s.notifications_sent);
            m.notes_received.absolute(s.notifications_received);
            m.failures.absolute(s.failures);
        }
    }

    /// The endpoint ended: `why` (an error's kind) is counted.
    pub(crate) fn ended(&self, why: &'static str) {
        counter!("gpudirect_endpoint_failures_total", "peer" => self.peer.clone(), "why" => why)
            .increment(1);
    }

    /// The endpoint connected again.
    pub(crate) fn reconnected(&self) {
        counter!("gpudirect_endpoint_reconnects_total", "peer" => self.peer.clone()).increment(1);
    }
}

/// A short name of why an endpoint failed, for a label.
pub(crate) fn kind(e: &crate::Error) -> &'static str {
    use crate::Error as E;
    match e {
        E::Timeout { .. } => "deadline",
        E::CmEvent { .. } => "disconnected",
        E::WorkCompletion { .. } => "completion",
        E::PeerLeft { .. } => "peer_left",
        E::Os { .. } => "os",
        E::InvalidArgument { .. } => "protocol",
        _ => "other",
    }
}

/// A handshake made (`side`: `connect`, `accept`; `via`: `rails`, `local`) in `secs` seconds,
/// or failed.
pub(crate) fn handshake(peer: &str, side: &'static str, via: &'static str, secs: Option<f64>) {
    let peer = peer.to_string();
    match secs {
        Some(s) => {
            counter!("gpudirect_handshakes_total", "peer" => peer.clone(), "side" => side, "via" => via)
                .increment(1);
            metrics::histogram!("gpudirect_handshake_seconds", "peer" => peer, "side" => side, "via" => via)
                .record(s);
        }
        None => counter!("gpudirect_handshake_errors_total", "peer" => peer, "side" => side, "via" => via)
            .increment(1),
    }
}
