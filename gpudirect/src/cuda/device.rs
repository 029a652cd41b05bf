//! CUDA devices and their GPUDirect attributes, read without creating a context.

use crate::driver::device;
use crate::error::Result;
use cudarc::driver::sys::{self, CUdevice_attribute as A};

/// What one CUDA device offers GPUDirect.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct DeviceInfo {
    /// The CUDA ordinal.
    pub ordinal: usize,
    /// `cuDeviceGetName`.
    pub name: String,
    /// `cuDeviceGetPCIBusId`, such as `0000:00:06.0` (lower case, as sysfs spells it).
    pub pci_bus_id: String,
    /// `cuDeviceTotalMem`, in bytes.
    pub total_memory_bytes: u64,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (i32, i32),
    /// Copy engines (`CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT`).
    pub copy_engines: i32,
    /// dma-buf export of device memory (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`).
    pub dma_buf: bool,
    /// GPUDirect RDMA (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`).
    pub gpudirect_rdma: bool,
    /// GPUDirect RDMA on VMM allocations (`..._GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`).
    pub gpudirect_rdma_vmm: bool,
    /// `cuFlushGPUDirectRDMAWrites` options (`..._GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS`, a bit mask).
    pub rdma_flush_writes_options: i32,
    /// Ordering of GPUDirect RDMA writes (`..._GPU_DIRECT_RDMA_WRITES_ORDERING`: 0 none, 100
    /// owner, 200 all devices).
    pub rdma_writes_ordering: i32,
    /// 32-bit stream memory operations through the `_v2` entry points (`cuStreamWaitValue32_v2`
    /// and friends): part of every CUDA 12+ driver, so true whenever the driver is supported.
    pub stream_mem_ops: bool,
    /// 64-bit `_v2` stream memory operations (`CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS`,
    /// attribute 122 in CUDA 12+).
    pub stream_mem_ops_64: bool,
    /// `CU_STREAM_WAIT_VALUE_NOR` in `_v2` waits (`..._CAN_USE_STREAM_WAIT_VALUE_NOR`, 123).
    pub stream_wait_value_nor: bool,
    /// Stream-ordered memory pools (`CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`).
    pub memory_pools: bool,
    /// POSIX fd shareable handles for VMM memory (`..._HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`).
    pub posix_fd_handles: bool,
    /// `cuMemHostRegister` support (`CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED`).
    pub host_register: bool,
    /// `CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES`.
    pub can_flush_remote_writes: bool,
}

// In CUDA 12+ headers the unsuffixed names are the `_v2` attributes (122, 123).
const MEM_OPS_64_V2: A = A::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS;
const WAIT_NOR_V2: A = A::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR;

/// `cuDeviceGetAttribute` of a device from `driver::device::get`.
fn attr(dev: sys::CUdevice, a: A) -> Result<i32> {
    // SAFETY: the driver is initialised (the caller's device came from `cuDeviceGet`).
    unsafe { device::attribute(dev, a) }
}

impl DeviceInfo {
    /// Query device `ordinal`.
    ///
    /// # Errors
    ///
    /// [`crate::Error::NoDevice`] for an ordinal past the device count (checked before it is
    /// handed to the driver); [`crate::Error::Load`] without libcuda; [`crate::Error::Cuda`].
    #[doc(alias = "cuDeviceGetAttribute")]
    pub fn query(ordinal: usize) -> Result<DeviceInfo> {
        let n = super::device_count()?;
        if ordinal >= n {
            return Err(crate::Error::NoDevice {
                what: "CUDA device",
                reason: format!("device {ordinal} requested, {n} visible"),
            });
        }
        // SAFETY: the driver is initialised (device_count); `ordinal` is below the count.
        let dev = unsafe { device::get(ordinal) }?;
        // SAFETY: `dev` came from cuDeviceGet (for the next three calls).
        let name = unsafe { device::name(dev) }?;
        // SAFETY: as above.
        let bus = unsafe { device::pci_bus_id(dev) }?;
        // SAFETY: as above.
        let mem = unsafe { device::total_mem(dev) }?;
        let flag = |a| attr(dev, a).map(|v| v != 0);
        Ok(DeviceInfo {
            ordinal,
            name,
            pci_bus_id: bus.to_ascii_lowercase(),
            total_memory_bytes: mem as u64,
            compute_capability: (
                attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            copy_engines: attr(dev, A::CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT)?,
            dma_buf: flag(A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)?,
            gpudirect_rdma: flag(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED)?,
            gpudirect_rdma_vmm: flag(
                A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
            )?,
            rdma_flush_writes_options: attr(
                dev,
                A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS,
            )?,
            rdma_writes_ordering: attr(
                dev,
                A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING,
            )?,
            stream_mem_ops: gpudirect_sys::cuda::driver()?.has_symbol("cuStreamWaitValue32_v2"),
            stream_mem_ops_64: flag(MEM_OPS_64_V2)?,
            stream_wait_value_nor: flag(WAIT_NOR_V2)?,
            memory_pools: flag(A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)?,
            posix_fd_handles: flag(
                A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            )?,
            host_register: flag(A::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED)?,
            can_flush_remote_writes: flag(A::CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES)?,
        })
    }

    /// Every visible device, by ordinal (empty when the driver sees none).
    ///
    /// # Errors
    ///
    /// As [`device_count`](super::device_count) (libcuda missing or failing to initialise), then
    /// as [`query`](Self::query) for the first device that cannot be queried.
    #[doc(alias = "cuDeviceGetCount")]
    pub fn all() -> Result<Vec<DeviceInfo>> {
        (0..super::device_count()?).map(DeviceInfo::query).collect()
    }
}
