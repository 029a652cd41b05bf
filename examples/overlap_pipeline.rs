//! The classic three-stream step, ordered only by CUDA events: while batch `i` is computed,
//! batch `i + 1` is loaded (H2D) and the result of batch `i - 1` is sent back (D2H).
//!
//! The compute stage is a kernel of known duration (`examples/kernels/spin.ptx`, hand-written
//! PTX spinning on `%globaltimer`, then adding 1 to every element), loaded with
//! `cuModuleLoadData`. Prints each stage alone, the serial sum, the overlapped step time and the
//! overlap efficiency, and checks the bytes that came back.
//!
//! ```text
//! cargo run --release --example overlap_pipeline
//! cargo run --release --example overlap_pipeline -- --batch-mib 64 --steps 100 --kernel-us 500
//! ```
//!
//! Without a GPU it prints `SKIPPED: reason` and exits 0; 2 on a bad option. `--help` lists the
//! options and their environment settings (`OVERLAP_BATCH_MIB`, `OVERLAP_STEPS`,
//! `OVERLAP_KERNEL_US`).

#[path = "support/cli.rs"]
mod cli;
#[path = "support/spin.rs"]
mod spin;

use clap::Parser;
use gpudirect::cuda::Stream;
use gpudirect::cudarc::driver::{CudaContext, CudaEvent, sys};
use gpudirect::memory::{DeviceBuffer, DeviceMemory, HostAllocFlags, PinnedHostBuffer};
use gpudirect_testing::{Hardware, skip_example};
use spin::{Kernel, check};
use std::sync::Arc;

const SLOTS: usize = 3;

/// Three streams ordered only by CUDA events: load batch i+1 (host to device), compute batch i
/// (a kernel of known duration), store batch i-1 (device to host); prints each stage alone, the
/// overlapped step and the overlap efficiency, and checks the bytes that come back.
#[derive(Parser)]
struct Args {
    /// Batch size in MiB (2^20 bytes), 1 to 4096; three batches live on the GPU and six in
    /// pinned host memory.
    #[arg(long, env = "OVERLAP_BATCH_MIB", default_value = "16", value_parser = batch_mib)]
    batch_mib: cli::Mib,
    /// Pipeline steps (batches), at least 3 (one per stage, so that every slot is checked).
    #[arg(long, env = "OVERLAP_STEPS", default_value_t = 40,
          value_parser = clap::value_parser!(u32).range(SLOTS as i64..=1_000_000))]
    steps: u32,
    /// Kernel duration in microseconds, 0 to 10000000 [default: the measured host-to-device time
    /// of one batch]
    #[arg(long, env = "OVERLAP_KERNEL_US",
          value_parser = clap::value_parser!(u64).range(0..=10_000_000))]
    kernel_us: Option<u64>,
}

/// A batch size: 1 to 4096 MiB (the kernel counts elements in 32 bits).
fn batch_mib(s: &str) -> Result<cli::Mib, String> {
    let m = cli::mib(s)?;
    if m.mib > 4096 {
        return Err(format!("{} MiB is over the 4096 MiB limit", m.mib));
    }
    Ok(m)
}

fn timing_event(ctx: &Arc<CudaContext>) -> CudaEvent {
    ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .expect("cuEventCreate")
}

/// H2D of `src` into `dst` on `stream`.
fn h2d(stream: &Stream, src: &PinnedHostBuffer<u32>, dst: &DeviceBuffer<u32>) {
    // SAFETY: both buffers outlive the copy (main synchronizes before dropping them); the
    // destination is not read by the host meanwhile.
    let r = unsafe {
        sys::cuMemcpyHtoDAsync_v2(
            dst.device_ptr(),
            src.as_ptr().cast(),
            dst.byte_len(),
            stream.cu_stream(),
        )
    };
    check("cuMemcpyHtoDAsync_v2", r).expect("H2D");
}

/// D2H of `src` into `dst` on `stream`.
fn d2h(stream: &Stream, src: &DeviceBuffer<u32>, dst: &PinnedHostBuffer<u32>) {
    // SAFETY: as in `h2d`; the host reads `dst` only after synchronizing.
    let r = unsafe {
        sys::cuMemcpyDtoHAsync_v2(
            dst.host_ptr().expect("pinned host").cast(),
            src.device_ptr(),
            src.byte_len(),
            stream.cu_stream(),
        )
    };
    check("cuMemcpyDtoHAsync_v2", r).expect("D2H");
}

fn main() {
    let args = Args::parse();
    let ctx = match gpudirect::cuda::context(0) {
        Ok(c) => c,
        Err(e) => skip_example(Hardware::Gpu, e),
    };
    let kernel = Kernel::load(&ctx).expect("load spin.ptx");
    let batch_mib = args.batch_mib.mib;
    let steps = args.steps as usize;
    let n = args.batch_mib.bytes / 4;
    let load = Stream::new(&ctx).unwrap();
    let comp = Stream::new(&ctx).unwrap();
    let store = Stream::new(&ctx).unwrap();

    let inputs: Vec<PinnedHostBuffer<u32>> = (0..SLOTS)
        .map(|s| {
            let data: Vec<u32> = (0..n as u32)
                .map(|i| i.wrapping_mul(2654435761) ^ s as u32)
                .collect();
            PinnedHostBuffer::from_slice(&ctx, &data, HostAllocFlags::PORTABLE).unwrap()
        })
        .collect();
    let mut outputs: Vec<PinnedHostBuffer<u32>> = (0..SLOTS)
        .map(|_| PinnedHostBuffer::alloc(&ctx, n, HostAllocFlags::PORTABLE).unwrap())
        .collect();
    let dev: Vec<DeviceBuffer<u32>> = (0..SLOTS)
        .map(|_| DeviceBuffer::alloc(&ctx, n).unwrap())
        .collect();

    // Each stage alone: `steps` repetitions on one stream, timed by events.
    let time = |stream: &Stream, f: &dyn Fn(usize)| -> f64 {
        let (a, b) = (timing_event(&ctx), timing_event(&ctx));
        f(0); // warm-up
        a.record(stream.cuda()).unwrap();
        for i in 0..steps {
            f(i);
        }
        b.record(stream.cuda()).unwrap();
        a.elapsed_ms(&b).unwrap() as f64 / steps as f64
    };
    let t_h2d = time(&load, &|i| h2d(&load, &inputs[i % SLOTS], &dev[i % SLOTS]));
    // At most 10^7 us (checked by the parser), or the measured time: no overflow in ns.
    let kernel_ns = args
        .kernel_us
        .unwrap_or(((t_h2d * 1000.0) as u64).min(10_000_000))
        * 1000;
    let t_comp = time(&comp, &|i| {
        kernel.launch(&comp, kernel_ns, &dev[i % SLOTS]).unwrap()
    });
    let t_d2h = time(&store, &|i| {
        d2h(&store, &dev[i % SLOTS], &outputs[i % SLOTS])
    });
    comp.synchronize().unwrap();

    // Reset the device slots to the inputs before the pipelined run.
    for s in 0..SLOTS {
        h2d(&load, &inputs[s], &dev[s]);
    }
    load.synchronize().unwrap();

    // Overlapped: step i loads batch i+1, computes batch i, stores batch i-1. Only events order
    // the three streams.
    let (start, end) = (timing_event(&ctx), timing_event(&ctx));
    let mut loaded: Vec<Option<CudaEvent>> = (0..steps + 1).map(|_| None).collect();
    let mut computed: Vec<Option<CudaEvent>> = (0..steps + 1).map(|_| None).collect();
    let mut stored: Vec<Option<CudaEvent>> = (0..steps + 1).map(|_| None).collect();
    start.record(load.cuda()).unwrap();
    comp.wait(&start).unwrap();
    store.wait(&start).unwrap();
    for step in 0..steps + 2 {
        // load batch `step` (slot reuse: after batch step-3 has been stored)
        if step < steps {
            if step >= SLOTS {
                load.wait(stored[step - SLOTS].as_ref().unwrap()).unwrap();
            }
            h2d(&load, &inputs[step % SLOTS], &dev[step % SLOTS]);
            loaded[step] = Some(load.record_event().unwrap());
        }
        // compute batch step-1
        if (1..=steps).contains(&step) {
            let b = step - 1;
            comp.wait(loaded[b].as_ref().unwrap()).unwrap();
            kernel.launch(&comp, kernel_ns, &dev[b % SLOTS]).unwrap();
            computed[b] = Some(comp.record_event().unwrap());
        }
        // store batch step-2
        if (2..steps + 2).contains(&step) {
            let b = step - 2;
            store.wait(computed[b].as_ref().unwrap()).unwrap();
            d2h(&store, &dev[b % SLOTS], &outputs[b % SLOTS]);
            stored[b] = Some(store.record_event().unwrap());
        }
    }
    load.wait(stored[steps - 1].as_ref().unwrap()).unwrap();
    end.record(load.cuda()).unwrap();
    let total = start.elapsed_ms(&end).unwrap() as f64;
    for s in [&load, &comp, &store] {
        s.synchronize().unwrap();
    }
    let step_ms = total / steps as f64;

    // Exact bytes: every batch went through the kernel once.
    for s in 0..SLOTS {
        let want = inputs[s].iter().map(|x| x.wrapping_add(1));
        assert!(
            outputs[s].iter().copied().eq(want),
            "slot {s}: output differs from input + 1"
        );
        outputs[s].as_mut_slice().fill(0);
    }

    let serial = t_h2d + t_comp + t_d2h;
    let slowest = t_h2d.max(t_comp).max(t_d2h);
    let gbs = |ms: f64| (n * 4) as f64 / (ms * 1e-3) / 1e9;
    println!(
        "overlap_pipeline: {} batches of {batch_mib} MiB, kernel {} us, 3 streams ordered by events only",
        steps,
        kernel_ns / 1000
    );
    println!(
        "  H2D alone            {t_h2d:8.3} ms/batch ({:.1} GB/s)",
        gbs(t_h2d)
    );
    println!("  compute alone        {t_comp:8.3} ms/batch");
    println!(
        "  D2H alone            {t_d2h:8.3} ms/batch ({:.1} GB/s)",
        gbs(t_d2h)
    );
    println!("  serial sum           {serial:8.3} ms/step");
    println!("  overlapped           {step_ms:8.3} ms/step (incl. pipeline fill and drain)");
    println!(
        "  speedup              {:8.2}x (ideal {:.2}x)",
        serial / step_ms,
        serial / slowest
    );
    println!(
        "  overlap efficiency   {:8.1}% (serial - overlapped) / (serial - slowest stage)",
        100.0 * (serial - step_ms) / (serial - slowest)
    );
    println!("  bytes checked: output == input + 1 for the last {SLOTS} batches");
}
