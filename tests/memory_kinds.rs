//! Memory kinds, typed copies and the completion tracker on a GPU (tier 2).
//!
//! Without a GPU each test prints `SKIPPED: reason` and passes, unless `GPUDIRECT_REQUIRE=gpu`.

mod support;

use gpudirect::Error;
use gpudirect::completion::{InFlight, Tracker};
use gpudirect::cuda::{MemopFlags, Stream, WaitCondition};
use gpudirect::memory::{
    DeviceBuffer, DeviceMemory, DeviceMemoryMut, HostAllocFlags, HostRegisterFlags, MemoryKind,
    MemoryType, PinnedHostBuffer, PoolBuffer, RegisteredHost, VmmBuffer, copy, copy_async,
    copy_from_host, copy_to_host,
};
use gpudirect_testing::{Hardware, require};
use rand::Rng;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const POISON: u32 = 0xDEAD_BEEF;

/// These tests block streams on host flags ("gates"): they run one at a time
/// (`support::gpu::one_at_a_time`) and allocate before closing their gate.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    support::gpu::one_at_a_time()
}

fn random(n: usize) -> Vec<u32> {
    let mut rng = rand::rng();
    (0..n).map(|_| rng.random()).collect()
}

/// A buffer that counts its drops (frees).
struct Counted<M> {
    inner: M,
    drops: Arc<AtomicUsize>,
}

// SAFETY: delegates to `inner`.
unsafe impl<M: DeviceMemory> DeviceMemory for Counted<M> {
    type Elem = M::Elem;
    fn device_ptr(&self) -> u64 {
        self.inner.device_ptr()
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn ordinal(&self) -> usize {
        self.inner.ordinal()
    }
    fn kind(&self) -> MemoryKind {
        self.inner.kind()
    }
    fn host_ptr(&self) -> Option<*mut u8> {
        self.inner.host_ptr()
    }
}
// SAFETY: delegates to `inner`.
unsafe impl<M: DeviceMemoryMut> DeviceMemoryMut for Counted<M> {}

impl<M> Drop for Counted<M> {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn every_kind_answers_its_pointer_attributes() {
    let _serial = serial();
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let stream = Stream::new(&ctx).unwrap();
    let n = 1 << 20;

    let d = DeviceBuffer::<u32>::alloc(&ctx, n).unwrap();
    let a = d.attributes().unwrap();
    println!("DeviceBuffer: {a:?}");
    assert_eq!(a.memory_type, MemoryType::Device);
    assert!(a.gpu_direct_rdma_capable);
    assert_eq!(a.device_ordinal, 0);
    assert_eq!(a.range_start, d.device_ptr());
    assert!(a.range_size >= d.byte_len());

    match VmmBuffer::<u32>::alloc(&ctx, n) {
        Ok(v) => {
            let a = v.attributes().unwrap();
            println!("VmmBuffer: {a:?} mapped {} bytes", v.mapped_bytes());
            assert_eq!(a.memory_type, MemoryType::Device);
            assert!(a.gpu_direct_rdma_capable);
            assert!(a.mapped);
            assert!(v.mapped_bytes() >= v.byte_len());
        }
        Err(Error::Unsupported { what, reason }) => {
            println!("VMM unsupported here: {what}: {reason}")
        }
        Err(e) => panic!("VmmBuffer: {e}"),
    }

    let slice = stream.cuda().alloc_zeros::<u32>(n).unwrap();
    let p = PoolBuffer::new(slice).unwrap();
    let a = p.attributes().unwrap();
    println!("PoolBuffer: {a:?}");
    assert_eq!(p.kind(), MemoryKind::Pool);
    assert_eq!(a.memory_type, MemoryType::Device);

    let h = PinnedHostBuffer::<u32>::alloc(
        &ctx,
        n,
        HostAllocFlags::PORTABLE | HostAllocFlags::DEVICEMAP,
    )
    .unwrap();
    let a = h.attributes().unwrap();
    println!("PinnedHostBuffer: {a:?}");
    assert_eq!(a.memory_type, MemoryType::Host);
    assert!(h.as_slice().iter().all(|&x| x == 0));

    let r = RegisteredHost::new(
        &ctx,
        vec![0u32; n].into_boxed_slice(),
        HostRegisterFlags::DEVICEMAP,
    )
    .unwrap();
    let a = r.attributes().unwrap();
    println!("RegisteredHost: {a:?}");
    assert_eq!(a.memory_type, MemoryType::Host);
    let back = r.into_inner().unwrap();
    assert_eq!(back.len(), n);
}

#[test]
fn copies_between_every_kind_are_exact() {
    let _serial = serial();
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let stream = Stream::new(&ctx).unwrap();
    let n = (3 << 20) + 17; // not a power of two
    let data = random(n);

    // pageable -> device (blocking)
    let mut d = DeviceBuffer::<u32>::alloc(&ctx, n).unwrap();
    copy_from_host(
        &stream,
        &[POISON; 1],
        &mut DeviceBuffer::<u32>::alloc(&ctx, 1).unwrap(),
    )
    .unwrap();
    copy_from_host(&stream, &data, &mut d).unwrap();

    // device -> pinned (async, poisoned destination)
    let mut h = PinnedHostBuffer::<u32>::alloc(&ctx, n, HostAllocFlags::empty()).unwrap();
    h.as_mut_slice().fill(POISON);
    let op = copy_async(&stream, d, h).unwrap();
    let (d, h) = op.wait().unwrap();
    assert!(h.as_slice() == &data[..], "D2H into pinned differs");

    // device -> vmm -> pool -> registered (async), each destination poisoned
    let vmm = VmmBuffer::<u32>::alloc(&ctx, n);
    let mid: Box<dyn FnOnce() -> Vec<u32>> = match vmm {
        Ok(v) => {
            let poison = vec![POISON; n];
            let mut v = v;
            copy_from_host(&stream, &poison, &mut v).unwrap();
            let (d, v) = copy_async(&stream, d, v).unwrap().wait().unwrap();
            drop(d);
            let got = v.to_vec(&stream).unwrap();
            assert!(got == data, "D2D into VMM differs");
            let slice = stream.cuda().alloc_zeros::<u32>(n).unwrap();
            let pool = PoolBuffer::new(slice).unwrap();
            let (_v, pool) = copy_async(&stream, v, pool).unwrap().wait().unwrap();
            Box::new(move || {
                let mut reg = RegisteredHost::new(
                    &ctx,
                    vec![POISON; n].into_boxed_slice(),
                    HostRegisterFlags::empty(),
                )
                .unwrap();
                copy(&stream, &pool, &mut reg).unwrap();
                reg.into_inner().unwrap().into_vec()
            })
        }
        Err(e) => {
            println!("VMM skipped: {e}");
            let slice = stream.cuda().alloc_zeros::<u32>(n).unwrap();
            let pool = PoolBuffer::new(slice).unwrap();
            let (_d, pool) = copy_async(&stream, d, pool).unwrap().wait().unwrap();
            Box::new(move || {
                let mut out = vec![POISON; n];
                copy_to_host(&stream, &pool, &mut out).unwrap();
                out
            })
        }
    };
    assert!(mid() == data, "pool -> registered host differs");

    // pinned -> device with an Arc source shared by two copies
    let src = Arc::new(h);
    let s2 = Stream::new(src.context()).unwrap();
    let a = copy_async(
        &s2,
        src.clone(),
        DeviceBuffer::<u32>::alloc(src.context(), n).unwrap(),
    )
    .unwrap();
    let b = copy_async(
        &s2,
        src.clone(),
        DeviceBuffer::<u32>::alloc(src.context(), n).unwrap(),
    )
    .unwrap();
    let (_, da) = a.wait().unwrap();
    let (_, db) = b.wait().unwrap();
    assert!(da.to_vec(&s2).unwrap() == data);
    assert!(db.to_vec(&s2).unwrap() == data);
}

#[test]
fn lengths_and_devices_are_checked_before_ffi() {
    let _serial = serial();
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let stream = Stream::new(&ctx).unwrap();
    let d = DeviceBuffer::<u32>::alloc(&ctx, 16).unwrap();
    let h = PinnedHostBuffer::<u32>::alloc(&ctx, 15, HostAllocFlags::empty()).unwrap();
    match copy_async(&stream, d, h) {
        Err(Error::InvalidArgument { arg: "dst", .. }) => {}
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    let mut out = vec![0u32; 3];
    let d = DeviceBuffer::<u32>::alloc(&ctx, 4).unwrap();
    assert!(matches!(
        copy_to_host(&stream, &d, &mut out),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        DeviceBuffer::<u32>::alloc(&ctx, 0),
        Err(Error::InvalidArgument { arg: "len", .. })
    ));
}

/// Block `stream` on a host flag; the returned closure releases it.
fn gate(ctx: &Arc<gpudirect::cudarc::driver::CudaContext>, stream: &Stream) -> Arc<MemopFlags> {
    let flags = Arc::new(MemopFlags::pinned_host(ctx, 1).unwrap());
    stream
        .wait_value32(&flags, 0, 1, WaitCondition::Eq)
        .unwrap();
    flags
}

#[test]
fn drop_while_in_flight_blocks_until_complete_and_frees_once() {
    let _serial = serial();
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let stream = Stream::new(&ctx).unwrap();
    let n = 1 << 20;
    let data = random(n);
    let drops = Arc::new(AtomicUsize::new(0));
    let src = Counted {
        inner: PinnedHostBuffer::from_slice(&ctx, &data, HostAllocFlags::empty()).unwrap(),
        drops: drops.clone(),
    };
    let dst = Counted {
        inner: DeviceBuffer::<u32>::alloc(&ctx, n).unwrap(),
        drops: drops.clone(),
    };
    let flags = gate(&ctx, &stream);
    let op = copy_async(&stream, src, dst).unwrap();
    assert!(!op.is_complete());
    let (f2, d2) = (flags.clone(), drops.clone());
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let before = d2.load(Ordering::SeqCst);
        f2.store_u32(0, 1).unwrap();
        before
    });
    let t = Instant::now();
    drop(op); // blocks until the gate opens and the copy completes
    let waited = t.elapsed();
    assert_eq!(releaser.join().unwrap(), 0, "freed before completion");
    assert_eq!(
        drops.load(Ordering::SeqCst),
        2,
        "each buffer freed exactly once"
    );
    assert!(
        waited >= Duration::from_millis(250),
        "drop returned after {waited:?}"
    );
    println!("drop blocked {waited:?} until completion");
}

#[test]
fn undecidable_drop_parks_and_reap_frees_after_completion() {
    let _serial = serial();
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let stream = Stream::new(&ctx).unwrap();
    let drops = Arc::new(AtomicUsize::new(0));
    let dst = Counted {
        inner: PinnedHostBuffer::<u32>::alloc(&ctx, 1024, HostAllocFlags::empty()).unwrap(),
        drops: drops.clone(),
    };
    let src = DeviceBuffer::<u32>::alloc(&ctx, 1024).unwrap();
    let flags = gate(&ctx, &stream);
    let op = copy_async(&stream, src, dst).unwrap();
    drop(op); // cannot complete: waits DROP_WAIT, then parks
    assert_eq!(drops.load(Ordering::SeqCst), 0, "freed while in flight");
    assert!(Tracker::global().parked() >= 1);
    flags.store_u32(0, 1).unwrap();
    stream.synchronize().unwrap();
    let t = Instant::now();
    while drops.load(Ordering::SeqCst) == 0 && t.elapsed() < Duration::from_secs(5) {
        Tracker::global().reap();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        drops.load(Ordering::SeqCst),
        1,
        "reap frees after completion"
    );
}

#[test]
fn forgotten_in_flight_leaks_never_frees() {
    let _serial = serial();
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let stream = Stream::new(&ctx).unwrap();
    let drops = Arc::new(AtomicUsize::new(0));
    let dst = Counted {
        inner: DeviceBuffer::<u32>::alloc(&ctx, 1 << 16).unwrap(),
        drops: drops.clone(),
    };
    let src = PinnedHostBuffer::<u32>::alloc(&ctx, 1 << 16, HostAllocFlags::empty()).unwrap();
    let flags = gate(&ctx, &stream);
    let op: InFlight<_, _> = copy_async(&stream, src, dst).unwrap();
    std::mem::forget(op);
    flags.store_u32(0, 1).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(drops.load(Ordering::SeqCst), 0);
}

#[test]
fn host_callbacks_run_in_order_catch_panics_and_free_on_reap() {
    let _serial = serial();
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let stream = Stream::new(&ctx).unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let drops = Arc::new(AtomicUsize::new(0));
    let captured = Counted {
        inner: DeviceBuffer::<u8>::alloc(&ctx, 4096).unwrap(),
        drops: drops.clone(),
    };
    let flags = gate(&ctx, &stream);
    let r = ran.clone();
    let f1 = stream
        .launch_host_fn(move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    let f2 = stream
        .launch_host_fn(|| panic!("caught by the trampoline"))
        .unwrap();
    let f3 = stream
        .launch_host_fn(move || {
            let _ = captured.len();
        })
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    use gpudirect::completion::Fence;
    assert!(!f1.is_complete());
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    flags.store_u32(0, 1).unwrap();
    assert!(f3.wait_timeout(Duration::from_secs(5)));
    assert!(f1.is_complete() && f2.is_complete());
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert!(!f1.panicked());
    assert!(f2.panicked());
    // The capture (device memory) is freed by reap, on this thread, not in the callback.
    let t = Instant::now();
    while drops.load(Ordering::SeqCst) == 0 && t.elapsed() < Duration::from_secs(5) {
        Tracker::global().reap();
    }
    assert_eq!(drops.load(Ordering::SeqCst), 1);
}

#[test]
fn events_order_work_across_streams() {
    let _serial = serial();
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let a = Stream::new(&ctx).unwrap();
    let b = Stream::new(&ctx).unwrap();
    let n = 1 << 22;
    let data = random(n);
    // a: blocked on the gate, then an H2D copy from a shared pinned source, then a marker.
    let src = Arc::new(PinnedHostBuffer::from_slice(&ctx, &data, HostAllocFlags::empty()).unwrap());
    let (dst1, dst2) = (
        DeviceBuffer::<u32>::alloc(&ctx, n).unwrap(),
        DeviceBuffer::<u32>::alloc(&ctx, n).unwrap(),
    );
    let flags = gate(&ctx, &a);
    let first = copy_async(&a, src.clone(), dst1).unwrap();
    let marker = Arc::new(AtomicUsize::new(0));
    let m = marker.clone();
    a.launch_host_fn(move || {
        m.store(1, Ordering::SeqCst);
    })
    .unwrap();
    // b: ordered after a by an event only; its callback sees a's marker.
    b.wait_for(&a).unwrap();
    let seen = Arc::new(AtomicUsize::new(usize::MAX));
    let (m, s) = (marker.clone(), seen.clone());
    let done = b
        .launch_host_fn(move || {
            s.store(m.load(Ordering::SeqCst), Ordering::SeqCst);
        })
        .unwrap();
    let second = copy_async(&b, src.clone(), dst2).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(!second.is_complete(), "b ran ahead of a");
    flags.store_u32(0, 1).unwrap();
    let (_, d1) = first.wait().unwrap();
    let (_, d2) = second.wait().unwrap();
    use gpudirect::completion::Fence;
    assert!(done.wait_timeout(Duration::from_secs(5)));
    assert_eq!(
        seen.load(Ordering::SeqCst),
        1,
        "b's callback ran before a's"
    );
    assert!(d1.to_vec(&a).unwrap() == data);
    assert!(d2.to_vec(&b).unwrap() == data);
}
