//! Making intra-node endpoints: a listener on a Unix domain socket that accepts them, and
//! connecting to one.

use super::fds::outgoing;
use super::handle::Local;
use super::meet::{dial, greet};
use super::side::Side;
use super::socket::os;
use crate::completion::deadline_after;
use crate::error::{Error, Result};
use crate::transfer::descriptor::MemoryDescriptor;
use crate::transfer::engine::Engine;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A listener for intra-node endpoints on a Unix domain socket (what a
/// [`LocalListener`](crate::transfer::LocalListener) holds). Dropping it removes the socket
/// file.
pub(crate) struct Listener {
    engine: Engine,
    listener: UnixListener,
    path: PathBuf,
}

/// Listen for intra-node endpoints on the Unix domain socket at `path` (made here; it must not
/// exist).
///
/// # Errors
///
/// As [`Engine::listen_local`].
pub(crate) fn listen(engine: &Engine, path: &Path) -> Result<Listener> {
    let path = path.to_path_buf();
    let listener = UnixListener::bind(&path).map_err(|e| os("bind (a Unix socket)", e))?;
    Ok(Listener {
        engine: engine.clone(),
        listener,
        path,
    })
}

/// Connect an intra-node endpoint to the local listener at `path` (its side not started yet).
///
/// # Errors
///
/// As [`Engine::connect_local`].
pub(crate) fn connect(engine: &Engine, path: &Path, publish: &[MemoryDescriptor]) -> Result<Local> {
    let path = path.to_path_buf();
    let (stream, hello, fds) = dial(engine, &path, publish)?;
    let side = Side::new(engine.clone(), stream, fds, Some((path, publish.to_vec())));
    Ok(Local::new(engine.clone(), hello.descriptors, side))
}

impl Listener {
    /// The socket's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Accept the next intra-node endpoint within `timeout` (its side not started yet).
    ///
    /// # Errors
    ///
    /// As [`LocalListener::accept`](crate::transfer::LocalListener::accept).
    pub(crate) fn accept(&self, publish: &[MemoryDescriptor], timeout: Duration) -> Result<Local> {
        let deadline = deadline_after(Instant::now(), timeout);
        // Refused before anyone is accepted: a VMM or pool export that is gone, or described
        // otherwise.
        outgoing(publish)?;
        self.listener
            .set_nonblocking(true)
            .map_err(|e| os("fcntl (a Unix socket)", e))?;
        let mut s = loop {
            match self.listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(Error::Timeout {
                            what: "an intra-node endpoint to accept",
                            after: timeout,
                        });
                    }
                    let mut p = libc::pollfd {
                        fd: self.listener.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    let ms = left.as_millis().clamp(1, 1000) as i32;
                    // SAFETY: one valid pollfd for the call.
                    unsafe { libc::poll(&mut p, 1, ms) };
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(os("accept (a Unix socket)", e)),
            }
        };
        s.set_nonblocking(false)
            .map_err(|e| os("fcntl (a Unix socket)", e))?;
        let left = deadline
            .saturating_duration_since(Instant::now())
            .min(self.engine.inner.config.connect_timeout);
        let (hello, fds) = greet(
            &mut s,
            &self.engine.inner.config,
            publish,
            false,
            left,
            self.engine.inner.config.connect_timeout,
        )?;
        let side = Side::new(self.engine.clone(), s, fds, None);
        Ok(Local::new(self.engine.clone(), hello.descriptors, side))
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::completion::Fence;

    use crate::error::{Error, Result};
    use crate::p2p::send_fds;
    use crate::transfer::descriptor::IpcPart;
    use crate::transfer::descriptor::MemoryDescriptor;
    use crate::transfer::engine::Engine;
    use crate::transfer::pending::{Finisher, Transfer};
    use crate::transfer::region::{FdOf, MemoryPath};
    use crate::transfer::request::{Direction, TransferOptions};

    use std::io::Read;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    use super::super::fds::FD_MAGIC;
    use super::super::hello::{LocalHello, descs};
    use super::super::meet::greet_bare;
    use super::super::side::{Job, lock};
    use super::super::socket::{FRAME, NOTE, recv_msg, send_all, send_msg};
    use crate::transfer::descriptor::DescribedKind;
    use crate::transfer::transport::Transport;
    use crate::transfer::{
        AuthKey, Authentication, Buffer, EngineConfig, LocalListener, LocalPeers,
    };
    use std::time::{Duration, Instant};

    use std::io::Write;

    /// Two endpoints of `engine` meeting over the socket `name`: the dialer publishing nothing,
    /// the acceptor `publish`; the listener is kept (its socket file with it).
    fn meet(
        engine: &Engine,
        name: &str,
        publish: Vec<MemoryDescriptor>,
    ) -> (
        crate::transfer::Endpoint,
        crate::transfer::Endpoint,
        LocalListener,
    ) {
        let l = engine.listen_local(socket(name)).unwrap();
        let path = l.path().to_path_buf();
        let acc = std::thread::spawn(move || {
            let ep = l.accept(&publish, Duration::from_secs(10));
            (ep, l)
        });
        let a = engine.connect_local(&path, &[]).unwrap();
        let (b, l) = acc.join().unwrap();
        (a, b.unwrap(), l)
    }

    fn socket(name: &str) -> PathBuf {
        static N: AtomicU64 = AtomicU64::new(0);
        std::env::temp_dir().join(format!(
            "gpudirect-local-{}-{name}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ))
    }

    #[test]
    fn connecting_to_a_missing_socket_is_a_typed_error() {
        let engine = Engine::new(EngineConfig::local()).unwrap();
        let e = engine.connect_local(socket("missing"), &[]).unwrap_err();
        match &e {
            Error::Os { source, .. } => {
                assert_eq!(source.kind(), std::io::ErrorKind::NotFound, "{e}")
            }
            other => panic!("{other:?}"),
        }
        // An accept nobody dials ends at its timeout.
        let l = engine.listen_local(socket("lonely")).unwrap();
        let t = Instant::now();
        let e = l.accept(&[], Duration::from_millis(50)).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(t.elapsed() < Duration::from_secs(5));
        // A listener's path in use: typed.
        let e = engine.listen_local(l.path()).unwrap_err();
        assert!(matches!(e, Error::Os { .. }), "{e}");
        // An engine without rails makes no across-node endpoint.
        let e = engine.connect(&["127.0.0.1:1"], &[]).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "engine", .. }),
            "{e}"
        );
    }

    fn keyed(b: u8) -> EngineConfig {
        EngineConfig {
            key: Some(AuthKey::from_bytes(vec![b; 32]).unwrap()),
            ..EngineConfig::local()
        }
    }

    /// An endpoint of an engine of `dial` meeting a listener of an engine of `listen`
    /// publishing `descs(2)`: (the dialer's result, the listener's).
    fn try_meet(
        listen: EngineConfig,
        dial: EngineConfig,
    ) -> (
        Result<crate::transfer::Endpoint>,
        Result<crate::transfer::Endpoint>,
    ) {
        let (le, de) = (Engine::new(listen).unwrap(), Engine::new(dial).unwrap());
        let l = le.listen_local(socket("keyed")).unwrap();
        let path = l.path().to_path_buf();
        let acc = std::thread::spawn(move || l.accept(&descs(2), Duration::from_secs(10)));
        let d = de.connect_local(&path, &[]);
        (d, acc.join().unwrap())
    }

    fn refused(r: &Result<crate::transfer::Endpoint>) -> bool {
        matches!(r, Err(Error::Authentication { .. }))
    }

    /// A greeting and a proof, as sent.
    type Sent = (Vec<u8>, Vec<u8>);

    /// A hand-made dialer: its greeting (and with `key`, its proof; with `replay`, that
    /// greeting and proof instead of its own), then whatever the listener sends before it
    /// hangs up. Returns (the greeting and proof sent, the listener's greeting, the bytes that
    /// came after the proofs).
    fn hand_dialer(
        path: &Path,
        key: Option<&AuthKey>,
        replay: Option<Sent>,
    ) -> (Sent, Vec<u8>, Vec<u8>) {
        use crate::transfer::auth::{Challenge, Role, Transcript, tag, tag_message};
        let mut s = UnixStream::connect(path).unwrap();
        let mine = match &replay {
            Some((g, _)) => g.clone(),
            None => super::super::hello::greeting(
                &Challenge::new(Role::Dialer, key.is_some() || replay.is_some()).unwrap(),
            ),
        };
        send_msg(&mut s, &mine).unwrap();
        let theirs = recv_msg(&mut s, Duration::from_secs(10)).unwrap();
        let me = std::process::id();
        let mut binding = me.to_le_bytes().to_vec();
        binding.extend_from_slice(&me.to_le_bytes());
        let proof = match (&replay, key) {
            (Some((_, p)), _) => p.clone(),
            (None, Some(k)) => {
                let t = Transcript::new(&mine, &theirs, &binding);
                tag_message(&tag(k, b"gpudirect transfer local v1", Role::Dialer, &t))
            }
            (None, None) => Vec::new(),
        };
        if !proof.is_empty() {
            send_msg(&mut s, &proof).unwrap();
        }
        if key.is_some() {
            // The first message (the dialer's goes first); the listener may have hung up.
            let h = LocalHello {
                pid: 77,
                descriptors: Vec::new(),
            };
            let _ = send_msg(&mut s, &h.encode().unwrap());
        }
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut after = Vec::new();
        let _ = s.read_to_end(&mut after);
        ((mine, proof), theirs, after)
    }

    #[test]
    fn keys_and_users_decide_who_meets_and_a_refused_peer_learns_nothing() {
        // The same key: met, and both say so.
        let (d, l) = try_meet(keyed(1), keyed(1));
        let (d, l) = (d.unwrap(), l.unwrap());
        assert_eq!(d.authentication(), Authentication::Key);
        assert_eq!(l.authentication(), Authentication::Key);
        assert_eq!(d.peer_descriptors(), descs(2));
        drop((d, l));
        // Without keys: as before, unauthenticated.
        let (d, l) = try_meet(EngineConfig::local(), EngineConfig::local());
        assert_eq!(d.unwrap().authentication(), Authentication::Unauthenticated);
        assert_eq!(l.unwrap().authentication().to_string(), "unauthenticated");
        // Another key, or a key on one side only: refused on both sides, typed.
        for (lc, dc, what) in [
            (keyed(1), keyed(2), "another key"),
            (keyed(1), EngineConfig::local(), "the dialer has none"),
            (EngineConfig::local(), keyed(1), "the listener has none"),
        ] {
            let (d, l) = try_meet(lc, dc);
            assert!(refused(&d) && refused(&l), "{what}: {d:?} / {l:?}");
        }
        // A user the listener's rule does not admit: refused there, before any greeting.
        let rule = EngineConfig {
            local_peers: LocalPeers::Users(Vec::new()),
            ..EngineConfig::local()
        };
        let (d, l) = try_meet(rule, EngineConfig::local());
        assert!(refused(&l), "{l:?}");
        assert!(d.is_err());
        let (d, l) = try_meet(
            EngineConfig::local(),
            EngineConfig {
                local_peers: LocalPeers::Users(Vec::new()),
                ..EngineConfig::local()
            },
        );
        assert!(refused(&d), "{d:?}");
        assert!(l.is_err());

        // Hand-made peers of a keyed listener: with the right key, its first message follows
        // the proofs; with another key, without one, or replaying a recorded meeting, it sends
        // nothing after them (nothing published) and refuses typed.
        let e = Engine::new(keyed(5)).unwrap();
        let l = e.listen_local(socket("hand")).unwrap();
        let run = |key: Option<AuthKey>, replay: Option<Sent>| {
            let path = l.path().to_path_buf();
            let peer = std::thread::spawn(move || hand_dialer(&path, key.as_ref(), replay));
            let r = l.accept(&descs(3), Duration::from_secs(10));
            (r, peer.join().unwrap())
        };
        let good = AuthKey::from_bytes(vec![5; 32]).unwrap();
        let (r, (recorded, _, after)) = run(Some(good.clone()), None);
        // The listener's proof and its first message came.
        assert!(after.len() > 40, "{} bytes after the proofs", after.len());
        assert_eq!(r.unwrap().peer_descriptors(), Vec::new());
        let (r, (_, _, after)) = run(Some(AuthKey::from_bytes(vec![6; 32]).unwrap()), None);
        assert!(refused(&r), "{r:?}");
        assert!(
            after.len() <= 4 + 36,
            "only the listener's proof: {}",
            after.len()
        );
        let (r, (_, _, after)) = run(None, None);
        assert!(refused(&r), "{r:?}");
        assert!(after.is_empty(), "{after:?}");
        let (r, (_, theirs, after)) = run(None, Some(recorded));
        assert!(refused(&r), "a replayed meeting: {r:?}");
        assert!(
            after.len() <= 4 + 36,
            "only the listener's proof: {}",
            after.len()
        );
        assert_eq!(theirs.len(), super::super::hello::GREETING_LEN);
        assert!(e.cache_stats().imports_opened == 0);
    }

    #[test]
    fn two_local_endpoints_in_one_process_greet_and_refuse_what_they_cannot_copy() {
        let engine = Engine::new(EngineConfig::local()).unwrap();
        let path = socket("pair");
        let l = engine.listen_local(&path).unwrap();
        let theirs = descs(3);
        let publish = theirs.clone();
        let acc = std::thread::spawn(move || l.accept(&publish, Duration::from_secs(10)));
        let mine = descs(1);
        let a = engine.connect_local(&path, &mine).unwrap();
        let b = acc.join().unwrap().unwrap();
        assert_eq!(a.peer_descriptors(), theirs);
        assert_eq!(b.peer_descriptors(), mine);
        assert_eq!((a.rails(), b.rails()), (0, 0));
        assert!(a.rail_stats().is_empty());
        assert!(a.failure().is_none());
        assert_eq!(
            a.next_notification(Duration::from_millis(10)).unwrap(),
            None
        );

        // Host memory registered with no NIC; no peer can reach it.
        let region = engine
            .register(Buffer::host(vec![5u8; 4096]).unwrap())
            .unwrap();
        assert_eq!(region.path(), &MemoryPath::Unregistered);
        // No window inside a node: grant is refused, typed.
        let e = a.grant(&region).unwrap_err();
        assert!(matches!(e, Error::Unsupported { .. }), "{e}");
        let e = region.descriptor().unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "region", .. }),
            "{e}"
        );
        // A remote descriptor without an IPC part: refused, saying why.
        let rdma_only = MemoryDescriptor::new(0x1000, 4096, DescribedKind::Host, &[1]).unwrap();
        let e = a
            .write(
                vec![(region.all(), rdma_only.all())],
                TransferOptions::default(),
            )
            .unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "pairs", .. })
                && e.to_string().contains("IPC"),
            "{e}"
        );
        // With an IPC part, but the peer is this very process: refused before any CUDA call.
        let e = a
            .write(
                vec![(region.all(), theirs[0].all())],
                TransferOptions::notify(3),
            )
            .unwrap_err();
        assert!(matches!(e, Error::Unsupported { .. }), "{e}");
        let e = a
            .read(
                vec![(region.all(), theirs[0].all())],
                TransferOptions::notify(3),
            )
            .unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "notify", .. }),
            "{e}"
        );
        // A prepared request is refused for the same reasons, before any CUDA call.
        let prep = |dir, pairs, opts| a.prepare(dir, pairs, opts).unwrap_err();
        let e = prep(
            Direction::Write,
            vec![(region.all(), rdma_only.all())],
            TransferOptions::default(),
        );
        assert!(
            matches!(e, Error::InvalidArgument { arg: "pairs", .. })
                && e.to_string().contains("IPC"),
            "{e}"
        );
        let e = prep(
            Direction::Write,
            vec![(region.all(), theirs[0].all())],
            TransferOptions::default(),
        );
        assert!(matches!(e, Error::Unsupported { .. }), "{e}");
        let e = prep(
            Direction::Read,
            vec![(region.all(), theirs[0].all())],
            TransferOptions::notify(3),
        );
        assert!(
            matches!(e, Error::InvalidArgument { arg: "notify", .. }),
            "{e}"
        );
        let e = prep(Direction::Write, Vec::new(), TransferOptions::default());
        assert!(
            matches!(e, Error::InvalidArgument { arg: "pairs", .. }),
            "{e}"
        );
        let e = prep(
            Direction::Write,
            vec![(
                region.range(0, 100).unwrap(),
                theirs[0].range(0, 99).unwrap(),
            )],
            TransferOptions::default(),
        );
        assert!(
            matches!(e, Error::InvalidArgument { arg: "pairs", .. }),
            "lengths differ: {e}"
        );
        assert_eq!(engine.cache_stats().imports_opened, 0);

        // The peer goes: the other side ends with a typed error naming the socket, no hang.
        drop(b);
        let t = Instant::now();
        let e = loop {
            match a.next_notification(Duration::from_secs(5)) {
                Err(e) => break e,
                Ok(None) => assert!(t.elapsed() < Duration::from_secs(10), "no failure seen"),
                Ok(Some(n)) => panic!("{n:?}"),
            }
        };
        assert!(
            matches!(&e, Error::Os { call, .. } if call.contains("Unix socket")),
            "{e}"
        );
        let e = a
            .write(
                vec![(region.all(), theirs[0].all())],
                TransferOptions::default(),
            )
            .unwrap_err();
        assert!(
            matches!(e, Error::Os { .. }),
            "later requests: the same failure: {e}"
        );

        // The dialing side reconnects to a listener that accepts again.
        let l = engine.listen_local(socket("pair2")).unwrap();
        let p2 = l.path().to_path_buf();
        let acc = std::thread::spawn(move || l.accept(&descs(2), Duration::from_secs(10)));
        let c = engine.connect_local(&p2, &[]).unwrap();
        let d = acc.join().unwrap().unwrap();
        assert!(
            matches!(d.reconnect(), Err(Error::InvalidArgument { .. })),
            "accepted side"
        );
        drop(d);
        drop(c);
        drop(a);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_peer_in_this_process_claiming_another_pid_is_still_refused_before_any_cuda_call() {
        let engine = Engine::new(EngineConfig::local()).unwrap();
        let path = socket("liar");
        let l = engine.listen_local(&path).unwrap();
        let acc = std::thread::spawn(move || l.accept(&[], Duration::from_secs(10)));
        // This very process, saying it is pid 4242 and publishing cuIpc memory.
        let theirs = descs(2);
        let mut s = UnixStream::connect(&path).unwrap();
        greet_bare(&mut s);
        let h = LocalHello {
            pid: 4242,
            descriptors: theirs.clone(),
        }
        .encode()
        .unwrap();
        send_msg(&mut s, &h).unwrap();
        let ep = acc.join().unwrap().unwrap();
        LocalHello::decode(&recv_msg(&mut s, Duration::from_secs(10)).unwrap()).unwrap();
        assert_eq!(ep.peer_descriptors(), theirs);
        let region = engine
            .register(Buffer::host(vec![5u8; 4096]).unwrap())
            .unwrap();
        for read in [false, true] {
            let pairs = vec![(region.all(), theirs[1].all())];
            let opts = TransferOptions::default();
            let e = if read {
                ep.read(pairs, opts)
            } else {
                ep.write(pairs, opts)
            }
            .unwrap_err();
            assert!(
                matches!(&e, Error::Unsupported { what, .. } if what.contains("one process")),
                "read {read}: {e}"
            );
        }
        assert_eq!(engine.cache_stats().imports_opened, 0);
        drop(s);
        drop(ep);
        let _ = std::fs::remove_file(&path);
    }

    /// An intra-node endpoint accepted from a bare peer (pid `pid`) on socket `name`: the
    /// listener, the endpoint, the peer's socket (each kept for the test) and the side.
    fn accepted_side(
        name: &str,
        pid: u32,
    ) -> (
        LocalListener,
        crate::transfer::Endpoint,
        UnixStream,
        Arc<super::super::side::Side>,
    ) {
        let engine = Engine::new(EngineConfig::local()).unwrap();
        let l = engine.listen_local(socket(name)).unwrap();
        let path = l.path().to_path_buf();
        let peer = std::thread::spawn(move || greeted_peer(&path, pid));
        let ep = l.accept(&[], Duration::from_secs(10)).unwrap();
        let peer = peer.join().unwrap();
        let Transport::Local(local) = ep.transport() else {
            panic!("an intra-node endpoint")
        };
        let side = local.side.me.upgrade().unwrap();
        (l, ep, peer, side)
    }

    /// A hand-made peer of a listener at `path`: connected, first messages swapped.
    fn greeted_peer(path: &std::path::Path, pid: u32) -> UnixStream {
        let mut s = UnixStream::connect(path).unwrap();
        greet_bare(&mut s);
        let h = LocalHello {
            pid,
            descriptors: Vec::new(),
        }
        .encode()
        .unwrap();
        send_msg(&mut s, &h).unwrap();
        LocalHello::decode(&recv_msg(&mut s, Duration::from_secs(10)).unwrap()).unwrap();
        s
    }

    /// A descriptor of 4096 bytes of the VMM export `id`, which maps `mapped` bytes.
    fn vmm_desc(id: u64, mapped: u64) -> MemoryDescriptor {
        MemoryDescriptor::with_ipc(
            0x7f00_0000_0000,
            4096,
            DescribedKind::Device,
            &[],
            IpcPart::vmm_fd(id, mapped, 0, [7; 16]),
        )
        .unwrap()
    }

    /// A descriptor of 4096 bytes at `offset` of a 1 MiB allocation of the pool export `id`,
    /// whose pointer export data is `data` repeated.
    fn pool_desc(id: u64, data: u8, offset: u64) -> MemoryDescriptor {
        MemoryDescriptor::with_ipc(
            0x7f00_0000_0000 + offset,
            4096,
            DescribedKind::Device,
            &[],
            IpcPart::pool_ptr(id, [data; 64], 1 << 20, offset, [7; 16]),
        )
        .unwrap()
    }

    /// A new file at a unique path, and that path as `/proc/self/fd` shows it.
    fn marker(name: &str) -> (std::fs::File, PathBuf) {
        let p = socket(name);
        let f = std::fs::File::create(&p).unwrap();
        (f, std::fs::canonicalize(&p).unwrap())
    }

    /// Descriptors of this process open on `path` (other tests' descriptors never are).
    fn open_on(path: &Path) -> usize {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| std::fs::read_link(e.path()).is_ok_and(|l| l == path))
            .count()
    }

    /// A VMM file descriptor message listing `ids`.
    fn fd_msg(ids: &[u64]) -> Vec<u8> {
        let mut b = FD_MAGIC.to_vec();
        b.extend_from_slice(&(ids.len() as u32).to_le_bytes());
        for id in ids {
            b.extend_from_slice(&id.to_le_bytes());
        }
        b
    }

    #[test]
    fn a_peer_whose_vmm_fds_do_not_match_its_descriptors_is_refused_and_nothing_leaks() {
        let engine = Engine::new(EngineConfig::local()).unwrap();
        let l = engine.listen_local(socket("vmm-fds")).unwrap();
        let (file, marked) = marker("vmm-fds-marker");
        drop(file);
        // What the hand-made peer announces, and what it then does on the socket (which the
        // listener may have closed already).
        type Act = fn(&UnixStream, &std::fs::File);
        let cases: [(&str, Vec<MemoryDescriptor>, Act); 11] = [
            ("no fd at all", vec![vmm_desc(11, 2 << 20)], |_, _| {}),
            ("two fds for one id", vec![vmm_desc(11, 2 << 20)], |s, f| {
                let _ = send_fds(s, &[f.as_fd(), f.as_fd()], &fd_msg(&[11]));
            }),
            (
                "an fd for an id not announced",
                vec![vmm_desc(11, 2 << 20)],
                |s, f| {
                    let _ = send_fds(s, &[f.as_fd()], &fd_msg(&[12]));
                },
            ),
            (
                "a listed fd that did not come",
                vec![vmm_desc(11, 2 << 20)],
                |s, _| {
                    let _ = send_all(s, &fd_msg(&[11]));
                },
            ),
            (
                "more ids than announced",
                vec![vmm_desc(11, 2 << 20)],
                |s, f| {
                    let _ = send_fds(s, &[f.as_fd(), f.as_fd()], &fd_msg(&[11, 12]));
                },
            ),
            (
                "one id with two lengths",
                vec![vmm_desc(11, 2 << 20), vmm_desc(11, 4 << 20)],
                |s, f| {
                    let _ = send_fds(s, &[f.as_fd()], &fd_msg(&[11]));
                },
            ),
            ("not a fd message", vec![vmm_desc(11, 2 << 20)], |s, f| {
                let _ = send_fds(s, &[f.as_fd()], b"GDXL and more bytes");
            }),
            (
                "one id named as a VMM export and as a pool",
                vec![vmm_desc(11, 2 << 20), pool_desc(11, 1, 0)],
                |s, f| {
                    let _ = send_fds(s, &[f.as_fd()], &fd_msg(&[11]));
                },
            ),
            (
                "one pool's fd twice for its two allocations",
                vec![pool_desc(21, 1, 0), pool_desc(21, 2, 8192)],
                |s, f| {
                    let _ = send_fds(s, &[f.as_fd(), f.as_fd()], &fd_msg(&[21, 21]));
                },
            ),
            (
                "a pool's and a VMM fd in another order than named",
                vec![pool_desc(21, 1, 0), vmm_desc(22, 2 << 20)],
                |s, f| {
                    let _ = send_fds(s, &[f.as_fd(), f.as_fd()], &fd_msg(&[22, 21]));
                },
            ),
            (
                "a VMM fd but not the pool's",
                vec![vmm_desc(22, 2 << 20), pool_desc(21, 1, 0)],
                |s, f| {
                    let _ = send_fds(s, &[f.as_fd()], &fd_msg(&[22]));
                    let _ = send_all(s, &fd_msg(&[21]));
                },
            ),
        ];
        for (what, descriptors, act) in cases {
            let path = l.path().to_path_buf();
            let m = marked.clone();
            let peer = std::thread::spawn(move || {
                let mut s = UnixStream::connect(&path).unwrap();
                greet_bare(&mut s);
                let h = LocalHello {
                    pid: 76,
                    descriptors,
                }
                .encode()
                .unwrap();
                send_msg(&mut s, &h).unwrap();
                let f = std::fs::File::open(&m).unwrap();
                act(&s, &f);
                drop(f);
                // Until the listener gives up on this peer.
                s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                let _ = s.read(&mut [0u8; 64]);
            });
            let t = Instant::now();
            let e = l.accept(&[], Duration::from_millis(500)).unwrap_err();
            peer.join().unwrap();
            assert!(t.elapsed() < Duration::from_secs(10), "{what}: bounded");
            if what == "no fd at all" {
                assert!(matches!(e, Error::Timeout { .. }), "{what}: {e}");
            } else {
                assert!(
                    matches!(e, Error::InvalidArgument { arg: "peer", .. }),
                    "{what}: {e}"
                );
            }
            assert_eq!(open_on(&marked), 0, "{what}: every fd received is closed");
        }
        // A peer that announces no VMM memory but sends an fd after its first message: the
        // endpoint ends typed when it reads it, and the kernel closes the fd.
        let path = l.path().to_path_buf();
        let m = marked.clone();
        let peer = std::thread::spawn(move || {
            let mut s = greeted_peer(&path, 75);
            let f = std::fs::File::open(&m).unwrap();
            send_fds(&s, &[f.as_fd()], &fd_msg(&[11])).unwrap();
            drop(f);
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let _ = s.read(&mut [0u8; 64]);
        });
        let ep = l.accept(&[], Duration::from_secs(10)).unwrap();
        let e = ep.next_notification(Duration::from_secs(10)).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "peer", .. }),
            "{e}"
        );
        drop(ep);
        peer.join().unwrap();
        assert_eq!(open_on(&marked), 0, "the extra fd is closed");
        let _ = std::fs::remove_file(&marked);
    }

    #[test]
    fn vmm_fds_cross_when_endpoints_meet_and_only_then() {
        let engine = Engine::new(EngineConfig::local()).unwrap();
        let (file, marked) = marker("vmm-export");
        let mapped = 2 << 20;
        let v =
            crate::transfer::export::export_any_fd(file.into(), FdOf::Vmm { len: mapped }, [7; 16]);
        let published = vmm_desc(v.id, mapped);
        assert_eq!(open_on(&marked), 1);

        // Publishing what this process does not hold, or describing it otherwise: refused
        // before connecting (the path does not even exist).
        let nowhere = socket("vmm-nowhere");
        for (d, what) in [
            (vmm_desc(u64::MAX, mapped), "an export not held"),
            (vmm_desc(v.id, mapped * 2), "another length"),
        ] {
            let e = engine.connect_local(&nowhere, &[d]).unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument { arg: "publish", .. }),
                "{what}: {e}"
            );
        }

        // Published at the meeting (twice: one fd crosses): the dialer holds it.
        let (a, b, _l) = meet(&engine, "vmm-meet", vec![published, vmm_desc(v.id, mapped)]);
        assert_eq!(a.peer_descriptors()[0], published);
        assert_eq!(open_on(&marked), 2, "the exporter's and the one received");

        let region = engine
            .register(Buffer::host(vec![5u8; 4096]).unwrap())
            .unwrap();
        // Its fd came: the request gets past the VMM checks (to the refusal of a peer that is
        // this very process, before any CUDA call).
        let e = a
            .write(
                vec![(region.all(), published.all())],
                TransferOptions::default(),
            )
            .unwrap_err();
        assert!(matches!(e, Error::Unsupported { .. }), "{e}");
        // The same export described with another length than at the meeting: refused.
        let e = a
            .write(
                vec![(region.all(), vmm_desc(v.id, mapped * 2).all())],
                TransferOptions::default(),
            )
            .unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "pairs", .. }),
            "{e}"
        );
        // VMM memory handed over after the meeting: refused, saying it must be published then.
        let late = vmm_desc(u64::MAX, mapped);
        let pairs = vec![
            (region.all(), descs(1)[0].all()),
            (region.all(), late.all()),
        ];
        let e = a.write(pairs, TransferOptions::default()).unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "pairs", .. })
                && text.contains("1")
                && text.contains("published when the endpoints meet"),
            "{text}"
        );
        // The accepting side never got one (the dialer published nothing).
        let e = b
            .write(
                vec![(region.all(), published.all())],
                TransferOptions::default(),
            )
            .unwrap_err();
        assert!(
            e.to_string().contains("published when the endpoints meet"),
            "{e}"
        );
        assert_eq!(engine.cache_stats().imports_opened, 0);

        // The endpoints go: the fd received is closed; the export's goes with its registration.
        drop(a);
        drop(b);
        assert_eq!(open_on(&marked), 1);
        drop(v);
        assert_eq!(open_on(&marked), 0);
        let _ = std::fs::remove_file(&marked);
    }

    #[test]
    fn pool_fds_cross_when_endpoints_meet_once_per_pool() {
        let engine = Engine::new(EngineConfig::local()).unwrap();
        let (file, marked) = marker("pool-export");
        // Export ids count up from below 2^63: u64::MAX is none of them.
        let pool = crate::transfer::export::export_any_fd(file.into(), FdOf::Pool, [7; 16]);
        let (vfile, vmarked) = marker("pool-export-vmm");
        let mapped = 2 << 20;
        let vmm = crate::transfer::export::export_any_fd(
            vfile.into(),
            FdOf::Vmm { len: mapped },
            [7; 16],
        );
        // Two allocations of the pool (another export data each) and a VMM allocation.
        let first = pool_desc(pool.id, 1, 0);
        let second = pool_desc(pool.id, 2, 8191);
        assert_eq!(open_on(&marked), 1);

        // A pool export described as VMM memory, a VMM export described as a pool, one on
        // another GPU: refused before connecting.
        let nowhere = socket("pool-nowhere");
        let other_gpu = MemoryDescriptor::with_ipc(
            0x7f00_0000_0000,
            4096,
            DescribedKind::Device,
            &[],
            IpcPart::pool_ptr(pool.id, [1; 64], 1 << 20, 0, [8; 16]),
        )
        .unwrap();
        for (d, what) in [
            (vmm_desc(pool.id, 1 << 20), "a pool as VMM memory"),
            (pool_desc(vmm.id, 1, 0), "a VMM export as a pool"),
            (pool_desc(u64::MAX, 1, 0), "a pool not held"),
            (other_gpu, "another GPU"),
        ] {
            let e = engine.connect_local(&nowhere, &[d]).unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument { arg: "publish", .. }),
                "{what}: {e}"
            );
        }

        // Published at the meeting: the pool's fd crosses once for both allocations, the VMM
        // one beside it.
        let (a, b, _l) = meet(
            &engine,
            "pool-meet",
            vec![first, vmm_desc(vmm.id, mapped), second],
        );
        assert_eq!(a.peer_descriptors()[0], first);
        assert_eq!(a.peer_descriptors()[2], second);
        assert_eq!(open_on(&marked), 2, "the exporter's and the one received");
        assert_eq!(open_on(&vmarked), 2);

        let region = engine
            .register(Buffer::host(vec![5u8; 4096]).unwrap())
            .unwrap();
        // Its fd came: both allocations get past the checks (to the refusal of a peer that is
        // this very process, before any CUDA call).
        for d in [first, second] {
            let e = a
                .write(vec![(region.all(), d.all())], TransferOptions::default())
                .unwrap_err();
            assert!(matches!(e, Error::Unsupported { .. }), "{e}");
        }
        // The pool's export described as VMM memory after the meeting, or a pool not
        // published then: refused, typed, before any CUDA call.
        let e = a
            .write(
                vec![(region.all(), vmm_desc(pool.id, 1 << 20).all())],
                TransferOptions::default(),
            )
            .unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "pairs", .. })
                && e.to_string().contains("a memory pool"),
            "{e}"
        );
        let e = a
            .write(
                vec![(region.all(), pool_desc(u64::MAX, 1, 0).all())],
                TransferOptions::default(),
            )
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("pool memory must be published when the endpoints meet"),
            "{e}"
        );
        assert_eq!(engine.cache_stats().imports_opened, 0);
        assert_eq!(engine.cache_stats().pool_imports_opened, 0);

        // The endpoints go: the fds received are closed; the exports' go with them.
        drop(a);
        drop(b);
        assert_eq!((open_on(&marked), open_on(&vmarked)), (1, 1));
        drop(pool);
        drop(vmm);
        assert_eq!((open_on(&marked), open_on(&vmarked)), (0, 0));
        let _ = std::fs::remove_file(&marked);
        let _ = std::fs::remove_file(&vmarked);
    }

    #[test]
    fn a_peer_flooding_unread_notifications_ends_the_endpoint_typed() {
        let engine = Engine::new(EngineConfig::local()).unwrap();
        let l = engine.listen_local(socket("flood")).unwrap();
        let path = l.path().to_path_buf();
        let peer = std::thread::spawn(move || {
            let mut s = greeted_peer(&path, 78);
            let mut frames = Vec::with_capacity(FRAME * 4096);
            for k in 0..4096u32 {
                frames.push(NOTE);
                frames.extend_from_slice(&k.to_le_bytes());
            }
            // One more than the bound, in batches; the endpoint may hang up first.
            for _ in 0..=(crate::transfer::MAX_UNREAD_NOTIFICATIONS / 4096) {
                if s.write_all(&frames).is_err() {
                    break;
                }
            }
        });
        let ep = l.accept(&[], Duration::from_secs(10)).unwrap();
        peer.join().unwrap();
        let t = std::time::Instant::now();
        while ep.failure().is_none() {
            assert!(t.elapsed() < Duration::from_secs(30), "never bounded");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            matches!(ep.failure(), Some(Error::InvalidArgument { .. })),
            "{:?}",
            ep.failure()
        );
    }

    /// A waker that calls its endpoint when first woken (a callback-style executor), then sends
    /// what the call answered.
    struct CallsBack {
        ep: Mutex<Option<crate::transfer::Endpoint>>,
        call: fn(&crate::transfer::Endpoint) -> bool,
        done: Mutex<std::sync::mpsc::Sender<bool>>,
    }

    impl CallsBack {
        /// A waker that makes `call` on `ep` when first woken, and where its answer arrives.
        fn waker(
            ep: &crate::transfer::Endpoint,
            call: fn(&crate::transfer::Endpoint) -> bool,
        ) -> (std::task::Waker, std::sync::mpsc::Receiver<bool>) {
            let (tx, rx) = std::sync::mpsc::channel();
            let w = std::task::Waker::from(Arc::new(CallsBack {
                ep: Mutex::new(Some(ep.clone())),
                call,
                done: Mutex::new(tx),
            }));
            (w, rx)
        }
    }

    impl std::task::Wake for CallsBack {
        fn wake(self: Arc<Self>) {
            if let Some(ep) = lock(&self.ep).take() {
                // The call takes the endpoint's locks: whoever wakes us must not hold them.
                let answer = (self.call)(&ep);
                let _ = lock(&self.done).send(answer);
            }
        }
    }

    /// A request queued after the endpoint closed (its worker gone) is ended at once, not
    /// left for a worker that will never look (found by a red-team read).
    #[test]
    fn a_request_queued_after_close_ends_at_once() {
        let (_l, _ep, _peer, side) = accepted_side("after-close", 84);
        let epoch = side.epoch.load(Ordering::Acquire);
        side.close();
        assert!(lock(&side.worker).is_none(), "the worker is gone");
        let (t, finish) = crate::transfer::pending::Transfer::pending(
            Duration::from_secs(30),
            Default::default(),
        );
        let job = Job::done_at_once(Box::new(finish), None, epoch);
        let back = side.push_job(0, job, false).expect("refused once closed");
        assert!(lock(&side.queue).is_empty());
        side.end_unqueued(back);
        let t0 = Instant::now();
        assert!(t.wait().is_err(), "ended with the endpoint's error");
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "at once, not at its limit"
        );
    }

    /// The next number of a xorshift sequence (test inputs).
    fn xorshift(x: &mut u32) -> u32 {
        *x ^= *x << 13;
        *x ^= *x >> 17;
        *x ^= *x << 5;
        *x
    }

    /// A request whose copies are done, queued on lane 0 without a call to the worker (as one
    /// a caller waits for blocking is): its transfer.
    fn queue_done(side: &super::super::side::Side) -> crate::transfer::pending::Transfer {
        let (t, finish) = crate::transfer::pending::Transfer::pending(
            Duration::from_secs(30),
            Default::default(),
        );
        let epoch = side.epoch.load(Ordering::Acquire);
        let job = Job::done_at_once(Box::new(finish), None, epoch);
        assert!(side.push_job(0, job, false).is_none());
        t
    }

    /// A request queued and finished by the worker, called for it: the worker lingers from
    /// when this returns.
    fn finished_by_the_worker(
        side: &super::super::side::Side,
    ) -> crate::transfer::pending::Transfer {
        let t = queue_done(side);
        side.call_worker();
        while !t.flag().is_complete() {
            std::hint::spin_loop();
        }
        t
    }

    /// `t` finishes within `limit` of `since` (looked at every `step`: `what` fails the test
    /// otherwise), then is waited for.
    fn finished_within(
        t: crate::transfer::pending::Transfer,
        since: Instant,
        limit: Duration,
        step: Duration,
        what: &str,
    ) {
        while !t.flag().is_complete() {
            assert!(since.elapsed() < limit, "{what}");
            std::thread::sleep(step);
        }
        t.wait().expect("finished");
    }

    /// A call to the worker is never lost, whether it lands while the worker lingers after
    /// its last request, as the linger ends, or while it sleeps: each request below (queued
    /// without waking the worker, as one a caller waits for is) is finished within 50 ms of
    /// its call, where a lost call would leave it to the worker's 100 ms idle look.
    #[test]
    fn a_call_to_the_worker_is_never_lost() {
        let (_l, _ep, _peer, side) = accepted_side("worker-calls", 85);
        // Gaps (µs) before each call: inside the 100 µs linger, around its end, past it.
        let mut x = 0x9e37_79b9_u32;
        for i in 0..120 {
            xorshift(&mut x);
            let gap = match i % 3 {
                0 => u64::from(x % 80),
                1 => 80 + u64::from(x % 60),
                _ => 140 + u64::from(x % 400),
            };
            std::thread::sleep(Duration::from_micros(gap));
            let t = queue_done(&side);
            side.call_worker();
            finished_within(
                t,
                Instant::now(),
                Duration::from_millis(50),
                Duration::from_micros(20),
                &format!("request {i} (gap {gap} µs) not finished 50 ms after the call"),
            );
        }
    }

    /// A failure and its move of the endpoint's epoch are seen together: the failure is marked
    /// first (whoever reads the moved epoch, a request being prepared, sees the failure) and
    /// the epoch moves under the same lock (whoever reads the failure, a waiter that then
    /// reconnects, reads the moved epoch). A test hook between the two, under the lock, starts
    /// a reader of the failure and lets it try for 50 ms. (Found by red-team reads: the epoch
    /// moved first; then, marked first, it moved after the lock was let go.)
    #[test]
    fn a_failure_and_its_epoch_move_are_seen_together() {
        use std::sync::mpsc::channel;
        let (_l, ep, _peer, side) = accepted_side("fail-order", 90);
        let before = side.epoch.load(Ordering::Acquire);
        let (tx, rx) = channel();
        let seen = ep.clone();
        *lock(&side.between_fail) = Some(Box::new(move |s| {
            let moved_now = s.epoch.load(Ordering::Acquire) != before;
            let (ep, me, tx) = (seen.clone(), s.me.upgrade().unwrap(), tx.clone());
            std::thread::spawn(move || {
                let failed = ep.failure().is_some();
                let moved = me.epoch.load(Ordering::Acquire) != before;
                tx.send((moved_now, failed, moved)).unwrap();
            });
            std::thread::sleep(Duration::from_millis(50));
        }));
        drop(side.fail_later(crate::transfer::request::Broken::Closed));
        drop(lock(&side.between_fail).take());
        let (moved_first, failed, moved) = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the reader ran");
        assert!(!moved_first, "the failure is marked before the epoch moves");
        assert!(failed, "the reader sees the failure");
        assert!(moved, "and, with it, the moved epoch");
    }

    /// A side that closed never reconnects: a close (here the membership's, for a peer that
    /// left) ends it for good, and a reconnect after it is refused with its cause, dialing
    /// nothing (found by a red-team read: it dialed, and started a fresh state, socket and
    /// reader on the closed side).
    #[test]
    fn a_closed_endpoint_does_not_reconnect() {
        let engine = Engine::new(EngineConfig::local()).unwrap();
        let l = engine.listen_local(socket("closed-redial")).unwrap();
        let path = l.path().to_path_buf();
        // The accepted endpoint is kept until the end: dropped at once, its close could end
        // `ep` first (the peer reset its socket), with that cause instead of the close's.
        let acc = std::thread::spawn(move || {
            (0..2)
                .map(|_| l.accept(&[], Duration::from_secs(2)))
                .collect::<Vec<_>>()
        });
        let ep = engine.connect_local(&path, &[]).unwrap();
        ep.peer_left("gone", "node-x");
        let e = ep.reconnect().unwrap_err();
        assert!(
            e.to_string().contains("gone"),
            "refused with its cause: {e}"
        );
        assert!(ep.failure().is_some(), "still ended");
        let accepted = acc.join().unwrap();
        assert_eq!(
            accepted.iter().map(Result::is_ok).collect::<Vec<_>>(),
            vec![true, false],
            "nothing dialed again"
        );
        let _ = std::fs::remove_file(&path);
    }

    /// A call (a failure's, a close's) made while the worker holds the queue's lock between its
    /// last look at the call flag and its sleep (held there by a test hook, which also queues a
    /// request without a call, as one queued during the linger is) wakes it: the request is
    /// finished at the call, not at the 100 ms idle look (found by a red-team read: a wake-up
    /// notified without the lock, and was lost there).
    #[test]
    fn a_call_held_at_the_worker_s_sleep_wakes_it() {
        use std::sync::mpsc::channel;
        let (_l, _ep, _peer, side) = accepted_side("call-held", 89);
        let (t, finish) = crate::transfer::pending::Transfer::pending(
            Duration::from_secs(30),
            Default::default(),
        );
        let epoch = side.epoch.load(Ordering::Acquire);
        let mut job = Some(Job::done_at_once(Box::new(finish), None, epoch));
        let (at_tx, at_rx) = channel::<()>();
        let (go_tx, go_rx) = channel::<()>();
        *lock(&side.before_sleep) = Some(Box::new(move |q| {
            if let Some(j) = job.take() {
                q.push(0, j);
                at_tx.send(()).unwrap();
                go_rx.recv_timeout(Duration::from_secs(10)).unwrap();
                // The call below has begun meanwhile.
                std::thread::sleep(Duration::from_millis(5));
            }
        }));
        // A request the worker finishes, so that it goes to sleep (and meets the hook) after.
        finished_by_the_worker(&side).wait().expect("finished");
        at_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the worker went to sleep");
        go_tx.send(()).unwrap();
        let r = Instant::now();
        side.call_worker();
        finished_within(
            t,
            r,
            Duration::from_millis(60),
            Duration::from_micros(50),
            "the call was lost: the request waits for the idle look",
        );
    }

    /// A close while the worker lingers does not wait for the worker's 100 ms idle look (found
    /// by a red-team read: `close` took 100.4 ms within about 700 tries).
    #[test]
    fn a_close_during_the_linger_is_prompt() {
        let mut x = 0x2545_f491_u32;
        let stop = Instant::now() + Duration::from_secs(3);
        for n in 0..1500 {
            if Instant::now() > stop {
                break;
            }
            xorshift(&mut x);
            let (_l, _ep, _peer, side) = accepted_side("close-linger", 88);
            let t = finished_by_the_worker(&side);
            let start = Instant::now();
            let off = Duration::from_nanos(u64::from(x % 120_000));
            while start.elapsed() < off {
                std::hint::spin_loop();
            }
            let c = Instant::now();
            side.close();
            let took = c.elapsed();
            assert!(
                took < Duration::from_millis(80),
                "try {n}: a close {off:?} into the linger took {took:?}"
            );
            t.wait().expect("finished");
        }
    }

    /// Queue on `lane` a request of the side's current epoch, its copies done at once or, with
    /// `waits`, once that is gathered; with `notify`, its deadline and timeout. Its transfer.
    fn queue_request(
        side: &Side,
        lane: usize,
        waits: Option<&Arc<super::super::copies::Events>>,
        notify: Option<u32>,
        deadline: Instant,
        timeout: Duration,
    ) -> Transfer {
        let (t, finish) = Transfer::pending(timeout, Default::default());
        let epoch = side.epoch.load(Ordering::Acquire);
        let mut j = Job::done_at_once(Box::new(finish), notify, epoch);
        if let Some(w) = waits {
            j.fence = w.clone();
        }
        j.deadline = deadline;
        j.timeout = timeout;
        lock(&side.queue).push(lane, j);
        t
    }

    /// A notified request held behind a reserved place (a prepared run's, in progress) whose
    /// deadline passes: the worker fails the endpoint once and waits, rather than spinning
    /// and failing it again and again (found by a red-team read: 1,929 failures in 200 ms).
    #[test]
    fn a_held_late_request_ends_the_endpoint_once() {
        let (_l, _ep, _peer, side) = accepted_side("rt-held-late", 83);
        // As `run` does with a notification: a place reserved, held while it synchronizes.
        let seq = lock(&side.queue).reserve();
        let epoch = side.epoch.load(Ordering::Acquire);
        // Its copies not done (a done one is not late: see the test below).
        let waits = Arc::new(super::super::copies::Events::later());
        let t = queue_request(
            &side,
            1,
            Some(&waits),
            Some(9),
            Instant::now() + Duration::from_millis(5),
            Duration::from_millis(5),
        );
        side.call_worker();
        std::thread::sleep(Duration::from_millis(200));
        let bumps = side.epoch.load(Ordering::Acquire) - epoch;
        lock(&side.queue).release(seq);
        waits.gathered(Ok(None));
        let r = t.wait();
        assert!(r.is_err(), "ended with the endpoint");
        assert!(
            bumps <= 2,
            "the worker failed the endpoint {bumps} times (spinning)"
        );
    }

    /// The same request with its copies done: not late while it is held, it finishes once the
    /// place is released, its notification sent (the endpoint goes on).
    #[test]
    fn a_held_done_request_finishes_once_released() {
        let (_l, ep, _peer, side) = accepted_side("rt-held-done", 80);
        let seq = lock(&side.queue).reserve();
        let epoch = side.epoch.load(Ordering::Acquire);
        // Past its deadline, within a timeout of it.
        let t = queue_request(
            &side,
            1,
            None,
            Some(9),
            Instant::now(),
            Duration::from_secs(10),
        );
        side.call_worker();
        std::thread::sleep(Duration::from_millis(60));
        let (ended, held) = (ep.failure().is_some(), !t.flag().is_complete());
        // Released before any assertion: a close with the place held would wait for it.
        lock(&side.queue).release(seq);
        assert!(!ended, "ended while held, done");
        assert!(held, "held behind the reserved place");
        side.call_worker();
        let r = t.wait().expect("finished once released");
        assert_eq!(r.notified, Some(9));
        assert_eq!(side.epoch.load(Ordering::Acquire), epoch);
    }

    /// Lane 0's first request, its copies waiting (a gather launch not yet gone) until the
    /// fence returned is gathered; its deadline 30 s away. The fence and its transfer.
    fn unfinished_first(side: &Side) -> (Arc<super::super::copies::Events>, Transfer) {
        let waits = Arc::new(super::super::copies::Events::later());
        let t = Duration::from_secs(30);
        let first = queue_request(side, 0, Some(&waits), None, Instant::now() + t, t);
        (waits, first)
    }

    /// A request whose copies are done, its deadline passed while it waits behind its lane's
    /// unfinished first request, is not late: the worker does not end the endpoint, and it
    /// finishes in its turn (found by a red-team read: the worker's late scan ended the endpoint
    /// for a request it had just seen done).
    #[test]
    fn a_done_request_behind_an_unfinished_one_is_not_late() {
        let (_l, ep, _peer, side) = accepted_side("done-not-late", 81);
        let epoch = side.epoch.load(Ordering::Acquire);
        let (waits, first) = unfinished_first(&side);
        // Behind it: done at once, its deadline already passed (its timeout long: it may wait
        // that much longer before it counts as late, see the test below).
        let now = Instant::now();
        let second = queue_request(&side, 0, None, None, now, Duration::from_secs(10));
        side.call_worker();
        // The worker looks every 5 ms while the first waits.
        std::thread::sleep(Duration::from_millis(60));
        assert!(ep.failure().is_none(), "the endpoint was ended");
        assert_eq!(side.epoch.load(Ordering::Acquire), epoch);
        waits.gathered(Ok(None));
        first.wait().expect("the first finished");
        second.wait().expect("the second finished, not late");
    }

    /// The same done request held a timeout past its deadline behind an unfinished first one
    /// ends the endpoint: held longer, its waiter's bound would pass first (reporting a
    /// failure) and the request be finished after, its notification sent (found by a red-team
    /// read of the test above's fix).
    #[test]
    fn a_done_request_held_a_timeout_past_its_deadline_is_late() {
        let (_l, ep, _peer, side) = accepted_side("done-held-late", 78);
        let (waits, first) = unfinished_first(&side);
        let now = Instant::now();
        let second = queue_request(&side, 0, None, Some(3), now, Duration::from_millis(20));
        side.call_worker();
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            ep.failure().is_some(),
            "not ended a timeout past the deadline"
        );
        waits.gathered(Ok(None));
        assert!(
            first.wait().is_err() && second.wait().is_err(),
            "both ended"
        );
    }

    #[test]
    fn a_request_finished_at_the_head_wakes_its_waker_with_finishing_let_go() {
        use std::sync::atomic::AtomicU32;
        use std::task::{Wake, Waker};
        // Counts wake-ups that found `finishing` free: a waker that drops the last clone of the
        // endpoint inline joins the worker, which may be waiting for it (held, both waited).
        struct Probe(Arc<Side>, AtomicU32, AtomicU32);
        impl Wake for Probe {
            fn wake(self: Arc<Self>) {
                self.wake_by_ref()
            }
            fn wake_by_ref(self: &Arc<Self>) {
                self.1.fetch_add(1, Ordering::SeqCst);
                if self.0.finishing.try_lock().is_ok() {
                    self.2.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
        let (_l, ep, _peer, side) = accepted_side("finishing-let-go", 82);
        // The worker stopped: the request is finished here, by a waiting caller's look, and
        // nobody else takes `finishing`.
        lock(&side.queue).closing = true;
        side.call_worker();
        lock(&side.worker).take().unwrap().join().unwrap();
        let probe = Arc::new(Probe(side.clone(), AtomicU32::new(0), AtomicU32::new(0)));
        let push = |finish, notify: Option<u32>| {
            let epoch = side.epoch.load(Ordering::Acquire);
            lock(&side.queue).push(0, Job::done_at_once(Box::new(finish), notify, epoch));
        };
        let counts = || {
            (
                probe.1.load(Ordering::SeqCst),
                probe.2.load(Ordering::SeqCst),
            )
        };
        let mut ts = Vec::new();
        for _ in 0..2 {
            let (t, finish) = Transfer::pending(Duration::from_secs(30), Default::default());
            assert!(t.flag().register_waker(&Waker::from(probe.clone())));
            push(finish, None);
            ts.push(t);
        }
        side.lanes()[0].help();
        for t in ts {
            assert_eq!(t.wait().unwrap().bytes, 8);
        }
        assert_eq!(counts(), (2, 2), "woken once each, `finishing` free");
        // Its notification cannot be sent (the socket's sending side shut): the endpoint fails
        // while `finishing` is held. The request's waker and a notification waiter's run once
        // it is let go.
        let (t, finish) = Transfer::pending(Duration::from_secs(30), Default::default());
        assert!(t.flag().register_waker(&Waker::from(probe.clone())));
        let mut note = Box::pin(ep.notification(Duration::from_secs(30)));
        let w = Waker::from(probe.clone());
        let mut cx = std::task::Context::from_waker(&w);
        assert!(note.as_mut().poll(&mut cx).is_pending());
        {
            let c = lock(&side.conn);
            let c = c.as_ref().unwrap();
            c.stream.shutdown(std::net::Shutdown::Write).unwrap();
        }
        push(finish, Some(7));
        side.lanes()[0].help();
        assert!(t.wait().is_err());
        assert!(ep.failure().is_some());
        assert_eq!(
            counts(),
            (4, 4),
            "the request's and the notification waiter's, `finishing` free"
        );
        assert!(note.as_mut().poll(&mut cx).is_ready());
    }

    #[test]
    fn a_waker_that_reconnects_runs_after_the_reconnect_that_woke_it() {
        use std::future::Future;
        use std::task::Context;
        let engine = Engine::new(EngineConfig::local()).unwrap();
        let l = engine.listen_local(socket("reconnects")).unwrap();
        let path = l.path().to_path_buf();
        // The first meeting, ours, the waker's.
        let acc = std::thread::spawn(move || {
            (0..3)
                .map(|_| l.accept(&[], Duration::from_secs(30)))
                .collect::<Vec<_>>()
        });
        let ep = engine.connect_local(&path, &[]).unwrap();
        let mut f = Box::pin(ep.notification(Duration::from_secs(60)));
        let (w, rx) = CallsBack::waker(&ep, |ep| ep.reconnect().is_ok());
        assert!(f.as_mut().poll(&mut Context::from_waker(&w)).is_pending());
        // Our reconnect ends the endpoint first: the waiting future's waker runs.
        let ours = ep.clone();
        let h = std::thread::spawn(move || ours.reconnect());
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(ok) => assert!(ok, "the waker's reconnect failed"),
            Err(_) => {
                // Dropping them would wait for the stuck thread.
                std::mem::forget((f, ep, h));
                panic!("the waker's reconnect never ended: it waited for the reconnect lock");
            }
        }
        h.join().unwrap().unwrap();
        let met = acc.join().unwrap();
        assert!(met.iter().all(Result::is_ok), "three meetings");
        assert!(ep.failure().is_none(), "connected again");
    }

    #[test]
    fn a_waker_that_calls_the_endpoint_is_run_after_the_lock_is_let_go() {
        use std::future::Future;
        use std::task::{Context, Poll};
        let engine = Engine::new(EngineConfig::local()).unwrap();
        let l = engine.listen_local(socket("calls-back")).unwrap();
        let path = l.path().to_path_buf();
        let (go, go_rx) = std::sync::mpsc::channel::<()>();
        let peer = std::thread::spawn(move || {
            let mut s = greeted_peer(&path, 81);
            go_rx.recv().unwrap();
            let mut f = vec![NOTE];
            f.extend_from_slice(&0x5eed_u32.to_le_bytes());
            s.write_all(&f).unwrap();
            // Hang up when told: the endpoint fails.
            let _ = go_rx.recv();
        });
        let ep = l.accept(&[], Duration::from_secs(10)).unwrap();
        let waker = |ep| {
            CallsBack::waker(ep, |ep| {
                let _ = ep.failure();
                let _ = ep.peer_descriptors();
                true
            })
        };
        // A notification arrives (the reader delivers it): the future's waker calls the endpoint.
        let mut f = Box::pin(ep.notification(Duration::from_secs(30)));
        let (w, woke) = waker(&ep);
        assert!(f.as_mut().poll(&mut Context::from_waker(&w)).is_pending());
        go.send(()).unwrap();
        if woke.recv_timeout(Duration::from_secs(20)).is_err() {
            // Dropping them would join the stuck thread.
            std::mem::forget((f, ep));
            panic!("the waker never ran to its end: it waited for the lock its caller held");
        }
        match f.as_mut().poll(&mut Context::from_waker(&w)) {
            Poll::Ready(Ok(Some(n))) => assert_eq!(n.tag, 0x5eed),
            other => panic!("{other:?}"),
        }
        // The peer hangs up (the endpoint fails): the same.
        let mut f = Box::pin(ep.notification(Duration::from_secs(30)));
        let (w, woke) = waker(&ep);
        assert!(f.as_mut().poll(&mut Context::from_waker(&w)).is_pending());
        drop(go);
        if woke.recv_timeout(Duration::from_secs(20)).is_err() {
            std::mem::forget((f, ep));
            panic!("after the failure, the waker never ran to its end");
        }
        assert!(matches!(
            f.as_mut().poll(&mut Context::from_waker(&w)),
            Poll::Ready(Err(_))
        ));
        peer.join().unwrap();
    }

    #[test]
    fn a_peer_sending_garbage_ends_the_endpoint_typed() {
        let engine = Engine::new(EngineConfig::local()).unwrap();
        let l = engine.listen_local(socket("garbage")).unwrap();
        let path = l.path().to_path_buf();
        let peer = std::thread::spawn(move || {
            let mut s = greeted_peer(&path, 77);
            s.write_all(&[9, 0, 0, 0, 0]).unwrap();
            std::thread::sleep(Duration::from_millis(200));
        });
        let ep = l.accept(&[], Duration::from_secs(10)).unwrap();
        let e = ep.next_notification(Duration::from_secs(10)).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "peer", .. }),
            "{e}"
        );
        peer.join().unwrap();
        // A first message that is not one: refused at accept.
        let path = l.path().to_path_buf();
        let peer = std::thread::spawn(move || {
            let mut s = UnixStream::connect(&path).unwrap();
            greet_bare(&mut s);
            send_msg(&mut s, b"definitely not a first message").unwrap();
        });
        let e = l.accept(&[], Duration::from_secs(10)).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidArgument {
                    arg: "hello.magic",
                    ..
                }
            ),
            "{e}"
        );
        peer.join().unwrap();
        // A length past the bound: refused before anything is allocated.
        let path = l.path().to_path_buf();
        let peer = std::thread::spawn(move || {
            let mut s = UnixStream::connect(&path).unwrap();
            s.write_all(&u32::MAX.to_le_bytes()).unwrap();
        });
        let e = l.accept(&[], Duration::from_secs(10)).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "peer", .. }),
            "{e}"
        );
        peer.join().unwrap();
    }

    #[test]
    fn a_peer_reading_our_first_message_slowly_does_not_stretch_the_meeting() {
        let engine = Engine::new(EngineConfig::local()).unwrap();
        let l = engine.listen_local(socket("slow-reader")).unwrap();
        let path = l.path().to_path_buf();
        // About 3.6 MB to publish: far more than a socket buffer holds.
        let publish = descs(30_000);
        let stop = Arc::new(AtomicBool::new(false));
        let halt = stop.clone();
        let peer = std::thread::spawn(move || {
            let mut s = UnixStream::connect(&path).unwrap();
            greet_bare(&mut s);
            let h = LocalHello {
                pid: 4242,
                descriptors: Vec::new(),
            }
            .encode()
            .unwrap();
            send_msg(&mut s, &h).unwrap();
            // Reads a little, often enough that no single send waits a whole timeout.
            let mut buf = vec![0u8; 128 << 10];
            let t = Instant::now();
            while !halt.load(Ordering::Acquire) && t.elapsed() < Duration::from_secs(8) {
                std::thread::sleep(Duration::from_millis(300));
                if matches!(s.read(&mut buf), Ok(0) | Err(_)) {
                    break;
                }
            }
        });
        let t = Instant::now();
        let r = l.accept(&publish, Duration::from_secs(1));
        let took = t.elapsed();
        stop.store(true, Ordering::Release);
        peer.join().unwrap();
        let e = r.unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(took < Duration::from_millis(2500), "{took:?}");
    }
}
