//! The spin kernel shared by the examples: `kernels/spin.ptx` (hand-written PTX spinning on
//! `%globaltimer` for a given time, then adding 1 to every `u32` of a buffer), loaded with
//! `cuModuleLoadData` and launched on a stream.
#![allow(dead_code)]

use gpudirect::cuda::Stream;
use gpudirect::cudarc::driver::{CudaContext, sys};
use gpudirect::memory::{DeviceBuffer, DeviceMemory};
use std::ffi::CString;
use std::sync::Arc;

const PTX: &str = include_str!("../kernels/spin.ptx");

pub fn check(call: &'static str, r: sys::CUresult) -> gpudirect::Result<()> {
    r.result().map_err(|e| gpudirect::Error::cuda(call, e.0))
}

pub struct Kernel {
    func: sys::CUfunction,
    blocks: u32,
}

impl Kernel {
    pub fn load(ctx: &Arc<CudaContext>) -> gpudirect::Result<Self> {
        ctx.bind_to_thread()
            .map_err(|e| gpudirect::Error::cuda("cuCtxSetCurrent", e.0))?;
        let image = CString::new(PTX).expect("PTX has no NUL");
        let mut module = std::ptr::null_mut();
        // SAFETY: a NUL-terminated PTX image; context current. The module lives for the process.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, image.as_ptr().cast())
        })?;
        let mut func = std::ptr::null_mut();
        let name = CString::new("spin_add1").expect("no NUL");
        // SAFETY: the module just loaded; a NUL-terminated name.
        check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut func, module, name.as_ptr())
        })?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| gpudirect::Error::cuda("cuDeviceGetAttribute", e.0))?;
        Ok(Kernel {
            func,
            blocks: (sms.max(1) as u32) * 2,
        })
    }

    /// Queue the kernel on `stream` over `buf`.
    pub fn launch(
        &self,
        stream: &Stream,
        ns: u64,
        buf: &DeviceBuffer<u32>,
    ) -> gpudirect::Result<()> {
        // SAFETY: `buf` is live device memory of `len` u32s; the callers synchronize every
        // stream before dropping buffers.
        unsafe { self.launch_raw(stream, ns, buf.device_ptr(), buf.len() as u32) }
    }

    /// Queue the kernel on `stream` over `n` u32s at device address `ptr`.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + 4n` is device memory of the stream's context that stays allocated until the
    /// kernel has run, and nothing else reads or writes it meanwhile.
    pub unsafe fn launch_raw(
        &self,
        stream: &Stream,
        ns: u64,
        ptr: u64,
        n: u32,
    ) -> gpudirect::Result<()> {
        let mut ns = ns;
        let mut ptr = ptr;
        let mut n = n;
        let mut args: [*mut std::ffi::c_void; 3] = [
            (&mut ns as *mut u64).cast(),
            (&mut ptr as *mut u64).cast(),
            (&mut n as *mut u32).cast(),
        ];
        // SAFETY: the kernel's parameters are (u64, u64, u32), matched by `args`; the memory
        // is the caller's promise.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.func,
                self.blocks,
                1,
                1,
                256,
                1,
                1,
                0,
                stream.cu_stream(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}
