//! Completion: what every asynchronous path of the crate rests on.
//!
//! An asynchronous operation returns an [`InFlight`] that owns everything the operation may still
//! touch. [`InFlight::wait`] gives the resources back once its [`Fence`] reports completion.
//! Dropping an `InFlight` waits a bounded time ([`DROP_WAIT`]); if completion still cannot be
//! proven the resources are parked in the process-wide [`Tracker`] and freed by a later
//! [`Tracker::reap`] after the fence completes, or never. `mem::forget` of an `InFlight` leaks
//! the resources, which is safe. One tracker serves CUDA work, cuFile and verbs.
//!
//! Fences:
//! - [`StreamFence`] (from [`crate::cuda::Stream::fence`]): amortised per-stream epochs of a
//!   [`Timeline`]. Issuing costs one atomic increment; a CUDA event is recorded only when someone
//!   asks whether the work is done, and one event answers for every earlier epoch of that stream.
//! - [`EventFence`]: one CUDA event recorded now (`cuEventRecord`), polled with `cuEventQuery`.
//! - [`HostFnFence`]: a host callback (`cuLaunchHostFunc`) that sets a [`CompletionFlag`]; the
//!   callback makes no CUDA calls and frees nothing (what it owned is freed by [`Tracker::reap`]).
//! - [`CompletionFlag`]: set by whoever observes completion (a polled work completion, an I/O
//!   thread); [`Outcome`]: the same, carrying the operation's result (set through its
//!   [`OutcomeSender`]); [`Done`]: complete from the start.
//!
//! Work is queued on a CUDA stream only through the graph-capture check of this module (a
//! capturing stream is refused, see [`crate::cuda`]), so that a fence never completes before the
//! work it stands for.
//!
//! # Awaiting
//!
//! Every `InFlight` is a future ([`IntoFuture`]): `op.await` gives the
//! resources back once the work has completed, `op.with_outcome().await` gives them with the
//! operation's result (for an [`Outcome`] fence). Nothing here needs a particular runtime: wake-ups
//! go through [`std::task::Waker`], and there is no `block_on` in the library (the blocking
//! calls stay for code that is not async).
//!
//! ```no_run
//! # async fn demo(stream: &gpudirect::cuda::Stream,
//! #     src: gpudirect::memory::DeviceBuffer<u32>, dst: gpudirect::memory::DeviceBuffer<u32>)
//! #     -> gpudirect::Result<()> {
//! use std::time::Duration;
//! let op = gpudirect::memory::copy_async(stream, src, dst)?;
//! let (src, dst) = op.timeout(Duration::from_millis(500)).await?; // or `op.await?`
//! # let _ = (src, dst); Ok(()) }
//! ```
//!
//! **Wake-up sources.** A future is woken by the completion source itself, never by a task
//! that polls in a loop ([`Fence::register_waker`]), unless it is told to spin first
//! ([`InFlightFuture::spin`]: it asks its fence in a loop for up to that long, at most 1 ms,
//! before it registers, and so sees quick work complete without a thread hand-off):
//!
//! | fence | woken by | cost per operation |
//! | --- | --- | --- |
//! | [`CompletionFlag`], [`Outcome`] | [`set`](CompletionFlag::set) / [`send`](OutcomeSender::send), on the setter's thread | a waker clone kept in the flag |
//! | [`HostFnFence`] | the host function, on CUDA's callback thread, the moment the stream passes it | `cuLaunchHostFunc` and a small allocation at issue; the callback wakes by reference, makes no CUDA call and drops no waker |
//! | [`StreamFence`] | the completion thread: one `cuEventQuery` per stream per round, however many futures wait on that stream | nothing at issue (an epoch); the completion thread records one `cuEventRecord` (recycled event) when no event is pending on the stream (a future's first poll only asks the pending events, and while the thread watches the stream a poll asks the driver nothing); a waker clone in the stream's list |
//! | [`EventFence`], your own fences | the completion thread: one [`Fence::check`] (`cuEventQuery`) per fence per round | an `Arc` for the fence; for an event fence `cuEventCreate` + `cuEventRecord` at issue |
//!
//! The **completion thread** is one thread per process, started by the first future that needs
//! it. Each round it checks what it watches, wakes the futures whose work completed and fires
//! due deadlines; between rounds it only yields for 64 µs after anything new, then sleeps
//! 64 µs, doubling up to 1 ms; a new registration or a completion starts it over, and with
//! nothing left to watch it goes on yielding for the rest of those 64 µs (a next await finds it
//! awake), then sleeps until woken. So an await on CUDA work costs at most the current pause in
//! latency, and no CPU once nothing has been pending for 64 µs. Why both
//! sources: a host function wakes with the least latency but occupies the stream while it runs
//! and costs a launch per operation; events cost nothing per operation on a stream (one query
//! answers for every future waiting on it) but are checked at the thread's pace. `benches/futures.rs`
//! measures both against `cuEventSynchronize`. A fence you implement yourself works unchanged:
//! by default the completion thread polls its [`check`](Fence::check) (or
//! [`is_complete`](Fence::is_complete)) with that back-off; implement
//! [`register_waker`](Fence::register_waker) when your source can wake a waker itself.
//!
//! # Deadlines
//!
//! Any await can take a deadline: [`InFlight::deadline`] (an [`Instant`](std::time::Instant)) or
//! [`InFlight::timeout`] (a [`Duration`](std::time::Duration)), also on the future itself
//! ([`InFlightFuture::deadline`]). The completion thread wakes the future at the deadline; if the
//! work has not completed by then, the future ends with [`Error::Timeout`](crate::Error::Timeout)
//! naming the operation and the time waited, and the resources are parked in the [`Tracker`]
//! until the device is done with them, never freed early (the next await, `wait` or
//! [`Tracker::reap`] frees them after completion). A fence whose completion can never be seen (a
//! stream that failed with a sticky error) ends the future with that error, the resources parked
//! the same way. A [`HostFnFence`] on a stream that fails before reaching the callback is never
//! woken: give such awaits a deadline.
//!
//! # Cancellation
//!
//! Dropping a future cancels the wait, not the work. If the fence reports completion at that
//! moment, the resources are dropped there; otherwise they are parked in the [`Tracker`] at
//! once. Unlike dropping an [`InFlight`], which blocks up to [`DROP_WAIT`], a future's drop never
//! blocks: futures are dropped by executor threads (a `select!` that another branch won, an
//! aborted task, a timeout wrapper), which must not stall for seconds. A fence that panics (a
//! user's) leaks what it guards, never frees it, in every path.
//!
//! With the `tokio` feature, file-descriptor readiness goes through tokio's reactor (the
//! wake-up source of the verbs completion channel); CUDA work, cuFile and user fences need no
//! feature and no runtime.
//!
//! Fork safety: the tracker records the pid that created it; in a forked child an `InFlight` or
//! a future dropped or reaped leaks what it owns (no driver calls, no frees), and the child gets
//! a completion thread of its own.

mod backoff;
pub(crate) mod capture;
#[cfg(feature = "rdma")]
pub(crate) mod deferred;
pub(crate) mod elsewhere;
mod event_fence;
#[cfg(feature = "tokio")]
pub(crate) mod fd;
mod fence;
mod future;
mod host_fn;
mod in_flight;
#[cfg(test)]
mod proptests;
mod signal;
#[cfg(test)]
pub(crate) mod testing;
pub(crate) mod thread;
mod timeline;
mod tracker;

pub use event_fence::EventFence;
pub use fence::{CompletionFlag, Done, Fence, Outcome, OutcomeSender};
pub use future::InFlightFuture;
pub use host_fn::HostFnFence;
pub use in_flight::{DROP_WAIT, InFlight};
#[cfg(feature = "transfer")]
pub(crate) use timeline::Line;
pub use timeline::{StreamFence, Timeline};
pub use tracker::Tracker;

pub(crate) use tracker::forked;

#[allow(
    unused_imports,
    reason = "p2p's copy fence no longer polls; the pinned bounce-buffer pool does"
)]
pub(crate) use backoff::{LONG_WAIT, deadline_after, poll_until};
