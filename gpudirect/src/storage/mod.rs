//! GPUDirect Storage: the cuFile driver, file handles, buffer registration, blocking, stream-ordered
//! and batch I/O, and an automatic path that falls back to (or prefers) the library's own POSIX path.
//!
//! | type | what | C |
//! | --- | --- | --- |
//! | [`Driver`] | a handle to the process-wide driver, opened once and never closed; properties and parameters | `cuFileDriverOpen` |
//! | [`FileHandle`] | a file registered with cuFile; blocking and async I/O | `cuFileHandleRegister` |
//! | [`BufRegistration`] | a registered device buffer range | `cuFileBufRegister` |
//! | [`AsyncIo`] | an I/O ordered on a stream, owning what it touches | `cuFileReadAsync` |
//! | [`Batch`] | up to `max_batch_io_size` requests at once | `cuFileBatchIOSubmit` |
//! | [`GdsFile`] | the automatic path: cuFile or our POSIX path, reporting which ran ([`IoPath`]) | – |
//! | [`PosixConfig`] | the POSIX path's configuration: reader threads, chunks, pipelining | `pread` |
//!
//! Every call that touches CUDA checks libcuda first ([`crate::cuda::init`]), so the driver can be
//! the first CUDA-touching call of a program, and a missing libcuda or
//! libcufile is an [`crate::Error::Load`], never a panic or a hang (the 1.20 library
//! hangs in `cuFileDriverOpen` when libcuda is absent; we never call it then).
//!
//! # End of file
//!
//! Every read path (blocking, stream-ordered, batch, the POSIX path, and so [`GdsFile`] whichever
//! path it picks) follows one rule: a read is first limited to the file's size (`fstat`, or the
//! device size for a block device), taken when the blocking call or batch submission starts, or
//! when the stream reaches a stream-ordered read (so earlier writes on that stream count). The
//! count returned is then `min(len, size - file_offset)` (0 at or past the end), and no byte of
//! the destination outside the bytes read changes. cuFile is never asked to read past the end of
//! a file: asked that, it changes destination bytes past the count (blocking and batch reads in
//! compatibility mode) or fails with `EIO` (`cuFileReadAsync`).
//!
//! A file that shrinks while a read runs is an [`crate::Error::FileShrank`] on every path, never
//! a silent short count: destination bytes past the size taken at the start are still unchanged,
//! but bytes between what was read and that size may have changed (cuFile may have written
//! them). A file that grows meanwhile is read up to the size taken at the start.
//!
//! # Threads
//!
//! [`Driver`] values may be opened, cloned and dropped from any number of threads: the first
//! open of the process calls `cuFileDriverOpen` under one process-wide lock (which the staged
//! parameters take too), and the driver stays open until the process exits; dropping handles
//! never closes it (closing and reopening cuFile's driver from several threads crashed it).
//!
//! # Arguments
//!
//! Offsets, lengths and configurations are checked before any library call, in release builds as
//! in debug ones: a buffer range lies within its buffer, a file range and a buffer offset end at
//! or below `i64::MAX` (`off_t`), and a [`PosixConfig`] stays within the bounds
//! [`PosixConfig::validate`] lists. A violation is an
//! [`crate::Error::InvalidArgument`] naming the argument.
//!
//! # The POSIX path
//!
//! Where cuFile is missing, cannot register a file, or runs in compatibility mode (no
//! nvidia-fs), [`GdsFile`] moves data itself: reader threads (kept for the life of the process;
//! the calling thread is one of them) `pread` chunks into pinned bounce chunks and queue each
//! chunk's copy to the GPU on their own stream right away, reading the next chunk while it runs;
//! chunks are claimed in file order from one counter, with no lock per chunk. Cold reads use
//! `O_DIRECT`. Thread counts and the chunk size come from the node's cores and the transfer's
//! size ([`PosixConfig::automatic`]: one reader per core up to 16, 4 MiB chunks), overridden per
//! file ([`GdsFile::set_posix_config`]) or by the environment (`GPUDIRECT_POSIX_THREADS`, ...).
//! Writes go through the page cache unless [`Durability::Durable`] is set (then `O_DIRECT` on
//! several threads, and `fdatasync` before the call returns). The bounce chunks and the copy
//! streams are the memory module's ([`BouncePool`](crate::memory::BouncePool),
//! [`CopyEngine`](crate::memory::CopyEngine)).

mod async_io;
mod auto;
mod batch;
mod buffer;
mod driver;
mod file;
mod io;
mod posix;
mod workers;

pub use async_io::{AsyncIo, AsyncIoFuture, AsyncResources};
pub use auto::{Durability, GdsFile, IoPath, Mode, PathReason, PathTaken, Transfer};
pub use batch::{Batch, BatchFuture, BatchOp, BatchRequest, BatchResult, BatchStatus, run_batched};
pub use buffer::BufRegistration;
pub use driver::{BoolParam, Driver, DriverProperties, FsSupport, SizeParam, StringParam};
pub use file::{DirectIo, FileHandle, OpenOptions};
pub use io::MAX_BYTES_PER_CALL;
pub use posix::{DIRECT_ALIGN, POSIX_ENV, PosixConfig};

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
    crate::driver::ctx::bind(&ctx)?;
    Ok(ctx)
}

// Sizes and offsets below convert `usize` to `u64` losslessly.
const _: () = assert!(usize::BITS <= u64::BITS);

/// The largest `off_t`: every file offset, buffer offset and the end of every range handed to
/// cuFile or to `pread`/`pwrite` stays at or below it.
pub(crate) const OFF_MAX: u64 = i64::MAX as u64;

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
        Some(end) if end <= OFF_MAX => Ok(()),
        _ => Err(Error::invalid(
            "file_offset",
            format!("{file_offset}+{len}"),
            "file_offset + len must not exceed i64::MAX",
        )),
    }
}

/// Check one transfer between `len` bytes at byte `buf_offset` of a buffer of `buf_len` bytes
/// (argument `arg`) and the file at `file_offset`: the buffer range lies in the buffer, and both
/// ranges end at or below `off_t`'s maximum (cuFile takes both offsets as `off_t`).
pub(crate) fn check_io(
    arg: &'static str,
    buf_offset: usize,
    file_offset: u64,
    len: usize,
    buf_len: usize,
) -> Result<()> {
    check_range(arg, buf_offset, len, buf_len)?;
    check_file_range(file_offset, len)?;
    match (buf_offset as u64).checked_add(len as u64) {
        Some(end) if end <= OFF_MAX => Ok(()),
        _ => Err(Error::invalid(
            arg,
            format!("{buf_offset}+{len}"),
            "buffer offset + len must not exceed i64::MAX",
        )),
    }
}

/// How many of the `len` bytes at `file_offset` a read asks for, given the file's size when it
/// starts (`None`: a file whose size cannot be known, not limited). Every read path limits its
/// request this way, so that no library is ever asked to read past the end of the file (cuFile
/// would then change destination bytes past the count, or fail).
pub(crate) fn clamp_read(file_offset: u64, len: usize, size: Option<u64>) -> usize {
    match size {
        None => len,
        Some(size) => {
            let avail = size.saturating_sub(file_offset);
            usize::try_from(avail).map_or(len, |avail| len.min(avail))
        }
    }
}

/// The outcome of a read that was limited to `expected` bytes ([`clamp_read`]) when the library
/// reported `got` (`Err` when it reported an error): `expected` itself, or
/// [`Error::FileShrank`] when the read stopped short (the file shrank meanwhile).
pub(crate) fn read_outcome(
    call: &'static str,
    file_offset: u64,
    expected: usize,
    got: Result<usize>,
) -> Result<usize> {
    match got {
        Ok(n) if n >= expected => Ok(expected),
        Ok(n) => Err(Error::FileShrank {
            call,
            file_offset,
            expected,
            got: n,
        }),
        Err(e) => Err(e),
    }
}

/// The size of the file behind `fd`, for [`clamp_read`]: `st_size` of a regular file, the
/// device size of a block device (`BLKGETSIZE64`), `None` for anything else.
///
/// # Errors
///
/// [`Error::Os`] from `fstat` or `ioctl`.
pub(crate) fn file_size(fd: std::os::fd::BorrowedFd<'_>) -> Result<Option<u64>> {
    use std::os::fd::AsRawFd;
    // SAFETY: zeroed stat is valid; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and out-pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(Error::last_os("fstat"));
    }
    match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => Ok(Some(u64::try_from(st.st_size).unwrap_or(0))),
        libc::S_IFBLK => block_device_size(fd),
        _ => Ok(None),
    }
}

/// `ioctl(fd, BLKGETSIZE64)`: a block device's size in bytes.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn block_device_size(fd: std::os::fd::BorrowedFd<'_>) -> Result<Option<u64>> {
    use std::os::fd::AsRawFd;
    // _IOR(0x12, 114, size_t) on architectures with the generic ioctl encoding.
    const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through a valid out-pointer.
    if unsafe { libc::ioctl(fd.as_raw_fd(), BLKGETSIZE64 as _, &mut size) } != 0 {
        return Err(Error::last_os("ioctl(BLKGETSIZE64)"));
    }
    Ok(Some(size))
}

/// Elsewhere the size is not known: reads are not limited (as for other special files).
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn block_device_size(_fd: std::os::fd::BorrowedFd<'_>) -> Result<Option<u64>> {
    Ok(None)
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

    #[test]
    fn reads_are_limited_to_the_file_size() {
        // A file of 22,295 bytes, 8,192 bytes asked at 18,295: 4,000 are there.
        assert_eq!(clamp_read(18_295, 8192, Some(22_295)), 4000);
        assert_eq!(clamp_read(22_295, 8192, Some(22_295)), 0);
        assert_eq!(clamp_read(30_000, 8192, Some(22_295)), 0);
        assert_eq!(clamp_read(0, 8192, Some(22_295)), 8192);
        assert_eq!(clamp_read(0, 8192, None), 8192);
        assert_eq!(read_outcome("pread", 0, 4000, Ok(4000)).unwrap(), 4000);
        match read_outcome("cuFileRead", 7, 4000, Ok(100)).unwrap_err() {
            Error::FileShrank {
                call,
                file_offset,
                expected,
                got,
            } => assert_eq!(
                (call, file_offset, expected, got),
                ("cuFileRead", 7, 4000, 100)
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn file_sizes_of_regular_and_special_files() {
        let p = std::env::temp_dir().join(format!("gpudirect-size-{}", std::process::id()));
        std::fs::write(&p, [1u8; 22_295]).unwrap();
        let f = std::fs::File::open(&p).unwrap();
        assert_eq!(file_size(f.as_fd()).unwrap(), Some(22_295));
        std::fs::remove_file(&p).unwrap();
        // A character device has no size: reads are not limited.
        let null = std::fs::File::open("/dev/null").unwrap();
        assert_eq!(file_size(null.as_fd()).unwrap(), None);
    }

    use proptest::prelude::*;
    use std::os::fd::AsFd;

    proptest! {
        #[test]
        fn check_range_is_exact(offset: usize, len: usize, size: usize) {
            let fits = offset as u128 + len as u128 <= size as u128;
            prop_assert_eq!(check_range("dst", offset, len, size).is_ok(), fits);
        }

        #[test]
        fn check_file_range_is_exact(file_offset: u64, len: usize) {
            let fits = file_offset as u128 + len as u128 <= i64::MAX as u128;
            prop_assert_eq!(check_file_range(file_offset, len).is_ok(), fits);
        }

        #[test]
        fn check_io_is_exact(
            buf_offset in prop_oneof![any::<usize>(), 0usize..1 << 20],
            file_offset in prop_oneof![any::<u64>(), (i64::MAX as u64 - (1 << 20))..=u64::MAX],
            len in prop_oneof![any::<usize>(), 0usize..1 << 20],
            buf_len: usize,
        ) {
            let end = buf_offset as u128 + len as u128;
            let ok = end <= buf_len as u128
                && end <= i64::MAX as u128
                && file_offset as u128 + len as u128 <= i64::MAX as u128;
            let r = check_io("dst_offset", buf_offset, file_offset, len, buf_len);
            prop_assert_eq!(r.is_ok(), ok);
            if let Err(e) = r {
                let is_invalid = matches!(e, Error::InvalidArgument { .. });
                prop_assert!(is_invalid);
            }
        }

        #[test]
        fn clamped_reads_never_pass_the_end(
            file_offset: u64,
            len: usize,
            size in proptest::option::of(any::<u64>()),
        ) {
            let n = clamp_read(file_offset, len, size);
            prop_assert!(n <= len);
            match size {
                None => prop_assert_eq!(n, len),
                Some(size) => {
                    let avail = (size as u128).saturating_sub(file_offset as u128);
                    prop_assert_eq!(n as u128, (len as u128).min(avail));
                    prop_assert!(file_offset as u128 + n as u128 <= size as u128 || n == 0);
                }
            }
        }

        #[test]
        fn read_outcomes_are_the_limit_or_file_shrank(expected: usize, got: usize) {
            match read_outcome("cuFileRead", 0, expected, Ok(got)) {
                Ok(n) => prop_assert!(got >= expected && n == expected),
                Err(Error::FileShrank { got: g, expected: e, .. }) => {
                    prop_assert!(got < expected && g == got && e == expected)
                }
                Err(other) => prop_assert!(false, "{other}"),
            }
        }

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
