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

impl PosixConfig {
    fn validate(&self) -> Result<()> {
        if self.threads == 0 || self.depth == 0 || self.direct_threads == 0 {
            return Err(Error::invalid(
                "config",
                format!("{self:?}"),
                "threads and depth must be at least 1",
            ));
        }
        if self.chunk == 0 || !self.chunk.is_multiple_of(DIRECT_ALIGN) {
            return Err(Error::invalid(
                "config.chunk",
                self.chunk,
                format!("must be a non-zero multiple of {DIRECT_ALIGN}"),
            ));
        }
        Ok(())
    }

    /// Bytes of each bounce buffer: a chunk plus room to align both ends for `O_DIRECT`.
    pub fn bounce_len(&self) -> usize {
        self.chunk + 2 * DIRECT_ALIGN
    }
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

fn pread_full(fd: BorrowedFd<'_>, buf: *mut u8, len: usize, offset: u64) -> Result<usize> {
    let mut done = 0;
    while done < len {
        // SAFETY: `buf..buf+len` is a bounce buffer owned by this thread's engine.
        let r = unsafe {
            libc::pread(
                fd.as_raw_fd(),
                buf.add(done).cast(),
                len - done,
                (offset + done as u64) as libc::off_t,
            )
        };
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
        done += r as usize;
    }
    Ok(done)
}

fn pwrite_full(fd: BorrowedFd<'_>, buf: *const u8, len: usize, offset: u64) -> Result<()> {
    let mut done = 0;
    while done < len {
        // SAFETY: `buf..buf+len` is a bounce buffer the finished copy filled.
        let r = unsafe {
            libc::pwrite(
                fd.as_raw_fd(),
                buf.add(done).cast(),
                len - done,
                (offset + done as u64) as libc::off_t,
            )
        };
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
        done += r as usize;
    }
    Ok(())
}

/// Read `start..start+len` of the file into `bounce`, through `O_DIRECT` (aligned around the
/// range) when possible; returns (offset of the data in `bounce`, bytes available).
fn read_chunk(
    file: &PosixFile<'_>,
    bounce: *mut u8,
    start: u64,
    len: usize,
) -> Result<(usize, usize)> {
    if let Some(d) = file.direct {
        let a = DIRECT_ALIGN as u64;
        let a_start = start / a * a;
        let a_end = (start + len as u64).div_ceil(a) * a;
        match pread_full(d, bounce, (a_end - a_start) as usize, a_start) {
            Ok(got) => {
                let skip = (start - a_start) as usize;
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
    cfg.validate()?;
    let shared = Shared {
        failed: AtomicBool::new(false),
        error: Mutex::new(None),
    };
    let n_chunks = len.div_ceil(cfg.chunk);
    let threads = cfg.threads.min(n_chunks).max(1);
    let worker = |t: usize| {
        let mut eng = match engines.acquire(cfg.bounce_len(), cfg.depth) {
            Ok(e) => e,
            Err(e) => return shared.fail(e),
        };
        let mut k = 0;
        let mut c = t;
        while c < n_chunks && !shared.failed.load(Ordering::Relaxed) {
            let slot = k % cfg.depth;
            let off = c * cfg.chunk;
            let clen = cfg.chunk.min(len - off);
            if let Err(e) = eng
                .wait_slot(slot)
                .and_then(|()| per_chunk(&mut eng, slot, off, clen))
            {
                shared.fail(e);
                break;
            }
            k += 1;
            c += threads;
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

/// Read `len` bytes at `file_offset` to device address `dst`; returns bytes read (short only at
/// end of file, as of `file_len` or a file shrinking meanwhile).
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a bad `cfg`; [`Error::Os`] from `pread`; the engine's errors.
/// Every copy started has finished when this returns.
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
    file_len: u64,
    file_offset: u64,
    dst: u64,
    len: usize,
) -> Result<usize> {
    let len = (len as u64).min(file_len.saturating_sub(file_offset)) as usize;
    if len == 0 {
        return Ok(0);
    }
    let short_at = AtomicU64::new(u64::MAX);
    let cfg = &PosixConfig {
        threads: if file.direct.is_some() {
            cfg.direct_threads
        } else {
            cfg.threads
        },
        ..*cfg
    };
    run(engines, cfg, len, |eng, slot, off, clen| {
        let start = file_offset + off as u64;
        let (skip, got) = read_chunk(file, eng.bounce(slot), start, clen)?;
        if got > 0 {
            eng.start_h2d(slot, skip, got, dst + off as u64)?;
        }
        if got < clen {
            short_at.fetch_min(start + got as u64, Ordering::Relaxed);
        }
        Ok(())
    })?;
    let short = short_at.load(Ordering::Relaxed);
    Ok(if short == u64::MAX {
        len
    } else {
        (short.saturating_sub(file_offset) as usize).min(len)
    })
}

/// Write `len` bytes from device address `src` to the file at `file_offset`; returns `len`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a bad `cfg`; [`Error::Os`] from `pwrite`; the engine's errors.
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
    if len == 0 {
        return Ok(0);
    }
    run(engines, cfg, len, |eng, slot, off, clen| {
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
        debug_assert!(offset + len <= self.bounce_len);
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
        debug_assert!(offset + len <= self.bounce_len);
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
                file_bytes.len() as u64,
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
                // A11: 4097 bytes at file offset 3 into device offset 1.
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
        let e = unsafe { read_to_device(&engines, &cfg, &file, 10, 0, 0, 10) }.unwrap_err();
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
