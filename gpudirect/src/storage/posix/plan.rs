//! How a transfer is cut into chunks: flat, or ramped for reads through the page cache.

use super::sys::DIRECT_ALIGN;
use crate::error::{Error, Result};
use std::sync::OnceLock;

/// Chunk `c` of a transfer of `len` bytes cut in `chunk`-byte pieces: its offset and length, or
/// `None` past the last chunk.
pub(crate) fn chunk_range(c: usize, chunk: usize, len: usize) -> Option<(usize, usize)> {
    let off = c.checked_mul(chunk)?;
    (off < len).then(|| (off, chunk.min(len - off)))
}

/// How a transfer of `len` bytes is cut: `head` chunks of growing sizes first (`unit`,
/// `2 * unit`, ..., `head * unit` bytes), then chunks of `chunk` bytes. With no head every chunk
/// is `chunk` bytes ([`chunk_range`]).
///
/// The head is the ramp of reads through the page cache (see [`Plan::for_read`]): when every
/// reader starts with a full chunk, all of them share the memory bandwidth and finish their
/// first `pread` at about the same time, so the copy engine waits for `threads * chunk` bytes
/// before its first copy; growing first chunks hand it a small one almost at once, and leave
/// the readers out of step with each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    chunk: usize,
    len: usize,
    unit: usize,
    pub(super) head: usize,
    /// `unit * head * (head + 1) / 2`: the bytes of the head, less than `len`.
    head_bytes: usize,
}

/// The environment variable that turns the ramp of [`Plan::for_read`] on (`1`, the default) or
/// off (`0`), read once.
pub(crate) const RAMP_ENV: &str = "GPUDIRECT_POSIX_RAMP";

impl Plan {
    /// Every chunk `chunk` bytes.
    pub(crate) fn flat(chunk: usize, len: usize) -> Plan {
        Plan {
            chunk,
            len,
            unit: 0,
            head: 0,
            head_bytes: 0,
        }
    }

    /// The ramp for `threads` readers: `threads` chunks growing by `chunk / threads` (rounded
    /// down to [`DIRECT_ALIGN`]) up to `chunk`, then `chunk`-byte chunks; flat where `threads`
    /// is below 2, the step would be under [`DIRECT_ALIGN`], or the transfer has fewer than
    /// `threads` full chunks after the head.
    pub(crate) fn ramped(chunk: usize, len: usize, threads: usize) -> Plan {
        let flat = Plan::flat(chunk, len);
        if threads < 2 || chunk == 0 {
            return flat;
        }
        let unit = chunk / threads / DIRECT_ALIGN * DIRECT_ALIGN;
        let head_bytes = threads
            .checked_mul(threads + 1)
            .map(|n| n / 2)
            .and_then(|n| n.checked_mul(unit));
        let need = head_bytes.and_then(|h| h.checked_add(threads.checked_mul(chunk)?));
        match (head_bytes, need) {
            (Some(head_bytes), Some(need)) if unit > 0 && len >= need => Plan {
                chunk,
                len,
                unit,
                head: threads,
                head_bytes,
            },
            _ => flat,
        }
    }

    /// The plan of a read of `len` bytes in `chunk`-byte chunks on `threads` threads: ramped
    /// when `ramp` is set and the read goes through the page cache (`direct` false), flat
    /// otherwise.
    pub(crate) fn for_read(
        ramp: bool,
        direct: bool,
        chunk: usize,
        len: usize,
        threads: usize,
    ) -> Plan {
        if ramp && !direct {
            Plan::ramped(chunk, len, threads)
        } else {
            Plan::flat(chunk, len)
        }
    }

    /// The number of chunks.
    pub(crate) fn chunks(&self) -> usize {
        // `head_bytes < len` when there is a head (`ramped`).
        self.head + (self.len - self.head_bytes).div_ceil(self.chunk.max(1))
    }

    /// Chunk `c`: its offset and length, or `None` past the last chunk.
    pub(crate) fn range(&self, c: usize) -> Option<(usize, usize)> {
        if c < self.head {
            // c < head <= MAX_THREADS-ish, and the head's bytes fit `len` (`ramped`).
            let off = self.unit.checked_mul(c.checked_mul(c + 1)? / 2)?;
            return Some((off, self.unit.checked_mul(c + 1)?));
        }
        let (off, n) = chunk_range(c - self.head, self.chunk, self.len - self.head_bytes)?;
        Some((off.checked_add(self.head_bytes)?, n))
    }
}

/// Whether [`RAMP_ENV`] turns the ramp on.
///
/// # Errors
///
/// [`Error::InvalidArgument`] naming the variable when it is set to anything but `0` or `1`.
pub(crate) fn ramp_from_env() -> Result<bool> {
    static V: OnceLock<Option<String>> = OnceLock::new();
    match V
        .get_or_init(|| std::env::var(RAMP_ENV).ok())
        .as_deref()
        .map(str::trim)
    {
        Some("0") => Ok(false),
        None | Some("1") => Ok(true),
        Some(v) => Err(Error::invalid(RAMP_ENV, v, "must be 0 or 1")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ramp_grows_to_the_chunk_and_is_only_for_long_page_cache_reads() {
        let mib = 1 << 20;
        let p = Plan::ramped(4 * mib, 1 << 30, 16);
        let sizes: Vec<usize> = (0..18).map(|c| p.range(c).unwrap().1).collect();
        let step = 256 << 10;
        assert_eq!(sizes[..16], (1..=16).map(|k| k * step).collect::<Vec<_>>());
        assert_eq!(sizes[16..], [4 * mib, 4 * mib]);
        assert_eq!(p.range(16).unwrap().0, 136 * step);
        assert_eq!(p.chunks(), 16 + ((1 << 30) - 136 * step).div_ceil(4 * mib));
        // Flat: one thread, a step under a page, too short a transfer, O_DIRECT, or off.
        for flat in [
            Plan::ramped(4 * mib, 1 << 30, 1),
            Plan::ramped(16384, 1 << 30, 8),
            Plan::ramped(4 * mib, 64 * mib, 16),
            Plan::for_read(true, true, 4 * mib, 1 << 30, 16),
            Plan::for_read(false, false, 4 * mib, 1 << 30, 16),
        ] {
            assert_eq!(flat.head, 0, "{flat:?}");
        }
        assert_eq!(
            Plan::for_read(true, false, 4 * mib, 1 << 30, 16),
            Plan::ramped(4 * mib, 1 << 30, 16)
        );
    }

    use proptest::prelude::*;

    proptest! {
        #[test]
        fn chunks_tile_the_transfer(chunk in 1usize..5000, len in 0usize..100_000) {
            let mut next = 0;
            let mut c = 0;
            while let Some((off, clen)) = chunk_range(c, chunk, len) {
                prop_assert_eq!(off, next);
                prop_assert!(clen >= 1 && clen <= chunk && off + clen <= len);
                next = off + clen;
                c += 1;
            }
            prop_assert_eq!(next, len);
            prop_assert_eq!(c, len.div_ceil(chunk));
        }

        #[test]
        fn ramped_plans_tile_the_transfer(
            chunk_pages in 1usize..64,
            len in 0usize..4_000_000,
            threads in 1usize..20,
        ) {
            let chunk = chunk_pages * DIRECT_ALIGN;
            let plan = Plan::ramped(chunk, len, threads);
            let mut next = 0;
            let mut c = 0;
            while let Some((off, clen)) = plan.range(c) {
                prop_assert_eq!(off, next);
                prop_assert!(clen >= 1 && clen <= chunk && off + clen <= len);
                next = off + clen;
                c += 1;
            }
            prop_assert_eq!(next, len);
            prop_assert_eq!(c, plan.chunks());
        }

        #[test]
        fn chunk_ranges_never_wrap(c: usize, chunk: usize, len: usize) {
            if let Some((off, clen)) = chunk_range(c, chunk, len) {
                prop_assert!(off < len && clen >= 1 && clen <= chunk);
                prop_assert!(off as u128 + clen as u128 <= len as u128);
            }
        }
    }
}
