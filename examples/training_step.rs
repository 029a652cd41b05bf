//! A training step that uses all four paths: two ranks (processes), each on its own GPU; every
//! step each rank reads its next batch from a file through storage (`Mode::Auto`: cuFile where it
//! works, the library's POSIX path otherwise) on a load stream, runs a kernel on a compute stream,
//! and sends its gradient to the other rank through the transfer engine on a communication
//! stream. The three streams are joined by events and by the engine's stream words: the host
//! never synchronizes a stream inside the loop.
//!
//! Per step `i` on each rank (slot `s = i % 2`):
//! - load: a loader thread reads batch `i` into one of two device batch buffers
//!   (`GdsFile::read_to_device`), then records an event on the load stream;
//! - compute: waits for that event, for the peer's gradient of step `i - 1` (the notification
//!   counter word: a stream wait, no host), and for the send of step `i - 2` out of gradient slot
//!   `s` (its completion word); runs the kernel on the batch (its duration is the compute stage),
//!   then produces gradient slot `s` (+1 on every element) and consumes the peer's gradient of
//!   step `i - 1` (+1);
//! - communication: waits for the compute event and writes gradient slot `s` into the peer's
//!   receive slot `s` with `Endpoint::write_on`, notifying the peer.
//!
//! Prints each stage alone, the step, the overlap efficiency, and the fraction of the step the
//! GPU computes; checks the received gradients' exact bytes. With one GPU both ranks share GPU 0.
//!
//! Stages alone: load and exchange are measured by one rank at a time, the other waiting at a
//! barrier; compute by both ranks at once, as the pipelined run computes. Two processes on one
//! GPU take turns on it (time slices), so a rank's exchange measured while the other rank's
//! kernels run waits for its turn on the device, not for the copy (`--alone-together` measures
//! every stage on both ranks at once, as earlier versions did; docs/transfer.md). The stage
//! windows printed (seconds on the clock both ranks share) show what ran beside what.
//! Ranks on one node meet over a Unix domain socket and move bytes by CUDA IPC; across nodes
//! (`--listen PORT` on one node, `--connect HOST:PORT` on the other) they use RDMA.
//!
//! ```text
//! cargo run --release --example training_step
//! cargo run --release --example training_step -- --batch-mib 64 --grad-mib 64 --steps 50
//! ```
//!
//! Without a GPU it prints `SKIPPED: reason` and exits 0; 1 on wrong bytes, an error, or a step
//! over 1.1x the compute stage with `--check-overlap`; 2 on a bad option.

#[path = "support/cli.rs"]
mod cli;
#[path = "support/spin.rs"]
mod spin;

use clap::Parser;
use gpudirect::cuda::Stream;
use gpudirect::cudarc::driver::{CudaContext, CudaEvent, sys};
use gpudirect::memory::DeviceBuffer;
use gpudirect::storage::{GdsFile, Mode, OpenOptions};
use gpudirect::transfer::{
    Buffer, Endpoint, Engine, EngineConfig, MemoryDescriptor, Region, StreamTransfer, StreamWord,
    TransferOptions,
};
use gpudirect_testing::{Hardware, skip_example};
use rand::RngCore;
use spin::Kernel;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Two ranks: load (storage), compute (a kernel) and exchange (the transfer engine) on three
/// streams joined by events; prints each stage alone, the step and the overlap.
#[derive(Parser, Clone)]
struct Args {
    /// Batch size in MiB read from the file each step.
    #[arg(long, env = "STEP_BATCH_MIB", default_value = "64", value_parser = cli::mib)]
    batch_mib: cli::Mib,
    /// Gradient size in MiB sent to the other rank each step.
    #[arg(long, env = "STEP_GRAD_MIB", default_value = "64", value_parser = cli::mib)]
    grad_mib: cli::Mib,
    /// Steps (at least 4).
    #[arg(long, env = "STEP_STEPS", default_value_t = 40,
          value_parser = clap::value_parser!(u32).range(4..=100_000))]
    steps: u32,
    /// Kernel duration in microseconds [default: 1.5x the slower of load and exchange alone, so
    /// that compute is the longest stage]
    #[arg(long, env = "STEP_KERNEL_US",
          value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    kernel_us: Option<u64>,
    /// Directory for the batch files: a real file system (not tmpfs) where cuFile can register
    /// files [default: target/gpudirect-storage-test]
    #[arg(long, env = "GPUDIRECT_TEST_DIR")]
    dir: Option<PathBuf>,
    /// Exit 1 when the step is over 1.1x the compute stage alone.
    #[arg(long)]
    check_overlap: bool,
    /// Measure every stage alone on both ranks at once, without the barriers that give each
    /// rank's load and exchange the device to itself.
    #[arg(long)]
    alone_together: bool,
    /// Across nodes: listen for the other rank on this TCP port (rdma_cm), as rank 0.
    #[arg(long, conflicts_with = "connect")]
    listen: Option<u16>,
    /// Across nodes: connect to the other rank's `HOST:PORT` (rdma_cm), as rank 1.
    #[arg(long)]
    connect: Option<String>,
    /// Internal: the rank this process is (set by rank 0 when it starts rank 1).
    #[arg(long, hide = true)]
    rank: Option<u32>,
    /// Internal: the Unix socket rank 0 listens on.
    #[arg(long, hide = true)]
    socket: Option<PathBuf>,
}

const DEADLINE: Duration = Duration::from_secs(60);
/// Batches in the file, read in turn.
const FILE_BATCHES: usize = 4;

fn fail(what: &str, e: impl std::fmt::Display) -> ! {
    eprintln!("training_step: {what}: {e}");
    std::process::exit(1);
}

trait OrFail<T> {
    fn or_fail(self, what: &str) -> T;
}

impl<T, E: std::fmt::Display> OrFail<T> for Result<T, E> {
    fn or_fail(self, what: &str) -> T {
        self.unwrap_or_else(|e| fail(what, e))
    }
}

/// The gradient pattern of `rank`'s slot `slot` before any step.
fn grad_seed(rank: u32, slot: usize, i: usize) -> u32 {
    (i as u32).wrapping_mul(2654435761) ^ (rank << 24) ^ ((slot as u32) << 16) ^ 0x5bd1_e995
}

fn timing_event(ctx: &Arc<CudaContext>) -> CudaEvent {
    ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .or_fail("cuEventCreate")
}

fn ms_between(a: &CudaEvent, b: &CudaEvent) -> f64 {
    a.elapsed_ms(b).or_fail("cuEventElapsedTime") as f64
}

/// The loader: reads batch after batch into the device batch buffers it is handed, each once
/// the compute stream is done with it.
struct Loader {
    file: GdsFile,
    batch: usize,
}

impl Loader {
    fn read(&self, step: usize, dst: &mut DeviceBuffer<u32>) {
        let off = ((step % FILE_BATCHES) * self.batch) as u64;
        let t = self
            .file
            .read_to_device(dst, 0, off, self.batch)
            .or_fail("read a batch");
        if t.bytes != self.batch {
            fail(
                "read a batch",
                format!("{} of {} bytes", t.bytes, self.batch),
            );
        }
    }
}

struct Rank {
    rank: u32,
    ctx: Arc<CudaContext>,
    ep: Endpoint,
    grads: Vec<Region>,
    recv: Vec<Region>,
    /// The peer's receive slots and its scratch buffer (for the exchange alone).
    peer: Vec<MemoryDescriptor>,
    grad_len: usize,
}

fn main() {
    let args = Args::parse();
    let rank = args
        .rank
        .unwrap_or(if args.connect.is_some() { 1 } else { 0 });
    let gpus = match gpudirect::cuda::device_count() {
        Ok(n) if n > 0 => n,
        Ok(_) => skip_example(Hardware::Gpu, "no CUDA device"),
        Err(e) => skip_example(Hardware::Gpu, e),
    };
    let ordinal = if gpus >= 2 { rank as usize } else { 0 };
    let ctx = match gpudirect::cuda::context(ordinal) {
        Ok(c) => c,
        Err(e) => skip_example(Hardware::Gpu, e),
    };
    let kernel = Kernel::load(&ctx).or_fail("load spin.ptx");
    let grad_len = args.grad_mib.bytes;
    let batch_len = args.batch_mib.bytes;

    // The engine: intra-node (CUDA IPC over a Unix socket) unless told to cross nodes.
    let across = args.listen.is_some() || args.connect.is_some();
    let engine = if across {
        let mut c = EngineConfig::default();
        c.gpu = Some(ordinal);
        Engine::new(c)
    } else {
        Engine::new(EngineConfig::local())
    }
    .or_fail("start the transfer engine");
    let alloc = |n: usize| -> Region {
        let b = DeviceBuffer::<u8>::alloc(&ctx, n).or_fail("cuMemAlloc");
        engine
            .register(Buffer::device(b).or_fail("Buffer::device"))
            .or_fail("register")
    };
    let grads: Vec<Region> = (0..2).map(|_| alloc(grad_len)).collect();
    let recv: Vec<Region> = (0..2).map(|_| alloc(grad_len)).collect();
    let scratch = alloc(grad_len);
    for (s, g) in grads.iter().enumerate() {
        let bytes: Vec<u8> = (0..grad_len / 4)
            .flat_map(|i| grad_seed(rank, s, i).to_le_bytes())
            .collect();
        g.copy_from_host(0, &bytes).or_fail("seed the gradient");
    }
    let publish: Vec<MemoryDescriptor> = recv
        .iter()
        .chain(std::iter::once(&scratch))
        .map(|r| r.descriptor().or_fail("descriptor"))
        .collect();

    let mut child = None;
    let ep = if let Some(port) = args.listen {
        let l = engine.listen(&format!("0.0.0.0:{port}")).or_fail("listen");
        println!("rank 0 listening on port {port}");
        l.accept(&publish, DEADLINE).or_fail("accept rank 1")
    } else if let Some(peer) = &args.connect {
        engine
            .connect(&[peer.as_str()], &publish)
            .or_fail("connect")
    } else if rank == 0 {
        let dir = std::env::temp_dir().join(format!("gpudirect-step-{}", std::process::id()));
        std::fs::create_dir_all(&dir).or_fail("socket directory");
        let path = dir.join("rank0.sock");
        let l = engine.listen_local(&path).or_fail("listen_local");
        let mut cmd = std::process::Command::new(std::env::current_exe().or_fail("current_exe"));
        cmd.args(std::env::args_os().skip(1))
            .arg("--rank")
            .arg("1")
            .arg("--socket")
            .arg(&path);
        child = Some(cmd.spawn().or_fail("start rank 1"));
        let ep = l.accept(&publish, DEADLINE).or_fail("accept rank 1");
        let _ = std::fs::remove_dir_all(&dir);
        ep
    } else {
        let path = args
            .socket
            .clone()
            .unwrap_or_else(|| fail("rank 1", "no --socket"));
        engine
            .connect_local(&path, &publish)
            .or_fail("connect_local")
    };
    // Counts the peer's notifications from here: the barrier's, then one per pipelined step.
    let counter = ep
        .notification_counter(&ctx)
        .or_fail("notification counter");
    let peer = ep.peer_descriptors();
    if peer.len() != 3 {
        fail("peer", format!("published {} buffers, not 3", peer.len()));
    }
    let me = Rank {
        rank,
        ctx: ctx.clone(),
        ep,
        grads,
        recv,
        peer,
        grad_len,
    };

    // The batch file: random bytes, FILE_BATCHES batches.
    let dir = args
        .dir
        .clone()
        .unwrap_or_else(|| PathBuf::from("target/gpudirect-storage-test"));
    std::fs::create_dir_all(&dir).or_fail("test directory");
    let path = dir.join(format!(
        "training-step-{}-rank{rank}.bin",
        std::process::id()
    ));
    {
        let mut data = vec![0u8; batch_len];
        let mut f = std::fs::File::create(&path).or_fail("create the batch file");
        for _ in 0..FILE_BATCHES {
            rand::rng().fill_bytes(&mut data);
            std::io::Write::write_all(&mut f, &data).or_fail("write the batch file");
        }
    }
    let file = GdsFile::open(&path, &OpenOptions::default(), Mode::Auto).or_fail("open");
    let how = file.path_for_read(0, batch_len);
    let loader = Arc::new(Loader {
        file,
        batch: batch_len,
    });

    let load = Stream::new(&ctx).or_fail("stream");
    let comp = Stream::new(&ctx).or_fail("stream");
    let comm = Stream::new(&ctx).or_fail("stream");
    let steps = args.steps as usize;
    let mut batches: Vec<DeviceBuffer<u32>> = (0..2)
        .map(|_| DeviceBuffer::alloc(&ctx, batch_len / 4).or_fail("cuMemAlloc"))
        .collect();

    // Each stage alone. Load and exchange one rank at a time (rank 0 first, rank 1 waiting at
    // the barrier), so that neither shares the device with the other rank's work; compute on
    // both at once, as the pipelined run computes. Every barrier is one notification each way.
    let mut barriers = 0u64;
    let mut sync = |me: &Rank, tag: u32| {
        barrier(me, tag);
        barriers += 1;
    };
    let epoch = std::time::SystemTime::UNIX_EPOCH;
    let clock = || {
        std::time::SystemTime::now()
            .duration_since(epoch)
            .map_or(0.0, |d| {
                (d.as_secs() % 1000) as f64 + f64::from(d.subsec_nanos()) * 1e-9
            })
    };
    let together = args.alone_together;
    if !together {
        sync(&me, 1);
        if rank == 1 {
            sync(&me, 2);
        }
    }
    let w_load = clock();
    let t0 = Instant::now();
    for i in 0..steps {
        loader.read(i, &mut batches[i % 2]);
    }
    let t_load = t0.elapsed().as_secs_f64() * 1e3 / steps as f64;
    let w_comm = clock();
    let (t_comm, comm_path) = exchange_alone(&me, &comm, steps);
    let w_comm_end = clock();
    let slower = t_load.max(t_comm);
    let kernel_us = args
        .kernel_us
        .unwrap_or(((slower * 1.5 * 1000.0) as u64).clamp(100, 10_000_000));
    if !together {
        if rank == 0 {
            sync(&me, 2);
        }
        sync(&me, 3);
    }
    let w_comp = clock();
    // Compute alone: the whole stage of a step (the batch kernel, the gradient produced, the
    // peer's consumed) without its waits.
    let t_comp = {
        let (a, b) = (timing_event(&ctx), timing_event(&ctx));
        kernel.launch(&comp, 0, &batches[0]).or_fail("launch");
        a.record(comp.cuda()).or_fail("record");
        for i in 0..steps {
            compute(
                &me,
                &kernel,
                &comp,
                kernel_us * 1000,
                &batches[i % 2],
                Some((i, None, None)),
                None,
            );
        }
        b.record(comp.cuda()).or_fail("record");
        comp.synchronize().or_fail("synchronize");
        ms_between(&a, &b) / steps as f64
    };
    let w_comp_end = clock();
    // The alone run changed the gradients: seed them again, and wait for the peer to be done
    // with its alone runs (it writes into our scratch buffer only) before the pipelined run.
    for (s, g) in me.grads.iter().enumerate() {
        let bytes: Vec<u8> = (0..grad_len / 4)
            .flat_map(|i| grad_seed(rank, s, i).to_le_bytes())
            .collect();
        g.copy_from_host(0, &bytes).or_fail("seed the gradient");
    }
    sync(&me, 1_000_000);

    // Pipelined: the loader thread runs ahead by one batch.
    let (to_loader, loader_in) = mpsc::channel::<(usize, DeviceBuffer<u32>, Option<CudaEvent>)>();
    let (loaded_tx, loaded) = mpsc::channel::<(usize, DeviceBuffer<u32>)>();
    let lt = {
        let loader = loader.clone();
        let ctx = ctx.clone();
        std::thread::spawn(move || {
            ctx.bind_to_thread().or_fail("cuCtxSetCurrent");
            for (i, mut b, done) in loader_in {
                if let Some(e) = done {
                    e.synchronize().or_fail("cuEventSynchronize"); // compute is done with it
                }
                loader.read(i, &mut b);
                if loaded_tx.send((i, b)).is_err() {
                    break;
                }
            }
        })
    };
    for (i, b) in batches.drain(..).enumerate() {
        to_loader.send((i, b, None)).or_fail("loader");
    }
    // The peer sent one notification per barrier before the pipelined run, so its step i's
    // gradient is there once the counter reaches barriers + i + 1.
    let base = barriers;
    let (start, end) = (timing_event(&ctx), timing_event(&ctx));
    comp.synchronize().or_fail("synchronize");
    start.record(comp.cuda()).or_fail("record");
    let mut sends: Vec<Option<StreamTransfer>> = (0..steps).map(|_| None).collect();
    let mut loader_wait = Duration::ZERO;
    for i in 0..steps {
        let waited = Instant::now();
        let (j, batch) = loaded.recv().or_fail("loader");
        loader_wait += waited.elapsed();
        assert_eq!(i, j);
        // The load stream marks the batch loaded; compute waits for it.
        let ev = load.record_event().or_fail("record");
        comp.wait(&ev).or_fail("wait");
        let peer_grad = (i >= 1).then(|| base + i as u64);
        let before = if i >= 2 { sends[i - 2].take() } else { None };
        compute(
            &me,
            &kernel,
            &comp,
            kernel_us * 1000,
            &batch,
            Some((i, Some(&counter), peer_grad)),
            before.as_ref(),
        );
        let computed = comp.record_event().or_fail("record");
        comm.wait(&computed).or_fail("wait");
        let s = i % 2;
        let send = me
            .ep
            .write_on(
                &comm,
                vec![(
                    me.grads[s].all(),
                    me.peer[s].range(0, grad_len as u64).or_fail("range"),
                )],
                TransferOptions::notify(i as u32).deadline(DEADLINE),
            )
            .or_fail("write_on");
        sends[i] = Some(send);
        if i + 2 < steps {
            to_loader
                .send((i + 2, batch, Some(comp.record_event().or_fail("record"))))
                .or_fail("loader");
        }
    }
    // The step ends when the last gradient has left and the peer's last one has arrived.
    for s in sends.iter().flatten() {
        s.wait_on(&comp).or_fail("wait_on");
    }
    counter
        .wait_on(&comp, base + steps as u64)
        .or_fail("counter wait");
    end.record(comp.cuda()).or_fail("record");
    drop(to_loader);
    for s in [&load, &comp, &comm] {
        s.synchronize().or_fail("synchronize");
    }
    lt.join().ok();
    for s in sends.into_iter().flatten() {
        s.wait(DEADLINE).or_fail("send");
    }
    let step_ms = ms_between(&start, &end) / steps as f64;
    check_received(&me, steps);
    let _ = std::fs::remove_file(&path);

    let serial = t_load + t_comp + t_comm;
    let slowest = t_load.max(t_comp).max(t_comm);
    let gbs = |bytes: usize, ms: f64| bytes as f64 / (ms * 1e-3) / 1e9;
    let r = format!("rank {rank} (GPU {ordinal})");
    println!(
        "training_step {r}: {steps} steps, batch {} MiB, gradient {} MiB, kernel {kernel_us} us",
        args.batch_mib.mib, args.grad_mib.mib
    );
    println!(
        "  {r} load alone      {t_load:8.3} ms ({:.1} GB/s, {:?} path, {:?})",
        gbs(batch_len, t_load),
        how.path,
        how.reason
    );
    println!("  {r} compute alone   {t_comp:8.3} ms");
    println!(
        "  {r} exchange alone  {t_comm:8.3} ms ({:.1} GB/s, {})",
        gbs(grad_len, t_comm),
        comm_path
    );
    println!(
        "  {r} stage windows (s): load {w_load:.3}-{w_comm:.3}, exchange {w_comm:.3}-{w_comm_end:.3}, compute {w_comp:.3}-{w_comp_end:.3}{}",
        if together {
            " (--alone-together: both ranks at once)"
        } else {
            ""
        }
    );
    println!("  {r} serial sum      {serial:8.3} ms");
    println!(
        "  {r} step            {step_ms:8.3} ms = {:.3}x compute alone",
        step_ms / t_comp
    );
    println!(
        "  {r} overlap efficiency {:5.1}% (serial - step) / (serial - slowest stage)",
        100.0 * (serial - step_ms) / (serial - slowest).max(1e-9)
    );
    println!(
        "  {r} GPU computes {:5.1}% of the step; received gradients checked",
        100.0 * (t_comp / step_ms).min(1.0)
    );
    println!(
        "  {r} host waited for the loader {:.3} ms per step",
        loader_wait.as_secs_f64() * 1e3 / steps as f64
    );
    if gpus < 2 && !across {
        println!(
            "  {r}: one GPU: both ranks' kernels share it, so the step holds both compute stages"
        );
    }
    let mut code = 0;
    if args.check_overlap && step_ms > 1.1 * t_comp {
        eprintln!("  {r}: step over 1.1x compute alone");
        code = 1;
    }
    if let Some(mut c) = child {
        let st = c.wait().or_fail("wait for rank 1");
        if !st.success() {
            eprintln!("rank 1 failed: {st}");
            code = 1;
        }
    }
    drop(me);
    std::process::exit(code);
}

/// The compute stage of one step: the kernel on the batch, then (in the pipelined run) the
/// gradient produced and the peer's previous one consumed, each after its stream wait.
#[allow(clippy::too_many_arguments)]
fn compute(
    me: &Rank,
    kernel: &Kernel,
    comp: &Stream,
    ns: u64,
    batch: &DeviceBuffer<u32>,
    stage: Option<(usize, Option<&StreamWord>, Option<u64>)>,
    send_before: Option<&StreamTransfer>,
) {
    kernel.launch(comp, ns, batch).or_fail("launch");
    let Some((i, counter, peer_grad)) = stage else {
        return;
    };
    let s = i % 2;
    if let Some(prev) = send_before {
        prev.wait_on(comp).or_fail("wait_on"); // slot s has left before it changes
    }
    let n = (me.grad_len / 4) as u32;
    let g = me.grads[s].device_ptr().expect("GPU memory");
    // SAFETY: the gradient region lives as long as `me`; the stream waited for the send that
    // reads it; the example synchronizes every stream before `me` goes.
    unsafe { kernel.launch_raw(comp, 0, g, n) }.or_fail("launch");
    if i >= 1 {
        if let (Some(counter), Some(want)) = (counter, peer_grad) {
            counter.wait_on(comp, want).or_fail("counter wait");
        }
        let r = me.recv[(i - 1) % 2].device_ptr().expect("GPU memory");
        // SAFETY: as above; the peer wrote this slot before notifying step i - 1 and writes it
        // again only after our gradient of step i (sent after this kernel) reaches it.
        unsafe { kernel.launch_raw(comp, 0, r, n) }.or_fail("launch");
    }
}

/// The exchange alone: `steps` writes of the gradient into the peer's scratch buffer, each
/// waited for on the stream; milliseconds per write, and the path the engine reported.
fn exchange_alone(me: &Rank, comm: &Stream, steps: usize) -> (f64, String) {
    let dst = me.peer[2].range(0, me.grad_len as u64).or_fail("range");
    let one = || {
        me.ep
            .write_on(
                comm,
                vec![(me.grads[0].all(), dst)],
                TransferOptions::default().deadline(DEADLINE),
            )
            .or_fail("write_on")
    };
    let report = one().wait(DEADLINE).or_fail("warm-up write");
    let path = report
        .paths
        .first()
        .map(|p| p.to_string())
        .unwrap_or_default();
    let (a, b) = (timing_event(&me.ctx), timing_event(&me.ctx));
    a.record(comm.cuda()).or_fail("record");
    let mut all = Vec::with_capacity(steps);
    for _ in 0..steps {
        let t = one();
        t.wait_on(comm).or_fail("wait_on");
        all.push(t);
    }
    b.record(comm.cuda()).or_fail("record");
    comm.synchronize().or_fail("synchronize");
    for t in all {
        t.wait(DEADLINE).or_fail("write");
    }
    (ms_between(&a, &b) / steps as f64, path)
}

/// Both ranks get here before either goes on: each notifies the other with `tag` and waits for
/// the other's.
fn barrier(me: &Rank, tag: u32) {
    let dst = me.peer[2].range(0, 4).or_fail("range");
    me.ep
        .write(
            vec![(me.grads[0].range(0, 4).or_fail("range"), dst)],
            TransferOptions::notify(tag).deadline(DEADLINE),
        )
        .or_fail("barrier write")
        .wait()
        .or_fail("barrier write");
    match me.ep.next_notification(DEADLINE).or_fail("barrier") {
        Some(n) if n.tag == tag => {}
        other => fail("barrier", format!("expected tag {tag}, got {other:?}")),
    }
}

/// The peer's last two gradients, exactly: slot `s` last written at step `j` holds the seed plus
/// `j / 2 + 1` productions, plus one if this rank consumed it (every step but the last).
fn check_received(me: &Rank, steps: usize) {
    let peer = 1 - me.rank;
    let mut host = vec![0u8; me.grad_len];
    for j in [steps - 2, steps - 1] {
        let s = j % 2;
        let consumed = u32::from(j + 1 < steps);
        let add = (j / 2 + 1) as u32 + consumed;
        me.recv[s].copy_to_host(0, &mut host).or_fail("copy back");
        for (i, w) in host.chunks_exact(4).enumerate() {
            let got = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
            let want = grad_seed(peer, s, i).wrapping_add(add);
            if got != want {
                fail(
                    "check",
                    format!("received slot {s} (step {j}) word {i}: {got:#x}, expected {want:#x}"),
                );
            }
        }
    }
}
