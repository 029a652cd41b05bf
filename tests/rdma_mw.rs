//! Tier 1: type 2 memory windows over loopback pairs of RC queue pairs: a window bound through
//! one queue pair gives exactly its range to that queue pair's peer and to no other, until it is
//! invalidated, while the region's own rkey keeps working; refusals are typed; a bound window
//! keeps its region alive. Prints `SKIPPED: reason` without a verbs device (and fails then when
//! `GPUDIRECT_REQUIRE` names `rdma`), and `SKIPPED: reason` when the device reports no type 2
//! windows.

mod support;

use gpudirect::Error;
use gpudirect::rdma::*;
use gpudirect_testing::{Hardware, require};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use support::rdma::*;

const POISON: u8 = 0x5A;
const REGION: usize = 64 * 1024;
/// The window's range of the region.
const AT: usize = 4096;
const LEN: usize = 16 * 1024;

/// Whether the device has type 2 windows; prints what it reports, and `SKIPPED` when it has
/// none (a capability, not a device: skipped even when `GPUDIRECT_REQUIRE` names `rdma`).
fn type_2(ctx: &Context) -> bool {
    let attr = ctx.query_device().expect("ibv_query_device");
    let types = attr.memory_windows();
    println!(
        "{}: memory windows {types:?} (device_cap_flags {:#x}, max_mw {})",
        ctx.name(),
        attr.device_cap_flags,
        attr.max_mw
    );
    if !types.type_2() {
        println!(
            "SKIPPED: {} reports no type 2 memory windows ({types:?})",
            ctx.name()
        );
    }
    types.type_2()
}

/// Another pair of queue pairs on `p`'s device and protection domain.
fn pair_beside(p: &Pair) -> Pair {
    pair_on(p.ctx.clone(), p.pd.clone(), None).expect("a second pair")
}

/// Bind `window` through `qp` (its completions go to `cq`) and wait for the bind.
fn bind(
    qp: &mut QueuePair,
    cq: &mut CompletionQueue,
    window: MemoryWindow,
    range: MrSlice,
    access: AccessFlags,
) -> BoundWindow {
    let pending = qp
        .bind_window(window, WindowBind::new(range, access).tag(11))
        .expect("bind posted");
    assert!(!pending.is_complete(), "nothing polled yet");
    let done = wait(cq, 1);
    assert_eq!(
        (done[0].tag, done[0].status, done[0].opcode),
        (11, WcStatus::Success, WcOpcode::BindMw)
    );
    match pending.finish() {
        BindOutcome::Bound(b) => b,
        other => panic!("bind: {other:?}"),
    }
}

/// Invalidate `window` through `qp` and wait for it.
fn invalidate(qp: &mut QueuePair, cq: &mut CompletionQueue, window: BoundWindow) -> MemoryWindow {
    let pending = qp
        .invalidate_window(window, 12)
        .expect("invalidation posted");
    let done = wait(cq, 1);
    assert_eq!(
        (done[0].tag, done[0].status, done[0].opcode),
        (12, WcStatus::Success, WcOpcode::LocalInv)
    );
    match pending.finish() {
        InvalidateOutcome::Unbound(w) => w,
        other => panic!("invalidation: {other:?}"),
    }
}

/// Post `wr` on `qp` and return its completion's status.
fn status_of(qp: &mut QueuePair, cq: &mut CompletionQueue, wr: SendRequest<'_>) -> WcStatus {
    qp.post_send([wr]).expect("posted");
    wait(cq, 1)[0].status
}

/// The region as it should be: poison, with `data` at `at`.
fn expect(region: &MemoryRegion<Remote>, parts: &[(usize, &[u8])]) {
    let mut want = vec![POISON; REGION];
    for (at, data) in parts {
        want[*at..*at + data.len()].copy_from_slice(data);
    }
    let got = region.to_vec();
    let first_diff = got.iter().zip(&want).position(|(a, b)| a != b);
    assert_eq!(first_diff, None, "the region differs from what was written");
}

#[test]
fn a_window_gives_one_queue_pair_its_range_until_invalidated() {
    let mut p = require!(Hardware::Rdma, pair());
    if !type_2(&p.ctx) {
        return;
    }
    // C -> D: another connection in the same protection domain.
    let mut cd = pair_beside(&p);
    // E -> F: one more, using the region's own rkey.
    let mut ef = pair_beside(&p);
    let all = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let mut target =
        p.pd.register_remote(
            HostBuffer::zeroed(REGION).unwrap(),
            all | AccessFlags::MW_BIND,
        )
        .unwrap();
    target.fill(0, REGION, POISON).unwrap();
    let data = random_bytes(LEN);
    let src =
        p.pd.register(HostBuffer::from_slice(&data).unwrap(), AccessFlags::empty())
            .unwrap();

    // Bound through B: A, B's peer, writes exactly the window's bytes.
    let window = p.pd.alloc_mw().unwrap();
    let bound = bind(
        &mut p.b,
        &mut p.cq_b,
        window,
        target.slice(AT..AT + LEN).unwrap(),
        all,
    );
    let remote = bound.remote();
    println!(
        "window rkey {:#x} (region rkey {:#x}), bound through QP {:#x}",
        bound.rkey(),
        target.rkey(),
        bound.qp_num()
    );
    assert_eq!(
        (remote.addr, remote.len),
        (target.addr() + AT as u64, LEN as u64)
    );
    assert_ne!(bound.rkey(), target.rkey());
    assert_eq!(bound.qp_num(), p.b.qp_num());
    let write = SendRequest::write(src.slice(..).unwrap(), remote.slice(0, LEN as u32).unwrap());
    assert_eq!(status_of(&mut p.a, &mut p.cq_a, write), WcStatus::Success);
    expect(&target, &[(AT, &data)]);

    // Read back through the window into a poisoned buffer.
    let mut back =
        p.pd.register(HostBuffer::zeroed(LEN).unwrap(), AccessFlags::LOCAL_WRITE)
            .unwrap();
    back.fill(0, LEN, 0xC3).unwrap();
    let read = SendRequest::read(
        back.slice(..).unwrap(),
        remote.slice(0, LEN as u32).unwrap(),
    );
    assert_eq!(status_of(&mut p.a, &mut p.cq_a, read), WcStatus::Success);
    assert_eq!(back.as_slice().unwrap(), &data[..]);

    // C, connected to D rather than B, is refused the window while it is bound; nothing lands.
    let other = random_bytes(LEN);
    let osrc =
        p.pd.register(
            HostBuffer::from_slice(&other).unwrap(),
            AccessFlags::empty(),
        )
        .unwrap();
    let write = SendRequest::write(
        osrc.slice(..).unwrap(),
        remote.slice(0, LEN as u32).unwrap(),
    );
    let s = status_of(&mut cd.a, &mut cd.cq_a, write);
    println!("C -> D with the window's rkey: {s:?}");
    assert_eq!(s, WcStatus::RemoteAccess);
    expect(&target, &[(AT, &data)]);

    // The region's own rkey still works for others.
    let region_remote = target.remote();
    let small = random_bytes(512);
    let ssrc =
        p.pd.register(
            HostBuffer::from_slice(&small).unwrap(),
            AccessFlags::empty(),
        )
        .unwrap();
    let at = 40_000;
    let write = SendRequest::write(
        ssrc.slice(..).unwrap(),
        region_remote.slice(at as u64, 512).unwrap(),
    );
    assert_eq!(status_of(&mut ef.a, &mut ef.cq_a, write), WcStatus::Success);
    expect(&target, &[(AT, &data), (at, &small)]);

    // Invalidated (on B): the same write from A is refused, nothing lands.
    let old_rkey = bound.rkey();
    let window = invalidate(&mut p.b, &mut p.cq_b, bound);
    let write = SendRequest::write(
        osrc.slice(..).unwrap(),
        remote.slice(0, LEN as u32).unwrap(),
    );
    let s = status_of(&mut p.a, &mut p.cq_a, write);
    println!("A -> B with the invalidated window's rkey: {s:?}");
    assert_eq!(s, WcStatus::RemoteAccess);
    expect(&target, &[(AT, &data), (at, &small)]);
    // The region is still registered for others.
    let again = random_bytes(512);
    let asrc =
        p.pd.register(
            HostBuffer::from_slice(&again).unwrap(),
            AccessFlags::empty(),
        )
        .unwrap();
    let write = SendRequest::write(
        asrc.slice(..).unwrap(),
        region_remote.slice(at as u64, 512).unwrap(),
    );
    assert_eq!(status_of(&mut ef.a, &mut ef.cq_a, write), WcStatus::Success);
    expect(&target, &[(AT, &data), (at, &again)]);

    // Bound again, through a new connection G -> H: a new rkey of the same window (its tag
    // byte stepped), and only its range: a write past its end is refused, nothing lands.
    let mut gh = pair_beside(&p);
    let bound = bind(
        &mut gh.b,
        &mut gh.cq_b,
        window,
        target.slice(AT..AT + LEN).unwrap(),
        AccessFlags::REMOTE_WRITE,
    );
    println!("rebound: rkey {:#x} (was {old_rkey:#x})", bound.rkey());
    assert_eq!(
        bound.rkey(),
        (old_rkey & !0xff) | (old_rkey.wrapping_add(1) & 0xff)
    );
    let inside = SendRequest::write(
        ssrc.slice(..).unwrap(),
        bound.remote().slice((LEN - 512) as u64, 512).unwrap(),
    );
    assert_eq!(
        status_of(&mut gh.a, &mut gh.cq_a, inside),
        WcStatus::Success
    );
    let mut now = data.clone();
    now[LEN - 512..].copy_from_slice(&small);
    expect(&target, &[(AT, &now), (at, &again)]);
    // 256 bytes inside the window and 256 past its end, still inside the region.
    let straddle = RemoteSlice {
        addr: bound.remote().addr + (LEN - 256) as u64,
        rkey: bound.rkey(),
        len: 512,
    };
    let past = random_bytes(512);
    let psrc =
        p.pd.register(HostBuffer::from_slice(&past).unwrap(), AccessFlags::empty())
            .unwrap();
    let write = SendRequest::write(psrc.slice(..).unwrap(), straddle);
    let s = status_of(&mut gh.a, &mut gh.cq_a, write);
    println!("G -> H across the window's end, inside the region: {s:?}");
    if p.ctx.name().starts_with("rxe") {
        // Soft-RoCE checks an access through a window against the bounds of the region it is
        // bound to, not the window's own (rxe_resp.c, check_rkey: mr_check_range only): the
        // bytes past the window land. Past the region's end it is refused.
        assert_eq!(s, WcStatus::Success);
        let mut edge = now.clone();
        edge[LEN - 256..].copy_from_slice(&past[..256]);
        let beyond = AT + LEN;
        expect(
            &target,
            &[(AT, &edge), (beyond, &past[256..]), (at, &again)],
        );
        let off_region = RemoteSlice {
            addr: target.addr() + (REGION - 256) as u64,
            rkey: bound.rkey(),
            len: 512,
        };
        let write = SendRequest::write(osrc.slice(..512).unwrap(), off_region);
        let s = status_of(&mut gh.a, &mut gh.cq_a, write);
        println!("G -> H across the region's end: {s:?}");
        assert_eq!(s, WcStatus::RemoteAccess);
        expect(
            &target,
            &[(AT, &edge), (beyond, &past[256..]), (at, &again)],
        );
    } else {
        assert_eq!(s, WcStatus::RemoteAccess);
        expect(&target, &[(AT, &now), (at, &again)]);
    }
    // Deallocated before its queue pair goes (else the queue pair is leaked).
    drop(bound);
    // Through all of it, the region's own rkey kept working for E.
    let read = SendRequest::read(
        back.slice(..512).unwrap(),
        region_remote.slice(at as u64, 512).unwrap(),
    );
    assert_eq!(status_of(&mut ef.a, &mut ef.cq_a, read), WcStatus::Success);
    assert_eq!(&back.as_slice().unwrap()[..512], &again[..]);
}

/// A region of `REGION` bytes of `POISON` that windows may be bound over, reachable remotely
/// only through them.
fn poisoned_target(pd: &ProtectionDomain) -> MemoryRegion<Remote> {
    let mut target = pd
        .register_remote(
            HostBuffer::zeroed(REGION).unwrap(),
            AccessFlags::MW_BIND | AccessFlags::LOCAL_WRITE,
        )
        .unwrap();
    target.fill(0, REGION, POISON).unwrap();
    target
}

#[test]
fn a_read_only_window_refuses_writes() {
    let mut p = require!(Hardware::Rdma, pair());
    if !type_2(&p.ctx) {
        return;
    }
    let target = poisoned_target(&p.pd);
    let bound = bind(
        &mut p.b,
        &mut p.cq_b,
        p.pd.alloc_mw().unwrap(),
        target.slice(AT..AT + LEN).unwrap(),
        AccessFlags::REMOTE_READ,
    );
    let mut back =
        p.pd.register(HostBuffer::zeroed(LEN).unwrap(), AccessFlags::LOCAL_WRITE)
            .unwrap();
    let read = SendRequest::read(
        back.slice(..).unwrap(),
        bound.remote().slice(0, LEN as u32).unwrap(),
    );
    assert_eq!(status_of(&mut p.a, &mut p.cq_a, read), WcStatus::Success);
    assert!(back.as_slice().unwrap().iter().all(|&b| b == POISON));
    let src =
        p.pd.register(
            HostBuffer::from_slice(&random_bytes(64)).unwrap(),
            AccessFlags::empty(),
        )
        .unwrap();
    let write = SendRequest::write(src.slice(..).unwrap(), bound.remote().slice(0, 64).unwrap());
    let s = status_of(&mut p.a, &mut p.cq_a, write);
    println!("a write through a read-only window: {s:?}");
    assert_eq!(s, WcStatus::RemoteAccess);
    expect(&target, &[]);
}

#[test]
fn binds_and_invalidations_are_refused_before_posting() {
    let mut p = require!(Hardware::Rdma, pair());
    if !type_2(&p.ctx) {
        return;
    }
    let access = AccessFlags::MW_BIND | AccessFlags::LOCAL_WRITE;
    let region =
        p.pd.register(HostBuffer::zeroed(4096).unwrap(), access)
            .unwrap();
    let pd2 = p.ctx.alloc_pd().unwrap();
    let elsewhere = pd2
        .register(HostBuffer::zeroed(4096).unwrap(), access)
        .unwrap();
    let plain =
        p.pd.register(HostBuffer::zeroed(4096).unwrap(), AccessFlags::LOCAL_WRITE)
            .unwrap();
    let read_only =
        p.pd.register(HostBuffer::zeroed(4096).unwrap(), AccessFlags::MW_BIND)
            .unwrap();
    let rw = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let arg = |r: Result<PendingBind, WindowRefused<MemoryWindow>>| match r {
        Err(WindowRefused {
            error: Error::InvalidArgument { arg, .. },
            window,
        }) => (arg, window),
        other => panic!("not refused: {other:?}"),
    };
    let w = p.pd.alloc_mw().unwrap();
    // A region of another protection domain.
    let (a, w) = arg(p
        .b
        .bind_window(w, WindowBind::new(elsewhere.slice(..).unwrap(), rw)));
    assert_eq!(a, "range");
    // A region without MW_BIND.
    let (a, w) = arg(p
        .b
        .bind_window(w, WindowBind::new(plain.slice(..).unwrap(), rw)));
    assert_eq!(a, "range");
    // Write access over a region without local write; local access.
    let (a, w) = arg(p
        .b
        .bind_window(w, WindowBind::new(read_only.slice(..).unwrap(), rw)));
    assert_eq!(a, "access");
    let local = WindowBind::new(region.slice(..).unwrap(), AccessFlags::LOCAL_WRITE);
    let (a, w) = arg(p.b.bind_window(w, local));
    assert_eq!(a, "access");
    // A window of another protection domain.
    let w2 = pd2.alloc_mw().unwrap();
    let (a, _w2) = arg(p
        .b
        .bind_window(w2, WindowBind::new(region.slice(..).unwrap(), rw)));
    assert_eq!(a, "window");
    assert_eq!(p.b.send_outstanding(), 0, "nothing was posted");
    // The window handed back binds.
    let bound = bind(&mut p.b, &mut p.cq_b, w, region.slice(..).unwrap(), rw);
    // Invalidated on another queue pair than the one it is bound through: refused.
    let bound = match p.a.invalidate_window(bound, 0) {
        Err(WindowRefused {
            error: Error::InvalidArgument { arg: "window", .. },
            window,
        }) => window,
        other => panic!("not refused: {other:?}"),
    };
    let w = invalidate(&mut p.b, &mut p.cq_b, bound);
    drop(w);
    // A refusal converts into its error for `?`.
    let e: Error =
        p.b.bind_window(
            p.pd.alloc_mw().unwrap(),
            WindowBind::new(plain.slice(..).unwrap(), rw),
        )
        .unwrap_err()
        .into();
    assert!(
        matches!(e, Error::InvalidArgument { arg: "range", .. }),
        "{e}"
    );
}

/// Host memory whose drop is counted.
fn counted(n: usize) -> (Counted, Arc<AtomicUsize>) {
    let freed = Arc::new(AtomicUsize::new(0));
    (Counted(vec![POISON; n], freed.clone()), freed)
}

#[test]
fn a_bound_window_keeps_its_region_alive() {
    let mut p = require!(Hardware::Rdma, pair());
    if !type_2(&p.ctx) {
        return;
    }
    let before = teardown_stats();
    // A local region a peer may write only through the window: no reference to its bytes while
    // the window holds it.
    let (mem, freed) = counted(8192);
    let access = AccessFlags::MW_BIND | AccessFlags::LOCAL_WRITE;
    let mut region = p.pd.register(mem, access).unwrap();
    let bound = bind(
        &mut p.b,
        &mut p.cq_b,
        p.pd.alloc_mw().unwrap(),
        region.slice(1024..5120).unwrap(),
        AccessFlags::REMOTE_WRITE,
    );
    assert!(region.as_slice().is_none(), "the window holds a slice");
    let data = random_bytes(4096);
    let src =
        p.pd.register(HostBuffer::from_slice(&data).unwrap(), AccessFlags::empty())
            .unwrap();
    let write = SendRequest::write(
        src.slice(..).unwrap(),
        bound.remote().slice(0, 4096).unwrap(),
    );
    assert_eq!(status_of(&mut p.a, &mut p.cq_a, write), WcStatus::Success);
    let mut got = vec![0u8; 4096];
    region.read_at(1024, &mut got).unwrap();
    assert_eq!(got, data);
    // The region dropped while bound: registration and memory live on in the window.
    drop(region);
    assert_eq!(freed.load(Ordering::SeqCst), 0);
    let pending = p.b.invalidate_window(bound, 0).unwrap();
    wait(&mut p.cq_b, 1);
    assert_eq!(freed.load(Ordering::SeqCst), 0, "the window still holds it");
    let window = match pending.finish() {
        InvalidateOutcome::Unbound(w) => w,
        other => panic!("{other:?}"),
    };
    assert_eq!(freed.load(Ordering::SeqCst), 1, "unbound: the region goes");

    // Dropping a bound window deallocates it, then lets its region go.
    let (mem, freed) = counted(4096);
    let region = p.pd.register(mem, access).unwrap();
    let bound = bind(
        &mut p.b,
        &mut p.cq_b,
        window,
        region.slice(..).unwrap(),
        AccessFlags::REMOTE_WRITE,
    );
    drop(region);
    assert_eq!(freed.load(Ordering::SeqCst), 0);
    let remote = bound.remote();
    drop(bound);
    assert_eq!(freed.load(Ordering::SeqCst), 1);
    // Deallocation unbound it: its rkey is refused.
    let write = SendRequest::write(src.slice(..256).unwrap(), remote.slice(0, 256).unwrap());
    let s = status_of(&mut p.a, &mut p.cq_a, write);
    println!("A -> B with a deallocated window's rkey: {s:?}");
    assert_eq!(s, WcStatus::RemoteAccess);
    let after = teardown_stats();
    assert_eq!(after.windows_deallocated - before.windows_deallocated, 1);
    assert_eq!(after.windows_leaked, before.windows_leaked);
    assert_eq!(after.regions_deregistered - before.regions_deregistered, 2);
}

#[test]
fn a_queue_pair_dropped_with_a_window_bound_is_leaked_in_the_error_state() {
    let mut p = require!(Hardware::Rdma, pair());
    if !type_2(&p.ctx) {
        return;
    }
    let target = poisoned_target(&p.pd);
    let bound = bind(
        &mut p.b,
        &mut p.cq_b,
        p.pd.alloc_mw().unwrap(),
        target.slice(..).unwrap(),
        AccessFlags::REMOTE_WRITE,
    );
    let before = teardown_stats();
    let Pair {
        ctx: _ctx,
        pd,
        mut a,
        b,
        mut cq_a,
        cq_b: _cq_b,
    } = p;
    drop(b);
    let after = teardown_stats();
    assert_eq!(after.queue_pairs_leaked - before.queue_pairs_leaked, 1);
    assert_eq!(after.queue_pairs_destroyed, before.queue_pairs_destroyed);
    // B is in the error state: A's write through the window does not land. Soft-RoCE drops
    // what reaches a queue pair in the error state and, taking a retry count of 7 as unlimited,
    // retransmits for ever: no completion, then A's flush.
    let src = pd
        .register(
            HostBuffer::from_slice(&random_bytes(256)).unwrap(),
            AccessFlags::empty(),
        )
        .unwrap();
    a.post_send([SendRequest::write(
        src.slice(..).unwrap(),
        bound.remote().slice(0, 256).unwrap(),
    )])
    .unwrap();
    let until = std::time::Instant::now() + std::time::Duration::from_secs(3);
    let mut seen = Vec::new();
    while std::time::Instant::now() < until && seen.is_empty() {
        seen.extend(cq_a.poll().expect("ibv_poll_cq").map(|w| w.status()));
    }
    println!("A -> B (dropped, in the error state) through the window, within 3 s: {seen:?}");
    assert!(!seen.contains(&WcStatus::Success), "{seen:?}");
    expect(&target, &[]);
    let a = a.into_error().unwrap();
    if seen.is_empty() {
        seen = wait(&mut cq_a, 1).iter().map(|d| d.status).collect();
        assert_eq!(seen, [WcStatus::Flushed]);
    }
    drop(a);
    expect(&target, &[]);
    drop(bound);
    assert_eq!(
        teardown_stats().windows_deallocated - before.windows_deallocated,
        1
    );
}
