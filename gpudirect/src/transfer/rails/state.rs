//! The verbs side of one endpoint ([`Link`]): its state under the endpoint's lock (rails,
//! requests, deadlines, credits), the requests' accounting, and how the endpoint breaks and its
//! requests finish.

use super::rail::{
    CTL_COUNT, Lane, MAX_RAILS, NOTIFY_RAIL, QpSlot, Rail, RailCounters, SPIN_DEPTH, Wr, ctl_ask,
    note_receives,
};
use super::windows::revoke;
use crate::completion::deferred::{Defers, Locked};
use crate::error::{Error, Result};
use crate::rdma::WorkCompletion;
use crate::transfer::auth::AuthKey;
use crate::transfer::descriptor::{MemoryDescriptor, RemoteRange};
use crate::transfer::engine::EngineInner;
use crate::transfer::pending::ReqShared;
use crate::transfer::plan::Credits;
use crate::transfer::region::{LocalRange, MemoryPath};
use crate::transfer::request::{Broken, Direction, Notification, TransferReport};
use crate::transfer::shared::{EpInner, Mailbox, Wakes};
use crate::transfer::wire::Hello;
use smallvec::SmallVec;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

pub(super) struct Request {
    pub(super) shared: Arc<ReqShared>,
    pub(super) dir: Direction,
    /// Messages in the rails' pending queues or held back.
    pub(super) unposted: usize,
    /// Messages posted whose completion has not been seen.
    pub(super) posted: usize,
    /// Data messages not yet completed, per rail (queued or posted there; not the
    /// notification).
    pub(super) left: RailCounts,
    /// The rail its notification goes on (an up one while it is held).
    pub(super) note_rail: usize,
    /// The notification message, held until every data message on other rails completed.
    pub(super) held: Option<Wr>,
    /// The notification was posted on a rail that failed before its completion: that rail, its
    /// index there, the message; the peer is asked whether it arrived.
    pub(super) asking: Option<(usize, u32, Wr)>,
    /// Data messages of the failed rail of `asking`, parked until the answer: posted again only
    /// if the notification did not arrive (else the peer may already use the bytes).
    pub(super) parked: Vec<Wr>,
    pub(super) notify: Option<u32>,
    pub(super) timeout: Duration,
    pub(super) error: Option<Error>,
    /// Inline up to 8 rails, as [`RailCounts`]; a `Vec` in the report.
    pub(super) rail_bytes: SmallVec<[u64; 8]>,
    pub(super) messages: u64,
    /// Messages posted again on another rail after theirs failed.
    pub(super) reposted: u64,
    pub(super) started: Instant,
    pub(super) paths: SmallVec<[MemoryPath; 1]>,
    /// GPUs whose memory a read wrote: flushed before the read is reported done.
    pub(super) flush: Vec<usize>,
}

impl Request {
    fn finished(&self) -> bool {
        self.unposted == 0
            && self.posted == 0
            && self.held.is_none()
            && self.asking.is_none()
            && self.parked.is_empty()
    }

    /// Data messages not yet completed on rails other than the notification's.
    pub(super) fn elsewhere(&self) -> usize {
        self.left
            .iter()
            .enumerate()
            .filter(|&(r, _)| r != self.note_rail)
            .map(|(_, n)| n)
            .sum()
    }

    /// Whether its notification may go now, as far as the request itself goes: no data left
    /// on other rails, its rail usable (one the peer gave up takes no more), a credit there.
    /// The endpoint's own order comes first (`notes_wait`, earlier notifications queued).
    pub(super) fn note_can_go(&self, lanes: &[Lane]) -> bool {
        let lane = &lanes[self.note_rail];
        self.elsewhere() == 0 && lane.usable() && lane.credits.can_notify()
    }
}

pub(crate) struct State {
    /// This state's own number (a reconnect makes a new state): what a prepared request's
    /// messages were built under ([`Ready`](super::post::Ready)).
    pub(super) id: u64,
    pub(super) rails: Vec<Rail>,
    pub(super) broken: Option<(Broken, Instant)>,
    /// By request id (the endpoint's own counter: a fast hash).
    pub(super) requests: HashMap<u64, Request, foldhash::fast::RandomState>,
    /// Requests whose notification is in doubt (`Request::asking` set): none are sent while
    /// one is, and `pump` reads this instead of looking through every request.
    pub(super) in_doubt: usize,
    pub(super) deadlines: BinaryHeap<std::cmp::Reverse<(Instant, u64)>>,
    pub(super) notify_q: VecDeque<u64>,
    /// Per rail: failed or up, its credits and notification counts.
    pub(super) lanes: Vec<Lane>,
    pub(super) notes: VecDeque<Notification>,
    pub(super) closing: bool,
    pub(super) turn: usize,
    /// The rail notifications go on: rail 0, or the first rail up when it failed (one that
    /// comes back does not take them back: those in flight elsewhere arrive first).
    pub(super) note_rail: usize,
    /// The endpoint's group id (the dialer's, on every rail's greeting).
    pub(super) group: [u8; 16],
    /// With a key: what a rail taken back proves instead of the key (derived from the key and
    /// the first rail's handshake).
    pub(super) session: Option<AuthKey>,
    /// When the progress thread next tries to take failed rails back (the dialing side).
    pub(super) retry_at: Option<Instant>,
    peer_descriptors: Vec<MemoryDescriptor>,
    pub(super) peer_devices: usize,
    pub(super) max_message: u32,
    /// Requests whose messages completed since the last look (then finished if done).
    pub(super) touched: Vec<u64>,
    /// Completions taken from a CQ, handled after (a buffer kept from look to look).
    pub(super) wcs: Vec<WorkCompletion>,
    /// A completion was taken since the CQs were last armed: one may have used up its arming.
    pub(super) unarmed: bool,
    /// The progress thread sleeps for at most `linger` and then looks (it saw a waiter
    /// polling): CQs left unarmed are seen that soon.
    pub(super) lingering: bool,
    /// When a waiter polling the CQs was last seen looking: stamped when it stops, and by the
    /// progress thread when it finds one polling that looked since its last pass (a look
    /// itself reads no clock).
    pub(super) looked: Instant,
    /// Looks by waiters polling the CQs, and as many as the progress thread has seen.
    pub(super) looks: u64,
    pub(super) looks_seen: u64,
    /// How long the progress thread sleeps while waiters poll: [`LINGER`](super::rail::LINGER),
    /// doubled at each pass that finds them still looking, up to
    /// [`LINGER_MAX`](super::rail::LINGER_MAX).
    pub(super) linger: Duration,
    /// What to wake once the lock is let go ([`Locked`]).
    wakes: Wakes,
}

impl Mailbox for State {
    fn broken(&self) -> Option<&(Broken, Instant)> {
        self.broken.as_ref()
    }

    fn notes(&mut self) -> &mut VecDeque<Notification> {
        &mut self.notes
    }

    fn peer_descriptors(&self) -> &[MemoryDescriptor] {
        &self.peer_descriptors
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
pub(super) enum Origin {
    Dialed {
        peers: Vec<SocketAddr>,
        publish: Vec<MemoryDescriptor>,
    },
    Accepted,
}

/// The verbs side of one endpoint: the state its progress thread and requests share (under
/// the endpoint's lock), the eventfd that wakes the thread, the rails' counters, how the
/// endpoint came about, and which waiting thread polls the CQs.
pub(crate) struct Link {
    pub(super) ep: EpInner<State>,
    pub(super) wake: OwnedFd,
    pub(super) counters: Vec<RailCounters>,
    pub(super) origin: Origin,
    pub(super) next_req: AtomicU64,
    /// A waiting thread polls the CQs (then the progress thread neither polls nor arms them).
    /// Taken and let go under the state lock.
    pub(super) polled: AtomicBool,
    /// Threads waiting in a spin (polling the CQs or ready to take them over).
    pub(super) spinners: AtomicUsize,
    /// More than [`SPIN_DEPTH`](super::rail::SPIN_DEPTH) messages are in flight or queued:
    /// waiting threads sleep instead of spinning. Set under the state lock ([`Link::gauge`]).
    pub(super) deep: AtomicBool,
    /// This link, for the requests' finisher.
    pub(super) me: Weak<Link>,
    /// A thread is taking failed rails back (one at a time; a reconnect does not reset it).
    pub(super) restoring: AtomicBool,
    /// The last waiter left the CQs unarmed to the lingering progress thread (nothing else
    /// was waited for then): what starts waiting without polling asks it to look at once
    /// ([`Link::watch`]). Set under the state lock; cleared when the CQs are armed.
    pub(super) left_unarmed: AtomicBool,
    /// Someone asked the progress thread to look ([`Link::watch`]): its next pass polls and
    /// arms the CQs unless a waiter holds the polling.
    pub(super) asked: AtomicBool,
}

impl Link {
    /// The verbs side of a new endpoint in `state` with `rails` rails, came about as `origin`.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] from `eventfd`.
    pub(super) fn new(
        engine: crate::transfer::Engine,
        state: State,
        rails: usize,
        origin: Origin,
    ) -> Result<Arc<Link>> {
        let wake = eventfd()?;
        Ok(Arc::new_cyclic(|me| Link {
            ep: EpInner::new(engine, state),
            wake,
            counters: (0..rails).map(|_| RailCounters::default()).collect(),
            origin,
            next_req: AtomicU64::new(1),
            polled: AtomicBool::new(false),
            spinners: AtomicUsize::new(0),
            deep: AtomicBool::new(false),
            me: me.clone(),
            restoring: AtomicBool::new(false),
            left_unarmed: AtomicBool::new(false),
            asked: AtomicBool::new(false),
        }))
    }

    /// Something now waits without polling (a thread about to sleep, a future, an
    /// `InFlight`, the notification counter): if the last waiter left the CQs unarmed to the
    /// lingering progress thread, ask it to look and arm them now (one eventfd write), rather
    /// than at the end of its linger.
    pub(super) fn watch(&self) {
        if self.left_unarmed.swap(false, Ordering::AcqRel) {
            self.asked.store(true, Ordering::Release);
            self.poke();
        }
    }

    pub(super) fn lock(&self) -> Locked<'_, State> {
        self.ep.lock()
    }

    /// Note whether the rails hold more than [`SPIN_DEPTH`](super::rail::SPIN_DEPTH) messages
    /// (in flight, queued, or held notifications). Under the state lock.
    pub(super) fn gauge(&self, st: &State) {
        let queued: usize = st
            .rails
            .iter()
            .map(|r| r.inflight.len() + r.pending.len())
            .sum();
        self.deep
            .store(queued + st.notify_q.len() > SPIN_DEPTH, Ordering::Relaxed);
    }

    pub(super) fn poke(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes to our eventfd; a full counter (EAGAIN) is fine.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}

pub(super) fn eventfd() -> Result<OwnedFd> {
    // SAFETY: no pointers.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::last_os("eventfd"));
    }
    // SAFETY: a new fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// An endpoint's rails connected: the rails, the peer's first messages (in rail order), the
/// endpoint's group id and, with a key, the secret a rail taken back proves.
pub(super) struct Connected {
    pub(super) rails: Vec<Rail>,
    pub(super) hellos: Vec<Hello>,
    pub(super) group: [u8; 16],
    pub(super) session: Option<AuthKey>,
}

/// The state of a new (or reconnected) endpoint.
pub(super) fn new_state(e: &EngineInner, c: Connected) -> Result<State> {
    let Connected {
        rails,
        hellos,
        group,
        session,
    } = c;
    let hellos = &hellos[..];
    if hellos.len() > MAX_RAILS {
        return Err(Error::invalid(
            "rails",
            hellos.len(),
            format!("an endpoint has at most {MAX_RAILS} rails"),
        ));
    }
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
    static STATES: AtomicU64 = AtomicU64::new(1);
    Ok(State {
        id: STATES.fetch_add(1, Ordering::Relaxed),
        rails,
        broken: None,
        requests: HashMap::default(),
        in_doubt: 0,
        deadlines: BinaryHeap::new(),
        notify_q: VecDeque::new(),
        lanes: hellos
            .iter()
            .map(|h| Lane::new(Credits::new(h.credits as u32, e.config.notify_depth)))
            .collect(),
        notes: VecDeque::new(),
        closing: false,
        turn: 0,
        note_rail: NOTIFY_RAIL,
        group,
        session,
        retry_at: None,
        peer_descriptors: h0.descriptors.clone(),
        peer_devices,
        max_message,
        touched: Vec::new(),
        wcs: Vec::new(),
        unarmed: true,
        lingering: false,
        // Never yet: the progress thread polls and arms from the start.
        looked: long_ago(),
        looks: 0,
        looks_seen: 0,
        linger: super::rail::LINGER,
        wakes: Wakes::default(),
    })
}

/// Every remote descriptor has one rkey per device of the peer.
pub(super) fn check_rkeys(pairs: &[(LocalRange, RemoteRange)], peer_devices: usize) -> Result<()> {
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

/// The peer's windows through `rail` revoked (their rkeys are refused from here on, and none is
/// left bound through a queue pair that goes; what they covered is kept in case the rail comes
/// back), then its queue pair to the error state.
fn retire(inner: &Link, rail: &mut Rail) {
    rail.lost = rail
        .windows
        .iter()
        .filter_map(|w| {
            let first = rail.firsts.get(&w.rkey()).copied().unwrap_or(w.rkey());
            Some((w.range()?.clone(), first))
        })
        .collect();
    revoke(&inner.ep.engine.inner, &mut rail.windows);
    rail.qp = match std::mem::replace(&mut rail.qp, QpSlot::Gone) {
        QpSlot::Rts(q) => match q.into_error() {
            Ok(q) => QpSlot::Error { _qp: q },
            Err(_) => QpSlot::Gone,
        },
        other => other,
    };
}

/// Stop the endpoint: every queue pair to the error state (the NIC flushes what is posted),
/// nothing more posted, every request ends with the cause's error.
pub(super) fn break_endpoint(inner: &Link, st: &mut State, cause: Broken) {
    if st.broken.is_some() {
        return;
    }
    st.broken = Some((cause.clone(), Instant::now()));
    for rail in &mut st.rails {
        retire(inner, rail);
        for (id, _) in rail.pending.drain(..) {
            if let Some(q) = st.requests.get_mut(&id) {
                q.unposted = q.unposted.saturating_sub(1);
            }
        }
    }
    st.notify_q.clear();
    for l in &mut st.lanes {
        l.ctl.clear();
    }
    for q in st.requests.values_mut() {
        if q.held.take().is_some() {
            q.unposted = q.unposted.saturating_sub(1);
        }
        q.asking = None;
        q.parked.clear();
        if q.error.is_none() {
            q.error = Some(cause.to_error());
        }
    }
    st.in_doubt = 0;
    finish_done(st);
    inner.ep.failed(st);
}

/// The rail a notification goes on now: the notification rail while it takes messages, else
/// the first of `up` (the rails up; with none, every rail given up by the peer and none failed
/// yet, the notification rail: the plan finds no rail and refuses the request).
pub(super) fn notify_rail(st: &State, up: &[usize]) -> usize {
    match up.first() {
        Some(&r) if !st.lanes[st.note_rail].usable() => r,
        _ => st.note_rail,
    }
}

/// Whether notifications wait to be sent: one is in doubt (it may be sent again), or one is
/// posted or queued on a rail the peer gave up and not seen completed (it may yet fail, be in
/// doubt and be sent again). Those after it must not arrive before it.
pub(super) fn notes_wait(st: &State) -> bool {
    st.in_doubt > 0
        || st.lanes.iter().zip(&st.rails).any(|(lane, rail)| {
            lane.given_up.is_some()
                && lane.up()
                && (rail.inflight.iter().any(|p| p.note.is_some())
                    || rail.pending.iter().any(|(_, w)| w.is_note()))
        })
}

/// Positions of rails (an endpoint's few on the stack).
pub(super) type RailList = SmallVec<[usize; 8]>;

/// A count per rail (inline up to 8 rails, as [`RailList`]).
pub(super) type RailCounts = SmallVec<[usize; 8]>;

/// Rails up, in order.
pub(super) fn up_rails(st: &State) -> RailList {
    (0..st.lanes.len())
        .filter(|&r| st.lanes[r].usable())
        .collect()
}

/// Rail `r` failed (`cause`): unless it was the last one up (then the endpoint breaks), it
/// leaves posting, its queue pair goes to the error state (the NIC flushes what is posted;
/// that memory stays held until the flushes are seen or `FLUSH_WAIT` ran out), and each of its
/// data messages not seen completed goes to the rails left. A notification posted on it
/// whose completion was not seen is in doubt: the peer is asked how many arrived there.
pub(super) fn fail_rail(inner: &Link, st: &mut State, r: usize, cause: Broken) {
    if st.broken.is_some() || !st.lanes[r].up() {
        return;
    }
    let last = up_rails(st).iter().all(|&x| x == r);
    let told = matches!(cause, Broken::RailGivenUp);
    st.lanes[r].failed = Some((cause.clone(), Instant::now()));
    st.lanes[r].ctl.clear();
    inner.counters[r].failures.fetch_add(1, Ordering::Relaxed);
    if last {
        break_endpoint(inner, st, cause);
        return;
    }
    if let (Origin::Dialed { .. }, Some(t)) =
        (&inner.origin, inner.ep.engine.inner.config.rail_retry)
    {
        st.retry_at.get_or_insert(Instant::now() + t);
    }
    let rail = &mut st.rails[r];
    retire(inner, rail);
    // Posted: the notifications in doubt first, so their requests' data is parked.
    let unsure: Vec<(u64, Wr, Option<u32>)> = rail
        .inflight
        .iter()
        .filter_map(|p| p.wr.clone().map(|w| (p.req, w, p.note)))
        .collect();
    let queued: Vec<(u64, Wr)> = rail.pending.drain(..).collect();
    for (id, wr, note) in &unsure {
        // A request that failed (the peer refused its memory) asks nothing: its notification
        // is not sent again.
        if let (Some(i), Some(q)) = (note, st.requests.get_mut(id))
            && q.error.is_none()
        {
            if q.asking.replace((r, *i, wr.clone())).is_none() {
                st.in_doubt += 1;
            }
            inner.counters[r].in_doubt.fetch_add(1, Ordering::Relaxed);
        }
    }
    for (id, wr, note) in unsure {
        if note.is_none() {
            move_to(inner, st, id, wr, r, true);
        }
    }
    for (id, wr) in queued {
        if wr.is_data() {
            move_to(inner, st, id, wr, r, false);
        }
    }
    // Held notifications of this rail go on another.
    let to = up_rails(st)[0];
    if st.note_rail == r {
        st.note_rail = to;
    }
    let note_rail = st.note_rail;
    let mut ids = Vec::new();
    for (id, q) in st.requests.iter_mut() {
        if q.note_rail == r && q.asking.is_none() {
            q.note_rail = note_rail;
        }
        if q.asking.as_ref().is_some_and(|a| a.0 == r) {
            ids.push(*id);
        }
    }
    // Ask about this rail, unless the peer gave it up first: the peer gives it up at once
    // rather than after its own retries. And again about every rail with a notification in
    // doubt or a question unanswered: a query sent on this rail is lost.
    let mut about: Vec<usize> = st
        .requests
        .values()
        .filter_map(|q| q.asking.as_ref().map(|a| a.0))
        .chain((0..st.lanes.len()).filter(|&x| st.lanes[x].asked))
        .collect();
    if !told {
        about.push(r);
    }
    about.sort_unstable();
    about.dedup();
    for x in about {
        let generation = st.lanes[x].generation;
        st.lanes[x].asked = true;
        st.lanes[to].ctl.push_back(ctl_ask(x, generation));
    }
    st.touched.extend(ids);
}

/// Data message `wr` of request `id`, of failed rail `from`, to a rail up (round robin);
/// `posted`: it was posted there (a new message now). A notification (in `from`'s queue, never
/// posted) is held again.
pub(super) fn move_to(inner: &Link, st: &mut State, id: u64, wr: Wr, from: usize, posted: bool) {
    let up = up_rails(st);
    if up.is_empty() {
        // The endpoint broke: its requests end with its cause.
        return;
    }
    let note_to = notify_rail(st, &up);
    let Some(q) = st.requests.get_mut(&id) else {
        return;
    };
    if q.error.is_some() {
        // A failed request's messages go nowhere: one posted is done once its flush is seen,
        // one queued is dropped here.
        if wr.is_data() && !wr.is_note() {
            q.left[from] = q.left[from].saturating_sub(1);
        }
        if !posted {
            q.unposted = q.unposted.saturating_sub(1);
        }
        return;
    }
    if posted {
        q.unposted += 1;
        q.messages += 1;
    }
    if wr.is_note() {
        // Never posted: its request's other messages on `from` move before it is let go. On
        // the notification rail, behind those sent before it.
        q.held = Some(wr);
        q.note_rail = note_to;
        if let Err(i) = st.notify_q.binary_search(&id) {
            st.notify_q.insert(i, id);
        }
        return;
    }
    if q.asking.as_ref().is_some_and(|a| a.0 == from) {
        q.unposted = q.unposted.saturating_sub(1);
        q.parked.push(wr);
        return;
    }
    let to = up[st.turn % up.len()];
    st.turn = st.turn.wrapping_add(1);
    q.left[from] = q.left[from].saturating_sub(1);
    match wr.on(&st.rails[to]) {
        Some(Ok(w)) => {
            q.left[to] += 1;
            q.reposted += 1;
            st.rails[to].pending.push_back((id, w));
            inner.counters[from]
                .reposted
                .fetch_add(1, Ordering::Relaxed);
        }
        Some(Err(e)) => {
            q.unposted = q.unposted.saturating_sub(1);
            q.error.get_or_insert(e);
        }
        None => q.unposted = q.unposted.saturating_sub(1),
    }
}

/// The peer answered that `n` (modulo [`CTL_COUNT`](super::rail::CTL_COUNT) + 1) notifications
/// arrived on failed rail `r`: those that did count as sent (with their requests' parked
/// data: it arrived before them); the others are held again and their parked data posted
/// again.
pub(super) fn answered(inner: &Link, st: &mut State, r: usize, n: u32) {
    st.lanes[r].asked = false;
    let ids: Vec<u64> = st
        .requests
        .iter()
        .filter(|(_, q)| q.asking.as_ref().is_some_and(|a| a.0 == r))
        .map(|(id, _)| *id)
        .collect();
    for id in ids {
        let q = st.requests.get_mut(&id).expect("present");
        let (_, i, wr) = q.asking.take().expect("asking");
        st.in_doubt = st.in_doubt.saturating_sub(1);
        let arrived = arrived(i, n);
        let parked = std::mem::take(&mut q.parked);
        if arrived {
            q.left[r] = q.left[r].saturating_sub(parked.len());
            let bytes: u64 = parked.iter().map(Wr::bytes).sum::<u64>() + wr.bytes();
            q.rail_bytes[r] += bytes;
            inner.counters[r].notes_sent.fetch_add(1, Ordering::Relaxed);
        } else {
            inner.counters[r].resent.fetch_add(1, Ordering::Relaxed);
            q.unposted += 1 + parked.len();
            for w in parked {
                move_to(inner, st, id, w, r, false);
            }
            move_to(inner, st, id, wr, r, false);
        }
        st.touched.push(id);
    }
}

/// Why no rail of an endpoint can come back: it failed, or closed.
pub(super) const ENDPOINT_FAILED: &str = "the endpoint failed or closed";

/// Why failed rail `r` cannot come back yet, if it cannot: the endpoint failed; the rail is
/// up; the NIC may still hold its posted memory (flushes not all seen, nor `FLUSH_WAIT` past);
/// a notification posted on it is in doubt, or a question about it is unanswered (a count of
/// its old connection must not meet the new one's).
pub(super) fn not_free(st: &State, r: usize) -> Option<&'static str> {
    let Some(lane) = st.lanes.get(r) else {
        return Some(ENDPOINT_FAILED);
    };
    if st.broken.is_some() {
        Some(ENDPOINT_FAILED)
    } else if lane.up() {
        Some("the rail is up")
    } else if !st.rails[r].inflight.is_empty() || !st.rails[r].pending.is_empty() {
        Some("its messages are not all flushed yet")
    } else if lane.asked
        || st
            .requests
            .values()
            .any(|q| q.asking.as_ref().is_some_and(|a| a.0 == r) || q.left[r] > 0)
    {
        Some("a notification posted on it is still in doubt")
    } else {
        None
    }
}

/// Put `rail` (connected and authenticated again, generation `generation`, the peer's credits
/// `credits`) in failed rail `r`'s place: its notification receives posted, then its lane up
/// afresh (credits, notification counts). Returns the old rail, to drop once the lock is let
/// go.
///
/// # Errors
///
/// [`Error::InvalidArgument`] when the rail cannot come back now ([`not_free`]); as
/// [`QueuePair::post_recv`](crate::rdma::QueuePair::post_recv).
pub(super) fn install(
    inner: &Link,
    st: &mut State,
    r: usize,
    mut rail: Rail,
    generation: u32,
    credits: u16,
) -> Result<Rail> {
    if let Some(why) = not_free(st, r) {
        return Err(Error::invalid(
            "rail",
            r,
            format!("cannot come back: {why}"),
        ));
    }
    // Only now: a notification the peer sent on this connection before could not have
    // been received here (the NIC had no receive for it), so a connection dropped before
    // this point received none.
    let n = inner.ep.engine.inner.config.notify_depth;
    if let QpSlot::Rts(qp) = &mut rail.qp {
        qp.post_recv(note_receives(n as usize))?;
    }
    let mut lane = Lane::new(Credits::new(credits as u32, n));
    lane.generation = generation;
    st.lanes[r] = lane;
    inner.counters[r].restored.fetch_add(1, Ordering::Relaxed);
    st.unarmed = true;
    let old = std::mem::replace(&mut st.rails[r], rail);
    inner.gauge(st);
    Ok(old)
}

/// Whether notification `i` (its index on its rail) is among the first `n` received there, `n`
/// counted modulo 2^20: indices within 2^19 below it.
fn arrived(i: u32, n: u32) -> bool {
    n.wrapping_sub(i).wrapping_sub(1) & CTL_COUNT < CTL_COUNT / 2
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
pub(super) fn finish_touched(st: &mut State) {
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
                rail_bytes: q.rail_bytes.into_vec(),
                paths: q.paths.into_vec(),
                elapsed: q.started.elapsed(),
                notified: q.notify,
                reposted: q.reposted,
            })
        }
    };
    st.wakes.finished.push((q.shared, r));
}

/// Make NIC writes to GPU `ordinal`'s memory visible to it.
pub(super) fn flush_gpu(ordinal: usize) -> Result<()> {
    let ctx = crate::cuda::context(ordinal)?;
    crate::rdma::flush_gpudirect_rdma_writes(&ctx, crate::rdma::FlushScope::Owner).map(|_| ())
}

/// After a failure: finish every request, flushed or not (the queue pairs keep what the NIC
/// may still touch).
pub(super) fn force_finish(st: &mut State) {
    st.in_doubt = 0;
    for (_, mut q) in st.requests.drain() {
        q.posted = 0;
        if q.error.is_none() {
            q.error = Some(Broken::Closed.to_error());
        }
        let r = Err(q.error.take().expect("set"));
        st.wakes.finished.push((q.shared, r));
    }
}

/// A time `LINGER` ago: a waiter's last look then leaves the CQs to the progress thread.
pub(super) fn long_ago() -> Instant {
    Instant::now()
        .checked_sub(super::rail::LINGER)
        .unwrap_or_else(Instant::now)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::descriptor::DescribedKind;
    use crate::transfer::{Buffer, Engine, EngineConfig};

    /// The answer about a failed rail: a notification arrived iff its index is below the count
    /// received, the count modulo 2^20 and the indices wrapping.
    #[test]
    fn a_notification_arrived_iff_its_index_is_below_the_count() {
        assert!(arrived(0, 1) && arrived(5, 6) && arrived(0, 6));
        assert!(!arrived(0, 0) && !arrived(6, 6) && !arrived(7, 6));
        // Past 2^20 notifications on the rail (the count is sent modulo 2^20).
        let i = (1 << 20) + 3;
        assert!(arrived(i, 4) && !arrived(i, 3));
        // And past 2^32 (the index wraps).
        assert!(arrived(u32::MAX, 0) && !arrived(u32::MAX, CTL_COUNT));
    }

    /// A control message carries its kind, the rail it names, that rail's generation modulo
    /// 16 and a count modulo 2^20, none spilling into another; never a credit return's shape.
    #[test]
    fn control_messages_keep_rail_generation_and_count_apart() {
        use super::super::rail::{CTL, ctl_answer, ctl_parts};
        for about in [0usize, 1, 15, 63] {
            for generation in [0u32, 1, 15, 16, 17, u32::MAX] {
                let q = ctl_ask(about, generation);
                assert_eq!(ctl_parts(q), (false, about, generation & 0xf, 0));
                for n in [0u32, 1, CTL_COUNT, CTL_COUNT + 2] {
                    let a = ctl_answer(about, generation, n);
                    assert_eq!(ctl_parts(a), (true, about, generation & 0xf, n & CTL_COUNT));
                    assert!(a & CTL != 0 && q & CTL != 0);
                }
            }
        }
    }

    /// The check `post()` and `prepare` share: one rkey per device of the peer, the pair named.
    #[test]
    fn a_remote_descriptor_needs_one_rkey_per_peer_device() {
        let e = Engine::new(EngineConfig::local()).unwrap();
        let r = e.register(Buffer::host(vec![0u8; 4096]).unwrap()).unwrap();
        let two = MemoryDescriptor::new(0x1000, 4096, DescribedKind::Host, &[1, 2]).unwrap();
        let one = MemoryDescriptor::new(0x1000, 4096, DescribedKind::Host, &[1]).unwrap();
        let pairs = vec![(r.all(), two.all()), (r.all(), one.all())];
        assert!(check_rkeys(&pairs[..1], 2).is_ok());
        let e = check_rkeys(&pairs, 2).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument { arg: "pairs", value, .. } if value == "1"),
            "{e}"
        );
        assert!(check_rkeys(&pairs[..1], 1).is_err());
    }
}
