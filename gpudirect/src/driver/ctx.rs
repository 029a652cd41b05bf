//! Contexts (`cuCtx*`).

use super::named;
use crate::error::Result;
#[cfg(feature = "rdma")]
use crate::error::cu;
use cudarc::driver::CudaContext;
use cudarc::driver::sys;

/// `cuCtxSetCurrent` through cudarc—Make `ctx` current on the calling thread.
///
/// Safe: `ctx` is a live context (cudarc holds it), and only the presence check of the module
/// docs is needed, which every way to get a `CudaContext` from the crate passes first.
///
/// On a thread the crate started ([`spawn_thread`]), the first bind also relaxes the
/// thread's stream-capture mode for good.
#[inline]
pub(crate) fn bind(ctx: &CudaContext) -> Result<()> {
    named("cuCtxSetCurrent", ctx.bind_to_thread())?;
    relax_library_thread();
    Ok(())
}

thread_local! {
    /// 0: a caller's thread; 1: the crate's own, not yet relaxed; 2: relaxed.
    static LIBRARY: std::cell::Cell<u8> = const { std::cell::Cell::new(0) };
}

/// Start one of the crate's own threads (a worker or a poller), named `name`. Every thread the
/// crate starts goes through here (a test checks the sources): it is marked as the crate's own,
/// so its first [`bind`] puts it in `CU_STREAM_CAPTURE_MODE_RELAXED` for good, and its event
/// queries and synchronizes (on the crate's own events and streams, never on a capturing
/// stream) are then neither refused nor invalidate a graph capture that a caller's thread runs
/// in global mode. Makes no driver call itself (the thread may run where libcuda is absent).
///
/// # Errors
///
/// [`Error::Os`](crate::Error::Os) naming `pthread_create` when no thread can be had (never a
/// panic).
pub(crate) fn spawn_thread<F, T>(
    name: impl Into<String>,
    f: F,
) -> Result<std::thread::JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    std::thread::Builder::new()
        .name(name.into())
        .spawn(marked(f))
        .map_err(pthread_create)
}

/// `f`, run on a thread marked as the crate's own, whose short sleeps stay short: the
/// library's threads nap for microseconds between looks (the completion thread, the stream
/// proxy, the local endpoint's worker), and the default timer slack of 50 µs would stretch
/// each nap by that much. Threads they start (a driver's helpers) inherit it: finer wake-ups,
/// nothing else.
fn marked<F: FnOnce() -> T, T>(f: F) -> impl FnOnce() -> T {
    move || {
        LIBRARY.with(|c| c.set(1));
        // SAFETY: PR_SET_TIMERSLACK takes a plain integer and affects only this thread.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
        f()
    }
}

fn pthread_create(source: std::io::Error) -> crate::Error {
    crate::Error::Os {
        call: "pthread_create",
        source,
    }
}

/// [`spawn_thread`] inside a [`std::thread::scope`]: the thread may borrow from the caller's
/// stack and is joined before the scope returns.
///
/// # Errors
///
/// As [`spawn_thread`].
#[cfg_attr(
    not(feature = "transfer"),
    allow(dead_code, reason = "the transfer registry's per-device threads")
)]
pub(crate) fn spawn_scoped_thread<'scope, 'env, F, T>(
    scope: &'scope std::thread::Scope<'scope, 'env>,
    name: impl Into<String>,
    f: F,
) -> Result<std::thread::ScopedJoinHandle<'scope, T>>
where
    F: FnOnce() -> T + Send + 'scope,
    T: Send + 'scope,
{
    std::thread::Builder::new()
        .name(name.into())
        .spawn_scoped(scope, marked(f))
        .map_err(pthread_create)
}

#[inline]
fn relax_library_thread() {
    LIBRARY.with(|c| {
        if c.get() == 1 {
            // SAFETY: a context was just made current: libcuda passed the presence check.
            let relaxed = unsafe {
                super::stream::exchange_capture_mode(
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
                )
            };
            // Refused: asked again at the next bind.
            if relaxed.is_ok() {
                c.set(2);
            }
        }
    });
}

/// `cuFlushGPUDirectRDMAWrites(CURRENT_CTX, scope)`—Make GPUDirect RDMA writes that reached the
/// current context visible to `scope`.
///
/// # Safety
///
/// A context is current; the driver has the symbol (it is checked by name first: CUDA 11.3+).
#[cfg(feature = "rdma")]
pub(crate) unsafe fn flush_gpudirect_rdma_writes(
    scope: sys::CUflushGPUDirectRDMAWritesScope,
) -> Result<()> {
    // SAFETY: plain enum arguments; the rest is the caller's.
    cu("cuFlushGPUDirectRDMAWrites", unsafe {
        sys::cuFlushGPUDirectRDMAWrites(
            sys::CUflushGPUDirectRDMAWritesTarget::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
            scope,
        )
    })
}

/// `cuCtxGetCurrent`—The context current on the calling thread (`None` when there is none).
///
/// Safe: only the presence check of the module docs is needed, which every caller passes first
/// (it holds a context or a stream made after [`crate::cuda::init`]). A thread-local read in the
/// driver: cheap enough for every copy.
#[cfg(feature = "p2p")]
#[inline]
pub(crate) fn current() -> Result<Option<sys::CUcontext>> {
    named(
        "cuCtxGetCurrent",
        cudarc::driver::result::ctx::get_current(),
    )
}

/// `cuCtxSetCurrent(ctx)`—Make the raw context `ctx` current on the calling thread.
///
/// # Safety
///
/// `ctx` is a live context (held by a `CudaContext` the caller keeps alive).
#[cfg(feature = "p2p")]
pub(crate) unsafe fn set_current(ctx: sys::CUcontext) -> Result<()> {
    // SAFETY: forwarded from the caller.
    named("cuCtxSetCurrent", unsafe {
        cudarc::driver::result::ctx::set_current(ctx)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spawned_thread_sleeps_with_a_fine_timer_slack() {
        // SAFETY: PR_GET_TIMERSLACK reads the calling thread's slack.
        let slack = || unsafe { libc::prctl(libc::PR_GET_TIMERSLACK) };
        // SAFETY: a plain integer, for this test thread alone.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 50_000 as libc::c_ulong) };
        assert_eq!(slack(), 50_000, "a caller's thread keeps its own slack");
        let h = spawn_thread("gpudirect-test", slack).unwrap();
        assert_eq!(h.join().unwrap(), 1, "nanoseconds");
        assert_eq!(slack(), 50_000);
        let scoped = std::thread::scope(|s| {
            spawn_scoped_thread(s, "gpudirect-test-scoped", slack)
                .unwrap()
                .join()
                .unwrap()
        });
        assert_eq!(scoped, 1);
    }

    #[test]
    fn a_spawned_thread_is_marked_and_named() {
        let h = spawn_thread("gpudirect-test", || {
            (
                LIBRARY.with(|c| c.get()),
                std::thread::current().name().map(str::to_owned),
            )
        })
        .unwrap();
        assert_eq!(h.join().unwrap(), (1, Some("gpudirect-test".into())));
        let here = 7;
        let scoped = std::thread::scope(|s| {
            spawn_scoped_thread(s, "gpudirect-test-scoped", || {
                (
                    LIBRARY.with(|c| c.get()),
                    std::thread::current().name().map(str::to_owned),
                    here,
                )
            })
            .unwrap()
            .join()
            .unwrap()
        });
        assert_eq!(scoped, (1, Some("gpudirect-test-scoped".into()), 7));
        assert_eq!(
            LIBRARY.with(|c| c.get()),
            0,
            "the caller's thread is not marked"
        );
    }

    // That every thread the crate starts goes through spawn_thread or spawn_scoped_thread is a
    // rule on the sources: scripts/check-source.py (CI) checks it.
}
