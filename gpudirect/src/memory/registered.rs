//! Host memory pinned in place with `cuMemHostRegister`.

use super::alloc::{Allocation, Release, byte_size, thin_memory};
use super::pod::Pod;
use crate::driver;
use crate::driver::ctx::bind;
use crate::error::{MemoryKind, Result};
use cudarc::driver::{CudaContext, sys};
use std::sync::Arc;

bitflags::bitflags! {
    /// Flags of `cuMemHostRegister`.
    #[repr(transparent)]
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct HostRegisterFlags: u32 {
        /// `CU_MEMHOSTREGISTER_PORTABLE`: pinned for every context.
        const PORTABLE = sys::CU_MEMHOSTREGISTER_PORTABLE;
        /// `CU_MEMHOSTREGISTER_DEVICEMAP`: mapped into the device address space; stream memory
        /// operations on host words need it.
        const DEVICEMAP = sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        /// `CU_MEMHOSTREGISTER_READ_ONLY`: the device only reads it.
        const READ_ONLY = sys::CU_MEMHOSTREGISTER_READ_ONLY;
    }
}

/// Owned host memory (`Box<[T]>`) pinned in place by `cuMemHostRegister`.
///
/// [`into_inner`](Self::into_inner) unregisters and gives the memory back; drop unregisters
/// (`cuMemHostUnregister`) and frees. In a forked child both leak.
#[derive(Debug)]
#[doc(alias = "cuMemHostRegister")]
pub struct RegisteredHost<T: Pod>(Allocation<T, HostRegistration<T>>);

/// A box pinned in place by `cuMemHostRegister`, given back by `cuMemHostUnregister` (then the
/// box is handed back or freed; if unregistering fails it is leaked, as it may still be pinned).
#[derive(Debug)]
pub(crate) struct HostRegistration<T: Pod> {
    data: Box<[T]>,
    /// The box's address, taken once through `as_mut_ptr` when it was registered.
    host: *mut T,
    flags: HostRegisterFlags,
}

// SAFETY: owns its box exclusively; `T: Pod` is Send + Sync; the bytes are reached only through
// the box, by the owner's `&self`/`&mut self`.
unsafe impl<T: Pod> Send for HostRegistration<T> {}
// SAFETY: as above: shared access only reads.
unsafe impl<T: Pod> Sync for HostRegistration<T> {}

// SAFETY: the box's heap memory is registered until `cuMemHostUnregister` and never moves (the
// box is not touched but through `&`/`&mut` of its owner); the allocation's device address is its
// device mapping (or the host address itself), and `host` is the box's.
unsafe impl<T: Pod> Release for HostRegistration<T> {
    const KIND: MemoryKind = MemoryKind::RegisteredHost;
    const CALL: &'static str = "cuMemHostUnregister";
    type Back = Box<[T]>;

    fn host_ptr(&self) -> Option<*mut u8> {
        Some(self.host.cast())
    }

    unsafe fn release(self, _ptr: u64) -> Result<Box<[T]>> {
        // SAFETY: registered by `RegisteredHost::new`, unregistered once; no work uses it.
        match unsafe { driver::mem::host_unregister(self.host.cast()) } {
            Ok(()) => Ok(self.data),
            Err(e) => {
                std::mem::forget(self.data); // may still be pinned: never free it
                Err(e)
            }
        }
    }
}

thin_memory!(RegisteredHost);

impl<T: Pod> RegisteredHost<T> {
    /// `cuMemHostRegister_v2(data, flags)` in `ctx`. The box's heap memory is pinned in place;
    /// moving the `RegisteredHost` does not move it.
    ///
    /// # Errors
    ///
    /// [`crate::Error::InvalidArgument`] for an empty box; [`crate::Error::Load`] without
    /// libcuda; [`crate::Error::Cuda`] (`CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`, ...) from the
    /// driver. On error the box is dropped.
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html>
    #[doc(alias = "cuMemHostRegister_v2")]
    pub fn new(ctx: &Arc<CudaContext>, data: Box<[T]>, flags: HostRegisterFlags) -> Result<Self> {
        let bytes = byte_size::<T>(data.len())?;
        crate::cuda::init()?;
        bind(ctx)?;
        let mut data = data;
        let host = data.as_mut_ptr();
        // SAFETY: context current; `host..host+bytes` is the box's live heap memory, kept alive
        // (and unmoved) until unregistered.
        unsafe { driver::mem::host_register(host.cast(), bytes, flags.bits()) }?;
        // Without a mapping the host address is what copies use.
        // SAFETY: registered memory of the current context.
        let dptr = unsafe { driver::mem::host_device_pointer(host.cast()) }.unwrap_or(host as u64);
        let len = data.len();
        let how = HostRegistration { data, host, flags };
        // SAFETY: the box's `bytes` bytes, registered and mapped at `dptr`, unregistered only by
        // `HostRegistration`.
        Ok(RegisteredHost(unsafe {
            Allocation::new(dptr, len, ctx, how)
        }))
    }

    /// The elements.
    pub fn as_slice(&self) -> &[T] {
        &self.0.how().data
    }

    /// The elements, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        &mut self.0.how_mut().data
    }

    /// The flags it was registered with.
    pub fn flags(&self) -> HostRegisterFlags {
        self.0.how().flags
    }

    /// `cuMemHostUnregister`, then the memory back.
    ///
    /// # Errors
    ///
    /// [`crate::Error::Cuda`] when unregistering fails, [`crate::Error::Unsupported`] in a forked
    /// child; the memory is then leaked (it may still be pinned), never handed back.
    #[doc(alias = "cuMemHostUnregister")]
    pub fn into_inner(self) -> Result<Box<[T]>> {
        self.0.close()
    }
}

impl<T: Pod> std::ops::Deref for RegisteredHost<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.as_slice()
    }
}

impl<T: Pod> std::ops::DerefMut for RegisteredHost<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.as_mut_slice()
    }
}
