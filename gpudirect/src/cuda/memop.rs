//! Stream memory operations: wait on and write 32- and 64-bit values from a stream
//! (`cuStreamWaitValue32_v2`, `cuStreamWriteValue64_v2`, `cuStreamBatchMemOp_v2`, ...).
//!
//! The words, their lifetime and the hazards are described on [`MemopFlags`].

use super::Stream;
use super::private::on_private_stream;
use crate::completion::capture::Refused;
use crate::completion::forked;
use crate::completion::{DROP_WAIT, Fence, StreamFence};
use crate::driver;
use crate::driver::ctx::bind;
use crate::error::{Error, Result, from_driver};
use cudarc::driver::{CudaContext, sys};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The most operations one `cuStreamBatchMemOp_v2` call takes (the limit the driver was seen to
/// take: `docs/soundness.md`); longer batches are split into calls of at most this many, queued
/// in order on the stream.
pub const MAX_BATCH_MEM_OPS: usize = 255;

/// The symbols the memory operations need.
pub const MEMOP_SYMBOLS: &[&str] = &[
    "cuStreamWaitValue32_v2",
    "cuStreamWaitValue64_v2",
    "cuStreamWriteValue32_v2",
    "cuStreamWriteValue64_v2",
    "cuStreamBatchMemOp_v2",
];

/// When a wait operation lets the stream go on (`CUstreamWaitValue_flags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum WaitCondition {
    /// `CU_STREAM_WAIT_VALUE_GEQ`: `(int32_t)(*addr - value) >= 0` (wrap-around aware).
    Geq = 0,
    /// `CU_STREAM_WAIT_VALUE_EQ`: `*addr == value`.
    Eq = 1,
    /// `CU_STREAM_WAIT_VALUE_AND`: `(*addr & value) != 0`.
    And = 2,
    /// `CU_STREAM_WAIT_VALUE_NOR`: `~(*addr | value) != 0`.
    Nor = 3,
}

/// One operation of a batch ([`Stream::batch_mem_ops`]). `slot` indexes the 64-bit slots of a
/// [`MemopFlags`]; 32-bit operations use the slot's first 4 bytes (its low half).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemOp {
    /// Wait until the 32-bit word satisfies `cond` against `value`.
    Wait32 {
        /// Slot index.
        slot: usize,
        /// Operand.
        value: u32,
        /// Condition.
        cond: WaitCondition,
    },
    /// Write a 32-bit value.
    Write32 {
        /// Slot index.
        slot: usize,
        /// Value.
        value: u32,
    },
    /// Wait until the 64-bit word satisfies `cond` against `value`.
    Wait64 {
        /// Slot index.
        slot: usize,
        /// Operand.
        value: u64,
        /// Condition.
        cond: WaitCondition,
    },
    /// Write a 64-bit value.
    Write64 {
        /// Slot index.
        slot: usize,
        /// Value.
        value: u64,
    },
}

impl MemOp {
    fn slot(&self) -> usize {
        match *self {
            MemOp::Wait32 { slot, .. }
            | MemOp::Write32 { slot, .. }
            | MemOp::Wait64 { slot, .. }
            | MemOp::Write64 { slot, .. } => slot,
        }
    }
    fn is_64(&self) -> bool {
        matches!(self, MemOp::Wait64 { .. } | MemOp::Write64 { .. })
    }
    fn cond(&self) -> Option<WaitCondition> {
        match *self {
            MemOp::Wait32 { cond, .. } | MemOp::Wait64 { cond, .. } => Some(cond),
            _ => None,
        }
    }

    /// The driver's parameter block for this operation on the word at `address`.
    fn params(&self, address: u64) -> sys::CUstreamBatchMemOpParams {
        use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWaitValueParams_st as Wait;
        use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWaitValueParams_st__bindgen_ty_1 as WaitV;
        use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st as Write;
        use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st__bindgen_ty_1 as WriteV;
        use sys::CUstreamBatchMemOpType as T;
        let wait = |operation, cond: WaitCondition, v| Wait {
            operation,
            address,
            __bindgen_anon_1: v,
            flags: cond as u32,
            alias: 0,
        };
        let write = |operation, v| Write {
            operation,
            address,
            __bindgen_anon_1: v,
            flags: 0,
            alias: 0,
        };
        // The union's unused bytes stay zero.
        let mut p = std::mem::MaybeUninit::<sys::CUstreamBatchMemOpParams>::zeroed();
        let u = p.as_mut_ptr();
        // SAFETY: writing one member of a zeroed C union through a valid pointer; a union of
        // plain C data is initialised by any member write.
        unsafe {
            match *self {
                MemOp::Wait32 { value, cond, .. } => {
                    (*u).waitValue = wait(
                        T::CU_STREAM_MEM_OP_WAIT_VALUE_32,
                        cond,
                        WaitV {
                            value64: value as u64,
                        },
                    )
                }
                MemOp::Wait64 { value, cond, .. } => {
                    (*u).waitValue = wait(
                        T::CU_STREAM_MEM_OP_WAIT_VALUE_64,
                        cond,
                        WaitV { value64: value },
                    )
                }
                MemOp::Write32 { value, .. } => {
                    (*u).writeValue = write(
                        T::CU_STREAM_MEM_OP_WRITE_VALUE_32,
                        WriteV {
                            value64: value as u64,
                        },
                    )
                }
                MemOp::Write64 { value, .. } => {
                    (*u).writeValue = write(
                        T::CU_STREAM_MEM_OP_WRITE_VALUE_64,
                        WriteV { value64: value },
                    )
                }
            }
            p.assume_init()
        }
    }
}

/// Split `n` operations into driver calls of at most [`MAX_BATCH_MEM_OPS`]: the chunk sizes.
pub fn batch_chunks(n: usize) -> impl Iterator<Item = usize> {
    batch_spans(n).map(|(_, len)| len)
}

/// [`batch_chunks`] with each chunk's first index.
pub(crate) fn batch_spans(n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n)
        .step_by(MAX_BATCH_MEM_OPS)
        .map(move |start| (start, (n - start).min(MAX_BATCH_MEM_OPS)))
}

/// The most 64-bit words one [`MemopFlags`] holds (8 MiB of words): flags are a handful of
/// counters, and the bound keeps every slot address arithmetic far from overflow.
pub const MAX_FLAG_SLOTS: usize = 1 << 20;

/// The byte size of `slots` words, checked: at least 1 and at most [`MAX_FLAG_SLOTS`].
pub(crate) fn flag_bytes(slots: usize) -> Result<usize> {
    if slots == 0 || slots > MAX_FLAG_SLOTS {
        return Err(Error::invalid(
            "slots",
            slots,
            format!("must be between 1 and {MAX_FLAG_SLOTS}"),
        ));
    }
    Ok(slots * 8)
}

/// The device address of word `slot` of `slots` words at `base`, checked.
pub(crate) fn slot_addr(base: u64, slots: usize, slot: usize) -> Result<u64> {
    if slot >= slots {
        return Err(Error::invalid(
            "slot",
            slot,
            format!("must be below the {slots} slots"),
        ));
    }
    (slot as u64)
        .checked_mul(8)
        .and_then(|off| base.checked_add(off))
        .ok_or_else(|| Error::invalid("slot", slot, "address overflows 64 bits"))
}

#[derive(Debug)]
enum Backing {
    Host(*mut u64),
    Device,
}

/// 64-bit words for stream memory operations (`cuStreamWaitValue32_v2`,
/// `cuStreamWriteValue64_v2`, `cuStreamBatchMemOp_v2`, ...: [`Stream::wait_value32`] and its
/// siblings, [`Stream::batch_mem_ops`]).
///
/// The words live in pinned host memory mapped for the device
/// (`cuMemHostAlloc` with `DEVICEMAP`), which the host reads and writes atomically, or device
/// memory (`cuMemAlloc`). The words are never exposed as `&`/`&mut`: the host uses
/// [`MemopFlags::load_u32`]/[`MemopFlags::store_u32`] and friends (atomics on host memory).
///
/// The `_v2` entry points are used (the legacy ones answer `CUDA_ERROR_NOT_SUPPORTED` on recent
/// GPUs); they are checked for with our own loader before cudarc calls them. 32-bit operations
/// are always available with the v2 API on CUDA 12 drivers; 64-bit ones are gated on
/// `CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS`, [`WaitCondition::Nor`] on
/// `CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR`.
///
/// Lifetime: an operation queued on a stream keeps using the word until the stream passes it.
/// [`MemopFlags`] remembers the latest [`StreamFence`] of every stream that used it; its drop
/// waits (bounded) for them and leaks the memory when it cannot prove they completed.
///
/// Deadlock hazard (driver behaviour, docs/p2p.md): `cuMemFree` and `cuMemFreeHost`
/// synchronize the device. While a stream waits on a word that thread T will set, T must not free
/// CUDA memory (drop a buffer, or let [`crate::completion::Tracker::reap`] or an allocation reap
/// one): the free waits for the stream, which waits for T. Allocate before queueing the wait and
/// free after setting the word.
#[derive(Debug)]
pub struct MemopFlags {
    backing: Backing,
    dptr: u64,
    slots: usize,
    ctx: Arc<CudaContext>,
    pid: u32,
    can_64: bool,
    can_nor: bool,
    users: Mutex<Vec<StreamFence>>,
    /// Set when an operation on the words may sit in a CUDA graph: the words are never freed.
    captured: AtomicBool,
}

// SAFETY: the words are only accessed atomically or through the driver.
unsafe impl Send for MemopFlags {}
// SAFETY: as above.
unsafe impl Sync for MemopFlags {}

impl MemopFlags {
    fn check(ctx: &Arc<CudaContext>, slots: usize) -> Result<(usize, bool, bool)> {
        let bytes = flag_bytes(slots)?;
        crate::cuda::init()?;
        gpudirect_sys::cuda::require_symbols(MEMOP_SYMBOLS)?;
        use sys::CUdevice_attribute as A;
        let a = |attr| {
            ctx.attribute(attr)
                .map_err(|e| from_driver("cuDeviceGetAttribute", e))
        };
        let can_64 = a(A::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS)? != 0;
        let can_nor = a(A::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR)? != 0;
        Ok((bytes, can_64, can_nor))
    }

    /// `slots` zeroed 64-bit words in pinned host memory mapped for the device
    /// (`cuMemHostAlloc(PORTABLE | DEVICEMAP)`): the host polls and sets them atomically.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for `slots` of 0 or past [`MAX_FLAG_SLOTS`]; [`Error::Load`]
    /// without libcuda or when the driver lacks the `_v2` memop symbols; [`Error::Cuda`].
    #[doc(alias = "cuMemHostAlloc")]
    pub fn pinned_host(ctx: &Arc<CudaContext>, slots: usize) -> Result<Self> {
        let (bytes, can_64, can_nor) = Self::check(ctx, slots)?;
        bind(ctx)?;
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: context current; valid flags.
        let p = unsafe { driver::mem::host_alloc(bytes, flags) }?;
        // SAFETY: fresh allocation of `bytes` bytes.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, bytes) };
        // SAFETY: mapped pinned memory of the current context.
        let dptr = match unsafe { driver::mem::host_device_pointer(p) } {
            Ok(d) => d,
            Err(e) => {
                // SAFETY: allocated above, unused.
                let _ = unsafe { driver::mem::free_host(p) };
                return Err(e);
            }
        };
        Ok(MemopFlags {
            backing: Backing::Host(p.cast()),
            dptr,
            slots,
            ctx: ctx.clone(),
            pid: std::process::id(),
            can_64,
            can_nor,
            users: Mutex::new(Vec::new()),
            captured: AtomicBool::new(false),
        })
    }

    /// `slots` zeroed 64-bit words in device memory (`cuMemAlloc`).
    ///
    /// # Errors
    ///
    /// As [`pinned_host`](Self::pinned_host).
    #[doc(alias = "cuMemAlloc_v2")]
    pub fn device(ctx: &Arc<CudaContext>, slots: usize) -> Result<Self> {
        let (bytes, can_64, can_nor) = Self::check(ctx, slots)?;
        bind(ctx)?;
        // SAFETY: context current.
        let dptr = unsafe { driver::mem::alloc(bytes) }?;
        let flags = MemopFlags {
            backing: Backing::Device,
            dptr,
            slots,
            ctx: ctx.clone(),
            pid: std::process::id(),
            can_64,
            can_nor,
            users: Mutex::new(Vec::new()),
            captured: AtomicBool::new(false),
        };
        // Not cuCtxSynchronize: that would wait for every stream of the context.
        on_private_stream(ctx, |stream| {
            // SAFETY: the allocation above, synchronized before use; a live stream.
            unsafe { driver::mem::memset_d8_async(dptr, 0, bytes, stream) }
        })?;
        Ok(flags)
    }

    /// Number of 64-bit slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Whether the words are host memory.
    pub fn is_host(&self) -> bool {
        matches!(self.backing, Backing::Host(_))
    }

    /// Whether 64-bit operations are available on this device.
    pub fn supports_64_bit(&self) -> bool {
        self.can_64
    }

    /// The device address of `slot`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a slot past the end.
    pub fn device_ptr(&self, slot: usize) -> Result<u64> {
        slot_addr(self.dptr, self.slots, slot)
    }

    fn check_slot(&self, slot: usize) -> Result<()> {
        slot_addr(self.dptr, self.slots, slot).map(drop)
    }

    /// Read slot `slot` as 64 bits (Acquire on host memory; on device memory a copy on a private
    /// non-blocking stream, synchronized: it never waits for the context's other streams).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a slot past the end; for device words, [`Error::Cuda`] from
    /// the copy.
    pub fn load_u64(&self, slot: usize) -> Result<u64> {
        self.check_slot(slot)?;
        match self.backing {
            Backing::Host(p) => {
                // SAFETY: in bounds, 8-byte aligned (page-aligned base), live while `self` is;
                // every access to the word is atomic (host) or by the device.
                let a = unsafe { AtomicU64::from_ptr(p.add(slot)) };
                Ok(a.load(Ordering::Acquire))
            }
            Backing::Device => {
                let mut v = 0u64;
                on_private_stream(&self.ctx, |stream| {
                    let src = self.device_ptr(slot)?;
                    // SAFETY: 8 bytes in bounds of the allocation into a local, which outlives
                    // the copy (the stream is synchronized before `on_private_stream` returns).
                    unsafe {
                        driver::mem::copy_dtoh_async((&mut v as *mut u64).cast(), src, 8, stream)
                    }
                })?;
                Ok(v)
            }
        }
    }

    /// Write slot `slot` as 64 bits (Release on host memory; on device memory a copy on a private
    /// non-blocking stream, synchronized: it never waits for the context's other streams, one of
    /// which may be blocked in a wait this store releases).
    ///
    /// # Errors
    ///
    /// As [`load_u64`](Self::load_u64).
    pub fn store_u64(&self, slot: usize, value: u64) -> Result<()> {
        self.check_slot(slot)?;
        match self.backing {
            Backing::Host(p) => {
                // SAFETY: as in `load_u64`.
                let a = unsafe { AtomicU64::from_ptr(p.add(slot)) };
                a.store(value, Ordering::Release);
                Ok(())
            }
            Backing::Device => {
                // On a private non-blocking stream, synchronized: the write is visible when this
                // returns, without waiting for the context's other streams (one of them may be
                // blocked in a wait that this write releases).
                on_private_stream(&self.ctx, |stream| {
                    let dst = self.device_ptr(slot)?;
                    // SAFETY: 8 bytes in bounds of the allocation, from a local that outlives
                    // the copy (the stream is synchronized before `on_private_stream` returns).
                    unsafe {
                        driver::mem::copy_htod_async(dst, (&value as *const u64).cast(), 8, stream)
                    }
                })
            }
        }
    }

    /// Raise slot `slot` to `value` if it holds less (one atomic `fetch_max` on host memory;
    /// on device memory a read then a write, not atomic against the device).
    ///
    /// # Errors
    ///
    /// As [`load_u64`](Self::load_u64).
    #[cfg_attr(
        not(feature = "transfer"),
        allow(dead_code, reason = "the transfer engine's stream proxy uses it")
    )]
    pub(crate) fn raise_u64(&self, slot: usize, value: u64) -> Result<()> {
        self.check_slot(slot)?;
        match self.backing {
            Backing::Host(p) => {
                // SAFETY: as in `load_u64`.
                let a = unsafe { AtomicU64::from_ptr(p.add(slot)) };
                a.fetch_max(value, Ordering::AcqRel);
                Ok(())
            }
            Backing::Device => {
                if self.load_u64(slot)? < value {
                    self.store_u64(slot, value)?;
                }
                Ok(())
            }
        }
    }

    /// Read the low 32 bits of slot `slot` (the word 32-bit operations use).
    ///
    /// # Errors
    ///
    /// As [`load_u64`](Self::load_u64).
    pub fn load_u32(&self, slot: usize) -> Result<u32> {
        self.check_slot(slot)?;
        match self.backing {
            Backing::Host(p) => {
                // SAFETY: the slot's first 4 bytes: in bounds, 4-byte aligned; atomic access only.
                let a = unsafe { AtomicU32::from_ptr(p.add(slot).cast::<u32>()) };
                Ok(a.load(Ordering::Acquire))
            }
            Backing::Device => Ok(self.load_u64(slot)? as u32),
        }
    }

    /// Write the low 32 bits of slot `slot`.
    ///
    /// # Errors
    ///
    /// As [`load_u64`](Self::load_u64).
    pub fn store_u32(&self, slot: usize, value: u32) -> Result<()> {
        self.check_slot(slot)?;
        match self.backing {
            Backing::Host(p) => {
                // SAFETY: as in `load_u32`.
                let a = unsafe { AtomicU32::from_ptr(p.add(slot).cast::<u32>()) };
                a.store(value, Ordering::Release);
                Ok(())
            }
            Backing::Device => {
                // As in `store_u64`: a private non-blocking stream, never cuCtxSynchronize.
                on_private_stream(&self.ctx, |stream| {
                    let dst = self.device_ptr(slot)?;
                    // SAFETY: 4 bytes in bounds, from a local that outlives the copy.
                    unsafe {
                        driver::mem::copy_htod_async(dst, (&value as *const u32).cast(), 4, stream)
                    }
                })
            }
        }
    }

    fn validate(&self, stream: &Stream, ops: &[MemOp]) -> Result<()> {
        // Refused here, not only by the enqueue: a refused call still notes the stream as a
        // user of the words (`note`), and a fence of this stream never completes, so the
        // words' drop would wait for it, then leak them.
        crate::completion::capture::refuse_per_thread(stream.cu_stream())?;
        if stream.context().cu_ctx() != self.ctx.cu_ctx() && !self.is_host() {
            return Err(Error::invalid(
                "stream",
                format!("device {}", stream.context().ordinal()),
                format!("must be on the flags' device {}", self.ctx.ordinal()),
            ));
        }
        for op in ops {
            self.check_slot(op.slot())?;
            if op.is_64() && !self.can_64 {
                return Err(Error::Unsupported {
                    what: "64-bit stream memory operations".into(),
                    reason: "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS is 0".into(),
                });
            }
            if op.cond() == Some(WaitCondition::Nor) && !self.can_nor {
                return Err(Error::Unsupported {
                    what: "CU_STREAM_WAIT_VALUE_NOR".into(),
                    reason: "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR is 0".into(),
                });
            }
        }
        Ok(())
    }

    /// Queue work that writes word `slot` on `stream` through the capture-checked path (`f`
    /// gets the raw stream, the word's device address and `keep`), remembered as a use of the
    /// words as the memory operations are: a kernel that stores a word.
    #[cfg_attr(
        not(feature = "transfer"),
        allow(dead_code, reason = "the transfer engine's stream proxy uses it")
    )]
    pub(crate) fn enqueue_writing<R, T>(
        &self,
        stream: &Stream,
        slot: usize,
        call: &'static str,
        keep: R,
        f: impl FnOnce(sys::CUstream, u64, &R) -> Result<T>,
    ) -> Result<(T, R), Refused<R>> {
        let checked = self
            .validate(stream, &[])
            .and_then(|()| self.device_ptr(slot));
        let addr = match checked {
            Ok(a) => a,
            Err(error) => {
                return Err(Refused {
                    error,
                    kept: Some(keep),
                });
            }
        };
        let r = stream.enqueue(call, keep, |s, k| f(s, addr, k));
        self.note(stream, &r);
        r
    }

    /// After queueing on `stream`: remember the use, or (when the operations may sit in a CUDA
    /// graph) make sure the words are never freed.
    fn queued<T>(&self, stream: &Stream, r: Result<(T, ()), Refused<()>>) -> Result<T> {
        self.note(stream, &r);
        r.map(|(t, ())| t).map_err(|refused| refused.error)
    }

    /// [`queued`](Self::queued)'s bookkeeping, whatever the work was given to keep.
    fn note<T, R>(&self, stream: &Stream, r: &Result<(T, R), Refused<R>>) {
        match r {
            Err(refused) if refused.leaked() => self.captured.store(true, Ordering::Release),
            // Refused before anything was queued: not a use (a fence of a capturing stream
            // would hold the words' drop until the capture ends).
            Err(Refused {
                error:
                    Error::StreamCapturing {
                        enqueued: false, ..
                    },
                ..
            }) => {}
            // Done, or a failed call, which may have queued part of a batch.
            _ => self.used_by(stream),
        }
    }

    /// Remember that `stream` has used the words up to now.
    fn used_by(&self, stream: &Stream) {
        let fence = stream.fence();
        let mut g = self.users.lock().unwrap_or_else(|e| e.into_inner());
        match g
            .iter_mut()
            .find(|f| Arc::ptr_eq(f.timeline(), fence.timeline()))
        {
            Some(f) => *f = fence,
            None => g.push(fence),
        }
    }
}

impl Drop for MemopFlags {
    fn drop(&mut self) {
        if forked(self.pid) {
            return;
        }
        if *self.captured.get_mut() {
            return; // an operation on the words may run at every launch of a graph: leak
        }
        let users = std::mem::take(self.users.get_mut().unwrap_or_else(|e| e.into_inner()));
        if !users.iter().all(|f| f.wait_timeout(DROP_WAIT)) {
            return; // a stream may still wait on or write the words: leak them
        }
        if bind(&self.ctx).is_err() {
            return;
        }
        // SAFETY: allocated by `pinned_host`/`device`, freed once; every stream that used it
        // has passed it.
        let _ = unsafe {
            match self.backing {
                Backing::Host(p) => driver::mem::free_host(p.cast()),
                Backing::Device => driver::mem::free(self.dptr),
            }
        };
    }
}

impl Stream {
    fn one_op(&self, flags: &MemopFlags, op: MemOp) -> Result<()> {
        flags.validate(self, std::slice::from_ref(&op))?;
        let addr = flags.device_ptr(op.slot())?;
        let call = match op {
            MemOp::Wait32 { .. } => "cuStreamWaitValue32_v2",
            MemOp::Write32 { .. } => "cuStreamWriteValue32_v2",
            MemOp::Wait64 { .. } => "cuStreamWaitValue64_v2",
            MemOp::Write64 { .. } => "cuStreamWriteValue64_v2",
        };
        let r = self.enqueue(call, (), |s, ()| {
            // SAFETY: symbols checked in MemopFlags::check; `addr` is a live, aligned word of
            // `flags`, which outlives the operation (its drop waits for this stream's fence, and
            // leaks the words if the operation may sit in a graph); 64-bit operations were
            // checked against the device in `validate`.
            unsafe {
                match op {
                    MemOp::Wait32 { value, cond, .. } => {
                        driver::memop::wait_value32(s, addr, value, cond as u32)
                    }
                    MemOp::Write32 { value, .. } => driver::memop::write_value32(s, addr, value),
                    MemOp::Wait64 { value, cond, .. } => {
                        driver::memop::wait_value64(s, addr, value, cond as u32)
                    }
                    MemOp::Write64 { value, .. } => driver::memop::write_value64(s, addr, value),
                }
            }
        });
        flags.queued(self, r)
    }

    /// `cuStreamWaitValue32_v2`: later work on this stream waits until the low 32 bits of
    /// `slot` satisfy `cond` against `value`.
    ///
    /// # Errors
    ///
    /// As [`batch_mem_ops`](Self::batch_mem_ops) for one operation; [`Error::StreamCapturing`]
    /// while the stream captures a graph.
    #[doc(alias = "cuStreamWaitValue32_v2")]
    pub fn wait_value32(
        &self,
        flags: &MemopFlags,
        slot: usize,
        value: u32,
        cond: WaitCondition,
    ) -> Result<()> {
        self.one_op(flags, MemOp::Wait32 { slot, value, cond })
    }

    /// `cuStreamWaitValue64_v2`: later work waits until `slot` satisfies `cond` against `value`.
    ///
    /// # Errors
    ///
    /// As [`wait_value32`](Self::wait_value32); [`Error::Unsupported`] where the device lacks
    /// 64-bit operations.
    #[doc(alias = "cuStreamWaitValue64_v2")]
    pub fn wait_value64(
        &self,
        flags: &MemopFlags,
        slot: usize,
        value: u64,
        cond: WaitCondition,
    ) -> Result<()> {
        self.one_op(flags, MemOp::Wait64 { slot, value, cond })
    }

    /// `cuStreamWriteValue32_v2`: write `value` to the low 32 bits of `slot` once the stream
    /// gets there.
    ///
    /// # Errors
    ///
    /// As [`wait_value32`](Self::wait_value32).
    #[doc(alias = "cuStreamWriteValue32_v2")]
    pub fn write_value32(&self, flags: &MemopFlags, slot: usize, value: u32) -> Result<()> {
        self.one_op(flags, MemOp::Write32 { slot, value })
    }

    /// `cuStreamWriteValue64_v2`: write `value` to `slot` once the stream gets there.
    ///
    /// # Errors
    ///
    /// As [`wait_value64`](Self::wait_value64).
    #[doc(alias = "cuStreamWriteValue64_v2")]
    pub fn write_value64(&self, flags: &MemopFlags, slot: usize, value: u64) -> Result<()> {
        self.one_op(flags, MemOp::Write64 { slot, value })
    }

    /// `cuStreamBatchMemOp_v2`: queue `ops` in order. Batches longer than
    /// [`MAX_BATCH_MEM_OPS`] are split into several calls; returns the number of driver calls
    /// made. Everything is validated before the first call.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a slot out of range or device flags on another device than
    /// the stream's; [`Error::Unsupported`] for 64-bit or NOR operations the device lacks;
    /// [`Error::StreamCapturing`] while the stream captures a graph; [`Error::Cuda`] from the
    /// driver (operations of earlier chunks stay queued).
    #[doc(alias = "cuStreamBatchMemOp_v2")]
    pub fn batch_mem_ops(&self, flags: &MemopFlags, ops: &[MemOp]) -> Result<usize> {
        flags.validate(self, ops)?;
        if ops.is_empty() {
            return Ok(0);
        }
        let mut params = ops
            .iter()
            .map(|op| Ok(op.params(flags.device_ptr(op.slot())?)))
            .collect::<Result<Vec<sys::CUstreamBatchMemOpParams>>>()?;
        let r = self.enqueue("cuStreamBatchMemOp_v2", (), |s, ()| {
            let mut calls = 0;
            for (start, n) in batch_spans(params.len()) {
                // SAFETY: symbols checked; `n <= MAX_BATCH_MEM_OPS` valid params addressing live
                // words of `flags` (which outlives the operations: see `queued`).
                unsafe { driver::memop::batch(s, &mut params[start..start + n]) }?;
                calls += 1;
            }
            Ok(calls)
        });
        flags.queued(self, r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_split_at_the_driver_limit() {
        assert_eq!(batch_chunks(0).count(), 0);
        assert_eq!(batch_chunks(255).collect::<Vec<_>>(), vec![255]);
        assert_eq!(batch_chunks(300).collect::<Vec<_>>(), vec![255, 45]);
        assert_eq!(batch_chunks(511).collect::<Vec<_>>(), vec![255, 255, 1]);
    }

    #[test]
    fn params_encode_ops() {
        let base = 0x1000;
        let p = MemOp::Write64 {
            slot: 2,
            value: 0xdead_beef_0000_0001,
        }
        .params(slot_addr(base, 4, 2).unwrap());
        // SAFETY: written as writeValue just above.
        let w = unsafe { p.writeValue };
        assert_eq!(w.address, 0x1010);
        // SAFETY: value64 written.
        assert_eq!(unsafe { w.__bindgen_anon_1.value64 }, 0xdead_beef_0000_0001);
        assert_eq!(
            w.operation,
            sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_64
        );
        let p = MemOp::Wait32 {
            slot: 1,
            value: 7,
            cond: WaitCondition::Eq,
        }
        .params(slot_addr(base, 4, 1).unwrap());
        // SAFETY: written as waitValue.
        let w = unsafe { p.waitValue };
        assert_eq!(w.address, 0x1008);
        assert_eq!(w.flags, 1);
        // SAFETY: value written.
        assert_eq!(unsafe { w.__bindgen_anon_1.value }, 7);
    }
}
