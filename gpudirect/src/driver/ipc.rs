//! CUDA IPC handles for `cuMemAlloc` memory and interprocess events (`cuIpc*`).

use crate::error::{Result, cu};
use cudarc::driver::sys;

/// `cuIpcGetMemHandle(base)`—A handle another process can open for the allocation at `base`.
///
/// # Safety
///
/// A context is current; `base` is the start of a live `cuMemAlloc` allocation.
pub(crate) unsafe fn get_mem_handle(base: sys::CUdeviceptr) -> Result<sys::CUipcMemHandle> {
    // SAFETY: all-zero is a valid CUipcMemHandle (plain bytes).
    let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer; `base` is the caller's.
    cu("cuIpcGetMemHandle", unsafe {
        sys::cuIpcGetMemHandle(&mut h, base)
    })?;
    Ok(h)
}

/// `cuIpcOpenMemHandle_v2(handle, flags)`—Map another process's allocation; the base of the
/// mapping. Close it with [`close_mem_handle`].
///
/// # Safety
///
/// A context is current (the driver checks the handle: plain bytes from a peer).
pub(crate) unsafe fn open_mem_handle(
    handle: sys::CUipcMemHandle,
    flags: sys::CUipcMem_flags,
) -> Result<sys::CUdeviceptr> {
    let mut base = 0;
    // SAFETY: valid out-pointer.
    cu("cuIpcOpenMemHandle_v2", unsafe {
        sys::cuIpcOpenMemHandle_v2(&mut base, handle, flags as u32)
    })?;
    Ok(base)
}

/// `cuIpcCloseMemHandle(base)`—Unmap a mapping from [`open_mem_handle`].
///
/// # Safety
///
/// `base` came from [`open_mem_handle`] and is closed once; no work that uses it is pending.
pub(crate) unsafe fn close_mem_handle(base: sys::CUdeviceptr) -> Result<()> {
    // SAFETY: forwarded from the caller.
    cu("cuIpcCloseMemHandle", unsafe {
        sys::cuIpcCloseMemHandle(base)
    })
}

/// `cuIpcGetEventHandle(event)`—A handle another process can open for an interprocess event.
///
/// # Safety
///
/// `event` is live and was created with `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`.
pub(crate) unsafe fn get_event_handle(event: sys::CUevent) -> Result<sys::CUipcEventHandle> {
    // SAFETY: all-zero is a valid CUipcEventHandle (plain bytes).
    let mut h: sys::CUipcEventHandle = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer; the event is the caller's.
    cu("cuIpcGetEventHandle", unsafe {
        sys::cuIpcGetEventHandle(&mut h, event)
    })?;
    Ok(h)
}

/// `cuIpcOpenEventHandle(handle)`—Open another process's event; destroy it with
/// [`super::event::destroy`].
///
/// # Safety
///
/// A context is current (the driver checks the handle: plain bytes from a peer).
pub(crate) unsafe fn open_event_handle(handle: sys::CUipcEventHandle) -> Result<sys::CUevent> {
    let mut ev = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    cu("cuIpcOpenEventHandle", unsafe {
        sys::cuIpcOpenEventHandle(&mut ev, handle)
    })?;
    Ok(ev)
}
