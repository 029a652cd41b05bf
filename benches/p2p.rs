//! Peer-copy bandwidth of gpudirect's [`Copier`] beside raw `cuMemcpyPeerAsync` measured in the
//! same run, one way and both ways at once, for 4 KiB to 1 GiB; one table with the ratios.
//!
//! Three figures per size:
//! - one at a time: issue a copy, wait for it, again (`Copier::copy_async(..).wait()` against
//!   `cuMemcpyPeerAsync` + `cuStreamSynchronize`); the difference per copy is printed in
//!   microseconds;
//! - pipelined: `depth` copies in flight (64 up to 16 MiB, fewer above: the destinations are
//!   distinct buffers), then one wait (`copy_async` x depth, then `wait` on each: the first
//!   synchronizes the stream, the others find their epoch done) against `cuMemcpyPeerAsync` x
//!   depth + one `cuStreamSynchronize`. The raw loop is measured twice in every round, before
//!   and after gpudirect's (`raw again`): each round's ratio is paired (gpudirect over the mean of
//!   the two raw runs around it, in GB/s). A cell's figure is the median paired ratio with its
//!   95% confidence interval from the order statistics (`gpudirect_testing::paired`): `ok` from
//!   0.97, `MISSES` only when the whole interval is under 0.97, else `undecided` (more rounds
//!   decide). Raw against itself (the second raw run over the first) is summarised the same way
//!   in the verdict lines under the table: an interval more than 1% from 1.00 means the order of
//!   the runs, not the library, moves the figures;
//! - scoped: the same `depth` copies between borrowed buffers inside one `Copier::scope` (its
//!   one wait when the scope ends), paired the same way: between the second raw run and a third
//!   (`raw` after it), decided against 0.97x alike;
//! - batched: the same `depth` copies as one `Copier::copy_batch_async` and one wait, against
//!   one raw `cuMemcpyBatchAsync` of them and one `cuStreamSynchronize` (where the driver has it:
//!   CUDA 12.8 and later); the ratio is printed against both raw figures.
//!
//! One at a time is decided the same way against 0.5 µs over raw (the median extra time per
//! copy, and its interval).
//!
//! Rounds: at least 9 (3 with `--quick`), more where a round is short (small sizes), up to a
//! time budget per cell fixed by the first round's time (`P2P_BENCH_CELL_SECS`, default 12, 3
//! with `--quick`) and at most 101 (31), so that small cells, the noisiest, get the most
//! rounds.
//!
//! Both ways: one thread per direction (each with its own copier, or its own raw stream), started
//! together; GB/s counts both directions' bytes over the slower thread's time.
//!
//! Each direction's thread is pinned to one CPU local to its source GPU (sysfs'
//! `local_cpulist`), the same for raw and gpudirect, so that no variant gains or loses by where
//! the scheduler put it; `GPUDIRECT_BENCH_PIN=0` lets the threads move.
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
use gpudirect_testing::paired::{self, Summary};
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
    /// `RawPipe` again, after gpudirect's: raw's own spread in the run.
    RawPipeAgain,
    /// `copy_async` x depth, then `wait` on each.
    GdPipe,
    /// `Copier::scope`: depth copies between borrowed buffers, one wait when the scope ends.
    GdScope,
    /// `RawPipe` a third time, after the scope's: the raw run after it.
    RawPipeThird,
    /// One `cuMemcpyBatchAsync` of depth copies + one `cuStreamSynchronize`.
    RawBatch,
    /// One `copy_batch_async` of depth pairs, then its wait.
    GdBatch,
}

/// In the order each round runs them (gpudirect's pipelined copies between the two raw runs).
const VARIANTS: [Variant; 9] = [
    Variant::RawOne,
    Variant::GdOne,
    Variant::RawPipe,
    Variant::GdPipe,
    Variant::RawPipeAgain,
    Variant::GdScope,
    Variant::RawPipeThird,
    Variant::RawBatch,
    Variant::GdBatch,
];

/// Where each variant's figures are in a row.
const RAW_ONE: usize = 0;
const GD_ONE: usize = 1;
const RAW_PIPE: usize = 2;
const GD_PIPE: usize = 3;
const RAW_AGAIN: usize = 4;
const GD_SCOPE: usize = 5;
const RAW_THIRD: usize = 6;
const RAW_BATCH: usize = 7;
const GD_BATCH: usize = 8;

impl Variant {
    fn pipelined(self) -> bool {
        matches!(
            self,
            Variant::RawPipe
                | Variant::RawPipeAgain
                | Variant::RawPipeThird
                | Variant::GdPipe
                | Variant::GdScope
                | Variant::RawBatch
                | Variant::GdBatch
        )
    }
}

/// One direction: its copier, its raw stream, a source and `depth` destinations.
struct Dir {
    /// The CPU its thread runs on (raw and gpudirect alike), when pinned.
    cpu: Option<usize>,
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
    fn new(a: usize, b: usize, bytes: usize, depth: usize, cpu: Option<usize>) -> Dir {
        let src_ctx = gpudirect::cuda::context(a).expect("context");
        let dst_ctx = gpudirect::cuda::context(b).expect("context");
        let copier = Copier::new(a, b, CopyOptions::default()).expect("copier");
        let raw = src_ctx.new_stream().expect("cuStreamCreate");
        let src = Arc::new(DeviceBuffer::<u8>::zeroed(&src_ctx, bytes).expect("cuMemAlloc"));
        let dsts = (0..depth)
            .map(|_| DeviceBuffer::<u8>::zeroed(&dst_ctx, bytes).expect("cuMemAlloc"))
            .collect();
        Dir {
            cpu,
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
            Variant::RawPipe | Variant::RawPipeAgain | Variant::RawPipeThird => {
                for _ in 0..n {
                    for k in 0..depth {
                        self.raw_copy(k);
                    }
                    self.raw_sync();
                }
                n * depth
            }
            Variant::GdScope => {
                let (src, dsts) = (&*self.src, &mut self.dsts);
                for _ in 0..n {
                    self.copier.scope(|s| {
                        for d in dsts.iter_mut() {
                            s.copy(src, d).expect("copy");
                        }
                    });
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

/// Seconds per copy of `v`, one way (`dirs` of one) or both ways at once (one thread per
/// direction, each on its own CPU when pinned).
fn measure(dirs: &mut [Dir], v: Variant, n: usize) -> f64 {
    let barrier = Barrier::new(dirs.len());
    let times: Vec<(Duration, usize)> = std::thread::scope(|s| {
        let hs: Vec<_> = dirs
            .iter_mut()
            .map(|d| {
                let barrier = &barrier;
                s.spawn(move || {
                    if let Some(cpu) = d.cpu {
                        pin(cpu);
                    }
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

/// The CPUs sysfs lists as local to GPU `ordinal` (its PCI device's `local_cpulist`); empty
/// when sysfs does not say.
fn local_cpus(ordinal: usize) -> Vec<usize> {
    let Ok(p) = gpudirect::topology::Placement::of_gpu(ordinal) else {
        return Vec::new();
    };
    let path = format!("/sys/bus/pci/devices/{}/local_cpulist", p.pci_bus_id);
    let list = std::fs::read_to_string(path).unwrap_or_default();
    let mut cpus = Vec::new();
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        let range = match part.split_once('-') {
            Some((lo, hi)) => (lo.parse::<usize>(), hi.parse::<usize>()),
            None => (part.parse::<usize>(), part.parse::<usize>()),
        };
        if let (Ok(lo), Ok(hi)) = range {
            cpus.extend(lo..=hi);
        }
    }
    cpus
}

/// Run the calling thread on `cpu` only.
fn pin(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes inside it (`cpu` is below
    // CPU_SETSIZE: checked where the CPU is chosen); sched_setaffinity reads it.
    let ok = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    };
    assert!(ok, "sched_setaffinity to CPU {cpu}");
}

/// A CPU for each direction's thread: one of its source GPU's local CPUs this process may run
/// on, never CPU 0 (interrupts) when another will do, and a different one for each direction.
/// `None` for both when pinning is off or sysfs does not say.
fn choose_cpus(a: usize, b: usize) -> (Option<usize>, Option<usize>) {
    if std::env::var("GPUDIRECT_BENCH_PIN").is_ok_and(|v| v == "0") {
        return (None, None);
    }
    // SAFETY: a zeroed set, filled by sched_getaffinity for this thread.
    let allowed = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return (None, None);
        }
        set
    };
    let usable = |c: &usize| {
        // SAFETY: reads inside the set (bounded just before).
        *c < libc::CPU_SETSIZE as usize && unsafe { libc::CPU_ISSET(*c, &allowed) }
    };
    let pick = |gpu: usize, not: Option<usize>| {
        let cpus: Vec<usize> = local_cpus(gpu).into_iter().filter(usable).collect();
        let free = |c: &&usize| Some(**c) != not;
        cpus.iter()
            .filter(free)
            .find(|&&c| c != 0)
            .or_else(|| cpus.iter().find(free))
            .copied()
    };
    let first = pick(a, None);
    let second = pick(b, first);
    match (first, second) {
        (Some(x), Some(y)) => (Some(x), Some(y)),
        _ => (None, None),
    }
}

/// One line of the table.
struct Row {
    bytes: usize,
    both: bool,
    depth: usize,
    /// GB/s of each variant (median of the rounds), in [`VARIANTS`]' order.
    gbs: Vec<f64>,
    /// gpudirect's extra time per copy, one at a time (µs), per round.
    extra_us: Vec<f64>,
    /// Per round: gpudirect's pipelined GB/s over the mean of the raw runs around it, and raw's
    /// second run over its first.
    pipe: Vec<f64>,
    /// Per round: the scope's GB/s over the mean of the raw runs around it.
    scoped: Vec<f64>,
    noise: Vec<f64>,
}

/// Pipelined: at least 0.97x raw; one at a time: at most 0.5 µs over raw.
const PIPE_TARGET: f64 = 0.97;
const ONE_TARGET_US: f64 = 0.5;

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
    // Seconds of rounds a cell may take, and the most rounds it makes.
    let cell_secs: f64 = std::env::var("P2P_BENCH_CELL_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if quick { 3.0 } else { 12.0 });
    let max_rounds = if quick { 31 } else { 101 };
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
    // Which machine: the same GPUs gave different figures on different hosts.
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, m)| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!("CPU: {cpu}, {cores} cores available");
    let (cpu_a, cpu_b) = choose_cpus(a, b);
    match (cpu_a, cpu_b) {
        (Some(x), Some(y)) => println!(
            "threads pinned, raw and gpudirect alike: {a} -> {b} on CPU {x}, {b} -> {a} on CPU {y} \
             (local to each source GPU, from sysfs; GPUDIRECT_BENCH_PIN=0 to let them move)"
        ),
        _ => println!(
            "threads not pinned (GPUDIRECT_BENCH_PIN=0, or sysfs gives no local CPUs for the GPUs)"
        ),
    }
    println!(
        "issue cost per copy of cuMemAlloc memory: raw 1 driver call; gpudirect 2 \
         (cuCtxGetCurrent, cuMemcpyPeerAsync; the copier's private streams need no capture \
         check), no event, no lock, no allocation; copy_async also owns and fences each copy's \
         buffers, a scope nothing per copy; a batch: one cuMemcpyBatchAsync for all its \
         copies; waiting: cuStreamSynchronize once per batch (per scope), both"
    );
    let mut rows = Vec::new();
    for &bytes in &sizes {
        let depth = (4 * GIB / bytes).clamp(2, 64);
        for both in [false, true] {
            let mut dirs = vec![Dir::new(a, b, bytes, depth, cpu_a)];
            if both {
                dirs.push(Dir::new(b, a, bytes, depth, cpu_b));
            }
            let mut per_copy: Vec<Vec<f64>> = vec![Vec::new(); VARIANTS.len()];
            for &v in &VARIANTS {
                measure(&mut dirs, v, 1); // warm-up
            }
            // Interleaved, so that drift over the run touches every variant alike. The first
            // round's time fixes how many rounds the cell makes (before the rest start).
            let mut rounds = repeats;
            let mut round = 0;
            while round < rounds {
                let t = Instant::now();
                for (i, &v) in VARIANTS.iter().enumerate() {
                    let k = count(v, bytes, depth, scale);
                    per_copy[i].push(measure(&mut dirs, v, k));
                }
                if round == 0 {
                    let fit = (cell_secs / t.elapsed().as_secs_f64().max(1e-6)) as usize;
                    rounds = fit.clamp(repeats, max_rounds);
                }
                round += 1;
            }
            // Paired by round: a ratio of two variants measured one after the other.
            let pairs = |x: usize, base: usize| -> Vec<f64> {
                per_copy[base]
                    .iter()
                    .zip(&per_copy[x])
                    .map(|(b, x)| b / x.max(1e-12))
                    .collect()
            };
            let extra_us: Vec<f64> = per_copy[GD_ONE]
                .iter()
                .zip(&per_copy[RAW_ONE])
                .map(|(g, r)| (g - r) * 1e6)
                .collect();
            let moved = bytes * dirs.len();
            let gbs = |s: f64| moved as f64 / s.max(1e-12) / 1e9;
            rows.push(Row {
                bytes,
                both,
                depth,
                gbs: per_copy
                    .iter()
                    .map(|v| Summary::of(v).map_or(0.0, |s| gbs(s.median)))
                    .collect(),
                extra_us,
                // Against the mean of the raw runs before and after it: whatever a run leaves
                // behind for the next touches both sides alike.
                pipe: per_copy[RAW_PIPE]
                    .iter()
                    .zip(&per_copy[RAW_AGAIN])
                    .zip(&per_copy[GD_PIPE])
                    // GB/s are 1 / seconds per copy: gpudirect's over the mean of raw's two.
                    .map(|((a, b), g)| paired::ratio(1.0 / a, 1.0 / g.max(1e-12), 1.0 / b))
                    .collect(),
                scoped: per_copy[RAW_AGAIN]
                    .iter()
                    .zip(&per_copy[RAW_THIRD])
                    .zip(&per_copy[GD_SCOPE])
                    .map(|((a, b), g)| paired::ratio(1.0 / a, 1.0 / g.max(1e-12), 1.0 / b))
                    .collect(),
                noise: pairs(RAW_AGAIN, RAW_PIPE),
            });
            eprintln!(
                "{} {}: done ({:.0} s so far)",
                size_name(bytes),
                if both { "both ways" } else { "one way" },
                started.elapsed().as_secs_f64()
            );
        }
    }
    println!(
        "\n== peer copies {a} -> {b}{} (GB/s, median of the cell's rounds; ratio = gpudirect / raw; \
         +us = gpudirect's extra time per copy one at a time, median; paired = each round's \
         gpudirect / the mean of the raw runs before and after it, median; verdicts below)",
        if a != b { " (and back, both ways)" } else { "" }
    );
    println!(
        "{:<5} {:>7} {:>6} | {:>8} {:>9} {:>6} {:>6} {:>9} | {:>5} {:>8} {:>9} {:>6} {:>9} {:>8} {:>6} {:>9} | {:>9} {:>9} {:>6} {:>6}",
        "dir",
        "size",
        "rounds",
        "raw",
        "gpudirect",
        "ratio",
        "+us",
        "verdict",
        "depth",
        "raw",
        "gpudirect",
        "paired",
        "verdict",
        "scoped",
        "paired",
        "verdict",
        "raw batch",
        "gpudirect",
        "/batch",
        "/pipe"
    );
    println!(
        "{:<21}| {:<43}| {:<68}| batched (depth copies, one call, one wait)",
        "",
        "one at a time",
        "pipelined (depth in flight, one wait): copy_async, and scoped (Copier::scope)"
    );
    let summary = |v: &[f64]| Summary::of(v).expect("a cell measures at least one round");
    for row in &rows {
        let g = &row.gbs;
        let r = |x: f64, base: f64| if base > 0.0 { x / base } else { 0.0 };
        let (one, pipe, scoped) = (
            summary(&row.extra_us),
            summary(&row.pipe),
            summary(&row.scoped),
        );
        println!(
            "{:<5} {:>7} {:>6} | {:>8.2} {:>9.2} {:>5.2}x {:>6.2} {:>9} | {:>5} {:>8.2} {:>9.2} {:>5.2}x {:>9} {:>8.2} {:>5.2}x {:>9} | {:>9} {:>9.2} {:>6} {:>5.2}x",
            if row.both { "both" } else { "one" },
            size_name(row.bytes),
            pipe.n,
            g[RAW_ONE],
            g[GD_ONE],
            r(g[GD_ONE], g[RAW_ONE]),
            one.median,
            one.at_most(ONE_TARGET_US).to_string(),
            row.depth,
            g[RAW_PIPE],
            g[GD_PIPE],
            pipe.median,
            pipe.at_least(PIPE_TARGET).to_string(),
            g[GD_SCOPE],
            scoped.median,
            scoped.at_least(PIPE_TARGET).to_string(),
            if g[RAW_BATCH] > 0.0 {
                format!("{:.2}", g[RAW_BATCH])
            } else {
                "-".to_string()
            },
            g[GD_BATCH],
            if g[RAW_BATCH] > 0.0 {
                format!("{:.2}x", r(g[GD_BATCH], g[RAW_BATCH]))
            } else {
                "-".to_string()
            },
            r(g[GD_BATCH], g[RAW_PIPE]),
        );
    }
    println!(
        "\nverdicts: median [95% interval of the median] (lowest..highest) and rounds; pipelined \
         paired ratio against {PIPE_TARGET:.2}x, one at a time +us against {ONE_TARGET_US} us \
         (ok: the median meets it; MISSES: the whole interval misses it; undecided: between, or too few rounds for an interval); \
         raw/raw: raw's second run over its first in the same rounds, flagged when its whole \
         interval is more than 1% from 1.00"
    );
    for row in &rows {
        let (one, pipe, scoped, noise) = (
            summary(&row.extra_us),
            summary(&row.pipe),
            summary(&row.scoped),
            summary(&row.noise),
        );
        // Raw's second run over its first, away from 1.00 by more than 1% (its whole interval):
        // the place in the round moves the figures, and the pairing's mean only halves that.
        let order = match noise.ci {
            Some((lo, hi)) if lo > 1.01 || hi < 0.99 => " (raw moves with its place in the round)",
            _ => "",
        };
        println!(
            "{:<4} {:>7}: pipelined {pipe} {}; scoped {scoped} {}; raw/raw {noise}{order}; one at a time +us {one} {}",
            if row.both { "both" } else { "one" },
            size_name(row.bytes),
            pipe.at_least(PIPE_TARGET),
            scoped.at_least(PIPE_TARGET),
            one.at_most(ONE_TARGET_US),
        );
    }
    println!(
        "(run took {:.0} s{})",
        started.elapsed().as_secs_f64(),
        if quick { ", quick mode" } else { "" }
    );
}
