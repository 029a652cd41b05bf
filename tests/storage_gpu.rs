//! Tier 2: cuFile and the automatic path on a GPU. Skips (`SKIPPED: reason`) without a GPU or
//! libcufile; `GPUDIRECT_REQUIRE=gpu,cufile` turns those skips into failures.
//!
//! Where the node has no udev data, `cuFileHandleRegister` answers 5027: the cuFile-path tests then
//! check that typed error and say so, and the fallback tests check the POSIX path took over.

mod support;

use gpudirect::Error;
use gpudirect::memory::DeviceBuffer;
use gpudirect::storage::{
    BatchOp, BatchRequest, BufRegistration, DirectIo, Driver, FileHandle, GdsFile, IoPath, Mode,
    OpenOptions, PathReason, run_batched,
};
use gpudirect_testing::{Hardware, require};
use support::files::{pattern, test_dir};
use support::gpu::{ToHost, poisoned_bytes};
use support::storage::{cufile as setup, register, write_file};

#[test]
fn properties_are_typed_and_version_aware() {
    let Some((_ctx, d)) = setup() else { return };
    let v = d.version().expect("cuFileGetVersion");
    println!("cuFile {v} from {}", d.library_path());
    assert!(v >= 1140, "{v}");
    let p = d.properties().unwrap();
    println!("{p:?}");
    assert!(p.max_batch_io_size > 0);
    assert_eq!(d.max_batch_entries(), p.max_batch_io_size as usize);
    let _ = gpudirect::storage::SizeParam::IoBatchSize.get().unwrap();
    // A second open is another handle to the same driver.
    let d2 = Driver::open().unwrap();
    assert_eq!(d2.version(), d.version());
    assert_eq!(d2.properties().unwrap(), p);
    assert!(d.properties().is_ok());
}

#[test]
fn sync_roundtrip_unaligned_and_eof() {
    let Some((_ctx, d)) = setup() else { return };
    let data = pattern(1 << 20, 1);
    let p = write_file("sync", &data);
    let Some(h) = register(&d, &p, &OpenOptions::read_write()) else {
        return;
    };
    // Unaligned: 4097 bytes at file offset 3 into device offset 1, poisoned destination.
    let mut dst = poisoned_bytes(0, 8192, 0xCD);
    let n = h.read(&mut dst, 1, 3, 4097).unwrap();
    assert_eq!(n, 4097);
    let host = dst.to_host();
    assert_eq!(&host[1..4098], &data[3..4100]);
    assert_eq!(host[0], 0xCD);
    assert!(host[4098..].iter().all(|&b| b == 0xCD));
    // Crossing end of file: the short count.
    let n = h.read(&mut dst, 0, (1 << 20) - 100, 4096).unwrap();
    assert_eq!(n, 100);
    assert_eq!(&dst.to_host()[..100], &data[(1 << 20) - 100..]);
    // Whole file, registered buffer.
    let buf = poisoned_bytes(0, 1 << 20, 0xCD);
    let mut reg = BufRegistration::register(&d, buf, 0, 1 << 20).unwrap();
    assert_eq!(h.read(&mut reg, 0, 0, 1 << 20).unwrap(), 1 << 20);
    let buf = reg.into_inner().unwrap();
    assert_eq!(buf.to_host(), data);
    // Write back at an unaligned offset, compare against a host read.
    assert_eq!(h.write(&buf, 5, 11, 70_000).unwrap(), 70_000);
    let back = std::fs::read(&p).unwrap();
    assert_eq!(&back[11..70_011], &data[5..70_005]);
    // Validation before any FFI call.
    let e = h.read(&mut dst, 8000, 0, 4097).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument {
                arg: "dst_offset",
                ..
            }
        ),
        "{e}"
    );
    std::fs::remove_file(&p).unwrap();
}

#[test]
fn async_write_sees_prior_stream_work() {
    let Some((ctx, d)) = setup() else { return };
    let p = write_file("async-order", &[0u8; 65536]);
    let Some(h) = register(&d, &p, &OpenOptions::read_write()) else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let buf = poisoned_bytes(0, 65536, 0);
    // The "kernel": a memset on the stream, then the write on the same stream.
    // SAFETY: the buffer is live; the stream is valid.
    let r = unsafe {
        gpudirect::cudarc::driver::sys::cuMemsetD32Async(
            buf.device_ptr_for_test(),
            0xDEAD_BEEF,
            65536 / 4,
            stream.cu_stream(),
        )
    };
    assert_eq!(r, gpudirect::cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    let op = h.write_async(&stream, buf, 0, 0, 65536).unwrap();
    let (buf, n) = op.wait().unwrap();
    assert_eq!(n, 65536);
    let back = std::fs::read(&p).unwrap();
    assert!(back.chunks(4).all(|c| c == 0xDEAD_BEEFu32.to_le_bytes()));
    // Async read back into a poisoned buffer.
    drop(buf);
    let dst = poisoned_bytes(0, 65536, 0xCD);
    let (dst, n) = h
        .read_async(&stream, dst, 0, 0, 65536)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(n, 65536);
    assert_eq!(dst.to_host(), back);
    gpudirect::completion::Tracker::global().reap();
    std::fs::remove_file(&p).unwrap();
}

#[test]
fn batches_split_at_the_limit() {
    let Some((_ctx, d)) = setup() else { return };
    let limit = d.max_batch_entries();
    println!("max_batch_io_size = {limit}");
    let e = gpudirect::storage::Batch::<DeviceBuffer<u8>>::new(&d, limit + 1).unwrap_err();
    assert!(
        matches!(e, Error::LimitExceeded { requested, limit: l, .. } if requested == limit + 1 && l == limit),
        "{e}"
    );
    let n = 200usize;
    let chunk = 4096usize;
    let data = pattern(n * chunk, 5);
    let p = write_file("batch", &data);
    let Some(h) = register(&d, &p, &OpenOptions::read_write()) else {
        return;
    };
    let reqs: Vec<_> = (0..n)
        .map(|i| BatchRequest {
            op: BatchOp::Read,
            handle: h.clone(),
            buffer: poisoned_bytes(0, chunk, 0xCD),
            buf_offset: 0,
            file_offset: (i * chunk) as u64,
            len: chunk,
        })
        .collect();
    // A small batch first, by hand: setup, submit, poll, wait.
    let mut b = gpudirect::storage::Batch::new(&d, 4).unwrap();
    b.submit(
        (0..4)
            .map(|i| BatchRequest {
                op: BatchOp::Read,
                handle: h.clone(),
                buffer: poisoned_bytes(0, chunk, 0xCD),
                buf_offset: 0,
                file_offset: (i * chunk) as u64,
                len: chunk,
            })
            .collect(),
    )
    .unwrap();
    let got = b.poll(1, std::time::Duration::from_secs(5)).unwrap();
    println!(
        "first poll: {got} finished, {} outstanding",
        b.outstanding()
    );
    let small = b.wait_timeout(std::time::Duration::from_secs(20)).unwrap();
    for (i, r) in small.iter().enumerate() {
        assert_eq!(
            *r.bytes.as_ref().unwrap(),
            chunk,
            "small {i}: {:?}",
            r.status
        );
        assert_eq!(
            r.buffer.to_host(),
            &data[i * chunk..(i + 1) * chunk],
            "small {i}"
        );
    }
    let results = run_batched(&d, reqs, std::time::Duration::from_secs(30)).unwrap();
    assert_eq!(results.len(), n);
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
    std::fs::remove_file(&p).unwrap();
}

#[test]
fn auto_path_reads_correctly_and_says_why() {
    let Some((_ctx, _d)) = setup() else { return };
    let data = pattern(40 << 20, 9);
    let p = write_file("auto", &data);
    let f = GdsFile::open(&p, &OpenOptions::read_only(), Mode::Auto).unwrap();
    let mut dst = poisoned_bytes(0, (40 << 20) + 16, 0xCD);
    let t = f.read_to_device(&mut dst, 1, 3, (40 << 20) - 3).unwrap();
    println!(
        "auto read: {t:?}; cuFile unavailable because {:?}",
        f.cufile_unavailable()
    );
    assert_eq!(t.bytes, (40 << 20) - 3);
    let host = dst.to_host();
    assert_eq!(&host[1..(40 << 20) - 2], &data[3..]);
    assert_eq!(host[0], 0xCD);
    match f.cufile_handle() {
        // Compatibility mode without nvidia-fs: our POSIX path is faster.
        Some(_) if !_d.properties().unwrap().has_nvidia_fs() => {
            assert_eq!(t.path.path, IoPath::Posix);
            assert_eq!(t.path.reason, PathReason::CompatModeSlower);
        }
        Some(_) => {}
        None => {
            assert_eq!(t.path.path, IoPath::Posix);
            assert!(
                matches!(t.path.reason, PathReason::RegistrationFailed { code, .. } if code > 5000),
                "{t:?}"
            );
        }
    }
    // The POSIX path, cold: O_DIRECT where the file allows it.
    let fp = GdsFile::open(&p, &OpenOptions::read_only(), Mode::Posix).unwrap();
    let mut dst2 = poisoned_bytes(0, 40 << 20, 0xCD);
    // SAFETY: a valid descriptor; dropping clean cached pages is harmless.
    let fd = std::fs::File::open(&p).unwrap();
    unsafe {
        libc::posix_fadvise(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            0,
            0,
            libc::POSIX_FADV_DONTNEED,
        )
    };
    let t = fp.read_to_device(&mut dst2, 0, 0, 40 << 20).unwrap();
    println!("posix read after fadvise(DONTNEED): {t:?}");
    assert_eq!(dst2.to_host(), data);
    std::fs::remove_file(&p).unwrap();
}

#[test]
fn tmpfs_falls_back_to_posix() {
    let Some((_ctx, d)) = setup() else { return };
    if !std::path::Path::new("/dev/shm").is_dir() {
        println!("SKIPPED: no /dev/shm");
        return;
    }
    let data = pattern(3 << 20, 4);
    let p = std::path::PathBuf::from(format!("/dev/shm/gpudirect-tmpfs-{}", std::process::id()));
    std::fs::write(&p, &data).unwrap();
    // Where tmpfs refuses O_DIRECT (kernels before 6.6), the open falls back to buffered;
    // newer kernels accept it. Either way the data below must be right.
    let (_, direct) = OpenOptions::read_only().open(&p).unwrap();
    let required = OpenOptions::read_only().direct(DirectIo::Require).open(&p);
    assert_eq!(
        direct,
        required.is_ok(),
        "Try and Require agree on O_DIRECT"
    );
    println!("tmpfs O_DIRECT accepted: {direct}");
    // cuFile refuses tmpfs; the automatic mode falls back and says why.
    let f = GdsFile::open(&p, &OpenOptions::read_only(), Mode::Auto).unwrap();
    let mut dst = poisoned_bytes(0, 3 << 20, 0xCD);
    let t = f.read_to_device(&mut dst, 0, 0, 3 << 20).unwrap();
    println!("tmpfs: {t:?}");
    assert_eq!(t.path.path, IoPath::Posix);
    assert_eq!(dst.to_host(), data);
    if f.cufile_handle().is_none() {
        // The typed cuFile error, in CuFile mode.
        let e = GdsFile::open(&p, &OpenOptions::read_only(), Mode::CuFile).unwrap_err();
        assert!(matches!(e, Error::CuFile { .. }), "{e}");
        let e = FileHandle::open(&d, &p, &OpenOptions::read_only()).unwrap_err();
        println!("tmpfs registration: {e}");
    }
    // Writes through the automatic path.
    let out = test_dir().join(format!("auto-write-{}", std::process::id()));
    let fw = GdsFile::open(&out, &OpenOptions::read_write().truncate(true), Mode::Auto).unwrap();
    let t = fw.write_from_device(&dst, 7, 0, (3 << 20) - 7).unwrap();
    println!("auto write: {t:?}");
    assert_eq!(t.bytes, (3 << 20) - 7);
    assert_eq!(std::fs::read(&out).unwrap(), &data[7..]);
    std::fs::remove_file(&out).unwrap();
    std::fs::remove_file(&p).unwrap();
}

#[test]
fn three_gib_read_arrives_whole() {
    let Some((_ctx, d)) = setup() else { return };
    if std::env::var_os("GPUDIRECT_BIG_TESTS").is_none() {
        println!("SKIPPED: set GPUDIRECT_BIG_TESTS=1 for the 3 GiB read");
        return;
    }
    let len: usize = 3 << 30;
    let p = test_dir().join(format!("three-gib-{}", std::process::id()));
    {
        use std::io::Write;
        let mut w = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(&p).unwrap());
        let block = pattern(1 << 20, 17);
        for i in 0..(len >> 20) {
            let mut b = block.clone();
            b[..8].copy_from_slice(&(i as u64).to_le_bytes());
            w.write_all(&b).unwrap();
        }
    }
    let check = |host: &[u8], what: &str| {
        let block = pattern(1 << 20, 17);
        for (i, c) in host.chunks(1 << 20).enumerate() {
            assert_eq!(&c[..8], &(i as u64).to_le_bytes(), "{what}: block {i}");
            assert_eq!(&c[8..], &block[8..], "{what}: block {i}");
        }
    };
    let mut dst = poisoned_bytes(0, len, 0xCD);
    if let Some(h) = register(&d, &p, &OpenOptions::read_only()) {
        let n = h.read(&mut dst, 0, 0, len).unwrap();
        assert_eq!(n, len);
        check(&dst.to_host(), "cuFile");
    }
    let mut dst = poisoned_bytes(0, len, 0xCD);
    let f = GdsFile::open(&p, &OpenOptions::read_only(), Mode::Auto).unwrap();
    let t = f.read_to_device(&mut dst, 0, 0, len).unwrap();
    println!("3 GiB auto: {t:?}");
    assert_eq!(t.bytes, len);
    check(&dst.to_host(), "auto");
    std::fs::remove_file(&p).unwrap();
}

trait PtrForTest {
    fn device_ptr_for_test(&self) -> u64;
}
impl PtrForTest for DeviceBuffer<u8> {
    fn device_ptr_for_test(&self) -> u64 {
        gpudirect::memory::DeviceMemory::device_ptr(self)
    }
}

#[test]
fn missing_hardware_is_a_typed_error_not_a_panic() {
    // Whatever this machine has, opening never panics.
    match Driver::open() {
        Ok(d) => println!("cuFile driver open: {:?}", d.version()),
        Err(e) => println!("typed: {e}"),
    }
    let _ = require!(Hardware::Gpu, gpudirect::cuda::context(0));
}
