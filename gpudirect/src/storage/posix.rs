//! The POSIX path: reader threads `pread` into pinned bounce buffers and copy to the GPU
//! asynchronously, chunked and pipelined (each thread keeps `depth` buffers in flight, so reading
//! chunk *k+1* overlaps the copy of chunk *k*). Writes run the other way (copy to the host, then
//! `pwrite`). `O_DIRECT` is used where the file allows it, with aligned bounce buffers and aligned
//! reads around unaligned requests; a refusal falls back to the buffered descriptor.
//!
//! The copy to or from the device is behind a crate-private `CopyEngine` trait, so the chunking
//! and pipelining are tested on host memory (a test-only engine) without a GPU. The entry points
//! that take raw device addresses are crate-private and `unsafe`: the public way in is
//! [`File`](super::File), which checks the device range first.

use super::check_range;
use crate::error::{Error, Result, cu};
use cudarc::driver::sys as cu_sys;
use std::os::fd::{AsRawFd, BorrowedFd};
#[cfg(test)]
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Alignment of `O_DIRECT` offsets, lengths and buffers.
pub const DIRECT_ALIGN: usize = 4096;

/// How the POSIX path splits and overlaps a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PosixConfig {
    /// Reader (or writer) threads.
    pub threads: usize,
    /// Bytes per chunk (one `pread` and one copy).
    pub chunk: usize,
    /// Bounce buffers per thread (2 = double, 3 = triple buffering).
    pub depth: usize,
    /// Reader threads for `O_DIRECT` (page-cache-cold) reads, which are bound by the device's
    /// queue rather than by memory copies.
    pub direct_threads: usize,
}

impl Default for PosixConfig {
    fn default() -> Self {
        PosixConfig {
            threads: 8,
            chunk: 16 << 20,
            depth: 3,
            direct_threads: 4,
        }
    }
}

/// The most reader (or writer) threads a [`PosixConfig`] may ask for.
pub const MAX_THREADS: usize = 256;
/// The most bounce buffers per thread.
pub const MAX_DEPTH: usize = 16;
/// The largest chunk, in bytes (1 GiB).
pub const MAX_CHUNK: usize = 1 << 30;
/// The most pinned host memory one transfer's bounce buffers may take, in bytes (64 GiB).
pub const MAX_PINNED_BYTES: usize = 64 << 30;

impl PosixConfig {
    /// Check the configuration: at least one thread, direct thread and buffer; a chunk that is a
    /// non-zero multiple of [`DIRECT_ALIGN`]; every field within its bound ([`MAX_THREADS`],
    /// [`MAX_DEPTH`], [`MAX_CHUNK`]); and the bounce buffers of the larger thread count within
    /// [`MAX_PINNED_BYTES`]. Every transfer checks it before anything else.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the field and the rule.
    pub fn validate(&self) -> Result<()> {
        for (arg, v) in [
            ("config.threads", self.threads),
            ("config.direct_threads", self.direct_threads),
        ] {
            if v == 0 || v > MAX_THREADS {
                return Err(Error::invalid(
                    arg,
                    v,
                    format!("must be between 1 and {MAX_THREADS}"),
                ));
            }
        }
        if self.depth == 0 || self.depth > MAX_DEPTH {
            return Err(Error::invalid(
                "config.depth",
                self.depth,
                format!("must be between 1 and {MAX_DEPTH}"),
            ));
        }
        if self.chunk == 0 || self.chunk > MAX_CHUNK || !self.chunk.is_multiple_of(DIRECT_ALIGN) {
            return Err(Error::invalid(
                "config.chunk",
                self.chunk,
                format!("must be a non-zero multiple of {DIRECT_ALIGN} of at most {MAX_CHUNK}"),
            ));
        }
        match self.pinned_bytes() {
            Some(n) if n <= MAX_PINNED_BYTES => Ok(()),
            _ => Err(Error::invalid(
                "config",
                format!("{self:?}"),
                format!("threads x depth x bounce length must be at most {MAX_PINNED_BYTES} bytes"),
            )),
        }
    }

    /// Bytes of each bounce buffer: a chunk plus room to align both ends for `O_DIRECT`.
    ///
    /// # Errors
    ///
    /// As [`validate`](Self::validate).
    pub fn bounce_len(&self) -> Result<usize> {
        self.validate()?;
        Ok(self.chunk + 2 * DIRECT_ALIGN) // within bounds: chunk <= MAX_CHUNK
    }

    /// The pinned bytes of the bounce buffers when every thread of the larger count is busy, or
    /// `None` where that overflows.
    fn pinned_bytes(&self) -> Option<usize> {
        self.chunk
            .checked_add(2 * DIRECT_ALIGN)?
            .checked_mul(self.depth)?
            .checked_mul(self.threads.max(self.direct_threads))
    }
}

/// Chunk `c` of a transfer of `len` bytes cut in `chunk`-byte pieces: its offset and length, or
/// `None` past the last chunk.
pub(crate) fn chunk_range(c: usize, chunk: usize, len: usize) -> Option<(usize, usize)> {
    let off = c.checked_mul(chunk)?;
    (off < len).then(|| (off, chunk.min(len - off)))
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
    if end > super::OFF_MAX {
        return None;
    }
    let a_start = start - start % a;
    let a_end = end.div_ceil(a).checked_mul(a)?;
    let span = usize::try_from(a_end - a_start).ok()?;
    let skip = usize::try_from(start - a_start).ok()?;
    (span <= bounce_len).then_some((a_start, span, skip))
}

/// One thread's copy engine: `depth` bounce buffers, each with an asynchronous copy slot.
///
/// # Safety
///
/// [`bounce`](Self::bounce) must return a pointer to at least the `bounce_len` bytes the engine
/// was acquired with, writable and not accessed by anything else (no copy in flight on it) until
/// the slot is started again; `start_*` must copy only within `bounce(slot) + offset .. + len` and
/// the given device range, and [`wait_slot`](Self::wait_slot) returning `Ok` must mean the slot's
/// copy has finished. The POSIX path writes through `bounce`'s pointer with `pread`.
pub(crate) unsafe trait CopyEngine: Send {
    /// The host address of bounce buffer `slot` ([`PosixConfig::bounce_len`] bytes,
    /// [`DIRECT_ALIGN`]-aligned). Valid until the engine is released; only touched while the
    /// slot's copy is not in flight.
    fn bounce(&mut self, slot: usize) -> *mut u8;
    /// Start copying `len` bytes at `bounce(slot) + offset` to device address `dst`.
    fn start_h2d(&mut self, slot: usize, offset: usize, len: usize, dst: u64) -> Result<()>;
    /// Start copying `len` bytes from device address `src` to `bounce(slot) + offset`.
    fn start_d2h(&mut self, slot: usize, offset: usize, len: usize, src: u64) -> Result<()>;
    /// Wait for slot's last copy.
    fn wait_slot(&mut self, slot: usize) -> Result<()>;
}

/// Hands out engines (pooled: pinned buffers are expensive to allocate).
///
/// # Safety
///
/// [`acquire`](Self::acquire) must return an engine whose every slot is idle, with `depth` bounce
/// buffers of at least `bounce_len` bytes each (the [`CopyEngine`] contract).
pub(crate) unsafe trait Engines: Sync {
    /// The engine type.
    type Engine: CopyEngine;
    /// An engine with `depth` bounce buffers of `bounce_len` bytes, bound to the calling thread.
    fn acquire(&self, bounce_len: usize, depth: usize) -> Result<Self::Engine>;
    /// Give an idle engine (every slot waited) back.
    fn release(&self, engine: Self::Engine);
}

/// The descriptors the POSIX path reads and writes: buffered, and `O_DIRECT` where available.
#[derive(Debug, Clone, Copy)]
pub struct PosixFile<'a> {
    /// A buffered descriptor.
    pub buffered: BorrowedFd<'a>,
    /// An `O_DIRECT` descriptor of the same file, if one could be opened.
    pub direct: Option<BorrowedFd<'a>>,
}

/// `offset + done` as an `off_t`.
fn off_t_at(call: &'static str, offset: u64, done: usize) -> Result<libc::off_t> {
    offset
        .checked_add(done as u64)
        .and_then(|o| libc::off_t::try_from(o).ok())
        .ok_or_else(|| {
            Error::invalid(
                call,
                format!("{offset}+{done}"),
                "file offsets must not exceed i64::MAX",
            )
        })
}

fn pread_full(fd: BorrowedFd<'_>, buf: *mut u8, len: usize, offset: u64) -> Result<usize> {
    let mut done = 0;
    while done < len {
        let at = off_t_at("pread", offset, done)?;
        // SAFETY: `buf..buf+len` is a bounce buffer owned by this thread's engine.
        let r = unsafe { libc::pread(fd.as_raw_fd(), buf.add(done).cast(), len - done, at) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(Error::Os {
                call: "pread",
                source: e,
            });
        }
        if r == 0 {
            break;
        }
        done += r.unsigned_abs().min(len - done);
    }
    Ok(done)
}

fn pwrite_full(fd: BorrowedFd<'_>, buf: *const u8, len: usize, offset: u64) -> Result<()> {
    let mut done = 0;
    while done < len {
        let at = off_t_at("pwrite", offset, done)?;
        // SAFETY: `buf..buf+len` is a bounce buffer the finished copy filled.
        let r = unsafe { libc::pwrite(fd.as_raw_fd(), buf.add(done).cast(), len - done, at) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(Error::Os {
                call: "pwrite",
                source: e,
            });
        }
        if r == 0 {
            return Err(Error::errno("pwrite", libc::EIO));
        }
        done += r.unsigned_abs().min(len - done);
    }
    Ok(())
}

/// Read `start..start+len` of the file into `bounce` (`bounce_len` bytes), through `O_DIRECT`
/// (aligned around the range) when possible; returns (offset of the data in `bounce`, bytes
/// available).
fn read_chunk(
    file: &PosixFile<'_>,
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
    if let Some(d) = file.direct {
        let Some((a_start, span, skip)) = direct_span(start, len, bounce_len) else {
            return Err(Error::invalid(
                "file_offset",
                format!("{start}+{len}"),
                "the aligned read must fit the bounce buffer and i64::MAX",
            ));
        };
        match pread_full(d, bounce, span, a_start) {
            Ok(got) => {
                return Ok((skip, got.saturating_sub(skip).min(len)));
            }
            Err(Error::Os { source, .. }) if source.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(e),
        }
    }
    Ok((0, pread_full(file.buffered, bounce, len, start)?))
}

struct Shared {
    failed: AtomicBool,
    error: Mutex<Option<Error>>,
}

impl Shared {
    fn fail(&self, e: Error) {
        self.failed.store(true, Ordering::Relaxed);
        let mut g = self.error.lock().unwrap_or_else(|p| p.into_inner());
        g.get_or_insert(e);
    }
}

/// Run `per_chunk` for every chunk on `threads` threads (chunk `c` on thread `c % threads`),
/// each thread with its own engine; every slot is waited before an engine is released.
fn run<E: Engines>(
    engines: &E,
    cfg: &PosixConfig,
    len: usize,
    per_chunk: impl Fn(&mut E::Engine, usize, usize, usize) -> Result<()> + Sync,
) -> Result<()> {
    let bounce_len = cfg.bounce_len()?;
    let shared = Shared {
        failed: AtomicBool::new(false),
        error: Mutex::new(None),
    };
    let n_chunks = len.div_ceil(cfg.chunk);
    let threads = cfg.threads.min(n_chunks).max(1);
    let worker = |t: usize| {
        let mut eng = match engines.acquire(bounce_len, cfg.depth) {
            Ok(e) => e,
            Err(e) => return shared.fail(e),
        };
        let mut k = 0;
        let mut c = t;
        while !shared.failed.load(Ordering::Relaxed) {
            let Some((off, clen)) = chunk_range(c, cfg.chunk, len) else {
                break;
            };
            let slot = k % cfg.depth;
            if let Err(e) = eng
                .wait_slot(slot)
                .and_then(|()| per_chunk(&mut eng, slot, off, clen))
            {
                shared.fail(e);
                break;
            }
            k += 1;
            let Some(next) = c.checked_add(threads) else {
                break;
            };
            c = next;
        }
        let mut ok = true;
        for s in 0..cfg.depth {
            if let Err(e) = eng.wait_slot(s) {
                ok = false;
                shared.fail(e);
            }
        }
        if ok {
            engines.release(eng);
        } else {
            // A copy may still be running into or out of its buffers: leak them.
            std::mem::forget(eng);
        }
    };
    if threads == 1 {
        worker(0);
    } else {
        std::thread::scope(|s| {
            for t in 0..threads {
                let w = &worker;
                s.spawn(move || w(t));
            }
        });
    }
    if let Some(e) = shared
        .error
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take()
    {
        return Err(e);
    }
    Ok(())
}

/// Check a transfer of `len` bytes between the file at `file_offset` and device address `addr`
/// (argument `arg`): both ranges end within their address spaces (`off_t` for the file).
pub(crate) fn check_transfer(
    arg: &'static str,
    addr: u64,
    file_offset: u64,
    len: usize,
) -> Result<()> {
    super::check_file_range(file_offset, len)?;
    match addr.checked_add(len as u64) {
        Some(_) => Ok(()),
        None => Err(Error::invalid(
            arg,
            format!("{addr:#x}+{len}"),
            "the device range must not wrap the address space",
        )),
    }
}

/// Read `len` bytes at `file_offset` to device address `dst`; returns bytes read. The read is
/// limited to `file_size` (the file's size when it starts; `None` for a file whose size is not
/// known, read until `pread` says end of file), so it is short only at end of file and leaves
/// every device byte past the count unchanged.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a bad `cfg` or a range past `off_t` or the address space;
/// [`Error::Os`] from `pread`; [`Error::FileShrank`] when the file shrank below `file_size`
/// meanwhile; the engine's errors. Every copy started has finished when this returns.
///
/// # Safety
///
/// `dst..dst + len` must be device memory (of the engines' device) that is live, writable and not
/// accessed by anything else until this returns.
#[doc(alias = "pread")]
pub(crate) unsafe fn read_to_device<E: Engines>(
    engines: &E,
    cfg: &PosixConfig,
    file: &PosixFile<'_>,
    file_size: Option<u64>,
    file_offset: u64,
    dst: u64,
    len: usize,
) -> Result<usize> {
    check_transfer("dst", dst, file_offset, len)?;
    let cfg = &PosixConfig {
        threads: if file.direct.is_some() {
            cfg.direct_threads
        } else {
            cfg.threads
        },
        ..*cfg
    };
    let bounce_len = cfg.bounce_len()?;
    let want = super::clamp_read(file_offset, len, file_size);
    if want == 0 {
        return Ok(0);
    }
    let short_at = AtomicU64::new(u64::MAX);
    run(engines, cfg, want, |eng, slot, off, clen| {
        // check_transfer: these sums stay below i64::MAX and the address space's end.
        let start = file_offset + off as u64;
        let (skip, got) = read_chunk(file, eng.bounce(slot), bounce_len, start, clen)?;
        if got > 0 {
            eng.start_h2d(slot, skip, got, dst + off as u64)?;
        }
        if got < clen {
            short_at.fetch_min(start + got as u64, Ordering::Relaxed);
        }
        Ok(())
    })?;
    let short = short_at.load(Ordering::Relaxed);
    let got = if short == u64::MAX {
        want
    } else {
        usize::try_from(short.saturating_sub(file_offset)).map_or(want, |n| n.min(want))
    };
    match file_size {
        Some(_) => super::read_outcome("pread", file_offset, want, Ok(got)),
        None => Ok(got),
    }
}

/// Write `len` bytes from device address `src` to the file at `file_offset`; returns `len`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a bad `cfg` or a range past `off_t` or the address space;
/// [`Error::Os`] from `pwrite`; the engine's errors.
///
/// # Safety
///
/// `src..src + len` must be device memory (of the engines' device) that is live and not written
/// by anything else until this returns.
#[doc(alias = "pwrite")]
pub(crate) unsafe fn write_from_device<E: Engines>(
    engines: &E,
    cfg: &PosixConfig,
    file: &PosixFile<'_>,
    file_offset: u64,
    src: u64,
    len: usize,
) -> Result<usize> {
    check_transfer("src", src, file_offset, len)?;
    cfg.validate()?;
    if len == 0 {
        return Ok(0);
    }
    run(engines, cfg, len, |eng, slot, off, clen| {
        // check_transfer: these sums stay below i64::MAX and the address space's end.
        let start = file_offset + off as u64;
        eng.start_d2h(slot, 0, clen, src + off as u64)?;
        eng.wait_slot(slot)?;
        let buf = eng.bounce(slot);
        let aligned =
            start.is_multiple_of(DIRECT_ALIGN as u64) && clen.is_multiple_of(DIRECT_ALIGN);
        match file.direct {
            Some(d) if aligned => match pwrite_full(d, buf, clen, start) {
                Err(Error::Os { source, .. }) if source.raw_os_error() == Some(libc::EINVAL) => {
                    pwrite_full(file.buffered, buf, clen, start)
                }
                r => r,
            },
            _ => pwrite_full(file.buffered, buf, clen, start),
        }
    })?;
    Ok(len)
}

/// Engines on a CUDA device: a stream, `depth` pinned buffers (`cuMemHostAlloc`) and events per
/// engine, pooled per device for the life of the process.
pub(crate) struct GpuEngines {
    ordinal: usize,
    pool: Mutex<Vec<GpuEngine>>,
}

impl std::fmt::Debug for GpuEngines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuEngines")
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

impl GpuEngines {
    /// The process-wide engines of device `ordinal`.
    ///
    /// # Errors
    ///
    /// As [`crate::cuda::context`].
    pub(crate) fn for_device(ordinal: usize) -> Result<&'static GpuEngines> {
        static ALL: Mutex<Vec<&'static GpuEngines>> = Mutex::new(Vec::new());
        super::bind_device(ordinal)?;
        let mut all = ALL.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = all.iter().find(|e| e.ordinal == ordinal) {
            return Ok(e);
        }
        let e: &'static GpuEngines = Box::leak(Box::new(GpuEngines {
            ordinal,
            pool: Mutex::new(Vec::new()),
        }));
        all.push(e);
        Ok(e)
    }
}

/// One thread's engine on a CUDA device.
pub(crate) struct GpuEngine {
    stream: cu_sys::CUstream,
    events: Vec<cu_sys::CUevent>,
    bufs: Vec<*mut u8>,
    bounce_len: usize,
}

// SAFETY: the stream, events and pinned buffers are owned by the engine and used by one thread at
// a time (engines move between threads only through the pool).
unsafe impl Send for GpuEngine {}

impl GpuEngine {
    fn new(bounce_len: usize, depth: usize) -> Result<Self> {
        let mut e = GpuEngine {
            stream: std::ptr::null_mut(),
            events: Vec::new(),
            bufs: Vec::new(),
            bounce_len,
        };
        // SAFETY: valid out-pointers; the context is current (bind_device).
        unsafe {
            cu(
                "cuStreamCreate",
                cu_sys::cuStreamCreate(&mut e.stream, 1 /* CU_STREAM_NON_BLOCKING */),
            )?;
            for _ in 0..depth {
                let mut ev = std::ptr::null_mut();
                cu(
                    "cuEventCreate",
                    cu_sys::cuEventCreate(&mut ev, 2 /* CU_EVENT_DISABLE_TIMING */),
                )?;
                e.events.push(ev);
                let mut p = std::ptr::null_mut();
                cu(
                    "cuMemHostAlloc",
                    cu_sys::cuMemHostAlloc(&mut p, bounce_len, 1 /* PORTABLE */),
                )?;
                e.bufs.push(p.cast());
            }
        }
        Ok(e)
    }
}

impl Drop for GpuEngine {
    fn drop(&mut self) {
        // SAFETY: handles created in `new`; the stream is synchronized before anything it used
        // is freed; if that fails the buffers are leaked.
        unsafe {
            if !self.stream.is_null()
                && cu_sys::cuStreamSynchronize(self.stream) != cu_sys::CUresult::CUDA_SUCCESS
            {
                return;
            }
            for &ev in &self.events {
                cu_sys::cuEventDestroy_v2(ev);
            }
            for &b in &self.bufs {
                cu_sys::cuMemFreeHost(b.cast());
            }
            if !self.stream.is_null() {
                cu_sys::cuStreamDestroy_v2(self.stream);
            }
        }
    }
}

// SAFETY: `bufs[slot]` are pinned allocations of `bounce_len` bytes owned by the engine; a slot's
// event is recorded after its copy and `wait_slot` synchronizes on it.
unsafe impl CopyEngine for GpuEngine {
    fn bounce(&mut self, slot: usize) -> *mut u8 {
        self.bufs[slot]
    }
    fn start_h2d(&mut self, slot: usize, offset: usize, len: usize, dst: u64) -> Result<()> {
        check_range("offset", offset, len, self.bounce_len)?;
        // SAFETY: the source lies in our pinned buffer; the caller checked the device range;
        // the buffer is not touched until wait_slot(slot).
        unsafe {
            cu(
                "cuMemcpyHtoDAsync_v2",
                cu_sys::cuMemcpyHtoDAsync_v2(
                    dst,
                    self.bufs[slot].add(offset).cast(),
                    len,
                    self.stream,
                ),
            )?;
            cu(
                "cuEventRecord",
                cu_sys::cuEventRecord(self.events[slot], self.stream),
            )
        }
    }
    fn start_d2h(&mut self, slot: usize, offset: usize, len: usize, src: u64) -> Result<()> {
        check_range("offset", offset, len, self.bounce_len)?;
        // SAFETY: as start_h2d, the other way.
        unsafe {
            cu(
                "cuMemcpyDtoHAsync_v2",
                cu_sys::cuMemcpyDtoHAsync_v2(
                    self.bufs[slot].add(offset).cast(),
                    src,
                    len,
                    self.stream,
                ),
            )?;
            cu(
                "cuEventRecord",
                cu_sys::cuEventRecord(self.events[slot], self.stream),
            )
        }
    }
    fn wait_slot(&mut self, slot: usize) -> Result<()> {
        // SAFETY: a live event (never-recorded events complete at once).
        cu("cuEventSynchronize", unsafe {
            cu_sys::cuEventSynchronize(self.events[slot])
        })
    }
}

// SAFETY: pooled engines are released only after every slot was waited; new ones are idle.
unsafe impl Engines for GpuEngines {
    type Engine = GpuEngine;
    fn acquire(&self, bounce_len: usize, depth: usize) -> Result<GpuEngine> {
        super::bind_device(self.ordinal)?;
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = pool
            .iter()
            .position(|e| e.bounce_len == bounce_len && e.bufs.len() == depth)
        {
            return Ok(pool.swap_remove(i));
        }
        drop(pool);
        GpuEngine::new(bounce_len, depth)
    }
    fn release(&self, engine: GpuEngine) {
        self.pool
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(engine);
    }
}

/// Host-memory engines for tests and for checking the pipeline: "device addresses" are offsets
/// into one shared host buffer, and a copy runs when its slot is waited (so an engine that reused
/// a bounce buffer early would corrupt the data).
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct HostEngines {
    /// The stand-in device memory.
    pub device: Arc<Mutex<Vec<u8>>>,
    /// The most copies one engine had in flight at once (≥ 2 shows pipelining). Shared with the
    /// engines (not reached through a pointer back to `self`, which a move would leave dangling).
    pub max_in_flight: Arc<AtomicU64>,
    /// Engines created (pooling keeps this at the thread count).
    pub created: AtomicU64,
    pool: Mutex<Vec<HostEngine>>,
}

#[cfg(test)]
impl HostEngines {
    /// Engines over a stand-in device buffer of `len` bytes filled with `fill`.
    pub fn new(len: usize, fill: u8) -> Self {
        HostEngines {
            device: Arc::new(Mutex::new(vec![fill; len])),
            max_in_flight: Arc::new(AtomicU64::new(0)),
            created: AtomicU64::new(0),
            pool: Mutex::new(Vec::new()),
        }
    }
}

/// A host-memory engine (see [`HostEngines`]).
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct HostEngine {
    bufs: Vec<Vec<u8>>,
    pending: Vec<Option<(bool, usize, usize, u64)>>,
    device: Arc<Mutex<Vec<u8>>>,
    max_in_flight: Arc<AtomicU64>,
}

#[cfg(test)]
impl HostEngine {
    fn in_flight(&self) -> u64 {
        self.pending.iter().filter(|p| p.is_some()).count() as u64
    }
}

// SAFETY: `bounce` points into an owned buffer over-allocated by DIRECT_ALIGN (so
// `bounce_len` bytes remain after aligning) and refuses a slot with a copy pending; copies run
// in `wait_slot`.
#[cfg(test)]
unsafe impl CopyEngine for HostEngine {
    fn bounce(&mut self, slot: usize) -> *mut u8 {
        assert!(
            self.pending[slot].is_none(),
            "bounce buffer reused while in flight"
        );
        // Align like pinned memory would be.
        let p = self.bufs[slot].as_mut_ptr();
        // SAFETY: bufs are over-allocated by DIRECT_ALIGN.
        unsafe { p.add(p.align_offset(DIRECT_ALIGN)) }
    }
    fn start_h2d(&mut self, slot: usize, offset: usize, len: usize, dst: u64) -> Result<()> {
        self.pending[slot] = Some((true, offset, len, dst));
        let n = self.in_flight();
        self.max_in_flight.fetch_max(n, Ordering::Relaxed);
        Ok(())
    }
    fn start_d2h(&mut self, slot: usize, offset: usize, len: usize, src: u64) -> Result<()> {
        self.pending[slot] = Some((false, offset, len, src));
        Ok(())
    }
    fn wait_slot(&mut self, slot: usize) -> Result<()> {
        if let Some((h2d, offset, len, addr)) = self.pending[slot].take() {
            let p = self.bufs[slot].as_mut_ptr();
            let base = p.align_offset(DIRECT_ALIGN) + offset;
            let mut dev = self.device.lock().unwrap_or_else(|p| p.into_inner());
            let a = addr as usize;
            if h2d {
                dev[a..a + len].copy_from_slice(&self.bufs[slot][base..base + len]);
                // Poison the consumed buffer so that stale bytes are caught.
                self.bufs[slot].fill(0xA5);
            } else {
                self.bufs[slot][base..base + len].copy_from_slice(&dev[a..a + len]);
            }
        }
        Ok(())
    }
}

// SAFETY: engines are handed out with no copy pending and buffers of `bounce_len + DIRECT_ALIGN`.
#[cfg(test)]
unsafe impl Engines for HostEngines {
    type Engine = HostEngine;
    fn acquire(&self, bounce_len: usize, depth: usize) -> Result<HostEngine> {
        if let Some(e) = self.pool.lock().unwrap_or_else(|p| p.into_inner()).pop()
            && e.bufs.len() == depth
            && e.bufs[0].len() == bounce_len + DIRECT_ALIGN
        {
            return Ok(e);
        }
        self.created.fetch_add(1, Ordering::Relaxed);
        Ok(HostEngine {
            bufs: (0..depth)
                .map(|_| vec![0; bounce_len + DIRECT_ALIGN])
                .collect(),
            pending: vec![None; depth],
            device: self.device.clone(),
            max_in_flight: self.max_in_flight.clone(),
        })
    }
    fn release(&self, engine: HostEngine) {
        self.pool
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(engine);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::{DirectIo, OpenOptions};
    use std::os::fd::AsFd;

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

    fn read_case(
        file_bytes: &[u8],
        cfg: PosixConfig,
        direct: DirectIo,
        fo: u64,
        dst_off: usize,
        len: usize,
    ) {
        let p = temp(
            &format!("r{}-{}-{}-{fo}-{len}", cfg.threads, cfg.chunk, cfg.depth),
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
        let engines = HostEngines::new(dst_off + len + 16, 0xEE);
        let file = PosixFile {
            buffered: buf.as_fd(),
            direct: dfd.as_ref().map(|d| d.as_fd()),
        };
        // SAFETY: host engines: "device addresses" are offsets into `engines.device`, which
        // covers `dst_off + len`.
        let n = unsafe {
            read_to_device(
                &engines,
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
        let dev = engines.device.lock().unwrap();
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
        if expect_n.div_ceil(cfg.chunk) > cfg.threads && cfg.depth >= 2 {
            assert!(
                engines.max_in_flight.load(Ordering::Relaxed) >= 2,
                "copies overlap reads: {cfg:?}"
            );
        }
        assert!(engines.created.load(Ordering::Relaxed) <= cfg.threads as u64);
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
            let cfg = PosixConfig {
                threads,
                chunk,
                depth,
                direct_threads: threads,
            };
            for direct in [DirectIo::Off, DirectIo::Try] {
                // Unaligned: 4097 bytes at file offset 3 into device offset 1.
                read_case(&bytes, cfg, direct, 3, 1, 4097);
                read_case(&bytes, cfg, direct, 0, 0, 300_000);
                read_case(&bytes, cfg, direct, 4095, 7, 123_457);
                // Crossing end of file: the short count.
                read_case(&bytes, cfg, direct, 290_001, 0, 20_000);
                read_case(&bytes, cfg, direct, 400_000, 0, 10);
            }
        }
    }

    #[test]
    fn pipelining_keeps_several_copies_in_flight() {
        let bytes = data(1 << 20, 3);
        let cfg = PosixConfig {
            threads: 2,
            chunk: 16384,
            depth: 3,
            direct_threads: 2,
        };
        read_case(&bytes, cfg, DirectIo::Off, 0, 0, 1 << 20);
    }

    #[test]
    fn chunked_writes_are_exact() {
        let src = data(200_003, 11);
        for &(threads, chunk, depth) in &[(1, 4096, 1), (3, 8192, 2), (8, 4096, 3)] {
            let cfg = PosixConfig {
                threads,
                chunk,
                depth,
                direct_threads: threads,
            };
            let p = temp(&format!("w{threads}-{chunk}"), &[]);
            let (buf, _) = OpenOptions::read_write()
                .direct(DirectIo::Off)
                .open(&p)
                .unwrap();
            let (dfd, is_direct) = OpenOptions::read_write().open(&p).unwrap();
            let engines = HostEngines::new(src.len(), 0);
            engines.device.lock().unwrap().copy_from_slice(&src);
            let file = PosixFile {
                buffered: buf.as_fd(),
                direct: is_direct.then(|| dfd.as_fd()),
            };
            // SAFETY: host engines; `engines.device` covers `1..200_001`.
            let n = unsafe { write_from_device(&engines, &cfg, &file, 5, 1, 200_000) }.unwrap();
            assert_eq!(n, 200_000);
            let back = std::fs::read(&p).unwrap();
            assert_eq!(back.len(), 200_005);
            assert_eq!(&back[5..], &src[1..200_001]);
            std::fs::remove_file(&p).unwrap();
        }
    }

    #[test]
    fn host_engine_stats_survive_moving_the_engines() {
        // An engine used to reach its HostEngines through a raw pointer taken at `acquire`:
        // moving the HostEngines afterwards left it dangling.
        let engines = HostEngines::new(64, 0);
        let mut eng = engines.acquire(DIRECT_ALIGN, 2).unwrap();
        let moved = Box::new(engines);
        eng.start_h2d(0, 0, 8, 0).unwrap();
        eng.start_h2d(1, 0, 8, 8).unwrap();
        assert_eq!(moved.max_in_flight.load(Ordering::Relaxed), 2);
        eng.wait_slot(0).unwrap();
        eng.wait_slot(1).unwrap();
        moved.release(eng);
    }

    #[test]
    fn a_read_crossing_the_end_of_file_changes_nothing_past_the_count() {
        // A file of 22,295 bytes; 8,192 bytes at 18,295 into device offset 100: 4,000 bytes,
        // and the poison after them intact (checked by read_case).
        let bytes = data(22_295, 12);
        let cfg = PosixConfig {
            threads: 2,
            chunk: 4096,
            depth: 2,
            direct_threads: 2,
        };
        for direct in [DirectIo::Off, DirectIo::Try] {
            read_case(&bytes, cfg, direct, 18_295, 100, 8192);
            read_case(&bytes, cfg, direct, 22_295, 100, 8192);
            read_case(&bytes, cfg, direct, 30_000, 100, 8192);
        }
    }

    #[test]
    fn a_file_that_shrank_is_an_error_and_nothing_past_the_limit_changes() {
        let bytes = data(10_000, 5);
        let p = temp("shrank", &bytes);
        let (fd, _) = OpenOptions::read_only()
            .direct(DirectIo::Off)
            .open(&p)
            .unwrap();
        let file = PosixFile {
            buffered: fd.as_fd(),
            direct: None,
        };
        let engines = HostEngines::new(40_000, 0xEE);
        let cfg = PosixConfig {
            threads: 1,
            chunk: 4096,
            depth: 2,
            direct_threads: 1,
        };
        // The size taken when the read started (20,000) is larger than what is there now.
        // SAFETY: host engines over 40,000 bytes.
        let e = unsafe { read_to_device(&engines, &cfg, &file, Some(20_000), 0, 0, 30_000) }
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
        let dev = engines.device.lock().unwrap();
        assert_eq!(&dev[..10_000], &bytes[..]);
        assert!(dev[20_000..].iter().all(|&b| b == 0xEE));
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn the_wrapping_chunk_is_refused_before_any_buffer_exists() {
        let cfg = PosixConfig {
            chunk: usize::MAX - 4095,
            ..PosixConfig::default()
        };
        let e = cfg.validate().unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidArgument {
                    arg: "config.chunk",
                    ..
                }
            ),
            "{e}"
        );
        assert!(cfg.bounce_len().is_err());
        let engines = HostEngines::new(1 << 16, 0);
        let p = temp("wrap", &[3; 1 << 16]);
        let (fd, _) = OpenOptions::read_only()
            .direct(DirectIo::Off)
            .open(&p)
            .unwrap();
        let file = PosixFile {
            buffered: fd.as_fd(),
            direct: None,
        };
        // SAFETY: host engines over 64 KiB.
        let e = unsafe { read_to_device(&engines, &cfg, &file, Some(1 << 16), 0, 0, 1 << 16) }
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidArgument {
                    arg: "config.chunk",
                    ..
                }
            ),
            "{e}"
        );
        // SAFETY: as above.
        let e = unsafe { write_from_device(&engines, &cfg, &file, 0, 0, 1 << 16) }.unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidArgument {
                    arg: "config.chunk",
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(engines.created.load(Ordering::Relaxed), 0);
        // A chunk larger than its bounce buffer is refused by the reader itself.
        let mut buf = vec![0u8; 2 * DIRECT_ALIGN];
        let e = read_chunk(&file, buf.as_mut_ptr(), DIRECT_ALIGN, 0, DIRECT_ALIGN + 1).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "len", .. }),
            "{e}"
        );
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn transfers_past_off_t_or_the_address_space_are_refused() {
        let engines = HostEngines::new(16, 0);
        let p = temp("range", &[1; 16]);
        let (fd, _) = OpenOptions::read_only()
            .direct(DirectIo::Off)
            .open(&p)
            .unwrap();
        let file = PosixFile {
            buffered: fd.as_fd(),
            direct: None,
        };
        let cfg = PosixConfig::default();
        // SAFETY: refused before any access.
        let e = unsafe { read_to_device(&engines, &cfg, &file, None, i64::MAX as u64, 0, 2) }
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidArgument {
                    arg: "file_offset",
                    ..
                }
            ),
            "{e}"
        );
        // SAFETY: refused before any access.
        let e =
            unsafe { read_to_device(&engines, &cfg, &file, None, 0, u64::MAX - 1, 4) }.unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "dst", .. }),
            "{e}"
        );
        // SAFETY: refused before any access.
        let e = unsafe { write_from_device(&engines, &cfg, &file, u64::MAX, 0, 1) }.unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidArgument {
                    arg: "file_offset",
                    ..
                }
            ),
            "{e}"
        );
        std::fs::remove_file(&p).unwrap();
    }

    fn config() -> impl Strategy<Value = PosixConfig> {
        let size = || prop_oneof![any::<usize>(), 0usize..300, Just(usize::MAX)];
        let chunk = prop_oneof![
            any::<usize>(),
            (0usize..=(MAX_CHUNK / DIRECT_ALIGN + 2)).prop_map(|k| k * DIRECT_ALIGN),
            Just(usize::MAX - 4095),
        ];
        (size(), chunk, size(), size()).prop_map(|(threads, chunk, depth, direct_threads)| {
            PosixConfig {
                threads,
                chunk,
                depth,
                direct_threads,
            }
        })
    }

    use proptest::prelude::*;

    proptest! {
        #[test]
        fn configs_are_bounded(cfg in config()) {
            let bounce = cfg.chunk as u128 + 2 * DIRECT_ALIGN as u128;
            let pinned = bounce
                .checked_mul(cfg.depth as u128)
                .and_then(|b| b.checked_mul(cfg.threads.max(cfg.direct_threads) as u128))
                .unwrap_or(u128::MAX);
            let ok = (1..=MAX_THREADS).contains(&cfg.threads)
                && (1..=MAX_THREADS).contains(&cfg.direct_threads)
                && (1..=MAX_DEPTH).contains(&cfg.depth)
                && cfg.chunk > 0
                && cfg.chunk <= MAX_CHUNK
                && cfg.chunk % DIRECT_ALIGN == 0
                && pinned <= MAX_PINNED_BYTES as u128;
            prop_assert_eq!(cfg.validate().is_ok(), ok);
            match cfg.bounce_len() {
                Ok(b) => prop_assert!(ok && b as u128 == bounce && b > cfg.chunk),
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
        let engines = HostEngines::new(10, 0);
        let p = temp("cfg", &[1; 10]);
        let (fd, _) = OpenOptions::read_only()
            .direct(DirectIo::Off)
            .open(&p)
            .unwrap();
        let file = PosixFile {
            buffered: fd.as_fd(),
            direct: None,
        };
        let cfg = PosixConfig {
            threads: 1,
            chunk: 1000,
            depth: 1,
            direct_threads: 1,
        };
        // SAFETY: host engines over 10 bytes.
        let e = unsafe { read_to_device(&engines, &cfg, &file, Some(10), 0, 0, 10) }.unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidArgument {
                    arg: "config.chunk",
                    ..
                }
            ),
            "{e}"
        );
        std::fs::remove_file(&p).unwrap();
    }
}
