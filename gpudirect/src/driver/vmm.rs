//! Virtual memory management: physical allocations, address ranges, mappings, access
//! (`cuMemCreate`, `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`, ...).

use crate::error::{Error, Result, cu};
use cudarc::driver::sys;

/// `cuMemGetAllocationGranularity(prop, flag)`—The size unit, in bytes, of allocations made
/// with `prop`.
///
/// # Safety
///
/// Only the presence check of the module docs; `prop` is read during the call.
pub(crate) unsafe fn granularity(
    prop: &sys::CUmemAllocationProp,
    flag: sys::CUmemAllocationGranularity_flags,
) -> Result<usize> {
    let mut g = 0;
    // SAFETY: valid prop and out-pointer.
    cu("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(&mut g, prop, flag)
    })?;
    Ok(g)
}

/// `cuMemAddressReserve(size, align, 0, 0)`—Reserve `size` bytes of device address space
/// (aligned to `align`, 0 for the default), anywhere.
///
/// # Safety
///
/// A context is current.
pub(crate) unsafe fn reserve(size: usize, align: usize) -> Result<sys::CUdeviceptr> {
    let mut ptr = 0;
    // SAFETY: valid out-pointer; no fixed address, flags 0.
    cu("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(&mut ptr, size, align, 0, 0)
    })?;
    Ok(ptr)
}

/// `cuMemAddressFree(ptr, size)`—Give back a range from [`reserve`].
///
/// # Safety
///
/// `ptr..ptr + size` is a whole reservation, freed once, with nothing mapped in it any more.
pub(crate) unsafe fn address_free(ptr: sys::CUdeviceptr, size: usize) -> Result<()> {
    // SAFETY: forwarded from the caller.
    cu("cuMemAddressFree", unsafe {
        sys::cuMemAddressFree(ptr, size)
    })
}

/// `cuMemCreate(size, prop, 0)`—A physical allocation of `size` bytes (a multiple of the
/// granularity).
///
/// # Safety
///
/// A context is current.
pub(crate) unsafe fn create(
    size: usize,
    prop: &sys::CUmemAllocationProp,
) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut h = 0;
    // SAFETY: valid prop and out-pointer; flags 0.
    cu("cuMemCreate", unsafe {
        sys::cuMemCreate(&mut h, size, prop, 0)
    })?;
    Ok(h)
}

/// `cuMemRelease(handle)`—Release a physical allocation (created or imported); its memory is
/// freed once no mapping uses it.
///
/// # Safety
///
/// `handle` is live and released once.
pub(crate) unsafe fn release(handle: sys::CUmemGenericAllocationHandle) -> Result<()> {
    // SAFETY: forwarded from the caller.
    cu("cuMemRelease", unsafe { sys::cuMemRelease(handle) })
}

/// `cuMemMap(ptr, size, 0, handle, 0)`—Map the first `size` bytes of `handle` at `ptr`.
///
/// # Safety
///
/// `ptr..ptr + size` lies in a reservation and is unmapped; `handle` holds at least `size`
/// bytes.
pub(crate) unsafe fn map(
    ptr: sys::CUdeviceptr,
    size: usize,
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<()> {
    // SAFETY: forwarded from the caller; offset and flags 0.
    cu("cuMemMap", unsafe {
        sys::cuMemMap(ptr, size, 0, handle, 0)
    })
}

/// `cuMemUnmap(ptr, size)`—Unmap a range mapped by [`map`].
///
/// # Safety
///
/// No work that uses the range is pending, and nothing else refers to it.
pub(crate) unsafe fn unmap(ptr: sys::CUdeviceptr, size: usize) -> Result<()> {
    // SAFETY: forwarded from the caller.
    cu("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr, size) })
}

/// `cuMemSetAccess(ptr, size, desc, n)`—Set who may access a mapped range.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for an empty `desc`, before any driver call; [`Error::Cuda`].
///
/// # Safety
///
/// `ptr..ptr + size` is mapped (by [`map`]).
pub(crate) unsafe fn set_access(
    ptr: sys::CUdeviceptr,
    size: usize,
    desc: &[sys::CUmemAccessDesc],
) -> Result<()> {
    if desc.is_empty() {
        return Err(Error::invalid("desc", 0, "at least one access descriptor"));
    }
    // SAFETY: `desc.len()` valid descriptors; the range is the caller's.
    cu("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(ptr, size, desc.as_ptr(), desc.len())
    })
}

/// `cuMemGetAccess(location, ptr)`—The `CU_MEM_ACCESS_FLAGS_*` that `location` has on the
/// mapping at `ptr`.
///
/// # Safety
///
/// Only the presence check of the module docs (the driver checks `ptr`).
#[cfg(feature = "p2p")]
pub(crate) unsafe fn get_access(
    location: &sys::CUmemLocation,
    ptr: sys::CUdeviceptr,
) -> Result<u64> {
    let mut flags = 0;
    // SAFETY: valid in and out pointers.
    cu("cuMemGetAccess", unsafe {
        sys::cuMemGetAccess(&mut flags, location, ptr)
    })?;
    Ok(flags)
}

/// `cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)`—A new fd for the physical allocation
/// `handle`; the caller owns it.
///
/// # Safety
///
/// `handle` is live and was created with the POSIX fd handle type requested.
#[cfg(feature = "p2p")]
pub(crate) unsafe fn export_fd(handle: sys::CUmemGenericAllocationHandle) -> Result<i32> {
    let mut fd: libc::c_int = -1;
    // SAFETY: the POSIX fd handle type writes an int; flags 0.
    cu("cuMemExportToShareableHandle", unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut libc::c_int).cast(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    Ok(fd)
}

/// `cuMemRetainAllocationHandle(ptr)`—The physical allocation mapped at `ptr`, with one more
/// reference on it: give that back with [`release`].
///
/// # Safety
///
/// A context is current (the driver checks that `ptr` is mapped VMM memory).
#[cfg(all(feature = "p2p", feature = "transfer"))]
pub(crate) unsafe fn retain_handle(
    ptr: sys::CUdeviceptr,
) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut h = 0;
    // SAFETY: valid out-pointer; the address is passed by value as the driver's `void *`.
    cu("cuMemRetainAllocationHandle", unsafe {
        sys::cuMemRetainAllocationHandle(&mut h, ptr as usize as *mut std::ffi::c_void)
    })?;
    Ok(h)
}

/// `cuMemImportFromShareableHandle(fd, POSIX_FILE_DESCRIPTOR)`—The physical allocation behind
/// an fd from [`export_fd`] (possibly another process's); release it with [`release`].
///
/// # Safety
///
/// A context is current; `fd` is open for the duration of the call.
#[cfg(feature = "p2p")]
pub(crate) unsafe fn import_fd(fd: i32) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut h = 0;
    // SAFETY: for the POSIX fd type the handle argument carries the descriptor's value.
    cu("cuMemImportFromShareableHandle", unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut h,
            fd as isize as *mut std::ffi::c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    })?;
    Ok(h)
}
