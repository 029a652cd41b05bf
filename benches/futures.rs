//! What awaiting CUDA work costs against blocking on it, one GPU, all in the same run.
//!
//! The operation is tiny on purpose (a 4-byte device-to-device copy), so that what is measured
//! is the wait, not the work. `FUTURES_BENCH_N` round trips per variant (default and minimum
//! 10,000), in rounds of blocks of 100: each round runs every variant's block with a block of the
//! baseline before and after it, and a variant's round ratio is its block's median over the mean
//! of those two baseline medians (paired rounds, docs/benches.md). A cell's figure is the median
//! round ratio with its 95% interval; `ratio` is the plain ratio of the medians of all round
//! trips, as earlier versions of this bench printed.
//!
//! - `cuEventSynchronize`: raw `cuMemcpyDtoDAsync_v2` + `cuEventRecord` + `cuEventSynchronize`
//!   (the baseline every ratio is against);
//! - `InFlight::wait`: `copy_async(..).wait()` (a stream fence: `cuStreamSynchronize`);
//! - `await stream fence`: `copy_async(..).await` (the completion thread queries the stream's
//!   event);
//! - `await event fence`: the raw copy, then an `EventFence` awaited (the completion thread
//!   queries that event); target at most 1.2x;
//! - `await host fn`: the raw copy, then a `HostFnFence` awaited (the host function wakes the
//!   future); target at most 1.2x;
//! - the three awaits again with `spin(100 µs)` (`InFlightFuture::spin`: the future asks its
//!   fence in a loop before it registers for a wake-up, as `cuEventSynchronize` spins); target
//!   at most 1.2x for the event and host-function ones;
//! - three raw decompositions with no gpudirect code: `cuLaunchHostFunc` after the copy with the
//!   caller spinning on the flag its callback sets (the driver's host-function path alone); the
//!   same with the caller parked and the callback unparking it (that path and one thread
//!   hand-off: the floor of any await woken by a host function); and the event recorded after
//!   the copy, queried in a loop by another thread that unparks the parked caller (the floor of
//!   any await woken by a thread that polls).
//!
//! Then the cost of each wake-up source per operation, paid when the operation is issued
//! (median of N): a stream fence (an epoch: one atomic add), an event fence (`cuEventCreate` +
//! `cuEventRecord`, and `cuEventDestroy` as it is dropped), a host function (`cuLaunchHostFunc`
//! and its payload); and 1,000 tiny copies in flight at once, each awaited by its own task,
//! against the same copies and one `cuStreamSynchronize`, in `FUTURES_BENCH_ROUNDS` paired rounds
//! (raw, awaited, raw; default 30); target at most 1.1x; the same with each await spinning
//! 20 µs first (`InFlightFuture::spin`); beside them the raw copies with an empty
//! task spawned and awaited per copy (the floor of a task per operation), the copies through
//! `copy_async` waited for once (the issue path alone), the raw copies with a task per copy
//! woken from another thread once the stream finished (the floor of a task per operation woken
//! at completion), the same woken while the copies are still being queued (each as soon as it
//! is queued, or once an event that another thread records and queries in a loop completed
//! behind it: the library's method with no gpudirect code), and the raw copies while another
//! thread queries an event on their stream in
//! a loop, does so sleeping 20 µs between queries, or only yields (what a thread that polls
//! costs the thread queueing). The awaits run on a multi-threaded tokio runtime (2 workers). Without a GPU it prints `SKIPPED: reason`. A run takes a few
//! seconds.
//!
//! `FUTURES_BENCH_LOOP=awaited` (or `woken`: the raw copies with a task per copy woken at
//! completion) instead runs the 1,000 awaited copies alone, again and again for 4 seconds once
//! the round trips above are done, prints the microseconds a run and exits: a loop for a
//! profiler (docs/benches.md profiles it with `perf record -e cpu-clock -g`).

use gpudirect::completion::{EventFence, InFlight};
use gpudirect::cuda::Stream;
use gpudirect::cudarc::driver::sys;
use gpudirect::memory::{DeviceBuffer, DeviceMemory, copy_async};
use gpudirect_testing::paired::{self, Summary};
use gpudirect_testing::{Hardware, skip_example};
use std::future::IntoFuture;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

fn ok(call: &'static str, r: sys::CUresult) {
    r.result()
        .map_err(|e| gpudirect::Error::cuda(call, e.0))
        .unwrap();
}

/// A new event without timing, in the context current on this thread (the caller's to destroy).
fn new_event() -> sys::CUevent {
    let mut ev: sys::CUevent = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the caller made the context current.
    ok("cuEventCreate", unsafe {
        sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
    });
    ev
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn us(s: f64) -> String {
    format!("{:>10.2} us", s * 1e6)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    EventSync,
    Wait,
    AwaitStream,
    AwaitEvent,
    AwaitHostFn,
    AwaitStreamSpin,
    AwaitEventSpin,
    AwaitHostFnSpin,
    RawHostFnSpin,
    RawHostFnPark,
    RawQueryPark,
}

/// The variants, their names, and the target of those that have one (at most this ratio).
const VARIANTS: [(Variant, &str, Option<f64>); 11] = [
    (Variant::EventSync, "cuEventSynchronize", None),
    (Variant::Wait, "InFlight::wait", None),
    (Variant::AwaitStream, "await stream fence", None),
    (Variant::AwaitEvent, "await event fence", Some(1.2)),
    (Variant::AwaitHostFn, "await host fn", Some(1.2)),
    (Variant::AwaitStreamSpin, "await stream fence, spin", None),
    (
        Variant::AwaitEventSpin,
        "await event fence, spin",
        Some(1.2),
    ),
    (Variant::AwaitHostFnSpin, "await host fn, spin", Some(1.2)),
    (Variant::RawHostFnSpin, "raw: host fn, caller spins", None),
    (Variant::RawHostFnPark, "raw: host fn unparks caller", None),
    (Variant::RawQueryPark, "raw: query thread unparks", None),
];

/// The spin of the `, spin` variants ([`InFlightFuture::spin`](gpudirect::completion::InFlightFuture::spin)).
const SPIN: std::time::Duration = std::time::Duration::from_micros(100);

/// The spin of each await in the second run of the 1,000 awaited copies.
const CONCURRENT_SPIN: std::time::Duration = std::time::Duration::from_micros(20);

/// `awaited_many`'s argument for the copies through `copy_async` without tasks or awaits.
const NO_TASKS: std::time::Duration = std::time::Duration::MAX;

/// What another thread does beside the raw 1,000 copies, with no gpudirect code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Beside {
    /// Queries an event on the copies' stream in a loop, yielding between, and records it again
    /// once it completed (what the completion thread does for the copies' futures).
    Queries,
    /// The same, sleeping 20 µs between queries.
    QueriesSleeping,
    /// Only yields in a loop (a busy thread that asks the driver nothing).
    Yields,
}

const BESIDE: [(Beside, &str); 3] = [
    (
        Beside::Queries,
        "another thread queries (and records again) an event on the stream in a loop",
    ),
    (
        Beside::QueriesSleeping,
        "another thread does the same, sleeping 20 us between queries",
    ),
    (Beside::Yields, "another thread only yields in a loop"),
];

/// The target for 1,000 awaited copies: at most this ratio over the raw copies.
const CONCURRENT_TARGET: f64 = 1.1;

/// Set by the raw host functions; the caller parked in `RawHostFnPark` is `CALLER`.
static CALLBACK_RAN: AtomicBool = AtomicBool::new(false);
static CALLER: OnceLock<std::thread::Thread> = OnceLock::new();

/// A raw host function: sets the flag (the caller spins on it).
unsafe extern "C" fn set_flag(_: *mut std::ffi::c_void) {
    CALLBACK_RAN.store(true, Ordering::Release);
}

/// A raw host function: sets the flag and unparks the caller.
unsafe extern "C" fn set_flag_and_unpark(_: *mut std::ffi::c_void) {
    CALLBACK_RAN.store(true, Ordering::Release);
    if let Some(t) = CALLER.get() {
        t.unpark();
    }
}

/// What the query thread of `RawQueryPark` is asked to do.
const IDLE: u8 = 0;
const QUERY: u8 = 1;
const DONE: u8 = 2;
const QUIT: u8 = 3;

/// A thread that, told to, queries `ev` until it completes, then unparks the caller: the raw
/// shape of a completion thread (it spins between requests, as one does while work is pending).
struct QueryThread {
    state: Arc<AtomicU8>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl QueryThread {
    fn start(ctx: &Arc<gpudirect::cudarc::driver::CudaContext>, ev: usize) -> Self {
        let state = Arc::new(AtomicU8::new(IDLE));
        let (st, ctx) = (state.clone(), ctx.clone());
        let caller = std::thread::current();
        let handle = std::thread::spawn(move || {
            ctx.bind_to_thread().unwrap();
            loop {
                match st.load(Ordering::Acquire) {
                    QUERY => {
                        // SAFETY: a live event, its context current.
                        while unsafe { sys::cuEventQuery(ev as sys::CUevent) }
                            == sys::CUresult::CUDA_ERROR_NOT_READY
                        {}
                        st.store(DONE, Ordering::Release);
                        caller.unpark();
                    }
                    QUIT => return,
                    _ => std::hint::spin_loop(),
                }
            }
        });
        QueryThread {
            state,
            handle: Some(handle),
        }
    }
}

impl Drop for QueryThread {
    fn drop(&mut self) {
        self.state.store(QUIT, Ordering::Release);
        if let Some(h) = self.handle.take() {
            h.join().unwrap();
        }
    }
}

fn main() {
    let ctx = match gpudirect::cuda::context(0) {
        Ok(c) => c,
        Err(e) => skip_example(Hardware::Gpu, e),
    };
    let n: usize = std::env::var("FUTURES_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000usize)
        .max(10_000)
        .div_ceil(100)
        * 100;
    let conc_rounds: usize = std::env::var("FUTURES_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30usize)
        .max(6);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let cs = stream.cu_stream();
    let mut a = Some(DeviceBuffer::<u32>::zeroed(&ctx, 1).unwrap());
    let mut b = Some(DeviceBuffer::<u32>::zeroed(&ctx, 1).unwrap());
    let (pa, pb) = (
        a.as_ref().unwrap().device_ptr(),
        b.as_ref().unwrap().device_ptr(),
    );
    ctx.bind_to_thread().unwrap();
    let ev = new_event();
    CALLER.set(std::thread::current()).unwrap();
    // SAFETY (for every raw copy below): two live 4-byte buffers, alive for the whole bench; the
    // gpudirect variants hold them in between, and each variant's copy has completed before the
    // next one starts.
    let raw_copy = || {
        ok("cuMemcpyDtoDAsync_v2", unsafe {
            sys::cuMemcpyDtoDAsync_v2(pb, pa, 4, cs)
        })
    };
    let mut query_thread: Option<QueryThread> = None;

    let mut one = |v: Variant, query_thread: &mut Option<QueryThread>| -> f64 {
        let t = Instant::now();
        match v {
            Variant::EventSync => {
                raw_copy();
                // SAFETY: a live event and stream.
                unsafe {
                    ok("cuEventRecord", sys::cuEventRecord(ev, cs));
                    ok("cuEventSynchronize", sys::cuEventSynchronize(ev));
                }
            }
            Variant::Wait => {
                let op = copy_async(&stream, a.take().unwrap(), b.take().unwrap()).unwrap();
                let (s, d) = op.wait().unwrap();
                a = Some(s);
                b = Some(d);
            }
            Variant::AwaitStream => {
                let op = copy_async(&stream, a.take().unwrap(), b.take().unwrap()).unwrap();
                let (s, d) = rt.block_on(op.into_future()).unwrap();
                a = Some(s);
                b = Some(d);
            }
            Variant::AwaitEvent => {
                raw_copy();
                let op = InFlight::new("event", EventFence::record(stream.cuda()).unwrap(), ());
                rt.block_on(op.into_future()).unwrap();
            }
            Variant::AwaitHostFn => {
                raw_copy();
                let op = InFlight::new("host fn", stream.host_fence().unwrap(), ());
                rt.block_on(op.into_future()).unwrap();
            }
            Variant::AwaitStreamSpin => {
                let op = copy_async(&stream, a.take().unwrap(), b.take().unwrap()).unwrap();
                let (s, d) = rt.block_on(op.spin(SPIN)).unwrap();
                a = Some(s);
                b = Some(d);
            }
            Variant::AwaitEventSpin => {
                raw_copy();
                let op = InFlight::new("event", EventFence::record(stream.cuda()).unwrap(), ());
                rt.block_on(op.spin(SPIN)).unwrap();
            }
            Variant::AwaitHostFnSpin => {
                raw_copy();
                let op = InFlight::new("host fn", stream.host_fence().unwrap(), ());
                rt.block_on(op.spin(SPIN)).unwrap();
            }
            Variant::RawHostFnSpin | Variant::RawHostFnPark => {
                let park = v == Variant::RawHostFnPark;
                CALLBACK_RAN.store(false, Ordering::Release);
                raw_copy();
                let f = if park { set_flag_and_unpark } else { set_flag };
                // SAFETY: a live stream; the callback touches only statics.
                ok("cuLaunchHostFunc", unsafe {
                    sys::cuLaunchHostFunc(cs, Some(f), std::ptr::null_mut())
                });
                while !CALLBACK_RAN.load(Ordering::Acquire) {
                    if park {
                        std::thread::park();
                    } else {
                        std::hint::spin_loop();
                    }
                }
            }
            Variant::RawQueryPark => {
                let q = query_thread.get_or_insert_with(|| QueryThread::start(&ctx, ev as usize));
                raw_copy();
                // SAFETY: a live event and stream.
                ok("cuEventRecord", unsafe { sys::cuEventRecord(ev, cs) });
                q.state.store(QUERY, Ordering::Release);
                while q.state.load(Ordering::Acquire) != DONE {
                    std::thread::park();
                }
                q.state.store(IDLE, Ordering::Release);
            }
        }
        t.elapsed().as_secs_f64()
    };
    // A block of 100 of `v`: its round trips are kept, its median returned. The query thread
    // spins only during its own variant's blocks.
    let mut block = |v: Variant, all: &mut Vec<f64>| -> f64 {
        let mut t: Vec<f64> = (0..100).map(|_| one(v, &mut query_thread)).collect();
        if v == Variant::RawQueryPark {
            query_thread = None;
        }
        all.extend_from_slice(&t);
        median(&mut t)
    };
    // Warm-up: one block of each (starts the completion thread, fills the event pools).
    let mut scratch = Vec::new();
    for (v, _, _) in VARIANTS {
        block(v, &mut scratch);
    }
    let mut times: Vec<Vec<f64>> = vec![Vec::with_capacity(n); VARIANTS.len()];
    let mut rounds: Vec<Vec<f64>> = vec![Vec::with_capacity(n / 100); VARIANTS.len()];
    for _round in 0..n / 100 {
        let mut before = block(Variant::EventSync, &mut times[0]);
        for (vi, (v, _, _)) in VARIANTS.iter().enumerate().skip(1) {
            let ours = block(*v, &mut times[vi]);
            let after = block(Variant::EventSync, &mut times[0]);
            rounds[vi].push(paired::ratio(before, ours, after));
            before = after;
        }
    }
    let medians: Vec<f64> = times.iter_mut().map(|v| median(v)).collect();

    // What each wake-up source costs when the operation is issued.
    stream.synchronize().unwrap();
    let issue = |f: &mut dyn FnMut()| {
        let mut v = Vec::with_capacity(n);
        for i in 0..n {
            let t = Instant::now();
            f();
            v.push(t.elapsed().as_secs_f64());
            if i % 1000 == 999 {
                stream.synchronize().unwrap();
            }
        }
        stream.synchronize().unwrap();
        median(&mut v)
    };
    let issue_stream = issue(&mut || drop(std::hint::black_box(stream.fence())));
    let issue_event = issue(&mut || {
        drop(std::hint::black_box(
            EventFence::record(stream.cuda()).unwrap(),
        ))
    });
    let issue_host = issue(&mut || drop(std::hint::black_box(stream.host_fence().unwrap())));
    // Host functions parked their payloads: free them now, outside any measurement.
    gpudirect::completion::Tracker::global().reap();

    // 1,000 operations in flight at once, each awaited by its own task.
    const CONCURRENT: usize = 1000;
    let srcs: Vec<DeviceBuffer<u32>> = (0..CONCURRENT)
        .map(|_| DeviceBuffer::zeroed(&ctx, 1).unwrap())
        .collect();
    let mut dsts: Vec<DeviceBuffer<u32>> = (0..CONCURRENT)
        .map(|_| DeviceBuffer::zeroed(&ctx, 1).unwrap())
        .collect();
    let src_ptrs: Vec<u64> = srcs.iter().map(|s| s.device_ptr()).collect();
    let dst_ptrs: Vec<u64> = dsts.iter().map(|d| d.device_ptr()).collect();
    let mut srcs = Some(srcs);
    let raw_many = || {
        let t = Instant::now();
        for (s, d) in src_ptrs.iter().zip(&dst_ptrs) {
            // SAFETY: live 4-byte buffers, no other work on them in flight.
            ok("cuMemcpyDtoDAsync_v2", unsafe {
                sys::cuMemcpyDtoDAsync_v2(*d, *s, 4, cs)
            });
        }
        // SAFETY: a live stream.
        ok("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(cs)
        });
        t.elapsed().as_secs_f64()
    };
    // The raw copies with another thread busy beside them (its start and end not timed).
    let raw_beside = |what: Beside| {
        let stop = Arc::new(AtomicBool::new(false));
        let qev = new_event();
        // SAFETY: a live event of the context current on this thread; a live stream.
        ok("cuEventRecord", unsafe { sys::cuEventRecord(qev, cs) });
        let (st, c, qe, s) = (stop.clone(), ctx.clone(), qev as usize, cs as usize);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let helper = std::thread::spawn(move || {
            c.bind_to_thread().unwrap();
            ready_tx.send(()).unwrap();
            while !st.load(Ordering::Acquire) {
                if what != Beside::Yields {
                    // SAFETY: a live event and stream, the context current.
                    unsafe {
                        if sys::cuEventQuery(qe as sys::CUevent) == sys::CUresult::CUDA_SUCCESS {
                            ok(
                                "cuEventRecord",
                                sys::cuEventRecord(qe as sys::CUevent, s as sys::CUstream),
                            );
                        }
                    }
                }
                if what == Beside::QueriesSleeping {
                    std::thread::sleep(std::time::Duration::from_micros(20));
                } else {
                    std::thread::yield_now();
                }
            }
        });
        ready_rx.recv().unwrap();
        let took = raw_many();
        stop.store(true, Ordering::Release);
        helper.join().unwrap();
        // SAFETY: a live stream; then the event is idle.
        unsafe {
            ok("cuStreamSynchronize", sys::cuStreamSynchronize(cs));
            sys::cuEventDestroy_v2(qev);
        }
        took
    };
    // The raw copies with one task spawned and awaited per copy (the tasks do nothing): the
    // floor of any "a task awaits each operation" shape, with no gpudirect code.
    let raw_tasks = || {
        let t = Instant::now();
        rt.block_on(async {
            let mut tasks = Vec::with_capacity(CONCURRENT);
            for (s, d) in src_ptrs.iter().zip(&dst_ptrs) {
                // SAFETY: live 4-byte buffers, no other work on them in flight.
                ok("cuMemcpyDtoDAsync_v2", unsafe {
                    sys::cuMemcpyDtoDAsync_v2(*d, *s, 4, cs)
                });
                tasks.push(tokio::spawn(async {}));
            }
            for t in tasks {
                t.await.unwrap();
            }
        });
        // SAFETY: a live stream.
        ok("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(cs)
        });
        t.elapsed().as_secs_f64()
    };
    // The raw copies, a task per copy awaiting a oneshot channel that another thread fires
    // once the stream has finished (`cuStreamSynchronize`): the floor of any "a task per
    // operation, woken from another thread at completion" shape, with no gpudirect code.
    let raw_woken = || {
        let t = Instant::now();
        rt.block_on(async {
            let mut tasks = Vec::with_capacity(CONCURRENT);
            let mut fire = Vec::with_capacity(CONCURRENT);
            for (s, d) in src_ptrs.iter().zip(&dst_ptrs) {
                // SAFETY: live 4-byte buffers, no other work on them in flight.
                ok("cuMemcpyDtoDAsync_v2", unsafe {
                    sys::cuMemcpyDtoDAsync_v2(*d, *s, 4, cs)
                });
                let (tx, rx) = tokio::sync::oneshot::channel::<()>();
                fire.push(tx);
                tasks.push(tokio::spawn(async move { rx.await.unwrap() }));
            }
            let (c, s) = (ctx.clone(), cs as usize);
            let firing = std::thread::spawn(move || {
                c.bind_to_thread().unwrap();
                // SAFETY: a live stream, its context current.
                ok("cuStreamSynchronize", unsafe {
                    sys::cuStreamSynchronize(s as sys::CUstream)
                });
                for tx in fire {
                    tx.send(()).unwrap();
                }
            });
            for t in tasks {
                t.await.unwrap();
            }
            firing.join().unwrap();
        });
        t.elapsed().as_secs_f64()
    };
    // The raw copies, a task per copy awaiting a oneshot channel that another thread fires as
    // the copies are still being queued: `polled` false, each as soon as it is queued (no
    // driver call on that thread: what the wake-ups alone cost the queueing thread); `polled`
    // true, once an event recorded after it completed (the thread queries the event in a loop
    // and records it again once complete, as the completion thread does: the library's method
    // with no gpudirect code).
    let raw_woken_live = |polled: bool| {
        let t = Instant::now();
        rt.block_on(async {
            let mut tasks = Vec::with_capacity(CONCURRENT);
            let (fire_tx, fire_rx) = std::sync::mpsc::channel::<tokio::sync::oneshot::Sender<()>>();
            let (c, s) = (ctx.clone(), cs as usize);
            let firing = std::thread::spawn(move || {
                c.bind_to_thread().unwrap();
                let qev = new_event();
                let (mut queued, mut covered) = (Vec::new(), 0usize);
                let mut open = true;
                while open || !queued.is_empty() {
                    loop {
                        match fire_rx.try_recv() {
                            Ok(tx) => queued.push(tx),
                            Err(std::sync::mpsc::TryRecvError::Empty) => break,
                            Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                                open = false;
                                break;
                            }
                        }
                    }
                    if !polled {
                        for tx in queued.drain(..) {
                            let _ = tx.send(());
                        }
                    } else if covered == 0 {
                        if !queued.is_empty() {
                            // Every copy of those received was queued before its sender was sent.
                            covered = queued.len();
                            // SAFETY: a live event and stream, the context current.
                            ok("cuEventRecord", unsafe {
                                sys::cuEventRecord(qev, s as sys::CUstream)
                            });
                        }
                    // SAFETY: a live event, the context current.
                    } else if unsafe { sys::cuEventQuery(qev) } == sys::CUresult::CUDA_SUCCESS {
                        for tx in queued.drain(..covered) {
                            let _ = tx.send(());
                        }
                        covered = 0;
                    }
                    std::thread::yield_now();
                }
                // SAFETY: idle: its last record completed (or it was never recorded).
                unsafe {
                    ok(
                        "cuStreamSynchronize",
                        sys::cuStreamSynchronize(s as sys::CUstream),
                    );
                    sys::cuEventDestroy_v2(qev);
                }
            });
            for (s, d) in src_ptrs.iter().zip(&dst_ptrs) {
                // SAFETY: live 4-byte buffers, no other work on them in flight.
                ok("cuMemcpyDtoDAsync_v2", unsafe {
                    sys::cuMemcpyDtoDAsync_v2(*d, *s, 4, cs)
                });
                let (tx, rx) = tokio::sync::oneshot::channel::<()>();
                fire_tx.send(tx).unwrap();
                tasks.push(tokio::spawn(async move { rx.await.unwrap() }));
            }
            drop(fire_tx);
            for t in tasks {
                t.await.unwrap();
            }
            firing.join().unwrap();
        });
        // SAFETY: a live stream.
        ok("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(cs)
        });
        t.elapsed().as_secs_f64()
    };
    // `spin`: each task's await spins that long first (`InFlightFuture::spin`; zero: none).
    let mut awaited_many = |spin: std::time::Duration| {
        let ss = srcs.take().unwrap();
        let ds = std::mem::take(&mut dsts);
        let t = Instant::now();
        if spin == NO_TASKS {
            let ops: Vec<_> = ss
                .into_iter()
                .zip(ds)
                .map(|(s, d)| copy_async(&stream, s, d).unwrap())
                .collect();
            let back: Vec<_> = ops.into_iter().map(|op| op.wait().unwrap()).collect();
            let took = t.elapsed().as_secs_f64();
            let (ss, ds): (Vec<_>, Vec<_>) = back.into_iter().unzip();
            srcs = Some(ss);
            dsts = ds;
            return took;
        }
        let back = rt.block_on(async {
            let tasks: Vec<_> = ss
                .into_iter()
                .zip(ds)
                .map(|(s, d)| {
                    let op = copy_async(&stream, s, d).unwrap();
                    tokio::spawn(async move { op.spin(spin).await.unwrap() })
                })
                .collect();
            let mut back = Vec::with_capacity(CONCURRENT);
            for t in tasks {
                back.push(t.await.unwrap());
            }
            back
        });
        let took = t.elapsed().as_secs_f64();
        let (ss, ds): (Vec<_>, Vec<_>) = back.into_iter().unzip();
        srcs = Some(ss);
        dsts = ds;
        took
    };
    if let Ok(what) = std::env::var("FUTURES_BENCH_LOOP") {
        let t0 = Instant::now();
        let (mut runs, mut took) = (0usize, 0.0);
        while t0.elapsed().as_secs_f64() < 4.0 {
            took += match what.as_str() {
                "woken" => raw_woken(),
                _ => awaited_many(std::time::Duration::ZERO),
            };
            runs += 1;
        }
        let us = took * 1e6 / runs as f64;
        println!("{what} in a loop: {us:.1} us a run of {CONCURRENT} copies");
        return;
    }
    awaited_many(std::time::Duration::ZERO); // warm-up
    let mut conc_await = Vec::new();
    let mut conc_raw = Vec::new();
    let mut conc_rounds_ratio = Vec::new();
    let mut spin_rounds_ratio = Vec::new();
    let mut tasks_rounds_ratio = Vec::new();
    let mut issue_ratio = Vec::new();
    let mut woken_ratio = Vec::new();
    let mut live_ratio = [Vec::new(), Vec::new()];
    let mut beside_ratio: Vec<Vec<f64>> = vec![Vec::new(); BESIDE.len()];
    let mut before = raw_many();
    conc_raw.push(before);
    for _ in 0..conc_rounds {
        let ours = awaited_many(std::time::Duration::ZERO);
        let after = raw_many();
        conc_rounds_ratio.push(paired::ratio(before, ours, after));
        conc_await.push(ours);
        conc_raw.push(after);
        let spun = awaited_many(CONCURRENT_SPIN);
        let after1 = raw_many();
        spin_rounds_ratio.push(paired::ratio(after, spun, after1));
        conc_raw.push(after1);
        let tasks = raw_tasks();
        let after2 = raw_many();
        tasks_rounds_ratio.push(paired::ratio(after1, tasks, after2));
        conc_raw.push(after2);
        let issued = awaited_many(NO_TASKS);
        let after3 = raw_many();
        issue_ratio.push(paired::ratio(after2, issued, after3));
        conc_raw.push(after3);
        let woken = raw_woken();
        let mut prev = raw_many();
        woken_ratio.push(paired::ratio(after3, woken, prev));
        conc_raw.push(prev);
        for (i, polled) in [false, true].into_iter().enumerate() {
            let live = raw_woken_live(polled);
            let after = raw_many();
            live_ratio[i].push(paired::ratio(prev, live, after));
            conc_raw.push(after);
            prev = after;
        }
        for (i, (what, _)) in BESIDE.iter().enumerate() {
            let beside = raw_beside(*what);
            let after = raw_many();
            beside_ratio[i].push(paired::ratio(prev, beside, after));
            conc_raw.push(after);
            prev = after;
        }
        before = prev;
    }
    let (conc_await, conc_raw) = (median(&mut conc_await), median(&mut conc_raw));
    // SAFETY: the event is idle (its last record was synchronized).
    unsafe { sys::cuEventDestroy_v2(ev) };

    let base = medians[0];
    println!();
    println!(
        "awaiting a 4-byte copy: {n} round trips per variant in {} paired rounds (ratio: of the \
         medians; paired: each round's block median over the mean of cuEventSynchronize's blocks \
         before and after it, median [95% interval] (lowest..highest) rounds)",
        n / 100
    );
    println!(
        "{:<28} {:>13} {:>7}  {:<34} {:>6} {:>9}",
        "wait", "latency", "ratio", "paired", "target", "verdict"
    );
    for (((_, name, target), m), r) in VARIANTS.iter().zip(&medians).zip(&rounds) {
        let paired = Summary::of(r);
        println!(
            "{name:<28} {} {:>7.3}  {:<34} {:>6} {:>9}",
            us(*m),
            m / base,
            paired.map_or_else(|| "-".to_string(), |s| s.to_string()),
            target.map_or_else(String::new, |t| format!("<={t:.2}")),
            match (target, paired) {
                (Some(t), Some(s)) => s.at_most(*t).to_string(),
                _ => String::new(),
            }
        );
    }
    println!(
        "(raw rows: no gpudirect code; 'host fn, caller spins' is the driver's host-function path \
         alone, 'host fn unparks caller' adds one thread hand-off, 'query thread unparks' is a \
         thread polling the event and waking the parked caller)"
    );
    println!();
    println!("wake-up source, issued per operation (median of {n})");
    println!("{:<24} {:>13}  woken by", "source", "issue");
    for (name, cost, by) in [
        (
            "stream fence",
            issue_stream,
            "completion thread: one cuEventQuery per stream per round, events recorded lazily",
        ),
        (
            "event fence",
            issue_event,
            "completion thread: one cuEventQuery per fence per round",
        ),
        (
            "host fn",
            issue_host,
            "the host function itself (CUDA's callback thread)",
        ),
    ] {
        println!("{name:<24} {}  {by}", us(cost));
    }
    println!();
    let conc = Summary::of(&conc_rounds_ratio).expect("rounds measured");
    println!(
        "{CONCURRENT} copies in flight, each awaited by a task: {} total ({:.2} us per op); raw copies + one cuStreamSynchronize: {} ({:.2} us per op); ratio {:.3}",
        us(conc_await),
        conc_await / CONCURRENT as f64 * 1e6,
        us(conc_raw),
        conc_raw / CONCURRENT as f64 * 1e6,
        conc_await / conc_raw
    );
    println!(
        "{CONCURRENT} copies awaited, paired (awaited over the mean of the raw runs before and after it): {conc} against <={CONCURRENT_TARGET:.2}: {}",
        conc.at_most(CONCURRENT_TARGET)
    );
    let spun = Summary::of(&spin_rounds_ratio).expect("rounds measured");
    println!(
        "{CONCURRENT} copies awaited, each await with spin({} us), paired the same way: {spun} against <={CONCURRENT_TARGET:.2}: {}",
        CONCURRENT_SPIN.as_micros(),
        spun.at_most(CONCURRENT_TARGET)
    );
    println!(
        "raw: the same copies with a task spawned and awaited per copy (no gpudirect code), paired the same way: {}",
        Summary::of(&tasks_rounds_ratio).expect("rounds measured")
    );
    println!(
        "copy_async: the same copies, waited for once at the end (no task, no await), paired the same way: {}",
        Summary::of(&issue_ratio).expect("rounds measured")
    );
    println!(
        "raw: the same copies with a task per copy woken from another thread when the stream has finished (no gpudirect code), paired the same way: {}",
        Summary::of(&woken_ratio).expect("rounds measured")
    );
    for (name, r) in [
        "woken from another thread as each is queued, while the rest are queued (no driver call on that thread)",
        "woken from another thread that queries an event in a loop and records it again once complete, once one recorded after the copy completed (the library's method)",
    ]
    .iter()
    .zip(&live_ratio)
    {
        println!(
            "raw: the same copies with a task per copy {name} (no gpudirect code), paired the same way: {}",
            Summary::of(r).expect("rounds measured")
        );
    }
    for ((_, name), r) in BESIDE.iter().zip(&beside_ratio) {
        println!(
            "raw: the same copies while {name} (no gpudirect code), paired the same way: {}",
            Summary::of(r).expect("rounds measured")
        );
    }
    drop((srcs, dsts));
}
