//! Memory regions over host memory, slices of them for work requests, and remote descriptors.

use super::pd::{PdInner, ProtectionDomain};
use super::{in_forked_child, nonnull, verbs};
use crate::error::{Error, Result};
use gpudirect_sys::ibverbs as ibv;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::{Bound, RangeBounds};
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
/// `&[u8]`/`&mut [u8]` when no work request holds a slice of it.
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
    /// A region registered elsewhere in this crate (GPU memory). `addr` is the address work
    /// requests and peers use for the first byte (the IOVA); `owner` holds everything the NIC may
    /// reach and is dropped only after `ibv_dereg_mr` succeeds (leaked otherwise).
    ///
    /// # Safety
    ///
    /// `mr` is a live registration of `len` bytes at `addr` in `pd`, returned by a verbs call and
    /// deregistered by nobody else; what it covers stays valid while `owner` lives.
    pub(crate) unsafe fn registered(
        mr: NonNull<ibv::ibv_mr>,
        addr: u64,
        len: usize,
        access: AccessFlags,
        pd: Arc<PdInner>,
        owner: Box<dyn Send>,
    ) -> Arc<MrInner> {
        // SAFETY: a live MR (the caller's contract).
        let (lkey, rkey) = unsafe { ((*mr.as_ptr()).lkey, (*mr.as_ptr()).rkey) };
        Arc::new(MrInner {
            mr,
            addr: addr as *mut u8,
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
}

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
        if in_forked_child() {
            return;
        }
        let Ok(l) = ibv::lib() else { return };
        // SAFETY: registered by ibv_reg_mr, deregistered once; no posted request holds a slice
        // (each holds an Arc to this).
        if unsafe { (l.ibv_dereg_mr)(self.mr.as_ptr()) } == 0 {
            // SAFETY: taken once, here, after the NIC lost access.
            drop(unsafe { ManuallyDrop::take(&mut self.mem) });
        }
    }
}

/// `ibv_reg_mr`—registered host memory. `M` says whether peers may write it ([`Remote`]) or not
/// ([`Local`]). The region owns its memory; slices of it ([`MrSlice`]) keep it registered and
/// alive while work requests use them. Dropping the region deregisters it and frees the memory
/// once the last slice is gone.
#[doc(alias = "ibv_mr")]
#[doc(alias = "ibv_reg_mr")]
#[doc(alias = "ibv_dereg_mr")]
pub struct MemoryRegion<M: MrMode = Local> {
    inner: Arc<MrInner>,
    _mode: PhantomData<M>,
}

impl<M: MrMode> MemoryRegion<M> {
    pub(crate) fn new(
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
        // SAFETY: a registered MR returned by the call.
        let (lkey, rkey) = unsafe { ((*p).lkey, (*p).rkey) };
        Ok(MemoryRegion {
            inner: Arc::new(MrInner {
                mr,
                addr,
                len,
                lkey,
                rkey,
                access,
                pd: pd.inner.clone(),
                mem: ManuallyDrop::new(Box::new(mem)),
            }),
            _mode: PhantomData,
        })
    }

    /// The local key, for scatter-gather entries.
    pub fn lkey(&self) -> u32 {
        self.inner.lkey
    }

    /// The remote key peers use to access the region.
    pub fn rkey(&self) -> u32 {
        self.inner.rkey
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether it is empty (never: registration needs one byte).
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The access granted (normalized: local write added where verbs require it).
    pub fn access(&self) -> AccessFlags {
        self.inner.access
    }

    /// The start address (the address peers use with the rkey).
    pub fn addr(&self) -> u64 {
        self.inner.addr as u64
    }

    /// The raw `ibv_mr`, valid while `self` is.
    pub fn as_raw(&self) -> *mut ibv::ibv_mr {
        self.inner.mr.as_ptr()
    }

    /// The descriptor a peer needs to access the whole region remotely.
    pub fn remote(&self) -> RemoteMemory {
        RemoteMemory {
            addr: self.addr(),
            rkey: self.rkey(),
            len: self.len() as u64,
        }
    }

    /// A slice of the region for a work request (`..` for all of it). The slice keeps the region
    /// registered and its memory alive.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the range is empty, out of bounds, or longer than 2^31
    /// bytes (the largest verbs message).
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<MrSlice> {
        MrSlice::of(&self.inner, range)
    }

    /// Copy `dst.len()` bytes starting at `offset` out of the region. A plain copy from memory the
    /// NIC may be writing: the bytes are whatever is there (use after the completion that wrote
    /// them).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when out of bounds.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range(offset, dst.len(), self.len())?;
        // SAFETY: in bounds of memory owned by the region; no reference to it exists (raw copy).
        unsafe {
            std::ptr::copy_nonoverlapping(self.inner.addr.add(offset), dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }

    /// Copy `src` into the region at `offset`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when out of bounds.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        check_range(offset, src.len(), self.len())?;
        // SAFETY: in bounds; raw copy into memory no reference covers.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.inner.addr.add(offset), src.len())
        };
        Ok(())
    }

    /// Fill `[offset, offset + len)` with `byte`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when out of bounds.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        check_range(offset, len, self.len())?;
        // SAFETY: in bounds; raw write.
        unsafe { std::ptr::write_bytes(self.inner.addr.add(offset), byte, len) };
        Ok(())
    }

    /// A copy of the whole region.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len()];
        self.read_at(0, &mut v).expect("in bounds");
        v
    }

    /// Read the 8-byte word at `offset` (the target of atomics), with a volatile load.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when out of bounds or not 8-byte aligned.
    pub fn read_u64(&self, offset: usize) -> Result<u64> {
        check_range(offset, 8, self.len())?;
        // SAFETY: in bounds.
        let p = unsafe { self.inner.addr.add(offset) };
        if !(p as usize).is_multiple_of(8) {
            return Err(Error::invalid(
                "offset",
                offset,
                "an 8-byte word must be 8-byte aligned",
            ));
        }
        // SAFETY: aligned, in bounds, raw volatile read.
        Ok(unsafe { std::ptr::read_volatile(p.cast::<u64>()) })
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

fn bounds(range: impl RangeBounds<usize>, len: usize) -> Result<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s + 1,
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e + 1,
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    if start >= end || end > len {
        return Err(Error::invalid(
            "range",
            format!("{start}..{end}"),
            format!("must be non-empty and within the region's {len} bytes"),
        ));
    }
    if end - start > 1 << 31 {
        return Err(Error::invalid(
            "range",
            format!("{start}..{end}"),
            "a message is at most 2 GiB",
        ));
    }
    Ok((start, end))
}

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
    /// `range` of the region `mr` (checked: non-empty, in bounds, at most 2 GiB).
    pub(crate) fn of(mr: &Arc<MrInner>, range: impl RangeBounds<usize>) -> Result<MrSlice> {
        let (start, end) = bounds(range, mr.len)?;
        Ok(MrSlice {
            mr: mr.clone(),
            offset: start,
            len: (end - start) as u32,
        })
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
        self.mr.addr as u64 + self.offset as u64
    }

    /// The region's access flags.
    pub fn access(&self) -> AccessFlags {
        self.mr.access
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct RemoteMemory {
    /// Start address, as the peer registered it.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Length in bytes.
    pub len: u64,
}

impl RemoteMemory {
    /// Size of [`RemoteMemory::to_bytes`].
    pub const WIRE_LEN: usize = 20;

    /// A fixed 20-byte little-endian encoding: addr, len, rkey.
    pub fn to_bytes(&self) -> [u8; Self::WIRE_LEN] {
        let mut b = [0; Self::WIRE_LEN];
        b[..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..].copy_from_slice(&self.rkey.to_le_bytes());
        b
    }

    /// Decode [`RemoteMemory::to_bytes`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `b` is shorter than 20 bytes.
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        if b.len() < Self::WIRE_LEN {
            return Err(Error::invalid(
                "bytes",
                b.len(),
                "a RemoteMemory descriptor is 20 bytes",
            ));
        }
        Ok(RemoteMemory {
            addr: u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
            len: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            rkey: u32::from_le_bytes(b[16..20].try_into().expect("4 bytes")),
        })
    }

    /// `len` bytes at `offset`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when empty, out of bounds or over 2 GiB.
    pub fn slice(&self, offset: u64, len: u32) -> Result<RemoteSlice> {
        if len == 0 || offset.checked_add(len as u64).is_none_or(|e| e > self.len) || len > 1 << 31
        {
            return Err(Error::invalid(
                "offset",
                format!("{offset} (+{len} bytes)"),
                format!(
                    "must be a non-empty range within the remote region's {} bytes",
                    self.len
                ),
            ));
        }
        Ok(RemoteSlice {
            addr: self.addr + offset,
            rkey: self.rkey,
            len,
        })
    }
}

/// A byte range of a peer's memory, checked against its [`RemoteMemory`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteSlice {
    /// Address.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Length in bytes.
    pub len: u32,
}

/// `ibv_reg_dmabuf_mr`—a region over a dma-buf (GPU or other device memory exported as an fd).
/// It keeps the fd, and so the dma-buf, until it is deregistered on drop.
#[doc(alias = "ibv_reg_dmabuf_mr")]
pub struct DmabufRegion {
    mr: NonNull<ibv::ibv_mr>,
    lkey: u32,
    rkey: u32,
    len: usize,
    iova: u64,
    fd: ManuallyDrop<std::os::fd::OwnedFd>,
    _pd: Arc<PdInner>,
}

// SAFETY: a registration handle; no memory is accessed through it.
unsafe impl Send for DmabufRegion {}
// SAFETY: as above.
unsafe impl Sync for DmabufRegion {}

impl DmabufRegion {
    pub(crate) fn new(
        pd: &ProtectionDomain,
        fd: std::os::fd::OwnedFd,
        offset: u64,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<Self> {
        use std::os::fd::AsRawFd;
        const WHAT: &str = "dma-buf memory registration (ibv_reg_dmabuf_mr)";
        if len == 0 {
            return Err(Error::invalid(
                "len",
                0,
                "a region must hold at least one byte",
            ));
        }
        let l = verbs()?;
        let Some(reg) = l.ibv_reg_dmabuf_mr else {
            return Err(Error::Unsupported {
                what: WHAT.into(),
                reason: format!(
                    "{} has no ibv_reg_dmabuf_mr (rdma-core older than 34)",
                    l.path()
                ),
            });
        };
        let access = access.normalized();
        // SAFETY: a live PD and an open fd; the kernel takes its own reference to the dma-buf.
        let p = unsafe {
            reg(
                pd.as_raw(),
                offset,
                len,
                iova,
                fd.as_raw_fd(),
                access.bits() as i32,
            )
        };
        let mr = nonnull("ibv_reg_dmabuf_mr", p).map_err(|e| match e {
            Error::Os { source, .. }
                if matches!(source.raw_os_error(), Some(libc::EOPNOTSUPP | libc::ENOSYS | libc::EPROTONOSUPPORT)) =>
            {
                Error::Unsupported {
                    what: WHAT.into(),
                    reason: format!(
                        "device {} answered {source} (Soft-RoCE and kernels before 5.12 cannot register dma-bufs)",
                        pd.context().name()
                    ),
                }
            }
            e => e,
        })?;
        // SAFETY: a registered MR returned by the call.
        let (lkey, rkey) = unsafe { ((*p).lkey, (*p).rkey) };
        Ok(DmabufRegion {
            mr,
            lkey,
            rkey,
            len,
            iova,
            fd: ManuallyDrop::new(fd),
            _pd: pd.inner.clone(),
        })
    }

    /// The local key.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// The descriptor peers use: the address is the IOVA given at registration.
    pub fn remote(&self) -> RemoteMemory {
        RemoteMemory {
            addr: self.iova,
            rkey: self.rkey,
            len: self.len as u64,
        }
    }
}

impl Drop for DmabufRegion {
    fn drop(&mut self) {
        if in_forked_child() {
            return;
        }
        let Ok(l) = ibv::lib() else { return };
        // SAFETY: registered once, deregistered once; only after success may the fd close.
        if unsafe { (l.ibv_dereg_mr)(self.mr.as_ptr()) } == 0 {
            // SAFETY: taken once, here.
            drop(unsafe { ManuallyDrop::take(&mut self.fd) });
        }
    }
}

impl std::fmt::Debug for DmabufRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmabufRegion")
            .field("iova", &format_args!("{:#x}", self.iova))
            .field("len", &self.len)
            .field("rkey", &format_args!("{:#x}", self.rkey))
            .finish()
    }
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
        let json = serde_json::to_string(&r).unwrap();
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
}
