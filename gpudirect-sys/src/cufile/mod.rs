//! `libcufile` (GPUDirect Storage): types generated from `cufile.h` and a run-time function table.
//!
//! # Loading
//!
//! [`lib`] opens the library once per process, trying in order:
//!
//! 1. the path in the environment variable [`PATH_ENV`] (`GPUDIRECT_LIBCUFILE_PATH`) when it is set
//!    and non-empty;
//! 2. `libcufile.so.0` (the soname every CUDA toolkit and the `nvidia-cufile` wheels ship);
//! 3. `libcufile.so` (a development symlink).
//!
//! The explicit path comes **first**, not last as first sketched in the issue: an override that is
//! only consulted when nothing else loads cannot select a wheel's library on a node whose CUDA
//! toolkit also has one, which is what both the tier-0 test and users pinning a version need. This
//! is the same order as libcuda's loader (`GPUDIRECT_LIBCUDA_PATH`).
//!
//! Opening the library does not call into it. [`Lib::version`] (`cuFileGetVersion`) is read on
//! first use; it needs no CUDA driver.
//!
//! # Versions and layouts
//!
//! [`bindings`] is generated from the 1.15 header (CUDA 13.0). Every struct that crosses the
//! boundary (`CUfileDrvProps_t`, `CUfileDescr_t`, `CUfileIOParams_t`, `CUfileIOEvents_t`,
//! `CUfileError_t`) was compared with the 1.14 and 1.20 headers by [`layouts`]' tests: the layouts
//! are identical in those three versions. What changed between them is *additive*: new error codes
//! (5039–5049 from 1.15), new parameters at the end of the parameter enums (1.20:
//! `CUFILE_PARAM_PROPERTIES_POSIX_IO_MODE`, `CUFILE_PARAM_GDS_FALLBACK_IO`,
//! `CUFILE_PARAM_RDMA_TRANSPORT`), new functions (the optional fields of [`Lib`]) and the statistics
//! structs (not bound). Callers must still gate parameters on [`Lib::version`], and read driver
//! properties through [`Lib::driver_properties`], which hands cuFile a buffer with slack past the
//! known struct so that a future, larger `CUfileDrvProps_t` cannot write out of bounds.
//!
//! `cuFileDriverClose` is a macro for `cuFileDriverClose_v2` in every header: the table holds the
//! `_v2` symbol.

#![allow(non_snake_case, non_camel_case_types)]

pub mod bindings;
mod errors;
pub mod layouts;

pub use bindings::*;
pub use errors::OP_ERRORS;
/// Parameters first seen in the 1.20 header (appended to their enums; refuse them on older
/// libraries, where the numbers are out of range).
pub use layouts::v1_20::{
    CUFILE_PARAM_GDS_FALLBACK_IO, CUFILE_PARAM_PROPERTIES_POSIX_IO_MODE,
    CUFILE_PARAM_RDMA_TRANSPORT,
};

use crate::loader::{self, LoadError, Opened};
use core::ffi::{c_char, c_int, c_long, c_uint, c_void};
use std::sync::OnceLock;

/// Candidate file names, in the order tried after [`PATH_ENV`].
pub const CANDIDATES: &[&str] = &["libcufile.so.0", "libcufile.so"];

/// Environment variable naming an explicit path to `libcufile.so.0`, tried first.
pub const PATH_ENV: &str = "GPUDIRECT_LIBCUFILE_PATH";

/// `CUstream` (an opaque pointer in `cuda.h`).
pub type CUstream = *mut c_void;

/// `ssize_t`.
pub type ssize_t = isize;

/// The oldest cuFile version whose headers were checked (`1000 * major + 10 * minor`).
pub const OLDEST_KNOWN_VERSION: i32 = 1140;
/// The newest cuFile version whose headers were checked.
pub const NEWEST_KNOWN_VERSION: i32 = 1200;

/// The name of a `CUfileOpError` code (`CU_FILE_INVALID_VALUE`), if the headers know it.
pub fn op_error_name(code: u32) -> Option<&'static str> {
    OP_ERRORS
        .iter()
        .find(|(c, ..)| *c == code)
        .map(|(_, n, _)| *n)
}

/// The header's description of a `CUfileOpError` code.
pub fn op_error_description(code: u32) -> Option<&'static str> {
    OP_ERRORS
        .iter()
        .find(|(c, ..)| *c == code)
        .map(|(.., d)| *d)
}

macro_rules! cufile_table {
    (
        required { $( $name:ident = fn ( $($arg:ty),* ) -> $ret:ty ; )* }
        optional { $( $oname:ident = fn ( $($oarg:ty),* ) -> $oret:ty ; )* }
    ) => {
        /// The `libcufile` function table. Required entries exist in every version from 1.14;
        /// optional ones (`Option`) are newer and `None` where the loaded library lacks them.
        ///
        /// Calling any entry is `unsafe`: the caller upholds cuFile's documented contract.
        #[derive(Debug)]
        pub struct Lib {
            opened: Opened,
            version: OnceLock<Option<i32>>,
            $(
                #[doc = concat!("`", stringify!($name), "`.")]
                pub $name: unsafe extern "C" fn($($arg),*) -> $ret,
            )*
            $(
                #[doc = concat!("`", stringify!($oname), "` (newer versions only).")]
                pub $oname: Option<unsafe extern "C" fn($($oarg),*) -> $oret>,
            )*
        }

        impl Lib {
            fn load(opened: Opened) -> Result<Lib, LoadError> {
                $(
                    // SAFETY: the field's type is the C prototype from cufile.h.
                    let $name = unsafe { loader::symbol(LIBRARY, &opened, stringify!($name)) }?;
                )*
                $(
                    // SAFETY: as above; absence is allowed.
                    let $oname = unsafe { loader::symbol(LIBRARY, &opened, stringify!($oname)) }.ok();
                )*
                Ok(Lib { opened, version: OnceLock::new(), $($name,)* $($oname,)* })
            }
        }
    };
}

const LIBRARY: &str = "libcufile";

cufile_table! {
    required {
        cuFileDriverOpen = fn() -> CUfileError_t;
        cuFileDriverClose_v2 = fn() -> CUfileError_t;
        cuFileUseCount = fn() -> c_long;
        cuFileDriverGetProperties = fn(*mut CUfileDrvProps_t) -> CUfileError_t;
        cuFileDriverSetPollMode = fn(bool, usize) -> CUfileError_t;
        cuFileDriverSetMaxDirectIOSize = fn(usize) -> CUfileError_t;
        cuFileDriverSetMaxCacheSize = fn(usize) -> CUfileError_t;
        cuFileDriverSetMaxPinnedMemSize = fn(usize) -> CUfileError_t;
        cuFileHandleRegister = fn(*mut CUfileHandle_t, *mut CUfileDescr_t) -> CUfileError_t;
        cuFileHandleDeregister = fn(CUfileHandle_t) -> ();
        cuFileBufRegister = fn(*const c_void, usize, c_int) -> CUfileError_t;
        cuFileBufDeregister = fn(*const c_void) -> CUfileError_t;
        cuFileRead = fn(CUfileHandle_t, *mut c_void, usize, off_t, off_t) -> ssize_t;
        cuFileWrite = fn(CUfileHandle_t, *const c_void, usize, off_t, off_t) -> ssize_t;
        cuFileBatchIOSetUp = fn(*mut CUfileBatchHandle_t, c_uint) -> CUfileError_t;
        cuFileBatchIOSubmit = fn(CUfileBatchHandle_t, c_uint, *mut CUfileIOParams_t, c_uint) -> CUfileError_t;
        cuFileBatchIOGetStatus = fn(CUfileBatchHandle_t, c_uint, *mut c_uint, *mut CUfileIOEvents_t, *mut libc::timespec) -> CUfileError_t;
        cuFileBatchIOCancel = fn(CUfileBatchHandle_t) -> CUfileError_t;
        cuFileBatchIODestroy = fn(CUfileBatchHandle_t) -> ();
        cuFileReadAsync = fn(CUfileHandle_t, *mut c_void, *mut usize, *mut off_t, *mut off_t, *mut ssize_t, CUstream) -> CUfileError_t;
        cuFileWriteAsync = fn(CUfileHandle_t, *mut c_void, *mut usize, *mut off_t, *mut off_t, *mut ssize_t, CUstream) -> CUfileError_t;
        cuFileStreamRegister = fn(CUstream, c_uint) -> CUfileError_t;
        cuFileStreamDeregister = fn(CUstream) -> CUfileError_t;
        cuFileGetVersion = fn(*mut c_int) -> CUfileError_t;
        cuFileGetParameterSizeT = fn(CUFileSizeTConfigParameter_t, *mut usize) -> CUfileError_t;
        cuFileGetParameterBool = fn(CUFileBoolConfigParameter_t, *mut bool) -> CUfileError_t;
        cuFileGetParameterString = fn(CUFileStringConfigParameter_t, *mut c_char, c_int) -> CUfileError_t;
        cuFileSetParameterSizeT = fn(CUFileSizeTConfigParameter_t, usize) -> CUfileError_t;
        cuFileSetParameterBool = fn(CUFileBoolConfigParameter_t, bool) -> CUfileError_t;
        cuFileSetParameterString = fn(CUFileStringConfigParameter_t, *const c_char) -> CUfileError_t;
    }
    optional {
        cuFileGetParameterMinMaxValue = fn(CUFileSizeTConfigParameter_t, *mut usize, *mut usize) -> CUfileError_t;
        cuFileGetBARSizeInKB = fn(c_int, *mut usize) -> CUfileError_t;
    }
}

/// Bytes of slack handed to `cuFileDriverGetProperties` past the known `CUfileDrvProps_t`.
pub const PROPS_SLACK: usize = 256;

impl Lib {
    /// Where the library was loaded from.
    pub fn path(&self) -> &str {
        &self.opened.path
    }

    /// `cuFileGetVersion`: `1000 * major + 10 * minor` (1150 for 1.15), or `None` when the library
    /// cannot say. Read once; needs no CUDA driver.
    #[doc(alias = "cuFileGetVersion")]
    pub fn version(&self) -> Option<i32> {
        *self.version.get_or_init(|| {
            let mut v: c_int = 0;
            // SAFETY: one valid out-pointer; the call reads a constant of the library.
            let r = unsafe { (self.cuFileGetVersion)(&mut v) };
            (r.err == CU_FILE_SUCCESS && v > 0).then_some(v)
        })
    }

    /// `cuFileDriverGetProperties` into a buffer [`PROPS_SLACK`] bytes larger than the 1.14–1.20
    /// struct, returning the common (identical) layout.
    ///
    /// # Safety
    ///
    /// The driver must be open (cuFile's contract).
    #[doc(alias = "cuFileDriverGetProperties")]
    pub unsafe fn driver_properties(&self) -> Result<CUfileDrvProps_t, CUfileError_t> {
        #[repr(C)]
        struct Slack {
            props: CUfileDrvProps_t,
            _slack: [u8; PROPS_SLACK],
        }
        // SAFETY: all-zero is a valid value of these plain-data structs.
        let mut buf: Slack = unsafe { std::mem::zeroed() };
        // SAFETY: the pointer covers the known struct plus slack; the caller opened the driver.
        let r = unsafe { (self.cuFileDriverGetProperties)(&mut buf.props) };
        if r.err == CU_FILE_SUCCESS {
            Ok(buf.props)
        } else {
            Err(r)
        }
    }
}

/// Open libcufile once per process (see the module docs for the order). Never panics.
pub fn lib() -> Result<&'static Lib, LoadError> {
    static LIB: OnceLock<Result<Lib, LoadError>> = OnceLock::new();
    LIB.get_or_init(|| {
        // SAFETY: libcufile's initialisers only set up its own state (it dlopens libcuda lazily,
        // on cuFileDriverOpen).
        let opened = unsafe { loader::open(LIBRARY, CANDIDATES, Some(PATH_ENV)) }?;
        Lib::load(opened)
    })
    .as_ref()
    .map_err(Clone::clone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_names_come_from_the_header() {
        assert_eq!(op_error_name(5022), Some("CU_FILE_INVALID_VALUE"));
        assert_eq!(op_error_name(5027), Some("CU_FILE_HANDLE_NOT_REGISTERED"));
        assert_eq!(op_error_name(5011), Some("CU_FILE_CUDA_DRIVER_ERROR"));
        assert_eq!(op_error_name(0), Some("CU_FILE_SUCCESS"));
        assert_eq!(op_error_name(4999), None);
        assert_eq!(CU_FILE_INVALID_VALUE, 5022);
        assert_eq!(CU_FILE_CUDA_DRIVER_ERROR, 5011);
        assert!(
            op_error_description(5007)
                .unwrap()
                .contains("not supported")
        );
    }

    #[test]
    fn the_close_symbol_is_v2_and_candidates_are_documented() {
        assert_eq!(CANDIDATES, ["libcufile.so.0", "libcufile.so"]);
        assert_eq!(PATH_ENV, "GPUDIRECT_LIBCUFILE_PATH");
    }
}
