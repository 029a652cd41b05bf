//! `cuMemHostAlloc` pinned host memory.

use super::alloc::{Allocation, Release, byte_size, thin_memory};
use super::pod::Pod;
use crate::driver;
use crate::driver::ctx::bind;
use crate::error::{MemoryKind, Result};
use cudarc::driver::{CudaContext, sys};
use std::sync::Arc;

bitflags::bitflags! {
    /// Flags of `cuMemHostAlloc`.
    #[repr(transparent)]
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct HostAllocFlags: u32 {
        /// `CU_MEMHOSTALLOC_PORTABLE`: pinned for every context, not only the allocating one.
        const PORTABLE = sys::CU_MEMHOSTALLOC_PORTABLE;
        /// `CU_MEMHOSTALLOC_DEVICEMAP`: mapped into the device address space
        /// (`cuMemHostGetDevicePointer`); stream memory operations on host words need it.
        const DEVICEMAP = sys::CU_MEMHOSTALLOC_DEVICEMAP;
        /// `CU_MEMHOSTALLOC_WRITECOMBINED`: write-combined (fast host writes, very slow host
        /// reads).
        const WRITECOMBINED = sys::CU_MEMHOSTALLOC_WRITECOMBINED;
    }
}

/// Pinned (page-locked) host memory from `cuMemHostAlloc`: `len` elements of `T`, zeroed.
///
/// The host reads and writes it through [`as_slice`](Self::as_slice) and
/// [`as_mut_slice`](Self::as_mut_slice); while a copy uses it, the copy owns it, so no reference
/// can exist. Pinned memory has no stream-ordered free: it is freed (`cuMemFreeHost`) only when
/// dropped, which in-flight work prevents. In a forked child it leaks.
#[derive(Debug)]
#[doc(alias = "cuMemHostAlloc")]
pub struct PinnedHostBuffer<T: Pod>(Allocation<T, HostAlloc>);

/// `cuMemHostAlloc` memory, given back with `cuMemFreeHost`.
#[derive(Debug)]
pub(crate) struct HostAlloc {
    /// The host address `cuMemHostAlloc` returned.
    host: *mut u8,
    flags: HostAllocFlags,
}

// SAFETY: the allocation is owned exclusively by its `Allocation`; the pointer is only read, and
// the bytes behind it are reached through the owner's `&self`/`&mut self`.
unsafe impl Send for HostAlloc {}
// SAFETY: as above.
unsafe impl Sync for HostAlloc {}

// SAFETY: pinned host memory, valid until `cuMemFreeHost`; the allocation's device address is its
// device mapping (or, with unified addressing, the host address itself, which the driver accepts
// as well), and `host` is the same bytes on the host.
unsafe impl Release for HostAlloc {
    const KIND: MemoryKind = MemoryKind::PinnedHost;
    const CALL: &'static str = "cuMemFreeHost";
    type Back = ();

    fn host_ptr(&self) -> Option<*mut u8> {
        Some(self.host)
    }

    unsafe fn release(self, _ptr: u64) -> Result<()> {
        // SAFETY: from cuMemHostAlloc, freed once; no work uses it (the caller's).
        unsafe { driver::mem::free_host(self.host.cast()) }
    }
}

thin_memory!(PinnedHostBuffer);

impl<T: Pod> PinnedHostBuffer<T> {
    /// `cuMemHostAlloc(len * size_of::<T>(), flags)` in `ctx`, zero-filled. `len` is in elements.
    ///
    /// # Errors
    ///
    /// [`crate::Error::InvalidArgument`] for `len == 0` or an overflowing size;
    /// [`crate::Error::Load`] without libcuda; [`crate::Error::Cuda`] from the driver.
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html>
    #[doc(alias = "cuMemHostAlloc")]
    pub fn alloc(ctx: &Arc<CudaContext>, len: usize, flags: HostAllocFlags) -> Result<Self> {
        let bytes = byte_size::<T>(len)?;
        crate::cuda::init()?;
        crate::completion::Tracker::global().reap();
        bind(ctx)?;
        // SAFETY: context current; flags are cuMemHostAlloc flags.
        let p = unsafe { driver::mem::host_alloc(bytes, flags.bits()) }?;
        // SAFETY: `p` is a fresh allocation of `bytes` bytes.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, bytes) };
        // Without a mapping (no DEVICEMAP on a device without unified addressing), the host
        // address is what copies use.
        // SAFETY: `p` is pinned memory of this context.
        let dptr = unsafe { driver::mem::host_device_pointer(p) }.unwrap_or(p as u64);
        let how = HostAlloc {
            host: p.cast(),
            flags,
        };
        // SAFETY: `bytes` bytes of pinned memory mapped at `dptr`, freed only by `HostAlloc`.
        Ok(PinnedHostBuffer(unsafe {
            Allocation::new(dptr, len, ctx, how)
        }))
    }

    /// A pinned copy of `data`.
    ///
    /// # Errors
    ///
    /// As [`alloc`](Self::alloc) (an empty `data` is an [`crate::Error::InvalidArgument`]).
    pub fn from_slice(ctx: &Arc<CudaContext>, data: &[T], flags: HostAllocFlags) -> Result<Self> {
        let mut b = Self::alloc(ctx, data.len(), flags)?;
        b.as_mut_slice().copy_from_slice(data);
        Ok(b)
    }

    /// The elements.
    pub fn as_slice(&self) -> &[T] {
        // SAFETY: `len` initialised elements (zero-filled at allocation, `T: Pod`); no device
        // work can be writing them while `self` is borrowed (device work owns the buffer).
        unsafe { std::slice::from_raw_parts(self.0.how().host.cast(), self.0.len()) }
    }

    /// The elements, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.0.how().host.cast(), self.0.len()) }
    }

    /// The flags it was allocated with.
    pub fn flags(&self) -> HostAllocFlags {
        self.0.how().flags
    }
}

impl<T: Pod> std::ops::Deref for PinnedHostBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.as_slice()
    }
}

impl<T: Pod> std::ops::DerefMut for PinnedHostBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.as_mut_slice()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_are_the_c_values() {
        assert_eq!(HostAllocFlags::PORTABLE.bits(), 1);
        assert_eq!(HostAllocFlags::DEVICEMAP.bits(), 2);
        assert_eq!(HostAllocFlags::WRITECOMBINED.bits(), 4);
    }
}
