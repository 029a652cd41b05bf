//! Peer access: enabling is idempotent and thread-safe and leaves no sticky error; a device to
//! itself, or a pair that cannot, is a typed PEER_ACCESS_UNSUPPORTED; TOO_MANY_PEERS is typed;
//! P2P attributes. docs/user-cases.md lists the cases.

mod support;

use support::gpu;

use gpudirect::cudarc::driver::sys::{self, CUresult};
use gpudirect::p2p::{self, Enabled, PeerAccessRefusal};
use gpudirect_testing::{Hardware, require, skip};
use std::sync::{Arc, Barrier};

/// After the calls under test the context must still work: a sync and a fresh allocation with a
/// copy succeed (the driver API keeps no "last error"; a sticky error would fail these).
fn context_is_healthy(ordinal: usize) {
    let ctx = gpudirect::cuda::context(ordinal).unwrap();
    ctx.synchronize()
        .expect("cuCtxSynchronize after the enables");
    let data = gpu::random_u32(1024, 5);
    let s = gpu::stream(ordinal);
    let b = gpudirect::memory::DeviceBuffer::from_slice(&s, &data).unwrap();
    assert_eq!(b.to_vec(&s).unwrap(), data);
}

#[test]
fn enable_twice_from_two_threads_is_ok() {
    let n = require!(Hardware::Gpu, gpu::gpus());
    if n < 2 {
        // One GPU: the pair (0, 0) is refused; two threads at once both get the same typed refusal
        // and leave the context healthy.
        let barrier = Arc::new(Barrier::new(2));
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let b = barrier.clone();
                std::thread::spawn(move || {
                    b.wait();
                    p2p::enable_peer_access(0, 0)
                })
            })
            .collect();
        for t in threads {
            let e = t.join().unwrap().unwrap_err();
            assert_eq!(
                PeerAccessRefusal::of(&e),
                Some(PeerAccessRefusal::Unsupported),
                "{e}"
            );
        }
        context_is_healthy(0);
        skip(
            Hardware::MultiGpu,
            "enabling a real pair twice needs two GPUs (one visible); ran the one-GPU part",
        );
        return;
    }
    for (a, b) in [(0, 1), (1, 0)] {
        if !p2p::can_access_peer(a, b).unwrap() {
            println!("{a}->{b}: cuDeviceCanAccessPeer = 0, enabling twice not applicable");
            continue;
        }
        let barrier = Arc::new(Barrier::new(2));
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let bar = barrier.clone();
                std::thread::spawn(move || {
                    bar.wait();
                    p2p::enable_peer_access(a, b)
                })
            })
            .collect();
        let results: Vec<_> = threads
            .into_iter()
            .map(|t| t.join().unwrap().expect("both threads Ok"))
            .collect();
        println!("{a}->{b}: {results:?}");
        assert!(results.iter().filter(|r| **r == Enabled::Now).count() <= 1);
        assert_eq!(p2p::enable_peer_access(a, b).unwrap(), Enabled::Already);
        assert!(p2p::is_peer_access_enabled(a, b));
        // Also the driver's own answer to a second enable is consumed: call it directly.
        let ctx = gpudirect::cuda::context(a).unwrap();
        let peer = gpudirect::cuda::context(b).unwrap();
        ctx.bind_to_thread().unwrap();
        // SAFETY: current context is `a`'s primary context; `peer` is live.
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer.cu_ctx(), 0) };
        assert_eq!(r, CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
        context_is_healthy(a);
        context_is_healthy(b);
    }
}

#[test]
fn device_to_itself_is_typed_unsupported() {
    let _n = require!(Hardware::Gpu, gpu::gpus());
    let e = p2p::enable_peer_access(0, 0).unwrap_err();
    assert_eq!(e.cuda_name(), Some("CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"));
    assert_eq!(
        PeerAccessRefusal::of(&e),
        Some(PeerAccessRefusal::Unsupported)
    );
    assert!(e.to_string().contains("cuCtxEnablePeerAccess"), "{e}");
    assert!(!p2p::can_access_peer(0, 0).unwrap());
    // What the driver itself answers for its own context (informational; not sticky).
    let ctx = gpudirect::cuda::context(0).unwrap();
    ctx.bind_to_thread().unwrap();
    // SAFETY: the current context and the peer are the same live primary context.
    let raw = unsafe { sys::cuCtxEnablePeerAccess(ctx.cu_ctx(), 0) };
    println!("driver's own answer to cuCtxEnablePeerAccess(self): {raw:?}");
    assert_ne!(raw, CUresult::CUDA_SUCCESS);
    context_is_healthy(0);
    // The typed copy still works, staged (tests/p2p_copy.rs checks the bytes).
    let c = p2p::Copier::new(
        0,
        0,
        p2p::CopyOptions {
            path: p2p::PathChoice::Peer,
            ..Default::default()
        },
    )
    .unwrap_err();
    assert_eq!(
        PeerAccessRefusal::of(&c),
        Some(PeerAccessRefusal::Unsupported)
    );
}

#[test]
fn pairs_that_cannot_are_typed() {
    let n = require!(Hardware::Gpu, gpu::gpus());
    let mut checked = 0;
    for a in 0..n {
        for b in 0..n {
            if a == b || p2p::can_access_peer(a, b).unwrap() {
                continue;
            }
            let e = p2p::enable_peer_access(a, b).unwrap_err();
            assert_eq!(
                PeerAccessRefusal::of(&e),
                Some(PeerAccessRefusal::Unsupported),
                "{a}->{b}: {e}"
            );
            checked += 1;
        }
    }
    println!("{checked} ordered pairs without P2P checked");
    if n < 2 {
        skip(Hardware::MultiGpu, "no second GPU to pair with");
    }
}

#[test]
fn too_many_peers_is_typed_not_a_panic() {
    // Logic level: the driver's code maps to the typed refusal (also covered beside the code).
    let e = gpudirect::Error::cuda("cuCtxEnablePeerAccess", CUresult::CUDA_ERROR_TOO_MANY_PEERS);
    assert_eq!(
        PeerAccessRefusal::of(&e),
        Some(PeerAccessRefusal::TooManyPeers)
    );
    assert_eq!(e.cuda_name(), Some("CUDA_ERROR_TOO_MANY_PEERS"));
    let n = require!(Hardware::Gpu, gpu::gpus());
    // With more than 8 peers the driver may refuse: every answer is Ok or a typed refusal.
    for b in 1..n {
        match p2p::enable_peer_access(0, b) {
            Ok(_) => {}
            Err(e) => assert!(PeerAccessRefusal::of(&e).is_some(), "0->{b}: untyped {e}"),
        }
    }
    if n < 10 {
        println!(
            "TOO_MANY_PEERS provoked only with more than 8 peers ({n} GPUs): logic-level check ran"
        );
    }
}

#[test]
fn p2p_attributes_and_matrix() {
    let n = require!(Hardware::Gpu, gpu::gpus());
    for a in 0..n {
        for b in 0..n {
            let attr = p2p::p2p_attributes(a, b).unwrap();
            if a == b {
                assert_eq!(attr, p2p::P2pAttributes::default());
            } else {
                assert_eq!(attr.access_supported, p2p::can_access_peer(a, b).unwrap());
            }
        }
    }
    let m = p2p::LinkMatrix::probe().unwrap();
    assert_eq!(m.links.len(), n * n);
    print!("{}", m.table());
    let j = serde_json::to_string(&m).unwrap();
    let back: p2p::LinkMatrix = serde_json::from_str(&j).unwrap();
    assert_eq!(back, m);
    assert_eq!(
        m.link(0, 0).unwrap().interconnect,
        p2p::Interconnect::SameDevice
    );
}

#[test]
fn no_device_is_a_typed_error() {
    match gpudirect::cuda::device_count() {
        Ok(n) => {
            let e = p2p::can_access_peer(0, n).unwrap_err();
            assert!(matches!(e, gpudirect::Error::NoDevice { .. }), "{e}");
        }
        Err(e) => println!("SKIPPED: {e}"),
    }
}
