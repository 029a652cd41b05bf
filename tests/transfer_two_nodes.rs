//! Tier 1, two nodes: the transfer engine between the two network namespaces of the Soft-RoCE
//! VM (`TWO_NODES=1 bash ci/rxe-vm/run.sh`, entries `transfer-*` of `ci/rxe-vm/two-nodes.list`).
//! Each test has a server half (node b, listening) and a client half (node a), told apart by
//! `GPUDIRECT_TEST_ROLE`; both sides run the same tests in the same order, each test on its own
//! port (`GPUDIRECT_TEST_PORT` + its number). Without that environment every test prints
//! `SKIPPED`.
//!
//! Data is random (a seed per test, printed) and compared byte for byte; the side that receives
//! last answers with a notification, so no side leaves while a message to it is unacknowledged
//! (rxe then retransmits it to a queue pair that is gone).

mod support;

use gpudirect::Error;
use gpudirect::rdma::WcStatus;
use gpudirect::transfer::{
    Buffer, Endpoint, Engine, EngineConfig, MemoryDescriptor, MemoryPath, Region, Transfer,
    TransferOptions,
};
use gpudirect_testing::{Hardware, skip};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

const ACCEPT: Duration = Duration::from_secs(120);
const CONNECT: Duration = Duration::from_secs(90);
const NOTE: Duration = Duration::from_secs(60);

/// The node this side is, from the VM's environment.
struct Node {
    server: bool,
    rails: Vec<String>,
    peers: Vec<String>,
    port: u16,
}

fn node() -> Option<Node> {
    let role = std::env::var("GPUDIRECT_TEST_ROLE").ok()?;
    let list = |v: &str| -> Vec<String> {
        std::env::var(v)
            .unwrap_or_default()
            .split(',')
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect()
    };
    Some(Node {
        server: role == "server",
        rails: list("GPUDIRECT_TEST_RAILS"),
        peers: list("GPUDIRECT_TEST_PEER_ADDRS"),
        port: std::env::var("GPUDIRECT_TEST_PORT").ok()?.parse().ok()?,
    })
}

macro_rules! two_nodes {
    () => {
        match node() {
            Some(n) => n,
            None => {
                skip(
                    Hardware::Rdma,
                    "not one side of the two-node VM (GPUDIRECT_TEST_ROLE unset)",
                );
                return;
            }
        }
    };
}

impl Node {
    fn engine(&self) -> Engine {
        self.engine_with(EngineConfig::with_devices(&self.rails))
    }

    fn engine_with(&self, c: EngineConfig) -> Engine {
        Engine::new(c).expect("engine on this node's rails")
    }

    /// Server: accept one endpoint on port + `k`, publishing `publish`.
    fn accept(&self, engine: &Engine, k: u16, publish: &[MemoryDescriptor]) -> Endpoint {
        let l = engine
            .listen(&format!("0.0.0.0:{}", self.port + k))
            .expect("listen");
        l.accept(publish, ACCEPT).expect("accept")
    }

    /// Client: connect on port + `k` over `rails` rails.
    fn connect(
        &self,
        engine: &Engine,
        k: u16,
        rails: usize,
        publish: &[MemoryDescriptor],
    ) -> Endpoint {
        let addrs: Vec<String> = self.peers[..rails]
            .iter()
            .map(|a| format!("{a}:{}", self.port + k))
            .collect();
        dial(engine, &addrs, publish)
    }
}

/// Connect to `addrs` (one per rail), retrying while the server is not listening yet.
fn dial(engine: &Engine, addrs: &[String], publish: &[MemoryDescriptor]) -> Endpoint {
    let addrs: Vec<&str> = addrs.iter().map(String::as_str).collect();
    let until = Instant::now() + CONNECT;
    loop {
        match engine.connect(&addrs, publish) {
            Ok(ep) => return ep,
            Err(e) if Instant::now() < until => {
                eprintln!("connect {addrs:?}: {e}; retrying");
                std::thread::sleep(Duration::from_millis(300));
            }
            Err(e) => panic!("connect {addrs:?}: {e}"),
        }
    }
}

/// Bytes from a seed: both sides make the same.
fn pattern(seed: u64, n: usize) -> Vec<u8> {
    support::files::pattern(n, seed)
}

fn seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        & 0xffff_ffff
}

fn host(engine: &Engine, data: &[u8]) -> Region {
    let r = engine
        .register(Buffer::host(data.to_vec()).unwrap())
        .unwrap();
    assert_eq!(r.path(), &MemoryPath::Host);
    r
}

fn note(ep: &Endpoint) -> u32 {
    ep.next_notification(NOTE)
        .expect("endpoint alive")
        .expect("a notification in time")
        .tag
}

/// The next notification's tag, awaited (`Endpoint::notification`) on `rt`.
fn note_awaited(rt: &tokio::runtime::Runtime, ep: &Endpoint) -> u32 {
    rt.block_on(ep.notification(NOTE))
        .expect("endpoint alive")
        .expect("a notification in time")
        .tag
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a tokio runtime")
}

/// The last word: `from` tells the other side it may go, and waits for the message to be
/// acknowledged; the other side waits for it, then lingers so its NIC acknowledges.
fn bye(ep: &Endpoint, scratch: &Region, peer: &MemoryDescriptor) {
    say(ep, scratch, peer, 0xB1E);
}

/// The tag of "checked": the client writes the same target again only after it, so the server
/// never compares bytes that the next write is already replacing.
const ACK: u32 = 0xACC;

/// A one-byte write from `scratch` into the peer's `peer` with the notification `tag`, waited
/// for.
fn say(ep: &Endpoint, scratch: &Region, peer: &MemoryDescriptor, tag: u32) {
    ep.write(
        vec![(scratch.range(0, 1).unwrap(), peer.range(0, 1).unwrap())],
        TransferOptions::notify(tag),
    )
    .unwrap()
    .wait()
    .expect("a one-byte notification");
}

fn wait_ack(ep: &Endpoint) {
    assert_eq!(note(ep), ACK, "the server's \"checked\"");
}

fn wait_bye(ep: &Endpoint) {
    assert_eq!(note(ep), 0xB1E);
    std::thread::sleep(Duration::from_millis(500));
}

/// The server half of a one-way test: a zeroed target of `size` bytes, published; at each of
/// `rounds` notifications the target holds the bytes seeded by its tag; then the goodbye.
fn serve_verified(n: &Node, e: &Engine, k: u16, size: usize, rounds: usize, what: &str) {
    let target = e.register(Buffer::host(vec![0u8; size]).unwrap()).unwrap();
    let ep = n.accept(e, k, &[target.descriptor().unwrap()]);
    let peer = ep.peer_descriptors()[0];
    for round in 0..rounds {
        let s = note(&ep);
        assert!(
            target.to_vec().unwrap() == pattern(u64::from(s), size),
            "{what}, round {round}: the bytes differ"
        );
        if round + 1 < rounds {
            say(&ep, &target, &peer, ACK);
        }
    }
    println!("server: {what}: {rounds} round(s) verified");
    bye(&ep, &target, &peer);
}

/// Writes and reads of host memory at several sizes over one rail and two, random bytes,
/// compared exactly on the other side; the path is reported as host memory.
#[test]
fn t1_host_writes_and_reads_arrive_exactly() {
    let n = two_nodes!();
    let e = n.engine();
    const SIZE: usize = 3 << 20;
    let sizes = [1usize, 4097, (1 << 20) + 3, SIZE];
    if n.server {
        let target = e.register(Buffer::host(vec![0u8; SIZE]).unwrap()).unwrap();
        // What the client reads: the server's seed comes back with the first note.
        let s = seed();
        let readable = host(&e, &pattern(s, SIZE));
        let ep = n.accept(
            &e,
            0,
            &[target.descriptor().unwrap(), readable.descriptor().unwrap()],
        );
        let peer = ep.peer_descriptors()[0];
        for (i, &len) in sizes.iter().enumerate() {
            let tag = note(&ep);
            let want = pattern(u64::from(tag), len);
            let mut got = vec![0u8; len];
            target.read_at(0, &mut got).unwrap();
            assert!(got == want, "write {i} of {len} bytes differs (seed {tag})");
            println!("server: write of {len} bytes verified");
            say(&ep, &readable, &peer, ACK);
        }
        // Tell the client the seed of what it reads, then wait for its verdict.
        ep.write(
            vec![(readable.range(0, 1).unwrap(), peer.range(0, 1).unwrap())],
            TransferOptions::notify(s as u32),
        )
        .unwrap()
        .wait()
        .unwrap();
        wait_bye(&ep);
    } else {
        let scratch = e.register(Buffer::host(vec![0u8; SIZE]).unwrap()).unwrap();
        for rails in [2usize] {
            let ep = n.connect(&e, 0, rails, &[scratch.descriptor().unwrap()]);
            let peer = ep.peer_descriptors();
            assert_eq!(peer.len(), 2);
            for &len in &sizes {
                let s = seed() as u32;
                let src = host(&e, &pattern(u64::from(s), len));
                let r = ep
                    .write(
                        vec![(src.all(), peer[0].range(0, len as u64).unwrap())],
                        TransferOptions::notify(s),
                    )
                    .unwrap()
                    .wait()
                    .unwrap();
                assert_eq!(r.bytes, len as u64);
                assert_eq!(r.paths, vec![MemoryPath::Host]);
                // The next write replaces these bytes: only once the server has checked them.
                wait_ack(&ep);
                println!(
                    "client: wrote {len} bytes in {} messages over rails {:?} ({:.1} MB/s)",
                    r.messages,
                    r.rails_used(),
                    r.gbps() * 1e3
                );
            }
            let s = note(&ep);
            // Read it back in pieces of several sizes, into one region.
            let into = e
                .register(Buffer::host(vec![0xEEu8; SIZE]).unwrap())
                .unwrap();
            let cuts = [0u64, 1, 4096, 4097, 1 << 20, SIZE as u64];
            let pairs = cuts
                .windows(2)
                .map(|w| {
                    (
                        into.range(w[0], w[1] - w[0]).unwrap(),
                        peer[1].range(w[0], w[1] - w[0]).unwrap(),
                    )
                })
                .collect();
            let r = ep
                .read(pairs, TransferOptions::default())
                .unwrap()
                .wait()
                .unwrap();
            assert_eq!(r.bytes, SIZE as u64);
            assert!(
                into.to_vec().unwrap() == pattern(u64::from(s), SIZE),
                "read differs"
            );
            println!("client: read {SIZE} bytes in 5 pairs, verified");
            bye(&ep, &scratch, &peer[0]);
        }
    }
}

/// 200 notified writes, each to its own slot: the server sees the tags in order, and each slot
/// holds its bytes when its notification arrives.
#[test]
fn t2_notifications_arrive_in_order_and_after_the_data() {
    let n = two_nodes!();
    let e = n.engine();
    const N: u32 = 200;
    const SLOT: usize = 8192;
    if n.server {
        let target = e
            .register(Buffer::host(vec![0u8; SLOT * N as usize]).unwrap())
            .unwrap();
        let ep = n.accept(&e, 1, &[target.descriptor().unwrap()]);
        let rt = runtime();
        let base = note(&ep);
        for i in 0..N {
            // Every other one through the awaited form: both see the same queue, in order.
            let tag = if i % 2 == 0 {
                note(&ep)
            } else {
                note_awaited(&rt, &ep)
            };
            assert_eq!(tag, base + i, "notification {i} out of order");
            let mut got = vec![0u8; SLOT];
            target.read_at(i as usize * SLOT, &mut got).unwrap();
            assert!(
                got == pattern(u64::from(tag), SLOT),
                "slot {i}: notification before its data"
            );
        }
        // Nothing more was sent: an await ends with `None` at its deadline.
        let t = Instant::now();
        let none = rt
            .block_on(ep.notification(Duration::from_millis(100)))
            .expect("endpoint alive");
        assert!(none.is_none(), "{none:?}");
        assert!(t.elapsed() >= Duration::from_millis(100));
        println!("server: {N} notifications in order, each after its data (half awaited)");
        let peer = ep.peer_descriptors()[0];
        bye(&ep, &target, &peer);
    } else {
        let scratch = e.register(Buffer::host(vec![0u8; 64]).unwrap()).unwrap();
        let ep = n.connect(&e, 1, 2, &[scratch.descriptor().unwrap()]);
        let peer = ep.peer_descriptors()[0];
        let base = seed() as u32 & 0x0fff_ffff;
        ep.write(
            vec![(scratch.range(0, 1).unwrap(), peer.range(0, 1).unwrap())],
            TransferOptions::notify(base),
        )
        .unwrap()
        .wait()
        .unwrap();
        let srcs: Vec<Region> = (0..N)
            .map(|i| host(&e, &pattern(u64::from(base + i), SLOT)))
            .collect();
        // All in flight at once: they may complete in any order, notifications may not.
        let ts: Vec<Transfer> = (0..N)
            .map(|i| {
                ep.write(
                    vec![(
                        srcs[i as usize].all(),
                        peer.range(u64::from(i) * SLOT as u64, SLOT as u64).unwrap(),
                    )],
                    TransferOptions::notify(base + i),
                )
                .unwrap()
            })
            .collect();
        // Half waited for, half awaited.
        let rt = runtime();
        for (i, t) in ts.into_iter().enumerate() {
            let r = if i % 2 == 0 {
                t.wait()
            } else {
                rt.block_on(async { t.await })
            };
            assert_eq!(r.unwrap().bytes, SLOT as u64);
        }
        // One more, unnotified (the same bytes to slot 0), awaited by a waker that calls the
        // endpoint: the progress thread wakes it only once it let the endpoint's lock go.
        let t = ep
            .write(
                vec![(srcs[0].all(), peer.range(0, SLOT as u64).unwrap())],
                TransferOptions::default(),
            )
            .unwrap();
        assert_eq!(await_calling_back(&ep, t).bytes, SLOT as u64);
        wait_bye(&ep);
    }
}

/// A waker that calls its endpoint when woken (a callback-style executor), then says so.
struct CallsBack {
    ep: std::sync::Mutex<Option<Endpoint>>,
    woke: std::sync::Mutex<std::sync::mpsc::Sender<()>>,
}

impl std::task::Wake for CallsBack {
    fn wake(self: std::sync::Arc<Self>) {
        if let Some(ep) = self.ep.lock().unwrap().take() {
            // Takes the endpoint's lock: whoever wakes us must not hold it.
            let _ = ep.failure();
            let _ = ep.rail_stats();
        }
        let _ = self.woke.lock().unwrap().send(());
    }
}

/// `t` awaited by a waker that calls `ep`; panics if a wake-up never ends.
fn await_calling_back(ep: &Endpoint, t: Transfer) -> gpudirect::transfer::TransferReport {
    use std::future::{Future, IntoFuture};
    use std::task::{Context, Poll, Waker};
    let mut f = Box::pin(t.into_future());
    loop {
        let (tx, rx) = std::sync::mpsc::channel();
        let w = Waker::from(std::sync::Arc::new(CallsBack {
            ep: std::sync::Mutex::new(Some(ep.clone())),
            woke: std::sync::Mutex::new(tx),
        }));
        match f.as_mut().poll(&mut Context::from_waker(&w)) {
            Poll::Ready(r) => return r.expect("the write"),
            Poll::Pending => {
                if rx.recv_timeout(NOTE).is_err() {
                    // Dropping them would wait for the stuck thread.
                    std::mem::forget((f, w));
                    panic!("a wake-up never ended: it waited for the lock its caller held");
                }
            }
        }
    }
}

/// 10,000 small writes (64 bytes each, at most 512 outstanding), every byte checked.
#[test]
fn t3_ten_thousand_small_transfers() {
    let n = two_nodes!();
    let e = n.engine();
    const N: usize = 10_000;
    const SMALL: usize = 64;
    if n.server {
        serve_verified(&n, &e, 2, N * SMALL, 1, "10,000 writes of 64 bytes");
    } else {
        let s = seed() as u32;
        let data = pattern(u64::from(s), N * SMALL);
        let src = host(&e, &data);
        let ep = n.connect(&e, 2, 1, &[src.descriptor().unwrap()]);
        let peer = ep.peer_descriptors()[0];
        let start = Instant::now();
        let mut q: VecDeque<Transfer> = VecDeque::new();
        for i in 0..N {
            if q.len() == 512 {
                q.pop_front().unwrap().wait().unwrap();
            }
            let at = (i * SMALL) as u64;
            let opts = if i + 1 == N {
                // The last one tells the server; it goes after every earlier one on the rail.
                TransferOptions::notify(s)
            } else {
                TransferOptions::default()
            };
            q.push_back(
                ep.write(
                    vec![(
                        src.range(at, SMALL as u64).unwrap(),
                        peer.range(at, SMALL as u64).unwrap(),
                    )],
                    opts,
                )
                .unwrap(),
            );
        }
        while let Some(t) = q.pop_front() {
            t.wait().unwrap();
        }
        let dt = start.elapsed();
        let st = ep.rail_stats();
        assert_eq!(st[0].writes, N as u64);
        println!(
            "client: 10,000 writes in {dt:?} ({:.0} per second)",
            N as f64 / dt.as_secs_f64()
        );
        wait_bye(&ep);
    }
}

/// A 4 MiB write is striped: both rails carry bytes (the report and the per-rail counters say
/// so), and every byte arrives.
#[test]
fn t4_striping_uses_both_rails() {
    let n = two_nodes!();
    let e = n.engine();
    const SIZE: usize = 4 << 20;
    if n.server {
        serve_verified(&n, &e, 3, SIZE, 1, "a striped write");
    } else {
        let s = seed() as u32;
        let src = host(&e, &pattern(u64::from(s), SIZE));
        let ep = n.connect(&e, 3, 2, &[src.descriptor().unwrap()]);
        let peer = ep.peer_descriptors()[0];
        let r = ep
            .write(vec![(src.all(), peer.all())], TransferOptions::notify(s))
            .unwrap()
            .wait()
            .unwrap();
        let st = ep.rail_stats();
        println!(
            "client: striped {SIZE} bytes: per rail {:?}, counters {:?}",
            r.rail_bytes, st
        );
        assert_eq!(r.rails_used(), vec![0, 1], "both rails carry bytes");
        assert!(st[0].bytes_written > 0 && st[1].bytes_written > 0);
        assert_eq!(st[0].bytes_written + st[1].bytes_written, SIZE as u64);
        assert_ne!(st[0].device, st[1].device);
        wait_bye(&ep);
    }
}

/// The registration cache: a range inside a registration reuses it; many views registered in
/// one call coalesce; after every holder is gone and new memory is registered (possibly at the
/// same address) nothing stale is hit, and the bytes a transfer moves are the new memory's.
#[test]
fn t5_registration_cache_hits_and_no_stale_hit() {
    let n = two_nodes!();
    let e = n.engine();
    const SIZE: usize = 1 << 20;
    if n.server {
        serve_verified(&n, &e, 4, SIZE, 2, "memory registered anew");
    } else {
        let scratch = e.register(Buffer::host(vec![0u8; 64]).unwrap()).unwrap();
        let ep = n.connect(&e, 4, 1, &[scratch.descriptor().unwrap()]);
        let peer = ep.peer_descriptors()[0];
        let before = e.cache_stats();
        // One buffer, then views inside it: hits, one registration.
        let buf = Buffer::host(vec![0u8; SIZE]).unwrap();
        let whole = e.register(buf.clone()).unwrap();
        let part = e.register(buf.slice(4096, 8192).unwrap()).unwrap();
        assert!(part.same_registration(&whole));
        let st = e.cache_stats();
        assert_eq!(
            (st.hits - before.hits, st.misses - before.misses),
            (1, 1),
            "{st:?}"
        );
        // 1,000 views of a fresh buffer in one call: coalesced into one registration.
        let big = Buffer::host(vec![0u8; 1000 * 512]).unwrap();
        let views: Vec<Buffer> = (0..1000)
            .map(|i| big.slice(i * 512, 512).unwrap())
            .collect();
        let rs = e.register_all(views).unwrap();
        assert!(rs.iter().all(|r| r.same_registration(&rs[0])));
        let st2 = e.cache_stats();
        assert_eq!(st2.registrations - st.registrations, 1, "{st2:?}");
        drop(rs);
        for round in 0..2u32 {
            let before = e.cache_stats();
            let s = seed() as u32 ^ round;
            // Free the previous memory (every region and transfer of it gone), allocate anew:
            // the allocator may well hand back the same address.
            let data = pattern(u64::from(s), SIZE);
            let fresh = e.register(Buffer::host(data.clone()).unwrap()).unwrap();
            let st = e.cache_stats();
            assert_eq!(
                (st.hits - before.hits, st.misses - before.misses),
                (0, 1),
                "new memory never hits an old registration"
            );
            ep.write(vec![(fresh.all(), peer.all())], TransferOptions::notify(s))
                .unwrap()
                .wait()
                .unwrap();
            if round == 0 {
                // Round 1 writes the same target: only once the server has checked round 0.
                wait_ack(&ep);
            }
            let d = fresh.descriptor().unwrap();
            drop(fresh);
            let after = e.cache_stats();
            println!(
                "client: round {round}: memory at {:#x}, cache {after:?}",
                d.addr()
            );
        }
        drop((whole, part));
        // The server's last write lands in `scratch`: it stays registered until then.
        wait_bye(&ep);
        drop(scratch);
        assert_eq!(
            e.cache_stats().live,
            0,
            "every registration gone with its holders"
        );
    }
}

/// A wrong rkey ends that endpoint's transfer with a typed remote access error within its
/// deadline; another endpoint to the same peer carries on; the broken one reconnects and works.
#[test]
fn t6_wrong_rkey_is_typed_others_carry_on_and_reconnect_works() {
    let n = two_nodes!();
    let e = n.engine();
    const SIZE: usize = 64 << 10;
    if n.server {
        let target = e.register(Buffer::host(vec![0u8; SIZE]).unwrap()).unwrap();
        let d = target.descriptor().unwrap();
        let l = e.listen(&format!("0.0.0.0:{}", n.port + 5)).unwrap();
        let ep1 = l.accept(&[d], ACCEPT).unwrap();
        let ep2 = l.accept(&[d], ACCEPT).unwrap();
        // The client's bad write breaks ep1 on both sides; ep2 carries a note after it.
        let s = note(&ep2);
        assert!(target.to_vec().unwrap() == pattern(u64::from(s), SIZE));
        println!(
            "server: endpoint 2 carried on after endpoint 1 failed ({:?})",
            ep1.failure()
        );
        let ep1b = l.accept(&[d], ACCEPT).unwrap();
        let s = note(&ep1b);
        assert!(target.to_vec().unwrap() == pattern(u64::from(s), SIZE));
        println!("server: the reconnected endpoint works");
        let peer = ep1b.peer_descriptors()[0];
        bye(&ep1b, &target, &peer);
        drop(ep1);
        drop(ep2);
    } else {
        let scratch = e.register(Buffer::host(vec![0u8; 64]).unwrap()).unwrap();
        let publish = [scratch.descriptor().unwrap()];
        let ep1 = n.connect(&e, 5, 1, &publish);
        let ep2 = n.connect(&e, 5, 1, &publish);
        let good = ep1.peer_descriptors()[0];
        let keys: Vec<u32> = good.rkeys().iter().map(|k| k ^ 0x5a5a_0000).collect();
        let bad = MemoryDescriptor::new(good.addr(), good.len(), good.kind(), &keys).unwrap();
        let src = host(&e, &pattern(1, SIZE));
        let t0 = Instant::now();
        let deadline = Duration::from_secs(10);
        let r = ep1
            .write(
                vec![(src.all(), bad.all())],
                TransferOptions::default().deadline(deadline),
            )
            .unwrap()
            .wait();
        let dt = t0.elapsed();
        println!("client: wrong rkey -> {r:?} after {dt:?}");
        match r {
            Err(Error::WorkCompletion { status, .. }) => assert!(
                matches!(
                    status,
                    WcStatus::RemoteAccess | WcStatus::RemoteInvalidRequest
                ),
                "{status:?}"
            ),
            other => panic!("a wrong rkey gave {other:?}"),
        }
        assert!(dt < deadline, "typed error only after {dt:?}");
        assert!(ep1.failure().is_some());
        // Later requests on it are refused at once, typed.
        assert!(
            ep1.write(vec![(src.all(), good.all())], TransferOptions::default())
                .is_err()
        );
        // The other endpoint carries on.
        let s = seed() as u32;
        let src2 = host(&e, &pattern(u64::from(s), SIZE));
        ep2.write(vec![(src2.all(), good.all())], TransferOptions::notify(s))
            .unwrap()
            .wait()
            .expect("the other endpoint carries on");
        // Reconnect the broken one (the server accepts it as a new endpoint).
        let until = Instant::now() + CONNECT;
        while let Err(e) = ep1.reconnect() {
            assert!(Instant::now() < until, "reconnect: {e}");
            std::thread::sleep(Duration::from_millis(300));
        }
        let good = ep1.peer_descriptors()[0];
        let s = seed() as u32 ^ 1;
        let src3 = host(&e, &pattern(u64::from(s), SIZE));
        ep1.write(vec![(src3.all(), good.all())], TransferOptions::notify(s))
            .unwrap()
            .wait()
            .expect("the reconnected endpoint works");
        wait_bye(&ep1);
    }
}

const VICTIM: &str = "GPUDIRECT_TRANSFER_VICTIM";

/// The server half's child: accepts, takes the first notification, says so, and waits to be
/// killed. Run only by `t7` through the environment.
#[test]
#[ignore = "run by t7_a_peer_killed_mid_transfer_gives_typed_errors_in_time in a child process"]
fn t7_victim() {
    let Ok(port) = std::env::var(VICTIM) else {
        return;
    };
    let n = node().expect("the VM's environment");
    let e = n.engine();
    let target = e
        .register(Buffer::host(vec![0u8; 4 << 20]).unwrap())
        .unwrap();
    let l = e.listen(&format!("0.0.0.0:{port}")).unwrap();
    let ep = l.accept(&[target.descriptor().unwrap()], ACCEPT).unwrap();
    let _ = note(&ep);
    println!("VICTIM-READY");
    use std::io::Write;
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(300));
}

/// The peer's process is killed while transfers stream to it: every transfer ends with a typed
/// error (the peer's disconnect, a flushed or failed message, or the deadline) within its
/// deadline plus the flush bound, and the endpoint says why.
#[test]
fn t7_a_peer_killed_mid_transfer_gives_typed_errors_in_time() {
    let n = two_nodes!();
    let port = n.port + 6;
    if n.server {
        use std::io::BufRead;
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "t7_victim",
                "--include-ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(VICTIM, port.to_string())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        for line in std::io::BufReader::new(out).lines() {
            let line = line.unwrap();
            println!("victim: {line}");
            if line.contains("VICTIM-READY") {
                break;
            }
        }
        // Let the client stream for a moment, then kill the peer outright.
        std::thread::sleep(Duration::from_millis(700));
        child.kill().unwrap();
        let st = child.wait().unwrap();
        println!("server: victim killed ({st})");
    } else {
        let e = n.engine();
        let src = host(&e, &pattern(3, 1 << 20));
        let ep = dial(&e, &[format!("{}:{port}", n.peers[0])], &[]);
        let peer = ep.peer_descriptors()[0];
        ep.write(
            vec![(src.range(0, 8).unwrap(), peer.range(0, 8).unwrap())],
            TransferOptions::notify(1),
        )
        .unwrap()
        .wait()
        .unwrap();
        let deadline = Duration::from_secs(5);
        let slack = Duration::from_secs(4);
        let mut ok = 0;
        let started = Instant::now();
        let err = loop {
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "the peer's death went unseen"
            );
            let t0 = Instant::now();
            let r = ep
                .write(
                    vec![(src.all(), peer.range(0, 1 << 20).unwrap())],
                    TransferOptions::default().deadline(deadline),
                )
                .and_then(Transfer::wait);
            let dt = t0.elapsed();
            assert!(dt < deadline + slack, "a transfer took {dt:?}");
            match r {
                Ok(_) => ok += 1,
                Err(e) => break (e, dt),
            }
        };
        println!(
            "client: {ok} transfers, then {:?} after {:?}; endpoint: {:?}",
            err.0,
            err.1,
            ep.failure()
        );
        assert!(
            matches!(
                err.0,
                Error::Timeout { .. } | Error::WorkCompletion { .. } | Error::CmEvent { .. }
            ),
            "untyped: {:?}",
            err.0
        );
        assert!(ep.failure().is_some());
    }
}

/// The peer vanishes without a word: the server's end of rail 1 goes down (its veth), so
/// nothing answers and nothing says so (rxe retries without end). The transfer ends with
/// `Error::Timeout` at its deadline; the link comes back afterwards for what runs next.
#[test]
fn t8_a_silent_peer_ends_at_the_deadline() {
    let n = two_nodes!();
    let port = n.port + 7;
    if n.server {
        let e = n.engine();
        let target = e
            .register(Buffer::host(vec![0u8; 1 << 20]).unwrap())
            .unwrap();
        let l = e.listen(&format!("0.0.0.0:{port}")).unwrap();
        let ep = l.accept(&[target.descriptor().unwrap()], ACCEPT).unwrap();
        let _ = note(&ep);
        std::thread::sleep(Duration::from_millis(300));
        let ip = |state: &str| {
            let st = std::process::Command::new("/usr/sbin/ip")
                .args(["link", "set", "vb1", state])
                .status()
                .unwrap();
            assert!(st.success(), "ip link set vb1 {state}");
        };
        ip("down");
        println!("server: rail 1 is down");
        std::thread::sleep(Duration::from_secs(8));
        ip("up");
        println!("server: rail 1 is up again");
        // Give the link a moment before the next users of rail 1.
        std::thread::sleep(Duration::from_secs(2));
        drop(ep);
    } else {
        let e = n.engine();
        let src = host(&e, &pattern(5, 1 << 20));
        let ep = dial(
            &e,
            &[format!("{}:{port}", n.peers[1])],
            &[src.descriptor().unwrap()],
        );
        let peer = ep.peer_descriptors()[0];
        ep.write(
            vec![(src.range(0, 8).unwrap(), peer.range(0, 8).unwrap())],
            TransferOptions::notify(1),
        )
        .unwrap()
        .wait()
        .unwrap();
        std::thread::sleep(Duration::from_secs(1));
        let deadline = Duration::from_secs(3);
        let t0 = Instant::now();
        let r = ep
            .write(
                vec![(src.all(), peer.all())],
                TransferOptions::default().deadline(deadline),
            )
            .unwrap()
            .wait();
        let dt = t0.elapsed();
        println!("client: silent peer -> {r:?} after {dt:?}");
        assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
        assert!(
            dt >= deadline && dt < deadline + Duration::from_secs(3),
            "{dt:?}"
        );
        assert!(matches!(ep.failure(), Some(Error::Timeout { .. })));
        // Wait out the link's absence before the next test uses it.
        std::thread::sleep(Duration::from_secs(8));
    }
}

/// Several threads on one endpoint wait at once, blocking and awaited, while another waits for
/// a notification, in both directions; waits spin briefly (200 µs, shorter than a round trip
/// here), so the waiting threads poll the completion queues themselves, take that over from
/// each other, and hand it back to the progress thread. Every request ends once with its bytes,
/// every notification arrives once.
#[test]
fn t9_many_waiting_threads_share_the_polling() {
    let n = two_nodes!();
    let mut c = EngineConfig::with_devices(&n.rails);
    c.spin = Duration::from_micros(200);
    let e = n.engine_with(c);
    const THREADS: u32 = 4;
    const WRITES: u64 = 150;
    const SLOTS: u64 = 32;
    const SLOT: u64 = 4096;
    const BACK: u32 = 60;
    let span = (THREADS as u64 * SLOTS * SLOT) as usize;
    if n.server {
        let target = e.register(Buffer::host(vec![0u8; span]).unwrap()).unwrap();
        let ep = n.accept(&e, 8, &[target.descriptor().unwrap()]);
        let peer = ep.peer_descriptors()[0];
        let base = note(&ep);
        // One thread takes the client's notifications while this one writes back.
        let rx = {
            let ep = ep.clone();
            std::thread::spawn(move || {
                let mut tags: Vec<u32> = (0..THREADS).map(|_| note(&ep)).collect();
                tags.sort_unstable();
                tags
            })
        };
        let back = host(&e, &pattern(u64::from(base), 4096));
        for i in 0..BACK {
            let opts = if i + 1 == BACK {
                TransferOptions::notify(base ^ 0xFFFF)
            } else {
                TransferOptions::default()
            };
            ep.write(
                vec![(
                    back.range(0, 64).unwrap(),
                    peer.range(u64::from(i % 8) * 64, 64).unwrap(),
                )],
                opts,
            )
            .unwrap()
            .wait()
            .expect("a write back");
        }
        let tags = rx.join().unwrap();
        assert_eq!(
            tags,
            (0..THREADS).map(|t| base + 1 + t).collect::<Vec<_>>(),
            "each thread's notification once"
        );
        let want: Vec<u8> = (0..THREADS)
            .flat_map(|t| pattern(u64::from(base + 1 + t), (SLOTS * SLOT) as usize))
            .collect();
        assert!(
            target.to_vec().unwrap() == want,
            "the threads' bytes differ"
        );
        println!("server: {THREADS} threads' writes verified, {BACK} written back");
        bye(&ep, &target, &peer);
    } else {
        let scratch = e.register(Buffer::host(vec![0u8; 4096]).unwrap()).unwrap();
        let ep = n.connect(&e, 8, 1, &[scratch.descriptor().unwrap()]);
        let peer = ep.peer_descriptors()[0];
        let base = seed() as u32 & 0x0fff_ffff;
        say(&ep, &scratch, &peer, base);
        let srcs: Vec<Region> = (0..THREADS)
            .map(|t| {
                host(
                    &e,
                    &pattern(u64::from(base + 1 + t), (SLOTS * SLOT) as usize),
                )
            })
            .collect();
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (ep, src) = (ep.clone(), srcs[t as usize].clone());
                std::thread::spawn(move || {
                    let rt = runtime();
                    let at = u64::from(t) * SLOTS * SLOT;
                    for k in 0..WRITES {
                        let off = (k % SLOTS) * SLOT;
                        // The last one of each thread goes after every slot of it was written.
                        let opts = if k + 1 == WRITES {
                            TransferOptions::notify(base + 1 + t)
                        } else {
                            TransferOptions::default()
                        };
                        let tr = ep
                            .write(
                                vec![(
                                    src.range(off, SLOT).unwrap(),
                                    peer.range(at + off, SLOT).unwrap(),
                                )],
                                opts,
                            )
                            .unwrap();
                        let r = if (k + u64::from(t)) % 3 == 0 {
                            rt.block_on(async { tr.await })
                        } else {
                            tr.wait()
                        };
                        assert_eq!(r.expect("a write").bytes, SLOT);
                    }
                })
            })
            .collect();
        // Meanwhile this thread waits for the server's last write back.
        assert_eq!(note(&ep), base ^ 0xFFFF);
        for w in workers {
            w.join().unwrap();
        }
        let st = ep.rail_stats();
        assert_eq!(st[0].writes, u64::from(THREADS) * WRITES + 1);
        println!(
            "client: {THREADS} threads x {WRITES} writes, each waited for once; {} notifications received",
            st[0].notifications_received
        );
        wait_bye(&ep);
    }
}
