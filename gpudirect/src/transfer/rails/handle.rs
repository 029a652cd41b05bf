//! The verbs transport of one endpoint as the endpoint holds it ([`Rails`]): started with its
//! progress thread; its requests (registered memory straight to the rails, staged memory
//! through the bounce ring); reconnecting, closing, and its counters.

use super::back::restore;
use super::grant::grant;
use super::handshake::dial;
use super::post::{Ready, check_request};
use super::progress::{close, drain_after_close, progress_loop};
use super::rail::{RailFailure, RailState, RailStats, TICK};
use super::staging::staged;
use super::state::{Connected, Link, Origin, State, break_endpoint, force_finish, new_state};
use super::wait::{look_for_note, next_notification, request, request_ready};
use crate::completion::thread::join_unless_current;
use crate::error::{Error, Result};
use crate::transfer::descriptor::{MemoryDescriptor, RemoteRange};
use crate::transfer::engine::{Engine, PeerAccess};
use crate::transfer::pending::Transfer;
use crate::transfer::region::{LocalRange, Region};
use crate::transfer::request::{Broken, Direction, FLUSH_WAIT, Notification, TransferOptions};
use crate::transfer::shared::{EpInner, Look};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// An endpoint's rails: what its requests, the progress thread and the endpoint share, and the
/// progress thread.
pub(crate) struct Rails {
    link: Arc<Link>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// Take `link`'s failed rails back on a thread of its own (the progress thread must not wait on
/// a connection); then, while a rail is still failed, try again after `rail_retry`.
fn retry(link: &Arc<Link>) {
    let again = |l: &Link| {
        let mut st = l.lock();
        if st.broken.is_none()
            && st.lanes.iter().any(|x| !x.up())
            && let Some(t) = l.ep.engine.inner.config.rail_retry
        {
            st.retry_at = Some(Instant::now() + t);
        }
    };
    let l = link.clone();
    let spawned = crate::driver::ctx::spawn_thread("gpudirect-rail-back", move || {
        let _ = restore(&l);
        again(&l);
    });
    if spawned.is_err() {
        again(link);
    }
}

impl Rails {
    /// The verbs side of a new (or accepted) endpoint: its state from the rails and the peer's
    /// first messages, and its progress thread.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for first messages that disagree; [`Error::Os`] from
    /// `eventfd`; as [`spawn_thread`](crate::driver::ctx::spawn_thread).
    pub(super) fn start(engine: Engine, connected: Connected, origin: Origin) -> Result<Rails> {
        let n = connected.rails.len();
        let state = new_state(&engine.inner, connected)?;
        let inner = Link::new(engine, state, n, origin)?;
        let t = inner.clone();
        let thread = crate::driver::ctx::spawn_thread("gpudirect-transfer", move || {
            // Streams wait for its notifications and for the requests it ends: what code run
            // here lets go of (a waker's) is freed elsewhere.
            crate::completion::elsewhere::frees_nothing();
            progress_loop(&t, retry)
        })?;
        Ok(Rails {
            link: inner,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The verbs side of the endpoint (a listener routes rails coming back to it).
    pub(super) fn link(&self) -> &Arc<Link> {
        &self.link
    }

    /// What the endpoint shares with its rails (notifications, failure, the peer's
    /// descriptors).
    pub(crate) fn shared(&self) -> &EpInner<State> {
        &self.link.ep
    }

    /// A request: registered memory straight to the rails, staged memory through the bounce
    /// ring on a worker that holds `keep` (the endpoint) until it ends.
    pub(crate) fn transfer<K: Clone + Send + 'static>(
        &self,
        keep: &K,
        dir: Direction,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<Transfer> {
        if pairs.iter().any(|(l, _)| l.region.entry.mrs.is_empty()) {
            staged(&self.link, keep.clone(), dir, pairs, opts)
        } else {
            request(&self.link, dir, pairs, opts)
        }
    }

    /// A request on registered memory checked once, to be posted many times with its messages
    /// built once per layout of the rails; `None` for staged memory (posted as a new request
    /// each time).
    ///
    /// # Errors
    ///
    /// As [`Endpoint::prepare`](crate::transfer::Endpoint::prepare).
    pub(crate) fn ready(
        &self,
        dir: Direction,
        pairs: &[(LocalRange, RemoteRange)],
        opts: TransferOptions,
    ) -> Result<Option<Ready>> {
        // A post's checks (`direct`'s among them: same engine, the rkeys), once here.
        check_request(&self.link, dir, pairs, &opts)?;
        if pairs.iter().any(|(l, _)| l.region.entry.mrs.is_empty()) {
            return Ok(None);
        }
        Ok(Some(Ready::new(dir, pairs.to_vec(), opts)))
    }

    /// Post a prepared request ([`ready`](Self::ready)) again.
    ///
    /// # Errors
    ///
    /// As [`Endpoint::transfer`](crate::transfer::Endpoint::transfer).
    pub(crate) fn post_ready(&self, ready: &Ready) -> Result<Transfer> {
        request_ready(&self.link, ready)
    }

    /// The checks a request passes before anything is queued, queueing nothing.
    ///
    /// # Errors
    ///
    /// As [`Endpoint::transfer`](crate::transfer::Endpoint::transfer).
    pub(crate) fn check_request(
        &self,
        dir: Direction,
        pairs: &[(LocalRange, RemoteRange)],
        opts: &TransferOptions,
    ) -> Result<()> {
        check_request(&self.link, dir, pairs, opts)
    }

    /// The next notification, waiting up to `timeout` (with the engine's `spin`, polling the
    /// completion queues here first).
    ///
    /// # Errors
    ///
    /// The endpoint's failure, once it has failed and no notification is left.
    pub(crate) fn next_notification(&self, timeout: Duration) -> Result<Option<Notification>> {
        next_notification(&self.link, timeout)
    }

    /// One look for a notification by `deadline`, for a future (the completion queues polled
    /// first when no other thread polls them).
    pub(crate) fn look_for_note(&self, deadline: Instant) -> Look {
        look_for_note(&self.link, deadline)
    }

    /// Something now waits for notifications without polling (the counter): see
    /// [`Link::watch`](super::state::Link).
    pub(crate) fn watch(&self) {
        self.link.watch();
    }

    /// Rails of the endpoint.
    pub(crate) fn rails(&self) -> usize {
        self.link.counters.len()
    }

    /// What the peer's descriptors give it (the same on every rail).
    pub(crate) fn peer_access(&self) -> PeerAccess {
        self.link
            .lock()
            .rails
            .first()
            .map_or(PeerAccess::Regions, |r| r.access)
    }

    /// Windows over `region` for this endpoint's peer, one per rail.
    ///
    /// # Errors
    ///
    /// As [`Endpoint::grant`](crate::transfer::Endpoint::grant).
    pub(crate) fn grant(&self, region: &Region) -> Result<MemoryDescriptor> {
        grant(&self.link, region)
    }

    /// Per-rail counters (cumulative), in rail order.
    pub(crate) fn rail_stats(&self) -> Vec<RailStats> {
        let i = &self.link;
        let st = i.lock();
        i.counters
            .iter()
            .enumerate()
            .map(|(r, c)| RailStats {
                device: st
                    .rails
                    .get(r)
                    .map(|x| i.ep.engine.inner.devices[x.device].name.clone())
                    .unwrap_or_default(),
                state: match st.lanes.get(r).and_then(|l| l.failed.as_ref()) {
                    Some((b, _)) => RailState::Failed(RailFailure::of(b)),
                    None => RailState::Up,
                },
                failures: c.failures.load(Ordering::Relaxed),
                restored: c.restored.load(Ordering::Relaxed),
                reposted: c.reposted.load(Ordering::Relaxed),
                notifications_in_doubt: c.in_doubt.load(Ordering::Relaxed),
                notifications_resent: c.resent.load(Ordering::Relaxed),
                bytes_written: c.bytes_written.load(Ordering::Relaxed),
                bytes_read: c.bytes_read.load(Ordering::Relaxed),
                writes: c.writes.load(Ordering::Relaxed),
                reads: c.reads.load(Ordering::Relaxed),
                notifications_sent: c.notes_sent.load(Ordering::Relaxed),
                notifications_received: c.notes_received.load(Ordering::Relaxed),
            })
            .collect()
    }

    /// Rails, requests in flight, and why the endpoint stopped (for `Debug`).
    pub(crate) fn describe(&self) -> (usize, usize, Option<Broken>) {
        let st = self.link.lock();
        (
            st.rails.len(),
            st.requests.len(),
            st.broken.as_ref().map(|b| b.0.clone()),
        )
    }

    /// Close the connections and connect the rails again (the side that connected only).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] on the accepting side; errors of connecting.
    pub(crate) fn reconnect(&self) -> Result<()> {
        let inner = &self.link;
        if matches!(inner.origin, Origin::Accepted) {
            return Err(Error::invalid(
                "endpoint",
                "accepted",
                "only the side that connected can reconnect; the listener accepts the new endpoint",
            ));
        }
        // A closed endpoint never reconnects (its progress thread is gone or going): refused
        // here, and again where the fresh state would go in, under the lock a close sets
        // `closing` under.
        {
            let mut st = inner.lock();
            if st.closing {
                return Err(ended(&st));
            }
            if st.broken.is_none() {
                break_endpoint(inner, &mut st, Broken::Closed);
            }
        }
        inner.poke();
        // Wait (bounded) for the old requests to end.
        let until = Instant::now() + FLUSH_WAIT + TICK * 4;
        while Instant::now() < until && !inner.lock().requests.is_empty() {
            std::thread::sleep(Duration::from_millis(2));
        }
        let connected = dial(&inner.ep.engine.inner, &inner.origin)?;
        if connected.rails.len() != inner.counters.len() {
            return Err(Error::invalid(
                "rails",
                connected.rails.len(),
                "the rail count changed",
            ));
        }
        let fresh = new_state(&inner.ep.engine.inner, connected)?;
        let old = {
            let mut st = inner.lock();
            if st.closing {
                return Err(ended(&st));
            }
            force_finish(&mut st);
            std::mem::replace(&mut *st, fresh)
        };
        inner.poke();
        drop(old);
        Ok(())
    }

    /// Take the failed rails back that can come back now (the side that connected only):
    /// each connected again alone, with the same authentication as at connect. Returns those
    /// that came back.
    ///
    /// # Errors
    ///
    /// As [`Endpoint::restore_rails`](crate::transfer::Endpoint::restore_rails).
    pub(crate) fn restore_rails(&self) -> Result<Vec<usize>> {
        restore(&self.link)
    }

    /// [`close`](Self::close), the endpoint broken with `cause` first (unless it already
    /// was): requests in flight end with its error.
    pub(crate) fn close_with(&self, cause: Broken) {
        break_endpoint(&self.link, &mut self.link.lock(), cause);
        self.close();
    }

    /// Close: the endpoint broken (every queue pair to the error state), the progress thread
    /// joined, then the flushed completions polled (bounded) and every request ended.
    pub(crate) fn close(&self) {
        close(&self.link);
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            // Dropped on the progress thread itself (a waker run there): it ends by itself.
            join_unless_current(t);
        }
        drain_after_close(&self.link);
    }
}

/// The error of a closed endpoint: why it stopped.
fn ended(st: &State) -> Error {
    st.broken
        .as_ref()
        .map_or_else(|| Broken::Closed.to_error(), |b| b.0.to_error())
}
