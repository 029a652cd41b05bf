//! Who the peer is: its pid and user as the kernel gives them (`SO_PEERCRED`), never what it
//! says; what its imports are cached by, what the same-process refusal decides by, and what the
//! user rule ([`LocalPeers`](crate::transfer::LocalPeers)) checks.

use super::socket::os;
use crate::error::Result;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};

/// `getsockopt(SO_PEERCRED)`: the pid of the process at the other end of `s` (when it
/// connected, or listened), in this process's pid namespace. A peer outside that namespace reads
/// as pid 0 for every such peer: it gets a key of its own instead (at or above 2^31, past any
/// pid), so two of them never share imports.
#[doc(alias = "SO_PEERCRED")]
pub(super) fn peer_process(s: &UnixStream) -> Result<u32> {
    static UNSEEN: AtomicU64 = AtomicU64::new(0);
    let pid = kernel_pid(s)?;
    if pid != 0 {
        return Ok(pid);
    }
    let n = UNSEEN.fetch_add(1, Ordering::Relaxed) % (1 << 31);
    Ok((1u32 << 31) | n as u32)
}

/// `getsockopt(SO_PEERCRED)`'s pid (0 for a process outside this pid namespace).
pub(super) fn kernel_pid(s: &UnixStream) -> Result<u32> {
    Ok(cred(s)?.pid.max(0) as u32)
}

/// `getsockopt(SO_PEERCRED)`'s user (as seen from this process's user namespace).
#[doc(alias = "SO_PEERCRED")]
pub(super) fn peer_uid(s: &UnixStream) -> Result<u32> {
    Ok(cred(s)?.uid)
}

/// `getsockopt(SO_PEERCRED)`.
fn cred(s: &UnixStream) -> Result<libc::ucred> {
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
    Ok(cred)
}
