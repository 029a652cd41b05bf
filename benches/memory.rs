//! Memory benches (criterion), each figure beside its raw driver baseline measured in the same
//! run, with a compact table of figure, raw and ratio printed at the end:
//!
//! - H2D (pinned), D2H (pinned) and D2D bandwidth, 4 KiB to 1 GiB: `copy_async(..).wait()` against
//!   `cuMemcpy*Async` + `cuStreamSynchronize`.
//! - Issue cost of a small (4 KiB H2D) async copy including the tracker's bookkeeping (an `Arc`
//!   source, an `InFlight` with a `StreamFence`) against a raw `cuMemcpyHtoDAsync_v2`; then decided
//!   by paired rounds (`MEMORY_BENCH_ISSUE_ROUNDS`, default 301): each round times a batch of 256
//!   raw copies, 256 raw copies each with the driver calls of gpudirect's checks (context and
//!   capture), 256 `copy_async`, and 256 raw again (the stream synchronized between batches); its
//!   figures are the time per copy of each minus the mean of the two raw ones; a cell is the
//!   median over rounds with its 95% interval, gpudirect's against the target of at most 0.3 µs
//!   over raw.
//! - Stream wait/write value round trip host -> GPU -> host (issue both ops, store the flag,
//!   spin until the GPU's write lands): median of 10,000 against the raw `_v2` calls.
//!
//! Without a GPU it prints `SKIPPED: reason`. `MEMORY_BENCH_MAX_MIB` caps the largest size
//! (default 1024).

use criterion::{Criterion, Throughput};
use gpudirect::completion::{InFlight, StreamFence};
use gpudirect::cuda::{MemopFlags, Stream, WaitCondition};
use gpudirect::cudarc::driver::{CudaContext, sys};
use gpudirect::memory::{DeviceBuffer, DeviceMemory, HostAllocFlags, PinnedHostBuffer, copy_async};
use gpudirect_testing::paired::Summary;
use gpudirect_testing::{Hardware, skip_example};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Per-iteration times recorded by `iter_custom`, by figure name.
static SAMPLES: Mutex<BTreeMap<String, Vec<f64>>> = Mutex::new(BTreeMap::new());

fn record(name: &str, total: Duration, iters: u64) {
    let per = total.as_secs_f64() / iters.max(1) as f64;
    SAMPLES
        .lock()
        .unwrap()
        .entry(name.to_string())
        .or_default()
        .push(per);
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn ok(call: &'static str, r: sys::CUresult) {
    r.result()
        .map_err(|e| gpudirect::Error::cuda(call, e.0))
        .unwrap();
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Dir {
    H2D,
    D2H,
    D2D,
}

fn size_name(bytes: usize) -> String {
    if bytes >= 1 << 30 {
        format!("{}GiB", bytes >> 30)
    } else if bytes >= 1 << 20 {
        format!("{}MiB", bytes >> 20)
    } else {
        format!("{}KiB", bytes >> 10)
    }
}

fn bandwidth(c: &mut Criterion, ctx: &Arc<CudaContext>, stream: &Stream, sizes: &[usize]) {
    let cs = stream.cu_stream();
    for &bytes in sizes {
        let n = bytes / 4;
        // One set of buffers per size, used by both variants (same memory, same placement).
        let mut h = Some(PinnedHostBuffer::<u32>::alloc(ctx, n, HostAllocFlags::empty()).unwrap());
        let mut d1 = Some(DeviceBuffer::<u32>::alloc(ctx, n).unwrap());
        let mut d2 = Some(DeviceBuffer::<u32>::alloc(ctx, n).unwrap());
        let hp = h.as_ref().unwrap().host_ptr().unwrap();
        let (da, db) = (
            d1.as_ref().unwrap().device_ptr(),
            d2.as_ref().unwrap().device_ptr(),
        );
        for dir in [Dir::H2D, Dir::D2H, Dir::D2D] {
            let key = format!("{dir:?} {}", size_name(bytes));
            let mut g = c.benchmark_group(&key);
            g.throughput(Throughput::Bytes(bytes as u64));
            g.bench_function("gpudirect", |b| {
                b.iter_custom(|iters| {
                    let t = Instant::now();
                    for _ in 0..iters {
                        match dir {
                            Dir::H2D => {
                                let op = copy_async(stream, h.take().unwrap(), d1.take().unwrap());
                                let (s, d) = op.unwrap().wait().unwrap();
                                h = Some(s);
                                d1 = Some(d);
                            }
                            Dir::D2H => {
                                let op = copy_async(stream, d1.take().unwrap(), h.take().unwrap());
                                let (s, d) = op.unwrap().wait().unwrap();
                                d1 = Some(s);
                                h = Some(d);
                            }
                            Dir::D2D => {
                                let op = copy_async(stream, d1.take().unwrap(), d2.take().unwrap());
                                let (s, d) = op.unwrap().wait().unwrap();
                                d1 = Some(s);
                                d2 = Some(d);
                            }
                        }
                    }
                    let e = t.elapsed();
                    record(&format!("{key} gpudirect"), e, iters);
                    e
                })
            });
            g.bench_function("raw", |b| {
                b.iter_custom(|iters| {
                    let t = Instant::now();
                    for _ in 0..iters {
                        // SAFETY: the buffers above, `bytes` bytes each, alive for the bench.
                        unsafe {
                            match dir {
                                Dir::H2D => ok(
                                    "cuMemcpyHtoDAsync_v2",
                                    sys::cuMemcpyHtoDAsync_v2(da, hp.cast(), bytes, cs),
                                ),
                                Dir::D2H => ok(
                                    "cuMemcpyDtoHAsync_v2",
                                    sys::cuMemcpyDtoHAsync_v2(hp.cast(), da, bytes, cs),
                                ),
                                Dir::D2D => ok(
                                    "cuMemcpyDtoDAsync_v2",
                                    sys::cuMemcpyDtoDAsync_v2(db, da, bytes, cs),
                                ),
                            }
                            ok("cuStreamSynchronize", sys::cuStreamSynchronize(cs));
                        }
                    }
                    let e = t.elapsed();
                    record(&format!("{key} raw"), e, iters);
                    e
                })
            });
            g.finish();
        }
    }
}

const QUEUE: usize = 256;
const SMALL: usize = 1024; // u32 elements: 4 KiB

fn issue_cost(c: &mut Criterion, ctx: &Arc<CudaContext>, stream: &Stream) {
    let src =
        Arc::new(PinnedHostBuffer::<u32>::alloc(ctx, SMALL, HostAllocFlags::empty()).unwrap());
    let mut dsts: Vec<DeviceBuffer<u32>> = (0..QUEUE)
        .map(|_| DeviceBuffer::alloc(ctx, SMALL).unwrap())
        .collect();
    let mut g = c.benchmark_group("issue 4KiB H2D");
    g.bench_function("gpudirect", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            let mut left = iters as usize;
            while left > 0 {
                let k = left.min(QUEUE);
                let mut ops: Vec<InFlight<_, StreamFence>> = Vec::with_capacity(k);
                let batch: Vec<_> = dsts.drain(..k).collect();
                let t = Instant::now();
                for d in batch {
                    ops.push(copy_async(stream, src.clone(), d).unwrap());
                }
                timed += t.elapsed();
                for op in ops {
                    dsts.push(op.wait().unwrap().1);
                }
                left -= k;
            }
            record("issue 4KiB H2D gpudirect", timed, iters);
            timed
        })
    });
    let hp = src.host_ptr().unwrap();
    let ptrs: Vec<u64> = dsts.iter().map(|d| d.device_ptr()).collect();
    let cs = stream.cu_stream();
    g.bench_function("raw", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            let mut left = iters as usize;
            while left > 0 {
                let k = left.min(QUEUE);
                let t = Instant::now();
                for &d in &ptrs[..k] {
                    // SAFETY: 4 KiB buffers alive for the bench.
                    ok("cuMemcpyHtoDAsync_v2", unsafe {
                        sys::cuMemcpyHtoDAsync_v2(d, hp.cast(), SMALL * 4, cs)
                    });
                }
                timed += t.elapsed();
                // SAFETY: a live stream.
                ok("cuStreamSynchronize", unsafe {
                    sys::cuStreamSynchronize(cs)
                });
                left -= k;
            }
            record("issue 4KiB H2D raw", timed, iters);
            timed
        })
    });
    g.finish();
}

/// The issue-cost target: at most this many microseconds per copy over raw.
const ISSUE_TARGET_US: f64 = 0.3;

/// The issue cost decided by paired rounds: per round, gpudirect's microseconds per copy over the
/// mean of the raw batches before and after it; and the same for raw copies with the driver
/// calls of gpudirect's checks (what those calls alone cost).
fn issue_paired(ctx: &Arc<CudaContext>, stream: &Stream, rounds: usize) -> (Vec<f64>, Vec<f64>) {
    let src =
        Arc::new(PinnedHostBuffer::<u32>::alloc(ctx, SMALL, HostAllocFlags::empty()).unwrap());
    let mut dsts: Vec<DeviceBuffer<u32>> = (0..QUEUE)
        .map(|_| DeviceBuffer::alloc(ctx, SMALL).unwrap())
        .collect();
    let hp = src.host_ptr().unwrap();
    let ptrs: Vec<u64> = dsts.iter().map(|d| d.device_ptr()).collect();
    let cs = stream.cu_stream();
    // `checked`: the driver calls a copy_async makes beside the copy (the context check and the
    // capture check before and after), and nothing else.
    let raw = |checked: bool| {
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let t = Instant::now();
        for &d in &ptrs {
            // SAFETY: 4 KiB buffers alive for the bench, none in use by other work; valid
            // out-pointers.
            unsafe {
                if checked {
                    ok("cuCtxGetCurrent", sys::cuCtxGetCurrent(&mut cur));
                    ok(
                        "cuStreamIsCapturing",
                        sys::cuStreamIsCapturing(cs, &mut status),
                    );
                }
                ok(
                    "cuMemcpyHtoDAsync_v2",
                    sys::cuMemcpyHtoDAsync_v2(d, hp.cast(), SMALL * 4, cs),
                );
                if checked {
                    ok(
                        "cuStreamIsCapturing",
                        sys::cuStreamIsCapturing(cs, &mut status),
                    );
                }
            }
        }
        let took = t.elapsed().as_secs_f64() / QUEUE as f64;
        // SAFETY: a live stream.
        ok("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(cs)
        });
        took
    };
    let ours = |dsts: &mut Vec<DeviceBuffer<u32>>| {
        let mut ops: Vec<InFlight<_, StreamFence>> = Vec::with_capacity(QUEUE);
        let batch: Vec<_> = std::mem::take(dsts);
        let t = Instant::now();
        for d in batch {
            ops.push(copy_async(stream, src.clone(), d).unwrap());
        }
        let took = t.elapsed().as_secs_f64() / QUEUE as f64;
        for op in ops {
            dsts.push(op.wait().unwrap().1);
        }
        took
    };
    // Warm-up.
    raw(false);
    raw(true);
    ours(&mut dsts);
    let mut extra = Vec::with_capacity(rounds);
    let mut checks = Vec::with_capacity(rounds);
    let mut before = raw(false);
    for _ in 0..rounds {
        let c = raw(true);
        let g = ours(&mut dsts);
        let after = raw(false);
        let base = (before + after) / 2.0;
        extra.push((g - base) * 1e6);
        checks.push((c - base) * 1e6);
        before = after;
    }
    (extra, checks)
}

const ROUND_TRIPS: usize = 10_000;

fn spin_until(mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "memop round trip stuck"
        );
        std::hint::spin_loop();
    }
}

/// Median round trip of `ROUND_TRIPS`, gpudirect's API and raw, interleaved in blocks.
fn memop_round_trip(ctx: &Arc<CudaContext>, stream: &Stream) -> (f64, f64) {
    let flags = MemopFlags::pinned_host(ctx, 2).unwrap();
    // Raw: our own pinned, device-mapped words, used through volatile accesses.
    let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
    ctx.bind_to_thread().unwrap();
    // SAFETY: context current; valid out-pointer.
    ok("cuMemHostAlloc", unsafe {
        sys::cuMemHostAlloc(
            &mut p,
            16,
            sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
        )
    });
    let words = p.cast::<u32>();
    // SAFETY: 16 fresh bytes.
    unsafe { std::ptr::write_bytes(words, 0, 4) };
    let mut dptr = 0;
    // SAFETY: mapped pinned memory.
    ok("cuMemHostGetDevicePointer_v2", unsafe {
        sys::cuMemHostGetDevicePointer_v2(&mut dptr, p, 0)
    });
    let cs = stream.cu_stream();
    let mut ours = Vec::with_capacity(ROUND_TRIPS);
    let mut raw = Vec::with_capacity(ROUND_TRIPS);
    let mut v = 0u32;
    for _block in 0..ROUND_TRIPS / 100 {
        for _ in 0..100 {
            v += 1;
            let t = Instant::now();
            stream
                .wait_value32(&flags, 0, v, WaitCondition::Eq)
                .unwrap();
            stream.write_value32(&flags, 1, v).unwrap();
            flags.store_u32(0, v).unwrap();
            spin_until(|| flags.load_u32(1).unwrap() == v);
            ours.push(t.elapsed().as_secs_f64());
        }
        for _ in 0..100 {
            v += 1;
            let t = Instant::now();
            // SAFETY: symbols checked by MemopFlags::pinned_host; words alive until the end.
            unsafe {
                ok(
                    "cuStreamWaitValue32_v2",
                    sys::cuStreamWaitValue32_v2(cs, dptr, v, 1),
                );
                ok(
                    "cuStreamWriteValue32_v2",
                    sys::cuStreamWriteValue32_v2(cs, dptr + 8, v, 0),
                );
                std::ptr::write_volatile(words, v);
                spin_until(|| std::ptr::read_volatile(words.add(2)) == v);
            }
            raw.push(t.elapsed().as_secs_f64());
        }
    }
    stream.synchronize().unwrap();
    // SAFETY: the stream has passed every operation on the words.
    unsafe { sys::cuMemFreeHost(p) };
    (median(&mut ours), median(&mut raw))
}

fn main() {
    let ctx = match gpudirect::cuda::context(0) {
        Ok(c) => c,
        Err(e) => skip_example(Hardware::Gpu, e),
    };
    let stream = Stream::new(&ctx).unwrap();
    let max_mib: usize = std::env::var("MEMORY_BENCH_MAX_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024);
    let sizes: Vec<usize> = [
        4usize << 10,
        64 << 10,
        1 << 20,
        16 << 20,
        256 << 20,
        1 << 30,
    ]
    .into_iter()
    .filter(|&b| b <= max_mib << 20)
    .collect();
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_millis(800))
        .without_plots()
        .configure_from_args();
    bandwidth(&mut c, &ctx, &stream, &sizes);
    issue_cost(&mut c, &ctx, &stream);
    let issue_rounds: usize = std::env::var("MEMORY_BENCH_ISSUE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(301usize)
        .max(6);
    let (issue_extra, issue_checks) = issue_paired(&ctx, &stream, issue_rounds);
    let (rt_ours, rt_raw) = memop_round_trip(&ctx, &stream);
    c.final_summary();

    let mut s = SAMPLES.lock().unwrap();
    let mut med = |k: &str| s.get_mut(k).map(|v| median(v));
    println!();
    println!(
        "{:<28} {:>14} {:>14} {:>8}",
        "figure", "gpudirect", "raw", "ratio"
    );
    for dir in [Dir::H2D, Dir::D2H, Dir::D2D] {
        for &bytes in &sizes {
            let key = format!("{dir:?} {}", size_name(bytes));
            if let (Some(o), Some(r)) =
                (med(&format!("{key} gpudirect")), med(&format!("{key} raw")))
            {
                let gbs = |t: f64| bytes as f64 / t / 1e9;
                println!(
                    "{:<28} {:>9.2} GB/s {:>9.2} GB/s {:>8.3}",
                    format!("{key} bandwidth"),
                    gbs(o),
                    gbs(r),
                    gbs(o) / gbs(r)
                );
            }
        }
    }
    if let (Some(o), Some(r)) = (med("issue 4KiB H2D gpudirect"), med("issue 4KiB H2D raw")) {
        println!(
            "{:<28} {:>11.3} us {:>11.3} us {:>8.3}  (overhead {:+.3} us, target <= 0.3)",
            "issue 4KiB H2D async",
            o * 1e6,
            r * 1e6,
            o / r,
            (o - r) * 1e6
        );
    }
    let paired = Summary::of(&issue_extra).expect("rounds measured");
    let checks = Summary::of(&issue_checks).expect("rounds measured");
    println!(
        "{:<28} {paired} us over raw, paired rounds (median [95% interval] (lowest..highest) rounds): {} against <= {ISSUE_TARGET_US}",
        "issue 4KiB H2D async",
        paired.at_most(ISSUE_TARGET_US)
    );
    println!(
        "{:<28} {checks} us over raw: raw copies with the driver calls of gpudirect's checks \
         (cuCtxGetCurrent, cuStreamIsCapturing before and after), same rounds",
        "  of which driver calls"
    );
    println!(
        "{:<28} {:>11.3} us {:>11.3} us {:>8.3}  (median of {ROUND_TRIPS}, target within 5%)",
        "memop round trip",
        rt_ours * 1e6,
        rt_raw * 1e6,
        rt_ours / rt_raw
    );
}
