//! Who the peer is: its pid as the kernel gives it (`SO_PEERCRED`), never what it says; what
//! its imports are cached by, and what the same-process refusal decides by.

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
