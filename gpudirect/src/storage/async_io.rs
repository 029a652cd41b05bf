//! Stream-ordered cuFile I/O (`cuFileReadAsync`/`cuFileWriteAsync`), owned by the completion
//! tracker until a host callback on the stream has run.
//!
//! # Device buffer offsets
//!
//! In compatibility mode (cuFile 1.15) `cuFileReadAsync` fails with `EIO` whenever the
//! device buffer offset is not 0, where the blocking `cuFileRead` on the same handle and buffer
//! succeeds; offset 0 at the start of a `cuMemAlloc` allocation works, with any file offset and
//! length. So cuFile is only ever handed that shape ([`Target::of`]): a buffer that is
//! [`MemoryKind::Device`] memory starting exactly at its allocation's base
//! (`cuMemGetAddressRange`), at buffer offset 0. Anything else (another offset, a buffer that
//! starts inside an allocation, VMM, pool or host memory) goes through a scratch
//! [`DeviceBuffer`] of its own, used at offset 0 ([`steps`]): a read first copies the
//! destination range into the scratch, reads into the scratch and copies the scratch back, all
//! on the stream, so bytes past the count get their own values back; a write copies the source
//! range into the scratch and writes from there. The scratch is owned by the operation until it
//! completes.

use super::context::bind_device;
use super::file::FileHandle;
use super::range::{check_io, clamp_read, file_size, read_outcome};
use super::status::{check, io_error};
use crate::completion::{Fence, HostFnFence, InFlight, InFlightFuture};
use crate::cuda::Stream;
use crate::driver;
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, DeviceMemory, DeviceMemoryMut, MemoryKind};
use cudarc::driver::{CudaStream, sys};
use std::future::{Future, IntoFuture};
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

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
        let want = match file_size(handle.as_fd()) {
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
    /// The scratch buffer cuFile was pointed at instead of `buffer`, when it was.
    scratch: Option<DeviceBuffer<u8>>,
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
            let now = file_size(self.handle.as_fd()).ok().flatten();
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

    /// Whether the I/O went through a scratch device buffer (a buffer offset other than 0, or a
    /// buffer that is not the start of a `cuMemAlloc` allocation; see the module docs) rather
    /// than cuFile reading or writing `buffer` itself.
    pub fn used_scratch(&self) -> bool {
        self.scratch.is_some()
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
    op: InFlight<AsyncResources<M>, IoFence>,
    /// The stream the operation is queued on (also owned by `op`), to notice a failed stream.
    stream: Arc<CudaStream>,
    /// Whether the I/O goes through a scratch buffer.
    scratch: bool,
}

impl<M: DeviceMemory> std::fmt::Debug for AsyncIo<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.op.fmt(f)
    }
}

impl<M: DeviceMemory> AsyncIo<M> {
    /// Whether the I/O goes through a scratch device buffer ([`AsyncResources::used_scratch`]).
    pub fn uses_scratch(&self) -> bool {
        self.scratch
    }

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

/// The fence of a stream-ordered I/O: the host callback after it, which wakes an await; asked
/// whether it completed, it also reports a stream that failed before reaching the callback (a
/// sticky error: the callback will never run).
struct IoFence {
    flag: HostFnFence,
    stream: Arc<CudaStream>,
}

impl Fence for IoFence {
    fn is_complete(&self) -> bool {
        self.flag.is_complete()
    }

    fn wait_timeout(&self, timeout: Duration) -> bool {
        self.flag.wait_timeout(timeout)
    }

    fn check(&self) -> Result<bool> {
        if self.flag.is_complete() {
            return Ok(true);
        }
        stream_failed(&self.stream)?;
        Ok(self.flag.is_complete())
    }

    fn register_waker(&self, waker: &Waker) -> bool {
        self.flag.register_waker(waker)
    }
}

impl<M: DeviceMemory> IntoFuture for AsyncIo<M> {
    type Output = Result<(M, usize)>;
    type IntoFuture = AsyncIoFuture<M>;

    /// Await the I/O: the buffer and the bytes moved, as [`AsyncIo::wait`] gives them.
    fn into_future(self) -> AsyncIoFuture<M> {
        AsyncIoFuture {
            inner: self.op.into_future(),
        }
    }
}

impl<M: DeviceMemory> AsyncIo<M> {
    /// Await with a deadline: [`Error::Timeout`] once `at` passes first (see [`AsyncIoFuture`]).
    pub fn deadline(self, at: Instant) -> AsyncIoFuture<M> {
        self.into_future().deadline(at)
    }

    /// Await with a deadline `timeout` from now.
    pub fn timeout(self, timeout: Duration) -> AsyncIoFuture<M> {
        self.into_future().timeout(timeout)
    }
}

/// An awaited [`AsyncIo`] (`io.await`, [`AsyncIo::deadline`], [`AsyncIo::timeout`]): the buffer
/// and the bytes moved, or the operation's error ([`AsyncResources::bytes`]).
///
/// Woken by the host callback queued after the I/O (`cuLaunchHostFunc`), on CUDA's callback
/// thread, the moment the stream passes it; each poll also asks `cuStreamQuery` whether the
/// stream failed before reaching it (its error then ends the await). A stream that fails while
/// nobody polls wakes nobody: give awaits a deadline. At the deadline the await ends with
/// [`Error::Timeout`], or with the stream's error when it failed.
///
/// Dropping the future (or a timeout, or a failed stream) parks the buffer, file handle, stream
/// and scratch in the [`Tracker`](crate::completion::Tracker) until the callback has run, never
/// freeing them early; unlike dropping an [`AsyncIo`], it never blocks.
#[must_use = "futures do nothing unless awaited; dropping it parks the I/O's resources until it completes"]
pub struct AsyncIoFuture<M: DeviceMemory> {
    inner: InFlightFuture<AsyncResources<M>, IoFence>,
}

impl<M: DeviceMemory> AsyncIoFuture<M> {
    /// End with [`Error::Timeout`] if the I/O has not completed by `at`.
    pub fn deadline(self, at: Instant) -> Self {
        AsyncIoFuture {
            inner: self.inner.deadline(at),
        }
    }

    /// [`deadline`](Self::deadline) `timeout` from now.
    pub fn timeout(self, timeout: Duration) -> Self {
        AsyncIoFuture {
            inner: self.inner.timeout(timeout),
        }
    }
}

impl<M: DeviceMemory> Future for AsyncIoFuture<M> {
    type Output = Result<(M, usize)>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.inner).poll(cx).map(|r| {
            let r = r?;
            let n = r.bytes()?;
            Ok((r.buffer, n))
        })
    }
}

impl<M: DeviceMemory> std::fmt::Debug for AsyncIoFuture<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt(f)
    }
}

/// `Err` when `stream` has failed (`cuStreamQuery` answers neither success nor not-ready).
fn stream_failed(stream: &CudaStream) -> Result<()> {
    driver::ctx::bind(stream.context())?;
    // SAFETY: a live stream of the current context.
    unsafe { driver::stream::query(stream.cu_stream()) }.map(drop)
}

/// The host-callback fence (the memory module's [`HostFnFence`]) after the operation just queued
/// on `stream`; where the callback cannot be queued, the stream is synchronized instead so that
/// the fence is still truthful.
fn fence_after(stream: &Arc<CudaStream>) -> Result<HostFnFence> {
    match Stream::wrap(stream.clone()).host_fence() {
        Ok(f) => Ok(f),
        Err(_) => {
            driver::ctx::bind(stream.context())?;
            // SAFETY: a valid stream of the current context.
            unsafe { driver::stream::synchronize(stream.cu_stream()) }?;
            let f = HostFnFence::new();
            f.complete(false);
            Ok(f)
        }
    }
}

/// What a stream-ordered I/O holds while its steps are queued: the caller's buffer, the scratch
/// buffer, the argument block.
struct Owned<M> {
    buf: M,
    scratch: Option<DeviceBuffer<u8>>,
    params: Arc<Block>,
}

/// Queue one step through the capture check. `Err` with the error and whether what the step uses
/// may be freed once earlier steps are done (`false`: the step may sit in a CUDA graph, so it
/// must be leaked).
fn enqueue_step(
    stream: &Arc<CudaStream>,
    call: &'static str,
    f: impl FnOnce(sys::CUstream) -> Result<()>,
) -> std::result::Result<(), (Error, bool)> {
    crate::completion::capture::enqueue(stream, call, (), |raw, ()| f(raw))
        .map(drop)
        .map_err(|r| {
            let kept = !r.leaked();
            (r.error, kept)
        })
}

/// Where cuFile reads into or writes from (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    /// The caller's buffer itself.
    Direct,
    /// A scratch device buffer at offset 0, copied from (and, for reads, back to) the caller's
    /// range on the stream.
    Scratch,
}

impl Target {
    /// The one shape cuFile's stream-ordered calls were seen to handle in compatibility mode:
    /// `cuMemAlloc` memory ([`MemoryKind::Device`]) whose pointer `ptr` is its allocation's base
    /// (`allocation_base`, from `cuMemGetAddressRange`; `None` when unknown), at buffer offset 0.
    /// Everything else goes through a scratch buffer.
    pub(crate) fn of(
        kind: MemoryKind,
        ptr: u64,
        buf_offset: usize,
        allocation_base: Option<u64>,
    ) -> Target {
        if kind == MemoryKind::Device && buf_offset == 0 && allocation_base == Some(ptr) {
            Target::Direct
        } else {
            Target::Scratch
        }
    }
}

/// One piece of work a stream-ordered I/O queues, in stream order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// The read's host callback that limits it to the file's size when the stream reaches it.
    Clamp,
    /// `cuMemcpyAsync` of the caller's range into the scratch (a write's data; a read's
    /// destination bytes, so that the copy back restores those past the count).
    CopyToScratch,
    /// `cuFileReadAsync` or `cuFileWriteAsync`.
    Io,
    /// `cuMemcpyAsync` of the scratch back into the caller's range (reads).
    CopyFromScratch,
}

/// The steps of a read (`read`) or write of `len` bytes through `target`, in stream order.
pub(crate) fn steps(read: bool, target: Target, len: usize) -> Vec<Step> {
    let copies = target == Target::Scratch && len > 0;
    let mut v = Vec::with_capacity(4);
    if read {
        v.push(Step::Clamp);
    }
    if copies {
        v.push(Step::CopyToScratch);
    }
    v.push(Step::Io);
    if read && copies {
        v.push(Step::CopyFromScratch);
    }
    v
}

/// The scratch buffer's size for `len` bytes: rounded up to 4 KiB, at least 4 KiB.
pub(crate) fn scratch_bytes(len: usize) -> Option<usize> {
    const PAGE: usize = 4096;
    len.max(1).checked_next_multiple_of(PAGE)
}

/// `cuMemGetAddressRange_v2(ptr)`: the base of the allocation holding `ptr`; `None` when the
/// driver does not say. The buffer's context is current.
fn allocation_base(ptr: u64) -> Option<u64> {
    // SAFETY: the buffer's context is current (the caller's); the driver checks `ptr`.
    match unsafe { driver::mem::address_range(ptr) } {
        Ok((base, size)) if size > 0 => Some(base),
        _ => None,
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
    /// Unless `dst_offset` is 0 and `dst` starts at the base of a `cuMemAlloc` allocation, the
    /// read goes through a scratch device buffer of `len` bytes (rounded up to 4 KiB), with two
    /// device-to-device copies of `len` bytes on `stream` (see the module docs for why):
    /// [`AsyncIo::uses_scratch`] says which.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a range outside `dst` or the file;
    /// [`Error::Cuda`] when the scratch buffer cannot be allocated (nothing was enqueued);
    /// [`Error::CuFile`] from `cuFileReadAsync` (nothing of it was enqueued; `dst` is dropped,
    /// or parked in the [`Tracker`](crate::completion::Tracker) until a copy into the scratch that
    /// was queued before has run);
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
    /// Unless `src_offset` is 0 and `src` starts at the base of a `cuMemAlloc` allocation, the
    /// bytes are first copied (on `stream`) into a scratch device buffer that cuFile writes from.
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
        let user = buf
            .device_ptr()
            .checked_add(buf_offset as u64)
            .ok_or_else(|| {
                Error::invalid(
                    "buf_offset",
                    buf_offset,
                    "the buffer's address + buf_offset passes 2^64",
                )
            })?;
        let ctx = bind_device(buf.ordinal())?;
        let call = if read {
            "cuFileReadAsync"
        } else {
            "cuFileWriteAsync"
        };
        // Refuse a capturing stream before anything else, the scratch allocation included
        // (`cuMemAlloc` while a capture runs would invalidate it). Each step is checked again
        // when it is queued.
        if crate::completion::capture::is_capturing(stream.cu_stream())? {
            return Err(Error::StreamCapturing {
                call,
                enqueued: false,
            });
        }
        let base_of_allocation = (buf.kind() == MemoryKind::Device && buf_offset == 0)
            .then(|| allocation_base(buf.device_ptr()))
            .flatten();
        let target = Target::of(buf.kind(), buf.device_ptr(), buf_offset, base_of_allocation);
        let scratch = match target {
            Target::Direct => None,
            Target::Scratch => {
                let bytes = scratch_bytes(len).ok_or_else(|| {
                    Error::invalid("len", len, "the scratch size overflows when rounded up")
                })?;
                Some(DeviceBuffer::<u8>::alloc(&ctx, bytes)?)
            }
        };
        let (io_base, io_offset) = match &scratch {
            Some(s) => (s.device_ptr(), 0),
            None => (buf.device_ptr(), buf_offset),
        };
        // check_io: both offsets and both ends are at most i64::MAX.
        let params = Arc::new(Block {
            params: std::cell::UnsafeCell::new(Params {
                size: len,
                file_offset: file_offset as libc::off_t,
                buf_offset: io_offset as libc::off_t,
                bytes: 0,
            }),
            clamped: AtomicUsize::new(NOT_CLAMPED),
            clamp_errno: AtomicI32::new(0),
        });
        let lib = self.inner.driver.lib();
        let p: *mut Params = params.params.get();
        let f = if read {
            lib.cuFileReadAsync
        } else {
            lib.cuFileWriteAsync
        };
        let handle = self.inner.handle;
        let owned = Owned {
            buf,
            scratch,
            params,
        };
        // Whether work that uses `owned` is on the stream: from then on a failure parks it.
        let mut queued = false;
        for step in steps(read, target, len) {
            let r = match step {
                Step::Clamp => {
                    // Limit the read to the file's size when the stream reaches it. The callback
                    // owns a clone of the block and of the handle (not `owned`), so both outlive
                    // it even if nothing after it can be enqueued.
                    let (block, fh) = (owned.params.clone(), self.clone());
                    Stream::wrap(stream.clone())
                        .launch_host_fn(move || block.clamp(&fh, file_offset, len))
                        .map(drop)
                        .map_err(|e| (e, true))
                }
                Step::CopyToScratch | Step::CopyFromScratch => {
                    let to_scratch = step == Step::CopyToScratch;
                    let scratch = owned.scratch.as_ref().map_or(0, |s| s.device_ptr());
                    let (dst, src) = if to_scratch {
                        (scratch, user)
                    } else {
                        (user, scratch)
                    };
                    enqueue_step(stream, "cuMemcpyAsync", |raw| {
                        // SAFETY: both ranges are `len` bytes inside memory `owned` holds (the
                        // checked buffer range, the scratch of at least `len` bytes), kept until
                        // the fence after the last step has been passed; UVA lets the driver
                        // tell device from host-mapped memory.
                        unsafe { driver::mem::copy_async(dst, src, len, raw) }
                    })
                }
                Step::Io => enqueue_step(stream, call, |raw| {
                    // SAFETY: every pointer is into the shared block or the owned (scratch)
                    // buffer, all kept in `owned` until the host callback after the last step
                    // has run (or leaked by the capture check).
                    check(call, unsafe {
                        f(
                            handle,
                            io_base as *mut libc::c_void,
                            &raw mut (*p).size,
                            &raw mut (*p).file_offset,
                            &raw mut (*p).buf_offset,
                            &raw mut (*p).bytes,
                            raw.cast(),
                        )
                    })
                }),
            };
            match r {
                Ok(()) => queued |= step != Step::Clamp,
                Err((error, kept)) => {
                    if kept && queued {
                        // Earlier steps may still use what `owned` holds: keep it until the
                        // stream has passed them (leak when that cannot be proven).
                        match fence_after(stream) {
                            Ok(fence) => crate::completion::Tracker::global().park(fence, owned),
                            Err(_) => std::mem::forget(owned),
                        }
                    } else if !kept {
                        // The capture check leaked it already (the work may be in a graph).
                        std::mem::forget(owned);
                    }
                    return Err(error);
                }
            }
        }
        let scratch_used = owned.scratch.is_some();
        let resources = AsyncResources {
            buffer: owned.buf,
            scratch: owned.scratch,
            handle: self.clone(),
            stream: stream.clone(),
            params: owned.params,
            call,
            file_offset,
        };
        match fence_after(stream) {
            Ok(flag) => Ok(AsyncIo {
                op: InFlight::new(
                    call,
                    IoFence {
                        flag,
                        stream: stream.clone(),
                    },
                    resources,
                ),
                stream: stream.clone(),
                scratch: scratch_used,
            }),
            Err(e) => {
                // Completion cannot be proven: leak, never free early.
                std::mem::forget(resources);
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: u64 = 0x7f12_3460_0000;

    #[test]
    fn only_offset_zero_at_a_cumemalloc_base_goes_to_cufile_directly() {
        let dev = MemoryKind::Device;
        // The shape seen to work: offset 0 on the allocation's own base.
        assert_eq!(Target::of(dev, BASE, 0, Some(BASE)), Target::Direct);
        // The shapes seen to fail (EIO): any other buffer offset, aligned or not.
        for off in [1, 100, 4095, 4096, 8192] {
            assert_eq!(
                Target::of(dev, BASE, off, Some(BASE)),
                Target::Scratch,
                "{off}"
            );
        }
        // A buffer that starts inside its allocation (a sub-buffer), even 4 KiB aligned.
        assert_eq!(Target::of(dev, BASE + 4096, 0, Some(BASE)), Target::Scratch);
        // The base unknown (the driver did not answer).
        assert_eq!(Target::of(dev, BASE, 0, None), Target::Scratch);
        // Other kinds: not the proven shape.
        for kind in [
            MemoryKind::Vmm,
            MemoryKind::Pool,
            MemoryKind::PinnedHost,
            MemoryKind::RegisteredHost,
        ] {
            assert_eq!(
                Target::of(kind, BASE, 0, Some(BASE)),
                Target::Scratch,
                "{kind:?}"
            );
        }
    }

    #[test]
    fn a_read_through_scratch_restores_the_bytes_past_the_count() {
        use Step::*;
        assert_eq!(steps(true, Target::Direct, 8192), [Clamp, Io]);
        // The destination range goes into the scratch first, so the copy back (which has to copy
        // the whole requested length: the count is only known when the stream runs) writes the
        // bytes past the count with their own values.
        assert_eq!(
            steps(true, Target::Scratch, 8192),
            [Clamp, CopyToScratch, Io, CopyFromScratch]
        );
        assert_eq!(steps(false, Target::Direct, 8192), [Io]);
        assert_eq!(steps(false, Target::Scratch, 8192), [CopyToScratch, Io]);
        // Nothing to copy for an empty request.
        assert_eq!(steps(true, Target::Scratch, 0), [Clamp, Io]);
        assert_eq!(steps(false, Target::Scratch, 0), [Io]);
    }

    /// What a read through the scratch leaves in the destination, modelled on the host: cuFile
    /// writes `count` bytes (the request limited to the file's size at stream time) at the
    /// scratch's start; the steps run in order.
    fn model_read(dst: &mut [u8], off: usize, len: usize, file: &[u8], count: usize) {
        let mut scratch = vec![0xEEu8; scratch_bytes(len).unwrap()];
        for step in steps(true, Target::Scratch, len) {
            match step {
                Step::Clamp => {}
                Step::CopyToScratch => scratch[..len].copy_from_slice(&dst[off..off + len]),
                Step::Io => scratch[..count].copy_from_slice(&file[..count]),
                Step::CopyFromScratch => dst[off..off + len].copy_from_slice(&scratch[..len]),
            }
        }
    }

    #[test]
    fn modelled_reads_change_only_the_bytes_read() {
        let file: Vec<u8> = (0..4000u32).map(|i| (i * 7 + 3) as u8).collect();
        for (off, len, count) in [
            (100, 8192, 4000),
            (0, 8192, 0),
            (3, 4000, 4000),
            (100, 1, 1),
        ] {
            let mut dst = vec![0xCDu8; 100 + 8192 + 100];
            model_read(&mut dst, off, len, &file, count);
            assert_eq!(&dst[off..off + count], &file[..count]);
            for (i, &b) in dst.iter().enumerate() {
                if !(off..off + count).contains(&i) {
                    assert_eq!(b, 0xCD, "byte {i} outside the {count} read changed");
                }
            }
        }
    }

    #[test]
    fn the_scratch_is_whole_pages_and_never_empty() {
        assert_eq!(scratch_bytes(0), Some(4096));
        assert_eq!(scratch_bytes(1), Some(4096));
        assert_eq!(scratch_bytes(4096), Some(4096));
        assert_eq!(scratch_bytes(4097), Some(8192));
        assert_eq!(scratch_bytes(usize::MAX), None);
    }
}
