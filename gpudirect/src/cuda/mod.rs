//! Presence-checked CUDA: what GPUDirect needs beyond cudarc.
//!
//! Call [`init`] (or anything that calls it) before any cudarc API: it checks that libcuda exists
//! and is new enough, so a missing or old driver is an [`Error`], never a cudarc panic.
//!
//! Ordering: [`Stream`] wraps cudarc's `CudaStream` with a completion [`Timeline`](crate::completion::Timeline)
//! (amortised fences), cross-stream event waits, host callbacks ([`Stream::launch_host_fn`]) and
//! stream memory operations ([`MemopFlags`] and [`Stream::batch_mem_ops`]: wait on and write
//! 32/64-bit values, batches).
//!
//! # CUDA graphs
//!
//! Nothing in gpudirect queues work on a stream that is capturing a CUDA graph: every such call
//! (copies, stream memory operations, host functions, events, peer copies, cuFile's stream-ordered
//! I/O) answers [`Error::StreamCapturing`] before queueing anything. Work captured into a graph
//! runs at every launch of the graph, long after any fence the library could take, so the memory
//! it touches could not be tracked. Capture with cudarc on [`Stream::cuda`] for your own kernels,
//! and queue gpudirect's work outside the capture. If a capture begins on another thread while a
//! call is queueing, the call notices it right after, invalidates that capture and leaks what the
//! work uses (never frees it); a capture begun *and* ended by another thread within one call is
//! not seen.

mod device;
mod memop;
mod private;
#[cfg(test)]
mod proptests;
mod stream;

pub use device::DeviceInfo;
pub use memop::{
    MAX_BATCH_MEM_OPS, MAX_FLAG_SLOTS, MEMOP_SYMBOLS, MemOp, MemopFlags, WaitCondition,
    batch_chunks,
};
pub use stream::Stream;

pub(crate) use private::on_private_stream;

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

/// A `CUmemLocation` of kind `type_` and `id` (a device ordinal, a NUMA node), for every binding
/// version: from CUDA 13.2 on, cudarc's `CUmemLocation` holds `id` in an anonymous union, with the
/// same layout (a C `int` after the 4-byte kind).
pub(crate) fn mem_location(type_: sys::CUmemLocationType, id: i32) -> sys::CUmemLocation {
    const _: () = assert!(
        size_of::<sys::CUmemLocation>() == 8
            && size_of::<sys::CUmemLocationType>() == 4
            && std::mem::offset_of!(sys::CUmemLocation, type_) == 0
    );
    // SAFETY: a plain C struct for which all-zero is valid (CU_MEM_LOCATION_TYPE_INVALID, id 0).
    let mut loc: sys::CUmemLocation = unsafe { std::mem::zeroed() };
    loc.type_ = type_;
    // SAFETY: bytes 4..8 are `id` (a C int) in every version: 8 bytes in all, the 4-byte kind at
    // offset 0 (asserted above); `loc` is a live local, written in bounds and aligned (align 4).
    unsafe { (&raw mut loc).cast::<u8>().add(4).cast::<i32>().write(id) };
    loc
}

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
    fn mem_location_sets_kind_and_id() {
        let loc = mem_location(
            sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            0x0102_0304,
        );
        // SAFETY: CUmemLocation is 8 bytes of plain data (asserted in `mem_location`).
        let raw: [u8; 8] = unsafe { std::mem::transmute(loc) };
        let kind = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as u32;
        assert_eq!(raw[..4], kind.to_ne_bytes());
        assert_eq!(raw[4..], 0x0102_0304_i32.to_ne_bytes());
    }

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
