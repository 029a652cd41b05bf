//! GPUDirect RDMA smoke test: register a GPU buffer with the NIC by the best available path
//! (dma-buf, then nvidia-peermem), RDMA-write it into a host buffer over a loopback pair of RC
//! queue pairs on the first verbs device, and verify every byte.
//!
//! ```text
//! cargo run --release --example gpu_rdma_write              # 1 MiB
//! cargo run --release --example gpu_rdma_write -- 65536     # BYTES
//! ```
//!
//! Where no path exists it prints `SKIPPED: <reason>` and exits 0: no GPU, a GPU that says it
//! cannot do GPUDirect RDMA, no verbs device, or neither dma-buf nor nvidia-peermem (with each
//! path's refusal). It exits 1 instead when
//! `GPUDIRECT_REQUIRE` names the missing hardware (`gpu`, `rdma`); 2 on a bad argument.

#[path = "support/cli.rs"]
mod cli;

use clap::Parser;
use gpudirect::memory::{DeviceBuffer, DeviceMemory};
use gpudirect::rdma::check_rdma_capable;
use gpudirect::rdma::*;
use gpudirect_testing::{Hardware, skip_example};
use std::time::{Duration, Instant};

/// Register GPU memory with the first verbs device (dma-buf, else nvidia-peermem), RDMA-write it
/// into host memory through two queue pairs connected to each other, and verify every byte.
#[derive(Parser)]
struct Args {
    /// Bytes to write (sent in messages of at most 1 GiB).
    #[arg(value_name = "BYTES", default_value = "1048576", value_parser = cli::positive)]
    bytes: usize,
}

fn main() {
    let n = Args::parse().bytes;
    if let Err(e) = run(n) {
        eprintln!("FAILED: {e}");
        std::process::exit(1);
    }
}

fn run(n: usize) -> gpudirect::Result<()> {
    let ctx = match gpudirect::cuda::context(0) {
        Ok(c) => c,
        Err(e) => skip_example(Hardware::Gpu, format!("no GPU: {e}")),
    };
    let info = gpudirect::cuda::DeviceInfo::query(0)?;
    let peermem = gpudirect::sys::peermem::peermem_module();
    let gpu_side = format!(
        "GPU 0 {}: dma-buf export {}, GPUDirect RDMA {}, peer-memory module {}",
        info.name,
        yes(info.dma_buf),
        yes(info.gpudirect_rdma),
        peermem.as_ref().map_or("absent".into(), |m| m.name.clone()),
    );
    println!("{gpu_side}");

    // The GPU buffer: bytes i*7+3 (mod 256), through a stream copy.
    let stream = gpudirect::cuda::Stream::new(&ctx)?;
    let pattern: Vec<u8> = (0..n)
        .map(|i| (i as u8).wrapping_mul(7).wrapping_add(3))
        .collect();
    let buf = DeviceBuffer::from_slice(&stream, &pattern)?;
    match check_rdma_capable(&buf) {
        Ok(_) => {}
        // The GPU says it cannot take part in GPUDirect RDMA: a missing capability, as no NIC.
        Err(e) if e.absence().is_some() => skip_example(
            Hardware::Rdma,
            format!("this GPU cannot do GPUDirect RDMA ({e}). {gpu_side}"),
        ),
        Err(e) => return Err(e),
    }

    let vctx = match Context::open_by_name(None) {
        Ok(c) => c,
        Err(e) => skip_example(
            Hardware::Rdma,
            format!("no verbs device ({e}); no GPU memory region can be registered. {gpu_side}"),
        ),
    };
    let pd = vctx.alloc_pd()?;
    let mr = match pd.register_gpu(buf, AccessFlags::empty(), GpuRegistration::Auto) {
        Ok(mr) => mr,
        Err(gpudirect::Error::NoGpuRegistrationPath { attempts }) => skip_example(
            Hardware::Rdma,
            format!(
                "no dma-buf and no nvidia-peermem path on {}: {attempts}",
                vctx.name()
            ),
        ),
        Err(e) => return Err(e),
    };
    println!(
        "registered {n} bytes of GPU memory on {} via {} (addr {:#x}, rkey {:#x}; refused first: {})",
        vctx.name(),
        mr.path(),
        mr.addr(),
        mr.rkey(),
        mr.attempts()
    );

    let dst = pd.register_remote(HostBuffer::zeroed(n)?, AccessFlags::REMOTE_WRITE)?;
    let (cq, a, _b) = loopback(&vctx, &pd)?;
    let mut cq = cq;
    let mut a = a;
    let start = Instant::now();
    // Messages are at most 2 GiB; the default size needs one.
    let mut off = 0;
    while off < n {
        let len = (n - off).min(1 << 30);
        a.post_send([SendRequest::write(
            mr.slice(off..off + len)?,
            dst.remote().slice(off as u64, len as u32)?,
        )])?;
        wait_one(&mut cq)?;
        off += len;
    }
    let took = start.elapsed();
    let got = dst.to_vec();
    if got != pattern {
        let first = got.iter().zip(&pattern).position(|(x, y)| x != y);
        return Err(cli::invalid(
            "received",
            format!("first mismatch at byte {first:?}"),
            "the RDMA-written bytes must equal the GPU buffer",
        ));
    }
    println!(
        "OK: {n} bytes RDMA-written from GPU memory ({}) into host memory and verified in {:.1} ms",
        mr.memory().kind_name(),
        took.as_secs_f64() * 1e3
    );
    Ok(())
}

trait KindName {
    fn kind_name(&self) -> String;
}

impl<M: DeviceMemory> KindName for M {
    fn kind_name(&self) -> String {
        format!("{:?} on GPU {}", self.kind(), self.ordinal())
    }
}

fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

/// Two RC queue pairs on port 1 of `ctx`, connected to each other; `a` reports to the CQ.
fn loopback(
    ctx: &Context,
    pd: &ProtectionDomain,
) -> gpudirect::Result<(CompletionQueue, QueuePair<Rts>, QueuePair<Rts>)> {
    let port = ctx.query_port(1)?;
    let gid = ctx.preferred_gid(1)?;
    let cq = ctx.create_cq(16, None)?;
    let cq_b = ctx.create_cq(16, None)?;
    let caps = QpCaps {
        max_send_wr: 16,
        max_recv_wr: 1,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
        signal_every: 1,
    };
    let access = AccessFlags::REMOTE_WRITE;
    let a = QueuePair::create(pd, &cq, &cq, None, caps)?.to_init(1, access)?;
    let b = QueuePair::create(pd, &cq_b, &cq_b, None, caps)?.to_init(1, access)?;
    let ep = |qp_num, psn| Endpoint {
        qp_num,
        psn,
        gid: gid.gid,
        gid_index: gid.index as u8,
        lid: port.lid,
    };
    let (ea, eb) = (ep(a.qp_num(), 0x1234), ep(b.qp_num(), 0x5678));
    let mtu = port.active_mtu;
    let a = a
        .to_rtr(&RtrAttr::from_endpoint(&eb, mtu, gid.index as u8))?
        .to_rts(&RtsAttr::new(ea.psn).timeout(14))?;
    let b = b
        .to_rtr(&RtrAttr::from_endpoint(&ea, mtu, gid.index as u8))?
        .to_rts(&RtsAttr::new(eb.psn).timeout(14))?;
    // b holds its CQ; the handle here is not needed.
    drop(cq_b);
    Ok((cq, a, b))
}

/// Poll one completion (10 s bound); an error status is an error.
fn wait_one(cq: &mut CompletionQueue) -> gpudirect::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(w) = cq.poll()?.next() {
            return w.result();
        }
        if Instant::now() > deadline {
            return Err(gpudirect::Error::Timeout {
                what: "the RDMA write's completion",
                after: Duration::from_secs(10),
            });
        }
        std::thread::yield_now();
    }
}
