//! P2P smoke test: the link matrix, then a verified copy for every ordered device pair (each device
//! with itself too) with GB/s and the path that ran; for each device also the staged path to itself;
//! then CUDA IPC between two processes (this binary re-executed as the importer, on the last GPU):
//! the exported memory copied into the importer's GPU, once mapped where it lives (a peer copy
//! from there) and once mapped on the importer's GPU (pulled across the link), each with its path
//! and GB/s.
//!
//! ```text
//! cargo run --release --example p2p_copy
//! cargo run --release --example p2p_copy -- --json --mib 1024
//! ```
//!
//! Without a GPU it prints `SKIPPED: reason` and exits 0 (1 when `GPUDIRECT_REQUIRE` has `gpu`);
//! 2 on a bad option. `--help` lists the options.

#[path = "support/cli.rs"]
mod cli;

use clap::Parser;
use gpudirect::cuda::Stream;
use gpudirect::memory::DeviceBuffer;
use gpudirect::memory::DeviceMemory;
use gpudirect::p2p::{
    Copier, CopyOptions, CopyPath, IpcEvent, IpcEventHandle, IpcExport, IpcMemHandle, IpcMemory,
    LinkMatrix, PathChoice,
};
use gpudirect_testing::{Hardware, skip_example};
use rand::{Rng, SeedableRng, rngs::StdRng};
use std::process::Command;

const CHILD: &str = "P2P_COPY_IPC_CHILD";

/// The link matrix, a verified copy per ordered GPU pair (GB/s: 10^9 bytes per second, and the
/// path that ran), then CUDA IPC between two processes.
#[derive(Parser)]
struct Args {
    /// Print one JSON document instead of tables.
    #[arg(long)]
    json: bool,
    /// Bytes per copy, in MiB (2^20 bytes); each pair holds a source and a destination this large.
    #[arg(long, default_value = "256", value_parser = cli::mib)]
    mib: cli::Mib,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Job {
    src: IpcMemHandle,
    ready: IpcEventHandle,
    seed: u64,
    device: usize,
}

#[derive(serde::Serialize)]
struct Measured {
    src: usize,
    dst: usize,
    bytes: usize,
    path: CopyPath,
    gb_per_s: f64,
    verified: bool,
}

fn random(n: usize, seed: u64) -> Vec<u32> {
    let mut r = StdRng::seed_from_u64(seed);
    (0..n).map(|_| r.random()).collect()
}

fn main() {
    if let Ok(job) = std::env::var(CHILD) {
        std::process::exit(match ipc_child(&job) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("IPC child failed: {e}");
                1
            }
        });
    }
    let args = Args::parse();
    let n = match gpudirect::cuda::device_count() {
        Ok(0) => skip_example(Hardware::Gpu, "no CUDA device visible"),
        Ok(n) => n,
        Err(e) => skip_example(Hardware::Gpu, e),
    };
    if let Err(e) = run(n, args.mib, args.json) {
        eprintln!("FAILED: {e}");
        std::process::exit(1);
    }
}

fn run(n: usize, size: cli::Mib, json: bool) -> gpudirect::Result<()> {
    let mib = size.mib;
    let matrix = LinkMatrix::probe()?;
    if !json {
        println!("== link matrix ({n} GPU{})", if n == 1 { "" } else { "s" });
        print!("{}", matrix.table());
        println!("== copies of {mib} MiB, verified byte for byte");
    }
    let words = size.bytes / 4;
    let mut results = Vec::new();
    for a in 0..n {
        for b in 0..n {
            let mut choices = vec![PathChoice::Auto];
            if a == b {
                choices.push(PathChoice::Staged); // the staged path (the fallback without peer access)
            }
            for choice in choices {
                let m = measure(a, b, words, choice)?;
                if !json {
                    println!(
                        "{a}->{b}  {:>7.1} GB/s  {}  {}",
                        m.gb_per_s,
                        m.path,
                        if m.verified { "verified" } else { "MISMATCH" }
                    );
                }
                if !m.verified {
                    return Err(cli::invalid(
                        "copy",
                        format!("{a}->{b}"),
                        "destination differs from source",
                    ));
                }
                results.push(m);
            }
        }
    }
    let ipc = ipc_parent(n, words)?;
    if json {
        let out = serde_json::json!({ "matrix": matrix, "copies": results, "ipc": ipc });
        println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
    } else {
        println!("== IPC between two processes: {ipc}");
    }
    Ok(())
}

/// One warm-up copy, then the best of three timed ones; verify the last one's bytes.
fn measure(a: usize, b: usize, words: usize, choice: PathChoice) -> gpudirect::Result<Measured> {
    let opts = CopyOptions {
        path: choice,
        ..Default::default()
    };
    let copier = Copier::new(a, b, opts)?;
    let sa = Stream::new(&gpudirect::cuda::context(a)?)?;
    let sb = Stream::new(&gpudirect::cuda::context(b)?)?;
    let data = random(words, (a as u64).wrapping_mul(131).wrapping_add(b as u64));
    let mut src = DeviceBuffer::from_slice(&sa, &data)?;
    let mut dst = DeviceBuffer::from_slice(&sb, &vec![0xDEAD_BEEFu32; words])?;
    let mut best: f64 = 0.0;
    let mut path = copier.path().clone();
    for i in 0..4 {
        let done = copier.copy(src, dst)?;
        if i > 0 {
            best = best.max(done.gb_per_s());
        }
        path = done.path.clone();
        (src, dst) = done.into_parts();
    }
    let verified = dst.to_vec(&sb)? == data;
    Ok(Measured {
        src: a,
        dst: b,
        bytes: words * 4,
        path,
        gb_per_s: best,
        verified,
    })
}

/// Export `words` words, let a second process import, copy and verify them; returns its summary.
fn ipc_parent(n: usize, words: usize) -> gpudirect::Result<String> {
    let seed = 0x1bc;
    let s = Stream::new(&gpudirect::cuda::context(0)?)?;
    let src = IpcExport::new(DeviceBuffer::from_slice(&s, &random(words, seed))?)?;
    let ready = IpcEvent::new(0)?;
    ready.record(&s)?;
    let device = n - 1;
    let job = Job {
        src: src.handle().clone(),
        ready: ready.handle().clone(),
        seed,
        device,
    };
    let exe = std::env::current_exe().map_err(|e| gpudirect::Error::Os {
        call: "current_exe",
        source: e,
    })?;
    let out = Command::new(exe)
        .env(CHILD, serde_json::to_string(&job).unwrap_or_default())
        .output()
        .map_err(|e| gpudirect::Error::Os {
            call: "fork/exec",
            source: e,
        })?;
    let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() {
        return Err(cli::invalid(
            "ipc child",
            format!("{:?}", out.status),
            format!(
                "the importing process failed: {said} {}",
                String::from_utf8_lossy(&out.stderr)
            ),
        ));
    }
    drop(src); // the child has closed its mapping (it exited)
    Ok(format!("device 0 -> process 2 on device {device}:\n{said}"))
}

fn ipc_child(job: &str) -> gpudirect::Result<()> {
    let job: Job =
        serde_json::from_str(job).map_err(|e| cli::invalid("job", e, "JSON from the parent"))?;
    let d = job.device;
    let s = Stream::new(&gpudirect::cuda::context(d)?)?;
    IpcEvent::open(&job.ready, d)?.wait_on(&s)?;
    s.synchronize()?;
    let want = random((job.src.bytes / 4) as usize, job.seed);
    // Mapped where it lives (device 0 of the parent, found by its PCI address), then mapped on
    // this process's device: one mapping at a time.
    for mapped_here in [false, true] {
        let src = if mapped_here {
            IpcMemory::<u32>::open_on(&job.src, d)?
        } else {
            IpcMemory::<u32>::open(&job.src)?
        };
        let (on, home) = (src.ordinal(), src.home());
        let words = src.len();
        let mut dst = DeviceBuffer::from_slice(&s, &vec![0u32; words])?;
        let copier = Copier::new(on, d, CopyOptions::default())?;
        let (mut src, mut best, mut path) = (src, 0f64, copier.path().clone());
        for i in 0..4 {
            let done = copier.copy(src, dst)?;
            if i > 0 {
                best = best.max(done.gb_per_s());
            }
            path = done.path.clone();
            (src, dst) = done.into_parts();
        }
        let ok = dst.to_vec(&s)? == want;
        println!(
            "  {} MiB of device {} memory mapped on device {on} -> device {d}: {best:.1} GB/s \
             ({path}), {}",
            (words * 4) >> 20,
            home.map_or("?".into(), |h| h.to_string()),
            if ok { "verified" } else { "MISMATCH" }
        );
        if !ok {
            return Err(cli::invalid(
                "imported bytes",
                "differ",
                "must equal the exporter's",
            ));
        }
    }
    Ok(())
}
