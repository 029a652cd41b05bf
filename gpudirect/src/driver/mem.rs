//! Device and pinned host memory, copies and address ranges (`cuMem*`).

use super::named::named;
use crate::error::{Result, cu};
use cudarc::driver::{result, sys};
use std::ffi::c_void;

/// `cuMemAlloc_v2(bytes)`—`bytes` bytes of device memory in the current context; contents
/// unspecified.
///
/// # Safety
///
/// A context is current.
pub(crate) unsafe fn alloc(bytes: usize) -> Result<sys::CUdeviceptr> {
    // SAFETY: the context is the caller's; the memory is only handed out as an address.
    named("cuMemAlloc_v2", unsafe { result::malloc_sync(bytes) })
}

/// `cuMemFree_v2(ptr)`—Free device memory (from [`alloc`], or a pool allocation or import).
///
/// # Safety
///
/// `ptr` is such an allocation, freed once; no work that uses it is pending.
pub(crate) unsafe fn free(ptr: sys::CUdeviceptr) -> Result<()> {
    // SAFETY: forwarded from the caller.
    named("cuMemFree_v2", unsafe { result::free_sync(ptr) })
}

/// `cuMemHostAlloc(bytes, flags)`—`bytes` bytes of pinned host memory; contents unspecified.
///
/// # Safety
///
/// A context is current; `flags` are `CU_MEMHOSTALLOC_*` flags.
pub(crate) unsafe fn host_alloc(bytes: usize, flags: u32) -> Result<*mut c_void> {
    // SAFETY: forwarded from the caller.
    named("cuMemHostAlloc", unsafe {
        result::malloc_host(bytes, flags)
    })
}

/// `cuMemFreeHost(p)`—Free pinned host memory from [`host_alloc`].
///
/// # Safety
///
/// `p` came from [`host_alloc`] and is freed once; no work that uses it is pending (pinned
/// memory has no stream-ordered free).
pub(crate) unsafe fn free_host(p: *mut c_void) -> Result<()> {
    // SAFETY: forwarded from the caller.
    named("cuMemFreeHost", unsafe { result::free_host(p) })
}

/// `cuMemHostGetDevicePointer_v2(p, 0)`—The device address of pinned (allocated or registered)
/// host memory.
///
/// # Safety
///
/// A context is current; `p` is pinned host memory of it.
pub(crate) unsafe fn host_device_pointer(p: *mut c_void) -> Result<sys::CUdeviceptr> {
    let mut d = 0;
    // SAFETY: one valid out-pointer; flags 0; the rest is the caller's.
    cu("cuMemHostGetDevicePointer_v2", unsafe {
        sys::cuMemHostGetDevicePointer_v2(&mut d, p, 0)
    })?;
    Ok(d)
}

/// `cuMemHostRegister_v2(p, bytes, flags)`—Pin `bytes` bytes of host memory in place.
///
/// # Safety
///
/// A context is current; `p..p + bytes` is live host memory that stays allocated, at the same
/// address, until [`host_unregister`]; `flags` are `CU_MEMHOSTREGISTER_*` flags.
pub(crate) unsafe fn host_register(p: *mut c_void, bytes: usize, flags: u32) -> Result<()> {
    // SAFETY: forwarded from the caller.
    cu("cuMemHostRegister_v2", unsafe {
        sys::cuMemHostRegister_v2(p, bytes, flags)
    })
}

/// `cuMemHostUnregister(p)`—Unpin memory pinned by [`host_register`].
///
/// # Safety
///
/// `p` was registered and no work that uses it is pending.
pub(crate) unsafe fn host_unregister(p: *mut c_void) -> Result<()> {
    // SAFETY: forwarded from the caller.
    cu("cuMemHostUnregister", unsafe {
        sys::cuMemHostUnregister(p)
    })
}

/// `cuMemsetD8Async(ptr, value, bytes, stream)`—Queue filling `bytes` bytes with `value`.
///
/// # Safety
///
/// `ptr..ptr + bytes` is device memory that stays allocated, and is not read or written by
/// anyone else, until the work completes; `stream` is live.
pub(crate) unsafe fn memset_d8_async(
    ptr: sys::CUdeviceptr,
    value: u8,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: forwarded from the caller.
    named("cuMemsetD8Async", unsafe {
        result::memset_d8_async(ptr, value, bytes, stream)
    })
}

/// `cuMemcpyHtoDAsync_v2`—Queue a copy of `bytes` bytes from host `src` to device `dst`.
///
/// # Safety
///
/// Both ranges stay valid until the copy completes; nobody reads or writes `dst`, or writes
/// `src`, meanwhile; `stream` is live.
#[inline]
pub(crate) unsafe fn copy_htod_async(
    dst: sys::CUdeviceptr,
    src: *const c_void,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: forwarded from the caller.
    cu("cuMemcpyHtoDAsync_v2", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, src, bytes, stream)
    })
}

/// `cuMemcpyDtoHAsync_v2`—Queue a copy of `bytes` bytes from device `src` to host `dst`.
///
/// # Safety
///
/// As [`copy_htod_async`].
#[inline]
pub(crate) unsafe fn copy_dtoh_async(
    dst: *mut c_void,
    src: sys::CUdeviceptr,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: forwarded from the caller.
    cu("cuMemcpyDtoHAsync_v2", unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst, src, bytes, stream)
    })
}

/// `cuMemcpyDtoDAsync_v2`—Queue a copy of `bytes` bytes between device addresses (of one
/// context, or of peers with access enabled).
///
/// # Safety
///
/// As [`copy_htod_async`].
#[inline]
pub(crate) unsafe fn copy_dtod_async(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: forwarded from the caller.
    named("cuMemcpyDtoDAsync_v2", unsafe {
        result::memcpy_dtod_async(dst, src, bytes, stream)
    })
}

/// `cuMemcpyAsync`—Queue a copy of `bytes` bytes between two unified addresses (host or device:
/// the driver tells which from the address).
///
/// # Safety
///
/// As [`copy_htod_async`].
#[inline]
pub(crate) unsafe fn copy_async(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: forwarded from the caller.
    cu("cuMemcpyAsync", unsafe {
        sys::cuMemcpyAsync(dst, src, bytes, stream)
    })
}

/// `cuMemcpyBatchAsync_v2` (or the CUDA 12.8 `cuMemcpyBatchAsync`)—Queue `dsts.len()` copies
/// on `stream` in one call, each `sizes[i]` bytes from `srcs[i]` to `dsts[i]` (any memory the
/// driver tells from the address), every source read in stream order as [`copy_async`] does.
/// The copies of one batch run in no order among themselves (overlapping destinations get
/// unspecified bytes). Returns `Ok(false)`, queueing nothing, where the driver lacks the call,
/// the batch is empty, or `stream` is the legacy default stream.
///
/// # Safety
///
/// As [`copy_async`] for every copy; the three slices have one length.
#[cfg_attr(
    not(feature = "p2p"),
    allow(
        dead_code,
        reason = "peer copies and the intra-node transfer path use it"
    )
)]
pub(crate) unsafe fn copy_batch_async(
    dsts: &mut [sys::CUdeviceptr],
    srcs: &mut [sys::CUdeviceptr],
    sizes: &mut [usize],
    stream: sys::CUstream,
) -> Result<bool> {
    let n = dsts.len();
    // The legacy default stream (a null handle, or `CU_STREAM_LEGACY`) is refused by the batch
    // call: copy one by one there.
    if n == 0 || srcs.len() != n || sizes.len() != n || stream.is_null() || stream as usize == 1 {
        return Ok(false);
    }
    let Some(batch) = gpudirect_sys::cuda::driver()
        .ok()
        .and_then(|d| d.memcpy_batch())
    else {
        return Ok(false);
    };
    // SAFETY: forwarded from the caller; three arrays of one length.
    let rc = unsafe { batch.call(dsts, srcs, sizes, stream.cast()) };
    if rc == 0 {
        Ok(true)
    } else {
        // The raw code (this entry point is called through our own loader, not cudarc's enum).
        Err(crate::error::Error::Cuda {
            call: "cuMemcpyBatchAsync",
            code: rc as u32,
            name: format!("CUresult {rc}"),
        })
    }
}

/// `cuMemGetAddressRange_v2(ptr)`—The base and size in bytes of the allocation (or VMM mapping)
/// that holds `ptr`.
///
/// # Safety
///
/// A context is current (the driver checks `ptr`).
#[cfg(any(feature = "p2p", feature = "storage"))]
pub(crate) unsafe fn address_range(ptr: sys::CUdeviceptr) -> Result<(sys::CUdeviceptr, usize)> {
    let (mut base, mut size) = (0, 0);
    // SAFETY: two valid out-pointers.
    cu("cuMemGetAddressRange_v2", unsafe {
        sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
    })?;
    Ok((base, size))
}

/// `cuMemGetHandleForAddressRange(.., CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)`—A new dma-buf fd
/// over `len` bytes at `base` (both page aligned); the caller owns it.
///
/// # Safety
///
/// A context is current and the driver has the symbol (CUDA 11.7+, checked by name first). The
/// fd reaches the memory for as long as it, or any duplicate, is open, and the driver does not
/// keep the memory alive for it: the caller keeps the memory allocated until every copy of the
/// fd is closed.
pub(crate) unsafe fn dmabuf_fd(base: sys::CUdeviceptr, len: usize) -> Result<i32> {
    let mut fd: i32 = -1;
    // SAFETY: the out-pointer is an int, as this handle type requires; the driver checks the
    // range.
    cu("cuMemGetHandleForAddressRange", unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut i32).cast(),
            base,
            len,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    })?;
    Ok(fd)
}
