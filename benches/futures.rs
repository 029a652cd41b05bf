//! What awaiting CUDA work costs against blocking on it, one GPU, all in the same run.
//!
//! The operation is tiny on purpose (a 4-byte device-to-device copy), so that what is measured
//! is the wait, not the work. Each latency is the median of `FUTURES_BENCH_N` (default and
//! minimum 10,000) round trips, the variants interleaved in blocks of 100 so that drift hits all
//! alike:
//!
//! - `cuEventSynchronize`: raw `cuMemcpyDtoDAsync_v2` + `cuEventRecord` + `cuEventSynchronize`
//!   (the baseline every ratio is against);
//! - `InFlight::wait`: `copy_async(..).wait()` (a stream fence: `cuStreamSynchronize`);
//! - `await stream fence`: `copy_async(..).await` (the completion thread queries the stream's
//!   event);
//! - `await event fence`: the raw copy, then an `EventFence` awaited (the completion thread
//!   queries that event);
//! - `await host fn`: the raw copy, then a `HostFnFence` awaited (the host function wakes the
//!   future).
//!
//! Then the cost of each wake-up source per operation, paid when the operation is issued
//! (median of N): a stream fence (an epoch: one atomic add), an event fence (`cuEventCreate` +
//! `cuEventRecord`, and `cuEventDestroy` as it is dropped), a host function (`cuLaunchHostFunc`
//! and its payload); and 1,000 tiny copies in flight at
//! once, each awaited by its own task, against the same copies and one `cuStreamSynchronize`.
//! The awaits run on a multi-threaded tokio runtime (2 workers). Without a GPU it prints
//! `SKIPPED: reason`. A run takes a few seconds.

use gpudirect::completion::{EventFence, InFlight};
use gpudirect::cuda::Stream;
use gpudirect::cudarc::driver::sys;
use gpudirect::memory::{DeviceBuffer, DeviceMemory, copy_async};
use gpudirect_testing::{Hardware, skip_example};
use std::future::IntoFuture;
use std::time::Instant;

fn ok(call: &'static str, r: sys::CUresult) {
    r.result()
        .map_err(|e| gpudirect::Error::cuda(call, e.0))
        .unwrap();
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
}

const VARIANTS: [(Variant, &str); 5] = [
    (Variant::EventSync, "cuEventSynchronize"),
    (Variant::Wait, "InFlight::wait"),
    (Variant::AwaitStream, "await stream fence"),
    (Variant::AwaitEvent, "await event fence"),
    (Variant::AwaitHostFn, "await host fn"),
];

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
    let mut ev: sys::CUevent = std::ptr::null_mut();
    ctx.bind_to_thread().unwrap();
    // SAFETY: context current; a valid out-pointer.
    ok("cuEventCreate", unsafe {
        sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
    });
    // SAFETY (for every raw copy below): two live 4-byte buffers, alive for the whole bench; the
    // gpudirect variants hold them in between, and each variant's copy has completed before the
    // next one starts.
    let raw_copy = || {
        ok("cuMemcpyDtoDAsync_v2", unsafe {
            sys::cuMemcpyDtoDAsync_v2(pb, pa, 4, cs)
        })
    };

    let mut one = |v: Variant| -> f64 {
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
        }
        t.elapsed().as_secs_f64()
    };
    // Warm-up: one block of each (starts the completion thread, fills the event pools).
    for (v, _) in VARIANTS {
        for _ in 0..100 {
            one(v);
        }
    }
    let mut times: Vec<Vec<f64>> = vec![Vec::with_capacity(n); VARIANTS.len()];
    for _block in 0..n / 100 {
        for (vi, (v, _)) in VARIANTS.iter().enumerate() {
            for _ in 0..100 {
                times[vi].push(one(*v));
            }
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
    let mut conc_await = Vec::new();
    let mut conc_raw = Vec::new();
    for _ in 0..10 {
        let ss = srcs.take().unwrap();
        let ds = std::mem::take(&mut dsts);
        let t = Instant::now();
        let back = rt.block_on(async {
            let tasks: Vec<_> = ss
                .into_iter()
                .zip(ds)
                .map(|(s, d)| {
                    let op = copy_async(&stream, s, d).unwrap();
                    tokio::spawn(async move { op.await.unwrap() })
                })
                .collect();
            let mut back = Vec::with_capacity(CONCURRENT);
            for t in tasks {
                back.push(t.await.unwrap());
            }
            back
        });
        conc_await.push(t.elapsed().as_secs_f64());
        let (ss, ds): (Vec<_>, Vec<_>) = back.into_iter().unzip();
        srcs = Some(ss);
        dsts = ds;
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
        conc_raw.push(t.elapsed().as_secs_f64());
    }
    let (conc_await, conc_raw) = (median(&mut conc_await), median(&mut conc_raw));
    // SAFETY: the event is idle (its last record was synchronized).
    unsafe { sys::cuEventDestroy_v2(ev) };

    let base = medians[0];
    println!();
    println!("awaiting a 4-byte copy, median of {n} (ratio against cuEventSynchronize)");
    println!("{:<24} {:>13} {:>8}", "wait", "latency", "ratio");
    for ((_, name), m) in VARIANTS.iter().zip(&medians) {
        println!("{name:<24} {} {:>8.3}", us(*m), m / base);
    }
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
    println!(
        "{CONCURRENT} copies in flight, each awaited by a task: {} total ({:.2} us per op); raw copies + one cuStreamSynchronize: {} ({:.2} us per op); ratio {:.3}",
        us(conc_await),
        conc_await / CONCURRENT as f64 * 1e6,
        us(conc_raw),
        conc_raw / CONCURRENT as f64 * 1e6,
        conc_await / conc_raw
    );
    drop((srcs, dsts));
}
