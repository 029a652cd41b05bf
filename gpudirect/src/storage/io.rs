//! Blocking cuFile reads and writes between a file range and a device buffer range.

use super::{FileHandle, check_file_range, check_range, io_error};
use crate::error::Result;
use crate::memory::{DeviceMemory, DeviceMemoryMut};

/// The most bytes one `cuFileRead`/`cuFileWrite` call is asked to move. Larger requests are
/// looped, and so are short counts (compatibility mode returns short counts near 2 GiB, A17).
pub const MAX_BYTES_PER_CALL: usize = 1 << 30;

/// One blocking transfer, looped until `len` bytes moved, a call returned 0 (end of file) or an
/// error. `step(chunk, file_offset, buf_offset)` returns the C function's `ssize_t`.
pub(crate) fn looped(
    call: &'static str,
    len: usize,
    file_offset: u64,
    buf_offset: usize,
    max_per_call: usize,
    mut step: impl FnMut(usize, i64, i64) -> isize,
) -> Result<usize> {
    let mut done = 0usize;
    while done < len {
        let chunk = (len - done).min(max_per_call);
        let r = step(
            chunk,
            (file_offset + done as u64) as i64,
            (buf_offset + done) as i64,
        );
        if r < 0 {
            return Err(io_error(call, r));
        }
        if r == 0 {
            break;
        }
        done += (r as usize).min(chunk);
    }
    Ok(done)
}

impl FileHandle {
    /// `cuFileRead(fh, buf, len, file_offset, buf_offset)`—Read `len` bytes at `file_offset`
    /// into `dst` at byte `dst_offset`, blocking; returns the bytes read, fewer than `len` only
    /// at end of file. Any alignment is correct (A11); 4 KiB-aligned offsets and lengths are
    /// fastest. Requests over [`MAX_BYTES_PER_CALL`] and short counts are looped (A17).
    ///
    /// `dst` must be a [`BufRegistration`](super::BufRegistration) (the registered base) or an
    /// unregistered buffer; device work writing `dst` on a stream must be complete (synchronize
    /// the stream first, or use [`read_async`](Self::read_async) on that stream).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when the range leaves `dst` or
    /// the file range overflows `off_t`; [`Error::Os`](crate::Error::Os) (errno) or
    /// [`Error::CuFile`](crate::Error::CuFile) from `cuFileRead`. Bytes read before an error are
    /// in `dst`.
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/gpudirect-storage/api-reference-guide/index.html#cufileread>
    #[doc(alias = "cuFileRead")]
    pub fn read<M: DeviceMemoryMut>(
        &self,
        dst: &mut M,
        dst_offset: usize,
        file_offset: u64,
        len: usize,
    ) -> Result<usize> {
        check_range("dst_offset", dst_offset, len, dst.byte_len())?;
        check_file_range(file_offset, len)?;
        super::bind_device(dst.ordinal())?;
        let base = dst.device_ptr() as *mut libc::c_void;
        let lib = self.inner.driver.lib();
        looped(
            "cuFileRead",
            len,
            file_offset,
            dst_offset,
            MAX_BYTES_PER_CALL,
            |n, fo, bo| {
                // SAFETY: `base + bo .. + n` lies in `dst` (checked), which is exclusively
                // borrowed for this blocking call; the handle is registered while `self` lives.
                unsafe { (lib.cuFileRead)(self.inner.handle, base, n, fo, bo) }
            },
        )
    }

    /// `cuFileWrite(fh, buf, len, file_offset, buf_offset)`—Write `len` bytes of `src` from byte
    /// `src_offset` to the file at `file_offset`, blocking; returns the bytes written. Looped as
    /// [`read`](Self::read). Work writing `src` on a stream must be complete first (A12: or use
    /// [`write_async`](Self::write_async) on that stream).
    ///
    /// # Errors
    ///
    /// As [`read`](Self::read), from `cuFileWrite`.
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/gpudirect-storage/api-reference-guide/index.html#cufilewrite>
    #[doc(alias = "cuFileWrite")]
    pub fn write<M: DeviceMemory>(
        &self,
        src: &M,
        src_offset: usize,
        file_offset: u64,
        len: usize,
    ) -> Result<usize> {
        check_range("src_offset", src_offset, len, src.byte_len())?;
        check_file_range(file_offset, len)?;
        super::bind_device(src.ordinal())?;
        let base = src.device_ptr() as *const libc::c_void;
        let lib = self.inner.driver.lib();
        looped(
            "cuFileWrite",
            len,
            file_offset,
            src_offset,
            MAX_BYTES_PER_CALL,
            |n, fo, bo| {
                // SAFETY: the range lies in `src` (checked), borrowed for this blocking call.
                unsafe { (lib.cuFileWrite)(self.inner.handle, base, n, fo, bo) }
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_counts_are_looped_and_eof_stops() {
        // A fake call that moves at most 7 bytes at a time, of a 30-byte file.
        let file_len = 30u64;
        let mut calls = Vec::new();
        let n = looped("fake", 40, 3, 1, 10, |n, fo, bo| {
            calls.push((n, fo, bo));
            let left = file_len.saturating_sub(fo as u64) as usize;
            n.min(7).min(left) as isize
        })
        .unwrap();
        assert_eq!(n, 27);
        assert_eq!(calls[0], (10, 3, 1));
        assert_eq!(calls[1], (10, 10, 8));
        assert_eq!(calls.last().unwrap().1, 30);
    }

    #[test]
    fn huge_requests_are_split_per_call() {
        let mut sizes = Vec::new();
        let n = looped("fake", 3 << 30, 0, 0, MAX_BYTES_PER_CALL, |n, _, _| {
            sizes.push(n);
            // Compatibility mode's short count near 2 GiB.
            n.min(0x7fff_f000) as isize
        })
        .unwrap();
        assert_eq!(n, 3 << 30);
        assert!(sizes.iter().all(|&s| s <= MAX_BYTES_PER_CALL));
    }

    #[test]
    fn errors_stop_the_loop() {
        let e = looped(
            "cuFileRead",
            10,
            0,
            0,
            4,
            |_, fo, _| if fo == 0 { 4 } else { -5022 },
        )
        .unwrap_err();
        assert!(e.to_string().contains("CU_FILE_INVALID_VALUE"), "{e}");
    }
}
