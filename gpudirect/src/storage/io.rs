//! Blocking cuFile reads and writes between a file range and a device buffer range.

use super::context::bind_device;
use super::file::FileHandle;
use super::range::{check_io, clamp_read, file_size, read_outcome};
use super::status::io_error;
use crate::error::{Error, Result};
use crate::memory::{DeviceMemory, DeviceMemoryMut};
use std::os::fd::AsFd;

/// The most bytes one `cuFileRead`/`cuFileWrite` call is asked to move. Larger requests are
/// looped, and so are short counts (compatibility mode returns short counts near 2 GiB).
pub const MAX_BYTES_PER_CALL: usize = 1 << 30;

/// The `off_t` file and buffer offsets of the call that continues a transfer after `done` bytes,
/// or `None` where either would pass `off_t`'s maximum.
pub(crate) fn step_offsets(file_offset: u64, buf_offset: usize, done: usize) -> Option<(i64, i64)> {
    let fo = file_offset.checked_add(done as u64)?;
    let bo = (buf_offset as u64).checked_add(done as u64)?;
    Some((i64::try_from(fo).ok()?, i64::try_from(bo).ok()?))
}

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
    if max_per_call == 0 {
        return Err(Error::invalid("max_per_call", 0, "must be at least 1"));
    }
    let mut done = 0usize;
    while done < len {
        let chunk = (len - done).min(max_per_call);
        let Some((fo, bo)) = step_offsets(file_offset, buf_offset, done) else {
            return Err(Error::invalid(
                "file_offset",
                format!("{file_offset}+{done}, buffer offset {buf_offset}+{done}"),
                "offsets must not exceed i64::MAX",
            ));
        };
        let r = step(chunk, fo, bo);
        if r < 0 {
            return Err(io_error(call, r));
        }
        if r == 0 {
            break;
        }
        // A count over the chunk asked for is clamped (never trusted past the request).
        done += r.unsigned_abs().min(chunk);
    }
    Ok(done)
}

impl FileHandle {
    /// `cuFileRead(fh, buf, len, file_offset, buf_offset)`—Read `len` bytes at `file_offset`
    /// into `dst` at byte `dst_offset`, blocking; returns the bytes read, fewer than `len` only
    /// at end of file. Any alignment is correct; 4 KiB-aligned offsets and lengths are fastest.
    /// Requests over [`MAX_BYTES_PER_CALL`] and short counts are looped.
    ///
    /// End of file: the request is first limited to the file's size (`fstat`), so a read that
    /// crosses the end returns the bytes up to it and leaves every byte of `dst` past them
    /// unchanged, as every read path of this module does (cuFile itself, asked past the end,
    /// changes destination bytes past the count).
    ///
    /// `dst` must be a [`BufRegistration`](super::BufRegistration) (the registered base) or an
    /// unregistered buffer; device work writing `dst` on a stream must be complete (synchronize
    /// the stream first, or use [`read_async`](Self::read_async) on that stream).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when the range leaves `dst` or
    /// the file range overflows `off_t`; [`Error::Os`](crate::Error::Os) (errno) from `fstat` or
    /// `cuFileRead`, or [`Error::CuFile`](crate::Error::CuFile) from `cuFileRead`;
    /// [`Error::FileShrank`](crate::Error::FileShrank) when the file shrank during the read.
    /// After an error, bytes of `dst` within the range read may have changed; none outside it.
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
        check_io("dst_offset", dst_offset, file_offset, len, dst.byte_len())?;
        let want = clamp_read(file_offset, len, file_size(self.as_fd())?);
        if want == 0 {
            return Ok(0);
        }
        bind_device(dst.ordinal())?;
        let base = dst.device_ptr() as *mut libc::c_void;
        let lib = self.inner.driver.lib();
        let got = looped(
            "cuFileRead",
            want,
            file_offset,
            dst_offset,
            MAX_BYTES_PER_CALL,
            |n, fo, bo| {
                // SAFETY: `base + bo .. + n` lies in `dst` (checked), which is exclusively
                // borrowed for this blocking call; the handle is registered while `self` lives.
                unsafe { (lib.cuFileRead)(self.inner.handle, base, n, fo, bo) }
            },
        );
        read_outcome("cuFileRead", file_offset, want, got)
    }

    /// `cuFileWrite(fh, buf, len, file_offset, buf_offset)`—Write `len` bytes of `src` from byte
    /// `src_offset` to the file at `file_offset`, blocking; returns the bytes written. Looped as
    /// [`read`](Self::read). Work writing `src` on a stream must be complete first (or use
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
        check_io("src_offset", src_offset, file_offset, len, src.byte_len())?;
        bind_device(src.ordinal())?;
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

    use proptest::prelude::*;

    proptest! {
        #[test]
        fn step_offsets_are_exact(file_offset: u64, buf_offset: usize, done: usize) {
            let fo = file_offset as u128 + done as u128;
            let bo = buf_offset as u128 + done as u128;
            let ok = fo <= i64::MAX as u128 && bo <= i64::MAX as u128;
            match step_offsets(file_offset, buf_offset, done) {
                Some((f, b)) => prop_assert!(ok && f as u128 == fo && b as u128 == bo),
                None => prop_assert!(!ok),
            }
        }

        #[test]
        fn loops_move_every_byte_in_order(
            len in 0usize..1 << 20,
            file_offset in 0u64..1 << 40,
            buf_offset in 0usize..1 << 20,
            max_per_call in 1usize..1 << 21,
            per_call_cap in 1usize..1 << 21,
        ) {
            // A library that moves at most `per_call_cap` bytes per call (and at least 1/64 of
            // the request, so the loop stays short).
            let cap = per_call_cap.max(len / 64).max(1);
            let mut next = (file_offset, buf_offset as u64);
            let n = looped("fake", len, file_offset, buf_offset, max_per_call, |n, fo, bo| {
                assert!(n >= 1 && n <= max_per_call);
                assert_eq!((fo as u64, bo as u64), next, "offsets continue where the last call ended");
                let moved = n.min(cap);
                next = (next.0 + moved as u64, next.1 + moved as u64);
                moved as isize
            })
            .unwrap();
            prop_assert_eq!(n, len);
        }

        #[test]
        fn loops_refuse_offsets_past_off_t(
            file_offset in (i64::MAX as u64 - 100)..=u64::MAX,
            len in 1usize..1000,
        ) {
            // Callers check first; the loop itself still never wraps an offset.
            let r = looped("fake", len, file_offset, 0, 16, |n, _, _| n as isize);
            if file_offset as u128 + len as u128 > i64::MAX as u128 + 16 {
                let is_invalid = matches!(r, Err(Error::InvalidArgument { .. }));
                prop_assert!(is_invalid);
            }
        }

        #[test]
        fn counts_over_the_request_are_not_trusted(len in 1usize..10_000, extra in 1isize..1000) {
            let n = looped("fake", len, 0, 0, 1 << 20, |n, _, _| n as isize + extra).unwrap();
            prop_assert_eq!(n, len);
        }
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
