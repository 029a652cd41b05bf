//! Opening files (O_DIRECT with a buffered fallback) and registering them with cuFile.

use super::driver::{Driver, serialized, serialized_call};
use super::range::file_size;
use super::status::cufile_error;
use crate::error::{Error, Result};
use gpudirect_sys::cufile as sys;
use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;

/// Whether to open with `O_DIRECT` (bypassing the page cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirectIo {
    /// Try `O_DIRECT`; where the file system refuses it (`EINVAL`: tmpfs, /dev/shm) open
    /// buffered instead.
    #[default]
    Try,
    /// `O_DIRECT` or an error.
    Require,
    /// Buffered (page cache).
    Off,
}

/// How to open a file, typed (read, write, create, truncate, direct I/O).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenOptions {
    /// Open for reading.
    pub read: bool,
    /// Open for writing.
    pub write: bool,
    /// Create if absent (mode 0o644).
    pub create: bool,
    /// Truncate to 0 bytes.
    pub truncate: bool,
    /// Direct I/O.
    pub direct: DirectIo,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions::read_only()
    }
}

impl OpenOptions {
    /// Read only, `O_DIRECT` attempted.
    pub const fn read_only() -> Self {
        OpenOptions {
            read: true,
            write: false,
            create: false,
            truncate: false,
            direct: DirectIo::Try,
        }
    }

    /// Read and write, created if absent, `O_DIRECT` attempted.
    pub const fn read_write() -> Self {
        OpenOptions {
            read: true,
            write: true,
            create: true,
            truncate: false,
            direct: DirectIo::Try,
        }
    }

    /// Set the direct I/O choice.
    pub const fn direct(mut self, direct: DirectIo) -> Self {
        self.direct = direct;
        self
    }

    /// Set truncation.
    pub const fn truncate(mut self, truncate: bool) -> Self {
        self.truncate = truncate;
        self
    }

    fn flags(&self) -> Result<libc::c_int> {
        let mut f = match (self.read, self.write) {
            (true, false) => libc::O_RDONLY,
            (false, true) => libc::O_WRONLY,
            (true, true) => libc::O_RDWR,
            (false, false) => {
                return Err(Error::invalid(
                    "options",
                    "read: false, write: false",
                    "open for reading, writing or both",
                ));
            }
        };
        if self.create {
            f |= libc::O_CREAT;
        }
        if self.truncate {
            f |= libc::O_TRUNC;
        }
        Ok(f | libc::O_CLOEXEC)
    }

    /// `open(path, flags)`—Open `path`; returns the descriptor and whether it is `O_DIRECT`.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] from `open` (with `O_DIRECT` under [`DirectIo::Require`]) or `fstat`;
    /// [`Error::InvalidArgument`] for what is neither a regular file nor a block device (a
    /// directory opens for reading, and would fail only at the first read).
    pub fn open(&self, path: impl AsRef<Path>) -> Result<(OwnedFd, bool)> {
        let path = path.as_ref();
        let c = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| Error::invalid("path", path.display(), "must not contain NUL"))?;
        let flags = self.flags()?;
        let open = |flags: libc::c_int| -> Result<OwnedFd> {
            // SAFETY: a NUL-terminated path; mode is read only with O_CREAT.
            let fd = unsafe { libc::open(c.as_ptr(), flags, 0o644 as libc::c_uint) };
            if fd < 0 {
                return Err(Error::last_os("open"));
            }
            // SAFETY: a fresh descriptor we own.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            match super::range::fstat(fd.as_fd())?.st_mode & libc::S_IFMT {
                libc::S_IFREG | libc::S_IFBLK => Ok(fd),
                kind => Err(Error::invalid(
                    "path",
                    path.display(),
                    if kind == libc::S_IFDIR {
                        "is a directory: a regular file or a block device"
                    } else {
                        "is neither a regular file nor a block device"
                    },
                )),
            }
        };
        match self.direct {
            DirectIo::Off => Ok((open(flags)?, false)),
            DirectIo::Require => Ok((open(flags | libc::O_DIRECT)?, true)),
            DirectIo::Try => match open(flags | libc::O_DIRECT) {
                Ok(fd) => Ok((fd, true)),
                Err(Error::Os { source, .. }) if source.raw_os_error() == Some(libc::EINVAL) => {
                    Ok((open(flags)?, false))
                }
                Err(e) => Err(e),
            },
        }
    }
}

pub(crate) struct HandleInner {
    pub(crate) driver: Driver,
    pub(crate) handle: sys::CUfileHandle_t,
    pub(crate) fd: OwnedFd,
    pub(crate) direct: bool,
}

// SAFETY: a CUfileHandle_t may be used from any thread (cuFile's I/O calls are thread-safe); the
// handle is only deregistered in Drop, with exclusive access.
unsafe impl Send for HandleInner {}
// SAFETY: as above.
unsafe impl Sync for HandleInner {}

impl Drop for HandleInner {
    fn drop(&mut self) {
        if crate::completion::Tracker::global().in_forked_child() {
            return; // no cuFile calls in a forked child: leave the registration (the fd closes)
        }
        // Every blocking call borrows the handle and every async or batch operation holds an
        // Arc of it, so no I/O is outstanding: deregistration cannot race it.
        // SAFETY: registered in FileHandle::register, deregistered once; the fd is still open.
        let (lib, handle) = (self.driver.lib(), self.handle);
        // Refused only in a forked child: the handle is then left registered.
        let _ = serialized(|| {
            // SAFETY: as for the call without the lock (above).
            unsafe { (lib.cuFileHandleDeregister)(handle) }
        });
    }
}

/// A file registered with cuFile (`cuFileHandleRegister`); deregistered when the last clone and
/// the last operation using it are gone. Cheap to clone.
#[derive(Clone)]
pub struct FileHandle {
    pub(crate) inner: Arc<HandleInner>,
}

impl std::fmt::Debug for FileHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileHandle")
            .field("fd", &self.inner.fd.as_raw_fd())
            .field("direct", &self.inner.direct)
            .finish()
    }
}

impl FileHandle {
    /// Open `path` with `options` and register it (`cuFileHandleRegister`).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] from `open`; [`Error::CuFile`] from `cuFileHandleRegister` (5027 where the
    /// udev database lacks the disk, `CU_FILE_IO_NOT_SUPPORTED` on an unsupported file system).
    #[doc(alias = "cuFileHandleRegister")]
    pub fn open(driver: &Driver, path: impl AsRef<Path>, options: &OpenOptions) -> Result<Self> {
        let (fd, direct) = options.open(path)?;
        Self::register(driver, fd, direct)
    }

    /// `cuFileHandleRegister(&fh, &descr)`—Register an open descriptor, taking ownership of it.
    /// `direct` says whether it was opened with `O_DIRECT` (it is checked with `fcntl`).
    ///
    /// # Errors
    ///
    /// [`Error::CuFile`] from `cuFileHandleRegister`.
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/gpudirect-storage/api-reference-guide/index.html#cufilehandleregister>
    #[doc(alias = "cuFileHandleRegister")]
    pub fn from_fd(driver: &Driver, fd: OwnedFd) -> Result<Self> {
        // SAFETY: F_GETFL on a valid descriptor.
        let fl = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        let direct = fl >= 0 && fl & libc::O_DIRECT != 0;
        Self::register(driver, fd, direct)
    }

    fn register(driver: &Driver, fd: OwnedFd, direct: bool) -> Result<Self> {
        // SAFETY: all-zero is valid for this plain struct (null fs_ops, fd 0 overwritten).
        let mut descr: sys::CUfileDescr_t = unsafe { std::mem::zeroed() };
        descr.type_ = sys::CU_FILE_HANDLE_TYPE_OPAQUE_FD;
        descr.handle.fd = fd.as_raw_fd();
        let mut handle: sys::CUfileHandle_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer and descriptor; the fd stays open while the handle lives.
        serialized_call("cuFileHandleRegister", || {
            // SAFETY: as for the call without the lock (above).
            unsafe { (driver.lib().cuFileHandleRegister)(&mut handle, &mut descr) }
        })?;
        if handle.is_null() {
            return Err(cufile_error(
                "cuFileHandleRegister",
                sys::CU_FILE_INTERNAL_ERROR,
                0,
            ));
        }
        Ok(FileHandle {
            inner: Arc::new(HandleInner {
                driver: driver.clone(),
                handle,
                fd,
                direct,
            }),
        })
    }

    /// Whether the descriptor is `O_DIRECT`.
    pub fn is_direct(&self) -> bool {
        self.inner.direct
    }

    /// The driver handle this file handle was registered with.
    pub fn driver(&self) -> &Driver {
        &self.inner.driver
    }

    /// The raw `CUfileHandle_t` (valid while `self` lives).
    pub fn as_raw(&self) -> sys::CUfileHandle_t {
        self.inner.handle
    }

    /// The file's size in bytes (`fstat`; a block device's size by `ioctl(BLKGETSIZE64)`).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] from `fstat` or `ioctl`.
    pub fn len(&self) -> Result<u64> {
        fd_len(self.inner.fd.as_fd())
    }

    /// Whether the file is empty.
    ///
    /// # Errors
    ///
    /// As [`len`](Self::len).
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }
}

impl AsFd for FileHandle {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.fd.as_fd()
    }
}

/// The file's size: `st_size` of a regular file, the size of a block device, 0 for anything else
/// (`fstat`, `ioctl(BLKGETSIZE64)`).
pub(crate) fn fd_len(fd: BorrowedFd<'_>) -> Result<u64> {
    Ok(file_size(fd)?.unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn o_direct_falls_back_where_refused() {
        // /dev/shm is tmpfs, which refuses O_DIRECT on older kernels; the temp dir may or may not.
        let dir = if std::path::Path::new("/dev/shm").is_dir() {
            std::path::PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let p = dir.join(format!("gpudirect-odirect-{}", std::process::id()));
        std::fs::write(&p, b"hello").unwrap();
        let (fd, _direct) = OpenOptions::read_only().open(&p).unwrap();
        let mut buf = [0u8; 5];
        // SAFETY: a valid descriptor and buffer.
        let n = unsafe { libc::pread(fd.as_raw_fd(), buf.as_mut_ptr().cast(), 5, 0) };
        // Buffered after fallback reads fine; O_DIRECT would refuse the unaligned buffer.
        if !OpenOptions::read_only().open(&p).unwrap().1 {
            assert_eq!(n, 5);
            assert_eq!(&buf, b"hello");
        }
        assert_eq!(fd_len(fd.as_fd()).unwrap(), 5);
        let off = OpenOptions::read_only().direct(DirectIo::Off);
        assert!(!off.open(&p).unwrap().1);
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn options_are_validated() {
        let o = OpenOptions {
            read: false,
            write: false,
            ..OpenOptions::read_only()
        };
        let e = o.open("/nonexistent").unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { arg: "options", .. }));
        let e = OpenOptions::read_only()
            .open("/nonexistent/gpudirect")
            .unwrap_err();
        assert!(
            matches!(&e, Error::Os { call: "open", source } if source.raw_os_error() == Some(libc::ENOENT))
        );
        // A directory opens for reading: refused at open, not at the first read.
        for d in [
            OpenOptions::read_only(),
            OpenOptions::read_only().direct(DirectIo::Off),
        ] {
            let e = d.open(std::env::temp_dir()).unwrap_err();
            assert!(
                matches!(&e, Error::InvalidArgument { arg: "path", rule, .. } if rule.contains("directory")),
                "{e:?}"
            );
        }
        // So is what is neither a file nor a block device.
        let e = OpenOptions::read_only()
            .direct(DirectIo::Off)
            .open("/dev/null")
            .unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "path", .. }),
            "{e:?}"
        );
    }
}
