//! Presence of `libcuda` and the driver version, checked before any cudarc call.
//!
//! cudarc panics when libcuda is absent and when a symbol an older driver lacks is first called.
//! Everything in gpudirect that touches CUDA calls [`driver`] first, and [`require_symbols`] for
//! entry points newer than the oldest supported driver.

use crate::loader::{self, LoadError, Opened};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Candidate file names for the CUDA driver library, in the order tried. cudarc's own list contains
/// both, so whatever opens here also opens there.
pub const CANDIDATES: &[&str] = &["libcuda.so.1", "libcuda.so"];

/// Environment variable naming an explicit path to `libcuda.so`, tried first. cudarc opens
/// libcuda by file name only, so the override is meaningful only where cudarc finds the same
/// library (`gpudirect::cuda::init` refuses the case where cudarc finds none).
pub const PATH_ENV: &str = "GPUDIRECT_LIBCUDA_PATH";

/// The CUDA driver library, opened by our own loader.
#[derive(Debug)]
pub struct Driver {
    opened: Opened,
    version: i32,
    symbols: Mutex<HashMap<&'static str, bool>>,
    batch: OnceLock<Option<MemcpyBatch>>,
    func_load: OnceLock<Option<FuncLoad>>,
}

impl Driver {
    /// Where the library was loaded from.
    pub fn path(&self) -> &str {
        &self.opened.path
    }

    /// `cuDriverGetVersion`: the driver's CUDA version as `1000 * major + 10 * minor`
    /// (13000 for CUDA 13.0).
    #[doc(alias = "cuDriverGetVersion")]
    pub fn version(&self) -> i32 {
        self.version
    }

    /// `cuMemcpyBatchAsync_v2` or `cuMemcpyBatchAsync`, when the driver exports one (drivers of
    /// CUDA 12.8 and later); looked up once.
    #[doc(alias = "cuMemcpyBatchAsync")]
    pub fn memcpy_batch(&self) -> Option<MemcpyBatch> {
        *self.batch.get_or_init(|| {
            // SAFETY: each name is looked up with the signature its CUDA version declares.
            unsafe {
                loader::symbol::<MemcpyBatchAsyncV2>(
                    "libcuda",
                    &self.opened,
                    "cuMemcpyBatchAsync_v2",
                )
                .map(MemcpyBatch::V2)
                .or_else(|_| {
                    loader::symbol::<MemcpyBatchAsyncV1>(
                        "libcuda",
                        &self.opened,
                        "cuMemcpyBatchAsync",
                    )
                    .map(MemcpyBatch::V1)
                })
                .ok()
            }
        })
    }

    /// `cuFuncLoad`, when the driver exports it (CUDA 12.4 and later); looked up once.
    #[doc(alias = "cuFuncLoad")]
    pub fn func_load(&self) -> Option<FuncLoad> {
        *self.func_load.get_or_init(|| {
            // SAFETY: the name is looked up with the signature CUDA declares for it.
            unsafe { loader::symbol::<FuncLoad>("libcuda", &self.opened, "cuFuncLoad").ok() }
        })
    }

    /// Whether the driver exports `symbol`.
    pub fn has_symbol(&self, symbol: &'static str) -> bool {
        let mut cache = self.symbols.lock().unwrap_or_else(|e| e.into_inner());
        *cache.entry(symbol).or_insert_with(|| {
            // SAFETY: only presence is checked; the pointer is never called through this type.
            unsafe { loader::symbol::<*const ()>("libcuda", &self.opened, symbol) }.is_ok()
        })
    }
}

/// `CUmemLocation` (CUDA 12.8 and 13.0 layout): a location's type and id.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemLocation {
    /// `CUmemLocationType` (0: invalid, 1: a device).
    pub kind: u32,
    /// The device ordinal when `kind` is a device.
    pub id: i32,
}

/// `CUmemcpyAttributes` (CUDA 12.8 and 13.0 layout): how a batch's copies may access their
/// sources. The location hints matter only for managed memory.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemcpyAttributes {
    /// `CUmemcpySrcAccessOrder`: [`MEMCPY_SRC_ACCESS_ORDER_STREAM`] reads each source in stream
    /// order, as `cuMemcpyAsync` does.
    pub src_access_order: u32,
    /// Where the source lives (a hint).
    pub src_loc_hint: MemLocation,
    /// Where the destination lives (a hint).
    pub dst_loc_hint: MemLocation,
    /// `CUmemcpyFlags` (0: default).
    pub flags: u32,
}

/// `CU_MEMCPY_SRC_ACCESS_ORDER_STREAM`.
pub const MEMCPY_SRC_ACCESS_ORDER_STREAM: u32 = 1;

/// `cuMemcpyBatchAsync` as CUDA 12.8 and 12.9 declare it (with `failIdx`).
pub type MemcpyBatchAsyncV1 = unsafe extern "C" fn(
    dsts: *mut u64,
    srcs: *mut u64,
    sizes: *mut usize,
    count: usize,
    attrs: *mut MemcpyAttributes,
    attrs_idxs: *mut usize,
    num_attrs: usize,
    fail_idx: *mut usize,
    stream: *mut std::ffi::c_void,
) -> i32;

/// `CUresult cuFuncLoad(CUfunction function)`: load a function of a lazily loaded module now.
pub type FuncLoad = unsafe extern "C" fn(function: *mut std::ffi::c_void) -> i32;

/// `cuMemcpyBatchAsync_v2` (CUDA 13.0 and later: no `failIdx`).
pub type MemcpyBatchAsyncV2 = unsafe extern "C" fn(
    dsts: *mut u64,
    srcs: *mut u64,
    sizes: *mut usize,
    count: usize,
    attrs: *mut MemcpyAttributes,
    attrs_idxs: *mut usize,
    num_attrs: usize,
    stream: *mut std::ffi::c_void,
) -> i32;

/// The batch copy entry point the driver exports, newest first.
#[derive(Debug, Clone, Copy)]
pub enum MemcpyBatch {
    /// `cuMemcpyBatchAsync` (CUDA 12.8 ABI).
    V1(MemcpyBatchAsyncV1),
    /// `cuMemcpyBatchAsync_v2` (CUDA 13.0 ABI).
    V2(MemcpyBatchAsyncV2),
}

impl MemcpyBatch {
    /// Queue `dsts.len()` copies (`sizes[i]` bytes from `srcs[i]` to `dsts[i]`) on `stream` in
    /// one call, every source read in stream order; returns the `CUresult`.
    ///
    /// # Safety
    ///
    /// The three slices have one length; every range is memory the driver can copy for as long
    /// as the stream may run the copies; `stream` is a live stream of the current context.
    pub unsafe fn call(
        self,
        dsts: &mut [u64],
        srcs: &mut [u64],
        sizes: &mut [usize],
        stream: *mut std::ffi::c_void,
    ) -> i32 {
        let n = dsts.len().min(srcs.len()).min(sizes.len());
        let mut attrs = MemcpyAttributes {
            src_access_order: MEMCPY_SRC_ACCESS_ORDER_STREAM,
            ..Default::default()
        };
        let mut idx = 0usize;
        match self {
            // SAFETY: `n` entries in each array, one attribute applying from copy 0; the rest as
            // the caller guarantees.
            MemcpyBatch::V2(f) => unsafe {
                f(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    n,
                    &mut attrs,
                    &mut idx,
                    1,
                    stream,
                )
            },
            MemcpyBatch::V1(f) => {
                let mut failed = usize::MAX;
                // SAFETY: as above, and one out-pointer for the failing index.
                unsafe {
                    f(
                        dsts.as_mut_ptr(),
                        srcs.as_mut_ptr(),
                        sizes.as_mut_ptr(),
                        n,
                        &mut attrs,
                        &mut idx,
                        1,
                        &mut failed,
                        stream,
                    )
                }
            }
        }
    }
}

/// `cuDriverGetVersion(int*)`.
type DriverGetVersion = unsafe extern "C" fn(*mut i32) -> i32;

/// Open libcuda once and read its version. Never panics.
pub fn driver() -> Result<&'static Driver, LoadError> {
    static DRIVER: OnceLock<Result<Driver, LoadError>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            // SAFETY: the system's CUDA driver library is sound to load.
            let opened = unsafe { loader::open("libcuda", CANDIDATES, Some(PATH_ENV)) }?;
            // SAFETY: cuDriverGetVersion has this signature in every CUDA version.
            let get: DriverGetVersion =
                unsafe { loader::symbol("libcuda", &opened, "cuDriverGetVersion") }?;
            let mut version = 0;
            // SAFETY: one valid out-pointer; the call needs no cuInit.
            let rc = unsafe { get(&mut version) };
            if rc != 0 {
                version = 0;
            }
            Ok(Driver {
                opened,
                version,
                symbols: Mutex::new(HashMap::new()),
                batch: OnceLock::new(),
                func_load: OnceLock::new(),
            })
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Check that every symbol in `symbols` is exported, so that calling it through cudarc cannot
/// panic. Returns the first missing one as [`LoadError::SymbolNotFound`].
pub fn require_symbols(symbols: &[&'static str]) -> Result<&'static Driver, LoadError> {
    let d = driver()?;
    for s in symbols {
        if !d.has_symbol(s) {
            return Err(LoadError::SymbolNotFound {
                library: "libcuda",
                path: d.path().to_string(),
                symbol: s,
            });
        }
    }
    Ok(d)
}
