//! Endpoints: one reliable connection per rail to one peer, through rdma_cm, with a progress
//! thread that waits on the rails' completion channels and finishes requests.

use super::descriptor::{MemoryDescriptor, RemoteRange};
use super::engine::{Engine, EngineInner};
use super::pending::{ReqShared, Transfer};
use super::plan::{Chunk, Credits, PlanInput, deadline_after, plan, send_window};
use super::region::{LocalRange, MemoryPath, Region};
use super::request::{
    Broken, Direction, FLUSH_WAIT, MAX_UNREAD_NOTIFICATIONS, Notification, TransferOptions,
    TransferReport, check_pairs, check_same_engine, unread_overflow,
};
use super::wire::{Hello, MAX_HELLO};
use crate::completion::deferred::{self, Defers, Locked, Woken};
use crate::completion::{CompletionFlag, Fence, InFlight};
use crate::error::{Error, Result};
use crate::rdma::{
    AccessFlags, CmLink, CompletionChannel, CompletionQueue, ConnectOptions, Connection,
    ErrorState, HostBuffer, Listener, Local, MemoryRegion, MrSlice, QpCaps, QpResources, QueuePair,
    RecvRequest, RemoteSlice, Rts, SendRequest, WcOpcode, WorkCompletion,
};
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Tag of the notification receives.
const RECV_TAG: u64 = u64::MAX - 7;
/// The notification rail: notifications and credit returns travel on rail 0, so they arrive in
/// the order they were sent.
const NOTIFY_RAIL: usize = 0;
/// The longest sleep of the progress thread between looks at the deadlines.
const TICK: Duration = Duration::from_millis(20);

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
struct RailCounters {
    bytes_written: AtomicU64,
    bytes_read: AtomicU64,
    writes: AtomicU64,
    reads: AtomicU64,
    notes_sent: AtomicU64,
    notes_received: AtomicU64,
}

/// A message waiting to be posted.
enum Wr {
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
    fn bytes(&self) -> u64 {
        match self {
            Wr::Write { local, .. } | Wr::Read { local, .. } => local.len() as u64,
            Wr::Credits(_) => 0,
        }
    }
}

/// A message posted: its sequence number on the rail (its tag), its request (0: internal).
struct Posted {
    seq: u64,
    req: u64,
    bytes: u64,
    dir: Option<Direction>,
    imm: bool,
}

enum QpSlot {
    Rts(QueuePair<Rts>),
    /// In the error state, kept until the rail goes (its drop drains and destroys it).
    Error {
        _qp: QueuePair<ErrorState>,
    },
    Gone,
}

/// One rail: its queue pair, CQs, channel, the rdma_cm link, and its message queues.
struct Rail {
    qp: QpSlot,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    channel: CompletionChannel,
    link: CmLink,
    /// Engine device of this rail; the peer's device for it.
    device: usize,
    peer_device: usize,
    window: u32,
    next_seq: u64,
    inflight: VecDeque<Posted>,
    pending: VecDeque<(u64, Wr)>,
    /// The first message, kept while the peer may read it.
    _hello: MemoryRegion<Local>,
}

impl Rail {
    fn outstanding(&self) -> usize {
        self.inflight.len()
    }
}

struct Request {
    shared: Arc<ReqShared>,
    dir: Direction,
    /// Messages in the rails' pending queues or held back.
    unposted: usize,
    /// Messages posted whose completion has not been seen.
    posted: usize,
    /// Messages on rails other than the notification rail not yet completed.
    elsewhere: usize,
    /// The notification message, held until `elsewhere` is 0.
    held: Option<Wr>,
    notify: Option<u32>,
    timeout: Duration,
    error: Option<Error>,
    rail_bytes: Vec<u64>,
    messages: u64,
    started: Instant,
    paths: Vec<MemoryPath>,
    /// GPUs whose memory a read wrote: flushed before the read is reported done.
    flush: Vec<usize>,
}

impl Request {
    fn finished(&self) -> bool {
        self.unposted == 0 && self.posted == 0 && self.held.is_none()
    }
}

struct State {
    rails: Vec<Rail>,
    broken: Option<(Broken, Instant)>,
    requests: HashMap<u64, Request>,
    deadlines: BinaryHeap<std::cmp::Reverse<(Instant, u64)>>,
    notify_q: VecDeque<u64>,
    credits: Credits,
    notes: VecDeque<Notification>,
    closing: bool,
    turn: usize,
    peer_descriptors: Vec<MemoryDescriptor>,
    peer_devices: usize,
    max_message: u32,
    /// Requests whose messages completed since the last look (then finished if done).
    touched: Vec<u64>,
    /// What to wake once the lock is let go ([`Locked`]).
    wakes: Wakes,
}

/// Wake-ups decided under the state lock, run once it is let go ([`Locked`]): a future's
/// waker is the caller's code, and one that calls the endpoint (or drops its last clone) would
/// take the lock again. Run when dropped.
#[derive(Default)]
pub(super) struct Wakes {
    /// Requests finished, with their results.
    finished: Vec<(Arc<ReqShared>, Result<TransferReport>)>,
    /// Notification waiters (a notification came, the endpoint failed, or their deadline
    /// passed).
    notes: Woken,
}

impl deferred::Wakes for Wakes {
    fn is_empty(&self) -> bool {
        self.finished.is_empty() && deferred::Wakes::is_empty(&self.notes)
    }
}

impl Drop for Wakes {
    fn drop(&mut self) {
        for (shared, r) in self.finished.drain(..) {
            shared.finish(r);
        }
    }
}

impl Defers for State {
    type Wakes = Wakes;
    fn wakes(&mut self) -> &mut Wakes {
        &mut self.wakes
    }
}

/// How an endpoint came about: what the dialing side needs to reconnect.
#[derive(Clone)]
enum Origin {
    Dialed {
        peers: Vec<SocketAddr>,
        publish: Vec<MemoryDescriptor>,
    },
    Accepted,
}

#[cfg_attr(
    not(feature = "p2p"),
    allow(dead_code, reason = "the intra-node path (feature p2p) uses it")
)]
/// The intra-node side of an endpoint (`transfer/local.rs`): its Unix socket, copy streams and
/// threads. The endpoint's state here (peer descriptors, notifications, failure) serves it too,
/// with no rails.
pub(super) trait LocalSide: Send + Sync {
    /// Start serving `ep` (its threads hold it weakly).
    fn attach(self: Arc<Self>, ep: &Arc<EpInner>) -> Result<()>;
    /// End: the socket shut, the threads joined, requests still queued ended.
    fn close(&self);
    /// Dial again (the dialing side), as [`Endpoint::reconnect`].
    fn reconnect(self: Arc<Self>, ep: &Arc<EpInner>) -> Result<()>;
    /// For the request path, which knows the concrete type.
    fn as_any(&self) -> &dyn std::any::Any;
}

pub(crate) struct EpInner {
    engine: Engine,
    /// The intra-node side, for an endpoint made by `connect_local` / `accept` of a local
    /// listener (no rails then).
    local: Option<Arc<dyn LocalSide>>,
    state: Mutex<State>,
    notes_cv: Condvar,
    /// Awaiting [`Endpoint::notification`] futures: each flag is set at the next notification
    /// or failure (or once its deadline has passed), then dropped from the list. Locked only
    /// under `state`.
    note_waiters: Mutex<Vec<(Instant, CompletionFlag)>>,
    wake: OwnedFd,
    counters: Vec<RailCounters>,
    origin: Origin,
    next_req: AtomicU64,
    /// Notifications delivered so far (what a [`NoteSink`] counts).
    delivered: AtomicU64,
    /// The word counting delivered notifications, once someone asked for it. Set and told
    /// only under `state`.
    note_sink: OnceLock<Arc<dyn NoteSink>>,
}

/// Told of every notification the progress thread delivers and of the endpoint's failure,
/// under the endpoint's lock (the stream-visible notification counter).
pub(crate) trait NoteSink: Send + Sync + 'static {
    /// `total` notifications have been delivered since the endpoint started (after the flush).
    fn delivered(&self, total: u64);
    /// The endpoint failed or closed: no more notifications will come.
    fn failed(&self);
    /// For finding the concrete type again.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Per-endpoint state of a later part of the transfer module (the stream proxy), made on first
/// use and closed with the endpoint.
pub(crate) trait Companion: Send + Sync + 'static {
    /// The endpoint is closing: take no more work, release what waits on it. Called before
    /// the endpoint's requests are ended.
    fn closing(&self);
    /// The endpoint's progress thread has stopped and every request has ended.
    fn closed(&self);
    /// For finding the concrete type again.
    fn as_any(&self) -> &dyn std::any::Any;
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

impl EpInner {
    fn lock(&self) -> Locked<'_, State> {
        Locked::new(&self.state)
    }

    /// Wake every thread and future waiting for a notification (one came, or the endpoint
    /// failed): the futures once `st`'s lock is let go.
    fn wake_notes(&self, st: &mut State) {
        self.notes_cv.notify_all();
        let waiters =
            std::mem::take(&mut *self.note_waiters.lock().unwrap_or_else(|e| e.into_inner()));
        st.wakes.notes.extend(waiters.into_iter().map(|(_, f)| f));
    }

    #[cfg_attr(
        not(feature = "p2p"),
        allow(dead_code, reason = "the intra-node path (feature p2p) uses it")
    )]
    /// End the endpoint with `cause` (the first cause stays). The wake-ups it decides
    /// (requests ended, notification waiters) are returned, to be run (dropped) once the
    /// caller let its own locks go.
    pub(super) fn fail_later(&self, cause: Broken) -> Wakes {
        let mut st = self.lock();
        break_endpoint(self, &mut st, cause);
        std::mem::take(&mut st.wakes)
    }

    #[cfg_attr(
        not(feature = "p2p"),
        allow(dead_code, reason = "the intra-node path (feature p2p) uses it")
    )]
    /// The endpoint's failure, if it has failed.
    pub(super) fn failure(&self) -> Option<Error> {
        self.lock().broken.as_ref().map(|(b, _)| b.to_error())
    }

    #[cfg_attr(
        not(feature = "p2p"),
        allow(dead_code, reason = "the intra-node path (feature p2p) uses it")
    )]
    /// Deliver a notification that arrived (the intra-node side's reader).
    pub(super) fn deliver(&self, n: Notification) {
        let mut st = self.lock();
        if st.notes.len() >= MAX_UNREAD_NOTIFICATIONS {
            break_endpoint(self, &mut st, Broken::Protocol(unread_overflow()));
            return;
        }
        st.notes.push_back(n);
        let total = self.delivered.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(s) = self.note_sink.get() {
            s.delivered(total);
        }
        self.wake_notes(&mut st);
        drop(st);
    }

    #[cfg_attr(
        not(feature = "p2p"),
        allow(dead_code, reason = "the intra-node path (feature p2p) uses it")
    )]
    /// A fresh state for a reconnected intra-node endpoint, with the peer's new descriptors.
    pub(super) fn restart_local(&self, peer_descriptors: Vec<MemoryDescriptor>) {
        let fresh = local_state(peer_descriptors);
        let old = std::mem::replace(&mut *self.lock(), fresh);
        drop(old);
    }

    fn poke(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes to our eventfd; a full counter (EAGAIN) is fine.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}

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
    inner: Arc<EpInner>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    companion: OnceLock<Arc<dyn Companion>>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        if let Some(c) = self.companion.get() {
            c.closing();
        }
        close(&self.inner);
        if let Some(l) = &self.inner.local {
            l.close();
        }
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            // Dropped on the progress thread itself (a waker run there): it ends by itself.
            crate::completion::thread::join_unless_current(t);
        }
        drain_after_close(&self.inner);
        if let Some(c) = self.companion.get() {
            c.closed();
        }
    }
}

/// An rdma_cm listener of a transfer [`Engine`]: accepts endpoints, grouping the rails of each.
pub struct TransferListener {
    engine: Engine,
    cm: Listener,
    /// Rails of endpoints not complete yet, by nonce, with when the group's first rail came.
    /// Bounded (a peer that never completes a group must not hold QPs and memory forever):
    /// groups older than [`PARTIAL_AGE`] connect timeouts are dropped, and past
    /// [`MAX_PARTIAL`] groups the oldest goes.
    partial: Mutex<HashMap<u64, (Instant, Vec<RailSetup>)>>,
}

/// The most endpoints whose rails are partly connected that a listener keeps.
pub(crate) const MAX_PARTIAL: usize = 64;
/// A partly connected endpoint is dropped after this many connect timeouts.
pub(crate) const PARTIAL_AGE: u32 = 4;

/// Drop the groups that began before `stale` (none when `None`), then the oldest while `max` or
/// more remain, making room for one more. Returns how many groups were dropped.
fn prune_partial<T>(
    groups: &mut HashMap<u64, (Instant, T)>,
    stale: Option<Instant>,
    max: usize,
) -> usize {
    let before = groups.len();
    if let Some(stale) = stale {
        groups.retain(|_, (since, _)| *since >= stale);
    }
    while groups.len() >= max.max(1) {
        let Some(oldest) = groups.iter().min_by_key(|(_, (t, _))| *t).map(|(k, _)| *k) else {
            break;
        };
        groups.remove(&oldest);
    }
    before - groups.len()
}

/// A rail connected and greeted, not yet part of an endpoint.
struct RailSetup {
    rail: Rail,
    hello: Hello,
}

fn resolve(peer: &str) -> Result<SocketAddr> {
    peer.to_socket_addrs()
        .map_err(|e| Error::invalid("peer", peer, format!("cannot be resolved: {e}")))?
        .min_by_key(|a| a.is_ipv6())
        .ok_or_else(|| Error::invalid("peer", peer, "resolves to no address"))
}

fn eventfd() -> Result<OwnedFd> {
    // SAFETY: no pointers.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::last_os("eventfd"));
    }
    // SAFETY: a new fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Engine {
    /// Listen for endpoints on `addr` (`host:port`; port 0 picks one).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an address that does not resolve, or an engine without
    /// rails; as [`Listener::bind`].
    #[doc(alias = "rdma_listen")]
    pub fn listen(&self, addr: &str) -> Result<TransferListener> {
        self.inner.require_rails()?;
        Ok(TransferListener {
            engine: self.clone(),
            cm: Listener::bind(resolve(addr)?)?,
            partial: Mutex::new(HashMap::new()),
        })
    }

    /// Connect an endpoint: one rail to each of `peers` (`host:port`, names resolved), in rail
    /// order, each through the local device rdma_cm routes it to (which must be one of the
    /// engine's). The first message of each rail's connection carries `publish` (on rail 0) and
    /// the peer's sends back its own ([`Endpoint::peer_descriptors`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an engine without rails, no peers, more than 16, a name
    /// that does not resolve, a
    /// route to a device that is not one of the engine's, or a first message that is not valid;
    /// [`Error::Timeout`] and [`Error::CmEvent`] from connecting; any verbs error.
    #[doc(alias = "rdma_connect")]
    pub fn connect(&self, peers: &[&str], publish: &[MemoryDescriptor]) -> Result<Endpoint> {
        self.inner.require_rails()?;
        if peers.is_empty() || peers.len() > super::descriptor::MAX_RAILS {
            return Err(Error::invalid(
                "peers",
                peers.len(),
                "one address per rail: 1 to 16",
            ));
        }
        let peers: Vec<SocketAddr> = peers.iter().map(|p| resolve(p)).collect::<Result<_>>()?;
        let origin = Origin::Dialed {
            peers,
            publish: publish.to_vec(),
        };
        let (rails, hellos) = dial(&self.inner, &origin)?;
        Endpoint::start(self.clone(), rails, hellos, origin)
    }
}

fn conn_opts(e: &EngineInner) -> ConnectOptions {
    ConnectOptions {
        caps: QpCaps {
            max_send_wr: e.config.queue_depth,
            max_recv_wr: e.config.notify_depth + 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
            signal_every: 0,
        },
        access: AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE,
        timeout: e.config.connect_timeout,
        ..Default::default()
    }
}

/// Connect every rail of `origin` (a dialed endpoint).
fn dial(e: &Arc<EngineInner>, origin: &Origin) -> Result<(Vec<Rail>, Vec<Hello>)> {
    let Origin::Dialed { peers, publish } = origin else {
        return Err(Error::invalid(
            "endpoint",
            "accepted",
            "only the side that connected can reconnect",
        ));
    };
    let nonce = (e.next_id() << 32) ^ u64::from(std::process::id()) ^ now_nanos();
    let mut rails = Vec::new();
    let mut hellos = Vec::new();
    for (i, addr) in peers.iter().enumerate() {
        let mut home = Home::new(e, i);
        let conn = Connection::connect_with(*addr, &conn_opts(e), |dev| home.resources(dev))?;
        let (rail, hello) = greet(
            e,
            conn,
            home,
            Hello {
                nonce,
                rail: i as u8,
                rails: peers.len() as u8,
                device: 0,
                devices: e.devices.len() as u8,
                credits: e.config.notify_depth as u16,
                max_message: e.max_message(),
                descriptors: if i == NOTIFY_RAIL {
                    publish.clone()
                } else {
                    Vec::new()
                },
            },
        )?;
        rails.push(rail);
        hellos.push(hello);
    }
    Ok((rails, hellos))
}

fn now_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// The resources a rail's connection is built on, made once rdma_cm has picked the device.
struct Home<'a> {
    e: &'a EngineInner,
    rail: usize,
    made: Option<(usize, CompletionChannel, u32)>,
}

impl<'a> Home<'a> {
    fn new(e: &'a EngineInner, rail: usize) -> Self {
        Home {
            e,
            rail,
            made: None,
        }
    }

    fn resources(&mut self, dev: &str) -> Result<QpResources> {
        let d = self.e.device_index(dev).ok_or_else(|| {
            Error::invalid(
                "peer",
                dev,
                format!(
                    "rdma_cm routed rail {} through device {dev}, which is not one of the engine's rails {:?}",
                    self.rail,
                    self.e.devices.iter().map(|d| &d.name).collect::<Vec<_>>()
                ),
            )
        })?;
        let rd = &self.e.devices[d];
        let ch = rd.ctx.create_comp_channel()?;
        ch.set_nonblocking(true)?;
        let depth = self.e.config.queue_depth;
        // One entry for the teardown request, a few for the handshake's send and read.
        let send_cq = rd.ctx.create_cq(depth + 4, Some(&ch))?;
        let recv_cq = rd
            .ctx
            .create_cq(self.e.config.notify_depth + 2, Some(&ch))?;
        let window = send_window(depth, send_cq.capacity().saturating_sub(2));
        self.made = Some((d, ch, window));
        Ok(QpResources {
            pd: rd.pd.clone(),
            send_cq,
            recv_cq,
        })
    }
}

/// A rail's handshake: post the notification receives (rail 0), swap the first messages'
/// addresses, read the peer's first message.
fn greet(
    e: &EngineInner,
    mut conn: Connection,
    home: Home<'_>,
    mut mine: Hello,
) -> Result<(Rail, Hello)> {
    let (device, channel, window) = home
        .made
        .ok_or_else(|| Error::invalid("connection", "no device", "rdma_cm picked no device"))?;
    mine.device = device as u8;
    let timeout = e.config.connect_timeout;
    if mine.rail as usize == NOTIFY_RAIL {
        let n = e.config.notify_depth as usize;
        conn.qp()
            .post_recv((0..n).map(|_| RecvRequest::empty().tag(RECV_TAG)))?;
    }
    let pd = conn.pd().clone();
    let hello_mr = pd.register(
        HostBuffer::from_slice(&mine.encode()?)?,
        AccessFlags::REMOTE_READ,
    )?;
    let theirs = conn.exchange(hello_mr.remote(), timeout)?;
    if theirs.len > MAX_HELLO {
        return Err(Error::invalid(
            "peer",
            theirs.len,
            format!("a first message is at most {MAX_HELLO} bytes"),
        ));
    }
    // Bounded just above: fits usize and one message.
    let len = theirs.len as usize;
    let mut into = pd.register(HostBuffer::zeroed(len)?, AccessFlags::LOCAL_WRITE)?;
    conn.qp()
        .post_send([SendRequest::read(into.slice(..)?, theirs.slice(0, len as u32)?).tag(1)])?;
    let deadline = deadline_after(Instant::now(), timeout);
    'wait: loop {
        for w in conn.send_cq().poll()? {
            if w.tag() == 1 {
                w.result()?;
                break 'wait;
            }
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: "the peer's first message",
                after: timeout,
            });
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let bytes = into
        .as_slice()
        .ok_or_else(|| Error::invalid("read", "region", "still in use"))?
        .to_vec();
    let hello = Hello::decode(&bytes)?;
    let parts = conn.into_parts();
    let rail = Rail {
        qp: QpSlot::Rts(parts.qp),
        send_cq: parts.send_cq,
        recv_cq: parts.recv_cq,
        channel,
        link: parts.link,
        device,
        peer_device: hello.device as usize,
        window,
        next_seq: 1,
        inflight: VecDeque::new(),
        pending: VecDeque::new(),
        _hello: hello_mr,
    };
    Ok((rail, hello))
}

impl TransferListener {
    /// The port listened on.
    pub fn port(&self) -> u16 {
        self.cm.port()
    }

    /// Accept the next endpoint: its rails' connections, whose first messages carry `publish`
    /// (on rail 0) and the peer's descriptors. Rails of other endpoints arriving meanwhile are
    /// kept for a later call.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when no complete endpoint arrives within `timeout`; errors of
    /// connecting and of the first messages (the failing connection is dropped).
    #[doc(alias = "rdma_accept")]
    pub fn accept(&self, publish: &[MemoryDescriptor], timeout: Duration) -> Result<Endpoint> {
        let e = &self.engine.inner;
        let deadline = deadline_after(Instant::now(), timeout);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    what: "an endpoint to accept",
                    after: timeout,
                });
            }
            let mut opts = conn_opts(e);
            opts.timeout = left.min(e.config.connect_timeout);
            let mut home = Home::new(e, 0);
            let conn = self.cm.accept_with(&opts, |dev| home.resources(dev))?;
            // The rail's index is the peer's: known only from its first message, so ours
            // carries the descriptors on every rail (the peer reads what it needs).
            let (rail, hello) = greet(
                e,
                conn,
                home,
                Hello {
                    nonce: 0,
                    rail: 0,
                    rails: 1,
                    device: 0,
                    devices: e.devices.len() as u8,
                    credits: e.config.notify_depth as u16,
                    max_message: e.max_message(),
                    descriptors: publish.to_vec(),
                },
            )?;
            let mut partial = self.partial.lock().unwrap_or_else(|e| e.into_inner());
            if !partial.contains_key(&hello.nonce) {
                let age = e.config.connect_timeout.saturating_mul(PARTIAL_AGE);
                let stale = Instant::now().checked_sub(age);
                prune_partial(&mut partial, stale, MAX_PARTIAL);
            }
            let (_, group) = partial
                .entry(hello.nonce)
                .or_insert_with(|| (Instant::now(), Vec::new()));
            if group.iter().any(|r| r.hello.rail == hello.rail)
                || group.first().is_some_and(|r| r.hello.rails != hello.rails)
            {
                return Err(Error::invalid(
                    "peer",
                    format!("rail {} of {}", hello.rail, hello.rails),
                    "a rail already connected, or a different rail count",
                ));
            }
            group.push(RailSetup { rail, hello });
            if group.len() == group[0].hello.rails as usize {
                let nonce = hello_nonce(group);
                let (_, mut group) = partial.remove(&nonce).expect("present");
                drop(partial);
                group.sort_by_key(|r| r.hello.rail);
                let (rails, hellos): (Vec<Rail>, Vec<Hello>) =
                    group.into_iter().map(|r| (r.rail, r.hello)).unzip();
                return Endpoint::start(self.engine.clone(), rails, hellos, Origin::Accepted);
            }
        }
    }
}

fn hello_nonce(group: &[RailSetup]) -> u64 {
    group[0].hello.nonce
}

impl std::fmt::Debug for TransferListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferListener")
            .field("port", &self.port())
            .finish()
    }
}

/// Rails, their peers' first messages: the state of a new (or reconnected) endpoint.
fn new_state(e: &EngineInner, rails: Vec<Rail>, hellos: &[Hello]) -> Result<State> {
    let h0 = &hellos[NOTIFY_RAIL];
    let peer_devices = h0.devices as usize;
    if hellos.iter().any(|h| h.devices as usize != peer_devices) {
        return Err(Error::invalid(
            "peer",
            "device counts",
            "differ between rails",
        ));
    }
    let max_message = hellos
        .iter()
        .map(|h| h.max_message)
        .fold(e.max_message(), u32::min);
    Ok(State {
        rails,
        broken: None,
        requests: HashMap::new(),
        deadlines: BinaryHeap::new(),
        notify_q: VecDeque::new(),
        credits: Credits::new(h0.credits as u32, e.config.notify_depth),
        notes: VecDeque::new(),
        closing: false,
        turn: 0,
        peer_descriptors: h0.descriptors.clone(),
        peer_devices,
        max_message,
        touched: Vec::new(),
        wakes: Wakes::default(),
    })
}

#[cfg_attr(
    not(feature = "p2p"),
    allow(dead_code, reason = "the intra-node path (feature p2p) uses it")
)]
/// The state of an intra-node endpoint: no rails, the peer's descriptors.
fn local_state(peer_descriptors: Vec<MemoryDescriptor>) -> State {
    State {
        rails: Vec::new(),
        broken: None,
        requests: HashMap::new(),
        deadlines: BinaryHeap::new(),
        notify_q: VecDeque::new(),
        credits: Credits::new(4, 4),
        notes: VecDeque::new(),
        closing: false,
        turn: 0,
        peer_descriptors,
        peer_devices: 0,
        max_message: u32::MAX,
        touched: Vec::new(),
        wakes: Wakes::default(),
    }
}

impl Endpoint {
    #[cfg_attr(
        not(feature = "p2p"),
        allow(dead_code, reason = "the intra-node path (feature p2p) uses it")
    )]
    /// An intra-node endpoint: no rails and no progress thread; `local` carries its requests
    /// and notifications.
    pub(super) fn start_local(
        engine: Engine,
        peer_descriptors: Vec<MemoryDescriptor>,
        local: Arc<dyn LocalSide>,
    ) -> Result<Endpoint> {
        let inner = Arc::new(EpInner {
            engine,
            local: Some(local.clone()),
            state: Mutex::new(local_state(peer_descriptors)),
            notes_cv: Condvar::new(),
            note_waiters: Mutex::new(Vec::new()),
            wake: eventfd()?,
            counters: Vec::new(),
            origin: Origin::Accepted,
            next_req: AtomicU64::new(1),
            delivered: AtomicU64::new(0),
            note_sink: OnceLock::new(),
        });
        let ep = Endpoint {
            handle: Arc::new(Handle {
                inner: inner.clone(),
                thread: Mutex::new(None),
                companion: OnceLock::new(),
            }),
        };
        // On failure the endpoint is dropped: its side is closed.
        local.attach(&inner)?;
        Ok(ep)
    }

    #[cfg_attr(
        not(feature = "p2p"),
        allow(dead_code, reason = "the intra-node path (feature p2p) uses it")
    )]
    /// The intra-node side, for an endpoint made by `connect_local` or a local listener.
    pub(super) fn local_side(&self) -> Option<&Arc<dyn LocalSide>> {
        self.inner().local.as_ref()
    }

    fn start(
        engine: Engine,
        rails: Vec<Rail>,
        hellos: Vec<Hello>,
        origin: Origin,
    ) -> Result<Endpoint> {
        let n = rails.len();
        let state = new_state(&engine.inner, rails, &hellos)?;
        let inner = Arc::new(EpInner {
            engine,
            local: None,
            state: Mutex::new(state),
            notes_cv: Condvar::new(),
            note_waiters: Mutex::new(Vec::new()),
            wake: eventfd()?,
            counters: (0..n).map(|_| RailCounters::default()).collect(),
            origin,
            next_req: AtomicU64::new(1),
            delivered: AtomicU64::new(0),
            note_sink: OnceLock::new(),
        });
        let t = inner.clone();
        let thread =
            crate::driver::ctx::spawn_thread("gpudirect-transfer", move || progress_loop(&t))?;
        Ok(Endpoint {
            handle: Arc::new(Handle {
                inner,
                thread: Mutex::new(Some(thread)),
                companion: OnceLock::new(),
            }),
        })
    }

    fn inner(&self) -> &Arc<EpInner> {
        &self.handle.inner
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.inner().engine
    }

    /// The descriptors the peer published in its first message.
    pub fn peer_descriptors(&self) -> Vec<MemoryDescriptor> {
        self.inner().lock().peer_descriptors.clone()
    }

    /// Rails of the endpoint.
    pub fn rails(&self) -> usize {
        self.inner().counters.len()
    }

    /// Per-rail counters (cumulative), in rail order.
    pub fn rail_stats(&self) -> Vec<RailStats> {
        let i = self.inner();
        let st = i.lock();
        i.counters
            .iter()
            .enumerate()
            .map(|(r, c)| RailStats {
                device: st
                    .rails
                    .get(r)
                    .map(|x| i.engine.inner.devices[x.device].name.clone())
                    .unwrap_or_default(),
                bytes_written: c.bytes_written.load(Ordering::Relaxed),
                bytes_read: c.bytes_read.load(Ordering::Relaxed),
                writes: c.writes.load(Ordering::Relaxed),
                reads: c.reads.load(Ordering::Relaxed),
                notifications_sent: c.notes_sent.load(Ordering::Relaxed),
                notifications_received: c.notes_received.load(Ordering::Relaxed),
            })
            .collect()
    }

    /// Why the endpoint stopped, if it has: the error its requests ended with.
    pub fn failure(&self) -> Option<Error> {
        self.inner()
            .lock()
            .broken
            .as_ref()
            .map(|(b, _)| b.to_error())
    }

    /// This endpoint without keeping it open.
    pub(crate) fn downgrade(&self) -> WeakEndpoint {
        WeakEndpoint(Arc::downgrade(&self.handle))
    }

    /// The endpoint's companion of type `T`, made by `make` on first use (`None` when a
    /// companion of another type was made first).
    pub(crate) fn companion<T: Companion>(&self, make: impl FnOnce() -> T) -> Option<&T> {
        self.handle
            .companion
            .get_or_init(|| Arc::new(make()))
            .as_any()
            .downcast_ref::<T>()
    }

    /// The endpoint's notification sink, made by `make` (given the notifications delivered so
    /// far) on first use, under the endpoint's lock so that no delivery is missed; a sink made
    /// on a failed endpoint is told so at once.
    ///
    /// # Errors
    ///
    /// What `make` returns.
    pub(crate) fn note_sink(
        &self,
        make: impl FnOnce(u64) -> Result<Arc<dyn NoteSink>>,
    ) -> Result<Arc<dyn NoteSink>> {
        let inner = self.inner();
        let st = inner.lock();
        if let Some(s) = inner.note_sink.get() {
            return Ok(s.clone());
        }
        let s = make(inner.delivered.load(Ordering::Relaxed))?;
        if st.broken.is_some() {
            s.failed();
        }
        let _ = inner.note_sink.set(s.clone());
        drop(st);
        Ok(s)
    }

    /// The checks [`transfer`](Self::transfer) makes before anything is queued, without queueing
    /// anything (stream-ordered requests make them before they are enqueued on a stream).
    ///
    /// # Errors
    ///
    /// As [`transfer`](Self::transfer).
    pub(crate) fn check_request(
        &self,
        dir: Direction,
        pairs: &[(LocalRange, RemoteRange)],
        opts: &TransferOptions,
    ) -> Result<()> {
        let inner = self.inner();
        check_pairs(dir, pairs, opts)?;
        if inner.local.is_some() {
            // Intra-node: no rails and no staging; the copies' own checks come when they are
            // mapped (before anything is queued).
            check_same_engine(inner.engine.inner.engine_id, pairs)?;
            return match inner.lock().broken.as_ref() {
                Some((b, _)) => Err(b.to_error()),
                None => Ok(()),
            };
        }
        let staged = pairs.iter().any(|(l, _)| l.region.entry.mrs.is_empty());
        if staged {
            if pairs.len() != 1 {
                return Err(Error::invalid(
                    "pairs",
                    pairs.len(),
                    "a request with staged memory moves one range",
                ));
            }
        } else {
            check_same_engine(inner.engine.inner.engine_id, pairs)?;
        }
        let st = inner.lock();
        if let Some((b, _)) = &st.broken {
            return Err(b.to_error());
        }
        check_rkeys(pairs, st.peer_devices)
    }

    /// The request on registered memory (what [`transfer`](Self::transfer) does once no
    /// local range is staged): checked, planned, queued and posted within the windows.
    pub(crate) fn direct(
        &self,
        dir: Direction,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<Transfer> {
        let inner = self.inner();
        let e = &inner.engine.inner;
        check_pairs(dir, &pairs, &opts)?;
        check_same_engine(e.engine_id, &pairs)?;
        if let Some(i) = pairs
            .iter()
            .position(|(l, _)| l.region.entry.mrs.is_empty())
        {
            return Err(Error::invalid(
                "pairs",
                i,
                "staged memory goes through the staged path",
            ));
        }
        let timeout = opts.deadline.unwrap_or(e.config.deadline);
        let started = Instant::now();
        let deadline = deadline_after(started, timeout);
        let lens: Vec<u64> = pairs.iter().map(|(l, _)| l.len).collect();
        let shared = ReqShared::new(deadline + FLUSH_WAIT + Duration::from_secs(5));
        let regions: Vec<Region> = pairs.iter().map(|(l, _)| l.region.clone()).collect();
        let mut st = inner.lock();
        if let Some((b, _)) = &st.broken {
            return Err(b.to_error());
        }
        check_rkeys(&pairs, st.peer_devices)?;
        // Rails nearest the first pair's memory, among the endpoint's.
        let preferred = &pairs[0].0.region.entry.preferred;
        let mut rails: Vec<usize> = (0..st.rails.len())
            .filter(|&r| preferred.contains(&st.rails[r].device))
            .collect();
        if rails.is_empty() {
            rails = (0..st.rails.len()).collect();
        }
        let turn = st.turn;
        st.turn = st.turn.wrapping_add(1);
        let chunks = plan(&PlanInput {
            lens: &lens,
            max_message: st.max_message,
            rails: &rails,
            stripe_min: e.config.stripe_min,
            notify_rail: opts.notify.map(|_| NOTIFY_RAIL),
            turn,
        })?;
        let mut wrs: Vec<(usize, Wr, bool)> = Vec::with_capacity(chunks.len());
        for c in &chunks {
            wrs.push((c.rail, build_wr(&st, dir, &pairs, c, opts.notify)?, c.imm));
        }
        let id = inner.next_req.fetch_add(1, Ordering::Relaxed);
        let mut req = Request {
            shared: shared.clone(),
            dir,
            unposted: wrs.len(),
            posted: 0,
            elsewhere: wrs.iter().filter(|w| w.0 != NOTIFY_RAIL).count(),
            held: None,
            notify: opts.notify,
            timeout,
            error: None,
            rail_bytes: vec![0; st.rails.len()],
            messages: wrs.len() as u64,
            started,
            paths: pairs
                .iter()
                .map(|(l, _)| l.region.entry.path.clone())
                .collect(),
            flush: if dir == Direction::Read {
                let mut v: Vec<usize> = pairs
                    .iter()
                    .filter_map(|(l, _)| l.region.entry.ordinal)
                    .collect();
                v.dedup();
                v
            } else {
                Vec::new()
            },
        };
        for (rail, wr, imm) in wrs {
            if imm {
                req.held = Some(wr);
            } else {
                st.rails[rail].pending.push_back((id, wr));
            }
        }
        if req.held.is_some() {
            st.notify_q.push_back(id);
        }
        st.requests.insert(id, req);
        st.deadlines.push(std::cmp::Reverse((deadline, id)));
        pump(inner, &mut st);
        drop(st);
        Ok(Transfer::started("transfer", shared, regions))
    }

    /// The next notification from the peer, waiting up to `timeout`; `None` when none came.
    ///
    /// # Errors
    ///
    /// The endpoint's failure, once it has failed and no notification is left.
    pub fn next_notification(&self, timeout: Duration) -> Result<Option<Notification>> {
        let inner = self.inner();
        let deadline = deadline_after(Instant::now(), timeout);
        // With `spin`, poll the completion queues here first (the lock is let go between
        // polls): no thread hand-off for a notification that comes soon.
        let spin = inner.engine.inner.config.spin;
        if !spin.is_zero() {
            let until = deadline_after(Instant::now(), spin.min(timeout));
            loop {
                let mut st = inner.lock();
                if let Some(n) = st.notes.pop_front() {
                    return Ok(Some(n));
                }
                if st.broken.is_some() || Instant::now() >= until {
                    break;
                }
                if poll_all(inner, &mut st) {
                    pump(inner, &mut st);
                }
                drop(st);
                // Let the kernel's side of a software NIC run on a busy CPU.
                std::thread::yield_now();
            }
        }
        let mut st = inner.lock();
        loop {
            if let Some(n) = st.notes.pop_front() {
                return Ok(Some(n));
            }
            if let Some((b, _)) = &st.broken {
                return Err(b.to_error());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            st = st.wait_timeout(&inner.notes_cv, left);
        }
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
                let flag = {
                    let inner = ep.inner();
                    let mut st = inner.lock();
                    if let Some(n) = st.notes.pop_front() {
                        return Ok(Some(n));
                    }
                    if let Some((b, _)) = &st.broken {
                        return Err(b.to_error());
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        return Ok(None);
                    }
                    let flag = CompletionFlag::new();
                    // Registered under the state lock: a notification pushed after the look
                    // above sets this flag.
                    let mut w = inner.note_waiters.lock().unwrap_or_else(|e| e.into_inner());
                    prune_waiters(&mut w, now, &mut st.wakes.notes);
                    w.push((deadline, flag.clone()));
                    flag
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
        let inner = self.inner();
        if let Some(l) = &inner.local {
            return l.clone().reconnect(inner);
        }
        if matches!(inner.origin, Origin::Accepted) {
            return Err(Error::invalid(
                "endpoint",
                "accepted",
                "only the side that connected can reconnect; the listener accepts the new endpoint",
            ));
        }
        {
            let mut st = inner.lock();
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
        let (rails, hellos) = dial(&inner.engine.inner, &inner.origin)?;
        if rails.len() != inner.counters.len() {
            return Err(Error::invalid(
                "rails",
                rails.len(),
                "the rail count changed",
            ));
        }
        let fresh = new_state(&inner.engine.inner, rails, &hellos)?;
        let old = {
            let mut st = inner.lock();
            force_finish(&mut st);
            std::mem::replace(&mut *st, fresh)
        };
        inner.poke();
        drop(old);
        Ok(())
    }
}

/// Sets its flag when dropped (a notification future that ends or is dropped).
struct SetOnDrop(CompletionFlag);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.set();
    }
}

/// Drop the notification waiters that are gone: set (their future ended or was dropped), or
/// past their deadline (then put in `expired`, to be set once the lock is let go, so what the
/// completion tracker parked for them is freed).
fn prune_waiters(w: &mut Vec<(Instant, CompletionFlag)>, now: Instant, expired: &mut Woken) {
    w.retain(|(d, f)| {
        if f.is_complete() {
            return false;
        }
        let live = *d > now;
        if !live {
            expired.push(f.clone());
        }
        live
    });
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.inner().lock();
        f.debug_struct("Endpoint")
            .field("rails", &st.rails.len())
            .field("requests", &st.requests.len())
            .field("broken", &st.broken.as_ref().map(|b| &b.0))
            .finish()
    }
}

/// Every remote descriptor has one rkey per device of the peer.
fn check_rkeys(pairs: &[(LocalRange, RemoteRange)], peer_devices: usize) -> Result<()> {
    for (i, (_, r)) in pairs.iter().enumerate() {
        if r.descriptor().rkeys().len() != peer_devices {
            return Err(Error::invalid(
                "pairs",
                i,
                format!(
                    "the remote descriptor has {} rkeys; the peer has {} devices",
                    r.descriptor().rkeys().len(),
                    peer_devices
                ),
            ));
        }
    }
    Ok(())
}
fn build_wr(
    st: &State,
    dir: Direction,
    pairs: &[(LocalRange, RemoteRange)],
    c: &Chunk,
    notify: Option<u32>,
) -> Result<Wr> {
    let rail = &st.rails[c.rail];
    let (l, r) = &pairs[c.pair];
    let off = usize::try_from(l.region.at + l.offset + c.offset)
        .map_err(|_| Error::invalid("offset", l.offset, "fits no usize"))?;
    let local = l.region.entry.mrs[rail.device].slice(off, c.len as usize)?;
    let remote = RemoteSlice {
        addr: r.addr_at(c.offset),
        rkey: r.descriptor().rkeys()[rail.peer_device],
        len: c.len,
    };
    Ok(match dir {
        Direction::Write => Wr::Write {
            local,
            remote,
            imm: if c.imm { notify } else { None },
            signaled: c.last_on_rail,
        },
        Direction::Read => Wr::Read {
            local,
            remote,
            signaled: c.last_on_rail,
        },
    })
}

/// Post what fits: each rail's pending messages within its window, the notifications whose
/// other rails are done (in order, against credits), and credit returns.
fn pump(inner: &EpInner, st: &mut State) {
    if st.broken.is_some() {
        return;
    }
    // Notifications, in request order.
    while let Some(&id) = st.notify_q.front() {
        let Some(req) = st.requests.get_mut(&id) else {
            st.notify_q.pop_front();
            continue;
        };
        if req.elsewhere > 0 || !st.credits.can_notify() {
            break;
        }
        let wr = req.held.take().expect("held until released");
        st.credits.take_notify();
        st.rails[NOTIFY_RAIL].pending.push_back((id, wr));
        st.notify_q.pop_front();
    }
    if let Some(n) = st.credits.take_return() {
        st.rails[NOTIFY_RAIL].pending.push_back((0, Wr::Credits(n)));
    }
    for r in 0..st.rails.len() {
        if let Err(e) = post_rail(inner, st, r) {
            break_endpoint(inner, st, Broken::of(&e));
            return;
        }
    }
}

/// Post rail `r`'s pending messages within its window, as one chain.
fn post_rail(inner: &EpInner, st: &mut State, r: usize) -> Result<()> {
    let State {
        rails, requests, ..
    } = st;
    let rail = &mut rails[r];
    let room = (rail.window as usize).saturating_sub(rail.outstanding());
    let n = room.min(rail.pending.len());
    if n == 0 {
        return Ok(());
    }
    let QpSlot::Rts(qp) = &mut rail.qp else {
        return Ok(());
    };
    let mut chain = Vec::with_capacity(n);
    let mut posted = Vec::with_capacity(n);
    for (req, wr) in rail.pending.drain(..n) {
        let seq = rail.next_seq;
        rail.next_seq += 1;
        let bytes = wr.bytes();
        let (sr, dir, imm) = match wr {
            Wr::Write {
                local,
                remote,
                imm,
                signaled,
            } => {
                let mut s = SendRequest::write(local, remote);
                if let Some(i) = imm {
                    s = s.with_imm(i);
                }
                let s = if signaled || imm.is_some() {
                    s.signaled()
                } else {
                    s.unsignaled()
                };
                (s, Some(Direction::Write), imm.is_some())
            }
            Wr::Read {
                local,
                remote,
                signaled,
            } => {
                let s = SendRequest::read(local, remote);
                let s = if signaled {
                    s.signaled()
                } else {
                    s.unsignaled()
                };
                (s, Some(Direction::Read), false)
            }
            Wr::Credits(k) => (
                SendRequest::send_inline(&[]).with_imm(k).signaled(),
                None,
                false,
            ),
        };
        chain.push(sr.tag(seq));
        posted.push(Posted {
            seq,
            req,
            bytes,
            dir,
            imm,
        });
    }
    let res = qp.post_send(chain);
    let ok = match &res {
        Ok(k) => *k,
        Err(_) => 0,
    };
    // Posted ones are in flight; the rest are dropped with the request failing below.
    for (i, p) in posted.into_iter().enumerate() {
        if let Some(q) = requests.get_mut(&p.req) {
            q.unposted = q.unposted.saturating_sub(1);
            if i < ok {
                q.posted += 1;
            }
        }
        if i < ok {
            rail.inflight.push_back(p);
        }
    }
    let _ = inner;
    res.map(|_| ())
}

/// Stop the endpoint: every queue pair to the error state (the NIC flushes what is posted),
/// nothing more posted, every request ends with the cause's error.
fn break_endpoint(inner: &EpInner, st: &mut State, cause: Broken) {
    if st.broken.is_some() {
        return;
    }
    st.broken = Some((cause.clone(), Instant::now()));
    for rail in &mut st.rails {
        rail.qp = match std::mem::replace(&mut rail.qp, QpSlot::Gone) {
            QpSlot::Rts(q) => match q.into_error() {
                Ok(q) => QpSlot::Error { _qp: q },
                Err(_) => QpSlot::Gone,
            },
            other => other,
        };
        for (id, _) in rail.pending.drain(..) {
            if let Some(q) = st.requests.get_mut(&id) {
                q.unposted = q.unposted.saturating_sub(1);
            }
        }
    }
    st.notify_q.clear();
    for q in st.requests.values_mut() {
        if q.held.take().is_some() {
            q.unposted = q.unposted.saturating_sub(1);
        }
        if q.error.is_none() {
            q.error = Some(cause.to_error());
        }
    }
    finish_done(st);
    if let Some(s) = inner.note_sink.get() {
        s.failed();
    }
    inner.wake_notes(st);
}

/// Finish every request that has nothing left in flight.
fn finish_done(st: &mut State) {
    st.touched.clear();
    let done: Vec<u64> = st
        .requests
        .iter()
        .filter(|(_, q)| q.finished())
        .map(|(id, _)| *id)
        .collect();
    for id in done {
        let q = st.requests.remove(&id).expect("present");
        finish(st, q);
    }
}

/// Finish the requests completions touched since the last look, if nothing is left in flight.
fn finish_touched(st: &mut State) {
    let touched = std::mem::take(&mut st.touched);
    for id in &touched {
        if st.requests.get(id).is_some_and(Request::finished) {
            let q = st.requests.remove(id).expect("present");
            finish(st, q);
        }
    }
    st.touched = touched;
    st.touched.clear();
}

/// Finish `q`: its waiters are woken once the state's lock is let go.
fn finish(st: &mut State, q: Request) {
    let r = match q.error {
        Some(e) => Err(e),
        None => {
            let mut flushed = Ok(());
            for &o in &q.flush {
                if let Err(e) = flush_gpu(o) {
                    flushed = Err(e);
                }
            }
            flushed.map(|_| TransferReport {
                direction: q.dir,
                bytes: q.rail_bytes.iter().sum(),
                messages: q.messages,
                rail_bytes: q.rail_bytes,
                paths: q.paths,
                elapsed: q.started.elapsed(),
                notified: q.notify,
            })
        }
    };
    st.wakes.finished.push((q.shared, r));
}

/// Make NIC writes to GPU `ordinal`'s memory visible to it.
fn flush_gpu(ordinal: usize) -> Result<()> {
    let ctx = crate::cuda::context(ordinal)?;
    crate::rdma::flush_gpudirect_rdma_writes(&ctx, crate::rdma::FlushScope::Owner).map(|_| ())
}

/// After a failure: finish every request, flushed or not (the queue pairs keep what the NIC
/// may still touch).
fn force_finish(st: &mut State) {
    for (_, mut q) in st.requests.drain() {
        q.posted = 0;
        if q.error.is_none() {
            q.error = Some(Broken::Closed.to_error());
        }
        let r = Err(q.error.take().expect("set"));
        st.wakes.finished.push((q.shared, r));
    }
}

fn close(inner: &EpInner) {
    {
        let mut st = inner.lock();
        st.closing = true;
        if st.broken.is_none() {
            break_endpoint(inner, &mut st, Broken::Closed);
        }
    }
    inner.poke();
}

/// After the progress thread stopped: poll the flushes (bounded), then finish what is left.
fn drain_after_close(inner: &EpInner) {
    let until = Instant::now() + FLUSH_WAIT;
    loop {
        let mut st = inner.lock();
        poll_all(inner, &mut st);
        if st.requests.is_empty() || Instant::now() >= until {
            force_finish(&mut st);
            return;
        }
        drop(st);
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Every completion `cq` holds now, as `read` takes each.
fn drain<T>(cq: &mut CompletionQueue, read: impl Fn(&WorkCompletion) -> T) -> Result<Vec<T>> {
    let mut out = Vec::new();
    loop {
        let ws = cq.poll()?;
        if ws.len() == 0 {
            return Ok(out);
        }
        out.extend(ws.map(&read));
    }
}

/// Poll every rail's CQs until empty; returns whether anything was found.
fn poll_all(inner: &EpInner, st: &mut State) -> bool {
    let mut any = false;
    let mut notes: Vec<Notification> = Vec::new();
    for r in 0..st.rails.len() {
        match drain(&mut st.rails[r].send_cq, |w| {
            (w.tag(), w.is_ok(), w.result())
        }) {
            Err(e) => break_endpoint(inner, st, Broken::of(&e)),
            Ok(got) => {
                any |= !got.is_empty();
                for (seq, ok, res) in got {
                    on_send_completion(inner, st, r, seq, ok, res);
                }
            }
        }
        {
            let got = match drain(&mut st.rails[r].recv_cq, |w| {
                (w.result(), w.opcode(), w.imm())
            }) {
                Err(e) => {
                    break_endpoint(inner, st, Broken::of(&e));
                    continue;
                }
                Ok(got) => got,
            };
            any |= !got.is_empty();
            let mut repost = 0;
            for (res, op, imm) in got {
                if let Err(e) = res {
                    // Flushed receives after a failure, or the failure itself.
                    break_endpoint(inner, st, Broken::of(&e));
                    continue;
                }
                repost += 1;
                st.credits.on_received();
                match (op, imm) {
                    (WcOpcode::RecvRdmaWithImm, Some(tag)) => {
                        inner.counters[r]
                            .notes_received
                            .fetch_add(1, Ordering::Relaxed);
                        notes.push(Notification { tag });
                    }
                    (WcOpcode::Recv, Some(n)) => {
                        if let Err(e) = st.credits.on_returned(n) {
                            break_endpoint(inner, st, Broken::Protocol(e.to_string()));
                        }
                    }
                    _ => break_endpoint(
                        inner,
                        st,
                        Broken::Protocol(
                            "a message that is neither a notification nor a credit return".into(),
                        ),
                    ),
                }
            }
            if repost > 0 && st.broken.is_none() {
                let rail = &mut st.rails[r];
                if let QpSlot::Rts(qp) = &mut rail.qp
                    && let Err(e) =
                        qp.post_recv((0..repost).map(|_| RecvRequest::empty().tag(RECV_TAG)))
                {
                    break_endpoint(inner, st, Broken::of(&e));
                }
            }
        }
    }
    if !notes.is_empty() {
        // Visible before delivered: GPU memory a peer may have written is flushed first.
        for o in inner.engine.inner.gpu_targets() {
            if let Err(e) = flush_gpu(o) {
                break_endpoint(
                    inner,
                    st,
                    Broken::Protocol(format!("flushing GPU {o}: {e}")),
                );
            }
        }
        if st.notes.len() + notes.len() > MAX_UNREAD_NOTIFICATIONS {
            break_endpoint(inner, st, Broken::Protocol(unread_overflow()));
            return true;
        }
        // Delivered even if the endpoint failed meanwhile: their bytes arrived.
        let total = inner
            .delivered
            .fetch_add(notes.len() as u64, Ordering::Relaxed)
            + notes.len() as u64;
        st.notes.extend(notes);
        if let Some(s) = inner.note_sink.get() {
            s.delivered(total);
        }
        inner.wake_notes(st);
    }
    finish_touched(st);
    any
}

/// A send completion tagged `seq` on rail `r`: every message up to it is done.
fn on_send_completion(
    inner: &EpInner,
    st: &mut State,
    r: usize,
    seq: u64,
    ok: bool,
    res: Result<()>,
) {
    let mut failed = None;
    while st.rails[r].inflight.front().is_some_and(|p| p.seq <= seq) {
        let p = st.rails[r].inflight.pop_front().expect("present");
        let this = p.seq == seq;
        st.touched.push(p.req);
        let Some(q) = st.requests.get_mut(&p.req) else {
            if this && !ok && st.broken.is_none() {
                failed = Some(res.as_ref().err().map(Broken::of).unwrap_or(Broken::Closed));
            }
            continue;
        };
        q.posted = q.posted.saturating_sub(1);
        if r != NOTIFY_RAIL {
            q.elsewhere = q.elsewhere.saturating_sub(1);
        }
        if this && !ok {
            if q.error.is_none()
                && let Err(e) = &res
            {
                q.error = Some(Broken::of(e).to_error());
            }
            if let Err(e) = &res {
                failed = Some(Broken::of(e));
            }
            continue;
        }
        if q.error.is_none() {
            q.rail_bytes[r] += p.bytes;
            let c = &inner.counters[r];
            match p.dir {
                Some(Direction::Write) => {
                    c.bytes_written.fetch_add(p.bytes, Ordering::Relaxed);
                    c.writes.fetch_add(1, Ordering::Relaxed);
                }
                Some(Direction::Read) => {
                    c.bytes_read.fetch_add(p.bytes, Ordering::Relaxed);
                    c.reads.fetch_add(1, Ordering::Relaxed);
                }
                None => {}
            }
            if p.imm {
                c.notes_sent.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    if let Some(b) = failed {
        break_endpoint(inner, st, b);
    }
}

/// One pass: events, completions, the rdma_cm links, deadlines, posting. Returns whether any
/// completion was found.
fn progress(inner: &EpInner, st: &mut State) -> bool {
    for rail in &st.rails {
        while rail.channel.get_event().is_ok() {}
    }
    let any = poll_all(inner, st);
    let mut cm = None;
    for rail in &st.rails {
        while let Ok(Some(ev)) = rail.link.next_event() {
            if ev.ends_connection() {
                cm = Some(Broken::Disconnected(ev.name, ev.status));
            }
        }
    }
    if let Some(b) = cm {
        break_endpoint(inner, st, b);
    }
    let now = Instant::now();
    while let Some(std::cmp::Reverse((d, id))) = st.deadlines.peek().copied() {
        if !st.requests.contains_key(&id) {
            st.deadlines.pop();
            continue;
        }
        if d > now {
            break;
        }
        st.deadlines.pop();
        let q = st.requests.get_mut(&id).expect("present");
        let after = q.timeout;
        if q.error.is_none() {
            q.error = Some(Broken::Deadline(after).to_error());
        }
        break_endpoint(inner, st, Broken::Deadline(after));
    }
    if let Some((_, at)) = st.broken
        && at.elapsed() >= FLUSH_WAIT
        && !st.requests.is_empty()
    {
        force_finish(st);
    }
    pump(inner, st);
    any
}

/// Arm every CQ, then look once more (a completion that raced the arming raises no event).
/// Returns whether something was found (then do not sleep).
fn arm(inner: &EpInner, st: &mut State) -> bool {
    let mut armed = true;
    for rail in &st.rails {
        armed &= rail.send_cq.req_notify(false).is_ok() && rail.recv_cq.req_notify(false).is_ok();
    }
    let found = poll_all(inner, st);
    if found {
        pump(inner, st);
    }
    found || !armed
}

fn progress_loop(inner: &Arc<EpInner>) {
    loop {
        let (fds, timeout) = {
            let mut st = inner.lock();
            if st.closing {
                return;
            }
            if progress(inner, &mut st) {
                continue;
            }
            if arm(inner, &mut st) {
                continue;
            }
            let mut fds = vec![inner.wake.as_raw_fd()];
            for r in &st.rails {
                fds.push(r.channel.as_fd().as_raw_fd());
                fds.push(r.link.as_fd().as_raw_fd());
            }
            let next = st
                .deadlines
                .peek()
                .map(|std::cmp::Reverse((d, _))| d.saturating_duration_since(Instant::now()))
                .unwrap_or(TICK)
                .min(TICK);
            (fds, next)
        };
        let mut p: Vec<libc::pollfd> = fds
            .iter()
            .map(|&fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // SAFETY: valid pollfds for the call; the fds stay open (the rails are replaced only by
        // reconnect, which pokes the eventfd, and a stale fd number is only polled once).
        let _ = unsafe {
            libc::poll(
                p.as_mut_ptr(),
                p.len() as libc::nfds_t,
                (timeout.as_millis() as i32).max(1),
            )
        };
        if p[0].revents & libc::POLLIN != 0 {
            let mut v: u64 = 0;
            // SAFETY: reads 8 bytes from our eventfd into `v`.
            unsafe { libc::read(inner.wake.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_rail_groups_are_bounded_by_age_and_count() {
        use std::time::Duration;
        let t0 = Instant::now();
        let mut g: HashMap<u64, (Instant, ())> = HashMap::new();
        for k in 0..10u64 {
            g.insert(k, (t0 + Duration::from_millis(k), ()));
        }
        // Nothing stale, room for one more under a cap of 20: nothing goes.
        assert_eq!(prune_partial(&mut g, None, 20), 0);
        // Groups that began before t0 + 3 ms are stale.
        assert_eq!(
            prune_partial(&mut g, Some(t0 + Duration::from_millis(3)), 20),
            3
        );
        assert!(!g.contains_key(&2) && g.contains_key(&3));
        // A cap of 4: the oldest go until three remain (room for the one being added).
        assert_eq!(prune_partial(&mut g, None, 4), 4);
        let mut left: Vec<u64> = g.keys().copied().collect();
        left.sort();
        assert_eq!(left, vec![7, 8, 9]);
        // A cap of 0 counts as 1: every group goes, none is kept waiting forever.
        assert_eq!(prune_partial(&mut g, None, 0), 3);
        assert!(g.is_empty());
    }

    #[test]
    fn dropped_notification_waiters_do_not_pile_up() {
        // A `select!` loop creates and drops a notification future per turn: each left its
        // waiter (and a parked tracker entry) until a notification came or a later call found
        // its deadline passed (hours, for a long timeout).
        let mut w = Vec::new();
        let far = Instant::now() + Duration::from_secs(3600);
        for _ in 0..1000 {
            let f = CompletionFlag::new();
            w.push((far, f.clone()));
            drop(SetOnDrop(f));
            prune_waiters(&mut w, Instant::now(), &mut Woken::default());
        }
        assert!(w.len() <= 1, "{} waiters left", w.len());
        // A live waiter stays; an expired one is set and dropped.
        let (live, old) = (CompletionFlag::new(), CompletionFlag::new());
        let now = Instant::now();
        w = vec![(far, live.clone()), (now, old.clone())];
        let mut expired = Woken::default();
        prune_waiters(&mut w, now, &mut expired);
        assert_eq!(w.len(), 1);
        assert!(
            !old.is_complete() && !live.is_complete(),
            "set once the lock is let go"
        );
        drop(expired);
        assert!(old.is_complete() && !live.is_complete());
    }
}
