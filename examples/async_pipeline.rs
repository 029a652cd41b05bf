//! An async pipeline on tokio: a file is read into GPU memory in chunks with awaited reads, and
//! while chunk `i + 1` is read, chunk `i` is processed: copied back to pinned host memory
//! (`memory::copy_async`, awaited) and checked byte for byte against the file. Two device
//! buffers take turns; every await has a deadline. Prints the pipeline's GB/s beside the same
//! reads and copies one after the other.
//!
//! ```text
//! cargo run --release --example async_pipeline
//! cargo run --release --example async_pipeline -- --mib 1024 --chunk-mib 16 --dir /mnt/nvme/tmp
//! cargo run --release --example async_pipeline -- --reads cufile   # cuFile's stream-ordered reads
//! ```
//!
//! By default the chunks are read by `GdsFile::read_async` in `Mode::Auto`: the path a blocking
//! read takes (cuFile with GPUDirect Storage, the library's POSIX path where cuFile runs in
//! compatibility mode or cannot register the file), awaited. `--reads cufile` reads with cuFile's
//! stream-ordered `FileHandle::read_async` instead (it fails where cuFile cannot register the
//! file: no udev data for its device, tmpfs). Exits 0 with `SKIPPED: reason` without a GPU; 1 on
//! wrong bytes or an error; 2 on a bad option. `--help` lists the options and their environment
//! settings.

#[path = "support/cli.rs"]
mod cli;

use clap::Parser;
use gpudirect::cuda::Stream;
use gpudirect::memory::{DeviceBuffer, HostAllocFlags, PinnedHostBuffer, copy_async};
use gpudirect::storage::{Driver, FileHandle, GdsFile, Mode, OpenOptions};
use gpudirect_testing::{Hardware, skip_example};
use rand::RngCore;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Read a random file into GPU memory chunk by chunk with awaited reads, processing each chunk
/// (copy back, check) while the next one is read.
#[derive(Parser)]
struct Args {
    /// File size in MiB (2^20 bytes); a multiple of --chunk-mib.
    #[arg(long, env = "GPUDIRECT_EXAMPLE_MIB", default_value = "64", value_parser = cli::mib)]
    mib: cli::Mib,
    /// Chunk size in MiB: two device buffers and one pinned host buffer of this size.
    #[arg(long, env = "PIPELINE_CHUNK_MIB", default_value = "8", value_parser = cli::mib)]
    chunk_mib: cli::Mib,
    /// Deadline of every await, in milliseconds.
    #[arg(long, env = "PIPELINE_DEADLINE_MS", default_value = "30000", value_parser = cli::positive)]
    deadline_ms: usize,
    /// Directory for the test file: a real file system (not tmpfs), where cuFile can register
    /// files [default: target/gpudirect-storage-test]
    #[arg(long, env = "GPUDIRECT_TEST_DIR")]
    dir: Option<PathBuf>,
    /// How chunks are read: `auto` (`GdsFile::read_async`, the automatic path) or `cufile`
    /// (cuFile's stream-ordered `FileHandle::read_async`).
    #[arg(long, env = "PIPELINE_READS", default_value = "auto", value_parser = ["auto", "cufile"])]
    reads: String,
}

fn main() {
    let args = Args::parse();
    if args.mib.bytes % args.chunk_mib.bytes != 0 {
        eprintln!(
            "error: --mib {} is not a multiple of --chunk-mib {}",
            args.mib.mib, args.chunk_mib.mib
        );
        std::process::exit(2);
    }
    let ctx = match gpudirect::cuda::context(0) {
        Ok(c) => c,
        Err(e) => skip_example(Hardware::Gpu, format!("no GPU: {e}")),
    };
    let dir = args
        .dir
        .clone()
        .unwrap_or_else(|| PathBuf::from("target/gpudirect-storage-test"));
    let mut data = vec![0u8; args.mib.bytes];
    rand::rng().fill_bytes(&mut data);
    let path = dir.join(format!("async-pipeline-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, &data)) {
        eprintln!("FAILED: writing {}: {e}", path.display());
        std::process::exit(1);
    }
    let reader = if args.reads == "cufile" {
        match Driver::open().and_then(|d| FileHandle::open(&d, &path, &OpenOptions::read_only())) {
            Ok(f) => {
                println!("reads: cuFileReadAsync on a stream, awaited");
                Ok(Reader::CuFile(f))
            }
            Err(e) => Err(e),
        }
    } else {
        GdsFile::open(&path, &OpenOptions::read_only(), Mode::Auto).map(|g| {
            let t = g.path_for_read(0, args.chunk_mib.bytes);
            println!(
                "reads: GdsFile::read_async (Mode::Auto), awaited: {:?} ({:?})",
                t.path, t.reason
            );
            Reader::Auto(Arc::new(g))
        })
    };
    let reader = match reader {
        Ok(r) => r,
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            eprintln!("FAILED: opening {}: {e}", path.display());
            std::process::exit(1);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let result = rt.block_on(run(&ctx, &reader, &data, &args));
    drop(reader);
    let _ = std::fs::remove_file(&path);
    if let Err(e) = result {
        eprintln!("FAILED: {e}");
        std::process::exit(1);
    }
}

/// Where the chunks come from.
enum Reader {
    /// cuFile's stream-ordered reads.
    CuFile(FileHandle),
    /// The automatic path, awaited (`GdsFile::read_async`).
    Auto(Arc<GdsFile>),
}

/// A chunk's read in flight: the buffer back and the bytes read.
type Reading = Pin<Box<dyn Future<Output = gpudirect::Result<(DeviceBuffer<u8>, usize)>>>>;

impl Reader {
    /// Start reading `len` bytes at `offset` into `buf` (on `io` for cuFile).
    fn read(
        &self,
        io: &Stream,
        buf: DeviceBuffer<u8>,
        offset: u64,
        len: usize,
        deadline: Duration,
    ) -> gpudirect::Result<Reading> {
        match self {
            Reader::CuFile(f) => Ok(Box::pin(
                f.read_async(io.cuda(), buf, 0, offset, len)?
                    .timeout(deadline)
                    .into_future(),
            )),
            Reader::Auto(g) => {
                let read = g.read_async(buf, 0, offset, len)?.timeout(deadline);
                Ok(Box::pin(async move {
                    let (buf, t) = read.await?;
                    Ok((buf, t.bytes))
                }))
            }
        }
    }
}

async fn run(
    ctx: &Arc<gpudirect::cudarc::driver::CudaContext>,
    reader: &Reader,
    data: &[u8],
    args: &Args,
) -> gpudirect::Result<()> {
    let chunk = args.chunk_mib.bytes;
    let deadline = Duration::from_millis(args.deadline_ms as u64);
    // Reads on one stream, processing on another: they overlap.
    let io = Stream::new(ctx)?;
    let work = Stream::new(ctx)?;
    let mut buffers = vec![
        DeviceBuffer::<u8>::alloc(ctx, chunk)?,
        DeviceBuffer::<u8>::alloc(ctx, chunk)?,
    ];
    let mut host = Some(PinnedHostBuffer::<u8>::alloc(
        ctx,
        chunk,
        HostAllocFlags::empty(),
    )?);
    let chunks = data.len() / chunk;
    let read = |buf: DeviceBuffer<u8>, i: usize| {
        reader.read(&io, buf, (i * chunk) as u64, chunk, deadline)
    };
    // Once one after the other (read, then process), then pipelined; both verified.
    for pipelined in [false, true] {
        let start = Instant::now();
        let mut reading = Some(read(buffers.pop().expect("two buffers"), 0)?);
        for i in 0..chunks {
            let (buf, got) = reading.take().expect("a read in flight").await?;
            if got != chunk {
                eprintln!("FAILED: chunk {i}: read {got} of {chunk} bytes");
                std::process::exit(1);
            }
            let next = i + 1 < chunks;
            if pipelined && next {
                // Chunk i + 1 is read while chunk i is processed below.
                reading = Some(read(buffers.pop().expect("the other buffer"), i + 1)?);
            }
            let (buf, back) = copy_async(&work, buf, host.take().expect("the host buffer"))?
                .timeout(deadline)
                .await?;
            if back.as_slice() != &data[i * chunk..(i + 1) * chunk] {
                eprintln!("FAILED: chunk {i} differs from the file");
                std::process::exit(1);
            }
            host = Some(back);
            buffers.push(buf);
            if !pipelined && next {
                reading = Some(read(buffers.pop().expect("a buffer"), i + 1)?);
            }
        }
        let secs = start.elapsed().as_secs_f64();
        println!(
            "{:<20} {:>7.2} GB/s  {chunks} chunks of {} MiB, bytes verified",
            if pipelined {
                "pipelined (awaited)"
            } else {
                "one after the other"
            },
            data.len() as f64 / secs / 1e9,
            args.chunk_mib.mib
        );
    }
    Ok(())
}
