//! Pinned host memory on transparent huge pages, for bounce chunks of 2 MiB and more: anonymous
//! memory mapped at a 2 MiB boundary, advised `MADV_HUGEPAGE` and `MADV_WIPEONFORK`, zero-filled
//! (which faults it in), then pinned in place with `cuMemHostRegister`.
//!
//! Why: an `O_DIRECT` read goes to the device as one scatter list per request, one segment per
//! physically contiguous run of the buffer. `cuMemHostAlloc` memory is contiguous only by chance:
//! a buffer may be split into hundreds of runs, and the same raw `O_DIRECT` loop ran faster into
//! buffers of 1 or 2 runs (huge pages, or `cuMemHostAlloc` chunks that happened to be
//! contiguous), with far fewer of its requests merged by the block layer (`docs/storage.md`,
//! "Physically contiguous buffers"). On a huge page, a read of up to 2 MiB that stays within the
//! page is one run (as long as the kernel keeps the page huge while it is pinned, which it
//! usually does).
//!
//! Where the kernel gives no huge page (THP off, memory fragmented), the memory is ordinary
//! pages, as fragmented as `cuMemHostAlloc`'s may be; it works the same.

use super::alloc::{Allocation, Release, byte_size, thin_memory};
use super::pod::Pod;
use crate::driver;
use crate::driver::ctx::bind;
use crate::error::{Error, MemoryKind, Result};
use cudarc::driver::{CudaContext, sys};
use std::sync::Arc;

/// The size and alignment of a transparent huge page on x86-64 and (with 4 KiB base pages)
/// aarch64.
pub(crate) const HUGE_PAGE: usize = 2 << 20;

/// Host memory pinned in place on huge pages where the kernel gives them: see the module docs.
#[derive(Debug)]
#[doc(alias = "cuMemHostRegister")]
pub(crate) struct HugePinned<T: Pod>(Allocation<T, HugeMapping>);

/// A private anonymous mapping of `bytes` bytes at `host`, registered with
/// `cuMemHostRegister`; given back by `cuMemHostUnregister`, then `munmap` (leaked if
/// unregistering fails: it may still be pinned).
#[derive(Debug)]
pub(crate) struct HugeMapping {
    host: *mut u8,
    bytes: usize,
}

// SAFETY: the mapping is owned exclusively by its `Allocation`; the pointer is only read, and the
// bytes behind it are reached through the owner's `&self`/`&mut self`.
unsafe impl Send for HugeMapping {}
// SAFETY: as above.
unsafe impl Sync for HugeMapping {}

// SAFETY: the mapping stays mapped, at `host`, and registered until `release`; the allocation's
// device address is its device mapping (or the host address itself), and `host` is the same
// bytes on the host.
unsafe impl Release for HugeMapping {
    const KIND: MemoryKind = MemoryKind::RegisteredHost;
    const CALL: &'static str = "cuMemHostUnregister";
    type Back = ();

    fn host_ptr(&self) -> Option<*mut u8> {
        Some(self.host)
    }

    unsafe fn release(self, _ptr: u64) -> Result<()> {
        // SAFETY: registered by `HugePinned::alloc`, unregistered once; no work uses it.
        unsafe { driver::mem::host_unregister(self.host.cast()) }?;
        // SAFETY: our mapping, unmapped once, no longer pinned.
        unsafe { libc::munmap(self.host.cast(), self.bytes) };
        Ok(())
    }
}

/// Unmap `host..host + bytes` (nothing when `bytes` is 0).
///
/// # Safety
///
/// The range is part of a mapping of ours that nothing uses.
unsafe fn unmap(host: *mut u8, bytes: usize) {
    if bytes > 0 {
        // SAFETY: the caller's.
        unsafe { libc::munmap(host.cast(), bytes) };
    }
}

impl<T: Pod> HugePinned<T> {
    /// `len` elements of `T`, zero-filled, at a [`HUGE_PAGE`] boundary, pinned in `ctx` with
    /// `cuMemHostRegister(PORTABLE)`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for `len == 0` or an overflowing size; [`Error::Os`] from
    /// `mmap`; [`Error::Load`] without libcuda; [`Error::Cuda`] from the driver (the mapping is
    /// then unmapped).
    #[doc(alias = "mmap")]
    #[doc(alias = "cuMemHostRegister_v2")]
    pub(crate) fn alloc(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
        let bytes = byte_size::<T>(len)?;
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
            .ok()
            .filter(|p| p.is_power_of_two() && *p <= HUGE_PAGE)
            .unwrap_or(4096);
        let keep = bytes
            .checked_next_multiple_of(page)
            .ok_or_else(|| Error::invalid("len", len, "the mapping overflows"))?;
        let span = keep
            .checked_add(HUGE_PAGE)
            .ok_or_else(|| Error::invalid("len", len, "the mapping overflows"))?;
        crate::cuda::init()?;
        crate::completion::Tracker::global().reap();
        bind(ctx)?;
        // SAFETY: a fresh private anonymous mapping; no address is asked for.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::last_os("mmap"));
        }
        let base = p.cast::<u8>();
        let head = (base as usize).next_multiple_of(HUGE_PAGE) - base as usize;
        // SAFETY: `head < HUGE_PAGE` (mmap returns a page-aligned address), so `head + keep <= span`: both cuts and the kept range lie
        // in the mapping, which nothing else knows of yet.
        let host = unsafe {
            unmap(base, head);
            unmap(base.add(head + keep), span - head - keep);
            base.add(head)
        };
        // Advice only: a kernel without THP (or before 4.14, without MADV_WIPEONFORK) refuses
        // it, and the memory works the same. WIPEONFORK gives a forked child fresh zero pages at
        // the same addresses: the parent's pinned pages are never shared copy-on-write, and the
        // child finds memory, not a hole that a later mapping of its own could fill.
        // SAFETY: the kept range is our mapping.
        unsafe {
            libc::madvise(host.cast(), keep, libc::MADV_HUGEPAGE);
            libc::madvise(host.cast(), keep, libc::MADV_WIPEONFORK);
            std::ptr::write_bytes(host, 0, keep);
        }
        // SAFETY: context current; `host..host + keep` stays mapped, at the same address, until
        // `HugeMapping::release` unregisters it.
        if let Err(e) = unsafe {
            driver::mem::host_register(host.cast(), keep, sys::CU_MEMHOSTREGISTER_PORTABLE)
        } {
            // SAFETY: not registered; nothing else knows the mapping.
            unsafe { unmap(host, keep) };
            return Err(e);
        }
        // Without a mapping the host address is what copies use.
        // SAFETY: registered memory of the current context.
        let dptr = unsafe { driver::mem::host_device_pointer(host.cast()) }.unwrap_or(host as u64);
        let how = HugeMapping { host, bytes: keep };
        // SAFETY: `bytes` bytes (of `keep`) of registered memory at `dptr`, given back only by
        // `HugeMapping`.
        Ok(HugePinned(unsafe { Allocation::new(dptr, len, ctx, how) }))
    }

    /// The elements.
    pub(crate) fn as_slice(&self) -> &[T] {
        // SAFETY: `len` initialised elements (zero-filled, `T: Pod`) in the live mapping; no
        // device work can be writing them while `self` is borrowed (device work owns the value).
        unsafe { std::slice::from_raw_parts(self.0.how().host.cast(), self.0.len()) }
    }

    /// The elements, mutably.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.0.how().host.cast(), self.0.len()) }
    }
}

thin_memory!(HugePinned, without_context);
