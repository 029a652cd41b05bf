//! Peer-copy bandwidth of gpudirect's [`Copier`] beside raw `cuMemcpyPeerAsync` measured in the
//! same run, one way and both ways at once, for 4 KiB to 1 GiB; one table with the ratios.
//!
//! Two figures per size:
//! - one at a time: issue a copy, wait for it, again (`Copier::copy_async(..).wait()` against
//!   `cuMemcpyPeerAsync` + `cuStreamSynchronize`); the difference per copy is printed in
//!   microseconds;
//! - pipelined: `depth` copies in flight (64 up to 16 MiB, fewer above: the destinations are
//!   distinct buffers), then one wait (`copy_async` x depth, then `wait` on each: the first
//!   synchronizes the stream, the others find their epoch done) against `cuMemcpyPeerAsync` x
//!   depth + one `cuStreamSynchronize`. Beside it, raw with the graph-capture check gpudirect
//!   makes per copy (`cuCtxGetCurrent` and `cuStreamIsCapturing` twice), to show what that check
//!   costs on its own;
//! - batched: the same `depth` copies as one `Copier::copy_batch_async` and one wait, against
//!   one raw `cuMemcpyBatchAsync` of them and one `cuStreamSynchronize` (where the driver has it:
//!   CUDA 12.8 and later); the ratio is printed against both raw figures.
//!
//! Both ways: one thread per direction (each with its own copier, or its own raw stream), started
//! together; GB/s counts both directions' bytes over the slower thread's time.
//!
//! With two or more GPUs it measures devices 0 and 1; with one, 0 -> 0 (a same-device copy on
//! both sides, said so in the table's heading).
//!
//! ```text
//! cargo bench --bench p2p -- --quick     # fixed, small iteration counts: well under a minute
//! cargo bench --bench p2p                # more repetitions (a few minutes at most)
//! ```
//!
//! `P2P_BENCH_MAX_MIB` caps the largest size (default 1024).

use gpudirect::cudarc::driver::sys;
use gpudirect::cudarc::driver::{CudaContext, CudaStream};
use gpudirect::memory::{DeviceBuffer, DeviceMemory};
use gpudirect::p2p::{Copier, CopyOptions};
use gpudirect_testing::{Hardware, skip_example};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// What one measurement runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    /// `cuMemcpyPeerAsync` + `cuStreamSynchronize`, one copy at a time.
    RawOne,
    /// `copy_async(..).wait()`, one copy at a time.
    GdOne,
    /// `cuMemcpyPeerAsync` x depth + one `cuStreamSynchronize`.
    RawPipe,
    /// As `RawPipe`, with the calls gpudirect's capture check adds per copy.
    RawPipeChecked,
    /// `copy_async` x depth, then `wait` on each.
    GdPipe,
    /// One `cuMemcpyBatchAsync` of depth copies + one `cuStreamSynchronize`.
    RawBatch,
    /// One `copy_batch_async` of depth pairs, then its wait.
    GdBatch,
}

const VARIANTS: [Variant; 7] = [
    Variant::RawOne,
    Variant::GdOne,
    Variant::RawPipe,
    Variant::RawPipeChecked,
    Variant::GdPipe,
    Variant::RawBatch,
    Variant::GdBatch,
];

impl Variant {
    fn pipelined(self) -> bool {
        matches!(
            self,
            Variant::RawPipe
                | Variant::RawPipeChecked
                | Variant::GdPipe
                | Variant::RawBatch
                | Variant::GdBatch
        )
    }
}

/// One direction: its copier, its raw stream, a source and `depth` destinations.
struct Dir {
    src_ctx: Arc<CudaContext>,
    dst_ctx: Arc<CudaContext>,
    copier: Copier,
    raw: Arc<CudaStream>,
    src: Arc<DeviceBuffer<u8>>,
    dsts: Vec<DeviceBuffer<u8>>,
    bytes: usize,
}

fn check(r: sys::CUresult, call: &str) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{call}");
}

impl Dir {
    fn new(a: usize, b: usize, bytes: usize, depth: usize) -> Dir {
        let src_ctx = gpudirect::cuda::context(a).expect("context");
        let dst_ctx = gpudirect::cuda::context(b).expect("context");
        let copier = Copier::new(a, b, CopyOptions::default()).expect("copier");
        let raw = src_ctx.new_stream().expect("cuStreamCreate");
        let src = Arc::new(DeviceBuffer::<u8>::zeroed(&src_ctx, bytes).expect("cuMemAlloc"));
        let dsts = (0..depth)
            .map(|_| DeviceBuffer::<u8>::zeroed(&dst_ctx, bytes).expect("cuMemAlloc"))
            .collect();
        Dir {
            src_ctx,
            dst_ctx,
            copier,
            raw,
            src,
            dsts,
            bytes,
        }
    }

    /// The raw baseline's copy into destination `k`.
    fn raw_copy(&self, k: usize) {
        // SAFETY: both buffers are live until the stream is synchronized, which every raw
        // variant does before returning.
        check(
            unsafe {
                sys::cuMemcpyPeerAsync(
                    self.dsts[k].device_ptr(),
                    self.dst_ctx.cu_ctx(),
                    self.src.device_ptr(),
                    self.src_ctx.cu_ctx(),
                    self.bytes,
                    self.raw.cu_stream(),
                )
            },
            "cuMemcpyPeerAsync",
        );
    }

    /// One raw `cuMemcpyBatchAsync` of the source into every destination; `false` where the
    /// driver lacks it.
    fn raw_batch(&self) -> bool {
        let Some(f) = gpudirect_sys::cuda::driver()
            .ok()
            .and_then(|d| d.memcpy_batch())
        else {
            return false;
        };
        let n = self.dsts.len();
        let mut dsts: Vec<u64> = self.dsts.iter().map(|d| d.device_ptr()).collect();
        let mut srcs = vec![self.src.device_ptr(); n];
        let mut sizes = vec![self.bytes; n];
        let s = self.raw.cu_stream().cast();
        // SAFETY: `n` entries each; every buffer holds `bytes` and lives until the stream is
        // synchronized (every caller does); one attribute.
        let rc = unsafe { f.call(&mut dsts, &mut srcs, &mut sizes, s) };
        assert_eq!(rc, 0, "cuMemcpyBatchAsync");
        true
    }

    fn raw_sync(&self) {
        // SAFETY: a live stream.
        check(
            unsafe { sys::cuStreamSynchronize(self.raw.cu_stream()) },
            "cuStreamSynchronize",
        );
    }

    /// What gpudirect's capture check adds to a copy: the context check and
    /// `cuStreamIsCapturing` before and after.
    fn checks(&self) {
        let mut cur = std::ptr::null_mut();
        let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: valid out-pointers; a live stream.
        unsafe {
            check(sys::cuCtxGetCurrent(&mut cur), "cuCtxGetCurrent");
            check(
                sys::cuStreamIsCapturing(self.raw.cu_stream(), &mut st),
                "cuStreamIsCapturing",
            );
        }
    }

    /// Run `v` for `n` copies (one at a time) or `n` rounds of all destinations (pipelined);
    /// returns the copies made.
    fn run(&mut self, v: Variant, n: usize) -> usize {
        let depth = self.dsts.len();
        match v {
            Variant::RawOne => {
                for _ in 0..n {
                    self.raw_copy(0);
                    self.raw_sync();
                }
                n
            }
            Variant::GdOne => {
                for _ in 0..n {
                    let d = self.dsts.pop().expect("a destination");
                    let op = self.copier.copy_async(self.src.clone(), d).expect("copy");
                    self.dsts.push(op.wait().expect("wait").dst);
                }
                n
            }
            Variant::RawPipe | Variant::RawPipeChecked => {
                let checked = v == Variant::RawPipeChecked;
                for _ in 0..n {
                    for k in 0..depth {
                        if checked {
                            self.checks();
                        }
                        self.raw_copy(k);
                        if checked {
                            self.checks();
                        }
                    }
                    self.raw_sync();
                }
                n * depth
            }
            Variant::RawBatch => {
                for _ in 0..n {
                    if !self.raw_batch() {
                        return 0;
                    }
                    self.raw_sync();
                }
                n * depth
            }
            Variant::GdBatch => {
                for _ in 0..n {
                    let pairs: Vec<_> =
                        self.dsts.drain(..).map(|d| (self.src.clone(), d)).collect();
                    let done = self
                        .copier
                        .copy_batch_async(pairs)
                        .expect("copy_batch_async")
                        .wait()
                        .expect("wait");
                    self.dsts.extend(done.into_iter().map(|c| c.dst));
                }
                n * depth
            }
            Variant::GdPipe => {
                let mut ops = Vec::with_capacity(depth);
                for _ in 0..n {
                    for d in self.dsts.drain(..) {
                        ops.push(self.copier.copy_async(self.src.clone(), d).expect("copy"));
                    }
                    for op in ops.drain(..) {
                        self.dsts.push(op.wait().expect("wait").dst);
                    }
                }
                n * depth
            }
        }
    }
}

/// How many copies (one at a time) or rounds (pipelined) a measurement makes at `bytes`.
fn count(v: Variant, bytes: usize, depth: usize, scale: usize) -> usize {
    if v.pipelined() {
        (64 * MIB * scale / (bytes * depth)).clamp(3, 100 * scale)
    } else {
        (16 * MIB * scale / bytes).clamp(4, 1000 * scale)
    }
}

/// Seconds per copy of `v`, one way (`dirs` of one) or both ways at once (two threads).
fn measure(dirs: &mut [Dir], v: Variant, n: usize) -> f64 {
    if let [one] = dirs {
        one.src_ctx.bind_to_thread().expect("bind");
        let t = Instant::now();
        let copies = one.run(v, n);
        return t.elapsed().as_secs_f64() / copies as f64;
    }
    let barrier = Barrier::new(dirs.len());
    let times: Vec<(Duration, usize)> = std::thread::scope(|s| {
        let hs: Vec<_> = dirs
            .iter_mut()
            .map(|d| {
                let barrier = &barrier;
                s.spawn(move || {
                    d.src_ctx.bind_to_thread().expect("bind");
                    barrier.wait();
                    let t = Instant::now();
                    let copies = d.run(v, n);
                    (t.elapsed(), copies)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    let slowest = times.iter().map(|t| t.0).max().unwrap_or_default();
    slowest.as_secs_f64() / times[0].1 as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn size_name(bytes: usize) -> String {
    match bytes {
        b if b >= GIB => format!("{} GiB", b / GIB),
        b if b >= MIB => format!("{} MiB", b / MIB),
        b => format!("{} KiB", b / KIB),
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let n = match gpudirect::cuda::device_count() {
        Ok(0) => skip_example(Hardware::Gpu, "no CUDA device visible"),
        Ok(n) => n,
        Err(e) => skip_example(Hardware::Gpu, e),
    };
    let max_mib: usize = std::env::var("P2P_BENCH_MAX_MIB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1024);
    let sizes: Vec<usize> = [4 * KIB, 64 * KIB, MIB, 16 * MIB, 256 * MIB, GIB]
        .into_iter()
        .filter(|&b| b <= max_mib * MIB)
        .collect();
    let (a, b) = if n > 1 { (0, 1) } else { (0, 0) };
    let (repeats, scale) = if quick { (3, 1) } else { (9, 3) };
    let started = Instant::now();
    let auto = Copier::new(a, b, CopyOptions::default()).expect("copier");
    let heading = if n > 1 {
        format!("GPUs {a} and {b}: the copier's path {}", auto.path())
    } else {
        "ONE GPU: 0 -> 0 on both sides (gpudirect: a same-device copy; raw: \
         cuMemcpyPeerAsync 0 -> 0), not a peer-copy figure"
            .to_string()
    };
    drop(auto);
    println!("{heading}");
    println!(
        "issue cost per copy of cuMemAlloc memory: raw 1 driver call; gpudirect 2 \
         (cuCtxGetCurrent, cuMemcpyPeerAsync; the copier's private streams need no capture \
         check), no event, no lock, no allocation; a batch: one cuMemcpyBatchAsync for all its copies; waiting: raw cuStreamSynchronize, gpudirect cuStreamIsCapturing + \
         cuStreamSynchronize once per batch"
    );
    let mut rows = Vec::new();
    for &bytes in &sizes {
        let depth = (4 * GIB / bytes).clamp(2, 64);
        for both in [false, true] {
            let mut dirs = vec![Dir::new(a, b, bytes, depth)];
            if both {
                dirs.push(Dir::new(b, a, bytes, depth));
            }
            let mut per_copy: Vec<Vec<f64>> = vec![Vec::new(); VARIANTS.len()];
            for &v in &VARIANTS {
                measure(&mut dirs, v, 1); // warm-up
            }
            // Interleaved, so that drift over the run touches every variant alike.
            for _ in 0..repeats {
                for (i, &v) in VARIANTS.iter().enumerate() {
                    let k = count(v, bytes, depth, scale);
                    per_copy[i].push(measure(&mut dirs, v, k));
                }
            }
            let secs: Vec<f64> = per_copy.into_iter().map(median).collect();
            let moved = bytes * dirs.len();
            let gbs = |s: f64| moved as f64 / s.max(1e-12) / 1e9;
            rows.push((
                bytes,
                both,
                depth,
                secs.iter().map(|&s| gbs(s)).collect::<Vec<f64>>(),
                (secs[1] - secs[0]) * 1e6,
            ));
            eprintln!(
                "{} {}: done ({:.0} s so far)",
                size_name(bytes),
                if both { "both ways" } else { "one way" },
                started.elapsed().as_secs_f64()
            );
        }
    }
    println!(
        "\n== peer copies {a} -> {b}{} (GB/s, median of {repeats} runs; ratio = gpudirect / raw \
         in this run; +us = gpudirect's extra time per copy, one at a time)",
        if a != b { " (and back, both ways)" } else { "" }
    );
    println!(
        "{:<5} {:>7} | {:>8} {:>9} {:>6} {:>7} | {:>5} {:>8} {:>9} {:>6} {:>10} {:>6} | {:>9} {:>9} {:>6} {:>6}",
        "dir",
        "size",
        "raw",
        "gpudirect",
        "ratio",
        "+us",
        "depth",
        "raw",
        "gpudirect",
        "ratio",
        "raw+check",
        "ratio",
        "raw batch",
        "gpudirect",
        "/batch",
        "/pipe"
    );
    println!(
        "{:<14}| {:<34}| {:<58}| batched (depth copies, one call, one wait)",
        "", "one at a time", "pipelined (depth in flight, one wait)"
    );
    for (bytes, both, depth, g, extra_us) in &rows {
        let r = |x: f64, base: f64| if base > 0.0 { x / base } else { 0.0 };
        println!(
            "{:<5} {:>7} | {:>8.2} {:>9.2} {:>5.2}x {:>7.2} | {:>5} {:>8.2} {:>9.2} {:>5.2}x {:>10.2} {:>5.2}x | {:>9} {:>9.2} {:>6} {:>5.2}x",
            if *both { "both" } else { "one" },
            size_name(*bytes),
            g[0],
            g[1],
            r(g[1], g[0]),
            extra_us,
            depth,
            g[2],
            g[4],
            r(g[4], g[2]),
            g[3],
            r(g[3], g[2]),
            if g[5] > 0.0 {
                format!("{:.2}", g[5])
            } else {
                "-".to_string()
            },
            g[6],
            if g[5] > 0.0 {
                format!("{:.2}x", r(g[6], g[5]))
            } else {
                "-".to_string()
            },
            r(g[6], g[2]),
        );
    }
    println!(
        "(run took {:.0} s{})",
        started.elapsed().as_secs_f64(),
        if quick { ", quick mode" } else { "" }
    );
}
