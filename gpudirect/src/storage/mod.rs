//! GPUDirect Storage: the cuFile driver, file handles, buffer registration, blocking, stream-ordered
//! and batch I/O, and an automatic path that falls back to (or prefers) the library's own POSIX path.
//!
//! | type | what | C |
//! | --- | --- | --- |
//! | [`Driver`] | process-wide, reference-counted driver; properties and parameters | `cuFileDriverOpen` |
//! | [`FileHandle`] | a file registered with cuFile; blocking and async I/O | `cuFileHandleRegister` |
//! | [`BufRegistration`] | a registered device buffer range | `cuFileBufRegister` |
//! | [`AsyncIo`] | an I/O ordered on a stream, owning what it touches | `cuFileReadAsync` |
//! | [`Batch`] | up to `max_batch_io_size` requests at once | `cuFileBatchIOSubmit` |
//! | [`File`] | the automatic path: cuFile or our POSIX path, reporting which ran | – |
//! | [`posix`] | the POSIX path's configuration: reader threads, pinned bounce buffers, pipelined copies | `pread` |
//!
//! Every call that touches CUDA checks libcuda first ([`crate::cuda::init`]), so the driver can be
//! the first CUDA-touching call of a program (acceptance case A13), and a missing libcuda or
//! libcufile is an [`crate::Error::Load`], never a panic or a hang (the 1.20 library
//! hangs in `cuFileDriverOpen` when libcuda is absent; we never call it then).

mod async_io;
mod auto;
mod batch;
mod buffer;
mod driver;
mod file;
mod io;
pub mod posix;

pub use async_io::{AsyncIo, AsyncResources};
pub use auto::{File, Mode, Path, PathReason, PathTaken, Transfer};
pub use batch::{Batch, BatchOp, BatchRequest, BatchResult, BatchStatus, run_batched};
pub use buffer::BufRegistration;
pub use driver::{BoolParam, Driver, DriverProperties, FsSupport, SizeParam, StringParam};
pub use file::{DirectIo, FileHandle, OpenOptions};
pub use io::MAX_BYTES_PER_CALL;

use crate::error::{Error, Result};
use cudarc::driver::CudaContext;
use gpudirect_sys::cufile as sys;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Turn a `CUfileError_t` from `call` into a `Result`.
pub(crate) fn check(call: &'static str, e: sys::CUfileError_t) -> Result<()> {
    if e.err == sys::CU_FILE_SUCCESS {
        Ok(())
    } else {
        Err(cufile_error(call, e.err, e.cu_err))
    }
}

/// An [`Error::CuFile`] from a code and a CUDA cause.
pub(crate) fn cufile_error(call: &'static str, code: u32, cu_err: i32) -> Error {
    Error::CuFile {
        call,
        code,
        name: sys::op_error_name(code).unwrap_or("CU_FILE_UNKNOWN_ERROR"),
        cu_err,
        cu_name: cuda_error_name(cu_err),
    }
}

/// The error of a data-path call returning `ssize_t`: `-1` with errno, or `-CUfileOpError`.
pub(crate) fn io_error(call: &'static str, ret: isize) -> Error {
    if ret == -1 {
        Error::last_os(call)
    } else {
        let code = ret.unsigned_abs();
        if code >= sys::CUFILEOP_BASE_ERR as usize {
            cufile_error(call, code as u32, 0)
        } else {
            // Some paths return -errno.
            Error::errno(call, code as i32)
        }
    }
}

/// `cuGetErrorName` for a raw `CUresult`, looked up without building the enum (never transmuted).
fn cuda_error_name(code: i32) -> Option<String> {
    if code == 0 {
        return None;
    }
    type GetName = unsafe extern "C" fn(i32, *mut *const libc::c_char) -> i32;
    let d = gpudirect_sys::cuda::driver().ok()?;
    if !d.has_symbol("cuGetErrorName") {
        return None;
    }
    // SAFETY: RTLD_NOLOAD only finds the already loaded libcuda; the name is NUL-terminated.
    let h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if h.is_null() {
        return None;
    }
    // SAFETY: valid handle and NUL-terminated name.
    let f = unsafe { libc::dlsym(h, c"cuGetErrorName".as_ptr()) };
    let name = if f.is_null() {
        None
    } else {
        // SAFETY: cuGetErrorName(CUresult (a 32-bit C enum), const char**) -> CUresult.
        let f: GetName = unsafe { std::mem::transmute::<*mut libc::c_void, GetName>(f) };
        let mut p = std::ptr::null();
        // SAFETY: one valid out-pointer; unknown codes answer CUDA_ERROR_INVALID_VALUE.
        let r = unsafe { f(code, &mut p) };
        (r == 0 && !p.is_null()).then(|| {
            // SAFETY: libcuda returns a static NUL-terminated string.
            unsafe { std::ffi::CStr::from_ptr(p) }
                .to_string_lossy()
                .into_owned()
        })
    };
    // SAFETY: balances the dlopen above (the library stays loaded: it was loaded before).
    unsafe { libc::dlclose(h) };
    name
}

/// Make device `ordinal`'s primary context current on this thread (cuFile uses the current
/// context), keeping one retained context per device for the process.
pub(crate) fn bind_device(ordinal: usize) -> Result<Arc<CudaContext>> {
    static CTX: OnceLock<Mutex<HashMap<usize, Arc<CudaContext>>>> = OnceLock::new();
    let ctx = {
        let mut map = CTX
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match map.get(&ordinal) {
            Some(c) => c.clone(),
            None => {
                let c = crate::cuda::context(ordinal)?;
                map.insert(ordinal, c.clone());
                c
            }
        }
    };
    ctx.bind_to_thread()
        .map_err(|e| crate::error::from_driver("cuCtxSetCurrent", e))?;
    Ok(ctx)
}

/// Check that `offset..offset + len` lies within `size` bytes of argument `arg`.
pub(crate) fn check_range(arg: &'static str, offset: usize, len: usize, size: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::invalid(
            arg,
            format!("{offset}..{offset}+{len}"),
            format!("must lie within the buffer's {size} bytes"),
        )),
    }
}

/// Check that a file range is representable as `off_t`.
pub(crate) fn check_file_range(file_offset: u64, len: usize) -> Result<()> {
    match file_offset.checked_add(len as u64) {
        Some(end) if end <= i64::MAX as u64 => Ok(()),
        _ => Err(Error::invalid(
            "file_offset",
            format!("{file_offset}+{len}"),
            "file_offset + len must not exceed i64::MAX",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cufile_errors_carry_code_name_and_cause() {
        let e = check(
            "cuFileHandleRegister",
            sys::CUfileError_t {
                err: 5027,
                cu_err: 0,
            },
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "cuFileHandleRegister failed: CU_FILE_HANDLE_NOT_REGISTERED (5027)"
        );
        let e = cufile_error("cuFileRead", 5011, 700);
        match &e {
            Error::CuFile { code, cu_err, .. } => assert_eq!((*code, *cu_err), (5011, 700)),
            other => panic!("{other:?}"),
        }
        assert!(e.to_string().contains("CUDA cause"), "{e}");
        let e = cufile_error("cuFileRead", 4242, 0);
        assert!(
            e.to_string().contains("CU_FILE_UNKNOWN_ERROR (4242)"),
            "{e}"
        );
    }

    #[test]
    fn io_errors_distinguish_errno_and_cufile_codes() {
        match io_error("cuFileRead", -5022) {
            Error::CuFile {
                code: 5022, name, ..
            } => assert_eq!(name, "CU_FILE_INVALID_VALUE"),
            other => panic!("{other:?}"),
        }
        match io_error("cuFileRead", -(libc::EIO as isize)) {
            Error::Os { source, .. } => assert_eq!(source.raw_os_error(), Some(libc::EIO)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn ranges_are_checked() {
        assert!(check_range("dst", 1, 4097, 4098).is_ok());
        let e = check_range("dst", 2, 4097, 4098).unwrap_err();
        assert!(e.to_string().contains("`dst`"), "{e}");
        assert!(check_range("dst", usize::MAX, 2, 4098).is_err());
        assert!(check_file_range(3, 4097).is_ok());
        assert!(check_file_range(i64::MAX as u64, 1).is_err());
    }
}
