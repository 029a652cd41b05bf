//! Awaiting a file descriptor's readability through tokio's reactor (feature `tokio`): the
//! wake-up source of completion channels (a verbs completion channel's fd becomes readable when
//! a completion event is queued).
#![cfg_attr(
    not(test),
    allow(
        dead_code,
        reason = "the wake-up source of the verbs completion channel's futures"
    )
)]

use crate::error::{Error, Result};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// A file descriptor watched for readability by the current tokio runtime's reactor. The fd is
/// made non-blocking; `T` owns it (or borrows it from something that outlives this value).
pub(crate) struct Readable<T: AsRawFd> {
    inner: AsyncFd<T>,
}

impl<T: AsRawFd> Readable<T> {
    /// Set `O_NONBLOCK` on `fd` and register it with the current tokio runtime.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] outside a tokio runtime (no reactor to register with);
    /// [`Error::Os`] naming `fcntl` or `epoll_ctl` when the fd cannot be made non-blocking or
    /// registered.
    ///
    /// # Safety
    ///
    /// `fd.as_raw_fd()` is an open file descriptor that stays open, answers the same number and
    /// refers to the same open file for as long as this value lives (until it is dropped, handed
    /// back by [`into_inner`](Self::into_inner), or forgotten): the reactor keeps it registered
    /// by number.
    pub(crate) unsafe fn new(fd: T) -> Result<Self> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::Unsupported {
                what: "awaiting a file descriptor".into(),
                reason: "not inside a tokio runtime (the `tokio` feature needs one)".into(),
            });
        }
        set_nonblocking(fd.as_raw_fd())?;
        // SAFETY: the caller keeps the fd open and the same while this value lives.
        let inner =
            unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }.map_err(|e| {
                Error::Os {
                    call: "epoll_ctl",
                    source: e.into_parts().1,
                }
            })?;
        Ok(Readable { inner })
    }

    /// Wait until `read` succeeds. `read` is a non-blocking attempt at whatever the readable fd
    /// offers (`ibv_get_cq_event` on a completion channel, `read` of an eventfd); it answers
    /// [`io::ErrorKind::WouldBlock`] when there is nothing yet, after which the fd's readiness
    /// is cleared and the wait goes on. Any other error ends the wait.
    ///
    /// Cancel-safe: dropping the future between attempts loses nothing (an attempt runs to its
    /// end within one poll).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `call` with `read`'s error, or naming `epoll_wait` when the reactor
    /// fails.
    pub(crate) async fn read_with<R>(
        &self,
        call: &'static str,
        mut read: impl FnMut(&T) -> io::Result<R>,
    ) -> Result<R> {
        loop {
            let mut guard = self.inner.readable().await.map_err(|source| Error::Os {
                call: "epoll_wait",
                source,
            })?;
            match guard.try_io(|fd| read(fd.get_ref())) {
                Ok(Ok(r)) => return Ok(r),
                Ok(Err(source)) => return Err(Error::Os { call, source }),
                Err(_would_block) => continue, // readiness cleared by try_io
            }
        }
    }

    /// [`read_with`](Self::read_with) as a poll: `Ready` once `read` succeeded or failed with
    /// an error other than `WouldBlock`; `Pending` with `cx`'s waker registered with the reactor
    /// (only the last waker given is kept).
    ///
    /// # Errors
    ///
    /// As [`read_with`](Self::read_with).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))] // the verbs futures' only user
    pub(crate) fn poll_read_with<R>(
        &self,
        cx: &mut std::task::Context<'_>,
        call: &'static str,
        mut read: impl FnMut(&T) -> io::Result<R>,
    ) -> std::task::Poll<Result<R>> {
        use std::task::Poll;
        loop {
            let mut guard = match self.inner.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(source)) => {
                    return Poll::Ready(Err(Error::Os {
                        call: "epoll_wait",
                        source,
                    }));
                }
                Poll::Ready(Ok(g)) => g,
            };
            match guard.try_io(|fd| read(fd.get_ref())) {
                Ok(Ok(r)) => return Poll::Ready(Ok(r)),
                Ok(Err(source)) => return Poll::Ready(Err(Error::Os { call, source })),
                Err(_would_block) => continue, // readiness cleared by try_io
            }
        }
    }

    /// What owns the fd.
    pub(crate) fn get_ref(&self) -> &T {
        self.inner.get_ref()
    }

    /// Deregister from the reactor and hand the owner back.
    pub(crate) fn into_inner(self) -> T {
        self.inner.into_inner()
    }
}

/// `fcntl(fd, F_SETFL, flags | O_NONBLOCK)`.
fn set_nonblocking(fd: RawFd) -> Result<()> {
    let os = |call| Error::Os {
        call,
        source: io::Error::last_os_error(),
    };
    // SAFETY: F_GETFL reads the flags of an fd the caller keeps open.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(os("fcntl"));
    }
    // SAFETY: F_SETFL on the same fd, adding O_NONBLOCK.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(os("fcntl"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::time::{Duration, Instant};

    fn eventfd() -> OwnedFd {
        // SAFETY: a new eventfd; checked below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        assert!(fd >= 0, "eventfd: {}", io::Error::last_os_error());
        // SAFETY: a fresh fd owned by nobody else.
        unsafe { OwnedFd::from_raw_fd(fd) }
    }

    fn read_u64(fd: &OwnedFd) -> io::Result<u64> {
        let mut v = 0u64;
        // SAFETY: 8 bytes into a live u64.
        let n = unsafe { libc::read(fd.as_raw_fd(), (&raw mut v).cast(), 8) };
        if n == 8 {
            Ok(v)
        } else {
            Err(io::Error::last_os_error())
        }
    }

    fn write_u64(fd: RawFd, v: u64) {
        // SAFETY: 8 bytes from a live u64 to an fd the test keeps open.
        let n = unsafe { libc::write(fd, (&raw const v).cast(), 8) };
        assert_eq!(n, 8);
    }

    #[test]
    fn outside_a_runtime_is_a_typed_error() {
        // SAFETY: an OwnedFd keeps its fd open and the same until dropped.
        let r = unsafe { Readable::new(eventfd()) };
        assert!(matches!(r, Err(Error::Unsupported { .. })));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_eventfd_written_by_another_thread_wakes_the_await() {
        // SAFETY: an OwnedFd keeps its fd open and the same until dropped.
        let r = unsafe { Readable::new(eventfd()) }.unwrap();
        let raw = r.get_ref().as_raw_fd();
        for round in 1..=50u64 {
            let t = Instant::now();
            let writer = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(2));
                write_u64(raw, round);
            });
            let got = tokio::time::timeout(Duration::from_secs(10), r.read_with("read", read_u64))
                .await
                .expect("woken, not lost")
                .unwrap();
            assert_eq!(got, round, "exactly what was written");
            assert!(
                t.elapsed() >= Duration::from_millis(2),
                "not before the write"
            );
            writer.join().unwrap();
        }
        // Nothing written: the await stays pending.
        let pending =
            tokio::time::timeout(Duration::from_millis(30), r.read_with("read", read_u64)).await;
        assert!(pending.is_err());
        drop(r.into_inner());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pipe_and_errors_other_than_would_block_end_the_wait() {
        let mut fds = [0; 2];
        // SAFETY: a two-int array for pipe2.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: fresh fds owned by nobody else.
        let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: as above.
        let r = unsafe { Readable::new(rd) }.unwrap();
        // SAFETY: 3 bytes from a static buffer to our pipe.
        let n = unsafe { libc::write(wr.as_raw_fd(), b"abc".as_ptr().cast(), 3) };
        assert_eq!(n, 3);
        let got = r
            .read_with("read", |fd| {
                let mut b = [0u8; 8];
                // SAFETY: up to 8 bytes into a live buffer.
                let n = unsafe { libc::read(fd.as_raw_fd(), b.as_mut_ptr().cast(), 8) };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(b[..n as usize].to_vec())
                }
            })
            .await
            .unwrap();
        assert_eq!(got, b"abc");
        // SAFETY: one more byte, so the fd is readable again.
        let n = unsafe { libc::write(wr.as_raw_fd(), b"x".as_ptr().cast(), 1) };
        assert_eq!(n, 1);
        let e = r
            .read_with("ibv_get_cq_event", |_| -> io::Result<()> {
                Err(io::Error::from_raw_os_error(libc::EIO))
            })
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Error::Os { call: "ibv_get_cq_event", source } if source.raw_os_error() == Some(libc::EIO)),
            "{e}"
        );
    }
}
