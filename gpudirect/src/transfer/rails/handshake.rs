//! Connecting a rail: the queue pair's resources made once rdma_cm has picked the device, and
//! the handshake on it (the notification receives posted, the first messages' addresses
//! swapped, the peer's first message read).

use super::rail::{NOTIFY_RAIL, QpSlot, RECV_TAG, Rail};
use super::state::Origin;
use crate::error::{Error, Result};
use crate::rdma::{
    AccessFlags, CompletionChannel, ConnectOptions, Connection, HostBuffer, QpCaps, QpResources,
    RecvRequest, SendRequest,
};
use crate::transfer::engine::EngineInner;
use crate::transfer::plan::{deadline_after, send_window};
use crate::transfer::wire::{Hello, MAX_HELLO};
use std::collections::VecDeque;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(super) fn resolve(peer: &str) -> Result<SocketAddr> {
    peer.to_socket_addrs()
        .map_err(|e| Error::invalid("peer", peer, format!("cannot be resolved: {e}")))?
        .min_by_key(|a| a.is_ipv6())
        .ok_or_else(|| Error::invalid("peer", peer, "resolves to no address"))
}

pub(super) fn conn_opts(e: &EngineInner) -> ConnectOptions {
    ConnectOptions {
        caps: QpCaps {
            max_send_wr: e.config.queue_depth,
            max_recv_wr: e.config.notify_depth + 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
            signal_every: 0,
        },
        access: AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE,
        timeout: e.config.connect_timeout,
        ..Default::default()
    }
}

/// Connect every rail of `origin` (a dialed endpoint).
pub(super) fn dial(e: &Arc<EngineInner>, origin: &Origin) -> Result<(Vec<Rail>, Vec<Hello>)> {
    let Origin::Dialed { peers, publish } = origin else {
        return Err(Error::invalid(
            "endpoint",
            "accepted",
            "only the side that connected can reconnect",
        ));
    };
    let nonce = (e.next_id() << 32) ^ u64::from(std::process::id()) ^ now_nanos();
    let mut rails = Vec::new();
    let mut hellos = Vec::new();
    for (i, addr) in peers.iter().enumerate() {
        let mut home = Home::new(e, i);
        let conn = Connection::connect_with(*addr, &conn_opts(e), |dev| home.resources(dev))?;
        let (rail, hello) = greet(
            e,
            conn,
            home,
            Hello {
                nonce,
                rail: i as u8,
                rails: peers.len() as u8,
                device: 0,
                devices: e.devices.len() as u8,
                credits: e.config.notify_depth as u16,
                max_message: e.max_message(),
                descriptors: if i == NOTIFY_RAIL {
                    publish.clone()
                } else {
                    Vec::new()
                },
            },
        )?;
        rails.push(rail);
        hellos.push(hello);
    }
    Ok((rails, hellos))
}

fn now_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// The resources a rail's connection is built on, made once rdma_cm has picked the device.
pub(super) struct Home<'a> {
    e: &'a EngineInner,
    rail: usize,
    made: Option<(usize, CompletionChannel, u32)>,
}

impl<'a> Home<'a> {
    pub(super) fn new(e: &'a EngineInner, rail: usize) -> Self {
        Home {
            e,
            rail,
            made: None,
        }
    }

    pub(super) fn resources(&mut self, dev: &str) -> Result<QpResources> {
        let d = self.e.device_index(dev).ok_or_else(|| {
            Error::invalid(
                "peer",
                dev,
                format!(
                    "rdma_cm routed rail {} through device {dev}, which is not one of the engine's rails {:?}",
                    self.rail,
                    self.e.devices.iter().map(|d| &d.name).collect::<Vec<_>>()
                ),
            )
        })?;
        let rd = &self.e.devices[d];
        let ch = rd.ctx.create_comp_channel()?;
        ch.set_nonblocking(true)?;
        let depth = self.e.config.queue_depth;
        // One entry for the teardown request, a few for the handshake's send and read.
        let send_cq = rd.ctx.create_cq(depth + 4, Some(&ch))?;
        let recv_cq = rd
            .ctx
            .create_cq(self.e.config.notify_depth + 2, Some(&ch))?;
        let window = send_window(depth, send_cq.capacity().saturating_sub(2));
        self.made = Some((d, ch, window));
        Ok(QpResources {
            pd: rd.pd.clone(),
            send_cq,
            recv_cq,
        })
    }
}

/// A rail's handshake: post the notification receives (rail 0), swap the first messages'
/// addresses, read the peer's first message.
pub(super) fn greet(
    e: &EngineInner,
    mut conn: Connection,
    home: Home<'_>,
    mut mine: Hello,
) -> Result<(Rail, Hello)> {
    let (device, channel, window) = home
        .made
        .ok_or_else(|| Error::invalid("connection", "no device", "rdma_cm picked no device"))?;
    mine.device = device as u8;
    let timeout = e.config.connect_timeout;
    if mine.rail as usize == NOTIFY_RAIL {
        let n = e.config.notify_depth as usize;
        conn.qp()
            .post_recv((0..n).map(|_| RecvRequest::empty().tag(RECV_TAG)))?;
    }
    let pd = conn.pd().clone();
    let hello_mr = pd.register(
        HostBuffer::from_slice(&mine.encode()?)?,
        AccessFlags::REMOTE_READ,
    )?;
    let theirs = conn.exchange(hello_mr.remote(), timeout)?;
    if theirs.len > MAX_HELLO {
        return Err(Error::invalid(
            "peer",
            theirs.len,
            format!("a first message is at most {MAX_HELLO} bytes"),
        ));
    }
    // Bounded just above: fits usize and one message.
    let len = theirs.len as usize;
    let mut into = pd.register(HostBuffer::zeroed(len)?, AccessFlags::LOCAL_WRITE)?;
    conn.qp()
        .post_send([SendRequest::read(into.slice(..)?, theirs.slice(0, len as u32)?).tag(1)])?;
    let deadline = deadline_after(Instant::now(), timeout);
    'wait: loop {
        for w in conn.send_cq().poll()? {
            if w.tag() == 1 {
                w.result()?;
                break 'wait;
            }
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: "the peer's first message",
                after: timeout,
            });
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let bytes = into
        .as_slice()
        .ok_or_else(|| Error::invalid("read", "region", "still in use"))?
        .to_vec();
    let hello = Hello::decode(&bytes)?;
    let parts = conn.into_parts();
    let rail = Rail {
        qp: QpSlot::Rts(parts.qp),
        send_cq: parts.send_cq,
        recv_cq: parts.recv_cq,
        channel,
        link: parts.link,
        device,
        peer_device: hello.device as usize,
        window,
        next_seq: 1,
        inflight: VecDeque::new(),
        pending: VecDeque::new(),
        _hello: hello_mr,
    };
    Ok((rail, hello))
}
