//! The cuFile batch API: set up, submit, poll, cancel, destroy.

use super::context::bind_device;
use super::driver::{Driver, serialized, serialized_call};
use super::file::FileHandle;
use super::range::{check_io, clamp_read, file_size, read_outcome};
use super::status::{check, io_error};
use crate::completion::{Fence, InFlight, InFlightFuture};
use crate::error::{Error, Result};
use crate::memory::{DeviceMemory, DeviceMemoryMut};
use gpudirect_sys::cufile as sys;
use std::future::{Future, IntoFuture};
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// Check a batch capacity against the driver's limit (`max_batch_io_size`, itself a `u32`).
pub(crate) fn check_capacity(capacity: usize, limit: usize) -> Result<()> {
    let limit = limit.min(u32::MAX as usize);
    if capacity == 0 || capacity > limit {
        return Err(Error::LimitExceeded {
            what: "cuFile batch entries",
            requested: capacity,
            limit,
        });
    }
    Ok(())
}

/// The shape of one request, for [`check_requests`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    pub(crate) buf_len: usize,
    pub(crate) buf_offset: usize,
    pub(crate) file_offset: u64,
    pub(crate) len: usize,
    pub(crate) ordinal: usize,
}

/// Check the requests of one submission: at most `capacity`, every range inside its buffer and
/// within `off_t`, every buffer on one device.
pub(crate) fn check_requests(capacity: usize, shapes: &[Shape]) -> Result<()> {
    if shapes.len() > capacity {
        return Err(Error::LimitExceeded {
            what: "cuFile batch entries",
            requested: shapes.len(),
            limit: capacity,
        });
    }
    let Some(first) = shapes.first() else {
        return Ok(());
    };
    for r in shapes {
        check_io("buf_offset", r.buf_offset, r.file_offset, r.len, r.buf_len)?;
        if r.ordinal != first.ordinal {
            return Err(Error::invalid(
                "buffer",
                format!("device {}", r.ordinal),
                format!(
                    "every buffer of a batch is on one device ({})",
                    first.ordinal
                ),
            ));
        }
    }
    Ok(())
}

/// Read or write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchOp {
    /// `CUFILE_READ`: file to buffer.
    Read,
    /// `CUFILE_WRITE`: buffer to file.
    Write,
}

/// One request of a batch, owning its buffer (and a clone of its file handle) until its result.
/// Buffers are [`DeviceMemoryMut`] (owned, never an `Arc`): a batch may read into any of them.
#[derive(Debug)]
pub struct BatchRequest<M: DeviceMemoryMut> {
    /// Read or write.
    pub op: BatchOp,
    /// The registered file.
    pub handle: FileHandle,
    /// The device buffer.
    pub buffer: M,
    /// Byte offset in the buffer.
    pub buf_offset: usize,
    /// Byte offset in the file.
    pub file_offset: u64,
    /// Bytes to move.
    pub len: usize,
}

/// `CUfileStatus_t`, typed; unknown values are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BatchStatus {
    /// `CUFILE_WAITING`.
    Waiting,
    /// `CUFILE_PENDING`.
    Pending,
    /// `CUFILE_INVALID`: ill-formed or not enqueued.
    Invalid,
    /// `CUFILE_CANCELED`.
    Canceled,
    /// `CUFILE_COMPLETE`.
    Complete,
    /// `CUFILE_TIMEOUT`.
    Timeout,
    /// `CUFILE_FAILED`.
    Failed,
    /// A value this crate does not know.
    Unknown(u32),
}

impl BatchStatus {
    /// From the C value (never transmuted).
    pub fn from_raw(v: u32) -> Self {
        match v {
            sys::CUFILE_WAITING => BatchStatus::Waiting,
            sys::CUFILE_PENDING => BatchStatus::Pending,
            sys::CUFILE_INVALID => BatchStatus::Invalid,
            sys::CUFILE_CANCELED => BatchStatus::Canceled,
            sys::CUFILE_COMPLETE => BatchStatus::Complete,
            sys::CUFILE_TIMEOUT => BatchStatus::Timeout,
            sys::CUFILE_FAILED => BatchStatus::Failed,
            other => BatchStatus::Unknown(other),
        }
    }

    /// Whether the request will not change any more.
    pub fn is_final(self) -> bool {
        !matches!(self, BatchStatus::Waiting | BatchStatus::Pending)
    }
}

/// The outcome of one request, with its buffer back.
#[derive(Debug)]
pub struct BatchResult<M: DeviceMemory> {
    /// The request's buffer.
    pub buffer: M,
    /// Its final status.
    pub status: BatchStatus,
    /// Bytes moved, or the error (`ret` negative, or a status other than complete;
    /// [`Error::FileShrank`] when a read's file shrank while it ran).
    pub bytes: Result<usize>,
}

/// A cuFile batch (`cuFileBatchIOSetUp`) of up to `capacity` requests, submitted once.
///
/// The requests' buffers and handles stay owned by the batch until every request has reached a
/// final status. Dropping a batch with requests outstanding cancels it and polls for a bounded
/// time; if they still have not finished, the buffers, handles and the batch are leaked (never
/// freed under the library's feet).
pub struct Batch<M: DeviceMemoryMut> {
    driver: Driver,
    handle: sys::CUfileBatchHandle_t,
    capacity: usize,
    requests: Vec<Option<BatchRequest<M>>>,
    params: Vec<sys::CUfileIOParams_t>,
    outcome: Vec<Option<(BatchStatus, usize)>>,
    /// Per request, the bytes asked of cuFile: a read's length limited to the file's size.
    expected: Vec<usize>,
    outstanding: usize,
    /// Requests could not be proven final within the bounded wait: their buffers, handles and
    /// params were leaked, and the batch is never destroyed or reused.
    leaked: bool,
    /// `cuFileBatchIOSubmit` was called on the handle, even if it failed: a failed submit that
    /// settled may still have events cuFile reports later, whose 1-based cookies would name
    /// another submission's requests, so the handle takes no second one.
    spent: bool,
}

// SAFETY: the batch handle may be used from any thread; all access goes through &mut self.
unsafe impl<M: DeviceMemoryMut> Send for Batch<M> {}

impl<M: DeviceMemoryMut> std::fmt::Debug for Batch<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("capacity", &self.capacity)
            .field("requests", &self.requests.len())
            .field("outstanding", &self.outstanding)
            .finish()
    }
}

impl<M: DeviceMemoryMut> Batch<M> {
    /// `cuFileBatchIOSetUp(&batch, capacity)`—A batch for up to `capacity` requests.
    ///
    /// # Errors
    ///
    /// [`Error::LimitExceeded`] when `capacity` is over the driver's `max_batch_io_size`
    /// ([`Driver::max_batch_entries`]) or 0; [`Error::CuFile`] from `cuFileBatchIOSetUp`.
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/gpudirect-storage/api-reference-guide/index.html#cufilebatchiosetup>
    #[doc(alias = "cuFileBatchIOSetUp")]
    pub fn new(driver: &Driver, capacity: usize) -> Result<Self> {
        check_capacity(capacity, driver.max_batch_entries())?;
        let mut handle: sys::CUfileBatchHandle_t = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; capacity within the limit.
        serialized_call("cuFileBatchIOSetUp", || {
            // SAFETY: as for the call without the lock (above).
            unsafe { (driver.lib().cuFileBatchIOSetUp)(&mut handle, capacity as u32) }
        })?;
        Ok(Batch {
            driver: driver.clone(),
            handle,
            capacity,
            requests: Vec::new(),
            params: Vec::new(),
            outcome: Vec::new(),
            expected: Vec::new(),
            outstanding: 0,
            leaked: false,
            spent: false,
        })
    }

    /// `cuFileBatchIOSubmit(batch, n, params, 0)`—Submit `requests` (at most `capacity`).
    ///
    /// End of file: each read is first limited to its file's size (`fstat`), so a read crossing
    /// the end moves the bytes up to it and leaves every byte of its buffer past them unchanged
    /// (as every read path of this module does); a read at or past the end is not submitted and
    /// completes with 0 bytes.
    ///
    /// # Errors
    ///
    /// [`Error::LimitExceeded`] over capacity; [`Error::InvalidArgument`] for a second submit
    /// (after a failed one too: the handle may still report its events), a range outside a
    /// buffer or past `off_t`, or buffers on different devices; [`Error::Os`]
    /// from `fstat`; [`Error::CuFile`] from `cuFileBatchIOSubmit`. cuFile does not promise that a failed submit enqueued nothing, so
    /// the batch is then canceled and polled for a bounded time (as on drop): the requests are
    /// dropped only if every one is proven final, else they are leaked with the batch.
    #[doc(alias = "cuFileBatchIOSubmit")]
    pub fn submit(&mut self, requests: Vec<BatchRequest<M>>) -> Result<()> {
        if second_submission(!self.requests.is_empty(), self.leaked, self.spent) {
            return Err(Error::invalid(
                "requests",
                "a second submission",
                "a Batch is submitted once (a failed submit too: make another Batch)",
            ));
        }
        let shapes: Vec<Shape> = requests
            .iter()
            .map(|r| Shape {
                buf_len: r.buffer.byte_len(),
                buf_offset: r.buf_offset,
                file_offset: r.file_offset,
                len: r.len,
                ordinal: r.buffer.ordinal(),
            })
            .collect();
        check_requests(self.capacity, &shapes)?;
        let Some(first) = shapes.first() else {
            return Ok(());
        };
        // Reads are limited to the file's size now, so that cuFile is never asked past the end
        // of the file; a request left with nothing to move completes at once, unsubmitted.
        let expected = requests
            .iter()
            .map(|r| match r.op {
                BatchOp::Read => {
                    let size = file_size(r.handle.as_fd())?;
                    Ok(clamp_read(r.file_offset, r.len, size))
                }
                BatchOp::Write => Ok(r.len),
            })
            .collect::<Result<Vec<usize>>>()?;
        bind_device(first.ordinal)?;
        let params: Vec<sys::CUfileIOParams_t> = requests
            .iter()
            .zip(&expected)
            .enumerate()
            .filter(|(_, (_, want))| **want > 0)
            .map(|(i, (r, &want))| {
                // SAFETY: all-zero is valid for this plain struct; fields set below.
                let mut p: sys::CUfileIOParams_t = unsafe { std::mem::zeroed() };
                p.mode = sys::CUFILE_BATCH;
                p.u.batch.devPtr_base = r.buffer.device_ptr() as *mut libc::c_void;
                // check_requests: both offsets and both ends are at most i64::MAX.
                p.u.batch.file_offset = r.file_offset as sys::off_t;
                p.u.batch.devPtr_offset = r.buf_offset as sys::off_t;
                p.u.batch.size = want;
                p.fh = r.handle.as_raw();
                p.opcode = match r.op {
                    BatchOp::Read => sys::CUFILE_READ,
                    BatchOp::Write => sys::CUFILE_WRITE,
                };
                // Cookies are 1-based request indices: a NULL cookie is never handed over.
                p.cookie = (i + 1) as *mut libc::c_void;
                p
            })
            .collect();
        let n = params.len();
        self.outcome = expected
            .iter()
            .map(|&want| (want == 0).then_some((BatchStatus::Complete, 0)))
            .collect();
        self.expected = expected;
        self.params = params;
        self.requests = requests.into_iter().map(Some).collect();
        if n == 0 {
            return Ok(());
        }
        self.spent = true;
        // SAFETY: `params` and every buffer and handle stay owned by `self` until each request
        // reaches a final status.
        let r = check("cuFileBatchIOSubmit", unsafe {
            (self.driver.lib().cuFileBatchIOSubmit)(
                self.handle,
                n as u32, // n <= capacity <= u32::MAX (check_capacity)
                self.params.as_mut_ptr(),
                0,
            )
        });
        if let Err(e) = r {
            // Some requests may have been enqueued all the same: settle them before anything
            // they use is freed.
            self.outstanding = n;
            if self.settle() {
                self.requests.clear();
                self.outcome.clear();
                self.expected.clear();
            }
            return Err(e);
        }
        self.outstanding = n;
        Ok(())
    }

    /// Requests not yet in a final status.
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// `cuFileBatchIOGetStatus(batch, min, &nr, events, timeout)`—Collect completions, waiting up
    /// to `timeout` for at least `min` of them; returns how many requests finished in this call.
    ///
    /// # Errors
    ///
    /// [`Error::CuFile`] from `cuFileBatchIOGetStatus`.
    #[doc(alias = "cuFileBatchIOGetStatus")]
    pub fn poll(&mut self, min: usize, timeout: Duration) -> Result<usize> {
        if self.outstanding == 0 {
            return Ok(0);
        }
        let mut events: Vec<sys::CUfileIOEvents_t> = (0..self.requests.len())
            // SAFETY: all-zero is valid for this plain struct.
            .map(|_| unsafe { std::mem::zeroed() })
            .collect();
        let mut nr = events.len() as u32;
        let mut ts = timespec_of(timeout);
        // SAFETY: `events` holds `nr` entries; valid timespec.
        check("cuFileBatchIOGetStatus", unsafe {
            (self.driver.lib().cuFileBatchIOGetStatus)(
                self.handle,
                min.min(self.outstanding) as u32,
                &mut nr,
                events.as_mut_ptr(),
                &mut ts,
            )
        })?;
        let mut finished = 0;
        for ev in events.iter().take(nr as usize) {
            let i = (ev.cookie as usize).wrapping_sub(1);
            let status = BatchStatus::from_raw(ev.status);
            if i < self.outcome.len() && self.outcome[i].is_none() && status.is_final() {
                self.outcome[i] = Some((status, ev.ret));
                self.outstanding -= 1;
                finished += 1;
            }
        }
        Ok(finished)
    }

    /// `cuFileBatchIOCancel(batch)`—Ask the library to cancel outstanding requests; poll or wait
    /// to learn which were canceled.
    ///
    /// # Errors
    ///
    /// [`Error::CuFile`] from `cuFileBatchIOCancel`.
    #[doc(alias = "cuFileBatchIOCancel")]
    pub fn cancel(&mut self) -> Result<()> {
        // SAFETY: a live batch handle.
        check("cuFileBatchIOCancel", unsafe {
            (self.driver.lib().cuFileBatchIOCancel)(self.handle)
        })
    }

    /// Wait until every request is final; the per-request results, in submission order. The
    /// batch is destroyed (`cuFileBatchIODestroy`).
    ///
    /// # Errors
    ///
    /// [`Error::CuFile`] from `cuFileBatchIOGetStatus`; the batch is then dropped (cancel and a
    /// bounded wait, else leak).
    #[doc(alias = "cuFileBatchIOGetStatus")]
    #[doc(alias = "cuFileBatchIODestroy")]
    pub fn wait(self) -> Result<Vec<BatchResult<M>>> {
        self.wait_timeout(Duration::MAX)
    }

    /// As [`wait`](Self::wait), giving up after `timeout`: then [`Error::Timeout`], and the batch
    /// is dropped (cancel, a bounded wait, else its buffers are leaked).
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`]; [`Error::CuFile`] from `cuFileBatchIOGetStatus`.
    #[doc(alias = "cuFileBatchIOGetStatus")]
    #[doc(alias = "cuFileBatchIODestroy")]
    pub fn wait_timeout(mut self, timeout: Duration) -> Result<Vec<BatchResult<M>>> {
        let start = Instant::now();
        while self.outstanding > 0 {
            if start.elapsed() >= timeout {
                return Err(Error::Timeout {
                    what: "cuFile batch requests",
                    after: timeout,
                });
            }
            self.poll(1, Duration::from_millis(100))?;
        }
        let out = std::mem::take(&mut self.outcome);
        let reqs = std::mem::take(&mut self.requests);
        let expected = std::mem::take(&mut self.expected);
        Ok(reqs
            .into_iter()
            .zip(out)
            .zip(expected)
            .filter_map(|((r, o), want)| Some((r?, o?, want)))
            .map(|(r, (status, ret), want)| {
                let ret = ret as isize; // `ret` is an ssize_t carried in a size_t
                let bytes = match status {
                    BatchStatus::Complete if ret >= 0 => Ok(ret.unsigned_abs()),
                    BatchStatus::Complete => Err(io_error("cuFileBatchIOSubmit", ret)),
                    other => Err(Error::Unsupported {
                        what: "cuFile batch request".into(),
                        reason: format!("ended {other:?} (ret {ret})"),
                    }),
                };
                let bytes = match r.op {
                    BatchOp::Read if want == 0 => Ok(0),
                    BatchOp::Read => {
                        let bytes = match bytes {
                            // Asked only for bytes the file held: an error after it shrank is that.
                            Err(_) if shrank(&r.handle, r.file_offset, want) => Ok(0),
                            b => b,
                        };
                        read_outcome("cuFileBatchIOSubmit", r.file_offset, want, bytes)
                    }
                    BatchOp::Write => bytes,
                };
                BatchResult {
                    buffer: r.buffer,
                    status,
                    bytes,
                }
            })
            .collect())
    }
}

/// A batch shared by its awaited future and the completion thread that polls it.
type Shared<M> = Arc<Mutex<Option<Batch<M>>>>;

fn lock<M: DeviceMemoryMut>(b: &Shared<M>) -> MutexGuard<'_, Option<Batch<M>>> {
    b.lock().unwrap_or_else(|e| e.into_inner())
}

/// The fence of an awaited batch: complete once no request is outstanding. Asked, it collects
/// completions with `cuFileBatchIOGetStatus` without waiting (`min_nr` 0, a zero timeout); it
/// has no wake-up source of its own, so the completion thread asks it with back-off.
struct BatchFence<M: DeviceMemoryMut>(Shared<M>);

impl<M: DeviceMemoryMut> Fence for BatchFence<M> {
    fn is_complete(&self) -> bool {
        self.check().unwrap_or(false)
    }

    fn check(&self) -> Result<bool> {
        let mut g = lock(&self.0);
        let Some(b) = g.as_mut() else {
            return Ok(true);
        };
        if b.outstanding > 0 {
            b.poll(0, Duration::ZERO)?;
        }
        Ok(b.outstanding == 0)
    }
}

/// What an awaited batch owns: the batch itself (its requests' buffers and handles).
struct BatchHold<M: DeviceMemoryMut>(Shared<M>);

impl<M: DeviceMemoryMut> IntoFuture for Batch<M> {
    type Output = Result<Vec<BatchResult<M>>>;
    type IntoFuture = BatchFuture<M>;

    /// Await every request: the per-request results in submission order, as
    /// [`wait`](Batch::wait) gives them.
    fn into_future(self) -> BatchFuture<M> {
        let shared: Shared<M> = Arc::new(Mutex::new(Some(self)));
        let op = InFlight::new(
            "cuFile batch requests",
            BatchFence(shared.clone()),
            BatchHold(shared),
        );
        BatchFuture {
            inner: op.into_future(),
        }
    }
}

impl<M: DeviceMemoryMut> Batch<M> {
    /// Await with a deadline: [`Error::Timeout`] once `at` passes first (see [`BatchFuture`]).
    pub fn deadline(self, at: Instant) -> BatchFuture<M> {
        self.into_future().deadline(at)
    }

    /// Await with a deadline `timeout` from now.
    pub fn timeout(self, timeout: Duration) -> BatchFuture<M> {
        self.into_future().timeout(timeout)
    }
}

/// An awaited [`Batch`] (`batch.await`): the results once every request is final.
///
/// The shared completion thread checks the batch with `cuFileBatchIOGetStatus` (without
/// waiting) between its pauses, 64 µs doubling up to 1 ms while anything is pending (see
/// [`completion`](crate::completion)), and wakes the future when no request is outstanding; each
/// poll of the future checks too. A deadline ([`deadline`](Self::deadline),
/// [`timeout`](Self::timeout)) ends the await with [`Error::Timeout`]; the batch is not
/// canceled: it and its buffers are parked in the [`Tracker`](crate::completion::Tracker) until
/// every request is final, then destroyed and freed. Dropping the future does the same and
/// never blocks (unlike dropping a [`Batch`], which cancels and waits a bounded time).
#[must_use = "futures do nothing unless awaited; dropping it parks the batch until its requests are final"]
pub struct BatchFuture<M: DeviceMemoryMut> {
    inner: InFlightFuture<BatchHold<M>, BatchFence<M>>,
}

impl<M: DeviceMemoryMut> BatchFuture<M> {
    /// End with [`Error::Timeout`] if the requests are not all final by `at`.
    pub fn deadline(self, at: Instant) -> Self {
        BatchFuture {
            inner: self.inner.deadline(at),
        }
    }

    /// [`deadline`](Self::deadline) `timeout` from now.
    pub fn timeout(self, timeout: Duration) -> Self {
        BatchFuture {
            inner: self.inner.timeout(timeout),
        }
    }
}

impl<M: DeviceMemoryMut> Future for BatchFuture<M> {
    type Output = Result<Vec<BatchResult<M>>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.inner).poll(cx).map(|r| {
            let hold = r?;
            let batch = lock(&hold.0).take();
            match batch {
                // Every request is final: no wait is left, only the results.
                Some(b) => b.wait_timeout(Duration::ZERO),
                None => Ok(Vec::new()),
            }
        })
    }
}

impl<M: DeviceMemoryMut> std::fmt::Debug for BatchFuture<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt(f)
    }
}

/// Whether the file behind `handle` now holds fewer than `want` bytes from `file_offset`.
fn shrank(handle: &FileHandle, file_offset: u64, want: usize) -> bool {
    let now = file_size(handle.as_fd()).ok().flatten();
    clamp_read(file_offset, want, now) < want
}

/// `timeout` as a `timespec`, the seconds clamped to `time_t::MAX` (a plain cast of
/// `Duration::MAX`'s seconds would be negative).
fn timespec_of(timeout: Duration) -> libc::timespec {
    libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    }
}

impl<M: DeviceMemoryMut> Batch<M> {
    /// Cancel outstanding requests and poll for a bounded time ([`DROP_WAIT`]); `true` when none
    /// is outstanding any more. Otherwise completion is unproven: the buffers, handles and params
    /// are leaked (never freed under the library's feet) and the batch is marked leaked.
    ///
    /// [`DROP_WAIT`]: crate::completion::DROP_WAIT
    fn settle(&mut self) -> bool {
        if self.leaked {
            return false;
        }
        if self.outstanding > 0 {
            let _ = self.cancel();
            let start = Instant::now();
            while self.outstanding > 0 && start.elapsed() < crate::completion::DROP_WAIT {
                if self.poll(1, Duration::from_millis(50)).is_err() {
                    break;
                }
            }
            if self.outstanding > 0 {
                std::mem::forget(std::mem::take(&mut self.requests));
                std::mem::forget(std::mem::take(&mut self.params));
                self.leaked = true;
                return false;
            }
        }
        true
    }
}

impl<M: DeviceMemoryMut> Drop for Batch<M> {
    fn drop(&mut self) {
        if crate::completion::Tracker::global().in_forked_child() {
            // No cuFile calls and no frees in a forked child: leak the batch and its buffers.
            std::mem::forget(std::mem::take(&mut self.requests));
            std::mem::forget(std::mem::take(&mut self.params));
            return;
        }
        if !self.settle() {
            return; // completion unproven: the buffers, handles and the batch itself are leaked
        }
        // SAFETY: no request is outstanding; destroyed once.
        let (lib, handle) = (self.driver.lib(), self.handle);
        // Refused only in a forked child: the batch is then left allocated.
        let _ = serialized(|| {
            // SAFETY: as for the call without the lock (above).
            unsafe { (lib.cuFileBatchIODestroy)(handle) }
        });
    }
}

/// Run any number of requests as batches of at most the driver's `max_batch_io_size` (with a
/// limit of 128, 200 requests become 128 + 72), one batch at a time (the limit may be per
/// process), each waited up to `timeout`; results in order.
///
/// # Errors
///
/// The first set-up, submit or poll error, or [`Error::Timeout`]; the batch in flight is then
/// dropped (cancel, bounded wait, else leak), later requests are dropped unsubmitted.
pub fn run_batched<M: DeviceMemoryMut>(
    driver: &Driver,
    requests: Vec<BatchRequest<M>>,
    timeout: Duration,
) -> Result<Vec<BatchResult<M>>> {
    let limit = driver.max_batch_entries();
    let mut out = Vec::new();
    let mut it = requests.into_iter().peekable();
    while it.peek().is_some() {
        let chunk: Vec<_> = it.by_ref().take(limit).collect();
        let mut b = Batch::new(driver, chunk.len())?;
        b.submit(chunk)?;
        out.extend(b.wait_timeout(timeout)?);
    }
    Ok(out)
}

/// Whether a submit is a second one: requests are held from an earlier one, the batch was
/// leaked, or the handle was given a submission before (one that failed included).
fn second_submission(holding: bool, leaked: bool, spent: bool) -> bool {
    holding || leaked || spent
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handle_given_a_submission_takes_no_second_even_after_a_failed_one() {
        // A failed submit that settled holds no requests, but its handle was given them.
        assert!(second_submission(false, false, true));
        assert!(second_submission(true, false, false));
        assert!(second_submission(false, true, false));
        assert!(!second_submission(false, false, false), "a fresh batch");
    }

    #[test]
    fn poll_timeouts_clamp_instead_of_going_negative() {
        let ts = timespec_of(Duration::MAX);
        assert_eq!(ts.tv_sec, libc::time_t::MAX);
        assert!(ts.tv_nsec >= 0 && ts.tv_nsec < 1_000_000_000);
        let ts = timespec_of(Duration::from_secs(u64::MAX / 2 + 1));
        assert_eq!(ts.tv_sec, libc::time_t::MAX);
        let ts = timespec_of(Duration::new(3, 500));
        assert_eq!((ts.tv_sec, ts.tv_nsec), (3, 500));
    }

    use proptest::prelude::*;

    fn shape() -> impl Strategy<Value = Shape> {
        (
            prop_oneof![any::<usize>(), 0usize..1 << 16],
            prop_oneof![any::<usize>(), 0usize..1 << 16],
            prop_oneof![any::<u64>(), 0u64..1 << 16],
            prop_oneof![any::<usize>(), 0usize..1 << 16],
            0usize..2,
        )
            .prop_map(|(buf_len, buf_offset, file_offset, len, ordinal)| Shape {
                buf_len,
                buf_offset,
                file_offset,
                len,
                ordinal,
            })
    }

    proptest! {
        #[test]
        fn capacities_are_bounded(capacity: usize, limit: usize) {
            let ok = capacity >= 1 && capacity <= limit && capacity <= u32::MAX as usize;
            prop_assert_eq!(check_capacity(capacity, limit).is_ok(), ok);
        }

        #[test]
        fn requests_are_checked_one_by_one(
            capacity in 0usize..8,
            shapes in proptest::collection::vec(shape(), 0..10),
        ) {
            let each_ok = shapes.iter().all(|r| {
                check_io("buf_offset", r.buf_offset, r.file_offset, r.len, r.buf_len).is_ok()
            });
            let one_device = shapes.iter().all(|r| r.ordinal == shapes[0].ordinal);
            let ok = shapes.len() <= capacity && each_ok && one_device;
            prop_assert_eq!(check_requests(capacity, &shapes).is_ok(), ok);
        }
    }

    #[test]
    fn statuses_are_typed_without_transmute() {
        assert_eq!(BatchStatus::from_raw(0x10), BatchStatus::Complete);
        assert_eq!(BatchStatus::from_raw(0x2), BatchStatus::Pending);
        assert_eq!(BatchStatus::from_raw(0x400), BatchStatus::Unknown(0x400));
        assert!(!BatchStatus::Pending.is_final());
        assert!(BatchStatus::Failed.is_final());
    }
}
