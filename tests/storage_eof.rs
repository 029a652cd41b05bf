//! Tier 2: one end-of-file rule for every read path. A file of 22,295 random bytes; 8,192 bytes
//! asked at file offset 18,295 into a poisoned device buffer at byte 100: every path (POSIX,
//! cuFile blocking into a plain and a registered buffer, stream-ordered, batch, and the
//! automatic path) returns 4,000 and changes no byte of the buffer outside 100..4,100. Reads at
//! and past the end return 0 and change nothing; a read inside the file is exact.
//!
//!
//! Stream-ordered I/O gives the blocking path's result for every device buffer offset: in
//! compatibility mode (cuFile 1.15, H200) `cuFileReadAsync` failed with EIO for any buffer offset
//! but 0, so the library points cuFile only at offset 0 of a `cuMemAlloc` allocation's base and
//! goes through a scratch buffer otherwise. Reads are compared with the blocking `cuFileRead` and
//! the file's bytes; writes are read back from the file.
//!
//! Skips (`SKIPPED: reason`) without a GPU or libcufile; `GPUDIRECT_REQUIRE=gpu,cufile` turns
//! those skips into failures. Where the node has no udev data, `cuFileHandleRegister` answers 5027
//! and only the POSIX and automatic paths run (said with a NOTE).

mod support;

use gpudirect::memory::DeviceBuffer;
use gpudirect::memory::{DeviceMemory, VmmBuffer};
use gpudirect::storage::{
    Batch, BatchOp, BatchRequest, BufRegistration, DirectIo, Driver, FileHandle, GdsFile, Mode,
    OpenOptions,
};
use support::files::{pattern, test_dir};
use support::gpu::{ToHost, device_bytes, poisoned_bytes};
use support::storage::cufile as setup;

/// `path` registered read-write with `direct`, or `None` where cuFile refuses it.
fn register(d: &Driver, path: &std::path::Path, direct: DirectIo) -> Option<FileHandle> {
    support::storage::register(d, path, &OpenOptions::read_write().direct(direct))
}

const FILE_LEN: usize = 22_295;
const DST_OFFSET: usize = 100;
const LEN: usize = 8192;
const BUF_LEN: usize = DST_OFFSET + LEN + 100;
const POISON: u8 = 0xCD;
/// 16 KiB past the largest buffer offset + length of the offset tests.
const OFFSETS_BUF_LEN: usize = 4096 + 8192 + 16384;
/// File offsets: crossing the end (the reported case), at the end, past it, inside the file.
const OFFSETS: [u64; 4] = [18_295, 22_295, 30_000, 3];

/// The count and the bytes of a read of `LEN` at `fo` into a poisoned buffer at `DST_OFFSET`.
fn check(what: &str, fo: u64, got: usize, buf: &DeviceBuffer<u8>, data: &[u8]) {
    let fo = fo as usize;
    let want = LEN.min(data.len().saturating_sub(fo));
    assert_eq!(got, want, "{what}: count at file offset {fo}");
    let host = buf.to_host();
    assert_eq!(
        &host[DST_OFFSET..DST_OFFSET + want],
        &data[fo.min(data.len())..][..want],
        "{what}: bytes read at file offset {fo}"
    );
    for (i, &b) in host.iter().enumerate() {
        if !(DST_OFFSET..DST_OFFSET + want).contains(&i) {
            assert_eq!(
                b, POISON,
                "{what}: device byte {i} outside the {want} bytes read changed (file offset {fo})"
            );
        }
    }
    println!("{what}: file offset {fo}: {got} bytes, nothing else changed");
}

#[test]
fn a_read_crossing_the_end_of_file_is_the_same_on_every_path() {
    let Some((ctx, d)) = setup() else { return };
    let data = pattern(FILE_LEN, 22);
    let path = test_dir().join(format!("eof-{}", std::process::id()));
    std::fs::write(&path, &data).unwrap();

    for mode in [Mode::Posix, Mode::Auto, Mode::CuFile] {
        let f = match GdsFile::open(&path, &OpenOptions::read_only(), mode) {
            Ok(f) => f,
            Err(e) if mode == Mode::CuFile => {
                println!("NOTE: Mode::CuFile unavailable: {e}");
                continue;
            }
            Err(e) => panic!("{mode:?}: {e}"),
        };
        for fo in OFFSETS {
            let mut buf = poisoned_bytes(0, BUF_LEN, POISON);
            let t = f.read_to_device(&mut buf, DST_OFFSET, fo, LEN).unwrap();
            check(
                &format!("GdsFile {mode:?} ({:?})", t.path),
                fo,
                t.bytes,
                &buf,
                &data,
            );
        }
    }

    for direct in [DirectIo::Try, DirectIo::Off] {
        let Some(h) = register(&d, &path, direct) else {
            break;
        };
        let what = |p: &str| format!("{p} (O_DIRECT {})", h.is_direct());
        for fo in OFFSETS {
            // Blocking, into a plain buffer.
            let mut buf = poisoned_bytes(0, BUF_LEN, POISON);
            let n = h.read(&mut buf, DST_OFFSET, fo, LEN).unwrap();
            check(&what("cuFileRead"), fo, n, &buf, &data);

            // Blocking, into a registered buffer.
            let buf = poisoned_bytes(0, BUF_LEN, POISON);
            let mut reg = BufRegistration::register(&d, buf, 0, BUF_LEN).unwrap();
            let n = h.read(&mut reg, DST_OFFSET, fo, LEN).unwrap();
            let buf = reg.into_inner().unwrap();
            check(&what("cuFileRead, registered"), fo, n, &buf, &data);

            // Stream-ordered.
            let stream = ctx.new_stream().unwrap();
            let buf = poisoned_bytes(0, BUF_LEN, POISON);
            let (buf, n) = h
                .read_async(&stream, buf, DST_OFFSET, fo, LEN)
                .unwrap()
                .wait()
                .unwrap();
            check(&what("cuFileReadAsync"), fo, n, &buf, &data);

            // Batch.
            let mut b = Batch::new(&d, 1).unwrap();
            b.submit(vec![BatchRequest {
                op: BatchOp::Read,
                handle: h.clone(),
                buffer: poisoned_bytes(0, BUF_LEN, POISON),
                buf_offset: DST_OFFSET,
                file_offset: fo,
                len: LEN,
            }])
            .unwrap();
            let mut r = b.wait_timeout(std::time::Duration::from_secs(30)).unwrap();
            let r = r.pop().unwrap();
            let n = r.bytes.unwrap();
            check(&what("cuFileBatchIOSubmit"), fo, n, &r.buffer, &data);
        }
    }
    gpudirect::completion::Tracker::global().reap();
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_stream_ordered_read_sees_the_size_an_earlier_write_on_the_stream_made() {
    let Some((ctx, d)) = setup() else { return };
    let path = test_dir().join(format!("eof-grow-{}", std::process::id()));
    std::fs::write(&path, b"").unwrap();
    let Some(h) = register(&d, &path, DirectIo::Try) else {
        return;
    };
    let data = pattern(65_536, 31);
    let src = device_bytes(0, &data);
    let stream = ctx.new_stream().unwrap();
    // Both queued before either runs: the file is empty when the read is queued, and 64 KiB long
    // when the stream reaches it.
    let write = h.write_async(&stream, src, 0, 0, data.len()).unwrap();
    let dst = poisoned_bytes(0, data.len() + 100, POISON);
    let read = h.read_async(&stream, dst, 0, 0, data.len() + 100).unwrap();
    let (_, w) = write.wait().unwrap();
    assert_eq!(w, data.len());
    let (dst, n) = read.wait().unwrap();
    assert_eq!(
        n,
        data.len(),
        "the read is limited when the stream reaches it"
    );
    let host = dst.to_host();
    assert_eq!(&host[..data.len()], &data[..]);
    assert!(host[data.len()..].iter().all(|&b| b == POISON));
    gpudirect::completion::Tracker::global().reap();
    std::fs::remove_file(&path).unwrap();
}

/// `host` after a read of `len` at file offset `fo` into byte `off`: the file's bytes there,
/// poison everywhere else.
fn expect_read(what: &str, host: &[u8], n: usize, off: usize, fo: usize, len: usize, data: &[u8]) {
    let want = len.min(data.len().saturating_sub(fo));
    assert_eq!(n, want, "{what}: count");
    assert_eq!(
        &host[off..off + want],
        &data[fo.min(data.len())..][..want],
        "{what}: bytes read"
    );
    for (i, &b) in host.iter().enumerate() {
        if !(off..off + want).contains(&i) {
            assert_eq!(
                b, POISON,
                "{what}: byte {i} outside the {want} bytes read changed"
            );
        }
    }
}

/// The matrix of the failing run (file offset, length, buffer offset), and more offsets.
const OFFSET_CASES: [(u64, usize, usize); 12] = [
    (0, 8192, 0),
    (3, 8192, 0),
    (0, 8192, 100),
    (3, 4000, 100),
    (4096, 8192, 100),
    (4096, 100, 0),
    (3, 4093, 0),
    (18_295, 4000, 100),
    (18_295, 8192, 100),
    (0, 8192, 4096),
    (5, 1, 4095),
    (22_295, 8192, 100),
];

#[test]
fn stream_ordered_reads_match_blocking_reads_at_every_buffer_offset() {
    let Some((ctx, d)) = setup() else { return };
    let data = pattern(FILE_LEN, 41);
    let path = test_dir().join(format!("async-offsets-{}", std::process::id()));
    std::fs::write(&path, &data).unwrap();
    for direct in [DirectIo::Try, DirectIo::Off] {
        let Some(h) = register(&d, &path, direct) else {
            break;
        };
        let stream = ctx.new_stream().unwrap();
        for (fo, len, off) in OFFSET_CASES {
            let what = format!("fo={fo} len={len} buf_off={off} O_DIRECT {}", h.is_direct());
            let mut sync_buf = poisoned_bytes(0, OFFSETS_BUF_LEN, POISON);
            let n = h.read(&mut sync_buf, off, fo, len).unwrap();
            expect_read(
                &format!("cuFileRead {what}"),
                &sync_buf.to_host(),
                n,
                off,
                fo as usize,
                len,
                &data,
            );
            let op = h
                .read_async(
                    &stream,
                    poisoned_bytes(0, OFFSETS_BUF_LEN, POISON),
                    off,
                    fo,
                    len,
                )
                .unwrap();
            assert_eq!(
                op.uses_scratch(),
                off != 0,
                "{what}: only offset 0 at the allocation's base goes to cuFile directly"
            );
            let (buf, n) = op
                .wait()
                .unwrap_or_else(|e| panic!("cuFileReadAsync {what}: {e}"));
            let host = buf.to_host();
            expect_read(
                &format!("cuFileReadAsync {what}"),
                &host,
                n,
                off,
                fo as usize,
                len,
                &data,
            );
            assert_eq!(
                host,
                sync_buf.to_host(),
                "{what}: async differs from blocking"
            );
            println!("{what}: {n} bytes, async == blocking");
        }
    }
    gpudirect::completion::Tracker::global().reap();
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn stream_ordered_writes_from_any_buffer_offset_land_exactly() {
    let Some((ctx, d)) = setup() else { return };
    let path = test_dir().join(format!("async-offsets-w-{}", std::process::id()));
    let Some(h) = ({
        std::fs::write(&path, vec![POISON; 3 * 8192]).unwrap();
        register(&d, &path, DirectIo::Try)
    }) else {
        let _ = std::fs::remove_file(&path);
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let src_bytes = pattern(OFFSETS_BUF_LEN, 43);
    for (fo, len, off) in [
        (0u64, 8192usize, 0usize),
        (0, 8192, 100),
        (8192, 4000, 4096),
        (3, 4093, 7),
    ] {
        std::fs::write(&path, vec![POISON; 3 * 8192]).unwrap();
        let src = device_bytes(0, &src_bytes);
        let op = h.write_async(&stream, src, off, fo, len).unwrap();
        assert_eq!(op.uses_scratch(), off != 0, "fo={fo} len={len} off={off}");
        let (_, n) = op
            .wait()
            .unwrap_or_else(|e| panic!("cuFileWriteAsync fo={fo} len={len} off={off}: {e}"));
        assert_eq!(n, len);
        let file = std::fs::read(&path).unwrap();
        let fo = fo as usize;
        assert_eq!(&file[fo..fo + len], &src_bytes[off..off + len], "off={off}");
        assert!(file[..fo].iter().all(|&b| b == POISON));
        assert!(file[fo + len..].iter().all(|&b| b == POISON));
        println!("cuFileWriteAsync fo={fo} len={len} buf_off={off}: exact");
    }
    gpudirect::completion::Tracker::global().reap();
    std::fs::remove_file(&path).unwrap();
}

/// A write then a read at buffer offset 100 on one stream, queued before either runs: the read
/// through the scratch sees the size the write made, and leaves the poison past it.
#[test]
fn a_scratch_read_sees_an_earlier_write_on_its_stream() {
    let Some((ctx, d)) = setup() else { return };
    let path = test_dir().join(format!("async-offsets-grow-{}", std::process::id()));
    std::fs::write(&path, b"").unwrap();
    let Some(h) = register(&d, &path, DirectIo::Try) else {
        let _ = std::fs::remove_file(&path);
        return;
    };
    let data = pattern(65_536, 47);
    let mut staged = vec![0u8; 100];
    staged.extend_from_slice(&data);
    let src = device_bytes(0, &staged);
    let stream = ctx.new_stream().unwrap();
    let write = h.write_async(&stream, src, 100, 0, data.len()).unwrap();
    let dst = poisoned_bytes(0, 100 + data.len() + 100, POISON);
    let read = h
        .read_async(&stream, dst, 100, 0, data.len() + 100)
        .unwrap();
    assert!(write.uses_scratch() && read.uses_scratch());
    let (_, w) = write.wait().unwrap();
    assert_eq!(w, data.len());
    let (dst, n) = read.wait().unwrap();
    assert_eq!(n, data.len(), "limited when the stream reached the read");
    let host = dst.to_host();
    assert!(host[..100].iter().all(|&b| b == POISON));
    assert_eq!(&host[100..100 + data.len()], &data[..]);
    assert!(host[100 + data.len()..].iter().all(|&b| b == POISON));
    gpudirect::completion::Tracker::global().reap();
    std::fs::remove_file(&path).unwrap();
}

/// VMM memory is not the shape cuFile was seen to handle: it goes through the scratch too.
#[test]
fn a_vmm_buffer_reads_through_the_scratch() {
    let Some((ctx, d)) = setup() else { return };
    let data = pattern(FILE_LEN, 53);
    let path = test_dir().join(format!("async-offsets-vmm-{}", std::process::id()));
    std::fs::write(&path, &data).unwrap();
    let Some(h) = register(&d, &path, DirectIo::Try) else {
        let _ = std::fs::remove_file(&path);
        return;
    };
    let mut buf = match VmmBuffer::<u8>::alloc(&ctx, OFFSETS_BUF_LEN) {
        Ok(b) => b,
        Err(e) => {
            println!("NOTE: no VMM memory here ({e}): not run");
            let _ = std::fs::remove_file(&path);
            return;
        }
    };
    let s = gpudirect::cuda::Stream::new(&ctx).unwrap();
    gpudirect::memory::copy_from_host(&s, &vec![POISON; OFFSETS_BUF_LEN], &mut buf).unwrap();
    let op = h.read_async(s.cuda(), buf, 0, 18_295, 8192).unwrap();
    assert!(op.uses_scratch());
    let (buf, n) = op.wait().unwrap();
    assert_eq!(buf.byte_len(), OFFSETS_BUF_LEN);
    expect_read(
        "cuFileReadAsync into VMM memory",
        &buf.to_vec(&s).unwrap(),
        n,
        0,
        18_295,
        8192,
        &data,
    );
    gpudirect::completion::Tracker::global().reap();
    std::fs::remove_file(&path).unwrap();
}
