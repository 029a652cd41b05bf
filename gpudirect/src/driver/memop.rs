//! Stream memory operations, the `_v2` entry points (`cuStreamWaitValue32_v2`, ...): the legacy
//! ones answer `CUDA_ERROR_NOT_SUPPORTED` on recent GPUs.
//!
//! Every function here needs the `_v2` symbols checked by name first (cudarc's loader panics on
//! a missing symbol), and `addr` a live, aligned word that stays allocated until the stream has
//! passed the operation (or forever, if the operation may sit in a graph).

use crate::error::{Result, cu};
use cudarc::driver::sys;

/// `cuStreamWaitValue32_v2(stream, addr, value, flags)`—Later work on `stream` waits until the
/// 32-bit word at `addr` satisfies the `CU_STREAM_WAIT_VALUE_*` condition `flags`.
///
/// # Safety
///
/// As the module docs say; `stream` is live.
pub(crate) unsafe fn wait_value32(
    stream: sys::CUstream,
    addr: sys::CUdeviceptr,
    value: u32,
    flags: u32,
) -> Result<()> {
    // SAFETY: forwarded from the caller.
    cu("cuStreamWaitValue32_v2", unsafe {
        sys::cuStreamWaitValue32_v2(stream, addr, value, flags)
    })
}

/// `cuStreamWaitValue64_v2`—As [`wait_value32`] on a 64-bit word.
///
/// # Safety
///
/// As [`wait_value32`]; the device supports 64-bit stream memory operations.
pub(crate) unsafe fn wait_value64(
    stream: sys::CUstream,
    addr: sys::CUdeviceptr,
    value: u64,
    flags: u32,
) -> Result<()> {
    // SAFETY: forwarded from the caller.
    cu("cuStreamWaitValue64_v2", unsafe {
        sys::cuStreamWaitValue64_v2(stream, addr, value, flags)
    })
}

/// `cuStreamWriteValue32_v2(stream, addr, value, 0)`—Write `value` to the 32-bit word at `addr`
/// once the stream gets there.
///
/// # Safety
///
/// As the module docs say; `stream` is live; nobody holds a Rust reference to the word.
pub(crate) unsafe fn write_value32(
    stream: sys::CUstream,
    addr: sys::CUdeviceptr,
    value: u32,
) -> Result<()> {
    // SAFETY: forwarded from the caller; default flags.
    cu("cuStreamWriteValue32_v2", unsafe {
        sys::cuStreamWriteValue32_v2(stream, addr, value, 0)
    })
}

/// `cuStreamWriteValue64_v2`—As [`write_value32`] on a 64-bit word.
///
/// # Safety
///
/// As [`write_value32`]; the device supports 64-bit stream memory operations.
pub(crate) unsafe fn write_value64(
    stream: sys::CUstream,
    addr: sys::CUdeviceptr,
    value: u64,
) -> Result<()> {
    // SAFETY: forwarded from the caller; default flags.
    cu("cuStreamWriteValue64_v2", unsafe {
        sys::cuStreamWriteValue64_v2(stream, addr, value, 0)
    })
}

/// `cuStreamBatchMemOp_v2(stream, n, ops, 0)`—Queue `ops` in order, in one call.
///
/// # Safety
///
/// As the module docs say, for the word of every operation; `stream` is live; `ops.len()` is at
/// most the driver's limit (`cuda::MAX_BATCH_MEM_OPS`).
pub(crate) unsafe fn batch(
    stream: sys::CUstream,
    ops: &mut [sys::CUstreamBatchMemOpParams],
) -> Result<()> {
    let n = u32::try_from(ops.len()).unwrap_or(u32::MAX);
    // SAFETY: `n` (at most `ops.len()`) valid parameter blocks; the words are the caller's.
    cu("cuStreamBatchMemOp_v2", unsafe {
        sys::cuStreamBatchMemOp_v2(stream, n, ops.as_mut_ptr(), 0)
    })
}
