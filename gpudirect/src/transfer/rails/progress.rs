//! The progress thread of an endpoint's rails: it sleeps on the rails' completion channels,
//! rdma_cm links and eventfd (a bounded `poll(2)`), takes completions, delivers the peer's
//! notifications, returns credits, ends requests at their deadlines, and posts what fits.
//! While a waiting thread polls the CQs itself (`wait`), the progress thread leaves them to it
//! and only looks at the links and the deadlines.

use super::post::pump;
use super::rail::{
    CTL, GIVEN_UP_GRACE, LINGER, LINGER_MAX, QpSlot, TICK, ctl_answer, ctl_parts, note_receives,
};
use super::state::{
    Link, State, answered, break_endpoint, fail_rail, finish_touched, flush_gpu, force_finish,
    long_ago,
};
use crate::error::{Error, Result, WcStatus};
use crate::rdma::{CompletionQueue, WcOpcode, WorkCompletion};
use crate::transfer::request::{
    Broken, Direction, FLUSH_WAIT, MAX_UNREAD_NOTIFICATIONS, Notification, unread_overflow,
};
use smallvec::SmallVec;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

pub(super) fn close(inner: &Link) {
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
pub(super) fn drain_after_close(inner: &Link) {
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

/// Every completion `cq` holds now, into `out` (emptied first).
fn drain(cq: &mut CompletionQueue, out: &mut Vec<WorkCompletion>) -> Result<()> {
    out.clear();
    loop {
        let ws = cq.poll()?;
        if ws.len() == 0 {
            return Ok(());
        }
        out.extend(ws.copied());
    }
}

/// Notifications taken in one look (delivered together).
type Notes = SmallVec<[Notification; 8]>;

/// Take every completion rail `r`'s send CQ holds now; whether there was any.
fn drain_sends(inner: &Link, st: &mut State, r: usize) -> bool {
    // The state's buffer, put back after (a nested look, on a failure, gets an empty one).
    let mut got = std::mem::take(&mut st.wcs);
    let any = match drain(&mut st.rails[r].send_cq, &mut got) {
        Err(e) => {
            fail_rail(inner, st, r, Broken::of(&e));
            false
        }
        Ok(()) => {
            for w in &got {
                on_send_completion(inner, st, r, w.tag(), w.is_ok(), w.result());
            }
            !got.is_empty()
        }
    };
    st.wcs = got;
    any
}

/// Post again the receives earlier looks found used on rail `r`, then count them owed to
/// the peer (its credits are returned only for receives posted); whether any were.
fn repost(inner: &Link, st: &mut State, r: usize) -> bool {
    let n = std::mem::take(&mut st.lanes[r].used);
    if n == 0 || st.broken.is_some() || !st.lanes[r].up() {
        return false;
    }
    let QpSlot::Rts(qp) = &mut st.rails[r].qp else {
        return false;
    };
    if let Err(e) = qp.post_recv(note_receives(n)) {
        fail_rail(inner, st, r, Broken::of(&e));
        return false;
    }
    for _ in 0..n {
        st.lanes[r].credits.on_received();
    }
    true
}

/// Poll every rail's CQs until empty; returns whether anything was found (or receives used
/// before were posted again: their credits may now go back to the peer).
pub(super) fn poll_all(inner: &Link, st: &mut State) -> bool {
    let mut any = false;
    // What earlier looks used: posted again here, after whatever the caller posted since.
    for r in 0..st.rails.len() {
        any |= repost(inner, st, r);
    }
    let mut notes = Notes::new();
    // Control messages (rail, immediate), taken once every CQ was looked at: an answer counts
    // what the rail it names received, all of it.
    let mut ctl: Vec<(usize, u32)> = Vec::new();
    for r in 0..st.rails.len() {
        any |= drain_sends(inner, st, r);
        {
            let mut got = std::mem::take(&mut st.wcs);
            if let Err(e) = drain(&mut st.rails[r].recv_cq, &mut got) {
                st.wcs = got;
                fail_rail(inner, st, r, Broken::of(&e));
                continue;
            }
            any |= !got.is_empty();
            for (res, op, imm) in got.iter().map(|w| (w.result(), w.opcode(), w.imm())) {
                if let Err(e) = res {
                    // Flushed receives after a failure, or the failure itself. A flush is a
                    // consequence: the send that failed the queue pair may have completed
                    // after its send queue was looked at above, and its error is the cause.
                    if matches!(
                        e,
                        Error::WorkCompletion {
                            status: WcStatus::Flushed,
                            ..
                        }
                    ) {
                        any |= drain_sends(inner, st, r);
                    }
                    fail_rail(inner, st, r, Broken::of(&e));
                    continue;
                }
                let up = st.lanes[r].up();
                if let (WcOpcode::RecvRdmaWithImm, Some(tag)) = (op, imm) {
                    // Counted and delivered even on a rail given up: the peer saw it acknowledged
                    // (or will ask, and the count says it arrived).
                    note_in(inner, st, r, tag, &mut notes);
                }
                if !up {
                    continue;
                }
                st.lanes[r].used += 1;
                match (op, imm) {
                    (WcOpcode::RecvRdmaWithImm, Some(_)) => {}
                    (WcOpcode::Recv, Some(c)) if c & CTL != 0 => ctl.push((r, c)),
                    (WcOpcode::Recv, Some(n)) => {
                        if let Err(e) = st.lanes[r].credits.on_returned(n) {
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
            st.wcs = got;
        }
    }
    for (r, c) in ctl {
        on_control(inner, st, r, c, &mut notes);
    }
    // Rails the peer gave up: failed once their messages' completions were seen, or after the
    // grace.
    for r in 0..st.lanes.len() {
        if let Some(at) = st.lanes[r].given_up
            && st.lanes[r].up()
            && (st.rails[r].inflight.is_empty() || at.elapsed() >= GIVEN_UP_GRACE)
        {
            fail_rail(inner, st, r, Broken::RailGivenUp);
        }
    }
    if !notes.is_empty() {
        // Visible before delivered: GPU memory a peer may have written is flushed first.
        for o in inner.ep.engine.inner.gpu_targets() {
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
        let n = notes.len() as u64;
        inner.ep.deliver(st, notes, n);
    }
    finish_touched(st);
    st.unarmed |= any;
    if any {
        inner.gauge(st);
    }
    any
}

/// A control message `c` from the peer on rail `r`: it asks how many notifications arrived on
/// a rail it gave up (that rail is given up here too, then answered on `r`), or it answers.
/// One about another connection of the rail named than its current one here (another
/// generation) changes nothing here: an answer is dropped; a question is answered "none" (a
/// connection the peer took back and this side never did had no receives here; one older is
/// asked about only by a stale copy, whose answer the peer drops).
fn on_control(inner: &Link, st: &mut State, r: usize, c: u32, notes: &mut Notes) {
    if st.broken.is_some() {
        return;
    }
    let (answer, about, generation, n) = ctl_parts(c);
    if about >= st.lanes.len() || about == r {
        break_endpoint(
            inner,
            st,
            Broken::Protocol(format!("a control message about rail {about} on rail {r}")),
        );
        return;
    }
    let current = generation == st.lanes[about].generation & 0xf;
    if answer {
        if current && !st.lanes[about].up() {
            answered(inner, st, about, n);
        }
        return;
    }
    if !current {
        if st.lanes[r].up() {
            st.lanes[r].ctl.push_back(ctl_answer(about, generation, 0));
        }
        return;
    }
    if st.lanes[about].up() && !st.rails[about].inflight.is_empty() {
        // Its unfinished messages wait for their own completions a little (one the peer
        // refused completes in error): the rail fails in `poll_all` once they are seen or
        // `GIVEN_UP_GRACE` passed. Nothing more arrives on it (the peer's side is in error), so
        // the count below is final.
        st.lanes[about].given_up.get_or_insert_with(Instant::now);
    } else {
        fail_rail(inner, st, about, Broken::RailGivenUp);
    }
    // What arrived on it between the last look and its queue pair's error state counts.
    let mut late = std::mem::take(&mut st.wcs);
    if drain(&mut st.rails[about].recv_cq, &mut late).is_ok() {
        for w in &late {
            if let (true, WcOpcode::RecvRdmaWithImm, Some(tag)) = (w.is_ok(), w.opcode(), w.imm()) {
                note_in(inner, st, about, tag, notes);
            }
        }
    }
    st.wcs = late;
    if st.broken.is_none() && st.lanes[r].up() {
        let n = st.lanes[about].notes_in;
        st.lanes[r].ctl.push_back(ctl_answer(about, generation, n));
    }
}

/// A notification `tag` received on rail `r`: counted there, delivered with `notes`.
fn note_in(inner: &Link, st: &mut State, r: usize, tag: u32, notes: &mut Notes) {
    inner.counters[r]
        .notes_received
        .fetch_add(1, Ordering::Relaxed);
    let lane = &mut st.lanes[r];
    lane.notes_in = lane.notes_in.wrapping_add(1);
    notes.push(Notification { tag });
}

/// A send completion tagged `seq` on rail `r`: every message up to it is done (on a failed
/// rail: flushed, its memory no longer the NIC's).
fn on_send_completion(inner: &Link, st: &mut State, r: usize, seq: u64, ok: bool, res: Result<()>) {
    if !ok && st.lanes[r].up() {
        // Those before it completed; it and those after it go to the rails left.
        done_until(inner, st, r, seq.saturating_sub(1));
        let cause = res.as_ref().err().map(Broken::of).unwrap_or(Broken::Closed);
        if refused_by_peer(&cause)
            && let Some(id) = st.rails[r]
                .inflight
                .front()
                .filter(|p| p.seq == seq)
                .map(|p| p.req)
            && let Some(q) = st.requests.get_mut(&id)
        {
            // The peer refused this request's memory: the request ends with that error, and
            // its messages are not posted again elsewhere (they would fail every rail).
            q.error.get_or_insert_with(|| cause.to_error());
        }
        fail_rail(inner, st, r, cause);
    }
    done_until(inner, st, r, seq);
}

/// Whether a message failed because of its own request (a remote descriptor the peer refuses),
/// not its rail.
fn refused_by_peer(b: &Broken) -> bool {
    matches!(
        b,
        Broken::Completion {
            status: WcStatus::RemoteAccess | WcStatus::RemoteInvalidRequest,
            ..
        }
    )
}

/// Messages of rail `r` up to `seq` completed (flushed, on a failed rail or a broken endpoint).
fn done_until(inner: &Link, st: &mut State, r: usize, seq: u64) {
    let flushed = !st.lanes[r].up() || st.broken.is_some();
    while st.rails[r].inflight.front().is_some_and(|p| p.seq <= seq) {
        let p = st.rails[r].inflight.pop_front().expect("present");
        st.touched.push(p.req);
        let Some(q) = st.requests.get_mut(&p.req) else {
            continue;
        };
        q.posted = q.posted.saturating_sub(1);
        if flushed {
            continue;
        }
        if p.wr.is_some() && !p.imm {
            q.left[r] = q.left[r].saturating_sub(1);
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
}

/// Failed rails whose flushes did not all come within `FLUSH_WAIT`: their messages are given
/// up (their requests may finish; the queue pair keeps what the NIC may still touch).
fn give_up_flushes(inner: &Link, st: &mut State) {
    for r in 0..st.rails.len() {
        if let Some((_, at)) = &st.lanes[r].failed
            && at.elapsed() >= FLUSH_WAIT
            && let Some(last) = st.rails[r].inflight.back().map(|p| p.seq)
        {
            done_until(inner, st, r, last);
        }
    }
}

/// One pass: events, completions (unless a waiting thread polls them: `waiter`), the rdma_cm
/// links, deadlines, posting. Returns whether any completion was found.
fn progress(inner: &Link, st: &mut State, waiter: bool) -> bool {
    for rail in &st.rails {
        while rail.channel.get_event().is_ok() {}
    }
    // A waiter that has not looked for a while (descheduled) is helped: polling is under the
    // lock either way, so nothing is taken twice.
    let polled = !(waiter && st.looked.elapsed() < LINGER);
    let any = polled && poll_all(inner, st);
    let mut cm = Vec::new();
    for (r, rail) in st.rails.iter().enumerate() {
        while let Ok(Some(ev)) = rail.link.next_event() {
            if ev.ends_connection() {
                cm.push((r, Broken::Disconnected(ev.name, ev.status)));
            }
        }
    }
    if !cm.is_empty() {
        // What completed before the peer went counts: a completion that came between the
        // poll above and the event (a notification, the acknowledgement of a last write) is
        // taken before the rail fails (the endpoint with its last rail).
        poll_all(inner, st);
        for (r, b) in cm {
            fail_rail(inner, st, r, b);
        }
    }
    give_up_flushes(inner, st);
    let now = Instant::now();
    // A deadline due while a waiting thread polls: what completed meanwhile is taken first (a
    // request whose completions wait in a queue is done, not late).
    if !polled && st.deadlines.peek().is_some_and(|r| r.0.0 <= now) {
        poll_all(inner, st);
    }
    finish_touched(st);
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

/// Arm every CQ (the next completion on each raises an event); returns whether all are. No
/// longer left unarmed to the lingering thread (`Link::left_unarmed`) from here on.
pub(super) fn arm_all(inner: &Link, st: &mut State) -> bool {
    inner.left_unarmed.store(false, Ordering::Release);
    let mut armed = true;
    for rail in &st.rails {
        armed &= rail.send_cq.req_notify(false).is_ok() && rail.recv_cq.req_notify(false).is_ok();
    }
    st.unarmed = !armed;
    armed
}

/// Arm every CQ, then look once more (a completion that raced the arming raises no event).
/// Returns whether something was found (then do not sleep).
fn arm(inner: &Link, st: &mut State) -> bool {
    let armed = arm_all(inner, st);
    let found = poll_all(inner, st);
    if found {
        pump(inner, st);
    }
    found || !armed
}

/// The progress thread's loop, until the endpoint closes; `retry` starts taking failed rails
/// back (on a thread of its own) when their time comes.
pub(super) fn progress_loop(inner: &Arc<Link>, retry: fn(&Arc<Link>)) {
    // The fds polled, filled again at each pass (kept: no allocation per pass).
    let mut p: Vec<libc::pollfd> = Vec::new();
    loop {
        let timeout = {
            let mut st = inner.lock();
            if st.closing {
                return;
            }
            if st.broken.is_none() && st.retry_at.is_some_and(|t| Instant::now() >= t) {
                // The thread started sets the next time, if a rail is still failed then.
                st.retry_at = None;
                drop(st);
                retry(inner);
                continue;
            }
            // Under the lock: a waiter takes and lets go of the CQs under it too. One that
            // polled within LINGER and left them unarmed counts too: it is likely back soon (one
            // request or notification after another, a ping-pong), and the CQs are left to it
            // rather than armed between its waits (each completion then raising an event that
            // wakes this thread). Without one for LINGER, or once they are armed (a waiter that
            // went to sleep), this thread polls and arms them.
            let polling = inner.polled.load(Ordering::Relaxed);
            let fresh = st.looks != st.looks_seen;
            st.looks_seen = st.looks;
            if fresh && polling {
                // It looked since the last pass (its looks are counted, not timed).
                st.looked = Instant::now();
            }
            // Asked to look (something waits without polling): it polls and arms, unless a
            // waiter holds the polling.
            let asked = inner.asked.swap(false, Ordering::AcqRel);
            if asked && !polling {
                // The last waiter's stop no longer counts as polling, also at the next pass
                // (this one may find completions and go round before it arms).
                st.looked = long_ago();
            }
            let waiter = polling || (st.unarmed && st.looked.elapsed() < LINGER);
            // A waiter that keeps looking alone needs nothing of this thread: each pass that
            // finds it still at it doubles the sleep, up to LINGER_MAX (a wake-up is two context
            // switches and the lock; in a software-NIC VM, a tenth of a CPU at every 1 ms).
            // Not while other threads wait beside it or something waits for a notification
            // without polling: a poller descheduled is then helped within LINGER.
            let alone = inner.spinners.load(Ordering::Acquire) <= 1
                && st.requests.len() <= 1
                && !inner.ep.watched();
            st.linger = if waiter && fresh && alone {
                (st.linger * 2).min(LINGER_MAX)
            } else {
                LINGER
            };
            if progress(inner, &mut st, waiter) {
                continue;
            }
            if !waiter && arm(inner, &mut st) {
                continue;
            }
            st.lingering = waiter;
            let fd = |fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            p.clear();
            p.push(fd(inner.wake.as_raw_fd()));
            for r in &st.rails {
                p.push(fd(r.channel.as_fd().as_raw_fd()));
                p.push(fd(r.link.as_fd().as_raw_fd()));
            }
            st.deadlines
                .peek()
                .map(|std::cmp::Reverse((d, _))| d.saturating_duration_since(Instant::now()))
                .unwrap_or(TICK)
                .min(if waiter { st.linger } else { TICK })
        };
        // SAFETY: valid pollfds for the call; the fds stay open (a rail is replaced only by a
        // reconnect or a rail taken back, each of which pokes the eventfd, and a stale fd
        // number is only polled once).
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
