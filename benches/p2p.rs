//! Peer-copy bandwidth, unidirectional and bidirectional, 4 KiB to 1 GiB, beside raw
//! `cuMemcpyPeerAsync` measured in the same run; a table of GB/s and ratios at the end.
//!
//! With two or more GPUs it measures devices 0 and 1 (`auto` is the peer path where the pair
//! allows it). With one GPU there is no peer: it measures gpudirect's staged path 0 -> 0 and
//! `auto` (the same-device path) against raw `cuMemcpyPeerAsync` 0 -> 0, and says so.
//!
//! `P2P_BENCH_MAX_MIB` caps the largest size (default 1024).

use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use gpudirect::cudarc::driver::sys;
use gpudirect::cudarc::driver::{CudaContext, CudaStream};
use gpudirect::memory::{DeviceBuffer, DeviceMemory};
use gpudirect::p2p::{Copier, CopyOptions, PathChoice};
use gpudirect_testing::{Hardware, skip_example};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type Results = Mutex<BTreeMap<(usize, &'static str, &'static str), Vec<f64>>>;
static RESULTS: Results = Mutex::new(BTreeMap::new());

fn record(bytes: usize, dir: &'static str, variant: &'static str, moved: usize, t: Duration) {
    let gbs = moved as f64 / t.as_secs_f64().max(1e-12) / 1e9;
    RESULTS
        .lock()
        .unwrap()
        .entry((bytes, dir, variant))
        .or_default()
        .push(gbs);
}

struct Pair {
    a: usize,
    b: usize,
    ctx_a: Arc<CudaContext>,
    ctx_b: Arc<CudaContext>,
    s_a: Arc<CudaStream>,
    s_b: Arc<CudaStream>,
}

fn buffers(ctx: &Arc<CudaContext>, words: usize) -> DeviceBuffer<u32> {
    DeviceBuffer::<u32>::zeroed(ctx, words).expect("cuMemAlloc")
}

/// Raw baseline: `cuMemcpyPeerAsync` on a stream of the source device, then synchronize.
fn raw_copy(
    dst: u64,
    dctx: &CudaContext,
    src: u64,
    sctx: &CudaContext,
    bytes: usize,
    s: &CudaStream,
) {
    // SAFETY: both buffers are live for the call's duration (synchronized before return).
    let r = unsafe {
        sys::cuMemcpyPeerAsync(dst, dctx.cu_ctx(), src, sctx.cu_ctx(), bytes, s.cu_stream())
    };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
}

fn bench(c: &mut Criterion, p: &Pair, sizes: &[usize], variants: &[(&'static str, PathChoice)]) {
    for &dir in &["uni", "bi"] {
        let mut g = c.benchmark_group(format!("p2p_{dir}_{}to{}", p.a, p.b));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(150))
            .measurement_time(Duration::from_millis(400))
            .sampling_mode(SamplingMode::Flat);
        for &bytes in sizes {
            let words = bytes / 4;
            let moved = if dir == "bi" { 2 * bytes } else { bytes };
            g.throughput(Throughput::Bytes(moved as u64));
            let mut a_src = Some(buffers(&p.ctx_a, words));
            let mut b_dst = Some(buffers(&p.ctx_b, words));
            let mut b_src = Some(buffers(&p.ctx_b, words));
            let mut a_dst = Some(buffers(&p.ctx_a, words));
            for &(name, choice) in variants {
                let opts = CopyOptions {
                    path: choice,
                    ..Default::default()
                };
                let ab = Copier::new(p.a, p.b, opts).expect("copier a->b");
                let ba = Copier::new(p.b, p.a, opts).expect("copier b->a");
                g.bench_function(BenchmarkId::new(name, bytes), |bch| {
                    bch.iter_custom(|iters| {
                        let t = Instant::now();
                        for _ in 0..iters {
                            let d1 = ab.copy_async(a_src.take().unwrap(), b_dst.take().unwrap());
                            let d2 = (dir == "bi").then(|| {
                                ba.copy_async(b_src.take().unwrap(), a_dst.take().unwrap())
                            });
                            (a_src, b_dst) = d1.unwrap().wait().unwrap().into_parts().into_opt();
                            if let Some(d2) = d2 {
                                (b_src, a_dst) =
                                    d2.unwrap().wait().unwrap().into_parts().into_opt();
                            }
                        }
                        let el = t.elapsed();
                        record(bytes, dir, name, moved * iters as usize, el);
                        el
                    })
                });
            }
            let (pa, pb, pb2, pa2) = (
                a_src.as_ref().unwrap().device_ptr(),
                b_dst.as_ref().unwrap().device_ptr(),
                b_src.as_ref().unwrap().device_ptr(),
                a_dst.as_ref().unwrap().device_ptr(),
            );
            g.bench_function(BenchmarkId::new("raw", bytes), |bch| {
                bch.iter_custom(|iters| {
                    let t = Instant::now();
                    for _ in 0..iters {
                        raw_copy(pb, &p.ctx_b, pa, &p.ctx_a, bytes, &p.s_a);
                        if dir == "bi" {
                            raw_copy(pa2, &p.ctx_a, pb2, &p.ctx_b, bytes, &p.s_b);
                        }
                        p.s_a.synchronize().unwrap();
                        if dir == "bi" {
                            p.s_b.synchronize().unwrap();
                        }
                    }
                    let el = t.elapsed();
                    record(bytes, dir, "raw", moved * iters as usize, el);
                    el
                })
            });
        }
        g.finish();
    }
}

trait IntoOpt<S, D> {
    fn into_opt(self) -> (Option<S>, Option<D>);
}
impl<S, D> IntoOpt<S, D> for (S, D) {
    fn into_opt(self) -> (Option<S>, Option<D>) {
        (Some(self.0), Some(self.1))
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn print_table(variants: &[(&'static str, PathChoice)], note: &str) {
    let r = RESULTS.lock().unwrap();
    println!(
        "\n== peer-copy bandwidth (GB/s, median of samples; ratio = gpudirect / raw in this run)"
    );
    println!("{note}");
    let mut header = format!("{:<4} {:>10} {:>9}", "dir", "size", "raw");
    for (name, _) in variants {
        header += &format!(" {:>9} {:>6}", name, "ratio");
    }
    println!("{header}");
    let mut keys: Vec<_> = r.keys().map(|(b, d, _)| (*d, *b)).collect();
    keys.sort();
    keys.dedup();
    for (dir, bytes) in keys {
        let raw = r
            .get(&(bytes, dir, "raw"))
            .map(|v| median(v))
            .unwrap_or(0.0);
        let size = if bytes >= 1 << 20 {
            format!("{} MiB", bytes >> 20)
        } else {
            format!("{} KiB", bytes >> 10)
        };
        let mut line = format!("{dir:<4} {size:>10} {raw:>9.2}");
        for (name, _) in variants {
            let v = r
                .get(&(bytes, dir, *name))
                .map(|v| median(v))
                .unwrap_or(0.0);
            line += &format!(" {v:>9.2} {:>5.2}x", if raw > 0.0 { v / raw } else { 0.0 });
        }
        println!("{line}");
    }
}

fn main() {
    let n = match gpudirect::cuda::device_count() {
        Ok(0) => skip_example(Hardware::Gpu, "no CUDA device visible"),
        Ok(n) => n,
        Err(e) => skip_example(Hardware::Gpu, e),
    };
    let max_mib: usize = std::env::var("P2P_BENCH_MAX_MIB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1024);
    let sizes: Vec<usize> = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30]
        .into_iter()
        .filter(|&b| b <= max_mib << 20)
        .collect();
    let (a, b) = if n > 1 { (0, 1) } else { (0, 0) };
    let ctx_a = gpudirect::cuda::context(a).expect("context");
    let ctx_b = gpudirect::cuda::context(b).expect("context");
    let pair = Pair {
        a,
        b,
        s_a: ctx_a.new_stream().expect("stream"),
        s_b: ctx_b.new_stream().expect("stream"),
        ctx_a,
        ctx_b,
    };
    let auto = Copier::new(a, b, CopyOptions::default()).expect("copier");
    let note = if n > 1 {
        if gpudirect::p2p::enable_peer_access_both(a, b).is_err() {
            format!("GPUs {a} and {b}: no peer access; auto = {}", auto.path())
        } else {
            format!(
                "GPUs {a} and {b}: auto = {} (raw runs with peer access enabled)",
                auto.path()
            )
        }
    } else {
        "ONE GPU: no peer pair exists. Measured: gpudirect's staged path 0->0 (pinned bounce \
         buffers) and auto (= same-device copy) against raw cuMemcpyPeerAsync 0->0 (a device-local \
         copy). Staged/raw is not a peer-copy ratio."
            .to_string()
    };
    println!("{note}");
    let variants: Vec<(&'static str, PathChoice)> = if n > 1 {
        vec![("auto", PathChoice::Auto)]
    } else {
        vec![("auto", PathChoice::Auto), ("staged", PathChoice::Staged)]
    };
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c, &pair, &sizes, &variants);
    c.final_summary();
    print_table(&variants, &note);
}
