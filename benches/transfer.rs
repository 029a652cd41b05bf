//! Transfer engine figures, each beside the raw baseline a user would compare with.
//!
//! ```text
//! cargo bench --bench transfer                            # registration, then a loopback write sweep
//! # the same through the transfer example, as the two-node VM run does:
//! transfer --bench --listen 7480 --device rxe_b0          # the peer (node b)
//! transfer --bench --connect 10.77.1.2:7480 --device rxe_a0 --size 65536 --bytes 16777216
//! transfer --bench --connect 10.77.1.2:7480 --device rxe_a0 --lat --iters 2000
//! transfer --bench --listen 7480 --device rxe_b0 --buffer 67108864
//! transfer --bench --connect 10.77.1.2:7480 --device rxe_a0 --size 4096 --batch 64 --threads 4 --seconds 3
//! transfer --bench --register --device rxe_a0 --device rxe_a1
//! transfer --bench --listen 7480 --device rxe_b0 --connect-bench 50 --key-file /tmp/k
//! transfer --bench --connect 10.77.1.2:7480 --device rxe_a0 --connect-bench 50 --key-file /tmp/k
//! ```
//!
//! - Write bandwidth (`TRANSFER-BENCH write_bw size=S MBps=X`, MB of 2^20 bytes as perftest
//!   prints them): requests of S-byte messages, up to 128 messages outstanding (perftest's
//!   `ib_write_bw` default depth), messages below 64 KiB batched 64 KiB to a request. The VM
//!   script runs it alternately with `ib_write_bw` between the two nodes.
//! - Batches (`--batch B`, `TRANSFER-BENCH write_batch ...`): as Mooncake's
//!   `transfer_engine_bench` measures, each of `--threads N` threads (one endpoint) writes one
//!   request of B S-byte blocks (thread t's block i at `(i * N + t) * S` on both sides), waits for
//!   it, and again, for `--seconds` (or `--bytes` in all); MB/s over the time until every thread
//!   stopped. The peer's target must hold `B * N * S` bytes (`--buffer` on the listening side).
//! - Latency (`TRANSFER-BENCH write_lat size=8 usec=X`): half the round trip of an 8-byte write
//!   with a notification answered by one (`ib_write_lat` reports the same half round trip),
//!   each side posting a request prepared once (`Endpoint::prepare`, as `ib_write_lat` builds
//!   its work request once); medians of the client's post (`post_usec`) and of its wait for the
//!   write once the answer came (`wait_usec`); the listening side prints the medians of its turn
//!   (the answer posted after the notification, `turn_usec`) and of its wait for the answer
//!   (`ack_usec`).
//! - The listening side counts the bytes of its target that hold the client's pattern when the
//!   run ends (`TRANSFER-BENCH target bytes_set=N`): the client's `span=` says how many it wrote.
//! - Registration (`TRANSFER-BENCH register ...`): 1,000 buffers registered one by one and in one
//!   call, separate allocations and views of one allocation.
//! - Connecting (`TRANSFER-BENCH connect key=yes|no usec=X`): the median time of
//!   `Engine::connect` over N endpoints made and dropped one after another (the peer accepts N),
//!   with the key of `--key-file` (or of the file `GPUDIRECT_TRANSFER_KEY_FILE` names) or
//!   without one.
//!
//! Without a verbs device it prints `SKIPPED: reason` and exits 0.

use gpudirect::transfer::{
    AuthKey, Buffer, Direction, Engine, EngineConfig, TransferListener, TransferOptions,
};
use gpudirect_testing::{Hardware, skip_example};
use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The system allocator, counting allocations (every thread's): the latency cell prints them
/// per round trip.
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(p, l, n) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.load(Ordering::Relaxed)
}

const TIMEOUT: Duration = Duration::from_secs(120);
const DONE: u32 = 0xD0_0E;
const LAT: u32 = 0x1A7;
const MAX: usize = 1 << 20;
/// What the client writes: the listening side counts these bytes at the end.
const FILL: u8 = 0x5a;

struct Args {
    listen: Option<u16>,
    connect: Option<String>,
    devices: Vec<String>,
    size: usize,
    bytes: u64,
    lat: bool,
    iters: u32,
    register: bool,
    spin_us: Option<u64>,
    batch: Option<usize>,
    threads: usize,
    seconds: f64,
    buffer: usize,
    key_file: Option<String>,
    connect_bench: Option<u32>,
}

fn parse(argv: &[String]) -> Args {
    let mut a = Args {
        listen: None,
        connect: None,
        devices: Vec::new(),
        size: 65536,
        bytes: 16 << 20,
        lat: false,
        iters: 2000,
        register: false,
        spin_us: None,
        batch: None,
        threads: 1,
        seconds: 0.0,
        buffer: MAX,
        key_file: None,
        connect_bench: None,
    };
    let mut it = argv.iter().cloned();
    let bad = |w: &str| -> ! {
        eprintln!("transfer_bench: bad or missing value for {w}");
        std::process::exit(2)
    };
    while let Some(w) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| bad(&w));
        match w.as_str() {
            "--listen" => a.listen = Some(val().parse().unwrap_or_else(|_| bad("--listen"))),
            "--connect" => a.connect = Some(val()),
            "--device" => a.devices.push(val()),
            "--size" => a.size = val().parse().unwrap_or_else(|_| bad("--size")),
            "--bytes" => a.bytes = val().parse().unwrap_or_else(|_| bad("--bytes")),
            "--iters" => a.iters = val().parse().unwrap_or_else(|_| bad("--iters")),
            "--spin-us" => a.spin_us = Some(val().parse().unwrap_or_else(|_| bad("--spin-us"))),
            "--batch" => a.batch = Some(val().parse().unwrap_or_else(|_| bad("--batch"))),
            "--threads" => a.threads = val().parse().unwrap_or_else(|_| bad("--threads")),
            "--seconds" => a.seconds = val().parse().unwrap_or_else(|_| bad("--seconds")),
            "--buffer" => a.buffer = val().parse().unwrap_or_else(|_| bad("--buffer")),
            "--lat" => a.lat = true,
            "--register" => a.register = true,
            "--key-file" => a.key_file = Some(val()),
            "--connect-bench" => {
                a.connect_bench = Some(val().parse().unwrap_or_else(|_| bad("--connect-bench")))
            }
            // cargo bench passes --bench; criterion-style filters are ignored.
            _ => {}
        }
    }
    if a.size == 0 || a.size > MAX {
        bad("--size (1 to 1048576)");
    }
    if a.batch == Some(0) || a.batch.is_some_and(|b| b > 4096) {
        bad("--batch (1 to 4096)");
    }
    if !(1..=64).contains(&a.threads) {
        bad("--threads (1 to 64)");
    }
    if !(a.seconds >= 0.0 && a.seconds <= 600.0) {
        bad("--seconds (0 to 600)");
    }
    if a.buffer < MAX || a.buffer > 1 << 30 {
        bad("--buffer (1048576 to 1073741824)");
    }
    a
}

fn engine(a: &Args) -> gpudirect::Result<Engine> {
    let mut c = EngineConfig::with_devices(&a.devices);
    if let Some(us) = a.spin_us {
        c.spin = Duration::from_micros(us);
    }
    c.key = match &a.key_file {
        Some(p) => Some(AuthKey::from_file(p)?),
        None => AuthKey::from_env("GPUDIRECT_TRANSFER_KEY_FILE")?,
    };
    Engine::new(c)
}

/// The peer of the connect bench: accepts `n` endpoints; each takes the peer's notification
/// and answers it before it is dropped (neither side goes while the other may still read the
/// last message of its handshake).
fn serve_connects(e: &Engine, l: &TransferListener, n: u32) -> gpudirect::Result<()> {
    let target = e.register(Buffer::host(vec![0u8; 4096])?)?;
    let mut went_first = 0;
    for _ in 0..n {
        let ep = l.accept(&[target.descriptor()?], TIMEOUT)?;
        ep.next_notification(TIMEOUT)?;
        let peer = ep.peer_descriptors()[0];
        let answer = ep.write(
            vec![(target.range(0, 8)?, peer.range(0, 8)?)],
            TransferOptions::notify(DONE),
        )?;
        // The peer goes once the answer arrived: its disconnect can overtake the answer's
        // acknowledgement here (docs/transfer.md), which then ends typed; the peer has it.
        match answer.wait() {
            Ok(_) => {}
            Err(gpudirect::Error::CmEvent { .. }) => went_first += 1,
            Err(err) => return Err(err),
        }
    }
    println!("TRANSFER-BENCH connect serve endpoints={n} peer_went_before_the_ack={went_first}");
    std::thread::sleep(Duration::from_millis(300));
    Ok(())
}

/// `n` endpoints connected to `peer` one after another (each then sends one notification and
/// is dropped): the median connect time.
fn connects(e: &Engine, peer: &str, n: u32) -> gpudirect::Result<()> {
    let src = e.register(Buffer::host(vec![0u8; 4096])?)?;
    let mut samples = Vec::with_capacity(n as usize);
    let until = Instant::now() + Duration::from_secs(60);
    while samples.len() < n as usize {
        let t0 = Instant::now();
        match e.connect(&[peer], &[src.descriptor()?]) {
            Ok(ep) => {
                samples.push(t0.elapsed());
                // Untimed: a notification each way, so neither side goes while the other may
                // still read the last message of its handshake.
                let dst = ep.peer_descriptors()[0];
                ep.write(
                    vec![(src.range(0, 8)?, dst.range(0, 8)?)],
                    TransferOptions::notify(DONE),
                )?
                .wait()?;
                ep.next_notification(TIMEOUT)?;
            }
            // The first: the peer may not listen yet.
            Err(gpudirect::Error::CmEvent { .. })
                if samples.is_empty() && Instant::now() < until =>
            {
                std::thread::sleep(Duration::from_millis(300));
            }
            Err(err) => return Err(err),
        }
    }
    samples.sort();
    let key = if e.config().key.is_some() {
        "yes"
    } else {
        "no"
    };
    println!(
        "TRANSFER-BENCH connect key={key} usec={:.1} min_usec={:.1} max_usec={:.1} iters={n}",
        samples[samples.len() / 2].as_secs_f64() * 1e6,
        samples[0].as_secs_f64() * 1e6,
        samples[samples.len() - 1].as_secs_f64() * 1e6,
    );
    Ok(())
}

/// The peer: a target buffer of `buffer` bytes; answers latency pings, acknowledges the end
/// of a run after counting the target's bytes that hold the client's pattern.
fn serve(e: &Engine, l: &TransferListener, buffer: usize) -> gpudirect::Result<()> {
    let target = e.register(Buffer::host(vec![0u8; buffer])?)?;
    let ep = l.accept(&[target.descriptor()?], TIMEOUT)?;
    let peer = ep.peer_descriptors()[0];
    // Answers carry the client's pattern: its source keeps it for the next write.
    let one = e.register(Buffer::host(vec![FILL; 8])?)?;
    // Both answers checked once, posted at each ping.
    let answer = |tag| {
        ep.prepare(
            Direction::Write,
            vec![(one.range(0, 8)?, peer.range(0, 8)?)],
            TransferOptions::notify(tag),
        )
    };
    let (lat, done) = (answer(LAT)?, answer(DONE)?);
    // Per latency ping: from its notification to the answer posted, and the answer's wait.
    let (mut turn, mut ack) = (Vec::new(), Vec::new());
    // Allocations (all threads) from the first ping's notification seen to the end's.
    let mut first = None;
    loop {
        let Some(n) = ep.next_notification(TIMEOUT)? else {
            return Ok(());
        };
        let seen = Instant::now();
        let back = if n.tag == LAT { LAT } else { DONE };
        if n.tag == LAT && first.is_none() {
            first = Some(allocs());
        }
        if n.tag == DONE {
            if !turn.is_empty() {
                let spent = allocs() - first.unwrap_or(0);
                println!(
                    "TRANSFER-BENCH serve pings={} turn_usec={:.2} ack_usec={:.2} allocs_per_ping={:.2}",
                    turn.len(),
                    median_us(&mut turn),
                    median_us(&mut ack),
                    spent as f64 / turn.len() as f64
                );
            }
            let mut set = 0usize;
            let mut chunk = vec![0u8; MAX];
            for at in (0..buffer).step_by(MAX) {
                let k = MAX.min(buffer - at);
                target.copy_to_host(at, &mut chunk[..k])?;
                set += chunk[..k].iter().filter(|&&b| b == FILL).count();
            }
            println!("TRANSFER-BENCH target bytes_set={set}");
        }
        let t = if back == LAT { &lat } else { &done }.post()?;
        let posted = Instant::now();
        t.wait()?;
        if n.tag == LAT {
            turn.push(posted - seen);
            ack.push(posted.elapsed());
        }
        if n.tag == DONE {
            // Let the peer's NIC acknowledge, then go.
            std::thread::sleep(Duration::from_millis(300));
            return Ok(());
        }
    }
}

fn client(e: &Engine, peer: &str, a: &Args) -> gpudirect::Result<()> {
    let need = a.batch.map_or(MAX, |b| (b * a.threads * a.size).max(MAX));
    let src = e.register(Buffer::host(vec![FILL; need])?)?;
    let ep = e.connect(&[peer], &[src.descriptor()?])?;
    let dst = ep.peer_descriptors()[0];
    if dst.len() < need as u64 {
        return Err(gpudirect::Error::InvalidArgument {
            arg: "--buffer",
            value: dst.len().to_string(),
            rule: format!("the peer's target must hold {need} bytes (--buffer on its side)"),
        });
    }
    if let Some(b) = a.batch {
        batches(&ep, &src, &dst, a, b)?;
    } else if a.lat {
        let mut samples = Vec::with_capacity(a.iters as usize);
        let n = a.iters as usize;
        let (mut post, mut done) = (Vec::with_capacity(n), Vec::with_capacity(n));
        // Checked once, posted at each round trip (as a caller after latency would).
        let ping = ep.prepare(
            Direction::Write,
            vec![(src.range(0, 8)?, dst.range(0, 8)?)],
            TransferOptions::notify(LAT),
        )?;
        let before = allocs();
        for _ in 0..a.iters {
            let t0 = Instant::now();
            let t = ping.post()?;
            post.push(t0.elapsed());
            let n = ep.next_notification(TIMEOUT)?;
            let t1 = Instant::now();
            samples.push(t1 - t0);
            t.wait()?;
            done.push(t1.elapsed());
            if n.map(|n| n.tag) != Some(LAT) {
                return Err(gpudirect::Error::Timeout {
                    what: "the latency answer",
                    after: TIMEOUT,
                });
            }
        }
        let spent = allocs() - before;
        let avg = samples.iter().sum::<Duration>() / samples.len() as u32;
        samples.sort();
        println!(
            "TRANSFER-BENCH write_lat size=8 usec={:.2} median_usec={:.2} iters={} span=8 post_usec={:.2} wait_usec={:.2} allocs_per_rt={:.2}",
            avg.as_secs_f64() * 1e6 / 2.0,
            samples[samples.len() / 2].as_secs_f64() * 1e6 / 2.0,
            a.iters,
            median_us(&mut post),
            median_us(&mut done),
            spent as f64 / a.iters as f64
        );
    } else {
        let size = a.size as u64;
        let per_req = (65536 / size).max(1);
        let msgs = (a.bytes / size).max(20);
        let reqs = msgs.div_ceil(per_req);
        let depth = (128 / per_req).max(1) as usize;
        let slots = MAX as u64 / size;
        let mut q = VecDeque::new();
        let t0 = Instant::now();
        let mut sent = 0u64;
        for r in 0..reqs {
            if q.len() == depth {
                let t: gpudirect::transfer::Transfer = q.pop_front().expect("full");
                t.wait()?;
            }
            let n = per_req.min(msgs - r * per_req);
            let pairs = (0..n)
                .map(|k| {
                    let at = ((r * per_req + k) % slots) * size;
                    Ok((src.range(at, size)?, dst.range(at, size)?))
                })
                .collect::<gpudirect::Result<Vec<_>>>()?;
            q.push_back(ep.write(pairs, TransferOptions::default())?);
            sent += n * size;
        }
        while let Some(t) = q.pop_front() {
            t.wait()?;
        }
        let dt = t0.elapsed();
        println!(
            "TRANSFER-BENCH write_bw size={} MBps={:.2} bytes={} requests={} seconds={:.3} span={}",
            size,
            sent as f64 / dt.as_secs_f64() / (1 << 20) as f64,
            sent,
            reqs,
            dt.as_secs_f64(),
            (msgs.min(slots) * size).max(8)
        );
    }
    ep.write(
        vec![(src.range(0, 8)?, dst.range(0, 8)?)],
        TransferOptions::notify(DONE),
    )?
    .wait()?;
    let _ = ep.next_notification(TIMEOUT)?;
    // Linger so our NIC acknowledges the peer's answer before we go.
    std::thread::sleep(Duration::from_millis(300));
    Ok(())
}

/// The median of `v` in microseconds.
fn median_us(v: &mut [Duration]) -> f64 {
    v.sort();
    v.get(v.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1e6)
}

/// Mooncake's bench loop: `a.threads` threads on `ep`, each writing one request of `batch`
/// blocks and waiting for it, until `a.seconds` passed (or `a.bytes` were written in all).
fn batches(
    ep: &gpudirect::transfer::Endpoint,
    src: &gpudirect::transfer::Region,
    dst: &gpudirect::transfer::MemoryDescriptor,
    a: &Args,
    batch: usize,
) -> gpudirect::Result<()> {
    let (size, threads) = (a.size as u64, a.threads as u64);
    let per_thread = (a.bytes / (size * batch as u64 * threads)).max(1);
    let t0 = Instant::now();
    let until = t0 + Duration::from_secs_f64(a.seconds);
    let counts = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || -> gpudirect::Result<u64> {
                    let mut done = 0u64;
                    loop {
                        // At least one request each: every block is written.
                        let over = if a.seconds > 0.0 {
                            done > 0 && Instant::now() >= until
                        } else {
                            done >= per_thread
                        };
                        if over {
                            return Ok(done);
                        }
                        let pairs = (0..batch as u64)
                            .map(|i| {
                                let at = (i * threads + t) * size;
                                Ok((src.range(at, size)?, dst.range(at, size)?))
                            })
                            .collect::<gpudirect::Result<Vec<_>>>()?;
                        ep.write(pairs, TransferOptions::default())?.wait()?;
                        done += 1;
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("a bench thread"))
            .collect::<gpudirect::Result<Vec<u64>>>()
    })?;
    let dt = t0.elapsed();
    let reqs: u64 = counts.iter().sum();
    let sent = reqs * batch as u64 * size;
    println!(
        "TRANSFER-BENCH write_batch size={} batch={} threads={} MBps={:.2} bytes={} requests={} seconds={:.3} span={}",
        size,
        batch,
        threads,
        sent as f64 / dt.as_secs_f64() / (1 << 20) as f64,
        sent,
        reqs,
        dt.as_secs_f64(),
        (batch as u64 * threads * size).max(8)
    );
    Ok(())
}

/// 1,000 buffers registered one by one and in one call: separate allocations, then views of one
/// allocation (which one call coalesces into one registration).
fn register(e: &Engine) -> gpudirect::Result<()> {
    const N: usize = 1000;
    const SZ: usize = 4096;
    let fresh = || -> gpudirect::Result<Vec<Buffer>> {
        (0..N).map(|_| Buffer::host(vec![0u8; SZ])).collect()
    };
    let views = || -> gpudirect::Result<Vec<Buffer>> {
        let big = Buffer::host(vec![0u8; N * SZ])?;
        (0..N).map(|i| big.slice(i * SZ, SZ)).collect()
    };
    for (what, make) in [("separate", &fresh as &dyn Fn() -> _), ("views", &views)] {
        let bufs = make()?;
        let before = e.cache_stats();
        let t0 = Instant::now();
        let one: Vec<_> = bufs
            .into_iter()
            .map(|b| e.register(b))
            .collect::<gpudirect::Result<_>>()?;
        let t_one = t0.elapsed();
        let mid = e.cache_stats();
        drop(one);
        let bufs = make()?;
        let t0 = Instant::now();
        let all = e.register_all(bufs)?;
        let t_all = t0.elapsed();
        let after = e.cache_stats();
        drop(all);
        println!(
            "TRANSFER-BENCH register buffers={N} bytes={SZ} kind={what} rails={} one_by_one_ms={:.2} batched_ms={:.2} speedup={:.2} registrations_one_by_one={} registrations_batched={}",
            e.devices().len(),
            t_one.as_secs_f64() * 1e3,
            t_all.as_secs_f64() * 1e3,
            t_one.as_secs_f64() / t_all.as_secs_f64().max(1e-9),
            mid.registrations - before.registrations,
            after.registrations - mid.registrations,
        );
    }
    Ok(())
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(run(&argv));
}

/// The bench with these arguments; the exit status.
pub fn run(argv: &[String]) -> i32 {
    let a = parse(argv);
    if let Err(e) = gpudirect::rdma::DeviceList::non_empty() {
        skip_example(Hardware::Rdma, e);
    }
    let r = (|| -> gpudirect::Result<()> {
        let e = engine(&a)?;
        if let Some(p) = a.listen {
            let l = e.listen(&format!("0.0.0.0:{p}"))?;
            if let Some(n) = a.connect_bench {
                return serve_connects(&e, &l, n);
            }
            return serve(&e, &l, a.buffer);
        }
        if let (Some(peer), Some(n)) = (&a.connect, a.connect_bench) {
            return connects(&e, peer, n);
        }
        if let Some(peer) = &a.connect {
            let until = Instant::now() + Duration::from_secs(60);
            loop {
                match client(&e, peer, &a) {
                    Err(gpudirect::Error::CmEvent { .. }) if Instant::now() < until => {
                        std::thread::sleep(Duration::from_millis(300));
                    }
                    r => return r,
                }
            }
        }
        register(&e)?;
        if a.register {
            return Ok(());
        }
        // cargo bench: a loopback sweep over the first device with an IPv4 GID.
        let list = gpudirect::rdma::DeviceList::non_empty()?;
        let ip = e.devices().iter().find_map(|n| {
            let ctx = gpudirect::rdma::Context::open(&list.find(n).ok()?).ok()?;
            ctx.gid_table(1)
                .ok()?
                .into_iter()
                .find(|g| g.gid.is_ipv4_mapped())
                .and_then(|g| g.gid.to_ipv6().to_ipv4_mapped())
        });
        let Some(ip) = ip else {
            println!("SKIPPED: no IPv4 address on a verbs device for the loopback sweep");
            return Ok(());
        };
        for size in [4096usize, 65536, 1 << 20] {
            let l = e.listen(&format!("{ip}:0"))?;
            let peer = format!("{ip}:{}", l.port());
            let e2 = e.clone();
            let srv = std::thread::spawn(move || serve(&e2, &l, MAX));
            let mut b = parse(argv);
            b.size = size;
            b.bytes = 8 << 20;
            client(&e, &peer, &b)?;
            srv.join().expect("server thread")?;
        }
        Ok(())
    })();
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("transfer_bench: error: {e}");
            1
        }
    }
}
