//! [`Timeline`] and [`StreamFence`]: amortised completion epochs of one stream.

use super::backoff::{Backoff, LONG_WAIT, poll_until};
use super::fence::Fence;
use cudarc::driver::{CudaEvent, CudaStream, sys};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Completion state of one stream, shared by its [`StreamFence`]s.
///
/// Every operation issued on the stream takes the next epoch ([`Timeline::issue`], one atomic
/// add). Nothing is recorded per operation: when a fence is polled and no recorded event covers
/// its epoch yet, one event is recorded then, covering every epoch issued so far (stream order
/// makes a later event complete only after all earlier work). Events are recycled.
#[derive(Debug)]
pub struct Timeline {
    stream: Arc<CudaStream>,
    issued: AtomicU64,
    completed: AtomicU64,
    events: Mutex<Events>,
}

#[derive(Debug, Default)]
struct Events {
    /// Recorded events and the last epoch each covers, oldest first.
    pending: VecDeque<(u64, CudaEvent)>,
    /// Completed events, ready to be recorded again.
    free: Vec<CudaEvent>,
}

impl Timeline {
    /// A timeline for `stream`.
    pub fn new(stream: Arc<CudaStream>) -> Arc<Self> {
        Arc::new(Timeline {
            stream,
            issued: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            events: Mutex::new(Events::default()),
        })
    }

    /// The stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A fence for everything queued on the stream so far. Call it after queueing the work.
    pub fn issue(self: &Arc<Self>) -> StreamFence {
        let epoch = self.issued.fetch_add(1, Ordering::AcqRel) + 1;
        StreamFence {
            timeline: self.clone(),
            epoch,
        }
    }

    /// The highest epoch known complete.
    pub fn completed(&self) -> u64 {
        self.completed.load(Ordering::Acquire)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Events> {
        self.events.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Retire completed events; make sure one covers `epoch`. Returns whether `epoch` is done,
    /// and otherwise the raw event that covers it (`None` when none could be recorded: the
    /// stream is capturing a graph, or the driver refused).
    ///
    /// Never records while the stream captures a graph: an event recorded in a capture is a
    /// captured event, which completes with the capture rather than with the work (and which
    /// `cuEventQuery` refuses with `CUDA_ERROR_CAPTURED_EVENT`). One that was recorded anyway (a
    /// capture that began during the record) is dropped from the timeline and leaked, so later
    /// polls record a real one instead of waiting on it forever.
    fn poll(&self, epoch: u64) -> (bool, Option<sys::CUevent>) {
        let mut g = self.lock();
        while let Some((covered, ev)) = g.pending.front() {
            match ev.try_is_complete() {
                Ok(true) => {
                    self.completed.fetch_max(*covered, Ordering::AcqRel);
                    let (_, ev) = g.pending.pop_front().expect("front exists");
                    g.free.push(ev);
                }
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_CAPTURED_EVENT => {
                    // Proves nothing: forget it (destroying a captured event is not worth the
                    // risk) and look at the next one.
                    let (_, ev) = g.pending.pop_front().expect("front exists");
                    std::mem::forget(ev);
                }
                _ => break,
            }
        }
        if self.completed() >= epoch {
            return (true, None);
        }
        if let Some((_, ev)) = g.pending.iter().find(|(c, _)| *c >= epoch) {
            return (false, Some(ev.cu_event()));
        }
        // No event covers `epoch` yet: record one covering everything issued so far. Epochs are
        // handed out after their work is queued, so this record comes after that work.
        let covered = self.issued.load(Ordering::Acquire);
        let ev = match g.free.pop() {
            Some(ev) => ev,
            None => match self.stream.context().new_event(None) {
                Ok(ev) => ev,
                Err(_) => return (false, None),
            },
        };
        // Checked like any work queued on the stream, but a capture found after the record is
        // left alone: an internal event puts nothing into the user's graph.
        let probe = super::capture::Driver {
            raw: self.stream.cu_stream(),
            invalidate: false,
        };
        if crate::driver::ctx::bind(self.stream.context()).is_err() {
            g.free.push(ev);
            return (false, None);
        }
        match super::capture::enqueue_with(&probe, "cuEventRecord", ev, |ev| {
            ev.record(&self.stream)
                .map_err(|e| crate::error::from_driver("cuEventRecord", e))
        }) {
            Ok(((), ev)) => {
                let raw = ev.cu_event();
                g.pending.push_back((covered, ev));
                (false, Some(raw))
            }
            Err(r) => {
                if let Some(ev) = r.kept {
                    g.free.push(ev); // not recorded: reusable
                }
                (false, None)
            }
        }
    }

    /// Whether the stream is capturing a graph (or that cannot be told).
    fn capturing(&self) -> bool {
        crate::driver::ctx::bind(self.stream.context()).is_err()
            || super::capture::is_capturing(self.stream.cu_stream()).unwrap_or(true)
    }
}

/// A fence on an epoch of a stream's [`Timeline`]: complete once all work queued on the stream
/// before the fence was made has finished. Cheap to make (no driver call) and to clone.
#[derive(Debug, Clone)]
pub struct StreamFence {
    timeline: Arc<Timeline>,
    epoch: u64,
}

impl StreamFence {
    /// The epoch this fence waits for.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The stream's timeline.
    pub fn timeline(&self) -> &Arc<Timeline> {
        &self.timeline
    }
}

impl Fence for StreamFence {
    fn is_complete(&self) -> bool {
        self.timeline.completed() >= self.epoch || self.timeline.poll(self.epoch).0
    }

    fn wait_timeout(&self, timeout: Duration) -> bool {
        if self.timeline.completed() >= self.epoch {
            return true;
        }
        if timeout >= LONG_WAIT {
            let tl = &self.timeline;
            if tl.capturing() {
                // cuStreamSynchronize is illegal on a capturing stream (and would invalidate the
                // user's capture). Wait on an event recorded before the capture, if one covers
                // the epoch; without one, completion cannot be observed now: answer `false` (the
                // caller gets an error and the resources stay parked, freed by a later reap once
                // the capture has ended) rather than waiting for a capture that this very thread
                // may be holding open.
                let mut backoff = Backoff::new();
                loop {
                    match tl.poll(self.epoch) {
                        (true, _) => return true,
                        (false, None) => return false,
                        (false, Some(_)) => {}
                    }
                    if !tl.capturing() {
                        break; // the capture ended: synchronize below
                    }
                    backoff.snooze();
                }
            }
            // Unbounded wait: one cuStreamSynchronize (what a hand-written loop would do) covers
            // every epoch issued before it, including this one.
            // If it fails (a sticky error, or a capture that began just now), completion cannot
            // be proven: answer `false` (the caller gets an error, the resources stay parked)
            // instead of polling forever.
            let covered = self.timeline.issued.load(Ordering::Acquire);
            if crate::driver::ctx::bind(tl.stream.context()).is_err() {
                return tl.completed() >= self.epoch;
            }
            // SAFETY: a live stream (the timeline holds it), its context current.
            let r = unsafe { crate::driver::stream::synchronize(tl.stream.cu_stream()) };
            if r.is_ok() {
                tl.completed.fetch_max(covered, Ordering::AcqRel);
                return true;
            }
            return tl.completed() >= self.epoch;
        }
        poll_until(|| self.is_complete(), timeout)
    }
}
