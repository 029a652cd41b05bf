//! Devices (`cuDevice*`), read without creating a context.

use super::named::named;
use crate::error::{Error, Result, cu};
use cudarc::driver::{result, sys};

/// `cuDeviceGetCount`—How many CUDA devices are visible.
///
/// # Safety
///
/// `cuInit` has succeeded.
pub(crate) unsafe fn count() -> Result<usize> {
    let n = named("cuDeviceGetCount", result::device::get_count())?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// `cuDeviceGet(ordinal)`—The device handle of `ordinal`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for an ordinal past `i32::MAX`, before any driver call;
/// [`Error::Cuda`] (`CUDA_ERROR_INVALID_DEVICE`) past the device count.
///
/// # Safety
///
/// `cuInit` has succeeded.
pub(crate) unsafe fn get(ordinal: usize) -> Result<sys::CUdevice> {
    let ordinal = i32::try_from(ordinal)
        .map_err(|_| Error::invalid("ordinal", ordinal, "must fit a C int"))?;
    named("cuDeviceGet", result::device::get(ordinal))
}

/// Up to `N - 1` bytes of a NUL-terminated string the driver writes into a buffer of `N`.
fn c_string<const N: usize>(
    call: &'static str,
    fill: impl FnOnce(*mut std::ffi::c_char, i32) -> sys::CUresult,
) -> Result<String> {
    let mut buf = [0 as std::ffi::c_char; N];
    cu(call, fill(buf.as_mut_ptr(), N as i32))?;
    // The driver NUL-terminates within the length given; the last byte stays 0 regardless.
    buf[N - 1] = 0;
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// `cuDeviceGetName`—The device's name (at most 255 bytes).
///
/// # Safety
///
/// `dev` came from [`get`].
pub(crate) unsafe fn name(dev: sys::CUdevice) -> Result<String> {
    c_string::<256>("cuDeviceGetName", |p, n| {
        // SAFETY: `p` is a buffer of `n` bytes; the device is the caller's.
        unsafe { sys::cuDeviceGetName(p, n, dev) }
    })
}

/// `cuDeviceGetPCIBusId`—The device's PCI address, such as `0000:00:06.0` (as the driver
/// spells it: upper-case hex).
///
/// # Safety
///
/// `dev` came from [`get`].
pub(crate) unsafe fn pci_bus_id(dev: sys::CUdevice) -> Result<String> {
    c_string::<64>("cuDeviceGetPCIBusId", |p, n| {
        // SAFETY: `p` is a buffer of `n` bytes; the device is the caller's.
        unsafe { sys::cuDeviceGetPCIBusId(p, n, dev) }
    })
}

#[cfg(all(feature = "p2p", feature = "transfer"))]
/// `cuDeviceGetUuid`—The device's UUID: the name every process on the node gives it, whatever
/// its `CUDA_VISIBLE_DEVICES`.
///
/// # Safety
///
/// `dev` came from [`get`].
pub(crate) unsafe fn uuid(dev: sys::CUdevice) -> Result<[u8; 16]> {
    let u = named("cuDeviceGetUuid", result::device::get_uuid(dev))?;
    Ok(u.bytes.map(|b| b as u8))
}

/// `cuDeviceTotalMem_v2`—The device's memory, in bytes.
///
/// # Safety
///
/// `dev` came from [`get`].
pub(crate) unsafe fn total_mem(dev: sys::CUdevice) -> Result<usize> {
    // SAFETY: forwarded from the caller.
    named("cuDeviceTotalMem_v2", unsafe {
        result::device::total_mem(dev)
    })
}

/// `cuDeviceGetAttribute(attr, dev)`—One attribute of the device.
///
/// # Safety
///
/// `dev` came from [`get`].
pub(crate) unsafe fn attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    // SAFETY: forwarded from the caller.
    named("cuDeviceGetAttribute", unsafe {
        result::device::get_attribute(dev, attr)
    })
}
