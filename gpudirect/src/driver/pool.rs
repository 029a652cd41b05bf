//! Stream-ordered memory pools (`cuMemPool*`, `cuMemAllocFromPoolAsync`).

use super::named::named;
use crate::error::{Error, Result, cu};
use cudarc::driver::{result, sys};

/// `cuMemPoolCreate(props)`—A new memory pool.
///
/// # Safety
///
/// A context is current.
pub(crate) unsafe fn create(props: &sys::CUmemPoolProps) -> Result<sys::CUmemoryPool> {
    // SAFETY: `props` is read during the call.
    named("cuMemPoolCreate", unsafe {
        result::mem_pool::create(props)
    })
}

/// `cuMemPoolDestroy(pool)`—Destroy a pool from [`create`] or [`import_fd`].
///
/// # Safety
///
/// `pool` is live and destroyed once; none of its allocations or imports is still in use.
pub(crate) unsafe fn destroy(pool: sys::CUmemoryPool) -> Result<()> {
    // SAFETY: forwarded from the caller.
    named("cuMemPoolDestroy", unsafe {
        result::mem_pool::destroy(pool)
    })
}

/// `cuMemAllocFromPoolAsync(bytes, pool, stream)`—Queue an allocation of `bytes` bytes from
/// `pool` on `stream`; usable on other streams once the stream has passed it.
///
/// # Safety
///
/// `pool` and `stream` are live, of the current context's device.
pub(crate) unsafe fn alloc_async(
    bytes: usize,
    pool: sys::CUmemoryPool,
    stream: sys::CUstream,
) -> Result<sys::CUdeviceptr> {
    // SAFETY: forwarded from the caller.
    named("cuMemAllocFromPoolAsync", unsafe {
        result::mem_pool::alloc_async(pool, bytes, stream)
    })
}

/// `cuMemPoolExportPointer(ptr)`—What another process needs to import the pool allocation at
/// `ptr` (into its import of the pool).
///
/// # Safety
///
/// `ptr` is a live allocation of an exportable pool.
pub(crate) unsafe fn export_pointer(ptr: sys::CUdeviceptr) -> Result<sys::CUmemPoolPtrExportData> {
    // SAFETY: all-zero is a valid CUmemPoolPtrExportData (plain bytes).
    let mut d: sys::CUmemPoolPtrExportData = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer; `ptr` is the caller's.
    cu("cuMemPoolExportPointer", unsafe {
        sys::cuMemPoolExportPointer(&mut d, ptr)
    })?;
    Ok(d)
}

/// `cuMemPoolImportPointer(pool, data)`—Map another process's pool allocation; free it with
/// [`super::mem::free`].
///
/// # Safety
///
/// `pool` is a live imported pool; the driver checks `data` (plain bytes from a peer).
pub(crate) unsafe fn import_pointer(
    pool: sys::CUmemoryPool,
    data: &sys::CUmemPoolPtrExportData,
) -> Result<sys::CUdeviceptr> {
    let mut ptr = 0;
    let mut d = *data;
    // SAFETY: valid in/out pointers; the pool is the caller's.
    cu("cuMemPoolImportPointer", unsafe {
        sys::cuMemPoolImportPointer(&mut ptr, pool, &mut d)
    })?;
    Ok(ptr)
}

/// `cuMemPoolExportToShareableHandle(POSIX_FILE_DESCRIPTOR)`—A new fd for `pool`; the caller
/// owns it.
///
/// # Safety
///
/// `pool` is live and was created with the POSIX fd handle type.
pub(crate) unsafe fn export_fd(pool: sys::CUmemoryPool) -> Result<i32> {
    let mut fd: libc::c_int = -1;
    // SAFETY: the POSIX fd handle type writes an int; flags 0.
    cu("cuMemPoolExportToShareableHandle", unsafe {
        sys::cuMemPoolExportToShareableHandle(
            (&mut fd as *mut libc::c_int).cast(),
            pool,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    Ok(fd)
}

/// `cuMemPoolImportFromShareableHandle(fd, POSIX_FILE_DESCRIPTOR)`—The pool behind an fd from
/// [`export_fd`] (possibly another process's); destroy it with [`destroy`].
///
/// # Safety
///
/// A context is current; `fd` is open for the duration of the call.
pub(crate) unsafe fn import_fd(fd: i32) -> Result<sys::CUmemoryPool> {
    let mut pool = std::ptr::null_mut();
    // SAFETY: for the POSIX fd type the handle argument carries the descriptor's value; flags 0.
    cu("cuMemPoolImportFromShareableHandle", unsafe {
        sys::cuMemPoolImportFromShareableHandle(
            &mut pool,
            fd as isize as *mut std::ffi::c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    Ok(pool)
}

/// `cuMemPoolGetAccess(pool, location)`—The access `location` has to `pool`'s memory.
///
/// # Safety
///
/// `pool` is live.
pub(crate) unsafe fn get_access(
    pool: sys::CUmemoryPool,
    location: &sys::CUmemLocation,
) -> Result<sys::CUmemAccess_flags> {
    let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
    let mut loc = *location;
    // SAFETY: valid in/out pointers; the pool is the caller's.
    cu("cuMemPoolGetAccess", unsafe {
        sys::cuMemPoolGetAccess(&mut flags, pool, &mut loc)
    })?;
    Ok(flags)
}

/// `cuMemPoolSetAccess(pool, desc, n)`—Set who may access `pool`'s memory.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for an empty `desc`, before any driver call; [`Error::Cuda`].
///
/// # Safety
///
/// `pool` is live.
pub(crate) unsafe fn set_access(
    pool: sys::CUmemoryPool,
    desc: &[sys::CUmemAccessDesc],
) -> Result<()> {
    if desc.is_empty() {
        return Err(Error::invalid("desc", 0, "at least one access descriptor"));
    }
    // SAFETY: `desc.len()` valid descriptors; the pool is the caller's.
    cu("cuMemPoolSetAccess", unsafe {
        sys::cuMemPoolSetAccess(pool, desc.as_ptr(), desc.len())
    })
}
