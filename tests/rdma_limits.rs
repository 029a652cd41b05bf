//! Tier 1: capacity and state rules on a verbs device. A completion queue never gets more
//! completions than it holds (send queues, receive queues and shared receive queues alike), and
//! the typed states follow the hardware through ERR → RESET → INIT → RTR → RTS. Prints
//! `SKIPPED: reason` without a verbs device, and fails then when `GPUDIRECT_REQUIRE` names `rdma`.

mod support;

use gpudirect::Error;
use gpudirect::completion::{CompletionFlag, Fence};
use gpudirect::rdma::*;
use gpudirect_testing::{Hardware, require};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use support::rdma::*;

const CHUNK: usize = 64;

fn small_caps(send: u32, recv: u32) -> QpCaps {
    QpCaps {
        max_send_wr: send,
        max_recv_wr: recv,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 64,
        signal_every: 0,
    }
}

fn is_cq_full(r: &gpudirect::Result<usize>, cap: u32) -> bool {
    matches!(r, Err(Error::QueueFull { queue: "completion queue", depth }) if *depth == cap)
}

/// The reported case: a send queue of 64 on a CQ of 4 entries used to accept a chain of 48
/// signaled writes (41 completions lost, 41 requests held forever). Now the chain is refused
/// whole, nothing reaches the NIC, and a chain that fits completes fully; then all 48 go through
/// in pieces the CQ can hold.
#[test]
fn a_chain_larger_than_its_cq_is_refused_whole() {
    let ctx = require!(Hardware::Rdma, Context::open_by_name(None));
    let pd = ctx.alloc_pd().unwrap();
    let mut small = ctx.create_cq(4, None).unwrap();
    let big = ctx.create_cq(256, None).unwrap();
    let cap = small.capacity();
    assert!((4..48).contains(&cap), "capacity {cap}");
    let a = init_qp(&pd, &small, &small, None, small_caps(64, 4)).unwrap();
    assert_eq!(small.reserved(), 1, "one entry kept for the QP's teardown");
    let b = init_qp(&pd, &big, &big, None, caps()).unwrap();
    let (mut a, _b) = connect(&ctx, a, b).unwrap();
    assert!(a.caps().max_send_wr >= 48);

    let data = random_bytes(48 * CHUNK);
    let src = pd
        .register(HostBuffer::from_slice(&data).unwrap(), AccessFlags::empty())
        .unwrap();
    let target = pd
        .register_remote(
            HostBuffer::zeroed(48 * CHUNK).unwrap(),
            AccessFlags::REMOTE_WRITE,
        )
        .unwrap();
    let remote = target.remote();
    let write = |i: usize| {
        SendRequest::write(
            src.slice(i * CHUNK..(i + 1) * CHUNK).unwrap(),
            remote.slice((i * CHUNK) as u64, CHUNK as u32).unwrap(),
        )
        .tag(i as u64)
    };

    // 48 signaled writes on a CQ of `cap`: refused whole, typed, nothing posted.
    let r = a.post_send((0..48).map(write));
    assert!(is_cq_full(&r, cap), "{r:?}");
    assert_eq!(a.send_outstanding(), 0);
    assert_eq!(small.reserved(), 1);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(small.poll().unwrap().count(), 0, "nothing reached the NIC");
    assert!(
        target.to_vec().iter().all(|&b| b == 0),
        "no byte was written"
    );
    // Unsignaled requests count as well: in the error state each one would complete.
    let r = a.post_send((0..48).map(|i| write(i).unsignaled()));
    assert!(is_cq_full(&r, cap), "{r:?}");
    assert_eq!(a.send_outstanding(), 0);

    // What fits: every completion arrives, no more and no less.
    let legal = small.available() as usize;
    assert_eq!(legal, cap as usize - 1);
    assert_eq!(a.post_send((0..legal).map(write)).unwrap(), legal);
    assert_eq!(small.available(), 0);
    let r = a.post_send([write(legal)]);
    assert!(is_cq_full(&r, cap), "one more does not fit: {r:?}");
    let d = wait_exactly(&mut small, legal, Duration::from_millis(100));
    assert!(d.iter().all(|d| d.status == WcStatus::Success), "{d:?}");
    let mut tags: Vec<u64> = d.iter().map(|d| d.tag).collect();
    tags.sort_unstable();
    assert_eq!(tags, (0..legal as u64).collect::<Vec<_>>());
    assert_eq!(a.outstanding(), 0);
    assert_eq!(small.reserved(), 1);
    let got = target.to_vec();
    assert_eq!(&got[..legal * CHUNK], &data[..legal * CHUNK]);
    assert!(got[legal * CHUNK..].iter().all(|&b| b == 0));

    // All 48, in chains the CQ can hold, mostly unsignaled: the CQ room paces the poster.
    let mut next = legal;
    let mut refusals = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while next < 48 {
        assert!(
            std::time::Instant::now() < deadline,
            "posting stalled at {next}: {a:?}, {small:?}"
        );
        let n = (small.available() as usize).min(48 - next).min(5);
        if n > 0 {
            match a.post_send((next..next + n).map(|i| write(i).unsignaled())) {
                Ok(k) => next += k,
                Err(Error::QueueFull {
                    queue: "completion queue",
                    ..
                }) => refusals += 1,
                Err(e) => panic!("{e}"),
            }
        }
        for w in small.poll().unwrap() {
            assert!(w.is_ok(), "{w:?}");
        }
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while target.to_vec() != data {
        assert!(std::time::Instant::now() < deadline, "writes did not land");
        small
            .poll()
            .unwrap()
            .for_each(|w| assert!(w.is_ok(), "{w:?}"));
    }
    println!("48 writes done; {refusals} chains refused while the CQ was full");
}

/// Receives count against their CQ too, and a CQ's room is shared by every QP using it.
#[test]
fn receives_and_shared_cqs_are_bounded_by_the_cq() {
    let ctx = require!(Hardware::Rdma, Context::open_by_name(None));
    let pd = ctx.alloc_pd().unwrap();
    let mut small = ctx.create_cq(4, None).unwrap();
    let big = ctx.create_cq(256, None).unwrap();
    let cap = small.capacity();
    // b sends on the big CQ and receives on the small one.
    let a = init_qp(&pd, &big, &big, None, caps()).unwrap();
    let b = init_qp(&pd, &big, &small, None, small_caps(64, 64)).unwrap();
    let (mut a, mut b) = connect(&ctx, a, b).unwrap();
    assert_eq!(small.reserved(), 0, "b's teardown entry is on its send CQ");
    let buf = pd
        .register(
            HostBuffer::zeroed(64 * CHUNK).unwrap(),
            AccessFlags::LOCAL_WRITE,
        )
        .unwrap();
    let recv =
        |i: usize| RecvRequest::new(buf.slice(i * CHUNK..(i + 1) * CHUNK).unwrap()).tag(i as u64);
    let r = b.post_recv((0..48).map(recv));
    assert!(is_cq_full(&r, cap), "{r:?}");
    assert_eq!(b.outstanding(), 0);
    assert_eq!(small.reserved(), 0);
    let legal = cap as usize;
    assert_eq!(b.post_recv((0..legal).map(recv)).unwrap(), legal);
    assert!(is_cq_full(&b.post_recv([recv(legal)]), cap));
    let msgs: Vec<Vec<u8>> = (0..legal).map(|_| random_bytes(CHUNK)).collect();
    for m in &msgs {
        a.post_send([SendRequest::send_inline(m).unsignaled()])
            .unwrap();
    }
    let d = wait_exactly(&mut small, legal, Duration::from_millis(100));
    assert!(
        d.iter()
            .all(|d| d.status == WcStatus::Success && d.byte_len == CHUNK as u32),
        "{d:?}"
    );
    let mut buf = buf;
    let got = buf.as_slice().expect("no slice in flight").to_vec();
    for (i, m) in msgs.iter().enumerate() {
        assert_eq!(&got[i * CHUNK..(i + 1) * CHUNK], &m[..], "message {i}");
    }

    // Two QPs sending on one CQ share its room.
    let shared = ctx.create_cq(8, None).unwrap();
    let cap = shared.capacity();
    let x = init_qp(&pd, &shared, &big, None, small_caps(64, 8)).unwrap();
    let y = init_qp(&pd, &shared, &big, None, small_caps(64, 8)).unwrap();
    let (mut x, mut y) = connect(&ctx, x, y).unwrap();
    assert_eq!(shared.reserved(), 2);
    let half = (cap as usize - 2) / 2;
    let msg = [7u8; 8];
    // x and y send to each other: post receives first (on the big CQ).
    let sink = pd
        .register(
            HostBuffer::zeroed(8 * 64).unwrap(),
            AccessFlags::LOCAL_WRITE,
        )
        .unwrap();
    for q in [&mut x, &mut y] {
        q.post_recv((0..8).map(|i| RecvRequest::new(sink.slice(i * 64..(i + 1) * 64).unwrap())))
            .unwrap();
    }
    assert_eq!(
        x.post_send((0..half).map(|_| SendRequest::send_inline(&msg).unsignaled()))
            .unwrap(),
        half
    );
    let rest = cap as usize - 2 - half;
    let r = y.post_send((0..rest + 1).map(|_| SendRequest::send_inline(&msg)));
    assert!(
        is_cq_full(&r, cap),
        "y sees the room x took: {r:?} ({} reserved)",
        shared.reserved()
    );
    assert_eq!(y.send_outstanding(), 0);
}

/// A shared receive queue's receives may all complete on any one of its QPs' receive CQs: each
/// such CQ keeps room for the SRQ's depth, and a CQ without that room is refused at QP creation.
#[test]
fn srq_completions_fit_every_cq_they_can_reach() {
    let ctx = require!(Hardware::Rdma, Context::open_by_name(None));
    let pd = ctx.alloc_pd().unwrap();
    let srq = SharedReceiveQueue::new(&pd, 32, 1).unwrap();
    let depth = srq.depth();
    assert!(depth >= 32);
    let small = ctx.create_cq(4, None).unwrap();
    let big = ctx.create_cq(256, None).unwrap();
    let r = QueuePair::create(&pd, &big, &small, Some(&srq), small_caps(16, 0));
    assert!(
        matches!(
            r,
            Err(Error::QueueFull {
                queue: "completion queue",
                ..
            })
        ),
        "{r:?}"
    );
    assert_eq!(small.reserved(), 0, "nothing kept after the refusal");
    assert_eq!(
        big.reserved(),
        0,
        "the send CQ's teardown entry was given back"
    );

    let mut rcq = ctx.create_cq(depth + 4, None).unwrap();
    let b1 = init_qp(&pd, &big, &rcq, Some(&srq), small_caps(16, 0)).unwrap();
    assert_eq!(rcq.reserved(), depth);
    let b2 = init_qp(&pd, &big, &rcq, Some(&srq), small_caps(16, 0)).unwrap();
    assert_eq!(rcq.reserved(), depth, "once per CQ and SRQ");
    let a1 = init_qp(&pd, &big, &big, None, caps()).unwrap();
    let a2 = init_qp(&pd, &big, &big, None, caps()).unwrap();
    let (mut a1, _b1) = connect(&ctx, a1, b1).unwrap();
    let (mut a2, _b2) = connect(&ctx, a2, b2).unwrap();

    let buf = pd
        .register(
            HostBuffer::zeroed(depth as usize * CHUNK).unwrap(),
            AccessFlags::LOCAL_WRITE,
        )
        .unwrap();
    let recv =
        |i: usize| RecvRequest::new(buf.slice(i * CHUNK..(i + 1) * CHUNK).unwrap()).tag(i as u64);
    assert_eq!(
        srq.post_recv((0..depth as usize).map(recv)).unwrap(),
        depth as usize
    );
    let r = srq.post_recv([recv(0)]);
    assert!(
        matches!(
            r,
            Err(Error::QueueFull {
                queue: "shared receive queue",
                ..
            })
        ),
        "{r:?}"
    );
    // Every receive completes on the one CQ, from two QPs.
    let msg = random_bytes(CHUNK);
    let half = depth as usize / 2;
    for i in 0..depth as usize {
        let q = if i < half { &mut a1 } else { &mut a2 };
        q.post_send([SendRequest::send_inline(&msg).unsignaled()])
            .unwrap();
    }
    let d = wait_exactly(&mut rcq, depth as usize, Duration::from_millis(100));
    assert!(d.iter().all(|d| d.status == WcStatus::Success), "{d:?}");
    assert_eq!(srq.outstanding(), 0);
    assert_eq!(
        rcq.reserved(),
        depth,
        "the SRQ's room stays for the CQ's life"
    );
}

/// ERR → RESET → INIT → RTR → RTS, with the hardware state checked at each step, then traffic
/// with exact bytes. Work outstanding at the error is flushed (or, unsignaled, proven done) and
/// released before RESET.
#[test]
fn error_reset_init_rtr_rts_cycle() {
    let p = require!(Hardware::Rdma, pair());
    let Pair {
        ctx,
        pd,
        mut cq_a,
        mut cq_b,
        a,
        b,
    } = p;
    let mut a = a;
    assert_eq!(a.query_state().unwrap(), a.state());
    assert_eq!(a.state(), QpStateKind::Rts);
    let target = pd
        .register_remote(HostBuffer::zeroed(4096).unwrap(), AccessFlags::REMOTE_WRITE)
        .unwrap();
    let freed = Arc::new(AtomicUsize::new(0));
    let src = pd
        .register(
            Counted(random_bytes(4096), freed.clone()),
            AccessFlags::LOCAL_WRITE,
        )
        .unwrap();
    // An unsignaled write (nothing will report it) and a receive that no message will fill.
    a.post_send([SendRequest::write(
        src.slice(..1024).unwrap(),
        target.remote().slice(0, 1024).unwrap(),
    )
    .unsignaled()])
        .unwrap();
    let flag = CompletionFlag::new();
    a.post_recv([RecvRequest::new(src.slice(2048..).unwrap())
        .tag(77)
        .notify(flag.clone())])
        .unwrap();
    drop(src);
    assert_eq!(a.outstanding(), 2);

    let a = a.into_error().unwrap();
    assert_eq!(a.query_state().unwrap(), QpStateKind::Error);
    assert_eq!(a.state(), QpStateKind::Error);
    // The user may poll the flushes; the receive's comes back with its tag (the write's too, if
    // it was still in flight).
    let mut seen = Vec::new();
    while !seen.iter().any(|d: &Done| d.tag == 77) {
        seen.extend(wait(&mut cq_a, 1));
    }
    assert!(
        seen.iter().all(|d| d.status == WcStatus::Flushed),
        "{seen:?}"
    );
    assert!(flag.is_complete());
    let a = a.reset().unwrap();
    assert_eq!(a.query_state().unwrap(), QpStateKind::Reset);
    assert_eq!(a.outstanding(), 0, "the unsignaled write was proven done");
    assert_eq!(
        freed.load(Ordering::SeqCst),
        1,
        "its memory was freed once released"
    );
    assert_eq!(cq_a.reserved(), 1, "only the teardown entry");
    let b = b.into_error().unwrap().reset().unwrap();

    let a = a.to_init(1, all_access()).unwrap();
    assert_eq!(a.query_state().unwrap(), QpStateKind::Init);
    let b = b.to_init(1, all_access()).unwrap();
    let (mut a, mut b) = connect(&ctx, a, b).unwrap();
    assert_eq!(a.query_state().unwrap(), QpStateKind::Rts);
    assert_eq!(b.query_state().unwrap(), QpStateKind::Rts);

    // Traffic again, exact bytes both ways.
    let data = random_bytes(3000);
    let tx = pd
        .register(HostBuffer::from_slice(&data).unwrap(), AccessFlags::empty())
        .unwrap();
    let mut rx = pd
        .register(HostBuffer::zeroed(4096).unwrap(), AccessFlags::LOCAL_WRITE)
        .unwrap();
    rx.fill(0, 4096, 0xEE).unwrap();
    b.post_recv([RecvRequest::new(rx.slice(..).unwrap()).tag(1)])
        .unwrap();
    a.post_send([SendRequest::send(tx.slice(..).unwrap()).tag(2)])
        .unwrap();
    assert_eq!(wait(&mut cq_a, 1)[0].status, WcStatus::Success);
    let r = wait(&mut cq_b, 1);
    assert_eq!(
        (r[0].tag, r[0].status, r[0].byte_len),
        (1, WcStatus::Success, 3000)
    );
    let got = rx.as_slice().unwrap();
    assert_eq!(&got[..3000], &data[..]);
    assert!(got[3000..].iter().all(|&x| x == 0xEE));
    b.post_send([SendRequest::write(
        rx.slice(..3000).unwrap(),
        target.remote().slice(100, 3000).unwrap(),
    )])
    .unwrap();
    assert_eq!(wait(&mut cq_b, 1)[0].status, WcStatus::Success);
    let t = target.to_vec();
    assert_eq!(&t[100..3100], &data[..]);
}

/// A transition attribute out of its range (a peer's endpoint is untrusted) is refused before
/// the verbs call; the transition consumed the QP, which is then torn down cleanly.
#[test]
fn transition_attributes_from_a_peer_are_checked() {
    let ctx = require!(Hardware::Rdma, Context::open_by_name(None));
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None).unwrap();
    let before = teardown_stats();
    let qp = init_qp(&pd, &cq, &cq, None, small_caps(4, 4)).unwrap();
    let bad = Endpoint {
        qp_num: 1 << 24,
        psn: 0,
        gid: Gid::default(),
        gid_index: 0,
        lid: 0,
    };
    let r = qp.to_rtr(&RtrAttr::from_endpoint(&bad, Mtu::Mtu1024, 0));
    assert!(
        matches!(
            r,
            Err(Error::InvalidArgument {
                arg: "dest_qp_num",
                ..
            })
        ),
        "{r:?}"
    );
    let after = teardown_stats();
    assert!(after.queue_pairs_destroyed > before.queue_pairs_destroyed);
    assert_eq!(cq.reserved(), 0);
    let qp = init_qp(&pd, &cq, &cq, None, small_caps(4, 4)).unwrap();
    let r = qp.to_rtr(&RtrAttr::new(1, 1 << 24, Mtu::Mtu1024));
    assert!(
        matches!(r, Err(Error::InvalidArgument { arg: "rq_psn", .. })),
        "{r:?}"
    );
}
