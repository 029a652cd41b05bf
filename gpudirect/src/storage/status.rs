//! cuFile's status codes and the errors of its data-path calls, as [`Error`]s.

use crate::error::{Error, Result};
use gpudirect_sys::cufile as sys;

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
        cu_name: crate::driver::error_name(cu_err),
    }
}

/// The error of a data-path call returning `ssize_t`: `-1` with errno, or `-CUfileOpError`.
pub(crate) fn io_error(call: &'static str, ret: isize) -> Error {
    if ret == -1 {
        Error::last_os(call)
    } else {
        let code = ret.unsigned_abs();
        if code >= sys::CUFILEOP_BASE_ERR as usize {
            // A code past u32 is no CUfileOpError: keep it unknown rather than truncate it.
            cufile_error(call, u32::try_from(code).unwrap_or(u32::MAX), 0)
        } else {
            // Some paths return -errno (below CUFILEOP_BASE_ERR, so it fits an i32).
            Error::errno(call, code as i32)
        }
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

    use proptest::prelude::*;

    proptest! {
        #[test]
        fn io_errors_never_truncate_codes(ret in isize::MIN..0) {
            match io_error("cuFileRead", ret) {
                Error::CuFile { code, .. } => {
                    let abs = ret.unsigned_abs();
                    prop_assert!(abs >= 5000);
                    prop_assert_eq!(code as usize, abs.min(u32::MAX as usize));
                }
                Error::Os { source, .. } => {
                    let abs = ret.unsigned_abs();
                    prop_assert!(ret == -1 || (abs < 5000 && source.raw_os_error() == Some(abs as i32)));
                }
                other => prop_assert!(false, "{other}"),
            }
        }
    }
}
