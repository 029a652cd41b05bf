//! Tier 2: CUDA graph capture on a gpudirect stream. Work captured into a graph runs at every
//! launch of the graph, long after any fence the library could take, so every gpudirect call
//! that queues work on a capturing stream must refuse with `Error::StreamCapturing` before
//! queueing anything: nothing completes early, nothing is freed, and the graph, launched, does
//! nothing of ours. After the capture ends the stream works as before.

mod support;

use gpudirect::Error;
use gpudirect::completion::{EventFence, Fence, Tracker};
use gpudirect::cuda::{MemOp, MemopFlags, Stream, WaitCondition};
use gpudirect::cudarc::driver::sys;
use gpudirect::memory::{self, DeviceBuffer, HostAllocFlags, PinnedHostBuffer};
use gpudirect::p2p::{IpcEvent, IpcPool};
use gpudirect_testing::{Hardware, require};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// `n` random words, the seed printed (`CAPTURE_TEST_SEED` replays it).
fn random_u32(n: usize) -> Vec<u32> {
    support::gpu::random_u32(n, support::gpu::seed_from("CAPTURE_TEST_SEED"))
}

/// A destination made before the capture and kept alive by the test: a refused call drops only
/// this handle, so nothing is freed while the stream captures.
struct Held<T: gpudirect::memory::Pod>(Arc<DeviceBuffer<T>>);

// SAFETY: the buffer outlives the handle (the Arc) and nothing reads it while a call holds the
// handle; the calls here are all refused before queueing anything.
unsafe impl<T: gpudirect::memory::Pod> gpudirect::memory::DeviceMemory for Held<T> {
    type Elem = T;
    fn device_ptr(&self) -> u64 {
        self.0.device_ptr()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn ordinal(&self) -> usize {
        self.0.ordinal()
    }
    fn kind(&self) -> gpudirect::memory::MemoryKind {
        self.0.kind()
    }
}

// SAFETY: as above: no other reader or writer while a call holds it.
unsafe impl<T: gpudirect::memory::Pod> gpudirect::memory::DeviceMemoryMut for Held<T> {}

/// `r` must be the refusal made before anything was queued.
#[track_caller]
fn refused<T: std::fmt::Debug>(what: &str, r: gpudirect::Result<T>) {
    match r {
        Err(Error::StreamCapturing {
            enqueued: false, ..
        }) => println!("{what}: refused"),
        other => panic!("{what} on a capturing stream: expected StreamCapturing, got {other:?}"),
    }
}

#[test]
fn every_enqueueing_api_refuses_a_capturing_stream() {
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let stream = Stream::new(&ctx).unwrap();
    let other = Stream::new(&ctx).unwrap();
    const N: usize = 16 << 20; // 64 MiB of u32: the copy is still running when the capture begins
    let data = random_u32(N);
    let src = Arc::new(DeviceBuffer::from_slice(&stream, &data).unwrap());
    let dst = DeviceBuffer::<u32>::alloc(&ctx, N).unwrap();
    // In flight when the capture begins; its fence's epoch has no event yet.
    let before = memory::copy_async(&stream, src.clone(), dst).unwrap();

    // Everything queued during the capture is made before it.
    let small: Vec<u32> = random_u32(1024);
    let a = Arc::new(DeviceBuffer::from_slice(&stream, &small).unwrap());
    let mut c = DeviceBuffer::from_slice(&stream, &vec![0xC0FF_EE00u32; 1024]).unwrap();
    let flags_h = MemopFlags::pinned_host(&ctx, 4).unwrap();
    let flags_d = MemopFlags::device(&ctx, 4).unwrap();
    let pinned =
        Arc::new(PinnedHostBuffer::from_slice(&ctx, &small, HostAllocFlags::PORTABLE).unwrap());
    let b = Arc::new(DeviceBuffer::<u32>::zeroed(&ctx, 1024).unwrap());
    let file_dst = Arc::new(DeviceBuffer::<u8>::alloc(&ctx, 65536).unwrap());
    let other_event = other.record_event().unwrap();
    let ipc_event = IpcEvent::new(0).ok();
    let pool = IpcPool::new(0).ok();
    let runs = Arc::new(AtomicUsize::new(0));
    // A second copy queued right before the capture: in flight across it, never polled yet.
    let dst2 = DeviceBuffer::<u32>::alloc(&ctx, N).unwrap();
    let during = memory::copy_async(&stream, src.clone(), dst2).unwrap();

    stream
        .cuda()
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();

    // Copies.
    refused(
        "copy_async",
        memory::copy_async(&stream, a.clone(), Held(b.clone())),
    );
    assert_eq!(
        Arc::strong_count(&a),
        1,
        "the refused copy dropped its source clone"
    );
    assert_eq!(Arc::strong_count(&b), 1, "and its destination handle");
    refused("copy", memory::copy(&stream, &*a, &mut c));
    refused(
        "copy_from_host",
        memory::copy_from_host(&stream, &small, &mut c),
    );
    let mut back = vec![0x5A5A_5A5Au32; 1024];
    refused(
        "copy_to_host",
        memory::copy_to_host(&stream, &*a, &mut back),
    );
    assert!(back.iter().all(|&w| w == 0x5A5A_5A5A), "nothing written");
    refused(
        "copy_async from pinned host memory",
        memory::copy_async(&stream, pinned.clone(), Held(b.clone())),
    );
    // Stream memory operations.
    refused("write_value32", stream.write_value32(&flags_h, 0, 0xAB));
    refused(
        "wait_value32",
        stream.wait_value32(&flags_h, 1, 1, WaitCondition::Geq),
    );
    if flags_d.supports_64_bit() {
        refused("write_value64", stream.write_value64(&flags_d, 0, 1 << 40));
    }
    refused(
        "batch_mem_ops",
        stream.batch_mem_ops(
            &flags_d,
            &[
                MemOp::Write32 { slot: 2, value: 9 },
                MemOp::Write32 { slot: 3, value: 9 },
            ],
        ),
    );
    // Host functions, events.
    let r2 = runs.clone();
    refused(
        "launch_host_fn",
        stream.launch_host_fn(move || {
            r2.fetch_add(1, Ordering::SeqCst);
        }),
    );
    refused("host_fence", stream.host_fence());
    refused("event_fence", stream.event_fence());
    refused("record_event", stream.record_event());
    refused("EventFence::record", EventFence::record(stream.cuda()));
    refused("wait", stream.wait(&other_event));
    refused(
        "wait_for (records on the capturing stream)",
        other.wait_for(&stream),
    );
    if let Some(ev) = &ipc_event {
        refused("IpcEvent::record", ev.record(&stream));
        refused("IpcEvent::wait_on", ev.wait_on(&stream));
    } else {
        println!("NOTE: no IPC event on this device; its part is untested");
    }
    if let Some(pool) = &pool {
        refused("IpcPool::alloc", pool.alloc::<u32>(1024, &stream));
    } else {
        println!("NOTE: no IPC pool on this device; its part is untested");
    }
    // cuFile's stream-ordered read, where cuFile works.
    let cufile = cufile_read_async_is_refused(&stream, &file_dst);

    // Nothing completes early: the fences of work queued before the capture cannot be proven
    // while it lasts (no event may be recorded in it), and polling them does not wedge them.
    let fence = stream.fence();
    assert!(!fence.is_complete(), "a fence completed inside the capture");
    assert!(
        !during.is_complete(),
        "an InFlight completed inside the capture"
    );
    assert!(
        !fence.wait_timeout(Duration::from_millis(20)),
        "a bounded wait proved completion inside the capture"
    );

    let graph = stream
        .cuda()
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .expect("the refusals did not invalidate the capture");
    // Launched, the graph does nothing of ours (it holds none of the refused work).
    if let Some(g) = &graph {
        g.launch().unwrap();
        g.launch().unwrap();
    }
    stream.synchronize().unwrap();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "a refused host function ran"
    );
    assert_eq!(flags_h.load_u32(0).unwrap(), 0, "a refused memop wrote");
    assert_eq!(flags_d.load_u32(2).unwrap(), 0, "a refused batch wrote");
    assert_eq!(
        c.to_vec(&stream).unwrap(),
        vec![0xC0FF_EE00u32; 1024],
        "a refused copy wrote"
    );

    // The fences taken before and during the capture complete now, with the right bytes.
    assert!(fence.wait_timeout(Duration::from_secs(30)));
    let (_, d) = before.wait().unwrap();
    assert!(
        d.to_vec(&stream).unwrap() == data,
        "copy before the capture"
    );
    let (_, d2) = during.wait().unwrap();
    assert!(
        d2.to_vec(&stream).unwrap() == data,
        "copy in flight across the capture"
    );

    assert_eq!(
        b.to_vec(&stream).unwrap(),
        vec![0u32; 1024],
        "a refused copy wrote"
    );
    drop(cufile);

    // The stream works as before.
    let out = memory::copy_async(
        &stream,
        pinned,
        DeviceBuffer::<u32>::alloc(&ctx, 1024).unwrap(),
    )
    .unwrap();
    let (_, out) = out.wait().unwrap();
    assert_eq!(out.to_vec(&stream).unwrap(), small);
    let r3 = runs.clone();
    let f = stream
        .launch_host_fn(move || {
            r3.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    assert!(f.wait_timeout(Duration::from_secs(10)));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "ran exactly once");
    stream.write_value32(&flags_h, 0, 0xAB).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(flags_h.load_u32(0).unwrap(), 0xAB);
    drop(graph);
    Tracker::global().reap();
}

/// `r` must be the per-thread default stream's refusal.
#[track_caller]
fn refused_per_thread<T: std::fmt::Debug>(what: &str, r: gpudirect::Result<T>) {
    match r {
        Err(e @ Error::InvalidArgument { .. })
            if e.to_string().contains("CU_STREAM_PER_THREAD") =>
        {
            println!("{what}: refused")
        }
        other => panic!(
            "{what} on the per-thread default stream: expected InvalidArgument, got {other:?}"
        ),
    }
}

/// The per-thread default stream (`CU_STREAM_PER_THREAD`, cudarc's `per_thread_stream`) names
/// another stream on every thread: an event the completion thread records there, or a
/// synchronize on another thread, would look at that thread's own stream, and a fence could
/// complete while its work still runs. Every queueing API refuses it before queueing anything,
/// and a fence of it never completes (no event of it can be recorded).
#[test]
fn every_enqueueing_api_refuses_the_per_thread_default_stream() {
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let pts = Stream::wrap(ctx.per_thread_stream());
    let other = Stream::new(&ctx).unwrap();
    let small: Vec<u32> = random_u32(1024);
    let a = Arc::new(DeviceBuffer::from_slice(&other, &small).unwrap());
    let b = Arc::new(DeviceBuffer::<u32>::zeroed(&ctx, 1024).unwrap());
    let mut c = DeviceBuffer::from_slice(&other, &vec![0xC0FF_EE00u32; 1024]).unwrap();
    let flags_h = MemopFlags::pinned_host(&ctx, 4).unwrap();
    let other_event = other.record_event().unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    other.synchronize().unwrap();

    refused_per_thread(
        "copy_async",
        memory::copy_async(&pts, a.clone(), Held(b.clone())),
    );
    assert_eq!(
        Arc::strong_count(&a),
        1,
        "the refused copy dropped its source"
    );
    refused_per_thread("copy", memory::copy(&pts, &*a, &mut c));
    refused_per_thread(
        "copy_from_host",
        memory::copy_from_host(&pts, &small, &mut c),
    );
    let mut back = vec![0x5A5A_5A5Au32; 1024];
    refused_per_thread("copy_to_host", memory::copy_to_host(&pts, &*a, &mut back));
    assert!(back.iter().all(|&w| w == 0x5A5A_5A5A), "nothing written");
    refused_per_thread("write_value32", pts.write_value32(&flags_h, 0, 0xAB));
    let r2 = runs.clone();
    refused_per_thread(
        "launch_host_fn",
        pts.launch_host_fn(move || {
            r2.fetch_add(1, Ordering::SeqCst);
        }),
    );
    refused_per_thread("host_fence", pts.host_fence());
    refused_per_thread("event_fence", pts.event_fence());
    refused_per_thread("record_event", pts.record_event());
    refused_per_thread("EventFence::record", EventFence::record(pts.cuda()));
    refused_per_thread("wait", pts.wait(&other_event));
    refused_per_thread("wait_for (records on it)", other.wait_for(&pts));

    // A fence of it (the user's own work, queued some other way) is never proven complete.
    let fence = pts.fence();
    assert!(
        !fence.is_complete(),
        "a per-thread stream's fence completed"
    );
    assert!(
        !fence.wait_timeout(Duration::from_millis(20)),
        "a bounded wait proved a per-thread stream's fence complete"
    );

    ctx.synchronize().unwrap();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "a refused host function ran"
    );
    assert_eq!(flags_h.load_u32(0).unwrap(), 0, "a refused memop wrote");
    assert_eq!(
        c.to_vec(&other).unwrap(),
        vec![0xC0FF_EE00u32; 1024],
        "a refused copy wrote"
    );
    assert_eq!(
        b.to_vec(&other).unwrap(),
        vec![0u32; 1024],
        "a refused copy wrote"
    );
    // The refused memory operations left no use of the words behind: their drop waits for no
    // fence of the per-thread stream (it would wait 5 s, then leak them).
    let t = std::time::Instant::now();
    drop(flags_h);
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "the words' drop waited {:?}",
        t.elapsed()
    );
    Tracker::global().reap();
}

/// cuFile's `cuFileReadAsync` on the capturing stream is refused the same way (skipped, with a
/// note, where the cuFile driver or the file registration is not available). Returns what must
/// outlive the capture (dropping the driver or the handle calls into cuFile).
fn cufile_read_async_is_refused(
    stream: &Stream,
    dst: &Arc<DeviceBuffer<u8>>,
) -> Option<Box<dyn std::any::Any>> {
    use gpudirect::storage::{Driver, FileHandle, OpenOptions};
    let Ok(driver) = Driver::open() else {
        println!("NOTE: no cuFile driver; the cuFileReadAsync part is untested");
        return None;
    };
    let path = std::env::temp_dir().join(format!("gpudirect-capture-{}", std::process::id()));
    std::fs::write(&path, vec![7u8; 65536]).unwrap();
    let handle = match FileHandle::open(&driver, &path, &OpenOptions::read_only()) {
        Ok(h) => {
            refused(
                "FileHandle::read_async",
                h.read_async(stream.cuda(), Held(dst.clone()), 0, 0, 65536),
            );
            Some(h)
        }
        Err(e) => {
            println!("NOTE: cuFile registration refused ({e}); cuFileReadAsync untested");
            None
        }
    };
    let _ = std::fs::remove_file(&path);
    Some(Box::new((handle, driver)))
}

/// The blocking copies borrow their buffers, so they must not return before the copy has
/// completed. A synchronize on this thread while another thread captures in global mode is
/// refused by the driver (and breaks that capture): the copies wait with the thread relaxed, so
/// they return only once the bytes are there, and the other thread's graph survives.
#[test]
fn blocking_copies_wait_through_another_threads_global_capture() {
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    // Alone: the global capture would fail the tests beside it (`gpu::alone`).
    if !support::gpu::alone("blocking_copies_wait_through_another_threads_global_capture") {
        return;
    }
    let stream = Stream::new(&ctx).unwrap();
    // Large enough that the copy is still running when a refused synchronize would return.
    let len = 64 << 20;
    let data = random_u32(len);
    let src = DeviceBuffer::from_slice(&stream, &data).unwrap();
    let mut dst = PinnedHostBuffer::<u32>::alloc(&ctx, len, HostAllocFlags::empty()).unwrap();
    let mut back = PinnedHostBuffer::<u32>::alloc(&ctx, len, HostAllocFlags::empty()).unwrap();
    let mut dev = DeviceBuffer::<u32>::zeroed(&ctx, len).unwrap();
    stream.synchronize().unwrap();

    let (copied, captured) =
        support::gpu::during_a_global_capture(&ctx, || memory::copy(&stream, &src, &mut dst));
    copied.expect("a blocking copy during another thread's global capture");
    assert!(
        dst.as_slice() == data,
        "the bytes are there when copy returns"
    );
    assert_eq!(
        captured,
        Ok(true),
        "a blocking copy broke another thread's global capture"
    );

    let (copied, captured) = support::gpu::during_a_global_capture(&ctx, || {
        memory::copy_to_host(&stream, &src, back.as_mut_slice())
    });
    copied.expect("copy_to_host during another thread's global capture");
    assert!(
        back.as_slice() == data,
        "the bytes are there when copy_to_host returns"
    );
    assert_eq!(captured, Ok(true), "copy_to_host broke the capture");

    let (copied, captured) = support::gpu::during_a_global_capture(&ctx, || {
        memory::copy_from_host(&stream, dst.as_slice(), &mut dev)
    });
    copied.expect("copy_from_host during another thread's global capture");
    assert_eq!(captured, Ok(true), "copy_from_host broke the capture");
    assert!(
        dev.to_vec(&stream).unwrap() == data,
        "copy_from_host's bytes"
    );
}
