//! The copy kernel of stream-ordered requests (`kernels/copy_fire.ptx`): one launch copies a
//! pair's bytes and then stores the request's trigger word, where copy-engine copies take a
//! copy and a trigger write, two submissions to the stream of some microseconds of host time
//! each. Loaded once per context (serialized, process-wide) and never unloaded.

use super::copies::Piece;
use crate::driver::ctx::bind;
use crate::driver::module::{self, MODULE_SYMBOLS};
use crate::error::{Error, Result, from_driver};
use cudarc::driver::{CudaContext, sys};
use std::ffi::{CString, c_void};
use std::sync::{Arc, Mutex};

const PTX: &str = include_str!("../../../kernels/copy_fire.ptx");

/// Threads of a block.
const THREADS: u32 = 256;

/// Bytes a block copies in one round of its loop (four 16-byte vectors a thread).
const BLOCK_BYTES: u64 = THREADS as u64 * 16 * 4;

/// Blocks per multiprocessor at most.
const BLOCKS_PER_SM: u32 = 8;

/// The copy kernel of one context, and the counters its launches count their blocks in.
pub(super) struct CopyKernel {
    func: sys::CUfunction,
    /// Device address of the module's counters (`u32` each).
    counters: u64,
    /// Counters no launch in flight holds.
    free: Mutex<Vec<u32>>,
    max_blocks: u32,
    /// Holds the context, and so the module, for the process's life.
    _ctx: Arc<CudaContext>,
}

// SAFETY: `func` is a driver handle of a module that is never unloaded; the driver takes it
// from any thread where its context is current (`launch` binds it through the enqueue path).
unsafe impl Send for CopyKernel {}
// SAFETY: as above; the free list is behind its lock.
unsafe impl Sync for CopyKernel {}

impl CopyKernel {
    /// The kernel of `ctx`, loaded on its first use; `None` where it cannot be (a driver
    /// without the symbols, or one that refused the module: the copy engines then copy).
    pub(super) fn of(ctx: &Arc<CudaContext>) -> Option<Arc<CopyKernel>> {
        type Found = Option<(usize, Option<Arc<CopyKernel>>)>;
        thread_local! {
            /// The last context this thread asked for, and its answer: no process-wide lock
            /// per request.
            static LAST: std::cell::RefCell<Found> = const { std::cell::RefCell::new(None) };
        }
        let key = ctx.cu_ctx() as usize;
        if let Some(k) = LAST.with_borrow(|l| match l {
            Some((c, k)) if *c == key => Some(k.clone()),
            _ => None,
        }) {
            return k;
        }
        let k = Self::loaded(ctx, key);
        LAST.with_borrow_mut(|l| *l = Some((key, k.clone())));
        k
    }

    /// [`of`](Self::of) through the process-wide list (serialized: one load per context).
    fn loaded(ctx: &Arc<CudaContext>, key: usize) -> Option<Arc<CopyKernel>> {
        // Each entry holds its context, so no other context can come at its address; a
        // refusal is kept too (the copy engines copy for that context from then on).
        type Loaded = Vec<(usize, Arc<CudaContext>, Option<Arc<CopyKernel>>)>;
        static LOADED: Mutex<Loaded> = Mutex::new(Vec::new());
        let mut g = LOADED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, _, k)) = g.iter().find(|(c, _, _)| *c == key) {
            return k.clone();
        }
        let k = Self::load(ctx).ok().map(Arc::new);
        g.push((key, ctx.clone(), k.clone()));
        k
    }

    fn load(ctx: &Arc<CudaContext>) -> Result<CopyKernel> {
        gpudirect_sys::cuda::require_symbols(MODULE_SYMBOLS)?;
        bind(ctx)?;
        let image =
            CString::new(PTX).map_err(|_| Error::invalid("PTX", "copy_fire", "has a NUL"))?;
        // SAFETY: symbols checked; the context is current; a NUL-terminated image.
        let m = unsafe { module::load_data(&image) }?;
        // SAFETY: the module just loaded, never unloaded.
        let func = unsafe { module::function(m, c"copy_fire") }?;
        // Loaded now, not at its first launch (lazy loading may wait for the context there).
        // SAFETY: a function of the live module.
        unsafe { module::load_function(func) }?;
        // SAFETY: as above.
        let (counters, bytes) = unsafe { module::global(m, c"copy_fire_counters") }?;
        let n = u32::try_from(bytes / 4).unwrap_or(0);
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| from_driver("cuDeviceGetAttribute", e))?;
        Ok(CopyKernel {
            func,
            counters,
            free: Mutex::new((0..n).rev().collect()),
            max_blocks: u32::try_from(sms).unwrap_or(1).max(1) * BLOCKS_PER_SM,
            _ctx: ctx.clone(),
        })
    }

    /// A counter for one launch; `None` while every counter is held (the copy engines copy).
    pub(super) fn lease(self: &Arc<Self>) -> Option<Lease> {
        let index = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop()?;
        Some(Lease {
            kernel: self.clone(),
            index,
        })
    }
}

/// Whether the kernel copies `p`: some bytes, both ends 16-byte aligned.
pub(super) fn fits(p: &Piece) -> bool {
    p.len > 0 && (p.dst | p.src).is_multiple_of(16)
}

/// Blocks for `len` bytes: one per round of [`BLOCK_BYTES`], at most `max`.
fn blocks(len: u64, max: u32) -> u32 {
    u32::try_from(len.div_ceil(BLOCK_BYTES).clamp(1, u64::from(max.max(1)))).unwrap_or(1)
}

/// A counter of the kernel held by one launch, given back when dropped: kept with what the
/// launch reaches until its trigger word was seen (the last block resets the counter before
/// it stores the word), or forever.
pub(super) struct Lease {
    kernel: Arc<CopyKernel>,
    index: u32,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.kernel
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(self.index);
    }
}

impl Lease {
    /// Queue on `stream` the copy of `p`, then the store of `seq` into the 64-bit word at
    /// device address `trigger`.
    ///
    /// # Safety
    ///
    /// `stream` is live in the kernel's context, which is current; [`fits`]`(p)`; both ranges
    /// of `p` are memory the kernel's GPU reaches, valid until `trigger` holds `seq`, and
    /// `trigger` a word mapped for that GPU, valid as long; this lease is kept until then.
    pub(super) unsafe fn launch(
        &self,
        stream: sys::CUstream,
        p: &Piece,
        trigger: u64,
        seq: u64,
    ) -> Result<()> {
        let k = &self.kernel;
        let (mut dst, mut src, mut n) = (p.dst, p.src, p.len);
        let mut counter = k.counters + 4 * u64::from(self.index);
        let (mut trigger, mut seq) = (trigger, seq);
        let mut params: [*mut c_void; 6] = [
            (&raw mut dst).cast(),
            (&raw mut src).cast(),
            (&raw mut n).cast(),
            (&raw mut counter).cast(),
            (&raw mut trigger).cast(),
            (&raw mut seq).cast(),
        ];
        // SAFETY: the kernel's six u64 parameters, matched by `params`; the memory is the
        // caller's promise.
        unsafe {
            module::launch(
                k.func,
                blocks(n, k.max_blocks),
                THREADS,
                stream,
                &mut params,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_the_bytes_up_to_the_limit() {
        assert_eq!(blocks(1, 1056), 1);
        assert_eq!(blocks(BLOCK_BYTES, 1056), 1);
        assert_eq!(blocks(BLOCK_BYTES + 1, 1056), 2);
        assert_eq!(blocks(1 << 20, 1056), 64);
        assert_eq!(blocks(1 << 30, 1056), 1056);
        assert_eq!(blocks(u64::MAX, 0), 1);
    }

    #[test]
    fn only_aligned_pieces_with_bytes_fit() {
        let p = |dst, src, len| Piece {
            dst,
            src,
            len,
            device: 0,
        };
        assert!(fits(&p(0x1000, 0x2000, 3)));
        assert!(!fits(&p(0x1000, 0x2000, 0)));
        assert!(!fits(&p(0x1008, 0x2000, 64)));
        assert!(!fits(&p(0x1000, 0x2001, 64)));
    }

    #[test]
    fn the_kernel_text_names_what_the_host_asks_for() {
        assert!(PTX.contains(".visible .entry copy_fire("));
        assert!(PTX.contains("copy_fire_counters[65536]"));
        assert_eq!(PTX.matches(".param .u64").count(), 6);
        assert!(!PTX.contains('\0'));
    }
}
