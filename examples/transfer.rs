//! The transfer engine between two nodes: write a buffer (GPU memory where there is a GPU, else
//! host memory) to the peer, which checks every byte; print the path the memory took, the rails
//! used and GB/s.
//!
//! ```text
//! cargo run --release --example transfer -- --listen 7400                 # on node b
//! cargo run --release --example transfer -- --connect nodeb:7400         # on node a (one rail)
//! cargo run --release --example transfer -- --connect b-rail0:7400 --connect b-rail1:7400 \
//!     --device mlx5_0 --device mlx5_1                                      # two rails
//! cargo run --release --example transfer                                  # both in one process
//! cargo run --release --example transfer -- --bench --register            # the bench (benches/transfer.rs)
//! cargo run --release --example transfer -- --listen 7400 --metrics 127.0.0.1:9400
//! cargo run --release --example transfer -- --listen 7400 --key-file key  # peers prove they hold the key
//! ```
//!
//! With `--metrics ADDR` the engine's metrics (requests, bytes per rail and peer, failures,
//! handshakes, membership events: docs/transfer.md) are served in Prometheus text at
//! `http://ADDR/metrics` while the example runs.
//!
//! `--key-file PATH` (or the environment variable `GPUDIRECT_TRANSFER_KEY_FILE` naming the file;
//! never the key itself) gives the engine a key (`EngineConfig::key`): both sides need the same
//! one. Each side prints how its endpoint was authenticated ("unauthenticated" without a key);
//! the server also what its peer reaches the target through (`Endpoint::peer_access`).
//!
//! Without a verbs device it prints `SKIPPED: reason` and exits 0 (1 when `GPUDIRECT_REQUIRE`
//! names `rdma`); 2 on a bad option; 1 when a byte differs or a transfer fails.

#[path = "../benches/transfer.rs"]
#[allow(dead_code)]
mod bench;

use clap::Parser;
use gpudirect::transfer::{
    AuthKey, Buffer, Endpoint, Engine, EngineConfig, MemoryPath, Region, TransferOptions,
};
use gpudirect_testing::{Hardware, skip_example};
use std::time::{Duration, Instant};

/// Write a buffer to a peer through the transfer engine, verify it there, report path, rails
/// and GB/s (10^9 bytes per second). With neither --listen nor --connect, both sides run in one
/// process over the first verbs device.
#[derive(Parser)]
struct Args {
    /// Serve: listen on this TCP port (rdma_cm) for one peer, check what it writes.
    #[arg(long, value_name = "PORT", conflicts_with = "connect",
          value_parser = clap::value_parser!(u16).range(1..))]
    listen: Option<u16>,
    /// Connect to a listening peer at HOST:PORT (a name or an address); give it once per rail,
    /// in rail order.
    #[arg(long, value_name = "HOST:PORT", value_parser = host_port)]
    connect: Vec<String>,
    /// A verbs device of this node to use as a rail (give it once per rail, in rail order)
    /// [default: every verbs device]
    #[arg(long = "device", value_name = "NAME")]
    devices: Vec<String>,
    /// Bytes written per iteration, 1 to 1073741824.
    #[arg(long, value_name = "BYTES", default_value_t = 16 << 20,
          value_parser = clap::value_parser!(u64).range(1..=1 << 30))]
    size: u64,
    /// Writes of the whole buffer; the last one carries the notification the peer checks by.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    iters: u32,
    /// Host memory even where there is a GPU.
    #[arg(long)]
    host: bool,
    /// Serve the engine's metrics in Prometheus text on this address (`host:port`) while the
    /// example runs.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
    /// A file holding the key both sides prove they hold (mode 0600; 16 to 1024 bytes, used
    /// whole).
    #[arg(long, value_name = "PATH", env = "GPUDIRECT_TRANSFER_KEY_FILE")]
    key_file: Option<std::path::PathBuf>,
    /// Run the transfer bench (benches/transfer.rs) with the arguments that follow instead.
    #[arg(long, num_args = 0.., allow_hyphen_values = true, value_name = "BENCH-ARGS")]
    bench: Option<Vec<String>>,
}

fn host_port(s: &str) -> Result<String, String> {
    use std::net::ToSocketAddrs;
    s.to_socket_addrs()
        .map_err(|e| format!("not HOST:PORT, or the name does not resolve ({e})"))?
        .next()
        .ok_or_else(|| "resolves to no address".to_string())?;
    Ok(s.to_string())
}

const TIMEOUT: Duration = Duration::from_secs(120);
const BYE: u32 = 0xB1E;

/// The seed-derived bytes both sides compute.
fn pattern(seed: u32, n: usize) -> Vec<u8> {
    let mut x = u64::from(seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// A buffer of `n` bytes: GPU memory on device 0 unless `host` or there is no GPU.
fn memory(engine: &Engine, n: usize, host: bool) -> gpudirect::Result<Region> {
    if !host && let Ok(ctx) = gpudirect::cuda::context(0) {
        let dev = gpudirect::memory::DeviceBuffer::<u8>::alloc(&ctx, n)?;
        return engine.register(Buffer::device(dev)?);
    }
    engine.register(Buffer::host(vec![0u8; n])?)
}

fn serve(
    engine: &Engine,
    l: gpudirect::transfer::TransferListener,
    args: &Args,
) -> gpudirect::Result<bool> {
    let n = args.size as usize;
    let mut target = memory(engine, n, args.host)?;
    if matches!(target.path(), MemoryPath::Staged { .. }) {
        println!(
            "server: {} cannot be a peer's target; using host memory",
            target.path()
        );
        target = memory(engine, n, true)?;
    }
    let ep = l.accept(&[target.descriptor()?], TIMEOUT)?;
    println!(
        "server: peer connected over {} rail(s), {}, peer reaches the target through {}; target is {}",
        ep.rails(),
        ep.authentication(),
        ep.peer_access()
            .map_or("no rkeys".into(), |a| a.to_string()),
        target.path()
    );
    let tag = ep
        .next_notification(TIMEOUT)?
        .ok_or(gpudirect::Error::Timeout {
            what: "the peer's notification",
            after: TIMEOUT,
        })?
        .tag;
    let mut got = vec![0u8; n];
    target.copy_to_host(0, &mut got)?;
    let ok = got == pattern(tag, n);
    println!(
        "server: {} bytes {}",
        n,
        if ok { "verified" } else { "DIFFER" }
    );
    // The verdict goes back as the notification's tag.
    let peer = ep.peer_descriptors()[0];
    let one = engine.register(Buffer::host(vec![u8::from(ok)])?)?;
    ep.write(
        vec![(one.all(), peer.range(0, 1)?)],
        TransferOptions::notify(if ok { BYE } else { BYE + 1 }),
    )?
    .wait()?;
    Ok(ok)
}

fn client(engine: &Engine, peers: &[String], args: &Args) -> gpudirect::Result<bool> {
    let n = args.size as usize;
    let src = memory(engine, n, args.host)?;
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(7)
        ^ std::process::id();
    src.copy_from_host(0, &pattern(seed, n))?;
    let verdict = engine.register(Buffer::host(vec![0u8; 1])?)?;
    let peers: Vec<&str> = peers.iter().map(String::as_str).collect();
    let until = Instant::now() + TIMEOUT;
    let ep: Endpoint = loop {
        match engine.connect(&peers, &[verdict.descriptor()?]) {
            Ok(ep) => break ep,
            Err(e) if Instant::now() < until => {
                eprintln!("client: connect: {e}; retrying");
                std::thread::sleep(Duration::from_millis(300));
            }
            Err(e) => return Err(e),
        }
    };
    println!("client: connected, {}", ep.authentication());
    let dst = ep.peer_descriptors()[0];
    if dst.len() < n as u64 {
        return Err(gpudirect::Error::InvalidArgument {
            arg: "--size",
            value: n.to_string(),
            rule: format!("the peer's buffer holds {} bytes", dst.len()),
        });
    }
    let start = Instant::now();
    let mut last = None;
    for i in 0..args.iters {
        let opts = if i + 1 == args.iters {
            TransferOptions::notify(seed)
        } else {
            TransferOptions::default()
        };
        last = Some(
            ep.write(vec![(src.all(), dst.range(0, n as u64)?)], opts)?
                .wait()?,
        );
    }
    let dt = start.elapsed();
    let r = last.expect("at least one iteration");
    let total = args.size * u64::from(args.iters);
    let stats = ep.rail_stats();
    println!("client: path: {}", r.paths[0]);
    println!(
        "client: rails used: {:?} of {} ({})",
        r.rails_used(),
        ep.rails(),
        stats
            .iter()
            .map(|s| format!("{}: {} bytes", s.device, s.bytes_written))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "client: {} x {} bytes in {:.3} s: {:.3} GB/s",
        args.iters,
        args.size,
        dt.as_secs_f64(),
        total as f64 / dt.as_secs_f64() / 1e9
    );
    let v = ep.next_notification(TIMEOUT)?.map(|x| x.tag);
    // Linger so our NIC acknowledges the peer's last message before we go.
    std::thread::sleep(Duration::from_millis(500));
    Ok(v == Some(BYE))
}

/// An IPv4 address of a verbs device, from its GID table (RoCE GIDs of IPv4 addresses are
/// IPv4-mapped).
fn device_ipv4(engine: &Engine) -> Option<std::net::Ipv4Addr> {
    let list = gpudirect::rdma::DeviceList::non_empty().ok()?;
    for name in engine.devices() {
        let ctx = gpudirect::rdma::Context::open(&list.find(&name).ok()?).ok()?;
        for g in ctx.gid_table(1).ok()? {
            if g.gid.is_ipv4_mapped() {
                return g.gid.to_ipv6().to_ipv4_mapped();
            }
        }
    }
    None
}

/// Install a Prometheus recorder for the `metrics` facade and serve its text at `addr` from a
/// thread (one request at a time: enough for a scraper).
fn serve_metrics(addr: std::net::SocketAddr) -> std::io::Result<()> {
    use std::io::{Read, Write};
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(std::io::Error::other)?;
    let listener = std::net::TcpListener::bind(addr)?;
    println!("metrics: http://{}/metrics", listener.local_addr()?);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut c) = conn else { continue };
            let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
            let mut req = [0u8; 1024];
            let _ = c.read(&mut req);
            let body = handle.render();
            let _ = write!(
                c,
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\n\
                 content-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    Ok(())
}

fn main() {
    let args = Args::parse();
    if let Some(b) = &args.bench {
        std::process::exit(bench::run(b));
    }
    if let Some(addr) = args.metrics
        && let Err(e) = serve_metrics(addr)
    {
        eprintln!("--metrics {addr}: {e}");
        std::process::exit(2);
    }
    // The options first: a bad one is refused (exit 2) on any machine, not skipped with the
    // hardware.
    let mut cfg = EngineConfig::default();
    cfg.devices = args.devices.clone();
    if let Some(p) = &args.key_file {
        match AuthKey::from_file(p) {
            Ok(k) => cfg.key = Some(k),
            Err(e) => {
                eprintln!("--key-file {}: {e}", p.display());
                std::process::exit(2);
            }
        }
    }
    if let Err(e) = cfg.check() {
        eprintln!("transfer: {e}");
        std::process::exit(2);
    }
    if let Err(e) = gpudirect::rdma::DeviceList::non_empty() {
        skip_example(Hardware::Rdma, e);
    }
    let run = || -> gpudirect::Result<bool> {
        let engine = Engine::new(cfg.clone())?;
        println!("rails: {:?}", engine.devices());
        if let Some(port) = args.listen {
            let l = engine.listen(&format!("0.0.0.0:{port}"))?;
            println!("server: listening on port {}", l.port());
            return serve(&engine, l, &args);
        }
        if !args.connect.is_empty() {
            return client(&engine, &args.connect, &args);
        }
        let Some(ip) = device_ipv4(&engine) else {
            skip_example(
                Hardware::Rdma,
                "no IPv4 address on a verbs device (rdma_cm needs one for the loopback)",
            );
        };
        let l = engine.listen(&format!("{ip}:0"))?;
        let peer = format!("{ip}:{}", l.port());
        println!("loopback on {peer}");
        let (e2, a2) = (engine.clone(), Args::parse());
        let srv = std::thread::spawn(move || serve(&e2, l, &a2));
        let ok = client(&engine, &[peer], &args)?;
        Ok(srv.join().expect("server thread")? && ok)
    };
    match run() {
        Ok(true) => println!("transfer: PASS"),
        Ok(false) => {
            println!("transfer: FAIL (bytes differ)");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("transfer: error: {e}");
            std::process::exit(1);
        }
    }
}
