//! Stream-ordered pool memory: cudarc's `CudaSlice`, accepted as it is.

use super::alloc::{Allocation, Release, thin_memory};
use super::pod::Pod;
use crate::error::{MemoryKind, Result, from_driver};
use cudarc::driver::{CudaSlice, DevicePtr};

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
pub struct PoolBuffer<T: Pod>(Allocation<T, Slice<T>>);

/// A cudarc slice, given back by dropping it (cudarc frees it on its stream).
#[derive(Debug)]
pub(crate) struct Slice<T: Pod>(CudaSlice<T>);

// SAFETY: the CudaSlice owns the allocation until dropped (and cudarc frees it only then); it
// never moves the memory, and has no host view.
unsafe impl<T: Pod> Release for Slice<T> {
    const KIND: MemoryKind = MemoryKind::Pool;
    const CALL: &'static str = "cuMemFreeAsync";
    type Back = ();

    unsafe fn release(self, _ptr: u64) -> Result<()> {
        drop(self.0);
        Ok(())
    }
}

thin_memory!(PoolBuffer);

impl<T: Pod> PoolBuffer<T> {
    /// Wrap `slice`, synchronizing its stream once so that earlier cudarc work on it is complete.
    ///
    /// # Errors
    ///
    /// [`crate::Error::Cuda`] from `cuStreamSynchronize` (the slice is then dropped).
    #[doc(alias = "cuMemAllocAsync")]
    #[doc(alias = "cuStreamSynchronize")]
    pub fn new(slice: CudaSlice<T>) -> Result<Self> {
        let stream = slice.stream().clone();
        let ptr = {
            let (p, _record) = slice.device_ptr(&stream);
            p
        };
        stream
            .synchronize()
            .map_err(|e| from_driver("cuStreamSynchronize", e))?;
        let len = slice.len();
        // SAFETY: the slice's `len` elements of pool memory at `ptr`, freed only when the slice
        // is dropped (by `Slice`, or by the caller after `into_inner`).
        Ok(PoolBuffer(unsafe {
            Allocation::new(ptr, len, stream.context(), Slice(slice))
        }))
    }

    /// The cudarc slice, for reading with cudarc.
    pub fn as_slice(&self) -> &CudaSlice<T> {
        &self.0.how().0
    }

    /// The cudarc slice back.
    pub fn into_inner(self) -> CudaSlice<T> {
        self.0.into_how().0
    }
}
