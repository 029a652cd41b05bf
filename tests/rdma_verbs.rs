//! Tier 1: every verbs path on host memory, over a loopback pair of RC queue pairs. Prints
//! `SKIPPED: reason` without a verbs device, and fails then when `GPUDIRECT_REQUIRE` names `rdma`.

mod support;

use gpudirect::Error;
use gpudirect::rdma::*;
use gpudirect_testing::{Hardware, require};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use support::rdma::*;

#[test]
fn device_port_and_gid_table() {
    let list = require!(Hardware::Rdma, DeviceList::non_empty());
    let dev = list.iter().next().unwrap();
    let ctx = Context::open(&dev).unwrap();
    assert_eq!(ctx.name(), dev.name());
    let attr = ctx.query_device().unwrap();
    assert!(
        attr.phys_port_cnt >= 1 && attr.max_qp > 0 && attr.max_mr_size > 0,
        "{attr:?}"
    );
    let port = ctx.query_port(1).unwrap();
    assert_eq!(port.state, PortState::Active, "{port:?}");
    assert!(port.active_mtu.bytes() >= 256);
    let table = ctx.gid_table(1).unwrap();
    assert!(!table.is_empty());
    for e in &table {
        assert_eq!(ctx.gid(1, e.index).unwrap(), e.gid);
        println!("GID[{}] {} {:?}", e.index, e.gid, e.gid_type);
    }
    if port.link_layer == LinkLayer::Ethernet {
        assert!(table.iter().all(|e| e.gid_type != GidType::Ib));
    }
    assert!(ctx.query_port(99).is_err(), "port 99 must not exist");
    // No asynchronous event is pending on a fresh context: non-blocking read says EAGAIN.
    ctx.set_async_nonblocking(true).unwrap();
    match ctx.get_async_event() {
        Err(Error::Os {
            call: "ibv_get_async_event",
            source,
        }) => assert_eq!(source.raw_os_error(), Some(libc::EAGAIN)),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn send_recv_exact_bytes_with_sg_and_inline() {
    let mut p = require!(Hardware::Rdma, pair());
    let data = random_bytes(3000);
    let src =
        p.pd.register(HostBuffer::from_slice(&data).unwrap(), AccessFlags::empty())
            .unwrap();
    let mut dst =
        p.pd.register(HostBuffer::zeroed(4096).unwrap(), AccessFlags::LOCAL_WRITE)
            .unwrap();
    dst.fill(0, 4096, 0xEE).unwrap(); // poison
    // Receive scattered over two slices; send gathered from two slices.
    p.b.post_recv([RecvRequest::sg(vec![
        dst.slice(0..1000).unwrap(),
        dst.slice(2000..4096).unwrap(),
    ])
    .tag(7)])
        .unwrap();
    p.a.post_send([SendRequest::send_sg(vec![
        src.slice(0..1500).unwrap(),
        src.slice(1500..3000).unwrap(),
    ])
    .tag(8)])
        .unwrap();
    let s = wait(&mut p.cq_a, 1);
    assert_eq!(
        (s[0].tag, s[0].status, s[0].opcode),
        (8, WcStatus::Success, WcOpcode::Send)
    );
    let r = wait(&mut p.cq_b, 1);
    assert_eq!(
        (r[0].tag, r[0].status, r[0].byte_len),
        (7, WcStatus::Success, 3000)
    );
    let got = dst
        .as_slice()
        .expect("no slice in flight after completion")
        .to_vec();
    assert_eq!(&got[..1000], &data[..1000]);
    assert!(got[1000..2000].iter().all(|&b| b == 0xEE), "gap untouched");
    assert_eq!(&got[2000..4000], &data[1000..3000]);

    // Inline send with immediate: no region on the sending side.
    let msg = random_bytes(48);
    p.b.post_recv([RecvRequest::new(dst.slice(0..64).unwrap()).tag(9)])
        .unwrap();
    p.a.post_send([SendRequest::send_inline(&msg).with_imm(0xA1B2C3D4)])
        .unwrap();
    wait(&mut p.cq_a, 1);
    let r = wait(&mut p.cq_b, 1);
    assert_eq!(
        (r[0].tag, r[0].byte_len, r[0].imm),
        (9, 48, Some(0xA1B2C3D4))
    );
    let mut back = [0u8; 48];
    dst.read_at(0, &mut back).unwrap();
    assert_eq!(&back[..], &msg[..]);
    // Too long for inline: checked before the FFI call.
    let big = vec![0u8; 4096];
    assert!(matches!(
        p.a.post_send([SendRequest::send_inline(&big)]),
        Err(Error::InvalidArgument { arg: "data", .. })
    ));
}

#[test]
fn rdma_write_with_immediate_and_read_back() {
    let mut p = require!(Hardware::Rdma, pair());
    let n = 65536;
    let data = random_bytes(n);
    let src =
        p.pd.register(HostBuffer::from_slice(&data).unwrap(), AccessFlags::empty())
            .unwrap();
    let mut target =
        p.pd.register_remote(
            HostBuffer::zeroed(n + 64).unwrap(),
            AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )
        .unwrap();
    assert!(
        target.access().contains(AccessFlags::LOCAL_WRITE),
        "remote write implies local write"
    );
    target.fill(0, n + 64, 0x5A).unwrap();
    let remote = target.remote();
    // Write at offset 32, with immediate: consumes a receive at the target.
    p.b.post_recv([RecvRequest::empty().tag(1)]).unwrap();
    p.a.post_send([SendRequest::write(
        src.slice(..).unwrap(),
        remote.slice(32, n as u32).unwrap(),
    )
    .with_imm(0x0102_0304)])
        .unwrap();
    assert_eq!(wait(&mut p.cq_a, 1)[0].opcode, WcOpcode::RdmaWrite);
    let r = wait(&mut p.cq_b, 1);
    assert_eq!(
        (r[0].status, r[0].opcode, r[0].imm),
        (
            WcStatus::Success,
            WcOpcode::RecvRdmaWithImm,
            Some(0x0102_0304)
        )
    );
    let all = target.to_vec();
    assert!(all[..32].iter().all(|&b| b == 0x5A));
    assert_eq!(&all[32..32 + n], &data[..]);
    assert!(all[32 + n..].iter().all(|&b| b == 0x5A));

    // Read it back into a poisoned local region.
    let mut back =
        p.pd.register(HostBuffer::zeroed(n).unwrap(), AccessFlags::LOCAL_WRITE)
            .unwrap();
    back.fill(0, n, 0xC3).unwrap();
    p.a.post_send([SendRequest::read(
        back.slice(..).unwrap(),
        remote.slice(32, n as u32).unwrap(),
    )
    .tag(5)])
        .unwrap();
    let d = wait(&mut p.cq_a, 1);
    assert_eq!(
        (d[0].tag, d[0].status, d[0].opcode),
        (5, WcStatus::Success, WcOpcode::RdmaRead)
    );
    assert_eq!(back.as_slice().unwrap(), &data[..]);

    // Inline RDMA write of a small payload.
    let small = random_bytes(40);
    p.a.post_send([SendRequest::write_inline(
        &small,
        remote.slice(0, 40).unwrap(),
    )])
    .unwrap();
    wait(&mut p.cq_a, 1);
    assert_eq!(&target.to_vec()[..40], &small[..]);

    // Reading into a region without local write is refused before the FFI call.
    let ro =
        p.pd.register(HostBuffer::zeroed(64).unwrap(), AccessFlags::empty())
            .unwrap();
    assert!(matches!(
        p.a.post_send([SendRequest::read(
            ro.slice(..).unwrap(),
            remote.slice(0, 64).unwrap()
        )]),
        Err(Error::InvalidArgument { arg: "local", .. })
    ));
    // Out of the remote bounds: refused.
    assert!(remote.slice(n as u64, 128).is_err());
}

#[test]
fn atomics_compare_swap_and_fetch_add() {
    let mut p = require!(Hardware::Rdma, pair());
    if p.ctx.query_device().unwrap().atomic_cap == 0 {
        gpudirect_testing::skip(Hardware::Rdma, "device has no atomics (atomic_cap 0)");
        return;
    }
    let mut word =
        p.pd.register_remote(HostBuffer::zeroed(64).unwrap(), AccessFlags::REMOTE_ATOMIC)
            .unwrap();
    word.write_at(8, &41u64.to_ne_bytes()).unwrap();
    let remote = word.remote();
    let mut result =
        p.pd.register(HostBuffer::zeroed(16).unwrap(), AccessFlags::LOCAL_WRITE)
            .unwrap();
    result.fill(0, 16, 0xFF).unwrap();
    p.a.post_send([SendRequest::fetch_add(
        result.slice(0..8).unwrap(),
        remote.slice(8, 8).unwrap(),
        1,
    )])
    .unwrap();
    assert_eq!(wait(&mut p.cq_a, 1)[0].status, WcStatus::Success);
    assert_eq!(result.read_u64(0).unwrap(), 41);
    assert_eq!(word.read_u64(8).unwrap(), 42);
    // CAS that matches, then one that does not.
    p.a.post_send([
        SendRequest::compare_swap(
            result.slice(8..16).unwrap(),
            remote.slice(8, 8).unwrap(),
            42,
            7,
        )
        .tag(1),
        SendRequest::compare_swap(
            result.slice(0..8).unwrap(),
            remote.slice(8, 8).unwrap(),
            42,
            9,
        )
        .tag(2)
        .fence(),
    ])
    .unwrap();
    let d = wait(&mut p.cq_a, 2);
    assert!(d.iter().all(|d| d.status == WcStatus::Success), "{d:?}");
    assert_eq!(result.read_u64(8).unwrap(), 42);
    assert_eq!(
        result.read_u64(0).unwrap(),
        7,
        "second CAS saw the swapped value"
    );
    assert_eq!(word.read_u64(8).unwrap(), 7);
    // Misaligned target and wrong result size: refused before the FFI call.
    assert!(matches!(
        p.a.post_send([SendRequest::fetch_add(
            result.slice(0..8).unwrap(),
            remote.slice(4, 8).unwrap(),
            1
        )]),
        Err(Error::InvalidArgument { arg: "remote", .. })
    ));
    assert!(matches!(
        p.a.post_send([SendRequest::fetch_add(
            result.slice(0..16).unwrap(),
            remote.slice(8, 8).unwrap(),
            1
        )]),
        Err(Error::InvalidArgument { arg: "local", .. })
    ));
}

#[test]
fn unsignaled_chains_release_memory_at_the_signaled_completion() {
    let mut p = require!(Hardware::Rdma, pair());
    let target =
        p.pd.register_remote(
            HostBuffer::zeroed(64 * 100).unwrap(),
            AccessFlags::REMOTE_WRITE,
        )
        .unwrap();
    let remote = target.remote();
    let data = random_bytes(64 * 100);
    let src =
        p.pd.register(HostBuffer::from_slice(&data).unwrap(), AccessFlags::empty())
            .unwrap();
    let flag = gpudirect::completion::CompletionFlag::new();
    // 100 writes in chains of 10, all unsignaled: the QP signals one in every 8 (caps) and the
    // memory of the unsignaled ones is released by the signaled completion after them.
    let mut posted = 0;
    let mut completions = 0;
    while posted < 100 {
        let chain: Vec<_> = (posted..posted + 10)
            .map(|i| {
                let w = SendRequest::write(
                    src.slice(i * 64..(i + 1) * 64).unwrap(),
                    remote.slice(i as u64 * 64, 64).unwrap(),
                )
                .unsignaled();
                if i == 99 {
                    w.signaled().tag(99).notify(flag.clone())
                } else {
                    w
                }
            })
            .collect();
        match p.a.post_send(chain) {
            Ok(n) => posted += n,
            Err(Error::QueueFull { .. }) => {}
            Err(e) => panic!("{e}"),
        }
        completions += p
            .cq_a
            .poll()
            .unwrap()
            .inspect(|w| assert!(w.is_ok(), "{w:?}"))
            .count();
    }
    while p.a.outstanding() > 0 {
        completions += p.cq_a.poll().unwrap().count();
    }
    assert!(gpudirect::completion::Fence::is_complete(&flag));
    assert!(
        (100 / 8..100).contains(&completions),
        "{completions} completions for 100 requests"
    );
    assert_eq!(target.to_vec(), data);
}

#[test]
fn shared_receive_queue_serves_a_qp() {
    let ctx = require!(Hardware::Rdma, Context::open_by_name(None));
    let pd = ctx.alloc_pd().unwrap();
    let srq = SharedReceiveQueue::new(&pd, 32, 1).unwrap();
    let mut p = pair_on(ctx, pd, Some(&srq)).unwrap();
    let mut dst =
        p.pd.register(HostBuffer::zeroed(256).unwrap(), AccessFlags::LOCAL_WRITE)
            .unwrap();
    dst.fill(0, 256, 0x11).unwrap();
    srq.post_recv(
        (0..4).map(|i| RecvRequest::new(dst.slice(i * 64..(i + 1) * 64).unwrap()).tag(i as u64)),
    )
    .unwrap();
    assert_eq!(srq.outstanding(), 4);
    assert!(
        p.b.post_recv([RecvRequest::new(dst.slice(..64).unwrap())])
            .is_err(),
        "QP with SRQ refuses direct receives"
    );
    let msg = random_bytes(64);
    p.a.post_send([SendRequest::send_inline(&msg)]).unwrap();
    wait(&mut p.cq_a, 1);
    let r = wait(&mut p.cq_b, 1);
    assert_eq!((r[0].status, r[0].byte_len), (WcStatus::Success, 64));
    let i = r[0].tag as usize;
    assert_eq!(&dst.to_vec()[i * 64..(i + 1) * 64], &msg[..]);
    assert_eq!(srq.outstanding(), 3);
}

#[test]
fn remote_access_error_is_typed() {
    let mut p = require!(Hardware::Rdma, pair());
    let local =
        p.pd.register(HostBuffer::zeroed(64).unwrap(), AccessFlags::empty())
            .unwrap();
    // A region the peer may only read: writing to it is a remote access error.
    let ro =
        p.pd.register(HostBuffer::zeroed(64).unwrap(), AccessFlags::REMOTE_READ)
            .unwrap();
    p.a.post_send([SendRequest::write(
        local.slice(..).unwrap(),
        ro.remote().slice(0, 64).unwrap(),
    )
    .tag(3)])
        .unwrap();
    let d = wait(&mut p.cq_a, 1);
    assert_eq!(
        (d[0].tag, d[0].status),
        (3, WcStatus::RemoteAccess),
        "{d:?}"
    );
    assert!(ro.to_vec().iter().all(|&b| b == 0));
}

#[test]
fn completion_channel_wakes_on_completion() {
    let ctx = require!(Hardware::Rdma, Context::open_by_name(None));
    let ch = ctx.create_comp_channel().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let mut p = pair_on(ctx.clone(), pd, None).unwrap();
    let mut cq = ctx.create_cq(16, Some(&ch)).unwrap();
    let port = ctx.query_port(1).unwrap();
    let gid = ctx.preferred_gid(1).unwrap();
    // A third QP whose receive CQ reports to the channel, connected to a fresh sender.
    let all = AccessFlags::REMOTE_WRITE;
    let rx = QueuePair::create(&p.pd, &p.cq_b, &cq, None, caps())
        .unwrap()
        .to_init(1, all)
        .unwrap();
    let tx = QueuePair::create(&p.pd, &p.cq_a, &p.cq_a, None, caps())
        .unwrap()
        .to_init(1, all)
        .unwrap();
    let ep = |q| Endpoint {
        qp_num: q,
        psn: 1,
        gid: gid.gid,
        gid_index: gid.index as u8,
        lid: port.lid,
    };
    let (erx, etx) = (ep(rx.qp_num()), ep(tx.qp_num()));
    let mut rx = rx
        .to_rtr(&RtrAttr::from_endpoint(
            &etx,
            port.active_mtu,
            gid.index as u8,
        ))
        .unwrap()
        .to_rts(&RtsAttr::new(1))
        .unwrap();
    let mut tx = tx
        .to_rtr(&RtrAttr::from_endpoint(
            &erx,
            port.active_mtu,
            gid.index as u8,
        ))
        .unwrap()
        .to_rts(&RtsAttr::new(1))
        .unwrap();
    let buf =
        p.pd.register(HostBuffer::zeroed(64).unwrap(), AccessFlags::LOCAL_WRITE)
            .unwrap();
    rx.post_recv([RecvRequest::new(buf.slice(..).unwrap())])
        .unwrap();
    cq.req_notify(false).unwrap();
    tx.post_send([SendRequest::send_inline(b"wake")]).unwrap();
    let ev = ch.get_event().unwrap();
    assert!(cq.is_event_for(&ev));
    let d = wait(&mut cq, 1);
    assert_eq!((d[0].status, d[0].byte_len), (WcStatus::Success, 4));
    wait(&mut p.cq_a, 1);
    // The CQ is destroyed after the QPs; its event was acknowledged when read.
    drop((rx, tx));
    drop(p.a);
}

/// A QP with outstanding receives goes to the error state; the receive buffers are freed
/// only when their flushed completions are polled, never before.
#[test]
fn buffers_freed_only_after_flush_completions() {
    let mut p = require!(Hardware::Rdma, pair());
    let freed = Arc::new(AtomicUsize::new(0));
    for i in 0..4 {
        let mr =
            p.pd.register(
                Counted(vec![0; 4096], freed.clone()),
                AccessFlags::LOCAL_WRITE,
            )
            .unwrap();
        p.b.post_recv([RecvRequest::new(mr.slice(..).unwrap()).tag(i)])
            .unwrap();
        drop(mr); // the posted request keeps the region and its memory
    }
    assert_eq!(freed.load(Ordering::SeqCst), 0);
    assert_eq!(p.b.outstanding(), 4);
    let b = p.b.into_error().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(
        freed.load(Ordering::SeqCst),
        0,
        "error state alone frees nothing"
    );
    let d = wait(&mut p.cq_b, 4);
    assert!(d.iter().all(|d| d.status == WcStatus::Flushed), "{d:?}");
    assert_eq!(
        freed.load(Ordering::SeqCst),
        4,
        "freed when the flushes were polled"
    );
    assert_eq!(b.outstanding(), 0);
    drop(b);
}

/// The same by drop: dropping a QP with outstanding receives drains their flushes before it frees
/// anything, and a completion of another QP found on the shared CQ during the drain is kept for
/// its owner's next poll.
#[test]
fn dropped_qp_drains_before_freeing() {
    let ctx = require!(Hardware::Rdma, Context::open_by_name(None));
    let pd = ctx.alloc_pd().unwrap();
    let p = pair_opts(ctx, pd, None, true).unwrap();
    let Pair {
        mut a,
        b,
        mut cq_a,
        pd,
        ..
    } = p;
    let mut b = b;
    let freed = Arc::new(AtomicUsize::new(0));
    let mr = pd
        .register(
            Counted(vec![0; 8192], freed.clone()),
            AccessFlags::LOCAL_WRITE,
        )
        .unwrap();
    b.post_recv(
        (0..8).map(|i| RecvRequest::new(mr.slice(i * 1024..(i + 1) * 1024).unwrap()).tag(i as u64)),
    )
    .unwrap();
    drop(mr);
    // a's send lands in b's first receive; both completions wait, unpolled, on the shared CQ.
    a.post_send([SendRequest::send_inline(b"x").tag(42)])
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(freed.load(Ordering::SeqCst), 0);
    drop(b);
    assert_eq!(
        freed.load(Ordering::SeqCst),
        1,
        "the region's memory goes once all 8 receives completed or flushed"
    );
    let d = wait(&mut cq_a, 1);
    assert_eq!(
        (d[0].tag, d[0].status, d[0].opcode),
        (42, WcStatus::Success, WcOpcode::Send),
        "a's completion was kept for it"
    );
    assert_eq!(
        cq_a.poll().unwrap().count(),
        0,
        "b's completions were consumed by its drain"
    );
    drop(a);
}

/// `ibv_reg_dmabuf_mr` answering EOPNOTSUPP (Soft-RoCE) is a typed `Unsupported` that says
/// dma-buf. A memfd stands in for the dma-buf: rxe refuses before looking at it; a device that
/// supports dma-bufs refuses the memfd with an `Os` error instead.
#[test]
fn dmabuf_unsupported_is_typed() {
    use std::os::fd::{FromRawFd, OwnedFd};
    let ctx = require!(Hardware::Rdma, Context::open_by_name(None));
    let pd = ctx.alloc_pd().unwrap();
    // SAFETY: memfd_create with a NUL-terminated name; the fd is owned below.
    let raw = unsafe { libc::memfd_create(c"gpudirect-a3".as_ptr(), 0) };
    assert!(raw >= 0);
    // SAFETY: a fresh fd owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: a valid fd.
    assert_eq!(unsafe { libc::ftruncate(raw, 1 << 16) }, 0);
    // SAFETY: the memfd's pages stay allocated while the fd, which the region keeps, is open.
    match unsafe { pd.register_dmabuf_fd(fd, 0, 1 << 16, 0, AccessFlags::LOCAL_WRITE) } {
        Err(Error::Unsupported { what, reason }) => {
            assert!(what.contains("dma-buf"), "{what}");
            println!("typed: {what}: {reason}");
        }
        Err(Error::Os {
            call: "ibv_reg_dmabuf_mr",
            source,
        }) => {
            assert!(
                !ctx.name().starts_with("rxe"),
                "rxe must answer Unsupported, got {source}"
            );
        }
        other => panic!("unexpected {other:?}"),
    }
}
