//! The POSIX path: `pread` into pinned bounce chunks and copy them to the GPU, chunked, on
//! several threads at once, each pipelining its own copies; writes run the other way (a copy to
//! a chunk, then `pwrite`). `O_DIRECT` is used where the file allows it, with aligned reads
//! around unaligned requests; a refusal falls back to the buffered descriptor.
//!
//! # Where the time goes, and the design
//!
//! A hot read (the file in the page cache) is two copies: the kernel's copy from the page cache
//! into a pinned chunk (`pread`, about 5 to 8 GB/s per core), and the copy engine's DMA from the
//! chunk to the GPU (about 55 GB/s on a PCIe 5 H200 for all streams together). So:
//!
//! - **Many readers.** Enough threads that their `pread`s together outrun the DMA: one per core
//!   up to 16 ([`PosixConfig::for_node`]). The threads are started once and kept
//!   (the pool in `workers.rs`); the calling thread is one of them, so a small transfer never
//!   waits for a thread to wake.
//! - **Chunks of 4 MiB**: the per-copy cost dominates smaller ones (a 1 MiB host-to-device copy
//!   runs at 47.5 GB/s where 4 MiB copies run at 53), and with 16 MiB chunks every byte went to
//!   memory and back before the DMA read it (19 to 24 GB/s whatever the thread count).
//! - **No wait on the critical path.** Each thread owns `depth` chunks (2 by default) and its own
//!   stream (a lane of the device's [`CopyEngine`](crate::memory::CopyEngine)): it queues a
//!   chunk's copy right after its `pread` and reads the next chunk into its other buffer while
//!   the copy runs; it waits for a copy only when it needs that buffer again. That wait spins
//!   under the default context scheduling (the lane's events are not blocking-sync ones): near
//!   the copy engine's limit a reader often waits, and sleeping until an interrupt cost a hot
//!   read 3 to 7% (47.0 to 48.8 GB/s against 50.3 to 51.3 on two H200s).
//! - **No lock per chunk.** Threads claim chunks from one atomic counter (so the file is read in
//!   order, which the kernel's read-ahead likes, and a slow thread takes fewer chunks); the only
//!   locks are the lane's event list and, twice per thread per transfer, the chunk pool.
//! - **No allocation per call.** Chunks come from the device's process-wide
//!   [`BouncePool`](crate::memory::BouncePool); events are recycled per lane.
//! - **A ramp.** A read through the page cache long enough for it starts with one chunk per
//!   thread of growing sizes (`chunk / threads`, `2 * chunk / threads`, ..., `chunk`), so that
//!   the copy engine gets its first copy after a small `pread` instead of waiting for every
//!   thread's full first chunk, and the threads stay out of step (see `Plan`). Measured on two
//!   H200s (1 GiB hot file, 32 cores): 1 to 3 GB/s faster in each of six paired runs.
//!   `GPUDIRECT_POSIX_RAMP=0` (read once) turns it off; `1`, the default, on.
//!
//! Cold reads (`O_DIRECT`) are bound by the device's queue, not by memory copies: they use
//! [`PosixConfig::direct_threads`] threads, each with one request per chunk in flight, in
//! chunks of their own ([`PosixConfig::direct_read_chunk`], 1 MiB: smaller requests than the
//! page-cache reads' 4 MiB, which the disks measured served faster). Buffered
//! writes to one file are serialized by the file system (ext4 and XFS take the inode lock), so
//! they use [`PosixConfig::write_threads`] (1) thread, with its device-to-host copies queued
//! `depth` chunks ahead of its `pwrite`s; `O_DIRECT` writes (durable writes) use
//! `direct_threads`.
//!
//! Copying to the GPU straight from the page cache (the file mapped with `mmap`, the pages
//! registered read-only with `cuMemHostRegister`) was measured on an H200 node and is slower
//! than the bounce chunks: registering ran at 22 to 64 GB/s and did not scale past about 40
//! GB/s over threads, and a register, copy, unregister pipeline reached 25 GB/s, where the bounce
//! path reads a hot file at 46 to 50 GB/s against a 52 to 55 GB/s host-to-device copy.
//!
//! The copies are behind the crate-private [`Staging`] trait, so the chunking, the threads and
//! the pipelining are tested on host memory (a test-only staging) without a GPU.

use super::range::{OFF_MAX, check_file_range, clamp_read, read_outcome};
use super::workers::{Job, Workers};
use crate::error::{Error, Result};
use crate::memory::{BounceChunk, BouncePool, ChunkCopy, CopyEngine};
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Alignment of `O_DIRECT` offsets, lengths and buffers.
pub const DIRECT_ALIGN: usize = 4096;

/// How the POSIX path splits and overlaps a transfer.
///
/// Unless set on the file ([`GdsFile::set_posix_config`](super::GdsFile::set_posix_config)),
/// each transfer uses [`PosixConfig::automatic`]: chosen from the node's cores and the
/// transfer's size, with the overrides of the environment (see there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PosixConfig {
    /// Threads for reads through the page cache (the calling thread is one of them).
    pub threads: usize,
    /// Threads for `O_DIRECT` reads and writes (page-cache-cold reads, durable writes), which
    /// are bound by the device's queue rather than by memory copies.
    pub direct_threads: usize,
    /// Threads for writes through the page cache (the file system serializes them per file).
    pub write_threads: usize,
    /// Bytes per chunk (one `pread` or `pwrite` and one copy), except `O_DIRECT` reads.
    pub chunk: usize,
    /// Bytes per chunk of `O_DIRECT` reads (page-cache-cold reads): one request to the device
    /// per chunk.
    pub direct_read_chunk: usize,
    /// Chunks each thread keeps in flight (2 = double buffering).
    pub depth: usize,
}

impl Default for PosixConfig {
    /// [`for_node`](Self::for_node) for this node's cores and a large transfer.
    fn default() -> Self {
        PosixConfig::for_node(cores(), usize::MAX)
    }
}

/// The cores this process may run on (`available_parallelism`: affinity and cgroup quota),
/// at least 1.
fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The environment variables that override the automatic configuration, with the field each
/// sets (chunks in KiB).
pub const POSIX_ENV: [&str; 6] = [
    "GPUDIRECT_POSIX_THREADS",
    "GPUDIRECT_POSIX_DIRECT_THREADS",
    "GPUDIRECT_POSIX_WRITE_THREADS",
    "GPUDIRECT_POSIX_CHUNK_KIB",
    "GPUDIRECT_POSIX_DEPTH",
    "GPUDIRECT_POSIX_DIRECT_READ_CHUNK_KIB",
];

impl PosixConfig {
    /// The most threads of each kind a configuration may ask for.
    pub const MAX_THREADS: usize = 256;
    /// The most chunks in flight per thread.
    pub const MAX_DEPTH: usize = 16;
    /// The largest chunk, in bytes (1 GiB).
    pub const MAX_CHUNK: usize = 1 << 30;
    /// The most pinned host memory one transfer's chunks may take, in bytes (64 GiB).
    pub const MAX_PINNED_BYTES: usize = 64 << 30;

    /// The configuration for a transfer of `len` bytes on a node with `cores` cores:
    ///
    /// - `threads`: `cores`, at most 16 (page-cache reads are memory copies, one per core; on a
    ///   32-core H200 node hot 1 GiB reads peaked at 16 threads, 46 GB/s, and 32 gave 39 to 43);
    /// - `direct_threads`: `cores / 8` between 4 and 8 (`O_DIRECT` requests wait on the device:
    ///   on an H200 node's disk raw `O_DIRECT` reads peaked at 4 to 8 threads and fell off past
    ///   them);
    /// - `write_threads`: 1 (buffered writes to one file are serialized by the file system);
    /// - `chunk`: 4 MiB (there, hot reads ran 46 GB/s against 40 with 1 MiB, cached writes 6.4
    ///   against 5.4); smaller, down to 256 KiB, while the transfer would give a thread fewer
    ///   than two chunks;
    /// - `direct_read_chunk`: 1 MiB (cold 1 GiB reads on 16-core H200 nodes' disks, two calls
    ///   of 6 and 10 interleaved rounds: raw `O_DIRECT` with 4 threads ran 2.63 and 2.88 GB/s
    ///   with 1 MiB requests against 1.99 and 2.68 with 4 MiB; this path 2.34 against 2.22),
    ///   smaller in the same way as `chunk`;
    /// - `depth`: 2.
    ///
    /// A transfer uses no more threads than it has chunks.
    pub fn for_node(cores: usize, len: usize) -> PosixConfig {
        let cores = cores.max(1);
        let threads = cores.min(16);
        // Halved, down to 256 KiB, while `len` would give each of `threads` fewer than two.
        let fit = |mut chunk: usize, threads: usize| {
            while chunk > 256 << 10 && len / chunk < 2 * threads {
                chunk /= 2;
            }
            chunk
        };
        // O_DIRECT reads are bound by the device's queue: on an H200 node's disk (32 cores)
        // raw O_DIRECT reads peaked at 4-8 threads and fell off beyond; 32 readers gave 0.76x.
        let direct_threads = (cores / 8).clamp(4, 8);
        PosixConfig {
            threads,
            direct_threads,
            write_threads: 1,
            chunk: fit(4 << 20, threads),
            direct_read_chunk: fit(1 << 20, direct_threads),
            depth: 2,
        }
    }

    /// The configuration a transfer of `len` bytes uses unless the file has its own:
    /// [`for_node`](Self::for_node) for this process's cores (`available_parallelism`), with
    /// any of these environment variables overriding its field ([`POSIX_ENV`], read once):
    /// `GPUDIRECT_POSIX_THREADS`, `GPUDIRECT_POSIX_DIRECT_THREADS`,
    /// `GPUDIRECT_POSIX_WRITE_THREADS`, `GPUDIRECT_POSIX_CHUNK_KIB` (the chunk in KiB),
    /// `GPUDIRECT_POSIX_DEPTH` and `GPUDIRECT_POSIX_DIRECT_READ_CHUNK_KIB`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the variable when one is not a whole number, or when
    /// the result breaks a bound of [`validate`](Self::validate).
    pub fn automatic(len: usize) -> Result<PosixConfig> {
        static ENV: OnceLock<[Option<String>; 6]> = OnceLock::new();
        let env = ENV.get_or_init(|| POSIX_ENV.map(|k| std::env::var(k).ok()));
        with_overrides(PosixConfig::for_node(cores(), len), env)
    }

    /// Check the configuration: at least one thread of each kind and one chunk in flight; a
    /// chunk that is a non-zero multiple of [`DIRECT_ALIGN`]; every field within its bound
    /// ([`MAX_THREADS`](Self::MAX_THREADS), [`MAX_DEPTH`](Self::MAX_DEPTH),
    /// [`MAX_CHUNK`](Self::MAX_CHUNK)); and the chunks of the largest thread count within
    /// [`MAX_PINNED_BYTES`](Self::MAX_PINNED_BYTES). Every transfer checks it before anything
    /// else.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the field and the rule.
    pub fn validate(&self) -> Result<()> {
        for (arg, v) in [
            ("config.threads", self.threads),
            ("config.direct_threads", self.direct_threads),
            ("config.write_threads", self.write_threads),
        ] {
            if v == 0 || v > Self::MAX_THREADS {
                return Err(Error::invalid(
                    arg,
                    v,
                    format!("must be between 1 and {}", Self::MAX_THREADS),
                ));
            }
        }
        if self.depth == 0 || self.depth > Self::MAX_DEPTH {
            return Err(Error::invalid(
                "config.depth",
                self.depth,
                format!("must be between 1 and {}", Self::MAX_DEPTH),
            ));
        }
        for (what, chunk) in [
            ("config.chunk", self.chunk),
            ("config.direct_read_chunk", self.direct_read_chunk),
        ] {
            if chunk == 0 || chunk > Self::MAX_CHUNK || !chunk.is_multiple_of(DIRECT_ALIGN) {
                return Err(Error::invalid(
                    what,
                    chunk,
                    format!(
                        "must be a non-zero multiple of {DIRECT_ALIGN} of at most {}",
                        Self::MAX_CHUNK
                    ),
                ));
            }
        }
        match self.pinned_bytes() {
            Some(n) if n <= Self::MAX_PINNED_BYTES => Ok(()),
            _ => Err(Error::invalid(
                "config",
                format!("{self:?}"),
                format!(
                    "threads x depth x bounce length must be at most {} bytes",
                    Self::MAX_PINNED_BYTES
                ),
            )),
        }
    }

    /// Bytes of each bounce chunk: the larger chunk plus room to align both ends for
    /// `O_DIRECT`.
    ///
    /// # Errors
    ///
    /// As [`validate`](Self::validate).
    pub fn bounce_len(&self) -> Result<usize> {
        self.validate()?;
        // Within bounds: both chunks are at most MAX_CHUNK.
        Ok(self.chunk.max(self.direct_read_chunk) + 2 * DIRECT_ALIGN)
    }

    /// The pinned bytes of the chunks when every thread of the largest count is busy, or `None`
    /// where that overflows.
    fn pinned_bytes(&self) -> Option<usize> {
        self.chunk
            .max(self.direct_read_chunk)
            .checked_add(2 * DIRECT_ALIGN)?
            .checked_mul(self.depth)?
            .checked_mul(
                self.threads
                    .max(self.direct_threads)
                    .max(self.write_threads),
            )
    }
}

/// `base` with the fields set by the environment values `env` (in [`POSIX_ENV`]'s order).
fn with_overrides(base: PosixConfig, env: &[Option<String>; 6]) -> Result<PosixConfig> {
    let mut cfg = base;
    for (i, v) in env.iter().enumerate() {
        let Some(v) = v else { continue };
        let n: usize = v.trim().parse().map_err(|_| {
            Error::invalid(
                POSIX_ENV[i],
                v,
                "must be a whole number (see PosixConfig::automatic)",
            )
        })?;
        let kib = || {
            n.checked_mul(1024)
                .ok_or_else(|| Error::invalid(POSIX_ENV[i], v, "the chunk in bytes overflows"))
        };
        match i {
            0 => cfg.threads = n,
            1 => cfg.direct_threads = n,
            2 => cfg.write_threads = n,
            3 => cfg.chunk = kib()?,
            4 => cfg.depth = n,
            _ => cfg.direct_read_chunk = kib()?,
        }
    }
    cfg.validate()?;
    Ok(cfg)
}

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
    head: usize,
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
/// [`read_to_device`]).
#[derive(Debug, Clone, Copy)]
struct Fds {
    buffered: RawFd,
    direct: Option<RawFd>,
}

impl Fds {
    fn of(f: &PosixFile<'_>) -> Fds {
        Fds {
            buffered: f.buffered.as_raw_fd(),
            direct: f.direct.map(|d| d.as_raw_fd()),
        }
    }
}

/// Which way [`io_full`] moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Io {
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
unsafe fn io_full(io: Io, fd: RawFd, buf: *mut u8, len: usize, offset: u64) -> Result<usize> {
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
unsafe fn read_chunk(
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
unsafe fn write_chunk(fds: Fds, buf: *mut u8, len: usize, start: u64) -> Result<()> {
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

/// How a transfer's threads get bounce chunks and copy them to and from the device.
///
/// # Safety
///
/// [`take`](Self::take) returns buffers of at least the `bounce_len` bytes the staging was made
/// for, whose [`ptr`](Self::ptr) is [`DIRECT_ALIGN`]-aligned, writable and used by nothing else;
/// a buffer handed to [`h2d`](Self::h2d) or [`d2h`](Self::d2h) is not touched by the host until
/// [`wait`](Self::wait) gives it back, and `wait` returning `Ok` means its copy has finished.
/// The POSIX path writes and reads the buffers through `ptr` with `pread` and `pwrite`.
pub(crate) unsafe trait Staging: Send + Sync + 'static {
    /// A bounce buffer.
    type Buf: Send;
    /// A copy in flight, owning its buffer.
    type Pending: Send;
    /// Prepare the calling thread (make the device's context current). Every participant calls
    /// it first.
    fn begin(&self) -> Result<()>;
    /// The caller's thread in the relaxed stream-capture mode for the transfer (its waits for
    /// copies must not break a graph capture that another thread runs in global mode); `None`
    /// where nothing needs it.
    fn relax_caller(&self) -> Option<crate::completion::capture::Relaxed> {
        None
    }
    /// A free bounce buffer.
    fn take(&self) -> Result<Self::Buf>;
    /// The host address of `buf`'s first byte.
    fn ptr(buf: &mut Self::Buf) -> *mut u8;
    /// Queue a copy of `len` bytes at `ptr(buf) + offset` to device address `dst`, on lane `lane`.
    ///
    /// # Safety
    ///
    /// `dst..dst + len` is device memory that stays valid, and is touched by nothing else, until
    /// the copy has been waited for.
    unsafe fn h2d(
        &self,
        lane: usize,
        buf: Self::Buf,
        offset: usize,
        len: usize,
        dst: u64,
    ) -> Result<Self::Pending>;
    /// Queue a copy of `len` bytes from device address `src` to the start of `buf`, on lane
    /// `lane`.
    ///
    /// # Safety
    ///
    /// `src..src + len` is device memory that stays valid, and is not written by anything else,
    /// until the copy has been waited for.
    unsafe fn d2h(
        &self,
        lane: usize,
        buf: Self::Buf,
        len: usize,
        src: u64,
    ) -> Result<Self::Pending>;
    /// Wait for a copy; its buffer back.
    fn wait(&self, p: Self::Pending) -> Result<Self::Buf>;
}

/// The GPU's staging: chunks of the device's process-wide [`BouncePool`] of that size, copies
/// on the lanes of its process-wide [`CopyEngine`] (participant `p` on lane `p`).
#[derive(Debug, Clone)]
pub(crate) struct GpuStaging {
    pool: BouncePool,
    engine: CopyEngine,
}

impl GpuStaging {
    /// The staging of device `ordinal` for bounce chunks of `bounce_len` bytes.
    ///
    /// # Errors
    ///
    /// As [`crate::cuda::context`]; [`Error::Cuda`] creating the engine's streams.
    pub(crate) fn for_device(ordinal: usize, bounce_len: usize) -> Result<GpuStaging> {
        let bytes = bounce_len
            .checked_next_multiple_of(DIRECT_ALIGN)
            .ok_or_else(|| Error::invalid("bounce_len", bounce_len, "overflows"))?;
        Ok(GpuStaging {
            pool: BouncePool::shared(ordinal, bytes)?,
            engine: CopyEngine::shared(ordinal)?,
        })
    }
}

// SAFETY: chunks are pinned, page-aligned allocations of at least `bounce_len` bytes (rounded
// up to pages), owned by one holder; an in-flight copy owns its chunk until its event has
// completed, and `wait` hands it back only then.
unsafe impl Staging for GpuStaging {
    type Buf = BounceChunk;
    type Pending = ChunkCopy;

    fn begin(&self) -> Result<()> {
        crate::driver::ctx::bind(self.engine.context())
    }

    fn relax_caller(&self) -> Option<crate::completion::capture::Relaxed> {
        // SAFETY: the engine holds a context: libcuda passed the presence check.
        unsafe { crate::completion::capture::Relaxed::new() }
    }

    fn take(&self) -> Result<BounceChunk> {
        self.pool.take()
    }

    fn ptr(buf: &mut BounceChunk) -> *mut u8 {
        buf.as_mut_ptr()
    }

    unsafe fn h2d(
        &self,
        lane: usize,
        buf: BounceChunk,
        offset: usize,
        len: usize,
        dst: u64,
    ) -> Result<ChunkCopy> {
        // SAFETY: forwarded from the caller.
        unsafe { self.engine.h2d_raw(lane, buf, offset, len, dst) }
    }

    unsafe fn d2h(&self, lane: usize, buf: BounceChunk, len: usize, src: u64) -> Result<ChunkCopy> {
        // SAFETY: forwarded from the caller.
        unsafe { self.engine.d2h_raw(lane, buf, 0, len, src) }
    }

    fn wait(&self, p: ChunkCopy) -> Result<BounceChunk> {
        p.wait_chunk()
    }
}

/// One transfer, shared by its threads (see the module docs): chunks are claimed from `next`;
/// the first error stops further claims.
struct Transfer<S: Staging> {
    staging: S,
    read: bool,
    fds: Fds,
    file_offset: u64,
    /// The device address of the transfer's first byte.
    addr: u64,
    /// How the transfer is cut (its length included).
    plan: Plan,
    bounce_len: usize,
    depth: usize,
    n_chunks: usize,
    next: AtomicUsize,
    failed: AtomicBool,
    error: Mutex<Option<Error>>,
    /// Reads: the lowest file offset where a chunk came back short.
    short_at: AtomicU64,
}

impl<S: Staging> Transfer<S> {
    fn fail(&self, e: Error) {
        self.failed.store(true, Ordering::Relaxed);
        let mut g = self.error.lock().unwrap_or_else(|p| p.into_inner());
        g.get_or_insert(e);
    }

    /// The next chunk to move, unless all are claimed or the transfer failed.
    fn claim(&self) -> Option<(usize, usize)> {
        if self.failed.load(Ordering::Relaxed) {
            return None;
        }
        let c = self.next.fetch_add(1, Ordering::Relaxed);
        if c >= self.n_chunks {
            return None;
        }
        self.plan.range(c)
    }

    /// Read chunks and queue their copies until none is left; `inflight` holds the copies not
    /// yet waited for, `spare` the free buffers.
    fn read_loop(
        &self,
        p: usize,
        inflight: &mut VecDeque<S::Pending>,
        spare: &mut Vec<S::Buf>,
    ) -> Result<()> {
        while let Some((off, clen)) = self.claim() {
            // A free buffer, a new one while fewer than `depth` exist, or the oldest copy's.
            let mut buf = match spare.pop() {
                Some(b) => b,
                None if inflight.len() < self.depth => self.staging.take()?,
                None => match inflight.pop_front() {
                    Some(c) => self.staging.wait(c)?,
                    None => self.staging.take()?,
                },
            };
            // In range: `check_transfer` bounded `file_offset + len` and `addr + len`.
            let start = self.file_offset + off as u64;
            // SAFETY: the buffer is this thread's (taken, or given back by `wait`), of
            // `bounce_len` bytes; the descriptors are open while the transfer runs.
            let (skip, got) = match unsafe {
                read_chunk(self.fds, S::ptr(&mut buf), self.bounce_len, start, clen)
            } {
                Ok(r) => r,
                Err(e) => {
                    spare.push(buf);
                    return Err(e);
                }
            };
            if got < clen {
                self.short_at
                    .fetch_min(start + got as u64, Ordering::Relaxed);
            }
            if got == 0 {
                spare.push(buf);
                continue;
            }
            // SAFETY: `addr + off .. + got` lies in the caller's device range, which stays
            // valid and untouched until the transfer returns, and this chunk's bytes of it are
            // written by this copy only; the copy is waited for before this thread leaves.
            let c = unsafe { self.staging.h2d(p, buf, skip, got, self.addr + off as u64) }?;
            inflight.push_back(c);
        }
        Ok(())
    }

    /// Queue device-to-host copies `depth` chunks ahead and write each chunk once its copy is
    /// done, until none is left.
    fn write_loop(
        &self,
        p: usize,
        inflight: &mut VecDeque<(S::Pending, usize, usize)>,
        spare: &mut Vec<S::Buf>,
    ) -> Result<()> {
        loop {
            while inflight.len() < self.depth {
                let Some((off, clen)) = self.claim() else {
                    break;
                };
                let buf = match spare.pop() {
                    Some(b) => b,
                    None => self.staging.take()?,
                };
                // SAFETY: `addr + off .. + clen` lies in the caller's device range, valid and
                // not written until the transfer returns; the copy is waited for before this
                // thread leaves.
                let c = unsafe { self.staging.d2h(p, buf, clen, self.addr + off as u64) }?;
                inflight.push_back((c, off, clen));
            }
            let Some((c, off, clen)) = inflight.pop_front() else {
                return Ok(());
            };
            let mut buf = self.staging.wait(c)?;
            // SAFETY: the buffer is this thread's, holding `clen` bytes from its finished copy;
            // the descriptors are open while the transfer runs. In range: see `read_loop`.
            let r = unsafe {
                write_chunk(
                    self.fds,
                    S::ptr(&mut buf),
                    clen,
                    self.file_offset + off as u64,
                )
            };
            spare.push(buf);
            r?;
        }
    }
}

/// The lane of a calling thread (participant 0): its own, given out round robin on first use,
/// so that transfers started by different threads do not share a stream.
fn caller_lane() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static LANE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % crate::memory::MAX_LANES;
    }
    LANE.with(|l| *l)
}

impl<S: Staging> Job for Transfer<S> {
    fn participate(&self, p: usize) {
        if let Err(e) = self.staging.begin() {
            return self.fail(e);
        }
        // Pool threads take lanes 1, 2, ... by their place in the transfer; the caller its own.
        let p = if p == 0 { caller_lane() } else { p };
        let mut spare = Vec::with_capacity(self.depth);
        let r = if self.read {
            let mut inflight = VecDeque::with_capacity(self.depth);
            let r = self.read_loop(p, &mut inflight, &mut spare);
            // Every copy this thread queued finishes before it leaves.
            inflight
                .into_iter()
                .map(|c| self.staging.wait(c).map(drop))
                .fold(r, Result::and)
        } else {
            let mut inflight = VecDeque::with_capacity(self.depth);
            let r = self.write_loop(p, &mut inflight, &mut spare);
            inflight
                .into_iter()
                .map(|(c, _, _)| self.staging.wait(c).map(drop))
                .fold(r, Result::and)
        };
        if let Err(e) = r {
            self.fail(e);
        }
    }
}

/// Check a transfer of `len` bytes between the file at `file_offset` and device address `addr`
/// (argument `arg`): both ranges end within their address spaces (`off_t` for the file).
pub(crate) fn check_transfer(
    arg: &'static str,
    addr: u64,
    file_offset: u64,
    len: usize,
) -> Result<()> {
    check_file_range(file_offset, len)?;
    match addr.checked_add(len as u64) {
        Some(_) => Ok(()),
        None => Err(Error::invalid(
            arg,
            format!("{addr:#x}+{len}"),
            "the device range must not wrap the address space",
        )),
    }
}

/// Run one transfer cut as `plan` says (its length too) on `threads` threads (fewer when it has
/// fewer chunks).
#[allow(clippy::too_many_arguments)]
fn run<S: Staging>(
    staging: S,
    read: bool,
    cfg: &PosixConfig,
    plan: Plan,
    threads: usize,
    file: &PosixFile<'_>,
    file_offset: u64,
    addr: u64,
) -> Result<Arc<Transfer<S>>> {
    let n_chunks = plan.chunks();
    let t = Arc::new(Transfer {
        staging,
        read,
        fds: Fds::of(file),
        file_offset,
        addr,
        plan,
        bounce_len: cfg.bounce_len()?,
        depth: cfg.depth,
        n_chunks,
        next: AtomicUsize::new(0),
        failed: AtomicBool::new(false),
        error: Mutex::new(None),
        short_at: AtomicU64::new(u64::MAX),
    });
    let participants = threads.min(n_chunks).max(1);
    let relaxed = t.staging.relax_caller();
    // Every participant has left, and none can join, when this returns: the descriptors and
    // the device range are used only until then.
    Workers::global().run(t.clone(), participants - 1);
    drop(relaxed);
    if let Some(e) = t.error.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(e);
    }
    Ok(t)
}

/// Read `len` bytes at `file_offset` to device address `dst`; returns bytes read. The read is
/// limited to `file_size` (the file's size when it starts; `None` for a file whose size is not
/// known, read until `pread` says end of file), so it is short only at end of file and leaves
/// every device byte past the count unchanged. `staging(bounce_len)` makes the staging once the
/// arguments are checked and there is something to read.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a bad `cfg` or a range past `off_t` or the address space;
/// [`Error::Os`] from `pread`; [`Error::FileShrank`] when the file shrank below `file_size`
/// meanwhile; the staging's errors. Every copy started has finished when this returns.
///
/// # Safety
///
/// `dst..dst + len` must be device memory (of the staging's device) that is live, writable and
/// not accessed by anything else until this returns; the descriptors stay open until then.
#[doc(alias = "pread")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn read_to_device<S: Staging>(
    staging: impl FnOnce(usize) -> Result<S>,
    cfg: &PosixConfig,
    file: &PosixFile<'_>,
    file_size: Option<u64>,
    file_offset: u64,
    dst: u64,
    len: usize,
) -> Result<usize> {
    let ramp = ramp_from_env()?;
    // SAFETY: the caller's.
    unsafe { read_planned(ramp, staging, cfg, file, file_size, file_offset, dst, len) }
}

/// [`read_to_device`], with the ramp of [`Plan::for_read`] on or off.
///
/// # Errors
///
/// As [`read_to_device`].
///
/// # Safety
///
/// As [`read_to_device`].
#[allow(clippy::too_many_arguments)]
unsafe fn read_planned<S: Staging>(
    ramp: bool,
    staging: impl FnOnce(usize) -> Result<S>,
    cfg: &PosixConfig,
    file: &PosixFile<'_>,
    file_size: Option<u64>,
    file_offset: u64,
    dst: u64,
    len: usize,
) -> Result<usize> {
    check_transfer("dst", dst, file_offset, len)?;
    let bounce_len = cfg.bounce_len()?;
    let want = clamp_read(file_offset, len, file_size);
    if want == 0 {
        return Ok(0);
    }
    let direct = file.direct.is_some();
    let (threads, chunk) = if direct {
        (cfg.direct_threads, cfg.direct_read_chunk)
    } else {
        (cfg.threads, cfg.chunk)
    };
    let plan = Plan::for_read(ramp, direct, chunk, want, threads);
    let t = run(
        staging(bounce_len)?,
        true,
        cfg,
        plan,
        threads,
        file,
        file_offset,
        dst,
    )?;
    let short = t.short_at.load(Ordering::Relaxed);
    let got = if short == u64::MAX {
        want
    } else {
        usize::try_from(short.saturating_sub(file_offset)).map_or(want, |n| n.min(want))
    };
    match file_size {
        Some(_) => read_outcome("pread", file_offset, want, Ok(got)),
        None => Ok(got),
    }
}

/// Write `len` bytes from device address `src` to the file at `file_offset`; returns `len`.
/// Chunks go through `file.direct` (`O_DIRECT`, on `direct_threads` threads) where it is given
/// and the chunk is aligned, through the buffered descriptor otherwise (on `write_threads`
/// threads when no `O_DIRECT` descriptor is given).
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a bad `cfg` or a range past `off_t` or the address space;
/// [`Error::Os`] from `pwrite`; the staging's errors. Every copy started has finished when this
/// returns.
///
/// # Safety
///
/// `src..src + len` must be device memory (of the staging's device) that is live and not
/// written by anything else until this returns; the descriptors stay open until then.
#[doc(alias = "pwrite")]
pub(crate) unsafe fn write_from_device<S: Staging>(
    staging: impl FnOnce(usize) -> Result<S>,
    cfg: &PosixConfig,
    file: &PosixFile<'_>,
    file_offset: u64,
    src: u64,
    len: usize,
) -> Result<usize> {
    check_transfer("src", src, file_offset, len)?;
    let bounce_len = cfg.bounce_len()?;
    if len == 0 {
        return Ok(0);
    }
    let threads = if file.direct.is_some() {
        cfg.direct_threads
    } else {
        cfg.write_threads
    };
    run(
        staging(bounce_len)?,
        false,
        cfg,
        Plan::flat(cfg.chunk, len),
        threads,
        file,
        file_offset,
        src,
    )?;
    Ok(len)
}

/// Host-memory staging for tests and for measuring the pipeline without a GPU: "device
/// addresses" are offsets into one host buffer; a copy runs when it is waited for, no earlier
/// than `copy_time` after it was queued (a stand-in for the copy engine), and a consumed bounce
/// buffer is poisoned (so a buffer reused before its copy would corrupt the data).
#[cfg(test)]
#[derive(Clone)]
pub(crate) struct HostStaging(Arc<HostInner>);

#[cfg(test)]
pub(crate) struct HostInner {
    device: *mut u8,
    device_len: usize,
    /// Set by the first transfer.
    bounce_len: AtomicUsize,
    copy_time: std::time::Duration,
    /// Poison buffers after use (correctness) or not (throughput).
    poison: bool,
    /// Buffers made (pooling keeps this at threads x depth).
    pub(crate) created: AtomicUsize,
    /// Copies in flight per lane now, and the most ever on one lane.
    in_flight: Mutex<std::collections::HashMap<usize, usize>>,
    pub(crate) max_in_flight: AtomicUsize,
    /// Copies in flight on all lanes now, and the most ever at once.
    total_in_flight: AtomicUsize,
    pub(crate) max_total_in_flight: AtomicUsize,
    /// When non-zero, a copy's `wait` holds on (up to 10 s) until this many copies were in
    /// flight at once: a test of the structure (do threads overlap?) that no clock decides.
    gather: usize,
    gave_up: std::sync::atomic::AtomicBool,
    /// The threads that took part.
    pub(crate) threads: Mutex<std::collections::HashSet<std::thread::ThreadId>>,
    /// Idle buffers (a dropped buffer comes back here, as a bounce chunk goes back to its pool).
    pool: Arc<Mutex<Vec<Box<[u8]>>>>,
}

// SAFETY: `device` is written only at disjoint ranges (one per chunk) by the threads of one
// transfer, and read by the test only between transfers; everything else is atomics or mutexes.
#[cfg(test)]
unsafe impl Send for HostInner {}
// SAFETY: as above.
#[cfg(test)]
unsafe impl Sync for HostInner {}

#[cfg(test)]
impl Drop for HostInner {
    fn drop(&mut self) {
        // SAFETY: made from a boxed slice of `device_len` bytes in `HostStaging::new`.
        drop(unsafe {
            Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.device,
                self.device_len,
            ))
        });
    }
}

/// A host bounce buffer: `bounce_len` bytes at a [`DIRECT_ALIGN`]-aligned offset; back to its
/// pool when dropped.
#[cfg(test)]
pub(crate) struct HostBuf {
    bytes: Box<[u8]>,
    pool: Arc<Mutex<Vec<Box<[u8]>>>>,
}

#[cfg(test)]
impl HostBuf {
    fn start(&mut self) -> *mut u8 {
        let p = self.bytes.as_mut_ptr();
        // SAFETY: over-allocated by DIRECT_ALIGN.
        unsafe { p.add(p.align_offset(DIRECT_ALIGN)) }
    }
}

#[cfg(test)]
impl Drop for HostBuf {
    fn drop(&mut self) {
        let b = std::mem::take(&mut self.bytes);
        self.pool.lock().unwrap().push(b);
    }
}

/// A queued host copy.
#[cfg(test)]
pub(crate) struct HostCopy {
    buf: HostBuf,
    h2d: bool,
    offset: usize,
    len: usize,
    addr: u64,
    lane: usize,
    due: std::time::Instant,
}

#[cfg(test)]
impl HostStaging {
    /// A stand-in device of `device_len` bytes filled with `fill`.
    pub(crate) fn new(device_len: usize, fill: u8, copy_time: std::time::Duration) -> Self {
        let device = Box::into_raw(vec![fill; device_len].into_boxed_slice()).cast::<u8>();
        HostStaging(Arc::new(HostInner {
            device,
            device_len,
            bounce_len: AtomicUsize::new(0),
            copy_time,
            poison: true,
            created: AtomicUsize::new(0),
            in_flight: Mutex::new(Default::default()),
            max_in_flight: AtomicUsize::new(0),
            total_in_flight: AtomicUsize::new(0),
            max_total_in_flight: AtomicUsize::new(0),
            gather: 0,
            gave_up: std::sync::atomic::AtomicBool::new(false),
            threads: Mutex::new(Default::default()),
            pool: Arc::new(Mutex::new(Vec::new())),
        }))
    }

    /// Without poisoning (a plain memcpy per copy: for throughput).
    pub(crate) fn unpoisoned(mut self) -> Self {
        Arc::get_mut(&mut self.0).expect("not shared yet").poison = false;
        self
    }

    /// Each copy waits (up to 10 s) until `n` copies were in flight at once.
    pub(crate) fn gathering(mut self, n: usize) -> Self {
        Arc::get_mut(&mut self.0).expect("not shared yet").gather = n;
        self
    }

    /// The staging a transfer gets: this one, for `bounce_len`-byte buffers (one length per
    /// staging).
    pub(crate) fn with_bounce(&self, bounce_len: usize) -> Result<HostStaging> {
        let was = self.0.bounce_len.swap(bounce_len, Ordering::Relaxed);
        assert!(
            was == 0 || was == bounce_len,
            "one bounce length per HostStaging"
        );
        Ok(self.clone())
    }

    /// The stand-in device's bytes (between transfers).
    pub(crate) fn device(&self) -> Vec<u8> {
        // SAFETY: `device_len` bytes, not written while no transfer runs.
        unsafe { std::slice::from_raw_parts(self.0.device, self.0.device_len) }.to_vec()
    }

    /// Fill the stand-in device from `data` at its start (between transfers).
    pub(crate) fn fill(&self, data: &[u8]) {
        assert!(data.len() <= self.0.device_len);
        // SAFETY: in range; no transfer runs.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.0.device, data.len()) };
    }

    fn lane_delta(&self, lane: usize, up: bool) {
        let mut m = self.0.in_flight.lock().unwrap();
        let n = m.entry(lane).or_insert(0);
        if up {
            *n += 1;
            self.0.max_in_flight.fetch_max(*n, Ordering::Relaxed);
            let total = self.0.total_in_flight.fetch_add(1, Ordering::Relaxed) + 1;
            self.0
                .max_total_in_flight
                .fetch_max(total, Ordering::Relaxed);
        } else {
            *n -= 1;
            self.0.total_in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

// SAFETY: buffers are owned boxes over-allocated by DIRECT_ALIGN (so `bounce_len` bytes remain
// after aligning), used by one holder at a time; a queued copy owns its buffer and runs in
// `wait`, which hands the buffer back only after the copy.
#[cfg(test)]
unsafe impl Staging for HostStaging {
    type Buf = HostBuf;
    type Pending = HostCopy;

    fn begin(&self) -> Result<()> {
        self.0
            .threads
            .lock()
            .unwrap()
            .insert(std::thread::current().id());
        Ok(())
    }

    fn take(&self) -> Result<HostBuf> {
        let idle = self.0.pool.lock().unwrap().pop();
        let bytes = idle.unwrap_or_else(|| {
            self.0.created.fetch_add(1, Ordering::Relaxed);
            let n = self.0.bounce_len.load(Ordering::Relaxed) + DIRECT_ALIGN;
            vec![0xA5; n].into_boxed_slice()
        });
        Ok(HostBuf {
            bytes,
            pool: self.0.pool.clone(),
        })
    }

    fn ptr(buf: &mut HostBuf) -> *mut u8 {
        buf.start()
    }

    unsafe fn h2d(
        &self,
        lane: usize,
        buf: HostBuf,
        offset: usize,
        len: usize,
        dst: u64,
    ) -> Result<HostCopy> {
        self.lane_delta(lane, true);
        Ok(HostCopy {
            buf,
            h2d: true,
            offset,
            len,
            addr: dst,
            lane,
            due: std::time::Instant::now() + self.0.copy_time,
        })
    }

    unsafe fn d2h(&self, lane: usize, buf: HostBuf, len: usize, src: u64) -> Result<HostCopy> {
        self.lane_delta(lane, true);
        Ok(HostCopy {
            buf,
            h2d: false,
            offset: 0,
            len,
            addr: src,
            lane,
            due: std::time::Instant::now() + self.0.copy_time,
        })
    }

    fn wait(&self, c: HostCopy) -> Result<HostBuf> {
        let HostCopy {
            mut buf,
            h2d,
            offset,
            len,
            addr,
            lane,
            due,
        } = c;
        let now = std::time::Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        if self.0.gather > 0 {
            // Once one copy gave up, the rest go on at once (a failing test takes 10 s, not 10 s
            // a copy).
            let give_up = now + std::time::Duration::from_secs(10);
            while self.0.max_total_in_flight.load(Ordering::Relaxed) < self.0.gather
                && !self.0.gave_up.load(Ordering::Relaxed)
            {
                if std::time::Instant::now() >= give_up {
                    self.0.gave_up.store(true, Ordering::Relaxed);
                }
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        }
        let a = usize::try_from(addr).unwrap();
        assert!(
            a + len <= self.0.device_len,
            "copy inside the stand-in device"
        );
        assert!(
            offset + len <= self.0.bounce_len.load(Ordering::Relaxed),
            "copy inside the bounce buffer"
        );
        let host = buf.start();
        // SAFETY: both ranges checked just above; the device range is this chunk's alone.
        unsafe {
            if h2d {
                std::ptr::copy_nonoverlapping(host.add(offset), self.0.device.add(a), len);
            } else {
                std::ptr::copy_nonoverlapping(self.0.device.add(a), host.add(offset), len);
            }
        }
        if h2d && self.0.poison {
            buf.bytes.fill(0xA5);
        }
        self.lane_delta(lane, false);
        Ok(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::{DirectIo, OpenOptions};
    use std::os::fd::AsFd;
    use std::time::{Duration, Instant};

    fn data(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn temp(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("gpudirect-posix-{name}-{}", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        p
    }

    /// `e` is an [`Error::InvalidArgument`] naming `arg`.
    #[track_caller]
    fn assert_invalid(e: &Error, arg: &str) {
        assert!(
            matches!(e, Error::InvalidArgument { arg: a, .. } if *a == arg),
            "expected an invalid `{arg}`: {e}"
        );
    }

    /// `path` opened for reading through the page cache.
    fn buffered(path: &std::path::Path) -> std::os::fd::OwnedFd {
        OpenOptions::read_only()
            .direct(DirectIo::Off)
            .open(path)
            .unwrap()
            .0
    }

    /// The POSIX path's view of a buffered descriptor alone.
    fn plain(fd: &std::os::fd::OwnedFd) -> PosixFile<'_> {
        PosixFile {
            buffered: fd.as_fd(),
            direct: None,
        }
    }

    fn cfg(threads: usize, chunk: usize, depth: usize) -> PosixConfig {
        PosixConfig {
            threads,
            direct_threads: threads,
            write_threads: threads,
            chunk,
            direct_read_chunk: chunk,
            depth,
        }
    }

    fn read_case(
        file_bytes: &[u8],
        cfg: PosixConfig,
        direct: DirectIo,
        fo: u64,
        dst_off: usize,
        len: usize,
    ) {
        read_case_ramp(false, file_bytes, cfg, direct, fo, dst_off, len)
    }

    fn read_case_ramp(
        ramp: bool,
        file_bytes: &[u8],
        cfg: PosixConfig,
        direct: DirectIo,
        fo: u64,
        dst_off: usize,
        len: usize,
    ) {
        let p = temp(
            &format!(
                "r{}-{}-{}-{}-{fo}-{len}-{}",
                cfg.threads, cfg.chunk, cfg.direct_read_chunk, cfg.depth, ramp as u8
            ),
            file_bytes,
        );
        let (buf, _) = OpenOptions::read_only()
            .direct(DirectIo::Off)
            .open(&p)
            .unwrap();
        let dfd = match direct {
            DirectIo::Off => None,
            _ => match OpenOptions::read_only().open(&p).unwrap() {
                (fd, true) => Some(fd),
                _ => None,
            },
        };
        let staging = HostStaging::new(dst_off + len + 16, 0xEE, Duration::ZERO);
        let file = PosixFile {
            buffered: buf.as_fd(),
            direct: dfd.as_ref().map(|d| d.as_fd()),
        };
        // SAFETY: host staging: "device addresses" are offsets into its buffer, which covers
        // `dst_off + len`.
        let n = unsafe {
            read_planned(
                ramp,
                |b| staging.with_bounce(b),
                &cfg,
                &file,
                Some(file_bytes.len() as u64),
                fo,
                dst_off as u64,
                len,
            )
        }
        .unwrap();
        let expect_n = len.min(file_bytes.len().saturating_sub(fo as usize));
        assert_eq!(n, expect_n, "{cfg:?} fo={fo} len={len}");
        let dev = staging.device();
        assert_eq!(
            &dev[dst_off..dst_off + n],
            &file_bytes[(fo as usize).min(file_bytes.len())..][..n],
            "{cfg:?}"
        );
        assert!(
            dev[..dst_off].iter().all(|&b| b == 0xEE),
            "bytes before the range untouched"
        );
        assert!(
            dev[dst_off + n..].iter().all(|&b| b == 0xEE),
            "bytes after the range untouched"
        );
        let threads = if file.direct.is_some() {
            cfg.direct_threads
        } else {
            cfg.threads
        };
        assert!(
            staging.0.created.load(Ordering::Relaxed) <= threads * cfg.depth,
            "at most depth buffers per thread"
        );
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn chunked_reads_are_exact_for_every_shape() {
        let bytes = data(300_000, 7);
        for &(threads, chunk, depth) in &[
            (1, 4096, 1),
            (1, 8192, 2),
            (3, 4096, 3),
            (8, 12288, 2),
            (4, 65536, 3),
        ] {
            let cfg = cfg(threads, chunk, depth);
            for direct in [DirectIo::Off, DirectIo::Try] {
                // Unaligned: 4097 bytes at file offset 3 into device offset 1.
                read_case(&bytes, cfg, direct, 3, 1, 4097);
                read_case(&bytes, cfg, direct, 0, 0, 300_000);
                read_case(&bytes, cfg, direct, 4095, 7, 123_457);
                // Crossing end of file: the short count.
                read_case(&bytes, cfg, direct, 290_001, 0, 20_000);
                read_case(&bytes, cfg, direct, 400_000, 0, 10);
            }
            // O_DIRECT reads cut by their own chunk, smaller and larger than `chunk`.
            for direct_read_chunk in [4096, 3 * chunk] {
                let cfg = PosixConfig {
                    direct_read_chunk,
                    ..cfg
                };
                read_case(&bytes, cfg, DirectIo::Try, 3, 1, 4097);
                read_case(&bytes, cfg, DirectIo::Try, 4095, 7, 123_457);
                read_case(&bytes, cfg, DirectIo::Try, 290_001, 0, 20_000);
            }
        }
    }

    #[test]
    fn ramped_reads_are_exact() {
        let bytes = data(600_000, 11);
        for &(threads, chunk, depth) in &[(2, 16384, 2), (3, 32768, 2), (8, 32768, 3)] {
            let cfg = cfg(threads, chunk, depth);
            let plan = Plan::ramped(chunk, 500_000, threads);
            assert!(plan.head == threads, "{cfg:?}: ramped ({plan:?})");
            for direct in [DirectIo::Off, DirectIo::Try] {
                read_case_ramp(true, &bytes, cfg, direct, 0, 0, 600_000);
                read_case_ramp(true, &bytes, cfg, direct, 4095, 7, 500_001);
                // Crossing end of file: the short count.
                read_case_ramp(true, &bytes, cfg, direct, 100_001, 3, 600_000);
            }
        }
    }

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

    #[test]
    fn each_thread_keeps_several_copies_in_flight() {
        // One thread, depth 3, copies slower than reads: the thread queues a copy and reads on,
        // so three copies are in flight on its lane at once.
        let bytes = data(1 << 20, 3);
        let p = temp("pipeline", &bytes);
        let fd = buffered(&p);
        let file = plain(&fd);
        let staging = HostStaging::new(1 << 20, 0, Duration::from_millis(2));
        // SAFETY: host staging over 1 MiB.
        let n = unsafe {
            read_to_device(
                |b| staging.with_bounce(b),
                &cfg(1, 16384, 3),
                &file,
                Some(1 << 20),
                0,
                0,
                1 << 20,
            )
        }
        .unwrap();
        assert_eq!(n, 1 << 20);
        assert_eq!(staging.device(), bytes);
        assert_eq!(staging.0.max_in_flight.load(Ordering::Relaxed), 3);
        assert_eq!(staging.0.created.load(Ordering::Relaxed), 3);
        std::fs::remove_file(&p).unwrap();
    }

    /// The time to read `len` bytes of `file` into `staging` with `threads` threads, and the
    /// number of threads that took part so far.
    fn read_with(
        path: &std::path::Path,
        staging: &HostStaging,
        len: usize,
        threads: usize,
        chunk: usize,
    ) -> (Duration, usize) {
        let fd = buffered(path);
        let file = plain(&fd);
        let t = Instant::now();
        // SAFETY: host staging over at least `len` bytes.
        let n = unsafe {
            read_to_device(
                |b| staging.with_bounce(b),
                &cfg(threads, chunk, 2),
                &file,
                Some(len as u64),
                0,
                0,
                len,
            )
        }
        .unwrap();
        let took = t.elapsed();
        assert_eq!(n, len);
        (took, staging.0.threads.lock().unwrap().len())
    }

    #[test]
    fn reads_overlap_across_threads() {
        // 64 chunks, 8 threads with two copies in flight each. Every copy holds on until four
        // copies were in flight at once, which one thread alone (two at most) never reaches:
        // if something serialized the threads, the copies would give up after 10 s and the
        // count below would say so. No clock decides the outcome on a loaded machine.
        let len = 64 * 65536;
        let bytes = data(len, 9);
        let p = temp("scale", &bytes);
        let staging = HostStaging::new(len, 0, Duration::ZERO).gathering(4);
        read_with(&p, &staging, len, 8, 65536);
        assert_eq!(staging.device(), bytes);
        assert!(
            staging.0.max_total_in_flight.load(Ordering::Relaxed) >= 4,
            "copies of several threads in flight at once"
        );
        assert!(
            staging.0.threads.lock().unwrap().len() >= 2,
            "pool threads took part"
        );
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn pool_threads_are_kept_between_transfers() {
        let len = 16 * 65536;
        let p = temp("kept", &data(len, 4));
        let staging = HostStaging::new(len, 0, Duration::ZERO);
        read_with(&p, &staging, len, 4, 65536);
        let before = Workers::global().threads();
        for _ in 0..5 {
            read_with(&p, &staging, len, 4, 65536);
        }
        assert!(
            staging.0.created.load(Ordering::Relaxed) <= 4 * 2,
            "buffers are reused between transfers"
        );
        // Other tests may grow the pool meanwhile, but not by five transfers' worth of threads.
        assert!(Workers::global().threads() < before + 15);
        std::fs::remove_file(&p).unwrap();
    }

    /// Host throughput of the pipeline (a memcpy per chunk for the copy), for a file in the page
    /// cache: `cargo test -p gpudirect --release --lib host_pipeline_throughput -- --ignored
    /// --nocapture`. On a GPU node the bench measures the real thing.
    #[test]
    #[ignore = "a measurement, not a check: run it by name"]
    fn host_pipeline_throughput() {
        let len = 256 << 20;
        let p = temp("throughput", &data(len, 5));
        // The reference: one thread's `pread` of the whole file into one buffer, no copy.
        let f = std::fs::File::open(&p).unwrap();
        let mut buf = vec![0u8; len];
        let best = (0..3)
            .map(|_| {
                let t = Instant::now();
                // SAFETY: a valid descriptor and buffer of `len` bytes.
                unsafe { io_full(Io::Read, f.as_raw_fd(), buf.as_mut_ptr(), len, 0) }.unwrap();
                t.elapsed()
            })
            .min()
            .unwrap();
        println!(
            "one pread, no copy: {:.2} GB/s",
            len as f64 / best.as_secs_f64() / 1e9
        );
        println!("| threads | chunk | GB/s (pread + memcpy per chunk) |");
        for chunk in [256 << 10, 1 << 20, 4 << 20] {
            for threads in [1, 2, 4, 8] {
                let staging = HostStaging::new(len, 1, Duration::ZERO).unpoisoned();
                let best = (0..4)
                    .map(|_| read_with(&p, &staging, len, threads, chunk).0)
                    .skip(1) // the first one also makes the buffers and touches the pages
                    .min()
                    .unwrap();
                println!(
                    "| {threads} | {} KiB | {:.2} |",
                    chunk >> 10,
                    len as f64 / best.as_secs_f64() / 1e9
                );
            }
        }
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn chunked_writes_are_exact() {
        let src = data(200_003, 11);
        for &(threads, chunk, depth) in &[(1, 4096, 1), (3, 8192, 2), (8, 4096, 3)] {
            let cfg = cfg(threads, chunk, depth);
            for direct in [false, true] {
                let p = temp(&format!("w{threads}-{chunk}-{direct}"), &[]);
                let (buf, _) = OpenOptions::read_write()
                    .direct(DirectIo::Off)
                    .open(&p)
                    .unwrap();
                let (dfd, is_direct) = OpenOptions::read_write().open(&p).unwrap();
                let staging = HostStaging::new(src.len(), 0, Duration::ZERO);
                staging.fill(&src);
                let file = PosixFile {
                    buffered: buf.as_fd(),
                    direct: (direct && is_direct).then(|| dfd.as_fd()),
                };
                for (fo, so, n) in [(5, 1, 200_000), (4096, 0, 8192 * 3)] {
                    // SAFETY: host staging; its device covers `so..so + n`.
                    let got = unsafe {
                        write_from_device(|b| staging.with_bounce(b), &cfg, &file, fo, so, n)
                    }
                    .unwrap();
                    assert_eq!(got, n);
                    let back = std::fs::read(&p).unwrap();
                    assert_eq!(
                        &back[fo as usize..fo as usize + n],
                        &src[so as usize..so as usize + n],
                        "{cfg:?} direct={direct}"
                    );
                }
                std::fs::remove_file(&p).unwrap();
            }
        }
    }

    #[test]
    fn a_read_crossing_the_end_of_file_changes_nothing_past_the_count() {
        // A file of 22,295 bytes; 8,192 bytes at 18,295 into device offset 100: 4,000 bytes,
        // and the poison after them intact (checked by read_case).
        let bytes = data(22_295, 12);
        for direct in [DirectIo::Off, DirectIo::Try] {
            read_case(&bytes, cfg(2, 4096, 2), direct, 18_295, 100, 8192);
            read_case(&bytes, cfg(2, 4096, 2), direct, 22_295, 100, 8192);
            read_case(&bytes, cfg(2, 4096, 2), direct, 30_000, 100, 8192);
        }
    }

    #[test]
    fn a_file_that_shrank_is_an_error_and_nothing_past_the_limit_changes() {
        let bytes = data(10_000, 5);
        let p = temp("shrank", &bytes);
        let fd = buffered(&p);
        let file = plain(&fd);
        for threads in [1, 3] {
            let staging = HostStaging::new(40_000, 0xEE, Duration::ZERO);
            // The size taken when the read started (20,000) is larger than what is there now.
            // SAFETY: host staging over 40,000 bytes.
            let e = unsafe {
                read_to_device(
                    |b| staging.with_bounce(b),
                    &cfg(threads, 4096, 2),
                    &file,
                    Some(20_000),
                    0,
                    0,
                    30_000,
                )
            }
            .unwrap_err();
            match e {
                Error::FileShrank {
                    call: "pread",
                    expected: 20_000,
                    got: 10_000,
                    ..
                } => {}
                other => panic!("{other:?}"),
            }
            let dev = staging.device();
            assert_eq!(&dev[..10_000], &bytes[..]);
            assert!(dev[20_000..].iter().all(|&b| b == 0xEE));
        }
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn errors_stop_the_transfer_and_every_copy_is_waited() {
        // A write to a read-only descriptor: pwrite fails with EBADF on some thread; the others
        // stop claiming chunks, and every copy queued has been waited (nothing in flight).
        let p = temp("ebadf", &[0u8; 4096]);
        let fd = buffered(&p);
        let file = plain(&fd);
        let staging = HostStaging::new(1 << 20, 1, Duration::from_micros(200));
        // SAFETY: host staging over 1 MiB.
        let e = unsafe {
            write_from_device(
                |b| staging.with_bounce(b),
                &cfg(4, 4096, 3),
                &file,
                0,
                0,
                1 << 20,
            )
        }
        .unwrap_err();
        assert!(
            matches!(&e, Error::Os { call: "pwrite", source } if source.raw_os_error() == Some(libc::EBADF)),
            "{e}"
        );
        assert!(
            staging
                .0
                .in_flight
                .lock()
                .unwrap()
                .values()
                .all(|&n| n == 0),
            "every copy waited"
        );
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn the_wrapping_chunk_is_refused_before_any_buffer_exists() {
        let bad = PosixConfig {
            chunk: usize::MAX - 4095,
            ..PosixConfig::default()
        };
        let e = bad.validate().unwrap_err();
        assert_invalid(&e, "config.chunk");
        assert!(bad.bounce_len().is_err());
        let p = temp("wrap", &[3; 1 << 16]);
        let fd = buffered(&p);
        let file = plain(&fd);
        let never = |_| -> Result<HostStaging> { panic!("no staging for a refused transfer") };
        // SAFETY: refused before any access.
        let e = unsafe { read_to_device(never, &bad, &file, Some(1 << 16), 0, 0, 1 << 16) }
            .unwrap_err();
        assert_invalid(&e, "config.chunk");
        // SAFETY: as above.
        let e = unsafe { write_from_device(never, &bad, &file, 0, 0, 1 << 16) }.unwrap_err();
        assert_invalid(&e, "config.chunk");
        // Nothing to read at end of file: no staging either.
        // SAFETY: nothing is accessed.
        let n = unsafe {
            read_to_device(
                never,
                &cfg(1, 4096, 1),
                &file,
                Some(1 << 16),
                1 << 16,
                0,
                10,
            )
        }
        .unwrap();
        assert_eq!(n, 0);
        // A chunk larger than its bounce buffer is refused by the reader itself.
        let mut buf = vec![0u8; 2 * DIRECT_ALIGN];
        // SAFETY: the buffer holds 2 x DIRECT_ALIGN bytes; refused before any read.
        let e = unsafe {
            read_chunk(
                Fds::of(&file),
                buf.as_mut_ptr(),
                DIRECT_ALIGN,
                0,
                DIRECT_ALIGN + 1,
            )
        }
        .unwrap_err();
        assert_invalid(&e, "len");
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn transfers_past_off_t_or_the_address_space_are_refused() {
        let p = temp("range", &[1; 16]);
        let fd = buffered(&p);
        let file = plain(&fd);
        let c = PosixConfig::default();
        let never = |_| -> Result<HostStaging> { panic!("refused first") };
        // SAFETY: refused before any access.
        let e =
            unsafe { read_to_device(never, &c, &file, None, i64::MAX as u64, 0, 2) }.unwrap_err();
        assert_invalid(&e, "file_offset");
        // SAFETY: refused before any access.
        let e = unsafe { read_to_device(never, &c, &file, None, 0, u64::MAX - 1, 4) }.unwrap_err();
        assert_invalid(&e, "dst");
        // SAFETY: refused before any access.
        let e = unsafe { write_from_device(never, &c, &file, u64::MAX, 0, 1) }.unwrap_err();
        assert_invalid(&e, "file_offset");
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn the_node_sets_threads_and_chunks() {
        let big = PosixConfig::for_node(16, 1 << 30);
        assert_eq!(
            big,
            PosixConfig {
                threads: 16,
                direct_threads: 4,
                write_threads: 1,
                chunk: 4 << 20,
                direct_read_chunk: 1 << 20,
                depth: 2
            }
        );
        assert_eq!(PosixConfig::for_node(128, 1 << 30).threads, 16);
        assert_eq!(PosixConfig::for_node(8, 1 << 30).threads, 8);
        assert_eq!(PosixConfig::for_node(2, 1 << 30).direct_threads, 4);
        assert_eq!(PosixConfig::for_node(64, 1 << 30).direct_threads, 8);
        assert_eq!(PosixConfig::for_node(1000, 1 << 30).direct_threads, 8);
        assert_eq!(PosixConfig::for_node(0, 1 << 30).threads, 1);
        // Small transfers: smaller chunks (powers of two, so few pools), never below 256 KiB.
        assert_eq!(PosixConfig::for_node(16, 128 << 20).chunk, 4 << 20);
        assert_eq!(PosixConfig::for_node(16, 64 << 20).chunk, 2 << 20);
        assert_eq!(PosixConfig::for_node(16, 16 << 20).chunk, 512 << 10);
        assert_eq!(PosixConfig::for_node(16, 4096).chunk, 256 << 10);
        // O_DIRECT reads: 1 MiB, halved while each of the 4 direct threads would get fewer
        // than two.
        assert_eq!(
            PosixConfig::for_node(16, 8 << 20).direct_read_chunk,
            1 << 20
        );
        assert_eq!(
            PosixConfig::for_node(16, 4 << 20).direct_read_chunk,
            512 << 10
        );
        assert_eq!(PosixConfig::for_node(16, 4096).direct_read_chunk, 256 << 10);
        for cores in [0, 1, 2, 16, 32, 1000] {
            for len in [0, 1, 1 << 20, 1 << 30, usize::MAX] {
                PosixConfig::for_node(cores, len).validate().unwrap();
            }
        }
        PosixConfig::default().validate().unwrap();
    }

    #[test]
    fn environment_overrides_are_checked() {
        let base = PosixConfig::for_node(16, 1 << 30);
        let none: [Option<String>; 6] = Default::default();
        assert_eq!(with_overrides(base, &none).unwrap(), base);
        let some = [
            Some("4".into()),
            None,
            Some(" 2 ".into()),
            Some("2048".into()),
            Some("3".into()),
            Some("512".into()),
        ];
        let c = with_overrides(base, &some).unwrap();
        assert_eq!(
            (
                c.threads,
                c.direct_threads,
                c.write_threads,
                c.chunk,
                c.depth,
                c.direct_read_chunk
            ),
            (4, 4, 2, 2 << 20, 3, 512 << 10)
        );
        let mut bad: [Option<String>; 6] = Default::default();
        bad[3] = Some("lots".into());
        let e = with_overrides(base, &bad).unwrap_err();
        assert_invalid(&e, "GPUDIRECT_POSIX_CHUNK_KIB");
        bad[3] = Some(usize::MAX.to_string());
        assert!(with_overrides(base, &bad).is_err(), "overflowing chunk");
        bad[3] = None;
        bad[0] = Some("0".into());
        let e = with_overrides(base, &bad).unwrap_err();
        assert_invalid(&e, "config.threads");
        bad[0] = None;
        bad[5] = Some("3".into()); // 3 KiB: not a multiple of DIRECT_ALIGN
        let e = with_overrides(base, &bad).unwrap_err();
        assert_invalid(&e, "config.direct_read_chunk");
        bad[5] = Some(usize::MAX.to_string());
        assert!(
            with_overrides(base, &bad).is_err(),
            "overflowing direct read chunk"
        );
    }

    fn config() -> impl Strategy<Value = PosixConfig> {
        let size = || prop_oneof![any::<usize>(), 0usize..300, Just(usize::MAX)];
        let chunk = || {
            prop_oneof![
                any::<usize>(),
                (0usize..=(PosixConfig::MAX_CHUNK / DIRECT_ALIGN + 2))
                    .prop_map(|k| k * DIRECT_ALIGN),
                Just(usize::MAX - 4095),
            ]
        };
        (size(), size(), size(), chunk(), chunk(), size()).prop_map(
            |(threads, direct_threads, write_threads, chunk, direct_read_chunk, depth)| {
                PosixConfig {
                    threads,
                    direct_threads,
                    write_threads,
                    chunk,
                    direct_read_chunk,
                    depth,
                }
            },
        )
    }

    use proptest::prelude::*;

    proptest! {
        #[test]
        fn configs_are_bounded(cfg in config()) {
            let bounce = cfg.chunk.max(cfg.direct_read_chunk) as u128 + 2 * DIRECT_ALIGN as u128;
            let most = cfg.threads.max(cfg.direct_threads).max(cfg.write_threads) as u128;
            let pinned = bounce
                .checked_mul(cfg.depth as u128)
                .and_then(|b| b.checked_mul(most))
                .unwrap_or(u128::MAX);
            let t = 1..=PosixConfig::MAX_THREADS;
            let ok = t.contains(&cfg.threads)
                && t.contains(&cfg.direct_threads)
                && t.contains(&cfg.write_threads)
                && (1..=PosixConfig::MAX_DEPTH).contains(&cfg.depth)
                && [cfg.chunk, cfg.direct_read_chunk].iter().all(|&c| {
                    c > 0 && c <= PosixConfig::MAX_CHUNK && c % DIRECT_ALIGN == 0
                })
                && pinned <= PosixConfig::MAX_PINNED_BYTES as u128;
            prop_assert_eq!(cfg.validate().is_ok(), ok);
            match cfg.bounce_len() {
                Ok(b) => prop_assert!(
                    ok && b as u128 == bounce && b > cfg.chunk && b > cfg.direct_read_chunk
                ),
                Err(_) => prop_assert!(!ok),
            }
        }

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

        #[test]
        fn transfers_are_checked(addr: u64, file_offset: u64, len: usize) {
            let ok = file_offset as u128 + len as u128 <= i64::MAX as u128
                && addr as u128 + len as u128 <= u64::MAX as u128;
            prop_assert_eq!(check_transfer("dst", addr, file_offset, len).is_ok(), ok);
        }
    }

    #[test]
    fn bad_configs_are_refused() {
        let p = temp("cfg", &[1; 10]);
        let fd = buffered(&p);
        let file = plain(&fd);
        let never = |_| -> Result<HostStaging> { panic!("refused first") };
        // SAFETY: refused before any access.
        let e = unsafe { read_to_device(never, &cfg(1, 1000, 1), &file, Some(10), 0, 0, 10) }
            .unwrap_err();
        assert_invalid(&e, "config.chunk");
        std::fs::remove_file(&p).unwrap();
    }
}
