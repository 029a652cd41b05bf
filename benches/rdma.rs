//! RDMA write/read bandwidth (8 B to 1 MiB) and RDMA write latency over a loopback pair of RC
//! queue pairs on the first verbs device. Prints `SKIPPED: reason` without one.
//!
//! Posting is what perftest does for parity: up to 128 requests in flight, chains of 16, one
//! signaled completion in 32, inline data up to 128 bytes. The raw baseline (perftest's
//! ib_write_bw / ib_read_bw / ib_write_lat in the same boot, with ratios) is produced by
//! `ci/rxe-vm/run.sh` beside `rdma_pingpong --report`, which measures the same loops.

use criterion::{BenchmarkId, Criterion, Throughput};
use gpudirect::rdma::*;
use gpudirect_testing::{Hardware, skip_example};
use std::time::{Duration, Instant};

const DEPTH: u32 = 128;
const INLINE: u32 = 128;
const MAX: usize = 1 << 20;

struct Setup {
    cq: CompletionQueue,
    cq_b: CompletionQueue,
    a: QueuePair<Rts>,
    b: QueuePair<Rts>,
    local: MemoryRegion<Remote>,
    remote: MemoryRegion<Remote>,
}

fn setup() -> gpudirect::Result<Setup> {
    let ctx = Context::open_by_name(None)?;
    let pd = ctx.alloc_pd()?;
    let port = ctx.query_port(1)?;
    let gid = ctx.preferred_gid(1)?;
    let cq = ctx.create_cq(2 * DEPTH, None)?;
    let cq_b = ctx.create_cq(2 * DEPTH, None)?;
    let caps = QpCaps {
        max_send_wr: DEPTH,
        max_recv_wr: 16,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: INLINE,
        signal_every: 32,
    };
    let acc = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
    let a = QueuePair::create(&pd, &cq, &cq, None, caps)?.to_init(1, acc)?;
    let b = QueuePair::create(&pd, &cq_b, &cq_b, None, caps)?.to_init(1, acc)?;
    let ep = |q| Endpoint {
        qp_num: q,
        psn: 0,
        gid: gid.gid,
        gid_index: gid.index as u8,
        lid: port.lid,
    };
    let (ea, eb) = (ep(a.qp_num()), ep(b.qp_num()));
    let rtr = |e: &Endpoint| {
        RtrAttr::from_endpoint(e, port.active_mtu, gid.index as u8).max_dest_rd_atomic(16)
    };
    let rts = RtsAttr::new(0).max_rd_atomic(16);
    let a = a.to_rtr(&rtr(&eb))?.to_rts(&rts)?;
    let b = b.to_rtr(&rtr(&ea))?.to_rts(&rts)?;
    let local = pd.register_remote(HostBuffer::zeroed(2 * MAX)?, acc)?;
    let remote = pd.register_remote(HostBuffer::zeroed(2 * MAX)?, acc)?;
    Ok(Setup {
        cq,
        cq_b,
        a,
        b,
        local,
        remote,
    })
}

impl Setup {
    /// `iters` writes (or reads) of `size` bytes, batched and mostly unsignaled.
    fn stream(&mut self, read: bool, size: usize, iters: u64) -> Duration {
        let remote = self.remote.remote().slice(0, size as u32).unwrap();
        let local = self.local.slice(..size).unwrap();
        let inline = !read && size <= INLINE as usize;
        let payload = vec![0x5Au8; size];
        let (mut posted, mut done) = (0u64, 0u64);
        let t0 = Instant::now();
        while done < iters {
            let room = (DEPTH as u64)
                .saturating_sub(self.a.send_outstanding() as u64)
                .min(iters - posted)
                .min(16);
            if room > 0 {
                let chain = (posted..posted + room).map(|i| {
                    let w = if read {
                        SendRequest::read(local.clone(), remote)
                    } else if inline {
                        SendRequest::write_inline(&payload, remote)
                    } else {
                        SendRequest::write(local.clone(), remote)
                    };
                    let w = w.tag(i);
                    if i + 1 == iters { w } else { w.unsignaled() }
                });
                posted += self.a.post_send(chain).expect("ibv_post_send") as u64;
            }
            for w in self.cq.poll().expect("ibv_poll_cq") {
                w.result().expect("work completion");
                done = done.max(w.tag() + 1);
            }
        }
        t0.elapsed()
    }

    /// Round trips of an 8-byte RDMA write ping-pong between the two QPs; returns half the time.
    fn pingpong(&mut self, iters: u64) -> Duration {
        let (ra, rb) = (
            self.local.remote().slice(0, 8).unwrap(),
            self.remote.remote().slice(0, 8).unwrap(),
        );
        let base = rand_base();
        let t0 = Instant::now();
        for i in 1..=iters {
            let v = (base + i).to_ne_bytes();
            let w = SendRequest::write_inline(&v, rb);
            self.a
                .post_send([if i % 32 == 0 { w } else { w.unsignaled() }])
                .unwrap();
            while self.remote.read_u64(0).unwrap() != base + i {
                std::hint::spin_loop();
            }
            let w = SendRequest::write_inline(&v, ra);
            self.b
                .post_send([if i % 32 == 0 { w } else { w.unsignaled() }])
                .unwrap();
            while self.local.read_u64(0).unwrap() != base + i {
                std::hint::spin_loop();
            }
            self.cq.poll().unwrap().for_each(|w| w.result().unwrap());
            self.cq_b.poll().unwrap().for_each(|w| w.result().unwrap());
        }
        t0.elapsed() / 2
    }
}

fn rand_base() -> u64 {
    (rand::random::<u32>() as u64 | 1) << 32
}

fn main() {
    let mut s = match DeviceList::non_empty().and_then(|_| setup()) {
        Ok(s) => s,
        Err(e) => skip_example(Hardware::Rdma, e),
    };
    let mut c = Criterion::default()
        .configure_from_args()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(200));
    for (name, read) in [("rdma_write_bw", false), ("rdma_read_bw", true)] {
        let mut g = c.benchmark_group(name);
        for p in (3..=20).step_by(1) {
            let size = 1usize << p;
            g.throughput(Throughput::Bytes(size as u64));
            g.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, &size| {
                b.iter_custom(|iters| s.stream(read, size, iters))
            });
        }
        g.finish();
    }
    let mut g = c.benchmark_group("rdma_write_lat");
    g.bench_function("8", |b| b.iter_custom(|iters| s.pingpong(iters)));
    g.finish();
    c.final_summary();
}
