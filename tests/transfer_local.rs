//! Tier 2 (a GPU node, no NIC): the transfer engine inside one node. The test re-executes its own
//! binary as the peer process (`TRANSFER_LOCAL_CHILD` set), on GPU 1 when there are two GPUs and
//! on GPU 0 otherwise; the two meet over a Unix socket with engines without rails, and bytes move
//! through CUDA IPC:
//!
//! - writes of random bytes at 4 KiB, 1 MiB + 7 and 64 MiB into poisoned peer memory, each with
//!   a notification the peer checks the bytes at, in order; reads of the peer's random bytes into
//!   poisoned local memory; all compared exactly;
//! - prepared requests (`Endpoint::prepare`): a read posted once and twice at once into poisoned
//!   memory, run on the caller's thread (alone, behind a post, with a deadline under 100 ms), a
//!   write posted or run with fresh random bytes each time and read back, all exact; posts and
//!   runs refused once the endpoint failed, posts once it is gone;
//! - 200 small writes queued at once, each notified after its own bytes; the peer's allocations
//!   opened once each however many requests use them (`CacheCounters::imports_opened`);
//! - the path each report gives (NVLink between two GPUs joined by NVLink, the same device with
//!   one GPU);
//! - a remote range past the peer's real allocation refused before any copy; a deadline that
//!   passes ending the request with `Error::Timeout`;
//! - a peer killed while writes run: a typed error, no hang;
//! - 32 writes of 256 MiB queued at once: the first, waited for, is done while the last still
//!   runs; the bytes read back exactly;
//! - with the copy kernel, and again with the copy graphs (the default), 600 requests made at once on one thread (writes and reads of random,
//!   overlapping ranges of the peer's area, most small and aligned so that they wait for a
//!   gather launch, some not, some the same write twice, some of 2 to 80 pairs into disjoint
//!   slots, queued in launches of their own), then dropped, made `InFlight` or
//!   waited for: the area and what the reads brought compared exactly with the same requests
//!   applied on the host in order; a gathered write only polled finishes; a prepared write run
//!   while writes of the same bytes wait lands after them (50 rounds, read back); one that
//!   waits with a 30 ms deadline, left alone 150 ms, ends done; requests left waiting when the
//!   endpoint goes end without a hang;
//! - stream-ordered requests (`write_on`, `read_on`) with the copy kernel, with the copy graphs
//!   (the default) and with a copy call per piece: a write behind the copies that fill its
//!   source, a read released by its word on another stream, reads of many shapes, of 40 pairs
//!   and on 20 streams, all into poisoned memory and compared exactly; refused under capture;
//! - a reconnect while 1,024 long writes run: later notified writes of the same bytes, from a
//!   lane that existed and from one made after the reconnect, land after the ended writes'
//!   copies (checked at each notification and at the end);
//! - VMM memory (`VmmBuffer`): the peer publishes a one-chunk buffer and a range inside chunk 1
//!   of a two-chunk one (their file descriptors cross the socket when the endpoints meet);
//!   random bytes written into each (checked by the peer at each notification) and read back
//!   into poisoned memory, compared exactly, each export mapped once, the path as above; the
//!   whole of a two-chunk buffer has no IPC part, saying why;
//! - pool memory (an `IpcPool`'s `PoolAlloc`s): the peer publishes one allocation and a range at
//!   an odd offset inside a second allocation of the same pool (the pool's file descriptor
//!   crosses once when the endpoints meet); random bytes written into each (checked by the peer
//!   at each notification) and read back into poisoned memory, compared exactly, the pool
//!   imported once and each pointer once, the path as above; memory of the device's default
//!   pool has no IPC part, saying why.
//!
//! Without a GPU each test prints `SKIPPED` (a failure when `GPUDIRECT_REQUIRE` names `gpu`).

mod support;

use gpudirect::Error;
use gpudirect::memory::{DeviceMemory, VmmBuffer};
use gpudirect::p2p::{Interconnect, IpcPool, LinkMatrix};
use gpudirect::transfer::{
    Buffer, Direction, Endpoint, Engine, EngineConfig, IpcKind, IpcLink, IpcPart, LocalListener,
    LocalRange, MemoryDescriptor, MemoryPath, Region, RemoteRange, TransferOptions,
};
use gpudirect_testing::{Hardware, require};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};
use support::gpu::{self, ToHost, device_bytes, poisoned_bytes, random_u32};

const CHILD: &str = "TRANSFER_LOCAL_CHILD";
const SIZES: [usize; 3] = [4096, (1 << 20) + 7, 64 << 20];
const SLOTS: usize = 200;
const SLOT: usize = 4096;
const WAIT: Duration = Duration::from_secs(60);

#[derive(serde::Serialize, serde::Deserialize)]
struct Job {
    role: String,
    socket: PathBuf,
    seed: u64,
    device: usize,
}

/// `n` random bytes from `seed`.
fn bytes(n: usize, seed: u64) -> Vec<u8> {
    random_u32(n.div_ceil(4), seed)
        .into_iter()
        .flat_map(u32::to_le_bytes)
        .take(n)
        .collect()
}

/// The bytes small write `k` carries.
fn slot(k: usize) -> Vec<u8> {
    bytes(SLOT, 0x5107 + k as u64)
}

fn socket(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("gpudirect-{name}-{}.sock", std::process::id()))
}

fn spawn_child(test: &str, job: &Job) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, serde_json::to_string(job).unwrap())
        .spawn()
        .unwrap()
}

/// A child process running `test` as `role` (with `seed`, on GPU `device`), dialing the
/// socket `name`: the listener (kept until the test ends, with its socket file) and the child.
fn start_child(
    engine: &Engine,
    name: &str,
    test: &str,
    role: &str,
    seed: u64,
    device: usize,
) -> (LocalListener, std::process::Child) {
    let path = socket(name);
    let _ = std::fs::remove_file(&path);
    let listener = engine.listen_local(&path).unwrap();
    let job = Job {
        role: role.into(),
        socket: path,
        seed,
        device,
    };
    (listener, spawn_child(test, &job))
}

/// [`start_child`], and the endpoint accepted from it (publishing nothing).
fn meet_child(
    engine: &Engine,
    name: &str,
    test: &str,
    role: &str,
    seed: u64,
    device: usize,
) -> (LocalListener, Endpoint, std::process::Child) {
    let (listener, child) = start_child(engine, name, test, role, seed, device);
    let ep = listener.accept(&[], WAIT).unwrap();
    (listener, ep, child)
}

fn register(engine: &Engine, b: gpudirect::memory::DeviceBuffer<u8>) -> Region {
    engine.register(Buffer::device(b).unwrap()).unwrap()
}

fn host_copy(r: &Region, offset: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    r.copy_to_host(offset, &mut v).unwrap();
    v
}

fn same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i}: got {:#04x}, want {:#04x}",
            got[i], want[i]
        );
    }
}

/// The path every pair between our GPU 0 and the peer's GPU `d` must report.
fn expected_link(d: usize) -> Option<IpcLink> {
    if d == 0 {
        return Some(IpcLink::SameDevice);
    }
    match LinkMatrix::probe().ok()?.link(0, d)?.interconnect {
        Interconnect::Nvlink { links, .. } => Some(IpcLink::Nvlink { links }),
        Interconnect::Pcie { .. } => Some(IpcLink::Pcie),
        _ => None,
    }
}

/// The path every intra-node copy to device `device` must report, as a check.
fn path_checker(device: usize) -> impl Fn(&MemoryPath) {
    let want = expected_link(device).map(|link| MemoryPath::CudaIpc { link });
    move |p: &MemoryPath| {
        println!("path: {p}");
        match &want {
            Some(w) => assert_eq!(p, w),
            None => assert!(
                matches!(p, MemoryPath::CudaIpc { link } if *link != IpcLink::SameDevice),
                "{p}"
            ),
        }
    }
}

/// Write random bytes (seed `seed ^ (base + i)` for range `i`) into each of the peer's ranges,
/// notified with its index (the peer checks them), then read each back into poisoned memory and
/// compare exactly.
fn write_and_read_back(
    engine: &Engine,
    ep: &Endpoint,
    peer: &[MemoryDescriptor],
    seed: u64,
    base: u64,
    what: &str,
    check_path: &impl Fn(&MemoryPath),
) {
    for (i, d) in peer.iter().enumerate() {
        let len = d.len() as usize;
        let data = bytes(len, seed ^ (base + i as u64));
        let src = register(engine, device_bytes(0, &data));
        let w = ep
            .write(
                vec![(src.all(), d.all())],
                TransferOptions::notify(i as u32),
            )
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!((w.bytes, w.notified), (len as u64, Some(i as u32)));
        check_path(&w.paths[0]);
        let back = register(engine, poisoned_bytes(0, len, 0xC3));
        let r = ep
            .read(vec![(back.all(), d.all())], TransferOptions::default())
            .unwrap()
            .wait()
            .unwrap();
        check_path(&r.paths[0]);
        same(
            &host_copy(&back, 0, len),
            &data,
            &format!("read back from {what} memory"),
        );
        println!(
            "{what} {len} B: write {:.2} GB/s, read {:.2} GB/s",
            w.gbps(),
            r.gbps()
        );
    }
}

/// The peer's side of [`write_and_read_back`]: region `i`'s `len` bytes checked exactly at
/// notification `i` (seed `seed ^ (base + i)`), then the closing notification (tag 99), then
/// until the other side hangs up.
fn check_at_notifications(
    ep: &Endpoint,
    regions: &[(&Region, usize)],
    seed: u64,
    base: u64,
    what: &str,
) {
    let next = |ep: &Endpoint| ep.next_notification(WAIT).unwrap().expect("a notification");
    for (i, &(r, len)) in regions.iter().enumerate() {
        assert_eq!(next(ep).tag, i as u32, "in order");
        same(
            &host_copy(r, 0, len),
            &bytes(len, seed ^ (base + i as u64)),
            &format!("written into {what} memory before its notification"),
        );
    }
    assert_eq!(next(ep).tag, 99);
    until_hung_up(ep);
}

/// Read notifications until the other side hangs up (its endpoint dropped: a typed error),
/// failing if that takes more than twice [`WAIT`] or another notification comes.
fn until_hung_up(ep: &Endpoint) {
    let t = Instant::now();
    loop {
        match ep.next_notification(WAIT) {
            Err(e) => {
                println!("peer: the other side went: {e}");
                break;
            }
            Ok(None) => assert!(t.elapsed() < WAIT * 2, "never hung up"),
            Ok(Some(n)) => panic!("unexpected {n:?}"),
        }
    }
}

/// The closing notified write (tag 99, `first` into the peer's first byte, which its checks
/// already passed), then the endpoint dropped and the peer's exit checked.
fn done_with_peer(
    engine: &Engine,
    ep: Endpoint,
    peer0: &MemoryDescriptor,
    first: Vec<u8>,
    mut child: std::process::Child,
) {
    let src = register(engine, device_bytes(0, &first));
    ep.write(
        vec![(src.all(), peer0.range(0, first.len() as u64).unwrap())],
        TransferOptions::notify(99),
    )
    .unwrap()
    .wait()
    .unwrap();
    drop(ep);
    let status = child.wait().unwrap();
    assert!(status.success(), "peer failed: {status:?}");
}

#[test]
fn local_writes_reads_and_notifications_between_two_processes() {
    if let Ok(job) = std::env::var(CHILD) {
        return peer(serde_json::from_str(&job).unwrap());
    }
    let n = require!(Hardware::Gpu, gpu::gpus());
    let seed = gpu::seed_from("TRANSFER_LOCAL_SEED");
    let device = if n > 1 { 1 } else { 0 };
    let engine = Engine::new(EngineConfig::local()).unwrap();
    let (_listener, ep, mut child) = meet_child(
        &engine,
        "local",
        "local_writes_reads_and_notifications_between_two_processes",
        "peer",
        seed,
        device,
    );
    assert_eq!(ep.rails(), 0);
    assert!(ep.rail_stats().is_empty());
    let peer = ep.peer_descriptors();
    assert_eq!(peer.len(), 7, "3 destinations, 3 sources, the slots");
    assert!(
        peer.iter()
            .all(|d| d.ipc().is_some() && d.rkeys().is_empty())
    );
    let check_path = path_checker(device);

    // Writes, each notified: the peer checks the bytes at each notification, in order.
    for (i, &len) in SIZES.iter().enumerate() {
        let src = register(&engine, device_bytes(0, &bytes(len, seed ^ i as u64)));
        let r = ep
            .write(
                vec![(src.all(), peer[i].all())],
                TransferOptions::notify(i as u32),
            )
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!((r.bytes, r.notified), (len as u64, Some(i as u32)));
        assert!(r.rail_bytes.is_empty());
        check_path(&r.paths[0]);
        println!("write {len} B: {:.2} GB/s", r.gbps());
    }
    // Reads of the peer's random bytes into poisoned memory, awaited once as a future.
    for (i, &len) in SIZES.iter().enumerate() {
        let dst = register(&engine, poisoned_bytes(0, len, 0xC3));
        let t = ep
            .read(
                vec![(dst.all(), peer[3 + i].all())],
                TransferOptions::default(),
            )
            .unwrap();
        let r = if i == 1 {
            futures_block_on(std::future::IntoFuture::into_future(t)).unwrap()
        } else {
            t.wait().unwrap()
        };
        check_path(&r.paths[0]);
        same(
            &host_copy(&dst, 0, len),
            &bytes(len, seed ^ (100 + i as u64)),
            "read",
        );
        println!("read {len} B: {:.2} GB/s", r.gbps());
    }
    // Reads nobody waits for blocking: polled, made an InFlight, dropped. Each still finishes
    // (the worker looks once the transfer is polled, made an InFlight or dropped).
    let dsts: Vec<Region> = SIZES
        .iter()
        .map(|&len| register(&engine, poisoned_bytes(0, len, 0x5A)))
        .collect();
    // Pair `i`'s read of the peer's random bytes into `into[i]`.
    let read = |into: &[Region], i: usize| {
        ep.read(
            vec![(into[i].all(), peer[3 + i].all())],
            TransferOptions::default(),
        )
        .unwrap()
    };
    let polled = read(&dsts, 0);
    poll_until_complete(&polled, "a polled read");
    polled.wait().unwrap();
    let in_flight = read(&dsts, 1).into_in_flight();
    in_flight.wait_timeout(WAIT).ok().unwrap().result().unwrap();
    drop(read(&dsts, 2));
    // The same behind a read in flight on this thread's lane (each finished only after it, in
    // order): polled, made an InFlight, dropped, then the first waited for.
    let behind: Vec<Region> = SIZES
        .iter()
        .map(|&len| register(&engine, poisoned_bytes(0, len, 0x6B)))
        .collect();
    let first = read(&behind, 2);
    let polled = read(&behind, 0);
    let in_flight = read(&behind, 1).into_in_flight();
    poll_until_complete(&polled, "a polled read behind another");
    polled.wait().unwrap();
    in_flight.wait_timeout(WAIT).ok().unwrap().result().unwrap();
    drop(read(&behind, 0));
    first.wait().unwrap();
    // Prepared requests: a read posted once, then twice at once, each time into poisoned
    // memory; a write posted with fresh random bytes each time, read back exactly.
    let len = SIZES[1];
    let back = register(&engine, poisoned_bytes(0, len, 0x3C));
    let prepared_read = ep
        .prepare(
            Direction::Read,
            vec![(back.all(), peer[4].all())],
            TransferOptions::default(),
        )
        .unwrap();
    assert_eq!(
        (prepared_read.bytes(), prepared_read.direction()),
        (len as u64, Direction::Read)
    );
    // The peer's random bytes exactly, then poisoned again for the next read.
    let read_exactly = |what: &str| {
        same(&host_copy(&back, 0, len), &bytes(len, seed ^ 101), what);
        back.copy_from_host(0, &vec![0x3C; len]).unwrap();
    };
    for posts in 1..=2 {
        let ts: Vec<_> = (0..posts).map(|_| prepared_read.post().unwrap()).collect();
        for t in ts {
            let r = t.wait().unwrap();
            assert_eq!(r.bytes, len as u64);
            check_path(&r.paths[0]);
        }
        read_exactly("prepared read");
    }
    // Run on this thread (waited for with a stream synchronize), then with a request of the
    // endpoint still in flight and with a deadline under 100 ms (both: post and wait).
    let r = prepared_read.run().unwrap();
    assert_eq!((r.bytes, r.messages), (len as u64, 1));
    check_path(&r.paths[0]);
    read_exactly("run");
    let pending = prepared_read.post().unwrap();
    check_path(&prepared_read.run().unwrap().paths[0]);
    pending.wait().unwrap();
    read_exactly("run behind a post");
    let short = ep
        .prepare(
            Direction::Read,
            vec![(back.all(), peer[4].all())],
            TransferOptions::default().deadline(Duration::from_millis(50)),
        )
        .unwrap();
    check_path(&short.run().unwrap().paths[0]);
    read_exactly("run, short deadline");
    let small = SIZES[0];
    let out = register(&engine, poisoned_bytes(0, small, 0x77));
    let check = register(&engine, poisoned_bytes(0, small, 0x3C));
    let prepared_write = ep
        .prepare(
            Direction::Write,
            vec![(out.all(), peer[3].all())],
            TransferOptions::default(),
        )
        .unwrap();
    let read_back = ep
        .prepare(
            Direction::Read,
            vec![(check.all(), peer[3].all())],
            TransferOptions::default(),
        )
        .unwrap();
    for k in 0..3u64 {
        let want = bytes(small, seed ^ (300 + k));
        out.copy_from_host(0, &want).unwrap();
        if k == 1 {
            check_path(&prepared_write.run().unwrap().paths[0]);
            read_back.run().unwrap();
        } else {
            check_path(&prepared_write.post().unwrap().wait().unwrap().paths[0]);
            read_back.post().unwrap().wait().unwrap();
        }
        same(&host_copy(&check, 0, small), &want, "prepared write");
        check.copy_from_host(0, &vec![0x3C; small]).unwrap();
    }
    // A later notified write finishes after it (requests finish in order).
    let one = register(&engine, device_bytes(0, &[7u8; 8]));
    ep.write(
        vec![(one.all(), peer[6].range(0, 8).unwrap())],
        TransferOptions::notify(998),
    )
    .unwrap()
    .wait()
    .unwrap();
    for (i, &len) in SIZES.iter().enumerate() {
        same(
            &host_copy(&dsts[i], 0, len),
            &bytes(len, seed ^ (100 + i as u64)),
            "unwaited read",
        );
        same(
            &host_copy(&behind[i], 0, len),
            &bytes(len, seed ^ (100 + i as u64)),
            "unwaited read behind another",
        );
    }
    assert_eq!(
        engine.cache_stats().imports_opened,
        7,
        "each peer allocation opened once"
    );

    // 200 small writes queued at once, each notified after its own bytes; one more import.
    let small = register(
        &engine,
        device_bytes(0, &(0..SLOTS).flat_map(slot).collect::<Vec<_>>()),
    );
    let slots = peer[6];
    let ts: Vec<_> = (0..SLOTS)
        .map(|k| {
            let off = (k * SLOT) as u64;
            ep.write(
                vec![(
                    small.range(off, SLOT as u64).unwrap(),
                    slots.range(off, SLOT as u64).unwrap(),
                )],
                TransferOptions::notify(1000 + k as u32),
            )
            .unwrap()
        })
        .collect();
    for t in ts {
        t.wait().unwrap();
    }
    assert_eq!(engine.cache_stats().imports_opened, 7);
    // The slots read back as one request of SLOTS pairs (one batch of copies where the driver
    // has cuMemcpyBatchAsync), each into its own place of poisoned memory, in reverse order.
    let back = register(&engine, poisoned_bytes(0, SLOTS * SLOT, 0x3C));
    let pairs = (0..SLOTS)
        .map(|k| {
            let mine = ((SLOTS - 1 - k) * SLOT) as u64;
            (
                back.range(mine, SLOT as u64).unwrap(),
                slots.range((k * SLOT) as u64, SLOT as u64).unwrap(),
            )
        })
        .collect();
    let r = ep
        .read(pairs, TransferOptions::default())
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(r.bytes, (SLOTS * SLOT) as u64);
    let want: Vec<u8> = (0..SLOTS).rev().flat_map(slot).collect();
    same(
        &host_copy(&back, 0, SLOTS * SLOT),
        &want,
        "slots read in one request",
    );

    // Four threads on the endpoint at once (each issues on a lane of its own): batches of reads
    // of random ranges of the peer's random bytes into poisoned memory, every byte compared.
    threads_reading(&engine, &ep, peer[5], seed);

    // A range past the peer's real allocation: the descriptor claims a longer one (so its own
    // checks pass), the mapping's real size refuses it before any copy.
    let d = peer[0];
    let ipc = d.ipc().unwrap();
    let claim = ipc.alloc_len() + (1 << 20);
    let forged = MemoryDescriptor::with_ipc(
        d.addr(),
        claim - ipc.offset(),
        d.kind(),
        &[],
        IpcPart::new(
            *ipc.handle().expect("cuMemAlloc memory"),
            claim,
            ipc.offset(),
            *ipc.gpu_uuid(),
        ),
    )
    .unwrap();
    let big = register(&engine, poisoned_bytes(0, claim as usize, 0x11));
    let e = ep
        .write(
            vec![(big.range(0, claim - ipc.offset()).unwrap(), forged.all())],
            TransferOptions::default(),
        )
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { arg: "pairs", .. }),
        "{e}"
    );
    assert!(ep.failure().is_none(), "a refused request ends nothing");
    assert_eq!(engine.cache_stats().imports_opened, 7);

    // Done: the peer checked everything when this arrives.
    ep.write(
        vec![(
            small.range(0, SLOT as u64).unwrap(),
            slots.range(0, SLOT as u64).unwrap(),
        )],
        TransferOptions::notify(999),
    )
    .unwrap()
    .wait()
    .unwrap();

    // A deadline that passes: 16 pairs of 64 MiB cannot be done in a nanosecond.
    let src = register(&engine, device_bytes(0, &bytes(SIZES[2], seed)));
    let pairs = (0..16).map(|_| (src.all(), peer[2].all())).collect();
    let t = Instant::now();
    let e = ep
        .write(
            pairs,
            TransferOptions::default().deadline(Duration::from_nanos(1)),
        )
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert!(matches!(ep.failure(), Some(Error::Timeout { .. })));
    let e = ep
        .write(vec![(src.all(), peer[2].all())], TransferOptions::default())
        .unwrap_err();
    assert!(
        matches!(e, Error::Timeout { .. }),
        "later requests: the failure: {e}"
    );
    let e = prepared_write.post().unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "posts too: {e}");
    let e = prepared_write.run().unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "runs too: {e}");

    drop(ep);
    let e = prepared_read.post().unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument {
                arg: "endpoint",
                ..
            } | Error::Timeout { .. }
        ),
        "the endpoint is gone (or still ends with its failure): {e}"
    );
    let status = child.wait().unwrap();
    assert!(status.success(), "peer failed: {status:?}");
}

/// Poll `t` (no blocking wait) until it is complete, failing after [`WAIT`] with `what` never
/// finished.
fn poll_until_complete(t: &gpudirect::transfer::Transfer, what: &str) {
    let until = Instant::now() + WAIT;
    while !t.is_complete() {
        assert!(Instant::now() < until, "{what} never finished");
        std::thread::yield_now();
    }
}

/// Four threads reading from `src` (the peer's random bytes of [`SIZES`]`[2]`, seed
/// `seed ^ 102`) on `ep` at once: each makes 24 requests of 8 pairs, random ranges into its own
/// poisoned memory, waited (every third awaited as a future, every fourth prepared and run),
/// and compares every byte.
fn threads_reading(engine: &Engine, ep: &Endpoint, src: MemoryDescriptor, seed: u64) {
    const PAIRS: usize = 8;
    const MAX: usize = 64 << 10;
    let want = bytes(SIZES[2], seed ^ 102);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let want = &want;
            s.spawn(move || {
                let dst = register(engine, poisoned_bytes(0, PAIRS * MAX, 0x3C));
                let mut draws = random_u32(24 * PAIRS * 2, seed ^ (500 + t)).into_iter();
                let mut draw = || draws.next().unwrap() as usize;
                for k in 0..24 {
                    let spans: Vec<(usize, usize)> = (0..PAIRS)
                        .map(|_| {
                            let len = 1 + draw() % MAX;
                            (draw() % (SIZES[2] - len), len)
                        })
                        .collect();
                    let pairs = spans
                        .iter()
                        .enumerate()
                        .map(|(i, &(off, len))| {
                            (
                                dst.range((i * MAX) as u64, len as u64).unwrap(),
                                src.range(off as u64, len as u64).unwrap(),
                            )
                        })
                        .collect();
                    let r = if k % 4 == 3 {
                        ep.prepare(Direction::Read, pairs, TransferOptions::default())
                            .unwrap()
                            .run()
                            .unwrap()
                    } else {
                        let tr = ep.read(pairs, TransferOptions::default()).unwrap();
                        if k % 3 == 1 {
                            futures_block_on(std::future::IntoFuture::into_future(tr)).unwrap()
                        } else {
                            tr.wait().unwrap()
                        }
                    };
                    let total: usize = spans.iter().map(|s| s.1).sum();
                    assert_eq!(r.bytes, total as u64);
                    for (i, &(off, len)) in spans.iter().enumerate() {
                        same(
                            &host_copy(&dst, i * MAX, len),
                            &want[off..off + len],
                            &format!("thread {t}, request {k}, pair {i}"),
                        );
                    }
                    dst.copy_from_host(0, &vec![0x3C; PAIRS * MAX]).unwrap();
                }
            });
        }
    });
    println!("4 threads x 24 requests of {PAIRS} random reads: every byte exact");
}

/// The peer: publishes poisoned destinations, random sources and the slots, checks every
/// notification's bytes in order, and stays until the other side hangs up.
fn peer(job: Job) {
    if job.role == "victim" {
        return victim(job);
    }
    if job.role == "stream-peer" {
        return stream_peer(job);
    }
    if job.role == "vmm-peer" {
        return vmm_peer(job);
    }
    if job.role == "pool-peer" {
        return pool_peer(job);
    }
    if job.role == "reconnecting" {
        return reconnecting_peer(job);
    }
    if job.role == "gather-peer" {
        return gather_peer(job);
    }
    if job.role == "long-peer" {
        return long_peer(job);
    }
    let d = job.device;
    let engine = Engine::new(EngineConfig::local()).unwrap();
    let dsts: Vec<Region> = SIZES
        .iter()
        .map(|&n| register(&engine, poisoned_bytes(d, n, 0xA5)))
        .collect();
    let srcs: Vec<Region> = SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            register(
                &engine,
                device_bytes(d, &bytes(n, job.seed ^ (100 + i as u64))),
            )
        })
        .collect();
    let slots = register(&engine, poisoned_bytes(d, SLOTS * SLOT, 0x5A));
    let publish: Vec<MemoryDescriptor> = dsts
        .iter()
        .chain(&srcs)
        .chain([&slots])
        .map(|r| r.descriptor().unwrap())
        .collect();
    let ep = engine.connect_local(&job.socket, &publish).unwrap();
    let next = |ep: &Endpoint| ep.next_notification(WAIT).unwrap().expect("a notification");
    for (i, &len) in SIZES.iter().enumerate() {
        assert_eq!(next(&ep).tag, i as u32, "in order");
        same(
            &host_copy(&dsts[i], 0, len),
            &bytes(len, job.seed ^ i as u64),
            "written before its notification",
        );
    }
    assert_eq!(next(&ep).tag, 998, "after the unwaited reads");
    for k in 0..SLOTS {
        assert_eq!(next(&ep).tag, 1000 + k as u32, "in order");
        same(&host_copy(&slots, k * SLOT, SLOT), &slot(k), "slot");
    }
    assert_eq!(next(&ep).tag, 999);
    until_hung_up(&ep);
}

/// Bytes of each write in [`the_first_of_many_long_writes_is_seen_done_before_the_last`], and
/// how many are queued at once.
const LONG: usize = 256 << 20;
const LONG_WRITES: usize = 32;

/// Long writes queued one behind another are each seen done when their own copies are: the
/// first of 32 writes of 256 MiB, waited for, returns while the last still runs (without an
/// event behind each long request, the first wait's event covered all 32, and it finished them
/// all at once; the last runs 31 copies of 256 MiB after the first). Then the peer's bytes
/// read back into poisoned memory and compared.
#[test]
fn the_first_of_many_long_writes_is_seen_done_before_the_last() {
    if let Ok(job) = std::env::var(CHILD) {
        return peer(serde_json::from_str(&job).unwrap());
    }
    let n = require!(Hardware::Gpu, gpu::gpus());
    let seed = gpu::seed_from("TRANSFER_LOCAL_SEED");
    let device = if n > 1 { 1 } else { 0 };
    let engine = Engine::new(EngineConfig::local()).unwrap();
    let (_listener, ep, child) = meet_child(
        &engine,
        "long",
        "the_first_of_many_long_writes_is_seen_done_before_the_last",
        "long-peer",
        seed,
        device,
    );
    let peer = ep.peer_descriptors();
    let want = bytes(LONG, seed ^ 700);
    let src = register(&engine, device_bytes(0, &want));
    let write = || {
        ep.write(
            vec![(src.all(), peer[0].range(0, LONG as u64).unwrap())],
            TransferOptions::default(),
        )
        .unwrap()
    };
    let mut ts: Vec<_> = (0..LONG_WRITES).map(|_| write()).collect();
    ts.remove(0).wait().unwrap();
    assert!(
        !ts.last().unwrap().is_complete(),
        "the first long write was seen done only with the last"
    );
    for t in ts {
        t.wait().unwrap();
    }
    let back = register(&engine, poisoned_bytes(0, LONG, 0x3C));
    ep.read(
        vec![(back.all(), peer[0].range(0, LONG as u64).unwrap())],
        TransferOptions::default(),
    )
    .unwrap()
    .wait()
    .unwrap();
    same(&host_copy(&back, 0, LONG), &want, "long writes read back");
    done_with_peer(&engine, ep, &peer[0], want[..1].to_vec(), child);
}

/// The long-writes test's peer: publishes a poisoned buffer of [`LONG`] bytes and waits for the
/// closing notification.
fn long_peer(job: Job) {
    let engine = Engine::new(EngineConfig::local()).unwrap();
    let area = register(&engine, poisoned_bytes(job.device, LONG, 0xA5));
    let ep = engine
        .connect_local(&job.socket, &[area.descriptor().unwrap()])
        .unwrap();
    let n = ep.next_notification(WAIT).unwrap().expect("a notification");
    assert_eq!(n.tag, 99);
    until_hung_up(&ep);
}

/// Bytes of the peer's area in [`gathered_requests_between_two_processes`].
const AREA: usize = 4 << 20;

/// Where in the area that test's prepared runs write (past the writes it leaves waiting).
const RUNS: usize = 1 << 20;

/// One pair: `len` bytes at `lo` in `local` and at `ro` in `remote`.
fn pair(
    local: &Region,
    lo: u64,
    remote: &MemoryDescriptor,
    ro: u64,
    len: u64,
) -> Vec<(LocalRange, RemoteRange)> {
    vec![(
        local.range(lo, len).unwrap(),
        remote.range(ro, len).unwrap(),
    )]
}

#[test]
fn gathered_requests_between_two_processes() {
    if let Ok(job) = std::env::var(CHILD) {
        return peer(serde_json::from_str(&job).unwrap());
    }
    let mut config = EngineConfig::local();
    config.copy_kernel = true;
    gathered_requests(config, "gathered_requests_between_two_processes", "gk");
}

/// The same with the default copy graphs: the pieces gathered on the copy engines.
#[test]
fn gathered_requests_on_copy_graphs_between_two_processes() {
    if let Ok(job) = std::env::var(CHILD) {
        return peer(serde_json::from_str(&job).unwrap());
    }
    let config = EngineConfig::local();
    assert!(config.copy_graphs && !config.copy_kernel, "the defaults");
    gathered_requests(
        config,
        "gathered_requests_on_copy_graphs_between_two_processes",
        "gg",
    );
}

/// The gathered-requests test with `config` (the copy kernel or the copy graphs), its child
/// started as `test`, meeting it on the socket named `name`.
fn gathered_requests(config: EngineConfig, test: &str, name: &str) {
    use rand::{Rng, SeedableRng, rngs::StdRng};
    let n = require!(Hardware::Gpu, gpu::gpus());
    let seed = gpu::seed_from("TRANSFER_LOCAL_SEED");
    let device = if n > 1 { 1 } else { 0 };
    let engine = Engine::new(config).unwrap();
    let (_listener, ep, mut child) = meet_child(&engine, name, test, "gather-peer", seed, device);
    let area = ep.peer_descriptors()[0];
    // What the peer's area and `back` hold, applied on the host in request order.
    let mut model = vec![0xA5u8; AREA];
    let mut back_model = vec![0x3Cu8; AREA];
    let src_bytes = bytes(AREA, seed ^ 7);
    let src = register(&engine, device_bytes(0, &src_bytes));
    let back = register(&engine, poisoned_bytes(0, AREA, 0x3C));
    let mut rng = StdRng::seed_from_u64(seed);
    // 600 requests made at once on this thread, nothing waited: writes of random ranges of
    // `src` over random ranges of the area and reads of the area into `back`, overlapping
    // (the lane's order decides the bytes), some writes made twice in a row. Most are 16-byte
    // aligned and small (they wait for a gather launch while the lane is busy); every seventh is
    // not aligned (the kernel does not take it: it goes on the copy engines after those waiting;
    // a graph takes it) and every 50th is 3 MiB (past what waits: it goes at once, after those
    // waiting).
    let mut ts = Vec::new();
    let mut last_write = None;
    for k in 0..600 {
        // Every 11th: the last write again (the same copy may go in one launch twice).
        if k % 11 == 5
            && let Some((a, b, len)) = last_write
        {
            // Requests of many pairs since may have written there.
            model[b..b + len].copy_from_slice(&src_bytes[a..a + len]);
            let t = ep.write(
                pair(&src, a as u64, &area, b as u64, len as u64),
                TransferOptions::default(),
            );
            ts.push(t.unwrap());
            continue;
        }
        // Every 13th: a request of 2 to 80 pairs into disjoint 16 KiB slots (more than 32 go
        // in launches of their own at once, after those waiting).
        if k % 13 == 6 {
            const SLOT: usize = 16 << 10;
            let n = rng.random_range(2..=80usize);
            let first = rng.random_range(0..=AREA / SLOT - n);
            let write = rng.random_range(0..2) == 0;
            let pairs: Vec<_> = (0..n)
                .map(|j| {
                    let len = rng.random_range(1..=SLOT / 2);
                    let near = (first + j) * SLOT + (rng.random_range(0..SLOT / 2) & !15);
                    let far = rng.random_range(0..=AREA - len) & !15;
                    if write {
                        model[near..near + len].copy_from_slice(&src_bytes[far..far + len]);
                        (
                            src.range(far as u64, len as u64).unwrap(),
                            area.range(near as u64, len as u64).unwrap(),
                        )
                    } else {
                        back_model[near..near + len].copy_from_slice(&model[far..far + len]);
                        (
                            back.range(near as u64, len as u64).unwrap(),
                            area.range(far as u64, len as u64).unwrap(),
                        )
                    }
                })
                .collect();
            let t = if write {
                ep.write(pairs, TransferOptions::default())
            } else {
                ep.read(pairs, TransferOptions::default())
            };
            ts.push(t.unwrap());
            continue;
        }
        let len = match k {
            _ if k % 50 == 49 => 3 << 20,
            _ => rng.random_range(1..=48 << 10),
        };
        let at = |rng: &mut StdRng| {
            let o = rng.random_range(0..=AREA - len);
            if k % 7 == 3 { o | 1 } else { o & !15 }.min(AREA - len)
        };
        let (a, b) = (at(&mut rng), at(&mut rng));
        let t = if rng.random_range(0..10) < 7 {
            model[b..b + len].copy_from_slice(&src_bytes[a..a + len]);
            last_write = Some((a, b, len));
            ep.write(
                pair(&src, a as u64, &area, b as u64, len as u64),
                TransferOptions::default(),
            )
        } else {
            back_model[a..a + len].copy_from_slice(&model[b..b + len]);
            ep.read(
                pair(&back, a as u64, &area, b as u64, len as u64),
                TransferOptions::default(),
            )
        };
        ts.push(t.unwrap());
    }
    // Some dropped unwaited, some made InFlight, the rest waited last first.
    let mut in_flight = Vec::new();
    for (k, t) in ts.into_iter().enumerate().rev() {
        match k % 5 {
            0 => drop(t),
            1 => in_flight.push(t.into_in_flight()),
            _ => {
                t.wait().unwrap();
            }
        }
    }
    for t in in_flight {
        t.wait_timeout(WAIT).ok().unwrap().result().unwrap();
    }
    // A request that waits for a launch and is only polled: the worker lets it go.
    let first = ep
        .write(pair(&src, 0, &area, 0, 4096), TransferOptions::default())
        .unwrap();
    let polled = ep
        .write(
            pair(&src, 4096, &area, 4096, 4096),
            TransferOptions::default(),
        )
        .unwrap();
    model[..8192].copy_from_slice(&src_bytes[..8192]);
    poll_until_complete(&polled, "a gathered write only polled");
    first.wait().unwrap();
    // A prepared write run while gathered writes of the same bytes wait for their launch: it
    // lands after them (the run goes behind them on the lane, not before their launch). At
    // RUNS, which the writes left waiting at the end do not touch (the peer checks it).
    let tail = AREA as u64 - 8192;
    let at = RUNS as u64;
    let last = ep
        .prepare(
            Direction::Write,
            pair(&src, tail, &area, at, 8192),
            TransferOptions::default(),
        )
        .unwrap();
    let seen = register(&engine, poisoned_bytes(0, 8192, 0x77));
    for round in 0..50u64 {
        let busy = ep
            .write(
                pair(&src, 0, &area, at + 8192, 4096),
                TransferOptions::default(),
            )
            .unwrap();
        let waiting: Vec<_> = (0..4u64)
            .map(|k| {
                let from = (round * 4 + k) * 8192;
                ep.write(
                    pair(&src, from, &area, at, 8192),
                    TransferOptions::default(),
                )
                .unwrap()
            })
            .collect();
        last.run().unwrap();
        for t in waiting {
            t.wait().unwrap();
        }
        busy.wait().unwrap();
        ep.read(
            vec![(seen.all(), area.range(at, 8192).unwrap())],
            TransferOptions::default(),
        )
        .unwrap()
        .wait()
        .unwrap();
        same(
            &host_copy(&seen, 0, 8192),
            &src_bytes[tail as usize..],
            "a run after waiting writes",
        );
    }
    model[RUNS..RUNS + 8192].copy_from_slice(&src_bytes[AREA - 8192..]);
    model[RUNS + 8192..RUNS + 12288].copy_from_slice(&src_bytes[..4096]);
    // A write that waits for a launch with a deadline shorter than the idle worker's look (100
    // ms), left alone past that deadline: the worker, woken when it was made, lets it go in
    // time, and neither it nor the endpoint fails.
    for round in 0..5 {
        let busy = ep
            .write(
                pair(&src, 0, &area, at + 16384, 4096),
                TransferOptions::default(),
            )
            .unwrap();
        let short = ep
            .write(
                pair(&src, 8192, &area, at + 20480, 4096),
                TransferOptions::default().deadline(Duration::from_millis(30)),
            )
            .unwrap();
        std::thread::sleep(Duration::from_millis(150));
        short
            .wait()
            .unwrap_or_else(|e| panic!("round {round}: a short deadline, left alone: {e}"));
        busy.wait().unwrap();
    }
    model[RUNS + 16384..RUNS + 20480].copy_from_slice(&src_bytes[..4096]);
    model[RUNS + 20480..RUNS + 24576].copy_from_slice(&src_bytes[8192..12288]);
    // Every byte: what the reads brought, and the area read back whole (waited: the lane's
    // requests before it are done or ended, and a dropped one still ran).
    let whole = register(&engine, poisoned_bytes(0, AREA, 0x11));
    ep.read(vec![(whole.all(), area.all())], TransferOptions::default())
        .unwrap()
        .wait()
        .unwrap();
    same(
        &host_copy(&whole, 0, AREA),
        &model,
        "the area after the requests",
    );
    same(
        &host_copy(&back, 0, AREA),
        &back_model,
        "what the reads brought",
    );
    // The peer checks the area once notified.
    let one = register(&engine, device_bytes(0, &model[..16]));
    ep.write(
        vec![(one.all(), area.range(0, 16).unwrap())],
        TransferOptions::notify(1),
    )
    .unwrap()
    .wait()
    .unwrap();
    // Requests left waiting for a launch when the endpoint goes: ended, nothing hangs.
    let left: Vec<_> = (0..8u64)
        .map(|k| {
            ep.write(
                pair(&src, k * 4096, &area, k * 4096, 4096),
                TransferOptions::default(),
            )
            .unwrap()
        })
        .collect();
    drop(ep);
    for t in left {
        // Done before the close, or ended by it.
        assert!(
            t.into_in_flight().wait_timeout(WAIT).is_ok(),
            "ended, not hung"
        );
    }
    let status = child.wait().unwrap();
    assert!(status.success(), "peer failed: {status:?}");
}

/// The peer of [`gathered_requests_between_two_processes`]: publishes a poisoned area; at the
/// notification its first bytes are the parent's `src` bytes.
fn gather_peer(job: Job) {
    let engine = Engine::new(EngineConfig::local()).unwrap();
    let area = register(&engine, poisoned_bytes(job.device, AREA, 0xA5));
    let ep = engine
        .connect_local(&job.socket, &[area.descriptor().unwrap()])
        .unwrap();
    let n = ep.next_notification(WAIT).unwrap().expect("a notification");
    assert_eq!(n.tag, 1);
    let src = bytes(AREA, job.seed ^ 7);
    same(
        &host_copy(&area, 0, 8192),
        &src[..8192],
        "the polled writes before the notification",
    );
    let mut want = src[AREA - 8192..].to_vec();
    want.extend_from_slice(&src[..4096]);
    same(
        &host_copy(&area, RUNS, 12288),
        &want,
        "the runs before the notification",
    );
    until_hung_up(&ep);
}

#[test]
fn a_peer_killed_mid_transfer_is_a_typed_error() {
    if let Ok(job) = std::env::var(CHILD) {
        return peer(serde_json::from_str(&job).unwrap());
    }
    let n = require!(Hardware::Gpu, gpu::gpus());
    let engine = Engine::new(EngineConfig::local()).unwrap();
    let (_listener, ep, mut child) = meet_child(
        &engine,
        "victim",
        "a_peer_killed_mid_transfer_is_a_typed_error",
        "victim",
        1,
        if n > 1 { 1 } else { 0 },
    );
    let dst = ep.peer_descriptors()[0];
    let src = register(&engine, device_bytes(0, &bytes(SIZES[2], 7)));
    let t = Instant::now();
    let mut k = 0u32;
    let e = loop {
        assert!(t.elapsed() < WAIT, "no error {WAIT:?} after the peer died");
        let r = ep
            .write(vec![(src.all(), dst.all())], TransferOptions::notify(k))
            .and_then(|t| t.wait());
        k += 1;
        if let Err(e) = r {
            break e;
        }
    };
    println!("after {k} writes: {e}");
    let status = child.wait().unwrap();
    assert!(!status.success(), "the peer aborted: {status:?}");
    // Later requests: refused at once, typed.
    let t = Instant::now();
    let e2 = ep
        .write(vec![(src.all(), dst.all())], TransferOptions::default())
        .unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(1));
    assert!(
        matches!(e2, Error::Os { .. } | Error::Timeout { .. }),
        "{e2}"
    );
    assert!(ep.failure().is_some());
}

/// The big range the reconnect test's first requests overwrite again and again.
const RECONNECT_BIG: usize = 256 << 20;
/// The small writes of the reconnect test, and where each lands: the first request's bytes
/// stay at `2 * RECONNECT_SMALL`.
const RECONNECT_SMALL: usize = 4096;

/// After a reconnect, notified writes of the same bytes that requests ended unfinished by it
/// still overwrite land after those requests' copies: on a lane whose streams existed before
/// the reconnect, and on a lane whose first request comes after it (its streams made then).
/// The peer (the dialing side, which reconnects) queues 1,024 writes of 256 MiB over the whole
/// range on one thread, reconnects while they run, then writes 4 KiB with notification 7 from
/// a thread new to the endpoint and with notification 8 from a thread that wrote before the
/// reconnect, and ends with a notified 8-byte write from the first thread (after its copies);
/// this side checks each notified write's bytes at its notification and at the last, and that
/// the long requests' bytes landed around them. On one GPU the copies run one after another
/// whatever their streams, so this passes without the reconnect's join too (docs/transfer.md);
/// across two GPUs a copy on another stream may overtake.
#[test]
fn a_reconnect_orders_later_writes_after_the_copies_it_ended() {
    if let Ok(job) = std::env::var(CHILD) {
        return peer(serde_json::from_str(&job).unwrap());
    }
    let n = require!(Hardware::Gpu, gpu::gpus());
    let engine = Engine::new(EngineConfig::local()).unwrap();
    let seed = 0x2c66;
    let dst = register(&engine, poisoned_bytes(0, RECONNECT_BIG, 0xA5));
    let (listener, mut child) = start_child(
        &engine,
        "reconnect-order",
        "a_reconnect_orders_later_writes_after_the_copies_it_ended",
        "reconnecting",
        seed,
        if n > 1 { 1 } else { 0 },
    );
    let d = [dst.descriptor().unwrap()];
    let first = listener.accept(&d, WAIT).unwrap();
    let ep = listener.accept(&d, WAIT).unwrap();
    let small = |k: usize| bytes(RECONNECT_SMALL, seed ^ (10 + k as u64));
    let next = |ep: &Endpoint| ep.next_notification(WAIT).unwrap().expect("a notification");
    assert_eq!(next(&ep).tag, 7);
    same(
        &host_copy(&dst, RECONNECT_SMALL, RECONNECT_SMALL),
        &small(1),
        "a lane new after the reconnect, at its notification",
    );
    assert_eq!(next(&ep).tag, 8);
    same(
        &host_copy(&dst, 0, RECONNECT_SMALL),
        &small(0),
        "a lane that wrote before the reconnect, at its notification",
    );
    assert_eq!(next(&ep).tag, 9);
    same(
        &host_copy(&dst, 0, 2 * RECONNECT_SMALL),
        &[small(0), small(1)].concat(),
        "both, once the ended requests' copies are done",
    );
    let big = bytes(RECONNECT_BIG, seed ^ 1);
    same(
        &host_copy(&dst, 2 * RECONNECT_SMALL, RECONNECT_SMALL),
        &big[2 * RECONNECT_SMALL..3 * RECONNECT_SMALL],
        "the ended requests' own bytes (their copies ran)",
    );
    same(
        &host_copy(&dst, RECONNECT_BIG - 8, 8),
        &bytes(8, seed ^ 9),
        "the last write, after them",
    );
    drop((first, ep));
    let status = child.wait().unwrap();
    assert!(status.success(), "peer failed: {status:?}");
}

/// The dialing side of the reconnect test.
fn reconnecting_peer(job: Job) {
    use std::sync::mpsc::channel;
    let d = job.device;
    let engine = Engine::new(EngineConfig::local()).unwrap();
    let big = register(
        &engine,
        device_bytes(d, &bytes(RECONNECT_BIG, job.seed ^ 1)),
    );
    let smalls: Vec<Region> = (0..2)
        .map(|k| {
            register(
                &engine,
                device_bytes(d, &bytes(RECONNECT_SMALL, job.seed ^ (10 + k))),
            )
        })
        .collect();
    let last = register(&engine, device_bytes(d, &bytes(8, job.seed ^ 9)));
    let ep = engine.connect_local(&job.socket, &[]).unwrap();
    // The main thread's lane gets streams before the reconnect.
    let p = ep.peer_descriptors()[0];
    ep.write(
        vec![(smalls[0].all(), p.range(0, RECONNECT_SMALL as u64).unwrap())],
        TransferOptions::default(),
    )
    .unwrap()
    .wait()
    .unwrap();
    // Prepared before the reconnect: refused after it (the peer's memory may have moved).
    let before = ep
        .prepare(
            Direction::Write,
            vec![(smalls[0].all(), p.range(0, RECONNECT_SMALL as u64).unwrap())],
            TransferOptions::default(),
        )
        .unwrap();
    let (go_tx, go_rx) = channel::<MemoryDescriptor>();
    let (issued_tx, issued_rx) = channel::<Vec<gpudirect::transfer::Transfer>>();
    let (ep, big, last) = (&ep, &big, &last);
    std::thread::scope(|s| {
        // The long requests, and later the last write, from one thread: one lane.
        let long = s.spawn(move || {
            let all: Vec<_> = (0..1024)
                .map(|_| {
                    ep.write(vec![(big.all(), p.all())], TransferOptions::default())
                        .unwrap()
                })
                .collect();
            issued_tx.send(all).unwrap();
            let p2 = go_rx.recv().unwrap();
            ep.write(
                vec![(last.all(), p2.range(RECONNECT_BIG as u64 - 8, 8).unwrap())],
                TransferOptions::notify(9),
            )
            .unwrap()
            .wait()
            .unwrap();
        });
        let ended = issued_rx.recv().unwrap();
        let pending = ended.iter().filter(|t| !t.is_complete()).count();
        ep.reconnect().unwrap();
        println!("peer: reconnected with {pending} of 1024 long writes unfinished");
        assert!(
            pending > 0,
            "the long writes ended before the reconnect: nothing tested"
        );
        let p2 = ep.peer_descriptors()[0];
        for e in [
            before.post_on(&gpu::stream(d)).map(drop).unwrap_err(),
            before.post().map(drop).unwrap_err(),
        ] {
            assert!(
                matches!(
                    &e,
                    Error::InvalidArgument {
                        arg: "prepared",
                        ..
                    }
                ),
                "{e}"
            );
        }
        // First from a thread new to the endpoint (its lane's streams made now), while the
        // ended writes' copies still run; then from the thread that wrote before.
        let small1 = &smalls[1];
        let t7 = Instant::now();
        s.spawn(move || {
            ep.write(
                vec![(
                    small1.all(),
                    p2.range(RECONNECT_SMALL as u64, RECONNECT_SMALL as u64)
                        .unwrap(),
                )],
                TransferOptions::notify(7),
            )
            .unwrap()
            .wait()
            .unwrap();
        })
        .join()
        .unwrap();
        // About the ended writes' remaining copies (a tenth of a second on one H200) when the
        // new lane is ordered after them; microseconds when it is not.
        println!("peer: the new lane's write took {:?}", t7.elapsed());
        ep.write(
            vec![(
                smalls[0].all(),
                p2.range(0, RECONNECT_SMALL as u64).unwrap(),
            )],
            TransferOptions::notify(8),
        )
        .unwrap()
        .wait()
        .unwrap();
        go_tx.send(p2).unwrap();
        long.join().unwrap();
        // Waited for only at the end: nothing above waits for them.
        let ended_with_error = ended
            .into_iter()
            .map(|t| t.wait())
            .filter(Result::is_err)
            .count();
        println!("peer: {ended_with_error} ended with an error");
    });
    until_hung_up(ep);
}

/// A peer that aborts at its third notification, while the writes go on.
fn victim(job: Job) {
    let engine = Engine::new(EngineConfig::local()).unwrap();
    let dst = register(&engine, poisoned_bytes(job.device, SIZES[2], 0));
    let ep = engine
        .connect_local(&job.socket, &[dst.descriptor().unwrap()])
        .unwrap();
    for _ in 0..3 {
        ep.next_notification(WAIT).unwrap().expect("a notification");
    }
    std::process::abort();
}

/// Poll a future to its end on this thread (no runtime needed: transfers wake by waker).
fn futures_block_on<F: std::future::Future>(f: F) -> F::Output {
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        match f.as_mut().poll(&mut cx) {
            Poll::Ready(v) => return v,
            Poll::Pending => std::thread::park_timeout(Duration::from_millis(100)),
        }
    }
}

/// Bytes of the stream-ordered test.
const STREAM_LEN: usize = (16 << 20) + 3;

/// `len` bytes from device `src` to device `dst` on `stream`.
fn stream_copy(stream: &gpudirect::cuda::Stream, dst: u64, src: u64, len: usize) {
    use gpudirect::cudarc::driver::sys;
    // SAFETY: both are live device allocations of at least `len` bytes that outlive the copy
    // (the test synchronizes the stream before dropping them).
    let r = unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, stream.cu_stream()) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuMemcpyDtoDAsync");
}

/// A stream-ordered request made by `post` on a stream capturing a graph: refused with nothing
/// queued, and the capture still valid.
fn refused_under_capture(
    post: impl FnOnce(
        &gpudirect::cuda::Stream,
    ) -> gpudirect::Result<gpudirect::transfer::StreamTransfer>,
) {
    use gpudirect::cudarc::driver::sys;
    let c = gpu::stream(0);
    c.cuda()
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    let e = post(&c).map(drop).unwrap_err();
    assert!(
        matches!(
            e,
            Error::StreamCapturing {
                enqueued: false,
                ..
            }
        ),
        "{e}"
    );
    c.cuda()
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .expect("the refusal did not invalidate the capture");
}

/// Stream-ordered transfers between two processes: a write queued on a stream behind the copy
/// that fills its source (so it must start only when the stream gets there), another stream
/// released by its completion word then reading the peer's bytes back on that stream; the peer's
/// stream waits on its notification counter before looking at what arrived. Under graph capture
/// `write_on` is refused with nothing queued.
///
/// Three engines: with the copy kernel (one-pair aligned requests take it, the others the copy
/// graphs); with the defaults (every request one launch of the stream's copy graphs, then an
/// event); with neither (a `cuMemcpyAsync` per piece, then an event).
#[test]
fn stream_ordered_writes_and_reads_between_two_processes() {
    if let Ok(job) = std::env::var(CHILD) {
        return peer(serde_json::from_str(&job).unwrap());
    }
    let mut config = EngineConfig::local();
    config.copy_kernel = true;
    stream_ordered(
        config,
        "stream_ordered_writes_and_reads_between_two_processes",
        "stream",
    );
}

/// The same on the copy graphs (the defaults).
#[test]
fn stream_ordered_requests_on_copy_graphs_between_two_processes() {
    if let Ok(job) = std::env::var(CHILD) {
        return peer(serde_json::from_str(&job).unwrap());
    }
    stream_ordered(
        EngineConfig::local(),
        "stream_ordered_requests_on_copy_graphs_between_two_processes",
        "stream-g",
    );
}

/// The same with a copy-engine call per piece.
#[test]
fn stream_ordered_requests_on_copy_calls_between_two_processes() {
    if let Ok(job) = std::env::var(CHILD) {
        return peer(serde_json::from_str(&job).unwrap());
    }
    let mut config = EngineConfig::local();
    config.copy_graphs = false;
    stream_ordered(
        config,
        "stream_ordered_requests_on_copy_calls_between_two_processes",
        "stream-c",
    );
}

/// The stream-ordered test with `config`, its child started as `test`, meeting it on the
/// socket named `name`.
fn stream_ordered(config: EngineConfig, test: &str, name: &str) {
    let n = require!(Hardware::Gpu, gpu::gpus());
    let seed = gpu::seed_from("TRANSFER_LOCAL_SEED");
    let device = if n > 1 { 1 } else { 0 };
    let ctx = gpudirect::cuda::context(0).unwrap();
    let engine = Engine::new(config).unwrap();
    let (_listener, ep, mut child) = meet_child(&engine, name, test, "stream-peer", seed, device);
    let peer = ep.peer_descriptors();
    assert_eq!(peer.len(), 2, "a destination and a source");
    let want = bytes(STREAM_LEN, seed ^ 300);
    let staged = device_bytes(0, &want);
    let src = register(&engine, poisoned_bytes(0, STREAM_LEN, 0x3C));
    let back = register(&engine, poisoned_bytes(0, STREAM_LEN, 0x4D));
    let a = gpu::stream(0);
    let b = gpu::stream(0);
    // Stream a: a long copy chain fills the source, then the write; stream b waits for the
    // write's word, then reads the peer's bytes back.
    for _ in 0..8 {
        stream_copy(
            &a,
            src.device_ptr().unwrap(),
            staged.device_ptr(),
            STREAM_LEN,
        );
    }
    let w = ep
        .write_on(
            &a,
            vec![(src.all(), peer[0].all())],
            TransferOptions::notify(1),
        )
        .unwrap();
    w.wait_on(&b).unwrap();
    let r = ep
        .read_on(
            &b,
            vec![(back.all(), peer[1].all())],
            TransferOptions::default(),
        )
        .unwrap();
    let done = gpu::stream(0);
    r.wait_on(&done).unwrap();
    done.synchronize().unwrap();
    // The stream passed the word: both are released. The host's view (`is_complete`) follows
    // the word (written first), so it is waited for, not asserted.
    assert!(r.is_released() && w.is_released());
    let rw = w.wait(WAIT).unwrap();
    let rr = r.wait(WAIT).unwrap();
    println!("stream write: {} B via {}", rw.bytes, rw.paths[0]);
    assert_eq!((rw.bytes, rr.bytes), (STREAM_LEN as u64, STREAM_LEN as u64));
    assert!(
        matches!(rw.paths[0], MemoryPath::CudaIpc { .. }),
        "{}",
        rw.paths[0]
    );
    assert_eq!(
        w.completion_value() & gpudirect::transfer::STREAM_ERROR_BIT,
        0
    );
    same(
        &host_copy(&back, 0, STREAM_LEN),
        &bytes(STREAM_LEN, seed ^ 301),
        "read back on the stream",
    );
    // Under capture: refused, nothing queued, the capture still valid.
    refused_under_capture(|c| {
        ep.write_on(
            c,
            vec![(src.all(), peer[0].all())],
            TransferOptions::default(),
        )
    });
    // Two pairs on the legacy default stream (which cuMemcpyBatchAsync refuses: one copy each
    // there), each half into the other half of poisoned memory.
    let legacy = gpudirect::cuda::Stream::wrap(ctx.default_stream());
    let two = register(&engine, poisoned_bytes(0, STREAM_LEN, 0x6E));
    let half = (STREAM_LEN / 2) as u64;
    let rest = STREAM_LEN as u64 - half;
    let r2 = ep
        .read_on(
            &legacy,
            vec![
                (
                    two.range(rest, half).unwrap(),
                    peer[1].range(0, half).unwrap(),
                ),
                (
                    two.range(0, rest).unwrap(),
                    peer[1].range(half, rest).unwrap(),
                ),
            ],
            TransferOptions::default(),
        )
        .unwrap();
    legacy.synchronize().unwrap();
    r2.wait(WAIT).unwrap();
    let all = bytes(STREAM_LEN, seed ^ 301);
    let mut swapped = all[half as usize..].to_vec();
    swapped.extend_from_slice(&all[..half as usize]);
    same(
        &host_copy(&two, 0, STREAM_LEN),
        &swapped,
        "two pairs on the legacy stream",
    );
    // Reads of many shapes on one stream, each into poisoned memory (with the copy kernel, the
    // aligned ones take it: one launch that also stores the trigger); every range lands
    // exactly and nothing around it changes.
    let shapes: [(u64, u64); 9] = [
        (0, 1),
        (16, 15),
        (32, 16),
        (48, 17),
        (67, 4101),
        (8192, 3 * 4096 + 5),
        (1 << 20, 1 << 20),
        ((2 << 20) + 5, (1 << 20) + 11),
        (4 << 20, (4 << 20) + 3),
    ];
    let many = register(&engine, poisoned_bytes(0, STREAM_LEN, 0x5A));
    let s = gpu::stream(0);
    let ts: Vec<_> = shapes
        .iter()
        .map(|&(off, len)| {
            ep.read_on(
                &s,
                vec![(
                    many.range(off, len).unwrap(),
                    peer[1].range(off, len).unwrap(),
                )],
                TransferOptions::default(),
            )
            .unwrap()
        })
        .collect();
    s.synchronize().unwrap();
    for (t, &(_, len)) in ts.iter().zip(&shapes) {
        assert_eq!(t.wait(WAIT).unwrap().bytes, len);
    }
    let mut want_many = vec![0x5Au8; STREAM_LEN];
    for &(off, len) in &shapes {
        let (a, b) = (off as usize, (off + len) as usize);
        want_many[a..b].copy_from_slice(&all[a..b]);
    }
    same(
        &host_copy(&many, 0, STREAM_LEN),
        &want_many,
        "reads of many shapes on one stream",
    );
    // One read of 40 pairs (more than a copy graph takes: a call per piece), each a random
    // range of the peer's source into a slot of its own; then 20 streams (more than an
    // endpoint keeps graphs for) each reading one range, the last while the first streams'
    // reads may still run. Into poisoned memory, compared exactly.
    use rand::{Rng, SeedableRng, rngs::StdRng};
    let mut rng = StdRng::seed_from_u64(seed ^ 302);
    let slot = STREAM_LEN / 64;
    let wide = register(&engine, poisoned_bytes(0, STREAM_LEN, 0x2B));
    let mut want_wide = vec![0x2Bu8; STREAM_LEN];
    let mut pick = |k: usize| {
        let len = rng.random_range(1..=slot);
        let far = rng.random_range(0..=STREAM_LEN - len);
        let near = k * slot + rng.random_range(0..=slot - len);
        want_wide[near..near + len].copy_from_slice(&all[far..far + len]);
        (
            wide.range(near as u64, len as u64).unwrap(),
            peer[1].range(far as u64, len as u64).unwrap(),
        )
    };
    let pairs: Vec<_> = (0..40).map(&mut pick).collect();
    let s40 = gpu::stream(0);
    let t40 = ep.read_on(&s40, pairs, TransferOptions::default()).unwrap();
    let streams: Vec<_> = (0..20).map(|_| gpu::stream(0)).collect();
    let ts: Vec<_> = streams
        .iter()
        .enumerate()
        .map(|(k, st)| {
            ep.read_on(st, vec![pick(40 + k)], TransferOptions::default())
                .unwrap()
        })
        .collect();
    // 100 reads queued on one stream faster than they copy (more than a stream's timeline keeps
    // events for otherwise), then the stream waits on the last one's completion word: each
    // request's event is recorded behind its own copies, so the wait is released (an event
    // left to the proxy would land behind the wait, and nothing would fire).
    let burst = gpu::stream(0);
    let bt: Vec<_> = (0..100u64)
        .map(|k| {
            let off = k * 4099 % (STREAM_LEN as u64 / 2);
            ep.read_on(
                &burst,
                vec![(
                    many.range(off, 4097).unwrap(),
                    peer[1].range(off, 4097).unwrap(),
                )],
                TransferOptions::default(),
            )
            .unwrap()
        })
        .collect();
    bt.last().unwrap().wait_on(&burst).unwrap();
    burst.synchronize().unwrap();
    for t in &bt {
        t.wait(Duration::from_secs(5)).unwrap();
    }
    assert_eq!(
        bt[99].completion_value() & gpudirect::transfer::STREAM_ERROR_BIT,
        0
    );
    let got = host_copy(&many, 0, STREAM_LEN);
    for k in 0..100usize {
        let off = k * 4099 % (STREAM_LEN / 2);
        same(
            &got[off..off + 4097],
            &all[off..off + 4097],
            "a read of the burst",
        );
    }
    // Prepared reads posted on one stream: two of one size into the same local range from two
    // places of the peer's source, posted A B A A B B A (the stream's graph set again only where
    // the last launch differs), the range poisoned on the stream before each post and copied
    // aside after it, and the prepared requests dropped before the stream synchronizes; each
    // copy aside holds exactly its post's bytes.
    let order = [0usize, 1, 0, 0, 1, 1, 0];
    let len = 65_536 + 5;
    let at = [3u64, (STREAM_LEN / 2) as u64 + 1];
    let into = register(&engine, poisoned_bytes(0, len, 0x71));
    let poison = device_bytes(0, &vec![0x93u8; len]);
    let aside = poisoned_bytes(0, len * order.len(), 0x1F);
    let prepared: Vec<_> = at
        .iter()
        .map(|&off| {
            ep.prepare(
                Direction::Read,
                vec![(into.all(), peer[1].range(off, len as u64).unwrap())],
                TransferOptions::default(),
            )
            .unwrap()
        })
        .collect();
    // A post under capture is refused with nothing queued; on the per-thread default stream too.
    refused_under_capture(|c| prepared[0].post_on(c));
    let e = prepared[0]
        .post_on(&gpudirect::cuda::Stream::wrap(ctx.per_thread_stream()))
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    let ps = gpu::stream(0);
    let into_ptr = into.device_ptr().unwrap();
    let posted: Vec<_> = order
        .iter()
        .enumerate()
        .map(|(k, &which)| {
            stream_copy(&ps, into_ptr, poison.device_ptr(), len);
            let t = prepared[which].post_on(&ps).unwrap();
            stream_copy(&ps, aside.device_ptr() + (k * len) as u64, into_ptr, len);
            t
        })
        .collect();
    // The prepared requests go before the stream gets to their copies: each post holds what
    // its copies reach.
    drop(prepared);
    ps.synchronize().unwrap();
    for t in &posted {
        assert_eq!(t.wait(WAIT).unwrap().bytes, len as u64);
    }
    let got = aside.to_host();
    for (k, &which) in order.iter().enumerate() {
        let off = at[which] as usize;
        same(
            &got[k * len..(k + 1) * len],
            &all[off..off + len],
            "a prepared read posted on a stream",
        );
    }
    // Regions registered, read into and dropped in turn (the allocator tends to give the same
    // addresses again, which the stream's graph was set to): each read lands in its own region.
    for k in 0..3u8 {
        let r = register(&engine, poisoned_bytes(0, len, 0x40 + k));
        let t = ep
            .read_on(
                &ps,
                vec![(r.all(), peer[1].range(at[0], len as u64).unwrap())],
                TransferOptions::default(),
            )
            .unwrap();
        ps.synchronize().unwrap();
        t.wait(WAIT).unwrap();
        let off = at[0] as usize;
        same(
            &host_copy(&r, 0, len),
            &all[off..off + len],
            "a read into a region registered anew",
        );
    }
    // The per-thread default stream is refused (its handle names another stream on every
    // thread), nothing queued.
    let per_thread = gpudirect::cuda::Stream::wrap(ctx.per_thread_stream());
    let e = ep
        .write_on(
            &per_thread,
            vec![(src.all(), peer[0].all())],
            TransferOptions::default(),
        )
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    assert_eq!(t40.wait(WAIT).unwrap().messages, 40);
    for t in ts {
        t.wait(WAIT).unwrap();
    }
    same(
        &host_copy(&wide, 0, STREAM_LEN),
        &want_wide,
        "40 pairs on one stream, then one on each of 20 streams",
    );
    drop(ctx);
    // Done: the peer checked what its stream saw.
    ep.write(
        vec![(src.range(0, 4).unwrap(), peer[0].range(0, 4).unwrap())],
        TransferOptions::notify(2),
    )
    .unwrap()
    .wait()
    .unwrap();
    drop(ep);
    let status = child.wait().unwrap();
    assert!(status.success(), "peer failed: {status:?}");
}

/// The stream-ordered test's peer: publishes a poisoned destination and a random source; its
/// stream waits on the notification counter, then copies what arrived aside; compared exactly.
fn stream_peer(job: Job) {
    let d = job.device;
    let engine = Engine::new(EngineConfig::local()).unwrap();
    let ctx = gpudirect::cuda::context(d).unwrap();
    let dst = register(&engine, poisoned_bytes(d, STREAM_LEN, 0xA5));
    let src = register(&engine, device_bytes(d, &bytes(STREAM_LEN, job.seed ^ 301)));
    let seen = poisoned_bytes(d, STREAM_LEN, 0x77);
    let ep = engine
        .connect_local(
            &job.socket,
            &[dst.descriptor().unwrap(), src.descriptor().unwrap()],
        )
        .unwrap();
    let counter = ep.notification_counter(&ctx).unwrap();
    let s = gpu::stream(d);
    counter.wait_on(&s, 1).unwrap();
    stream_copy(&s, seen.device_ptr(), dst.device_ptr().unwrap(), STREAM_LEN);
    s.synchronize().unwrap();
    same(
        &seen.to_host(),
        &bytes(STREAM_LEN, job.seed ^ 300),
        "seen by the stream after the counter",
    );
    let next = |ep: &Endpoint| ep.next_notification(WAIT).unwrap().expect("a notification");
    assert_eq!(next(&ep).tag, 1);
    assert_eq!(next(&ep).tag, 2);
    drop(src);
    loop {
        match ep.next_notification(WAIT) {
            Err(_) => break,
            Ok(None) => {}
            Ok(Some(n)) => panic!("unexpected {n:?}"),
        }
    }
}

/// Bytes of the one-chunk VMM buffer the VMM test's peer publishes (mapped rounded up).
const VMM_LEN: usize = (3 << 20) + 5;

/// VMM memory between two processes: the peer publishes a one-chunk `VmmBuffer` and a range
/// inside chunk 1 of a two-chunk one; their file descriptors come when the endpoints meet. Random
/// bytes written into each (the peer checks them at the notification) and read back into
/// poisoned memory, compared exactly; each export is mapped once; the path is the link's.
#[test]
fn vmm_memory_between_two_processes() {
    if let Ok(job) = std::env::var(CHILD) {
        return peer(serde_json::from_str(&job).unwrap());
    }
    let n = require!(Hardware::Gpu, gpu::gpus());
    let ctx = gpudirect::cuda::context(0).unwrap();
    require!(Hardware::Gpu, VmmBuffer::<u8>::alloc(&ctx, 1));
    let seed = gpu::seed_from("TRANSFER_LOCAL_SEED");
    let device = if n > 1 { 1 } else { 0 };
    let engine = Engine::new(EngineConfig::local()).unwrap();
    let (_listener, ep, child) = meet_child(
        &engine,
        "vmm",
        "vmm_memory_between_two_processes",
        "vmm-peer",
        seed,
        device,
    );
    let peer = ep.peer_descriptors();
    assert_eq!(
        peer.len(),
        2,
        "a one-chunk buffer and a range inside one chunk"
    );
    for d in &peer {
        let ipc = d.ipc().expect("an IPC part");
        assert!(matches!(ipc.kind(), IpcKind::VmmFd { .. }), "{d:?}");
        assert!(d.rkeys().is_empty() && ipc.handle().is_none());
    }
    assert_eq!(peer[0].len(), VMM_LEN as u64);
    let check_path = path_checker(device);
    write_and_read_back(&engine, &ep, &peer, seed, 500, "VMM", &check_path);
    assert_eq!(
        engine.cache_stats().imports_opened,
        2,
        "each VMM export mapped once"
    );
    done_with_peer(&engine, ep, &peer[0], bytes(1, seed ^ 500), child);
}

/// The VMM test's peer: publishes a poisoned one-chunk `VmmBuffer` and a poisoned range inside
/// chunk 1 of a two-chunk one, checks each one's bytes at its notification, and checks that the
/// whole of a two-chunk buffer has no IPC part, saying why.
fn vmm_peer(job: Job) {
    let d = job.device;
    let ctx = gpudirect::cuda::context(d).unwrap();
    let engine = Engine::new(EngineConfig::local()).unwrap();
    let one = Buffer::device(VmmBuffer::<u8>::alloc(&ctx, VMM_LEN).unwrap()).unwrap();
    let one = engine.register(one).unwrap();
    one.copy_from_host(0, &vec![0xA5; VMM_LEN]).unwrap();
    let g = VmmBuffer::<u8>::granularity(&ctx).unwrap();
    let two = Buffer::device(VmmBuffer::<u8>::alloc_chunks(&ctx, &[g, g]).unwrap()).unwrap();
    let inner_len = g - 8192;
    let inner = engine
        .register(two.slice(g + 4099, inner_len).unwrap())
        .unwrap();
    inner.copy_from_host(0, &vec![0x5A; inner_len]).unwrap();
    let whole = Buffer::device(VmmBuffer::<u8>::alloc_chunks(&ctx, &[g, g]).unwrap()).unwrap();
    let whole = engine.register(whole).unwrap();
    let e = whole.descriptor().unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { .. })
            && e.to_string().contains("physical allocations"),
        "{e}"
    );
    let publish = vec![one.descriptor().unwrap(), inner.descriptor().unwrap()];
    let ep = engine.connect_local(&job.socket, &publish).unwrap();
    check_at_notifications(
        &ep,
        &[(&one, VMM_LEN), (&inner, inner_len)],
        job.seed,
        500,
        "VMM",
    );
}

/// Bytes of the first pool allocation, and of the second (the range published inside it
/// starts at an odd offset).
const POOL_LEN: usize = (2 << 20) + 3;
const POOL_LEN2: usize = 1 << 20;
const POOL_AT: usize = 4099;

/// Pool memory between two processes: the peer publishes an `IpcPool` allocation and a range
/// at an odd offset inside a second allocation of the same pool; the pool's file descriptor
/// comes once when the endpoints meet. Random bytes written into each (the peer checks them at
/// the notification) and read back into poisoned memory, compared exactly; the pool is imported
/// once and each pointer once; the path is the link's.
#[test]
fn pool_memory_between_two_processes() {
    if let Ok(job) = std::env::var(CHILD) {
        return peer(serde_json::from_str(&job).unwrap());
    }
    let n = require!(Hardware::Gpu, gpu::gpus());
    require!(Hardware::Gpu, IpcPool::new(0));
    let seed = gpu::seed_from("TRANSFER_LOCAL_SEED");
    let device = if n > 1 { 1 } else { 0 };
    let engine = Engine::new(EngineConfig::local()).unwrap();
    let (_listener, ep, child) = meet_child(
        &engine,
        "pool",
        "pool_memory_between_two_processes",
        "pool-peer",
        seed,
        device,
    );
    let peer = ep.peer_descriptors();
    assert_eq!(peer.len(), 2, "an allocation and a range inside another");
    let mut pools = Vec::new();
    let mut ptrs = Vec::new();
    for d in &peer {
        let ipc = d.ipc().expect("an IPC part");
        match ipc.kind() {
            IpcKind::PoolPtr {
                pool_export_id,
                ptr_data,
            } => {
                pools.push(*pool_export_id);
                ptrs.push(*ptr_data);
            }
            k => panic!("a pool part, not {k:?}"),
        }
        assert!(d.rkeys().is_empty() && ipc.handle().is_none());
    }
    assert_eq!(pools[0], pools[1], "one pool");
    assert_ne!(ptrs[0], ptrs[1], "two allocations");
    assert_eq!(peer[0].len(), POOL_LEN as u64);
    assert_eq!(peer[0].ipc().unwrap().offset(), 0);
    assert_eq!(peer[1].ipc().unwrap().offset(), POOL_AT as u64);
    assert_eq!(peer[0].ipc().unwrap().alloc_len(), POOL_LEN as u64);
    assert_eq!(peer[1].ipc().unwrap().alloc_len(), POOL_LEN2 as u64);
    let check_path = path_checker(device);
    write_and_read_back(&engine, &ep, &peer, seed, 700, "pool", &check_path);
    // The first allocation described 4 KiB longer than it is (a peer's word): refused against
    // the pointer imported, before any copy.
    let ipc = peer[0].ipc().unwrap();
    let longer = (POOL_LEN + 4096) as u64;
    let forged = MemoryDescriptor::with_ipc(
        peer[0].addr(),
        longer,
        peer[0].kind(),
        &[],
        IpcPart::pool_ptr(pools[0], ptrs[0], longer, 0, *ipc.gpu_uuid()),
    )
    .unwrap();
    let big = register(&engine, poisoned_bytes(0, longer as usize, 0));
    let e = ep
        .write(vec![(big.all(), forged.all())], TransferOptions::default())
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    let stats = engine.cache_stats();
    assert_eq!(
        (stats.pool_imports_opened, stats.imports_opened),
        (1, 2),
        "the pool imported once, each allocation once"
    );
    done_with_peer(&engine, ep, &peer[0], bytes(1, seed ^ 700), child);
}

/// The pool test's peer: publishes a poisoned `IpcPool` allocation and a poisoned range at an
/// odd offset inside a second allocation of the same pool, checks each one's bytes at its
/// notification, and checks that memory of the device's default pool has no IPC part, saying
/// why. Its regions outlive its endpoint (an importer frees its pointers first).
fn pool_peer(job: Job) {
    let d = job.device;
    let ctx = gpudirect::cuda::context(d).unwrap();
    let engine = Engine::new(EngineConfig::local()).unwrap();
    let pool = IpcPool::new(d).unwrap();
    let stream = gpu::stream(d);
    let one = Buffer::device(pool.alloc::<u8>(POOL_LEN, &stream).unwrap()).unwrap();
    let one = engine.register(one).unwrap();
    one.copy_from_host(0, &vec![0xA5; POOL_LEN]).unwrap();
    let two = Buffer::device(pool.alloc::<u8>(POOL_LEN2, &stream).unwrap()).unwrap();
    let inner_len = POOL_LEN2 - 8192;
    let inner = engine
        .register(two.slice(POOL_AT, inner_len).unwrap())
        .unwrap();
    inner.copy_from_host(0, &vec![0x5A; inner_len]).unwrap();
    let default =
        gpudirect::memory::PoolBuffer::new(ctx.default_stream().alloc_zeros::<u8>(4096).unwrap())
            .unwrap();
    let default = engine.register(Buffer::device(default).unwrap()).unwrap();
    let e = default.descriptor().unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("shareable handle"),
        "{e}"
    );
    let publish = vec![one.descriptor().unwrap(), inner.descriptor().unwrap()];
    let ep = engine.connect_local(&job.socket, &publish).unwrap();
    check_at_notifications(
        &ep,
        &[(&one, POOL_LEN), (&inner, inner_len)],
        job.seed,
        700,
        "pool",
    );
    drop(ep);
}
