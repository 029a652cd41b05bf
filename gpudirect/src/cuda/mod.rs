//! Presence-checked CUDA: what GPUDirect needs beyond cudarc.
//!
//! Call [`init`] (or anything that calls it) before any cudarc API: it checks that libcuda exists
//! and is new enough, so a missing or old driver is an [`Error`](crate::Error), never a cudarc
//! panic.
//!
//! Ordering: [`Stream`] wraps cudarc's `CudaStream` with a completion [`Timeline`](crate::completion::Timeline)
//! (amortised fences), cross-stream event waits, host callbacks ([`Stream::launch_host_fn`]) and
//! stream memory operations ([`MemopFlags`] and [`Stream::batch_mem_ops`]: wait on and write
//! 32/64-bit values, batches).
//!
//! # CUDA graphs
//!
//! Nothing in gpudirect queues work on a stream that is capturing a CUDA graph: every such call
//! (copies, stream memory operations, host functions, events, peer copies, cuFile's stream-ordered
//! I/O) answers [`Error::StreamCapturing`](crate::Error::StreamCapturing) before queueing
//! anything. Work captured into a graph runs at every launch of the graph, long after any fence
//! the library could take, so the memory it touches could not be tracked. Capture with cudarc on
//! [`Stream::cuda`] for your own kernels, and queue gpudirect's work outside the capture. If a
//! capture begins on another thread while a call is queueing, the call notices it right after,
//! invalidates that capture and leaks what the work uses (never frees it); a capture begun *and*
//! ended by another thread within one call is not seen.

mod device;
mod init;
mod location;
mod memop;
mod private;
#[cfg(test)]
mod proptests;
mod stream;

pub use device::DeviceInfo;
pub use init::{BINDINGS_VERSION, MIN_DRIVER_VERSION, context, device_count, init};
pub use memop::{
    MAX_BATCH_MEM_OPS, MAX_FLAG_SLOTS, MEMOP_SYMBOLS, MemOp, MemopFlags, WaitCondition,
    batch_chunks,
};
pub use stream::Stream;

pub(crate) use location::mem_location;
pub(crate) use private::on_private_stream;
#[cfg(feature = "p2p")]
pub(crate) use stream::unprovable;
