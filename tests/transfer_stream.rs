//! Tier 2 with a verbs device: stream-ordered transfers over the RDMA backend, started by one
//! CUDA stream and waited for by another, on a loopback endpoint pair (the first verbs device's
//! IPv4 address). Needs a GPU and a verbs device on the same node (Soft-RoCE will do: the
//! transferred memory is host memory, or GPU memory the engine stages); without either every
//! test prints `SKIPPED`. On a GPU node without a NIC these skip: the stream half alone is
//! covered by the unit test `transfer::stream::tests::streams_fire_the_proxy_and_wait_on_its_word_on_a_gpu`.

mod support;

use gpudirect::Error;
use gpudirect::cuda::{MemopFlags, Stream, WaitCondition};
use gpudirect::cudarc::driver::{CudaContext, sys};
use gpudirect::memory::DeviceBuffer;
use gpudirect::transfer::{
    Buffer, Endpoint, Engine, EngineConfig, MemoryDescriptor, Region, TransferOptions,
};
use gpudirect_testing::{Hardware, skip};
use std::sync::Arc;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(60);

struct Setup {
    ctx: Arc<CudaContext>,
    engine: Engine,
    client: Endpoint,
    _server: Endpoint,
    target: Region,
}

/// GPU 0, and a loopback pair on the first verbs device whose server publishes a host region
/// holding `target`.
fn setup(target: Vec<u8>) -> Option<Setup> {
    let ctx = match gpudirect::cuda::context(0) {
        Ok(c) => c,
        Err(e) => {
            skip(Hardware::Gpu, e);
            return None;
        }
    };
    let engine = match gpudirect::rdma::DeviceList::non_empty() {
        Ok(l) => {
            let first = l.iter().map(|d| d.name()).min()?;
            Engine::new(EngineConfig::with_devices(&[first])).expect("engine")
        }
        Err(e) => {
            skip(
                Hardware::Rdma,
                format!("{e} (the RDMA backend needs a verbs device)"),
            );
            return None;
        }
    };
    let Some(ip) = support::rdma::device_ipv4(&engine.devices()) else {
        skip(Hardware::Rdma, "no IPv4 address on the verbs device");
        return None;
    };
    let target = engine.register(Buffer::host(target).unwrap()).unwrap();
    let descs: Vec<MemoryDescriptor> = vec![target.descriptor().unwrap()];
    let l = engine.listen(&format!("{ip}:0")).expect("listen");
    let peer = format!("{ip}:{}", l.port());
    let srv = std::thread::spawn(move || l.accept(&descs, WAIT));
    let client = engine.connect(&[&peer], &[]).expect("connect");
    let server = srv.join().unwrap().expect("accept");
    Some(Setup {
        ctx,
        engine,
        client,
        _server: server,
        target,
    })
}

fn spin_until(what: &str, f: impl Fn() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < WAIT, "{what}");
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Pinned words: slot 0 a gate the first stream waits on, slot 1 a marker the second stream
/// writes after its wait.
fn gate(ctx: &Arc<CudaContext>) -> Option<Arc<MemopFlags>> {
    let g = Arc::new(MemopFlags::pinned_host(ctx, 2).unwrap());
    if !g.supports_64_bit() {
        skip(
            Hardware::Gpu,
            "the device lacks 64-bit stream memory operations",
        );
        return None;
    }
    Some(g)
}

#[test]
fn a_stream_starts_a_write_and_another_stream_waits_for_its_word() {
    let _one = support::gpu::one_at_a_time();
    const N: usize = 256 << 10;
    let Some(s) = setup(vec![0xA5; N]) else {
        return;
    };
    let Some(g) = gate(&s.ctx) else { return };
    let data = support::files::pattern(N, support::gpu::seed_from("STREAM_TEST_SEED"));
    let src = s
        .engine
        .register(Buffer::host(data.clone()).unwrap())
        .unwrap();
    let dst = s.client.peer_descriptors()[0];
    let (s1, s2) = (Stream::new(&s.ctx).unwrap(), Stream::new(&s.ctx).unwrap());
    s1.wait_value64(&g, 0, 1, WaitCondition::Geq).unwrap();
    let t = s
        .client
        .write_on(
            &s1,
            vec![(src.all(), dst.all())],
            TransferOptions::default(),
        )
        .unwrap();
    t.wait_on(&s2).unwrap();
    s2.write_value64(&g, 1, 7).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(!t.is_complete(), "started before its stream got there");
    assert_eq!(g.load_u64(1).unwrap(), 0);
    assert!(s.target.to_vec().unwrap().iter().all(|&b| b == 0xA5));
    g.store_u64(0, 1).unwrap();
    spin_until("the second stream released", || g.load_u64(1).unwrap() == 7);
    // The second stream passed its wait: the peer's NIC acknowledged every byte.
    assert!(s.target.to_vec().unwrap() == data, "bytes differ");
    assert_eq!(t.wait(WAIT).unwrap().bytes, N as u64);
    let (addr, seq) = t.completion_word().unwrap();
    assert!(addr != 0 && seq == t.seq());
    s1.synchronize().unwrap();
    s2.synchronize().unwrap();
}

#[test]
fn a_stream_read_into_gpu_memory_is_visible_to_the_stream_that_waited() {
    let _one = support::gpu::one_at_a_time();
    const N: usize = 256 << 10;
    let data = support::files::pattern(N, support::gpu::seed_from("STREAM_TEST_SEED"));
    let Some(s) = setup(data.clone()) else {
        return;
    };
    let Some(g) = gate(&s.ctx) else { return };
    let (s1, s2) = (Stream::new(&s.ctx).unwrap(), Stream::new(&s.ctx).unwrap());
    let dev = DeviceBuffer::<u8>::from_slice(&s1, &vec![0x5A; N]).unwrap();
    let local = s.engine.register(Buffer::device(dev).unwrap()).unwrap();
    println!("local GPU memory reaches the NIC via {}", local.path());
    let src = s.client.peer_descriptors()[0];
    let t = s
        .client
        .read_on(
            &s1,
            vec![(local.all(), src.all())],
            TransferOptions::default(),
        )
        .unwrap();
    t.wait_on(&s2).unwrap();
    s2.write_value64(&g, 1, 9).unwrap();
    spin_until("the second stream released", || g.load_u64(1).unwrap() == 9);
    let mut got = vec![0u8; N];
    local.copy_to_host(0, &mut got).unwrap();
    assert!(got == data, "read bytes differ");
    t.wait(WAIT).unwrap();
    s1.synchronize().unwrap();
    s2.synchronize().unwrap();
}

#[test]
fn under_graph_capture_write_on_and_wait_on_are_refused_with_nothing_enqueued() {
    let _one = support::gpu::one_at_a_time();
    let Some(s) = setup(vec![0; 4096]) else {
        return;
    };
    let src = s
        .engine
        .register(Buffer::host(vec![3u8; 4096]).unwrap())
        .unwrap();
    let dst = s.client.peer_descriptors()[0];
    let s1 = Stream::new(&s.ctx).unwrap();
    let t = s
        .client
        .write_on(
            &s1,
            vec![(src.all(), dst.all())],
            TransferOptions::default(),
        )
        .unwrap();
    t.wait(WAIT).unwrap();
    let cap = Stream::new(&s.ctx).unwrap();
    cap.cuda()
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    let e = s
        .client
        .write_on(
            &cap,
            vec![(src.all(), dst.all())],
            TransferOptions::default(),
        )
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::StreamCapturing {
                enqueued: false,
                ..
            }
        ),
        "{e}"
    );
    let e = t.wait_on(&cap).unwrap_err();
    assert!(
        matches!(
            e,
            Error::StreamCapturing {
                enqueued: false,
                ..
            }
        ),
        "{e}"
    );
    let graph = cap
        .cuda()
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .expect("the refusals did not invalidate the capture");
    if let Some(g) = &graph {
        g.launch().unwrap();
    }
    cap.synchronize().unwrap();
    // The queue carries on after the refusals.
    let t = s
        .client
        .write_on(
            &s1,
            vec![(src.all(), dst.all())],
            TransferOptions::default(),
        )
        .unwrap();
    t.wait(WAIT).unwrap();
    assert!(t.is_released());
}
