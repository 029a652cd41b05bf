//! GPUDirect Storage: the cuFile driver, file handles, buffer registration, blocking, stream-ordered
//! and batch I/O, and an automatic path that falls back to (or prefers) the library's own POSIX path.
//!
//! | type | what | C |
//! | --- | --- | --- |
//! | [`Driver`] | a handle to the process-wide driver, opened once and never closed; properties and parameters | `cuFileDriverOpen` |
//! | [`FileHandle`] | a file registered with cuFile; blocking and async I/O | `cuFileHandleRegister` |
//! | [`BufRegistration`] | a registered device buffer range | `cuFileBufRegister` |
//! | [`AsyncIo`] | an I/O ordered on a stream, owning what it touches | `cuFileReadAsync` |
//! | [`Batch`] | up to `max_batch_io_size` requests at once | `cuFileBatchIOSubmit` |
//! | [`GdsFile`] | the automatic path: cuFile or our POSIX path, reporting which ran ([`IoPath`]) | – |
//! | [`PosixConfig`] | the POSIX path's configuration: reader threads, chunks, pipelining | `pread` |
//!
//! Every call that touches CUDA checks libcuda first ([`crate::cuda::init`]), so the driver can be
//! the first CUDA-touching call of a program, and a missing libcuda or
//! libcufile is an [`crate::Error::Load`], never a panic or a hang (the 1.20 library
//! hangs in `cuFileDriverOpen` when libcuda is absent; we never call it then).
//!
//! # End of file
//!
//! Every read path (blocking, stream-ordered, batch, the POSIX path, and so [`GdsFile`] whichever
//! path it picks) follows one rule: a read is first limited to the file's size (`fstat`, or the
//! device size for a block device), taken when the blocking call or batch submission starts, or
//! when the stream reaches a stream-ordered read (so earlier writes on that stream count). The
//! count returned is then `min(len, size - file_offset)` (0 at or past the end), and no byte of
//! the destination outside the bytes read changes. cuFile is never asked to read past the end of
//! a file: asked that, it changes destination bytes past the count (blocking and batch reads in
//! compatibility mode) or fails with `EIO` (`cuFileReadAsync`).
//!
//! A file that shrinks while a read runs is an [`crate::Error::FileShrank`] on every path, never
//! a silent short count: destination bytes past the size taken at the start are still unchanged,
//! but bytes between what was read and that size may have changed (cuFile may have written
//! them). A file that grows meanwhile is read up to the size taken at the start.
//!
//! # Threads
//!
//! [`Driver`] values may be opened, cloned and dropped from any number of threads: the first
//! open of the process calls `cuFileDriverOpen` under one process-wide lock (which the staged
//! parameters take too), and the driver stays open until the process exits; dropping handles
//! never closes it (closing and reopening cuFile's driver from several threads crashed it).
//!
//! # Arguments
//!
//! Offsets, lengths and configurations are checked before any library call, in release builds as
//! in debug ones: a buffer range lies within its buffer, a file range and a buffer offset end at
//! or below `i64::MAX` (`off_t`), and a [`PosixConfig`] stays within the bounds
//! [`PosixConfig::validate`] lists. A violation is an
//! [`crate::Error::InvalidArgument`] naming the argument.
//!
//! # The POSIX path
//!
//! Where cuFile is missing, cannot register a file, or runs in compatibility mode (no
//! nvidia-fs), [`GdsFile`] moves data itself: reader threads (kept for the life of the process;
//! the calling thread is one of them) `pread` chunks into pinned bounce chunks and queue each
//! chunk's copy to the GPU on their own stream right away, reading the next chunk while it runs;
//! chunks are claimed in file order from one counter, with no lock per chunk. Cold reads use
//! `O_DIRECT`. Thread counts and the chunk size come from the node's cores and the transfer's
//! size ([`PosixConfig::automatic`]: one reader per core up to 16, 4 MiB chunks), overridden per
//! file ([`GdsFile::set_posix_config`]) or by the environment (`GPUDIRECT_POSIX_THREADS`, ...).
//! Writes go through the page cache unless [`Durability::Durable`] is set (then `O_DIRECT` on
//! several threads, and `fdatasync` before the call returns). The bounce chunks and the copy
//! streams are the memory module's ([`BouncePool`](crate::memory::BouncePool),
//! [`CopyEngine`](crate::memory::CopyEngine)).

mod async_io;
mod auto;
mod awaited;
mod batch;
mod buffer;
mod context;
mod driver;
mod file;
mod io;
mod posix;
mod range;
mod status;

pub use async_io::{AsyncIo, AsyncIoFuture, AsyncResources};
pub use auto::{Durability, GdsFile, IoPath, Mode, PathReason, PathTaken, Transfer};
pub use awaited::AutoReadFuture;
pub use batch::{Batch, BatchFuture, BatchOp, BatchRequest, BatchResult, BatchStatus, run_batched};
pub use buffer::BufRegistration;
pub use driver::{BoolParam, Driver, DriverProperties, FsSupport, SizeParam, StringParam};
pub use file::{DirectIo, FileHandle, OpenOptions};
pub use io::MAX_BYTES_PER_CALL;
pub use posix::{DIRECT_ALIGN, POSIX_ENV, PosixConfig};
