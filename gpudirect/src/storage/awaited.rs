//! Awaited reads by the automatic path: [`GdsFile::read_async`] runs
//! [`GdsFile::read_to_device`] (the path [`GdsFile::path_for_read`] picks: the POSIX engine where
//! cuFile runs in compatibility mode or is missing) on a thread of its own and completes a future.

use super::auto::{GdsFile, Transfer};
use super::range::check_io;
use crate::completion::{InFlight, InFlightFuture, Outcome};
use crate::error::Result;
use crate::memory::DeviceMemoryMut;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// What the reading thread sends back: the buffer and the transfer, or the read's error (the
/// buffer is then dropped on that thread), or the read's panic (the buffer is then leaked).
type Sent<M> = std::thread::Result<Result<(M, Transfer)>>;

/// An awaited read of [`GdsFile::read_async`]: the destination buffer back and the
/// [`Transfer`] (bytes read, path taken), or the read's error.
///
/// The read runs on a thread of its own that owns the buffer until the read has ended: dropping
/// the future, or its deadline passing ([`Error::Timeout`](crate::Error::Timeout)), lets the read
/// finish there and the buffer be dropped after it, never earlier. Woken by that thread the
/// moment the read ends; a deadline is kept by the crate's completion thread. Should the read
/// panic, the panic reaches the task polling the future and the buffer is leaked, never freed
/// while a transfer might still touch it.
#[must_use = "futures do nothing unless awaited; the read runs on and its buffer is dropped after it"]
pub struct AutoReadFuture<M: Send + 'static> {
    inner: InFlightFuture<(), Outcome<Sent<M>>, ((), Sent<M>)>,
}

impl<M: Send + 'static> AutoReadFuture<M> {
    /// End with [`Error::Timeout`](crate::Error::Timeout) if the read has not ended by `at`.
    pub fn deadline(self, at: Instant) -> Self {
        AutoReadFuture {
            inner: self.inner.deadline(at),
        }
    }

    /// [`deadline`](Self::deadline) `timeout` from now.
    pub fn timeout(self, timeout: Duration) -> Self {
        AutoReadFuture {
            inner: self.inner.timeout(timeout),
        }
    }
}

impl<M: Send + 'static> Future for AutoReadFuture<M> {
    type Output = Result<(M, Transfer)>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.inner).poll(cx).map(|r| {
            r.and_then(|((), sent)| match sent {
                Ok(read) => read,
                Err(panic) => std::panic::resume_unwind(panic),
            })
        })
    }
}

impl GdsFile {
    /// Read `len` bytes at `file_offset` into `dst` at byte `dst_offset`, awaited: the same read
    /// as [`read_to_device`](Self::read_to_device) (the same path, the same result at end of
    /// file), on a thread of its own, so an async program's executor never blocks on it. Device
    /// work writing `dst` must be complete. The buffer comes back with the [`Transfer`].
    ///
    /// Unlike [`FileHandle::read_async`](super::FileHandle::read_async) (cuFile's stream-ordered
    /// read, slow where cuFile runs in compatibility mode), this takes the path `Mode::Auto` picks
    /// for blocking reads.
    ///
    /// # Errors
    ///
    /// At once, before any thread starts: [`Error::InvalidArgument`](crate::Error::InvalidArgument)
    /// for ranges outside `dst` or `off_t`; [`Error::Os`](crate::Error::Os) naming the thread's
    /// start when it cannot start (the buffer is dropped). Awaited: as
    /// [`read_to_device`](Self::read_to_device).
    #[doc(alias = "cuFileRead")]
    #[doc(alias = "pread")]
    pub fn read_async<M: DeviceMemoryMut + Send + 'static>(
        self: &Arc<Self>,
        mut dst: M,
        dst_offset: usize,
        file_offset: u64,
        len: usize,
    ) -> Result<AutoReadFuture<M>> {
        check_io("dst_offset", dst_offset, file_offset, len, dst.byte_len())?;
        let (tx, rx) = Outcome::<Sent<M>>::pair();
        let file = self.clone();
        crate::driver::ctx::spawn_thread("gpudirect-read", move || {
            // A panic is sent on, not left to end the thread: an outcome never sent would leave
            // an await without a deadline waiting forever.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                file.read_to_device(&mut dst, dst_offset, file_offset, len)
            }));
            tx.send(match r {
                Ok(read) => Ok(read.map(|t| (dst, t))),
                Err(panic) => {
                    std::mem::forget(dst);
                    Err(panic)
                }
            });
        })?;
        Ok(AutoReadFuture {
            inner: InFlight::new("GdsFile::read_async", rx, ()).with_outcome(),
        })
    }
}
