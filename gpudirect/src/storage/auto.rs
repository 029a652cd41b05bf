//! The automatic path: cuFile where it helps, our own POSIX path where cuFile is missing, cannot
//! register the file, or would be slower; every transfer says which path ran and why.

use super::posix::{self, GpuEngines, PosixConfig, PosixFile};
use super::{DirectIo, Driver, FileHandle, OpenOptions, check_io};
use crate::error::{Error, Result};
use crate::memory::{DeviceMemory, DeviceMemoryMut};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

/// Which path a [`File`] may use.
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
pub enum Path {
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
    pub path: Path,
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

/// A file for the automatic path: a buffered descriptor, an `O_DIRECT` one where the file system
/// allows it, and a cuFile registration where cuFile works.
#[derive(Debug)]
pub struct File {
    buffered: OwnedFd,
    direct: Option<OwnedFd>,
    cufile: Option<FileHandle>,
    /// Why cuFile is not used, or `None` when it is registered.
    no_cufile: Option<PathReason>,
    gds: bool,
    mode: Mode,
    posix: PosixConfig,
}

impl File {
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
    ) -> Result<File> {
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
        let mut f = File {
            buffered,
            direct,
            cufile: None,
            no_cufile: Some(PathReason::Requested),
            gds: false,
            mode,
            posix: PosixConfig::default(),
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

    /// Set how the POSIX path splits and overlaps transfers.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] from [`PosixConfig::validate`]; the configuration in use is
    /// then kept.
    pub fn set_posix_config(&mut self, cfg: PosixConfig) -> Result<()> {
        cfg.validate()?;
        self.posix = cfg;
        Ok(())
    }

    /// How the POSIX path splits and overlaps transfers.
    pub fn posix_config(&self) -> &PosixConfig {
        &self.posix
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
        super::file::fd_len(self.buffered.as_fd())
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
                path: Path::CuFile,
                reason: PathReason::Requested,
                direct: h.is_direct(),
            },
            (Mode::Auto, Some(h)) if self.gds => {
                if hot() {
                    self.posix_taken(PathReason::PageCacheHot, false)
                } else {
                    PathTaken {
                        path: Path::CuFile,
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
            path: Path::Posix,
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
            (Path::CuFile, Some(h)) => h.read(dst, dst_offset, file_offset, len)?,
            _ => {
                let engines = GpuEngines::for_device(dst.ordinal())?;
                // SAFETY: `check_io` put `dst_offset..+len` inside `dst`, live device memory of
                // that ordinal (so the address sum does not wrap) borrowed mutably (so nothing else touches it) until this returns.
                unsafe {
                    posix::read_to_device(
                        engines,
                        &self.posix,
                        &self.posix_file(path.direct),
                        super::file_size(self.buffered.as_fd())?,
                        file_offset,
                        dst.device_ptr().wrapping_add(dst_offset as u64),
                        len,
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
                path: Path::CuFile,
                reason: PathReason::Requested,
                direct: h.is_direct(),
            },
            (Mode::Auto, Some(h)) if self.gds => PathTaken {
                path: Path::CuFile,
                reason: PathReason::GdsDirect,
                direct: h.is_direct(),
            },
            // Writes go through the page cache (as KvikIO's POSIX path does): many writer
            // threads fill it faster than direct I/O, and durability needs fsync either way.
            (Mode::Auto, Some(_)) => self.posix_taken(PathReason::CompatModeSlower, false),
            _ => self.posix_taken(
                self.no_cufile.clone().unwrap_or(PathReason::Requested),
                false,
            ),
        }
    }

    /// Write `len` bytes of `src` from byte `src_offset` to the file at `file_offset`, blocking.
    /// Device work writing `src` must be complete (synchronize its stream first).
    ///
    /// # Errors
    ///
    /// As [`read_to_device`](Self::read_to_device).
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
            (Path::CuFile, Some(h)) => h.write(src, src_offset, file_offset, len)?,
            _ => {
                let engines = GpuEngines::for_device(src.ordinal())?;
                // SAFETY: `check_io` put `src_offset..+len` inside `src`, live device memory of
                // that ordinal (so the address sum does not wrap), borrowed (so not freed) until this returns; the caller's contract
                // is that device work writing it is complete.
                unsafe {
                    posix::write_from_device(
                        engines,
                        &self.posix,
                        &self.posix_file(path.direct),
                        file_offset,
                        src.device_ptr().wrapping_add(src_offset as u64),
                        len,
                    )
                }?
            }
        };
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
    if page == 0 || offset > super::OFF_MAX {
        return None;
    }
    let start = offset - offset % page;
    let end = offset.saturating_add(len as u64).min(file_len);
    if end <= start {
        return None;
    }
    Some((start, usize::try_from(end - start).ok()?))
}

/// The fraction of `offset..offset+len` of the file in the page cache (`mincore`); 0 when unknown.
pub(crate) fn page_cache_fraction(fd: &OwnedFd, offset: u64, len: usize) -> f64 {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    let Ok(file_len) = super::file::fd_len(fd.as_fd()) else {
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
    let pages = map_len.div_ceil(page as usize);
    let mut vec = vec![0u8; pages];
    // SAFETY: `vec` holds one byte per page of the mapping.
    let r = unsafe { libc::mincore(p, map_len, vec.as_mut_ptr()) };
    // SAFETY: unmapping what we mapped.
    unsafe { libc::munmap(p, map_len) };
    if r != 0 {
        return 0.0;
    }
    vec.iter().filter(|&&b| b & 1 != 0).count() as f64 / pages as f64
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
        let f = File::open(&p, &OpenOptions::read_only(), Mode::Posix).unwrap();
        assert!(f.cufile_handle().is_none());
        let t = f.path_for_read(0, 10000);
        assert_eq!(t.path, Path::Posix);
        assert_eq!(t.reason, PathReason::Requested);
        // Just written: in the page cache, so the buffered descriptor is used.
        assert!(!t.direct);
        assert!(page_cache_fraction(&f.buffered, 0, 10000) > 0.5);
        std::fs::remove_file(&p).unwrap();
    }

    /// Never dereferenced: every use below is refused before any access.
    struct Fake(usize);
    // SAFETY: never dereferenced or handed to any library (the checks refuse it first).
    unsafe impl DeviceMemory for Fake {
        type Elem = u8;
        fn device_ptr(&self) -> u64 {
            0x1000
        }
        fn len(&self) -> usize {
            self.0
        }
        fn ordinal(&self) -> usize {
            0
        }
        fn kind(&self) -> crate::memory::MemoryKind {
            crate::memory::MemoryKind::Device
        }
    }
    // SAFETY: as above.
    unsafe impl DeviceMemoryMut for Fake {}

    #[test]
    fn bad_ranges_and_configs_are_refused_before_any_call() {
        let p = temp("auto-ranges", &[5u8; 4096]);
        let mut f = File::open(&p, &OpenOptions::read_only(), Mode::Posix).unwrap();
        let mut dst = Fake(64);
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
            assert_eq!(f.path_for_read(fo, len).path, Path::Posix);
        }
        // The wrapping chunk of the POSIX path is refused, and the configuration kept.
        let bad = PosixConfig {
            chunk: usize::MAX - 4095,
            ..PosixConfig::default()
        };
        let e = f.set_posix_config(bad).unwrap_err();
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
        assert_eq!(*f.posix_config(), PosixConfig::default());
        std::fs::remove_file(&p).unwrap();
    }

    proptest::proptest! {
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
        let f = File::open(&p, &OpenOptions::read_only(), Mode::Auto).unwrap();
        let t = f.path_for_read(0, 100);
        assert_eq!(t.path, Path::Posix);
        assert!(
            matches!(&t.reason, PathReason::CufileUnavailable(s) if s.contains("not found")),
            "{t:?}"
        );
        assert!(File::open(&p, &OpenOptions::read_only(), Mode::CuFile).is_err());
        std::fs::remove_file(&p).unwrap();
    }
}
