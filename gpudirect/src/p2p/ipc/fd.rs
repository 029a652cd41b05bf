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

#[cfg(feature = "transfer")]
/// The most descriptors one [`send_fds`] message carries (the kernel's `SCM_MAX_FD` is 253).
pub(crate) const MAX_FDS_PER_MSG: usize = 64;

#[cfg(feature = "transfer")]
/// A zeroed control buffer of 8-byte words with room for `n` descriptors in one header, and its
/// length in bytes.
fn control_for(n: usize) -> (Vec<u64>, usize) {
    // At most a few hundred ints: fits u32.
    let bytes = std::mem::size_of::<libc::c_int>() * n;
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(bytes as u32) } as usize;
    (vec![0u64; space.div_ceil(8)], space)
}

#[cfg(feature = "transfer")]
/// `sendmsg` with the descriptors `fds` (1 to [`MAX_FDS_PER_MSG`]) in one `SCM_RIGHTS` header
/// and `payload` (at least one byte); what the kernel did not take of the payload at once is
/// sent after (the descriptors go with the first byte). The socket's send timeout bounds each
/// call.
///
/// # Errors
///
/// The errno of `sendmsg` / `send`; `InvalidInput` for an empty payload or a count out of range.
#[doc(alias = "sendmsg")]
#[doc(alias = "SCM_RIGHTS")]
pub(crate) fn send_fds(
    sock: &UnixStream,
    fds: &[BorrowedFd<'_>],
    payload: &[u8],
) -> io::Result<()> {
    if payload.is_empty() || fds.is_empty() || fds.len() > MAX_FDS_PER_MSG {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "send_fds needs a non-empty payload and 1 to 64 descriptors",
        ));
    }
    let mut iov = libc::iovec {
        iov_base: payload.as_ptr() as *mut libc::c_void,
        iov_len: payload.len(),
    };
    let (mut cbuf, space) = control_for(fds.len());
    // SAFETY: all-zero is a valid msghdr; the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg_control points at `space` bytes, room for one header carrying `fds.len()` ints.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len =
            libc::CMSG_LEN((std::mem::size_of::<libc::c_int>() * fds.len()) as u32) as _;
        let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
        for (i, fd) in fds.iter().enumerate() {
            std::ptr::write_unaligned(data.add(i), fd.as_raw_fd());
        }
    }
    let sent = loop {
        // SAFETY: `msg` and the buffers it points to are valid for the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut rest = &payload[sent.min(payload.len())..];
    while !rest.is_empty() {
        // SAFETY: `rest` is valid for `rest.len()` bytes; the fd is the live socket's.
        let n = unsafe {
            libc::send(
                sock.as_raw_fd(),
                rest.as_ptr().cast(),
                rest.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // 0 <= n <= rest.len().
        rest = &rest[n as usize..];
    }
    Ok(())
}

#[cfg(feature = "transfer")]
/// What [`recv_fds`] received: the descriptors (each closed when dropped), the payload bytes,
/// and whether the kernel dropped descriptors it had no room for (`MSG_CTRUNC`: more than the
/// buffer holds, or the process's descriptor limit).
#[derive(Debug)]
pub(crate) struct Received {
    pub(crate) fds: Vec<OwnedFd>,
    pub(crate) len: usize,
    pub(crate) truncated: bool,
}

#[cfg(feature = "transfer")]
/// `recvmsg` one message into `buf`, with room for at least `max_fds` descriptors
/// (close-on-exec) in its control data (the kernel fills the padding too); every descriptor that came is returned owned, whatever else is wrong. A `len`
/// of 0 means the peer closed. The socket's receive timeout bounds the call.
///
/// # Errors
///
/// The errno of `recvmsg` (`EAGAIN` when the receive timeout passes).
#[doc(alias = "recvmsg")]
pub(crate) fn recv_fds(sock: &UnixStream, buf: &mut [u8], max_fds: usize) -> io::Result<Received> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let (mut cbuf, space) = control_for(max_fds.clamp(1, 253));
    // SAFETY: all-zero is a valid msghdr; the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` and its buffers are valid for the call.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled msg_control and set msg_controllen; CMSG_FIRSTHDR and
    // CMSG_NXTHDR stay inside it.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: a non-null header lies inside `cbuf`, its data within its `cmsg_len`.
        unsafe {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                let head = data.cast::<u8>().offset_from(cmsg.cast::<u8>()) as usize;
                let count = ((*cmsg).cmsg_len as usize).saturating_sub(head)
                    / std::mem::size_of::<libc::c_int>();
                for i in 0..count {
                    let fd = std::ptr::read_unaligned(data.add(i));
                    // The kernel installed a new descriptor that nothing else owns.
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok(Received {
        fds,
        len: n as usize,
        truncated: msg.msg_flags & libc::MSG_CTRUNC != 0,
    })
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

    #[cfg(feature = "transfer")]
    #[test]
    fn several_descriptors_cross_in_one_message_and_extra_ones_are_dropped() {
        let (a, b) = UnixStream::pair().unwrap();
        let files: Vec<std::fs::File> = (0..3)
            .map(|_| std::fs::File::open("/dev/null").unwrap())
            .collect();
        let fds: Vec<BorrowedFd<'_>> = files.iter().map(std::os::fd::AsFd::as_fd).collect();
        send_fds(&a, &fds, b"three").unwrap();
        let mut buf = [0u8; 16];
        let r = recv_fds(&b, &mut buf, 4).unwrap();
        assert_eq!((r.fds.len(), r.len, r.truncated), (3, 5, false));
        assert_eq!(&buf[..5], b"three");
        // More than the receiver has room for (one int, padded to two): it gets what fits and
        // knows it was cut.
        send_fds(&a, &fds, b"x").unwrap();
        let r = recv_fds(&b, &mut buf, 1).unwrap();
        assert!(r.fds.len() < 3 && r.truncated, "{r:?}");
        assert!(send_fds(&a, &[], b"x").is_err());
        assert!(send_fds(&a, &fds, b"").is_err());
        drop(a);
        assert_eq!(recv_fds(&b, &mut buf, 4).unwrap().len, 0);
    }
}
