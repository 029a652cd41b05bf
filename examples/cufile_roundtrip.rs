//! Smoke test for GPUDirect Storage: write a random file, read it to the GPU through every path
//! available here (raw cuFile, the library's POSIX path, the automatic path), verify the bytes,
//! print GB/s.
//!
//! ```text
//! cargo run --release --example cufile_roundtrip
//! cargo run --release --example cufile_roundtrip -- --mib 1024 --dir /mnt/nvme/tmp
//! ```
//!
//! Exits 0 with `SKIPPED: reason` without a GPU; exits 1 if any path delivers wrong bytes, 2 on a
//! bad option. Each path runs twice (the first run also allocates bounce buffers) and the faster
//! run is reported. `--help` lists the options and their environment settings.

#[path = "support/cli.rs"]
mod cli;

use clap::Parser;
use gpudirect::cuda::Stream;
use gpudirect::memory::DeviceBuffer;
use gpudirect::storage::{Driver, FileHandle, GdsFile, Mode, OpenOptions};
use gpudirect_testing::{Hardware, skip_example};
use rand::RngCore;
use std::path::PathBuf;
use std::time::Instant;

/// Write a random file, read it into GPU memory through cuFile, the POSIX path and the automatic
/// path, verify every byte and print GB/s (1 GB = 10^9 bytes).
#[derive(Parser)]
struct Args {
    /// File size in MiB (2^20 bytes); the GPU buffer is as large.
    #[arg(long, env = "GPUDIRECT_EXAMPLE_MIB", default_value = "256", value_parser = cli::mib)]
    mib: cli::Mib,
    /// Directory for the test file: a real file system (not tmpfs), where cuFile can register
    /// files [default: target/gpudirect-storage-test]
    #[arg(long, env = "GPUDIRECT_TEST_DIR")]
    dir: Option<PathBuf>,
}

fn main() {
    let args = Args::parse();
    let ctx = match gpudirect::cuda::context(0) {
        Ok(c) => c,
        Err(e) => skip_example(Hardware::Gpu, format!("no GPU: {e}")),
    };
    if let Err(e) = run(&ctx, &args) {
        eprintln!("FAILED: {e}");
        std::process::exit(1);
    }
}

fn run(
    ctx: &std::sync::Arc<gpudirect::cudarc::driver::CudaContext>,
    args: &Args,
) -> gpudirect::Result<()> {
    let stream = Stream::new(ctx)?;
    let (mib, len) = (args.mib.mib, args.mib.bytes);
    let mut data = vec![0u8; len];
    rand::rng().fill_bytes(&mut data);
    let poison = vec![0xCDu8; len];
    let dir = args
        .dir
        .clone()
        .unwrap_or_else(|| PathBuf::from("target/gpudirect-storage-test"));
    let os = |call| move |source| gpudirect::Error::Os { call, source };
    std::fs::create_dir_all(&dir).map_err(os("mkdir"))?;
    let path = dir.join(format!("cufile-roundtrip-{}", std::process::id()));
    std::fs::write(&path, &data).map_err(os("write"))?;
    println!("file: {} ({mib} MiB, random)", path.display());
    let result = read_all_paths(&stream, &path, &data, &poison);
    let _ = std::fs::remove_file(&path);
    let failed = result?;
    if failed > 0 {
        eprintln!("FAILED: {failed} path(s) delivered wrong bytes");
        std::process::exit(1);
    }
    Ok(())
}

/// Every path in turn into a poisoned device buffer; returns how many delivered wrong bytes.
fn read_all_paths(
    stream: &Stream,
    path: &std::path::Path,
    data: &[u8],
    poison: &[u8],
) -> gpudirect::Result<usize> {
    let len = data.len();
    let mut failed = 0;
    let mut report = |name: &str, what: String, secs: f64, dst: &DeviceBuffer<u8>| {
        let ok = dst.to_vec(stream)? == data;
        let gbs = len as f64 / secs / 1e9;
        println!(
            "{name:<8} {gbs:>7.2} GB/s  {}  {what}",
            if ok { "bytes verified" } else { "WRONG BYTES" }
        );
        if !ok {
            failed += 1;
        }
        Ok::<_, gpudirect::Error>(())
    };

    // Raw cuFile, where the driver opens and the file registers.
    match Driver::open().and_then(|d| {
        let h = FileHandle::open(&d, path, &OpenOptions::read_only())?;
        Ok((d, h))
    }) {
        Ok((d, h)) => {
            let mut secs = f64::MAX;
            let mut dst = DeviceBuffer::from_slice(stream, poison)?;
            let mut n = 0;
            for _ in 0..2 {
                dst = DeviceBuffer::from_slice(stream, poison)?;
                let t = Instant::now();
                n = h.read(&mut dst, 0, 0, len)?;
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
            )?;
        }
        Err(e) => println!("cuFile   unavailable: {e}"),
    }

    for (name, mode) in [("posix", Mode::Posix), ("auto", Mode::Auto)] {
        let f = GdsFile::open(path, &OpenOptions::read_only(), mode)?;
        // Best of two: the first transfer also allocates the pinned bounce buffers.
        let mut secs = f64::MAX;
        let mut dst = DeviceBuffer::from_slice(stream, poison)?;
        let mut tr = None;
        for _ in 0..2 {
            dst = DeviceBuffer::from_slice(stream, poison)?;
            let t = Instant::now();
            tr = Some(f.read_to_device(&mut dst, 0, 0, len)?);
            secs = secs.min(t.elapsed().as_secs_f64());
        }
        let Some(tr) = tr else { continue };
        assert_eq!(tr.bytes, len);
        report(
            name,
            format!(
                "{:?} because {:?} (O_DIRECT: {})",
                tr.path.path, tr.path.reason, tr.path.direct
            ),
            secs,
            &dst,
        )?;
    }
    Ok(failed)
}
