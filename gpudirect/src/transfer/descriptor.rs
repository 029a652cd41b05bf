//! Memory descriptors: what a peer needs to reach registered memory (address, length, memory
//! kind, one rkey per rail, and for exportable GPU memory a CUDA IPC part: a `cuIpc` handle,
//! the id of a VMM file descriptor, or the id of a memory pool's file descriptor with the
//! allocation's pointer export data), serializable with serde or as bytes, and checked field by
//! field when they come from outside.

use crate::error::{Error, Result};

/// The most rails (verbs devices) an engine, and so a descriptor, may have.
pub const MAX_RAILS: usize = 16;

/// The descriptor format this library writes. It reads this one and version 2 (the same
/// layout without the VMM and pool parts). A pool part (flag bit 2) is new within version 3:
/// a reader that does not know it refuses the flag, typed, and reads every other descriptor.
pub const DESCRIPTOR_VERSION: u16 = 3;

/// The oldest descriptor format this library reads.
const OLDEST_VERSION: u16 = 2;

/// The most descriptors one list ([`encode_list`], an endpoint's first message) may carry.
pub const MAX_DESCRIPTORS: usize = 1 << 16;

const MAGIC: [u8; 4] = *b"GDXD";
const HEADER: usize = 4 + 2 + 1 + 1 + 1 + 8 + 8;
/// Flag bit: a CUDA IPC part with a `cuIpc` handle follows the rkeys.
const HAS_IPC: u8 = 1;
/// Flag bit (version 3): a CUDA IPC part naming a VMM file descriptor follows the rkeys.
const HAS_VMM_FD: u8 = 2;
/// Flag bit (version 3): a CUDA IPC part naming a pool's file descriptor and an allocation's
/// pointer export data follows the rkeys.
const HAS_POOL_PTR: u8 = 4;

/// Where described memory lives, as its owner reports it. Informational for the peer (the owner
/// flushes GPU memory before it reports a write as arrived); the bytes are reached the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum DescribedKind {
    /// Host memory.
    Host,
    /// GPU memory registered with the NIC (dma-buf or nvidia-peermem).
    Device,
}

impl DescribedKind {
    fn to_raw(self) -> u8 {
        match self {
            DescribedKind::Host => 1,
            DescribedKind::Device => 2,
        }
    }

    fn from_raw(v: u8) -> Result<Self> {
        match v {
            1 => Ok(DescribedKind::Host),
            2 => Ok(DescribedKind::Device),
            v => Err(Error::invalid(
                "descriptor.kind",
                v,
                "a memory kind is 1 (host) or 2 (device)",
            )),
        }
    }
}

/// How an [`IpcPart`] lets a process on the same node map the owner's allocation.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum IpcKind {
    /// `cuMemAlloc` memory: the allocation's `cuIpcGetMemHandle` handle (64 bytes), opened with
    /// `cuIpcOpenMemHandle`.
    #[doc(alias = "cuIpcGetMemHandle")]
    CudaIpcHandle {
        /// The `CUipcMemHandle` bytes.
        handle: [u8; 64],
    },
    /// VMM memory (`cuMemCreate`, one physical allocation): exported as a POSIX file descriptor
    /// (`cuMemExportToShareableHandle`), which an intra-node endpoint sends to its peer by
    /// `SCM_RIGHTS` when the two meet; `export_id` names that descriptor (unique in the
    /// exporting process). The importer maps it with `cuMemImportFromShareableHandle` and
    /// `cuMemMap`.
    #[doc(alias = "cuMemExportToShareableHandle")]
    VmmFd {
        /// Which of the owner's exported file descriptors maps the memory.
        export_id: u64,
    },
    /// Memory of an exportable stream-ordered pool (`cuMemAllocFromPoolAsync` from a pool made
    /// with the POSIX fd handle type, such as an [`IpcPool`](crate::p2p::IpcPool)'s
    /// [`PoolAlloc`](crate::p2p::PoolAlloc)): the pool is exported as a POSIX file descriptor
    /// (`cuMemPoolExportToShareableHandle`), which an intra-node endpoint sends to its peer by
    /// `SCM_RIGHTS` when the two meet, named by `pool_export_id` (unique in the exporting
    /// process, one per pool); the allocation by its `cuMemPoolExportPointer` data. The
    /// importer imports the pool (`cuMemPoolImportFromShareableHandle`), then the pointer
    /// (`cuMemPoolImportPointer`).
    #[doc(alias = "cuMemPoolExportPointer")]
    #[doc(alias = "cuMemPoolExportToShareableHandle")]
    PoolPtr {
        /// Which of the owner's exported file descriptors is the pool's.
        pool_export_id: u64,
        /// The allocation's `CUmemPoolPtrExportData` bytes.
        ptr_data: [u8; 64],
    },
}

impl std::fmt::Debug for IpcKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IpcKind::CudaIpcHandle { handle } => f
                .debug_struct("CudaIpcHandle")
                .field("handle", &hex(&handle[..8]))
                .finish(),
            IpcKind::VmmFd { export_id } => f
                .debug_struct("VmmFd")
                .field("export_id", export_id)
                .finish(),
            IpcKind::PoolPtr {
                pool_export_id,
                ptr_data,
            } => f
                .debug_struct("PoolPtr")
                .field("pool_export_id", pool_export_id)
                .field("ptr_data", &hex(&ptr_data[..8]))
                .finish(),
        }
    }
}

/// How a process on the same node reaches described GPU memory through CUDA IPC: how to map
/// the allocation holding it ([`IpcKind`]: a `cuIpcGetMemHandle` handle, the id of a VMM file
/// descriptor passed when endpoints meet, or the id of a pool's file descriptor passed then
/// with the allocation's pointer export data), the allocation's length in bytes (for VMM
/// memory: the mapping's), the offset of the described bytes in it, and the UUID of the GPU that
/// owns it (what every process on the node calls that GPU, whatever its
/// `CUDA_VISIBLE_DEVICES`).
///
/// A descriptor carries one when its memory can be exported (`cuMemAlloc` memory, such as a
/// [`DeviceBuffer`](crate::memory::DeviceBuffer); VMM memory of one physical allocation, such
/// as a [`VmmBuffer`](crate::memory::VmmBuffer); an allocation of an exportable pool, such as
/// a [`PoolAlloc`](crate::p2p::PoolAlloc)); from a peer it is untrusted: the descriptor
/// checks that its bytes lie inside the allocation length claimed, and an importer checks them
/// again against the mapping it really gets.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcPart {
    kind: IpcKind,
    alloc_len: u64,
    offset: u64,
    uuid: [u8; 16],
}

impl IpcPart {
    /// Bytes of an IPC part with a `cuIpc` handle in [`MemoryDescriptor::to_bytes`].
    pub const WIRE_LEN: usize = 64 + 8 + 8 + 16;

    /// Bytes of an IPC part naming a VMM file descriptor in [`MemoryDescriptor::to_bytes`].
    pub const VMM_WIRE_LEN: usize = 8 + 8 + 8 + 16;

    /// Bytes of an IPC part naming a pool allocation in [`MemoryDescriptor::to_bytes`].
    pub const POOL_WIRE_LEN: usize = 8 + 64 + 8 + 8 + 16;

    /// An IPC part with a `cuIpcGetMemHandle` handle, from its fields (checked when it joins a
    /// descriptor: [`MemoryDescriptor::with_ipc`]).
    pub fn new(handle: [u8; 64], alloc_len: u64, offset: u64, gpu_uuid: [u8; 16]) -> Self {
        IpcPart {
            kind: IpcKind::CudaIpcHandle { handle },
            alloc_len,
            offset,
            uuid: gpu_uuid,
        }
    }

    /// An IPC part naming the owner's VMM file descriptor `export_id`, which maps
    /// `mapped_len` bytes; the described bytes start `offset` bytes into them (checked when it
    /// joins a descriptor: [`MemoryDescriptor::with_ipc`]).
    #[doc(alias = "cuMemExportToShareableHandle")]
    pub fn vmm_fd(export_id: u64, mapped_len: u64, offset: u64, gpu_uuid: [u8; 16]) -> Self {
        IpcPart {
            kind: IpcKind::VmmFd { export_id },
            alloc_len: mapped_len,
            offset,
            uuid: gpu_uuid,
        }
    }

    /// An IPC part naming an allocation of the owner's exported pool `pool_export_id` by its
    /// `cuMemPoolExportPointer` data `ptr_data`; the allocation holds `alloc_len` bytes and the
    /// described bytes start `offset` bytes into it (checked when it joins a descriptor:
    /// [`MemoryDescriptor::with_ipc`]).
    #[doc(alias = "cuMemPoolExportPointer")]
    pub fn pool_ptr(
        pool_export_id: u64,
        ptr_data: [u8; 64],
        alloc_len: u64,
        offset: u64,
        gpu_uuid: [u8; 16],
    ) -> Self {
        IpcPart {
            kind: IpcKind::PoolPtr {
                pool_export_id,
                ptr_data,
            },
            alloc_len,
            offset,
            uuid: gpu_uuid,
        }
    }

    /// How the allocation is mapped: a `cuIpc` handle, a VMM file descriptor, or a pool's file
    /// descriptor and pointer export data.
    pub fn kind(&self) -> &IpcKind {
        &self.kind
    }

    /// The `CUipcMemHandle` bytes of the allocation; `None` for VMM and pool memory.
    #[doc(alias = "cuIpcGetMemHandle")]
    pub fn handle(&self) -> Option<&[u8; 64]> {
        match &self.kind {
            IpcKind::CudaIpcHandle { handle } => Some(handle),
            IpcKind::VmmFd { .. } | IpcKind::PoolPtr { .. } => None,
        }
    }

    /// The id of the owner's exported file descriptor that this part needs (crossing when
    /// endpoints meet): the VMM allocation's, or the pool's; `None` for a `cuIpc` handle.
    pub fn export_id(&self) -> Option<u64> {
        match self.kind {
            IpcKind::VmmFd { export_id } => Some(export_id),
            IpcKind::PoolPtr { pool_export_id, .. } => Some(pool_export_id),
            IpcKind::CudaIpcHandle { .. } => None,
        }
    }

    /// The allocation's `CUmemPoolPtrExportData` bytes; `None` unless pool memory.
    #[doc(alias = "cuMemPoolExportPointer")]
    pub fn pool_ptr_data(&self) -> Option<&[u8; 64]> {
        match &self.kind {
            IpcKind::PoolPtr { ptr_data, .. } => Some(ptr_data),
            IpcKind::CudaIpcHandle { .. } | IpcKind::VmmFd { .. } => None,
        }
    }

    /// The allocation's length in bytes (for VMM memory, the bytes the file descriptor maps),
    /// as its owner reports it.
    pub fn alloc_len(&self) -> u64 {
        self.alloc_len
    }

    /// Bytes from the allocation's base to the described memory's first byte.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The UUID of the GPU whose memory holds the allocation (`cuDeviceGetUuid`).
    pub fn gpu_uuid(&self) -> &[u8; 16] {
        &self.uuid
    }

    /// The flag bit that announces this part.
    fn flag(&self) -> u8 {
        match self.kind {
            IpcKind::CudaIpcHandle { .. } => HAS_IPC,
            IpcKind::VmmFd { .. } => HAS_VMM_FD,
            IpcKind::PoolPtr { .. } => HAS_POOL_PTR,
        }
    }

    /// Bytes of this part on the wire.
    fn wire_len(&self) -> usize {
        match self.kind {
            IpcKind::CudaIpcHandle { .. } => Self::WIRE_LEN,
            IpcKind::VmmFd { .. } => Self::VMM_WIRE_LEN,
            IpcKind::PoolPtr { .. } => Self::POOL_WIRE_LEN,
        }
    }

    fn write_to(&self, b: &mut Vec<u8>) {
        match &self.kind {
            IpcKind::CudaIpcHandle { handle } => b.extend_from_slice(handle),
            IpcKind::VmmFd { export_id } => b.extend_from_slice(&export_id.to_le_bytes()),
            IpcKind::PoolPtr {
                pool_export_id,
                ptr_data,
            } => {
                b.extend_from_slice(&pool_export_id.to_le_bytes());
                b.extend_from_slice(ptr_data);
            }
        }
        b.extend_from_slice(&self.alloc_len.to_le_bytes());
        b.extend_from_slice(&self.offset.to_le_bytes());
        b.extend_from_slice(&self.uuid);
    }

    /// The part announced by `flag` at the start of `b` (exactly as long as that kind's part:
    /// [`WIRE_LEN`](Self::WIRE_LEN), [`VMM_WIRE_LEN`](Self::VMM_WIRE_LEN) or
    /// [`POOL_WIRE_LEN`](Self::POOL_WIRE_LEN)).
    fn read_from(flag: u8, b: &[u8]) -> Self {
        let (kind, at) = if flag == HAS_VMM_FD {
            let export_id = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
            (IpcKind::VmmFd { export_id }, 8)
        } else if flag == HAS_POOL_PTR {
            let pool_export_id = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
            let mut ptr_data = [0u8; 64];
            ptr_data.copy_from_slice(&b[8..72]);
            (
                IpcKind::PoolPtr {
                    pool_export_id,
                    ptr_data,
                },
                72,
            )
        } else {
            let mut handle = [0u8; 64];
            handle.copy_from_slice(&b[..64]);
            (IpcKind::CudaIpcHandle { handle }, 64)
        };
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[at + 16..at + 32]);
        IpcPart {
            kind,
            alloc_len: u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes")),
            offset: u64::from_le_bytes(b[at + 8..at + 16].try_into().expect("8 bytes")),
            uuid,
        }
    }
}

impl std::fmt::Debug for IpcPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcPart")
            .field("kind", &self.kind)
            .field("alloc_len", &self.alloc_len)
            .field("offset", &self.offset)
            .field("gpu_uuid", &hex(&self.uuid))
            .finish()
    }
}

/// Lower-case hex digits of `b`.
fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// `N` bytes from `2 * N` hex digits.
fn unhex<const N: usize>(arg: &'static str, s: &str) -> Result<[u8; N]> {
    let bad = || {
        Error::invalid(
            arg,
            format!("{} characters", s.len()),
            format!("{} hex digits", 2 * N),
        )
    };
    // Digits only: `from_str_radix` would also take a sign ("+f").
    if s.len() != 2 * N || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return Err(bad());
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(out)
}

/// A peer's registered memory, as transfers reach it: the address of the first byte (a host
/// address, or the IOVA of a GPU region), the length in bytes, the memory kind, one remote key
/// per rail of the owner's engine (in the owner's rail order; none for an engine without rails),
/// and for GPU memory that can be exported an [`IpcPart`] (how a process on the same node maps
/// it).
///
/// Serialize it with serde or [`to_bytes`](Self::to_bytes) and hand it to the peer through the
/// endpoint's first message or any channel. A descriptor from outside is untrusted:
/// deserialization and [`from_bytes`](Self::from_bytes) check every field (version, kind, rail
/// count 0 to [`MAX_RAILS`] and at least 1 without an IPC part, a length of at least one byte, an
/// address plus length within 2^64, and the IPC part's offset plus length within its allocation
/// length), and every range taken of it ([`range`](Self::range)) is checked again.
#[derive(Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "DescriptorFields", into = "DescriptorFields")]
pub struct MemoryDescriptor {
    addr: u64,
    len: u64,
    kind: DescribedKind,
    rails: u8,
    rkeys: [u32; MAX_RAILS],
    ipc: Option<IpcPart>,
}

/// The fields as they travel through serde, before they are checked.
#[derive(serde::Serialize, serde::Deserialize)]
struct DescriptorFields {
    version: u16,
    addr: u64,
    len: u64,
    kind: DescribedKind,
    rkeys: Vec<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ipc: Option<IpcFields>,
}

/// An [`IpcPart`] through serde: the handle, the VMM export id, or the pool export id with the
/// pointer export data (exactly one of the three); handle, pointer data and UUID as hex digits.
#[derive(serde::Serialize, serde::Deserialize)]
struct IpcFields {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    handle: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    vmm_export_id: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pool_export_id: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pool_ptr: Option<String>,
    alloc_len: u64,
    offset: u64,
    gpu_uuid: String,
}

impl TryFrom<DescriptorFields> for MemoryDescriptor {
    type Error = Error;
    fn try_from(f: DescriptorFields) -> Result<Self> {
        check_version(f.version)?;
        let ipc = match f.ipc {
            None => None,
            Some(i) => {
                let uuid = unhex("descriptor.ipc.gpu_uuid", &i.gpu_uuid)?;
                let newer = f.version > OLDEST_VERSION;
                match (i.handle, i.vmm_export_id, i.pool_export_id, i.pool_ptr) {
                    (Some(h), None, None, None) => Some(IpcPart::new(
                        unhex("descriptor.ipc.handle", &h)?,
                        i.alloc_len,
                        i.offset,
                        uuid,
                    )),
                    (None, Some(id), None, None) if newer => {
                        Some(IpcPart::vmm_fd(id, i.alloc_len, i.offset, uuid))
                    }
                    (None, None, Some(id), Some(data)) if newer => Some(IpcPart::pool_ptr(
                        id,
                        unhex("descriptor.ipc.pool_ptr", &data)?,
                        i.alloc_len,
                        i.offset,
                        uuid,
                    )),
                    (h, v, p, d) => {
                        let said = |o: bool| if o { "given" } else { "absent" };
                        return Err(Error::invalid(
                            "descriptor.ipc",
                            format!(
                                "handle {}, vmm_export_id {}, pool_export_id {}, pool_ptr {} \
                                 (version {})",
                                said(h.is_some()),
                                said(v.is_some()),
                                said(p.is_some()),
                                said(d.is_some()),
                                f.version
                            ),
                            "an IPC part has a handle or (from version 3) a VMM export id or a \
                             pool export id with its pool_ptr, exactly one",
                        ));
                    }
                }
            }
        };
        MemoryDescriptor::build(f.addr, f.len, f.kind, &f.rkeys, ipc)
    }
}

impl From<MemoryDescriptor> for DescriptorFields {
    fn from(d: MemoryDescriptor) -> Self {
        DescriptorFields {
            version: DESCRIPTOR_VERSION,
            addr: d.addr,
            len: d.len,
            kind: d.kind,
            rkeys: d.rkeys().to_vec(),
            ipc: d.ipc.map(|i| IpcFields {
                handle: i.handle().map(|h| hex(h)),
                vmm_export_id: match i.kind {
                    IpcKind::VmmFd { export_id } => Some(export_id),
                    _ => None,
                },
                pool_export_id: match i.kind {
                    IpcKind::PoolPtr { pool_export_id, .. } => Some(pool_export_id),
                    _ => None,
                },
                pool_ptr: i.pool_ptr_data().map(|d| hex(d)),
                alloc_len: i.alloc_len,
                offset: i.offset,
                gpu_uuid: hex(&i.uuid),
            }),
        }
    }
}

fn check_version(v: u16) -> Result<()> {
    if !(OLDEST_VERSION..=DESCRIPTOR_VERSION).contains(&v) {
        return Err(Error::invalid(
            "descriptor.version",
            v,
            format!(
                "this library reads descriptor versions {OLDEST_VERSION} to {DESCRIPTOR_VERSION}"
            ),
        ));
    }
    Ok(())
}

impl MemoryDescriptor {
    /// A checked descriptor without an IPC part.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the field: `len` 0; `addr + len` past 2^64 (the end
    /// address must fit 64 bits); no rkey, or more than [`MAX_RAILS`].
    pub fn new(addr: u64, len: u64, kind: DescribedKind, rkeys: &[u32]) -> Result<Self> {
        Self::build(addr, len, kind, rkeys, None)
    }

    /// A checked descriptor with a CUDA IPC part; it may have no rkey (memory of an engine
    /// without rails, reached only through CUDA IPC).
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new), except that no rkey is allowed; and for an allocation length of
    /// 0, or an offset plus `len` past the allocation length (or 2^64).
    pub fn with_ipc(
        addr: u64,
        len: u64,
        kind: DescribedKind,
        rkeys: &[u32],
        ipc: IpcPart,
    ) -> Result<Self> {
        Self::build(addr, len, kind, rkeys, Some(ipc))
    }

    fn build(
        addr: u64,
        len: u64,
        kind: DescribedKind,
        rkeys: &[u32],
        ipc: Option<IpcPart>,
    ) -> Result<Self> {
        if len == 0 {
            return Err(Error::invalid(
                "descriptor.len",
                0,
                "described memory holds at least one byte",
            ));
        }
        if addr.checked_add(len).is_none() {
            return Err(Error::invalid(
                "descriptor.len",
                len,
                format!("address {addr:#x} plus length passes 2^64"),
            ));
        }
        check_rails(rkeys.len(), ipc.is_some())?;
        if let Some(i) = &ipc
            && i.offset.checked_add(len).is_none_or(|e| e > i.alloc_len)
        {
            return Err(Error::invalid(
                "descriptor.ipc.offset",
                format!("{} (+{len} bytes)", i.offset),
                format!(
                    "the described bytes must lie inside the {}-byte allocation",
                    i.alloc_len
                ),
            ));
        }
        let mut k = [0u32; MAX_RAILS];
        k[..rkeys.len()].copy_from_slice(rkeys);
        Ok(MemoryDescriptor {
            addr,
            len,
            kind,
            // At most MAX_RAILS (16): checked above.
            rails: rkeys.len() as u8,
            rkeys: k,
            ipc,
        })
    }

    /// The same memory with `rkey` as device `dev`'s rkey and 0 (no key) for every other
    /// device: what a peer reaching it through a window on `dev` receives.
    pub(crate) fn only_rkey(&self, dev: usize, rkey: u32) -> MemoryDescriptor {
        let mut d = *self;
        d.rkeys = [0; MAX_RAILS];
        if dev < d.rails as usize {
            d.rkeys[dev] = rkey;
        }
        d
    }

    /// The same memory with `rkey` as device `dev`'s rkey, the others kept (no change for a
    /// `dev` past the rkeys).
    pub(crate) fn with_rkey(&self, dev: usize, rkey: u32) -> MemoryDescriptor {
        let mut d = *self;
        if dev < d.rails as usize {
            d.rkeys[dev] = rkey;
        }
        d
    }

    /// How a process on the same node maps the memory through CUDA IPC, when it can be
    /// exported.
    pub fn ipc(&self) -> Option<&IpcPart> {
        self.ipc.as_ref()
    }

    /// The address of the first byte, as the owner's NICs expect it.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// The length in bytes (at least 1).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always `false`: a descriptor describes at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The memory kind the owner reported.
    pub fn kind(&self) -> DescribedKind {
        self.kind
    }

    /// One rkey per rail of the owner's engine, in its rail order (none for an engine without
    /// rails).
    pub fn rkeys(&self) -> &[u32] {
        &self.rkeys[..self.rails as usize]
    }

    /// `len` bytes at `offset` of the described memory.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the range is empty or passes the described length (or
    /// the arithmetic overflows).
    pub fn range(&self, offset: u64, len: u64) -> Result<RemoteRange> {
        check_range(offset, len, self.len)?;
        Ok(RemoteRange {
            desc: *self,
            offset,
            len,
        })
    }

    /// The whole described memory as a range.
    pub fn all(&self) -> RemoteRange {
        RemoteRange {
            desc: *self,
            offset: 0,
            len: self.len,
        }
    }

    /// Bytes of [`to_bytes`](Self::to_bytes) for a descriptor with `rails` rkeys and no IPC
    /// part (add [`IpcPart::WIRE_LEN`] for one with).
    pub fn wire_len(rails: usize) -> usize {
        HEADER + 4 * rails
    }

    /// Bytes of this descriptor's [`to_bytes`](Self::to_bytes).
    pub fn encoded_len(&self) -> usize {
        Self::wire_len(self.rails as usize) + self.ipc.map_or(0, |i| i.wire_len())
    }

    /// The descriptor as bytes (little endian): `GDXD`, version (u16, [`DESCRIPTOR_VERSION`]),
    /// kind (u8), rail count (u8), flags (u8: bit 0, an IPC part with a `cuIpc` handle follows;
    /// bit 1, an IPC part naming a VMM file descriptor follows; bit 2, an IPC part naming a pool
    /// allocation follows; at most one), address (u64), length (u64), one rkey (u32) per rail,
    /// then the IPC part if any: the handle (64 bytes), the VMM export id (u64), or the pool
    /// export id (u64) and the pointer export data (64 bytes); then the allocation length
    /// (u64), the offset in it (u64), the GPU's UUID (16 bytes).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.encoded_len());
        self.write_to(&mut b);
        b
    }

    fn write_to(&self, b: &mut Vec<u8>) {
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&DESCRIPTOR_VERSION.to_le_bytes());
        b.push(self.kind.to_raw());
        b.push(self.rails);
        b.push(self.ipc.map_or(0, |i| i.flag()));
        b.extend_from_slice(&self.addr.to_le_bytes());
        b.extend_from_slice(&self.len.to_le_bytes());
        for k in self.rkeys() {
            b.extend_from_slice(&k.to_le_bytes());
        }
        if let Some(i) = &self.ipc {
            i.write_to(b);
        }
    }

    /// Decode [`to_bytes`](Self::to_bytes): exactly one descriptor, every field checked.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming what is wrong: the length, the magic, an unknown
    /// version, kind or flag, a rail count above [`MAX_RAILS`] (or 0 without an IPC part), an
    /// empty range or one whose address plus length passes 2^64, an IPC part whose offset plus
    /// length passes its allocation length.
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        let (d, used) = Self::read_from(b)?;
        if used != b.len() {
            return Err(Error::invalid(
                "descriptor",
                format!("{} bytes", b.len()),
                format!("one descriptor of {used} bytes, nothing after it"),
            ));
        }
        Ok(d)
    }

    /// One descriptor at the start of `b`, and the bytes it took.
    fn read_from(b: &[u8]) -> Result<(Self, usize)> {
        let short = || {
            Error::invalid(
                "descriptor",
                format!("{} bytes", b.len()),
                format!("a descriptor is at least {HEADER} bytes"),
            )
        };
        let h = b.get(..HEADER).ok_or_else(short)?;
        if h[..4] != MAGIC {
            return Err(Error::invalid(
                "descriptor.magic",
                format!("{:02x?}", &h[..4]),
                "a descriptor starts with GDXD",
            ));
        }
        let version = u16::from_le_bytes([h[4], h[5]]);
        check_version(version)?;
        let kind = DescribedKind::from_raw(h[6])?;
        let rails = h[7] as usize;
        let flags = h[8];
        let part_len = match flags {
            0 => 0,
            HAS_IPC => IpcPart::WIRE_LEN,
            HAS_VMM_FD if version > OLDEST_VERSION => IpcPart::VMM_WIRE_LEN,
            HAS_POOL_PTR if version > OLDEST_VERSION => IpcPart::POOL_WIRE_LEN,
            _ => {
                return Err(Error::invalid(
                    "descriptor.flags",
                    format!("{flags:#04x} (version {version})"),
                    "0, or one IPC part: bit 0 (a cuIpc handle) or, from version 3, bit 1 (a \
                     VMM file descriptor) or bit 2 (a pool allocation)",
                ));
            }
        };
        let has_ipc = flags != 0;
        check_rails(rails, has_ipc)?;
        let addr = u64::from_le_bytes(h[9..17].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(h[17..25].try_into().expect("8 bytes"));
        let keys_end = Self::wire_len(rails);
        let total = keys_end + part_len;
        let body = b.get(HEADER..total).ok_or_else(|| {
            Error::invalid(
                "descriptor",
                format!("{} bytes", b.len()),
                format!("{rails} rails and the flags {flags:#04x} need {total} bytes"),
            )
        })?;
        let mut rkeys = [0u32; MAX_RAILS];
        for (k, c) in rkeys.iter_mut().zip(body[..4 * rails].chunks_exact(4)) {
            *k = u32::from_le_bytes(c.try_into().expect("4 bytes"));
        }
        let ipc = has_ipc.then(|| IpcPart::read_from(flags, &body[4 * rails..]));
        Ok((Self::build(addr, len, kind, &rkeys[..rails], ipc)?, total))
    }
}

impl std::fmt::Debug for MemoryDescriptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryDescriptor")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("kind", &self.kind)
            .field("rkeys", &format_args!("{:x?}", self.rkeys()))
            .field("ipc", &self.ipc)
            .finish()
    }
}

/// A rail count: at most [`MAX_RAILS`], and at least one without an IPC part (the descriptor
/// must say some way to reach the memory).
fn check_rails(rails: usize, has_ipc: bool) -> Result<()> {
    if rails > MAX_RAILS || (rails == 0 && !has_ipc) {
        return Err(Error::invalid(
            "descriptor.rkeys",
            rails,
            format!("one rkey per rail: 1 to {MAX_RAILS} (0 only with a CUDA IPC part)"),
        ));
    }
    Ok(())
}

/// `offset..offset + len` lies inside `total` bytes and is not empty.
pub(crate) fn check_range(offset: u64, len: u64, total: u64) -> Result<()> {
    if len == 0 || offset.checked_add(len).is_none_or(|e| e > total) {
        return Err(Error::invalid(
            "range",
            format!("{offset} (+{len} bytes)"),
            format!("must be a non-empty range within the {total} bytes described"),
        ));
    }
    Ok(())
}

/// A byte range of a peer's memory: a [`MemoryDescriptor`] and a checked `offset..offset + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRange {
    desc: MemoryDescriptor,
    offset: u64,
    len: u64,
}

impl RemoteRange {
    /// The descriptor.
    pub fn descriptor(&self) -> &MemoryDescriptor {
        &self.desc
    }

    /// Offset into the described memory, in bytes.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always `false`: a range holds at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The address of the byte `at` bytes into the range.
    pub(crate) fn addr_at(&self, at: u64) -> u64 {
        // offset + at < len <= desc.len and desc.addr + desc.len fits (checked at construction).
        self.desc.addr + self.offset + at
    }
}

/// Encode several descriptors (a count, then each as [`MemoryDescriptor::to_bytes`]).
///
/// # Errors
///
/// [`Error::InvalidArgument`] for more than [`MAX_DESCRIPTORS`].
pub fn encode_list(list: &[MemoryDescriptor]) -> Result<Vec<u8>> {
    if list.len() > MAX_DESCRIPTORS {
        return Err(Error::invalid(
            "descriptors",
            list.len(),
            format!("at most {MAX_DESCRIPTORS} in one list"),
        ));
    }
    let mut b = Vec::with_capacity(
        4 + list
            .iter()
            .map(MemoryDescriptor::encoded_len)
            .sum::<usize>(),
    );
    // At most MAX_DESCRIPTORS (2^16): fits u32.
    b.extend_from_slice(&(list.len() as u32).to_le_bytes());
    for d in list {
        d.write_to(&mut b);
    }
    Ok(b)
}

/// Decode [`encode_list`], every descriptor checked; the whole input must be used.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a count above [`MAX_DESCRIPTORS`], a short or long input, or
/// any invalid descriptor (as [`MemoryDescriptor::from_bytes`]).
pub fn decode_list(b: &[u8]) -> Result<Vec<MemoryDescriptor>> {
    let n = b
        .get(..4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")) as usize)
        .ok_or_else(|| {
            Error::invalid("descriptors", b.len(), "a list starts with a 4-byte count")
        })?;
    if n > MAX_DESCRIPTORS {
        return Err(Error::invalid(
            "descriptors",
            n,
            format!("at most {MAX_DESCRIPTORS} in one list"),
        ));
    }
    let mut at = 4;
    // Room for what the bytes can hold (no descriptor is shorter than its header), not what
    // the count says.
    let mut out = Vec::with_capacity(n.min(b.len() / HEADER));
    for _ in 0..n {
        let (d, used) = MemoryDescriptor::read_from(&b[at..])?;
        out.push(d);
        at += used;
    }
    if at != b.len() {
        return Err(Error::invalid(
            "descriptors",
            format!("{} bytes", b.len()),
            format!("{n} descriptors take {at} bytes"),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proptest_support::is_invalid;
    use proptest::prelude::*;

    fn kind() -> impl Strategy<Value = DescribedKind> {
        prop_oneof![Just(DescribedKind::Host), Just(DescribedKind::Device)]
    }

    fn ipc_part() -> impl Strategy<Value = IpcPart> {
        prop_oneof![
            (
                proptest::collection::vec(any::<u8>(), 64),
                any::<u64>(),
                any::<u64>(),
                any::<[u8; 16]>(),
            )
                .prop_map(|(h, a, o, u)| IpcPart::new(
                    h.try_into().expect("64"),
                    a,
                    o,
                    u
                )),
            (any::<u64>(), any::<u64>(), any::<u64>(), any::<[u8; 16]>())
                .prop_map(|(id, a, o, u)| IpcPart::vmm_fd(id, a, o, u)),
            (
                any::<u64>(),
                proptest::collection::vec(any::<u8>(), 64),
                any::<u64>(),
                any::<u64>(),
                any::<[u8; 16]>(),
            )
                .prop_map(|(id, d, a, o, u)| IpcPart::pool_ptr(
                    id,
                    d.try_into().expect("64"),
                    a,
                    o,
                    u
                )),
        ]
    }

    /// `i` with another allocation length and offset, of the same kind.
    fn resized(i: &IpcPart, alloc: u64, off: u64) -> IpcPart {
        match i.kind() {
            IpcKind::CudaIpcHandle { handle } => IpcPart::new(*handle, alloc, off, *i.gpu_uuid()),
            IpcKind::VmmFd { export_id } => IpcPart::vmm_fd(*export_id, alloc, off, *i.gpu_uuid()),
            IpcKind::PoolPtr {
                pool_export_id,
                ptr_data,
            } => IpcPart::pool_ptr(*pool_export_id, *ptr_data, alloc, off, *i.gpu_uuid()),
        }
    }

    fn desc() -> impl Strategy<Value = MemoryDescriptor> {
        (
            crate::proptest_support::addr(),
            1u64..=(1 << 40),
            kind(),
            proptest::collection::vec(any::<u32>(), 0..=MAX_RAILS),
            proptest::option::of(ipc_part()),
            any::<u64>(),
        )
            .prop_filter_map("fits", |(a, l, k, r, ipc, slack)| match ipc {
                None => MemoryDescriptor::new(a, l, k, &r).ok(),
                Some(i) => {
                    // An allocation that holds the described bytes, most of the time.
                    let off = i.offset() % (1 << 40);
                    let alloc = off.checked_add(l)?.checked_add(slack % (1 << 20))?;
                    MemoryDescriptor::with_ipc(a, l, k, &r, resized(&i, alloc, off)).ok()
                }
            })
    }

    #[test]
    fn a_window_descriptor_carries_one_rkey_and_no_other() {
        let d = MemoryDescriptor::new(0x1000, 64, DescribedKind::Host, &[7, 8, 9]).unwrap();
        let w = d.only_rkey(1, 0xabcd);
        assert_eq!(w.rkeys(), &[0, 0xabcd, 0]);
        assert_eq!((w.addr(), w.len(), w.kind()), (d.addr(), d.len(), d.kind()));
        // Through the wire as any other.
        assert_eq!(MemoryDescriptor::from_bytes(&w.to_bytes()).unwrap(), w);
        // A device it has no rkey for: none at all.
        assert_eq!(d.only_rkey(5, 1).rkeys(), &[0, 0, 0]);
    }

    #[test]
    fn an_ipc_part_stays_inside_its_allocation() {
        let part = |alloc, off| IpcPart::new([7; 64], alloc, off, [9; 16]);
        let d =
            MemoryDescriptor::with_ipc(0x1000, 100, DescribedKind::Device, &[], part(4096, 3996))
                .unwrap();
        assert_eq!(d.rkeys().len(), 0);
        assert_eq!(d.ipc().unwrap().offset(), 3996);
        assert_eq!(d.encoded_len(), d.to_bytes().len());
        assert_eq!(MemoryDescriptor::from_bytes(&d.to_bytes()).unwrap(), d);
        for (alloc, off) in [(4096, 3997), (0, 0), (u64::MAX, u64::MAX - 50)] {
            let e = MemoryDescriptor::with_ipc(
                0x1000,
                100,
                DescribedKind::Device,
                &[],
                part(alloc, off),
            )
            .unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::InvalidArgument {
                        arg: "descriptor.ipc.offset",
                        ..
                    }
                ),
                "{e}"
            );
        }
        // No rkey and no IPC part: no way to reach the memory.
        let e = MemoryDescriptor::new(0x1000, 100, DescribedKind::Host, &[]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidArgument {
                    arg: "descriptor.rkeys",
                    ..
                }
            ),
            "{e}"
        );
        // The same refusals from bytes: the allocation length cut below the described end.
        let mut b = d.to_bytes();
        let at = MemoryDescriptor::wire_len(0) + 64;
        b[at..at + 8].copy_from_slice(&4095u64.to_le_bytes());
        assert!(matches!(
            MemoryDescriptor::from_bytes(&b),
            Err(Error::InvalidArgument {
                arg: "descriptor.ipc.offset",
                ..
            })
        ));
        // An unknown flag, and the IPC flag without the part's bytes.
        let mut b = d.to_bytes();
        b[8] = 3;
        assert!(matches!(
            MemoryDescriptor::from_bytes(&b),
            Err(Error::InvalidArgument {
                arg: "descriptor.flags",
                ..
            })
        ));
        let plain = MemoryDescriptor::new(0x1000, 100, DescribedKind::Device, &[5]).unwrap();
        let mut b = plain.to_bytes();
        b[8] = 1;
        assert!(MemoryDescriptor::from_bytes(&b).is_err());
        // Serde: the handle and UUID as hex, checked.
        let j = serde_json::to_string(&d).unwrap();
        assert!(
            j.contains(&"07".repeat(64)) && j.contains(&"09".repeat(16)),
            "{j}"
        );
        assert_eq!(serde_json::from_str::<MemoryDescriptor>(&j).unwrap(), d);
        let bad = j.replace(&"09".repeat(16), &"09".repeat(15));
        assert!(serde_json::from_str::<MemoryDescriptor>(&bad).is_err());
        let bad = j.replace(&"07".repeat(64), &format!("zz{}", "07".repeat(63)));
        assert!(serde_json::from_str::<MemoryDescriptor>(&bad).is_err());
        let bad = j.replace("\"alloc_len\":4096", "\"alloc_len\":4000");
        assert_ne!(bad, j);
        assert!(serde_json::from_str::<MemoryDescriptor>(&bad).is_err());
    }

    #[test]
    fn serde_hex_fields_take_hex_digits_only() {
        let part = IpcPart::new([0x0f; 64], 4096, 0, [0x0f; 16]);
        let d = MemoryDescriptor::with_ipc(0x1000, 4096, DescribedKind::Device, &[], part).unwrap();
        let j = serde_json::to_string(&d).unwrap();
        // `from_str_radix` takes a sign: "+f" would read as 0x0f.
        for (good, bad) in [
            ("0f".repeat(16), "+f".repeat(16)),
            ("0f".repeat(64), "+f".repeat(64)),
        ] {
            let b = j.replace(&good, &bad);
            assert_ne!(b, j);
            let e = serde_json::from_str::<MemoryDescriptor>(&b).unwrap_err();
            assert!(e.to_string().contains("hex digits"), "{e}");
        }
        assert!(unhex::<1>("x", "+f").is_err());
        assert!(unhex::<1>("x", "-0").is_err());
        assert_eq!(unhex::<2>("x", "0aFf").unwrap(), [0x0a, 0xff]);
    }

    #[test]
    fn a_vmm_part_names_its_export_and_stays_inside_the_mapping() {
        let part = |mapped, off| IpcPart::vmm_fd(0xfeed_0000_0001, mapped, off, [9; 16]);
        let d = MemoryDescriptor::with_ipc(
            0x7f00_0000,
            4096,
            DescribedKind::Device,
            &[],
            part(2 << 20, 8192),
        )
        .unwrap();
        let ipc = d.ipc().unwrap();
        assert_eq!(ipc.export_id(), Some(0xfeed_0000_0001));
        assert_eq!(ipc.handle(), None);
        assert!(matches!(ipc.kind(), IpcKind::VmmFd { .. }));
        let b = d.to_bytes();
        assert_eq!(
            b.len(),
            MemoryDescriptor::wire_len(0) + IpcPart::VMM_WIRE_LEN
        );
        assert_eq!((b[4], b[8]), (3, HAS_VMM_FD));
        assert_eq!(MemoryDescriptor::from_bytes(&b).unwrap(), d);
        // Past the mapping, or overflowing: refused, from fields and from bytes.
        for (mapped, off) in [
            (2 << 20, (2 << 20) - 4095),
            (0, 0),
            (u64::MAX, u64::MAX - 10),
        ] {
            let e = MemoryDescriptor::with_ipc(
                0x7f00_0000,
                4096,
                DescribedKind::Device,
                &[],
                part(mapped, off),
            )
            .unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::InvalidArgument {
                        arg: "descriptor.ipc.offset",
                        ..
                    }
                ),
                "{e}"
            );
        }
        let at = MemoryDescriptor::wire_len(0) + 8;
        let mut cut = b.clone();
        cut[at..at + 8].copy_from_slice(&8191u64.to_le_bytes());
        assert!(matches!(
            MemoryDescriptor::from_bytes(&cut),
            Err(Error::InvalidArgument {
                arg: "descriptor.ipc.offset",
                ..
            })
        ));
        // Version 2 knows no VMM part; both parts at once is no descriptor; versions 1 and 4
        // are not read.
        let mut v2 = b.clone();
        v2[4] = 2;
        assert!(matches!(
            MemoryDescriptor::from_bytes(&v2),
            Err(Error::InvalidArgument {
                arg: "descriptor.flags",
                ..
            })
        ));
        let mut both = b.clone();
        both[8] = HAS_IPC | HAS_VMM_FD;
        assert!(matches!(
            MemoryDescriptor::from_bytes(&both),
            Err(Error::InvalidArgument {
                arg: "descriptor.flags",
                ..
            })
        ));
        for v in [1u8, 4] {
            let mut old = b.clone();
            old[4] = v;
            assert!(matches!(
                MemoryDescriptor::from_bytes(&old),
                Err(Error::InvalidArgument {
                    arg: "descriptor.version",
                    ..
                })
            ));
        }
        // A version 2 descriptor with a handle part still decodes.
        let h = MemoryDescriptor::with_ipc(
            0x1000,
            100,
            DescribedKind::Device,
            &[],
            IpcPart::new([7; 64], 4096, 0, [9; 16]),
        )
        .unwrap();
        let mut old = h.to_bytes();
        old[4] = 2;
        assert_eq!(MemoryDescriptor::from_bytes(&old).unwrap(), h);
        // Serde: the export id instead of the handle; exactly one of the two.
        let j = serde_json::to_string(&d).unwrap();
        assert!(
            j.contains("\"vmm_export_id\":280293860704257") && !j.contains("handle"),
            "{j}"
        );
        assert_eq!(serde_json::from_str::<MemoryDescriptor>(&j).unwrap(), d);
        let v2 = j.replace("\"version\":3", "\"version\":2");
        assert!(
            serde_json::from_str::<MemoryDescriptor>(&v2).is_err(),
            "{v2}"
        );
        let with_both = j.replace(
            "\"vmm_export_id\"",
            &format!("\"handle\":\"{}\",\"vmm_export_id\"", "07".repeat(64)),
        );
        assert!(serde_json::from_str::<MemoryDescriptor>(&with_both).is_err());
        let neither = j.replace("\"vmm_export_id\":280293860704257,", "");
        assert_ne!(neither, j);
        assert!(serde_json::from_str::<MemoryDescriptor>(&neither).is_err());
    }

    #[test]
    fn a_pool_part_names_its_pool_and_pointer_and_stays_inside_the_allocation() {
        let data: [u8; 64] = std::array::from_fn(|i| i as u8 ^ 0x5a);
        let part = |alloc, off| IpcPart::pool_ptr(0xfeed_0000_0002, data, alloc, off, [9; 16]);
        let d = MemoryDescriptor::with_ipc(
            0x7f00_0000,
            4096,
            DescribedKind::Device,
            &[],
            part(1 << 20, 8191),
        )
        .unwrap();
        let ipc = d.ipc().unwrap();
        assert_eq!(ipc.export_id(), Some(0xfeed_0000_0002));
        assert_eq!(ipc.pool_ptr_data(), Some(&data));
        assert_eq!(ipc.handle(), None);
        assert!(matches!(ipc.kind(), IpcKind::PoolPtr { .. }));
        let b = d.to_bytes();
        assert_eq!(
            b.len(),
            MemoryDescriptor::wire_len(0) + IpcPart::POOL_WIRE_LEN
        );
        assert_eq!((b[4], b[8]), (3, HAS_POOL_PTR));
        let at = MemoryDescriptor::wire_len(0);
        assert_eq!(&b[at..at + 8], &0xfeed_0000_0002u64.to_le_bytes());
        assert_eq!(&b[at + 8..at + 72], &data);
        assert_eq!(MemoryDescriptor::from_bytes(&b).unwrap(), d);
        // Past the allocation, or overflowing: refused, from fields and from bytes.
        for (alloc, off) in [
            (1 << 20, (1 << 20) - 4095),
            (0, 0),
            (u64::MAX, u64::MAX - 1),
        ] {
            let e = MemoryDescriptor::with_ipc(
                0x7f00_0000,
                4096,
                DescribedKind::Device,
                &[],
                part(alloc, off),
            )
            .unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::InvalidArgument {
                        arg: "descriptor.ipc.offset",
                        ..
                    }
                ),
                "{e}"
            );
        }
        let mut short = b.clone();
        short[at + 72..at + 80].copy_from_slice(&8192u64.to_le_bytes());
        assert!(matches!(
            MemoryDescriptor::from_bytes(&short),
            Err(Error::InvalidArgument {
                arg: "descriptor.ipc.offset",
                ..
            })
        ));
        // Version 2 knows no pool part; two parts at once, or a part cut short, is no
        // descriptor.
        let mut v2 = b.clone();
        v2[4] = 2;
        for flags in [
            None,
            Some(HAS_POOL_PTR | HAS_VMM_FD),
            Some(HAS_POOL_PTR | HAS_IPC),
        ] {
            let mut x = if flags.is_none() {
                v2.clone()
            } else {
                b.clone()
            };
            if let Some(f) = flags {
                x[8] = f;
            }
            assert!(
                matches!(
                    MemoryDescriptor::from_bytes(&x),
                    Err(Error::InvalidArgument {
                        arg: "descriptor.flags",
                        ..
                    })
                ),
                "{flags:?}"
            );
        }
        assert!(MemoryDescriptor::from_bytes(&b[..b.len() - 1]).is_err());
        // Read as a VMM part, the same bytes are too long: refused, not misread.
        let mut as_vmm = b.clone();
        as_vmm[8] = HAS_VMM_FD;
        assert!(MemoryDescriptor::from_bytes(&as_vmm).is_err());
        // Serde: the pool export id and the pointer data as hex, both or neither, and nothing
        // else.
        let j = serde_json::to_string(&d).unwrap();
        assert!(
            j.contains("\"pool_export_id\":280293860704258")
                && j.contains(&hex(&data))
                && !j.contains("handle")
                && !j.contains("vmm_export_id"),
            "{j}"
        );
        assert_eq!(serde_json::from_str::<MemoryDescriptor>(&j).unwrap(), d);
        let no_ptr = j.replace(&format!(",\"pool_ptr\":\"{}\"", hex(&data)), "");
        assert_ne!(no_ptr, j);
        let no_id = j.replace("\"pool_export_id\":280293860704258,", "");
        assert_ne!(no_id, j);
        let bad_hex = j.replace(&hex(&data), &hex(&data[..63]));
        let with_vmm = j.replace(
            "\"pool_export_id\"",
            "\"vmm_export_id\":3,\"pool_export_id\"",
        );
        let v2 = j.replace("\"version\":3", "\"version\":2");
        for bad in [no_ptr, no_id, bad_hex, with_vmm, v2] {
            assert!(
                serde_json::from_str::<MemoryDescriptor>(&bad).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_end_address_must_fit_64_bits() {
        let e = MemoryDescriptor::new(u64::MAX - 9, 9, DescribedKind::Host, &[1]).unwrap();
        assert_eq!(e.addr() + e.len(), u64::MAX);
        for (addr, len) in [
            (u64::MAX - 9, 10),
            (u64::MAX - 9, 11),
            (u64::MAX, 1),
            (1, u64::MAX),
        ] {
            let r = MemoryDescriptor::new(addr, len, DescribedKind::Host, &[1]);
            assert!(
                matches!(
                    &r,
                    Err(Error::InvalidArgument {
                        arg: "descriptor.len",
                        ..
                    })
                ),
                "{r:?}"
            );
        }
        // The same from bytes and from serde.
        let mut b = e.to_bytes();
        b[17..25].copy_from_slice(&11u64.to_le_bytes());
        assert!(matches!(
            MemoryDescriptor::from_bytes(&b),
            Err(Error::InvalidArgument {
                arg: "descriptor.len",
                ..
            })
        ));
        let j = r#"{"version":2,"addr":18446744073709551606,"len":11,"kind":"Host","rkeys":[1]}"#;
        assert!(serde_json::from_str::<MemoryDescriptor>(j).is_err());
        let j = r#"{"version":2,"addr":0,"len":11,"kind":"Host","rkeys":[1]}"#;
        assert!(serde_json::from_str::<MemoryDescriptor>(j).is_ok());
        let j = r#"{"version":1,"addr":0,"len":11,"kind":"Host","rkeys":[1]}"#;
        let e = serde_json::from_str::<MemoryDescriptor>(j).unwrap_err();
        assert!(e.to_string().contains("version"), "{e}");
    }

    #[test]
    fn ranges_stay_inside() {
        let d = MemoryDescriptor::new(0x1000, 100, DescribedKind::Device, &[7, 8]).unwrap();
        let r = d.range(90, 10).unwrap();
        assert_eq!(
            (r.addr_at(0), r.addr_at(9), r.len()),
            (0x1000 + 90, 0x1000 + 99, 10)
        );
        assert!(d.range(91, 10).is_err());
        assert!(d.range(0, 0).is_err());
        assert!(d.range(u64::MAX, 2).is_err());
        assert_eq!(d.all().len(), 100);
    }

    proptest! {
        /// Any descriptor: bytes and serde give it back exactly.
        #[test]
        fn descriptors_round_trip(d in desc()) {
            prop_assert_eq!(MemoryDescriptor::from_bytes(&d.to_bytes()).unwrap(), d);
            prop_assert_eq!(d.to_bytes().len(), d.encoded_len());
            let j = serde_json::to_string(&d).unwrap();
            prop_assert_eq!(serde_json::from_str::<MemoryDescriptor>(&j).unwrap(), d);
        }

        /// Any bytes at all: a descriptor whose every field holds, or a typed error.
        #[test]
        fn any_bytes_decode_checked_or_refused(
            b in proptest::collection::vec(any::<u8>(), 0..220),
            real in any::<bool>(), rails in 0u8..=20, addr in crate::proptest_support::addr(),
            len in any::<u64>(), kind in any::<u8>(), flags in 0u8..9, version in 1u16..5,
        ) {
            // Half the inputs start with a plausible header so the later checks are reached.
            let mut input = b.clone();
            if real {
                let mut h = MAGIC.to_vec();
                h.extend_from_slice(&version.to_le_bytes());
                h.push(kind % 4);
                h.push(rails);
                h.push(flags);
                h.extend_from_slice(&addr.to_le_bytes());
                h.extend_from_slice(&len.to_le_bytes());
                h.extend_from_slice(&b);
                input = h;
            }
            match MemoryDescriptor::from_bytes(&input) {
                Ok(d) => {
                    prop_assert_ne!(d.len(), 0);
                    prop_assert!(d.addr().checked_add(d.len()).is_some());
                    prop_assert!(d.rkeys().len() <= MAX_RAILS);
                    prop_assert!(!d.rkeys().is_empty() || d.ipc().is_some());
                    prop_assert!((2..=3).contains(&version));
                    if let Some(i) = d.ipc() {
                        prop_assert!(i.offset().checked_add(d.len()).is_some_and(|e| e <= i.alloc_len()));
                        prop_assert!(version == 3 || i.export_id().is_none(), "no VMM or pool part in version 2");
                        prop_assert_eq!(i.handle().is_some(), i.export_id().is_none());
                        prop_assert_eq!(i.pool_ptr_data().is_some(), flags == HAS_POOL_PTR);
                    }
                    prop_assert_eq!(input.len(), d.encoded_len());
                    prop_assert_eq!(MemoryDescriptor::from_bytes(&d.to_bytes()).unwrap(), d);
                }
                Err(e) => prop_assert!(is_invalid(&e), "{}", e),
            }
        }

        /// Lists of any descriptors round-trip; any cut or extension of them is refused.
        #[test]
        fn lists_round_trip_and_refuse_cuts(
            list in proptest::collection::vec(desc(), 0..8), cut in any::<usize>(), extra in any::<u8>(),
        ) {
            let b = encode_list(&list).unwrap();
            prop_assert_eq!(decode_list(&b).unwrap(), list);
            let c = cut % b.len();
            let r = decode_list(&b[..c]);
            prop_assert!(r.is_err() && is_invalid(&r.unwrap_err()));
            let mut longer = b.clone();
            longer.push(extra);
            prop_assert!(decode_list(&longer).is_err());
        }

        /// Ranges of any offsets and lengths: inside the described bytes, or refused.
        #[test]
        fn ranges_are_checked(d in desc(), off in any::<u64>(), len in any::<u64>()) {
            match d.range(off, len) {
                Ok(r) => {
                    prop_assert!(len > 0 && off + len <= d.len());
                    prop_assert_eq!(r.addr_at(len - 1), d.addr() + off + len - 1);
                }
                Err(e) => prop_assert!(is_invalid(&e)),
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Every strict prefix of a descriptor's bytes is refused, typed, and so is a byte
        /// more (nothing may follow one descriptor).
        #[test]
        fn every_cut_of_a_descriptor_is_refused(d in desc(), extra in any::<u8>()) {
            let b = d.to_bytes();
            for cut in 0..b.len() {
                let r = MemoryDescriptor::from_bytes(&b[..cut]);
                prop_assert!(matches!(&r, Err(e) if is_invalid(e)), "{} of {}: {:?}", cut, b.len(), r);
            }
            let mut longer = b;
            longer.push(extra);
            let r = MemoryDescriptor::from_bytes(&longer);
            prop_assert!(matches!(r, Err(Error::InvalidArgument { arg: "descriptor", .. })), "{:?}", r);
        }

        /// One byte of a descriptor changed: a typed refusal, or a descriptor whose every rule
        /// holds and whose bytes are exactly the changed ones (the version aside: version 2 is
        /// read, and written back as the newest).
        #[test]
        fn a_changed_byte_is_refused_or_read_exactly(
            d in desc(), at in any::<usize>(), byte in any::<u8>(),
        ) {
            let mut b = d.to_bytes();
            let i = at % b.len();
            b[i] = byte;
            match MemoryDescriptor::from_bytes(&b) {
                Ok(got) => {
                    prop_assert_ne!(got.len(), 0);
                    prop_assert!(got.addr().checked_add(got.len()).is_some());
                    if let Some(p) = got.ipc() {
                        let end = p.offset().checked_add(got.len());
                        prop_assert!(end.is_some_and(|e| e <= p.alloc_len()));
                    }
                    let mut again = got.to_bytes();
                    again[4..6].copy_from_slice(&b[4..6]);
                    prop_assert_eq!(again, b);
                }
                Err(e) => prop_assert!(is_invalid(&e), "{}", e),
            }
        }

        /// A list's count is the peer's word: past MAX_DESCRIPTORS it is refused on its own;
        /// any other count in front of fewer bytes than one descriptor (29) is refused, typed,
        /// without reserving room for the count.
        #[test]
        fn a_lists_count_is_checked_against_its_bytes(
            n in prop_oneof![0u32..8, Just(u32::MAX), any::<u32>()],
            tail in proptest::collection::vec(any::<u8>(), 0..29),
        ) {
            let mut b = n.to_le_bytes().to_vec();
            b.extend_from_slice(&tail);
            let r = decode_list(&b);
            if n == 0 && tail.is_empty() {
                prop_assert_eq!(r.unwrap(), Vec::new());
            } else if n as usize > MAX_DESCRIPTORS {
                prop_assert!(matches!(r, Err(Error::InvalidArgument { arg: "descriptors", .. })), "{:?}", r);
            } else {
                prop_assert!(matches!(&r, Err(e) if is_invalid(e)), "{:?}", r);
            }
        }
    }
}
