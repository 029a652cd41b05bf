//! Awaiting CUDA work on a GPU (tier 2), on a multi-threaded tokio runtime: copies awaited with
//! exact bytes (stream fences, served by the completion thread), a host function waking its
//! future, deadlines on a stream held by `cuStreamWaitValue32` and then released (the resources
//! parked until the stream passes, then freed by the tracker), and cancellation.

mod support;

use gpudirect::Error;
use gpudirect::completion::{EventFence, InFlight, Tracker};
use gpudirect::cuda::{MemopFlags, Stream, WaitCondition};
use gpudirect::memory::{DeviceBuffer, copy_async};
use gpudirect_testing::Hardware;
use gpudirect_testing::require;
use std::future::IntoFuture;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Reap until `f` holds (bounded).
fn reap_until(what: &str, f: impl Fn() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(10), "{what}");
        Tracker::global().reap();
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A stream held at a `cuStreamWaitValue32` on a pinned host word until [`Held::release`].
struct Held {
    flags: MemopFlags,
}

impl Held {
    fn new(stream: &Stream) -> Held {
        let flags = MemopFlags::pinned_host(stream.context(), 1).unwrap();
        stream
            .wait_value32(&flags, 0, 1, WaitCondition::Geq)
            .unwrap();
        Held { flags }
    }

    fn release(&self) {
        self.flags.store_u32(0, 1).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn copies_awaited_concurrently_hand_back_exact_bytes() {
    let _one = support::gpu::one_at_a_time_async().await;
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let seed = support::gpu::seed();
    let streams = [Stream::new(&ctx).unwrap(), Stream::new(&ctx).unwrap()];
    // 1,000 small copies over two streams, every one awaited by its own task.
    const OPS: usize = 1000;
    const WORDS: usize = 1024;
    let mut tasks = Vec::with_capacity(OPS);
    let mut expected = Vec::with_capacity(OPS);
    for i in 0..OPS {
        let s = &streams[i % 2];
        let data = support::gpu::random_u32(WORDS, seed.wrapping_add(i as u64));
        let src = DeviceBuffer::from_slice(s, &data).unwrap();
        let dst = DeviceBuffer::from_slice(s, &vec![0xDEAD_BEEFu32; WORDS]).unwrap();
        let op = copy_async(s, src, dst).unwrap();
        tasks.push(tokio::spawn(async move { op.await }));
        expected.push(data);
    }
    for (i, (t, want)) in tasks.into_iter().zip(expected).enumerate() {
        let (_src, dst) = tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("awaited copy completes")
            .unwrap()
            .unwrap();
        support::gpu::assert_same(&dst.to_vec(&streams[i % 2]).unwrap(), &want, "awaited copy");
    }
    // One large copy, and an event fence awaited after it.
    let n = 16 << 20;
    let data = support::gpu::random_u32(n, seed ^ 0x5eed);
    let s = &streams[0];
    let src = DeviceBuffer::from_slice(s, &data).unwrap();
    let dst = DeviceBuffer::from_slice(s, &vec![0xDEAD_BEEFu32; n]).unwrap();
    let (src, dst) = copy_async(s, src, dst).unwrap().await.unwrap();
    support::gpu::assert_same(&dst.to_vec(s).unwrap(), &data, "awaited 64 MiB copy");
    let op = copy_async(s, dst, src).unwrap();
    let ev = InFlight::new("event after copy", s.event_fence().unwrap(), ());
    ev.await.unwrap();
    let (dst, src) = op.await.unwrap();
    support::gpu::assert_same(&src.to_vec(s).unwrap(), &data, "copied back");
    drop(dst);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_host_function_wakes_its_future() {
    let _one = support::gpu::one_at_a_time_async().await;
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let stream = Stream::new(&ctx).unwrap();
    for round in 0..20 {
        let held = Held::new(&stream);
        let token = Arc::new(round);
        let op = InFlight::new("host fn", stream.host_fence().unwrap(), token.clone());
        let task = tokio::spawn(async move { op.await.map(|t| (*t, Instant::now())) });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !task.is_finished(),
            "woken before the stream passed the callback"
        );
        let released = Instant::now();
        held.release();
        let (got, woke) = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the callback wakes the future")
            .unwrap()
            .unwrap();
        assert_eq!(got, round);
        println!(
            "round {round}: woken {:?} after the release",
            woke - released
        );
        assert_eq!(Arc::strong_count(&token), 1, "handed back, then dropped");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deadlines_on_a_held_stream_are_typed_and_park_until_it_passes() {
    let _one = support::gpu::one_at_a_time_async().await;
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let stream = Stream::new(&ctx).unwrap();
    let seed = support::gpu::seed();
    let data = support::gpu::random_u32(4096, seed);
    let src = Arc::new(DeviceBuffer::from_slice(&stream, &data).unwrap());
    let dst = DeviceBuffer::from_slice(&stream, &vec![0xDEAD_BEEFu32; 4096]).unwrap();
    let held = Held::new(&stream);
    let copy = copy_async(&stream, src.clone(), dst).unwrap();
    let event = InFlight::new(
        "event",
        EventFence::record(stream.cuda()).unwrap(),
        src.clone(),
    );
    let host = InFlight::new("host fn", stream.host_fence().unwrap(), src.clone());
    let t = Instant::now();
    let (a, b, c) = tokio::join!(
        copy.timeout(Duration::from_millis(100)),
        event.timeout(Duration::from_millis(150)),
        host.deadline(Instant::now() + Duration::from_millis(200)),
    );
    assert!(t.elapsed() >= Duration::from_millis(200));
    for (r, what, ms) in [
        (a.map(|_| ()), "async copy", 100),
        (b.map(|_| ()), "event", 150),
        (c.map(|_| ()), "host fn", 200),
    ] {
        match r {
            Err(Error::Timeout { what: w, after }) => {
                assert_eq!(w, what);
                assert!(after >= Duration::from_millis(ms), "{what}: {after:?}");
            }
            other => panic!("{what}: expected a timeout, got {other:?}"),
        }
    }
    Tracker::global().reap();
    assert_eq!(
        Arc::strong_count(&src),
        4,
        "the three operations' resources are parked, not freed"
    );
    held.release();
    reap_until("freed once the stream passes", || {
        Arc::strong_count(&src) == 1
    });
    // The stream works on: a later copy awaited with exact bytes.
    let dst = DeviceBuffer::from_slice(&stream, &vec![0u32; 4096]).unwrap();
    let (_, dst) = copy_async(&stream, src, dst).unwrap().await.unwrap();
    support::gpu::assert_same(
        &dst.to_vec(&stream).unwrap(),
        &data,
        "copy after the deadlines",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancelled_awaits_park_until_the_stream_passes() {
    let _one = support::gpu::one_at_a_time_async().await;
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let stream = Stream::new(&ctx).unwrap();
    let src = Arc::new(DeviceBuffer::from_slice(&stream, &[7u32; 1024]).unwrap());
    let dst = || DeviceBuffer::from_slice(&stream, &[0u32; 1024]).unwrap();
    let dsts: Vec<_> = (0..4).map(|_| dst()).collect();
    let mut dsts = dsts.into_iter();
    let held = Held::new(&stream);
    // Never polled.
    drop(
        copy_async(&stream, src.clone(), dsts.next().unwrap())
            .unwrap()
            .into_future(),
    );
    // Dropped by a select that a timer wins.
    let op = copy_async(&stream, src.clone(), dsts.next().unwrap()).unwrap();
    tokio::select! {
        biased;
        _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        _ = op => panic!("the stream is held"),
    }
    // An aborted task, and a host-function await dropped by a timeout wrapper.
    let op = copy_async(&stream, src.clone(), dsts.next().unwrap()).unwrap();
    let task = tokio::spawn(async move { op.await.map(drop) });
    tokio::time::sleep(Duration::from_millis(20)).await;
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    let op = InFlight::new("host fn", stream.host_fence().unwrap(), src.clone());
    assert!(
        tokio::time::timeout(Duration::from_millis(20), op)
            .await
            .is_err()
    );
    let t = Instant::now();
    Tracker::global().reap();
    assert!(t.elapsed() < Duration::from_secs(1));
    assert_eq!(
        Arc::strong_count(&src),
        5,
        "nothing freed while the stream is held"
    );
    held.release();
    reap_until("freed once the stream passes", || {
        Arc::strong_count(&src) == 1
    });
    stream.synchronize().unwrap();
}
