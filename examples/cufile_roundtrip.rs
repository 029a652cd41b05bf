//! Smoke test for GPUDirect Storage: write a random file, read it to the GPU through every path
//! available here (raw cuFile, our POSIX path, the automatic path), verify the bytes, print GB/s.
//!
//! `cargo run --release --example cufile_roundtrip` (size: `GPUDIRECT_EXAMPLE_MIB`, default 256;
//! directory: `GPUDIRECT_TEST_DIR`, default `target/gpudirect-storage-test`). Exits 0 with
//! `SKIPPED: reason` without a GPU; exits 1 if any path delivers wrong bytes. Each path runs twice
//! (the first run also allocates bounce buffers) and the faster run is reported.

#[path = "../tests/support/devbuf.rs"]
mod devbuf;

use devbuf::{DevBuf, test_dir};
use gpudirect::storage::{Driver, File, FileHandle, Mode, OpenOptions};
use gpudirect::testing::{Hardware, skip_example};
use rand::RngCore;
use std::time::Instant;

fn main() {
    let ctx = match gpudirect::cuda::context(0) {
        Ok(c) => c,
        Err(e) => skip_example(Hardware::Gpu, format!("no GPU: {e}")),
    };
    ctx.bind_to_thread().expect("bind context");
    let mib: usize = std::env::var("GPUDIRECT_EXAMPLE_MIB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(256);
    let len = mib << 20;
    let mut data = vec![0u8; len];
    rand::rng().fill_bytes(&mut data);
    let path = test_dir().join(format!("cufile-roundtrip-{}", std::process::id()));
    std::fs::write(&path, &data).expect("write the test file");
    println!("file: {} ({mib} MiB, random)", path.display());

    let mut failed = 0;
    let mut report = |name: &str, what: String, secs: f64, dst: &DevBuf| {
        let ok = dst.to_host() == data;
        let gbs = len as f64 / secs / 1e9;
        println!(
            "{name:<8} {gbs:>7.2} GB/s  {}  {what}",
            if ok { "bytes verified" } else { "WRONG BYTES" }
        );
        if !ok {
            failed += 1;
        }
    };

    // Raw cuFile, where the driver opens and the file registers.
    match Driver::open().and_then(|d| {
        let h = FileHandle::open(&d, &path, &OpenOptions::read_only())?;
        Ok((d, h))
    }) {
        Ok((d, h)) => {
            let mut secs = f64::MAX;
            let mut dst = DevBuf::new(0, len, 0xCD);
            let mut n = 0;
            for _ in 0..2 {
                dst = DevBuf::new(0, len, 0xCD);
                let t = Instant::now();
                n = h.read(&mut dst, 0, 0, len).expect("cuFileRead");
                secs = secs.min(t.elapsed().as_secs_f64());
            }
            assert_eq!(n, len);
            let p = d.properties().ok();
            let mode = match p {
                Some(p) if p.has_nvidia_fs() => "GDS (nvidia-fs)",
                _ => "compatibility mode",
            };
            report(
                "cuFile",
                format!("cuFile {:?}, {mode}", d.version()),
                secs,
                &dst,
            );
        }
        Err(e) => println!("cuFile   unavailable: {e}"),
    }

    for (name, mode) in [("posix", Mode::Posix), ("auto", Mode::Auto)] {
        let f = File::open(&path, &OpenOptions::read_only(), mode).expect("open");
        // Best of two: the first transfer also allocates the pinned bounce buffers.
        let mut secs = f64::MAX;
        let mut dst = DevBuf::new(0, len, 0xCD);
        let mut tr = None;
        for _ in 0..2 {
            dst = DevBuf::new(0, len, 0xCD);
            let t = Instant::now();
            tr = Some(f.read_to_device(&mut dst, 0, 0, len).expect("read"));
            secs = secs.min(t.elapsed().as_secs_f64());
        }
        let tr = tr.expect("ran");
        assert_eq!(tr.bytes, len);
        report(
            name,
            format!(
                "{:?} because {:?} (O_DIRECT: {})",
                tr.path.path, tr.path.reason, tr.path.direct
            ),
            secs,
            &dst,
        );
    }
    let _ = std::fs::remove_file(&path);
    if failed > 0 {
        eprintln!("FAILED: {failed} path(s) delivered wrong bytes");
        std::process::exit(1);
    }
}
