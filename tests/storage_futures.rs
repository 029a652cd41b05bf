//! Tier 2: cuFile futures on a GPU: stream-ordered I/O (`AsyncIo`) and batches awaited, with
//! deadlines and cancellation. Skips (`SKIPPED: reason`) without a GPU or libcufile;
//! `GPUDIRECT_REQUIRE=gpu,cufile` turns those skips into failures.

mod support;

use gpudirect::Error;
use gpudirect::completion::Tracker;
use gpudirect::cuda::Stream;
use gpudirect::storage::{Batch, BatchOp, BatchRequest, OpenOptions};
use std::future::{Future, IntoFuture};
use std::time::{Duration, Instant};
use support::files::pattern;
use support::gpu::{ToHost, poisoned_bytes};
use support::storage::{cufile as setup, write_file};

const LONG: Duration = Duration::from_secs(30);

/// One test at a time: both count what the process-wide tracker holds.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Reap until nothing more than `base` is parked (bounded).
async fn reaped_to(base: usize) {
    let until = Instant::now() + LONG;
    loop {
        Tracker::global().reap();
        if Tracker::global().parked() <= base {
            return;
        }
        assert!(Instant::now() < until, "parked resources never released");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// The tracker's count once what is done has been reaped: a base that a later reap cannot
/// lower (a count taken while finished resources are still parked went down under the
/// deadline case's own park on two H200s).
async fn settled() -> usize {
    let until = Instant::now() + Duration::from_secs(2);
    let mut last = usize::MAX;
    loop {
        Tracker::global().reap();
        let now = Tracker::global().parked();
        if now == 0 || (now == last && Instant::now() >= until) {
            return now;
        }
        last = now;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_ordered_io_is_awaited_with_deadlines_and_cancellation() {
    let _one = SERIAL.lock().await;
    let Some((ctx, d)) = setup() else { return };
    let n = 1 << 20;
    let data = pattern(n, 11);
    let p = write_file("futures-async", &data);
    let Some(h) = support::storage::register(&d, &p, &OpenOptions::read_write()) else {
        println!("SKIPPED: cuFile cannot register the test file here");
        return;
    };
    let stream = ctx.new_stream().unwrap();
    // Read, awaited: exact bytes into a poisoned buffer.
    let dst = poisoned_bytes(0, n, 0xCD);
    let (dst, got) = h
        .read_async(&stream, dst, 0, 0, n)
        .unwrap()
        .timeout(LONG)
        .await
        .unwrap();
    assert_eq!(got, n);
    assert_eq!(dst.to_host(), data);
    // Write, awaited, then read back with the blocking path.
    let s = Stream::wrap(stream.clone());
    let src = gpudirect::memory::DeviceBuffer::from_slice(&s, &pattern(n, 12)).unwrap();
    let (_src, put) = h.write_async(&stream, src, 0, 0, n).unwrap().await.unwrap();
    assert_eq!(put, n);
    assert_eq!(std::fs::read(&p).unwrap(), pattern(n, 12));
    // A deadline that passes first: a host function holds the stream for 300 ms. The buffer is
    // made before the hold, and the submission is timed on its own: on two H200s (cuFile 1.15,
    // compatibility mode) the await ended Ok here, so either the submission itself waited for
    // the stream or the read did not wait for the hold; the note says which.
    let dst = poisoned_bytes(0, n, 0xCD);
    stream.synchronize().unwrap();
    let base = settled().await;
    let hold = Duration::from_millis(300);
    let _held = s.launch_host_fn(move || std::thread::sleep(hold)).unwrap();
    let t = Instant::now();
    let io = h.read_async(&stream, dst, 0, 0, n).unwrap();
    let submitted = t.elapsed();
    let r = io.timeout(Duration::from_millis(50)).await;
    if submitted >= hold - Duration::from_millis(50) {
        // The submission waited for the stream: by then the read may be done.
        println!(
            "NOTE: cuFileReadAsync returned after {submitted:?}, behind a {hold:?} host \
             function: the submission waited for the stream; the await then gave {}",
            if r.is_ok() { "the read" } else { "a timeout" }
        );
        if let Ok((dst, got)) = r {
            assert_eq!(got, n);
            assert_eq!(dst.to_host(), data);
        }
    } else {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(t.elapsed() < hold, "not a wait for the stream");
        assert!(
            Tracker::global().parked() > base,
            "the buffer is parked, not freed"
        );
    }
    reaped_to(base).await;
    // Cancellation after one poll: parked, then released once the stream passes it.
    let dst = poisoned_bytes(0, n, 0xCD);
    let hold = Duration::from_millis(100);
    let _held = s.launch_host_fn(move || std::thread::sleep(hold)).unwrap();
    let t = Instant::now();
    let mut f = Box::pin(h.read_async(&stream, dst, 0, 0, n).unwrap().into_future());
    let submitted = t.elapsed();
    let first = std::future::poll_fn(|cx| std::task::Poll::Ready(f.as_mut().poll(cx))).await;
    if first.is_pending() {
        drop(f);
        assert!(Tracker::global().parked() > base);
    } else {
        println!("NOTE: the read was complete at its first poll ({submitted:?} to submit)");
        assert!(
            submitted >= hold - Duration::from_millis(50),
            "done before the hold ended"
        );
    }
    reaped_to(base).await;
    std::fs::remove_file(&p).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_are_awaited_and_a_dropped_batch_future_parks() {
    let _one = SERIAL.lock().await;
    let Some((_ctx, d)) = setup() else { return };
    let chunk = 65536usize;
    let k = d.max_batch_entries().min(16);
    let data = pattern(k * chunk, 13);
    let p = write_file("futures-batch", &data);
    let Some(h) = support::storage::register(&d, &p, &OpenOptions::read_write()) else {
        println!("SKIPPED: cuFile cannot register the test file here");
        return;
    };
    let reqs = |poison| -> Vec<_> {
        (0..k)
            .map(|i| BatchRequest {
                op: BatchOp::Read,
                handle: h.clone(),
                buffer: poisoned_bytes(0, chunk, poison),
                buf_offset: 0,
                file_offset: (i * chunk) as u64,
                len: chunk,
            })
            .collect()
    };
    let mut b = Batch::new(&d, k).unwrap();
    b.submit(reqs(0xCD)).unwrap();
    let results = b.timeout(LONG).await.unwrap();
    assert_eq!(results.len(), k);
    for (i, r) in results.iter().enumerate() {
        assert_eq!(
            *r.bytes.as_ref().unwrap(),
            chunk,
            "request {i}: {:?}",
            r.status
        );
        assert_eq!(
            r.buffer.to_host(),
            &data[i * chunk..(i + 1) * chunk],
            "request {i}"
        );
    }
    // Dropped before it finished: the batch and its buffers are parked, then released.
    let base = Tracker::global().parked();
    let mut b = Batch::new(&d, k).unwrap();
    b.submit(reqs(0xAB)).unwrap();
    let f = b.into_future();
    drop(f);
    reaped_to(base).await;
    std::fs::remove_file(&p).unwrap();
}
