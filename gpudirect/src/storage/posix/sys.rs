//! The POSIX path's system calls: `pread` and `pwrite` looped over short counts and `EINTR`,
//! and `O_DIRECT` reads and writes around a range, falling back to the buffered descriptor.

use crate::error::{Error, Result};
use crate::storage::range::OFF_MAX;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};

/// Alignment of `O_DIRECT` offsets, lengths and buffers.
pub const DIRECT_ALIGN: usize = 4096;

/// The `O_DIRECT` read around `start..start + len`: the aligned start, the aligned length and
/// where the data begins in it; `None` where the range passes `off_t` or the aligned span does
/// not fit a bounce buffer of `bounce_len` bytes.
pub(crate) fn direct_span(
    start: u64,
    len: usize,
    bounce_len: usize,
) -> Option<(u64, usize, usize)> {
    let a = DIRECT_ALIGN as u64;
    let end = start.checked_add(len as u64)?;
    if end > OFF_MAX {
        return None;
    }
    let a_start = start - start % a;
    let a_end = end.div_ceil(a).checked_mul(a)?;
    let span = usize::try_from(a_end - a_start).ok()?;
    let skip = usize::try_from(start - a_start).ok()?;
    (span <= bounce_len).then_some((a_start, span, skip))
}

/// The descriptors the POSIX path reads and writes: buffered, and `O_DIRECT` where available
/// (and wanted for this transfer).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PosixFile<'a> {
    /// A buffered descriptor.
    pub(crate) buffered: BorrowedFd<'a>,
    /// An `O_DIRECT` descriptor of the same file.
    pub(crate) direct: Option<BorrowedFd<'a>>,
}

/// The raw descriptors a transfer's threads use (valid while the transfer runs: see
/// [`read_to_device`](super::transfer::read_to_device)).
#[derive(Debug, Clone, Copy)]
pub(super) struct Fds {
    buffered: RawFd,
    direct: Option<RawFd>,
}

impl Fds {
    pub(super) fn of(f: &PosixFile<'_>) -> Fds {
        Fds {
            buffered: f.buffered.as_raw_fd(),
            direct: f.direct.map(|d| d.as_raw_fd()),
        }
    }
}

/// Which way [`io_full`] moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Io {
    /// `pread`: stops short at end of file.
    Read,
    /// `pwrite`: a write of 0 bytes is an error.
    Write,
}

/// `pread` or `pwrite` of `len` bytes at `buf` and file `offset`, looped over short counts and
/// `EINTR`; the bytes moved (fewer than `len` only for a read at end of file).
///
/// # Safety
///
/// `buf..buf + len` is host memory this thread may write (reads) or read (writes), not
/// accessed by anything else meanwhile; `fd` is open.
pub(super) unsafe fn io_full(
    io: Io,
    fd: RawFd,
    buf: *mut u8,
    len: usize,
    offset: u64,
) -> Result<usize> {
    let call = match io {
        Io::Read => "pread",
        Io::Write => "pwrite",
    };
    let mut done = 0;
    while done < len {
        let at = offset
            .checked_add(done as u64)
            .and_then(|o| libc::off_t::try_from(o).ok())
            .ok_or_else(|| {
                Error::invalid(
                    call,
                    format!("{offset}+{done}"),
                    "file offsets must not exceed i64::MAX",
                )
            })?;
        // SAFETY: `buf + done .. buf + len` lies in the caller's range.
        let r = unsafe {
            let p = buf.add(done);
            match io {
                Io::Read => libc::pread(fd, p.cast(), len - done, at),
                Io::Write => libc::pwrite(fd, p.cast_const().cast(), len - done, at),
            }
        };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(Error::Os { call, source: e });
        }
        if r == 0 {
            match io {
                Io::Read => break,
                Io::Write => return Err(Error::errno(call, libc::EIO)),
            }
        }
        done += r.unsigned_abs().min(len - done);
    }
    Ok(done)
}

/// Whether an error is `EINVAL` (what `O_DIRECT` answers for a request it cannot take).
fn is_einval(e: &Error) -> bool {
    matches!(e, Error::Os { source, .. } if source.raw_os_error() == Some(libc::EINVAL))
}

/// Read `start..start+len` of the file into `bounce` (`bounce_len` bytes), through `O_DIRECT`
/// (aligned around the range) when possible; returns (offset of the data in `bounce`, bytes
/// available).
///
/// # Safety
///
/// `bounce..bounce + bounce_len` is host memory only this thread uses meanwhile; the
/// descriptors are open.
pub(super) unsafe fn read_chunk(
    fds: Fds,
    bounce: *mut u8,
    bounce_len: usize,
    start: u64,
    len: usize,
) -> Result<(usize, usize)> {
    if len > bounce_len {
        return Err(Error::invalid(
            "len",
            len,
            format!("a chunk must fit its {bounce_len}-byte bounce buffer"),
        ));
    }
    if let Some(d) = fds.direct {
        let Some((a_start, span, skip)) = direct_span(start, len, bounce_len) else {
            return Err(Error::invalid(
                "file_offset",
                format!("{start}+{len}"),
                "the aligned read must fit the bounce buffer and i64::MAX",
            ));
        };
        // SAFETY: `span <= bounce_len` (direct_span); the rest is the caller's.
        match unsafe { io_full(Io::Read, d, bounce, span, a_start) } {
            Ok(got) => return Ok((skip, got.saturating_sub(skip).min(len))),
            Err(e) if is_einval(&e) => {}
            Err(e) => return Err(e),
        }
    }
    // SAFETY: `len <= bounce_len`; the rest is the caller's.
    Ok((0, unsafe {
        io_full(Io::Read, fds.buffered, bounce, len, start)
    }?))
}

/// Write `len` bytes at `buf` to the file at `start`: through `O_DIRECT` when the descriptor
/// is there and the range is aligned (falling back on `EINVAL`), buffered otherwise.
///
/// # Safety
///
/// As [`io_full`], for a write; `buf` is [`DIRECT_ALIGN`]-aligned.
pub(super) unsafe fn write_chunk(fds: Fds, buf: *mut u8, len: usize, start: u64) -> Result<()> {
    let aligned = start.is_multiple_of(DIRECT_ALIGN as u64) && len.is_multiple_of(DIRECT_ALIGN);
    if let (Some(d), true) = (fds.direct, aligned) {
        // SAFETY: the caller's.
        match unsafe { io_full(Io::Write, d, buf, len, start) } {
            Ok(_) => return Ok(()),
            Err(e) if is_einval(&e) => {}
            Err(e) => return Err(e),
        }
    }
    // SAFETY: the caller's.
    unsafe { io_full(Io::Write, fds.buffered, buf, len, start) }.map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn direct_spans_cover_the_range_and_fit_the_buffer(
            start in prop_oneof![any::<u64>(), 0u64..1 << 20, (i64::MAX as u64 - (1 << 20))..=i64::MAX as u64],
            len in prop_oneof![any::<usize>(), 0usize..1 << 20],
            bounce_len in prop_oneof![any::<usize>(), 0usize..1 << 21],
        ) {
            let a = DIRECT_ALIGN as u128;
            let end = start as u128 + len as u128;
            let a_start = start as u128 / a * a;
            let a_end = end.div_ceil(a) * a;
            let ok = end <= i64::MAX as u128 && a_end - a_start <= bounce_len as u128;
            match direct_span(start, len, bounce_len) {
                Some((s, span, skip)) => {
                    prop_assert!(ok);
                    prop_assert_eq!(s as u128, a_start);
                    prop_assert_eq!(span as u128, a_end - a_start);
                    prop_assert_eq!(skip as u128, start as u128 - a_start);
                    prop_assert!(span <= bounce_len && span % DIRECT_ALIGN == 0);
                    prop_assert!(skip as u128 + len as u128 <= span as u128);
                }
                None => prop_assert!(!ok),
            }
        }
    }
}
