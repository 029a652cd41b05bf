//! Modules and kernel launches: `cuModuleLoadData`, `cuModuleGetFunction`,
//! `cuModuleGetGlobal_v2`, `cuLaunchKernel` (the intra-node path's copy kernel).
//!
//! Every function here needs [`MODULE_SYMBOLS`] checked by name first (cudarc's loader panics
//! on a missing symbol) and the module's context current.

use crate::error::{Result, cu};
use cudarc::driver::sys;
use std::ffi::{CStr, c_void};

/// The symbols this module calls.
pub(crate) const MODULE_SYMBOLS: &[&str] = &[
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleGetGlobal_v2",
    "cuLaunchKernel",
];

/// `cuModuleLoadData`—Load a module from a NUL-terminated PTX image (JIT-compiled by the
/// driver for the current context's GPU).
///
/// # Safety
///
/// As the module docs say.
pub(crate) unsafe fn load_data(image: &CStr) -> Result<sys::CUmodule> {
    let mut m = std::ptr::null_mut();
    // SAFETY: a NUL-terminated image that outlives the call; an out-pointer.
    cu("cuModuleLoadData", unsafe {
        sys::cuModuleLoadData(&mut m, image.as_ptr().cast())
    })?;
    Ok(m)
}

/// `cuModuleGetFunction`—The kernel `name` of `module`.
///
/// # Safety
///
/// As the module docs say; `module` is live.
pub(crate) unsafe fn function(module: sys::CUmodule, name: &CStr) -> Result<sys::CUfunction> {
    let mut f = std::ptr::null_mut();
    // SAFETY: a live module, a NUL-terminated name, an out-pointer.
    cu("cuModuleGetFunction", unsafe {
        sys::cuModuleGetFunction(&mut f, module, name.as_ptr())
    })?;
    Ok(f)
}

/// `cuFuncLoad`—Load `f` now where the driver loads modules lazily (CUDA 12.4 and later,
/// called through the crate's own loader: cudarc's bindings of older CUDA versions lack it;
/// nothing to do where the driver lacks it: every function is loaded with its module).
///
/// # Safety
///
/// As the module docs say; `f` is live.
pub(crate) unsafe fn load_function(f: sys::CUfunction) -> Result<()> {
    let Some(load) = gpudirect_sys::cuda::driver()
        .ok()
        .and_then(|d| d.func_load())
    else {
        return Ok(());
    };
    // SAFETY: a live function handle, passed as the pointer it is.
    let rc = unsafe { load(f.cast()) };
    if rc == 0 {
        Ok(())
    } else {
        // The raw code (called through our own loader, not cudarc's enum).
        Err(crate::error::Error::Cuda {
            call: "cuFuncLoad",
            code: rc as u32,
            name: format!("CUresult {rc}"),
        })
    }
}

/// `cuModuleGetGlobal_v2`—The device address and size in bytes of the global `name`.
///
/// # Safety
///
/// As the module docs say; `module` is live.
pub(crate) unsafe fn global(module: sys::CUmodule, name: &CStr) -> Result<(u64, usize)> {
    let (mut p, mut n) = (0, 0);
    // SAFETY: a live module, a NUL-terminated name, two out-pointers.
    cu("cuModuleGetGlobal_v2", unsafe {
        sys::cuModuleGetGlobal_v2(&mut p, &mut n, module, name.as_ptr())
    })?;
    Ok((p, n))
}

/// `cuLaunchKernel`—Queue `f` on `stream`: `blocks` blocks of `threads` threads, no dynamic
/// shared memory, `params` one pointer per kernel parameter.
///
/// # Safety
///
/// As the module docs say; `f` and `stream` live in the current context; `params` matches the
/// kernel's parameters in number, order and size; whatever memory the kernel reaches stays
/// valid until the stream has passed it.
pub(crate) unsafe fn launch(
    f: sys::CUfunction,
    blocks: u32,
    threads: u32,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    // SAFETY: forwarded from the caller.
    unsafe { launch_rows(f, blocks, 1, threads, stream, params) }
}

/// [`launch`] with a grid of `rows` rows of `blocks` blocks each (`gridDimY` = `rows`).
///
/// # Safety
///
/// As [`launch`].
#[doc(alias = "cuLaunchKernel")]
pub(crate) unsafe fn launch_rows(
    f: sys::CUfunction,
    blocks: u32,
    rows: u32,
    threads: u32,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    // SAFETY: forwarded from the caller.
    cu("cuLaunchKernel", unsafe {
        sys::cuLaunchKernel(
            f,
            blocks,
            rows,
            1,
            threads,
            1,
            1,
            0,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    })
}
