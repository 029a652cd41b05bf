//! The intra-node transport of one endpoint as the endpoint holds it ([`Local`]): the state it
//! shares with the endpoint and its side; requests, prepared requests, stream-ordered copies,
//! notifications, reconnecting and closing.

use super::request::{
    Queued, Ready, Staged, enqueue_staged, notify_peer, post, ready, request, run, stage,
    stage_ready,
};
use super::side::Side;
use super::state::{State, fail};
use crate::cuda::Stream;
use crate::error::Result;
use crate::transfer::descriptor::{MemoryDescriptor, RemoteRange};
use crate::transfer::engine::Engine;
use crate::transfer::pending::Transfer;
use crate::transfer::region::LocalRange;
use crate::transfer::request::{
    Broken, Direction, Notification, TransferOptions, TransferReport, check_pairs,
    check_same_engine,
};
use crate::transfer::shared::EpInner;
use crate::transfer::stream::{Mark, Unmade};
use std::sync::Arc;
use std::time::Duration;

/// The intra-node transport of one endpoint as the endpoint holds it: the state it shares with
/// the endpoint, and its side (socket, copy streams, threads).
pub(crate) struct Local {
    inner: Arc<EpInner<State>>,
    pub(crate) side: Arc<Side>,
}

impl Local {
    pub(super) fn new(
        engine: Engine,
        peer_descriptors: Vec<MemoryDescriptor>,
        side: Arc<Side>,
    ) -> Local {
        Local {
            inner: Arc::new(EpInner::new(engine, State::new(peer_descriptors))),
            side,
        }
    }

    /// What the endpoint shares with its side (notifications, failure, the peer's descriptors).
    pub(crate) fn shared(&self) -> &EpInner<State> {
        &self.inner
    }

    /// Start the side's threads. On failure the caller closes it.
    ///
    /// # Errors
    ///
    /// As [`spawn_thread`](crate::driver::ctx::spawn_thread).
    pub(crate) fn attach(&self) -> Result<()> {
        self.side.clone().attach(&self.inner)
    }

    /// The checks a request passes before anything is queued, queueing nothing: no rails and
    /// no staging; the copies' own checks come when they are mapped (before anything is
    /// queued).
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
        check_pairs(dir, pairs, opts)?;
        check_same_engine(self.inner.engine.inner.engine_id, pairs)?;
        match self.inner.lock().broken.as_ref() {
            Some((b, _)) => Err(b.to_error()),
            None => Ok(()),
        }
    }

    /// A request: checked, mapped, its copies queued and handed to the worker.
    ///
    /// # Errors
    ///
    /// As [`Endpoint::transfer`](crate::transfer::Endpoint::transfer).
    pub(crate) fn transfer(
        &self,
        dir: Direction,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<Transfer> {
        request(&self.inner, &self.side, dir, pairs, opts)
    }

    /// A request checked and mapped once, to be posted many times.
    ///
    /// # Errors
    ///
    /// As [`Endpoint::prepare`](crate::transfer::Endpoint::prepare).
    pub(crate) fn ready(
        &self,
        dir: Direction,
        pairs: Vec<(LocalRange, RemoteRange)>,
        bytes: u64,
        opts: TransferOptions,
    ) -> Result<Ready> {
        ready(&self.inner, &self.side, dir, pairs, bytes, opts)
    }

    /// Post a prepared request.
    ///
    /// # Errors
    ///
    /// As [`PreparedTransfer::post`](crate::transfer::PreparedTransfer::post).
    pub(crate) fn post(&self, r: &Ready) -> Result<Transfer> {
        post(&self.inner, r)
    }

    /// Post a prepared request and wait for it on this thread.
    ///
    /// # Errors
    ///
    /// As [`PreparedTransfer::run`](crate::transfer::PreparedTransfer::run).
    pub(crate) fn run(&self, r: &Ready) -> Result<TransferReport> {
        run(&self.inner, r)
    }

    /// A stream-ordered request for `stream` checked and mapped, nothing queued yet.
    ///
    /// # Errors
    ///
    /// As [`Endpoint::write_on`](crate::transfer::Endpoint::write_on).
    pub(crate) fn stage_on_stream(
        &self,
        stream: &Stream,
        dir: Direction,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: &TransferOptions,
    ) -> Result<Staged> {
        stage(&self.inner, &self.side, stream, dir, pairs, opts)
    }

    /// A prepared request staged for `stream`, nothing queued yet.
    ///
    /// # Errors
    ///
    /// As [`PreparedTransfer::post_on`](crate::transfer::PreparedTransfer::post_on).
    pub(crate) fn stage_ready_on_stream(&self, stream: &Stream, r: &Ready) -> Result<Staged> {
        stage_ready(&self.inner, stream, r)
    }

    /// A staged request's copies queued on `stream`, then its trigger at `mark` (a lean
    /// request, [`Staged::lean`], has none: the event behind its copies stands for it).
    ///
    /// # Errors
    ///
    /// As [`Endpoint::write_on`](crate::transfer::Endpoint::write_on), with whether something
    /// may be queued anyway.
    pub(crate) fn enqueue_staged(
        &self,
        staged: Staged,
        stream: &Stream,
        mark: Option<&Mark<'_>>,
    ) -> std::result::Result<Queued, Unmade> {
        enqueue_staged(staged, &self.side, stream, mark)
    }

    /// Notify the peer of a stream-ordered request whose copies are done.
    ///
    /// # Errors
    ///
    /// The endpoint's failure, or that it closed or reconnected since the copies were queued;
    /// [`Error::Os`] from the socket.
    pub(crate) fn notify_peer(&self, q: &Queued, tag: u32) -> Result<()> {
        notify_peer(&self.side, q, tag)
    }

    /// The next notification, waiting up to `timeout`.
    ///
    /// # Errors
    ///
    /// The endpoint's failure, once it has failed and no notification is left.
    pub(crate) fn next_notification(&self, timeout: Duration) -> Result<Option<Notification>> {
        self.inner.next_notification(timeout, |_| {})
    }

    /// Rails (none), requests in the endpoint's state (none: the side holds them), and why the
    /// endpoint stopped (for `Debug`).
    pub(crate) fn describe(&self) -> (usize, usize, Option<Broken>) {
        let st = self.inner.lock();
        (0, 0, st.broken.as_ref().map(|b| b.0.clone()))
    }

    /// Dial the socket path again (the dialing side).
    ///
    /// # Errors
    ///
    /// As [`Endpoint::reconnect`](crate::transfer::Endpoint::reconnect).
    pub(crate) fn reconnect(&self) -> Result<()> {
        self.side.clone().reconnect(&self.inner)
    }

    /// [`close`](Self::close), the endpoint ended with `cause` first (unless it already was):
    /// requests still running end with its error.
    pub(crate) fn close_with(&self, cause: Broken) {
        fail(&self.inner, &mut self.inner.lock(), cause.clone());
        self.side.close();
        // A reconnect that was under way started a fresh state: end that one too.
        fail(&self.inner, &mut self.inner.lock(), cause);
    }

    /// Close: the endpoint ended (no more notifications), then the side's socket shut and its
    /// threads joined.
    pub(crate) fn close(&self) {
        self.close_with(Broken::Closed);
    }
}
