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
#[cfg(all(feature = "p2p", feature = "transfer"))]
pub(crate) mod graph;
mod init;
#[cfg(feature = "p2p")]
pub(crate) mod ipc;
pub(crate) mod mem;
pub(crate) mod memop;
#[cfg(all(feature = "p2p", feature = "transfer"))]
pub(crate) mod module;
mod named;
#[cfg(feature = "p2p")]
pub(crate) mod peer;
pub(crate) mod pointer;
#[cfg(feature = "p2p")]
pub(crate) mod pool;
pub(crate) mod stream;
pub(crate) mod vmm;

#[cfg(feature = "storage")]
pub(crate) use code::error_name;
pub(crate) use init::init;
pub(crate) use named::named;
