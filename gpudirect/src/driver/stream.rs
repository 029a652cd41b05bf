//! Streams (`cuStream*`, `cuLaunchHostFunc`).

use super::named::named;
use crate::error::{Result, cu};
use cudarc::driver::{result, sys};

/// `CU_STREAM_PER_THREAD`: the handle of the calling thread's per-thread default stream (a
/// different stream on every thread).
pub(crate) const PER_THREAD: usize = 0x2;

/// `cuStreamCreate(flags)`—A new stream of the current context.
///
/// # Safety
///
/// A context is current.
pub(crate) unsafe fn create(flags: sys::CUstream_flags) -> Result<sys::CUstream> {
    let mut s = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    cu("cuStreamCreate", unsafe {
        sys::cuStreamCreate(&mut s, flags as u32)
    })?;
    Ok(s)
}

/// `cuStreamDestroy_v2(stream)`—Destroy a stream from [`create`] (the driver defers it past the
/// work already queued).
///
/// # Safety
///
/// `stream` came from [`create`] and is destroyed once; nothing queues on it afterwards.
pub(crate) unsafe fn destroy(stream: sys::CUstream) -> Result<()> {
    // SAFETY: forwarded from the caller.
    named("cuStreamDestroy_v2", unsafe {
        result::stream::destroy(stream)
    })
}

/// `cuStreamSynchronize(stream)`—Block until the work queued on `stream` has finished.
///
/// # Safety
///
/// `stream` is live (or the legacy default stream of the current context).
pub(crate) unsafe fn synchronize(stream: sys::CUstream) -> Result<()> {
    // SAFETY: forwarded from the caller.
    named("cuStreamSynchronize", unsafe {
        result::stream::synchronize(stream)
    })
}

/// `cuThreadExchangeStreamCaptureMode(mode)`—Set the calling thread's stream-capture
/// interaction mode to `mode`; the mode it had.
///
/// # Safety
///
/// Only the presence check of the module docs.
pub(crate) unsafe fn exchange_capture_mode(
    mode: sys::CUstreamCaptureMode,
) -> Result<sys::CUstreamCaptureMode> {
    let mut m = mode;
    // SAFETY: a valid in/out pointer; libcuda is present (the caller's).
    cu("cuThreadExchangeStreamCaptureMode", unsafe {
        sys::cuThreadExchangeStreamCaptureMode(&mut m)
    })?;
    Ok(m)
}

/// `cuStreamQuery(stream)`—Whether the work queued on `stream` has finished: `Ok(false)` for
/// `CUDA_ERROR_NOT_READY`. On a capturing stream the query is illegal and invalidates the
/// capture (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`): that is how the crate invalidates a
/// capture its work may have joined.
///
/// # Safety
///
/// `stream` is live.
pub(crate) unsafe fn query(stream: sys::CUstream) -> Result<bool> {
    // SAFETY: forwarded from the caller.
    match unsafe { sys::cuStreamQuery(stream) } {
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        r => cu("cuStreamQuery", r).map(|()| true),
    }
}

/// `cuStreamWaitEvent(stream, event, 0)`—Work queued on `stream` from now on waits for the work
/// before `event`'s latest record.
///
/// # Safety
///
/// `stream` and `event` are live.
pub(crate) unsafe fn wait_event(stream: sys::CUstream, event: sys::CUevent) -> Result<()> {
    // SAFETY: forwarded from the caller; default flags.
    named("cuStreamWaitEvent", unsafe {
        result::stream::wait_event(
            stream,
            event,
            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
        )
    })
}

/// `cuStreamIsCapturing(stream)`—Whether the stream is in capture mode (an active capture, or
/// an invalidated one not yet ended).
///
/// # Errors
///
/// [`crate::Error::Cuda`] (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` for the legacy default stream
/// while a blocking stream captures).
///
/// # Safety
///
/// `stream` is live (or the legacy stream), its context current.
#[inline]
pub(crate) unsafe fn is_capturing(stream: sys::CUstream) -> Result<bool> {
    // SAFETY: forwarded from the caller.
    let status = named("cuStreamIsCapturing", unsafe {
        result::stream::is_capturing(stream)
    })?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// `cuLaunchHostFunc(stream, f, arg)`—Queue a call of `f(arg)` on a driver thread once the
/// stream reaches this point.
///
/// # Safety
///
/// `stream` is live; `arg` stays valid for every run of `f` (more than one, if the stream is
/// capturing a graph that is launched several times); `f` makes no CUDA calls and does not
/// unwind.
pub(crate) unsafe fn launch_host_func(
    stream: sys::CUstream,
    f: unsafe extern "C" fn(*mut std::ffi::c_void),
    arg: *mut std::ffi::c_void,
) -> Result<()> {
    // SAFETY: forwarded from the caller.
    named("cuLaunchHostFunc", unsafe {
        result::stream::launch_host_function(stream, f, arg)
    })
}
