//! GPUDirect RDMA: memory regions over GPU memory, registered by dma-buf or nvidia-peermem (the
//! paths and their order are described on the [`rdma`](super) module page).

use super::ffi::{nonnull, verbs};
use super::mr::{AccessFlags, DmabufRegArgs, MrInner, MrSlice, RemoteMemory, region_accessors};
use super::pd::ProtectionDomain;
use crate::error::{Error, GpuMrAttempts, GpuMrPath, GpuMrRefusal, Result};
use crate::memory::DmaBuf;
use crate::memory::{DeviceMemory, DeviceMemoryMut, MemoryKind, PointerAttributes};
use gpudirect_sys::ibverbs as ibv;
use std::fmt;
use std::marker::PhantomData;
use std::ops::RangeBounds;
use std::os::fd::OwnedFd;
use std::sync::Arc;

/// How [`ProtectionDomain::register_gpu`] registers GPU memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum GpuRegistration {
    /// Try dma-buf, then nvidia-peermem, recording why each path was refused (the default).
    #[default]
    Auto,
    /// Only dma-buf (`cuMemGetHandleForAddressRange` + `ibv_reg_dmabuf_mr`).
    DmaBuf,
    /// Only nvidia-peermem (`ibv_reg_mr` on the device pointer), when the module is loaded.
    Peermem,
}

impl GpuRegistration {
    /// The paths this mode tries, in order.
    pub fn order(self) -> &'static [GpuMrPath] {
        match self {
            GpuRegistration::Auto => &[GpuMrPath::DmaBuf, GpuMrPath::Peermem],
            GpuRegistration::DmaBuf => &[GpuMrPath::DmaBuf],
            GpuRegistration::Peermem => &[GpuMrPath::Peermem],
        }
    }
}

/// Memory the GPU registration paths can hand to a NIC: every owned device buffer
/// ([`DeviceMemoryMut`]: [`DeviceBuffer`](crate::memory::DeviceBuffer),
/// [`VmmBuffer`](crate::memory::VmmBuffer); [`PoolBuffer`](crate::memory::PoolBuffer) is refused
/// by [`prepare`](Self::prepare)), and other dma-buf exporters (a udmabuf in the Soft-RoCE tests,
/// which drive the same path machinery with host memory).
///
/// # Safety
///
/// `nic_addr()..nic_addr() + nic_len()` must stay valid memory, not freed, moved or remapped, while
/// the value lives; registering it with `ibv_reg_mr` (the peer-memory step, when
/// [`peermem`](Self::peermem) says `Ok`) must pin exactly that memory. A dma-buf returned by
/// [`export_dmabuf`](Self::export_dmabuf) must hold the same `nic_len()` bytes at the returned
/// offset, and the memory behind it must stay valid while the value lives (the region keeps both,
/// and closes the fd before dropping the value).
pub unsafe trait GpuMrSource: Send + 'static {
    /// The address of the first byte, as the NIC will be told (the IOVA of a dma-buf region, the
    /// address `ibv_reg_mr` registers on the peer-memory path).
    fn nic_addr(&self) -> u64;

    /// The length in bytes.
    fn nic_len(&self) -> usize;

    /// Checks and settings that come before any verbs call (GPUDirect RDMA capability, the
    /// `SYNC_MEMOPS` attribute).
    ///
    /// # Errors
    ///
    /// [`Error::NotRdmaCapable`] for memory a NIC cannot reach; whatever the checks' driver calls
    /// answer.
    fn prepare(&self) -> Result<()>;

    /// The dma-buf step's export: an fd and the byte offset of the first byte inside it.
    ///
    /// # Errors
    ///
    /// A [`GpuMrRefusal`] saying why this path cannot be taken.
    ///
    /// # Safety
    ///
    /// The fd reaches `self`'s memory, which the driver does not keep alive for it: the caller
    /// must close the fd and every duplicate of it before `self` is dropped, and hand it to no
    /// one who could keep it longer. ([`ProtectionDomain::register_gpu`] keeps the fd beside the
    /// source and closes it first.)
    unsafe fn export_dmabuf(&self) -> Result<(OwnedFd, u64), GpuMrRefusal>;

    /// Whether the peer-memory step may register [`nic_addr`](Self::nic_addr) with `ibv_reg_mr`.
    ///
    /// # Errors
    ///
    /// A [`GpuMrRefusal`] saying why not ([`GpuMrRefusal::NoPeermemModule`] for device memory without the
    /// module).
    fn peermem(&self) -> Result<(), GpuMrRefusal>;
}

/// Check that `mem` is device memory a NIC can reach through GPUDirect RDMA: a device kind other
/// than pool memory, and `CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE = 1`. The checks
/// [`ProtectionDomain::register_gpu`] runs before any verbs call; usable without a NIC.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for host memory kinds (register those with
/// [`ProtectionDomain::register`]) or an empty buffer, before any FFI call;
/// [`Error::NotRdmaCapable`] for pool memory or memory whose attribute is 0; [`Error::Cuda`] /
/// [`Error::Load`] when the attributes cannot be read.
#[doc(alias = "CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE")]
#[doc(alias = "cuPointerGetAttributes")]
pub fn check_rdma_capable<M: DeviceMemory>(mem: &M) -> Result<PointerAttributes> {
    let kind = mem.kind();
    if !kind.is_device() {
        return Err(Error::invalid(
            "mem",
            format!("{kind:?}"),
            "GPU registration needs device memory; register host memory with ProtectionDomain::register",
        ));
    }
    if mem.byte_len() == 0 {
        return Err(Error::invalid(
            "mem",
            "0 bytes",
            "a region must hold at least one byte",
        ));
    }
    let ptr = mem.device_ptr();
    crate::memory::refuse_pool(kind, ptr, "GPU memory registration")?;
    let attrs = crate::memory::pointer_attributes(ptr)?;
    if !attrs.gpu_direct_rdma_capable {
        return Err(Error::NotRdmaCapable {
            ptr,
            kind,
            reason: "CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE = 0".into(),
        });
    }
    Ok(attrs)
}

/// `cuPointerSetAttribute(1, CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, ptr)`: synchronous memory
/// operations on the allocation holding `ptr` always synchronize (blocks until pending ones
/// complete). Device `ordinal`'s primary context is made current first.
///
/// # Errors
///
/// [`Error::Cuda`] naming `cuPointerSetAttribute`; [`Error::Load`] / [`Error::NoDevice`] from
/// the context.
#[doc(alias = "cuPointerSetAttribute")]
#[doc(alias = "CU_POINTER_ATTRIBUTE_SYNC_MEMOPS")]
pub fn set_sync_memops(ordinal: usize, ptr: u64) -> Result<()> {
    use cudarc::driver::sys;
    let ctx = crate::cuda::context(ordinal)?;
    crate::driver::ctx::bind(&ctx)?;
    let one: u32 = 1;
    // SAFETY: SYNC_MEMOPS takes an unsigned int, read during the call; the driver validates `ptr`.
    unsafe {
        crate::driver::pointer::set_attribute(
            &one,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
            ptr,
        )
    }
}

/// The checks and settings before device memory is handed to a NIC: RDMA capable, the device
/// supports GPUDirect RDMA, `SYNC_MEMOPS` set.
fn prepare_device<M: DeviceMemory>(mem: &M) -> Result<()> {
    use cudarc::driver::sys::CUdevice_attribute as A;
    check_rdma_capable(mem)?;
    let ordinal = mem.ordinal();
    if device_attr(ordinal, A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED)? == 0 {
        return Err(Error::Unsupported {
            what: "GPUDirect RDMA".into(),
            reason: format!(
                "CUDA device {ordinal} reports CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED = 0"
            ),
        });
    }
    match set_sync_memops(ordinal, mem.device_ptr()) {
        // VMM mappings may not take the attribute; their copies are not deferred the way
        // cuMemAlloc memory's can be, so a refusal there is not an error.
        Err(Error::Cuda { .. }) if mem.kind() == MemoryKind::Vmm => Ok(()),
        r => r,
    }
}

fn device_attr(ordinal: usize, a: cudarc::driver::sys::CUdevice_attribute) -> Result<i32> {
    let ctx = crate::cuda::context(ordinal)?;
    ctx.attribute(a)
        .map_err(|e| crate::error::from_driver("cuDeviceGetAttribute", e))
}

// SAFETY: an owned device buffer's range stays valid and unmoved while it lives (the
// `DeviceMemory` contract); the dma-buf export covers the same bytes at `DmaBufRange::offset`;
// `ibv_reg_mr` is only reached when a peer-memory module resolves device pointers.
unsafe impl<M: DeviceMemoryMut> GpuMrSource for M {
    fn nic_addr(&self) -> u64 {
        self.device_ptr()
    }

    fn nic_len(&self) -> usize {
        self.byte_len()
    }

    fn prepare(&self) -> Result<()> {
        prepare_device(self)
    }

    unsafe fn export_dmabuf(&self) -> Result<(OwnedFd, u64), GpuMrRefusal> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        let ordinal = self.ordinal();
        match device_attr(ordinal, A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) {
            Ok(0) => return Err(GpuMrRefusal::NoDmaBufSupport { ordinal }),
            Ok(_) => {}
            Err(e) => return Err(GpuMrRefusal::Failed(e)),
        }
        match crate::memory::dmabuf::export_dmabuf_range(
            ordinal,
            self.device_ptr(),
            self.byte_len() as u64,
        ) {
            Ok((fd, range)) => Ok((fd, range.offset)),
            Err(e @ (Error::Load(_) | Error::Unsupported { .. })) => {
                Err(GpuMrRefusal::Unsupported(e))
            }
            Err(e) if e.cuda_name() == Some("CUDA_ERROR_NOT_SUPPORTED") => {
                Err(GpuMrRefusal::Unsupported(e))
            }
            Err(e) => Err(GpuMrRefusal::Failed(e)),
        }
    }

    fn peermem(&self) -> Result<(), GpuMrRefusal> {
        match gpudirect_sys::peermem::peermem_module() {
            Some(_) => Ok(()),
            None => Err(GpuMrRefusal::NoPeermemModule),
        }
    }
}

/// Try `order`'s paths one after the other with `attempt`, which gives the source back with a
/// [`GpuMrRefusal`] when its path is not taken. Returns the first success with its path, and every
/// refusal before it; or the source back with all refusals.
#[allow(clippy::type_complexity)]
pub(crate) fn run_paths<S, T>(
    order: &[GpuMrPath],
    src: S,
    mut attempt: impl FnMut(GpuMrPath, S) -> Result<T, (S, GpuMrRefusal)>,
) -> (Result<(T, GpuMrPath), S>, GpuMrAttempts) {
    let mut refused = Vec::new();
    let mut src = src;
    for &path in order {
        match attempt(path, src) {
            Ok(t) => return (Ok((t, path)), GpuMrAttempts(refused)),
            Err((s, r)) => {
                refused.push((path, r));
                src = s;
            }
        }
    }
    (Err(src), GpuMrAttempts(refused))
}

/// What the NIC may reach through a dma-buf region: the fd is declared first so it is closed
/// before the memory is dropped.
struct DmabufOwner<S> {
    _fd: OwnedFd,
    _src: S,
}

/// A memory region over GPU memory (or another [`GpuMrSource`]), registered by
/// [`ProtectionDomain::register_gpu`]. It owns the memory (and the dma-buf fd); slices of it go
/// into work requests like host regions' slices. Its bytes are never handed out on the host.
#[doc(alias = "ibv_reg_dmabuf_mr")]
#[doc(alias = "ibv_reg_mr")]
pub struct GpuMemoryRegion<S> {
    inner: Arc<MrInner>,
    path: GpuMrPath,
    attempts: GpuMrAttempts,
    dmabuf_offset: Option<u64>,
    /// The source, inside the owner `inner` keeps (a stable heap address until `inner` drops).
    src: std::ptr::NonNull<S>,
    _src: PhantomData<S>,
}

// SAFETY: the region owns `S` (through `inner`); moving the region moves ownership, which `S:
// Send` allows. The verbs handle is thread-safe.
unsafe impl<S: Send> Send for GpuMemoryRegion<S> {}
// SAFETY: shared access hands out `&S` only (`memory`), which `S: Sync` allows.
unsafe impl<S: Sync> Sync for GpuMemoryRegion<S> {}

/// What one path's verbs call registered: `len` bytes addressed from `addr` with `access`, and
/// the offset inside the dma-buf when the path was dma-buf.
#[derive(Debug, Clone, Copy)]
struct Span {
    addr: u64,
    len: usize,
    access: AccessFlags,
    dmabuf_offset: Option<u64>,
}

impl Span {
    /// What `ibv_reg_dmabuf_mr` registered with `args`.
    fn dmabuf(args: DmabufRegArgs) -> Span {
        Span {
            addr: args.iova,
            len: args.len,
            access: args.access,
            dmabuf_offset: Some(args.offset),
        }
    }
}

/// A registration made by one path: the region, the source inside its owner, and the dma-buf
/// offset when the path was dma-buf.
struct Registered<S> {
    inner: Arc<MrInner>,
    src: std::ptr::NonNull<S>,
    dmabuf_offset: Option<u64>,
}

impl<S> Registered<S> {
    /// Wrap `mr` with `owner`, which holds the source (found in it by `src`) and, for dma-buf,
    /// the fd: the region drops it only after `ibv_dereg_mr` succeeded.
    ///
    /// # Safety
    ///
    /// `mr` was just registered in `pd` over `span.len` bytes addressed from `span.addr`, and the
    /// memory it covers stays valid while `owner` lives.
    unsafe fn new<O: Send + 'static>(
        pd: &ProtectionDomain,
        mr: std::ptr::NonNull<ibv::ibv_mr>,
        span: Span,
        owner: Box<O>,
        src: impl FnOnce(&O) -> &S,
    ) -> Self {
        let Span {
            addr,
            len,
            access,
            dmabuf_offset,
        } = span;
        // A stable heap address: the box's contents do not move with it.
        let src = std::ptr::NonNull::from(src(&owner));
        // SAFETY: the caller's contract; `addr` is an IOVA or device pointer, never dereferenced.
        let inner = unsafe {
            MrInner::registered(mr, addr as *mut u8, len, access, pd.inner.clone(), owner)
        };
        Registered {
            inner,
            src,
            dmabuf_offset,
        }
    }
}

impl<S> GpuMemoryRegion<S> {
    /// The path that registered it.
    pub fn path(&self) -> GpuMrPath {
        self.path
    }

    /// The memory registered. A shared reference to the buffer value, never to its bytes: device
    /// bytes are only reached through copies (which see whatever the NIC has written so far; copy
    /// after the completion that wrote them, and after [`flush_gpudirect_rdma_writes`] where the
    /// device needs it).
    pub fn memory(&self) -> &S {
        // SAFETY: `src` points into the owner `inner` keeps alive as long as `self`; only shared
        // references to it are ever made.
        unsafe { self.src.as_ref() }
    }

    /// For a dma-buf region, the `offset` passed to `ibv_reg_dmabuf_mr`: where the first byte sits
    /// inside the exported (4 KiB-aligned) range.
    pub fn dmabuf_offset(&self) -> Option<u64> {
        self.dmabuf_offset
    }

    /// The paths refused before [`path`](Self::path) was taken (empty when the first one worked).
    pub fn attempts(&self) -> &GpuMrAttempts {
        &self.attempts
    }

    region_accessors!(
        "The address of the first byte as work requests and peers use it: the IOVA of a dma-buf \
         region (the device pointer), the device pointer on the peer-memory path."
    );

    fn new(reg: Registered<S>, path: GpuMrPath, attempts: GpuMrAttempts) -> Self {
        GpuMemoryRegion {
            inner: reg.inner,
            path,
            attempts,
            dmabuf_offset: reg.dmabuf_offset,
            src: reg.src,
            _src: PhantomData,
        }
    }
}

impl<S> fmt::Debug for GpuMemoryRegion<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuMemoryRegion")
            .field("path", &self.path)
            .field("dmabuf_offset", &self.dmabuf_offset)
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("lkey", &format_args!("{:#x}", self.lkey()))
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .field("access", &self.access())
            .field("refused", &format_args!("{}", self.attempts))
            .finish()
    }
}

impl ProtectionDomain {
    /// Register GPU memory with the NIC by dma-buf or nvidia-peermem (see
    /// [GPU memory regions](crate::rdma#gpu-memory-regions) for both paths and the automatic
    /// order). The region owns
    /// `src`; `access` may include remote write and atomics (GPU bytes are never borrowed on the
    /// host).
    ///
    /// Order of checks: the length and access (no FFI), then [`GpuMrSource::prepare`] (pool
    /// memory refused, `SYNC_MEMOPS` set), then libibverbs, then the paths.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty or overflowing range or host memory;
    /// [`Error::NotRdmaCapable`] for pool memory (cudarc's `CudaSlice`); [`Error::Load`] without
    /// libibverbs. With [`GpuRegistration::Auto`]: [`Error::NoGpuRegistrationPath`] listing each
    /// path and its [`GpuMrRefusal`]. With one path: that path's error ([`Error::Unsupported`] saying
    /// dma-buf when `ibv_reg_dmabuf_mr` answers `EOPNOTSUPP`, or naming nvidia-peermem when the
    /// module is absent; [`Error::Os`] with the errno of a failed `ibv_reg_mr` /
    /// `ibv_reg_dmabuf_mr`; [`Error::Cuda`] from the export).
    #[doc(alias = "ibv_reg_dmabuf_mr")]
    #[doc(alias = "cuMemGetHandleForAddressRange")]
    #[doc(alias = "ibv_reg_mr")]
    pub fn register_gpu<S: GpuMrSource>(
        &self,
        src: S,
        access: AccessFlags,
        how: GpuRegistration,
    ) -> Result<GpuMemoryRegion<S>> {
        let (addr, len) = (src.nic_addr(), src.nic_len());
        // Checked before any FFI call: the same arithmetic the dma-buf step uses.
        let _ = DmabufRegArgs::new(0, len, addr, access)?;
        let access = access.normalized();
        src.prepare()?;
        let l = verbs()?;
        let (r, attempts) = run_paths(how.order(), src, |path, s| match path {
            GpuMrPath::DmaBuf => self.try_dmabuf(l, s, access),
            GpuMrPath::Peermem => self.try_peermem(l, s, access),
        });
        match r {
            Ok((reg, path)) => Ok(GpuMemoryRegion::new(reg, path, attempts)),
            Err(_src) if how != GpuRegistration::Auto => {
                let (path, refusal) = attempts.0.into_iter().next().expect("one path tried");
                Err(refusal.into_error(path))
            }
            Err(_src) => Err(Error::NoGpuRegistrationPath { attempts }),
        }
    }

    fn try_dmabuf<S: GpuMrSource>(
        &self,
        l: &ibv::Lib,
        s: S,
        access: AccessFlags,
    ) -> Result<Registered<S>, (S, GpuMrRefusal)> {
        // SAFETY: the fd goes into the region's owner beside `s`, declared first so that it is
        // closed before `s` is dropped; on refusal it is closed here, while `s` is alive.
        let (fd, offset) = match unsafe { s.export_dmabuf() } {
            Ok(x) => x,
            Err(r) => return Err((s, r)),
        };
        let args = match DmabufRegArgs::new(offset, s.nic_len(), s.nic_addr(), access) {
            Ok(a) => a,
            Err(e) => return Err((s, GpuMrRefusal::Failed(e))),
        };
        match self.reg_dmabuf(l, std::os::fd::AsFd::as_fd(&fd), args) {
            // SAFETY: `mr` was just registered in this PD over `args.len` bytes addressed from
            // `args.iova`; the owner keeps the fd and the memory until after dereg.
            Ok(mr) => Ok(unsafe {
                Registered::new(
                    self,
                    mr,
                    Span::dmabuf(args),
                    Box::new(DmabufOwner { _fd: fd, _src: s }),
                    |o| &o._src,
                )
            }),
            Err(e @ Error::Unsupported { .. }) => Err((s, GpuMrRefusal::Unsupported(e))),
            Err(e) => Err((s, GpuMrRefusal::Failed(e))),
        }
    }

    /// `ibv_reg_dmabuf_mr(pd, offset, len, iova, fd, access)` over a dma-buf export made by
    /// [`crate::memory::export_dmabuf`]: registers exactly the export's requested bytes
    /// ([`DmaBuf::range`]: `offset` inside the fd, `len`, `iova` = the device pointer). The region
    /// owns the export, so the fd and the memory outlive the registration: `ibv_dereg_mr` first,
    /// then the fd closed, then the memory dropped. The memory must be owned
    /// ([`DeviceMemoryMut`]), since the NIC may write it.
    ///
    /// There is no safe way to register any other fd: an fd alone says nothing about how long
    /// the memory behind it lives. [`register_dmabuf_fd`](Self::register_dmabuf_fd) is the
    /// `unsafe` form for dma-bufs of other exporters.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an export whose numbers overflow; [`Error::NotRdmaCapable`]
    /// or [`Error::Unsupported`] when the memory or device cannot do GPUDirect RDMA (checked
    /// before any verbs call, as [`register_gpu`](Self::register_gpu) does); [`Error::Load`]
    /// without libibverbs; [`Error::Unsupported`] saying dma-buf when `ibv_reg_dmabuf_mr` is
    /// missing or answers `EOPNOTSUPP`; [`Error::Os`] naming `ibv_reg_dmabuf_mr` otherwise.
    #[doc(alias = "ibv_reg_dmabuf_mr")]
    pub fn register_dmabuf<M: DeviceMemoryMut>(
        &self,
        export: DmaBuf<M>,
        access: AccessFlags,
    ) -> Result<GpuMemoryRegion<DmaBuf<M>>> {
        let r = export.range();
        let len = usize::try_from(r.len)
            .map_err(|_| Error::invalid("export", r.len, "length does not fit usize"))?;
        let args = DmabufRegArgs::new(r.offset, len, r.iova, access)?;
        prepare_device(export.memory())?;
        let l = verbs()?;
        let mr = self.reg_dmabuf(l, export.fd(), args)?;
        // SAFETY: `mr` was just registered in this PD over `args.len` bytes addressed from
        // `args.iova`; the owner keeps the fd and the memory until after dereg.
        let reg = unsafe { Registered::new(self, mr, Span::dmabuf(args), Box::new(export), |o| o) };
        Ok(GpuMemoryRegion::new(
            reg,
            GpuMrPath::DmaBuf,
            GpuMrAttempts::default(),
        ))
    }

    fn try_peermem<S: GpuMrSource>(
        &self,
        l: &ibv::Lib,
        s: S,
        access: AccessFlags,
    ) -> Result<Registered<S>, (S, GpuMrRefusal)> {
        if let Err(r) = s.peermem() {
            return Err((s, r));
        }
        let (addr, len) = (s.nic_addr(), s.nic_len());
        // SAFETY: `addr..addr+len` is memory `s` keeps valid (GpuMrSource contract), which the
        // region owns until after ibv_dereg_mr; the PD is live.
        let p = unsafe {
            (l.ibv_reg_mr)(
                self.as_raw(),
                addr as *mut std::ffi::c_void,
                len,
                access.bits() as i32,
            )
        };
        let span = Span {
            addr,
            len,
            access,
            dmabuf_offset: None,
        };
        match nonnull("ibv_reg_mr", p) {
            // SAFETY: registered just now in this PD over exactly these bytes; the owner holds
            // the memory until after dereg.
            Ok(mr) => Ok(unsafe { Registered::new(self, mr, span, Box::new(s), |o| o) }),
            Err(e) => Err((s, GpuMrRefusal::Failed(e))),
        }
    }
}

/// The scope of [`flush_gpudirect_rdma_writes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FlushScope {
    /// `CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER` (100): visible to the context owning the data.
    Owner,
    /// `CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_ALL_DEVICES` (200): visible to every device context.
    AllDevices,
}

impl FlushScope {
    /// The C value (100 or 200), comparable with `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`.
    pub fn raw(self) -> i32 {
        match self {
            FlushScope::Owner => 100,
            FlushScope::AllDevices => 200,
        }
    }
}

/// What [`flush_gpudirect_rdma_writes`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FlushOutcome {
    /// `cuFlushGPUDirectRDMAWrites` ran and returned.
    Flushed,
    /// The device already orders GPUDirect RDMA writes at this scope
    /// (`..._GPU_DIRECT_RDMA_WRITES_ORDERING` ≥ the scope): the call is a no-op and was skipped.
    AlreadyOrdered,
}

/// Decide a flush from the device's `..._GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS` bit mask and
/// `..._GPU_DIRECT_RDMA_WRITES_ORDERING` value.
///
/// # Errors
///
/// [`Error::Unsupported`] when the options lack `CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST` (1).
pub fn flush_plan(
    ordinal: usize,
    options: i32,
    ordering: i32,
    scope: FlushScope,
) -> Result<FlushOutcome> {
    if options & 1 == 0 {
        return Err(Error::Unsupported {
            what: "cuFlushGPUDirectRDMAWrites".into(),
            reason: format!(
                "CUDA device {ordinal} reports CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS = {options} (no HOST bit)"
            ),
        });
    }
    Ok(if ordering >= scope.raw() {
        FlushOutcome::AlreadyOrdered
    } else {
        FlushOutcome::Flushed
    })
}

/// `cuFlushGPUDirectRDMAWrites(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX, scope)` on
/// `ctx` (made current): blocks until GPUDirect RDMA writes a NIC made to this device's memory are
/// visible at `scope`. Call it before a GPU consumer reads what a NIC wrote, when the device's
/// write ordering does not already cover the scope (then nothing is called:
/// [`FlushOutcome::AlreadyOrdered`]).
///
/// # Errors
///
/// [`Error::Unsupported`] when the device's flush options lack the host flush bit;
/// [`Error::Load`] when the driver lacks the entry point; [`Error::Cuda`] from the call.
#[doc(alias = "cuFlushGPUDirectRDMAWrites")]
pub fn flush_gpudirect_rdma_writes(
    ctx: &Arc<cudarc::driver::CudaContext>,
    scope: FlushScope,
) -> Result<FlushOutcome> {
    use cudarc::driver::sys;
    use sys::CUdevice_attribute as A;
    crate::cuda::init()?;
    gpudirect_sys::cuda::require_symbols(&["cuFlushGPUDirectRDMAWrites"])?;
    let ordinal = ctx.ordinal();
    let attr = |a| {
        ctx.attribute(a)
            .map_err(|e| crate::error::from_driver("cuDeviceGetAttribute", e))
    };
    let plan = flush_plan(
        ordinal,
        attr(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS)?,
        attr(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING)?,
        scope,
    )?;
    if plan == FlushOutcome::AlreadyOrdered {
        return Ok(plan);
    }
    crate::driver::ctx::bind(ctx)?;
    let s = match scope {
        FlushScope::Owner => {
            sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER
        }
        FlushScope::AllDevices => {
            sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_ALL_DEVICES
        }
    };
    // SAFETY: the symbol exists (checked); a context is current.
    unsafe { crate::driver::ctx::flush_gpudirect_rdma_writes(s) }?;
    Ok(FlushOutcome::Flushed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::mr::dmabuf_error;
    use gpudirect_sys::peermem::DmaBufRange;

    #[test]
    fn dmabuf_arguments_are_exact() {
        // 65544 bytes starting 40 bytes into a 2 MiB-aligned allocation.
        let ptr = 0x7f00_0020_0000u64 + 40;
        let r = DmaBufRange::new(ptr, 65544).unwrap();
        let a =
            DmabufRegArgs::new(r.offset, r.len as usize, ptr, AccessFlags::REMOTE_WRITE).unwrap();
        assert_eq!((a.offset, a.len, a.iova), (40, 65544, ptr));
        assert_eq!(
            a.access,
            AccessFlags::REMOTE_WRITE | AccessFlags::LOCAL_WRITE
        );
        assert_eq!(a.access.bits(), 3);
        // The registered bytes lie inside the export.
        assert!(r.offset + a.len as u64 <= r.export_len);
        // Two 40-byte buffers in one page: distinct, non-overlapping registrations.
        let page = 0x10_0000u64;
        let (x, y) = (
            DmaBufRange::new(page + 100, 40).unwrap(),
            DmaBufRange::new(page + 200, 40).unwrap(),
        );
        let ax = DmabufRegArgs::new(x.offset, 40, x.iova, AccessFlags::REMOTE_READ).unwrap();
        let ay = DmabufRegArgs::new(y.offset, 40, y.iova, AccessFlags::REMOTE_READ).unwrap();
        assert_eq!((ax.offset, ax.iova), (100, page + 100));
        assert_eq!((ay.offset, ay.iova), (200, page + 200));
        assert!(ax.iova + ax.len as u64 <= ay.iova);
        assert_eq!(ax.access, AccessFlags::REMOTE_READ);
    }

    #[test]
    fn dmabuf_arguments_are_checked_before_ffi() {
        assert!(matches!(
            DmabufRegArgs::new(0, 0, 0x1000, AccessFlags::empty()),
            Err(Error::InvalidArgument { arg: "len", .. })
        ));
        assert!(DmabufRegArgs::new(u64::MAX - 4, 8, 0, AccessFlags::empty()).is_err());
        assert!(DmabufRegArgs::new(0, 8, u64::MAX - 4, AccessFlags::empty()).is_err());
        let a = DmabufRegArgs::new(4095, 2, 0x2fff, AccessFlags::REMOTE_ATOMIC).unwrap();
        assert_eq!(a.access.bits(), 9);
    }

    #[test]
    fn eopnotsupp_is_unsupported_saying_dmabuf() {
        for errno in [libc::EOPNOTSUPP, libc::ENOSYS, libc::EPROTONOSUPPORT] {
            let e = dmabuf_error(Error::errno("ibv_reg_dmabuf_mr", errno), "rxe0");
            match &e {
                Error::Unsupported { what, reason } => {
                    assert!(what.contains("dma-buf"), "{what}");
                    assert!(reason.contains("rxe0"), "{reason}");
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        let e = dmabuf_error(Error::errno("ibv_reg_dmabuf_mr", libc::EINVAL), "rxe0");
        match e {
            Error::Os { call, source } => {
                assert_eq!(call, "ibv_reg_dmabuf_mr");
                assert_eq!(source.raw_os_error(), Some(libc::EINVAL));
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn errors_and_regions_cross_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Error>();
        send_sync::<GpuMrAttempts>();
        send_sync::<GpuMemoryRegion<crate::memory::DeviceBuffer<u8>>>();
        send_sync::<GpuMemoryRegion<crate::memory::VmmBuffer<u32>>>();
    }

    #[test]
    fn auto_order_is_dmabuf_then_peermem() {
        assert_eq!(
            GpuRegistration::Auto.order(),
            &[GpuMrPath::DmaBuf, GpuMrPath::Peermem]
        );
        assert_eq!(GpuRegistration::default(), GpuRegistration::Auto);
        assert_eq!(GpuRegistration::DmaBuf.order(), &[GpuMrPath::DmaBuf]);
        assert_eq!(GpuRegistration::Peermem.order(), &[GpuMrPath::Peermem]);
    }

    #[test]
    fn paths_fall_through_and_record_why() {
        let mut tried = Vec::new();
        let (r, attempts) = run_paths(GpuRegistration::Auto.order(), "mem", |p, s| {
            tried.push(p);
            match p {
                GpuMrPath::DmaBuf => Err((
                    s,
                    GpuMrRefusal::Unsupported(dmabuf_error(
                        Error::errno("ibv_reg_dmabuf_mr", libc::EOPNOTSUPP),
                        "rxe0",
                    )),
                )),
                GpuMrPath::Peermem => Ok(7),
            }
        });
        assert_eq!(tried, [GpuMrPath::DmaBuf, GpuMrPath::Peermem]);
        assert_eq!(r.unwrap(), (7, GpuMrPath::Peermem));
        assert_eq!(attempts.as_slice().len(), 1);
        assert!(matches!(
            attempts.refusal(GpuMrPath::DmaBuf),
            Some(GpuMrRefusal::Unsupported(Error::Unsupported { .. }))
        ));
        let text = attempts.to_string();
        assert!(text.starts_with("dma-buf: unsupported:"), "{text}");

        // Everything refused: the source comes back with both reasons.
        let (r, attempts) = run_paths::<_, ()>(GpuRegistration::Auto.order(), 5u8, |p, s| {
            Err((
                s,
                match p {
                    GpuMrPath::DmaBuf => GpuMrRefusal::NoDmaBufSupport { ordinal: 0 },
                    GpuMrPath::Peermem => GpuMrRefusal::NoPeermemModule,
                },
            ))
        });
        assert_eq!(r.unwrap_err(), 5);
        let e = Error::NoGpuRegistrationPath { attempts };
        let text = e.to_string();
        assert!(
            text.contains("dma-buf: not tried: CUDA device 0 reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0"),
            "{text}"
        );
        assert!(
            text.contains("nvidia-peermem: not tried: neither nvidia_peermem nor nv_peer_mem"),
            "{text}"
        );
    }

    #[test]
    fn single_path_refusals_become_typed_errors() {
        let e = GpuMrRefusal::NoPeermemModule.into_error(GpuMrPath::Peermem);
        assert!(
            matches!(&e, Error::Unsupported { what, .. } if what.contains("nvidia-peermem")),
            "{e}"
        );
        let e = GpuMrRefusal::NoDmaBufSupport { ordinal: 1 }.into_error(GpuMrPath::DmaBuf);
        assert!(
            matches!(&e, Error::Unsupported { what, .. } if what.contains("dma-buf")),
            "{e}"
        );
    }

    #[test]
    fn flush_needs_the_host_option_and_skips_when_ordered() {
        use FlushOutcome::{AlreadyOrdered, Flushed};
        for options in [0, 2] {
            assert!(matches!(
                flush_plan(0, options, 0, FlushScope::Owner),
                Err(Error::Unsupported { .. })
            ));
        }
        for (options, ordering, scope, want) in [
            (1, 0, FlushScope::Owner, Flushed),
            (3, 100, FlushScope::Owner, AlreadyOrdered),
            (3, 100, FlushScope::AllDevices, Flushed),
            (1, 200, FlushScope::AllDevices, AlreadyOrdered),
        ] {
            assert_eq!(
                flush_plan(0, options, ordering, scope).unwrap(),
                want,
                "options {options}, ordering {ordering}, {scope:?}"
            );
        }
    }

    #[test]
    fn host_kinds_and_empty_buffers_are_refused_before_ffi() {
        use crate::memory::testing::FakeDevice as Fake;
        for k in [MemoryKind::PinnedHost, MemoryKind::RegisteredHost] {
            assert!(matches!(
                check_rdma_capable(&Fake(k, 64)),
                Err(Error::InvalidArgument { arg: "mem", .. })
            ));
        }
        assert!(matches!(
            check_rdma_capable(&Fake(MemoryKind::Device, 0)),
            Err(Error::InvalidArgument { arg: "mem", .. })
        ));
        // Pool memory is refused as such, whether or not a driver can be asked.
        match check_rdma_capable(&Fake(MemoryKind::Pool, 64)) {
            Err(Error::NotRdmaCapable { kind, reason, .. }) => {
                assert_eq!(kind, MemoryKind::Pool);
                assert!(reason.contains("not GPUDirect RDMA capable"), "{reason}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}
