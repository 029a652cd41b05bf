//! The presence checks every CUDA call of the crate comes after: libcuda found, the one
//! cudarc calls, new enough; then `cuInit` once. [`device_count`] and [`context`] are the first
//! calls past them.

use crate::error::{Error, Result, from_driver};
use cudarc::driver::{CudaContext, sys};
use std::sync::{Arc, OnceLock};

/// The oldest driver supported: CUDA 12.0 (stream memory ops v2, dma-buf export and VMM RDMA all
/// exist there).
pub const MIN_DRIVER_VERSION: i32 = 12000;

/// The CUDA version of the cudarc bindings gpudirect was compiled against
/// (`1000 * major + 10 * minor`: 12080 for CUDA 12.8): cudarc's `driver::sys::CUDA_VERSION`, so
/// it is the version really built, whichever crate chose it (a `cuda-*` feature of gpudirect or of
/// cudarc itself).
pub const BINDINGS_VERSION: i32 = sys::CUDA_VERSION as i32;

/// Check libcuda and its version, then `cuInit(0)` once. Never panics.
///
/// The library checked must be the one cudarc calls. With cudarc's `dynamic-loading` (the default)
/// cudarc opens libcuda by file name only, so a library found only through
/// `GPUDIRECT_LIBCUDA_PATH` would pass our checks and then make cudarc panic: that case is an
/// [`Error::Load`] (put the library's directory on `LD_LIBRARY_PATH` instead). With cudarc's
/// `dynamic-linking` libcuda is linked into the program, and an override naming another library
/// is an [`Error::InvalidArgument`] naming the variable.
///
/// # Errors
///
/// [`Error::Load`] when libcuda (or a symbol gpudirect needs) is missing, or cudarc would not
/// find the library checked; [`Error::InvalidArgument`] for an override the linked libcuda
/// contradicts; [`Error::DriverTooOld`] below CUDA 12.0; [`Error::Cuda`] from `cuInit`
/// (`CUDA_ERROR_NO_DEVICE` on a node without a GPU, `CUDA_ERROR_STUB_LIBRARY` for a stub). Each
/// is answered again, the same, by every later call.
#[doc(alias = "cuInit")]
#[doc(alias = "cuDriverGetVersion")]
pub fn init() -> Result<&'static gpudirect_sys::cuda::Driver> {
    // The tracker records this process's id before any CUDA work, so that a forked child
    // recognises itself (and leaks rather than frees) even if it first touches the tracker.
    crate::completion::Tracker::global();
    let d = gpudirect_sys::cuda::driver()?;
    static CUDARC_VIEW: OnceLock<CudarcLibcuda> = OnceLock::new();
    let view = CUDARC_VIEW.get_or_init(|| cudarc_libcuda(d.path()));
    cudarc_loader_check(*view, d.path())?;
    if d.version() < MIN_DRIVER_VERSION {
        return Err(Error::DriverTooOld {
            found: d.version(),
            required: MIN_DRIVER_VERSION,
        });
    }
    static INIT: OnceLock<Result<(), (u32, String)>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: libcuda is present and is the one cudarc calls (checked above).
        unsafe { crate::driver::init() }.map_err(|e| match e {
            Error::Cuda { code, name, .. } => (code, name),
            _ => (0, String::new()),
        })
    })
    .clone()
    .map_err(|(code, name)| Error::Cuda {
        call: "cuInit",
        code,
        name,
    })?;
    Ok(d)
}

/// Which libcuda cudarc will call, as seen from this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CudarcLibcuda {
    /// libcuda's symbols are already global in the process: it was linked at build time (cudarc's
    /// `dynamic-linking`, or another linked library), so cudarc calls that one. `same`: it is
    /// the library gpudirect's loader opened.
    Linked { same: bool },
    /// Nothing linked: cudarc opens libcuda by file name (`dynamic-loading`); `found` says
    /// whether one of the names opens.
    ByName { found: bool },
}

/// Where cudarc's libcuda comes from, decided at run time: gpudirect cannot see at compile time
/// which of cudarc's loading features the program chose.
fn cudarc_libcuda(ours: &str) -> CudarcLibcuda {
    const SYMBOL: &std::ffi::CStr = c"cuDriverGetVersion";
    // SAFETY: dlsym with RTLD_DEFAULT only searches the global scope; the pointer is compared,
    // never called.
    let global = unsafe { libc::dlsym(libc::RTLD_DEFAULT, SYMBOL.as_ptr()) };
    if !global.is_null() {
        let same = std::ffi::CString::new(ours).is_ok_and(|path| {
            // SAFETY: RTLD_NOLOAD only returns a handle to a library already loaded (ours is, by
            // our loader), running no initialiser; the handle's reference is released below.
            let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
            if h.is_null() {
                return false;
            }
            // SAFETY: `h` is a valid handle; the pointer is only compared.
            let p = unsafe { libc::dlsym(h, SYMBOL.as_ptr()) };
            // SAFETY: releases the reference taken by dlopen above; our loader keeps its own.
            unsafe { libc::dlclose(h) };
            p == global
        });
        return CudarcLibcuda::Linked { same };
    }
    let found = gpudirect_sys::cuda::CANDIDATES.iter().any(|name| {
        let Ok(name) = std::ffi::CString::new(*name) else {
            return false;
        };
        // SAFETY: opens the system's CUDA driver library by name (our loader has loaded one, so
        // its initialisers are sound to run); the handle is closed at once.
        let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
        if h.is_null() {
            return false;
        }
        // SAFETY: `h` came from dlopen above and is released once.
        unsafe { libc::dlclose(h) };
        true
    });
    CudarcLibcuda::ByName { found }
}

/// `Ok` when cudarc will call the libcuda gpudirect checked (the one our loader opened at
/// `ours`); else the error that says why not.
fn cudarc_loader_check(view: CudarcLibcuda, ours: &str) -> Result<()> {
    match view {
        CudarcLibcuda::Linked { same: true } | CudarcLibcuda::ByName { found: true } => Ok(()),
        CudarcLibcuda::Linked { same: false } => Err(Error::invalid(
            gpudirect_sys::cuda::PATH_ENV,
            ours,
            "this program links libcuda at build time (cudarc's `dynamic-linking`), and the \
             variable names another library: unset it, or link the library it names",
        )),
        CudarcLibcuda::ByName { found: false } => {
            Err(Error::Load(gpudirect_sys::LoadError::LibraryNotFound {
                library: "libcuda (cudarc's loader)",
                tried: gpudirect_sys::cuda::CANDIDATES
                    .iter()
                    .map(|c| c.to_string())
                    .collect(),
                detail: format!(
                    "gpudirect opened {ours} (via {} or its own candidates), but cudarc opens \
                     libcuda by file name only and would panic: put that library's directory on \
                     LD_LIBRARY_PATH",
                    gpudirect_sys::cuda::PATH_ENV
                ),
            }))
        }
    }
}

/// `cuDeviceGetCount`: how many CUDA devices are visible.
///
/// # Errors
///
/// As [`init`]; [`Error::Cuda`] from `cuDeviceGetCount`.
#[doc(alias = "cuDeviceGetCount")]
pub fn device_count() -> Result<usize> {
    init()?;
    // SAFETY: the driver is initialised.
    unsafe { crate::driver::device::count() }
}

/// The primary context of device `ordinal`, through cudarc, after the presence checks.
///
/// # Errors
///
/// [`Error::Load`] without libcuda, [`Error::DriverTooOld`], [`Error::NoDevice`] when `ordinal`
/// is past the device count.
#[doc(alias = "cuDevicePrimaryCtxRetain")]
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    let n = device_count()?;
    if ordinal >= n {
        return Err(Error::NoDevice {
            what: "CUDA device",
            reason: format!("device {ordinal} requested, {n} visible"),
        });
    }
    CudaContext::new(ordinal).map_err(|e| from_driver("cuDevicePrimaryCtxRetain", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libcuda_cudarc_cannot_find_is_a_load_error_naming_its_candidates() {
        let ours = "/opt/x/libcuda.so.1";
        assert!(cudarc_loader_check(CudarcLibcuda::ByName { found: true }, ours).is_ok());
        assert!(cudarc_loader_check(CudarcLibcuda::Linked { same: true }, ours).is_ok());
        let e = cudarc_loader_check(CudarcLibcuda::Linked { same: false }, ours).unwrap_err();
        assert!(e.to_string().contains("dynamic-linking"), "{e}");
        assert!(e.to_string().contains("GPUDIRECT_LIBCUDA_PATH"), "{e}");
        assert_eq!(e.absence(), None, "a setting to fix, not something absent");
        let e = cudarc_loader_check(CudarcLibcuda::ByName { found: false }, ours).unwrap_err();
        match &e {
            Error::Load(gpudirect_sys::LoadError::LibraryNotFound { tried, detail, .. }) => {
                assert!(tried.iter().any(|t| t == "libcuda.so.1"), "{tried:?}");
                assert!(detail.contains("/opt/x/libcuda.so.1"), "{detail}");
                assert!(detail.contains("GPUDIRECT_LIBCUDA_PATH"), "{detail}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}
