//! The endpoint: a connection to one peer over one transport ([`Transport`]), and every
//! request method a user calls on it. It owns its transport and its stream proxy, and closes
//! both when the last clone goes.

use super::auth::Authentication;
use super::descriptor::{MemoryDescriptor, RemoteRange};
use super::engine::{Engine, PeerAccess};
#[cfg(feature = "p2p")]
use super::local::{Local, Queued, Ready as LocalReady, Staged};
use super::meter::Meter;
use super::pending::{Transfer, Transferred};
use super::plan::deadline_after;
use super::rails::{RailStats, Rails};
use super::region::{LocalRange, Region};
use super::request::{Broken, Direction, Notification, TransferOptions, TransferReport};
use super::shared::{Look, SetOnDrop};
#[cfg(feature = "p2p")]
use super::stream::Mark;
use super::stream::{
    Backend, Counter, HostWords, Keep, Proxy, Running, StreamTransfer, StreamWord, Trigger,
    WordMemory, closed_error,
};
use super::transport::Transport;
use crate::completion::{CompletionFlag, Fence, InFlight};
use crate::cuda::{MemopFlags, Stream};
use crate::error::{Error, Result};
use cudarc::driver::CudaContext;
use std::sync::{Arc, OnceLock, Weak};
use std::task::Waker;
use std::time::{Duration, Instant};

/// A connection to one peer over one or more rails (one reliable queue pair per rail, each on
/// its own device), with a progress thread. Cheap to clone; the last clone closes it.
///
/// Requests ([`write`](Self::write), [`read`](Self::read)) are batches of (local range, remote
/// range) pairs; each returns a [`Transfer`]. Messages over the largest message are split, large
/// requests are striped over the rails (those nearest the local memory's GPU first), and every
/// rail keeps at most its window of messages outstanding (its send-queue depth, and its send
/// completion queue less the teardown entry), so no queue is ever found full; what does not fit
/// waits in the endpoint's queue and is posted as completions free room.
#[derive(Clone)]
pub struct Endpoint {
    handle: Arc<Handle>,
}

struct Handle {
    transport: Transport,
    /// The stream proxy, made by the first stream-ordered request.
    proxy: OnceLock<Proxy<Rdma>>,
    /// The peer's segment name and node, once it left the membership (`transfer::membership`).
    left: OnceLock<(String, String)>,
    /// The peer's segment name, for an endpoint found by name (the metrics' `peer` label).
    peer: OnceLock<String>,
    /// Its metrics, registered at its first request.
    meter: OnceLock<Meter>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        // Why it failed, if it did before this close (counted once, not as a peer's leave).
        let failed = self
            .meter
            .get()
            .filter(|_| self.left.get().is_none())
            .and(self.transport.failure());
        if let Some(p) = self.proxy.get() {
            p.closing();
        }
        self.transport.close();
        if let Some(p) = self.proxy.get() {
            p.closed();
        }
        if let Some(m) = self.meter.get() {
            m.rails(&self.transport.rail_stats());
            if let Some(e) = failed {
                m.ended(super::meter::kind(&e));
            }
        }
    }
}

/// An endpoint that does not keep it open ([`Endpoint::downgrade`]).
#[derive(Clone)]
pub(crate) struct WeakEndpoint(Weak<Handle>);

impl WeakEndpoint {
    /// The endpoint, while some clone of it lives.
    pub(crate) fn upgrade(&self) -> Option<Endpoint> {
        self.0.upgrade().map(|handle| Endpoint { handle })
    }
}

impl Endpoint {
    /// An endpoint over `transport` (started).
    fn new(transport: Transport) -> Endpoint {
        Endpoint {
            handle: Arc::new(Handle {
                transport,
                proxy: OnceLock::new(),
                left: OnceLock::new(),
                peer: OnceLock::new(),
                meter: OnceLock::new(),
            }),
        }
    }

    /// An endpoint over `rails` (their progress thread running).
    pub(crate) fn over_rails(rails: Rails) -> Endpoint {
        Endpoint::new(Transport::Rails(rails))
    }

    /// An intra-node endpoint: no rails and no progress thread; its side carries its requests
    /// and notifications.
    ///
    /// # Errors
    ///
    /// As [`spawn_thread`](crate::driver::ctx::spawn_thread) (the endpoint is closed then).
    #[cfg(feature = "p2p")]
    pub(crate) fn inside_node(local: Local) -> Result<Endpoint> {
        let ep = Endpoint::new(Transport::Local(local));
        // On failure the endpoint is dropped: its side is closed.
        if let Transport::Local(l) = ep.transport() {
            l.attach()?;
        }
        Ok(ep)
    }

    /// The transport.
    pub(crate) fn transport(&self) -> &Transport {
        &self.handle.transport
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        self.transport().engine()
    }

    /// The descriptors the peer published in its first message.
    pub fn peer_descriptors(&self) -> Vec<MemoryDescriptor> {
        self.transport().peer_descriptors()
    }

    /// Rails of the endpoint.
    pub fn rails(&self) -> usize {
        self.transport().rails()
    }

    /// Per-rail counters (cumulative), in rail order.
    pub fn rail_stats(&self) -> Vec<RailStats> {
        self.transport().rail_stats()
    }

    /// Take back the failed rails that can come back now ([`RailStats::state`] says which
    /// failed), on the side that connected: each is connected again alone to the peer's address
    /// for it, with the same authentication as at connect (with a key, a proof of a secret only
    /// the two ends of this endpoint derived from it), and its windows bound again; the peer's
    /// listener routes it to the endpoint it accepted, while it accepts. A rail comes back only
    /// once its flushes were seen and nothing sent on it is in doubt. The engine does this by
    /// itself every [`EngineConfig::rail_retry`](super::EngineConfig::rail_retry); this is the
    /// same, now. Returns the rails that came back (none inside a node, or with none failed).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] on the accepting side, while another thread (the engine's
    /// own retry) takes this endpoint's rails back, or when a rail came back through other
    /// devices than it went; when no failed rail came back, the first one's error:
    /// connecting ([`Error::CmEvent`], [`Error::Timeout`]), [`Error::Authentication`],
    /// [`Error::InvalidArgument`] while it cannot come back yet; the endpoint's failure once
    /// it has failed or closed.
    #[doc(alias = "rdma_connect")]
    pub fn restore_rails(&self) -> Result<Vec<usize>> {
        self.transport().restore_rails()
    }

    /// How the peer was authenticated: [`Authentication::Key`] when the engine has a key
    /// ([`EngineConfig::key`](super::EngineConfig::key): the peer proved it holds the same one
    /// on every rail, or on the socket inside a node, before anything was published), else
    /// [`Authentication::Unauthenticated`] (`Display`: "unauthenticated").
    pub fn authentication(&self) -> Authentication {
        if self.engine().config().key.is_some() {
            Authentication::Key
        } else {
            Authentication::Unauthenticated
        }
    }

    /// What the descriptors this endpoint published give its peer
    /// ([`EngineConfig::peer_access`](super::EngineConfig::peer_access)):
    /// [`PeerAccess::Windows`] (windows bound through this endpoint's queue pair, revoked when it
    /// closes or breaks) or [`PeerAccess::Regions`] (the regions' rkeys, good until
    /// deregistration); `None` inside a node (no rkeys: CUDA IPC).
    pub fn peer_access(&self) -> Option<PeerAccess> {
        self.transport().peer_access()
    }

    /// A descriptor of `region` for this endpoint's peer alone, to hand it out of band (the
    /// descriptors published at connect are made the same way): under
    /// [`PeerAccess::Windows`] one type 2 memory window per rail is bound over the region through
    /// that rail's queue pair (each bind completed before this returns, within
    /// [`EngineConfig::connect_timeout`](super::EngineConfig::connect_timeout)), and the
    /// descriptor carries each window's rkey as the rkey of its rail's device (0 for the
    /// others). The windows are revoked with the endpoint's others when it closes, is dropped or
    /// breaks; a reconnect does not bring them back (grant again). Under
    /// [`PeerAccess::Regions`] it is [`Region::descriptor`], good until deregistration.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a region of another engine, or staged memory (no rail
    /// reaches it); the endpoint's failure once it has failed or closed (also while binding);
    /// [`Error::Timeout`] when the binds did not complete in time; a failed bind's
    /// [`Error::WorkCompletion`]; [`Error::Unsupported`] inside a node (CUDA IPC maps the whole
    /// allocation, which no window limits or revokes: hand out [`Region::descriptor`] there).
    #[doc(alias = "ibv_bind_mw")]
    #[doc(alias = "ibv_alloc_mw")]
    pub fn grant(&self, region: &Region) -> Result<MemoryDescriptor> {
        self.transport().grant(region)
    }

    /// Why the endpoint stopped, if it has: the error its requests ended with;
    /// [`Error::PeerLeft`] once a peer found by name left the membership.
    pub fn failure(&self) -> Option<Error> {
        self.left().or_else(|| self.transport().failure())
    }

    /// The peer (segment `name`, node `node`) left the membership: the endpoint is closed,
    /// its requests in flight and later ones end with [`Error::PeerLeft`] (those in flight with
    /// the transport's own error if it had failed before).
    pub(crate) fn peer_left(&self, name: &str, node: &str) {
        if self.handle.left.set((name.into(), node.into())).is_ok() {
            self.transport()
                .close_with(Broken::PeerLeft(name.into(), node.into()));
            self.meter().ended("peer_left");
        }
    }

    /// The peer is segment `name` (the metrics' `peer` label; set before any request).
    pub(crate) fn name_peer(&self, name: &str) {
        let _ = self.handle.peer.set(name.to_string());
    }

    fn meter(&self) -> &Meter {
        self.handle
            .meter
            .get_or_init(|| Meter::new(self.handle.peer.get().map_or("unnamed", String::as_str)))
    }

    fn left(&self) -> Option<Error> {
        self.handle.left.get().map(|(name, node)| Error::PeerLeft {
            name: name.clone(),
            node: node.clone(),
        })
    }

    /// This endpoint without keeping it open.
    pub(crate) fn downgrade(&self) -> WeakEndpoint {
        WeakEndpoint(Arc::downgrade(&self.handle))
    }

    /// Write each local range to its remote range (same lengths), as one request.
    ///
    /// # Errors
    ///
    /// As [`transfer`](Self::transfer).
    #[doc(alias = "IBV_WR_RDMA_WRITE")]
    pub fn write(
        &self,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<Transfer> {
        self.transfer(Direction::Write, pairs, opts)
    }

    /// Read each remote range into its local range, as one request.
    ///
    /// # Errors
    ///
    /// As [`transfer`](Self::transfer).
    #[doc(alias = "IBV_WR_RDMA_READ")]
    pub fn read(
        &self,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<Transfer> {
        self.transfer(Direction::Read, pairs, opts)
    }

    /// One request: the pairs are split and striped into messages, queued on the rails, and
    /// posted within each rail's window; the returned [`Transfer`] finishes when every message
    /// has completed (or the endpoint failed: then with its error, once the NIC is done with
    /// every message or 2 s after the failure). A pair whose local memory is staged
    /// ([`MemoryPath::Staged`](super::MemoryPath::Staged)) moves through pinned bounce buffers.
    ///
    /// # Errors
    ///
    /// Before anything is queued: [`Error::InvalidArgument`](crate::Error::InvalidArgument) for
    /// no pairs, a pair whose lengths differ, a local region registered with another engine, a
    /// remote range whose descriptor has not one rkey per peer device, a notification on a read,
    /// or staged memory with several pairs; the
    /// endpoint's failure (as [`failure`](Self::failure)) once it has failed.
    ///
    /// Inside a node, also: [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a
    /// remote range whose descriptor has no CUDA IPC part (host memory, default-pool memory) or
    /// names VMM or pool memory not published when the endpoints met;
    /// [`Error::Unsupported`](crate::Error::Unsupported) when the peer is this process;
    /// [`Error::Cuda`](crate::Error::Cuda) from mapping the peer's allocation or queueing the
    /// copies.
    pub fn transfer(
        &self,
        dir: Direction,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<Transfer> {
        let bytes = pairs.iter().map(|(l, _)| l.len()).sum();
        self.metered(dir, bytes, || {
            self.transport().transfer(self, dir, pairs, opts)
        })
    }

    /// A request of `bytes` made (or made and waited for) by `make`, refused once the peer
    /// left, counted in the endpoint's metrics (queued or refused).
    pub(crate) fn metered<T>(
        &self,
        dir: Direction,
        bytes: u64,
        make: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        if let Some(e) = self.left() {
            return Err(e);
        }
        let r = make();
        let m = self.meter();
        m.request(dir, bytes, r.is_ok());
        if m.rails_due() {
            m.rails(&self.rail_stats());
        }
        r
    }

    /// The next notification from the peer, waiting up to `timeout`; `None` when none came.
    ///
    /// # Errors
    ///
    /// The endpoint's failure, once it has failed and no notification is left.
    pub fn next_notification(&self, timeout: Duration) -> Result<Option<Notification>> {
        self.transport()
            .next_notification(timeout)
            .map_err(|e| self.left().unwrap_or(e))
    }

    /// The next notification from the peer, awaited up to `timeout`; `None` when none came.
    /// The future is woken by the progress thread when a notification arrives or the endpoint
    /// fails, and at its deadline by the crate's completion thread
    /// ([`InFlight::deadline`](crate::completion::InFlight::deadline)); it holds a clone of the
    /// endpoint, and dropping it only stops the wait.
    ///
    /// # Errors
    ///
    /// As [`next_notification`](Self::next_notification).
    pub fn notification(
        &self,
        timeout: Duration,
    ) -> impl std::future::Future<Output = Result<Option<Notification>>> + Send + 'static {
        let ep = self.clone();
        let deadline = deadline_after(Instant::now(), timeout);
        async move {
            loop {
                let flag = match ep.transport().look_for_note(deadline) {
                    Look::Found(r) => return r,
                    Look::Wait(flag) => flag,
                };
                // A future dropped while it waits sets its flag: the completion tracker frees
                // what it parked, and the next call drops the waiter from the list.
                let _release = SetOnDrop(flag.clone());
                let wait = InFlight::new("transfer notification", flag.clone(), ());
                match wait.deadline(deadline).await {
                    Ok(()) => {}
                    // Looked at once more above, then `None`; the flag is set so the tracker
                    // frees what it parked at the timeout.
                    Err(Error::Timeout { .. }) => flag.set(),
                    Err(e) => return Err(e),
                }
            }
        }
    }

    /// Close this endpoint's connections and connect its rails again (the side that
    /// connected only; the listening side accepts the new endpoint). An intra-node endpoint
    /// dials its socket path again. Requests still in flight
    /// end with an error first; the peer's descriptors are those of its new first message.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] on the accepting side; errors of connecting.
    pub fn reconnect(&self) -> Result<()> {
        self.meter().reconnected();
        self.transport().reconnect()
    }

    /// The stream proxy, made on first use.
    fn proxy(&self) -> &Proxy<Rdma> {
        let weak = self.downgrade();
        self.handle
            .proxy
            .get_or_init(|| Proxy::new(Rdma { ep: weak }))
    }

    /// A request armed on the endpoint's stream queue.
    fn arm(
        &self,
        trig: Trigger<'_>,
        dir: Direction,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<StreamTransfer> {
        if let Trigger::Stream(s) = &trig {
            // Its handle names another stream on every thread: the proxy, which looks at the
            // stream's events from its own thread, would look at its own. Refused before
            // anything is checked or mapped (every queueing path refuses it too).
            crate::completion::capture::refuse_per_thread(s.cu_stream())?;
        }
        let timeout = opts.deadline.unwrap_or(self.engine().inner.config.deadline);
        // Intra-node on a stream: the copies go on the stream itself, before the trigger.
        #[cfg(feature = "p2p")]
        if let Trigger::Stream(stream) = &trig
            && let Transport::Local(local) = self.transport()
        {
            // Checked (every check of `check_request` among them) and mapped before its seq is
            // taken: nothing slow between the two.
            let staged = local.stage_on_stream(stream, dir, pairs, &opts)?;
            return self.arm_staged(local, stream, staged, timeout);
        }
        self.transport().check_request(dir, &pairs, &opts)?;
        self.proxy()
            .arm(trig, RdmaWork::Post { dir, pairs, opts }, timeout)
    }

    /// An intra-node request staged for `stream` armed on the stream queue: its copies go on
    /// the stream now, before the trigger.
    #[cfg(feature = "p2p")]
    fn arm_staged(
        &self,
        local: &Local,
        stream: &Stream,
        staged: Staged,
        timeout: Duration,
    ) -> Result<StreamTransfer> {
        let started = staged.started();
        if staged.lean() {
            // Lean: its copies and the event behind them queued first, then only its place in
            // the queue's word is the proxy's (no seq is needed before). What its seq would
            // refuse is refused before anything is queued.
            self.proxy().ready_lean(Trigger::Stream(stream))?;
            let q = local
                .enqueue_staged(staged, stream, None)
                .map_err(|u| u.error)?;
            let (fence, report, keep) = q.into_lean().ok_or_else(|| {
                Error::invalid("stream", "no event", "a lean request has its event")
            })?;
            return self.proxy().arm_lean(
                Trigger::Stream(stream),
                fence,
                (report, keep),
                timeout,
                started,
            );
        }
        let make = |mark: Option<Mark<'_>>| {
            let mark = mark.ok_or_else(|| {
                Error::invalid("stream", "no trigger", "a stream request has one")
            })?;
            local
                .enqueue_staged(staged, stream, Some(&mark))
                .map(|q| (RdmaWork::Queued(q), true))
        };
        self.proxy()
            .arm_with(Trigger::Stream(stream), make, timeout, started)
    }

    /// A prepared intra-node request armed on `stream` ([`PreparedTransfer::post_on`]): no
    /// check or lookup repeated.
    ///
    /// [`PreparedTransfer::post_on`]: super::PreparedTransfer::post_on
    #[cfg(feature = "p2p")]
    pub(crate) fn arm_prepared(&self, stream: &Stream, r: &LocalReady) -> Result<StreamTransfer> {
        crate::completion::capture::refuse_per_thread(stream.cu_stream())?;
        let Transport::Local(local) = self.transport() else {
            return Err(Broken::Closed.to_error());
        };
        let staged = local.stage_ready_on_stream(stream, r)?;
        self.arm_staged(local, stream, staged, r.timeout())
    }

    /// [`write`](Self::write) ordered on `stream`: the request starts when the stream reaches
    /// it, and its completion word is set when it finishes (see
    /// [`StreamTransfer::wait_on`]). Checked now, before anything is enqueued; posted by the
    /// endpoint's proxy thread when the trigger fires. Inside a node the copies go on `stream`
    /// now (with the engine's copy graphs, one graph launch of the stream's own), followed by
    /// an event that stands for the trigger.
    ///
    /// Each call costs the caller some microseconds of host time whatever its size, so several
    /// blocks for one point of the stream go faster as one call: up to 32 pairs are one launch
    /// and one event (docs/transfer.md has the figures).
    ///
    /// # Errors
    ///
    /// As [`transfer`](Self::transfer)'s checks; [`Error::StreamCapturing`] while the stream
    /// captures a graph (nothing enqueued; `enqueued: true` if a capture began meanwhile: the
    /// queue is then retired and its words never freed); [`Error::Unsupported`] without 64-bit
    /// stream memory operations; [`Error::InvalidArgument`] with [`TRIGGER_SLOTS`](super::TRIGGER_SLOTS) requests
    /// armed, after host-triggered requests still outstanding in host memory, or on the
    /// per-thread default stream (`CU_STREAM_PER_THREAD`: another stream on every thread);
    /// [`Error::Cuda`], [`Error::Load`].
    #[doc(alias = "cuStreamWriteValue64_v2")]
    #[doc(alias = "cuGraphLaunch")]
    pub fn write_on(
        &self,
        stream: &Stream,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<StreamTransfer> {
        self.arm(Trigger::Stream(stream), Direction::Write, pairs, opts)
    }

    /// [`read`](Self::read) ordered on `stream`, as [`write_on`](Self::write_on). Reads into
    /// GPU memory are flushed before the completion word is set.
    ///
    /// # Errors
    ///
    /// As [`write_on`](Self::write_on).
    #[doc(alias = "cuStreamWriteValue64_v2")]
    #[doc(alias = "cuGraphLaunch")]
    pub fn read_on(
        &self,
        stream: &Stream,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<StreamTransfer> {
        self.arm(Trigger::Stream(stream), Direction::Read, pairs, opts)
    }

    /// A write armed on the stream queue and fired from the host ([`StreamTransfer::trigger`]:
    /// what a stream's trigger write does), for code without CUDA and for tests of the proxy.
    /// The queue's words are plain host memory when no stream request made them CUDA memory.
    ///
    /// # Errors
    ///
    /// As [`transfer`](Self::transfer)'s checks; [`Error::InvalidArgument`] with
    /// [`TRIGGER_SLOTS`](super::TRIGGER_SLOTS) requests armed.
    pub fn write_triggered(
        &self,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<StreamTransfer> {
        self.arm(Trigger::Host, Direction::Write, pairs, opts)
    }

    /// A read armed on the stream queue and fired from the host, as
    /// [`write_triggered`](Self::write_triggered).
    ///
    /// # Errors
    ///
    /// As [`write_triggered`](Self::write_triggered).
    pub fn read_triggered(
        &self,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<StreamTransfer> {
        self.arm(Trigger::Host, Direction::Read, pairs, opts)
    }

    /// The endpoint's notification counter in pinned host memory mapped for `ctx`'s device
    /// (made on the first call, the same word after), starting at the notifications delivered
    /// so far. See [`StreamWord`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the counter was made in plain host memory first;
    /// [`Error::Load`], [`Error::Cuda`] from allocating it; [`Error::Unsupported`] without
    /// 64-bit stream memory operations.
    #[doc(alias = "cuMemHostAlloc")]
    pub fn notification_counter(&self, ctx: &Arc<CudaContext>) -> Result<StreamWord> {
        let f = MemopFlags::pinned_host(ctx, 1)?;
        if !f.supports_64_bit() {
            return Err(Error::Unsupported {
                what: "a stream-visible notification counter".into(),
                reason: "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS is 0".into(),
            });
        }
        let w = self.counter_with(Box::new(f))?;
        w.flags().map_err(|_| {
            Error::invalid(
                "notification counter",
                "host memory",
                "the endpoint's counter was made in plain host memory first",
            )
        })?;
        Ok(w)
    }

    /// The endpoint's notification counter in plain host memory (for code without CUDA), or
    /// the counter already made. See [`StreamWord`].
    ///
    /// # Errors
    ///
    /// None today (the signature leaves room).
    pub fn notification_counter_host(&self) -> Result<StreamWord> {
        self.counter_with(Box::new(HostWords::new(1)))
    }

    fn counter_with(&self, words: Box<dyn WordMemory>) -> Result<StreamWord> {
        let counter = self
            .transport()
            .counter(move |delivered| Ok(Arc::new(Counter::new(words, delivered))))?;
        Ok(StreamWord::new(counter))
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (rails, requests, broken) = self.transport().describe();
        f.debug_struct("Endpoint")
            .field("rails", &rails)
            .field("requests", &requests)
            .field("broken", &broken)
            .finish()
    }
}

/// The RDMA backend: posts through the engine.
pub(crate) struct Rdma {
    ep: WeakEndpoint,
}

/// A request of a stream queue.
pub(crate) enum RdmaWork {
    /// Started through [`Endpoint::transfer`] when the trigger fires (RDMA; intra-node with a
    /// host trigger).
    Post {
        dir: Direction,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    },
    /// Intra-node: the copies were queued on the stream before the trigger, so they are done
    /// when it fires; only the notification is left.
    #[cfg(feature = "p2p")]
    Queued(Queued),
}

struct RdmaRunning {
    flag: CompletionFlag,
    op: Option<InFlight<Transferred, CompletionFlag>>,
}

impl Running for RdmaRunning {
    fn poll(&mut self, waker: &Waker) -> Option<(Result<TransferReport>, Keep)> {
        if !self.flag.is_complete() {
            self.flag.register_waker(waker);
            if !self.flag.is_complete() {
                return None;
            }
        }
        // Complete: `try_take` answers at once and neither waits nor reaps the tracker (which
        // could free CUDA memory on this thread).
        match self.op.take()?.try_take() {
            Ok(done) => {
                let r = done.take_result();
                Some((r, Box::new(done)))
            }
            Err(op) => {
                self.op = Some(op);
                None
            }
        }
    }
}

impl Backend for Rdma {
    type Work = RdmaWork;
    type Fired = crate::completion::StreamFence;

    fn start(&self, w: &RdmaWork) -> Result<Box<dyn Running>> {
        let ep = self.ep.upgrade().ok_or_else(closed_error)?;
        let (dir, pairs, opts) = match w {
            RdmaWork::Post { dir, pairs, opts } => (*dir, pairs, *opts),
            #[cfg(feature = "p2p")]
            RdmaWork::Queued(_) => {
                // Taken by `done_at_fire` (which the proxy asks first).
                return Err(closed_error());
            }
        };
        // Clones: the proxy keeps the originals until the request finished, so nothing the
        // request uses is freed on this thread.
        let t: Transfer = ep.transfer(dir, pairs.clone(), opts)?;
        let flag = t.flag().clone();
        Ok(Box::new(RdmaRunning {
            flag,
            op: Some(t.into_in_flight()),
        }))
    }

    #[cfg(feature = "p2p")]
    fn done_at_fire(&self, w: &mut RdmaWork) -> Option<Result<TransferReport>> {
        let RdmaWork::Queued(q) = w else {
            return None;
        };
        // The stream passed the copies before it fired the request: they are done. The report
        // is taken, not copied (the proxy's thread allocates nothing the caller frees). The
        // endpoint is taken only to notify (its count is a line every caller writes too).
        let Some(mut report) = q.report.take() else {
            return Some(Err(Error::invalid(
                "stream transfer",
                "its report",
                "already taken",
            )));
        };
        let r = match report.notified {
            Some(tag) => match self.ep.upgrade() {
                Some(ep) => match ep.transport() {
                    Transport::Local(local) => local.notify_peer(q, tag),
                    _ => Err(closed_error()),
                },
                None => Err(closed_error()),
            },
            None => Ok(()),
        };
        report.elapsed = q.started.elapsed();
        Some(r.map(|()| report))
    }

    fn fired_by(&self, w: &RdmaWork) -> Option<crate::completion::StreamFence> {
        self.with_fence(w, Clone::clone)
    }

    fn with_fence<R>(
        &self,
        w: &RdmaWork,
        f: impl FnOnce(&crate::completion::StreamFence) -> R,
    ) -> Option<R> {
        match w {
            RdmaWork::Post { .. } => {
                let _ = f;
                None
            }
            #[cfg(feature = "p2p")]
            RdmaWork::Queued(q) => q.fired_by().map(f),
        }
    }

    fn notifies(&self, w: &RdmaWork) -> bool {
        match w {
            RdmaWork::Post { .. } => false,
            #[cfg(feature = "p2p")]
            RdmaWork::Queued(q) => q.report.as_ref().is_some_and(|r| r.notified.is_some()),
        }
    }
}
