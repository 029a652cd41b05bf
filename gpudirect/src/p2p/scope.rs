//! [`CopyScope`]: peer copies between borrowed buffers, all waited for once, before the scope
//! returns.

use super::copy::{Copier, Left};
use crate::error::Result;
use crate::memory::{DeviceMemory, DeviceMemoryMut};
use std::marker::PhantomData;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, Ordering};

/// Copies between borrowed buffers through one [`Copier`], made inside
/// [`Copier::scope`]: every copy the scope queued has completed before `scope` returns.
///
/// On the peer and same-device paths a copy here costs the raw driver call plus the checks
/// (`cuCtxGetCurrent` and `cuMemcpyPeerAsync` for `cuMemAlloc` memory): nothing is owned, fenced
/// or moved per copy. It is the form for many small copies between buffers the caller keeps (a
/// layer's blocks, a cache's pages); [`Copier::copy_async`] is the form that hands buffers over
/// and back.
///
/// Sound without any destructor: the buffers stay borrowed until `scope` itself has seen the
/// copier's stream finish (after the closure returns or panics), which no `mem::forget` can
/// skip.
pub struct CopyScope<'scope, 'env: 'scope> {
    copier: &'env Copier,
    /// Some copy queued work (the scope then waits for the copier's stream before it returns).
    queued: AtomicBool,
    /// A failed copy may have left work that no fence can prove done.
    unprovable: AtomicBool,
    /// Invariant in both lifetimes, as `std::thread::Scope`: borrows handed to
    /// [`copy`](Self::copy) last exactly until `scope` returns.
    scope: PhantomData<&'scope mut &'scope ()>,
    env: PhantomData<&'env mut &'env ()>,
}

impl std::fmt::Debug for CopyScope<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyScope")
            .field("copier", self.copier)
            .finish_non_exhaustive()
    }
}

impl Copier {
    /// Run `f` with a [`CopyScope`] that queues copies between borrowed buffers, then wait for
    /// all of them (one `cuStreamSynchronize` of the copier's stream) and return what `f`
    /// returned. A panic in `f` is resumed after the wait.
    ///
    /// ```no_run
    /// # fn main() -> gpudirect::Result<()> {
    /// use gpudirect::memory::DeviceBuffer;
    /// use gpudirect::p2p::{Copier, CopyOptions};
    /// let (c0, c1) = (gpudirect::cuda::context(0)?, gpudirect::cuda::context(1)?);
    /// let src: Vec<DeviceBuffer<u8>> = (0..64)
    ///     .map(|_| DeviceBuffer::zeroed(&c0, 4096))
    ///     .collect::<gpudirect::Result<_>>()?;
    /// let mut dst: Vec<DeviceBuffer<u8>> = (0..64)
    ///     .map(|_| DeviceBuffer::zeroed(&c1, 4096))
    ///     .collect::<gpudirect::Result<_>>()?;
    /// let copier = Copier::new(0, 1, CopyOptions::default())?;
    /// copier.scope(|s| -> gpudirect::Result<()> {
    ///     for (a, b) in src.iter().zip(dst.iter_mut()) {
    ///         s.copy(a, b)?;
    ///     }
    ///     Ok(())
    /// })?;
    /// // Every copy has completed: `dst` is readable again.
    /// # Ok(()) }
    /// ```
    ///
    /// The final wait runs with the calling thread relaxed to
    /// `CU_STREAM_CAPTURE_MODE_RELAXED` (its mode is put back after), so a graph that another
    /// thread captures in global mode is neither refused nor invalidated by it.
    ///
    /// # Aborts
    ///
    /// When the copies queued cannot be proven complete: the copier's stream cannot be
    /// synchronized (a sticky error, after which CUDA recovers only in a new process; a call
    /// from a CUDA host function, where the driver may refuse; the driver shutting down) after
    /// retries over about 0.6 s, or a failed copy left work that nothing can wait for. The
    /// borrowed buffers cannot be kept from their owners the way
    /// [`copy_async`](Self::copy_async) parks owned ones, so the process aborts (with a message
    /// on standard error naming the driver's answer) rather than return while a copy might still
    /// write them. A scope that queued nothing never waits and never aborts.
    #[doc(alias = "cuMemcpyPeerAsync")]
    #[doc(alias = "cuStreamSynchronize")]
    pub fn scope<'env, F, T>(&'env self, f: F) -> T
    where
        F: for<'scope> FnOnce(&'scope CopyScope<'scope, 'env>) -> T,
    {
        let scope = CopyScope {
            copier: self,
            queued: AtomicBool::new(false),
            unprovable: AtomicBool::new(false),
            scope: PhantomData,
            env: PhantomData,
        };
        let out = catch_unwind(AssertUnwindSafe(|| f(&scope)));
        // Nothing after the closure may unwind: the borrows would end before the wait.
        if catch_unwind(AssertUnwindSafe(|| scope.finish())).is_err() {
            std::process::abort();
        }
        match out {
            Ok(t) => t,
            Err(panic) => resume_unwind(panic),
        }
    }
}

impl<'scope> CopyScope<'scope, '_> {
    /// Queue a copy of all of `src` into `dst` (equal lengths, in elements) on the copier's
    /// stream, after every copy queued before it. Both stay borrowed until the scope ends, when
    /// the copy has completed.
    ///
    /// As with [`Copier::copy_async`], work already queued on other streams that writes `src`
    /// or uses `dst` must be complete (or synchronized) first.
    ///
    /// # Errors
    ///
    /// Before any FFI call, [`Error::InvalidArgument`](crate::Error::InvalidArgument) when a
    /// buffer is not device memory, lives on another device than the copier's, or `dst` holds
    /// a different number of elements than `src`. When queueing fails,
    /// [`Error::Cuda`](crate::Error::Cuda); the scope still waits for whatever was queued.
    #[doc(alias = "cuMemcpyPeerAsync")]
    #[doc(alias = "cuMemcpyDtoDAsync")]
    pub fn copy<S, D>(&'scope self, src: &'scope S, dst: &'scope mut D) -> Result<()>
    where
        S: DeviceMemory,
        D: DeviceMemoryMut<Elem = S::Elem>,
    {
        // SAFETY: both buffers are borrowed for 'scope, which ends only when `Copier::scope`
        // returns: after it has seen a fence of the copier's stream issued after this copy
        // complete; after an unprovable failure (or a panic while queueing) it never returns.
        let queued = catch_unwind(AssertUnwindSafe(|| unsafe {
            self.copier.queue_borrowed(src, &*dst)
        }));
        match queued {
            Ok(Ok(())) => {
                self.mark_queued();
                Ok(())
            }
            Ok(Err((error, Left::Nothing))) => Err(error),
            // Covered by the fence the scope waits for at its end (one of the same stream).
            Ok(Err((error, Left::Covered(_)))) => {
                self.mark_queued();
                Err(error)
            }
            Ok(Err((error, Left::Unprovable))) => {
                self.unprovable.store(true, Ordering::Release);
                Err(error)
            }
            Err(panic) => {
                // Midway through queueing: what is queued may be joined to no stream.
                self.unprovable.store(true, Ordering::Release);
                resume_unwind(panic)
            }
        }
    }

    /// Some copy queued work. Read first: no write, per copy, to a line the scope's other
    /// threads share.
    fn mark_queued(&self) {
        if !self.queued.load(Ordering::Relaxed) {
            self.queued.store(true, Ordering::Release);
        }
    }

    /// Wait for every copy queued, or abort when that cannot be proven.
    fn finish(&self) {
        if self.unprovable.load(Ordering::Acquire) {
            unprovable("a failed copy left work that no stream can wait for");
        }
        if !self.queued.load(Ordering::Acquire) {
            return;
        }
        if let Err(e) = self.copier.stream().settle() {
            unprovable(&format!("the copier's stream cannot be synchronized: {e}"));
        }
    }
}

/// Abort: the copies may still write the borrowed buffers.
#[cold]
fn unprovable(why: &str) -> ! {
    crate::cuda::unprovable("a copy scope", why)
}
