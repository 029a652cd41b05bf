//! The ranges a transfer may touch (checked before any library call) and the end-of-file rule:
//! a read is limited to the file's size when it starts.

use crate::error::{Error, Result};

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
    let st = fstat(fd)?;
    match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => Ok(Some(u64::try_from(st.st_size).unwrap_or(0))),
        libc::S_IFBLK => block_device_size(fd),
        _ => Ok(None),
    }
}

/// `fstat(fd)`.
pub(crate) fn fstat(fd: std::os::fd::BorrowedFd<'_>) -> Result<libc::stat> {
    use std::os::fd::AsRawFd;
    // SAFETY: zeroed stat is valid; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and out-pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(Error::last_os("fstat"));
    }
    Ok(st)
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
    }
}
