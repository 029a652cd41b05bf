//! The progress thread of an endpoint's rails: it sleeps on the rails' completion channels,
//! rdma_cm links and eventfd (a bounded `poll(2)`), takes completions, delivers the peer's
//! notifications, returns credits, ends requests at their deadlines, and posts what fits.
//! While a waiting thread polls the CQs itself (`wait`), the progress thread leaves them to it
//! and only looks at the links and the deadlines.

use super::post::pump;
use super::rail::{LINGER, NOTIFY_RAIL, QpSlot, RECV_TAG, TICK};
use super::state::{Link, State, break_endpoint, finish_touched, flush_gpu, force_finish};
use crate::error::Result;
use crate::rdma::{CompletionQueue, RecvRequest, WcOpcode, WorkCompletion};
use crate::transfer::request::{
    Broken, Direction, FLUSH_WAIT, MAX_UNREAD_NOTIFICATIONS, Notification, unread_overflow,
};
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
pub(super) fn poll_all(inner: &Link, st: &mut State) -> bool {
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

/// A send completion tagged `seq` on rail `r`: every message up to it is done.
fn on_send_completion(inner: &Link, st: &mut State, r: usize, seq: u64, ok: bool, res: Result<()>) {
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

/// One pass: events, completions (unless a waiting thread polls them: `waiter`), the rdma_cm
/// links, deadlines, posting. Returns whether any completion was found.
fn progress(inner: &Link, st: &mut State, waiter: bool) -> bool {
    for rail in &st.rails {
        while rail.channel.get_event().is_ok() {}
    }
    // A waiter that has not looked for a while (descheduled) is helped: polling is under the
    // lock either way, so nothing is taken twice.
    let any = if waiter && st.looked.elapsed() < LINGER {
        false
    } else {
        poll_all(inner, st)
    };
    let mut cm = None;
    for rail in &st.rails {
        while let Ok(Some(ev)) = rail.link.next_event() {
            if ev.ends_connection() {
                cm = Some(Broken::Disconnected(ev.name, ev.status));
            }
        }
    }
    if let Some(b) = cm {
        // What completed before the peer went counts: a completion that came between the
        // poll above and the event (a notification, the acknowledgement of a last write) is
        // taken before the endpoint breaks.
        poll_all(inner, st);
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

/// Arm every CQ (the next completion on each raises an event); returns whether all are.
pub(super) fn arm_all(st: &mut State) -> bool {
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
    let armed = arm_all(st);
    let found = poll_all(inner, st);
    if found {
        pump(inner, st);
    }
    found || !armed
}

pub(super) fn progress_loop(inner: &Arc<Link>) {
    loop {
        let (fds, timeout) = {
            let mut st = inner.lock();
            if st.closing {
                return;
            }
            // Under the lock: a waiter takes and lets go of the CQs under it too.
            let waiter = inner.polled.load(Ordering::Relaxed);
            if progress(inner, &mut st, waiter) {
                continue;
            }
            if !waiter && arm(inner, &mut st) {
                continue;
            }
            st.lingering = waiter;
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
                .min(if waiter { LINGER } else { TICK });
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
