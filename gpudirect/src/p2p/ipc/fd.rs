//! Passing a file descriptor to another process over a Unix socket (`SCM_RIGHTS`).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

/// Words of control buffer for one `SCM_RIGHTS` int (`CMSG_SPACE(4)` is 24 bytes on Linux);
/// 8-byte words keep the `cmsghdr` aligned.
const CBUF_WORDS: usize = 4;

/// A `msghdr` with one data buffer `iov` and the control buffer `cbuf`, sized for one
/// descriptor. Both must outlive every use of the header.
fn one_fd_msg(iov: &mut libc::iovec, cbuf: &mut [u64; CBUF_WORDS]) -> libc::msghdr {
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    debug_assert!(space <= std::mem::size_of_val(cbuf));
    // SAFETY: all-zero is a valid msghdr; the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    msg
}

/// `sendmsg` with one `SCM_RIGHTS` descriptor and `payload` (at least one byte; the receiver
/// needs a buffer at least as large).
///
/// # Errors
///
/// The errno of `sendmsg` as [`io::Error`]; `InvalidInput` for an empty payload.
///
/// # References
///
/// <https://man7.org/linux/man-pages/man7/unix.7.html>
#[doc(alias = "sendmsg")]
#[doc(alias = "SCM_RIGHTS")]
pub fn send_fd(sock: &UnixStream, fd: BorrowedFd<'_>, payload: &[u8]) -> io::Result<()> {
    if payload.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "send_fd needs a non-empty payload",
        ));
    }
    let mut iov = libc::iovec {
        iov_base: payload.as_ptr() as *mut libc::c_void,
        iov_len: payload.len(),
    };
    let mut cbuf = [0u64; CBUF_WORDS];
    let msg = one_fd_msg(&mut iov, &mut cbuf);
    // SAFETY: msg_control points at a buffer large enough for one header carrying one int.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), fd.as_raw_fd());
    }
    // SAFETY: `msg` and the buffers it points to are valid for the call.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if (n as usize) < payload.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "sendmsg sent part of the payload",
        ));
    }
    Ok(())
}

/// `recvmsg` one descriptor sent by [`send_fd`] and its payload into `buf`; returns the
/// descriptor (close-on-exec) and the payload length.
///
/// # Errors
///
/// The errno of `recvmsg`; `UnexpectedEof` when the peer closed; `InvalidData` when no
/// descriptor came with the message.
#[doc(alias = "recvmsg")]
pub fn recv_fd(sock: &UnixStream, buf: &mut [u8]) -> io::Result<(OwnedFd, usize)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; CBUF_WORDS];
    let mut msg = one_fd_msg(&mut iov, &mut cbuf);
    // SAFETY: `msg` and its buffers are valid for the call.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "peer closed before sending a descriptor",
        ));
    }
    // SAFETY: the kernel filled msg_control; CMSG_FIRSTHDR checks its length.
    let cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    if cmsg.is_null()
        // SAFETY: a non-null cmsg points into `cbuf`.
        || unsafe {
            (*cmsg).cmsg_level != libc::SOL_SOCKET || (*cmsg).cmsg_type != libc::SCM_RIGHTS
        }
    {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "message carried no SCM_RIGHTS descriptor",
        ));
    }
    // SAFETY: an SCM_RIGHTS header holds at least one int.
    let fd = unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>()) };
    // SAFETY: the kernel installed a new descriptor that nothing else owns.
    Ok((unsafe { OwnedFd::from_raw_fd(fd) }, n as usize))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    #[test]
    fn a_descriptor_crosses_a_socket_pair() {
        let (a, b) = UnixStream::pair().unwrap();
        let path = std::env::temp_dir().join(format!("gpudirect-fd-{}", std::process::id()));
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        f.write_all(b"peer bytes").unwrap();
        send_fd(&a, std::os::fd::AsFd::as_fd(&f), b"{\"len\":10}").unwrap();
        let mut buf = [0u8; 64];
        let (fd, n) = recv_fd(&b, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"{\"len\":10}");
        let mut g = std::fs::File::from(fd);
        g.rewind().unwrap();
        let mut s = String::new();
        g.read_to_string(&mut s).unwrap();
        assert_eq!(s, "peer bytes");
        assert!(send_fd(&a, std::os::fd::AsFd::as_fd(&f), b"").is_err());
        drop(a);
        assert_eq!(
            recv_fd(&b, &mut buf).unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
        let _ = std::fs::remove_file(&path);
    }
}
