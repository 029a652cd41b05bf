//! Meeting a peer on a new connection: first messages and exported file descriptors swapped
//! (the dialer sends first), all within one deadline; dialing a listener's socket.

use super::fds::{PeerFds, expected, outgoing, recv_export_fds, send_export_fds};
use super::hello::LocalHello;
use super::socket::{os, recv_msg_by, send_msg_by};
use crate::completion::deadline_after;
use crate::error::{Error, Result};
use crate::transfer::descriptor::{MAX_DESCRIPTORS, MemoryDescriptor};
use crate::transfer::engine::Engine;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// Swap first messages and exported file descriptors (VMM, pool) on a new connection (the
/// dialer sends first), all bounded by `timeout`.
pub(super) fn greet(
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

pub(super) fn dial(
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
