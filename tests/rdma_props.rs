//! Tier 1: property tests of the public RDMA functions that take offsets, lengths, ranges and
//! sizes, on a real verbs device: random (and hostile) values get exactly the documented answer,
//! a typed error before any verbs call or the bytes asked for, never a panic or a wrapped
//! address. Prints `SKIPPED: reason` without a verbs device, and fails then when
//! `GPUDIRECT_REQUIRE` names `rdma`.

mod support;

use gpudirect::Error;
use gpudirect::rdma::*;
use gpudirect_testing::{Hardware, require};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use std::cell::RefCell;
use std::ops::Bound;
use support::rdma::*;

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

fn offset() -> impl Strategy<Value = usize> {
    prop_oneof![0usize..9000, Just(usize::MAX), any::<usize>()]
}

fn bound() -> impl Strategy<Value = Bound<usize>> {
    prop_oneof![
        offset().prop_map(Bound::Included),
        offset().prop_map(Bound::Excluded),
        Just(Bound::Unbounded),
    ]
}

fn in_range(off: usize, len: usize, total: usize) -> bool {
    off as u128 + len as u128 <= total as u128
}

/// `read_at`, `write_at`, `fill`, `read_u64` and `slice` of a registered region, at random
/// offsets and lengths: in bounds they move exactly the bytes asked for and nothing else; out of
/// bounds (overflowing included) they answer `InvalidArgument` and change nothing.
#[test]
fn region_copies_and_slices_follow_the_bounds() {
    let ctx = require!(Hardware::Rdma, Context::open_by_name(None));
    let pd = ctx.alloc_pd().unwrap();
    let len = 8192;
    // The runner takes an `Fn`: the region is borrowed mutably through a RefCell.
    let cell = RefCell::new(
        pd.register_remote(HostBuffer::zeroed(len).unwrap(), AccessFlags::REMOTE_WRITE)
            .unwrap(),
    );
    let strategy = (
        offset(),
        prop_oneof![0usize..300, Just(usize::MAX)],
        any::<u8>(),
        bound(),
        bound(),
    );
    runner(256)
        .run(&strategy, |(off, n, byte, start, end)| {
            let mut mr = cell.borrow_mut();
            let mut model = mr.to_vec();
            // write_at: a random payload of min(n, 300) bytes.
            let data: Vec<u8> = (0..n.min(300)).map(|i| byte ^ i as u8).collect();
            match mr.write_at(off, &data) {
                Ok(()) => {
                    prop_assert!(in_range(off, data.len(), len));
                    model[off..off + data.len()].copy_from_slice(&data);
                }
                Err(Error::InvalidArgument { .. }) => {
                    prop_assert!(!in_range(off, data.len(), len))
                }
                Err(e) => return Err(fail(e)),
            }
            prop_assert_eq!(mr.to_vec(), model.clone());
            // fill: n bytes (possibly usize::MAX).
            match mr.fill(off, n, byte) {
                Ok(()) => {
                    prop_assert!(in_range(off, n, len));
                    model[off..off + n].fill(byte);
                }
                Err(Error::InvalidArgument { .. }) => prop_assert!(!in_range(off, n, len)),
                Err(e) => return Err(fail(e)),
            }
            prop_assert_eq!(mr.to_vec(), model.clone());
            // read_at.
            let mut back = vec![0u8; n.min(300)];
            match mr.read_at(off, &mut back) {
                Ok(()) => prop_assert_eq!(&back[..], &model[off..off + back.len()]),
                Err(Error::InvalidArgument { .. }) => {
                    prop_assert!(!in_range(off, back.len(), len))
                }
                Err(e) => return Err(fail(e)),
            }
            // read_u64: in bounds and 8-byte aligned (the region is page aligned).
            match mr.read_u64(off) {
                Ok(v) => {
                    prop_assert!(in_range(off, 8, len) && off % 8 == 0);
                    let want = u64::from_ne_bytes(model[off..off + 8].try_into().unwrap());
                    prop_assert_eq!(v, want);
                }
                Err(Error::InvalidArgument { .. }) => {
                    prop_assert!(!in_range(off, 8, len) || off % 8 != 0)
                }
                Err(e) => return Err(fail(e)),
            }
            // slice: the SGE covers exactly the range asked for.
            let s0 = match start {
                Bound::Included(s) => Some(s as u128),
                Bound::Excluded(s) => Some(s as u128 + 1),
                Bound::Unbounded => Some(0),
            };
            let e0 = match end {
                Bound::Included(e) => Some(e as u128 + 1),
                Bound::Excluded(e) => Some(e as u128),
                Bound::Unbounded => Some(len as u128),
            };
            let ok = matches!((s0, e0), (Some(s), Some(e)) if s < e && e <= len as u128);
            match mr.slice((start, end)) {
                Ok(sl) => {
                    prop_assert!(ok);
                    let s = s0.unwrap() as usize;
                    prop_assert_eq!(sl.offset(), s);
                    prop_assert_eq!(sl.addr(), mr.addr() + s as u64);
                    prop_assert_eq!(sl.len() as u128, e0.unwrap() - s as u128);
                }
                Err(Error::InvalidArgument { .. }) => prop_assert!(!ok),
                Err(e) => return Err(fail(e)),
            }
            Ok(())
        })
        .unwrap();
}

/// Completion queues, queue pairs and shared receive queues of random sizes: sizes over the
/// device's limits (or zero) are refused with `InvalidArgument` before the verbs call; sizes
/// within them are created with at least what was asked (or refused by the provider with a typed
/// `Os` error, as for an inline size it cannot hold).
#[test]
fn queue_sizes_are_checked_against_the_device() {
    let ctx = require!(Hardware::Rdma, Context::open_by_name(None));
    let pd = ctx.alloc_pd().unwrap();
    let dev = ctx.query_device().unwrap();
    let big = ctx.create_cq(1024, None).unwrap();
    // Valid sizes stay small (a queue at the device's maximum takes more memory than the VM
    // has); the refusals are tried right past the maximum and anywhere in u32.
    let size = |max: u32| {
        prop_oneof![
            0u32..64,
            Just(max.min(1 << 12)),
            Just(max.saturating_add(1)),
            any::<u32>().prop_filter("valid sizes stay small", move |v| *v > max || *v < 1 << 12)
        ]
    };
    runner(64)
        .run(&size(dev.max_cqe), |cqe| {
            match ctx.create_cq(cqe, None) {
                Ok(cq) => {
                    prop_assert!(cqe >= 1 && cqe <= dev.max_cqe);
                    prop_assert!(cq.capacity() >= cqe);
                    prop_assert_eq!(cq.reserved(), 0);
                }
                Err(Error::InvalidArgument { arg: "cqe", .. }) => {
                    prop_assert!(cqe == 0 || cqe > dev.max_cqe)
                }
                Err(e) => return Err(fail(e)),
            }
            Ok(())
        })
        .unwrap();
    let caps = (
        size(dev.max_qp_wr),
        size(dev.max_qp_wr),
        size(dev.max_sge),
        size(dev.max_sge),
        prop_oneof![0u32..512, any::<u32>()],
        any::<u32>(),
    );
    runner(64)
        .run(&caps, |(s, r, ss, rs, inline, every)| {
            let caps = QpCaps {
                max_send_wr: s.min(dev.max_qp_wr.saturating_add(1)),
                max_recv_wr: r,
                max_send_sge: ss,
                max_recv_sge: rs,
                max_inline_data: inline,
                signal_every: every,
            };
            let valid = caps.max_send_wr >= 1
                && caps.max_send_wr <= dev.max_qp_wr
                && r >= 1
                && r <= dev.max_qp_wr
                && ss <= dev.max_sge
                && rs <= dev.max_sge;
            match QueuePair::create(&pd, &big, &big, None, caps) {
                Ok(qp) => {
                    prop_assert!(valid);
                    let g = qp.caps();
                    prop_assert!(g.max_send_wr >= caps.max_send_wr);
                    prop_assert!(g.max_recv_wr >= r);
                    prop_assert!(g.max_inline_data >= inline);
                    prop_assert!(g.signal_every >= 1 && g.signal_every <= g.max_send_wr);
                    prop_assert_eq!(big.reserved(), 1);
                }
                Err(Error::InvalidArgument { arg: "caps", .. }) => prop_assert!(!valid),
                Err(Error::Os {
                    call: "ibv_create_qp",
                    ..
                }) => {
                    // The provider's own limits (inline data, memory): typed, and only for
                    // caps the device's attributes allow.
                    prop_assert!(valid);
                }
                Err(e) => return Err(fail(e)),
            }
            prop_assert_eq!(big.reserved(), 0, "the teardown entry is given back");
            Ok(())
        })
        .unwrap();
    runner(32)
        .run(
            &(size(dev.max_srq_wr), size(dev.max_srq_sge)),
            |(wr, sge)| {
                let valid = wr >= 1 && wr <= dev.max_srq_wr && sge <= dev.max_srq_sge;
                match SharedReceiveQueue::new(&pd, wr, sge) {
                    Ok(srq) => {
                        prop_assert!(valid);
                        prop_assert!(srq.depth() >= wr);
                    }
                    Err(Error::InvalidArgument { .. }) => prop_assert!(!valid),
                    Err(Error::Os {
                        call: "ibv_create_srq",
                        ..
                    }) => prop_assert!(valid),
                    Err(e) => return Err(fail(e)),
                }
                Ok(())
            },
        )
        .unwrap();
}

/// RDMA writes to random ranges of a peer's descriptor (and to hand-built remote ranges):
/// refused with `InvalidArgument` unless within it, otherwise posted and the exact bytes land.
#[test]
fn remote_ranges_are_checked_and_exact() {
    let p = require!(Hardware::Rdma, pair());
    let len = 16384usize;
    let target =
        p.pd.register_remote(HostBuffer::zeroed(len).unwrap(), AccessFlags::REMOTE_WRITE)
            .unwrap();
    let data = random_bytes(len);
    let src =
        p.pd.register(HostBuffer::from_slice(&data).unwrap(), AccessFlags::empty())
            .unwrap();
    let remote = target.remote();
    let p = RefCell::new(p);
    let strategy = (
        prop_oneof![0u64..17000, Just(u64::MAX), any::<u64>()],
        prop_oneof![0u32..5000, Just(u32::MAX), any::<u32>()],
        prop_oneof![(u64::MAX - 8000)..=u64::MAX, any::<u64>()],
    );
    runner(64)
        .run(&strategy, |(off, n, wild)| {
            let p = &mut *p.borrow_mut();
            let ok = n > 0 && off as u128 + n as u128 <= len as u128;
            match remote.slice(off, n) {
                Ok(r) => {
                    prop_assert!(ok);
                    let before = target.to_vec();
                    let local = src.slice(..n as usize).map_err(fail)?;
                    p.a.post_send([SendRequest::write(local, r).tag(off)])
                        .map_err(fail)?;
                    let d = wait(&mut p.cq_a, 1);
                    prop_assert_eq!((d[0].tag, d[0].status), (off, WcStatus::Success));
                    let mut want = before;
                    want[off as usize..off as usize + n as usize]
                        .copy_from_slice(&data[..n as usize]);
                    prop_assert_eq!(target.to_vec(), want);
                }
                Err(Error::InvalidArgument { .. }) => prop_assert!(!ok),
                Err(e) => return Err(fail(e)),
            }
            // A hand-built range whose end passes 2^64: refused before the verbs call.
            let n = n.clamp(1, 1 << 20);
            let hostile = RemoteSlice {
                addr: wild,
                rkey: remote.rkey,
                len: n,
            };
            if wild.checked_add(n as u64).is_none() {
                let local = src.slice(..(n as usize).min(len)).map_err(fail)?;
                let r = p.a.post_send([SendRequest::write(local, hostile)]);
                prop_assert!(
                    matches!(r, Err(Error::InvalidArgument { arg: "remote", .. })),
                    "{:?}",
                    r
                );
                prop_assert_eq!(p.a.send_outstanding(), 0);
            }
            Ok(())
        })
        .unwrap();
}
