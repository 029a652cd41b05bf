//! Memory regions over host memory and dma-bufs, slices of them for work requests, and remote
//! descriptors.

use super::ffi::{free_in_parent, nonnull, verbs};
use super::pd::{PdInner, ProtectionDomain};
use super::teardown::{COUNTERS, Counters};
use crate::error::{Error, Result};
use gpudirect_sys::ibverbs as ibv;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::{Bound, RangeBounds};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

bitflags::bitflags! {
    /// `enum ibv_access_flags`: what the NIC may do with a memory region.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    #[repr(transparent)]
    #[doc(alias = "ibv_access_flags")]
    pub struct AccessFlags: u32 {
        /// `IBV_ACCESS_LOCAL_WRITE`: receives and RDMA-read/atomic results may land here.
        const LOCAL_WRITE = ibv::IBV_ACCESS_LOCAL_WRITE;
        /// `IBV_ACCESS_REMOTE_WRITE`: peers holding the rkey may RDMA-write here.
        const REMOTE_WRITE = ibv::IBV_ACCESS_REMOTE_WRITE;
        /// `IBV_ACCESS_REMOTE_READ`: peers holding the rkey may RDMA-read from here.
        const REMOTE_READ = ibv::IBV_ACCESS_REMOTE_READ;
        /// `IBV_ACCESS_REMOTE_ATOMIC`: peers holding the rkey may run atomics on 8-byte words here.
        const REMOTE_ATOMIC = ibv::IBV_ACCESS_REMOTE_ATOMIC;
        /// `IBV_ACCESS_MW_BIND`: memory windows may be bound to ranges of the region
        /// ([`QueuePair::bind_window`](super::QueuePair::bind_window)).
        #[doc(alias = "IBV_ACCESS_MW_BIND")]
        const MW_BIND = ibv::IBV_ACCESS_MW_BIND;
        /// `IBV_ACCESS_RELAXED_ORDERING`: the NIC may reorder PCIe writes (a hint).
        const RELAXED_ORDERING = ibv::IBV_ACCESS_RELAXED_ORDERING;
    }
}

impl AccessFlags {
    /// Verbs require local write for remote write and remote atomic access: add it.
    pub fn normalized(self) -> Self {
        if self.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC) {
            self | AccessFlags::LOCAL_WRITE
        } else {
            self
        }
    }

    /// Whether a peer may write the memory.
    pub fn remote_writable(self) -> bool {
        self.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
    }
}

/// Host memory that can be registered: a stable heap address valid for `len` bytes.
///
/// # Safety
///
/// The pointer `as_mut_ptr` returns must be valid for reads and writes of `len()` bytes, must not
/// change when the value is moved, and must stay valid until the value is dropped. After
/// registration the library never creates references to the value again (the NIC may write the
/// bytes at any time): it only drops it.
pub unsafe trait HostMemory: Send + Sync + 'static {
    /// The start of the memory.
    fn as_mut_ptr(&mut self) -> *mut u8;
    /// Its length in bytes.
    fn len(&self) -> usize;
    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// SAFETY: a Vec's heap buffer does not move with the Vec and lives until it is dropped (the region
// never grows the Vec).
unsafe impl HostMemory for Vec<u8> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        Vec::as_mut_ptr(self)
    }
    fn len(&self) -> usize {
        Vec::len(self)
    }
}

// SAFETY: as for Vec.
unsafe impl HostMemory for Box<[u8]> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        <[u8]>::as_mut_ptr(self)
    }
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
}

/// Page-aligned, zeroed host memory (4096-byte alignment), the usual backing of a region.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: plain owned memory.
unsafe impl Send for HostBuffer {}
// SAFETY: plain owned memory; no interior references are handed out.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    const ALIGN: usize = 4096;

    /// `len` zero bytes, 4096-byte aligned.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for `len` 0; [`Error::Os`] (`ENOMEM`) when allocation fails.
    pub fn zeroed(len: usize) -> Result<HostBuffer> {
        if len == 0 {
            return Err(Error::invalid(
                "len",
                0,
                "a buffer must hold at least one byte",
            ));
        }
        let layout = std::alloc::Layout::from_size_align(len, Self::ALIGN)
            .map_err(|_| Error::invalid("len", len, "too large for one allocation"))?;
        // SAFETY: non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or_else(|| Error::errno("alloc_zeroed", libc::ENOMEM))?;
        Ok(HostBuffer { ptr, len })
    }

    /// A buffer holding a copy of `data`.
    ///
    /// # Errors
    ///
    /// As [`HostBuffer::zeroed`].
    pub fn from_slice(data: &[u8]) -> Result<HostBuffer> {
        let mut b = Self::zeroed(data.len())?;
        b.as_mut_slice().copy_from_slice(data);
        Ok(b)
    }

    /// The bytes (before registration).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: owned, initialised memory of `len` bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably (before registration).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: owned, initialised memory of `len` bytes, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.len, Self::ALIGN)
            .expect("checked at allocation");
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

// SAFETY: the allocation is fixed for the value's life.
unsafe impl HostMemory for HostBuffer {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.len)
            .finish()
    }
}

mod sealed {
    pub trait Sealed {}
}

/// Whether a region's peers may write it: [`Local`] or [`Remote`].
pub trait MrMode: sealed::Sealed + Send + Sync + 'static {
    /// Whether this mode allows remote write or atomic access.
    const REMOTE_WRITABLE: bool;
}

/// A region only this node's NIC writes (receives, RDMA-read results). Its bytes are available as
/// `&[u8]`/`&mut [u8]` when no slice of it exists (so no work request can hold one).
#[derive(Debug)]
pub enum Local {}
/// A region peers may write at any time. Its bytes are only copied, never borrowed.
#[derive(Debug)]
pub enum Remote {}
impl sealed::Sealed for Local {}
impl sealed::Sealed for Remote {}
impl MrMode for Local {
    const REMOTE_WRITABLE: bool = false;
}
impl MrMode for Remote {
    const REMOTE_WRITABLE: bool = true;
}

pub(crate) struct MrInner {
    mr: NonNull<ibv::ibv_mr>,
    /// The first byte's address in the region's address space: the host pointer for host regions
    /// (which `MemoryRegion` dereferences), the IOVA for GPU regions (never dereferenced).
    addr: *mut u8,
    len: usize,
    lkey: u32,
    rkey: u32,
    access: AccessFlags,
    pub(crate) pd: Arc<PdInner>,
    /// Everything the NIC may reach through the registration (the memory, a dma-buf fd): dropped
    /// only after `ibv_dereg_mr` succeeded.
    mem: ManuallyDrop<Box<dyn Send>>,
}

impl MrInner {
    /// A region just registered. `addr` is the address work requests and peers use for the first
    /// byte (the host pointer of a host region, dereferenced by `MemoryRegion`; the IOVA of a GPU
    /// or dma-buf region, never dereferenced); `owner` holds everything the NIC may reach and is
    /// dropped only after `ibv_dereg_mr` succeeds (leaked otherwise).
    ///
    /// # Safety
    ///
    /// `mr` is a live registration of `len` bytes at `addr` in `pd`, returned by a verbs call and
    /// deregistered by nobody else; what it covers stays valid while `owner` lives.
    pub(crate) unsafe fn registered(
        mr: NonNull<ibv::ibv_mr>,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
        pd: Arc<PdInner>,
        owner: Box<dyn Send>,
    ) -> Arc<MrInner> {
        // SAFETY: a live MR (the caller's contract).
        let (lkey, rkey) = unsafe { ((*mr.as_ptr()).lkey, (*mr.as_ptr()).rkey) };
        Arc::new(MrInner {
            mr,
            addr,
            len,
            lkey,
            rkey,
            access,
            pd,
            mem: ManuallyDrop::new(owner),
        })
    }

    pub(crate) fn lkey(&self) -> u32 {
        self.lkey
    }

    pub(crate) fn rkey(&self) -> u32 {
        self.rkey
    }

    pub(crate) fn addr(&self) -> u64 {
        self.addr as u64
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn access(&self) -> AccessFlags {
        self.access
    }

    pub(crate) fn as_raw(&self) -> *mut ibv::ibv_mr {
        self.mr.as_ptr()
    }

    /// The descriptor of the whole region: its address, rkey and length.
    pub(crate) fn remote(&self) -> RemoteMemory {
        RemoteMemory {
            addr: self.addr(),
            rkey: self.rkey,
            len: self.len as u64,
        }
    }
}

/// The accessors every registered region has over its `inner: Arc<MrInner>`; `$addr` documents
/// `addr()`, which means the host address of a host region and the IOVA of a GPU region.
macro_rules! region_accessors {
    ($addr:literal) => {
        /// The local key, for scatter-gather entries.
        pub fn lkey(&self) -> u32 {
            self.inner.lkey()
        }

        /// The remote key peers use to access the region.
        pub fn rkey(&self) -> u32 {
            self.inner.rkey()
        }

        /// Length in bytes: exactly the bytes registered.
        pub fn len(&self) -> usize {
            self.inner.len()
        }

        /// Whether it is empty (never: registration needs one byte).
        pub fn is_empty(&self) -> bool {
            self.inner.len() == 0
        }

        /// The access granted (normalized: local write added where verbs require it).
        pub fn access(&self) -> AccessFlags {
            self.inner.access()
        }

        #[doc = $addr]
        pub fn addr(&self) -> u64 {
            self.inner.addr()
        }

        /// The raw `ibv_mr`, valid while `self` is.
        pub fn as_raw(&self) -> *mut ibv::ibv_mr {
            self.inner.as_raw()
        }

        /// The descriptor a peer needs to access the whole region remotely: `addr` =
        /// [`addr`](Self::addr), the rkey, the length in bytes.
        pub fn remote(&self) -> RemoteMemory {
            self.inner.remote()
        }

        /// A slice of the region for a work request (`..` for all of it). The slice keeps the
        /// region registered and its memory alive until the request that holds it completes.
        ///
        /// # Errors
        ///
        /// [`Error::InvalidArgument`] when the range is empty, out of bounds, or longer than
        /// 2^31 bytes (the largest verbs message).
        pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<MrSlice> {
            MrSlice::of(&self.inner, range)
        }

        /// Whether [`slice`](Self::slice) of `range` would succeed, building nothing.
        #[cfg_attr(
            not(feature = "transfer"),
            allow(dead_code, reason = "the transfer engine's check")
        )]
        pub(crate) fn check_slice(&self, range: impl RangeBounds<usize>) -> Result<()> {
            MrSlice::check(&self.inner, range).map(|_| ())
        }
    };
}
pub(crate) use region_accessors;

// SAFETY: the raw pointers are to memory owned by `mem` and to the verbs MR; the bytes are only
// accessed through raw copies or under `&mut MemoryRegion` with no other owner. `mem` (Send) is
// never accessed through a shared reference, only dropped, so sharing `MrInner` is sound.
unsafe impl Send for MrInner {}
// SAFETY: as above.
unsafe impl Sync for MrInner {}

impl Drop for MrInner {
    fn drop(&mut self) {
        // ibv_dereg_mr is the fence against holders of the rkey: only after it succeeds may the
        // memory go. If it fails, or in a forked child, the memory is leaked.
        free_in_parent(ibv::lib, |l| {
            // SAFETY: registered by a verbs call, deregistered once; no posted request holds a
            // slice (each holds an Arc to this).
            if unsafe { (l.ibv_dereg_mr)(self.mr.as_ptr()) } == 0 {
                // SAFETY: taken once, here, after the NIC lost access.
                drop(unsafe { ManuallyDrop::take(&mut self.mem) });
                Counters::count(&COUNTERS.mr_deregistered);
            } else {
                Counters::count(&COUNTERS.mr_leaked);
            }
        });
    }
}

/// `ibv_reg_mr`—registered host memory. `M` says whether peers may write it ([`Remote`]) or not
/// ([`Local`]). The region owns its memory; slices of it ([`MrSlice`]) keep it registered and
/// alive while work requests use them. Dropping the region deregisters it and frees the memory
/// once the last slice is gone.
///
/// # CPU access
///
/// The CPU reaches the bytes by copies, never by references, while a NIC may touch them:
/// [`read_at`](Self::read_at) (and [`to_vec`](Self::to_vec), [`read_u64`](Self::read_u64)) take
/// `&self` and copy with volatile loads, so any number of threads may read at once;
/// [`write_at`](Self::write_at) and [`fill`](Self::fill) take `&mut self`, so no thread reads
/// while another writes. A region shared between threads needs a lock (or one owner) to be
/// written.
///
/// What a NIC writes (a receive, an RDMA read's result, an atomic's old value, or a peer's RDMA
/// write into a [`Remote`] region) is stable once the completion that covers the write has been
/// polled: the receive's or read's own completion, or for a peer's write whatever the peer uses to
/// say it is done (a write with immediate's receive completion, a message). Before that a copy
/// may see any mix of old and new bytes.
#[doc(alias = "ibv_mr")]
#[doc(alias = "ibv_reg_mr")]
#[doc(alias = "ibv_dereg_mr")]
pub struct MemoryRegion<M: MrMode = Local> {
    inner: Arc<MrInner>,
    _mode: PhantomData<M>,
}

impl<M: MrMode> MemoryRegion<M> {
    fn new(
        pd: &ProtectionDomain,
        mut mem: Box<dyn HostMemory>,
        access: AccessFlags,
    ) -> Result<Self> {
        let access = access.normalized();
        if access.remote_writable() && !M::REMOTE_WRITABLE {
            return Err(Error::invalid(
                "access",
                format!("{access:?}"),
                "remote write or atomic access needs ProtectionDomain::register_remote",
            ));
        }
        let len = mem.len();
        if len == 0 {
            return Err(Error::invalid(
                "buf",
                "0 bytes",
                "a region must hold at least one byte",
            ));
        }
        let l = verbs()?;
        let addr = mem.as_mut_ptr();
        // SAFETY: `addr..addr+len` is valid memory owned by `mem`, which the region keeps until
        // after ibv_dereg_mr; the PD is live.
        let p = unsafe { (l.ibv_reg_mr)(pd.as_raw(), addr.cast(), len, access.bits() as i32) };
        let mr = nonnull("ibv_reg_mr", p)?;
        // SAFETY: `mr` was just registered in this PD over the `len` bytes at `addr`, which
        // `mem` owns and keeps valid until after ibv_dereg_mr.
        let inner =
            unsafe { MrInner::registered(mr, addr, len, access, pd.inner.clone(), Box::new(mem)) };
        Ok(MemoryRegion {
            inner,
            _mode: PhantomData,
        })
    }

    region_accessors!("The start address: the address peers use with the rkey.");

    /// Copy `dst.len()` bytes starting at `offset` out of the region, with volatile loads (the
    /// NIC may be writing them). The bytes are stable after the completion that covers their
    /// write (see [CPU access](MemoryRegion#cpu-access)).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `offset + dst.len()` is past the end (or overflows).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range(offset, dst.len(), self.len())?;
        // SAFETY: `offset..offset + dst.len()` lies in the region's memory, which lives while
        // `self` does; no Rust reference to it exists, and CPU writes need `&mut self`.
        unsafe { volatile_read(self.inner.addr.add(offset), dst) };
        Ok(())
    }

    /// Copy `src` into the region at `offset`, with volatile stores. Needs `&mut self`: no other
    /// thread can copy out of the region at the same time. Bytes that a posted send or RDMA write
    /// still reads should not be changed before its completion (the NIC may send either).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `offset + src.len()` is past the end (or overflows).
    pub fn write_at(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        check_range(offset, src.len(), self.len())?;
        // SAFETY: in bounds of memory the region owns; no Rust reference covers it and `&mut
        // self` excludes CPU readers.
        unsafe { volatile_write(self.inner.addr.add(offset), src) };
        Ok(())
    }

    /// Fill `[offset, offset + len)` with `byte`, with volatile stores (see
    /// [`write_at`](Self::write_at)).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `offset + len` is past the end (or overflows).
    pub fn fill(&mut self, offset: usize, len: usize, byte: u8) -> Result<()> {
        check_range(offset, len, self.len())?;
        // SAFETY: as in `write_at`.
        unsafe { volatile_fill(self.inner.addr.add(offset), len, byte) };
        Ok(())
    }

    /// A copy of the whole region (volatile loads, as [`read_at`](Self::read_at)).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len()];
        // SAFETY: the whole region, as in `read_at`.
        unsafe { volatile_read(self.inner.addr, &mut v) };
        v
    }

    /// Read the 8-byte word at `offset` (the target of atomics, or a flag a peer writes last) with
    /// one volatile load, followed by an acquire fence: copies made after it see what the CPU
    /// ordered before the word (spin on a flag, then [`read_at`](Self::read_at) the data).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when out of bounds or not 8-byte aligned.
    pub fn read_u64(&self, offset: usize) -> Result<u64> {
        check_range(offset, 8, self.len())?;
        let p = self.inner.addr.wrapping_add(offset);
        if !(p as usize).is_multiple_of(8) {
            return Err(Error::invalid(
                "offset",
                offset,
                "an 8-byte word must be 8-byte aligned",
            ));
        }
        // SAFETY: aligned, in bounds of the region's memory; a volatile load, no reference.
        let v = unsafe { std::ptr::read_volatile(p.cast::<u64>()) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        Ok(v)
    }
}

/// Copy `dst.len()` bytes from `src` with volatile loads (8-byte words where aligned).
///
/// # Safety
///
/// `src..src + dst.len()` is valid for reads and covered by no Rust reference.
unsafe fn volatile_read(src: *const u8, dst: &mut [u8]) {
    let n = dst.len();
    let mut i = 0;
    while i < n && !(src as usize).wrapping_add(i).is_multiple_of(8) {
        // SAFETY: i < n: inside the caller's range.
        dst[i] = unsafe { std::ptr::read_volatile(src.add(i)) };
        i += 1;
    }
    while n - i >= 8 {
        // SAFETY: i + 8 <= n, and `src + i` is 8-byte aligned here.
        let w = unsafe { std::ptr::read_volatile(src.add(i).cast::<u64>()) };
        dst[i..i + 8].copy_from_slice(&w.to_ne_bytes());
        i += 8;
    }
    while i < n {
        // SAFETY: i < n.
        dst[i] = unsafe { std::ptr::read_volatile(src.add(i)) };
        i += 1;
    }
}

/// Copy `src` to `dst` with volatile stores (8-byte words where aligned).
///
/// # Safety
///
/// `dst..dst + src.len()` is valid for writes and covered by no Rust reference.
unsafe fn volatile_write(dst: *mut u8, src: &[u8]) {
    let n = src.len();
    let mut i = 0;
    while i < n && !(dst as usize).wrapping_add(i).is_multiple_of(8) {
        // SAFETY: i < n: inside the caller's range.
        unsafe { std::ptr::write_volatile(dst.add(i), src[i]) };
        i += 1;
    }
    while n - i >= 8 {
        let mut w = [0u8; 8];
        w.copy_from_slice(&src[i..i + 8]);
        // SAFETY: i + 8 <= n, and `dst + i` is 8-byte aligned here.
        unsafe { std::ptr::write_volatile(dst.add(i).cast::<u64>(), u64::from_ne_bytes(w)) };
        i += 8;
    }
    while i < n {
        // SAFETY: i < n.
        unsafe { std::ptr::write_volatile(dst.add(i), src[i]) };
        i += 1;
    }
}

/// Set `len` bytes at `dst` to `byte` with volatile stores.
///
/// # Safety
///
/// `dst..dst + len` is valid for writes and covered by no Rust reference.
unsafe fn volatile_fill(dst: *mut u8, len: usize, byte: u8) {
    let mut i = 0;
    let word = u64::from_ne_bytes([byte; 8]);
    while i < len && !(dst as usize).wrapping_add(i).is_multiple_of(8) {
        // SAFETY: i < len: inside the caller's range.
        unsafe { std::ptr::write_volatile(dst.add(i), byte) };
        i += 1;
    }
    while len - i >= 8 {
        // SAFETY: i + 8 <= len, and `dst + i` is 8-byte aligned here.
        unsafe { std::ptr::write_volatile(dst.add(i).cast::<u64>(), word) };
        i += 8;
    }
    while i < len {
        // SAFETY: i < len.
        unsafe { std::ptr::write_volatile(dst.add(i), byte) };
        i += 1;
    }
}

impl MemoryRegion<Local> {
    /// The bytes, when no slice of the region exists (so no work request can be touching them).
    /// `None` while a slice is held or in flight.
    pub fn as_slice(&mut self) -> Option<&[u8]> {
        let inner = Arc::get_mut(&mut self.inner)?;
        // SAFETY: no other owner exists (no slice, no posted request), the region is not
        // remote-writable, and the borrow of `self` prevents new slices.
        Some(unsafe { std::slice::from_raw_parts(inner.addr, inner.len) })
    }

    /// The bytes, mutably, when no slice of the region exists. `None` while a slice is held or in
    /// flight.
    pub fn as_mut_slice(&mut self) -> Option<&mut [u8]> {
        let inner = Arc::get_mut(&mut self.inner)?;
        // SAFETY: as in `as_slice`, and uniquely borrowed.
        Some(unsafe { std::slice::from_raw_parts_mut(inner.addr, inner.len) })
    }
}

impl<M: MrMode> std::fmt::Debug for MemoryRegion<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("lkey", &format_args!("{:#x}", self.lkey()))
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .field("access", &self.access())
            .finish()
    }
}

/// The largest verbs message (and so the largest slice): 2^31 bytes.
pub(crate) const MAX_MESSAGE: u64 = 1 << 31;

/// `range` as `[start, end)` within `len` bytes: non-empty, in bounds, at most [`MAX_MESSAGE`].
fn bounds(range: impl RangeBounds<usize>, len: usize) -> Result<(usize, usize)> {
    let shown = || format!("{:?}..{:?}", range.start_bound(), range.end_bound());
    let start = match range.start_bound() {
        Bound::Included(&s) => Some(s),
        Bound::Excluded(&s) => s.checked_add(1),
        Bound::Unbounded => Some(0),
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1),
        Bound::Excluded(&e) => Some(e),
        Bound::Unbounded => Some(len),
    };
    let (Some(start), Some(end)) = (start, end) else {
        return Err(Error::invalid(
            "range",
            shown(),
            "a bound overflows the address space",
        ));
    };
    if start >= end || end > len {
        return Err(Error::invalid(
            "range",
            format!("{start}..{end}"),
            format!("must be non-empty and within the region's {len} bytes"),
        ));
    }
    if (end - start) as u64 > MAX_MESSAGE {
        return Err(Error::invalid(
            "range",
            format!("{start}..{end}"),
            "a message is at most 2 GiB",
        ));
    }
    Ok((start, end))
}

/// Whether `offset + len` (checked) lies within `total` bytes.
fn check_range(offset: usize, len: usize, total: usize) -> Result<()> {
    if offset.checked_add(len).is_none_or(|e| e > total) {
        return Err(Error::invalid(
            "offset",
            format!("{offset} (+{len} bytes)"),
            format!("must lie within the region's {total} bytes"),
        ));
    }
    Ok(())
}

/// A byte range of a [`MemoryRegion`], owned: it keeps the region registered and its memory alive.
/// Work requests take slices by value and hold them until their completion.
#[derive(Clone)]
pub struct MrSlice {
    pub(crate) mr: Arc<MrInner>,
    offset: usize,
    len: u32,
}

impl MrSlice {
    /// `range` of the region `mr` (checked: non-empty, in bounds, at most 2 GiB, and its
    /// addresses within 2^64).
    pub(crate) fn of(mr: &Arc<MrInner>, range: impl RangeBounds<usize>) -> Result<MrSlice> {
        let (start, end) = Self::check(mr, range)?;
        Ok(MrSlice {
            mr: mr.clone(),
            offset: start,
            len: (end - start) as u32,
        })
    }

    /// The checks of [`of`](Self::of), building nothing: the range's start and end.
    pub(crate) fn check(mr: &MrInner, range: impl RangeBounds<usize>) -> Result<(usize, usize)> {
        let (start, end) = bounds(range, mr.len)?;
        if (mr.addr as u64).checked_add(end as u64).is_none() {
            return Err(Error::invalid(
                "range",
                format!("{start}..{end}"),
                format!(
                    "the region's address {:#x} plus the end overflows 64 bits",
                    mr.addr as u64
                ),
            ));
        }
        Ok((start, end))
    }

    /// Offset in the region, in bytes.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Length in bytes.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// Whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of the first byte.
    pub fn addr(&self) -> u64 {
        // Checked when the slice was made: the region's address plus the slice's end fits.
        (self.mr.addr as u64).wrapping_add(self.offset as u64)
    }

    /// The region's access flags.
    pub fn access(&self) -> AccessFlags {
        self.mr.access
    }

    /// Copy `dst.len()` bytes starting at `offset` of the slice out, with volatile loads (a NIC
    /// may be writing them): stable once the completion covering their write was polled (see
    /// [CPU access](MemoryRegion#cpu-access)).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `offset + dst.len()` is past the slice's end (or
    /// overflows).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range(offset, dst.len(), self.len as usize)?;
        // SAFETY: `self.offset + offset + dst.len()` lies within the region (the slice lies in
        // it, checked when made); its memory lives while the slice does, and no Rust reference
        // covers bytes a NIC may write.
        unsafe { volatile_read(self.mr.addr.add(self.offset + offset), dst) };
        Ok(())
    }

    /// The first `len` bytes of the slice (at most its length), copied with volatile loads as
    /// [`read_at`](Self::read_at).
    pub fn to_vec(&self, len: usize) -> Vec<u8> {
        let mut v = vec![0; len.min(self.len as usize)];
        // SAFETY: within the slice, as in `read_at`.
        unsafe { volatile_read(self.mr.addr.add(self.offset), &mut v) };
        v
    }

    pub(crate) fn sge(&self) -> ibv::ibv_sge {
        ibv::ibv_sge {
            addr: self.addr(),
            length: self.len,
            lkey: self.mr.lkey,
        }
    }

    pub(crate) fn pd_ptr(&self) -> *mut ibv::ibv_pd {
        self.mr.pd.pd.as_ptr()
    }
}

impl std::fmt::Debug for MrSlice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MrSlice")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .finish()
    }
}

/// A peer's registered memory: what RDMA read, write and atomics target. Send it to the peer in a
/// first message (rdma_cm private data is too small to be relied on: 56 bytes).
///
/// A descriptor that came from a peer is untrusted: [`from_bytes`](Self::from_bytes) and
/// deserialization check it ([`validate`](Self::validate)), and [`slice`](Self::slice) checks its
/// arithmetic again, so a hand-built one cannot produce a wrapped address either.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(try_from = "RemoteMemoryFields"))]
pub struct RemoteMemory {
    /// Start address, as the peer registered it.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Length in bytes.
    pub len: u64,
}

/// The fields as they arrive, before [`RemoteMemory::validate`].
#[cfg(feature = "serde")]
#[derive(serde::Deserialize)]
struct RemoteMemoryFields {
    addr: u64,
    rkey: u32,
    len: u64,
}

#[cfg(feature = "serde")]
impl TryFrom<RemoteMemoryFields> for RemoteMemory {
    type Error = Error;
    fn try_from(f: RemoteMemoryFields) -> Result<Self> {
        RemoteMemory::new(f.addr, f.rkey, f.len)
    }
}

impl RemoteMemory {
    /// Size of [`RemoteMemory::to_bytes`].
    pub const WIRE_LEN: usize = 20;

    /// A checked descriptor (see [`validate`](Self::validate)).
    ///
    /// # Errors
    ///
    /// As [`validate`](Self::validate).
    pub fn new(addr: u64, rkey: u32, len: u64) -> Result<Self> {
        let r = RemoteMemory { addr, rkey, len };
        r.validate()?;
        Ok(r)
    }

    /// Check a descriptor as untrusted input: at least one byte, and `addr + len` within 2^64.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming `len` when either rule is broken.
    pub fn validate(&self) -> Result<()> {
        if self.len == 0 {
            return Err(Error::invalid(
                "len",
                0,
                "a remote region holds at least one byte",
            ));
        }
        if self.addr.checked_add(self.len).is_none() {
            return Err(Error::invalid(
                "len",
                self.len,
                format!("address {:#x} plus length overflows 64 bits", self.addr),
            ));
        }
        Ok(())
    }

    /// A fixed 20-byte little-endian encoding: addr, len, rkey.
    pub fn to_bytes(&self) -> [u8; Self::WIRE_LEN] {
        let mut b = [0; Self::WIRE_LEN];
        b[..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..].copy_from_slice(&self.rkey.to_le_bytes());
        b
    }

    /// Decode [`RemoteMemory::to_bytes`] (the first 20 bytes of `b`), checked as
    /// [`validate`](Self::validate) does.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `b` is shorter than 20 bytes or the descriptor is invalid.
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        let Some(b) = b.get(..Self::WIRE_LEN) else {
            return Err(Error::invalid(
                "bytes",
                b.len(),
                "a RemoteMemory descriptor is 20 bytes",
            ));
        };
        let mut addr = [0u8; 8];
        let mut len = [0u8; 8];
        let mut rkey = [0u8; 4];
        addr.copy_from_slice(&b[..8]);
        len.copy_from_slice(&b[8..16]);
        rkey.copy_from_slice(&b[16..20]);
        RemoteMemory::new(
            u64::from_le_bytes(addr),
            u32::from_le_bytes(rkey),
            u64::from_le_bytes(len),
        )
    }

    /// `len` bytes at `offset`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when empty, over 2 GiB, past the descriptor's length, or when
    /// the descriptor itself is invalid (its address plus length overflows).
    pub fn slice(&self, offset: u64, len: u32) -> Result<RemoteSlice> {
        self.validate()?;
        if len == 0
            || len as u64 > MAX_MESSAGE
            || offset.checked_add(len as u64).is_none_or(|e| e > self.len)
        {
            return Err(Error::invalid(
                "offset",
                format!("{offset} (+{len} bytes)"),
                format!(
                    "must be a non-empty range of at most 2 GiB within the remote region's {} bytes",
                    self.len
                ),
            ));
        }
        // Cannot overflow: offset + len <= self.len and addr + self.len fits (validated).
        Ok(RemoteSlice {
            addr: self.addr + offset,
            rkey: self.rkey,
            len,
        })
    }
}

/// A byte range of a peer's memory, checked against its [`RemoteMemory`]. A hand-built one is
/// checked again when posted (its address plus length within 2^64, at most 2 GiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteSlice {
    /// Address.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Length in bytes.
    pub len: u32,
}

impl RemoteSlice {
    /// The rules [`RemoteMemory::slice`] guarantees, for a slice that may have been built by hand.
    pub(crate) fn check(&self) -> Result<()> {
        if self.addr.checked_add(self.len as u64).is_none() || self.len as u64 > MAX_MESSAGE {
            return Err(Error::invalid(
                "remote",
                format!("{:#x} (+{} bytes)", self.addr, self.len),
                "a remote range lies within 2^64 and holds at most 2 GiB",
            ));
        }
        Ok(())
    }
}

impl ProtectionDomain {
    /// `ibv_reg_mr(pd, buf, len, access)`—register host memory that only this node's NIC writes
    /// (receives, RDMA-read targets) and that remote peers may at most read.
    ///
    /// `access` may hold [`AccessFlags::LOCAL_WRITE`] and [`AccessFlags::REMOTE_READ`]; the default
    /// (empty) is the least privilege: the NIC may only read it, for sends and RDMA writes. Use
    /// [`register_remote`](Self::register_remote) for remote write or atomic access.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for remote write or atomic flags, or
    /// an empty buffer; [`Error::Os`](crate::Error::Os) naming `ibv_reg_mr` (`ENOMEM` over the
    /// locked-memory limit, `EINVAL` for flags the device refuses); [`Error::Os`](crate::Error::Os) naming
    /// `ibv_fork_init` when fork support could not be set up.
    #[doc(alias = "ibv_reg_mr")]
    pub fn register<B: HostMemory>(
        &self,
        buf: B,
        access: AccessFlags,
    ) -> Result<MemoryRegion<Local>> {
        MemoryRegion::<Local>::new(self, Box::new(buf), access)
    }

    /// `ibv_reg_mr(pd, buf, len, access)`—register host memory that remote peers may write
    /// ([`AccessFlags::REMOTE_WRITE`]) or update atomically ([`AccessFlags::REMOTE_ATOMIC`]). Local
    /// write, which verbs require for both, is added.
    ///
    /// Such a region never hands out `&`/`&mut` to its bytes: copy them with
    /// [`MemoryRegion::read_at`] / [`MemoryRegion::write_at`] (and [`MemoryRegion::read_u64`] for
    /// atomic targets).
    ///
    /// # Errors
    ///
    /// As [`register`](Self::register).
    #[doc(alias = "ibv_reg_mr")]
    pub fn register_remote<B: HostMemory>(
        &self,
        buf: B,
        access: AccessFlags,
    ) -> Result<MemoryRegion<Remote>> {
        MemoryRegion::<Remote>::new(self, Box::new(buf), access)
    }

    /// `ibv_reg_dmabuf_mr(pd, offset, len, iova, fd, access)`—register `len` bytes at `offset`
    /// of the dma-buf `fd` of any exporter; peers address them from `iova`. The region keeps
    /// `fd`. For CUDA memory use the safe
    /// [`register_dmabuf`](ProtectionDomain::register_dmabuf), which takes the owning export.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`](crate::Error::Unsupported) saying dma-buf when libibverbs lacks the
    /// call or the device answers `EOPNOTSUPP` (Soft-RoCE, kernels before 5.12): the caller's
    /// automatic mode then tries the next path; [`Error::Os`](crate::Error::Os) naming
    /// `ibv_reg_dmabuf_mr` otherwise (`EINVAL` for an fd that is no dma-buf).
    ///
    /// # Safety
    ///
    /// The NIC may read and (with write access) write the registered bytes until the region is
    /// dropped: the memory behind `fd` must stay allocated, and not be reused for anything else,
    /// until then. An fd does not guarantee that (a CUDA dma-buf does not keep its memory alive).
    #[doc(alias = "ibv_reg_dmabuf_mr")]
    pub unsafe fn register_dmabuf_fd(
        &self,
        fd: OwnedFd,
        offset: u64,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<DmabufRegion> {
        let args = DmabufRegArgs::new(offset, len, iova, access)?;
        let l = verbs()?;
        let mr = self.reg_dmabuf(l, fd.as_fd(), args)?;
        // SAFETY: `mr` was just registered in this PD over `args.len` bytes addressed from
        // `args.iova`; the caller keeps the memory behind `fd` valid until the region is dropped,
        // and the region keeps `fd` open until after ibv_dereg_mr.
        let inner = unsafe {
            MrInner::registered(
                mr,
                args.iova as *mut u8,
                args.len,
                args.access,
                self.inner.clone(),
                Box::new(fd),
            )
        };
        Ok(DmabufRegion { inner })
    }

    /// The dma-buf step on an fd: `ibv_reg_dmabuf_mr(pd, args.offset, args.len, args.iova, fd,
    /// args.access)`, with `EOPNOTSUPP` mapped to [`Error::Unsupported`]. The caller wraps the
    /// registration ([`MrInner::registered`]) with what keeps the memory behind `fd` valid.
    pub(crate) fn reg_dmabuf(
        &self,
        l: &ibv::Lib,
        fd: BorrowedFd<'_>,
        args: DmabufRegArgs,
    ) -> Result<NonNull<ibv::ibv_mr>> {
        let Some(reg) = l.ibv_reg_dmabuf_mr else {
            return Err(Error::Unsupported {
                what: "dma-buf memory registration (ibv_reg_dmabuf_mr)".into(),
                reason: format!(
                    "{} has no ibv_reg_dmabuf_mr (rdma-core older than 34)",
                    l.path()
                ),
            });
        };
        // SAFETY: a live PD and an open fd; the kernel takes its own reference to the dma-buf
        // and validates offset/len against it.
        let p = unsafe {
            reg(
                self.as_raw(),
                args.offset,
                args.len,
                args.iova,
                fd.as_raw_fd(),
                args.access.bits() as i32,
            )
        };
        nonnull("ibv_reg_dmabuf_mr", p).map_err(|e| dmabuf_error(e, self.context().name()))
    }
}

/// The arguments of one `ibv_reg_dmabuf_mr` call, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmabufRegArgs {
    /// Byte offset of the first registered byte inside the dma-buf.
    pub offset: u64,
    /// Bytes registered: exactly the requested length.
    pub len: usize,
    /// The address peers and work requests use for the first byte.
    pub iova: u64,
    /// The access flags passed (normalized: local write added where verbs require it).
    pub access: AccessFlags,
}

impl DmabufRegArgs {
    /// `len` bytes at `offset` of a dma-buf, addressed from `iova`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty range or one whose end overflows (offset or IOVA).
    pub fn new(offset: u64, len: usize, iova: u64, access: AccessFlags) -> Result<Self> {
        if len == 0 {
            return Err(Error::invalid(
                "len",
                0,
                "a region must hold at least one byte",
            ));
        }
        if offset.checked_add(len as u64).is_none() || iova.checked_add(len as u64).is_none() {
            return Err(Error::invalid(
                "len",
                len,
                format!("offset {offset:#x} / iova {iova:#x} + len overflows 64 bits"),
            ));
        }
        Ok(DmabufRegArgs {
            offset,
            len,
            iova,
            access: access.normalized(),
        })
    }
}

/// An `ibv_reg_dmabuf_mr` failure as the typed error: `EOPNOTSUPP` (and `ENOSYS`,
/// `EPROTONOSUPPORT`) become [`Error::Unsupported`] saying dma-buf; anything else stays
/// [`Error::Os`].
pub(crate) fn dmabuf_error(e: Error, device: &str) -> Error {
    match e {
        Error::Os { source, .. }
            if matches!(
                source.raw_os_error(),
                Some(libc::EOPNOTSUPP | libc::ENOSYS | libc::EPROTONOSUPPORT)
            ) =>
        {
            Error::Unsupported {
                what: "dma-buf memory registration (ibv_reg_dmabuf_mr)".into(),
                reason: format!(
                    "device {device} answered {source} (Soft-RoCE and kernels before 5.12 cannot register dma-bufs)"
                ),
            }
        }
        e => e,
    }
}

/// `ibv_reg_dmabuf_mr`—a region over a dma-buf of any exporter, registered with
/// [`ProtectionDomain::register_dmabuf_fd`]. It keeps the fd, and so the dma-buf, until it is
/// deregistered on drop.
#[doc(alias = "ibv_reg_dmabuf_mr")]
pub struct DmabufRegion {
    inner: Arc<MrInner>,
}

// No slices: the caller of `register_dmabuf_fd` keeps the memory valid until the region is
// dropped, so nothing may hold the registration longer.
impl DmabufRegion {
    /// The local key.
    pub fn lkey(&self) -> u32 {
        self.inner.lkey()
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        self.inner.rkey()
    }

    /// The descriptor peers use: the address is the IOVA given at registration.
    pub fn remote(&self) -> RemoteMemory {
        self.inner.remote()
    }
}

impl std::fmt::Debug for DmabufRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmabufRegion")
            .field("iova", &format_args!("{:#x}", self.inner.addr()))
            .field("len", &self.inner.len())
            .field("rkey", &format_args!("{:#x}", self.inner.rkey()))
            .finish()
    }
}

/// A region that was never registered, at `addr` (an IOVA: never dereferenced), for tests of the
/// logic above it. Leaked with its PD, so neither is ever deregistered or freed.
#[cfg(test)]
pub(crate) fn fake_region(addr: u64, len: usize, access: AccessFlags) -> Arc<MrInner> {
    let pd = Arc::new(PdInner {
        pd: NonNull::dangling(),
        ctx: super::context::CtxInner::fake(),
    });
    std::mem::forget(pd.clone());
    let mr = Arc::new(MrInner {
        mr: NonNull::dangling(),
        addr: addr as *mut u8,
        len,
        lkey: 1,
        rkey: 2,
        access,
        pd,
        mem: ManuallyDrop::new(Box::new(())),
    });
    std::mem::forget(mr.clone());
    mr
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_access_implies_local_write() {
        assert_eq!(
            AccessFlags::REMOTE_WRITE.normalized(),
            AccessFlags::REMOTE_WRITE | AccessFlags::LOCAL_WRITE
        );
        assert_eq!(
            AccessFlags::REMOTE_ATOMIC.normalized(),
            AccessFlags::REMOTE_ATOMIC | AccessFlags::LOCAL_WRITE
        );
        assert_eq!(
            AccessFlags::REMOTE_READ.normalized(),
            AccessFlags::REMOTE_READ
        );
        assert_eq!(AccessFlags::default(), AccessFlags::empty());
        assert_eq!(AccessFlags::LOCAL_WRITE.bits(), 1);
        assert_eq!(AccessFlags::REMOTE_WRITE.bits(), 2);
        assert_eq!(AccessFlags::REMOTE_READ.bits(), 4);
        assert_eq!(AccessFlags::REMOTE_ATOMIC.bits(), 8);
    }

    #[test]
    fn remote_memory_round_trips() {
        let r = RemoteMemory {
            addr: 0x7f00_1234_5678,
            rkey: 0xdead_beef,
            len: 1 << 20,
        };
        assert_eq!(RemoteMemory::from_bytes(&r.to_bytes()).unwrap(), r);
        #[cfg(feature = "serde")]
        let json = serde_json::to_string(&r).unwrap();
        #[cfg(feature = "serde")]
        assert_eq!(serde_json::from_str::<RemoteMemory>(&json).unwrap(), r);
        assert!(RemoteMemory::from_bytes(&[0; 19]).is_err());
        let s = r.slice(16, 8).unwrap();
        assert_eq!((s.addr, s.rkey, s.len), (r.addr + 16, r.rkey, 8));
        assert!(r.slice(1 << 20, 1).is_err());
        assert!(r.slice((1 << 20) - 4, 8).is_err());
        assert!(r.slice(0, 0).is_err());
    }

    #[test]
    fn ranges_are_checked() {
        assert_eq!(bounds(.., 10).unwrap(), (0, 10));
        assert_eq!(bounds(2..=3, 10).unwrap(), (2, 4));
        assert!(bounds(5..5, 10).is_err());
        assert!(bounds(0..11, 10).is_err());
        assert!(check_range(8, 8, 16).is_ok());
        assert!(check_range(9, 8, 16).is_err());
        assert!(check_range(usize::MAX, 2, 16).is_err());
    }

    #[test]
    fn host_buffer_is_page_aligned_and_zeroed() {
        let mut b = HostBuffer::zeroed(10000).unwrap();
        assert_eq!(b.as_mut_ptr() as usize % 4096, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        assert!(HostBuffer::zeroed(0).is_err());
        assert_eq!(HostBuffer::from_slice(b"abc").unwrap().as_slice(), b"abc");
    }

    use proptest::prelude::*;
    use std::ops::Bound;

    fn bound() -> impl Strategy<Value = Bound<usize>> {
        let v = prop_oneof![
            0usize..5000,
            Just(usize::MAX),
            Just(usize::MAX - 1),
            (1usize << 31)..(1usize << 33),
            any::<usize>(),
        ];
        prop_oneof![
            v.clone().prop_map(Bound::Included),
            v.prop_map(Bound::Excluded),
            Just(Bound::Unbounded),
        ]
    }

    fn remote_len() -> impl Strategy<Value = u64> {
        prop_oneof![
            0u64..5000,
            Just(u64::MAX),
            (1u64 << 31)..(1u64 << 40),
            any::<u64>()
        ]
    }

    fn remote_addr() -> impl Strategy<Value = u64> {
        prop_oneof![
            Just(u64::MAX - 3),
            (u64::MAX - 10_000)..=u64::MAX,
            0u64..(1 << 48),
            any::<u64>()
        ]
    }

    /// The reference: a range as u128 arithmetic, which cannot overflow.
    fn expected(start: Bound<usize>, end: Bound<usize>, len: usize) -> Option<(usize, usize)> {
        let s = match start {
            Bound::Included(s) => s as u128,
            Bound::Excluded(s) => s as u128 + 1,
            Bound::Unbounded => 0,
        };
        let e = match end {
            Bound::Included(e) => e as u128 + 1,
            Bound::Excluded(e) => e as u128,
            Bound::Unbounded => len as u128,
        };
        (s < e && e <= len as u128 && e - s <= 1 << 31).then_some((s as usize, e as usize))
    }

    proptest! {
        /// Any range of any region: the checked bounds match u128 arithmetic, never a panic.
        #[test]
        fn slice_bounds_match_exact_arithmetic(
            start in bound(), end in bound(), len in prop_oneof![1usize..10_000, any::<usize>()],
        ) {
            prop_assert_eq!(bounds((start, end), len).ok(), expected(start, end, len));
        }

        /// `offset + len <= total`, checked, for every offset/length of read_at, write_at, fill.
        #[test]
        fn copy_ranges_match_exact_arithmetic(
            off in prop_oneof![0usize..5000, any::<usize>()],
            len in prop_oneof![0usize..5000, any::<usize>()],
            total in 0usize..10_000,
        ) {
            prop_assert_eq!(
                check_range(off, len, total).is_ok(),
                off as u128 + len as u128 <= total as u128
            );
        }

        /// Slices of a region at any address (GPU regions are addressed by an IOVA): accepted
        /// exactly when in bounds and their end address fits 64 bits; the SGE says what was asked.
        #[test]
        fn mr_slices_never_wrap(
            addr in remote_addr(), len in 1usize..100_000, start in bound(), end in bound(),
        ) {
            let mr = fake_region(addr, len, AccessFlags::LOCAL_WRITE);
            let want = expected(start, end, len)
                .filter(|&(_, e)| addr as u128 + e as u128 <= u64::MAX as u128);
            match MrSlice::of(&mr, (start, end)) {
                Ok(s) => {
                    let (st, e) = want.expect("accepted only when valid");
                    let sge = s.sge();
                    prop_assert_eq!(sge.addr as u128, addr as u128 + st as u128);
                    prop_assert_eq!(sge.length as usize, e - st);
                    prop_assert_eq!(s.offset(), st);
                }
                Err(Error::InvalidArgument { arg: "range", .. }) => prop_assert!(want.is_none()),
                Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
            }
        }

        /// A descriptor built, decoded or deserialized from anything: valid exactly when it holds
        /// a byte and its end fits 64 bits; its slices never wrap and stay inside it.
        #[test]
        fn remote_descriptors_are_untrusted(
            addr in remote_addr(), rkey in any::<u32>(), len in remote_len(),
            off in prop_oneof![0u64..5000, any::<u64>()],
            slen in prop_oneof![0u32..5000, Just(u32::MAX), any::<u32>()],
        ) {
            let valid = len > 0 && addr.checked_add(len).is_some();
            let r = RemoteMemory { addr, rkey, len };
            prop_assert_eq!(RemoteMemory::new(addr, rkey, len).is_ok(), valid);
            prop_assert_eq!(RemoteMemory::from_bytes(&r.to_bytes()).ok(), valid.then_some(r));
            #[cfg(feature = "serde")]
            let json = serde_json::to_string(&r).unwrap();
            #[cfg(feature = "serde")]
            prop_assert_eq!(serde_json::from_str::<RemoteMemory>(&json).ok(), valid.then_some(r));
            // A hand-built (possibly invalid) descriptor sliced anywhere.
            let ok = valid
                && slen > 0
                && slen as u64 <= MAX_MESSAGE
                && off as u128 + slen as u128 <= len as u128;
            match r.slice(off, slen) {
                Ok(s) => {
                    prop_assert!(ok);
                    prop_assert_eq!(s.addr as u128, addr as u128 + off as u128);
                    prop_assert!(s.addr as u128 + s.len as u128 <= addr as u128 + len as u128);
                    prop_assert!(s.check().is_ok());
                }
                Err(Error::InvalidArgument { .. }) => prop_assert!(!ok),
                Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
            }
        }

        /// Any bytes of any length decode to a checked descriptor or a typed error.
        #[test]
        fn descriptor_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..40)) {
            match RemoteMemory::from_bytes(&b) {
                Ok(r) => prop_assert!(b.len() >= 20 && r.validate().is_ok()),
                Err(Error::InvalidArgument { .. }) => {}
                Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
            }
        }

        /// Any 20 bytes or more: the first 20 read as address, length and rkey exactly (what
        /// follows is not read, as documented), checked as `new` checks them; fewer are refused.
        #[test]
        fn descriptor_bytes_read_exactly(b in proptest::collection::vec(any::<u8>(), 0..48)) {
            let r = RemoteMemory::from_bytes(&b);
            if b.len() < RemoteMemory::WIRE_LEN {
                prop_assert!(matches!(r, Err(Error::InvalidArgument { arg: "bytes", .. })), "{:?}", r);
            } else {
                let u = |at: usize, n: usize| {
                    b[at..at + n].iter().rev().fold(0u64, |v, &x| (v << 8) | u64::from(x))
                };
                let (addr, len, rkey) = (u(0, 8), u(8, 8), u(16, 4) as u32);
                prop_assert_eq!(r.ok(), RemoteMemory::new(addr, rkey, len).ok());
            }
        }

        /// Hand-built remote slices: checked like the ones `slice` makes.
        #[test]
        fn remote_slices_are_checked(addr in remote_addr(), len in any::<u32>()) {
            let s = RemoteSlice { addr, rkey: 0, len };
            prop_assert_eq!(
                s.check().is_ok(),
                addr.checked_add(len as u64).is_some() && len as u64 <= MAX_MESSAGE
            );
        }

        /// The volatile copies read back exactly what they wrote, at any alignment, and touch
        /// nothing outside their range.
        #[test]
        fn volatile_copies_are_exact(
            off in 0usize..64, data in proptest::collection::vec(any::<u8>(), 0..200),
            byte in any::<u8>(), foff in 0usize..64, flen in 0usize..130,
        ) {
            let mut buf = vec![0xEEu8; 300];
            let p = buf.as_mut_ptr();
            // SAFETY: off + data.len() < 300: inside `buf`, which no reference covers meanwhile.
            unsafe { volatile_write(p.add(off), &data) };
            let mut back = vec![0u8; data.len()];
            // SAFETY: as above.
            unsafe { volatile_read(p.add(off), &mut back) };
            prop_assert_eq!(&back, &data);
            prop_assert!(buf[..off].iter().all(|&b| b == 0xEE));
            prop_assert!(buf[off + data.len()..].iter().all(|&b| b == 0xEE));
            let mut buf = vec![0u8; 200];
            // SAFETY: foff + flen < 200.
            unsafe { volatile_fill(buf.as_mut_ptr().add(foff), flen, byte) };
            for (i, &b) in buf.iter().enumerate() {
                let inside = i >= foff && i < foff + flen;
                prop_assert_eq!(b, if inside { byte } else { 0 });
            }
        }
    }

    #[test]
    fn a_descriptor_ending_past_2_64_is_refused_not_wrapped() {
        let r = RemoteMemory {
            addr: u64::MAX - 3,
            rkey: 1,
            len: 16,
        };
        assert!(matches!(
            r.slice(8, 4),
            Err(Error::InvalidArgument { arg: "len", .. })
        ));
        assert!(RemoteMemory::from_bytes(&r.to_bytes()).is_err());
        #[cfg(feature = "serde")]
        assert!(serde_json::from_str::<RemoteMemory>(&serde_json::to_string(&r).unwrap()).is_err());
    }
}
