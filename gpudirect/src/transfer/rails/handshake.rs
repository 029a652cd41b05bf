//! Connecting a rail: the queue pair's resources made once rdma_cm has picked the device, and
//! the handshake on it: greetings swapped (with the authentication challenges), with a key the
//! proofs swapped and checked, and only then the notification receives posted; once every
//! rail of the endpoint is greeted, on each the windows bound, the descriptor messages'
//! addresses swapped and the peer's read, and the peer's per-rail lists merged. A failed rail
//! taken back proves the endpoint's session secret instead of the key, and swaps window
//! messages (the windows it had, bound again) instead of descriptors.

use super::rail::{INLINE_MAX, NOTIFY_RAIL, QpSlot, Rail, note_receives};
use super::state::{Connected, Origin};
use super::windows::{bind_for_peer, bind_ranges, count_bound, merge_descriptors};
use crate::error::{Error, Result};
use crate::rdma::{
    AccessFlags, BoundWindow, CompletionChannel, ConnectOptions, Connection, ConnectionBinding,
    HostBuffer, Local, MemoryRegion, MrSlice, QpCaps, QpResources, SendRequest,
};
use crate::transfer::auth::{
    AuthKey, Challenge, Role, Transcript, agree, check_tag, random, read_tag_message, tag,
    tag_message,
};
use crate::transfer::descriptor::MemoryDescriptor;
use crate::transfer::engine::{EngineInner, PeerAccess};
use crate::transfer::plan::{deadline_after, send_window};
use crate::transfer::wire::{Hello, MAX_HELLO};
use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What the rails' proofs are made over, besides the transcript (the local transport's differs).
const LABEL: &[u8] = b"gpudirect transfer rails v1";
/// What an endpoint's session secret is made over, besides its first rail's transcript.
const SESSION_LABEL: &[u8] = b"gpudirect transfer rails session v1";

/// What an authenticated peer may do through a rail's queue pair.
const PEER_ACCESS: AccessFlags = AccessFlags::REMOTE_READ.union(AccessFlags::REMOTE_WRITE);

/// How many names the process resolves at once ([`resolve`]). The system's resolver cannot be
/// cancelled: a name it does not answer holds its thread for as long as the resolver's own
/// timeouts and retries run, whatever the connect's bound, so connects retried against such a
/// name would otherwise start a thread each.
const MAX_RESOLVING: usize = 16;

/// The resolver threads running, at most `max`.
struct Resolving {
    running: Mutex<usize>,
    freed: Condvar,
    max: usize,
}

/// The process's resolver threads ([`MAX_RESOLVING`]).
static RESOLVING: Resolving = Resolving::new(MAX_RESOLVING);

impl Resolving {
    const fn new(max: usize) -> Resolving {
        Resolving {
            running: Mutex::new(0),
            freed: Condvar::new(),
            max,
        }
    }

    /// A place for one more resolver thread, waited for until `deadline` (`None`: none came
    /// free by then).
    fn take(&'static self, deadline: Instant) -> Option<ResolverPlace> {
        let mut n = self.running.lock().unwrap_or_else(|e| e.into_inner());
        while *n >= self.max {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            n = self
                .freed
                .wait_timeout(n, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *n += 1;
        Some(ResolverPlace(self))
    }
}

/// One resolver thread's place, given back when it ends.
struct ResolverPlace(&'static Resolving);

impl Drop for ResolverPlace {
    fn drop(&mut self) {
        let mut n = self.0.running.lock().unwrap_or_else(|e| e.into_inner());
        *n = n.saturating_sub(1);
        drop(n);
        self.0.freed.notify_one();
    }
}

/// `peer` (`host:port`) as a socket address, an IPv4 one where it has both. A literal address
/// is taken as it is; a name is asked of the system's resolver for at most `timeout` (a peer's
/// address may come from a metadata store: its name must not hold a connect past its bound),
/// on a thread of its own, at most [`MAX_RESOLVING`] at once in the process.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for an address that does not resolve; [`Error::Timeout`] when
/// the resolver has not answered within `timeout` (it goes on in its thread, its answer
/// dropped), or when [`MAX_RESOLVING`] names were still being resolved throughout it;
/// [`Error::Os`] when no thread can be had.
pub(super) fn resolve(peer: &str, timeout: Duration) -> Result<SocketAddr> {
    resolve_with(peer, timeout, &RESOLVING, |p| {
        p.to_socket_addrs().map(|a| a.collect())
    })
}

/// [`resolve`] through `ask` (the resolver; a stand-in in tests), its threads counted in
/// `places`.
fn resolve_with(
    peer: &str,
    timeout: Duration,
    places: &'static Resolving,
    ask: impl FnOnce(String) -> std::io::Result<Vec<SocketAddr>> + Send + 'static,
) -> Result<SocketAddr> {
    let found = match peer.parse::<SocketAddr>() {
        Ok(a) => Ok(vec![a]),
        Err(_) => {
            let deadline = deadline_after(Instant::now(), timeout);
            let Some(place) = places.take(deadline) else {
                return Err(Error::Timeout {
                    what: "resolving a peer's address (every resolver thread still busy with \
                           names that did not answer)",
                    after: timeout,
                });
            };
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            let name = peer.to_owned();
            crate::driver::ctx::spawn_thread("gpudirect-resolve", move || {
                let _ = tx.send(ask(name));
                drop(place);
            })?;
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(r) => r,
                Err(_) => {
                    return Err(Error::Timeout {
                        what: "resolving a peer's address",
                        after: timeout,
                    });
                }
            }
        }
    };
    found
        .map_err(|e| Error::invalid("peer", peer, format!("cannot be resolved: {e}")))?
        .into_iter()
        .min_by_key(|a| a.is_ipv6())
        .ok_or_else(|| Error::invalid("peer", peer, "resolves to no address"))
}

pub(super) fn conn_opts(e: &EngineInner) -> ConnectOptions {
    ConnectOptions {
        caps: QpCaps {
            max_send_wr: e.config.queue_depth,
            // The notification receives, and two of the handshake's while its rounds run.
            max_recv_wr: e.config.notify_depth + 2,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: INLINE_MAX,
            signal_every: 0,
        },
        // Nothing until the peer is authenticated: `greet` grants `PEER_ACCESS` then.
        access: AccessFlags::empty(),
        timeout: e.config.connect_timeout,
        ack_timeout: e.config.ack_timeout,
        ..Default::default()
    }
}

/// Connect every rail of `origin` (a dialed endpoint), all within the engine's
/// `connect_timeout`: every rail greeted (and authenticated) first, then, once the devices of
/// all are known, the descriptors published on each ([`publish_all`]).
pub(super) fn dial(e: &Arc<EngineInner>, origin: &Origin) -> Result<Connected> {
    let Origin::Dialed { peers, publish } = origin else {
        return Err(Error::invalid(
            "endpoint",
            "accepted",
            "only the side that connected can reconnect",
        ));
    };
    let deadline = deadline_after(Instant::now(), e.config.connect_timeout);
    let group = random::<16>()?;
    let mut greeted = Vec::new();
    for (i, addr) in peers.iter().enumerate() {
        let mut home = Home::new(e, i);
        let conn =
            Connection::connect_until(*addr, &conn_opts(e), |dev| home.resources(dev), deadline)?;
        greeted.push(greet(
            e,
            conn,
            home,
            greeting(e, group, i, peers.len(), 0),
            &Greet {
                role: Role::Dialer,
                peer: addr.to_string(),
                deadline,
                stop: None,
                authenticated: None,
                back: Back::No,
            },
        )?);
    }
    publish_all(e, greeted, group, publish, deadline, None)
}

/// This side's greeting on rail `rail` of `rails` of endpoint `group` (`back`: 0, or one more
/// than the rail's generation when it comes back); its device is set once rdma_cm picked it.
pub(super) fn greeting(
    e: &EngineInner,
    group: [u8; 16],
    rail: usize,
    rails: usize,
    back: u32,
) -> Hello {
    Hello {
        group,
        rail: rail as u8,
        rails: rails as u8,
        back,
        device: 0,
        devices: e.devices.len() as u8,
        credits: e.config.notify_depth as u16,
        max_message: e.max_message(),
        descriptors: Vec::new(),
    }
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
        // One entry for the teardown request, a few for the handshake's sends and read.
        let send_cq = rd.ctx.create_cq(depth + 4, Some(&ch))?;
        let recv_cq = rd
            .ctx
            .create_cq(self.e.config.notify_depth + 3, Some(&ch))?;
        let window = send_window(depth, send_cq.capacity().saturating_sub(2));
        self.made = Some((d, ch, window));
        Ok(QpResources {
            pd: rd.pd.clone(),
            send_cq,
            recv_cq,
        })
    }
}

/// How one rail's handshake goes: this side's role, the peer (for errors), the deadline, what
/// ends it early (a listener making room), where to say it is authenticated, and whether it
/// takes a failed rail back.
pub(super) struct Greet<'a> {
    pub(super) role: Role,
    pub(super) peer: String,
    pub(super) deadline: Instant,
    pub(super) stop: Option<&'a AtomicBool>,
    pub(super) authenticated: Option<&'a AtomicBool>,
    pub(super) back: Back<'a>,
}

/// Whether a rail's handshake takes a failed rail of a connected endpoint back, and what its
/// proofs use instead of the engine's key then (the endpoint's session secret).
pub(super) enum Back<'a> {
    /// A rail of a new endpoint (the dialer's, or the listener's that the peer's greeting
    /// did not mark as coming back).
    No,
    /// The dialer takes a failed rail back; with a key, its endpoint's session secret.
    Dial(Option<&'a AuthKey>),
    /// The listener: for a greeting marked as coming back, the session secret of the endpoint
    /// it names (an error when there is none to take the rail back into).
    Accept(&'a dyn Fn(&Hello) -> Result<Option<AuthKey>>),
}

/// The bytes both sides see alike of what binds the connection: the dialer's queue pair number,
/// the listener's, the dialer's GID, the listener's (as `b`, seen from `role`, says).
fn binding(role: Role, b: &ConnectionBinding) -> Vec<u8> {
    let (dq, lq, dg, lg) = match role {
        Role::Dialer => (b.local_qpn, b.peer_qpn, b.local_gid, b.peer_gid),
        Role::Listener => (b.peer_qpn, b.local_qpn, b.peer_gid, b.local_gid),
    };
    let mut v = Vec::with_capacity(40);
    v.extend_from_slice(&dq.to_le_bytes());
    v.extend_from_slice(&lq.to_le_bytes());
    v.extend_from_slice(&dg.0);
    v.extend_from_slice(&lg.0);
    v
}

/// A rail greeted and authenticated, its descriptors not published yet.
pub(super) struct Greeted {
    conn: Connection,
    pub(super) device: usize,
    channel: CompletionChannel,
    window: u32,
    /// The peer's greeting (no descriptors yet).
    pub(super) theirs: Hello,
    /// With a key, on a rail of a new endpoint: the endpoint's session secret (what a rail
    /// taken back proves), from this rail's transcript.
    session: Option<AuthKey>,
}

/// A rail's handshake on a queue pair that lets the peer reach nothing yet: greetings swapped
/// and checked (a key on both sides or on neither); with a key, proofs swapped and checked
/// (made with the endpoint's session secret on a rail taken back); then, and only then, remote
/// read and write granted and the notification receives posted (on a rail taken back, once it
/// is back). The peer's greeting is read into a fixed-size buffer; its descriptors are read
/// later, by [`publish_all`].
pub(super) fn greet(
    e: &EngineInner,
    mut conn: Connection,
    home: Home<'_>,
    mut mine: Hello,
    g: &Greet<'_>,
) -> Result<Greeted> {
    let (device, channel, window) = home
        .made
        .ok_or_else(|| Error::invalid("connection", "no device", "rdma_cm picked no device"))?;
    mine.device = device as u8;
    let engine_key = e.config.key.as_ref();
    let challenge = Challenge::new(g.role, engine_key.is_some())?;
    let my_first = mine.greeting(&challenge);
    let their_first = conn.exchange_bytes_until(&my_first, g.deadline, g.stop)?;
    let (their_challenge, theirs) = Hello::from_greeting(&their_first)?;
    agree(&challenge, &their_challenge, &g.peer)?;
    let back = mine.back != 0 || theirs.back != 0;
    let looked_up;
    let key = match (&g.back, theirs.back) {
        (Back::No, 0) => engine_key,
        (Back::Dial(session), 0) => *session,
        (Back::Accept(_), 0) => engine_key,
        (Back::Accept(session_of), _) => {
            looked_up = session_of(&theirs)?;
            looked_up.as_ref()
        }
        _ => {
            return Err(Error::invalid(
                "hello.back",
                theirs.back,
                "0 from the listening side",
            ));
        }
    };
    if key.is_some() != engine_key.is_some() {
        return Err(Error::invalid(
            "hello.back",
            theirs.back,
            "an endpoint with a session secret exactly when the engine has a key",
        ));
    }
    let mut session = None;
    if let Some(key) = key {
        let (d, l) = match g.role {
            Role::Dialer => (&my_first, &their_first),
            Role::Listener => (&their_first, &my_first),
        };
        let t = Transcript::new(d, l, &binding(g.role, &conn.binding()));
        let proof = tag_message(&tag(key, LABEL, g.role, &t));
        let got = conn.exchange_bytes_until(&proof, g.deadline, g.stop)?;
        let got = read_tag_message(&got, &g.peer)?;
        check_tag(key, LABEL, g.role.peer(), &t, got, &g.peer)?;
        if !back {
            let s = tag(key, SESSION_LABEL, Role::Dialer, &t);
            session = Some(AuthKey::from_bytes(s.to_vec())?);
        }
    }
    if let Some(a) = g.authenticated {
        a.store(true, Ordering::Release);
    }
    // Until here the queue pair let the peer reach no registration, whatever rkey it tried.
    conn.set_remote_access(PEER_ACCESS)?;
    // Every rail's: notifications go on another rail when theirs fails. A rail taken back
    // posts them only once it is back (see `state::install`).
    if !back {
        let n = e.config.notify_depth as usize;
        conn.qp().post_recv(note_receives(n))?;
    }
    Ok(Greeted {
        conn,
        device,
        channel,
        window,
        theirs,
        session,
    })
}

/// Publish on every rail of an endpoint, in rail order (both sides go in the same order: each
/// rail's address swap waits for the peer's), by `deadline` (or `stop`): what the peer may
/// reach decided from the devices of all the rails ([`EngineInner::peer_access`]), under
/// windows a window bound per descriptor through each rail's queue pair, each rail's descriptor
/// message registered and swapped, the peer's read, and the peer's lists merged into one
/// ([`merge_descriptors`], in the first rail's [`Hello`]).
///
/// # Errors
///
/// [`Error::Unsupported`] under [`PeerAccess::Windows`] when two rails go through one device;
/// [`Error::InvalidArgument`] for a peer's message that is not valid, or lists that differ
/// between rails; as [`bind_for_peer`]; [`Error::Timeout`].
pub(super) fn publish_all(
    e: &EngineInner,
    mut greeted: Vec<Greeted>,
    group: [u8; 16],
    publish: &[MemoryDescriptor],
    deadline: Instant,
    stop: Option<&AtomicBool>,
) -> Result<Connected> {
    let devices: Vec<usize> = greeted.iter().map(|g| g.device).collect();
    let session = greeted.first_mut().and_then(|g| g.session.take());
    let access = e.peer_access(&devices)?;
    let mut rails = Vec::with_capacity(greeted.len());
    let mut hellos = Vec::with_capacity(greeted.len());
    for g in greeted {
        let (rail, hello) = publish_rail(e, g, publish, access, deadline, stop)?;
        rails.push(rail);
        hellos.push(hello);
    }
    let per_rail: Vec<(usize, &[MemoryDescriptor])> = hellos
        .iter()
        .map(|h| (h.device as usize, &h.descriptors[..]))
        .collect();
    let merged = merge_descriptors(&per_rail)?;
    for h in &mut hellos {
        h.descriptors = Vec::new();
    }
    if let Some(h) = hellos.get_mut(NOTIFY_RAIL) {
        h.descriptors = merged;
    }
    Ok(Connected {
        rails,
        hellos,
        group,
        session,
    })
}

/// One rail's descriptors published under `access` (windows bound through its queue pair for
/// the descriptors it sends), and the peer's read: the peer's descriptors are decoded only
/// here, after it was authenticated.
fn publish_rail(
    e: &EngineInner,
    g: Greeted,
    publish: &[MemoryDescriptor],
    access: PeerAccess,
    deadline: Instant,
    stop: Option<&AtomicBool>,
) -> Result<(Rail, Hello)> {
    let Greeted {
        mut conn,
        device,
        channel,
        window,
        mut theirs,
        ..
    } = g;
    let mut windows = Vec::new();
    let granted;
    let publish = if access == PeerAccess::Windows && !publish.is_empty() {
        let got = bind_for_peer(
            e,
            device,
            &mut conn,
            publish,
            window as usize,
            deadline,
            stop,
        )?;
        windows = got.windows;
        granted = got.descriptors;
        &granted[..]
    } else {
        publish
    };
    let (bytes, hello_mr) = swap(
        &mut conn,
        &Hello::encode_descriptors(publish)?,
        deadline,
        stop,
    )?;
    theirs.descriptors = Hello::decode_descriptors(&bytes, theirs.devices)?;
    let mut rail = rail_of(conn, windows, access, channel, device, window, hello_mr);
    rail.peer_device = theirs.device as usize;
    Ok((rail, theirs))
}

/// A rail taken back, once greeted: the windows it had bound for the peer (`lost`, under
/// `access`) bound again through its new queue pair, the window messages swapped (each side's
/// proposed generation, `proposed` here, and its rkeys renamed), by `deadline` (or `stop`).
/// Returns the rail (ready to put in the failed one's place, its notification receives not
/// posted yet), the generation both sides agree on (the larger proposal), and the peer's
/// greeting.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a peer's message that is not valid; as [`bind_ranges`];
/// [`Error::Timeout`].
pub(super) fn rebind(
    e: &EngineInner,
    g: Greeted,
    lost: &[(MrSlice, u32)],
    access: PeerAccess,
    proposed: u32,
    deadline: Instant,
    stop: Option<&AtomicBool>,
) -> Result<(Rail, u32, Hello)> {
    let Greeted {
        mut conn,
        device,
        channel,
        window,
        theirs,
        ..
    } = g;
    let ranges = lost.iter().map(|(r, _)| r.clone()).collect();
    let windows = bind_ranges(&mut conn, ranges, window as usize, deadline, stop)?;
    let pairs: Vec<(u32, u32)> = lost
        .iter()
        .zip(&windows)
        .map(|((_, first), w)| (*first, w.rkey()))
        .collect();
    let (bytes, mine_mr) = swap(
        &mut conn,
        &Hello::encode_renamed(proposed, &pairs)?,
        deadline,
        stop,
    )?;
    let (theirs_proposed, renamed) = Hello::decode_renamed(&bytes)?;
    count_bound(e, windows.len());
    let mut rail = rail_of(conn, windows, access, channel, device, window, mine_mr);
    rail.peer_device = theirs.device as usize;
    rail.renamed = renamed.into_iter().collect();
    rail.firsts = pairs.into_iter().map(|(first, now)| (now, first)).collect();
    Ok((rail, proposed.max(theirs_proposed), theirs))
}

/// A rail of a connection whose handshake ended: nothing posted yet, no rkey renamed, its peer
/// device 0 until set.
fn rail_of(
    conn: Connection,
    windows: Vec<BoundWindow>,
    access: PeerAccess,
    channel: CompletionChannel,
    device: usize,
    window: u32,
    hello: MemoryRegion<Local>,
) -> Rail {
    let parts = conn.into_parts();
    Rail {
        windows,
        access,
        qp: QpSlot::Rts(parts.qp),
        send_cq: parts.send_cq,
        recv_cq: parts.recv_cq,
        channel,
        link: parts.link,
        device,
        peer_device: 0,
        window,
        renamed: HashMap::new(),
        firsts: HashMap::new(),
        lost: Vec::new(),
        next_seq: 1,
        inflight: VecDeque::new(),
        pending: VecDeque::new(),
        _hello: hello,
    }
}

/// Swap messages with the peer: `mine` registered for it to read, the addresses swapped, the
/// peer's read (at most [`MAX_HELLO`] bytes), by `deadline` (or `stop`). Returns the peer's
/// bytes and this side's registration (kept while the peer may read it).
fn swap(
    conn: &mut Connection,
    mine: &[u8],
    deadline: Instant,
    stop: Option<&AtomicBool>,
) -> Result<(Vec<u8>, MemoryRegion<Local>)> {
    let pd = conn.pd().clone();
    let hello_mr = pd.register(HostBuffer::from_slice(mine)?, AccessFlags::REMOTE_READ)?;
    let theirs_at = conn.exchange_until(hello_mr.remote(), deadline, stop)?;
    if theirs_at.len > MAX_HELLO {
        return Err(Error::invalid(
            "peer",
            theirs_at.len,
            format!("a first message is at most {MAX_HELLO} bytes"),
        ));
    }
    // Bounded just above: fits usize and one message.
    let len = theirs_at.len as usize;
    let mut into = pd.register(HostBuffer::zeroed(len)?, AccessFlags::LOCAL_WRITE)?;
    conn.qp()
        .post_send([SendRequest::read(into.slice(..)?, theirs_at.slice(0, len as u32)?).tag(1)])?;
    let started = Instant::now();
    'wait: loop {
        for w in conn.send_cq().poll()? {
            if w.tag() == 1 {
                w.result()?;
                break 'wait;
            }
        }
        if Instant::now() >= deadline || stop.is_some_and(|s| s.load(Ordering::Acquire)) {
            return Err(Error::Timeout {
                what: "the peer's first message",
                after: started.elapsed(),
            });
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let bytes = into
        .as_slice()
        .ok_or_else(|| Error::invalid("read", "region", "still in use"))?;
    Ok((bytes.to_vec(), hello_mr))
}

#[cfg(test)]
mod resolve_tests {
    use super::*;

    #[test]
    fn a_literal_address_needs_no_resolver() {
        static PLACES: Resolving = Resolving::new(1);
        let a = resolve_with("10.1.2.3:4791", Duration::ZERO, &PLACES, |_| {
            panic!("asked the resolver for a literal address")
        })
        .unwrap();
        assert_eq!(a, "10.1.2.3:4791".parse().unwrap());
    }

    #[test]
    fn a_name_resolves_within_its_bound_or_times_out() {
        static PLACES: Resolving = Resolving::new(4);
        let v4: SocketAddr = "192.0.2.7:4791".parse().unwrap();
        let v6: SocketAddr = "[2001:db8::7]:4791".parse().unwrap();
        let got = resolve_with("node-a:4791", Duration::from_secs(5), &PLACES, move |n| {
            assert_eq!(n, "node-a:4791");
            Ok(vec![v6, v4])
        });
        assert_eq!(got.unwrap(), v4, "IPv4 first");
        // A resolver that does not answer: refused at the bound, not at its own pace.
        let started = Instant::now();
        let e = resolve_with("slow:4791", Duration::from_millis(100), &PLACES, |_| {
            std::thread::sleep(Duration::from_secs(3));
            Ok(vec![])
        })
        .unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        let e =
            resolve_with("none:4791", Duration::from_secs(5), &PLACES, |_| Ok(vec![])).unwrap_err();
        assert!(e.to_string().contains("no address"), "{e}");
    }

    /// Names that never answer hold their threads; with every place taken, the next name waits
    /// for one within its bound and is refused at it, starting no thread; a thread that ends
    /// gives its place to the next name.
    #[test]
    fn resolver_threads_are_bounded() {
        static PLACES: Resolving = Resolving::new(2);
        let v4: SocketAddr = "192.0.2.9:4791".parse().unwrap();
        let mut release = Vec::new();
        for k in 0..2 {
            let (tx, rx) = std::sync::mpsc::channel::<()>();
            release.push(tx);
            let e = resolve_with(
                &format!("hung-{k}:4791"),
                Duration::from_millis(20),
                &PLACES,
                move |_| {
                    let _ = rx.recv();
                    Ok(vec![])
                },
            )
            .unwrap_err();
            assert!(matches!(e, Error::Timeout { .. }), "{e}");
        }
        let started = Instant::now();
        let e = resolve_with("next:4791", Duration::from_millis(100), &PLACES, |_| {
            panic!("a resolver thread started past the bound")
        })
        .unwrap_err();
        assert!(
            matches!(e, Error::Timeout { what, .. } if what.contains("busy")),
            "{e}"
        );
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(100) && waited < Duration::from_secs(2),
            "{waited:?}"
        );
        // One hung name answers at last: its place serves the next name.
        drop(release.remove(0));
        let got = resolve_with("next:4791", Duration::from_secs(5), &PLACES, move |_| {
            Ok(vec![v4])
        });
        assert_eq!(got.unwrap(), v4);
        drop(release);
    }
}
