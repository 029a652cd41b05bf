//! One transfer on the POSIX path: its threads claim chunks in file order, read or write them
//! through bounce buffers, and keep their copies in flight ([`read_to_device`],
//! [`write_from_device`]).

use super::config::PosixConfig;
use super::plan::{Plan, ramp_from_env};
use super::stage::Staging;
use super::sys::{Fds, PosixFile, read_chunk, write_chunk};
use super::workers::{Job, Workers};
use crate::error::{Error, Result};
use crate::storage::range::{check_file_range, clamp_read, read_outcome};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

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

/// What a read or a write moves: `len` bytes between the file at `file_offset` (through `file`'s
/// descriptors) and device address `addr` (a read's destination, a write's source), cut and
/// overlapped as `cfg` says.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Request<'a> {
    pub(crate) cfg: &'a PosixConfig,
    pub(crate) file: &'a PosixFile<'a>,
    pub(crate) file_offset: u64,
    pub(crate) addr: u64,
    pub(crate) len: usize,
}

/// Run one transfer of `req` cut as `plan` says (its length too, which replaces `req.len`) on
/// `threads` threads (fewer when it has fewer chunks).
fn run<S: Staging>(
    staging: S,
    read: bool,
    req: &Request<'_>,
    plan: Plan,
    threads: usize,
) -> Result<Arc<Transfer<S>>> {
    let n_chunks = plan.chunks();
    let t = Arc::new(Transfer {
        staging,
        read,
        fds: Fds::of(req.file),
        file_offset: req.file_offset,
        addr: req.addr,
        plan,
        bounce_len: req.cfg.bounce_len()?,
        depth: req.cfg.depth,
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

/// Read `req.len` bytes at `req.file_offset` to device address `req.addr`; returns bytes read.
/// The read is limited to `file_size` (the file's size when it starts; `None` for a file whose size is not
/// known, read until `pread` says end of file), so it is short only at end of file and leaves
/// every device byte past the count unchanged. `staging(bounce_len)` makes the staging once the
/// arguments are checked and there is something to read.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a bad `req.cfg` or a range past `off_t` or the address space
/// (naming `dst`); [`Error::Os`] from `pread`; [`Error::FileShrank`] when the file shrank below `file_size`
/// meanwhile; the staging's errors. Every copy started has finished when this returns.
///
/// # Safety
///
/// `req.addr..req.addr + req.len` must be device memory (of the staging's device) that is live,
/// writable and not accessed by anything else until this returns; the descriptors stay open
/// until then.
#[doc(alias = "pread")]
pub(crate) unsafe fn read_to_device<S: Staging>(
    staging: impl FnOnce(usize) -> Result<S>,
    req: Request<'_>,
    file_size: Option<u64>,
) -> Result<usize> {
    let ramp = ramp_from_env()?;
    // SAFETY: the caller's.
    unsafe { read_planned(ramp, staging, req, file_size) }
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
unsafe fn read_planned<S: Staging>(
    ramp: bool,
    staging: impl FnOnce(usize) -> Result<S>,
    req: Request<'_>,
    file_size: Option<u64>,
) -> Result<usize> {
    let Request {
        cfg,
        file,
        file_offset,
        addr: dst,
        len,
    } = req;
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
    let t = run(staging(bounce_len)?, true, &req, plan, threads)?;
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

/// Write `req.len` bytes from device address `req.addr` to the file at `req.file_offset`;
/// returns `req.len`. Chunks go through `req.file.direct` (`O_DIRECT`, on `direct_threads` threads) where it is given
/// and the chunk is aligned, through the buffered descriptor otherwise (on `write_threads`
/// threads when no `O_DIRECT` descriptor is given).
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a bad `req.cfg` or a range past `off_t` or the address space
/// (naming `src`); [`Error::Os`] from `pwrite`; the staging's errors. Every copy started has finished when this
/// returns.
///
/// # Safety
///
/// `req.addr..req.addr + req.len` must be device memory (of the staging's device) that is live
/// and not written by anything else until this returns; the descriptors stay open until then.
#[doc(alias = "pwrite")]
pub(crate) unsafe fn write_from_device<S: Staging>(
    staging: impl FnOnce(usize) -> Result<S>,
    req: Request<'_>,
) -> Result<usize> {
    let Request {
        cfg,
        file,
        file_offset,
        addr: src,
        len,
    } = req;
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
        &req,
        Plan::flat(cfg.chunk, len),
        threads,
    )?;
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::posix::config::PosixConfig;
    use crate::storage::posix::sys::{DIRECT_ALIGN, Io, io_full};
    use crate::storage::posix::testing::{HostStaging, assert_invalid};
    use crate::storage::{DirectIo, OpenOptions};
    use std::os::fd::{AsFd, AsRawFd};
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

    /// The request for `len` bytes between `file` at `file_offset` and stand-in address `addr`.
    fn req<'a>(
        cfg: &'a PosixConfig,
        file: &'a PosixFile<'a>,
        file_offset: u64,
        addr: u64,
        len: usize,
    ) -> Request<'a> {
        Request {
            cfg,
            file,
            file_offset,
            addr,
            len,
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
                req(&cfg, &file, fo, dst_off as u64, len),
                Some(file_bytes.len() as u64),
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
                req(&cfg(1, 16384, 3), &file, 0, 0, 1 << 20),
                Some(1 << 20),
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
                req(&cfg(threads, chunk, 2), &file, 0, 0, len),
                Some(len as u64),
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
                        write_from_device(|b| staging.with_bounce(b), req(&cfg, &file, fo, so, n))
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
                    req(&cfg(threads, 4096, 2), &file, 0, 0, 30_000),
                    Some(20_000),
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
                req(&cfg(4, 4096, 3), &file, 0, 0, 1 << 20),
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
        let e = unsafe { read_to_device(never, req(&bad, &file, 0, 0, 1 << 16), Some(1 << 16)) }
            .unwrap_err();
        assert_invalid(&e, "config.chunk");
        // SAFETY: as above.
        let e = unsafe { write_from_device(never, req(&bad, &file, 0, 0, 1 << 16)) }.unwrap_err();
        assert_invalid(&e, "config.chunk");
        // Nothing to read at end of file: no staging either.
        // SAFETY: nothing is accessed.
        let n = unsafe {
            read_to_device(
                never,
                req(&cfg(1, 4096, 1), &file, 1 << 16, 0, 10),
                Some(1 << 16),
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
        let e = unsafe { read_to_device(never, req(&c, &file, i64::MAX as u64, 0, 2), None) }
            .unwrap_err();
        assert_invalid(&e, "file_offset");
        // SAFETY: refused before any access.
        let e =
            unsafe { read_to_device(never, req(&c, &file, 0, u64::MAX - 1, 4), None) }.unwrap_err();
        assert_invalid(&e, "dst");
        // SAFETY: refused before any access.
        let e = unsafe { write_from_device(never, req(&c, &file, u64::MAX, 0, 1)) }.unwrap_err();
        assert_invalid(&e, "file_offset");
        std::fs::remove_file(&p).unwrap();
    }

    use proptest::prelude::*;

    proptest! {
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
        let e = unsafe { read_to_device(never, req(&cfg(1, 1000, 1), &file, 0, 0, 10), Some(10)) }
            .unwrap_err();
        assert_invalid(&e, "config.chunk");
        std::fs::remove_file(&p).unwrap();
    }
}
