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
/// `pthread_create`'s, as [`std::thread::Builder::spawn`] gives it (no panic): each caller
/// maps it to its own error.
pub(crate) fn spawn_thread<F, T>(
    name: impl Into<String>,
    f: F,
) -> std::io::Result<std::thread::JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            LIBRARY.with(|c| c.set(1));
            f()
        })
}

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
    fn a_spawned_thread_is_marked_and_named() {
        let h = spawn_thread("gpudirect-test", || {
            (
                LIBRARY.with(|c| c.get()),
                std::thread::current().name().map(str::to_owned),
            )
        })
        .unwrap();
        assert_eq!(h.join().unwrap(), (1, Some("gpudirect-test".into())));
        assert_eq!(
            LIBRARY.with(|c| c.get()),
            0,
            "the caller's thread is not marked"
        );
    }

    /// Every thread the crate starts goes through `spawn_thread`: a `std::thread::spawn` (which
    /// panics when threads run out) or a `Builder` elsewhere in the crate's code, outside its
    /// test modules (each file's `#[cfg(test)] mod`, last by convention), fails here.
    #[test]
    fn the_crate_starts_threads_only_through_spawn_thread() {
        fn walk(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
            for e in std::fs::read_dir(dir).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    walk(&p, out);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    out.push(p);
                }
            }
        }
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        walk(&src, &mut files);
        assert!(files.len() > 50, "found the sources ({})", files.len());
        let mut found = Vec::new();
        for f in &files {
            let text = std::fs::read_to_string(f).unwrap();
            let code = text.split("#[cfg(test)]\nmod ").next().unwrap_or("");
            let here = f.ends_with("driver/ctx.rs");
            for (n, line) in code.lines().enumerate() {
                let l = line.trim_start();
                if l.starts_with("//") {
                    continue;
                }
                let builder = l.contains("thread::Builder::new()");
                if l.contains("thread::spawn(") || (builder && !here) {
                    found.push(format!("{}:{}: {}", f.display(), n + 1, l));
                }
            }
        }
        assert!(
            found.is_empty(),
            "threads started past spawn_thread:\n{}",
            found.join("\n")
        );
    }
}
