//! Tier 2: the POSIX path and the pinned bounce pool on a GPU. Random files, poisoned device
//! buffers, exact bytes: reads hot (page cache) and cold (`O_DIRECT` after dropping the cache)
//! at unaligned offsets and for several configurations, many application threads at once,
//! writes cached and durable, and the bounce engine's public copies; a read and a write while
//! another thread captures a CUDA graph in global mode, which must survive them.
//!
//! Skips (`SKIPPED: reason`) without a GPU; `GPUDIRECT_REQUIRE=gpu` turns the skip into a failure.
//! cuFile is not needed (every file is opened in `Mode::Posix`).

mod support;

use gpudirect::cuda::Stream;
use gpudirect::memory::{BouncePool, CopyEngine, DeviceBuffer};
use gpudirect::storage::{Durability, GdsFile, IoPath, Mode, OpenOptions, PathReason, PosixConfig};
use gpudirect::{Error, cudarc::driver::CudaContext};
use gpudirect_testing::Hardware;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use support::files::pattern;
use support::gpu::during_a_global_capture;

fn setup() -> Option<(Arc<CudaContext>, Stream)> {
    match gpudirect::cuda::context(0).and_then(|c| Ok((c.clone(), Stream::new(&c)?))) {
        Ok(v) => Some(v),
        Err(e) => {
            gpudirect_testing::skip(Hardware::Gpu, e);
            None
        }
    }
}

fn write_file(name: &str, data: &[u8]) -> std::path::PathBuf {
    support::storage::write_file(&format!("posix-{name}"), data)
}

/// Drop the file from the page cache (written back first), so that the next read is cold.
fn drop_cache(p: &std::path::Path) {
    let f = std::fs::File::open(p).unwrap();
    // SAFETY: a valid descriptor.
    unsafe {
        assert_eq!(libc::fdatasync(f.as_raw_fd()), 0);
        assert_eq!(
            libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED),
            0
        );
    }
}

const POISON: u8 = 0xCD;

/// Read `len` bytes at `fo` into a poisoned buffer at `off` and check every byte of it.
fn read_and_check(
    stream: &Stream,
    f: &GdsFile,
    data: &[u8],
    off: usize,
    fo: u64,
    len: usize,
    what: &str,
) -> gpudirect::storage::PathTaken {
    let mut dst = DeviceBuffer::from_slice(stream, &vec![POISON; off + len + 4099]).unwrap();
    let t = f.read_to_device(&mut dst, off, fo, len).unwrap();
    let want = len.min(data.len().saturating_sub(fo as usize));
    assert_eq!(t.bytes, want, "{what}: count");
    let host = dst.to_vec(stream).unwrap();
    let from = (fo as usize).min(data.len());
    assert!(
        host[off..off + want] == data[from..from + want],
        "{what}: bytes read ({:?})",
        t.path
    );
    assert!(
        host[..off].iter().all(|&b| b == POISON) && host[off + want..].iter().all(|&b| b == POISON),
        "{what}: bytes outside the range changed"
    );
    t.path
}

#[test]
fn reads_are_exact_hot_and_cold_for_every_configuration() {
    let Some((_ctx, stream)) = setup() else {
        return;
    };
    // 37 MiB and a few bytes: many chunks, a short last one.
    let data = pattern((37 << 20) + 4099, 21);
    let p = write_file("read", &data);
    let mut f = GdsFile::open(&p, &OpenOptions::read_only(), Mode::Posix).unwrap();
    let auto = f.posix_config(data.len()).unwrap();
    println!("automatic configuration for {} bytes: {auto:?}", data.len());
    let configs = [
        None,
        Some(PosixConfig {
            threads: 1,
            direct_threads: 1,
            write_threads: 1,
            chunk: 4096,
            direct_read_chunk: 4096,
            depth: 1,
        }),
        Some(PosixConfig {
            threads: 32,
            direct_threads: 32,
            write_threads: 4,
            chunk: 256 << 10,
            direct_read_chunk: 1 << 20,
            depth: 3,
        }),
        Some(PosixConfig {
            threads: 3,
            direct_threads: 5,
            write_threads: 2,
            chunk: 16 << 20,
            direct_read_chunk: 12 << 10,
            depth: 2,
        }),
    ];
    for cfg in configs {
        f.set_posix_config(cfg).unwrap();
        for cold in [false, true] {
            for (off, fo, len) in [
                (0, 0, data.len()),
                (1, 3, (19 << 20) + 1),
                (4095, 4097, 12_345),
                (7, data.len() as u64 - 5000, 20_000), // crosses the end of file
                (0, data.len() as u64 + 10, 4096),     // past it
            ] {
                if cold {
                    drop_cache(&p);
                } else {
                    let _ = std::fs::read(&p).unwrap(); // hot
                }
                let what = format!("{cfg:?} cold={cold} off={off} fo={fo} len={len}");
                let path = read_and_check(&stream, &f, &data, off, fo, len, &what);
                assert_eq!(path.path, IoPath::Posix);
                assert_eq!(path.reason, PathReason::Requested);
                if cold && f.has_direct() && fo < data.len() as u64 {
                    assert!(path.direct, "{what}: a cold read takes O_DIRECT");
                }
            }
        }
    }
    std::fs::remove_file(&p).unwrap();
}

#[test]
fn many_application_threads_read_at_once() {
    let Some((ctx, _stream)) = setup() else {
        return;
    };
    let data = pattern(24 << 20, 5);
    let p = write_file("threads", &data);
    let f = Arc::new(GdsFile::open(&p, &OpenOptions::read_only(), Mode::Posix).unwrap());
    std::thread::scope(|s| {
        for t in 0..8usize {
            let (f, data, ctx) = (f.clone(), &data, ctx.clone());
            s.spawn(move || {
                let stream = Stream::new(&ctx).unwrap();
                // Each thread its own range (3 MiB at an odd offset), ten times.
                let fo = (t * (3 << 20) + t) as u64;
                for _ in 0..10 {
                    read_and_check(&stream, &f, data, t, fo, 3 << 20, "concurrent");
                }
            });
        }
    });
    std::fs::remove_file(&p).unwrap();
}

#[test]
fn writes_are_exact_cached_and_durable() {
    let Some((_ctx, stream)) = setup() else {
        return;
    };
    let data = pattern((21 << 20) + 777, 8);
    let src = DeviceBuffer::from_slice(&stream, &data).unwrap();
    for durability in [Durability::Cached, Durability::Durable] {
        let out = write_file(&format!("write-{durability:?}"), &[]);
        let mut f = GdsFile::open(&out, &OpenOptions::read_write(), Mode::Posix).unwrap();
        f.set_durability(durability);
        // Aligned (O_DIRECT where durable), then unaligned on both ends.
        for (so, fo, len) in [(0, 0, 16 << 20), (3, (16 << 20) + 5, (5 << 20) + 11)] {
            let t = f.write_from_device(&src, so, fo, len).unwrap();
            assert_eq!(t.bytes, len);
            assert_eq!(t.path.path, IoPath::Posix);
            assert_eq!(
                t.path.direct,
                durability == Durability::Durable && f.has_direct(),
                "{durability:?}"
            );
            let back = std::fs::read(&out).unwrap();
            assert!(
                back[fo as usize..fo as usize + len] == data[so..so + len],
                "{durability:?} so={so} fo={fo} len={len}"
            );
        }
        f.sync_data().unwrap();
        std::fs::remove_file(&out).unwrap();
    }
}

#[test]
fn the_bounce_engine_copies_exactly_and_recycles_chunks() {
    let Some((ctx, stream)) = setup() else { return };
    let pool = BouncePool::new(&ctx, 1 << 20, 2).unwrap();
    let engine = CopyEngine::new(&ctx, 3).unwrap();
    let data = pattern(1 << 20, 13);
    let dst = DeviceBuffer::from_slice(&stream, &vec![POISON; 3 << 20]).unwrap();
    let mut chunk = pool.take().unwrap();
    chunk.copy_from_slice(&data);
    // Chunk bytes 100..100+70_000 to device bytes 5..70_005, on lane 7 (= 7 % 3).
    let (chunk, dst) = engine
        .h2d(7, chunk, 100, dst, 5, 70_000)
        .unwrap()
        .wait()
        .unwrap();
    let host = dst.to_vec(&stream).unwrap();
    assert!(host[5..70_005] == data[100..70_100]);
    assert!(
        host[..5]
            .iter()
            .chain(&host[70_005..])
            .all(|&b| b == POISON)
    );
    // And back into another chunk.
    let other = pool.take().unwrap();
    let (other, _dst) = engine
        .d2h(1, dst, 5, other, 9, 70_000)
        .unwrap()
        .wait()
        .unwrap();
    assert!(other[9..70_009] == data[100..70_100]);
    drop((chunk, other));
    assert_eq!(pool.idle(), 2, "both chunks went back to the pool");
    let again = pool.take().unwrap();
    assert_eq!(pool.idle(), 1, "a chunk is reused, not allocated");
    drop(again);
    // Ranges are checked before any driver call; the chunk comes back to the pool.
    let small = DeviceBuffer::<u8>::alloc(&ctx, 4096).unwrap();
    let e = engine
        .h2d(0, pool.take().unwrap(), 0, small, 1, 4096)
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { arg: "len", .. }),
        "{e}"
    );
    let small = DeviceBuffer::<u8>::alloc(&ctx, 4096).unwrap();
    let e = engine
        .h2d(0, pool.take().unwrap(), (1 << 20) - 10, small, 0, 11)
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { arg: "len", .. }),
        "{e}"
    );
    assert_eq!(pool.idle(), 2);
    assert!(BouncePool::new(&ctx, 4097, 1).is_err());
    assert!(CopyEngine::new(&ctx, 0).is_err());
}

/// The `AnonHugePages` of the mapping that holds `addr` (kB), from `/proc/self/smaps`.
fn anon_huge_kb(addr: usize) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut inside = false;
    for line in smaps.lines() {
        let head = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = head.split_once('-')
            && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
        {
            inside = (a..b).contains(&addr);
        } else if inside && let Some(v) = line.strip_prefix("AnonHugePages:") {
            return v.trim().trim_end_matches("kB").trim().parse().ok();
        }
    }
    None
}

#[test]
fn chunks_from_2_mib_up_are_registered_at_a_huge_page_boundary_and_copy_exactly() {
    let Some((ctx, stream)) = setup() else { return };
    use gpudirect::memory::{DeviceMemory, MemoryKind};
    // 4 MiB and two pages: the POSIX path's default bounce buffer.
    let bytes = (4 << 20) + 8192;
    let pool = BouncePool::new(&ctx, bytes, 2).unwrap();
    let engine = CopyEngine::new(&ctx, 2).unwrap();
    let mut chunk = pool.take().unwrap();
    let at = chunk.as_mut_ptr() as usize;
    assert_eq!(at % (2 << 20), 0, "{at:#x} is not at a 2 MiB boundary");
    assert_eq!(chunk.kind(), MemoryKind::RegisteredHost);
    assert_eq!(chunk.len(), bytes);
    assert!(chunk.iter().all(|&b| b == 0), "a new chunk is zero-filled");
    // Where the kernel gave huge pages is its call (THP mode, fragmentation): reported only.
    let thp =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    println!(
        "THP {:?}; AnonHugePages of the chunk's mapping: {:?} kB",
        thp.trim(),
        anon_huge_kb(at)
    );
    // Every byte, both ways, through the last page past the huge ones.
    let data = pattern(bytes, 29);
    chunk.copy_from_slice(&data);
    let dst = DeviceBuffer::from_slice(&stream, &vec![POISON; bytes + 3]).unwrap();
    let (chunk, dst) = engine
        .h2d(0, chunk, 0, dst, 3, bytes)
        .unwrap()
        .wait()
        .unwrap();
    let host = dst.to_vec(&stream).unwrap();
    assert!(host[..3].iter().all(|&b| b == POISON));
    assert!(host[3..] == data[..]);
    let mut back = pool.take().unwrap();
    back.fill(POISON);
    let (back, _dst) = engine
        .d2h(1, dst, 3, back, 0, bytes)
        .unwrap()
        .wait()
        .unwrap();
    assert!(back[..] == data[..]);
    drop((chunk, back));
    assert_eq!(pool.idle(), 2, "both went back to the pool");
    // Below 2 MiB: cuMemHostAlloc.
    let small = BouncePool::new(&ctx, 1 << 20, 1).unwrap();
    assert_eq!(small.take().unwrap().kind(), MemoryKind::PinnedHost);
}

#[test]
fn a_forked_child_finds_huge_chunks_zeroed_and_gets_no_new_ones() {
    let Some((ctx, _stream)) = setup() else {
        return;
    };
    // Alone: the child is forked from a process with no other test threads.
    if !support::gpu::alone("a_forked_child_finds_huge_chunks_zeroed_and_gets_no_new_ones") {
        return;
    }
    use gpudirect::memory::{DeviceMemory, MemoryKind};
    let pool = BouncePool::new(&ctx, 2 << 20, 1).unwrap();
    let mut chunk = pool.take().unwrap();
    assert_eq!(chunk.kind(), MemoryKind::RegisteredHost);
    chunk.fill(0x5A);
    // SAFETY: the child reads the chunk, asks the pool once, drops the chunk (the pool's
    // forked-child path: a leak) and calls `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let zeroed = chunk.iter().all(|&b| b == 0);
        let refused = matches!(pool.take(), Err(Error::Unsupported { .. }));
        drop(chunk);
        let code = i32::from(!zeroed) | (i32::from(!refused) << 1);
        // SAFETY: ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(
        libc::WIFEXITED(status),
        "the child died: status {status:#x}"
    );
    let code = libc::WEXITSTATUS(status);
    assert_eq!(
        code & 1,
        0,
        "the child saw the parent's bytes (no MADV_WIPEONFORK)"
    );
    assert_eq!(code & 2, 0, "the pool handed a chunk to the forked child");
    assert!(
        chunk.iter().all(|&b| b == 0x5A),
        "the parent's chunk changed"
    );
}

#[test]
fn the_bounce_pool_keeps_what_a_transfer_needed_at_once() {
    let Some((ctx, _stream)) = setup() else {
        return;
    };
    // At most one idle chunk by configuration; a transfer that held three at once finds its
    // three again (pinning anew each time would cost more than the copies), until `trim`.
    let pool = BouncePool::new(&ctx, 1 << 16, 1).unwrap();
    let chunks: Vec<_> = (0..3).map(|_| pool.take().unwrap()).collect();
    assert_eq!((pool.peak(), pool.idle()), (3, 0));
    drop(chunks);
    assert_eq!(pool.idle(), 3, "the peak's chunks are kept");
    pool.trim();
    assert_eq!((pool.idle(), pool.peak()), (0, 0));
    let (a, b) = (pool.take().unwrap(), pool.take().unwrap());
    drop((a, b));
    assert_eq!(pool.idle(), 2, "the new peak");
}

#[test]
fn reads_and_writes_leave_another_threads_global_capture_valid() {
    let Some((ctx, stream)) = setup() else {
        return;
    };
    // Alone: the global capture would fail the tests beside it (`gpu::alone`).
    if !support::gpu::alone("reads_and_writes_leave_another_threads_global_capture_valid") {
        return;
    }
    // The hazard first: on this driver, does a synchronize on another thread (in the default,
    // global mode) break a global capture of the same device?
    let other = Stream::new(&ctx).unwrap();
    let ((), control) = during_a_global_capture(&ctx, || {
        let _ = other.synchronize();
    });
    if control == Ok(true) {
        println!(
            "NOTE: this driver lets another thread synchronize during a global capture: the \
             checks below cannot fail here"
        );
    } else {
        println!("a synchronize on another thread broke the capture ({control:?}): checking ours");
    }

    let len = 32 << 20;
    let data = pattern(len, 9);
    let p = write_file("capture", &data);
    let mut f = GdsFile::open(&p, &OpenOptions::read_write(), Mode::Posix).unwrap();
    f.set_posix_config(Some(PosixConfig {
        threads: 4,
        chunk: 1 << 20,
        ..PosixConfig::automatic(len).unwrap()
    }))
    .unwrap();
    // Warmed first: the pool's chunks, its threads and the copy streams exist before the capture.
    let mut dst = DeviceBuffer::from_slice(&stream, &vec![POISON; len]).unwrap();
    f.read_to_device(&mut dst, 0, 0, len).unwrap();
    let mut dst = DeviceBuffer::from_slice(&stream, &vec![POISON; len]).unwrap();
    let src = DeviceBuffer::from_slice(&stream, &pattern(len, 10)).unwrap();
    stream.synchronize().unwrap();

    // A hot read: four threads, each waiting for its copies (cuEventSynchronize), the caller
    // among them.
    let (read, captured) = during_a_global_capture(&ctx, || f.read_to_device(&mut dst, 0, 0, len));
    assert_eq!(read.unwrap().bytes, len);
    assert_eq!(
        captured,
        Ok(true),
        "a read broke another thread's global capture"
    );
    assert!(dst.to_vec(&stream).unwrap() == data, "bytes read");
    // A write: copies from the device waited for before each pwrite.
    let (wrote, captured) = during_a_global_capture(&ctx, || f.write_from_device(&src, 0, 0, len));
    assert_eq!(wrote.unwrap().bytes, len);
    assert_eq!(
        captured,
        Ok(true),
        "a write broke another thread's global capture"
    );
    assert!(
        std::fs::read(&p).unwrap() == pattern(len, 10),
        "bytes written"
    );
    std::fs::remove_file(&p).unwrap();
}

/// `GdsFile::read_async` takes the path a blocking read takes and gives the same bytes: many
/// awaited at once on a tokio runtime, exact bytes at unaligned offsets into poisoned buffers,
/// a read across the end of the file short with the rest untouched, bad ranges refused before
/// any thread starts, and a deadline that passes first ends the await typed while the read
/// finishes on its own thread.
#[test]
fn awaited_reads_take_the_blocking_path_and_give_its_bytes() {
    let Some((_ctx, stream)) = setup() else {
        return;
    };
    let n = (8 << 20) + 4097;
    let data = pattern(n, 31);
    let p = write_file("awaited", &data);
    let f = Arc::new(GdsFile::open(&p, &OpenOptions::read_only(), Mode::Auto).unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let cases: Vec<(usize, u64, usize)> = vec![
        (0, 0, 1 << 20),
        (3, 4097, (2 << 20) + 5),
        (4096, 1 << 20, 4 << 20),
        (17, (n - 1000) as u64, 5000),
        (0, n as u64 + 10, 4096),
    ];
    let results = rt.block_on(async {
        let mut reads = Vec::new();
        for &(off, fo, len) in &cases {
            let dst = DeviceBuffer::from_slice(&stream, &vec![POISON; off + len + 4099]).unwrap();
            let want = f.path_for_read(fo, len);
            let r = f
                .read_async(dst, off, fo, len)
                .unwrap()
                .timeout(std::time::Duration::from_secs(60));
            reads.push(async move { (want, r.await) });
        }
        let mut out = Vec::new();
        for r in reads {
            out.push(r.await);
        }
        out
    });
    for ((want, r), &(off, fo, len)) in results.into_iter().zip(&cases) {
        let (dst, t) = r.unwrap();
        assert_eq!(t.path.path, want.path, "the blocking read's path");
        let exp = len.min(data.len().saturating_sub(fo as usize));
        assert_eq!(t.bytes, exp, "count at {fo}");
        let host = dst.to_vec(&stream).unwrap();
        let from = (fo as usize).min(data.len());
        assert!(
            host[off..off + exp] == data[from..from + exp],
            "bytes at {fo}"
        );
        assert!(
            host[..off].iter().all(|&b| b == POISON)
                && host[off + exp..].iter().all(|&b| b == POISON),
            "bytes outside the range changed at {fo}"
        );
    }
    // A range outside the buffer: refused at once.
    let small = DeviceBuffer::from_slice(&stream, &[0u8; 64]).unwrap();
    assert!(matches!(
        f.read_async(small, 0, 0, 65),
        Err(Error::InvalidArgument { .. })
    ));
    // A deadline that has passed: typed, and the read still ends on its thread.
    let dst = DeviceBuffer::from_slice(&stream, &vec![POISON; n]).unwrap();
    let r = rt.block_on(
        f.read_async(dst, 0, 0, n)
            .unwrap()
            .deadline(std::time::Instant::now()),
    );
    assert!(matches!(r, Err(Error::Timeout { .. })), "{:?}", r.err());
    let _ = std::fs::remove_file(&p);
}
