//! Events (`cuEvent*`).

use super::named::named;
use crate::error::{Result, cu};
use cudarc::driver::{result, sys};

/// `cuEventCreate(flags)`—A new event of the current context; `flags` are `CU_EVENT_*` flags
/// (combinations allowed, such as `DISABLE_TIMING | INTERPROCESS`).
///
/// # Safety
///
/// A context is current.
pub(crate) unsafe fn create(flags: u32) -> Result<sys::CUevent> {
    let mut ev = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the driver checks the flags.
    cu("cuEventCreate", unsafe {
        sys::cuEventCreate(&mut ev, flags)
    })?;
    Ok(ev)
}

/// `cuEventDestroy_v2(event)`—Destroy an event (the driver defers it past pending records).
///
/// # Safety
///
/// `event` came from [`create`] or an IPC open, and is destroyed once.
pub(crate) unsafe fn destroy(event: sys::CUevent) -> Result<()> {
    // SAFETY: forwarded from the caller.
    named("cuEventDestroy_v2", unsafe {
        result::event::destroy(event)
    })
}

/// `cuEventRecord(event, stream)`—Record `event` after the work queued on `stream` so far.
///
/// # Safety
///
/// `event` and `stream` are live, of the same device.
pub(crate) unsafe fn record(event: sys::CUevent, stream: sys::CUstream) -> Result<()> {
    // SAFETY: forwarded from the caller.
    named("cuEventRecord", unsafe {
        result::event::record(event, stream)
    })
}

/// `cuEventQuery(event)`—Whether the work before the event's latest record has finished:
/// `Ok(false)` for `CUDA_ERROR_NOT_READY`.
///
/// # Safety
///
/// `event` is live.
pub(crate) unsafe fn query(event: sys::CUevent) -> Result<bool> {
    // SAFETY: forwarded from the caller.
    unsafe { query_code(event) }.or_else(|r| cu("cuEventQuery", r).map(|()| true))
}

/// [`query`] answering the driver's own code for an error (`CUDA_ERROR_NOT_READY` is
/// `Ok(false)`).
///
/// # Safety
///
/// `event` is live.
pub(crate) unsafe fn query_code(event: sys::CUevent) -> std::result::Result<bool, sys::CUresult> {
    // SAFETY: forwarded from the caller.
    match unsafe { sys::cuEventQuery(event) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        r => Err(r),
    }
}

/// `cuEventSynchronize(event)`—Block until the work before the event's latest record has
/// finished.
///
/// # Safety
///
/// `event` is live.
pub(crate) unsafe fn synchronize(event: sys::CUevent) -> Result<()> {
    // SAFETY: forwarded from the caller.
    named("cuEventSynchronize", unsafe {
        result::event::synchronize(event)
    })
}
