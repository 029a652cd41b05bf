//! Meeting a peer on a new connection: its user checked, greetings (with a key, proofs) swapped,
//! then first messages and exported file descriptors (the dialer sends first), all within one
//! deadline; dialing a listener's socket.

use super::fds::{PeerFds, expected, outgoing, recv_export_fds, send_export_fds};
use super::hello::{LocalHello, from_greeting, greeting};
use super::peer::{kernel_pid, peer_uid};
use super::socket::{os, recv_msg_by, send_msg_by};
use crate::completion::deadline_after;
use crate::error::{Error, Result};
use crate::transfer::auth::{
    AuthKey, Challenge, LocalPeers, Role, Transcript, agree, check_tag, read_tag_message, tag,
    tag_message,
};
use crate::transfer::descriptor::{MAX_DESCRIPTORS, MemoryDescriptor};
use crate::transfer::engine::{Engine, EngineConfig};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// What the local transport's proofs are made over, besides the transcript.
const LABEL: &[u8] = b"gpudirect transfer local v1";

/// The peer, in words: its pid as the kernel gives it, and its user.
fn who(pid: u32, uid: u32) -> String {
    format!("the local process {pid} (uid {uid})")
}

/// Check the peer's user against `rule`, then swap greetings (the dialer's first) and, with a
/// key, proofs over both greetings and both pids (each as this side sees them): both sides send
/// theirs before either checks, so a wrong key is refused on both.
///
/// # Errors
///
/// [`Error::Authentication`]: a user the rule does not admit, a key on one side only, a proof
/// that does not match, or (with a key) a peer outside this pid namespace; as the socket's
/// reads and sends.
fn authenticate(
    s: &mut UnixStream,
    dialer: bool,
    rule: &LocalPeers,
    key: Option<&AuthKey>,
    end: Instant,
    timeout: Duration,
) -> Result<()> {
    let (pid, uid) = (kernel_pid(s)?, peer_uid(s)?);
    let peer = who(pid, uid);
    // SAFETY: no arguments; cannot fail.
    let mine_uid = unsafe { libc::geteuid() };
    if !rule.admits(uid, mine_uid) {
        return Err(Error::Authentication {
            peer,
            reason: format!(
                "its user is not admitted (EngineConfig::local_peers is {rule:?}; this process                  runs as uid {mine_uid})"
            ),
        });
    }
    let role = if dialer { Role::Dialer } else { Role::Listener };
    let challenge = Challenge::new(role, key.is_some())?;
    let mine = greeting(&challenge);
    // One side sends first, the other answers: the listener sends nothing to whoever connects
    // before it has their greeting.
    let swap = |s: &mut UnixStream, b: &[u8]| -> Result<Vec<u8>> {
        if dialer {
            send_msg_by(s, b, end, timeout)?;
            recv_msg_by(s, end, timeout)
        } else {
            let got = recv_msg_by(s, end, timeout)?;
            send_msg_by(s, b, end, timeout)?;
            Ok(got)
        }
    };
    let theirs = swap(s, &mine)?;
    agree(&challenge, &from_greeting(&theirs)?, &peer)?;
    let Some(key) = key else { return Ok(()) };
    if pid == 0 {
        return Err(Error::Authentication {
            peer,
            reason: "the peer is outside this process's pid namespace: the key's proofs bind                      both pids"
                .into(),
        });
    }
    let me = std::process::id();
    let (d, l, pids) = if dialer {
        (&mine, &theirs, [me, pid])
    } else {
        (&theirs, &mine, [pid, me])
    };
    let mut binding = Vec::with_capacity(8);
    for p in pids {
        binding.extend_from_slice(&p.to_le_bytes());
    }
    let t = Transcript::new(d, l, &binding);
    let got = swap(s, &tag_message(&tag(key, LABEL, role, &t)))?;
    check_tag(
        key,
        LABEL,
        role.peer(),
        &t,
        read_tag_message(&got, &peer)?,
        &peer,
    )
}

/// Check the peer and swap greetings ([`authenticate`]), then first messages and exported file
/// descriptors (VMM, pool) on a new connection (the dialer sends first), all bounded by
/// `timeout`. Nothing of `publish` leaves before the peer is authenticated.
pub(super) fn greet(
    s: &mut UnixStream,
    config: &EngineConfig,
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
    authenticate(
        s,
        dialer,
        &config.local_peers,
        config.key.as_ref(),
        end,
        timeout,
    )?;
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
    let (hello, fds) = greet(&mut s, &engine.inner.config, publish, true, bound, bound)?;
    Ok((s, hello, fds))
}

/// A hand-made dialer's greeting without a key (tests of what follows it): sent, and the
/// listener's read.
#[cfg(test)]
pub(super) fn greet_bare(s: &mut UnixStream) {
    use super::socket::{recv_msg, send_msg};
    let c = Challenge::new(Role::Dialer, false).unwrap();
    send_msg(s, &greeting(&c)).unwrap();
    from_greeting(&recv_msg(s, Duration::from_secs(10)).unwrap()).unwrap();
}
