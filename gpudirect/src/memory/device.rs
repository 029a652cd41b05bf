//! `cuMemAlloc` device memory: GPUDirect RDMA capable, exportable.

use super::alloc::{Allocation, Release, byte_size, thin_memory};
use super::copy::{self, copy_from_host};
use super::kind::DeviceMemory;
use super::pod::Pod;
use crate::cuda::Stream;
use crate::driver;
use crate::driver::ctx::bind;
use crate::error::{MemoryKind, Result};
use cudarc::driver::CudaContext;
use std::sync::Arc;

/// Device memory from `cuMemAlloc`: `len` elements of `T` on one GPU.
///
/// This is the memory kind for GPUDirect RDMA and cuFile (`IS_GPU_DIRECT_RDMA_CAPABLE` is 1),
/// exportable by dma-buf and cuIpc. Its contents start unspecified (any bit pattern, which `T:
/// Pod` makes valid) unless made with [`zeroed`](Self::zeroed) or
/// [`from_slice`](Self::from_slice).
///
/// Dropping it calls `cuMemFree`; in a forked child it leaks instead.
#[derive(Debug)]
#[doc(alias = "cuMemAlloc")]
pub struct DeviceBuffer<T: Pod>(Allocation<T, MemAlloc>);

/// `cuMemAlloc` memory, given back with `cuMemFree`.
#[derive(Debug)]
pub(crate) struct MemAlloc;

// SAFETY: memory from `cuMemAlloc_v2` is device memory of the context's device, valid until
// `cuMemFree_v2`; it has no host view.
unsafe impl Release for MemAlloc {
    const KIND: MemoryKind = MemoryKind::Device;
    const CALL: &'static str = "cuMemFree_v2";
    type Back = ();

    unsafe fn release(self, ptr: u64) -> Result<()> {
        // SAFETY: the allocation's pointer from cuMemAlloc_v2, freed once (the caller's).
        unsafe { driver::mem::free(ptr) }
    }
}

thin_memory!(DeviceBuffer);

impl<T: Pod> DeviceBuffer<T> {
    /// `cuMemAlloc_v2(len * size_of::<T>())` on `ctx`'s device. `len` is in elements.
    ///
    /// # Errors
    ///
    /// [`crate::Error::InvalidArgument`] for `len == 0` or an overflowing size;
    /// [`crate::Error::Load`] without libcuda; [`crate::Error::Cuda`]
    /// (`CUDA_ERROR_OUT_OF_MEMORY`) from the driver.
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html>
    #[doc(alias = "cuMemAlloc_v2")]
    pub fn alloc(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
        let bytes = byte_size::<T>(len)?;
        crate::cuda::init()?;
        crate::completion::Tracker::global().reap();
        bind(ctx)?;
        // SAFETY: context current.
        let ptr = unsafe { driver::mem::alloc(bytes) }?;
        // SAFETY: `bytes` bytes of cuMemAlloc memory in `ctx`, freed only by `MemAlloc`.
        Ok(DeviceBuffer(unsafe {
            Allocation::new(ptr, len, ctx, MemAlloc)
        }))
    }

    /// [`alloc`](Self::alloc), then `cuMemsetD8Async` to zero on a private non-blocking stream,
    /// synchronized (blocking, but not waiting for the context's other streams).
    ///
    /// # Errors
    ///
    /// As [`alloc`](Self::alloc); [`crate::Error::Cuda`] from the memset or its synchronization
    /// (the buffer is then freed).
    #[doc(alias = "cuMemsetD8Async")]
    pub fn zeroed(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
        let b = Self::alloc(ctx, len)?;
        crate::cuda::on_private_stream(ctx, |stream| {
            // SAFETY: context current; the range is this allocation, synchronized before it is
            // handed out; a live stream.
            unsafe { driver::mem::memset_d8_async(b.device_ptr(), 0, b.byte_len(), stream) }
        })?;
        Ok(b)
    }

    /// A new buffer holding a copy of `data` (blocking, on `stream`).
    ///
    /// # Errors
    ///
    /// As [`alloc`](Self::alloc) (an empty `data` is an [`crate::Error::InvalidArgument`]) and
    /// [`copy_from_host`](super::copy_from_host).
    pub fn from_slice(stream: &Stream, data: &[T]) -> Result<Self> {
        let mut b = Self::alloc(stream.context(), data.len())?;
        copy_from_host(stream, data, &mut b)?;
        Ok(b)
    }

    /// The contents, copied to the host (blocking, on `stream`).
    ///
    /// # Errors
    ///
    /// As [`copy_to_host`](super::copy_to_host).
    pub fn to_vec(&self, stream: &Stream) -> Result<Vec<T>> {
        copy::to_vec(stream, self)
    }
}
