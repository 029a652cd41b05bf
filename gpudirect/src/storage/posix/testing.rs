//! Test fixtures of the POSIX path: a staging in host memory, so that the chunking, the threads
//! and the pipelining run without a GPU.

use super::stage::Staging;
use super::sys::DIRECT_ALIGN;
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Host-memory staging for tests and for measuring the pipeline without a GPU: "device
/// addresses" are offsets into one host buffer; a copy runs when it is waited for, no earlier
/// than `copy_time` after it was queued (a stand-in for the copy engine), and a consumed bounce
/// buffer is poisoned (so a buffer reused before its copy would corrupt the data).
#[derive(Clone)]
pub(crate) struct HostStaging(pub(super) Arc<HostInner>);

pub(crate) struct HostInner {
    device: *mut u8,
    device_len: usize,
    /// Set by the first transfer.
    bounce_len: AtomicUsize,
    copy_time: std::time::Duration,
    /// Poison buffers after use (correctness) or not (throughput).
    poison: bool,
    /// Buffers made (pooling keeps this at threads x depth).
    pub(crate) created: AtomicUsize,
    /// Copies in flight per lane now, and the most ever on one lane.
    pub(super) in_flight: Mutex<std::collections::HashMap<usize, usize>>,
    pub(crate) max_in_flight: AtomicUsize,
    /// Copies in flight on all lanes now, and the most ever at once.
    total_in_flight: AtomicUsize,
    pub(crate) max_total_in_flight: AtomicUsize,
    /// When non-zero, a copy's `wait` holds on (up to 10 s) until this many copies were in
    /// flight at once: a test of the structure (do threads overlap?) that no clock decides.
    gather: usize,
    gave_up: std::sync::atomic::AtomicBool,
    /// The threads that took part.
    pub(crate) threads: Mutex<std::collections::HashSet<std::thread::ThreadId>>,
    /// Idle buffers (a dropped buffer comes back here, as a bounce chunk goes back to its pool).
    pool: Arc<Mutex<Vec<Box<[u8]>>>>,
}

// SAFETY: `device` is written only at disjoint ranges (one per chunk) by the threads of one
// transfer, and read by the test only between transfers; everything else is atomics or mutexes.
unsafe impl Send for HostInner {}
// SAFETY: as above.
unsafe impl Sync for HostInner {}

impl Drop for HostInner {
    fn drop(&mut self) {
        // SAFETY: made from a boxed slice of `device_len` bytes in `HostStaging::new`.
        drop(unsafe {
            Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.device,
                self.device_len,
            ))
        });
    }
}

/// A host bounce buffer: `bounce_len` bytes at a [`DIRECT_ALIGN`]-aligned offset; back to its
/// pool when dropped.
pub(crate) struct HostBuf {
    bytes: Box<[u8]>,
    pool: Arc<Mutex<Vec<Box<[u8]>>>>,
}

impl HostBuf {
    fn start(&mut self) -> *mut u8 {
        let p = self.bytes.as_mut_ptr();
        // SAFETY: over-allocated by DIRECT_ALIGN.
        unsafe { p.add(p.align_offset(DIRECT_ALIGN)) }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        let b = std::mem::take(&mut self.bytes);
        self.pool.lock().unwrap().push(b);
    }
}

/// A queued host copy.
pub(crate) struct HostCopy {
    buf: HostBuf,
    h2d: bool,
    offset: usize,
    len: usize,
    addr: u64,
    lane: usize,
    due: std::time::Instant,
}

impl HostStaging {
    /// A stand-in device of `device_len` bytes filled with `fill`.
    pub(crate) fn new(device_len: usize, fill: u8, copy_time: std::time::Duration) -> Self {
        let device = Box::into_raw(vec![fill; device_len].into_boxed_slice()).cast::<u8>();
        HostStaging(Arc::new(HostInner {
            device,
            device_len,
            bounce_len: AtomicUsize::new(0),
            copy_time,
            poison: true,
            created: AtomicUsize::new(0),
            in_flight: Mutex::new(Default::default()),
            max_in_flight: AtomicUsize::new(0),
            total_in_flight: AtomicUsize::new(0),
            max_total_in_flight: AtomicUsize::new(0),
            gather: 0,
            gave_up: std::sync::atomic::AtomicBool::new(false),
            threads: Mutex::new(Default::default()),
            pool: Arc::new(Mutex::new(Vec::new())),
        }))
    }

    /// Without poisoning (a plain memcpy per copy: for throughput).
    pub(crate) fn unpoisoned(mut self) -> Self {
        Arc::get_mut(&mut self.0).expect("not shared yet").poison = false;
        self
    }

    /// Each copy waits (up to 10 s) until `n` copies were in flight at once.
    pub(crate) fn gathering(mut self, n: usize) -> Self {
        Arc::get_mut(&mut self.0).expect("not shared yet").gather = n;
        self
    }

    /// The staging a transfer gets: this one, for `bounce_len`-byte buffers (one length per
    /// staging).
    pub(crate) fn with_bounce(&self, bounce_len: usize) -> Result<HostStaging> {
        let was = self.0.bounce_len.swap(bounce_len, Ordering::Relaxed);
        assert!(
            was == 0 || was == bounce_len,
            "one bounce length per HostStaging"
        );
        Ok(self.clone())
    }

    /// The stand-in device's bytes (between transfers).
    pub(crate) fn device(&self) -> Vec<u8> {
        // SAFETY: `device_len` bytes, not written while no transfer runs.
        unsafe { std::slice::from_raw_parts(self.0.device, self.0.device_len) }.to_vec()
    }

    /// Fill the stand-in device from `data` at its start (between transfers).
    pub(crate) fn fill(&self, data: &[u8]) {
        assert!(data.len() <= self.0.device_len);
        // SAFETY: in range; no transfer runs.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.0.device, data.len()) };
    }

    fn lane_delta(&self, lane: usize, up: bool) {
        let mut m = self.0.in_flight.lock().unwrap();
        let n = m.entry(lane).or_insert(0);
        if up {
            *n += 1;
            self.0.max_in_flight.fetch_max(*n, Ordering::Relaxed);
            let total = self.0.total_in_flight.fetch_add(1, Ordering::Relaxed) + 1;
            self.0
                .max_total_in_flight
                .fetch_max(total, Ordering::Relaxed);
        } else {
            *n -= 1;
            self.0.total_in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

// SAFETY: buffers are owned boxes over-allocated by DIRECT_ALIGN (so `bounce_len` bytes remain
// after aligning), used by one holder at a time; a queued copy owns its buffer and runs in
// `wait`, which hands the buffer back only after the copy.
unsafe impl Staging for HostStaging {
    type Buf = HostBuf;
    type Pending = HostCopy;

    fn begin(&self) -> Result<()> {
        self.0
            .threads
            .lock()
            .unwrap()
            .insert(std::thread::current().id());
        Ok(())
    }

    fn take(&self) -> Result<HostBuf> {
        let idle = self.0.pool.lock().unwrap().pop();
        let bytes = idle.unwrap_or_else(|| {
            self.0.created.fetch_add(1, Ordering::Relaxed);
            let n = self.0.bounce_len.load(Ordering::Relaxed) + DIRECT_ALIGN;
            vec![0xA5; n].into_boxed_slice()
        });
        Ok(HostBuf {
            bytes,
            pool: self.0.pool.clone(),
        })
    }

    fn ptr(buf: &mut HostBuf) -> *mut u8 {
        buf.start()
    }

    unsafe fn h2d(
        &self,
        lane: usize,
        buf: HostBuf,
        offset: usize,
        len: usize,
        dst: u64,
    ) -> Result<HostCopy> {
        self.lane_delta(lane, true);
        Ok(HostCopy {
            buf,
            h2d: true,
            offset,
            len,
            addr: dst,
            lane,
            due: std::time::Instant::now() + self.0.copy_time,
        })
    }

    unsafe fn d2h(&self, lane: usize, buf: HostBuf, len: usize, src: u64) -> Result<HostCopy> {
        self.lane_delta(lane, true);
        Ok(HostCopy {
            buf,
            h2d: false,
            offset: 0,
            len,
            addr: src,
            lane,
            due: std::time::Instant::now() + self.0.copy_time,
        })
    }

    fn wait(&self, c: HostCopy) -> Result<HostBuf> {
        let HostCopy {
            mut buf,
            h2d,
            offset,
            len,
            addr,
            lane,
            due,
        } = c;
        let now = std::time::Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        if self.0.gather > 0 {
            // Once one copy gave up, the rest go on at once (a failing test takes 10 s, not 10 s
            // a copy).
            let give_up = now + std::time::Duration::from_secs(10);
            while self.0.max_total_in_flight.load(Ordering::Relaxed) < self.0.gather
                && !self.0.gave_up.load(Ordering::Relaxed)
            {
                if std::time::Instant::now() >= give_up {
                    self.0.gave_up.store(true, Ordering::Relaxed);
                }
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        }
        let a = usize::try_from(addr).unwrap();
        assert!(
            a + len <= self.0.device_len,
            "copy inside the stand-in device"
        );
        assert!(
            offset + len <= self.0.bounce_len.load(Ordering::Relaxed),
            "copy inside the bounce buffer"
        );
        let host = buf.start();
        // SAFETY: both ranges checked just above; the device range is this chunk's alone.
        unsafe {
            if h2d {
                std::ptr::copy_nonoverlapping(host.add(offset), self.0.device.add(a), len);
            } else {
                std::ptr::copy_nonoverlapping(self.0.device.add(a), host.add(offset), len);
            }
        }
        if h2d && self.0.poison {
            buf.bytes.fill(0xA5);
        }
        self.lane_delta(lane, false);
        Ok(buf)
    }
}

/// `e` is an [`Error::InvalidArgument`] naming `arg`.
#[track_caller]
pub(super) fn assert_invalid(e: &Error, arg: &str) {
    assert!(
        matches!(e, Error::InvalidArgument { arg: a, .. } if *a == arg),
        "expected an invalid `{arg}`: {e}"
    );
}
