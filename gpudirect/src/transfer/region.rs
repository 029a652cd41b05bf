//! Buffers handed to the engine, their registration with every rail, and the registration cache:
//! register once, reuse for every range inside, keyed by the memory's identity.

use super::descriptor::{DescribedKind, IpcPart, MemoryDescriptor, check_range};
use crate::error::{Error, GpuMrPath, Result};
use crate::memory::{DeviceMemory, DeviceMemoryMut, MemoryKind};
use crate::rdma::{GpuMemoryRegion, HostMemory, MemoryRegion, MrSlice, Remote};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

/// Device memory the engine holds, whatever its type.
pub(crate) trait DeviceBacking: Send + Sync {
    /// The device address of the first byte.
    fn ptr(&self) -> u64;
    /// Bytes.
    fn bytes(&self) -> usize;
    /// The CUDA device.
    fn ordinal(&self) -> usize;
    /// How it was allocated.
    fn kind(&self) -> MemoryKind;
    /// Its VMM mappings, when it knows them.
    fn mappings(&self) -> Option<Vec<(u64, usize)>>;
}

impl<M: DeviceMemoryMut + Sync> DeviceBacking for M {
    fn ptr(&self) -> u64 {
        self.device_ptr()
    }
    fn bytes(&self) -> usize {
        self.byte_len()
    }
    fn ordinal(&self) -> usize {
        DeviceMemory::ordinal(self)
    }
    fn kind(&self) -> MemoryKind {
        DeviceMemory::kind(self)
    }
    fn mappings(&self) -> Option<Vec<(u64, usize)>> {
        self.vmm_mappings()
    }
}

/// The memory behind a [`Buffer`], owned by the engine until the last region and transfer using
/// it are gone.
pub(crate) enum Backing {
    /// Host memory (heap, or CUDA pinned/registered host memory by its host address). The
    /// address stays valid while the owner lives; after registration no reference to the bytes
    /// is made again (only atomic copies).
    Host {
        _owner: Box<dyn Send + Sync>,
        ptr: usize,
        len: usize,
        /// Ordinary memory the CPU reads through its caches (not CUDA host memory, which may
        /// be write-combined): a few bytes of it may go inline in a work request.
        cached: bool,
    },
    /// Device memory, reached only by the NIC and by CUDA copies.
    Device(Box<dyn DeviceBacking>),
}

/// How many times memory that requests' copies may name went away: a [`Backing`] dropped (its
/// memory freed with it) or a peer's allocation unmapped. A copy graph whose nodes were set to
/// some addresses launches them again without setting them only while this has not moved
/// (another allocation may since lie at the same addresses).
static RELEASED: AtomicU64 = AtomicU64::new(0);

/// Count memory going away; called before it is freed or unmapped.
pub(crate) fn memory_released() {
    RELEASED.fetch_add(1, Ordering::SeqCst);
}

/// How many times memory went away so far ([`memory_released`]).
#[cfg_attr(not(feature = "p2p"), allow(dead_code))]
pub(crate) fn memory_released_count() -> u64 {
    RELEASED.load(Ordering::SeqCst)
}

impl Drop for Backing {
    fn drop(&mut self) {
        // Before the owner (its fields, dropped after this) frees the memory.
        memory_released();
        // On a thread that frees nothing (a waker's code on a progress thread or a stream
        // proxy took a transfer's result, the memory's last holder), the memory goes to a
        // thread that may free it: `cuMemFree` waits for the device, whose streams may wait
        // for this thread.
        if crate::completion::elsewhere::frees_nothing_here() {
            let owner: Box<dyn Send> = match self {
                Backing::Host { _owner, .. } => Box::new(std::mem::replace(_owner, Box::new(()))),
                Backing::Device(d) => Box::new(std::mem::replace(d, Box::new(Gone))),
            };
            crate::completion::elsewhere::drop_elsewhere(owner);
        }
    }
}

/// What a [`Backing`] holds once its memory went to be freed elsewhere (only dropped).
struct Gone;

impl DeviceBacking for Gone {
    fn ptr(&self) -> u64 {
        0
    }
    fn bytes(&self) -> usize {
        0
    }
    fn ordinal(&self) -> usize {
        0
    }
    fn kind(&self) -> MemoryKind {
        MemoryKind::Device
    }
    fn mappings(&self) -> Option<Vec<(u64, usize)>> {
        None
    }
}

impl Backing {
    fn len(&self) -> usize {
        match self {
            Backing::Host { len, .. } => *len,
            Backing::Device(d) => d.bytes(),
        }
    }
}

/// Memory to register with a transfer [`Engine`](super::Engine): host memory, or GPU memory, owned by value
/// (the engine holds it until every region and transfer using it is gone), or a view of such a
/// buffer ([`slice`](Self::slice): views share the memory). Cheap to clone (a view of the same
/// bytes).
#[derive(Clone)]
pub struct Buffer {
    pub(crate) backing: Arc<Backing>,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

impl Buffer {
    /// Host memory (a `Vec<u8>`, `Box<[u8]>`, [`HostBuffer`](crate::rdma::HostBuffer), or any
    /// [`HostMemory`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty buffer.
    pub fn host<B: HostMemory>(mut mem: B) -> Result<Buffer> {
        let len = mem.len();
        let ptr = mem.as_mut_ptr() as usize;
        Self::new(Backing::Host {
            _owner: Box::new(mem),
            ptr,
            len,
            cached: true,
        })
    }

    /// GPU memory ([`DeviceBuffer`](crate::memory::DeviceBuffer),
    /// [`VmmBuffer`](crate::memory::VmmBuffer), [`PoolBuffer`](crate::memory::PoolBuffer)), or
    /// CUDA host memory ([`PinnedHostBuffer`](crate::memory::PinnedHostBuffer),
    /// [`RegisteredHost`](crate::memory::RegisteredHost)), which is registered as host memory
    /// by its host address.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty buffer, or host memory without a host address.
    pub fn device<M: DeviceMemoryMut + Sync>(mem: M) -> Result<Buffer> {
        if mem.kind().is_device() {
            return Self::new(Backing::Device(Box::new(mem)));
        }
        let len = mem.byte_len();
        let Some(ptr) = mem.host_ptr() else {
            return Err(Error::invalid(
                "mem",
                format!("{:?}", mem.kind()),
                "host memory needs a host address",
            ));
        };
        Self::new(Backing::Host {
            _owner: Box::new(mem),
            ptr: ptr as usize,
            len,
            cached: false,
        })
    }

    fn new(b: Backing) -> Result<Buffer> {
        let len = b.len();
        if len == 0 {
            return Err(Error::invalid(
                "mem",
                "0 bytes",
                "a buffer holds at least one byte",
            ));
        }
        Ok(Buffer {
            backing: Arc::new(b),
            offset: 0,
            len,
        })
    }

    /// Bytes in this view.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: a buffer holds at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// `len` bytes at `offset` of this view, sharing the memory.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty range or one past the end.
    pub fn slice(&self, offset: usize, len: usize) -> Result<Buffer> {
        check_range(offset as u64, len as u64, self.len as u64)?;
        Ok(Buffer {
            backing: self.backing.clone(),
            offset: self.offset + offset,
            len,
        })
    }

    /// Whether the memory is on a GPU.
    pub fn is_device(&self) -> bool {
        matches!(*self.backing, Backing::Device(_))
    }

    /// The address of the view's first byte: host or device.
    pub(crate) fn addr(&self) -> u64 {
        // The backing's range fits the address space (its owner holds it); offset < len.
        match &*self.backing {
            Backing::Host { ptr, .. } => (*ptr + self.offset) as u64,
            Backing::Device(d) => d.ptr() + self.offset as u64,
        }
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .field("device", &self.is_device())
            .finish()
    }
}

/// Host memory handed to `ibv_reg_mr`: `len` bytes at `ptr` inside backings the region keeps.
pub(crate) struct HostSlice {
    pub(crate) _keep: Vec<Arc<Backing>>,
    pub(crate) ptr: usize,
    pub(crate) len: usize,
}

// SAFETY: `ptr..ptr + len` lies inside host memory owned by `_keep` (checked when the slice is
// made), which does not move and stays valid while the Arcs live; the slice lives exactly as long
// as its region. No reference to the bytes is made.
unsafe impl HostMemory for HostSlice {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr as *mut u8
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// Device memory handed to the GPU registration paths: `len` bytes at `ptr` inside backings the
/// region keeps.
pub(crate) struct DeviceSlice {
    pub(crate) keep: Vec<Arc<Backing>>,
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    pub(crate) ordinal: usize,
    pub(crate) kind: MemoryKind,
}

// SAFETY: `ptr..ptr + len` lies inside device memory of `kind` on `ordinal` owned by `keep`
// (checked when the slice is made), valid and unmoved while the Arcs live.
unsafe impl DeviceMemory for DeviceSlice {
    type Elem = u8;
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn ordinal(&self) -> usize {
        self.ordinal
    }
    fn kind(&self) -> MemoryKind {
        self.kind
    }
    fn vmm_mappings(&self) -> Option<Vec<(u64, usize)>> {
        match self.keep.first().map(|b| &**b) {
            Some(Backing::Device(d)) => d.mappings(),
            _ => None,
        }
    }
}

// SAFETY: device bytes are never referenced on the host; the engine, which alone holds these
// backings, only lets the NIC and CUDA copies reach them.
unsafe impl DeviceMemoryMut for DeviceSlice {}

/// The link a CUDA IPC copy crosses between the local memory and the peer's GPU.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum IpcLink {
    /// Both on one GPU: a copy inside its memory.
    SameDevice,
    /// NVLink between the two GPUs (`links` active links, or the smaller switch link count
    /// through NVSwitch).
    Nvlink {
        /// Active links.
        links: u32,
    },
    /// PCIe peer to peer between the two GPUs.
    Pcie,
    /// Local host memory and the peer's GPU: over the GPU's host link.
    LocalHost,
    /// The link could not be told (NVML absent, the peer's GPU not visible here); why.
    Unknown {
        /// What could not be answered.
        reason: String,
    },
}

impl std::fmt::Display for IpcLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IpcLink::SameDevice => f.write_str("the same device"),
            IpcLink::Nvlink { links } => write!(f, "NVLink (NV{links})"),
            IpcLink::Pcie => f.write_str("PCIe"),
            IpcLink::LocalHost => f.write_str("the GPU's host link (local host memory)"),
            IpcLink::Unknown { reason } => write!(f, "an unknown link ({reason})"),
        }
    }
}

/// How a transfer's local memory reaches the peer: through the NIC (registered or staged), or
/// through CUDA IPC inside the node.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemoryPath {
    /// Host memory registered with `ibv_reg_mr`.
    Host,
    /// GPU memory registered directly: dma-buf or nvidia-peermem.
    GpuDirect(GpuMrPath),
    /// GPU memory that cannot be registered, moved through pinned host bounce buffers; why it
    /// could not be registered.
    Staged {
        /// The refusal that made it staged.
        reason: String,
    },
    /// Memory of an engine without rails ([`EngineConfig::local`](super::EngineConfig::local)):
    /// registered with no NIC; reached only inside the node.
    Unregistered,
    /// A copy inside the node: the peer's GPU memory mapped here (`cuIpcOpenMemHandle`; for
    /// VMM memory the file descriptor it sent, imported and mapped; for pool memory its pool's
    /// file descriptor imported and the pointer imported into it) and copied over `link` (by
    /// the copy engines: a graph launch of copy nodes or `cuMemcpyAsync`; or by the copy
    /// kernel). Which one is in the remote descriptor's [`IpcPart::kind`].
    CudaIpc {
        /// What the bytes cross.
        link: IpcLink,
    },
}

impl std::fmt::Display for MemoryPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemoryPath::Host => f.write_str("host memory"),
            MemoryPath::GpuDirect(p) => write!(f, "GPU memory registered by {p}"),
            MemoryPath::Staged { reason } => {
                write!(
                    f,
                    "GPU memory staged through pinned host buffers ({reason})"
                )
            }
            MemoryPath::Unregistered => {
                f.write_str("memory registered with no NIC (an engine without rails)")
            }
            MemoryPath::CudaIpc {
                link: IpcLink::SameDevice,
            } => f.write_str("CUDA IPC on the same device"),
            MemoryPath::CudaIpc { link } => write!(f, "CUDA IPC over {link}"),
        }
    }
}

/// One rail's registration.
pub(crate) enum RailMr {
    Host(MemoryRegion<Remote>),
    Gpu(GpuMemoryRegion<DeviceSlice>),
}

impl RailMr {
    /// `len` bytes at `offset` of the region, for a work request.
    pub(crate) fn slice(&self, offset: usize, len: usize) -> Result<MrSlice> {
        let end = Self::end(offset, len)?;
        match self {
            RailMr::Host(m) => m.slice(offset..end),
            RailMr::Gpu(m) => m.slice(offset..end),
        }
    }

    /// Whether [`slice`](Self::slice) would succeed, building nothing.
    pub(crate) fn check_slice(&self, offset: usize, len: usize) -> Result<()> {
        let end = Self::end(offset, len)?;
        match self {
            RailMr::Host(m) => m.check_slice(offset..end),
            RailMr::Gpu(m) => m.check_slice(offset..end),
        }
    }

    fn end(offset: usize, len: usize) -> Result<usize> {
        offset
            .checked_add(len)
            .ok_or_else(|| Error::invalid("range", offset, "offset plus length overflows"))
    }

    pub(crate) fn rkey(&self) -> u32 {
        match self {
            RailMr::Host(m) => m.rkey(),
            RailMr::Gpu(m) => m.rkey(),
        }
    }
}

/// What identifies memory in the cache. Host memory: its backing (host addresses of one backing
/// never belong to another while the cache holds it); device memory: the driver's buffer id of
/// the allocation (`CU_POINTER_ATTRIBUTE_BUFFER_ID`, never reused within the process).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Identity {
    Host { backing: usize },
    Device { ordinal: usize, buffer_id: u64 },
}

/// A registration: one range of one identity on every rail, holding the memory it covers.
pub(crate) struct Entry {
    pub(crate) id: Identity,
    /// The engine whose protection domains and devices the registrations belong to.
    pub(crate) engine: u64,
    /// Address of the first byte (host or device address space).
    pub(crate) start: u64,
    pub(crate) len: u64,
    /// One per engine device; empty for staged memory.
    pub(crate) mrs: Vec<RailMr>,
    pub(crate) path: MemoryPath,
    /// Host memory of [`Buffer::host`] only (ordinary, cached memory): small writes of it go
    /// inline.
    pub(crate) cached: bool,
    pub(crate) ordinal: Option<usize>,
    /// Engine devices nearest the memory.
    pub(crate) preferred: Vec<usize>,
    /// For staged and unregistered memory: what the copies reach.
    pub(crate) _keep: Vec<Arc<Backing>>,
    /// The allocation exported for CUDA IPC (once per registration), or why not.
    pub(crate) ipc: std::result::Result<Exported, String>,
}

/// An allocation exported for CUDA IPC: what every descriptor of its registrations carries.
#[derive(Debug, Clone)]
pub(crate) struct Exported {
    /// How a peer maps it.
    pub(crate) how: ExportedAs,
    /// The allocation's base and length (`cuMemGetAddressRange`; for VMM memory, the mapping
    /// of its one physical allocation; for pool memory, the pool allocation).
    pub(crate) base: u64,
    pub(crate) alloc_len: u64,
    /// The owning GPU's UUID.
    pub(crate) uuid: [u8; 16],
}

/// How an exported allocation is mapped by a peer.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "p2p"), allow(dead_code))] // made only by the CUDA IPC path
pub(crate) enum ExportedAs {
    /// `cuIpcGetMemHandle` of a `cuMemAlloc` allocation.
    Handle([u8; 64]),
    /// A VMM allocation's POSIX file descriptor, sent to peers when endpoints meet.
    Vmm(Arc<ExportFd>),
    /// An allocation of an exportable pool: the pool's POSIX file descriptor (shared by every
    /// registration of the pool's memory, sent to peers when endpoints meet) and the
    /// allocation's `cuMemPoolExportPointer` data.
    Pool {
        pool: Arc<ExportFd>,
        ptr_data: [u8; 64],
    },
}

/// A POSIX file descriptor exported for processes on the node: a VMM physical allocation's
/// (`cuMemExportToShareableHandle`, once per registration) or a memory pool's
/// (`cuMemPoolExportToShareableHandle`, once per pool while registrations of its memory live);
/// closed when the last registration holding it goes. The descriptor is never handed out: it
/// only crosses a local endpoint's socket to a peer (whose import then holds what it needs).
#[derive(Debug)]
#[cfg_attr(not(feature = "p2p"), allow(dead_code))] // made only by the CUDA IPC path
pub(crate) struct ExportFd {
    /// Unique in this process: names the descriptor in the descriptors and on the socket.
    pub(crate) id: u64,
    pub(crate) fd: std::os::fd::OwnedFd,
    /// What it is (for VMM memory, the bytes it maps), and the owning GPU's UUID: what its
    /// descriptors must say.
    pub(crate) of: FdOf,
    pub(crate) uuid: [u8; 16],
}

/// What an exported file descriptor is, as every descriptor naming it must say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "p2p"), allow(dead_code))] // made only by the CUDA IPC path
pub(crate) enum FdOf {
    /// A VMM physical allocation, mapping `len` bytes.
    Vmm { len: u64 },
    /// A stream-ordered memory pool.
    Pool,
}

impl Entry {
    fn covers(&self, start: u64, len: u64) -> bool {
        start >= self.start
            && start
                .checked_add(len)
                .is_some_and(|e| e <= self.start + self.len)
    }
}

/// Registration counters.
#[derive(Debug, Default)]
pub(crate) struct CacheStats {
    pub(crate) hits: AtomicU64,
    pub(crate) misses: AtomicU64,
    pub(crate) registered: AtomicU64,
    /// CUDA IPC imports this engine opened (`cuIpcOpenMemHandle`).
    pub(crate) imports: AtomicU64,
    /// Peers' pools this engine imported (`cuMemPoolImportFromShareableHandle`).
    pub(crate) pool_imports: AtomicU64,
}

/// What the registration cache has done so far ([`Engine::cache_stats`](super::Engine::cache_stats)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheCounters {
    /// Ranges served by a registration that already covered them.
    pub hits: u64,
    /// Ranges that needed a new registration.
    pub misses: u64,
    /// Registrations made (each on every rail); coalesced ranges count once.
    pub registrations: u64,
    /// Registrations alive now (held by regions or transfers).
    pub live: usize,
    /// Peer allocations this engine's local endpoints mapped (`cuIpcOpenMemHandle`, a VMM
    /// file descriptor imported and mapped, or a pool pointer imported with
    /// `cuMemPoolImportPointer`): each is opened once per (allocation, local GPU), a pool
    /// pointer once per allocation, and reused by every request and endpoint until none holds
    /// it.
    pub imports_opened: u64,
    /// Peers' pools this engine's local endpoints imported (`cuMemPoolImportFromShareableHandle`
    /// of the file descriptor the peer sent): once per pool, whatever the number of its
    /// allocations reached, until no imported pointer of it is held.
    pub pool_imports_opened: u64,
}

/// The registration cache: live entries by identity. Entries are held by the regions and
/// transfers that use them; the cache only finds them (and forgets the dead).
#[derive(Default)]
pub(crate) struct Cache {
    map: HashMap<Identity, Vec<Weak<Entry>>>,
}

impl Cache {
    pub(crate) fn lookup(&mut self, id: Identity, start: u64, len: u64) -> Option<Arc<Entry>> {
        let v = self.map.get_mut(&id)?;
        v.retain(|w| w.strong_count() > 0);
        let hit = v
            .iter()
            .filter_map(Weak::upgrade)
            .find(|e| e.covers(start, len));
        if v.is_empty() {
            self.map.remove(&id);
        }
        hit
    }

    /// The live entry registered on engine device `dev` under `rkey` that covers `len` bytes
    /// at `start`.
    pub(crate) fn by_rkey(
        &mut self,
        dev: usize,
        rkey: u32,
        start: u64,
        len: u64,
    ) -> Option<Arc<Entry>> {
        self.map
            .values()
            .flatten()
            .filter_map(Weak::upgrade)
            .find(|e| e.mrs.get(dev).is_some_and(|m| m.rkey() == rkey) && e.covers(start, len))
    }

    pub(crate) fn insert(&mut self, e: &Arc<Entry>) {
        self.map.entry(e.id).or_default().push(Arc::downgrade(e));
    }

    pub(crate) fn live(&mut self) -> usize {
        self.map.retain(|_, v| {
            v.retain(|w| w.strong_count() > 0);
            !v.is_empty()
        });
        self.map.values().map(Vec::len).sum()
    }
}

/// Merge ranges `(start, len, index)` of one identity into maximal runs of overlapping or
/// adjacent ranges: `(start, len, indices)`, in address order. Pure; checked arithmetic.
pub(crate) fn coalesce(mut ranges: Vec<(u64, u64, usize)>) -> Vec<(u64, u64, Vec<usize>)> {
    ranges.sort_by_key(|r| (r.0, r.1));
    let mut out: Vec<(u64, u64, Vec<usize>)> = Vec::new();
    for (s, l, i) in ranges {
        let end = s.saturating_add(l);
        if let Some(last) = out.last_mut() {
            let last_end = last.0.saturating_add(last.1);
            if s <= last_end {
                last.1 = last_end.max(end) - last.0;
                last.2.push(i);
                continue;
            }
        }
        out.push((s, l, vec![i]));
    }
    out
}

/// The regions a request holds until it is taken (one pair's on the stack).
pub(crate) type Regions = smallvec::SmallVec<[Region; 1]>;

/// Registered memory: a [`Buffer`] view with its registration on every rail (shared through the
/// engine's cache with every other region inside the same registration). Cheap to clone; the
/// registration and the memory go when the last region and transfer using them are gone.
///
/// The CPU reaches host bytes only through copies ([`read_at`](Self::read_at),
/// [`write_at`](Self::write_at)), made of atomic loads and stores: a NIC may write them at any
/// time, and other clones may copy at the same time, so no Rust reference to them is ever made.
#[derive(Clone)]
pub struct Region {
    pub(crate) entry: Arc<Entry>,
    pub(crate) buf: Buffer,
    /// Where the view starts inside the registration.
    pub(crate) at: u64,
}

impl Region {
    /// Bytes in the region.
    pub fn len(&self) -> usize {
        self.buf.len
    }

    /// Always `false`.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// How transfers of this memory reach the NIC.
    pub fn path(&self) -> &MemoryPath {
        &self.entry.path
    }

    /// Whether the memory is on a GPU.
    pub fn is_device(&self) -> bool {
        self.buf.is_device()
    }

    /// The descriptor a peer needs to read or write this whole region: one rkey per rail, and
    /// for GPU memory that can be exported a CUDA IPC part, through which a process on the same
    /// node reaches it: a `cuIpcGetMemHandle` handle for `cuMemAlloc` memory; for VMM memory
    /// inside one physical allocation the id of its POSIX file descriptor (exported once per
    /// registration); for an allocation of an exportable pool ([`PoolAlloc`](crate::p2p::PoolAlloc)
    /// of an [`IpcPool`](crate::p2p::IpcPool)) the id of the pool's POSIX file descriptor
    /// (exported once per pool) and the allocation's `cuMemPoolExportPointer` data (once per
    /// registration). A local endpoint sends the file descriptors to its peer when they meet,
    /// for the descriptors it publishes then.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for memory that no peer can reach: staged memory without an
    /// IPC part, or memory of an engine without rails that cannot be exported (host memory,
    /// memory of a pool without a shareable handle type such as the device's default pool, a
    /// VMM range across several physical allocations).
    #[doc(alias = "cuIpcGetMemHandle")]
    #[doc(alias = "cuMemExportToShareableHandle")]
    #[doc(alias = "cuMemPoolExportPointer")]
    pub fn descriptor(&self) -> Result<MemoryDescriptor> {
        self.descriptor_of(0, self.len() as u64)
    }

    /// The descriptor of `len` bytes at `offset` of the region (its rkeys reach the whole
    /// registration: see [`Engine::register_all`](super::Engine::register_all)).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a range outside the region, or memory no peer can reach
    /// (as [`descriptor`](Self::descriptor)).
    pub fn descriptor_of(&self, offset: u64, len: u64) -> Result<MemoryDescriptor> {
        check_range(offset, len, self.len() as u64)?;
        let rkeys: Vec<u32> = self.entry.mrs.iter().map(RailMr::rkey).collect();
        let kind = if self.is_device() {
            DescribedKind::Device
        } else {
            DescribedKind::Host
        };
        // at + offset + len <= entry.len, and entry.start + entry.len fits (a live allocation).
        let addr = self.entry.start + self.at + offset;
        match &self.entry.ipc {
            Ok(x) => {
                let off = addr.checked_sub(x.base).ok_or_else(|| {
                    Error::invalid("region", format!("{addr:#x}"), "lies before its allocation")
                })?;
                let part = match &x.how {
                    ExportedAs::Handle(h) => IpcPart::new(*h, x.alloc_len, off, x.uuid),
                    ExportedAs::Vmm(v) => IpcPart::vmm_fd(v.id, x.alloc_len, off, x.uuid),
                    ExportedAs::Pool { pool, ptr_data } => {
                        IpcPart::pool_ptr(pool.id, *ptr_data, x.alloc_len, off, x.uuid)
                    }
                };
                MemoryDescriptor::with_ipc(addr, len, kind, &rkeys, part)
            }
            Err(why) if rkeys.is_empty() => Err(Error::invalid(
                "region",
                &self.entry.path,
                format!(
                    "no peer can reach this memory: it is registered with no NIC, and not \
                     exported through CUDA IPC ({why})"
                ),
            )),
            Err(_) => MemoryDescriptor::new(addr, len, kind, &rkeys),
        }
    }

    /// `len` bytes at `offset`, for a transfer.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty range or one past the end.
    pub fn range(&self, offset: u64, len: u64) -> Result<LocalRange> {
        check_range(offset, len, self.len() as u64)?;
        Ok(LocalRange {
            region: self.clone(),
            offset,
            len,
        })
    }

    /// The whole region, for a transfer.
    pub fn all(&self) -> LocalRange {
        LocalRange {
            region: self.clone(),
            offset: 0,
            len: self.len() as u64,
        }
    }

    fn host_ptr(&self, offset: usize, len: usize, what: &'static str) -> Result<*mut u8> {
        check_range(offset as u64, len as u64, self.len() as u64).or_else(|e| {
            if len == 0 && offset <= self.len() {
                Ok(())
            } else {
                Err(e)
            }
        })?;
        match &*self.buf.backing {
            Backing::Host { ptr, .. } => Ok((*ptr + self.buf.offset + offset) as *mut u8),
            Backing::Device(_) => Err(Error::invalid(
                what,
                "device memory",
                "the CPU copies device bytes with copy_to_host / copy_from_host",
            )),
        }
    }

    /// Copy `dst.len()` bytes at `offset` out of a host region (atomic loads: a NIC may be
    /// writing them; they are stable once the transfer or notification that wrote them is seen).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a range past the end, or device memory.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let p = self.host_ptr(offset, dst.len(), "read_at")?;
        // SAFETY: `p..p + dst.len()` lies in host memory the region keeps alive; it is only
        // reached by atomic accesses here and by the NIC.
        unsafe { atomic_copy_out(p, dst) };
        Ok(())
    }

    /// Copy `src` into a host region at `offset` (atomic stores).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a range past the end, or device memory.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        let p = self.host_ptr(offset, src.len(), "write_at")?;
        // SAFETY: as in read_at.
        unsafe { atomic_copy_in(p, src) };
        Ok(())
    }

    /// The whole host region as a vector.
    ///
    /// # Errors
    ///
    /// As [`read_at`](Self::read_at).
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0; self.len()];
        self.read_at(0, &mut v)?;
        Ok(v)
    }

    /// Copy `dst.len()` bytes at `offset` of a device region to the host (`cuMemcpyDtoHAsync`
    /// on a stream of the memory's device, then its synchronization); host regions are read as
    /// [`read_at`](Self::read_at).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a range past the end; [`Error::Cuda`] from the copy.
    ///
    /// # Aborts
    ///
    /// As [`memory::copy`](crate::memory::copy): when the copy, once queued, cannot be proven
    /// complete (`dst` is borrowed: it cannot be parked).
    #[doc(alias = "cuMemcpyDtoHAsync")]
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        match &*self.buf.backing {
            Backing::Host { .. } => self.read_at(offset, dst),
            Backing::Device(d) => {
                check_range(offset as u64, dst.len() as u64, self.len() as u64)?;
                let src = d.ptr() + (self.buf.offset + offset) as u64;
                super::copy::copy_sync(d.ordinal(), src, dst.as_mut_ptr(), dst.len(), true)
            }
        }
    }

    /// Copy `src` into a device region at `offset` (`cuMemcpyHtoDAsync`, then synchronization);
    /// host regions are written as [`write_at`](Self::write_at).
    ///
    /// # Errors
    ///
    /// As [`copy_to_host`](Self::copy_to_host).
    ///
    /// # Aborts
    ///
    /// As [`copy_to_host`](Self::copy_to_host).
    #[doc(alias = "cuMemcpyHtoDAsync")]
    pub fn copy_from_host(&self, offset: usize, src: &[u8]) -> Result<()> {
        match &*self.buf.backing {
            Backing::Host { .. } => self.write_at(offset, src),
            Backing::Device(d) => {
                check_range(offset as u64, src.len() as u64, self.len() as u64)?;
                let dst = d.ptr() + (self.buf.offset + offset) as u64;
                super::copy::copy_sync(d.ordinal(), dst, src.as_ptr() as *mut u8, src.len(), false)
            }
        }
    }

    /// The host address of byte `offset` (host memory), for the staged path's ring.
    pub(crate) fn host_addr(&self, offset: u64) -> Option<*mut u8> {
        match &*self.buf.backing {
            Backing::Host { ptr, .. } => {
                Some((*ptr + self.buf.offset + offset as usize) as *mut u8)
            }
            Backing::Device(_) => None,
        }
    }

    /// The device pointer of byte `offset` (device memory), for the staged path.
    pub(crate) fn device_addr(&self, offset: u64) -> Option<(usize, u64)> {
        match &*self.buf.backing {
            Backing::Device(d) => Some((d.ordinal(), d.ptr() + self.buf.offset as u64 + offset)),
            Backing::Host { .. } => None,
        }
    }

    /// The device address of the region's first byte, for the caller's own kernels and CUDA
    /// calls; `None` for host memory. Transfers in flight read or write it: order such work
    /// after their completion (their events, or a stream transfer's completion word).
    pub fn device_ptr(&self) -> Option<u64> {
        self.device_addr(0).map(|(_, a)| a)
    }

    /// Whether two regions share one registration.
    pub fn same_registration(&self, other: &Region) -> bool {
        Arc::ptr_eq(&self.entry, &other.entry)
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("buffer", &self.buf)
            .field("path", &self.entry.path)
            .field(
                "registration",
                &format_args!("{:#x} (+{})", self.entry.start, self.entry.len),
            )
            .finish()
    }
}

/// Copy out with atomic byte and word loads.
///
/// # Safety
///
/// `src..src + dst.len()` is valid memory reached only by atomic accesses and DMA.
unsafe fn atomic_copy_out(src: *const u8, dst: &mut [u8]) {
    let mut i = 0;
    let n = dst.len();
    while i < n {
        // SAFETY: in bounds (the caller's); aligned word loads where the address allows.
        unsafe {
            let p = src.add(i);
            if (p as usize).is_multiple_of(8) && n - i >= 8 {
                let w = (*p.cast::<AtomicU64>()).load(Ordering::Relaxed);
                dst[i..i + 8].copy_from_slice(&w.to_ne_bytes());
                i += 8;
            } else {
                dst[i] = (*p.cast::<AtomicU8>()).load(Ordering::Relaxed);
                i += 1;
            }
        }
    }
    std::sync::atomic::fence(Ordering::Acquire);
}

/// Copy in with atomic byte and word stores.
///
/// # Safety
///
/// As [`atomic_copy_out`].
unsafe fn atomic_copy_in(dst: *mut u8, src: &[u8]) {
    std::sync::atomic::fence(Ordering::Release);
    let mut i = 0;
    let n = src.len();
    while i < n {
        // SAFETY: in bounds (the caller's); aligned word stores where the address allows.
        unsafe {
            let p = dst.add(i);
            if (p as usize).is_multiple_of(8) && n - i >= 8 {
                let w = u64::from_ne_bytes(src[i..i + 8].try_into().expect("8 bytes"));
                (*p.cast::<AtomicU64>()).store(w, Ordering::Relaxed);
                i += 8;
            } else {
                (*p.cast::<AtomicU8>()).store(src[i], Ordering::Relaxed);
                i += 1;
            }
        }
    }
}

/// A byte range of a [`Region`]: the local side of a transfer.
#[derive(Debug, Clone)]
pub struct LocalRange {
    pub(crate) region: Region,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

impl LocalRange {
    /// Bytes in the range.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always `false`.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The region.
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// Offset into the region.
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

/// The VMM mappings (`(base, bytes)`) that `start..start + len` touches.
pub(crate) fn chunks_within(
    mappings: Option<Vec<(u64, usize)>>,
    start: u64,
    len: u64,
) -> Vec<(u64, usize)> {
    let end = start.saturating_add(len);
    mappings
        .unwrap_or_default()
        .into_iter()
        .filter(|&(b, l)| b < end && b.saturating_add(l as u64) > start)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The last handle of a buffer's memory let go on a thread that frees nothing (a waker's
    /// code that took a transfer's result on a progress thread): the memory is freed on
    /// another thread, host and device alike.
    #[test]
    fn memory_let_go_on_a_thread_that_frees_nothing_is_freed_elsewhere() {
        type Seen = Arc<std::sync::Mutex<Vec<String>>>;
        struct Owner(Seen);
        impl Drop for Owner {
            fn drop(&mut self) {
                let name = std::thread::current().name().unwrap_or("?").to_string();
                self.0.lock().unwrap().push(name);
            }
        }
        struct Gpu(#[allow(dead_code)] Owner);
        impl DeviceBacking for Gpu {
            fn ptr(&self) -> u64 {
                0x1000
            }
            fn bytes(&self) -> usize {
                8
            }
            fn ordinal(&self) -> usize {
                0
            }
            fn kind(&self) -> MemoryKind {
                MemoryKind::Device
            }
            fn mappings(&self) -> Option<Vec<(u64, usize)>> {
                None
            }
        }
        let seen: Seen = Default::default();
        let host = Buffer::new(Backing::Host {
            _owner: Box::new(Owner(seen.clone())),
            ptr: 0x1000,
            len: 8,
            cached: true,
        })
        .unwrap();
        let gpu = Buffer::new(Backing::Device(Box::new(Gpu(Owner(seen.clone()))))).unwrap();
        std::thread::Builder::new()
            .name("frees-nothing".into())
            .spawn(move || {
                crate::completion::elsewhere::frees_nothing();
                drop((host, gpu));
            })
            .unwrap()
            .join()
            .unwrap();
        crate::completion::testing::until("both freed", || seen.lock().unwrap().len() == 2);
        let seen = seen.lock().unwrap().clone();
        assert!(
            seen.iter().all(|n| n == "gpudirect-drop"),
            "freed on {seen:?}"
        );
    }

    #[test]
    fn memory_going_away_is_counted_before_it_is_freed() {
        struct Owner(Arc<AtomicU64>);
        impl Drop for Owner {
            fn drop(&mut self) {
                self.0.store(memory_released_count(), Ordering::SeqCst);
            }
        }
        let seen = Arc::new(AtomicU64::new(0));
        let before = memory_released_count();
        let b = Backing::Host {
            _owner: Box::new(Owner(seen.clone())),
            ptr: 0x1000,
            len: 8,
            cached: true,
        };
        let view = Buffer::new(b).unwrap();
        let other = view.clone();
        drop(view);
        assert_eq!(seen.load(Ordering::SeqCst), 0, "a view is left");
        drop(other);
        // Other tests may count too: at least this one, before the owner was dropped.
        assert!(seen.load(Ordering::SeqCst) > before);
        assert!(memory_released_count() >= seen.load(Ordering::SeqCst));
    }

    #[test]
    fn chunks_touched_by_a_range() {
        let m = Some(vec![(0x1000, 0x1000), (0x2000, 0x1000), (0x3000, 0x1000)]);
        assert_eq!(
            chunks_within(m.clone(), 0x1800, 0x100),
            vec![(0x1000, 0x1000)]
        );
        assert_eq!(chunks_within(m.clone(), 0x1800, 0x1000).len(), 2);
        assert_eq!(chunks_within(m.clone(), 0x1000, 0x3000).len(), 3);
        assert!(chunks_within(None, 0, 10).is_empty());
        assert!(chunks_within(m, u64::MAX - 1, u64::MAX).is_empty());
    }

    #[test]
    fn a_cache_entry_covers_only_its_range_and_dies_with_its_holders() {
        let mut c = Cache::default();
        let id = Identity::Device {
            ordinal: 0,
            buffer_id: 7,
        };
        let e = Arc::new(Entry {
            id,
            engine: 1,
            start: 0x1000,
            len: 0x100,
            mrs: Vec::new(),
            path: MemoryPath::Host,
            cached: false,
            ordinal: None,
            preferred: vec![0],
            _keep: Vec::new(),
            ipc: Err("a test".into()),
        });
        c.insert(&e);
        assert!(c.lookup(id, 0x1000, 0x100).is_some());
        assert!(c.lookup(id, 0x1080, 0x80).is_some());
        assert!(c.lookup(id, 0x1080, 0x81).is_none());
        assert!(c.lookup(id, 0xfff, 2).is_none());
        assert!(c.lookup(id, u64::MAX, 2).is_none());
        // Another allocation at the same address: another buffer id, no hit.
        let other = Identity::Device {
            ordinal: 0,
            buffer_id: 8,
        };
        assert!(c.lookup(other, 0x1000, 0x10).is_none());
        assert_eq!(c.live(), 1);
        drop(e);
        assert!(c.lookup(id, 0x1000, 0x10).is_none(), "no stale hit");
        assert_eq!(c.live(), 0);
    }

    proptest! {
        /// Any ranges: coalesced runs cover every range, never overlap or touch each other,
        /// and each index lands in exactly the run that covers it.
        #[test]
        fn coalescing_covers_and_separates(
            ranges in proptest::collection::vec((0u64..10_000, 1u64..500), 0..40),
        ) {
            let input: Vec<(u64, u64, usize)> =
                ranges.iter().enumerate().map(|(i, &(s, l))| (s, l, i)).collect();
            let runs = coalesce(input.clone());
            let mut seen = vec![0; input.len()];
            for w in runs.windows(2) {
                prop_assert!(w[0].0 + w[0].1 < w[1].0, "runs apart: {:?}", w);
            }
            for (s, l, idx) in &runs {
                for &i in idx {
                    seen[i] += 1;
                    let (rs, rl, _) = input[i];
                    prop_assert!(rs >= *s && rs + rl <= s + l);
                }
                // A run is exactly the union of its members (no byte outside them).
                let mut covered: Vec<(u64, u64)> = idx.iter().map(|&i| (input[i].0, input[i].0 + input[i].1)).collect();
                covered.sort();
                let mut end = *s;
                for (a, b) in covered {
                    prop_assert!(a <= end);
                    end = end.max(b);
                }
                prop_assert_eq!(end, s + l);
            }
            prop_assert!(seen.iter().all(|&n| n == 1));
        }
    }
}
