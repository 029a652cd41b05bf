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
//!
//! With `GPUDIRECT_TRANSFER_KEY_FILE` naming a key file (the list's `transfer-tests-key`
//! entry), every engine of the tests before `t9` has that key. `t9`, `t9b` and `t9c` (named to
//! run last) try the endpoints as an attacker would (a peer without the key, with another, replaying a recorded handshake;
//! 200 silent connections; a silent peer against an accept's deadline) and print
//! `SECURITY-...` lines with what each got.

mod support;

use gpudirect::Error;
use gpudirect::rdma::WcStatus;
use gpudirect::transfer::{
    AuthKey, Authentication, Buffer, Direction, Endpoint, Engine, EngineConfig, MemoryDescriptor,
    MemoryPath, PeerAccess, Region, Transfer, TransferOptions,
};
use gpudirect_testing::{Hardware, skip};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

const ACCEPT: Duration = Duration::from_secs(120);
const CONNECT: Duration = Duration::from_secs(90);
const NOTE: Duration = Duration::from_secs(60);

use support::rdma::{Node, node};

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

    /// An engine of `c`, with the key of `GPUDIRECT_TRANSFER_KEY_FILE` when `c` has none.
    fn engine_with(&self, mut c: EngineConfig) -> Engine {
        if c.key.is_none() {
            c.key = AuthKey::from_env("GPUDIRECT_TRANSFER_KEY_FILE").expect("the key file");
        }
        let e = Engine::new(c).expect("engine on this node's rails");
        println!(
            "engine: {}",
            if e.config().key.is_some() {
                Authentication::Key
            } else {
                Authentication::Unauthenticated
            }
        );
        e
    }

    /// An engine with exactly `key` (none: unauthenticated), whatever the environment says.
    fn engine_keyed(&self, key: Option<AuthKey>) -> Engine {
        let mut c = EngineConfig::with_devices(&self.rails);
        c.key = key;
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

/// The server's "checked", then a pause before this side breaks the connection (a write with a
/// revoked rkey, a close): rxe completes the receive before it acknowledges the write, so a
/// break at once can reach the server first and flush its write (as `wait_bye` lingers).
fn wait_ack_then_linger(ep: &Endpoint) {
    wait_ack(ep);
    std::thread::sleep(Duration::from_millis(300));
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

/// Prepared requests posted again and again, each post moving the bytes its source holds then
/// (new random bytes every time, compared exactly): an 8-byte notified write (inline), a
/// 4097-byte write without notification posted twice in a row (the round robin takes each rail
/// once: a set of messages kept per slot), two pairs striped over both rails with a
/// notification, and a read into a poisoned region.
#[test]
fn t5b_prepared_requests_move_new_bytes_at_every_post() {
    let n = two_nodes!();
    let e = n.engine();
    const SIZE: usize = 1 << 20;
    const STRIPE: u64 = 384 << 10;
    const AT_C: u64 = 64 << 10;
    const READ: usize = 100_000;
    const ROUNDS: u64 = 12;
    const PREP_A: u32 = 0xA11;
    const PREP_B: u32 = 0xB22;
    const PREP_C: u32 = 0xC33;
    let k = 14;
    if n.server {
        let target = e.register(Buffer::host(vec![0u8; SIZE]).unwrap()).unwrap();
        let sr = seed();
        let readable = host(&e, &pattern(sr, READ));
        let ep = n.accept(
            &e,
            k,
            &[target.descriptor().unwrap(), readable.descriptor().unwrap()],
        );
        let peer = ep.peer_descriptors()[0];
        say(&ep, &readable, &peer, sr as u32);
        let base = u64::from(note(&ep));
        let check = |at: u64, len: usize, s: u64, what: &str| {
            let mut got = vec![0u8; len];
            target.read_at(at as usize, &mut got).unwrap();
            assert!(got == pattern(s, len), "{what}: the bytes differ");
        };
        for (tag, at, len, off) in [
            (PREP_A, 8, 8, 0),
            (PREP_B, 4096, 4097, 100),
            (PREP_C, AT_C, 2 * STRIPE as usize, 200),
        ] {
            for i in 0..ROUNDS {
                assert_eq!(note(&ep), tag, "round {i} of {tag:#x}");
                check(at, len, base + off + i, &format!("{tag:#x} round {i}"));
                say(&ep, &readable, &peer, ACK);
            }
            println!("server: {ROUNDS} posts of {tag:#x} ({len} bytes) verified");
        }
        wait_bye(&ep);
    } else {
        let scratch = e.register(Buffer::host(vec![0u8; 64]).unwrap()).unwrap();
        let ep = n.connect(&e, k, 2, &[scratch.descriptor().unwrap()]);
        let peer = ep.peer_descriptors();
        let sr = u64::from(note(&ep));
        let base = seed() as u32;
        say(&ep, &scratch, &peer[0], base);
        let base = u64::from(base);
        let sa = host(&e, &[0u8; 8]);
        let sb = host(&e, &[0u8; 4097]);
        let sc = host(&e, &vec![0u8; 2 * STRIPE as usize]);
        let a = ep
            .prepare(
                Direction::Write,
                vec![(sa.all(), peer[0].range(8, 8).unwrap())],
                TransferOptions::notify(PREP_A),
            )
            .unwrap();
        let b = ep
            .prepare(
                Direction::Write,
                vec![(sb.all(), peer[0].range(4096, 4097).unwrap())],
                TransferOptions::default(),
            )
            .unwrap();
        let c = ep
            .prepare(
                Direction::Write,
                vec![
                    (
                        sc.range(0, STRIPE).unwrap(),
                        peer[0].range(AT_C, STRIPE).unwrap(),
                    ),
                    (
                        sc.range(STRIPE, STRIPE).unwrap(),
                        peer[0].range(AT_C + STRIPE, STRIPE).unwrap(),
                    ),
                ],
                TransferOptions::notify(PREP_C),
            )
            .unwrap();
        for i in 0..ROUNDS {
            sa.write_at(0, &pattern(base + i, 8)).unwrap();
            let r = a.run().unwrap();
            assert_eq!((r.bytes, r.messages), (8, 1));
            wait_ack(&ep);
        }
        for i in 0..ROUNDS {
            sb.write_at(0, &pattern(base + 100 + i, 4097)).unwrap();
            // Twice in a row: consecutive requests take the rails in turn.
            let mut rails = Vec::new();
            for _ in 0..2 {
                let r = b.run().unwrap();
                assert_eq!(r.bytes, 4097);
                rails.extend(r.rails_used());
            }
            rails.sort();
            assert_eq!(rails, vec![0, 1], "post pair {i}: one post on each rail");
            say(&ep, &scratch, &peer[0], PREP_B);
            wait_ack(&ep);
        }
        for i in 0..ROUNDS {
            sc.write_at(0, &pattern(base + 200 + i, 2 * STRIPE as usize))
                .unwrap();
            let r = c.run().unwrap();
            assert_eq!(r.bytes, 2 * STRIPE);
            assert_eq!(r.rails_used(), vec![0, 1], "striped over both rails");
            wait_ack(&ep);
        }
        let into = e.register(Buffer::host(vec![0u8; READ]).unwrap()).unwrap();
        let d = ep
            .prepare(
                Direction::Read,
                vec![(into.all(), peer[1].all())],
                TransferOptions::default(),
            )
            .unwrap();
        for i in 0..ROUNDS {
            into.write_at(0, &vec![0xEE; READ]).unwrap();
            assert_eq!(d.run().unwrap().bytes, READ as u64);
            assert!(
                into.to_vec().unwrap() == pattern(sr, READ),
                "read {i}: the bytes differ"
            );
        }
        println!(
            "client: {ROUNDS} posts each of four prepared requests verified; rails {:?}",
            ep.rail_stats()
        );
        bye(&ep, &scratch, &peer[0]);
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
        // The other endpoint carries on, with its own descriptor: with per-peer windows
        // (`PeerAccess`) ep1's names a window that only ep1's queue pair reaches.
        let s = seed() as u32;
        let src2 = host(&e, &pattern(u64::from(s), SIZE));
        let good2 = ep2.peer_descriptors()[0];
        ep2.write(vec![(src2.all(), good2.all())], TransferOptions::notify(s))
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

/// The key of the security tests (both sides make the same).
fn test_key() -> AuthKey {
    AuthKey::from_bytes(b"gpudirect two-node test key, 32B".to_vec()).unwrap()
}

/// A hand-made rails handshake (the engine's wire format, spoken by an attacker through the
/// crate's own `rdma::Connection`): greetings and proofs.
mod hand {
    use gpudirect::rdma::ConnectionBinding;
    use hmac::{Hmac, KeyInit, Mac};

    /// A dialer's greeting: `GDXA`, version 2, role 1, a key flag, the nonce, a group id, rail
    /// 0 of 1, device 0 of 1, 64 credits, 1 MiB messages, generation 0 (a new endpoint).
    pub fn greeting(keyed: bool, nonce: [u8; 32]) -> Vec<u8> {
        let mut b = b"GDXA".to_vec();
        b.extend_from_slice(&2u16.to_le_bytes());
        b.push(1);
        b.push(u8::from(keyed));
        b.extend_from_slice(&nonce);
        b.extend_from_slice(&[0x77; 16]);
        b.extend_from_slice(&[0, 1, 0, 1]);
        b.extend_from_slice(&64u16.to_le_bytes());
        b.extend_from_slice(&(1u32 << 20).to_le_bytes());
        // Not a rail coming back.
        b.extend_from_slice(&0u32.to_le_bytes());
        b
    }

    /// The dialer's proof over both greetings and the connection as the dialer sees it.
    pub fn proof(key: &[u8], mine: &[u8], theirs: &[u8], b: &ConnectionBinding) -> Vec<u8> {
        let mut binding = b.local_qpn.to_le_bytes().to_vec();
        binding.extend_from_slice(&b.peer_qpn.to_le_bytes());
        binding.extend_from_slice(&b.local_gid.0);
        binding.extend_from_slice(&b.peer_gid.0);
        let mut m = <Hmac<sha2::Sha256> as KeyInit>::new_from_slice(key).unwrap();
        m.update(b"gpudirect transfer rails v1");
        m.update(&[1]);
        for part in [mine, theirs, &binding[..]] {
            m.update(&(part.len() as u32).to_le_bytes());
            m.update(part);
        }
        let mut out = b"GDXM".to_vec();
        out.extend_from_slice(&m.finalize().into_bytes());
        out
    }
}

/// A raw rdma_cm connection to `addr`, retried while nobody listens there yet.
fn raw_connect(addr: &str) -> gpudirect::rdma::Connection {
    use std::net::ToSocketAddrs;
    let a = addr.to_socket_addrs().unwrap().next().unwrap();
    let opts = gpudirect::rdma::ConnectOptions {
        timeout: Duration::from_secs(10),
        ..Default::default()
    };
    let until = Instant::now() + CONNECT;
    loop {
        match gpudirect::rdma::Connection::connect(a, &opts) {
            Ok(c) => return c,
            Err(e) if Instant::now() < until => {
                eprintln!("raw connect {addr}: {e}; retrying");
                std::thread::sleep(Duration::from_millis(300));
            }
            Err(e) => panic!("raw connect {addr}: {e}"),
        }
    }
}

/// Peers without the key, with another key, and replaying a recorded handshake are refused,
/// typed, on both sides, and never learn a descriptor; then a peer with the key connects and
/// transfers, and `prepare` refuses a descriptor with the wrong rkey count.
#[test]
fn t9_peers_without_the_key_with_another_or_replaying_are_refused_typed() {
    let n = two_nodes!();
    let port = n.port + 8;
    if n.server {
        let e = n.engine_keyed(Some(test_key()));
        let target = e.register(Buffer::host(vec![0u8; 4096]).unwrap()).unwrap();
        let l = e.listen(&format!("0.0.0.0:{port}")).unwrap();
        let ep = l.accept(&[target.descriptor().unwrap()], ACCEPT).unwrap();
        let refusals = l.take_refusals();
        for r in &refusals {
            println!("SECURITY-ATTACK server refused: {r}");
        }
        let auth = refusals
            .iter()
            .filter(|e| matches!(e, Error::Authentication { .. }))
            .count();
        println!("SECURITY-ATTACK server stats: {:?}", l.stats());
        assert!(
            auth >= 3,
            "no key, another key, the replay: {auth} of {refusals:?}"
        );
        assert_eq!(ep.authentication(), Authentication::Key);
        let s = note(&ep);
        assert!(target.to_vec().unwrap() == pattern(u64::from(s), 4096));
        let peer = ep.peer_descriptors()[0];
        bye(&ep, &target, &peer);
    } else {
        let addr = format!("{}:{port}", n.peers[0]);
        let scratch_of = |e: &Engine| e.register(Buffer::host(vec![0u8; 64]).unwrap()).unwrap();
        // 1. Without a key (retried until the server listens).
        let bare = n.engine_keyed(None);
        let until = Instant::now() + CONNECT;
        let r = loop {
            match bare.connect(&[addr.as_str()], &[scratch_of(&bare).descriptor().unwrap()]) {
                Err(Error::CmEvent { .. }) if Instant::now() < until => {
                    std::thread::sleep(Duration::from_millis(300))
                }
                r => break r,
            }
        };
        println!("SECURITY-ATTACK no-key: {:?}", r.as_ref().err());
        assert!(matches!(r, Err(Error::Authentication { .. })), "{r:?}");
        // 2. Another key.
        let other = n.engine_keyed(Some(
            AuthKey::from_bytes(b"not the key of the two-node test".to_vec()).unwrap(),
        ));
        let r = other.connect(
            &[addr.as_str()],
            &[scratch_of(&other).descriptor().unwrap()],
        );
        println!("SECURITY-ATTACK wrong-key: {:?}", r.as_ref().err());
        assert!(matches!(r, Err(Error::Authentication { .. })), "{r:?}");
        // 3. A handshake recorded (here: made by hand with the key, then dropped after the
        // proofs), replayed on a new connection without the key.
        let key = b"gpudirect two-node test key, 32B";
        let mut c = raw_connect(&addr);
        let mine = hand::greeting(true, [0x42; 32]);
        let theirs = c.exchange_bytes(&mine, Duration::from_secs(10)).unwrap();
        let proof = hand::proof(key, &mine, &theirs, &c.binding());
        let back = c.exchange_bytes(&proof, Duration::from_secs(10)).unwrap();
        assert_eq!(back.len(), 36, "the server's proof");
        drop(c);
        let mut c = raw_connect(&addr);
        let theirs2 = c.exchange_bytes(&mine, Duration::from_secs(10)).unwrap();
        assert_ne!(theirs, theirs2, "the server's nonce is fresh");
        let _ = c.exchange_bytes(&proof, Duration::from_secs(10));
        // What a descriptor message's address would be: the server never sends it.
        let mr = c
            .pd()
            .register(
                gpudirect::rdma::HostBuffer::zeroed(64).unwrap(),
                gpudirect::rdma::AccessFlags::REMOTE_READ,
            )
            .unwrap();
        let r = c.exchange(mr.remote(), Duration::from_secs(8));
        println!("SECURITY-ATTACK replay: the descriptor exchange gave {r:?}");
        assert!(r.is_err(), "a replayed handshake learnt {r:?}");
        drop(c);
        // 4. The key: connected, and a transfer.
        let e = n.engine_keyed(Some(test_key()));
        let scratch = scratch_of(&e);
        let ep = dial(&e, &[addr], &[scratch.descriptor().unwrap()]);
        assert_eq!(ep.authentication(), Authentication::Key);
        let dst = ep.peer_descriptors()[0];
        // prepare: an rkey count that is not the peer's devices is refused there, not at post.
        let keys: Vec<u32> = dst.rkeys().iter().chain(dst.rkeys()).copied().collect();
        let bad = MemoryDescriptor::new(dst.addr(), dst.len(), dst.kind(), &keys).unwrap();
        let src = host(&e, &pattern(9, 4096));
        let p = ep.prepare(
            Direction::Write,
            vec![(src.all(), bad.all())],
            TransferOptions::default(),
        );
        println!(
            "SECURITY-PREPARE rkeys={} -> {:?}",
            keys.len(),
            p.as_ref().err()
        );
        assert!(matches!(
            p,
            Err(Error::InvalidArgument { arg: "pairs", .. })
        ));
        let step = ep
            .prepare(
                Direction::Write,
                vec![(src.all(), dst.all())],
                TransferOptions::notify(9),
            )
            .unwrap();
        step.run().unwrap();
        wait_bye(&ep);
    }
}

/// Resident memory of this process (bytes), from `/proc/self/statm`.
fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = s.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: no arguments.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}

/// Where this process's threads wait, and every task of the node in D state (kernel stacks).
fn dump_tasks() {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    for t in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        let d = t.path().display().to_string();
        println!(
            "TASK {} {} wchan={} stack:\n{}",
            t.file_name().to_string_lossy(),
            read(&format!("{d}/comm")).trim(),
            read(&format!("{d}/wchan")),
            read(&format!("{d}/stack"))
        );
    }
    for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let d = p.path().display().to_string();
        let stat = read(&format!("{d}/stat"));
        if stat.split(") ").nth(1).is_some_and(|r| r.starts_with('D')) {
            println!("DTASK {stat}\n{}", read(&format!("{d}/stack")));
        }
    }
}

/// 200 connections that never say a word, while a good peer connects and transfers within its
/// own deadline; the listener (`max_pending` 32) holds at most that many handshakes (each a
/// queue pair and a little memory) meanwhile, ending the oldest to make room. Prints
/// `SECURITY-FLOOD` lines.
#[test]
fn t9b_a_flood_of_silent_connections_delays_no_good_peer() {
    let n = two_nodes!();
    let port = n.port + 9;
    const FLOOD: usize = 200;
    if n.server {
        // Fewer than the flood holds at once: the oldest unauthenticated ones make room.
        let mut c = EngineConfig::with_devices(&n.rails);
        c.max_pending = 32;
        let e = n.engine_with(c);
        let max = e.config().max_pending;
        let target = e.register(Buffer::host(vec![0u8; 4096]).unwrap()).unwrap();
        let l = std::sync::Arc::new(e.listen(&format!("0.0.0.0:{port}")).unwrap());
        let before = rss();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (l2, stop2) = (l.clone(), stop.clone());
        let sampler = std::thread::spawn(move || {
            let (mut peak_rss, mut peak_pending) = (0u64, 0usize);
            let (t0, mut dumped) = (Instant::now(), false);
            while !stop2.load(std::sync::atomic::Ordering::Acquire) {
                peak_rss = peak_rss.max(rss());
                peak_pending = peak_pending.max(l2.stats().pending);
                if !dumped && t0.elapsed() > Duration::from_secs(20) {
                    // Still here after 20 s: say where every thread (and any task in D state)
                    // waits.
                    dumped = true;
                    println!("SECURITY-FLOOD slow: {:?}", l2.stats());
                    dump_tasks();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            (peak_rss, peak_pending)
        });
        // Short accepts until the good peer's endpoint comes (the peers may start this test
        // at different times): each returns by its own deadline, whatever the flood does.
        let (t0, mut short) = (Instant::now(), 0);
        let ep = loop {
            let t = Instant::now();
            match l.accept(&[target.descriptor().unwrap()], Duration::from_secs(2)) {
                Ok(ep) => break ep,
                Err(Error::Timeout { .. }) => short += 1,
                Err(e) => panic!("accept: {e}"),
            }
            let dt = t.elapsed();
            assert!(dt < Duration::from_secs(3), "a 2 s accept took {dt:?}");
            assert!(t0.elapsed() < ACCEPT, "no good peer: {:?}", l.stats());
        };
        let took = t0.elapsed();
        println!(
            "SECURITY-FLOOD server: the good peer's endpoint after {short} 2 s accepts that timed out"
        );
        let s = note(&ep);
        assert!(target.to_vec().unwrap() == pattern(u64::from(s), 4096));
        let peer = ep.peer_descriptors()[0];
        // The flood goes on after the good peer: keep taking its connections (a listener takes
        // requests only while an accept runs) until the peer says it is over.
        let until = Instant::now() + ACCEPT;
        while ep.next_notification(Duration::ZERO).unwrap().is_none() {
            assert!(
                Instant::now() < until,
                "the flood never ended: {:?}",
                l.stats()
            );
            let t = Instant::now();
            let r = l.accept(&[], Duration::from_secs(1));
            assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
            assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        }
        stop.store(true, std::sync::atomic::Ordering::Release);
        let (peak_rss, peak_pending) = sampler.join().unwrap();
        let st = l.stats();
        let grew = peak_rss.saturating_sub(before);
        println!(
            "SECURITY-FLOOD server accept_ms={} rss_before_kib={} rss_peak_kib={} grew_kib={} \
             peak_pending={} (sampled {peak_pending}) max_pending={max} per_pending_kib={} \
             stats={st:?}",
            took.as_millis(),
            before >> 10,
            peak_rss >> 10,
            grew >> 10,
            st.peak_pending,
            (grew >> 10) / st.peak_pending.max(1) as u64,
        );
        assert!(st.peak_pending <= max, "{st:?}");
        // Each pending handshake: one queue pair with its CQs (rxe maps their rings into the
        // process), its thread (stack, malloc arena) and a few KiB; 512 KiB each covers them.
        assert!(
            grew <= max as u64 * (512 << 10),
            "the listener grew {} KiB under the flood",
            grew >> 10
        );
        bye(&ep, &target, &peer);
        drop(ep);
        let st = l.stats();
        println!("SECURITY-FLOOD server after: {st:?}");
    } else {
        let addr = format!("{}:{port}", n.peers[0]);
        let (tx, rx) = std::sync::mpsc::channel::<usize>();
        let a2 = addr.clone();
        let flood = std::thread::spawn(move || {
            let mut held = Vec::new();
            let (mut ok, mut failed) = (0, 0);
            for i in 0..FLOOD {
                let c = if i == 0 {
                    Ok(raw_connect(&a2))
                } else {
                    use std::net::ToSocketAddrs;
                    let a = a2.to_socket_addrs().unwrap().next().unwrap();
                    let opts = gpudirect::rdma::ConnectOptions {
                        timeout: Duration::from_secs(5),
                        ..Default::default()
                    };
                    gpudirect::rdma::Connection::connect(a, &opts)
                };
                match c {
                    Ok(c) => {
                        ok += 1;
                        held.push(c);
                    }
                    Err(_) => failed += 1,
                }
                let _ = tx.send(i);
            }
            (ok, failed, held)
        });
        // The good peer comes once the flood is a quarter through.
        while rx.recv().unwrap() < FLOOD / 4 {}
        let e = n.engine();
        let scratch = host(&e, &pattern(1, 64));
        let t0 = Instant::now();
        let ep = e
            .connect(&[addr.as_str()], &[scratch.descriptor().unwrap()])
            .expect("the good peer connects within its connect timeout");
        let took = t0.elapsed();
        let dst = ep.peer_descriptors()[0];
        let s = seed() as u32;
        let src = host(&e, &pattern(u64::from(s), 4096));
        let t1 = Instant::now();
        ep.write(
            vec![(src.all(), dst.range(0, 4096).unwrap())],
            TransferOptions::notify(s).deadline(Duration::from_secs(10)),
        )
        .unwrap()
        .wait()
        .expect("the good peer's transfer within its deadline");
        println!(
            "SECURITY-FLOOD client good_connect_ms={} transfer_ms={} connect_timeout_ms={}",
            took.as_millis(),
            t1.elapsed().as_millis(),
            e.config().connect_timeout.as_millis()
        );
        assert!(took < e.config().connect_timeout);
        let (ok, failed, held) = flood.join().unwrap();
        println!(
            "SECURITY-FLOOD client silent connections: {ok} made, {failed} refused or timed out"
        );
        drop(held);
        // The flood is over.
        say(&ep, &scratch, &dst, ACK);
        wait_bye(&ep);
    }
}

/// `accept(&[], 2 s)` while a silent peer's handshake is pending returns at its own deadline;
/// the silent peer's handshake ends at `handshake_timeout`.
#[test]
fn t9c_accept_returns_by_its_own_deadline_whatever_a_silent_peer_does() {
    let n = two_nodes!();
    let port = n.port + 10;
    if n.server {
        let e = n.engine();
        let l = e.listen(&format!("0.0.0.0:{port}")).unwrap();
        let until = Instant::now() + ACCEPT;
        while l.stats().pending == 0 {
            assert!(Instant::now() < until, "the silent peer never came");
            let _ = l.accept(&[], Duration::from_millis(200));
        }
        let t0 = Instant::now();
        let r = l.accept(&[], Duration::from_secs(2));
        let took = t0.elapsed();
        println!(
            "SECURITY-DEADLINE accept(&[], 2 s) with a silent peer pending: {:?} after {took:?}",
            r.as_ref().err()
        );
        assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
        assert!(
            took >= Duration::from_secs(2) && took < Duration::from_secs(3),
            "{took:?}"
        );
        // The silent peer's handshake ends by itself.
        let t = Instant::now();
        while l.stats().pending > 0 {
            assert!(
                t.elapsed() < e.config().handshake_timeout * 2,
                "{:?}",
                l.stats()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        println!("SECURITY-DEADLINE after: {:?}", l.stats());
        assert!(l.stats().timed_out >= 1);
    } else {
        let c = raw_connect(&format!("{}:{port}", n.peers[0]));
        std::thread::sleep(Duration::from_secs(8));
        drop(c);
    }
}

/// Several threads on one endpoint wait at once, blocking and awaited, while another waits for
/// a notification, in both directions; waits spin briefly (200 µs, shorter than a round trip
/// here), so the waiting threads poll the completion queues themselves, take that over from
/// each other, and hand it back to the progress thread. Every request ends once with its bytes,
/// every notification arrives once.
#[test]
fn t8b_many_waiting_threads_share_the_polling() {
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
        let ep = n.accept(&e, 11, &[target.descriptor().unwrap()]);
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
        let ep = n.connect(&e, 11, 1, &[scratch.descriptor().unwrap()]);
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

/// Per-peer windows, revoked at close: the server (`PeerAccess::Windows`) publishes a target to
/// endpoint A, which writes through it; A closes. Then the client writes with A's old
/// descriptor (its window's rkey) through endpoint B (another queue pair of the same engine) and
/// through a fresh A': each gets a remote access error, and no byte of the target changes. B's
/// own descriptor still writes.
#[test]
fn t9d_a_closed_peers_window_rkeys_reach_nothing() {
    let n = two_nodes!();
    const SIZE: usize = 64 << 10;
    let k = 12;
    if n.server {
        let mut c = EngineConfig::with_devices(&n.rails);
        c.peer_access = PeerAccess::Windows;
        let e = n.engine_with(c);
        let target = host(&e, &pattern(seed(), SIZE));
        let d = target.descriptor().unwrap();
        let l = e
            .listen(&format!("0.0.0.0:{}", n.port + k))
            .expect("listen");
        let a = l.accept(&[d], ACCEPT).expect("accept A");
        assert_eq!(a.peer_access(), Some(PeerAccess::Windows));
        let s = note(&a);
        assert!(
            target.to_vec().unwrap() == pattern(u64::from(s), SIZE),
            "A's bytes differ"
        );
        say(&a, &target, &a.peer_descriptors()[0], ACK);
        // A closes: its windows go with it.
        let until = Instant::now() + NOTE;
        while a.failure().is_none() {
            assert!(Instant::now() < until, "A never ended");
            let _ = a.next_notification(Duration::from_millis(100));
        }
        let stats = e.window_stats();
        println!(
            "SECURITY-WINDOWS after A closed: {stats:?}, A: {:?}",
            a.failure()
        );
        assert!(stats.bound >= 1 && stats.revoked >= 1, "{stats:?}");
        drop(a);
        let b = l.accept(&[d], ACCEPT).expect("accept B");
        let s = note(&b);
        assert!(
            target.to_vec().unwrap() == pattern(u64::from(s), SIZE),
            "B's bytes differ"
        );
        let before = target.to_vec().unwrap();
        say(&b, &target, &b.peer_descriptors()[0], ACK);
        // The client's writes with A's old rkeys come now, through B and through A'.
        let a2 = l.accept(&[d], ACCEPT).expect("accept A'");
        say(&a2, &target, &a2.peer_descriptors()[0], ACK);
        let last = l.accept(&[d], ACCEPT).expect("accept the last endpoint");
        let changed = target
            .to_vec()
            .unwrap()
            .iter()
            .zip(&before)
            .filter(|(x, y)| x != y)
            .count();
        println!(
            "SECURITY-WINDOWS old rkeys through B and A': {changed} byte(s) changed; B: {:?}; A': {:?}; {:?}",
            b.failure(),
            a2.failure(),
            e.window_stats()
        );
        assert_eq!(changed, 0, "a revoked window's rkey changed bytes");
        let peer = last.peer_descriptors()[0];
        bye(&last, &target, &peer);
        drop((b, a2));
    } else {
        let e = n.engine();
        let scratch = e.register(Buffer::host(vec![0u8; 64]).unwrap()).unwrap();
        let publish = [scratch.descriptor().unwrap()];
        let refused = |ep: &Endpoint, src: &Region, old: &MemoryDescriptor, what: &str| {
            let r = ep
                .write(
                    vec![(src.all(), old.all())],
                    TransferOptions::default().deadline(Duration::from_secs(20)),
                )
                .unwrap()
                .wait();
            println!("SECURITY-WINDOWS client: A's old rkeys through {what}: {r:?}");
            match r {
                Err(Error::WorkCompletion { status, .. }) => {
                    assert_eq!(status, WcStatus::RemoteAccess, "{what}")
                }
                other => panic!("A's old rkeys through {what} gave {other:?}"),
            }
        };
        let a = n.connect(&e, k, 1, &publish);
        let old = a.peer_descriptors()[0];
        let s = seed() as u32;
        let src = host(&e, &pattern(u64::from(s), SIZE));
        a.write(vec![(src.all(), old.all())], TransferOptions::notify(s))
            .unwrap()
            .wait()
            .expect("A writes through its window");
        wait_ack_then_linger(&a);
        drop(a);
        let b = n.connect(&e, k, 1, &publish);
        let mine = b.peer_descriptors()[0];
        assert_ne!(mine.rkeys(), old.rkeys(), "B got a window of its own");
        let s = seed() as u32 ^ 1;
        let src = host(&e, &pattern(u64::from(s), SIZE));
        b.write(vec![(src.all(), mine.all())], TransferOptions::notify(s))
            .unwrap()
            .wait()
            .expect("B writes through its own window");
        wait_ack_then_linger(&b);
        let evil = host(&e, &pattern(seed() ^ 0xbad, SIZE));
        refused(&b, &evil, &old, "B");
        let a2 = n.connect(&e, k, 1, &publish);
        // Only once the server has accepted it (a write that breaks the connection while the
        // server still reads the client's descriptor message would end its handshake instead).
        wait_ack_then_linger(&a2);
        refused(&a2, &evil, &old, "a fresh A'");
        let last = n.connect(&e, k, 1, &publish);
        wait_bye(&last);
        drop((b, a2));
    }
}

/// Windows on both rails, and `Endpoint::grant`: the server (`PeerAccess::Windows`) publishes a
/// target to a two-rail endpoint A (whose client, under `Auto`, gets windows too); a striped
/// write lands exactly, both rails carrying bytes. The server grants A a second region and
/// hands A the descriptor through a write; A writes through it. A closes. Then the client
/// writes with A's old descriptor through a fresh two-rail endpoint, and with the granted one
/// through another: each gets a remote access error, and no byte of either region changes.
#[test]
fn t9e_windows_on_every_rail_and_a_granted_region_go_with_the_endpoint() {
    let n = two_nodes!();
    const SIZE: usize = 4 << 20;
    const GRANTED: usize = 64 << 10;
    /// Where the granted descriptor's bytes land in the client's scratch (`say` writes byte 0).
    const AT: u64 = 64;
    let k = 13;
    if n.server {
        let mut c = EngineConfig::with_devices(&n.rails);
        c.peer_access = PeerAccess::Windows;
        let e = n.engine_with(c);
        let target = host(&e, &pattern(seed(), SIZE));
        let g = host(&e, &pattern(seed() ^ 0x77, GRANTED));
        let d = target.descriptor().unwrap();
        let l = e
            .listen(&format!("0.0.0.0:{}", n.port + k))
            .expect("listen");
        let a = l.accept(&[d], ACCEPT).expect("accept A");
        assert_eq!((a.rails(), a.peer_access()), (2, Some(PeerAccess::Windows)));
        let s = note(&a);
        assert!(
            target.to_vec().unwrap() == pattern(u64::from(s), SIZE),
            "the striped write's bytes differ"
        );
        let peer = a.peer_descriptors()[0];
        let granted = a.grant(&g).expect("grant");
        let own = g.descriptor().unwrap();
        println!(
            "SECURITY-WINDOWS t9e granted {:x?} over a region of rkeys {:x?}",
            granted.rkeys(),
            own.rkeys()
        );
        assert_eq!((granted.addr(), granted.len()), (own.addr(), own.len()));
        assert!(granted.rkeys().iter().all(|&k| k != 0));
        assert_ne!(granted.rkeys()[0], granted.rkeys()[1]);
        let bytes = granted.to_bytes();
        let m = host(&e, &bytes);
        a.write(
            vec![(m.all(), peer.range(AT, bytes.len() as u64).unwrap())],
            TransferOptions::notify(bytes.len() as u32),
        )
        .unwrap()
        .wait()
        .expect("the granted descriptor sent");
        let s = note(&a);
        assert!(
            g.to_vec().unwrap() == pattern(u64::from(s), GRANTED),
            "the granted region's bytes differ"
        );
        say(&a, &target, &peer, ACK);
        let until = Instant::now() + NOTE;
        while a.failure().is_none() {
            assert!(Instant::now() < until, "A never ended");
            let _ = a.next_notification(Duration::from_millis(100));
        }
        let stats = e.window_stats();
        println!("SECURITY-WINDOWS t9e after A closed: {stats:?}");
        // Two rails: a window each for the published target and for the granted region.
        assert!(stats.bound >= 4 && stats.revoked >= 4, "{stats:?}");
        drop(a);
        let (before, before_g) = (target.to_vec().unwrap(), g.to_vec().unwrap());
        let b = l.accept(&[d], ACCEPT).expect("accept B");
        say(&b, &target, &b.peer_descriptors()[0], ACK);
        let b2 = l.accept(&[d], ACCEPT).expect("accept B2");
        say(&b2, &target, &b2.peer_descriptors()[0], ACK);
        let last = l.accept(&[d], ACCEPT).expect("accept the last endpoint");
        let changed =
            |now: Vec<u8>, was: &[u8]| now.iter().zip(was).filter(|(x, y)| x != y).count();
        let (ct, cg) = (
            changed(target.to_vec().unwrap(), &before),
            changed(g.to_vec().unwrap(), &before_g),
        );
        println!(
            "SECURITY-WINDOWS t9e old rkeys through B and B2: {ct} + {cg} byte(s) changed; B: {:?}; B2: {:?}; {:?}",
            b.failure(),
            b2.failure(),
            e.window_stats()
        );
        assert_eq!((ct, cg), (0, 0), "a revoked window's rkey changed bytes");
        let peer = last.peer_descriptors()[0];
        bye(&last, &target, &peer);
        drop((b, b2));
    } else {
        let e = n.engine();
        let scratch = e.register(Buffer::host(vec![0u8; 256]).unwrap()).unwrap();
        let publish = [scratch.descriptor().unwrap()];
        let refused = |ep: &Endpoint, src: &Region, old: &MemoryDescriptor, what: &str| {
            let r = ep
                .write(
                    vec![(src.all(), old.range(0, src.len() as u64).unwrap())],
                    TransferOptions::default().deadline(Duration::from_secs(20)),
                )
                .unwrap()
                .wait();
            println!("SECURITY-WINDOWS t9e client: A's old rkeys through {what}: {r:?}");
            match r {
                Err(Error::WorkCompletion { status, .. }) => {
                    assert_eq!(status, WcStatus::RemoteAccess, "{what}")
                }
                other => panic!("A's old rkeys through {what} gave {other:?}"),
            }
        };
        let a = n.connect(&e, k, 2, &publish);
        // Auto on two rails through two devices: windows.
        assert_eq!(a.peer_access(), Some(PeerAccess::Windows));
        let old = a.peer_descriptors()[0];
        println!("client: A's descriptor rkeys {:x?}", old.rkeys());
        assert!(old.rkeys().iter().all(|&k| k != 0));
        assert_ne!(old.rkeys()[0], old.rkeys()[1], "a window per rail");
        let s = seed() as u32;
        let src = host(&e, &pattern(u64::from(s), SIZE));
        let r = a
            .write(vec![(src.all(), old.all())], TransferOptions::notify(s))
            .unwrap()
            .wait()
            .expect("A writes through its windows on both rails");
        let st = a.rail_stats();
        println!("client: t9e striped per rail {:?}", r.rail_bytes);
        assert_eq!(r.rails_used(), vec![0, 1], "both rails carry bytes");
        assert!(st[0].bytes_written > 0 && st[1].bytes_written > 0);
        let len = note(&a) as usize;
        let got = scratch.to_vec().unwrap();
        let granted = MemoryDescriptor::from_bytes(&got[AT as usize..AT as usize + len])
            .expect("the granted descriptor");
        let s = seed() as u32 ^ 1;
        let gsrc = host(&e, &pattern(u64::from(s), GRANTED));
        a.write(
            vec![(gsrc.all(), granted.all())],
            TransferOptions::notify(s),
        )
        .unwrap()
        .wait()
        .expect("A writes through the granted windows");
        wait_ack_then_linger(&a);
        drop(a);
        let b = n.connect(&e, k, 2, &publish);
        // Only once the server has accepted it (as in t9d).
        wait_ack_then_linger(&b);
        let evil = host(&e, &pattern(seed() ^ 0xbad, SIZE));
        refused(&b, &evil, &old, "a fresh B");
        let b2 = n.connect(&e, k, 2, &publish);
        wait_ack_then_linger(&b2);
        let evil = host(&e, &pattern(seed() ^ 0xbad2, GRANTED));
        refused(&b2, &evil, &granted, "a fresh B2 (the granted descriptor)");
        let last = n.connect(&e, k, 1, &publish);
        wait_bye(&last);
        drop((b, b2));
    }
}
