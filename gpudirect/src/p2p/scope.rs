//! [`CopyScope`]: peer copies between borrowed buffers, all waited for once, before the scope
//! returns.

use super::copy::{Copier, Left};
use crate::completion::capture::Relaxed;
use crate::completion::{Fence, StreamFence};
use crate::error::Result;
use crate::memory::{DeviceMemory, DeviceMemoryMut};
use std::marker::PhantomData;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Copies between borrowed buffers through one [`Copier`], made inside
/// [`Copier::scope`]: every copy the scope queued has completed before `scope` returns.
///
/// A copy here costs what the raw driver call costs plus the checks (`cuCtxGetCurrent` and
/// `cuMemcpyPeerAsync` for `cuMemAlloc` memory): nothing is owned, fenced or moved per copy. It
/// is the form for many small copies between buffers the caller keeps (a layer's blocks, a
/// cache's pages); [`Copier::copy_async`] is the form that hands buffers over and back.
///
/// Sound without any destructor: the buffers stay borrowed until `scope` itself has seen the
/// copier's stream finish (after the closure returns or panics), which no `mem::forget` can
/// skip.
pub struct CopyScope<'scope, 'env: 'scope> {
    copier: &'env Copier,
    /// Fences left by staged copies that failed midway (work on the staging lanes that the
    /// copier's stream does not cover).
    left: Mutex<Vec<StreamFence>>,
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
    /// When the copies cannot be proven complete: the copier's stream failed with a sticky
    /// error (the CUDA context is lost, which CUDA recovers from only in a new process). The
    /// borrowed buffers cannot be kept from their owners the way [`copy_async`](Self::copy_async)
    /// parks owned ones, so the process aborts (with a message on standard error) rather than
    /// return while a copy might still write them.
    #[doc(alias = "cuMemcpyPeerAsync")]
    #[doc(alias = "cuStreamSynchronize")]
    pub fn scope<'env, F, T>(&'env self, f: F) -> T
    where
        F: for<'scope> FnOnce(&'scope CopyScope<'scope, 'env>) -> T,
    {
        let scope = CopyScope {
            copier: self,
            left: Mutex::new(Vec::new()),
            unprovable: AtomicBool::new(false),
            scope: PhantomData,
            env: PhantomData,
        };
        let out = catch_unwind(AssertUnwindSafe(|| f(&scope)));
        scope.finish();
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
        // returns: after it has seen a fence of the copier's stream issued after this copy, and
        // every fence a failure left, complete; after an unprovable failure it never returns.
        match unsafe { self.copier.queue_borrowed(src, &*dst) } {
            Ok(()) => Ok(()),
            Err((error, Left::Covered)) => Err(error),
            Err((error, Left::Fence(fence))) => {
                self.left
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(fence);
                Err(error)
            }
            Err((error, Left::Unprovable)) => {
                self.unprovable.store(true, Ordering::Release);
                Err(error)
            }
        }
    }

    /// Wait for every copy queued, or abort when that cannot be proven.
    fn finish(&self) {
        if !self.unprovable.load(Ordering::Acquire) {
            let left = std::mem::take(&mut *self.left.lock().unwrap_or_else(|e| e.into_inner()));
            let last = self.copier.stream_fence();
            // SAFETY: the copier exists, so libcuda passed the crate's presence check.
            let relaxed = unsafe { Relaxed::new() };
            let proven = left.iter().chain([&last]).all(wait_proven);
            drop(relaxed);
            if proven {
                return;
            }
        }
        unprovable()
    }
}

/// Wait for `fence` (a few tries: a failed `cuStreamSynchronize` is tried again before it is
/// believed).
fn wait_proven(fence: &StreamFence) -> bool {
    (0..3).any(|_| fence.wait_timeout(Duration::MAX))
}

#[cold]
fn unprovable() -> ! {
    eprintln!(
        "gpudirect: a copy scope cannot prove that its copies have completed (the copier's \
         stream failed: a sticky CUDA error); the buffers it borrowed could still be written, \
         so the process aborts"
    );
    std::process::abort()
}
