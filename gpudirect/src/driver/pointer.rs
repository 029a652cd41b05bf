//! Pointer attributes (`cuPointerGetAttribute`, `cuPointerGetAttributes`,
//! `cuPointerSetAttribute`).

use crate::error::{Error, Result, cu};
use cudarc::driver::sys;
use std::ffi::c_void;
#[cfg(feature = "p2p")]
use std::mem::MaybeUninit;

/// `cuPointerGetAttribute(attr, ptr)`—One attribute of the memory at `ptr`, as a `T`.
///
/// # Safety
///
/// `T` is the type the driver writes for `attr` (`CUmemoryPool` for `MEMPOOL_HANDLE`, a C
/// `int` for `DEVICE_ORDINAL`, ...).
#[cfg(feature = "p2p")]
pub(crate) unsafe fn attribute<T: Copy>(
    attr: sys::CUpointer_attribute,
    ptr: sys::CUdeviceptr,
) -> Result<T> {
    let mut v = MaybeUninit::<T>::uninit();
    // SAFETY: an out-pointer of the attribute's type (the caller's); the driver checks `ptr`.
    cu("cuPointerGetAttribute", unsafe {
        sys::cuPointerGetAttribute(v.as_mut_ptr().cast(), attr, ptr)
    })?;
    // SAFETY: written by the driver on success.
    Ok(unsafe { v.assume_init() })
}

/// `cuPointerGetAttributes(n, attrs, data, ptr)`—Several attributes at once: `data[i]` receives
/// `attrs[i]`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] when the slices differ in length, before any driver call;
/// [`Error::Cuda`] (`CUDA_ERROR_INVALID_VALUE` for an address the driver does not know).
///
/// # Safety
///
/// Each `data[i]` is valid for a write of the type the driver writes for `attrs[i]`.
pub(crate) unsafe fn attributes(
    attrs: &mut [sys::CUpointer_attribute],
    data: &mut [*mut c_void],
    ptr: sys::CUdeviceptr,
) -> Result<()> {
    if attrs.len() != data.len() {
        return Err(Error::invalid(
            "data",
            data.len(),
            format!("must hold one pointer per attribute ({})", attrs.len()),
        ));
    }
    let n =
        u32::try_from(attrs.len()).map_err(|_| Error::invalid("attrs", attrs.len(), "too many"))?;
    // SAFETY: `n` attributes with their out-pointers (the caller's).
    cu("cuPointerGetAttributes", unsafe {
        sys::cuPointerGetAttributes(n, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr)
    })
}

/// `cuPointerSetAttribute(value, attr, ptr)`—Set one attribute of the memory at `ptr`.
///
/// # Safety
///
/// `T` is the type the driver reads for `attr` (an unsigned int for `SYNC_MEMOPS`).
#[cfg(feature = "rdma")]
pub(crate) unsafe fn set_attribute<T: Copy>(
    value: &T,
    attr: sys::CUpointer_attribute,
    ptr: sys::CUdeviceptr,
) -> Result<()> {
    // SAFETY: the value is read through the pointer during the call; the driver checks `ptr`.
    cu("cuPointerSetAttribute", unsafe {
        sys::cuPointerSetAttribute((value as *const T).cast(), attr, ptr)
    })
}
