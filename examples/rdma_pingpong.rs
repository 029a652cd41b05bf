//! RDMA ping-pong over rdma_cm: send/recv, RDMA write (with immediate) and RDMA read with every
//! byte verified, then bandwidth and latency.
//!
//! ```text
//! cargo run --release --example rdma_pingpong                          # server + client in one process
//! cargo run --release --example rdma_pingpong -- --server              # on one node, port 7471
//! cargo run --release --example rdma_pingpong -- --connect node1       # on the other (name or address)
//! cargo run --release --example rdma_pingpong -- --report              # bench report (loopback), 8 B..1 MiB
//! cargo run --release --example rdma_pingpong -- --only 65536          # the report for one size
//! cargo run --release --example rdma_pingpong -- --async               # awaited on tokio (loopback)
//! ```
//!
//! `--async` runs the same verified transfers awaited on a tokio runtime (`AsyncCq`,
//! `AsyncQueuePair`: futures of work completions woken through the completion channel, received
//! messages and immediates as streams), between two queue pairs of this process connected
//! directly (no rdma_cm), then the median 8-byte send/receive round trip awaited.
//!
//! Without a verbs device it prints `SKIPPED: reason` and exits 0 (1 when `GPUDIRECT_REQUIRE`
//! names `rdma`); 2 on a bad or contradictory option. `--help` lists the options and their units.

#[path = "support/cli.rs"]
mod cli;

use clap::{ArgGroup, Parser};
use gpudirect::rdma::*;
use gpudirect::rdma::{ConnectOptions, Connection, Listener};
use gpudirect_testing::{Hardware, skip_example};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

const MAX_MSG: usize = 1 << 20;
const DEPTH: u32 = 128;
const SIGNAL_EVERY: u32 = 32;
const INLINE: u32 = 128;
const TIMEOUT: Duration = Duration::from_secs(20);

// Control messages (client -> server), 24 bytes: op, size, iters/seed.
const OP_VERIFY: u64 = 1;
const OP_LAT: u64 = 2;
const OP_QUIT: u64 = 3;

/// RDMA ping-pong over rdma_cm: send/recv, RDMA write with immediate and RDMA read, every byte
/// verified, then bandwidth (MB/s of 2^20 bytes, as perftest) and one-way latency (microseconds).
/// With neither --server nor --connect, server and client run in one process (loopback).
#[derive(Parser)]
#[command(group(ArgGroup::new("role").args(["server", "connect"])))]
#[command(group(ArgGroup::new("report_mode").args(["report", "only"])))]
struct Args {
    /// Serve one client: everything else is the client's choice.
    #[arg(long, conflicts_with_all = ["addr", "report", "only", "size", "iters", "bytes"])]
    server: bool,
    /// Connect to a server: a host name or an IPv4/IPv6 address.
    #[arg(long, value_name = "HOST", value_parser = cli::host, conflicts_with = "addr")]
    connect: Option<cli::Host>,
    /// The server's TCP port for rdma_cm (with --server or --connect; loopback picks a free one).
    #[arg(long, default_value_t = 7471, requires = "role")]
    port: u16,
    /// Message size in bytes for the verified transfers and the bandwidth run, 1 to 1048576.
    #[arg(long, value_name = "BYTES", default_value_t = 65536,
          value_parser = clap::value_parser!(u32).range(1..=MAX_MSG as i64))]
    size: u32,
    /// Iterations of the bandwidth and latency runs (the report derives its own from --bytes).
    #[arg(long, default_value_t = 2000, conflicts_with = "report_mode",
          value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    iters: u32,
    /// The bench report: bandwidth of RDMA write and read for 8 B to 1 MiB, latency for 8 B to 4 KiB.
    #[arg(long)]
    report: bool,
    /// The report for one message size in bytes, 1 to 1048576 (instead of --report's sweep).
    #[arg(long, value_name = "BYTES",
          value_parser = clap::value_parser!(u32).range(1..=MAX_MSG as i64))]
    only: Option<u32>,
    /// Bytes moved per report run (iterations = BYTES / size, clamped to 20..=5000).
    #[arg(long, value_name = "BYTES", default_value_t = 8 << 20, requires = "report_mode",
          value_parser = clap::value_parser!(u64).range(1..))]
    bytes: u64,
    /// Loopback address: a host name or an address of a net device under the RDMA device
    /// [default: an IPv4 address of the RDMA device's net device]
    #[arg(long, value_name = "HOST", value_parser = cli::host)]
    addr: Option<cli::Host>,
    /// Await every completion on a tokio runtime instead of polling (loopback in this process,
    /// queue pairs connected directly): verified send/recv, write with immediate and read of
    /// --size bytes, --iters times (at most 1000), then the 8-byte round trip.
    #[arg(long = "async", conflicts_with_all = ["role", "report_mode", "addr"])]
    awaited: bool,
}

impl Args {
    fn report(&self) -> bool {
        self.report || self.only.is_some()
    }
}

fn opts() -> ConnectOptions {
    ConnectOptions {
        caps: QpCaps {
            max_send_wr: DEPTH,
            max_recv_wr: 64,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: INLINE,
            signal_every: SIGNAL_EVERY,
        },
        timeout: TIMEOUT,
        recv_channel: true,
        ..Default::default()
    }
}

/// The tools' xorshift: both sides generate the same bytes from a seed.
fn pattern(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// An endpoint: connection, one remote-writable data region, a control region, the peer's data
/// region.
struct Side {
    c: Connection,
    /// Receive completions polled but not yet consumed: (result, slot, imm).
    rx: std::collections::VecDeque<(gpudirect::Result<()>, u64, Option<u32>)>,
    data: MemoryRegion<Remote>,
    ctl: MemoryRegion<Local>,
    peer: RemoteMemory,
}

fn setup(c: Connection) -> gpudirect::Result<Side> {
    let mut c = c;
    let data = c.pd().register_remote(
        HostBuffer::zeroed(MAX_MSG)?,
        AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
    )?;
    let ctl = c
        .pd()
        .register(HostBuffer::zeroed(64 * 32)?, AccessFlags::LOCAL_WRITE)?;
    let peer = c.exchange(data.remote(), TIMEOUT)?;
    let mut s = Side {
        c,
        rx: Default::default(),
        data,
        ctl,
        peer,
    };
    for i in 0..16 {
        s.post_ctl_recv(i)?;
    }
    Ok(s)
}

impl Side {
    fn post_ctl_recv(&mut self, i: usize) -> gpudirect::Result<()> {
        let sl = self.ctl.slice(64 + i * 64..64 + (i + 1) * 64)?;
        self.c
            .qp()
            .post_recv([RecvRequest::new(sl).tag(i as u64)])?;
        Ok(())
    }

    fn send_ctl(&mut self, msg: [u64; 3]) -> gpudirect::Result<()> {
        let mut b = [0u8; 24];
        for (i, v) in msg.iter().enumerate() {
            b[i * 8..(i + 1) * 8].copy_from_slice(&v.to_le_bytes());
        }
        self.c
            .qp()
            .post_send([SendRequest::send_inline(&b).tag(u64::MAX)])?;
        self.wait_send(u64::MAX)
    }

    /// Wait for the signaled send completion tagged `tag` (errors of others propagate).
    fn wait_send(&mut self, tag: u64) -> gpudirect::Result<()> {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            for w in self.c.send_cq().poll()? {
                w.result()?;
                if w.tag() == tag {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                return Err(gpudirect::Error::Timeout {
                    what: "send completion",
                    after: TIMEOUT,
                });
            }
        }
    }

    /// The next control message or write-with-immediate: (msg, imm).
    fn recv_ctl(&mut self) -> gpudirect::Result<([u64; 3], Option<u32>)> {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let polled: Vec<_> = self
                .c
                .recv_cq()
                .poll()?
                .map(|w| (w.result(), w.tag(), w.imm()))
                .collect();
            self.rx.extend(polled);
            if let Some((r, slot, imm)) = self.rx.pop_front() {
                r?;
                let mut b = [0u8; 24];
                self.ctl.read_at(64 + slot as usize * 64, &mut b)?;
                self.post_ctl_recv(slot as usize)?;
                let m = |i: usize| u64::from_le_bytes(b[i * 8..(i + 1) * 8].try_into().unwrap());
                return Ok(([m(0), m(1), m(2)], imm));
            }
            // Idle: block on the completion channel rather than spin (a spinning peer takes CPU
            // from the NIC, which for Soft-RoCE is the kernel).
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(gpudirect::Error::Timeout {
                    what: "control message",
                    after: TIMEOUT,
                });
            }
            self.c.wait_recv(left.min(Duration::from_millis(100)))?;
        }
    }

    /// `iters` RDMA writes (or reads) of `size` bytes, `DEPTH` in flight, mostly unsignaled.
    /// Returns MB/s with perftest's MB: 2^20 bytes.
    fn bandwidth(&mut self, read: bool, size: usize, iters: usize) -> gpudirect::Result<f64> {
        let remote = self.peer.slice(0, size as u32)?;
        let local = self.data.slice(..size)?;
        let inline = !read && size <= INLINE as usize;
        let payload = if inline {
            pattern(size as u64, size)
        } else {
            Vec::new()
        };
        let (mut posted, mut done) = (0usize, 0usize);
        let t0 = Instant::now();
        while done < iters {
            let room = (DEPTH as usize)
                .saturating_sub(self.c.qp().send_outstanding())
                .min(iters - posted)
                .min(16);
            if room > 0 {
                let chain = (posted..posted + room).map(|i| {
                    let w = if read {
                        SendRequest::read(local.clone(), remote)
                    } else if inline {
                        SendRequest::write_inline(&payload, remote)
                    } else {
                        SendRequest::write(local.clone(), remote)
                    };
                    let w = w.tag(i as u64);
                    if i + 1 == iters { w } else { w.unsignaled() }
                });
                posted += self.c.qp().post_send(chain)?;
            }
            for w in self.c.send_cq().poll()? {
                w.result()?;
                done = done.max(w.tag() as usize + 1);
            }
        }
        Ok((size * iters) as f64 / t0.elapsed().as_secs_f64() / 1048576.0)
    }

    /// Write ping-pong: each side writes `size` bytes whose last 8 hold the iteration number and
    /// spins on its own region for the peer's. Returns the average one-way latency in µs.
    /// Flag values are `base + i`, so stale bytes from earlier runs never match.
    fn latency(
        &mut self,
        size: usize,
        iters: u64,
        base: u64,
        initiator: bool,
    ) -> gpudirect::Result<f64> {
        let size = size.max(8);
        let off = size - 8;
        let remote = self.peer.slice(0, size as u32)?;
        let mut buf = vec![0u8; size];
        let t0 = Instant::now();
        let wait_for = |data: &MemoryRegion<Remote>, n: u64| -> gpudirect::Result<()> {
            let deadline = Instant::now() + TIMEOUT;
            let mut spins = 0u32;
            while data.read_u64(off)? != n {
                spins = spins.wrapping_add(1);
                // Both loopback threads spin: if the scheduler put them on one CPU, give way now
                // and then (the peer, or Soft-RoCE's kernel work, needs it to answer). Measured
                // under TCG against perftest in one boot: never yielding gave 0.45x its 8-byte
                // latency; yielding on every look 0.87x on a quiet host, but far less on a loaded
                // one (ci/rxe-vm/README.md).
                if spins.is_multiple_of(1024) {
                    std::thread::yield_now();
                }
                if spins.is_multiple_of(65536) && Instant::now() > deadline {
                    return Err(gpudirect::Error::Timeout {
                        what: "latency ping",
                        after: TIMEOUT,
                    });
                }
            }
            Ok(())
        };
        for i in 1..=iters {
            if !initiator {
                wait_for(&self.data, base + i)?;
            }
            buf[off..].copy_from_slice(&(base + i).to_ne_bytes());
            let w = if size <= INLINE as usize {
                SendRequest::write_inline(&buf, remote)
            } else {
                self.data.write_at(size, &buf)?; // staged copy in our own region, past the flag
                SendRequest::write(self.data.slice(size..2 * size)?, remote)
            };
            let w = w.tag(i);
            let signaled = i % SIGNAL_EVERY as u64 == 0 || i == iters;
            self.c
                .qp()
                .post_send([if signaled { w } else { w.unsignaled() }])?;
            if signaled {
                for w in self.c.send_cq().poll()? {
                    w.result()?;
                }
            }
            if initiator {
                wait_for(&self.data, base + i)?;
            }
        }
        while self.c.qp().send_outstanding() > 0 {
            for w in self.c.send_cq().poll()? {
                w.result()?;
            }
        }
        Ok(t0.elapsed().as_secs_f64() * 1e6 / iters as f64 / 2.0)
    }
}

fn serve(listener: Listener) -> gpudirect::Result<()> {
    let mut s = setup(listener.accept(&opts())?)?;
    // Send/recv: echo the first message back.
    let (m, _) = s.recv_ctl()?;
    s.send_ctl(m)?;
    loop {
        let (m, imm) = s.recv_ctl()?;
        if let Some(seed) = imm {
            // RDMA write with immediate: the immediate is the seed; the next message the size.
            let (m, _) = s.recv_ctl()?;
            let want = pattern(seed as u64, m[1] as usize);
            let mut got = vec![0u8; want.len()];
            s.data.read_at(0, &mut got)?;
            let ok = got == want;
            println!(
                "server: RDMA write of {} bytes {}",
                want.len(),
                if ok { "verified" } else { "CORRUPT" }
            );
            s.send_ctl([OP_VERIFY, ok as u64, 0])?;
            continue;
        }
        match m[0] {
            OP_LAT => {
                s.latency(
                    m[1] as usize,
                    m[2] & 0xffff_ffff,
                    m[2] & !0xffff_ffff,
                    false,
                )?;
            }
            OP_QUIT => return Ok(()),
            o => eprintln!("server: unknown op {o}"),
        }
    }
}

fn client(addr: SocketAddr, args: &Args) -> gpudirect::Result<bool> {
    let mut s = setup(Connection::connect(addr, &opts())?)?;
    let mut ok = true;
    // 1. send/recv round trip with random bytes.
    let seed = rand::random::<u64>();
    s.send_ctl([0xfeed, seed, seed.rotate_left(17)])?;
    let (echo, _) = s.recv_ctl()?;
    let good = echo == [0xfeed, seed, seed.rotate_left(17)];
    ok &= good;
    println!(
        "send/recv: 24-byte message echoed {}",
        if good { "exactly" } else { "WRONG" }
    );
    // 2. RDMA write with immediate (seed), verified by the server from the seed.
    let size = args.size as usize;
    let seed = rand::random::<u32>();
    let data = pattern(seed as u64, size);
    s.data.write_at(0, &data)?;
    s.c.qp().post_send([SendRequest::write(
        s.data.slice(..size)?,
        s.peer.slice(0, size as u32)?,
    )
    .with_imm(seed)
    .tag(1)])?;
    s.wait_send(1)?;
    // The server's verdict arrives as a control message; the write-with-imm also needs a receive
    // at the server, which the control receives provide.
    s.send_ctl([0, size as u64, 0])?; // carries the size for the verification
    let (v, _) = s.recv_ctl()?;
    ok &= v == [OP_VERIFY, 1, 0];
    println!(
        "RDMA write: {size} bytes {}",
        if v[1] == 1 {
            "verified by the peer"
        } else {
            "CORRUPT at the peer"
        }
    );
    // 3. RDMA read them back into a poisoned local buffer.
    s.data.fill(0, size, 0xA5)?;
    s.c.qp().post_send([SendRequest::read(
        s.data.slice(..size)?,
        s.peer.slice(0, size as u32)?,
    )
    .tag(2)])?;
    s.wait_send(2)?;
    let mut back = vec![0u8; size];
    s.data.read_at(0, &mut back)?;
    let good = back == data;
    ok &= good;
    println!(
        "RDMA read: {size} bytes {}",
        if good { "verified" } else { "WRONG" }
    );
    // 4. Performance.
    let sizes: Vec<usize> = if let Some(o) = args.only {
        vec![o as usize]
    } else if args.report() {
        (3..=20).step_by(1).map(|p| 1usize << p).collect()
    } else {
        vec![size]
    };
    for &sz in &sizes {
        // The same counts as perftest gets in ci/rxe-vm/scripts/test.sh: `--bytes` per run
        // (default 8 MiB), 20..5000 iterations.
        // sz >= 1: --only is refused at 0, the sweep starts at 8.
        let iters = if args.report() {
            (args.bytes / sz as u64).clamp(20, 5000) as usize
        } else {
            (args.iters as usize).clamp(20, 5000)
        };
        let w = s.bandwidth(false, sz, iters)?;
        let r = s.bandwidth(true, sz, iters)?;
        if args.report() {
            println!("REPORT write_bw size={sz} iters={iters} MBps={w:.2}");
            println!("REPORT read_bw size={sz} iters={iters} MBps={r:.2}");
        } else {
            println!("bandwidth: {sz} B x {iters}: RDMA write {w:.1} MB/s, RDMA read {r:.1} MB/s");
        }
    }
    let lat_sizes: Vec<usize> = if let Some(o) = args.only {
        // Latency is measured up to 4 KiB (a ping-pong stages its message in the region).
        if o <= 4096 {
            vec![(o as usize).max(8)]
        } else {
            vec![]
        }
    } else if args.report() {
        vec![8, 64, 1024, 4096]
    } else {
        vec![8]
    };
    for &sz in &lat_sizes {
        let iters = if args.report() {
            2000
        } else {
            args.iters.min(2000) as usize
        };
        let base = (rand::random::<u32>() as u64 | 1) << 32;
        s.send_ctl([OP_LAT, sz as u64, iters as u64 | base])?;
        let l = s.latency(sz, iters as u64, base, true)?;
        if args.report() {
            println!("REPORT write_lat size={sz} iters={iters} usec={l:.2}");
        } else {
            println!("latency: RDMA write ping-pong {sz} B: {l:.2} us one-way");
        }
    }
    s.send_ctl([OP_QUIT, 0, 0])?;
    Ok(ok)
}

/// An IPv4 address of a net device under a verbs device (RoCE/rxe), from sysfs and getifaddrs.
fn rdma_ipv4() -> Option<Ipv4Addr> {
    let mut ndevs = Vec::new();
    for dev in std::fs::read_dir("/sys/class/infiniband").ok()?.flatten() {
        let p = dev.path().join("ports/1/gid_attrs/ndevs");
        for f in std::fs::read_dir(p).into_iter().flatten().flatten() {
            if let Ok(n) = std::fs::read_to_string(f.path()) {
                ndevs.push(n.trim().to_string());
            }
        }
    }
    let mut ifa = std::ptr::null_mut();
    // SAFETY: one out-pointer; freed below.
    if unsafe { libc::getifaddrs(&mut ifa) } != 0 {
        return None;
    }
    let mut found = None;
    let mut p = ifa;
    while !p.is_null() {
        // SAFETY: a node of the list getifaddrs returned.
        let i = unsafe { &*p };
        if !i.ifa_addr.is_null() && unsafe { (*i.ifa_addr).sa_family } as i32 == libc::AF_INET {
            // SAFETY: a NUL-terminated name; an AF_INET address is a sockaddr_in.
            let name = unsafe { std::ffi::CStr::from_ptr(i.ifa_name) }.to_string_lossy();
            let sin = unsafe { &*(i.ifa_addr as *const libc::sockaddr_in) };
            if ndevs.iter().any(|n| *n == name) && found.is_none() {
                found = Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
            }
        }
        p = i.ifa_next;
    }
    // SAFETY: the list from getifaddrs, freed once.
    unsafe { libc::freeifaddrs(ifa) };
    found
}

fn main() {
    let args = Args::parse();
    match DeviceList::non_empty() {
        Ok(_) => {}
        Err(e) => skip_example(Hardware::Rdma, e),
    }
    let run = || -> gpudirect::Result<bool> {
        if args.awaited {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .map_err(|source| gpudirect::Error::Os {
                    call: "tokio runtime",
                    source,
                })?;
            return rt.block_on(awaited::run(args.size as usize, args.iters as usize));
        }
        if args.server {
            let l = Listener::bind(SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), args.port))?;
            println!("server: listening on port {}", l.port());
            serve(l)?;
            return Ok(true);
        }
        if let Some(host) = &args.connect {
            println!(
                "connecting to {} ({}), port {}",
                host.name, host.ip, args.port
            );
            return client(SocketAddr::new(host.ip, args.port), &args);
        }
        // Loopback: server and client in one process.
        let given = args.addr.as_ref().map(|h| h.ip);
        let ip = match given.or_else(|| rdma_ipv4().map(IpAddr::V4)) {
            Some(ip) => ip,
            None => skip_example(
                Hardware::Rdma,
                "no IPv4 address on a net device of a verbs device (rdma_cm needs one)",
            ),
        };
        let l = Listener::bind(SocketAddr::new(ip, 0))?;
        let port = l.port();
        println!("loopback on {ip}:{port}");
        let srv = std::thread::spawn(move || serve(l));
        let ok = client(SocketAddr::new(ip, port), &args)?;
        srv.join().expect("server thread")?;
        Ok(ok)
    };
    match run() {
        Ok(true) => println!("rdma_pingpong: PASS"),
        Ok(false) => {
            println!("rdma_pingpong: FAIL (bytes differ)");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("rdma_pingpong: error: {e}");
            std::process::exit(1);
        }
    }
}

/// `--async`: the transfers awaited on tokio.
mod awaited {
    use super::{TIMEOUT, pattern};
    use futures_core::Stream;
    use gpudirect::rdma::*;
    use std::pin::Pin;
    use std::time::Instant;

    async fn next<S: Stream + Unpin>(s: &mut S) -> gpudirect::Result<S::Item> {
        let item = std::future::poll_fn(|cx| Pin::new(&mut *s).poll_next(cx));
        match tokio::time::timeout(TIMEOUT, item).await {
            Ok(Some(i)) => Ok(i),
            _ => Err(gpudirect::Error::Timeout {
                what: "a received message",
                after: TIMEOUT,
            }),
        }
    }

    /// Two queue pairs of `ctx`, each on a CQ woken through its own completion channel,
    /// connected to each other.
    fn pair(
        ctx: &Context,
        pd: &ProtectionDomain,
    ) -> gpudirect::Result<(AsyncQueuePair, AsyncQueuePair)> {
        let caps = QpCaps {
            max_send_wr: 128,
            max_recv_wr: 128,
            ..QpCaps::default()
        };
        let access = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
        let side = || -> gpudirect::Result<_> {
            let ch = ctx.create_comp_channel()?;
            let cq = ctx.create_cq(1024, Some(&ch))?;
            let qp = QueuePair::create(pd, &cq, &cq, None, caps)?.to_init(1, access)?;
            Ok((AsyncCq::new(cq, Some(ch))?, qp))
        };
        let ((acq_a, a), (acq_b, b)) = (side()?, side()?);
        let port = ctx.query_port(1)?;
        let gid = ctx.preferred_gid(1)?;
        let ep = |qp_num, psn| Endpoint {
            qp_num,
            psn,
            gid: gid.gid,
            gid_index: gid.index as u8,
            lid: port.lid,
        };
        let (ea, eb) = (ep(a.qp_num(), 0x1234), ep(b.qp_num(), 0x4321));
        let rtr = |peer: &Endpoint| {
            RtrAttr::from_endpoint(peer, port.active_mtu, gid.index as u8).max_dest_rd_atomic(4)
        };
        let a = a
            .to_rtr(&rtr(&eb))?
            .to_rts(&RtsAttr::new(ea.psn).max_rd_atomic(4))?;
        let b = b
            .to_rtr(&rtr(&ea))?
            .to_rts(&RtsAttr::new(eb.psn).max_rd_atomic(4))?;
        Ok((acq_a.attach(a, 1024)?, acq_b.attach(b, 1024)?))
    }

    pub(super) async fn run(size: usize, iters: usize) -> gpudirect::Result<bool> {
        let n = iters.clamp(1, 1000);
        let ctx = Context::open_by_name(None)?;
        let pd = ctx.alloc_pd()?;
        let (a, b) = pair(&ctx, &pd)?;
        println!(
            "rdma_pingpong --async: {n} x {size} bytes on {}",
            ctx.name()
        );
        let data = pattern(size as u64, size * n);
        let src = pd.register(HostBuffer::from_slice(&data)?, AccessFlags::empty())?;
        let rbuf = pd.register(HostBuffer::zeroed(size * 64)?, AccessFlags::LOCAL_WRITE)?;
        let target = pd.register_remote(
            HostBuffer::zeroed(size * n)?,
            AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )?;
        let mut ok = true;
        // Send/recv: every send in flight at once (the backlog holds what the send queue does
        // not); the receiver's stream hands back each filled buffer, in order.
        for k in 0..64.min(n) {
            b.post_recv(rbuf.slice(k * size..(k + 1) * size)?)?;
        }
        let t = Instant::now();
        let mut sends = Vec::with_capacity(n);
        for i in 0..n {
            sends.push(
                a.send(src.slice(i * size..(i + 1) * size)?)?
                    .timeout(TIMEOUT),
            );
        }
        let mut msgs = b.messages();
        for i in 0..n {
            let r = next(&mut msgs).await??;
            ok &= r.bytes() == data[i * size..(i + 1) * size];
            if i + 64 < n {
                b.post_recv(r.into_buf())?;
            }
        }
        for s in sends {
            s.await?;
        }
        println!(
            "send/recv: {n} messages verified in {:.1} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
        // RDMA write with immediate: the bytes in place, (immediate, length) on the stream.
        let remote = target.remote();
        for k in 0..64.min(n) {
            b.post_recv(rbuf.slice(k * size..(k + 1) * size)?)?;
        }
        let mut writes = Vec::with_capacity(n);
        for i in 0..n {
            let w = SendRequest::write(
                src.slice(i * size..(i + 1) * size)?,
                remote.slice((i * size) as u64, size as u32)?,
            )
            .with_imm(i as u32);
            writes.push(a.post(w)?.timeout(TIMEOUT));
        }
        let mut imms = b.immediates();
        for i in 0..n {
            let (imm, len) = next(&mut imms).await??;
            ok &= (imm, len as usize) == (i as u32, size);
            if i + 64 < n {
                b.post_recv(rbuf.slice((i % 64) * size..(i % 64 + 1) * size)?)?;
            }
        }
        for w in writes {
            w.await?;
        }
        ok &= target.to_vec() == data;
        // RDMA read back into poisoned memory.
        let mut back = pd.register(HostBuffer::zeroed(size * n)?, AccessFlags::LOCAL_WRITE)?;
        back.fill(0, size * n, 0xEE)?;
        let mut reads = Vec::with_capacity(n);
        for i in 0..n {
            reads.push(
                a.read(
                    back.slice(i * size..(i + 1) * size)?,
                    remote.slice((i * size) as u64, size as u32)?,
                )?
                .timeout(TIMEOUT),
            );
        }
        for r in reads {
            r.await?;
        }
        ok &= back.to_vec() == data;
        println!("write with immediate and read: {n} x {size} bytes verified");
        // 8-byte round trip, awaited on both sides: median of 1000.
        let ping = pd.register(HostBuffer::from_slice(&[0xA5; 8])?, AccessFlags::empty())?;
        let pong = pd.register(HostBuffer::zeroed(8 * 2)?, AccessFlags::LOCAL_WRITE)?;
        let echo = {
            let b = b.clone();
            let reply = pong.slice(8..16)?;
            let buf = pong.slice(0..8)?;
            tokio::spawn(async move {
                let mut m = b.messages();
                for _ in 0..1100 {
                    b.post_recv(buf.clone())?;
                    next(&mut m).await??;
                    b.send(reply.clone())?.await?;
                }
                Ok::<(), gpudirect::Error>(())
            })
        };
        let rx = pd.register(HostBuffer::zeroed(8)?, AccessFlags::LOCAL_WRITE)?;
        let mut am = a.messages();
        let mut times = Vec::with_capacity(1100);
        for _ in 0..1100 {
            a.post_recv(rx.slice(..)?)?;
            let t = Instant::now();
            a.send(ping.slice(..)?)?.await?;
            next(&mut am).await??;
            times.push(t.elapsed());
        }
        echo.await.map_err(|e| gpudirect::Error::Os {
            call: "tokio join",
            source: std::io::Error::other(e),
        })??;
        let mut times = times.split_off(100);
        times.sort_unstable();
        println!(
            "latency: 8-byte send/recv round trip awaited, median of 1000: {:.1} us",
            times[times.len() / 2].as_secs_f64() * 1e6
        );
        Ok(ok)
    }
}
