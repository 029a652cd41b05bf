//! The socket between two intra-node endpoints: bounded sends and reads of length-prefixed
//! messages (a peer that reads or writes a little now and then cannot stretch a deadline), and
//! the frames sent after the first messages.

#[cfg(test)]
use crate::completion::deadline_after;
use crate::error::{Error, Result};
use crate::transfer::wire::MAX_HELLO;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// A message after the first: kind (u8), tag (u32).
pub(super) const FRAME: usize = 5;

/// Frame kind: a notification.
pub(super) const NOTE: u8 = 1;

pub(super) fn os(call: &'static str, e: std::io::Error) -> Error {
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
pub(super) fn send_all(s: &UnixStream, mut b: &[u8]) -> std::io::Result<()> {
    while !b.is_empty() {
        b = &b[send_some(s, b, 0)?..];
    }
    Ok(())
}

/// Whether `e` is a send or receive timeout passing.
pub(super) fn timed_out(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// The send timeout set to what is left before `end` (at least 1 ms): `false` when nothing is.
pub(super) fn send_bound(s: &UnixStream, end: Instant) -> Result<bool> {
    let left = end.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Ok(false);
    }
    s.set_write_timeout(Some(left.max(Duration::from_millis(1))))
        .map_err(|e| os("setsockopt (the local endpoint's Unix socket)", e))?;
    Ok(true)
}

/// The meeting's deadline passed while the peer was to read what this side sends.
pub(super) fn send_late(timeout: Duration) -> Error {
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
pub(super) fn send_msg(s: &mut UnixStream, b: &[u8]) -> Result<()> {
    let t = Duration::from_secs(60);
    send_msg_by(s, b, deadline_after(Instant::now(), t), t)
}

/// Send one length-prefixed message by `end` (`timeout` is what the meeting was given, for the
/// error).
pub(super) fn send_msg_by(
    s: &mut UnixStream,
    b: &[u8],
    end: Instant,
    timeout: Duration,
) -> Result<()> {
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
pub(super) fn recv_msg(s: &mut UnixStream, timeout: Duration) -> Result<Vec<u8>> {
    recv_msg_by(s, deadline_after(Instant::now(), timeout), timeout)
}

/// [`recv_msg`] by `end` (`timeout` is what the meeting was given, for the error).
pub(super) fn recv_msg_by(s: &mut UnixStream, end: Instant, timeout: Duration) -> Result<Vec<u8>> {
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
pub(super) fn read_by(
    s: &mut UnixStream,
    buf: &mut [u8],
    end: Instant,
    timeout: Duration,
) -> Result<()> {
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
