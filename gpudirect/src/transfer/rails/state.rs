//! The verbs side of one endpoint ([`Link`]): its state under the endpoint's lock (rails,
//! requests, deadlines, credits), the requests' accounting, and how the endpoint breaks and its
//! requests finish.

use super::rail::{NOTIFY_RAIL, QpSlot, Rail, RailCounters, SPIN_DEPTH, Wr};
use super::windows::revoke;
use crate::completion::deferred::{Defers, Locked};
use crate::error::{Error, Result};
use crate::transfer::descriptor::{MemoryDescriptor, RemoteRange};
use crate::transfer::engine::EngineInner;
use crate::transfer::pending::ReqShared;
use crate::transfer::plan::Credits;
use crate::transfer::region::{LocalRange, MemoryPath};
use crate::transfer::request::{Broken, Direction, Notification, TransferReport};
use crate::transfer::shared::{EpInner, Mailbox, Wakes};
use crate::transfer::wire::Hello;
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
    /// Messages on rails other than the notification rail not yet completed.
    pub(super) elsewhere: usize,
    /// The notification message, held until `elsewhere` is 0.
    pub(super) held: Option<Wr>,
    pub(super) notify: Option<u32>,
    pub(super) timeout: Duration,
    pub(super) error: Option<Error>,
    pub(super) rail_bytes: Vec<u64>,
    pub(super) messages: u64,
    pub(super) started: Instant,
    pub(super) paths: Vec<MemoryPath>,
    /// GPUs whose memory a read wrote: flushed before the read is reported done.
    pub(super) flush: Vec<usize>,
}

impl Request {
    fn finished(&self) -> bool {
        self.unposted == 0 && self.posted == 0 && self.held.is_none()
    }
}

pub(crate) struct State {
    pub(super) rails: Vec<Rail>,
    pub(super) broken: Option<(Broken, Instant)>,
    pub(super) requests: HashMap<u64, Request>,
    pub(super) deadlines: BinaryHeap<std::cmp::Reverse<(Instant, u64)>>,
    pub(super) notify_q: VecDeque<u64>,
    pub(super) credits: Credits,
    pub(super) notes: VecDeque<Notification>,
    pub(super) closing: bool,
    pub(super) turn: usize,
    peer_descriptors: Vec<MemoryDescriptor>,
    pub(super) peer_devices: usize,
    pub(super) max_message: u32,
    /// Requests whose messages completed since the last look (then finished if done).
    pub(super) touched: Vec<u64>,
    /// A completion was taken since the CQs were last armed: one may have used up its arming.
    pub(super) unarmed: bool,
    /// The progress thread sleeps for at most [`LINGER`](super::rail::LINGER) and then looks
    /// (it saw a waiter polling): CQs left unarmed are seen that soon.
    pub(super) lingering: bool,
    /// When the waiter polling the CQs last looked.
    pub(super) looked: Instant,
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
        }))
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

/// Rails, their peers' first messages: the state of a new (or reconnected) endpoint.
pub(super) fn new_state(e: &EngineInner, rails: Vec<Rail>, hellos: &[Hello]) -> Result<State> {
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
        unarmed: true,
        lingering: false,
        looked: Instant::now(),
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

/// Stop the endpoint: every queue pair to the error state (the NIC flushes what is posted),
/// nothing more posted, every request ends with the cause's error.
pub(super) fn break_endpoint(inner: &Link, st: &mut State, cause: Broken) {
    if st.broken.is_some() {
        return;
    }
    st.broken = Some((cause.clone(), Instant::now()));
    for rail in &mut st.rails {
        // The peer's windows first: their rkeys are refused from here on, and none is left
        // bound through a queue pair that goes.
        revoke(&inner.ep.engine.inner, &mut rail.windows);
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
    inner.ep.failed(st);
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
pub(super) fn flush_gpu(ordinal: usize) -> Result<()> {
    let ctx = crate::cuda::context(ordinal)?;
    crate::rdma::flush_gpudirect_rdma_writes(&ctx, crate::rdma::FlushScope::Owner).map(|_| ())
}

/// After a failure: finish every request, flushed or not (the queue pairs keep what the NIC
/// may still touch).
pub(super) fn force_finish(st: &mut State) {
    for (_, mut q) in st.requests.drain() {
        q.posted = 0;
        if q.error.is_none() {
            q.error = Some(Broken::Closed.to_error());
        }
        let r = Err(q.error.take().expect("set"));
        st.wakes.finished.push((q.shared, r));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::descriptor::DescribedKind;
    use crate::transfer::{Buffer, Engine, EngineConfig};

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
