//! The automatic path: cuFile where it helps, our own POSIX path where cuFile is missing, cannot
//! register the file, or would be slower; every transfer says which path ran and why.

use super::driver::Driver;
use super::file::{DirectIo, FileHandle, OpenOptions, fd_len};
use super::posix::{self, GpuStaging, PosixConfig, PosixFile, Request};
use super::range::{OFF_MAX, check_io, file_size};
use crate::error::{Error, Result};
use crate::memory::{DeviceMemory, DeviceMemoryMut};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

/// Which path a [`GdsFile`] may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Choose per transfer (like KvikIO's compatibility mode AUTO): cuFile with nvidia-fs on
    /// page-cache-cold data; otherwise the POSIX path.
    #[default]
    Auto,
    /// cuFile only: opening fails if the driver or the registration does.
    CuFile,
    /// The POSIX path only; cuFile is not touched.
    Posix,
}

/// A data path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IoPath {
    /// `cuFileRead`/`cuFileWrite` (GDS, or cuFile's own compatibility mode).
    CuFile,
    /// Our POSIX path: threads, pinned bounce buffers, pipelined copies.
    Posix,
}

/// Why a path was taken.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PathReason {
    /// The [`Mode`] asked for it.
    Requested,
    /// cuFile could not be opened (the library or the driver is missing); the error, rendered.
    CufileUnavailable(String),
    /// `cuFileHandleRegister` refused the file (5027 without udev data, tmpfs, an unsupported
    /// file system).
    RegistrationFailed {
        /// The cuFile code (0 for a non-cuFile error).
        code: u32,
        /// The error, rendered.
        detail: String,
    },
    /// cuFile runs in compatibility mode (no nvidia-fs): its single-threaded POSIX I/O is slower
    /// than ours.
    CompatModeSlower,
    /// The range is in the page cache: buffered reads beat direct I/O.
    PageCacheHot,
    /// nvidia-fs is loaded and the data is not cached: true GPUDirect.
    GdsDirect,
}

/// The path that ran and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathTaken {
    /// The path.
    pub path: IoPath,
    /// Why.
    pub reason: PathReason,
    /// Whether the file was accessed with `O_DIRECT`.
    pub direct: bool,
}

/// A finished transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    /// Bytes moved (fewer than asked only at end of file for reads).
    pub bytes: usize,
    /// The path that ran and why.
    pub path: PathTaken,
}

/// When a write's data is safe from a crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// A write returns once its data is in the page cache (or, for cuFile with nvidia-fs, on
    /// the device): a crash or power loss before the kernel writes it back may lose it. Call
    /// [`GdsFile::sync_data`] (`fdatasync`) to make it durable. The fastest for data read back
    /// soon (a checkpoint that stays in memory).
    #[default]
    Cached,
    /// A write returns once its data, and the metadata needed to read it back (the file size),
    /// are on the device: the POSIX path writes aligned chunks with `O_DIRECT` (on
    /// [`PosixConfig::direct_threads`] threads; unaligned ends through the page cache) and every
    /// path ends with `fdatasync`. The fastest way to durable data: buffered writes followed by
    /// `fdatasync` copy every byte twice.
    Durable,
}

/// A file for the automatic path: a buffered descriptor, an `O_DIRECT` one where the file system
/// allows it, and a cuFile registration where cuFile works.
#[derive(Debug)]
pub struct GdsFile {
    buffered: OwnedFd,
    direct: Option<OwnedFd>,
    cufile: Option<FileHandle>,
    /// Why cuFile is not used, or `None` when it is registered.
    no_cufile: Option<PathReason>,
    gds: bool,
    mode: Mode,
    /// The POSIX path's configuration, when set; `None`: [`PosixConfig::automatic`] per transfer.
    posix: Option<PosixConfig>,
    durability: Durability,
}

impl GdsFile {
    /// Open `path` for `mode`. `options.direct` governs the `O_DIRECT` descriptor ([`DirectIo::Try`]
    /// falls back to buffered only where refused).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] from `open`; in [`Mode::CuFile`], the driver's or the registration's error.
    /// In [`Mode::Auto`] cuFile errors are not errors: they are recorded and reported as the
    /// reason of each transfer ([`PathTaken`]).
    pub fn open(
        path: impl AsRef<std::path::Path>,
        options: &OpenOptions,
        mode: Mode,
    ) -> Result<GdsFile> {
        let path = path.as_ref();
        let (buffered, _) = options.direct(DirectIo::Off).open(path)?;
        let direct = match options.direct {
            DirectIo::Off => None,
            DirectIo::Require => Some(options.open(path)?.0),
            DirectIo::Try => match options.truncate(false).open(path)? {
                (fd, true) => Some(fd),
                (_, false) => None,
            },
        };
        let mut f = GdsFile {
            buffered,
            direct,
            cufile: None,
            no_cufile: Some(PathReason::Requested),
            gds: false,
            mode,
            posix: None,
            durability: Durability::Cached,
        };
        if mode == Mode::Posix {
            return Ok(f);
        }
        let driver = match Driver::open() {
            Ok(d) => d,
            Err(e) if mode == Mode::Auto => {
                f.no_cufile = Some(PathReason::CufileUnavailable(e.to_string()));
                return Ok(f);
            }
            Err(e) => return Err(e),
        };
        f.gds = driver
            .properties()
            .map(|p| p.has_nvidia_fs())
            .unwrap_or(false);
        let fd = f
            .direct
            .as_ref()
            .unwrap_or(&f.buffered)
            .try_clone()
            .map_err(|e| Error::Os {
                call: "dup",
                source: e,
            })?;
        match FileHandle::from_fd(&driver, fd) {
            Ok(h) => {
                f.cufile = Some(h);
                f.no_cufile = None;
            }
            Err(e) if mode == Mode::Auto => {
                let code = match &e {
                    Error::CuFile { code, .. } => *code,
                    _ => 0,
                };
                f.no_cufile = Some(PathReason::RegistrationFailed {
                    code,
                    detail: e.to_string(),
                });
            }
            Err(e) => return Err(e),
        }
        Ok(f)
    }

    /// Set how the POSIX path splits and overlaps this file's transfers; `None` (the default):
    /// [`PosixConfig::automatic`] for each transfer (from the node's cores, the transfer's size
    /// and the environment's overrides).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] from [`PosixConfig::validate`]; the configuration in use is
    /// then kept.
    pub fn set_posix_config(&mut self, cfg: Option<PosixConfig>) -> Result<()> {
        if let Some(c) = &cfg {
            c.validate()?;
        }
        self.posix = cfg;
        Ok(())
    }

    /// The POSIX path's configuration for a transfer of `len` bytes: the one set with
    /// [`set_posix_config`](Self::set_posix_config), else [`PosixConfig::automatic`].
    ///
    /// # Errors
    ///
    /// As [`PosixConfig::automatic`] (an environment override that is not a whole number or
    /// breaks a bound).
    pub fn posix_config(&self, len: usize) -> Result<PosixConfig> {
        match self.posix {
            Some(c) => Ok(c),
            None => PosixConfig::automatic(len),
        }
    }

    /// Set when writes return ([`Durability`]; [`Durability::Cached`] by default).
    pub fn set_durability(&mut self, durability: Durability) {
        self.durability = durability;
    }

    /// When writes return.
    pub fn durability(&self) -> Durability {
        self.durability
    }

    /// `fdatasync(fd)`—Make the data written so far, and the metadata needed to read it back,
    /// durable on the device.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] from `fdatasync`.
    #[doc(alias = "fdatasync")]
    pub fn sync_data(&self) -> Result<()> {
        // SAFETY: a valid descriptor.
        if unsafe { libc::fdatasync(self.buffered.as_raw_fd()) } != 0 {
            return Err(Error::last_os("fdatasync"));
        }
        Ok(())
    }

    /// The cuFile registration, when there is one.
    pub fn cufile_handle(&self) -> Option<&FileHandle> {
        self.cufile.as_ref()
    }

    /// Whether an `O_DIRECT` descriptor is open.
    pub fn has_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// Why cuFile is not available to this file, or `None` when it is.
    pub fn cufile_unavailable(&self) -> Option<&PathReason> {
        self.no_cufile.as_ref()
    }

    /// The file's size in bytes.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] from `fstat`.
    pub fn len(&self) -> Result<u64> {
        fd_len(self.buffered.as_fd())
    }

    /// Whether the file is empty.
    ///
    /// # Errors
    ///
    /// As [`len`](Self::len).
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// The path a read of `file_offset..+len` would take now, and why.
    pub fn path_for_read(&self, file_offset: u64, len: usize) -> PathTaken {
        let hot = || page_cache_fraction(&self.buffered, file_offset, len) >= 0.5;
        match (self.mode, &self.cufile) {
            (Mode::CuFile, Some(h)) => PathTaken {
                path: IoPath::CuFile,
                reason: PathReason::Requested,
                direct: h.is_direct(),
            },
            (Mode::Auto, Some(h)) if self.gds => {
                if hot() {
                    self.posix_taken(PathReason::PageCacheHot, false)
                } else {
                    PathTaken {
                        path: IoPath::CuFile,
                        reason: PathReason::GdsDirect,
                        direct: h.is_direct(),
                    }
                }
            }
            (Mode::Auto, Some(_)) => {
                let direct = self.direct.is_some() && !hot();
                self.posix_taken(PathReason::CompatModeSlower, direct)
            }
            (_, _) => {
                let direct = self.direct.is_some() && !hot();
                let reason = self.no_cufile.clone().unwrap_or(PathReason::Requested);
                self.posix_taken(reason, direct)
            }
        }
    }

    fn posix_taken(&self, reason: PathReason, direct: bool) -> PathTaken {
        PathTaken {
            path: IoPath::Posix,
            reason,
            direct,
        }
    }

    fn posix_file(&self, direct: bool) -> PosixFile<'_> {
        PosixFile {
            buffered: self.buffered.as_fd(),
            direct: if direct {
                self.direct.as_ref().map(|d| d.as_fd())
            } else {
                None
            },
        }
    }

    /// Read `len` bytes at `file_offset` into `dst` at byte `dst_offset`, blocking, by the path
    /// [`path_for_read`](Self::path_for_read) picks. Returns the bytes read and the path taken.
    /// Device work writing `dst` must be complete.
    ///
    /// Whichever path runs, the result is the same: the read is limited to the file's size when
    /// it starts, so it is short only at end of file and every byte of `dst` past the count is
    /// left unchanged.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for ranges outside `dst` or `off_t`;
    /// [`Error::FileShrank`] when the file shrank during the read; the path's I/O or CUDA error.
    #[doc(alias = "cuFileRead")]
    #[doc(alias = "pread")]
    pub fn read_to_device<M: DeviceMemoryMut>(
        &self,
        dst: &mut M,
        dst_offset: usize,
        file_offset: u64,
        len: usize,
    ) -> Result<Transfer> {
        check_io("dst_offset", dst_offset, file_offset, len, dst.byte_len())?;
        let path = self.path_for_read(file_offset, len);
        let bytes = match (path.path, &self.cufile) {
            (IoPath::CuFile, Some(h)) => h.read(dst, dst_offset, file_offset, len)?,
            _ => {
                let cfg = self.posix_config(len)?;
                let ordinal = dst.ordinal();
                // SAFETY: `check_io` put `dst_offset..+len` inside `dst`, live device memory of
                // that ordinal (so the address sum does not wrap), borrowed mutably (so nothing
                // else touches it) until this returns, as are the descriptors.
                unsafe {
                    posix::read_to_device(
                        |b| GpuStaging::for_device(ordinal, b),
                        Request {
                            cfg: &cfg,
                            file: &self.posix_file(path.direct),
                            file_offset,
                            addr: dst.device_ptr().wrapping_add(dst_offset as u64),
                            len,
                        },
                        file_size(self.buffered.as_fd())?,
                    )
                }?
            }
        };
        Ok(Transfer { bytes, path })
    }

    /// The path a write takes now, and why.
    pub fn path_for_write(&self) -> PathTaken {
        match (self.mode, &self.cufile) {
            (Mode::CuFile, Some(h)) => PathTaken {
                path: IoPath::CuFile,
                reason: PathReason::Requested,
                direct: h.is_direct(),
            },
            (Mode::Auto, Some(h)) if self.gds => PathTaken {
                path: IoPath::CuFile,
                reason: PathReason::GdsDirect,
                direct: h.is_direct(),
            },
            // Cached writes go through the page cache, the fastest way to get data off the GPU
            // (a buffered `pwrite` is a memory copy); durable ones take `O_DIRECT` where the file
            // allows it, since writing back the page cache afterwards would copy every byte
            // again.
            (Mode::Auto, Some(_)) => {
                self.posix_taken(PathReason::CompatModeSlower, self.direct_writes())
            }
            _ => self.posix_taken(
                self.no_cufile.clone().unwrap_or(PathReason::Requested),
                self.direct_writes(),
            ),
        }
    }

    /// Whether the POSIX path writes with `O_DIRECT`: for durable writes, where the file has an
    /// `O_DIRECT` descriptor.
    fn direct_writes(&self) -> bool {
        self.durability == Durability::Durable && self.direct.is_some()
    }

    /// Write `len` bytes of `src` from byte `src_offset` to the file at `file_offset`, blocking,
    /// by the path [`path_for_write`](Self::path_for_write) picks. Device work writing `src`
    /// must be complete (synchronize its stream first).
    ///
    /// What is on the device when this returns depends on [`durability`](Self::durability):
    /// with [`Durability::Cached`] (the default) the data is in the page cache and a crash may
    /// lose it until the kernel writes it back or [`sync_data`](Self::sync_data) runs; with
    /// [`Durability::Durable`] the data and the file size are on the device (`fdatasync` ran).
    ///
    /// # Errors
    ///
    /// As [`read_to_device`](Self::read_to_device); [`Error::Os`] from `pwrite` or `fdatasync`.
    /// After an error, any part of the range may have been written.
    #[doc(alias = "cuFileWrite")]
    #[doc(alias = "pwrite")]
    pub fn write_from_device<M: DeviceMemory>(
        &self,
        src: &M,
        src_offset: usize,
        file_offset: u64,
        len: usize,
    ) -> Result<Transfer> {
        check_io("src_offset", src_offset, file_offset, len, src.byte_len())?;
        let path = self.path_for_write();
        let bytes = match (path.path, &self.cufile) {
            (IoPath::CuFile, Some(h)) => h.write(src, src_offset, file_offset, len)?,
            _ => {
                let cfg = self.posix_config(len)?;
                let ordinal = src.ordinal();
                // SAFETY: `check_io` put `src_offset..+len` inside `src`, live device memory of
                // that ordinal (so the address sum does not wrap), borrowed (so not freed) until
                // this returns, as are the descriptors; the caller's contract is that device work
                // writing it is complete.
                unsafe {
                    posix::write_from_device(
                        |b| GpuStaging::for_device(ordinal, b),
                        Request {
                            cfg: &cfg,
                            file: &self.posix_file(path.direct),
                            file_offset,
                            addr: src.device_ptr().wrapping_add(src_offset as u64),
                            len,
                        },
                    )
                }?
            }
        };
        if self.durability == Durability::Durable {
            self.sync_data()?;
        }
        Ok(Transfer { bytes, path })
    }
}

/// The page-aligned span of the file to look at for `offset..offset + len` of a file of
/// `file_len` bytes: its start and length, or `None` when empty or past `off_t`.
pub(crate) fn cache_span(
    offset: u64,
    len: usize,
    file_len: u64,
    page: u64,
) -> Option<(u64, usize)> {
    if page == 0 || offset > OFF_MAX {
        return None;
    }
    let start = offset - offset % page;
    let end = offset.saturating_add(len as u64).min(file_len);
    if end <= start {
        return None;
    }
    Some((start, usize::try_from(end - start).ok()?))
}

/// The windows of pages that [`page_cache_fraction`] asks about in a span of `pages` pages:
/// `(first page, pages)`, at most `windows` windows of `per` pages spread evenly from the first
/// page to the last; the whole span when it is that small.
pub(crate) fn sample_windows(pages: usize, windows: usize, per: usize) -> Vec<(usize, usize)> {
    let (windows, per) = (windows.max(1), per.max(1));
    if pages <= windows.saturating_mul(per) || windows == 1 {
        return if pages == 0 { vec![] } else { vec![(0, pages)] };
    }
    let last = pages - per; // pages > windows * per >= per
    (0..windows)
        .map(|i| {
            // i * last / (windows - 1) <= last, computed without overflow in u128.
            let first = (i as u128 * last as u128 / (windows as u128 - 1)) as usize;
            (first, per)
        })
        .collect()
}

/// The fraction of `offset..offset+len` of the file in the page cache (`mincore`), sampled: at
/// most 64 windows of 16 pages spread over the range, so that a large read costs a few
/// microseconds to classify, not a walk of every page; 0 when unknown.
#[doc(alias = "mincore")]
pub(crate) fn page_cache_fraction(fd: &OwnedFd, offset: u64, len: usize) -> f64 {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    let Ok(file_len) = fd_len(fd.as_fd()) else {
        return 0.0;
    };
    let Some((start, map_len)) = cache_span(offset, len, file_len, page) else {
        return 0.0;
    };
    // SAFETY: a read-only shared mapping of an open file; only mincore looks at it.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            start as libc::off_t, // cache_span: at most i64::MAX
        )
    };
    if p == libc::MAP_FAILED {
        return 0.0;
    }
    let page = page as usize;
    let pages = map_len.div_ceil(page);
    let (mut seen, mut cached) = (0usize, 0usize);
    let mut vec = Vec::new();
    for (first, n) in sample_windows(pages, 64, 16) {
        vec.clear();
        vec.resize(n, 0u8);
        // In the mapping: `first + n <= pages` (sample_windows), and the last page may be partial.
        let at = first * page;
        let bytes = (n * page).min(map_len - at);
        // SAFETY: `at..at + bytes` lies in the mapping; `vec` holds one byte per page of it.
        let r = unsafe { libc::mincore(p.cast::<u8>().add(at).cast(), bytes, vec.as_mut_ptr()) };
        if r != 0 {
            seen = 0;
            break;
        }
        seen += n;
        cached += vec.iter().filter(|&&b| b & 1 != 0).count();
    }
    // SAFETY: unmapping what we mapped.
    unsafe { libc::munmap(p, map_len) };
    if seen == 0 {
        return 0.0;
    }
    cached as f64 / seen as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str, data: &[u8]) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("gpudirect-{name}-{}", std::process::id()));
        std::fs::write(&p, data).unwrap();
        p
    }

    #[test]
    fn posix_mode_never_touches_cufile_and_says_so() {
        let p = temp("auto-posix", &[7u8; 10000]);
        let f = GdsFile::open(&p, &OpenOptions::read_only(), Mode::Posix).unwrap();
        assert!(f.cufile_handle().is_none());
        let t = f.path_for_read(0, 10000);
        assert_eq!(t.path, IoPath::Posix);
        assert_eq!(t.reason, PathReason::Requested);
        // Just written: in the page cache, so the buffered descriptor is used.
        assert!(!t.direct);
        assert!(page_cache_fraction(&f.buffered, 0, 10000) > 0.5);
        std::fs::remove_file(&p).unwrap();
    }

    use crate::memory::MemoryKind;
    use crate::memory::testing::FakeDevice;

    #[test]
    fn bad_ranges_and_configs_are_refused_before_any_call() {
        let p = temp("auto-ranges", &[5u8; 4096]);
        let mut f = GdsFile::open(&p, &OpenOptions::read_only(), Mode::Posix).unwrap();
        // Never dereferenced: every use below is refused before any access.
        let mut dst = FakeDevice(MemoryKind::Device, 64);
        for (off, fo, len) in [
            (8, 0, 57),
            (usize::MAX, 0, 2),
            (0, i64::MAX as u64, 2),
            (0, u64::MAX, 1),
        ] {
            let e = f.read_to_device(&mut dst, off, fo, len).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
            let e = f.write_from_device(&dst, off, fo, len).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        }
        // Choosing a path for any range never panics or wraps.
        for (fo, len) in [
            (u64::MAX, usize::MAX),
            (i64::MAX as u64, usize::MAX),
            (0, usize::MAX),
        ] {
            assert_eq!(f.path_for_read(fo, len).path, IoPath::Posix);
        }
        // The wrapping chunk of the POSIX path is refused, and the configuration kept.
        let bad = PosixConfig {
            chunk: usize::MAX - 4095,
            ..PosixConfig::default()
        };
        let e = f.set_posix_config(Some(bad)).unwrap_err();
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
        assert_eq!(
            f.posix_config(1 << 30).unwrap(),
            PosixConfig::automatic(1 << 30).unwrap()
        );
        std::fs::remove_file(&p).unwrap();
    }

    proptest::proptest! {
        #[test]
        fn sample_windows_stay_in_the_span(
            pages in 0usize..1 << 22,
            windows in 0usize..100,
            per in 0usize..40,
        ) {
            let w = sample_windows(pages, windows, per);
            proptest::prop_assert!(w.len() <= windows.max(1));
            for &(first, n) in &w {
                proptest::prop_assert!(n >= 1 && first + n <= pages);
            }
            if pages > 0 {
                proptest::prop_assert_eq!(w[0].0, 0, "the first page is looked at");
                let &(first, n) = w.last().unwrap();
                proptest::prop_assert_eq!(first + n, pages, "and the last one");
            }
        }

        #[test]
        fn cache_spans_stay_in_the_file(
            offset: u64,
            len: usize,
            file_len in proptest::prop_oneof![proptest::prelude::any::<u64>(), 0u64..1 << 20],
            page in proptest::prop_oneof![proptest::prelude::Just(4096u64), 0u64..70_000],
        ) {
            if let Some((start, n)) = cache_span(offset, len, file_len, page) {
                proptest::prop_assert!(page > 0 && start % page == 0 && start <= offset);
                proptest::prop_assert!(start <= i64::MAX as u64);
                proptest::prop_assert!(n > 0 && start as u128 + n as u128 <= file_len as u128);
            }
        }
    }

    #[test]
    fn auto_mode_without_cufile_falls_back_with_the_reason() {
        if gpudirect_sys::cufile::lib().is_ok() && gpudirect_sys::cuda::driver().is_ok() {
            // A GPU node: the hardware tests cover this.
            return;
        }
        let p = temp("auto-fallback", &[1u8; 100]);
        let f = GdsFile::open(&p, &OpenOptions::read_only(), Mode::Auto).unwrap();
        let t = f.path_for_read(0, 100);
        assert_eq!(t.path, IoPath::Posix);
        assert!(
            matches!(&t.reason, PathReason::CufileUnavailable(s) if s.contains("not found")),
            "{t:?}"
        );
        assert!(GdsFile::open(&p, &OpenOptions::read_only(), Mode::CuFile).is_err());
        std::fs::remove_file(&p).unwrap();
    }
}
