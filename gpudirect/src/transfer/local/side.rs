//! The intra-node side of an endpoint ([`Side`]): its socket and reader thread, its issue
//! lanes (each with its copy streams), and the worker that finishes requests (each lane's in
//! order, notifications in request order; a caller blocked in a wait finishes what is done on
//! its lane itself), sends their notifications, and ends the endpoint at a deadline.

use super::copies::{Events, Keep, park_imports};
use super::fds::{PeerFd, PeerFds};
use super::graphs::CopyGraphs;
use super::import::Import;
use super::kernel::{GATHER_PIECES, Gather};
use super::meet::dial;
use super::socket::{FRAME, NOTE, os, send_all};
use super::state::{State, deliver, fail_later, restart};
use crate::completion::{Fence, Tracker, deadline_after, thread::join_unless_current};
use crate::cuda::Stream;
use crate::cudarc::driver::{CudaContext, CudaEvent};
use crate::error::{Error, Result};
use crate::transfer::descriptor::MemoryDescriptor;
use crate::transfer::engine::Engine;
use crate::transfer::pending::{Finisher, Settled};
use crate::transfer::request::{Broken, Notification, TransferReport};
use crate::transfer::shared::{EpInner, Wakes};
use std::collections::{HashMap, VecDeque};
use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The longest a waiting worker sleeps before it looks at deadlines and failures again.
const SLICE: Duration = Duration::from_millis(5);

/// The live connection: the socket notifications are written to, the file descriptors (VMM,
/// pool) the peer sent when the endpoints met and its pid as the kernel gives it, the reader.
pub(super) struct Conn {
    pub(super) stream: UnixStream,
    peer_fds: PeerFds,
    reader: Option<JoinHandle<()>>,
}

/// Tests: what the worker runs under the queue's lock right before it sleeps.
#[cfg(test)]
pub(super) type SleepHook = Box<dyn FnMut(&mut Queue) + Send>;

/// See `Side::between_fail`.
#[cfg(test)]
pub(super) type FailHook = Box<dyn FnMut(&Side) + Send>;

/// A request whose copies are queued, waiting for its events.
pub(super) struct Job {
    /// Shared so that it can be asked outside the queue's lock.
    pub(super) fence: Arc<Events>,
    pub(super) keep: Keep,
    /// Sets the result; the [`Settled`] returned wakes the waiters when dropped.
    pub(super) finish: Box<dyn FnOnce(Result<TransferReport>) -> Settled + Send>,
    pub(super) report: TransferReport,
    pub(super) started: Instant,
    pub(super) deadline: Instant,
    pub(super) timeout: Duration,
    pub(super) epoch: u64,
    /// Its place in the endpoint's request order (set by [`Queue::push`]).
    pub(super) seq: u64,
}

/// The requests queued on an endpoint: each lane's in the order they were made.
pub(super) struct Queue {
    lanes: Vec<VecDeque<Job>>,
    /// The order numbers of the queued requests with a notification, in request order: only
    /// the first may finish (notifications leave in request order).
    notified: VecDeque<u64>,
    next: u64,
    pub(super) closing: bool,
    /// The worker sleeps on the queue's condition variable (new work must wake it).
    pub(super) idle: bool,
}

/// What the finishers look at of a lane's first request.
pub(super) struct Head {
    lane: usize,
    seq: u64,
    fence: Arc<Events>,
    epoch: u64,
    deadline: Instant,
    notified: bool,
}

impl Queue {
    fn new(lanes: usize) -> Queue {
        Queue {
            lanes: (0..lanes).map(|_| VecDeque::new()).collect(),
            notified: VecDeque::new(),
            next: 0,
            closing: false,
            idle: false,
        }
    }

    /// The next number in request order; with a notification, also its place in the
    /// notifications' order.
    fn number(&mut self, notified: bool) -> u64 {
        let seq = self.next;
        self.next += 1;
        if notified {
            self.notified.push_back(seq);
        }
        seq
    }

    /// Queue `job` last on `lane`, numbered in request order.
    pub(super) fn push(&mut self, lane: usize, mut job: Job) {
        job.seq = self.number(job.report.notified.is_some());
        self.lanes[lane].push_back(job);
    }

    /// Whether no request is queued on any lane.
    pub(super) fn is_empty(&self) -> bool {
        self.lanes.iter().all(VecDeque::is_empty)
    }

    /// Whether no request is queued on `lane`.
    pub(super) fn lane_empty(&self, lane: usize) -> bool {
        self.lanes[lane].is_empty()
    }

    /// Whether a request with a notification is queued.
    pub(super) fn any_notified(&self) -> bool {
        !self.notified.is_empty()
    }

    fn jobs(&self) -> impl Iterator<Item = &Job> {
        self.lanes.iter().flatten()
    }

    /// The first request of `lane`, as the finishers look at it.
    fn head(&self, lane: usize) -> Option<Head> {
        self.lanes[lane].front().map(|j| Head {
            lane,
            seq: j.seq,
            fence: j.fence.clone(),
            epoch: j.epoch,
            deadline: j.deadline,
            notified: j.report.notified.is_some(),
        })
    }

    /// Every lane's first request, in request order.
    fn heads(&self) -> Vec<Head> {
        let mut v: Vec<Head> = (0..self.lanes.len()).filter_map(|i| self.head(i)).collect();
        v.sort_unstable_by_key(|h| h.seq);
        v
    }

    /// The lanes' first requests that [`may_finish`](Self::may_finish), in request order.
    fn finishable(&self) -> Vec<Head> {
        let mut v = self.heads();
        v.retain(|h| self.may_finish(h));
        v
    }

    /// Whether `h` may finish before the requests still queued: one without a notification may
    /// (its lane's earlier requests finished before it, and their copies ran before its own on
    /// the lane's streams); one with a notification only once every request made before it, on
    /// any lane, has finished (and no earlier notification is reserved), so that its
    /// notification tells the peer every earlier request's bytes are there too.
    fn may_finish(&self, h: &Head) -> bool {
        !h.notified
            || (self.notified.front() == Some(&h.seq)
                && self
                    .lanes
                    .iter()
                    .filter_map(VecDeque::front)
                    .all(|j| j.seq >= h.seq))
    }

    /// A place in the request order for a notification sent without a queued request (a
    /// prepared run's): requests with a notification made later wait until it is released.
    pub(super) fn reserve(&mut self) -> u64 {
        self.number(true)
    }

    /// Give a reserved place back (its notification sent, or not to be sent).
    pub(super) fn release(&mut self, seq: u64) {
        self.notified.retain(|&s| s != seq);
    }

    /// The earliest deadline of the lanes' first requests that may finish (none queued:
    /// `None`; none of them may finish, held behind a reserved place: at most [`SLICE`] away).
    /// A held request's deadline is not the worker's to wait for: it cannot end it, and the
    /// late scan ends its endpoint (once its copies are done, a timeout later).
    fn first_deadline(&self) -> Option<Instant> {
        if self.is_empty() {
            return None;
        }
        let now = Instant::now();
        Some(
            self.finishable()
                .iter()
                .map(|h| h.deadline)
                .min()
                .unwrap_or_else(|| deadline_after(now, SLICE)),
        )
    }

    /// Take `lane`'s first request, which must be number `seq`.
    fn pop(&mut self, lane: usize, seq: u64) -> Job {
        let job = self.lanes[lane].pop_front().expect("the head stays");
        assert_eq!(job.seq, seq, "only a holder of `finishing` takes a head");
        if job.report.notified.is_some() {
            let first = self.notified.pop_front();
            debug_assert_eq!(first, Some(seq));
        }
        job
    }
}

/// Numbers the sides of the process, for the threads' lane cache.
static NEXT_SIDE: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's lane on each side it submitted on that is still alive: (the side's
    /// number, the side, the lane).
    static LANES: std::cell::RefCell<Vec<(u64, Weak<Side>, usize)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// An issue lane of an endpoint ([`EngineConfig::copy_lanes`]): the streams its threads'
/// copies are queued on and the lock they are queued under; the finisher its requests' waits
/// call on.
///
/// [`EngineConfig::copy_lanes`]: crate::transfer::EngineConfig::copy_lanes
pub(crate) struct Lane {
    pub(super) index: usize,
    side: Weak<Side>,
    /// Held while a request's copies are queued on the lane's streams and the request pushed;
    /// holds the requests whose copies wait for a gather launch.
    pub(super) issue: Mutex<Gather>,
    /// Whether requests wait in `issue` (a hint, set and cleared under it): lookers take the lock
    /// only then.
    pub(super) gathering: AtomicBool,
    /// Piece streams per local GPU.
    streams: Mutex<HashMap<usize, Arc<[Stream]>>>,
    copy_streams: usize,
    /// When a waiting caller last looked at the lane's first request (nanoseconds since the
    /// side was made; 0: never): the worker leaves the looking to it meanwhile.
    helped_at: AtomicU64,
}

impl Lane {
    /// The copy streams of GPU `ordinal` (made on first use).
    pub(super) fn streams_of(&self, ordinal: usize) -> Result<Arc<[Stream]>> {
        let mut m = lock(&self.streams);
        if let Some(v) = m.get(&ordinal) {
            return Ok(v.clone());
        }
        let ctx = crate::cuda::context(ordinal)?;
        // Private (see `queue_on`): their fences' waits and event records ask no capture questions.
        let v: Arc<[Stream]> = (0..self.copy_streams)
            .map(|_| Stream::private(&ctx))
            .collect::<Result<Vec<_>>>()?
            .into();
        // Made after a reconnect: ordered after the copies of requests ended unfinished by it,
        // as every stream that existed then is ([`Side::order_lanes`]; under this lane's
        // streams lock, which that holds while it records the barrier).
        if let Some(side) = self.side.upgrade()
            && let Some((_, ev)) = &*lock(&side.barrier)
        {
            for s in v.iter() {
                s.wait(ev)?;
            }
        }
        m.insert(ordinal, v.clone());
        Ok(v)
    }

    /// Let the requests waiting for a gather launch go, unless another thread holds the issue
    /// lock (it is queueing on the lane: a later look lets them go).
    pub(super) fn let_gathered_go(&self) {
        if !self.gathering.load(Ordering::Acquire) {
            return;
        }
        let mut g = match self.issue.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        g.flush();
        self.gathering.store(false, Ordering::Release);
    }

    /// This lane as the finisher of a request's waits.
    pub(super) fn finisher(self: &Arc<Self>) -> Weak<dyn Finisher> {
        let me: Weak<Lane> = Arc::downgrade(self);
        me
    }
}

/// The intra-node side of an endpoint.
pub(crate) struct Side {
    engine: Engine,
    /// The socket path and what to publish, for the dialing side (reconnect).
    dialed: Option<(PathBuf, Vec<MemoryDescriptor>)>,
    pub(super) conn: Mutex<Option<Conn>>,
    /// Bumped by every failure and close: requests of an older epoch are ended. Shared with the
    /// lanes' gathers (a request of an older epoch waiting there never goes).
    pub(super) epoch: Arc<AtomicU64>,
    /// Bumped when this side shuts its own socket: the reader of an older one ends quietly.
    generation: AtomicU64,
    closed: AtomicBool,
    pub(super) queue: Mutex<Queue>,
    pub(super) queue_cv: Condvar,
    /// Set by whoever asks the worker to look ([`call_worker`](Side::call_worker)); taken by the
    /// worker when it lingers or before it sleeps.
    called: AtomicBool,
    /// Tests: run by the worker under the queue's lock right before it sleeps.
    #[cfg(test)]
    pub(super) before_sleep: Mutex<Option<SleepHook>>,
    /// Tests: run by [`fail_later`](Side::fail_later) between marking the failure and moving
    /// the epoch, under the endpoint's lock.
    #[cfg(test)]
    pub(super) between_fail: Mutex<Option<FailHook>>,
    /// The issue lanes.
    lanes: Box<[Arc<Lane>]>,
    /// The last reconnect's join of every lane's streams (an event complete once the copies of
    /// the requests it ended unfinished are), with its context: a stream made later waits on
    /// it before its first copy. Let go once seen complete ([`Side::barrier_done`]).
    barrier: Mutex<Option<(Arc<CudaContext>, CudaEvent)>>,
    /// The peer allocations this endpoint has used, held until it goes.
    pub(super) held: Mutex<Vec<Arc<Import>>>,
    ep: Mutex<Weak<EpInner<State>>>,
    pub(super) worker: Mutex<Option<JoinHandle<()>>>,
    /// Held while a request is finished: one at a time (each lane's in order, notifications
    /// in request order); and by a prepared run with a notification while it reserves its
    /// place and while it sends it.
    pub(super) finishing: Mutex<()>,
    /// Held for a whole reconnect.
    reconnecting: Mutex<()>,
    /// Itself, for prepared requests.
    pub(super) me: Weak<Side>,
    born: Instant,
    /// This side's number in the process (the threads' lanes).
    number: u64,
    /// The next lane given to a thread that first submits here (modulo the lanes).
    next_lane: AtomicUsize,
    /// Copy graphs for stream-ordered requests, one set per caller's stream (by its handle,
    /// with its context), the most recently used last.
    stream_graphs: Mutex<Vec<(usize, Arc<CopyGraphs>, Instant)>>,
}

/// The callers' streams whose copy graphs a side keeps; the least recently used go beyond,
/// once unused for [`STREAM_GRAPHS_IDLE`].
const STREAM_GRAPHS: usize = 16;

/// How long a stream's copy graphs stay kept unused, when other streams want room: a program
/// that turns over more streams than are kept would otherwise make every request's graphs anew
/// (tens of microseconds), where copy calls cost a few.
const STREAM_GRAPHS_IDLE: Duration = Duration::from_secs(1);

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A worker waiting for the head request yields this many times, looking, before it sleeps.
const WORKER_SPINS: u32 = 64;

/// The worker's sleeps between looks grow from ten microseconds to this. (A host function after
/// the copies could wake it, but it would hold back the next request's copies on the stream
/// until CUDA's callback thread ran it: see docs/transfer.md.) A caller that waits blocking looks
/// itself.
const WORKER_NAP: Duration = Duration::from_micros(100);

/// How often an idle worker looks at the queue anyway (requests that did not wake it).
pub(super) const IDLE_LOOK: Duration = Duration::from_millis(100);

/// How long a worker whose queue ran empty stays awake for a call (yielding) before it sleeps
/// on the queue's condition variable: a program that awaits one request after another calls
/// it again within microseconds, and a sleeping worker's wake-up would add a thread hand-off
/// to every request (see docs/transfer.md). It makes no CUDA call meanwhile.
const WORKER_LINGER: Duration = Duration::from_micros(100);

/// Ask `done` until it answers `true` (then `true`) or `timeout` has passed (then `false`): a
/// few yields, then sleeps growing to [`WORKER_NAP`].
fn look_until(mut done: impl FnMut() -> bool, timeout: Duration) -> bool {
    let end = deadline_after(Instant::now(), timeout);
    for _ in 0..WORKER_SPINS {
        if done() {
            return true;
        }
        std::thread::yield_now();
    }
    let mut nap = Duration::from_micros(10);
    loop {
        if done() {
            return true;
        }
        let now = Instant::now();
        if now >= end {
            return false;
        }
        std::thread::sleep(nap.min(end - now));
        nap = (nap * 2).min(WORKER_NAP);
    }
}

impl Side {
    pub(super) fn new(
        engine: Engine,
        stream: UnixStream,
        peer_fds: PeerFds,
        dialed: Option<(PathBuf, Vec<MemoryDescriptor>)>,
    ) -> Arc<Side> {
        let lanes = engine.inner.config.copy_lanes.max(1);
        let copy_streams = engine.inner.config.copy_streams;
        let epoch = Arc::new(AtomicU64::new(1));
        Arc::new_cyclic(|me: &Weak<Side>| Side {
            me: me.clone(),
            lanes: (0..lanes)
                .map(|index| {
                    Arc::new(Lane {
                        index,
                        side: me.clone(),
                        issue: Mutex::new(Gather::new(epoch.clone())),
                        gathering: AtomicBool::new(false),
                        streams: Mutex::new(HashMap::new()),
                        copy_streams,
                        helped_at: AtomicU64::new(0),
                    })
                })
                .collect(),
            born: Instant::now(),
            number: NEXT_SIDE.fetch_add(1, Ordering::Relaxed),
            next_lane: AtomicUsize::new(0),
            stream_graphs: Mutex::new(Vec::new()),
            engine,
            dialed,
            conn: Mutex::new(Some(Conn {
                stream,
                peer_fds,
                reader: None,
            })),
            epoch,
            generation: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            queue: Mutex::new(Queue::new(lanes)),
            queue_cv: Condvar::new(),
            called: AtomicBool::new(false),
            #[cfg(test)]
            before_sleep: Mutex::new(None),
            #[cfg(test)]
            between_fail: Mutex::new(None),
            barrier: Mutex::new(None),
            held: Mutex::new(Vec::new()),
            ep: Mutex::new(Weak::new()),
            worker: Mutex::new(None),
            finishing: Mutex::new(()),
            reconnecting: Mutex::new(()),
        })
    }

    fn ep(&self) -> Option<Arc<EpInner<State>>> {
        lock(&self.ep).upgrade()
    }

    /// The copy graphs for a stream-ordered request of `pieces` on `stream`, made on its
    /// first use; `None` without the engine's copy graphs, for more pieces than a graph takes,
    /// or where the driver has no graph calls or refused one. A set of the stream's own:
    /// launches of one executable graph are ordered behind each other whatever their streams,
    /// so a set shared by two streams would make one wait for the other's work. `None` too for
    /// a stream not kept while all that are were used within [`STREAM_GRAPHS_IDLE`]. `now`: the
    /// request's start, as the caller read the clock.
    pub(super) fn stream_graphs(
        &self,
        stream: &Stream,
        pieces: usize,
        now: Instant,
    ) -> Option<Arc<CopyGraphs>> {
        if !self.engine.inner.config.copy_graphs || pieces > GATHER_PIECES {
            return None;
        }
        let key = stream.cu_stream() as usize;
        let ctx = stream.context();
        let mut g = lock(&self.stream_graphs);
        let found = g
            .iter()
            .position(|(k, c, _)| *k == key && c.context().cu_ctx() == ctx.cu_ctx());
        let graphs = match found {
            Some(i) => {
                // The most recent last (moved only when it was not already).
                if i + 1 != g.len() {
                    let e = g.remove(i);
                    g.push(e);
                }
                let e = g.last_mut().expect("found");
                e.2 = e.2.max(now);
                e.1.clone()
            }
            None => {
                if g.len() >= STREAM_GRAPHS {
                    if now.duration_since(g[0].2) < STREAM_GRAPHS_IDLE {
                        // Every kept stream is in use: this one copies with calls.
                        return None;
                    }
                    // Dropped here: a launch in flight completes first (the driver frees
                    // an executable graph once it has).
                    g.remove(0);
                }
                let c = CopyGraphs::new(ctx, GATHER_PIECES)?;
                g.push((key, c.clone(), now));
                c
            }
        };
        (!graphs.refused()).then_some(graphs)
    }

    /// End the endpoint with `cause`: requests in flight are ended by the worker (what their
    /// copies reach parked until the copies are done).
    fn fail(&self, cause: Broken) {
        drop(self.fail_later(cause));
    }

    /// [`fail`](Self::fail), the wake-ups it decides returned, to be dropped once the caller
    /// let its own locks go.
    ///
    /// The epoch moves under the endpoint's lock that marks the failure: whoever reads the
    /// failure reads the moved epoch, and a reconnect's fresh state (made under that lock
    /// too) comes wholly before or after both. A request that reads the moved epoch
    /// ([`super::request`]'s `prepare`, then the endpoint's failure) sees the failure and is
    /// refused. With the epoch moved first, one that read it in between passed every check
    /// with the old connection's mappings and, once a reconnect had started the new one,
    /// could notify the new peer of bytes that went to the old peer's memory; with the
    /// failure marked first and the epoch moved after the lock, a waiter woken by the failure
    /// could reconnect in between, and the late move then ended the new connection's requests
    /// (both found by red-team reads).
    pub(super) fn fail_later(&self, cause: Broken) -> Option<Wakes> {
        let bump = || {
            #[cfg(test)]
            if let Some(h) = lock(&self.between_fail).as_mut() {
                h(self);
            }
            self.epoch.fetch_add(1, Ordering::AcqRel);
        };
        let wakes = match self.ep() {
            Some(ep) => Some(fail_later(&ep, cause, bump)),
            None => {
                bump();
                None
            }
        };
        self.call_worker();
        wakes
    }

    /// Start the reader of the current connection.
    fn spawn_reader(self: &Arc<Self>) -> Result<()> {
        let mut c = lock(&self.conn);
        let Some(conn) = c.as_mut() else {
            return Ok(());
        };
        let mut rd = conn
            .stream
            .try_clone()
            .map_err(|e| os("dup (the local endpoint's Unix socket)", e))?;
        let side = self.clone();
        let generation = self.generation.load(Ordering::Acquire);
        let t = crate::driver::ctx::spawn_thread("gpudirect-local-rx", move || {
            // Streams wait on the notification counter it counts into: it frees nothing.
            crate::completion::elsewhere::frees_nothing();
            side.read_loop(&mut rd, generation)
        })?;
        conn.reader = Some(t);
        Ok(())
    }

    /// Deliver the peer's notifications in order until the socket closes.
    fn read_loop(&self, rd: &mut UnixStream, generation: u64) {
        let mut f = [0u8; FRAME];
        loop {
            let r = rd.read_exact(&mut f);
            if self.generation.load(Ordering::Acquire) != generation {
                return; // this side shut the socket (close, reconnect)
            }
            match r {
                Ok(()) if f[0] == NOTE => {
                    let tag = u32::from_le_bytes(f[1..5].try_into().expect("4 bytes"));
                    match self.ep() {
                        Some(ep) => deliver(&ep, Notification { tag }),
                        None => return,
                    }
                }
                Ok(()) => {
                    self.fail(Broken::Protocol(format!(
                        "a message of kind {} on the local endpoint's socket (only \
                         notifications, kind 1, are sent)",
                        f[0]
                    )));
                    return;
                }
                Err(e) => {
                    let errno = e.raw_os_error().unwrap_or(libc::ECONNRESET);
                    self.fail(Broken::Os(
                        "recv on the local endpoint's Unix socket (the peer closed it, or its \
                         process ended)",
                        errno,
                    ));
                    return;
                }
            }
        }
    }

    /// Shut this side's socket and join its reader.
    fn hang_up(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        let old = lock(&self.conn).take();
        if let Some(mut c) = old {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
            if let Some(t) = c.reader.take() {
                join_unless_current(t);
            }
        }
    }

    /// The peer's pid as the kernel gives it (`SO_PEERCRED`, never what the peer says), whether
    /// that is this process, and the file descriptor (VMM, pool) it sent for each of `ids` (all
    /// of one connection).
    pub(super) fn peer(&self, ids: &[Option<u64>]) -> Option<(u32, bool, Vec<Option<PeerFd>>)> {
        let c = lock(&self.conn);
        let c = c.as_ref()?;
        let fds = ids
            .iter()
            .map(|id| id.and_then(|id| c.peer_fds.by_id.get(&id).cloned()))
            .collect();
        Some((c.peer_fds.pid, c.peer_fds.this_process, fds))
    }

    /// The error of a request whose endpoint failed, closed or reconnected under it: the
    /// endpoint's failure, or that it closed.
    pub(super) fn ended(&self) -> Error {
        self.ep()
            .and_then(|ep| ep.failure())
            .unwrap_or_else(|| Broken::Closed.to_error())
    }

    /// Send a notification (after its request's copies are done) for a request of `epoch`:
    /// refused when the endpoint failed or reconnected since (the socket may reach another
    /// peer). The epoch is looked at with the connection held: a reconnect moves it on before it
    /// puts in its new connection.
    pub(super) fn notify(&self, tag: u32, epoch: u64) -> Result<()> {
        let mut f = [0u8; FRAME];
        f[0] = NOTE;
        f[1..].copy_from_slice(&tag.to_le_bytes());
        let mut c = lock(&self.conn);
        if self.epoch.load(Ordering::Acquire) != epoch {
            drop(c);
            return Err(self.ended());
        }
        let Some(conn) = c.as_mut() else {
            return Err(Broken::Closed.to_error());
        };
        send_all(&conn.stream, &f).map_err(|e| os("send on the local endpoint's Unix socket", e))
    }

    /// The issue lanes.
    pub(super) fn lanes(&self) -> &[Arc<Lane>] {
        &self.lanes
    }

    /// The lane this thread issues on: given when it first submits on this endpoint (the lanes
    /// in turn), the same one every time after, so one thread's requests are in order.
    /// (A thread whose thread-locals are gone, in their destructors, issues on lane 0.)
    pub(super) fn lane_here(&self) -> &Arc<Lane> {
        let lane = LANES
            .try_with(|l| {
                let Ok(mut l) = l.try_borrow_mut() else {
                    return 0;
                };
                if let Some(&(_, _, lane)) = l.iter().find(|(n, ..)| *n == self.number) {
                    return lane;
                }
                // The sides this thread used that are gone leave the list first.
                l.retain(|(_, side, _)| side.strong_count() > 0);
                let lane = self.next_lane.fetch_add(1, Ordering::Relaxed) % self.lanes.len();
                l.push((self.number, self.me.clone(), lane));
                lane
            })
            .unwrap_or(0);
        &self.lanes[lane]
    }

    /// Order every lane's streams after everything queued so far on every other lane's (an
    /// event recorded on each, waited on by the others: nothing blocks on the host). Each
    /// lane's issue lock is held meanwhile, so a request issued on it is either queued before
    /// its event or refused (the endpoint's epoch moved: [`super::request`] asks again under
    /// the lock).
    ///
    /// Every stream is joined, its own lane's too: a lane's order comes from finishing its
    /// requests in turn, which the ended requests no longer take part in, and a lane has
    /// several streams (`copy_streams`, one set per GPU). One stream waits on an event of every
    /// other, records the join, and every other stream waits on that (a number of driver calls
    /// linear in the streams). The join is kept: a stream made later (a lane's first request
    /// after this, or its first on another GPU) waits on it when it is made
    /// ([`Lane::streams_of`]); every lane's streams lock is held meanwhile, so a stream is made
    /// either before (and waits here) or after (and waits there).
    fn order_lanes(&self) -> Result<()> {
        let mut issuing: Vec<_> = self.lanes.iter().map(|l| lock(&l.issue)).collect();
        // Requests waiting for a gather launch go first: the join covers them.
        for (g, l) in issuing.iter_mut().zip(self.lanes.iter()) {
            g.flush();
            l.gathering.store(false, Ordering::Release);
        }
        let maps: Vec<_> = self.lanes.iter().map(|l| lock(&l.streams)).collect();
        let streams: Vec<Stream> = maps
            .iter()
            .flat_map(|m| m.values().flat_map(|v| v.iter().cloned()))
            .collect();
        let Some((join, others)) = streams.split_first() else {
            return Ok(());
        };
        for s in others {
            join.wait(&s.record_event()?)?;
        }
        let joined = join.record_event()?;
        for s in others {
            s.wait(&joined)?;
        }
        *lock(&self.barrier) = Some((join.context().clone(), joined));
        Ok(())
    }

    /// Whether the copies the last reconnect ended unfinished are done (`true` when there was
    /// none); once they are, the join is let go.
    pub(super) fn barrier_done(&self) -> Result<bool> {
        let mut b = lock(&self.barrier);
        let Some((ctx, ev)) = &*b else {
            return Ok(true);
        };
        crate::driver::ctx::bind(ctx)?;
        let done = ev
            .try_is_complete()
            .map_err(|e| crate::error::from_driver("cuEventQuery", e))?;
        if done {
            *b = None;
        }
        Ok(done)
    }

    /// Look (as the worker does) until the last reconnect's join is complete ([`barrier_done`](
    /// Self::barrier_done)), up to `deadline`: [`Error::Timeout`] after `timeout` past it.
    pub(super) fn await_barrier(&self, deadline: Instant, timeout: Duration) -> Result<()> {
        // Passed already (the usual case): no clock read, no wait.
        if self.barrier_done()? {
            return Ok(());
        }
        let mut failed = None;
        let done = look_until(
            || {
                self.barrier_done().unwrap_or_else(|e| {
                    failed = Some(e);
                    true
                })
            },
            deadline.saturating_duration_since(Instant::now()),
        );
        match (failed, done) {
            (Some(e), _) => Err(e),
            (None, true) => Ok(()),
            (None, false) => Err(Error::Timeout {
                what: "the copies of requests a reconnect ended unfinished",
                after: timeout,
            }),
        }
    }

    /// Nanoseconds since this side was made (at least 1).
    fn now_ns(&self) -> u64 {
        (self.born.elapsed().as_nanos() as u64).max(1)
    }

    /// Wait for each lane's requests' events in order; finish them and send their
    /// notifications.
    fn work_loop(&self) {
        loop {
            while self.finish_next(None, true) {}
            let deadline = {
                let mut q = lock(&self.queue);
                let mut lingered = false;
                loop {
                    if let Some(d) = q.first_deadline() {
                        // Every call so far is about a request queued now, looked at next.
                        self.called.store(false, Ordering::Relaxed);
                        break d;
                    }
                    if q.closing {
                        return;
                    }
                    // Awake a while first, for the next call; requests queued meanwhile without
                    // one are left to their waiting callers (as when the worker sleeps).
                    if !lingered {
                        drop(q);
                        // With nothing queued, requests still waiting for a gather launch have
                        // ended (a request is queued before it waits there): let go of them now
                        // (nothing is launched for them), not at the lane's next request.
                        for l in self.lanes.iter() {
                            l.let_gathered_go();
                        }
                        let called = self.linger();
                        q = lock(&self.queue);
                        if called {
                            // Perhaps about a request finished meanwhile: with the queue still
                            // empty, the worker lingers again (a call needs a transfer someone
                            // holds unfinished, so this ends).
                            continue;
                        }
                        lingered = true;
                    }
                    // A call since: look again (taken under the lock, so that one made after
                    // this finds the worker asleep and wakes it).
                    if self.called.swap(false, Ordering::AcqRel) {
                        continue;
                    }
                    #[cfg(test)]
                    if let Some(h) = lock(&self.before_sleep).as_mut() {
                        h(&mut q);
                    }
                    q.idle = true;
                    // Timed: a request nobody waits for does not wake the worker, and its
                    // deadline must still end the endpoint when its copies hang.
                    q = self
                        .queue_cv
                        .wait_timeout(q, IDLE_LOOK)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                    q.idle = false;
                }
            };
            // Until a lane's first request can be finished: its copies done, a failure, its
            // deadline; looking at least every SLICE.
            let left = deadline.saturating_duration_since(Instant::now());
            look_until(|| self.any_ready(), left.min(SLICE));
            // A request queued behind a lane's first (or held behind a reserved place) whose
            // deadline passed first ends the endpoint too (its copies run after the first's),
            // once: a request of an earlier epoch has ended it already.
            // One whose copies are done is not late yet: it finishes in its turn (found by a
            // red-team read: a request seen done by the look above, its deadline passed while
            // the worker looked, failed the endpoint). But only for one more timeout: held that
            // long behind an unfinished request, it would outlast its waiter's bound (which
            // then reports a failure) and be finished, its notification sent, after.
            let now = Instant::now();
            let epoch = self.epoch.load(Ordering::Acquire);
            let late: Vec<(Arc<Events>, Duration, bool)> = lock(&self.queue)
                .jobs()
                .filter(|j| j.epoch == epoch && now >= j.deadline)
                .map(|j| {
                    let held_too_long = now >= deadline_after(j.deadline, j.timeout);
                    (j.fence.clone(), j.timeout, held_too_long)
                })
                .collect();
            // Asked outside the lock (a driver query). A refused one ends the endpoint itself.
            let late = late.iter().find(|(f, _, too_long)| {
                *too_long || f.refused().is_none() && !matches!(f.check(), Ok(true))
            });
            if let Some((_, t, _)) = late {
                self.fail(Broken::Deadline(*t));
            }
        }
    }

    /// Ask the worker to look (a transfer looked at or dropped unfinished, a failure, a close):
    /// a lingering worker sees the call at once, a sleeping one is woken.
    pub(super) fn call_worker(&self) {
        // Before the lock: a worker that takes the call under it does not sleep. `idle` read
        // under it: a worker between taking `called` and sleeping holds it, so this finds it
        // asleep (a notification without the lock was lost there, found by a red-team read:
        // a failure or a close left to the 100 ms idle look).
        self.called.store(true, Ordering::Release);
        let idle = lock(&self.queue).idle;
        if idle {
            self.queue_cv.notify_all();
        }
    }

    /// Stay awake (yielding) until the worker is called (then `true`) or [`WORKER_LINGER`]
    /// passed, taking the call.
    fn linger(&self) -> bool {
        let end = Instant::now() + WORKER_LINGER;
        loop {
            if self.called.swap(false, Ordering::AcqRel) {
                return true;
            }
            if self.closed.load(Ordering::Acquire) || Instant::now() >= end {
                return false;
            }
            std::thread::yield_now();
        }
    }

    /// Whether a waiting caller looked at `lane`'s first request in the last [`WORKER_NAP`].
    fn recently_helped(&self, lane: usize) -> bool {
        let at = self.lanes[lane].helped_at.load(Ordering::Relaxed);
        at != 0 && self.now_ns().saturating_sub(at) < WORKER_NAP.as_nanos() as u64
    }

    /// Whether a lane's first request that no waiting caller looks at can be finished now (or
    /// none is queued).
    fn any_ready(&self) -> bool {
        for l in self.lanes.iter() {
            l.let_gathered_go();
        }
        let heads = {
            let q = lock(&self.queue);
            if q.is_empty() {
                return true;
            }
            q.finishable()
        };
        // Asked outside the lock: requests are queued meanwhile.
        heads
            .iter()
            .filter(|h| !self.recently_helped(h.lane))
            .any(|h| self.end_of(h).is_some())
    }

    /// Fail the endpoint for `e`, a request's of endpoint epoch `epoch`, if that is still the
    /// current connection (one that ended already is not ended again, nor its successor).
    fn fail_current(&self, epoch: u64, e: &Error) -> Option<Wakes> {
        (self.epoch.load(Ordering::Acquire) == epoch)
            .then(|| self.fail_later(Broken::of(e)))
            .flatten()
    }

    /// How `h` ends if it can end now: its copies done, or failed, its endpoint ended, or its
    /// deadline passed (`None`: not yet).
    fn end_of(&self, h: &Head) -> Option<End> {
        if let Some(e) = h.fence.refused() {
            return Some(End::Refused(e));
        }
        match h.fence.check() {
            Err(e) => Some(End::Failed(e)),
            Ok(true) => Some(End::Done),
            Ok(false) if self.epoch.load(Ordering::Acquire) != h.epoch => Some(End::Ended),
            Ok(false) if Instant::now() >= h.deadline => Some(End::Late),
            Ok(false) => None,
        }
    }

    /// Finish a lane's first request (`only`: of that lane) if it can be now: its copies done,
    /// or failed, its endpoint ended, or its deadline passed. Each lane's requests finish in
    /// the order they were made, and those with a notification in request order (so
    /// notifications leave in request order), by the worker or by a caller waiting for its
    /// transfer (`block` false: only when no one else is finishing). Returns whether one was
    /// finished.
    fn finish_next(&self, only: Option<usize>, block: bool) -> bool {
        let _order = if block {
            lock(&self.finishing)
        } else {
            match self.finishing.try_lock() {
                Ok(g) => g,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => return false,
            }
        };
        // One lane's first request, or every lane's (the worker); `Vec::new` allocates nothing.
        let (one, all) = {
            let q = lock(&self.queue);
            match only {
                Some(lane) => (q.head(lane).filter(|h| q.may_finish(h)), Vec::new()),
                None => (None, q.finishable()),
            }
        };
        for h in one.into_iter().chain(all) {
            // Asked outside the queue's lock; only a holder of `finishing` takes a lane's first
            // request, so it is still this one after.
            let Some(end) = self.end_of(&h) else {
                continue;
            };
            let job = lock(&self.queue).pop(h.lane, h.seq);
            drop(h);
            let later = self.conclude(job, end, block);
            // The waiters' wakers run with `finishing` let go: a waker may poll, wait or drop
            // the last clone of the endpoint inline (whose close joins the worker, which may be
            // waiting for `finishing`).
            drop(_order);
            drop(later);
            return true;
        }
        false
    }

    /// Queue `job` on `lane` for the finishers, waking the worker if it sleeps and `eager` (a
    /// notification: someone else sees it finish). Once the endpoint closed (its worker may be
    /// gone, so nobody would end it) the job comes back instead: end it with
    /// [`end_unqueued`](Self::end_unqueued) once the caller's locks are let go.
    pub(super) fn push_job(&self, lane: usize, job: Job, eager: bool) -> Option<Job> {
        let mut q = lock(&self.queue);
        if q.closing {
            return Some(job);
        }
        q.push(lane, job);
        if eager {
            // Under the lock: a worker about to sleep takes the call first.
            self.called.store(true, Ordering::Release);
        }
        let wake = eager && q.idle;
        drop(q);
        if wake {
            self.queue_cv.notify_all();
        }
        None
    }

    /// End at once a request whose copies are queued but which the worker will never see (the
    /// endpoint closed and its worker may be gone): what it reaches is parked behind its
    /// epochs, its transfer ends with the endpoint's error. Call with no lock held.
    pub(super) fn end_unqueued(&self, job: Job) {
        drop(self.conclude(job, End::Ended, false));
    }

    /// End a request taken from the head. `on_worker`: this is the worker thread, which frees
    /// nothing (a `cuMemFree` waits for the whole device, and a stream may wait on a word only
    /// this thread can let through): what the request held is parked, its events done, for the
    /// next reap on a caller's thread. Returns the wake-ups it decided, to be run (dropped) once
    /// `finishing` is let go.
    fn conclude(&self, job: Job, end: End, on_worker: bool) -> Later {
        let Job {
            fence,
            keep,
            finish,
            mut report,
            started,
            timeout,
            epoch,
            ..
        } = job;
        // Its result set, with the wake-ups of the failure it caused (if any).
        let end_with = move |r: Result<TransferReport>, failed: Option<Wakes>| Later {
            _settled: finish(r),
            _failed: failed,
        };
        match end {
            End::Failed(e) => {
                // A sticky error: the copy will never be seen done; what it reaches stays.
                Tracker::global().park(fence, keep);
                let failed = self.fail_current(epoch, &e);
                end_with(Err(e), failed)
            }
            End::Refused(e) => {
                // Its gather launch failed: nothing was queued for it, so what it holds may go.
                if on_worker {
                    Tracker::global().park(fence, keep);
                } else {
                    drop((fence, keep));
                }
                // Its caller was told it was made: a later notification would vouch for bytes
                // that never came, so the connection ends.
                let failed = self.fail_current(epoch, &e);
                end_with(Err(e), failed)
            }
            End::Ended => {
                Tracker::global().park(fence, keep);
                end_with(Err(self.ended()), None)
            }
            End::Late => {
                Tracker::global().park(fence, keep);
                let failed = self.fail_later(Broken::Deadline(timeout));
                let e = Error::Timeout {
                    what: "an intra-node transfer (its copies did not finish in time; the \
                           endpoint was closed)",
                    after: timeout,
                };
                end_with(Err(e), failed)
            }
            End::Done => {
                if on_worker {
                    Tracker::global().park(fence, keep);
                } else {
                    drop(keep);
                }
                if self.epoch.load(Ordering::Acquire) != epoch {
                    // Done, but the endpoint failed or reconnected meanwhile: no notification
                    // on a socket that may reach another peer.
                    return end_with(Err(self.ended()), None);
                }
                if let Some(tag) = report.notified
                    && let Err(e) = self.notify(tag, epoch)
                {
                    let failed = match &e {
                        Error::Os { call, source } => {
                            self.fail_later(Broken::Os(call, source.raw_os_error().unwrap_or(0)))
                        }
                        _ => None,
                    };
                    return end_with(Err(e), failed);
                }
                report.elapsed = started.elapsed();
                end_with(Ok(report), None)
            }
        }
    }
}

/// The wake-ups of a request ended at the head ([`Side::conclude`]): its own, and those of
/// the endpoint's failure it caused. Run when dropped.
struct Later {
    _settled: Settled,
    _failed: Option<Wakes>,
}

/// How a request ends ([`Side::finish_next`]).
enum End {
    Done,
    Failed(Error),
    /// Its gather launch failed: nothing queued.
    Refused(Error),
    Ended,
    Late,
}

impl Finisher for Lane {
    fn help(&self) {
        let Some(side) = self.side.upgrade() else {
            return;
        };
        self.helped_at.store(side.now_ns(), Ordering::Relaxed);
        self.let_gathered_go();
        while side.finish_next(Some(self.index), false) {}
    }

    fn wake(&self) {
        if let Some(side) = self.side.upgrade() {
            side.call_worker();
        }
    }
}

impl Side {
    /// Start serving `ep` (its threads hold it weakly).
    pub(super) fn attach(self: Arc<Self>, ep: &Arc<EpInner<State>>) -> Result<()> {
        *lock(&self.ep) = Arc::downgrade(ep);
        let side = self.clone();
        let t = crate::driver::ctx::spawn_thread("gpudirect-local-copy", move || {
            // Streams wait for the requests it ends (see `conclude`): it frees nothing, nor
            // does code a waker runs here.
            crate::completion::elsewhere::frees_nothing();
            side.work_loop()
        })?;
        *lock(&self.worker) = Some(t);
        self.spawn_reader()
    }

    /// End: the socket shut, the threads joined, requests still queued ended.
    pub(super) fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        // After a reconnect under way (see `reconnect`).
        let _one = lock(&self.reconnecting);
        self.epoch.fetch_add(1, Ordering::AcqRel);
        lock(&self.queue).closing = true;
        self.call_worker();
        self.hang_up();
        if let Some(t) = lock(&self.worker).take() {
            join_unless_current(t);
        }
        // Requests still waiting for a gather launch have ended (the epoch moved, and none is
        // queued since): nothing is queued for them.
        for l in self.lanes.iter() {
            lock(&l.issue).cancel();
            l.gathering.store(false, Ordering::Release);
        }
        park_imports(std::mem::take(&mut *lock(&self.held)));
    }

    /// Dial again (the dialing side), as
    /// [`Endpoint::reconnect`](crate::transfer::Endpoint::reconnect).
    pub(super) fn reconnect(self: Arc<Self>, ep: &EpInner<State>) -> Result<()> {
        let Some((path, publish)) = &self.dialed else {
            return Err(Error::invalid(
                "endpoint",
                "accepted",
                "only the side that connected can reconnect; the listener accepts the new endpoint",
            ));
        };
        // Declared before the lock: the wake-ups the failures decide run once it is let go (a
        // waker may call `reconnect` itself).
        let mut wakes = Vec::with_capacity(2);
        // One reconnect at a time: two would interleave hang-ups, dials and readers. A close
        // takes it too: none begins once the side closed, and a close waits for one under way
        // (which would otherwise start a fresh state, socket and reader on a closed side).
        let _one = lock(&self.reconnecting);
        if self.closed.load(Ordering::Acquire) {
            return Err(self.ended());
        }
        wakes.extend(self.fail_later(Broken::Closed));
        self.hang_up();
        let (stream, hello, peer_fds) = dial(&self.engine, path, publish)?;
        *lock(&self.conn) = Some(Conn {
            stream,
            peer_fds,
            reader: None,
        });
        // The old peer's mappings: each request still running holds its own.
        park_imports(std::mem::take(&mut *lock(&self.held)));
        // Copies of requests that ended unfinished may still be queued on any lane's streams:
        // what the new connection queues goes behind them on every lane, as it would on one
        // stream, so that a notification never leaves before an older copy to the same bytes.
        // Without a reader the endpoint would look healthy and never hear of the peer's close.
        // If either cannot be had, the endpoint ends instead.
        let started = self.order_lanes().and_then(|()| {
            restart(ep, hello.descriptors);
            self.spawn_reader()
        });
        if let Err(e) = started {
            wakes.extend(self.fail_later(Broken::Closed));
            self.hang_up();
            return Err(e);
        }
        Ok(())
    }
}

#[cfg(test)]
impl Job {
    /// An 8-byte write on no stream (done as soon as asked), of endpoint epoch `epoch`, with
    /// notification `notify`; numbered when queued.
    pub(super) fn done_at_once(
        finish: Box<dyn FnOnce(Result<TransferReport>) -> Settled + Send>,
        notify: Option<u32>,
        epoch: u64,
    ) -> Job {
        let opts = crate::transfer::request::TransferOptions {
            notify,
            deadline: None,
        };
        let now = Instant::now();
        Job {
            fence: Arc::new(Events::of(Vec::new())),
            keep: Keep {
                _pairs: Vec::new(),
                _imports: super::copies::Imports::new(),
                _held: None,
            },
            finish,
            report: super::request::report(
                crate::transfer::request::Direction::Write,
                8,
                1,
                Vec::new(),
                &opts,
            ),
            started: now,
            deadline: now + Duration::from_secs(30),
            timeout: Duration::from_secs(30),
            epoch,
            seq: u64::MAX,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::pending::Transfer;
    use proptest::prelude::*;

    /// A queued request on no stream (done as soon as asked), numbered by the queue.
    fn job(notified: bool) -> (Transfer, Job) {
        let (t, finish) = Transfer::pending(Duration::from_secs(30), Default::default());
        (
            t,
            Job::done_at_once(Box::new(finish), notified.then_some(7), 1),
        )
    }

    /// A place reserved for a prepared run's notification holds back a later request with one
    /// until it is released; one without a notification goes on.
    #[test]
    fn a_reserved_place_holds_later_notifications_back() {
        let mut q = Queue::new(2);
        let seq = q.reserve();
        let (t1, plain) = job(false);
        let (t2, noted) = job(true);
        q.push(0, plain);
        q.push(1, noted);
        let heads = q.heads();
        assert_eq!(heads.len(), 2);
        assert!(q.may_finish(&heads[0]), "no notification: not held");
        assert!(!q.may_finish(&heads[1]), "held behind the reserved place");
        let j = q.pop(0, heads[0].seq);
        drop((j.finish)(Ok(j.report.clone())));
        t1.wait().unwrap();
        assert!(!q.may_finish(&q.head(1).unwrap()), "still reserved");
        q.release(seq);
        let h = q.head(1).unwrap();
        assert!(q.may_finish(&h), "released");
        let j = q.pop(1, h.seq);
        drop((j.finish)(Ok(j.report.clone())));
        t2.wait().unwrap();
        assert!(q.is_empty() && !q.any_notified());
    }

    proptest! {
        /// Requests on random lanes, some with a notification, their copies done at random
        /// steps (in order on each lane, as on a lane's streams): taken as the finishers take
        /// them, each lane's come out in the order they were made, those with a notification in
        /// request order, none is held once it may go, and all come out.
        #[test]
        fn lanes_finish_in_order_and_notifications_in_request_order(
            reqs in proptest::collection::vec((0usize..4, any::<bool>(), 0u32..20), 1..40),
        ) {
            let mut q = Queue::new(4);
            let mut done_at = Vec::new();
            let mut last = [0u32; 4];
            let mut transfers = Vec::new();
            for &(lane, notified, at) in &reqs {
                // A lane's copies end in the order they were queued.
                last[lane] = last[lane].max(at);
                done_at.push(last[lane]);
                let (t, j) = job(notified);
                transfers.push(t);
                q.push(lane, j);
            }
            let mut out: Vec<u64> = Vec::new();
            for step in 0..=20u32 {
                loop {
                    let heads = q.heads();
                    let next = heads
                        .iter()
                        .find(|h| q.may_finish(h) && done_at[h.seq as usize] <= step);
                    let Some(h) = next else { break };
                    let (lane, seq) = (h.lane, h.seq);
                    let j = q.pop(lane, seq);
                    prop_assert_eq!(j.seq, seq);
                    out.push(seq);
                    // Its transfer finished (one dropped unfinished waits for its end).
                    drop((j.finish)(Ok(j.report.clone())));
                }
                // Nothing that may go and is done is left behind at this step.
                for h in q.heads() {
                    let done = done_at[h.seq as usize] <= step;
                    prop_assert!(!(done && q.may_finish(&h)), "request {} held", h.seq);
                }
            }
            prop_assert!(q.is_empty(), "every request came out");
            prop_assert_eq!(out.len(), reqs.len());
            for lane in 0..4 {
                let mine: Vec<u64> = out.iter().copied().filter(|&s| reqs[s as usize].0 == lane).collect();
                prop_assert!(mine.windows(2).all(|w| w[0] < w[1]), "lane {} in order: {:?}", lane, mine);
            }
            let notes: Vec<u64> = out.iter().copied().filter(|&s| reqs[s as usize].1).collect();
            prop_assert!(notes.windows(2).all(|w| w[0] < w[1]), "notifications in order: {:?}", notes);
            // A request with a notification comes out after every request made before it.
            for (at, &s) in out.iter().enumerate() {
                if reqs[s as usize].1 {
                    let before = out[..at].iter().filter(|&&o| o < s).count();
                    prop_assert_eq!(before, s as usize, "request {} came out early", s);
                }
            }
            for t in transfers {
                prop_assert!(t.wait().is_ok());
            }
        }
    }
}
