//! Stream memory operations on a GPU (tier 2), including a batch of 300
//! operations is split into legal batches (255 is the limit seen on the H200).

mod support;

use gpudirect::Error;
use gpudirect::completion::Fence;
use gpudirect::cuda::{MAX_BATCH_MEM_OPS, MemOp, MemopFlags, Stream, WaitCondition};
use gpudirect_testing::{Hardware, require};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn spin_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < timeout {
        if f() {
            return true;
        }
        std::hint::spin_loop();
    }
    false
}

#[test]
fn wait_and_write_32_and_64_bit_on_host_words() {
    let _one = support::gpu::one_at_a_time();
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let stream = Stream::new(&ctx).unwrap();
    let flags = Arc::new(MemopFlags::pinned_host(&ctx, 4).unwrap());
    stream
        .wait_value32(&flags, 0, 5, WaitCondition::Geq)
        .unwrap();
    stream.write_value32(&flags, 1, 0xABCD_0123).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        flags.load_u32(1).unwrap(),
        0,
        "write ran before the wait was satisfied"
    );
    flags.store_u32(0, 7).unwrap();
    assert!(spin_until(Duration::from_secs(5), || flags
        .load_u32(1)
        .unwrap()
        == 0xABCD_0123));
    if flags.supports_64_bit() {
        stream
            .wait_value64(&flags, 2, 1 << 40, WaitCondition::Eq)
            .unwrap();
        stream.write_value64(&flags, 3, u64::MAX - 1).unwrap();
        flags.store_u64(2, 1 << 40).unwrap();
        assert!(spin_until(Duration::from_secs(5), || flags
            .load_u64(3)
            .unwrap()
            == u64::MAX - 1));
    } else {
        println!("64-bit stream memory operations unsupported on this device");
    }
    let fence = stream.fence();
    assert!(fence.wait_timeout(Duration::from_secs(5)));
}

#[test]
fn batch_of_300_is_split_into_legal_batches() {
    let _one = support::gpu::one_at_a_time();
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let stream = Stream::new(&ctx).unwrap();
    for flags in [
        MemopFlags::pinned_host(&ctx, 301).unwrap(),
        MemopFlags::device(&ctx, 301).unwrap(),
    ] {
        let mut ops: Vec<MemOp> = (0..150)
            .map(|i| MemOp::Write32 {
                slot: i,
                value: 1000 + i as u32,
            })
            .collect();
        if flags.supports_64_bit() {
            ops.extend((150..300).map(|i| MemOp::Write64 {
                slot: i,
                value: (1u64 << 33) + i as u64,
            }));
        } else {
            ops.extend((150..300).map(|i| MemOp::Write32 {
                slot: i,
                value: 1000 + i as u32,
            }));
        }
        // a wait in the middle of the batch, on a word the host has already set
        flags.store_u32(300, 42).unwrap();
        ops.insert(
            200,
            MemOp::Wait32 {
                slot: 300,
                value: 42,
                cond: WaitCondition::Eq,
            },
        );
        assert_eq!(ops.len(), 301);
        let calls = stream.batch_mem_ops(&flags, &ops).unwrap();
        assert_eq!(
            calls, 2,
            "301 ops need 2 calls of at most {MAX_BATCH_MEM_OPS}"
        );
        stream.synchronize().unwrap();
        for i in 0..300 {
            if i < 150 || !flags.supports_64_bit() {
                assert_eq!(flags.load_u32(i).unwrap(), 1000 + i as u32, "slot {i}");
            } else {
                assert_eq!(
                    flags.load_u64(i).unwrap(),
                    (1u64 << 33) + i as u64,
                    "slot {i}"
                );
            }
        }
        println!(
            "301 memops ({} memory) in {calls} driver calls",
            if flags.is_host() { "host" } else { "device" }
        );
    }
}

#[test]
fn memop_arguments_are_checked_before_ffi() {
    let _one = support::gpu::one_at_a_time();
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let stream = Stream::new(&ctx).unwrap();
    let flags = MemopFlags::pinned_host(&ctx, 2).unwrap();
    assert!(matches!(
        stream.write_value32(&flags, 2, 1),
        Err(Error::InvalidArgument { arg: "slot", .. })
    ));
    let ops = vec![
        MemOp::Write32 { slot: 0, value: 1 },
        MemOp::Write32 { slot: 9, value: 1 },
    ];
    assert!(stream.batch_mem_ops(&flags, &ops).is_err());
    stream.synchronize().unwrap();
    assert_eq!(
        flags.load_u32(0).unwrap(),
        0,
        "nothing of a rejected batch was queued"
    );
    assert!(MemopFlags::pinned_host(&ctx, 0).is_err());
}

#[test]
fn round_trip_host_gpu_host() {
    let _one = support::gpu::one_at_a_time();
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let stream = Stream::new(&ctx).unwrap();
    let flags = MemopFlags::pinned_host(&ctx, 2).unwrap();
    let n = 1000u32;
    let mut rtts = Vec::with_capacity(n as usize);
    for i in 1..=n {
        stream
            .wait_value32(&flags, 0, i, WaitCondition::Eq)
            .unwrap();
        stream.write_value32(&flags, 1, i).unwrap();
        let t = Instant::now();
        flags.store_u32(0, i).unwrap();
        assert!(spin_until(Duration::from_secs(5), || flags
            .load_u32(1)
            .unwrap()
            == i));
        rtts.push(t.elapsed());
    }
    rtts.sort();
    println!(
        "memop round trip median {:?} over {n}",
        rtts[rtts.len() / 2]
    );
}

/// Run `f` on a helper thread; `false` if it has not returned within `timeout` (a deadlock).
/// Run `f` on another thread; its result if it returns within `timeout`.
fn returns_within<T: Send + 'static>(
    timeout: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(timeout).ok()
}

#[test]
fn host_stores_to_device_words_release_a_waiting_stream() {
    let _one = support::gpu::one_at_a_time();
    // A stream blocked in cuStreamWaitValue on a device word: blocking host-side helpers must
    // not wait for it (cuCtxSynchronize would, and deadlock until the store they are making).
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let stream = Stream::new(&ctx).unwrap();
    let flags = Arc::new(MemopFlags::device(&ctx, 4).unwrap());
    stream
        .wait_value32(&flags, 0, 5, WaitCondition::Eq)
        .unwrap();
    stream.write_value32(&flags, 1, 0x600D).unwrap();
    let c = ctx.clone();
    // The allocations are kept until the stream is released: freeing device memory
    // (cuMemFree) synchronizes the device, which would wait for the blocked stream.
    let keep = returns_within(Duration::from_secs(10), move || {
        (
            gpudirect::memory::DeviceBuffer::<u8>::zeroed(&c, 4096).unwrap(),
            MemopFlags::device(&c, 2).unwrap(),
        )
    })
    .expect("zeroed/device allocation waited for the blocked stream");
    assert_eq!(flags.load_u32(1).unwrap(), 0, "write ran before the wait");
    let f = flags.clone();
    assert!(
        returns_within(Duration::from_secs(10), move || f.store_u32(0, 5).unwrap()).is_some(),
        "store_u32 on a device word waited for the stream it releases"
    );
    assert!(spin_until(Duration::from_secs(5), || flags
        .load_u32(1)
        .unwrap()
        == 0x600D));
    if flags.supports_64_bit() {
        stream
            .wait_value64(&flags, 2, 1 << 40, WaitCondition::Eq)
            .unwrap();
        let f = flags.clone();
        assert!(
            returns_within(Duration::from_secs(10), move || f
                .store_u64(2, 1 << 40)
                .unwrap())
            .is_some(),
            "store_u64 on a device word waited for the stream it releases"
        );
    }
    let fence = stream.fence();
    assert!(fence.wait_timeout(Duration::from_secs(5)));
    drop(keep);
}
