//! `cuMemAlloc` device memory: GPUDirect RDMA capable, exportable.

use super::{DeviceMemory, DeviceMemoryMut, MemoryKind, Pod, byte_size};
use crate::completion::forked;
use crate::cuda::Stream;
use crate::driver;
use crate::driver::ctx::bind;
use crate::error::Result;
use cudarc::driver::CudaContext;
use std::marker::PhantomData;
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
pub struct DeviceBuffer<T: Pod> {
    ptr: u64,
    len: usize,
    ctx: Arc<CudaContext>,
    pid: u32,
    _elem: PhantomData<T>,
}

impl<T: Pod> DeviceBuffer<T> {
    /// `cuMemAlloc_v2(len * size_of::<T>())` on `ctx`'s device. `len` is in elements.
    ///
    /// # Errors
    ///
    /// [`crate::Error::InvalidArgument`] for `len == 0` or an overflowing size;
    /// [`crate::Error::Cuda`] (`CUDA_ERROR_OUT_OF_MEMORY`) from the driver.
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
        Ok(DeviceBuffer {
            ptr,
            len,
            ctx: ctx.clone(),
            pid: std::process::id(),
            _elem: PhantomData,
        })
    }

    /// [`alloc`](Self::alloc), then `cuMemsetD8Async` to zero on a private non-blocking stream,
    /// synchronized (blocking, but not waiting for the context's other streams).
    #[doc(alias = "cuMemsetD8_v2")]
    pub fn zeroed(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
        let b = Self::alloc(ctx, len)?;
        crate::cuda::on_private_stream(ctx, |stream| {
            // SAFETY: context current; the range is this allocation, synchronized before it is
            // handed out; a live stream.
            unsafe { driver::mem::memset_d8_async(b.ptr, 0, b.byte_len(), stream) }
        })?;
        Ok(b)
    }

    /// A new buffer holding a copy of `data` (blocking, on `stream`).
    pub fn from_slice(stream: &Stream, data: &[T]) -> Result<Self> {
        let mut b = Self::alloc(stream.context(), data.len())?;
        super::copy_from_host(stream, data, &mut b)?;
        Ok(b)
    }

    /// The contents, copied to the host (blocking, on `stream`).
    pub fn to_vec(&self, stream: &Stream) -> Result<Vec<T>> {
        super::copy::to_vec(stream, self)
    }

    /// The context the memory was allocated in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

// SAFETY: the allocation lives until drop, never moves, and is `len * size_of::<T>()` bytes of
// device memory on `ctx`'s device.
unsafe impl<T: Pod> DeviceMemory for DeviceBuffer<T> {
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
        MemoryKind::Device
    }
}

// SAFETY: no host reference to device bytes is ever handed out.
unsafe impl<T: Pod> DeviceMemoryMut for DeviceBuffer<T> {}

impl<T: Pod> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if forked(self.pid) || bind(&self.ctx).is_err() {
            return; // leak: no driver frees in a forked child or without a usable context
        }
        // SAFETY: the pointer came from cuMemAlloc_v2 and nothing in flight holds it (in-flight
        // work owns the buffer, so it is not being dropped).
        let _ = unsafe { driver::mem::free(self.ptr) };
    }
}
