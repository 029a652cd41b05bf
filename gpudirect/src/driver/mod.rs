//! The checked CUDA driver layer: one function per driver entry point the crate uses, grouped by
//! the object it acts on (`driver::mem::alloc` is `cuMemAlloc_v2`), in the manner of cudarc's
//! `driver::result`, which it wraps where that already does what is needed.
//!
//! Each function returns [`Result`](crate::Result), with an [`Error::Cuda`](crate::Error::Cuda)
//! naming the C function and the code's name; out-parameters become return values. No other
//! module calls `cudarc::driver::sys` functions: this is where the crate's driver calls can be
//! read, and checked, in one place.
//!
//! # Safety
//!
//! Every function here needs libcuda checked present and current enough by the crate's
//! presence check (`cuda::init`) before its first call: cudarc's loader panics where the
//! library or a symbol is missing. Each function's own `# Safety` says what it needs beyond
//! that: handles that are live, a current context, memory that stays valid while the device
//! uses it.

// cuFile reports CUDA errors as plain integers.
#[cfg(feature = "storage")]
mod code;

pub(crate) mod ctx;
pub(crate) mod device;
pub(crate) mod event;
#[cfg(feature = "p2p")]
pub(crate) mod ipc;
pub(crate) mod mem;
pub(crate) mod memop;
#[cfg(feature = "p2p")]
pub(crate) mod peer;
pub(crate) mod pointer;
#[cfg(feature = "p2p")]
pub(crate) mod pool;
pub(crate) mod stream;
pub(crate) mod vmm;

#[cfg(feature = "storage")]
pub(crate) use code::error_name;

use crate::error::{Result, cu, from_driver};
use cudarc::driver::DriverError;

/// A value from cudarc's `result` layer, its error named after the C function `call`.
fn named<T>(call: &'static str, r: std::result::Result<T, DriverError>) -> Result<T> {
    r.map_err(|e| from_driver(call, e))
}

/// `cuInit(0)`—Initialise the driver API for this process.
///
/// # Safety
///
/// Only the presence check of the module docs.
pub(crate) unsafe fn init() -> Result<()> {
    // SAFETY: flags 0; libcuda is present (the caller's).
    cu("cuInit", unsafe { cudarc::driver::sys::cuInit(0) })
}
