//! Posting on the rails: a request checked, planned into messages (split and striped), queued
//! and posted within each rail's window; notifications held until the other rails are done and
//! sent against the peer's credits.

use super::rail::{Again, INLINE_MAX, Posted, QpSlot, Wr};
use super::state::{
    Link, RailCounts, RailList, Request, State, check_rkeys, fail_rail, notes_wait, notify_rail,
    up_rails,
};
use crate::error::{Error, Result};
use crate::rdma::{RemoteSlice, SendRequest};
use crate::transfer::descriptor::RemoteRange;
use crate::transfer::pending::{ReqShared, Transfer};
use crate::transfer::plan::{Chunk, PlanInput, deadline_after, plan};
use crate::transfer::region::{LocalRange, MemoryPath};
use crate::transfer::request::{
    Broken, Direction, FLUSH_WAIT, TransferOptions, check_pairs, check_same_engine,
};
use smallvec::SmallVec;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The request on registered memory (what
/// [`Endpoint::transfer`](crate::transfer::Endpoint::transfer) does once no local range is
/// staged): checked, planned, queued and posted within the windows.
pub(crate) fn direct(
    inner: &Link,
    dir: Direction,
    pairs: Vec<(LocalRange, RemoteRange)>,
    opts: TransferOptions,
) -> Result<Transfer> {
    check_direct(inner.ep.engine.inner.engine_id, dir, &pairs, &opts)?;
    let lens: SmallVec<[u64; 4]> = pairs.iter().map(|(l, _)| l.len).collect();
    let shared = submit(inner, dir, &opts, |st| {
        check_rkeys(&pairs, st.peer_devices)?;
        let route = route(inner, st, &pairs, &lens, opts.notify.is_some());
        build(st, inner, dir, &pairs, &lens, opts.notify, &route)
    })?;
    let regions = pairs.into_iter().map(|(l, _)| l.region).collect();
    Ok(Transfer::started("transfer", shared, regions))
}

/// A new request under the endpoint's lock (refused once the endpoint broke): its messages
/// from `make`, queued, and what fits posted. Returns its shared state.
fn submit(
    inner: &Link,
    dir: Direction,
    opts: &TransferOptions,
    make: impl FnOnce(&mut State) -> Result<Built>,
) -> Result<Arc<ReqShared>> {
    let timeout = opts
        .deadline
        .unwrap_or(inner.ep.engine.inner.config.deadline);
    let started = Instant::now();
    let deadline = deadline_after(started, timeout);
    let shared = ReqShared::new(deadline + FLUSH_WAIT + Duration::from_secs(5));
    let mut st = inner.lock();
    if let Some((b, _)) = &st.broken {
        return Err(b.to_error());
    }
    let built = make(&mut st)?;
    let job = Job {
        shared: &shared,
        dir,
        notify: opts.notify,
        started,
        timeout,
        deadline,
    };
    enqueue(inner, &mut st, &job, built);
    drop(st);
    Ok(shared)
}

/// What [`direct`] refuses before it takes the lock (a prepared request passed them once).
fn check_direct(
    engine: u64,
    dir: Direction,
    pairs: &[(LocalRange, RemoteRange)],
    opts: &TransferOptions,
) -> Result<()> {
    check_pairs(dir, pairs, opts)?;
    check_same_engine(engine, pairs)?;
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
    Ok(())
}

/// Where a request goes: the rails up nearest its first pair's memory (among the endpoint's),
/// the notification rail, and which of them an unstriped request without notification takes
/// (the endpoint's round robin, advanced here; 0 where the plan does not ask).
struct Route {
    up: RailList,
    rails: RailList,
    note_rail: usize,
    slot: usize,
}

fn route(
    inner: &Link,
    st: &mut State,
    pairs: &[(LocalRange, RemoteRange)],
    lens: &[u64],
    notify: bool,
) -> Route {
    let stripe_min = inner.ep.engine.inner.config.stripe_min;
    let preferred = &pairs[0].0.region.entry.preferred;
    let up = up_rails(st);
    let mut rails: RailList = up
        .iter()
        .copied()
        .filter(|&r| preferred.contains(&st.rails[r].device))
        .collect();
    if rails.is_empty() {
        rails = up.clone();
    }
    let note_rail = notify_rail(st, &up);
    let turn = st.turn;
    st.turn = st.turn.wrapping_add(1);
    // The plan reads the turn only for an unstriped request without notification on several
    // rails (a sum that overflows is refused by the plan).
    let total = lens.iter().fold(0u64, |a, &l| a.saturating_add(l));
    let slot = if !notify && rails.len() > 1 && total < stripe_min {
        turn % rails.len()
    } else {
        0
    };
    Route {
        up,
        rails,
        note_rail,
        slot,
    }
}

/// A request's messages built for the rails as they are: each with its rail and whether it
/// carries the notification; the data messages per rail; where the memory is; the GPUs a read
/// flushes.
#[derive(Clone)]
pub(super) struct Built {
    wrs: SmallVec<[(usize, Wr, bool); 2]>,
    left: RailCounts,
    note_rail: usize,
    paths: SmallVec<[MemoryPath; 1]>,
    flush: Vec<usize>,
}

fn build(
    st: &State,
    inner: &Link,
    dir: Direction,
    pairs: &[(LocalRange, RemoteRange)],
    lens: &[u64],
    notify: Option<u32>,
    route: &Route,
) -> Result<Built> {
    let chunks = plan(&PlanInput {
        lens,
        max_message: st.max_message,
        rails: &route.rails,
        stripe_min: inner.ep.engine.inner.config.stripe_min,
        notify_rail: notify.map(|_| route.note_rail),
        turn: route.slot,
    })?;
    let mut wrs: SmallVec<[(usize, Wr, bool); 2]> = SmallVec::with_capacity(chunks.len());
    let mut left: RailCounts = smallvec::smallvec![0; st.rails.len()];
    for c in &chunks {
        let wr = build_wr(st, dir, pairs, c, notify)?;
        // Checked here for every other rail up: a message moved to another rail fits there too
        // (its own rail's is the one just built).
        for &r in route.up.iter().filter(|&&r| r != c.rail) {
            wr.fits(&st.rails[r])?;
        }
        if !c.imm {
            left[c.rail] += 1;
        }
        wrs.push((c.rail, wr, c.imm));
    }
    Ok(Built {
        wrs,
        left,
        note_rail: route.note_rail,
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
    })
}

/// A request about to be queued: its shared state, direction, notification and times.
struct Job<'a> {
    shared: &'a Arc<ReqShared>,
    dir: Direction,
    notify: Option<u32>,
    started: Instant,
    timeout: Duration,
    deadline: Instant,
}

/// Queue `built` as a new request and post what fits.
fn enqueue(inner: &Link, st: &mut State, job: &Job<'_>, built: Built) {
    let Built {
        wrs,
        left,
        note_rail,
        paths,
        flush,
    } = built;
    let id = inner.next_req.fetch_add(1, Ordering::Relaxed);
    let mut req = Request {
        shared: job.shared.clone(),
        dir: job.dir,
        unposted: wrs.len(),
        posted: 0,
        left,
        note_rail,
        held: None,
        asking: None,
        parked: Vec::new(),
        notify: job.notify,
        timeout: job.timeout,
        error: None,
        rail_bytes: smallvec::smallvec![0; st.rails.len()],
        messages: wrs.len() as u64,
        reposted: 0,
        started: job.started,
        paths,
        flush,
    };
    for (rail, wr, imm) in wrs {
        if imm {
            // Straight to its rail when `pump` would send it now (none queued before it, none
            // waiting, `note_can_go`): built for that rail, it is not made again.
            debug_assert_eq!(
                rail, note_rail,
                "a notification goes on the notification rail"
            );
            if st.notify_q.is_empty() && !notes_wait(st) && req.note_can_go(&st.lanes) {
                st.lanes[note_rail].credits.take_notify();
                st.rails[note_rail].pending.push_back((id, wr));
            } else {
                req.held = Some(wr);
            }
        } else {
            st.rails[rail].pending.push_back((id, wr));
        }
    }
    if req.held.is_some() {
        st.notify_q.push_back(id);
    }
    st.requests.insert(id, req);
    st.deadlines.push(std::cmp::Reverse((job.deadline, id)));
    pump(inner, st);
    inner.gauge(st);
}

/// A request on registered memory checked once ([`Endpoint::prepare`]) and posted many times:
/// its messages are planned and built once per layout of the rails and posted as built while
/// that layout holds. A layout is the endpoint's state (a reconnect makes a new one), each
/// rail usable or not and its generation (a rail taken back has new rkeys for the peer's
/// memory), the notification rail, and the round-robin slot the plan took.
///
/// [`Endpoint::prepare`]: crate::transfer::Endpoint::prepare
pub(crate) struct Ready {
    dir: Direction,
    pairs: Vec<(LocalRange, RemoteRange)>,
    opts: TransferOptions,
    lens: SmallVec<[u64; 4]>,
    /// Built per layout: at most one per slot of the current layout.
    built: Mutex<SmallVec<[(Layout, Built); 1]>>,
}

#[derive(Clone, PartialEq, Eq)]
struct Layout {
    state: u64,
    note_rail: usize,
    slot: usize,
    lanes: SmallVec<[(bool, u32); 8]>,
}

impl Layout {
    /// The same rails, whatever the slot.
    fn same_rails(&self, o: &Layout) -> bool {
        self.state == o.state && self.note_rail == o.note_rail && self.lanes == o.lanes
    }
}

impl Ready {
    /// `pairs` of registered memory, checked by the caller as a post would check them.
    pub(crate) fn new(
        dir: Direction,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Ready {
        Ready {
            dir,
            lens: pairs.iter().map(|(l, _)| l.len).collect(),
            pairs,
            opts,
            built: Mutex::new(SmallVec::new()),
        }
    }

    /// Its pairs.
    pub(crate) fn pairs(&self) -> &[(LocalRange, RemoteRange)] {
        &self.pairs
    }
}

/// Post `ready` again: [`direct`] with its messages as built for this layout of the rails
/// (built now, and kept, when none was).
pub(crate) fn post_ready(inner: &Link, ready: &Ready) -> Result<Transfer> {
    let notify = ready.opts.notify;
    let shared = submit(inner, ready.dir, &ready.opts, |st| {
        let route = route(inner, st, &ready.pairs, &ready.lens, notify.is_some());
        let layout = Layout {
            state: st.id,
            note_rail: route.note_rail,
            slot: route.slot,
            lanes: st
                .lanes
                .iter()
                .map(|l| (l.usable(), l.generation))
                .collect(),
        };
        let mut kept = ready.built.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, b)) = kept.iter().find(|(l, _)| *l == layout) {
            return Ok(b.clone());
        }
        check_rkeys(&ready.pairs, st.peer_devices)?;
        let b = build(
            st,
            inner,
            ready.dir,
            &ready.pairs,
            &ready.lens,
            notify,
            &route,
        )?;
        kept.retain(|(l, _)| l.same_rails(&layout));
        kept.push((layout, b.clone()));
        Ok(b)
    })?;
    let regions = ready.pairs.iter().map(|(l, _)| l.region.clone()).collect();
    Ok(Transfer::started("transfer", shared, regions))
}

/// The checks [`direct`] or the staged path make before anything is queued, without
/// queueing anything (stream-ordered requests make them before they are enqueued on a
/// stream).
///
/// # Errors
///
/// As [`Endpoint::transfer`](crate::transfer::Endpoint::transfer).
pub(crate) fn check_request(
    inner: &Link,
    dir: Direction,
    pairs: &[(LocalRange, RemoteRange)],
    opts: &TransferOptions,
) -> Result<()> {
    check_pairs(dir, pairs, opts)?;
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
        check_same_engine(inner.ep.engine.inner.engine_id, pairs)?;
    }
    let st = inner.lock();
    if let Some((b, _)) = &st.broken {
        return Err(b.to_error());
    }
    check_rkeys(pairs, st.peer_devices)
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
    let again = Again {
        entry: l.region.entry.clone(),
        off,
        rkeys: SmallVec::from_slice(r.descriptor().rkeys()),
    };
    let remote = RemoteSlice {
        addr: r.addr_at(c.offset),
        rkey: rail.peer_rkey(r.descriptor().rkeys()[rail.peer_device]),
        len: c.len,
    };
    Ok(match dir {
        Direction::Write => Wr::Write {
            local,
            remote,
            imm: if c.imm { notify } else { None },
            signaled: c.last_on_rail,
            again,
        },
        Direction::Read => Wr::Read {
            local,
            remote,
            signaled: c.last_on_rail,
            again,
        },
    })
}

/// Post what fits: each rail's pending messages within its window, the notifications whose
/// other rails are done (in order, against their rail's credits), credit returns and control
/// messages.
pub(super) fn pump(inner: &Link, st: &mut State) {
    if st.broken.is_some() {
        return;
    }
    // Notifications, in request order: none while one may be sent again (`notes_wait`): it
    // must arrive before those after it.
    let doubt = notes_wait(st);
    debug_assert_eq!(
        st.in_doubt,
        st.requests.values().filter(|q| q.asking.is_some()).count()
    );
    while let Some(&id) = st.notify_q.front()
        && !doubt
    {
        let Some(req) = st.requests.get_mut(&id) else {
            st.notify_q.pop_front();
            continue;
        };
        let Some(held) = &req.held else {
            st.notify_q.pop_front();
            continue;
        };
        if req.error.is_some() {
            // A failed request sends no notification.
            req.held = None;
            req.unposted = req.unposted.saturating_sub(1);
            st.touched.push(id);
            st.notify_q.pop_front();
            continue;
        }
        let r = req.note_rail;
        // On a rail the peer gave up, it waits until the rail fails and moves it (those after
        // it wait too).
        if !req.note_can_go(&st.lanes) {
            break;
        }
        let wr = match held.on(&st.rails[r]) {
            Some(Ok(w)) => w,
            Some(Err(e)) => {
                req.error.get_or_insert(e);
                req.held = None;
                req.unposted = req.unposted.saturating_sub(1);
                st.touched.push(id);
                st.notify_q.pop_front();
                continue;
            }
            None => unreachable!("a notification is a write"),
        };
        req.held = None;
        st.lanes[r].credits.take_notify();
        st.rails[r].pending.push_back((id, wr));
        st.notify_q.pop_front();
    }
    for r in 0..st.rails.len() {
        let lane = &mut st.lanes[r];
        if !lane.usable() {
            continue;
        }
        if let Some(n) = lane.credits.take_return() {
            st.rails[r].pending.push_back((0, Wr::Credits(n)));
        }
        while !lane.ctl.is_empty() && lane.credits.take_control() {
            let c = lane.ctl.pop_front().expect("not empty");
            st.rails[r].pending.push_back((0, Wr::Ctl(c)));
        }
    }
    for r in 0..st.rails.len() {
        if let Err(e) = post_rail(inner, st, r) {
            fail_rail(inner, st, r, Broken::of(&e));
            if st.broken.is_some() {
                return;
            }
        }
    }
}

/// Post rail `r`'s pending messages within its window, as one chain.
fn post_rail(inner: &Link, st: &mut State, r: usize) -> Result<()> {
    let State {
        rails,
        requests,
        lanes,
        ..
    } = st;
    let rail = &mut rails[r];
    let lane = &mut lanes[r];
    if !lane.usable() {
        return Ok(());
    }
    let room = (rail.window as usize).saturating_sub(rail.outstanding());
    let n = room.min(rail.pending.len());
    if n == 0 {
        return Ok(());
    }
    let QpSlot::Rts(qp) = &mut rail.qp else {
        return Ok(());
    };
    // What the provider granted, should it be less than asked.
    let inline_max = INLINE_MAX.min(qp.caps().max_inline_data);
    let mut chain: SmallVec<[SendRequest<'_>; 4]> = SmallVec::with_capacity(n);
    let mut posted: SmallVec<[Posted; 4]> = SmallVec::with_capacity(n);
    for (req, wr) in rail.pending.drain(..n) {
        let seq = rail.next_seq;
        rail.next_seq += 1;
        let bytes = wr.bytes();
        let keep = wr.is_data().then(|| wr.clone());
        let note = wr.is_note().then(|| {
            let i = lane.notes_out;
            lane.notes_out = i.wrapping_add(1);
            i
        });
        let (sr, dir, imm) = match wr {
            Wr::Write {
                local,
                remote,
                imm,
                signaled,
                again,
            } => {
                // A few bytes of ordinary host memory go inline, as perftest sends them: copied
                // during the post, nothing for the NIC to fetch (never GPU memory, which the
                // CPU cannot load, nor CUDA host memory, which may be write-combined).
                let inline = local.len() <= inline_max
                    && again.entry.cached
                    && matches!(again.entry.path, MemoryPath::Host);
                let mut s = SendRequest::write(local, remote);
                if inline {
                    s = s.inline_host();
                }
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
                ..
            } => {
                let s = SendRequest::read(local, remote);
                let s = if signaled {
                    s.signaled()
                } else {
                    s.unsignaled()
                };
                (s, Some(Direction::Read), false)
            }
            Wr::Credits(k) | Wr::Ctl(k) => (
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
            wr: keep,
            note,
        });
    }
    let res = qp.post_send(chain);
    let ok = match &res {
        Ok(k) => *k,
        Err(_) => 0,
    };
    // Posted ones are in flight. The data of the rest goes back to the queue, to move to the
    // rails left as the rail fails (an error); credit returns and control messages die with it.
    let mut unsent = Vec::new();
    let mut rewind = None;
    for (i, p) in posted.into_iter().enumerate() {
        if i < ok {
            if let Some(q) = requests.get_mut(&p.req) {
                q.unposted = q.unposted.saturating_sub(1);
                q.posted += 1;
            }
            rail.inflight.push_back(p);
        } else if let Some(w) = p.wr {
            if let Some(n) = p.note {
                rewind.get_or_insert(n);
            }
            unsent.push((p.req, w));
        } else if let Some(q) = requests.get_mut(&p.req) {
            q.unposted = q.unposted.saturating_sub(1);
        }
    }
    for x in unsent.into_iter().rev() {
        rail.pending.push_front(x);
    }
    if let Some(n) = rewind {
        // The first notification not posted: the next one posted here takes its index.
        lane.notes_out = n;
    }
    let _ = inner;
    res.map(|_| ())
}
