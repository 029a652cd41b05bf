//! Presence-checked CUDA: what GPUDirect needs beyond cudarc.
//!
//! Call [`init`] (or anything that calls it) before any cudarc API: it checks that libcuda exists
//! and is new enough, so a missing or old driver is an [`Error`], never a cudarc panic.
//!
//! Ordering: [`Stream`] wraps cudarc's `CudaStream` with a completion [`Timeline`](crate::memory::tracker::Timeline)
//! (amortised fences), cross-stream event waits, host callbacks ([`Stream::launch_host_fn`]) and
//! stream memory operations ([`memop`]: wait on and write 32/64-bit values, batches).

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
#[doc(alias = "cuInit")]
#[doc(alias = "cuDriverGetVersion")]
pub fn init() -> Result<&'static gpudirect_sys::cuda::Driver> {
    let d = gpudirect_sys::cuda::driver()?;
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
