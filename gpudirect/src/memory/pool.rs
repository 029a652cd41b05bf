//! Stream-ordered pool memory: cudarc's `CudaSlice`, accepted as it is.

use super::{DeviceMemory, DeviceMemoryMut, MemoryKind, Pod};
use crate::error::{Result, from_driver};
use cudarc::driver::{CudaSlice, DevicePtr};
use std::mem::ManuallyDrop;

/// A cudarc [`CudaSlice`] (pool memory from `cuMemAllocAsync`) handed to gpudirect's data paths.
///
/// Its pointer attribute `IS_GPU_DIRECT_RDMA_CAPABLE` is 0: NICs and cuFile want
/// [`super::DeviceBuffer`] or [`super::VmmBuffer`]. cudarc frees it on its own stream and
/// tracks read/write events; [`new`](Self::new) waits once for the work cudarc queued on it, so
/// gpudirect's work on any stream sees its contents. The slice goes back through
/// [`into_inner`](Self::into_inner) (after in-flight work has completed, since that work owns
/// this wrapper), and cudarc then frees it on its stream as usual. Dropped in a forked child,
/// it leaks.
#[derive(Debug)]
pub struct PoolBuffer<T: Pod> {
    slice: ManuallyDrop<CudaSlice<T>>,
    ptr: u64,
    pid: u32,
}

impl<T: Pod> PoolBuffer<T> {
    /// Wrap `slice`, synchronizing its stream once so that earlier cudarc work on it is complete.
    ///
    /// # Errors
    ///
    /// [`crate::Error::Cuda`] from `cuStreamSynchronize`.
    #[doc(alias = "cuMemAllocAsync")]
    pub fn new(slice: CudaSlice<T>) -> Result<Self> {
        let stream = slice.stream().clone();
        let ptr = {
            let (p, _record) = slice.device_ptr(&stream);
            p
        };
        stream
            .synchronize()
            .map_err(|e| from_driver("cuStreamSynchronize", e))?;
        Ok(PoolBuffer {
            slice: ManuallyDrop::new(slice),
            ptr,
            pid: std::process::id(),
        })
    }

    /// The cudarc slice, for reading with cudarc.
    pub fn as_slice(&self) -> &CudaSlice<T> {
        &self.slice
    }

    /// The cudarc slice back.
    pub fn into_inner(self) -> CudaSlice<T> {
        let mut me = ManuallyDrop::new(self);
        // SAFETY: `me` is never dropped, so the slice is taken out exactly once.
        unsafe { ManuallyDrop::take(&mut me.slice) }
    }
}

// SAFETY: the CudaSlice owns the allocation until dropped (and cudarc frees it only then); it
// never moves the memory.
unsafe impl<T: Pod> DeviceMemory for PoolBuffer<T> {
    type Elem = T;
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.slice.len()
    }
    fn ordinal(&self) -> usize {
        self.slice.ordinal()
    }
    fn kind(&self) -> MemoryKind {
        MemoryKind::Pool
    }
}

// SAFETY: only `&CudaSlice` is handed out, through which cudarc's safe API only reads.
unsafe impl<T: Pod> DeviceMemoryMut for PoolBuffer<T> {}

impl<T: Pod> Drop for PoolBuffer<T> {
    fn drop(&mut self) {
        if crate::completion::forked(self.pid) {
            return; // leak: cudarc's free would call the driver in a forked child
        }
        // SAFETY: dropped exactly once, here.
        unsafe { ManuallyDrop::drop(&mut self.slice) }
    }
}
