//! Intra-node endpoints: two processes on one node meet over a Unix domain socket and move GPU
//! memory with CUDA IPC and stream-ordered copies, not through a NIC.
//!
//! Each side sends a first message (magic, version, its pid, the descriptors it publishes), then
//! the file descriptors of the VMM allocations and memory pools those descriptors name
//! (`SCM_RIGHTS`, at most [`MAX_FDS_PER_MSG`] a message, each message listing their export ids),
//! and checks the peer's: the same deadline bounds it all, and a peer that sends fewer, more or
//! other file descriptors than its descriptors name (each export once) is refused (every one
//! received closed). A request maps each remote range's allocation from its descriptor's
//! [`IpcPart`](super::IpcPart): `cuIpcOpenMemHandle` of its handle; for VMM memory
//! `cuMemImportFromShareableHandle` of the file descriptor that came when the endpoints met
//! (once per allocation and local GPU, shared process-wide); for pool memory
//! `cuMemPoolImportFromShareableHandle` of the pool's file descriptor that came then (once per
//! pool, on the GPU holding it, with `cuMemPoolSetAccess` for each local GPU that copies) and
//! `cuMemPoolImportPointer` of the allocation's export data (once per allocation; freed before
//! its pool goes). It checks the range against the allocation length the peer claims and the
//! mapping's real size, and queues `cuMemcpyAsync` on the endpoint's stream(s) of the local
//! memory's GPU, then takes an epoch of each stream's completion timeline (no driver call: an
//! event is recorded only when someone looks, covering every request queued before, and events
//! are recycled). Requests finish in request order, each only once its epochs complete, and
//! only then is its notification sent over the socket, so the peer sees a notification only
//! once its bytes are in its memory. A caller blocked in [`Transfer::wait`] finishes what is done
//! itself; a worker thread does it for requests with a notification, and for the others once
//! they are polled, awaited, made an `InFlight` or dropped unfinished, or at its next look
//! (at least every 100 ms), so that a waiting caller is not slowed by the worker's wake-up and
//! queries beside its own copies. A reader thread
//! delivers the peer's notifications and ends the endpoint when the socket closes.

use super::descriptor::{IpcKind, IpcPart};
use super::descriptor::{MAX_DESCRIPTORS, MemoryDescriptor, RemoteRange, decode_list, encode_list};
use super::engine::Engine;
use super::ipc::{
    Import, import, import_pool, import_pool_ptr, import_vmm, link, ordinal_of_uuid, published,
};
use super::pending::{Finisher, Settled, Transfer};
use super::region::{ExportFd, FdOf, LocalRange, MemoryPath, Region};
use super::request::{
    Broken, Direction, MAX_UNREAD_NOTIFICATIONS, Notification, TransferOptions, TransferReport,
    check_pairs, check_same_engine, pairs_bytes, unread_overflow,
};
use super::shared::{EpInner, Mailbox, Wakes};
use super::wire::{MAX_HELLO, header};
use crate::completion::deferred::{Defers, Locked};
use crate::completion::{
    CompletionFlag, EventFence, Fence, StreamFence, Tracker, capture, deadline_after,
    thread::join_unless_current,
};
use crate::cuda::Stream;
use crate::error::{Error, Result};
use crate::p2p::{MAX_FDS_PER_MSG, recv_fds, send_fds};
use std::collections::{HashMap, VecDeque};
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const MAGIC: [u8; 4] = *b"GDXL";
/// Version 2: exported file descriptors (VMM allocations', pools') follow the first message.
const VERSION: u16 = 2;
/// A message of exported file descriptors: `GDXF`, the count (u32), one export id (u64) per
/// descriptor, in the order of the `SCM_RIGHTS` descriptors it carries.
const FD_MAGIC: [u8; 4] = *b"GDXF";
const FD_HEAD: usize = 4 + 4;
/// Magic, version, flags (u16, 0), pid (u32).
const FIXED: usize = 4 + 2 + 2 + 4;
/// A message after the first: kind (u8), tag (u32).
const FRAME: usize = 5;
/// Frame kind: a notification.
const NOTE: u8 = 1;
/// The longest a waiting worker sleeps before it looks at deadlines and failures again.
const SLICE: Duration = Duration::from_millis(5);

/// The first message of an intra-node endpoint, each way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LocalHello {
    /// The sender's process id (as it sees itself). Only reported: what the library decides by
    /// (imports, the same-process refusal) uses the pid `SO_PEERCRED` gives.
    pub(crate) pid: u32,
    pub(crate) descriptors: Vec<MemoryDescriptor>,
}

impl LocalHello {
    pub(crate) fn encode(&self) -> Result<Vec<u8>> {
        let list = encode_list(&self.descriptors)?;
        let mut b = Vec::with_capacity(FIXED + list.len());
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&0u16.to_le_bytes());
        b.extend_from_slice(&self.pid.to_le_bytes());
        b.extend_from_slice(&list);
        Ok(b)
    }

    /// Decode a peer's first message; every field is checked.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the field.
    pub(crate) fn decode(b: &[u8]) -> Result<LocalHello> {
        let bad = |arg: &'static str, v: String, rule: &str| Err(Error::invalid(arg, v, rule));
        let h = header(b, FIXED, MAGIC, VERSION)?;
        let flags = u16::from_le_bytes([h[6], h[7]]);
        if flags != 0 {
            return bad("hello.flags", flags.to_string(), "no flags are defined");
        }
        let pid = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes"));
        if pid == 0 {
            return bad("hello.pid", "0".into(), "a process id is not 0");
        }
        let descriptors = decode_list(&b[FIXED..])?;
        Ok(LocalHello { pid, descriptors })
    }
}

fn os(call: &'static str, e: std::io::Error) -> Error {
    Error::Os { call, source: e }
}

/// One `send(MSG_NOSIGNAL | flags)` of some of `b` (retried when interrupted): the bytes
/// taken. A peer that is gone gives `EPIPE`, never the signal that would end the process.
fn send_some(s: &UnixStream, b: &[u8], flags: libc::c_int) -> std::io::Result<usize> {
    loop {
        // SAFETY: `b` is valid for `b.len()` bytes; the fd is the live socket's.
        let n = unsafe {
            libc::send(
                s.as_raw_fd(),
                b.as_ptr().cast(),
                b.len(),
                libc::MSG_NOSIGNAL | flags,
            )
        };
        if n >= 0 {
            // 0 <= n <= b.len().
            return Ok(n as usize);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Write all of `b` (the socket's send timeout bounds each wait for room).
fn send_all(s: &UnixStream, mut b: &[u8]) -> std::io::Result<()> {
    while !b.is_empty() {
        b = &b[send_some(s, b, 0)?..];
    }
    Ok(())
}

/// Whether `e` is a send or receive timeout passing.
fn timed_out(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// The send timeout set to what is left before `end` (at least 1 ms): `false` when nothing is.
fn send_bound(s: &UnixStream, end: Instant) -> Result<bool> {
    let left = end.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Ok(false);
    }
    s.set_write_timeout(Some(left.max(Duration::from_millis(1))))
        .map_err(|e| os("setsockopt (the local endpoint's Unix socket)", e))?;
    Ok(true)
}

/// The meeting's deadline passed while the peer was to read what this side sends.
fn send_late(timeout: Duration) -> Error {
    Error::Timeout {
        what: "the peer to read this side's first message and file descriptors",
        after: timeout,
    }
}

/// Write all of `b` by `end` (`timeout` is what the meeting was given, for the error): sends
/// that do not wait, and `poll` for room with what is left. (A send timeout bounds each wait for
/// room, not the call: a peer that reads a little now and then would stretch the meeting past
/// its deadline.)
fn send_all_by(s: &UnixStream, mut b: &[u8], end: Instant, timeout: Duration) -> Result<()> {
    while !b.is_empty() {
        match send_some(s, b, libc::MSG_DONTWAIT) {
            Ok(n) => {
                b = &b[n..];
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(os("send (the local endpoint's Unix socket)", e)),
        }
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(send_late(timeout));
        }
        let mut p = libc::pollfd {
            fd: s.as_raw_fd(),
            events: libc::POLLOUT,
            revents: 0,
        };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd for the call. An error (EINTR) or a hang-up only leads to
        // the next send, which tells.
        unsafe { libc::poll(&mut p, 1, ms) };
    }
    Ok(())
}

/// Send one length-prefixed message (tests: bounded by a minute).
#[cfg(test)]
fn send_msg(s: &mut UnixStream, b: &[u8]) -> Result<()> {
    let t = Duration::from_secs(60);
    send_msg_by(s, b, deadline_after(Instant::now(), t), t)
}

/// Send one length-prefixed message by `end` (`timeout` is what the meeting was given, for the
/// error).
fn send_msg_by(s: &mut UnixStream, b: &[u8], end: Instant, timeout: Duration) -> Result<()> {
    let n = u32::try_from(b.len())
        .ok()
        .filter(|&n| u64::from(n) <= MAX_HELLO)
        .ok_or_else(|| {
            Error::invalid(
                "publish",
                format!("{} bytes", b.len()),
                format!("a first message is at most {MAX_HELLO} bytes"),
            )
        })?;
    send_all_by(s, &n.to_le_bytes(), end, timeout)?;
    send_all_by(s, b, end, timeout)
}

/// Receive one length-prefixed message of at most [`MAX_HELLO`] bytes (the peer's word,
/// checked before anything is allocated).
#[cfg(test)]
fn recv_msg(s: &mut UnixStream, timeout: Duration) -> Result<Vec<u8>> {
    recv_msg_by(s, deadline_after(Instant::now(), timeout), timeout)
}

/// [`recv_msg`] by `end` (`timeout` is what the meeting was given, for the error).
fn recv_msg_by(s: &mut UnixStream, end: Instant, timeout: Duration) -> Result<Vec<u8>> {
    let mut n = [0u8; 4];
    read_by(s, &mut n, end, timeout)?;
    let n = u32::from_le_bytes(n);
    if u64::from(n) > MAX_HELLO {
        return Err(Error::invalid(
            "peer",
            n,
            format!("a first message is at most {MAX_HELLO} bytes"),
        ));
    }
    let mut b = vec![0u8; n as usize];
    read_by(s, &mut b, end, timeout)?;
    Ok(b)
}

/// Fill `buf` by `end`, however the peer spaces its bytes (a read timeout alone bounds each
/// read, not the message).
fn read_by(s: &mut UnixStream, buf: &mut [u8], end: Instant, timeout: Duration) -> Result<()> {
    let late = || Error::Timeout {
        what: "the peer's first message",
        after: timeout,
    };
    let mut at = 0;
    while at < buf.len() {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(late());
        }
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .map_err(|e| os("setsockopt (the local endpoint's Unix socket)", e))?;
        match s.read(&mut buf[at..]) {
            Ok(0) => {
                return Err(os(
                    "recv (the local endpoint's Unix socket)",
                    std::io::ErrorKind::UnexpectedEof.into(),
                ));
            }
            Ok(k) => at += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(late());
            }
            Err(e) => return Err(os("recv (the local endpoint's Unix socket)", e)),
        }
    }
    Ok(())
}

/// A file descriptor the peer sent when the endpoints met (a VMM allocation's or a pool's), and
/// what its descriptors say it is (every later descriptor naming it must say the same).
#[derive(Debug, Clone)]
pub(super) struct PeerFd {
    fd: Arc<OwnedFd>,
    of: FdOf,
    uuid: [u8; 16],
}

/// The exported file descriptor an IPC part needs (VMM memory, pool memory), and what the part
/// says it is; `None` for a `cuIpc` handle.
fn fd_said(p: &IpcPart) -> Option<(u64, FdOf)> {
    match *p.kind() {
        IpcKind::VmmFd { export_id } => Some((export_id, FdOf::Vmm { len: p.alloc_len() })),
        IpcKind::PoolPtr { pool_export_id, .. } => Some((pool_export_id, FdOf::Pool)),
        _ => None,
    }
}

/// What an exported file descriptor is, in words.
fn what(of: FdOf) -> String {
    match of {
        FdOf::Vmm { len } => format!("a VMM allocation mapping {len} bytes"),
        FdOf::Pool => "a memory pool".into(),
    }
}

/// The peer's exported file descriptors, by export id, and its pid as the kernel gives it
/// (`SO_PEERCRED`, not the peer's word): what its imports are cached by.
#[derive(Debug)]
pub(super) struct PeerFds {
    pid: u32,
    by_id: HashMap<u64, PeerFd>,
}

/// `getsockopt(SO_PEERCRED)`: the pid of the process at the other end of `s` (when it
/// connected, or listened), in this process's pid namespace. A peer outside that namespace reads
/// as pid 0 for every such peer: it gets a key of its own instead (at or above 2^31, past any
/// pid), so two of them never share imports.
#[doc(alias = "SO_PEERCRED")]
fn peer_process(s: &UnixStream) -> Result<u32> {
    static UNSEEN: AtomicU64 = AtomicU64::new(0);
    let pid = kernel_pid(s)?;
    if pid != 0 {
        return Ok(pid);
    }
    let n = UNSEEN.fetch_add(1, Ordering::Relaxed) % (1 << 31);
    Ok((1u32 << 31) | n as u32)
}

/// `getsockopt(SO_PEERCRED)`'s pid (0 for a process outside this pid namespace).
fn kernel_pid(s: &UnixStream) -> Result<u32> {
    // SAFETY: all-zero is a valid ucred.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid out-pointers of the sizes given; the fd is the live
    // socket's.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(os(
            "getsockopt(SO_PEERCRED) (the local endpoint's Unix socket)",
            std::io::Error::last_os_error(),
        ));
    }
    // A pid is positive.
    Ok(cred.pid.max(0) as u32)
}

/// The file descriptor exports of this process (VMM allocations, pools) that `publish` names,
/// once each, in the order first named; each must be alive and described as it is (what it
/// is, for VMM memory its length, and its GPU).
///
/// # Errors
///
/// [`Error::InvalidArgument`] (`publish`) naming the descriptor.
fn outgoing(publish: &[MemoryDescriptor]) -> Result<Vec<Arc<ExportFd>>> {
    let mut out: Vec<Arc<ExportFd>> = Vec::new();
    let mut seen: HashMap<u64, usize> = HashMap::new();
    for (i, d) in publish.iter().enumerate() {
        let Some(p) = d.ipc() else { continue };
        let Some((id, of)) = fd_said(p) else { continue };
        let v = match seen.get(&id) {
            Some(&k) => out[k].clone(),
            None => {
                let v = published(id).ok_or_else(|| {
                    Error::invalid(
                        "publish",
                        i,
                        format!(
                            "descriptor {i} names the file descriptor export {id} (VMM or \
                             pool), which this process does not hold: its region was dropped, \
                             or the descriptor is another process's"
                        ),
                    )
                })?;
                seen.insert(id, out.len());
                out.push(v.clone());
                v
            }
        };
        if v.of != of || v.uuid != *p.gpu_uuid() {
            return Err(Error::invalid(
                "publish",
                i,
                format!(
                    "descriptor {i} says the export {id} is {}; it is {} (or another GPU's)",
                    what(of),
                    what(v.of)
                ),
            ));
        }
    }
    Ok(out)
}

/// The file descriptor export ids the peer's descriptors name (VMM allocations, pools), once
/// each, in the order first named, with what they say each is and its GPU; descriptors naming
/// one id must agree (a VMM export and a pool export never share one).
///
/// # Errors
///
/// [`Error::InvalidArgument`] (`peer`) naming the descriptor that disagrees.
fn expected(descs: &[MemoryDescriptor]) -> Result<Vec<(u64, FdOf, [u8; 16])>> {
    let mut out: Vec<(u64, FdOf, [u8; 16])> = Vec::new();
    let mut seen: HashMap<u64, usize> = HashMap::new();
    for (i, d) in descs.iter().enumerate() {
        let Some(p) = d.ipc() else { continue };
        let Some((id, of)) = fd_said(p) else { continue };
        let said = (id, of, *p.gpu_uuid());
        match seen.get(&id) {
            Some(&k) if out[k] != said => {
                return Err(Error::invalid(
                    "peer",
                    i,
                    format!(
                        "descriptor {i} names the export {id} as {} on another GPU, or as \
                         another kind or length than an earlier descriptor ({})",
                        what(of),
                        what(out[k].1)
                    ),
                ));
            }
            Some(_) => {}
            None => {
                seen.insert(id, out.len());
                out.push(said);
            }
        }
    }
    Ok(out)
}

/// Send the exported file descriptors `fds`, at most [`MAX_FDS_PER_MSG`] a message, each
/// message listing their export ids, by `end` (`timeout` is what the meeting was given, for the
/// error). The send timeout is what is left before each message: a message whose payload the
/// kernel takes in two parts may wait that long once more.
fn send_export_fds(
    s: &UnixStream,
    fds: &[Arc<ExportFd>],
    end: Instant,
    timeout: Duration,
) -> Result<()> {
    for batch in fds.chunks(MAX_FDS_PER_MSG) {
        let mut b = Vec::with_capacity(FD_HEAD + 8 * batch.len());
        b.extend_from_slice(&FD_MAGIC);
        // At most MAX_FDS_PER_MSG: fits u32.
        b.extend_from_slice(&(batch.len() as u32).to_le_bytes());
        for v in batch {
            b.extend_from_slice(&v.id.to_le_bytes());
        }
        let raw: Vec<BorrowedFd<'_>> = batch.iter().map(|v| v.fd.as_fd()).collect();
        if !send_bound(s, end)? {
            return Err(send_late(timeout));
        }
        send_fds(s, &raw, &b).map_err(|e| {
            if timed_out(&e) {
                send_late(timeout)
            } else {
                os("sendmsg (the local endpoint's Unix socket)", e)
            }
        })?;
    }
    Ok(())
}

/// Receive the peer's exported file descriptors for `want` (export id, what it is, GPU; in
/// order) by `end`. Every descriptor received is closed again when the peer is refused.
///
/// # Errors
///
/// [`Error::Timeout`] when they do not all come by `end`; [`Error::InvalidArgument`] (`peer`)
/// for a message that is not one of them, more or fewer descriptors than it lists, or an id the
/// peer's descriptors do not name there; [`Error::Os`] from `recvmsg`, or the peer's close.
fn recv_export_fds(
    s: &mut UnixStream,
    want: &[(u64, FdOf, [u8; 16])],
    end: Instant,
    timeout: Duration,
) -> Result<PeerFds> {
    let refuse = |why: String| Error::invalid("peer", "its exported file descriptors", why);
    let mut out = PeerFds {
        pid: peer_process(s)?,
        by_id: HashMap::with_capacity(want.len()),
    };
    let mut buf = vec![0u8; FD_HEAD + 8 * MAX_FDS_PER_MSG];
    let mut at = 0;
    while at < want.len() {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout {
                what: "the peer's exported file descriptors (VMM, pool)",
                after: timeout,
            });
        }
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .map_err(|e| os("setsockopt (the local endpoint's Unix socket)", e))?;
        // Room for one more than a message may carry: a peer that sends more is seen doing it.
        let r = match recv_fds(s, &mut buf, MAX_FDS_PER_MSG + 1) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(Error::Timeout {
                    what: "the peer's exported file descriptors (VMM, pool)",
                    after: timeout,
                });
            }
            Err(e) => return Err(os("recvmsg (the local endpoint's Unix socket)", e)),
        };
        // From here every descriptor that came is owned by `r.fds`: closed on any refusal.
        if r.len == 0 {
            return Err(os(
                "recvmsg (the local endpoint's Unix socket)",
                std::io::ErrorKind::UnexpectedEof.into(),
            ));
        }
        if r.truncated {
            return Err(refuse(format!(
                "more file descriptors than a message carries ({MAX_FDS_PER_MSG}), or than this \
                 process may open"
            )));
        }
        let mut n = r.len;
        if n < FD_HEAD {
            read_by(s, &mut buf[n..FD_HEAD], end, timeout)?;
            n = FD_HEAD;
        }
        if buf[..4] != FD_MAGIC {
            return Err(refuse(format!(
                "a message starting {:02x?} where its exported file descriptors (GDXF) were due",
                &buf[..4]
            )));
        }
        let count = u32::from_le_bytes(buf[4..8].try_into().expect("4 bytes")) as usize;
        let due = (want.len() - at).min(MAX_FDS_PER_MSG);
        if count == 0 || count > due {
            return Err(refuse(format!(
                "a message listing {count} file descriptors where at most {due} were due"
            )));
        }
        let total = FD_HEAD + 8 * count;
        if n > total {
            return Err(refuse(format!(
                "{n} bytes in a message of {count} file descriptors ({total} bytes)"
            )));
        }
        if n < total {
            read_by(s, &mut buf[n..total], end, timeout)?;
        }
        if r.fds.len() != count {
            return Err(refuse(format!(
                "{} file descriptors came with a message listing {count}",
                r.fds.len()
            )));
        }
        for (k, fd) in r.fds.into_iter().enumerate() {
            let at_id = FD_HEAD + 8 * k;
            let id = u64::from_le_bytes(buf[at_id..at_id + 8].try_into().expect("8 bytes"));
            let (want_id, of, uuid) = want[at];
            if id != want_id {
                return Err(refuse(format!(
                    "a file descriptor for the export {id}, where its descriptors name \
                     {want_id} next (each export it names, once, in the order first named)"
                )));
            }
            out.by_id.insert(
                id,
                PeerFd {
                    fd: Arc::new(fd),
                    of,
                    uuid,
                },
            );
            at += 1;
        }
    }
    Ok(out)
}

/// Swap first messages and exported file descriptors (VMM, pool) on a new connection (the
/// dialer sends first), all bounded by `timeout`.
fn greet(
    s: &mut UnixStream,
    publish: &[MemoryDescriptor],
    dialer: bool,
    timeout: Duration,
    write_bound: Duration,
) -> Result<(LocalHello, PeerFds)> {
    let end = deadline_after(Instant::now(), timeout);
    let t = Some(timeout.max(Duration::from_millis(1)));
    s.set_read_timeout(t)
        .and_then(|()| s.set_write_timeout(t))
        .map_err(|e| os("setsockopt (the local endpoint's Unix socket)", e))?;
    let fds = outgoing(publish)?;
    let mine = LocalHello {
        pid: std::process::id(),
        descriptors: publish.to_vec(),
    }
    .encode()?;
    if dialer {
        send_msg_by(s, &mine, end, timeout)?;
        send_export_fds(s, &fds, end, timeout)?;
    }
    let theirs = LocalHello::decode(&recv_msg_by(s, end, timeout)?)?;
    let theirs_fds = recv_export_fds(s, &expected(&theirs.descriptors)?, end, timeout)?;
    if !dialer {
        send_msg_by(s, &mine, end, timeout)?;
        send_export_fds(s, &fds, end, timeout)?;
    }
    // The reader blocks; notifications are sent with the engine's bound (not what was left of
    // the meeting's timeout).
    s.set_read_timeout(None)
        .and_then(|()| s.set_write_timeout(Some(write_bound.max(Duration::from_millis(1)))))
        .map_err(|e| os("setsockopt (the local endpoint's Unix socket)", e))?;
    Ok((theirs, theirs_fds))
}

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

fn dial(
    engine: &Engine,
    path: &Path,
    publish: &[MemoryDescriptor],
) -> Result<(UnixStream, LocalHello, PeerFds)> {
    if publish.len() > MAX_DESCRIPTORS {
        return Err(Error::invalid(
            "publish",
            publish.len(),
            format!("at most {MAX_DESCRIPTORS} descriptors"),
        ));
    }
    // Refused before connecting: a VMM or pool export that is gone, or described otherwise.
    outgoing(publish)?;
    let mut s = UnixStream::connect(path).map_err(|e| os("connect (a Unix socket)", e))?;
    let bound = engine.inner.config.connect_timeout;
    let (hello, fds) = greet(&mut s, publish, true, bound, bound)?;
    Ok((s, hello, fds))
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

/// The live connection: the socket notifications are written to, the file descriptors (VMM,
/// pool) the peer sent when the endpoints met and its pid as the kernel gives it, the reader.
struct Conn {
    stream: UnixStream,
    peer_fds: PeerFds,
    reader: Option<JoinHandle<()>>,
}

/// What a copy in flight reaches: the local regions (by the request's own pairs, or a list of
/// them) and the peer's imports (its streams are held by the stream epochs that track it).
struct Keep {
    _pairs: Vec<(LocalRange, RemoteRange)>,
    _regions: Vec<Region>,
    _imports: Vec<Arc<Import>>,
    /// A prepared request's pairs and imports, shared by every post of it.
    _held: Option<Arc<Held>>,
}

/// What a prepared request's copies reach: its pairs (their regions) and the peer's imports.
struct Held {
    _pairs: Vec<(LocalRange, RemoteRange)>,
    _imports: Vec<Arc<Import>>,
}

impl Keep {
    /// What a post of a prepared request holds: the request's shared pairs and imports.
    fn posted(held: &Arc<Held>) -> Keep {
        Keep {
            _pairs: Vec::new(),
            _regions: Vec::new(),
            _imports: Vec::new(),
            _held: Some(held.clone()),
        }
    }
}

impl Drop for Held {
    /// The imports are parked, closed by a later reap on a caller's thread (as a refused
    /// request's are): the last holder may be the worker, or a waker.
    fn drop(&mut self) {
        park_imports(std::mem::take(&mut self._imports));
    }
}

/// The stream epochs of one request (one per stream it used): complete when all are.
struct Events(Vec<StreamFence>);

impl Fence for Arc<Events> {
    fn is_complete(&self) -> bool {
        (**self).is_complete()
    }

    fn check(&self) -> Result<bool> {
        (**self).check()
    }
}

impl Fence for Events {
    fn is_complete(&self) -> bool {
        self.0.iter().all(Fence::is_complete)
    }

    fn check(&self) -> Result<bool> {
        for e in &self.0 {
            if !e.check()? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// A request whose copies are queued, waiting for its events.
struct Job {
    /// Shared so that it can be asked outside the queue's lock.
    fence: Arc<Events>,
    keep: Keep,
    /// Sets the result; the [`Settled`] returned wakes the waiters when dropped.
    finish: Box<dyn FnOnce(Result<TransferReport>) -> Settled + Send>,
    report: TransferReport,
    started: Instant,
    deadline: Instant,
    timeout: Duration,
    epoch: u64,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    closing: bool,
    /// The worker sleeps on the queue's condition variable (new work must wake it).
    idle: bool,
}

/// The intra-node side of an endpoint.
pub(crate) struct Side {
    engine: Engine,
    /// The socket path and what to publish, for the dialing side (reconnect).
    dialed: Option<(PathBuf, Vec<MemoryDescriptor>)>,
    conn: Mutex<Option<Conn>>,
    /// Bumped by every failure and close: requests of an older epoch are ended.
    epoch: AtomicU64,
    /// Bumped when this side shuts its own socket: the reader of an older one ends quietly.
    generation: AtomicU64,
    closed: AtomicBool,
    queue: Mutex<Queue>,
    queue_cv: Condvar,
    /// Piece streams per local GPU.
    streams: Mutex<HashMap<usize, Arc<[Stream]>>>,
    /// The peer allocations this endpoint has used, held until it goes.
    held: Mutex<Vec<Arc<Import>>>,
    ep: Mutex<Weak<EpInner<State>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
    /// Held while a request is finished: one at a time, in queue order.
    finishing: Mutex<()>,
    /// Held while a request's copies are queued and the request pushed.
    issue: Mutex<()>,
    /// Held for a whole reconnect.
    reconnecting: Mutex<()>,
    /// Itself, for the waits that help.
    me: Weak<Side>,
    /// When a waiting caller last looked at the head (nanoseconds since `born`): the worker
    /// leaves the looking to it meanwhile.
    helped_at: AtomicU64,
    born: Instant,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A worker waiting for the head request yields this many times, looking, before it sleeps.
const WORKER_SPINS: u32 = 64;
/// The worker's sleeps between looks grow from 10 µs to this. (A host function after the copies
/// could wake it, but it would hold back the next request's copies on the stream until CUDA's
/// callback thread ran it: tens of microseconds each.) A caller that waits blocking looks itself.
const WORKER_NAP: Duration = Duration::from_micros(100);

/// How often an idle worker looks at the queue anyway (requests that did not wake it).
const IDLE_LOOK: Duration = Duration::from_millis(100);

/// Ask `done` until it answers `true` (then `true`) or `timeout` has passed (then `false`): a
/// few yields, then sleeps growing to [`WORKER_NAP`].
fn look_until(mut done: impl FnMut() -> bool, timeout: Duration) -> bool {
    let end = deadline_after(Instant::now(), timeout);
    for _ in 0..WORKER_SPINS {
        if done() {
            return true;
        }
        std::thread::yield_now();
    }
    let mut nap = Duration::from_micros(10);
    loop {
        if done() {
            return true;
        }
        let now = Instant::now();
        if now >= end {
            return false;
        }
        std::thread::sleep(nap.min(end - now));
        nap = (nap * 2).min(WORKER_NAP);
    }
}

impl Side {
    fn new(
        engine: Engine,
        stream: UnixStream,
        peer_fds: PeerFds,
        dialed: Option<(PathBuf, Vec<MemoryDescriptor>)>,
    ) -> Arc<Side> {
        Arc::new_cyclic(|me| Side {
            me: me.clone(),
            helped_at: AtomicU64::new(0),
            born: Instant::now(),
            engine,
            dialed,
            conn: Mutex::new(Some(Conn {
                stream,
                peer_fds,
                reader: None,
            })),
            epoch: AtomicU64::new(1),
            generation: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            queue: Mutex::new(Queue::default()),
            queue_cv: Condvar::new(),
            streams: Mutex::new(HashMap::new()),
            held: Mutex::new(Vec::new()),
            ep: Mutex::new(Weak::new()),
            worker: Mutex::new(None),
            finishing: Mutex::new(()),
            issue: Mutex::new(()),
            reconnecting: Mutex::new(()),
        })
    }

    fn ep(&self) -> Option<Arc<EpInner<State>>> {
        lock(&self.ep).upgrade()
    }

    /// End the endpoint with `cause`: requests in flight are ended by the worker (what their
    /// copies reach parked until the copies are done).
    fn fail(&self, cause: Broken) {
        drop(self.fail_later(cause));
    }

    /// [`fail`](Self::fail), the wake-ups it decides returned, to be dropped once the caller
    /// let its own locks go.
    fn fail_later(&self, cause: Broken) -> Option<Wakes> {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        let wakes = self.ep().map(|ep| fail_later(&ep, cause));
        self.queue_cv.notify_all();
        wakes
    }

    /// Start the reader of the current connection.
    fn spawn_reader(self: &Arc<Self>) -> Result<()> {
        let mut c = lock(&self.conn);
        let Some(conn) = c.as_mut() else {
            return Ok(());
        };
        let mut rd = conn
            .stream
            .try_clone()
            .map_err(|e| os("dup (the local endpoint's Unix socket)", e))?;
        let side = self.clone();
        let generation = self.generation.load(Ordering::Acquire);
        let t = crate::driver::ctx::spawn_thread("gpudirect-local-rx", move || {
            side.read_loop(&mut rd, generation)
        })?;
        conn.reader = Some(t);
        Ok(())
    }

    /// Deliver the peer's notifications in order until the socket closes.
    fn read_loop(&self, rd: &mut UnixStream, generation: u64) {
        let mut f = [0u8; FRAME];
        loop {
            let r = rd.read_exact(&mut f);
            if self.generation.load(Ordering::Acquire) != generation {
                return; // this side shut the socket (close, reconnect)
            }
            match r {
                Ok(()) if f[0] == NOTE => {
                    let tag = u32::from_le_bytes(f[1..5].try_into().expect("4 bytes"));
                    match self.ep() {
                        Some(ep) => deliver(&ep, Notification { tag }),
                        None => return,
                    }
                }
                Ok(()) => {
                    self.fail(Broken::Protocol(format!(
                        "a message of kind {} on the local endpoint's socket (only \
                         notifications, kind 1, are sent)",
                        f[0]
                    )));
                    return;
                }
                Err(e) => {
                    let errno = e.raw_os_error().unwrap_or(libc::ECONNRESET);
                    self.fail(Broken::Os(
                        "recv on the local endpoint's Unix socket (the peer closed it, or its \
                         process ended)",
                        errno,
                    ));
                    return;
                }
            }
        }
    }

    /// Shut this side's socket and join its reader.
    fn hang_up(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        let old = lock(&self.conn).take();
        if let Some(mut c) = old {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
            if let Some(t) = c.reader.take() {
                join_unless_current(t);
            }
        }
    }

    /// The peer's pid as the kernel gives it (`SO_PEERCRED`, never what the peer says), and the
    /// file descriptor (VMM, pool) it sent for each of `ids` (all of one connection).
    fn peer(&self, ids: &[Option<u64>]) -> Option<(u32, Vec<Option<PeerFd>>)> {
        let c = lock(&self.conn);
        let c = c.as_ref()?;
        let fds = ids
            .iter()
            .map(|id| id.and_then(|id| c.peer_fds.by_id.get(&id).cloned()))
            .collect();
        Some((c.peer_fds.pid, fds))
    }

    /// The error of a request whose endpoint failed, closed or reconnected under it: the
    /// endpoint's failure, or that it closed.
    fn ended(&self) -> Error {
        self.ep()
            .and_then(|ep| ep.failure())
            .unwrap_or_else(|| Broken::Closed.to_error())
    }

    /// Send a notification (after its request's copies are done) for a request of `epoch`:
    /// refused when the endpoint failed or reconnected since (the socket may reach another
    /// peer). The epoch is looked at with the connection held: a reconnect moves it on before it
    /// puts in its new connection.
    fn notify(&self, tag: u32, epoch: u64) -> Result<()> {
        let mut f = [0u8; FRAME];
        f[0] = NOTE;
        f[1..].copy_from_slice(&tag.to_le_bytes());
        let mut c = lock(&self.conn);
        if self.epoch.load(Ordering::Acquire) != epoch {
            drop(c);
            return Err(self.ended());
        }
        let Some(conn) = c.as_mut() else {
            return Err(Broken::Closed.to_error());
        };
        send_all(&conn.stream, &f).map_err(|e| os("send on the local endpoint's Unix socket", e))
    }

    /// The copy streams of GPU `ordinal` (made on first use).
    fn streams_of(&self, ordinal: usize) -> Result<Arc<[Stream]>> {
        let mut m = lock(&self.streams);
        if let Some(v) = m.get(&ordinal) {
            return Ok(v.clone());
        }
        let ctx = crate::cuda::context(ordinal)?;
        let n = self.engine.inner.config.copy_streams;
        // Private (see `queue_on`): their fences' waits and event records ask no capture questions.
        let v: Arc<[Stream]> = (0..n)
            .map(|_| Stream::private(&ctx))
            .collect::<Result<Vec<_>>>()?
            .into();
        m.insert(ordinal, v.clone());
        Ok(v)
    }

    /// Wait for each request's events in order; finish it and send its notification.
    fn work_loop(&self) {
        loop {
            while self.finish_head(true) {}
            let deadline = {
                let mut q = lock(&self.queue);
                loop {
                    if let Some(j) = q.jobs.front() {
                        break j.deadline;
                    }
                    if q.closing {
                        return;
                    }
                    q.idle = true;
                    // Timed: a request nobody waits for does not wake the worker, and its
                    // deadline must still end the endpoint when its copies hang.
                    q = self
                        .queue_cv
                        .wait_timeout(q, IDLE_LOOK)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                    q.idle = false;
                }
            };
            // Until the head can be finished: its copies done, a failure, its
            // deadline; looking at least every SLICE.
            let left = deadline.saturating_duration_since(Instant::now());
            look_until(
                || !self.recently_helped() && self.head_ready(),
                left.min(SLICE),
            );
            // A request queued behind the head whose deadline passed first ends the endpoint
            // too (its copies run after the head's).
            let now = Instant::now();
            let late = lock(&self.queue)
                .jobs
                .iter()
                .find(|j| now >= j.deadline)
                .map(|j| j.timeout);
            if let Some(t) = late {
                self.fail(Broken::Deadline(t));
            }
        }
    }

    /// Wake the worker if it sleeps for want of work.
    fn wake_worker(&self) {
        let idle = lock(&self.queue).idle;
        if idle {
            self.queue_cv.notify_all();
        }
    }

    /// Whether a waiting caller looked at the head in the last [`WORKER_NAP`].
    fn recently_helped(&self) -> bool {
        let at = self.helped_at.load(Ordering::Relaxed);
        at != 0
            && (self.born.elapsed().as_nanos() as u64).saturating_sub(at)
                < WORKER_NAP.as_nanos() as u64
    }

    /// Whether the head request can be finished now (or there is none).
    fn head_ready(&self) -> bool {
        let (fence, epoch, deadline) = {
            let q = lock(&self.queue);
            match q.jobs.front() {
                None => return true,
                Some(j) => (j.fence.clone(), j.epoch, j.deadline),
            }
        };
        // Asked outside the lock: requests are queued meanwhile.
        !matches!(fence.check(), Ok(false))
            || self.epoch.load(Ordering::Acquire) != epoch
            || Instant::now() >= deadline
    }

    /// Finish the head request if it can be now: its copies done, or failed, its endpoint ended,
    /// or its deadline passed. Requests finish in queue order (so notifications leave in request
    /// order), by the worker or by a caller waiting for its transfer (`block` false: only when no
    /// one else is finishing). Returns whether one was finished.
    fn finish_head(&self, block: bool) -> bool {
        let _order = if block {
            lock(&self.finishing)
        } else {
            match self.finishing.try_lock() {
                Ok(g) => g,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => return false,
            }
        };
        let (fence, epoch, deadline) = {
            let q = lock(&self.queue);
            let Some(j) = q.jobs.front() else {
                return false;
            };
            (j.fence.clone(), j.epoch, j.deadline)
        };
        // Asked outside the queue's lock; only a holder of `finishing` takes the head, so it is
        // still this one after.
        let end = match fence.check() {
            Err(e) => End::Failed(e),
            Ok(true) => End::Done,
            Ok(false) if self.epoch.load(Ordering::Acquire) != epoch => End::Ended,
            Ok(false) if Instant::now() >= deadline => End::Late,
            Ok(false) => return false,
        };
        drop(fence);
        let job = lock(&self.queue).jobs.pop_front().expect("the head stays");
        let later = self.conclude(job, end, block);
        // The waiters' wakers run with `finishing` let go: a waker may poll, wait or drop the
        // last clone of the endpoint inline (whose close joins the worker, which may be
        // waiting for `finishing`).
        drop(_order);
        drop(later);
        true
    }

    /// End a request taken from the head. `on_worker`: this is the worker thread, which frees
    /// nothing (a `cuMemFree` waits for the whole device, and a stream may wait on a word only
    /// this thread can let through): what the request held is parked, its events done, for the
    /// next reap on a caller's thread. Returns the wake-ups it decided, to be run (dropped) once
    /// `finishing` is let go.
    fn conclude(&self, job: Job, end: End, on_worker: bool) -> Later {
        let Job {
            fence,
            keep,
            finish,
            mut report,
            started,
            timeout,
            epoch,
            ..
        } = job;
        // Its result set, with the wake-ups of the failure it caused (if any).
        let end_with = move |r: Result<TransferReport>, failed: Option<Wakes>| Later {
            _settled: finish(r),
            _failed: failed,
        };
        match end {
            End::Failed(e) => {
                // A sticky error: the copy will never be seen done; what it reaches stays.
                Tracker::global().park(fence, keep);
                let failed = self.fail_later(Broken::of(&e));
                end_with(Err(e), failed)
            }
            End::Ended => {
                Tracker::global().park(fence, keep);
                end_with(Err(self.ended()), None)
            }
            End::Late => {
                Tracker::global().park(fence, keep);
                let failed = self.fail_later(Broken::Deadline(timeout));
                let e = Error::Timeout {
                    what: "an intra-node transfer (its copies did not finish in time; the \
                           endpoint was closed)",
                    after: timeout,
                };
                end_with(Err(e), failed)
            }
            End::Done => {
                if on_worker {
                    Tracker::global().park(fence, keep);
                } else {
                    drop(keep);
                }
                if self.epoch.load(Ordering::Acquire) != epoch {
                    // Done, but the endpoint failed or reconnected meanwhile: no notification
                    // on a socket that may reach another peer.
                    return end_with(Err(self.ended()), None);
                }
                if let Some(tag) = report.notified
                    && let Err(e) = self.notify(tag, epoch)
                {
                    let failed = match &e {
                        Error::Os { call, source } => {
                            self.fail_later(Broken::Os(call, source.raw_os_error().unwrap_or(0)))
                        }
                        _ => None,
                    };
                    return end_with(Err(e), failed);
                }
                report.elapsed = started.elapsed();
                end_with(Ok(report), None)
            }
        }
    }
}

/// The wake-ups of a request ended at the head ([`Side::conclude`]): its own, and those of
/// the endpoint's failure it caused. Run when dropped.
struct Later {
    _settled: Settled,
    _failed: Option<Wakes>,
}

/// How a request ends ([`Side::finish_head`]).
enum End {
    Done,
    Failed(Error),
    Ended,
    Late,
}

impl Finisher for Side {
    fn help(&self) {
        self.helped_at
            .store(self.born.elapsed().as_nanos() as u64, Ordering::Relaxed);
        while self.finish_head(false) {}
    }

    fn wake(&self) {
        self.wake_worker();
    }
}

impl Side {
    /// Start serving `ep` (its threads hold it weakly).
    fn attach(self: Arc<Self>, ep: &Arc<EpInner<State>>) -> Result<()> {
        *lock(&self.ep) = Arc::downgrade(ep);
        let side = self.clone();
        let t = crate::driver::ctx::spawn_thread("gpudirect-local-copy", move || side.work_loop())?;
        *lock(&self.worker) = Some(t);
        self.spawn_reader()
    }

    /// End: the socket shut, the threads joined, requests still queued ended.
    fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.epoch.fetch_add(1, Ordering::AcqRel);
        lock(&self.queue).closing = true;
        self.queue_cv.notify_all();
        self.hang_up();
        if let Some(t) = lock(&self.worker).take() {
            join_unless_current(t);
        }
        park_imports(std::mem::take(&mut *lock(&self.held)));
    }

    /// Dial again (the dialing side), as
    /// [`Endpoint::reconnect`](crate::transfer::Endpoint::reconnect).
    fn reconnect(self: Arc<Self>, ep: &EpInner<State>) -> Result<()> {
        let Some((path, publish)) = &self.dialed else {
            return Err(Error::invalid(
                "endpoint",
                "accepted",
                "only the side that connected can reconnect; the listener accepts the new endpoint",
            ));
        };
        // Declared before the lock: the wake-ups the failures decide run once it is let go (a
        // waker may call `reconnect` itself).
        let mut wakes = Vec::with_capacity(2);
        // One reconnect at a time: two would interleave hang-ups, dials and readers.
        let _one = lock(&self.reconnecting);
        wakes.extend(self.fail_later(Broken::Closed));
        self.hang_up();
        let (stream, hello, peer_fds) = dial(&self.engine, path, publish)?;
        *lock(&self.conn) = Some(Conn {
            stream,
            peer_fds,
            reader: None,
        });
        // The old peer's mappings: each request still running holds its own.
        park_imports(std::mem::take(&mut *lock(&self.held)));
        restart(ep, hello.descriptors);
        // Without a reader the endpoint would look healthy and never hear of the peer's close:
        // it ends instead.
        if let Err(e) = self.spawn_reader() {
            wakes.extend(self.fail_later(Broken::Closed));
            self.hang_up();
            return Err(e);
        }
        Ok(())
    }
}

/// One copy: destination, source (unified addresses), bytes, the local GPU it runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    dst: u64,
    src: u64,
    len: u64,
    device: usize,
}

/// What a pair's copy crosses, told once its copies are queued.
fn path_of(local_gpu: Option<usize>, peer_gpu: usize) -> MemoryPath {
    MemoryPath::CudaIpc {
        link: link(local_gpu, Some(peer_gpu)),
    }
}

/// Cut copies into chunks of at most `chunk` bytes spread over `streams` streams, in turn;
/// with one stream nothing is cut. Pure: the chunks of each copy cover it exactly, in order.
fn spread(copies: &[Piece], streams: usize, chunk: u64) -> Vec<Vec<Piece>> {
    let n = streams.max(1);
    let mut out = vec![Vec::new(); n];
    let mut turn = 0;
    for c in copies {
        if n == 1 || c.len <= chunk {
            out[turn % n].push(*c);
            turn += 1;
            continue;
        }
        let mut at = 0;
        while at < c.len {
            let len = chunk.min(c.len - at);
            out[turn % n].push(Piece {
                dst: c.dst + at,
                src: c.src + at,
                len,
                device: c.device,
            });
            turn += 1;
            at += len;
        }
    }
    out
}

/// The side holds the imports a request used for as long as it lives (the next requests find
/// them mapped). Called once the copies are queued: nothing here delays them.
fn hold_imports(side: &Side, imports: &[Arc<Import>]) {
    let mut held = lock(&side.held);
    for imp in imports {
        if !held.iter().any(|x| Arc::ptr_eq(x, imp)) {
            held.push(imp.clone());
        }
    }
}

/// A request checked and mapped, its copies not yet queued.
struct Prepared {
    copies: Vec<Piece>,
    /// Per pair: the local GPU (`None`: host memory) and the peer's GPU, for its path.
    gpus: Vec<(Option<usize>, usize)>,
    imports: Vec<Arc<Import>>,
    timeout: Duration,
    started: Instant,
    deadline: Instant,
    epoch: u64,
}

/// Every range checked, the peer's allocations mapped (once, held by the side).
fn prepare(
    ep: &EpInner<State>,
    side: &Side,
    dir: Direction,
    pairs: &[(LocalRange, RemoteRange)],
    opts: &TransferOptions,
) -> Result<Prepared> {
    let e = &ep.engine.inner;
    check_pairs(dir, pairs, opts)?;
    check_same_engine(e.engine_id, pairs)?;
    let epoch = side.epoch.load(Ordering::Acquire);
    if let Some(err) = ep.failure() {
        return Err(err);
    }
    let mut any_fd = false;
    for (i, (_, r)) in pairs.iter().enumerate() {
        let Some(ipc) = r.descriptor().ipc() else {
            return Err(Error::invalid(
                "pairs",
                i,
                "the remote memory has no CUDA IPC part: an intra-node endpoint reaches only GPU \
                 memory its owner could export (cuMemAlloc memory such as a DeviceBuffer, by its \
                 cuIpc handle; VMM memory inside one physical allocation such as a VmmBuffer, by \
                 its file descriptor; an allocation of an exportable pool, an IpcPool's \
                 PoolAlloc, by the pool's file descriptor and its pointer export data); host \
                 memory and memory of a pool without a shareable handle type (the device's \
                 default pool: cudarc's CudaSlice, a PoolBuffer) are not exported",
            ));
        };
        any_fd |= fd_said(ipc).is_some();
    }
    // Only VMM and pool memory need the peer's fds (cuIpc handles: none to look up, nothing
    // allocated).
    let said = |r: &RemoteRange| r.descriptor().ipc().and_then(fd_said);
    let wanted: Vec<Option<u64>> = if any_fd {
        pairs
            .iter()
            .map(|(_, r)| said(r).map(|(id, _)| id))
            .collect()
    } else {
        Vec::new()
    };
    let (exporter, fds) = side
        .peer(&wanted)
        .ok_or_else(|| Broken::Closed.to_error())?;
    let fd_of = |i: usize| fds.get(i).and_then(Option::as_ref);
    // VMM and pool memory: mapped from the file descriptor the peer sent when the endpoints met,
    // which the descriptor must describe as the peer's first message did. Checked before any
    // CUDA call.
    for (i, (_, r)) in pairs.iter().enumerate() {
        let (Some((id, of)), Some(ipc)) = (said(r), r.descriptor().ipc()) else {
            continue;
        };
        let memory = match of {
            FdOf::Vmm { .. } => "VMM memory",
            FdOf::Pool => "pool memory",
        };
        match fd_of(i) {
            None => {
                return Err(Error::invalid(
                    "pairs",
                    i,
                    format!(
                        "the remote memory is {memory} (the peer's export {id}) whose file \
                         descriptor did not come when this endpoint met its peer: {memory} \
                         must be published when the endpoints meet (among the descriptors given \
                         to connect_local or accept); a descriptor handed over otherwise cannot \
                         be mapped"
                    ),
                ));
            }
            Some(f) if f.of != of || f.uuid != *ipc.gpu_uuid() => {
                return Err(Error::invalid(
                    "pairs",
                    i,
                    format!(
                        "the remote descriptor says the peer's export {id} is {}; the peer \
                         published it as {} (or on another GPU)",
                        what(of),
                        what(f.of)
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    // The kernel's word, not the peer's first message: a peer that claims another pid is still
    // this process.
    if exporter == std::process::id() {
        return Err(Error::Unsupported {
            what: "an intra-node transfer between two endpoints of one process".into(),
            reason: "CUDA IPC maps no allocation in the process that exported it: copy between \
                     the buffers directly"
                .into(),
        });
    }
    let timeout = opts.deadline.unwrap_or(e.config.deadline);
    let started = Instant::now();
    let deadline = deadline_after(started, timeout);
    let mut copies = Vec::with_capacity(pairs.len());
    let mut imports = Parking(Vec::new());
    let mut gpus = Vec::with_capacity(pairs.len());
    // The previous pair's peer allocation, local GPU, the peer's GPU and its import: pairs into
    // one allocation (many small ranges of one buffer) look it up once.
    let mut last: Option<(IpcPart, usize, usize, Arc<Import>)> = None;
    for (i, (l, r)) in pairs.iter().enumerate() {
        let ipc = r.descriptor().ipc().expect("checked above");
        let (local_gpu, laddr) = match l.region.device_addr(l.offset) {
            Some((o, a)) => (Some(o), a),
            None => (
                None,
                l.region
                    .host_addr(l.offset)
                    .ok_or_else(|| Error::invalid("pairs", i, "local memory has no address"))?
                    as u64,
            ),
        };
        let device = local_gpu.unwrap_or(0);
        let same = last
            .as_ref()
            .filter(|(p, d, ..)| p == ipc && *d == device)
            .map(|(_, _, g, imp)| (*g, imp.clone()));
        let peer_gpu = match &same {
            Some((g, _)) => *g,
            None => ordinal_of_uuid(ipc.gpu_uuid())?.ok_or_else(|| Error::NoDevice {
                what: "the peer's GPU",
                reason: format!(
                    "no visible GPU has the UUID {} of pair {i}'s remote memory (another \
                 CUDA_VISIBLE_DEVICES?)",
                    ipc.gpu_uuid()
                        .iter()
                        .map(|b| format!("{b:02x}"))
                        .collect::<String>()
                ),
            })?,
        };
        // Where the range lies in the peer's allocation: inside the length it claims, checked
        // before anything is mapped; then inside the mapping's real size.
        let off = ipc.offset().checked_add(r.offset());
        let end = off.and_then(|o| o.checked_add(r.len()));
        let (Some(off), Some(end)) = (off, end) else {
            return Err(Error::invalid("pairs", i, "the remote range overflows"));
        };
        if end > ipc.alloc_len() {
            return Err(Error::invalid(
                "pairs",
                i,
                format!(
                    "the remote range ends at byte {end} of an allocation the peer says holds {}",
                    ipc.alloc_len()
                ),
            ));
        }
        let home = || crate::p2p::link::bus_id_of(peer_gpu).ok();
        let imp = match (same, ipc.kind(), fd_of(i)) {
            (Some((_, imp)), ..) => imp,
            (None, IpcKind::CudaIpcHandle { handle }, _) => {
                import(handle, device, ipc.alloc_len(), home, &e.stats.imports)?
            }
            (None, IpcKind::VmmFd { export_id }, Some(f)) => import_vmm(
                exporter,
                *export_id,
                device,
                &f.fd,
                ipc.alloc_len(),
                home,
                &e.stats.imports,
            )?,
            (
                None,
                IpcKind::PoolPtr {
                    pool_export_id,
                    ptr_data,
                },
                Some(f),
            ) => {
                // The pool is imported on the GPU that holds it (a refusal after a first
                // import destroys it here, on the caller's thread: no pointer is in it yet).
                let pool = import_pool(
                    exporter,
                    *pool_export_id,
                    &f.fd,
                    peer_gpu,
                    device,
                    &e.stats.pool_imports,
                )?;
                import_pool_ptr(&pool, ptr_data, ipc.alloc_len(), &e.stats.imports)?
            }
            (None, IpcKind::VmmFd { .. } | IpcKind::PoolPtr { .. }, None) => {
                return Err(Error::invalid(
                    "pairs",
                    i,
                    "no exported file descriptor (checked above)",
                ));
            }
        };
        // Kept (and parked if the request is refused) before anything can fail.
        if !imports.0.iter().any(|x| Arc::ptr_eq(x, &imp)) {
            imports.0.push(imp.clone());
        }
        if end > imp.size {
            return Err(Error::invalid(
                "pairs",
                i,
                format!(
                    "the remote range ends at byte {end} of an allocation mapped with {} bytes",
                    imp.size
                ),
            ));
        }
        // off < end <= size, and base + size fits (a live mapping).
        let raddr = imp.base + off;
        let (dst, src) = match dir {
            Direction::Write => (raddr, laddr),
            Direction::Read => (laddr, raddr),
        };
        copies.push(Piece {
            dst,
            src,
            len: r.len(),
            device,
        });
        gpus.push((local_gpu, peer_gpu));
        last = Some((*ipc, device, peer_gpu, imp));
    }
    drop(last);
    let imports = std::mem::take(&mut imports.0);
    Ok(Prepared {
        copies,
        gpus,
        imports,
        timeout,
        started,
        deadline,
        epoch,
    })
}

/// The intra-node request: every range checked, the peer's allocations mapped (once), the
/// copies queued on the endpoint's streams and handed to the worker.
pub(super) fn request(
    ep: &EpInner<State>,
    side: &Side,
    dir: Direction,
    pairs: Vec<(LocalRange, RemoteRange)>,
    opts: TransferOptions,
) -> Result<Transfer> {
    let Prepared {
        copies,
        gpus,
        imports,
        timeout,
        started,
        deadline,
        epoch,
    } = prepare(ep, side, dir, &pairs, &opts)?;
    let streams = streams_for(side, &copies)?;
    let bytes = pairs_bytes(&pairs)?;
    // The pairs themselves hold the regions: nothing to copy before the copies start.
    let keep = Keep {
        _pairs: pairs,
        _regions: Vec::new(),
        _imports: imports,
        _held: None,
    };
    let report = report(dir, bytes, 0, Vec::new(), &opts);
    let when = When {
        started,
        deadline,
        timeout,
        epoch,
    };
    issue(ep, side, &streams, &copies, keep, report, &gpus, when)
}

/// The streams of each local GPU the copies start from (one GPU, almost always).
fn streams_for(side: &Side, copies: &[Piece]) -> Result<Vec<(usize, Arc<[Stream]>)>> {
    let mut streams: Vec<(usize, Arc<[Stream]>)> = Vec::with_capacity(1);
    for c in copies {
        if !streams.iter().any(|(d, _)| *d == c.device) {
            streams.push((c.device, side.streams_of(c.device)?));
        }
    }
    Ok(streams)
}

/// When a request was made and must end, and the endpoint's epoch it belongs to.
struct When {
    started: Instant,
    deadline: Instant,
    timeout: Duration,
    epoch: u64,
}

/// Queue a checked request's copies and hand it to the worker. `report` has no paths and no
/// message count yet: they are set here.
#[allow(clippy::too_many_arguments)]
fn issue(
    ep: &EpInner<State>,
    side: &Side,
    streams: &[(usize, Arc<[Stream]>)],
    copies: &[Piece],
    keep: Keep,
    mut report: TransferReport,
    gpus: &[(Option<usize>, usize)],
    when: When,
) -> Result<Transfer> {
    let e = &ep.engine.inner;
    let eager = report.notified.is_some();
    // Under the issue lock, queued then pushed: the streams' order is the queue's, so
    // notifications leave in request order. (The worker takes only the queue's lock, briefly.)
    let issue = lock(&side.issue);
    let (fence, keep, messages) = enqueue(streams, copies, e.config.copy_chunk as u64, keep)?;
    // From here on the copies run: what is left costs them nothing.
    hold_imports(side, &keep._imports);
    report.messages = messages;
    report.paths = gpus.iter().map(|&(l, p)| path_of(l, p)).collect();
    // Made once the copies are queued: a request refused before has no transfer to end. What
    // the copies reach is the job's to hold (`keep`), not the transfer's.
    let (transfer, finish) = Transfer::pending(when.timeout, Vec::new());
    // A caller waiting for it finishes what is done at the head of the queue itself. The
    // worker is woken when the request is issued only if someone else sees it finish (its
    // notification); otherwise when the transfer is looked at without a blocking wait, or goes
    // unfinished (a blocking wait finishes it alone, without the worker's wake-up and its polls
    // beside the caller's copies: measured on the H200, they doubled a small request's cost).
    let me: Weak<dyn Finisher> = side.me.clone();
    transfer.set_finisher(me);
    let mut q = lock(&side.queue);
    q.jobs.push_back(Job {
        fence: Arc::new(fence),
        keep,
        finish: Box::new(finish),
        report,
        started: when.started,
        deadline: when.deadline,
        timeout: when.timeout,
        epoch: when.epoch,
    });
    let wake = eager && q.idle;
    drop(q);
    drop(issue);
    if wake {
        side.queue_cv.notify_all();
    }
    Ok(transfer)
}

/// An intra-node request checked and mapped once, to be posted many times ([`post`]).
pub(crate) struct Ready {
    side: Weak<Side>,
    copies: Vec<Piece>,
    gpus: Vec<(Option<usize>, usize)>,
    streams: Vec<(usize, Arc<[Stream]>)>,
    /// The report every post starts from (no paths, no messages yet).
    report: TransferReport,
    held: Arc<Held>,
    timeout: Duration,
    epoch: u64,
}

/// Check and map a request of `bytes` bytes (its pairs' total, checked) once
/// ([`Endpoint::prepare`](crate::transfer::Endpoint::prepare)): what [`request`] does before it queues
/// anything, kept.
pub(super) fn ready(
    ep: &EpInner<State>,
    side: &Side,
    dir: Direction,
    pairs: Vec<(LocalRange, RemoteRange)>,
    bytes: u64,
    opts: TransferOptions,
) -> Result<Ready> {
    let Prepared {
        copies,
        gpus,
        imports,
        timeout,
        epoch,
        ..
    } = prepare(ep, side, dir, &pairs, &opts)?;
    // Made first: refused below, its imports are parked, not closed here.
    let held = Arc::new(Held {
        _pairs: pairs,
        _imports: imports,
    });
    let streams = streams_for(side, &copies)?;
    // Held by the side from now on, as a request's are once queued: every post finds them.
    hold_imports(side, &held._imports);
    Ok(Ready {
        side: side.me.clone(),
        copies,
        gpus,
        streams,
        report: report(dir, bytes, 0, Vec::new(), &opts),
        held,
        timeout,
        epoch,
    })
}

/// Post a prepared request: its copies queued as [`request`] queues them, with no check or
/// lookup repeated. Refused when the endpoint failed, closed or reconnected since it was
/// prepared (the peer's memory may have moved).
pub(super) fn post(ep: &EpInner<State>, r: &Ready) -> Result<Transfer> {
    let side = current(ep, r)?;
    let started = Instant::now();
    let keep = Keep::posted(&r.held);
    let when = When {
        started,
        deadline: deadline_after(started, r.timeout),
        timeout: r.timeout,
        epoch: r.epoch,
    };
    issue(
        ep,
        &side,
        &r.streams,
        &r.copies,
        keep,
        r.report.clone(),
        &r.gpus,
        when,
    )
}

/// The side of a prepared request, refused when the endpoint failed, closed or reconnected since
/// it was prepared (the peer's memory may have moved).
fn current(ep: &EpInner<State>, r: &Ready) -> Result<Arc<Side>> {
    let side = r.side.upgrade().ok_or_else(|| Broken::Closed.to_error())?;
    if side.epoch.load(Ordering::Acquire) != r.epoch {
        return Err(ep.failure().unwrap_or_else(|| {
            Error::invalid(
                "prepared",
                "an earlier connection",
                "the endpoint reconnected (or closed) since this transfer was prepared: the \
                 peer's memory may have moved; prepare it again",
            )
        }));
    }
    if let Some(err) = ep.failure() {
        return Err(err);
    }
    Ok(side)
}

/// The most bytes [`run`] waits for in `cuStreamSynchronize`: 64 MiB take under 3 ms even over
/// PCIe, so a deadline of [`RUN_SYNC_MIN_DEADLINE`] cannot pass unseen unless the GPU stalls.
pub(super) const RUN_SYNC_MAX_BYTES: u64 = 64 << 20;
/// The shortest deadline [`run`] waits for in `cuStreamSynchronize`.
pub(super) const RUN_SYNC_MIN_DEADLINE: Duration = Duration::from_millis(100);

/// Post a prepared request and wait for it on this thread. With one stream, at most
/// [`RUN_SYNC_MAX_BYTES`], a deadline of at least [`RUN_SYNC_MIN_DEADLINE`], nothing of the
/// endpoint queued or being finished, and nothing earlier left running on the stream (a request
/// that ended late leaves its copies there): the copies are queued and waited for with
/// `cuStreamSynchronize`, holding the issue lock (no request is queued meanwhile) and the
/// finishing lock (no earlier request is still sending its notification), with no job, transfer
/// or worker in between. Otherwise `post(..).wait()`.
pub(super) fn run(ep: &EpInner<State>, r: &Ready) -> Result<TransferReport> {
    let lane = match &r.streams[..] {
        [(_, s)]
            if s.len() == 1
                && r.report.bytes <= RUN_SYNC_MAX_BYTES
                && r.timeout >= RUN_SYNC_MIN_DEADLINE =>
        {
            &s[0]
        }
        _ => return post(ep, r)?.wait(),
    };
    // What finished requests left parked goes here, on the caller's thread (as a wait does).
    Tracker::global().reap();
    let side = current(ep, r)?;
    // Declared before the locks: the wake-ups of a failure run once they are let go.
    let mut wakes = None;
    let issue = lock(&side.issue);
    // Requests finish (and notify) one at a time under `finishing`, after leaving the queue.
    let order = lock(&side.finishing);
    let timeline = lane.timeline();
    if !lock(&side.queue).jobs.is_empty() || timeline.completed() < timeline.issued() {
        drop((order, issue));
        return post(ep, r)?.wait();
    }
    // The wait must neither fail nor break another thread's global-mode capture.
    // SAFETY: the peer's allocations were mapped through CUDA when this was prepared: libcuda
    // passed the presence check.
    let Some(relaxed) = (unsafe { capture::Relaxed::new() }) else {
        drop((order, issue));
        return post(ep, r)?.wait();
    };
    let started = Instant::now();
    let keep = Keep::posted(&r.held);
    let (fence, keep, messages) = enqueue(
        &r.streams,
        &r.copies,
        ep.engine.inner.config.copy_chunk as u64,
        keep,
    )?;
    // Nobody else issues on this stream while `issue` is held: the newest epoch is this one.
    let covered = timeline.issued();
    // SAFETY: the endpoint's own live stream, whose context `enqueue` made current.
    let synced = unsafe { crate::driver::stream::synchronize(lane.cu_stream()) };
    drop(relaxed);
    if let Err(e) = synced {
        // A sticky error: the copies may never be seen done; what they reach stays.
        Tracker::global().park(fence, keep);
        wakes = side.fail_later(Broken::of(&e));
        drop((order, issue));
        drop(wakes);
        return Err(e);
    }
    timeline.completed_through(covered);
    drop((fence, keep));
    let elapsed = started.elapsed();
    // Done is done, as at the head of the queue: the deadline is not looked at once the copies
    // are seen complete.
    let result = if let Some(tag) = r.report.notified
        && let Err(e) = side.notify(tag, r.epoch)
    {
        if let Error::Os { call, source } = &e {
            wakes = side.fail_later(Broken::Os(call, source.raw_os_error().unwrap_or(0)));
        }
        Err(e)
    } else if side.epoch.load(Ordering::Acquire) != r.epoch {
        // Done, but the endpoint failed or reconnected meanwhile.
        Err(side.ended())
    } else {
        let mut report = r.report.clone();
        report.messages = messages;
        report.paths = r.gpus.iter().map(|&(l, p)| path_of(l, p)).collect();
        report.elapsed = elapsed;
        Ok(report)
    };
    drop((order, issue));
    drop(wakes);
    result
}

/// Hand imports to the completion tracker, to be closed by a later reap on a caller's thread
/// instead of here: `cuIpcCloseMemHandle` waits for the work queued on the device (seen on the
/// H200: 450 ms behind a 500 ms kernel), which may wait on a word only this thread (the proxy,
/// the worker) lets through.
fn park_imports(v: Vec<Arc<Import>>) {
    if !v.is_empty() {
        let done = CompletionFlag::new();
        done.set();
        Tracker::global().park(done, v);
    }
}

/// Imports taken while a request is prepared: parked (not closed here) if it is refused.
struct Parking(Vec<Arc<Import>>);

impl Drop for Parking {
    fn drop(&mut self) {
        park_imports(std::mem::take(&mut self.0));
    }
}

/// The report of an intra-node request (no rails; `elapsed` set when it finishes).
fn report(
    direction: Direction,
    bytes: u64,
    messages: u64,
    paths: Vec<MemoryPath>,
    opts: &TransferOptions,
) -> TransferReport {
    TransferReport {
        direction,
        bytes,
        messages,
        rail_bytes: Vec::new(),
        paths,
        elapsed: Duration::ZERO,
        notified: opts.notify,
    }
}

/// Queue `work` on `raw` in order: one `cuMemcpyBatchAsync` for two pieces or more where the
/// driver has it (one driver call instead of one per piece), else `cuMemcpyAsync` per piece.
/// On an error some pieces may be queued.
///
/// # Safety
///
/// Every piece's ranges are live device (or mapped) memory for as long as the stream may run
/// the copies; `raw` is a live stream of the current context.
unsafe fn queue_copies(work: &[Piece], raw: cudarc::driver::sys::CUstream) -> Result<()> {
    let len = |c: &Piece| {
        usize::try_from(c.len).map_err(|_| Error::invalid("len", c.len, "fits no usize"))
    };
    if work.len() >= 2 {
        let mut dsts: Vec<u64> = work.iter().map(|c| c.dst).collect();
        let mut srcs: Vec<u64> = work.iter().map(|c| c.src).collect();
        let mut sizes = work.iter().map(len).collect::<Result<Vec<_>>>()?;
        // SAFETY: forwarded from the caller; three arrays of one length.
        if unsafe { crate::driver::mem::copy_batch_async(&mut dsts, &mut srcs, &mut sizes, raw) }? {
            return Ok(());
        }
    }
    for c in work {
        // SAFETY: forwarded from the caller.
        unsafe { crate::driver::mem::copy_async(c.dst, c.src, len(c)?, raw) }?;
    }
    Ok(())
}

/// Queue the copies (each on the streams of its GPU, cut as [`spread`] says) and take an epoch
/// of each stream used (after its copies: the epoch covers them). On a failure after some copies
/// were queued, what they reach is parked behind the epochs taken: never freed early.
fn enqueue(
    streams: &[(usize, Arc<[Stream]>)],
    copies: &[Piece],
    chunk: u64,
    keep: Keep,
) -> Result<(Events, Keep, u64)> {
    let mut keep = Some(keep);
    let mut fences = Vec::with_capacity(1);
    let mut messages = 0u64;
    for (d, mine) in streams {
        if let ([_], [s]) = (streams, &mine[..]) {
            // One GPU, one stream (the defaults): every copy goes there as it is.
            queue_on(s, copies, &mut keep, &mut fences)?;
            messages += copies.len() as u64;
            continue;
        }
        let list: Vec<Piece> = copies.iter().filter(|c| c.device == *d).copied().collect();
        for (s, work) in mine.iter().zip(spread(&list, mine.len(), chunk)) {
            if work.is_empty() {
                continue;
            }
            queue_on(s, &work, &mut keep, &mut fences)?;
            messages += work.len() as u64;
        }
    }
    Ok((
        Events(fences),
        keep.take().expect("kept to the end"),
        messages,
    ))
}

/// Queue `work` on `s` and take an epoch of it (after the copies: the epoch covers them). On a
/// failure `keep` is parked behind the epochs taken so far (or dropped when nothing was
/// queued), never freed early.
fn queue_on(
    s: &Stream,
    work: &[Piece],
    keep: &mut Option<Keep>,
    fences: &mut Vec<StreamFence>,
) -> Result<()> {
    // The stream's context current for the copy (the caller's thread may have another).
    if let Err(e) = crate::driver::ctx::bind(s.cuda().context()) {
        if let Some(k) = keep.take() {
            if fences.is_empty() {
                drop(k); // nothing queued yet
            } else {
                Tracker::global().park(Events(std::mem::take(fences)), k);
            }
        }
        return Err(e);
    }
    let k = keep.take().expect("kept between streams");
    // The endpoint's streams are its own: made in `streams_of`, never handed out, and never
    // made to wait on anyone's event, so no capture can reach them (the private protocol: no
    // driver questions).
    let r = capture::enqueue_private(s.cu_stream(), "cuMemcpyAsync", k, |raw, _| {
        // SAFETY: both ranges of every piece were checked: the local range inside its region,
        // which `keep` holds; the remote range inside the peer's allocation and the mapping,
        // which `keep` holds too. The copies are tracked by the stream epoch taken after them,
        // and nothing is freed before that epoch completes.
        unsafe { queue_copies(work, raw) }
    });
    // Taken after the copies (some may be queued even when the call failed): the epoch covers
    // them.
    fences.push(s.timeline().issue());
    match r {
        Ok(((), k)) => {
            *keep = Some(k);
            Ok(())
        }
        Err(refused) => {
            if let Some(k) = refused.kept {
                Tracker::global().park(Events(std::mem::take(fences)), k);
            }
            Err(refused.error)
        }
    }
}

/// An intra-node request whose copies are queued on a caller's stream ([`Endpoint::write_on`]):
/// complete once the stream passed them. What they reach is held until the stream's event after
/// them completes; dropped earlier, it is parked behind that event (never freed early).
pub(crate) struct Queued {
    hold: Option<(EventFence, Keep)>,
    /// What the request did (its `elapsed` set when it is reported).
    pub(crate) report: TransferReport,
    pub(crate) started: Instant,
    /// The endpoint's epoch when the copies were queued: a notification goes only to that peer.
    epoch: u64,
}

impl Drop for Queued {
    fn drop(&mut self) {
        if let Some((fence, keep)) = self.hold.take() {
            if fence.is_complete() {
                drop(keep);
            } else {
                Tracker::global().park(fence, keep);
            }
        }
    }
}

/// Queue a request's copies on `stream` (through the capture-checked path), then an event after
/// them. Checked and mapped as [`request`]; nothing is queued when a check fails.
pub(super) fn on_stream(
    ep: &EpInner<State>,
    side: &Side,
    stream: &Stream,
    dir: Direction,
    pairs: &[(LocalRange, RemoteRange)],
    opts: &TransferOptions,
) -> Result<Queued> {
    let Prepared {
        copies,
        gpus,
        imports,
        started,
        epoch,
        ..
    } = prepare(ep, side, dir, pairs, opts)?;
    let keep = Keep {
        _pairs: Vec::new(),
        _regions: pairs.iter().map(|(l, _)| l.region.clone()).collect(),
        _imports: imports,
        _held: None,
    };
    let bytes = pairs_bytes(pairs)?;
    let messages = copies.len() as u64;
    let r = stream.enqueue("cuMemcpyAsync", keep, |raw, _| {
        // SAFETY: both ranges of every piece were checked: the local range inside its region,
        // which `keep` holds; the remote range inside the peer's allocation and the mapping,
        // which `keep` holds too. The event recorded after the copies tracks them, and `keep` is
        // freed only once it completes (or leaked).
        unsafe { queue_copies(&copies, raw) }
    });
    let keep = match r {
        Ok(((), k)) => k,
        Err(refused) => {
            if let Some(k) = refused.kept {
                match EventFence::record(stream.cuda()) {
                    Ok(ev) => Tracker::global().park(ev, k),
                    Err(_) => std::mem::forget(k),
                }
            }
            return Err(refused.error);
        }
    };
    let fence = match EventFence::record(stream.cuda()) {
        Ok(f) => f,
        Err(e) => {
            // The copies may be queued and nothing tracks them: what they reach is leaked.
            std::mem::forget(keep);
            return Err(e);
        }
    };
    hold_imports(side, &keep._imports);
    let paths = gpus.iter().map(|&(l, p)| path_of(l, p)).collect();
    Ok(Queued {
        hold: Some((fence, keep)),
        report: report(dir, bytes, messages, paths, opts),
        started,
        epoch,
    })
}

/// Notify the peer of a stream-ordered request whose copies are done; refused when the endpoint
/// failed or reconnected since they were queued (the socket may reach another peer).
pub(super) fn notify_peer(side: &Side, q: &Queued, tag: u32) -> Result<()> {
    side.notify(tag, q.epoch)
}

/// The state of an intra-node endpoint under its lock: no rails; the peer's descriptors, the
/// notifications not read yet, and why it stopped.
pub(crate) struct State {
    broken: Option<(Broken, Instant)>,
    notes: VecDeque<Notification>,
    peer_descriptors: Vec<MemoryDescriptor>,
    /// What to wake once the lock is let go ([`Locked`]).
    wakes: Wakes,
}

impl State {
    /// The state of a new (or reconnected) endpoint whose peer published `peer_descriptors`.
    fn new(peer_descriptors: Vec<MemoryDescriptor>) -> State {
        State {
            broken: None,
            notes: VecDeque::new(),
            peer_descriptors,
            wakes: Wakes::default(),
        }
    }
}

impl Mailbox for State {
    fn broken(&self) -> Option<&(Broken, Instant)> {
        self.broken.as_ref()
    }

    fn notes(&mut self) -> &mut VecDeque<Notification> {
        &mut self.notes
    }

    fn peer_descriptors(&self) -> &[MemoryDescriptor] {
        &self.peer_descriptors
    }
}

impl Defers for State {
    type Wakes = Wakes;
    fn wakes(&mut self) -> &mut Wakes {
        &mut self.wakes
    }
}

/// End the endpoint with `cause` (the first cause stays): no more notifications; whoever waits
/// for one is woken once `st`'s lock is let go.
fn fail(ep: &EpInner<State>, st: &mut State, cause: Broken) {
    if st.broken.is_some() {
        return;
    }
    st.broken = Some((cause, Instant::now()));
    ep.failed(st);
}

/// [`fail`], the wake-ups it decides returned, to be run (dropped) once the caller let its own
/// locks go.
fn fail_later(ep: &EpInner<State>, cause: Broken) -> Wakes {
    let mut st = ep.lock();
    fail(ep, &mut st, cause);
    std::mem::take(&mut st.wakes)
}

/// Deliver a notification that arrived (the reader).
fn deliver(ep: &EpInner<State>, n: Notification) {
    let mut st: Locked<'_, State> = ep.lock();
    if st.notes.len() >= MAX_UNREAD_NOTIFICATIONS {
        fail(ep, &mut st, Broken::Protocol(unread_overflow()));
        return;
    }
    ep.deliver(&mut st, [n], 1);
    drop(st);
}

/// A fresh state for a reconnected endpoint, with the peer's new descriptors.
fn restart(ep: &EpInner<State>, peer_descriptors: Vec<MemoryDescriptor>) {
    let fresh = State::new(peer_descriptors);
    let old = std::mem::replace(&mut *ep.lock(), fresh);
    drop(old);
}

/// The intra-node transport of one endpoint as the endpoint holds it: the state it shares with
/// the endpoint, and its side (socket, copy streams, threads).
pub(crate) struct Local {
    inner: Arc<EpInner<State>>,
    pub(crate) side: Arc<Side>,
}

impl Local {
    fn new(engine: Engine, peer_descriptors: Vec<MemoryDescriptor>, side: Arc<Side>) -> Local {
        Local {
            inner: Arc::new(EpInner::new(engine, State::new(peer_descriptors))),
            side,
        }
    }

    /// What the endpoint shares with its side (notifications, failure, the peer's descriptors).
    pub(crate) fn shared(&self) -> &EpInner<State> {
        &self.inner
    }

    /// Start the side's threads. On failure the caller closes it.
    ///
    /// # Errors
    ///
    /// As [`spawn_thread`](crate::driver::ctx::spawn_thread).
    pub(crate) fn attach(&self) -> Result<()> {
        self.side.clone().attach(&self.inner)
    }

    /// The checks a request passes before anything is queued, queueing nothing: no rails and
    /// no staging; the copies' own checks come when they are mapped (before anything is
    /// queued).
    ///
    /// # Errors
    ///
    /// As [`Endpoint::transfer`](crate::transfer::Endpoint::transfer).
    pub(crate) fn check_request(
        &self,
        dir: Direction,
        pairs: &[(LocalRange, RemoteRange)],
        opts: &TransferOptions,
    ) -> Result<()> {
        check_pairs(dir, pairs, opts)?;
        check_same_engine(self.inner.engine.inner.engine_id, pairs)?;
        match self.inner.lock().broken.as_ref() {
            Some((b, _)) => Err(b.to_error()),
            None => Ok(()),
        }
    }

    /// A request: checked, mapped, its copies queued and handed to the worker.
    ///
    /// # Errors
    ///
    /// As [`Endpoint::transfer`](crate::transfer::Endpoint::transfer).
    pub(crate) fn transfer(
        &self,
        dir: Direction,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<Transfer> {
        request(&self.inner, &self.side, dir, pairs, opts)
    }

    /// A request checked and mapped once, to be posted many times.
    ///
    /// # Errors
    ///
    /// As [`Endpoint::prepare`](crate::transfer::Endpoint::prepare).
    pub(crate) fn ready(
        &self,
        dir: Direction,
        pairs: Vec<(LocalRange, RemoteRange)>,
        bytes: u64,
        opts: TransferOptions,
    ) -> Result<Ready> {
        ready(&self.inner, &self.side, dir, pairs, bytes, opts)
    }

    /// Post a prepared request.
    ///
    /// # Errors
    ///
    /// As [`PreparedTransfer::post`](crate::transfer::PreparedTransfer::post).
    pub(crate) fn post(&self, r: &Ready) -> Result<Transfer> {
        post(&self.inner, r)
    }

    /// Post a prepared request and wait for it on this thread.
    ///
    /// # Errors
    ///
    /// As [`PreparedTransfer::run`](crate::transfer::PreparedTransfer::run).
    pub(crate) fn run(&self, r: &Ready) -> Result<TransferReport> {
        run(&self.inner, r)
    }

    /// A request's copies queued on `stream` (stream-ordered), then an event after them.
    ///
    /// # Errors
    ///
    /// As [`Endpoint::write_on`](crate::transfer::Endpoint::write_on).
    pub(crate) fn on_stream(
        &self,
        stream: &Stream,
        dir: Direction,
        pairs: &[(LocalRange, RemoteRange)],
        opts: &TransferOptions,
    ) -> Result<Queued> {
        on_stream(&self.inner, &self.side, stream, dir, pairs, opts)
    }

    /// Notify the peer of a stream-ordered request whose copies are done.
    ///
    /// # Errors
    ///
    /// The endpoint's failure, or that it closed or reconnected since the copies were queued;
    /// [`Error::Os`] from the socket.
    pub(crate) fn notify_peer(&self, q: &Queued, tag: u32) -> Result<()> {
        notify_peer(&self.side, q, tag)
    }

    /// The next notification, waiting up to `timeout`.
    ///
    /// # Errors
    ///
    /// The endpoint's failure, once it has failed and no notification is left.
    pub(crate) fn next_notification(&self, timeout: Duration) -> Result<Option<Notification>> {
        self.inner.next_notification(timeout, |_| {})
    }

    /// Rails (none), requests in the endpoint's state (none: the side holds them), and why the
    /// endpoint stopped (for `Debug`).
    pub(crate) fn describe(&self) -> (usize, usize, Option<Broken>) {
        let st = self.inner.lock();
        (0, 0, st.broken.as_ref().map(|b| b.0.clone()))
    }

    /// Dial the socket path again (the dialing side).
    ///
    /// # Errors
    ///
    /// As [`Endpoint::reconnect`](crate::transfer::Endpoint::reconnect).
    pub(crate) fn reconnect(&self) -> Result<()> {
        self.side.clone().reconnect(&self.inner)
    }

    /// Close: the endpoint ended (no more notifications), then the side's socket shut and its
    /// threads joined.
    pub(crate) fn close(&self) {
        {
            let mut st = self.inner.lock();
            fail(&self.inner, &mut st, Broken::Closed);
        }
        self.side.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proptest_support::is_invalid;
    use crate::transfer::descriptor::{DescribedKind, IpcPart};
    use crate::transfer::transport::Transport;
    use crate::transfer::{Buffer, EngineConfig, LocalListener};
    use proptest::prelude::*;
    use std::io::Write;

    fn descs(n: usize) -> Vec<MemoryDescriptor> {
        (0..n)
            .map(|i| {
                let part = IpcPart::new([i as u8; 64], 1 << 20, 4096, [7; 16]);
                MemoryDescriptor::with_ipc(
                    0x7000_0000 + i as u64 * 4096,
                    4096,
                    DescribedKind::Device,
                    &[],
                    part,
                )
                .unwrap()
            })
            .collect()
    }

    /// Two endpoints of `engine` meeting over the socket `name`: the dialer publishing nothing,
    /// the acceptor `publish`; the listener is kept (its socket file with it).
    fn meet(
        engine: &Engine,
        name: &str,
        publish: Vec<MemoryDescriptor>,
    ) -> (
        super::super::Endpoint,
        super::super::Endpoint,
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
    fn a_first_message_round_trips_and_is_checked() {
        for n in [0, 1, 5] {
            let h = LocalHello {
                pid: 4242,
                descriptors: descs(n),
            };
            assert_eq!(LocalHello::decode(&h.encode().unwrap()).unwrap(), h);
        }
        let good = LocalHello {
            pid: 1,
            descriptors: descs(1),
        }
        .encode()
        .unwrap();
        for (at, byte, arg) in [
            (0, b'X', "hello.magic"),
            (4, 9, "hello.version"),
            (6, 1, "hello.flags"),
        ] {
            let mut b = good.clone();
            b[at] = byte;
            let e = LocalHello::decode(&b).unwrap_err();
            assert!(
                matches!(&e, Error::InvalidArgument { arg: a, .. } if *a == arg),
                "{e}"
            );
        }
        let mut b = good.clone();
        b[8..12].copy_from_slice(&0u32.to_le_bytes());
        assert!(LocalHello::decode(&b).is_err());
        assert!(LocalHello::decode(&good[..good.len() - 1]).is_err());
        assert!(LocalHello::decode(&good[..3]).is_err());
    }

    proptest! {
        /// Any corruption of a valid first message: decoded with every field sound, or refused
        /// with a typed error.
        #[test]
        fn corrupted_first_messages_are_refused_or_sound(
            n in 0usize..4, at in any::<usize>(), byte in any::<u8>(), cut in any::<usize>(),
        ) {
            let mut b = LocalHello { pid: 99, descriptors: descs(n) }.encode().unwrap();
            let i = at % b.len();
            b[i] = byte;
            b.truncate(b.len() - cut % 3);
            match LocalHello::decode(&b) {
                Ok(h) => {
                    prop_assert!(h.pid != 0);
                    prop_assert_eq!(LocalHello::decode(&h.encode().unwrap()).unwrap(), h);
                }
                Err(e) => prop_assert!(is_invalid(&e), "{}", e),
            }
        }

        /// Copies spread over streams: every byte of every copy once, chunks at most `chunk`
        /// bytes (one stream: nothing cut).
        #[test]
        fn spreading_covers_every_byte_once(
            lens in proptest::collection::vec(1u64..5_000_000, 1..6),
            streams in 1usize..5, chunk in 65_536u64..2_000_000,
        ) {
            let copies: Vec<Piece> = lens.iter().enumerate().map(|(i, &len)| Piece {
                dst: (i as u64) << 40, src: ((i as u64) << 40) + (1 << 39), len, device: 0,
            }).collect();
            let out = spread(&copies, streams, chunk);
            prop_assert_eq!(out.len(), streams);
            let mut all: Vec<Piece> = out.concat();
            if streams == 1 {
                prop_assert_eq!(&all, &copies);
            }
            all.sort_by_key(|c| c.dst);
            for c in &copies {
                let mut at = c.dst;
                for p in all.iter().filter(|p| p.dst >> 40 == c.dst >> 40) {
                    prop_assert_eq!(p.dst, at);
                    prop_assert_eq!(p.src - c.src, p.dst - c.dst);
                    prop_assert!(streams == 1 || p.len <= chunk);
                    at += p.len;
                }
                prop_assert_eq!(at, c.dst + c.len);
            }
        }
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

    /// A hand-made peer of a listener at `path`: connected, first messages swapped.
    fn greeted_peer(path: &std::path::Path, pid: u32) -> UnixStream {
        let mut s = UnixStream::connect(path).unwrap();
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
        let v = super::super::ipc::export_any_fd(file.into(), FdOf::Vmm { len: mapped }, [7; 16]);
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
        let pool = super::super::ipc::export_any_fd(file.into(), FdOf::Pool, [7; 16]);
        let (vfile, vmarked) = marker("pool-export-vmm");
        let mapped = 2 << 20;
        let vmm =
            super::super::ipc::export_any_fd(vfile.into(), FdOf::Vmm { len: mapped }, [7; 16]);
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
        ep: Mutex<Option<super::super::Endpoint>>,
        call: fn(&super::super::Endpoint) -> bool,
        done: Mutex<std::sync::mpsc::Sender<bool>>,
    }

    impl CallsBack {
        /// A waker that makes `call` on `ep` when first woken, and where its answer arrives.
        fn waker(
            ep: &super::super::Endpoint,
            call: fn(&super::super::Endpoint) -> bool,
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
        let engine = Engine::new(EngineConfig::local()).unwrap();
        let l = engine.listen_local(socket("finishing-let-go")).unwrap();
        let path = l.path().to_path_buf();
        let peer = std::thread::spawn(move || greeted_peer(&path, 82));
        let ep = l.accept(&[], Duration::from_secs(10)).unwrap();
        let _peer = peer.join().unwrap();
        let Transport::Local(local) = ep.transport() else {
            panic!("an intra-node endpoint")
        };
        let side = local.side.me.upgrade().unwrap();
        // The worker stopped: the request is finished here, by a waiting caller's look, and
        // nobody else takes `finishing`.
        lock(&side.queue).closing = true;
        side.queue_cv.notify_all();
        lock(&side.worker).take().unwrap().join().unwrap();
        let probe = Arc::new(Probe(side.clone(), AtomicU32::new(0), AtomicU32::new(0)));
        let push = |finish, notify: Option<u32>| {
            let now = Instant::now();
            let opts = TransferOptions {
                notify,
                deadline: None,
            };
            lock(&side.queue).jobs.push_back(Job {
                // No stream: done at once.
                fence: Arc::new(Events(Vec::new())),
                keep: Keep {
                    _pairs: Vec::new(),
                    _regions: Vec::new(),
                    _imports: Vec::new(),
                    _held: None,
                },
                finish: Box::new(finish),
                report: report(Direction::Write, 8, 1, Vec::new(), &opts),
                started: now,
                deadline: now + Duration::from_secs(30),
                timeout: Duration::from_secs(30),
                epoch: side.epoch.load(Ordering::Acquire),
            });
        };
        let counts = || {
            (
                probe.1.load(Ordering::SeqCst),
                probe.2.load(Ordering::SeqCst),
            )
        };
        let mut ts = Vec::new();
        for _ in 0..2 {
            let (t, finish) = Transfer::pending(Duration::from_secs(30), Vec::new());
            assert!(t.flag().register_waker(&Waker::from(probe.clone())));
            push(finish, None);
            ts.push(t);
        }
        side.help();
        for t in ts {
            assert_eq!(t.wait().unwrap().bytes, 8);
        }
        assert_eq!(counts(), (2, 2), "woken once each, `finishing` free");
        // Its notification cannot be sent (the socket's sending side shut): the endpoint fails
        // while `finishing` is held. The request's waker and a notification waiter's run once
        // it is let go.
        let (t, finish) = Transfer::pending(Duration::from_secs(30), Vec::new());
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
        side.help();
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
