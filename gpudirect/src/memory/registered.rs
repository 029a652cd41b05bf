//! Host memory pinned in place with `cuMemHostRegister`.

use super::{DeviceMemory, DeviceMemoryMut, MemoryKind, Pod, byte_size};
use crate::completion::forked;
use crate::driver;
use crate::driver::ctx::bind;
use crate::error::Result;
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
pub struct RegisteredHost<T: Pod> {
    data: Option<Box<[T]>>,
    ptr: *mut T,
    dptr: u64,
    len: usize,
    flags: HostRegisterFlags,
    ctx: Arc<CudaContext>,
    pid: u32,
}

// SAFETY: owns its box exclusively; `T: Pod` is Send + Sync.
unsafe impl<T: Pod> Send for RegisteredHost<T> {}
// SAFETY: shared access only reads.
unsafe impl<T: Pod> Sync for RegisteredHost<T> {}

impl<T: Pod> RegisteredHost<T> {
    /// `cuMemHostRegister_v2(data, flags)` in `ctx`. The box's heap memory is pinned in place;
    /// moving the `RegisteredHost` does not move it.
    ///
    /// # Errors
    ///
    /// [`crate::Error::InvalidArgument`] for an empty box; [`crate::Error::Cuda`]
    /// (`CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`, ...) from the driver. On error the box is
    /// dropped.
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
        let ptr = data.as_mut_ptr();
        // SAFETY: context current; `ptr..ptr+bytes` is the box's live heap memory, kept alive
        // (and unmoved) until unregistered.
        unsafe { driver::mem::host_register(ptr.cast(), bytes, flags.bits()) }?;
        // Without a mapping the host address is what copies use.
        // SAFETY: registered memory of the current context.
        let dptr = unsafe { driver::mem::host_device_pointer(ptr.cast()) }.unwrap_or(ptr as u64);
        Ok(RegisteredHost {
            len: data.len(),
            data: Some(data),
            ptr,
            dptr,
            flags,
            ctx: ctx.clone(),
            pid: std::process::id(),
        })
    }

    /// The elements.
    pub fn as_slice(&self) -> &[T] {
        self.data.as_deref().unwrap_or(&[])
    }

    /// The elements, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        self.data.as_deref_mut().unwrap_or(&mut [])
    }

    /// The flags it was registered with.
    pub fn flags(&self) -> HostRegisterFlags {
        self.flags
    }

    /// `cuMemHostUnregister`, then the memory back.
    ///
    /// # Errors
    ///
    /// [`crate::Error::Cuda`] when unregistering fails; the memory is then leaked (it may still be
    /// pinned), never handed back.
    #[doc(alias = "cuMemHostUnregister")]
    pub fn into_inner(mut self) -> Result<Box<[T]>> {
        self.unregister()?;
        Ok(self.data.take().unwrap_or_default())
    }

    fn unregister(&mut self) -> Result<()> {
        if forked(self.pid) {
            std::mem::forget(self.data.take());
            return Err(crate::Error::Unsupported {
                what: "cuMemHostUnregister".into(),
                reason: "in a forked child; the memory is leaked".into(),
            });
        }
        let r = bind(&self.ctx).and_then(|()| {
            // SAFETY: `ptr` was registered by `new`; nothing in flight uses it.
            unsafe { driver::mem::host_unregister(self.ptr.cast()) }
        });
        if r.is_err() {
            std::mem::forget(self.data.take()); // may still be pinned: never free it
        }
        r
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

// SAFETY: the box's heap memory is registered until drop and never moves.
unsafe impl<T: Pod> DeviceMemory for RegisteredHost<T> {
    type Elem = T;
    fn device_ptr(&self) -> u64 {
        self.dptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }
    fn kind(&self) -> MemoryKind {
        MemoryKind::RegisteredHost
    }
    fn host_ptr(&self) -> Option<*mut u8> {
        Some(self.ptr.cast())
    }
}

// SAFETY: references only through `&self`/`&mut self`.
unsafe impl<T: Pod> DeviceMemoryMut for RegisteredHost<T> {}

impl<T: Pod> Drop for RegisteredHost<T> {
    fn drop(&mut self) {
        if self.data.is_some() {
            let _ = self.unregister();
        }
    }
}
