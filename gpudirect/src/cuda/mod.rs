//! Presence-checked CUDA: what GPUDirect needs beyond cudarc.
//!
//! Call [`init`] (or anything that calls it) before any cudarc API: it checks that libcuda exists
//! and is new enough, so a missing or old driver is an [`Error`], never a cudarc panic.
//!
//! Ordering: [`Stream`] wraps cudarc's `CudaStream` with a completion [`Timeline`](crate::memory::tracker::Timeline)
//! (amortised fences), cross-stream event waits, host callbacks ([`Stream::launch_host_fn`]) and
//! stream memory operations ([`memop`]: wait on and write 32/64-bit values, batches).
//!
//! # CUDA graphs
//!
//! Nothing in gpudirect queues work on a stream that is capturing a CUDA graph: every such call
//! (copies, stream memory operations, host functions, events, peer copies, cuFile's stream-ordered
//! I/O) answers [`Error::StreamCapturing`] before queueing anything. Work captured into a graph
//! runs at every launch of the graph, long after any fence the library could take, so the memory
//! it touches could not be tracked. Capture with cudarc on [`Stream::cuda`] for your own kernels,
//! and queue gpudirect's work outside the capture. If a capture begins on another thread while a
//! call is queueing, the call notices it right after, invalidates that capture and leaks what the
//! work uses (never frees it); a capture begun *and* ended by another thread within one call is
//! not seen.

pub(crate) mod capture;
pub mod memop;
mod stream;

pub use memop::{MAX_BATCH_MEM_OPS, MemOp, MemopFlags, WaitCondition};
pub use stream::Stream;

use crate::error::{Error, Result, cu, from_driver};
use cudarc::driver::{CudaContext, sys};
use std::sync::{Arc, OnceLock};

/// The oldest driver supported: CUDA 12.0 (stream memory ops v2, dma-buf export and VMM RDMA all
/// exist there).
pub const MIN_DRIVER_VERSION: i32 = 12000;

/// The CUDA version of the bindings gpudirect was built with (the `cuda-*` feature).
pub const BINDINGS_VERSION: i32 = if cfg!(feature = "cuda-13000") {
    13000
} else if cfg!(feature = "cuda-12090") {
    12090
} else {
    12080
};

/// Check libcuda and its version, then `cuInit(0)` once. Never panics.
///
/// libcuda must also be found by cudarc's own loader (which opens it by file name only, from
/// its candidate list): a library found only through `GPUDIRECT_LIBCUDA_PATH` would pass our
/// checks and then make cudarc panic, so that case is an [`Error::Load`] naming cudarc's
/// candidates. The override is meaningful only where cudarc finds the same library (put its
/// directory on `LD_LIBRARY_PATH`).
#[doc(alias = "cuInit")]
#[doc(alias = "cuDriverGetVersion")]
pub fn init() -> Result<&'static gpudirect_sys::cuda::Driver> {
    // The tracker records this process's id before any CUDA work, so that a forked child
    // recognises itself (and leaks rather than frees) even if it first touches the tracker.
    crate::memory::Tracker::global();
    let d = gpudirect_sys::cuda::driver()?;
    static CUDARC_FINDS_IT: OnceLock<bool> = OnceLock::new();
    // SAFETY: dlopens cudarc's libcuda candidates; the system's CUDA driver library is sound to
    // load (our own loader has just loaded one).
    let present = *CUDARC_FINDS_IT.get_or_init(|| unsafe { sys::is_culib_present() });
    cudarc_loader_check(present, d.path())?;
    if d.version() < MIN_DRIVER_VERSION {
        return Err(Error::DriverTooOld {
            found: d.version(),
            required: MIN_DRIVER_VERSION,
        });
    }
    static INIT: OnceLock<Result<(), (u32, String)>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: libcuda is present (checked above); cuInit takes flags 0.
        let r = unsafe { sys::cuInit(0) };
        cu("cuInit", r).map_err(|e| match e {
            Error::Cuda { code, name, .. } => (code, name),
            _ => (0, String::new()),
        })
    })
    .clone()
    .map_err(|(code, name)| Error::Cuda {
        call: "cuInit",
        code,
        name,
    })?;
    Ok(d)
}

/// `Ok` when cudarc's loader finds libcuda too (`present`); else the [`Error::Load`] that says
/// cudarc would not, naming its candidates and the library our loader opened at `ours`.
fn cudarc_loader_check(present: bool, ours: &str) -> Result<()> {
    if present {
        return Ok(());
    }
    let tried = ["cuda", "nvcuda"]
        .iter()
        .flat_map(|l| cudarc::get_lib_name_candidates(l))
        .collect();
    Err(Error::Load(gpudirect_sys::LoadError::LibraryNotFound {
        library: "libcuda (cudarc's loader)",
        tried,
        detail: format!(
            "gpudirect opened {ours} (via {} or its own candidates), but cudarc opens libcuda              by file name only and would panic: put that library's directory on LD_LIBRARY_PATH",
            gpudirect_sys::cuda::PATH_ENV
        ),
    }))
}

/// `cuDeviceGetCount`: how many CUDA devices are visible.
#[doc(alias = "cuDeviceGetCount")]
pub fn device_count() -> Result<usize> {
    init()?;
    let mut n = 0;
    // SAFETY: driver initialised; one valid out-pointer.
    cu("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(n as usize)
}

/// The primary context of device `ordinal`, through cudarc, after the presence checks.
///
/// # Errors
///
/// [`Error::Load`] without libcuda, [`Error::DriverTooOld`], [`Error::NoDevice`] when `ordinal`
/// is past the device count.
#[doc(alias = "cuDevicePrimaryCtxRetain")]
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    let n = device_count()?;
    if ordinal >= n {
        return Err(Error::NoDevice {
            what: "CUDA device",
            reason: format!("device {ordinal} requested, {n} visible"),
        });
    }
    CudaContext::new(ordinal).map_err(|e| from_driver("cuDevicePrimaryCtxRetain", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libcuda_cudarc_cannot_find_is_a_load_error_naming_its_candidates() {
        assert!(cudarc_loader_check(true, "/opt/x/libcuda.so.1").is_ok());
        let e = cudarc_loader_check(false, "/opt/x/libcuda.so.1").unwrap_err();
        match &e {
            Error::Load(gpudirect_sys::LoadError::LibraryNotFound { tried, detail, .. }) => {
                assert!(tried.iter().any(|t| t == "libcuda.so.1"), "{tried:?}");
                assert!(detail.contains("/opt/x/libcuda.so.1"), "{detail}");
                assert!(detail.contains("GPUDIRECT_LIBCUDA_PATH"), "{detail}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}
