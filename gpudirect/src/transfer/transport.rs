//! What carries an endpoint's requests: a closed enum of the transports, matched where the
//! transport matters. The transports never import each other; this file is the one place that
//! knows both.

use super::descriptor::{MemoryDescriptor, RemoteRange};
use super::engine::{Engine, PeerAccess};
#[cfg(feature = "p2p")]
use super::local::Local;
use super::pending::Transfer;
use super::rails::{RailStats, Rails};
use super::region::{LocalRange, Region};
use super::request::{Broken, Direction, Notification, TransferOptions};
use super::shared::Look;
use super::stream::Counter;
use crate::error::{Error, Result};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// An endpoint's transport.
pub(crate) enum Transport {
    /// Across nodes: one reliable queue pair per rail, through rdma_cm.
    Rails(Rails),
    /// Inside a node: a Unix socket, CUDA IPC and stream-ordered copies.
    #[cfg(feature = "p2p")]
    Local(Local),
}

/// `$body` with `$s` bound to the transport's shared endpoint state (every transport has one).
macro_rules! shared {
    ($t:expr, $s:ident => $body:expr) => {
        match $t {
            Transport::Rails(r) => {
                let $s = r.shared();
                $body
            }
            #[cfg(feature = "p2p")]
            Transport::Local(l) => {
                let $s = l.shared();
                $body
            }
        }
    };
}

impl Transport {
    /// The engine.
    pub(crate) fn engine(&self) -> &Engine {
        shared!(self, s => &s.engine)
    }

    /// A request. `keep` (the endpoint) is held by a worker that outlives the call (the staged
    /// path), so that the endpoint stays open until the request ends.
    ///
    /// # Errors
    ///
    /// As [`Endpoint::transfer`](super::Endpoint::transfer).
    pub(crate) fn transfer<K: Clone + Send + 'static>(
        &self,
        keep: &K,
        dir: Direction,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<Transfer> {
        match self {
            Transport::Rails(r) => r.transfer(keep, dir, pairs, opts),
            #[cfg(feature = "p2p")]
            Transport::Local(l) => l.transfer(dir, pairs, opts),
        }
    }

    /// The checks a request passes before anything is queued, queueing nothing.
    ///
    /// # Errors
    ///
    /// As [`Endpoint::transfer`](super::Endpoint::transfer).
    pub(crate) fn check_request(
        &self,
        dir: Direction,
        pairs: &[(LocalRange, RemoteRange)],
        opts: &TransferOptions,
    ) -> Result<()> {
        match self {
            Transport::Rails(r) => r.check_request(dir, pairs, opts),
            #[cfg(feature = "p2p")]
            Transport::Local(l) => l.check_request(dir, pairs, opts),
        }
    }

    /// The descriptors the peer published.
    pub(crate) fn peer_descriptors(&self) -> Vec<MemoryDescriptor> {
        shared!(self, s => s.peer_descriptors())
    }

    /// Why the endpoint stopped, if it has.
    pub(crate) fn failure(&self) -> Option<Error> {
        shared!(self, s => s.failure())
    }

    /// Rails (none inside a node).
    pub(crate) fn rails(&self) -> usize {
        match self {
            Transport::Rails(r) => r.rails(),
            #[cfg(feature = "p2p")]
            Transport::Local(_) => 0,
        }
    }

    /// What the peer's descriptors give it (none inside a node: no rkeys).
    pub(crate) fn peer_access(&self) -> Option<PeerAccess> {
        match self {
            Transport::Rails(r) => Some(r.peer_access()),
            #[cfg(feature = "p2p")]
            Transport::Local(_) => None,
        }
    }

    /// Windows over `region` for the peer (rails only).
    ///
    /// # Errors
    ///
    /// As [`Endpoint::grant`](super::Endpoint::grant).
    pub(crate) fn grant(&self, region: &Region) -> Result<MemoryDescriptor> {
        match self {
            Transport::Rails(r) => r.grant(region),
            #[cfg(feature = "p2p")]
            Transport::Local(_) => Err(Error::Unsupported {
                what: "Endpoint::grant".into(),
                reason: "an endpoint inside a node reaches memory through CUDA IPC, which no \
                         window limits or revokes"
                    .into(),
            }),
        }
    }

    /// Per-rail counters (none inside a node).
    pub(crate) fn rail_stats(&self) -> Vec<RailStats> {
        match self {
            Transport::Rails(r) => r.rail_stats(),
            #[cfg(feature = "p2p")]
            Transport::Local(_) => Vec::new(),
        }
    }

    /// The next notification, waiting up to `timeout`.
    ///
    /// # Errors
    ///
    /// The endpoint's failure, once it has failed and no notification is left.
    pub(crate) fn next_notification(&self, timeout: Duration) -> Result<Option<Notification>> {
        match self {
            Transport::Rails(r) => r.next_notification(timeout),
            #[cfg(feature = "p2p")]
            Transport::Local(l) => l.next_notification(timeout),
        }
    }

    /// One look for a notification by `deadline`, for a future.
    pub(crate) fn look_for_note(&self, deadline: Instant) -> Look {
        match self {
            Transport::Rails(r) => r.look_for_note(deadline),
            #[cfg(feature = "p2p")]
            Transport::Local(l) => l.shared().look_for_note(deadline),
        }
    }

    /// The endpoint's notification counter, made by `make` on first use.
    ///
    /// # Errors
    ///
    /// What `make` returns.
    pub(crate) fn counter(
        &self,
        make: impl FnOnce(u64) -> Result<Arc<Counter>>,
    ) -> Result<Arc<Counter>> {
        match self {
            Transport::Rails(r) => {
                let c = r.shared().counter(make)?;
                // The counter waits without polling: CQs a waiter left unarmed are watched now.
                r.watch();
                Ok(c)
            }
            #[cfg(feature = "p2p")]
            Transport::Local(l) => l.shared().counter(make),
        }
    }

    /// Rails, requests in flight, and why the endpoint stopped (for `Debug`).
    pub(crate) fn describe(&self) -> (usize, usize, Option<Broken>) {
        match self {
            Transport::Rails(r) => r.describe(),
            #[cfg(feature = "p2p")]
            Transport::Local(l) => l.describe(),
        }
    }

    /// Take failed rails back (rails only; inside a node there are none).
    ///
    /// # Errors
    ///
    /// As [`Endpoint::restore_rails`](super::Endpoint::restore_rails).
    pub(crate) fn restore_rails(&self) -> Result<Vec<usize>> {
        match self {
            Transport::Rails(r) => r.restore_rails(),
            #[cfg(feature = "p2p")]
            Transport::Local(_) => Ok(Vec::new()),
        }
    }

    /// Connect again (the side that connected).
    ///
    /// # Errors
    ///
    /// As [`Endpoint::reconnect`](super::Endpoint::reconnect).
    pub(crate) fn reconnect(&self) -> Result<()> {
        match self {
            Transport::Rails(r) => r.reconnect(),
            #[cfg(feature = "p2p")]
            Transport::Local(l) => l.reconnect(),
        }
    }

    /// Close, the endpoint ended with `cause` first (unless it already was): requests in
    /// flight end with its error.
    pub(crate) fn close_with(&self, cause: Broken) {
        match self {
            Transport::Rails(r) => r.close_with(cause),
            #[cfg(feature = "p2p")]
            Transport::Local(l) => l.close_with(cause),
        }
    }

    /// Close: every request ends, the threads are joined.
    pub(crate) fn close(&self) {
        match self {
            Transport::Rails(r) => r.close(),
            #[cfg(feature = "p2p")]
            Transport::Local(l) => l.close(),
        }
    }
}
