//! Tier 1: verbs completions as futures and streams (`AsyncCq`, `AsyncQueuePair`) over a loopback
//! pair of RC queue pairs, woken through the completion channel (tokio) or by the completion
//! thread; and what an await costs over a blocking poll (printed). Prints `SKIPPED: reason`
//! without a verbs device, and fails then when `GPUDIRECT_REQUIRE` names `rdma`.

mod support;

use futures_core::Stream;
use gpudirect::Error;
use gpudirect::completion::Tracker;
use gpudirect::rdma::*;
use gpudirect_testing::{Hardware, require};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};
use support::rdma::*;

const LONG: Duration = Duration::from_secs(60);

/// Two connected queue pairs, each awaited through a dispatcher of its own CQ.
struct APair {
    pd: ProtectionDomain,
    a: AsyncQueuePair,
    b: AsyncQueuePair,
}

fn cq(
    ctx: &Context,
    channel: bool,
) -> gpudirect::Result<(CompletionQueue, Option<CompletionChannel>)> {
    if channel {
        let ch = ctx.create_comp_channel()?;
        Ok((ctx.create_cq(1024, Some(&ch))?, Some(ch)))
    } else {
        Ok((ctx.create_cq(1024, None)?, None))
    }
}

/// A loopback pair; `channel`: woken through completion channels (else the completion thread).
/// Must run inside a tokio runtime for the channel to be used.
fn apair(backlog: usize, channel: bool) -> gpudirect::Result<APair> {
    apair_spin(backlog, channel, Duration::ZERO)
}

/// As [`apair`], each wait polling the CQ for up to `spin` before it sleeps.
fn apair_spin(backlog: usize, channel: bool, spin: Duration) -> gpudirect::Result<APair> {
    let ctx = Context::open_by_name(None)?;
    let pd = ctx.alloc_pd()?;
    let (cq_a, ch_a) = cq(&ctx, channel)?;
    let (cq_b, ch_b) = cq(&ctx, channel)?;
    let a = init_qp(&pd, &cq_a, &cq_a, None, caps())?;
    let b = init_qp(&pd, &cq_b, &cq_b, None, caps())?;
    let (a, b) = connect(&ctx, a, b)?;
    let acq_a = AsyncCq::new(cq_a, ch_a)?;
    let acq_b = AsyncCq::new(cq_b, ch_b)?;
    assert_eq!(acq_a.channel_driven(), channel);
    acq_a.spin(spin);
    acq_b.spin(spin);
    let a = acq_a.attach(a, backlog)?;
    let b = acq_b.attach(b, backlog)?;
    Ok(APair { pd, a, b })
}

async fn next<S: Stream + Unpin>(s: &mut S) -> S::Item {
    let item = std::future::poll_fn(|cx| Pin::new(&mut *s).poll_next(cx));
    tokio::time::timeout(LONG, item)
        .await
        .expect("a stream item within the bound")
        .expect("the stream never ends")
}

/// Poll `f` once.
async fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *f).poll(cx))).await
}

/// Poll a stream once.
async fn poll_next_once<S: Stream + Unpin>(s: &mut S) -> Poll<Option<S::Item>> {
    std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *s).poll_next(cx))).await
}

async fn settle(qp: &AsyncQueuePair) {
    let until = Instant::now() + LONG;
    while qp.in_flight() > 0 {
        assert!(
            Instant::now() < until,
            "{} requests never answered",
            qp.in_flight()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// A receive region of `slots` slots of `slot` bytes, poisoned with 0xEE, every slot posted on
/// `p.b`.
fn post_receives(p: &APair, slots: usize, slot: usize) -> MemoryRegion<Local> {
    let mut rbuf =
        p.pd.register(
            HostBuffer::zeroed(slots * slot).unwrap(),
            AccessFlags::LOCAL_WRITE,
        )
        .unwrap();
    rbuf.fill(0, slots * slot, 0xEE).unwrap();
    for k in 0..slots {
        p.b.post_recv(rbuf.slice(k * slot..(k + 1) * slot).unwrap())
            .unwrap();
    }
    rbuf
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_concurrent_futures_on_one_queue_pair_move_exact_bytes() {
    for (channel, spin) in [
        (true, Duration::ZERO),
        (false, Duration::ZERO),
        (true, Duration::from_micros(20)),
    ] {
        let p = require!(Hardware::Rdma, apair_spin(1024, channel, spin));
        const N: usize = 1000;
        const SZ: usize = 64;
        let data = random_bytes(N * SZ);
        let src =
            p.pd.register(HostBuffer::from_slice(&data).unwrap(), AccessFlags::empty())
                .unwrap();
        let mut dst =
            p.pd.register_remote(
                HostBuffer::zeroed(N * SZ).unwrap(),
                AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            )
            .unwrap();
        dst.fill(0, N * SZ, 0xEE).unwrap();
        let remote = dst.remote();
        let mut order: Vec<usize> = (0..N).collect();
        rand::seq::SliceRandom::shuffle(&mut order[..], &mut rand::rng());
        let mut tasks = Vec::new();
        for &i in &order {
            let a = p.a.clone();
            let s = src.slice(i * SZ..(i + 1) * SZ).unwrap();
            let r = remote.slice((i * SZ) as u64, SZ as u32).unwrap();
            tasks.push(tokio::spawn(async move {
                let done = a.write(s, r)?.timeout(LONG).await?;
                assert_eq!(done.wc().opcode(), WcOpcode::RdmaWrite);
                Ok::<(), Error>(())
            }));
        }
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        assert_eq!(dst.to_vec(), data, "every written byte, channel={channel}");
        // And back: 1,000 reads into poisoned memory.
        let mut back =
            p.pd.register(
                HostBuffer::zeroed(N * SZ).unwrap(),
                AccessFlags::LOCAL_WRITE,
            )
            .unwrap();
        back.fill(0, N * SZ, 0xAB).unwrap();
        let mut tasks = Vec::new();
        for &i in &order {
            let a = p.a.clone();
            let s = back.slice(i * SZ..(i + 1) * SZ).unwrap();
            let r = remote.slice((i * SZ) as u64, SZ as u32).unwrap();
            tasks.push(tokio::spawn(async move {
                a.read(s, r)?.timeout(LONG).await.map(drop)
            }));
        }
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        assert_eq!(back.to_vec(), data, "every read byte, channel={channel}");
        assert_eq!((p.a.in_flight(), p.a.backlogged()), (0, 0));
        println!("RDMA async: 1000 writes + 1000 reads exact, channel={channel}, spin={spin:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn messages_and_immediates_arrive_as_streams_in_order() {
    let p = require!(Hardware::Rdma, apair(512, true));
    const N: usize = 300;
    const SLOT: usize = 256;
    let lens: Vec<usize> = (0..N).map(|_| 1 + rand::random::<u8>() as usize).collect();
    let data = random_bytes(N * SLOT);
    let src =
        p.pd.register(HostBuffer::from_slice(&data).unwrap(), AccessFlags::empty())
            .unwrap();
    let rbuf = post_receives(&p, 64, SLOT);
    // All sends at once: more than the peer has receives posted (RNR retries cover that).
    let mut sends = Vec::new();
    for (i, &len) in lens.iter().enumerate() {
        let s = src.slice(i * SLOT..i * SLOT + len).unwrap();
        sends.push(tokio::spawn(
            p.a.post(SendRequest::send(s).tag(i as u64))
                .unwrap()
                .timeout(LONG),
        ));
    }
    let mut m = p.b.messages();
    for (i, &len) in lens.iter().enumerate() {
        let r = next(&mut m).await.unwrap();
        assert_eq!(r.len() as usize, len, "message {i}");
        assert_eq!(r.bytes(), &data[i * SLOT..i * SLOT + len], "message {i}");
        p.b.post_recv(r.into_buf()).unwrap();
    }
    for (i, s) in sends.into_iter().enumerate() {
        let done = s.await.unwrap().unwrap();
        assert_eq!(
            done.wc().tag(),
            i as u64,
            "the request's own tag comes back"
        );
    }
    // RDMA writes with immediate: (immediate, length) in order, and the bytes in place.
    let mut target =
        p.pd.register_remote(
            HostBuffer::zeroed(N * SLOT).unwrap(),
            AccessFlags::REMOTE_WRITE,
        )
        .unwrap();
    target.fill(0, N * SLOT, 0xEE).unwrap();
    let remote = target.remote();
    let imms: Vec<u32> = (0..N).map(|_| rand::random()).collect();
    let mut writes = Vec::new();
    for (i, &len) in lens.iter().enumerate() {
        let s = src.slice(i * SLOT..i * SLOT + len).unwrap();
        let r = remote.slice((i * SLOT) as u64, len as u32).unwrap();
        writes.push(
            p.a.post(SendRequest::write(s, r).with_imm(imms[i]))
                .unwrap(),
        );
    }
    let mut im = p.b.immediates();
    for (i, &len) in lens.iter().enumerate() {
        let (imm, got) = next(&mut im).await.unwrap();
        assert_eq!(
            (imm, got as usize),
            (imms[i], len),
            "write with immediate {i}"
        );
        let mut b = vec![0u8; len];
        target.read_at(i * SLOT, &mut b).unwrap();
        assert_eq!(b, &data[i * SLOT..i * SLOT + len]);
        // Its receive was consumed: post another.
        let k = i % 64;
        p.b.post_recv(rbuf.slice(k * SLOT..(k + 1) * SLOT).unwrap())
            .unwrap();
    }
    for w in writes {
        w.timeout(LONG).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancellation_at_every_await_point_loses_nothing_and_frees_nothing_early() {
    for channel in [false, true] {
        let p = require!(Hardware::Rdma, apair(256, channel));
        const K: usize = 150; // more than the send queue holds: some wait in the backlog
        const SZ: usize = 32;
        let data = random_bytes(K * SZ);
        let freed = Arc::new(AtomicUsize::new(0));
        let mr =
            p.pd.register(Counted(data.clone(), freed.clone()), AccessFlags::empty())
                .unwrap();
        // No receive is posted at the peer yet: every send waits (receiver not ready, retried
        // without end), so each future is cancelled before its completion.
        let mut timed_out = 0;
        for i in 0..K {
            let f = p.a.send(mr.slice(i * SZ..(i + 1) * SZ).unwrap()).unwrap();
            match i % 3 {
                0 => drop(f), // before the first poll
                1 => {
                    let mut f = f;
                    assert!(poll_once(&mut f).await.is_pending());
                    drop(f); // after a Pending poll
                }
                _ => {
                    // After its deadline expired.
                    let e = f.timeout(Duration::from_millis(1)).await.unwrap_err();
                    assert!(matches!(e, Error::Timeout { .. }), "{e}");
                    timed_out += 1;
                }
            }
        }
        assert!(timed_out > 0);
        drop(mr);
        tokio::time::sleep(Duration::from_millis(50)).await;
        Tracker::global().reap();
        assert_eq!(
            freed.load(Ordering::SeqCst),
            0,
            "freed before the NIC was done"
        );
        assert_eq!(
            p.a.in_flight(),
            K,
            "every request still owed its completion"
        );
        assert!(p.a.backlogged() > 0, "some requests wait in the backlog");
        // The peer now receives: every message arrives, in order, with its bytes.
        let _rbuf = post_receives(&p, 64, SZ);
        let mut m = p.b.messages();
        for i in 0..K {
            let r = next(&mut m).await.unwrap();
            assert_eq!(
                r.bytes(),
                &data[i * SZ..(i + 1) * SZ],
                "message {i}, channel={channel}"
            );
            p.b.post_recv(r.into_buf()).unwrap();
        }
        // Nothing lost: every cancelled request is answered, then its memory freed.
        settle(&p.a).await;
        let until = Instant::now() + LONG;
        while freed.load(Ordering::SeqCst) == 0 {
            assert!(Instant::now() < until, "never freed");
            Tracker::global().reap();
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(freed.load(Ordering::SeqCst), 1);
        // The queue pair goes on; a stream dropped while it waited loses nothing either.
        let mut waiting = p.b.messages();
        assert!(poll_next_once(&mut waiting).await.is_pending());
        drop(waiting);
        let s =
            p.pd.register(
                HostBuffer::from_slice(&[7u8; 8]).unwrap(),
                AccessFlags::empty(),
            )
            .unwrap();
        p.a.send(s.slice(..).unwrap())
            .unwrap()
            .timeout(LONG)
            .await
            .unwrap();
        assert_eq!(next(&mut m).await.unwrap().bytes(), [7u8; 8]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_deadline_is_typed_and_the_queue_pair_stays_usable() {
    for channel in [true, false] {
        let p = require!(Hardware::Rdma, apair(16, channel));
        let msg = random_bytes(100);
        let src =
            p.pd.register(HostBuffer::from_slice(&msg).unwrap(), AccessFlags::empty())
                .unwrap();
        // No receive at the peer: the send cannot complete in time.
        let t = Instant::now();
        let e =
            p.a.send(src.slice(..).unwrap())
                .unwrap()
                .timeout(Duration::from_millis(100))
                .await
                .unwrap_err();
        match e {
            Error::Timeout { what, after } => {
                assert_eq!(what, "an RDMA work request");
                assert!(after >= Duration::from_millis(100), "{after:?}");
            }
            e => panic!("not a timeout: {e}"),
        }
        assert!(t.elapsed() >= Duration::from_millis(100));
        // Usable: a receive lets the send through; a later write completes; the bytes are exact.
        let mut rbuf =
            p.pd.register(HostBuffer::zeroed(128).unwrap(), AccessFlags::LOCAL_WRITE)
                .unwrap();
        rbuf.fill(0, 128, 0xEE).unwrap();
        p.b.post_recv(rbuf.slice(..).unwrap()).unwrap();
        let target =
            p.pd.register_remote(HostBuffer::zeroed(100).unwrap(), AccessFlags::REMOTE_WRITE)
                .unwrap();
        p.a.write(
            src.slice(..).unwrap(),
            target.remote().slice(0, 100).unwrap(),
        )
        .unwrap()
        .timeout(LONG)
        .await
        .unwrap();
        assert_eq!(target.to_vec(), msg);
        let r = next(&mut p.b.messages()).await.unwrap();
        assert_eq!(r.bytes(), msg);
        settle(&p.a).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_backlog_answers_queue_full_and_loses_nothing() {
    let p = require!(Hardware::Rdma, apair(4, true));
    const SZ: usize = 16;
    let data = random_bytes(1024 * SZ);
    let src =
        p.pd.register(HostBuffer::from_slice(&data).unwrap(), AccessFlags::empty())
            .unwrap();
    // No receive at the peer: nothing completes, so the send queue then the backlog fill up.
    let mut futs = Vec::new();
    let err = loop {
        let i = futs.len();
        assert!(i < 1024, "the backlog never filled");
        match p.a.send(src.slice(i * SZ..(i + 1) * SZ).unwrap()) {
            Ok(f) => futs.push(f),
            Err(e) => break e,
        }
    };
    assert!(
        matches!(
            err,
            Error::QueueFull {
                queue: "backlog",
                depth: 4
            }
        ),
        "{err}"
    );
    assert_eq!(p.a.backlogged(), 4);
    assert_eq!(p.a.in_flight(), futs.len());
    let n = futs.len();
    let _rbuf = post_receives(&p, 64, SZ);
    let mut m = p.b.messages();
    for i in 0..n {
        let r = next(&mut m).await.unwrap();
        assert_eq!(r.bytes(), &data[i * SZ..(i + 1) * SZ], "message {i}");
        p.b.post_recv(r.into_buf()).unwrap();
    }
    for f in futs {
        f.timeout(LONG).await.unwrap();
    }
    assert_eq!((p.a.in_flight(), p.a.backlogged()), (0, 0));
}

#[test]
fn a_channel_of_another_cq_or_shared_is_refused() {
    let ctx = require!(Hardware::Rdma, Context::open_by_name(None));
    let ch = ctx.create_comp_channel().unwrap();
    let other = ctx.create_comp_channel().unwrap();
    let cq = ctx.create_cq(16, Some(&ch)).unwrap();
    let e = AsyncCq::new(cq, Some(other)).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { arg: "channel", .. }),
        "{e}"
    );
    let cq = ctx.create_cq(16, Some(&ch)).unwrap();
    let _second = ctx.create_cq(16, Some(&ch)).unwrap();
    let e = AsyncCq::new(cq, Some(ch)).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { arg: "channel", .. }),
        "{e}"
    );
    // A QP reporting to another CQ is refused.
    let pd = ctx.alloc_pd().unwrap();
    let cq1 = ctx.create_cq(64, None).unwrap();
    let cq2 = ctx.create_cq(64, None).unwrap();
    let a = init_qp(&pd, &cq1, &cq1, None, caps()).unwrap();
    let b = init_qp(&pd, &cq1, &cq1, None, caps()).unwrap();
    let (a, _b) = connect(&ctx, a, b).unwrap();
    let acq = AsyncCq::new(cq2, None).unwrap();
    let e = acq.attach(a, 4).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { arg: "qp", .. }), "{e}");
}

/// The peer side of the round-trip bench: a plain queue pair that answers every 8-byte message
/// with one of its own, polling its CQ without pause, until `stop`.
fn echo(
    mut qp: QueuePair<Rts>,
    mut cq: CompletionQueue,
    buf: MemoryRegion,
    reply: MemoryRegion,
    stop: Arc<AtomicBool>,
) {
    for k in 0..32 {
        qp.post_recv([RecvRequest::new(buf.slice(k * 8..(k + 1) * 8).unwrap()).tag(k as u64)])
            .unwrap();
    }
    while !stop.load(Ordering::Relaxed) {
        let mut got = Vec::new();
        for w in cq.poll().unwrap() {
            assert!(w.is_ok(), "{w:?}");
            if w.opcode() == WcOpcode::Recv {
                got.push(w.tag());
            }
        }
        for k in got {
            let k = k as usize;
            qp.post_recv([RecvRequest::new(buf.slice(k * 8..(k + 1) * 8).unwrap()).tag(k as u64)])
                .unwrap();
            qp.post_send([SendRequest::send(reply.slice(..).unwrap())])
                .unwrap();
        }
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

/// Blocking round trips on `qp`, then the same awaited through `AsyncCq::new(cq, channel)`.
fn round_trips(
    iters: usize,
    channel: bool,
    spin: Duration,
) -> gpudirect::Result<(Duration, Duration, f64, f64)> {
    let ctx = Context::open_by_name(None)?;
    let pd = ctx.alloc_pd()?;
    let (mut cq_a, ch_a) = cq(&ctx, channel)?;
    let cq_b = ctx.create_cq(256, None)?;
    let a = init_qp(&pd, &cq_a, &cq_a, None, caps())?;
    let b = init_qp(&pd, &cq_b, &cq_b, None, caps())?;
    let (mut a, b) = connect(&ctx, a, b)?;
    let stop = Arc::new(AtomicBool::new(false));
    let echo_t = {
        let buf = pd.register(HostBuffer::zeroed(32 * 8)?, AccessFlags::LOCAL_WRITE)?;
        let reply = pd.register(HostBuffer::from_slice(&[0x5A; 8])?, AccessFlags::empty())?;
        let stop = stop.clone();
        std::thread::spawn(move || echo(b, cq_b, buf, reply, stop))
    };
    let msg = pd.register(HostBuffer::from_slice(&[0xA5; 8])?, AccessFlags::empty())?;
    let rbuf = pd.register(HostBuffer::zeroed(8)?, AccessFlags::LOCAL_WRITE)?;
    // Blocking: post, then poll until the send and the reply completed.
    let mut blocking = Vec::with_capacity(iters);
    for _ in 0..iters + iters / 10 {
        a.post_recv([RecvRequest::new(rbuf.slice(..)?)])?;
        let t = Instant::now();
        a.post_send([SendRequest::send(msg.slice(..)?)])?;
        let mut seen = 0;
        while seen < 2 {
            for w in cq_a.poll()? {
                w.result()?;
                seen += 1;
            }
        }
        blocking.push(t.elapsed());
    }
    let blocking = median(blocking.split_off(iters / 10));
    // Awaited, on a current-thread runtime.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let (awaited, conc_blocking, conc_await) = rt.block_on(async {
        // 1,000 concurrent 8-byte writes, blocking first (posted as room allows, polled).
        let target =
            pd.register_remote(HostBuffer::zeroed(8 * 1000)?, AccessFlags::REMOTE_WRITE)?;
        let remote = target.remote();
        let t = Instant::now();
        let (mut posted, mut done) = (0usize, 0usize);
        while done < 1000 {
            while posted < 1000 && a.send_outstanding() < 32 {
                a.post_send([SendRequest::write(
                    msg.slice(..)?,
                    remote.slice(8 * posted as u64, 8)?,
                )])?;
                posted += 1;
            }
            for w in cq_a.poll()? {
                w.result()?;
                done += 1;
            }
        }
        let conc_blocking = 1000.0 / t.elapsed().as_secs_f64();
        let acq = AsyncCq::new(cq_a, ch_a)?;
        assert_eq!(acq.channel_driven(), channel);
        acq.spin(spin);
        let a = acq.attach(a, 1024)?;
        let mut m = a.messages();
        let mut awaited = Vec::with_capacity(iters);
        for _ in 0..iters + iters / 10 {
            a.post_recv(rbuf.slice(..)?)?;
            let t = Instant::now();
            a.send(msg.slice(..)?)?.await?;
            let r = next(&mut m).await?;
            awaited.push(t.elapsed());
            drop(r);
        }
        let awaited = median(awaited.split_off(iters / 10));
        let t = Instant::now();
        let mut futs = Vec::with_capacity(1000);
        for i in 0..1000u64 {
            futs.push(a.write(msg.slice(..)?, remote.slice(8 * i, 8)?)?);
        }
        for f in futs {
            f.await?;
        }
        let conc_await = 1000.0 / t.elapsed().as_secs_f64();
        Ok::<_, Error>((awaited, conc_blocking, conc_await))
    })?;
    stop.store(true, Ordering::Relaxed);
    echo_t.join().expect("echo thread");
    Ok((blocking, awaited, conc_blocking, conc_await))
}

#[test]
fn await_costs_against_the_blocking_poll() {
    require!(Hardware::Rdma, DeviceList::non_empty());
    let iters: usize = std::env::var("RDMA_ASYNC_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    for (channel, spin) in [
        (true, Duration::ZERO),
        (true, Duration::from_micros(50)),
        (true, Duration::from_micros(200)),
        (false, Duration::ZERO),
        (false, Duration::from_micros(200)),
    ] {
        let (blocking, awaited, cb, ca) = round_trips(iters, channel, spin).unwrap();
        let source = match (channel, spin.is_zero()) {
            (true, true) => "channel".to_string(),
            (true, false) => format!("channel, spin {} us", spin.as_micros()),
            (false, true) => "completion thread".to_string(),
            (false, false) => format!("completion thread, spin {} us", spin.as_micros()),
        };
        println!(
            "RDMA async: 8-byte send/recv round trip, median of {iters}: blocking poll {:.1} us, await ({source}) {:.1} us, ratio {:.2}x",
            blocking.as_secs_f64() * 1e6,
            awaited.as_secs_f64() * 1e6,
            awaited.as_secs_f64() / blocking.as_secs_f64()
        );
        println!(
            "RDMA async: 1000 concurrent 8-byte writes: blocking {cb:.0} ops/s, await ({source}) {ca:.0} ops/s, ratio {:.2}x",
            cb / ca
        );
    }
}

/// An rdma_cm connection awaited: made with one CQ and a receive channel, taken over by
/// `Connection::into_async`; messages and an RDMA write with immediate arrive with exact bytes.
/// The address is the device's own (its IPv4-mapped GID). A connection with two CQs is refused,
/// typed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rdma_cm_connection_is_awaited_through_one_cq() {
    let ctx = require!(Hardware::Rdma, Context::open_by_name(None));
    let Some(ip) = device_ipv4(&[ctx.name()]) else {
        // A failure when GPUDIRECT_REQUIRE names rdma.
        gpudirect_testing::skip(
            Hardware::Rdma,
            "no IPv4 address on the verbs device (rdma_cm needs one)",
        );
        return;
    };
    let ip = std::net::IpAddr::V4(ip);
    let l = require!(
        Hardware::Rdma,
        Listener::bind(std::net::SocketAddr::new(ip, 0))
    );
    let addr = std::net::SocketAddr::new(ip, l.port());
    let opts = |one_cq| ConnectOptions {
        caps: caps(),
        recv_channel: true,
        one_cq,
        ..ConnectOptions::default()
    };
    // Two CQs: refused.
    let two = opts(false);
    let t = std::thread::spawn(move || Connection::connect(addr, &two));
    let server = l.accept(&opts(false)).unwrap();
    let client = t.join().unwrap().unwrap();
    let e = client.into_async(8).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument {
                arg: "connection",
                ..
            }
        ),
        "{e}"
    );
    drop(server);
    // One CQ: awaited.
    let one = opts(true);
    let t = std::thread::spawn(move || Connection::connect(addr, &one));
    let mut server = l.accept(&opts(true)).unwrap();
    let mut client = t.join().unwrap().unwrap();
    const N: usize = 64;
    const SLOT: usize = 512;
    let data = random_bytes(N * SLOT);
    let src = client
        .pd()
        .register(HostBuffer::from_slice(&data).unwrap(), AccessFlags::empty())
        .unwrap();
    let mut rbuf = server
        .pd()
        .register(
            HostBuffer::zeroed(N * SLOT).unwrap(),
            AccessFlags::LOCAL_WRITE,
        )
        .unwrap();
    rbuf.fill(0, N * SLOT, 0xEE).unwrap();
    let target = server
        .pd()
        .register_remote(HostBuffer::zeroed(SLOT).unwrap(), AccessFlags::REMOTE_WRITE)
        .unwrap();
    let mine = target.remote();
    let st = std::thread::spawn(move || {
        server.exchange(mine, LONG).unwrap();
        server
    });
    let offer = client
        .pd()
        .register_remote(HostBuffer::zeroed(SLOT).unwrap(), AccessFlags::REMOTE_WRITE)
        .unwrap();
    let remote = client.exchange(offer.remote(), LONG).unwrap();
    let server = st.join().unwrap();
    let (_cq_a, a, _link_a) = client.into_async(N).unwrap();
    let (_cq_b, b, _link_b) = server.into_async(N).unwrap();
    for k in 0..N {
        b.post_recv(rbuf.slice(k * SLOT..(k + 1) * SLOT).unwrap())
            .unwrap();
    }
    let sends: Vec<_> = (0..N - 1)
        .map(|k| {
            a.send(src.slice(k * SLOT..(k + 1) * SLOT).unwrap())
                .unwrap()
                .timeout(LONG)
        })
        .collect();
    let mut m = b.messages();
    for k in 0..N - 1 {
        let r = next(&mut m).await.unwrap();
        assert_eq!(r.bytes(), &data[k * SLOT..(k + 1) * SLOT], "message {k}");
    }
    for s in sends {
        s.await.unwrap();
    }
    let w = SendRequest::write(
        src.slice(0..SLOT).unwrap(),
        remote.slice(0, SLOT as u32).unwrap(),
    )
    .with_imm(0xC0FFEE);
    a.post(w).unwrap().timeout(LONG).await.unwrap();
    let mut imms = b.immediates();
    assert_eq!(next(&mut imms).await.unwrap(), (0xC0FFEE, SLOT as u32));
    let mut got = vec![0u8; SLOT];
    target.read_at(0, &mut got).unwrap();
    assert_eq!(got, &data[..SLOT]);
}
