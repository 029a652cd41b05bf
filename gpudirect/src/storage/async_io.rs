//! Stream-ordered cuFile I/O (`cuFileReadAsync`/`cuFileWriteAsync`), owned by the completion
//! tracker until a host callback on the stream has run.

use super::{FileHandle, check, check_io, clamp_read, io_error, read_outcome};
use crate::completion::{HostFnFence, InFlight};
use crate::cuda::Stream;
use crate::error::{Error, Result, cu};
use crate::memory::{DeviceMemory, DeviceMemoryMut};
use cudarc::driver::{CudaStream, sys as cu_sys};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::time::Duration;

/// The size/offset/bytes-done block cuFile reads and writes when the stream reaches the
/// operation. Its address is handed to cuFile and must not move.
#[derive(Debug)]
#[repr(C)]
struct Params {
    size: usize,
    file_offset: libc::off_t,
    buf_offset: libc::off_t,
    bytes: isize,
}

/// Not yet limited to the file's size (a write, or a read whose limiting callback has not run).
const NOT_CLAMPED: usize = usize::MAX;

/// The argument block, shared by the operation's owner and the read's limiting callback (so it
/// outlives whichever runs last), with what that callback found.
struct Block {
    params: std::cell::UnsafeCell<Params>,
    /// The read's length after limiting it to the file's size when the stream reached it.
    clamped: AtomicUsize,
    /// The errno of that callback's `fstat`, 0 when none.
    clamp_errno: AtomicI32,
}

// SAFETY: `params` is written by cuFile and by the limiting callback only in stream order (the
// callback runs before the read, the read before the completion callback), and read by the
// owner only after completion; the other fields are atomics.
unsafe impl Send for Block {}
// SAFETY: as above.
unsafe impl Sync for Block {}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block")
            .field("clamped", &self.clamped.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Block {
    /// The read's limiting callback: set `size` to what the file holds from `file_offset`.
    fn clamp(&self, handle: &FileHandle, file_offset: u64, len: usize) {
        let want = match super::file_size(handle.as_fd()) {
            Ok(size) => clamp_read(file_offset, len, size),
            Err(e) => {
                let errno = match &e {
                    Error::Os { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
                    _ => libc::EIO,
                };
                self.clamp_errno.store(errno, Ordering::Relaxed);
                0
            }
        };
        // SAFETY: the stream runs this callback before the read that takes `size`; nothing else
        // touches the field meanwhile.
        unsafe { std::ptr::write_volatile(&raw mut (*self.params.get()).size, want) };
        self.clamped.store(want, Ordering::Release);
    }
}

/// What a stream-ordered I/O owns until the stream has passed it: the buffer, the file handle
/// (so it cannot be deregistered early), the stream and the argument block.
pub struct AsyncResources<M: DeviceMemory> {
    /// The device buffer (or [`BufRegistration`](super::BufRegistration)).
    pub buffer: M,
    handle: FileHandle,
    stream: Arc<CudaStream>,
    params: Arc<Block>,
    call: &'static str,
    /// Where the operation starts in the file.
    file_offset: u64,
}

impl<M: DeviceMemory> std::fmt::Debug for AsyncResources<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncResources")
            .field("call", &self.call)
            .field("params", &self.params)
            .finish()
    }
}

impl<M: DeviceMemory> AsyncResources<M> {
    /// The bytes moved, as cuFile reported them when the stream ran the operation.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] or [`Error::CuFile`] when cuFile reported a negative count.
    pub fn bytes(&self) -> Result<usize> {
        // SAFETY: the operation has completed (resources are only handed out then); cuFile
        // wrote the field from another thread, ordered before our host callback's Release store.
        let b = unsafe { std::ptr::read_volatile(&raw const (*self.params.params.get()).bytes) };
        let clamped = self.params.clamped.load(Ordering::Acquire);
        if clamped == NOT_CLAMPED {
            // A write.
            return if b < 0 {
                Err(io_error(self.call, b))
            } else {
                Ok(b.unsigned_abs())
            };
        }
        match self.params.clamp_errno.load(Ordering::Relaxed) {
            0 => {}
            errno => return Err(Error::errno("fstat", errno)),
        }
        if clamped == 0 {
            // At or past the end of file: nothing was asked for, whatever cuFile says of it.
            return Ok(0);
        }
        let got = if b < 0 {
            // Asked only for bytes the file held: an error after the file shrank is that.
            let now = super::file_size(self.handle.as_fd()).ok().flatten();
            if clamp_read(self.file_offset, clamped, now) < clamped {
                Ok(0)
            } else {
                Err(io_error(self.call, b))
            }
        } else {
            Ok(b.unsigned_abs())
        };
        read_outcome(self.call, self.file_offset, clamped, got)
    }

    /// The file handle, stream and buffer back.
    pub fn into_parts(self) -> (M, FileHandle, Arc<CudaStream>) {
        (self.buffer, self.handle, self.stream)
    }
}

/// A stream-ordered cuFile I/O in flight. [`wait`](Self::wait) returns the buffer and the byte
/// count. Dropping it waits a bounded time, then parks everything in the
/// [`Tracker`](crate::completion::Tracker) until the host callback has run (freed by a later `reap`);
/// `mem::forget` leaks it, which is safe.
#[must_use = "dropping an AsyncIo blocks until the stream passes it (bounded), then parks it"]
pub struct AsyncIo<M: DeviceMemory> {
    op: InFlight<AsyncResources<M>, HostFnFence>,
    /// The stream the operation is queued on (also owned by `op`), to notice a failed stream.
    stream: Arc<CudaStream>,
}

impl<M: DeviceMemory> std::fmt::Debug for AsyncIo<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.op.fmt(f)
    }
}

impl<M: DeviceMemory> AsyncIo<M> {
    /// Whether the stream has passed the operation.
    pub fn is_complete(&self) -> bool {
        self.op.is_complete()
    }

    /// Wait for the stream to pass the operation; the buffer and the bytes moved.
    ///
    /// # Errors
    ///
    /// The operation's error ([`AsyncResources::bytes`]); the buffer is then dropped (the
    /// operation is complete, so that is safe). Use [`wait_resources`](Self::wait_resources) to
    /// keep it.
    pub fn wait(self) -> Result<(M, usize)> {
        let r = self.wait_resources()?;
        let n = r.bytes()?;
        Ok((r.buffer, n))
    }

    /// Wait and take everything back, whatever the outcome.
    ///
    /// # Errors
    ///
    /// [`Error::Cuda`] from `cuStreamQuery` (or `cuCtxSetCurrent`) when the stream has failed
    /// (a sticky error) before passing the operation: its host callback will never run, so the
    /// wait gives up and the resources stay parked in the [`Tracker`](crate::completion::Tracker)
    /// (never freed early; in practice leaked).
    pub fn wait_resources(self) -> Result<AsyncResources<M>> {
        let stream = self.stream;
        self.op
            .wait_unless(Duration::from_millis(50), || stream_failed(&stream))
    }
}

/// `Err` when `stream` has failed (`cuStreamQuery` answers neither success nor not-ready).
fn stream_failed(stream: &CudaStream) -> Result<()> {
    crate::driver::ctx::bind(stream.context())?;
    // SAFETY: a live stream of the current context.
    match unsafe { cu_sys::cuStreamQuery(stream.cu_stream()) } {
        cu_sys::CUresult::CUDA_ERROR_NOT_READY => Ok(()),
        r => cu("cuStreamQuery", r),
    }
}

/// The host-callback fence (the memory module's [`HostFnFence`]) after the operation just queued
/// on `stream`; where the callback cannot be queued, the stream is synchronized instead so that
/// the fence is still truthful.
fn fence_after(stream: &Arc<CudaStream>) -> Result<HostFnFence> {
    match Stream::wrap(stream.clone()).host_fence() {
        Ok(f) => Ok(f),
        Err(_) => {
            // SAFETY: a valid stream.
            cu("cuStreamSynchronize", unsafe {
                cu_sys::cuStreamSynchronize(stream.cu_stream())
            })?;
            let f = HostFnFence::new();
            f.complete(false);
            Ok(f)
        }
    }
}

impl FileHandle {
    /// `cuFileReadAsync(fh, buf, &size, &file_offset, &buf_offset, &bytes, stream)`—Read `len`
    /// bytes at `file_offset` into `dst` at `dst_offset` when `stream` reaches this point. The
    /// handle, buffer, stream and argument block are owned by the returned [`AsyncIo`] until a
    /// host callback enqueued after the read has run.
    ///
    /// End of file: a host callback enqueued just before the read limits it to the file's size
    /// when the stream reaches it (so earlier writes on the stream count), and the count is the
    /// bytes up to the end of file with every byte of `dst` past them unchanged, as for
    /// [`read`](Self::read).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a range outside `dst` or the file;
    /// [`Error::CuFile`] from `cuFileReadAsync` (nothing was enqueued; `dst` is dropped);
    /// [`Error::Cuda`] when the limiting callback cannot be queued (nothing was enqueued);
    /// [`Error::Cuda`] when neither a host callback nor a stream synchronization works (the
    /// resources are then leaked, never freed early).
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/gpudirect-storage/api-reference-guide/index.html#cufilereadasync>
    #[doc(alias = "cuFileReadAsync")]
    pub fn read_async<M: DeviceMemoryMut>(
        &self,
        stream: &Arc<CudaStream>,
        dst: M,
        dst_offset: usize,
        file_offset: u64,
        len: usize,
    ) -> Result<AsyncIo<M>> {
        self.submit_async(true, stream, dst, dst_offset, file_offset, len)
    }

    /// `cuFileWriteAsync(...)`—Write `len` bytes of `src` from `src_offset` to `file_offset`
    /// when `stream` reaches this point: the write sees all earlier work on `stream`.
    /// Ownership as [`read_async`](Self::read_async).
    ///
    /// # Errors
    ///
    /// As [`read_async`](Self::read_async), from `cuFileWriteAsync`.
    #[doc(alias = "cuFileWriteAsync")]
    pub fn write_async<M: DeviceMemory>(
        &self,
        stream: &Arc<CudaStream>,
        src: M,
        src_offset: usize,
        file_offset: u64,
        len: usize,
    ) -> Result<AsyncIo<M>> {
        self.submit_async(false, stream, src, src_offset, file_offset, len)
    }

    fn submit_async<M: DeviceMemory>(
        &self,
        read: bool,
        stream: &Arc<CudaStream>,
        buf: M,
        buf_offset: usize,
        file_offset: u64,
        len: usize,
    ) -> Result<AsyncIo<M>> {
        check_io("buf_offset", buf_offset, file_offset, len, buf.byte_len())?;
        if stream.context().ordinal() != buf.ordinal() {
            return Err(Error::invalid(
                "stream",
                format!("device {}", stream.context().ordinal()),
                format!("must be on the buffer's device {}", buf.ordinal()),
            ));
        }
        super::bind_device(buf.ordinal())?;
        // check_io: both offsets and both ends are at most i64::MAX.
        let params = Arc::new(Block {
            params: std::cell::UnsafeCell::new(Params {
                size: len,
                file_offset: file_offset as libc::off_t,
                buf_offset: buf_offset as libc::off_t,
                bytes: 0,
            }),
            clamped: AtomicUsize::new(NOT_CLAMPED),
            clamp_errno: AtomicI32::new(0),
        });
        if read {
            // Limit the read to the file's size when the stream reaches it. The callback owns a
            // clone of the block and of the handle, so both outlive it even if the read below
            // cannot be enqueued.
            let (block, handle) = (params.clone(), self.clone());
            Stream::wrap(stream.clone())
                .launch_host_fn(move || block.clamp(&handle, file_offset, len))?;
        }
        let lib = self.inner.driver.lib();
        let base = buf.device_ptr() as *mut libc::c_void;
        let call = if read {
            "cuFileReadAsync"
        } else {
            "cuFileWriteAsync"
        };
        let p: *mut Params = params.params.get();
        let f = if read {
            lib.cuFileReadAsync
        } else {
            lib.cuFileWriteAsync
        };
        let handle = self.inner.handle;
        let ((), (buf, params)) =
            crate::completion::capture::enqueue(stream, call, (buf, params), |raw, _| {
                // SAFETY: every pointer is into the boxed block or the owned buffer, both moved
                // into the tracker below (or leaked by the capture check) and kept until the host
                // callback after this operation has run.
                check(call, unsafe {
                    f(
                        handle,
                        base,
                        &raw mut (*p).size,
                        &raw mut (*p).file_offset,
                        &raw mut (*p).buf_offset,
                        &raw mut (*p).bytes,
                        raw.cast(),
                    )
                })
            })?;
        let resources = AsyncResources {
            buffer: buf,
            handle: self.clone(),
            stream: stream.clone(),
            params,
            call,
            file_offset,
        };
        match fence_after(stream) {
            Ok(flag) => Ok(AsyncIo {
                op: InFlight::new(call, flag, resources),
                stream: stream.clone(),
            }),
            Err(e) => {
                // Completion cannot be proven: leak, never free early.
                std::mem::forget(resources);
                Err(e)
            }
        }
    }
}
