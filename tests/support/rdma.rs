//! Helpers shared by the RDMA integration tests: a loopback pair of connected RC queue pairs on
//! the first verbs device, and bounded completion waits.
#![allow(dead_code)]

use gpudirect::Result;
use gpudirect::rdma::*;
use std::time::{Duration, Instant};

pub struct Pair {
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub cq_a: CompletionQueue,
    pub cq_b: CompletionQueue,
    pub a: QueuePair<Rts>,
    pub b: QueuePair<Rts>,
}

pub fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 64,
        max_recv_wr: 64,
        max_send_sge: 4,
        max_recv_sge: 4,
        max_inline_data: 64,
        signal_every: 8,
    }
}

/// Two RC QPs on the first device's port 1, connected to each other with typed transitions.
pub fn pair() -> Result<Pair> {
    pair_with(None)
}

pub fn pair_with(srq: Option<&SharedReceiveQueue>) -> Result<Pair> {
    let ctx = Context::open_by_name(None)?;
    let pd = ctx.alloc_pd()?;
    pair_on(ctx, pd, srq)
}

pub fn pair_on(
    ctx: Context,
    pd: ProtectionDomain,
    srq: Option<&SharedReceiveQueue>,
) -> Result<Pair> {
    pair_opts(ctx, pd, srq, false)
}

/// With `shared_cq`, both QPs report to `cq_a` (and `cq_b` stays empty).
pub fn pair_opts(
    ctx: Context,
    pd: ProtectionDomain,
    srq: Option<&SharedReceiveQueue>,
    shared_cq: bool,
) -> Result<Pair> {
    let cq_a = ctx.create_cq(256, None)?;
    let cq_b = ctx.create_cq(256, None)?;
    let a = QueuePair::create(&pd, &cq_a, &cq_a, srq, caps())?.to_init(1, all_access())?;
    let cq = if shared_cq { &cq_a } else { &cq_b };
    let b = QueuePair::create(&pd, cq, cq, srq, caps())?.to_init(1, all_access())?;
    let (a, b) = connect(&ctx, a, b)?;
    Ok(Pair {
        ctx,
        pd,
        cq_a,
        cq_b,
        a,
        b,
    })
}

/// Remote read, write and atomic access.
pub fn all_access() -> AccessFlags {
    AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC
}

/// A QP in INIT on port 1 with every remote access allowed.
pub fn init_qp(
    pd: &ProtectionDomain,
    send_cq: &CompletionQueue,
    recv_cq: &CompletionQueue,
    srq: Option<&SharedReceiveQueue>,
    caps: QpCaps,
) -> Result<QueuePair<Init>> {
    QueuePair::create(pd, send_cq, recv_cq, srq, caps)?.to_init(1, all_access())
}

/// Connect two QPs in INIT on `ctx`'s port 1 to each other, with fresh random PSNs.
pub fn connect(
    ctx: &Context,
    a: QueuePair<Init>,
    b: QueuePair<Init>,
) -> Result<(QueuePair<Rts>, QueuePair<Rts>)> {
    let port = ctx.query_port(1)?;
    let gid = ctx.preferred_gid(1)?;
    let (psn_a, psn_b) = (
        rand::random::<u32>() & 0xffffff,
        rand::random::<u32>() & 0xffffff,
    );
    let ep = |qp_num, psn| Endpoint {
        qp_num,
        psn,
        gid: gid.gid,
        gid_index: gid.index as u8,
        lid: port.lid,
    };
    let (ea, eb) = (ep(a.qp_num(), psn_a), ep(b.qp_num(), psn_b));
    let a = a
        .to_rtr(
            &RtrAttr::from_endpoint(&eb, port.active_mtu, gid.index as u8).max_dest_rd_atomic(4),
        )?
        .to_rts(&RtsAttr::new(psn_a).max_rd_atomic(4).timeout(12))?;
    let b = b
        .to_rtr(
            &RtrAttr::from_endpoint(&ea, port.active_mtu, gid.index as u8).max_dest_rd_atomic(4),
        )?
        .to_rts(&RtsAttr::new(psn_b).max_rd_atomic(4).timeout(12))?;
    Ok((a, b))
}

/// One polled completion, copied out of the lending cursor.
#[derive(Debug, Clone, Copy)]
pub struct Done {
    pub tag: u64,
    pub status: WcStatus,
    pub opcode: WcOpcode,
    pub byte_len: u32,
    pub imm: Option<u32>,
}

/// Poll until `n` completions arrived (10 s bound).
pub fn wait(cq: &mut CompletionQueue, n: usize) -> Vec<Done> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "timed out: {} of {n} completions: {out:?}",
            out.len()
        );
        for w in cq.poll().expect("ibv_poll_cq") {
            out.push(Done {
                tag: w.tag(),
                status: w.status(),
                opcode: w.opcode(),
                byte_len: w.byte_len(),
                imm: w.imm(),
            });
        }
    }
    out
}

/// Poll until `n` completions arrived, then make sure no more come for `settle`.
pub fn wait_exactly(cq: &mut CompletionQueue, n: usize, settle: Duration) -> Vec<Done> {
    let mut out = wait(cq, n);
    let until = Instant::now() + settle;
    while Instant::now() < until {
        for w in cq.poll().expect("ibv_poll_cq") {
            out.push(Done {
                tag: w.tag(),
                status: w.status(),
                opcode: w.opcode(),
                byte_len: w.byte_len(),
                imm: w.imm(),
            });
        }
    }
    assert_eq!(out.len(), n, "exactly {n} completions: {out:?}");
    out
}

/// Host memory whose drop is counted: shows exactly when a region's memory is freed.
pub struct Counted(
    pub Vec<u8>,
    pub std::sync::Arc<std::sync::atomic::AtomicUsize>,
);
// SAFETY: the Vec's heap buffer is stable and lives until drop.
unsafe impl HostMemory for Counted {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.0.as_mut_ptr()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
}
impl Drop for Counted {
    fn drop(&mut self) {
        self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// `n` random bytes.
pub fn random_bytes(n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rand::Rng::fill(&mut rand::rng(), &mut v[..]);
    v
}

/// The IPv4 address of the first of `devices` (verbs device names) that has one: the
/// IPv4-mapped GID of port 1, which is what rdma_cm binds and connects to on RoCE.
pub fn device_ipv4<S: AsRef<str>>(devices: &[S]) -> Option<std::net::Ipv4Addr> {
    let list = DeviceList::non_empty().ok()?;
    for name in devices {
        let ctx = Context::open(&list.find(name.as_ref()).ok()?).ok()?;
        for g in ctx.gid_table(1).ok()? {
            if g.gid.is_ipv4_mapped() {
                return g.gid.to_ipv6().to_ipv4_mapped();
            }
        }
    }
    None
}

/// One side of the VM's two-node mode, from its environment (`GPUDIRECT_TEST_ROLE`, `_RAILS`,
/// `_PEER_ADDRS`, `_PORT`; ci/rxe-vm/README.md, "Two nodes").
pub struct Node {
    pub server: bool,
    pub rails: Vec<String>,
    pub peers: Vec<String>,
    pub port: u16,
}

/// This side, or `None` outside the two-node VM.
pub fn node() -> Option<Node> {
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
