//! VMM device memory: `cuMemCreate` with the GPUDirect RDMA flag, reserved, mapped, access set.

use super::{DeviceMemory, DeviceMemoryMut, MemoryKind, Pod, bind, byte_size, forked};
use crate::error::{Error, Result, cu, from_driver};
use cudarc::driver::{CudaContext, sys};
use std::marker::PhantomData;
use std::sync::Arc;

/// Device memory made with the virtual memory management API: `cuMemCreate` (pinned, on one
/// device, `gpuDirectRDMACapable = 1`, exportable as a POSIX fd), `cuMemAddressReserve`,
/// `cuMemMap` and `cuMemSetAccess` (read-write for the owning device).
///
/// The physical size is rounded up to the allocation granularity
/// ([`mapped_bytes`](Self::mapped_bytes)); [`len`](DeviceMemory::len) is the requested element
/// count. Drop unmaps, frees the address range and releases the handle; in a forked child it
/// leaks.
#[derive(Debug)]
#[doc(alias = "cuMemCreate")]
#[doc(alias = "cuMemMap")]
pub struct VmmBuffer<T: Pod> {
    ptr: u64,
    len: usize,
    size: usize,
    handle: sys::CUmemGenericAllocationHandle,
    ctx: Arc<CudaContext>,
    pid: u32,
    _elem: PhantomData<T>,
}

fn prop(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct for which all-zero is valid (TYPE_INVALID, HANDLE_TYPE_NONE, null).
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    p.location =
        crate::cuda::mem_location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, ordinal);
    p.allocFlags.gpuDirectRDMACapable = 1;
    p
}

/// `size` rounded up to a multiple of `granularity` (a power of two or any positive value).
pub(crate) fn round_up(size: usize, granularity: usize) -> Option<usize> {
    let g = granularity.max(1);
    size.checked_add(g - 1).map(|s| s / g * g)
}

impl<T: Pod> VmmBuffer<T> {
    /// Allocate and map `len` elements on `ctx`'s device.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for `len == 0`; [`Error::Unsupported`] when the device lacks
    /// VMM or GPUDirect RDMA with VMM (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`);
    /// [`Error::Cuda`] from any step, after undoing the earlier ones.
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html>
    #[doc(alias = "cuMemGetAllocationGranularity")]
    #[doc(alias = "cuMemAddressReserve")]
    #[doc(alias = "cuMemSetAccess")]
    pub fn alloc(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
        let bytes = byte_size::<T>(len)?;
        crate::cuda::init()?;
        super::Tracker::global().reap();
        bind(ctx)?;
        use sys::CUdevice_attribute as A;
        for (attr, what) in [
            (
                A::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
                "virtual memory management",
            ),
            (
                A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                "GPUDirect RDMA with VMM memory",
            ),
        ] {
            let v = ctx
                .attribute(attr)
                .map_err(|e| from_driver("cuDeviceGetAttribute", e))?;
            if v == 0 {
                return Err(Error::Unsupported {
                    what: what.into(),
                    reason: format!("device {} reports {attr:?} = 0", ctx.ordinal()),
                });
            }
        }
        let p = prop(ctx.ordinal() as i32);
        let mut gran = 0;
        // SAFETY: valid prop and out-pointer.
        cu("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut gran,
                &p,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        let size = round_up(bytes, gran)
            .ok_or_else(|| Error::invalid("len", len, "size overflows when rounded"))?;
        let mut handle = 0;
        // SAFETY: valid prop and out-pointer; size is a multiple of the granularity.
        cu("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut handle, size, &p, 0)
        })?;
        let mut ptr = 0;
        // SAFETY: out-pointer valid; alignment = granularity, no fixed address.
        let r = cu("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut ptr, size, gran, 0, 0)
        });
        if let Err(e) = r {
            // SAFETY: the handle was created above and is not mapped.
            unsafe { sys::cuMemRelease(handle) };
            return Err(e);
        }
        // SAFETY: the reserved range and the handle are both `size` bytes.
        let r = cu("cuMemMap", unsafe {
            sys::cuMemMap(ptr, size, 0, handle, 0)
        });
        if let Err(e) = r {
            // SAFETY: undo the reservation and the handle made above.
            unsafe {
                sys::cuMemAddressFree(ptr, size);
                sys::cuMemRelease(handle);
            }
            return Err(e);
        }
        let buf = VmmBuffer {
            ptr,
            len,
            size,
            handle,
            ctx: ctx.clone(),
            pid: std::process::id(),
            _elem: PhantomData,
        };
        let access = sys::CUmemAccessDesc {
            location: p.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the mapped range; one access descriptor. On error `buf`'s drop undoes it all.
        cu("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(ptr, size, &access, 1)
        })?;
        Ok(buf)
    }

    /// Bytes mapped: the requested size rounded up to the allocation granularity.
    pub fn mapped_bytes(&self) -> usize {
        self.size
    }

    /// The `CUmemGenericAllocationHandle` (for `cuMemExportToShareableHandle`).
    pub fn handle(&self) -> sys::CUmemGenericAllocationHandle {
        self.handle
    }

    /// The context it was allocated for.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The contents, copied to the host (blocking, on `stream`).
    pub fn to_vec(&self, stream: &crate::cuda::Stream) -> Result<Vec<T>> {
        super::copy::to_vec(stream, self)
    }
}

// SAFETY: the mapping lives until drop and never moves; `len * size_of::<T>() <= size`.
unsafe impl<T: Pod> DeviceMemory for VmmBuffer<T> {
    type Elem = T;
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }
    fn kind(&self) -> MemoryKind {
        MemoryKind::Vmm
    }
}

// SAFETY: no host references to device bytes.
unsafe impl<T: Pod> DeviceMemoryMut for VmmBuffer<T> {}

impl<T: Pod> Drop for VmmBuffer<T> {
    fn drop(&mut self) {
        if forked(self.pid) || bind(&self.ctx).is_err() {
            return;
        }
        // SAFETY: the mapping, reservation and handle made in `alloc`; nothing in flight.
        unsafe {
            if sys::cuMemUnmap(self.ptr, self.size) != sys::CUresult::CUDA_SUCCESS {
                return; // still mapped: leak rather than free under a mapping
            }
            sys::cuMemAddressFree(self.ptr, self.size);
            sys::cuMemRelease(self.handle);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_up_to_granularity() {
        assert_eq!(round_up(1, 2 << 20), Some(2 << 20));
        assert_eq!(round_up(2 << 20, 2 << 20), Some(2 << 20));
        assert_eq!(round_up((2 << 20) + 1, 2 << 20), Some(4 << 20));
        assert_eq!(round_up(usize::MAX, 4096), None);
    }
}
