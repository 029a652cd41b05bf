//! `cuPointerGetAttributes` as a typed struct.

use crate::error::Result;
use cudarc::driver::sys;

/// Where the bytes behind a pointer live (`CU_POINTER_ATTRIBUTE_MEMORY_TYPE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemoryType {
    /// `CU_MEMORYTYPE_HOST`.
    Host,
    /// `CU_MEMORYTYPE_DEVICE`.
    Device,
    /// `CU_MEMORYTYPE_ARRAY`.
    Array,
    /// `CU_MEMORYTYPE_UNIFIED`.
    Unified,
    /// A value this version does not know.
    Other(u32),
}

impl MemoryType {
    fn from_raw(v: u32) -> Self {
        match v {
            1 => MemoryType::Host,
            2 => MemoryType::Device,
            3 => MemoryType::Array,
            4 => MemoryType::Unified,
            v => MemoryType::Other(v),
        }
    }
}

/// What the driver says about an address (`cuPointerGetAttributes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PointerAttributes {
    /// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`.
    pub memory_type: MemoryType,
    /// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`: the device the memory belongs to (or was mapped
    /// for); negative for host memory on some drivers.
    pub device_ordinal: i32,
    /// `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`: the start of the whole allocation.
    pub range_start: u64,
    /// `CU_POINTER_ATTRIBUTE_RANGE_SIZE`: the size of the whole allocation, in bytes.
    pub range_size: usize,
    /// `CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE`: whether a NIC may DMA to it through
    /// GPUDirect RDMA (0 for pool memory from `cuMemAllocAsync`).
    pub gpu_direct_rdma_capable: bool,
    /// `CU_POINTER_ATTRIBUTE_IS_MANAGED`.
    pub is_managed: bool,
    /// `CU_POINTER_ATTRIBUTE_MAPPED`: whether the range is mapped (VMM memory).
    pub mapped: bool,
    /// `CU_POINTER_ATTRIBUTE_DEVICE_POINTER`: the device address of the pointer.
    pub device_pointer: u64,
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID`: an id the driver gives each allocation, unique for the
    /// process's life: a new allocation at a reused address gets a new id, so it tells
    /// allocations apart where addresses cannot.
    pub buffer_id: u64,
}

/// `cuPointerGetAttributes(ptr)`: the typed attributes of a device (or mapped host) address.
///
/// # Errors
///
/// [`crate::Error::Load`] without libcuda, [`crate::Error::Cuda`] for an address the driver does
/// not know (`CUDA_ERROR_INVALID_VALUE`).
///
/// # C function
///
/// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__UNIFIED.html>
#[doc(alias = "cuPointerGetAttributes")]
#[doc(alias = "cuPointerGetAttribute")]
pub fn pointer_attributes(ptr: u64) -> Result<PointerAttributes> {
    crate::cuda::init()?;
    use sys::CUpointer_attribute as A;
    let mut mem_type: u32 = 0;
    let mut ordinal: i32 = -1;
    let mut start: u64 = 0;
    let mut size: usize = 0;
    let mut rdma: i32 = 0;
    let mut managed: i32 = 0;
    let mut mapped: i32 = 0;
    let mut dptr: u64 = 0;
    let mut buffer_id: u64 = 0;
    let mut attrs = [
        A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        A::CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE,
        A::CU_POINTER_ATTRIBUTE_IS_MANAGED,
        A::CU_POINTER_ATTRIBUTE_MAPPED,
        A::CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
        A::CU_POINTER_ATTRIBUTE_BUFFER_ID,
    ];
    let mut data: [*mut std::ffi::c_void; 9] = [
        (&mut mem_type as *mut u32).cast(),
        (&mut ordinal as *mut i32).cast(),
        (&mut start as *mut u64).cast(),
        (&mut size as *mut usize).cast(),
        (&mut rdma as *mut i32).cast(),
        (&mut managed as *mut i32).cast(),
        (&mut mapped as *mut i32).cast(),
        (&mut dptr as *mut u64).cast(),
        (&mut buffer_id as *mut u64).cast(),
    ];
    // SAFETY: nine attributes, each with an out-pointer of the size the driver writes
    // (CUmemorytype/int/bool-as-int: 4 bytes; addresses, sizes and the buffer id: 8 bytes).
    unsafe { crate::driver::pointer::attributes(&mut attrs, &mut data, ptr) }?;
    Ok(PointerAttributes {
        memory_type: MemoryType::from_raw(mem_type),
        device_ordinal: ordinal,
        range_start: start,
        range_size: size,
        gpu_direct_rdma_capable: rdma != 0,
        is_managed: managed != 0,
        mapped: mapped != 0,
        device_pointer: dptr,
        buffer_id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_types_from_raw() {
        assert_eq!(MemoryType::from_raw(1), MemoryType::Host);
        assert_eq!(MemoryType::from_raw(2), MemoryType::Device);
        assert_eq!(MemoryType::from_raw(4), MemoryType::Unified);
        assert_eq!(MemoryType::from_raw(9), MemoryType::Other(9));
    }

    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        if crate::cuda::init().is_err() {
            assert!(pointer_attributes(0x1000).is_err());
        }
    }
}
