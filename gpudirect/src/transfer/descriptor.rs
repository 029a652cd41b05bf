//! Memory descriptors: what a peer needs to reach registered memory (address, length, memory
//! kind, one rkey per rail, and for exportable GPU memory a CUDA IPC part), serializable with
//! serde or as bytes, and checked field by field when they come from outside.

use crate::error::{Error, Result};

/// The most rails (verbs devices) an engine, and so a descriptor, may have.
pub const MAX_RAILS: usize = 16;

/// The descriptor format this library writes and reads.
pub const DESCRIPTOR_VERSION: u16 = 2;

/// The most descriptors one list ([`encode_list`], an endpoint's first message) may carry.
pub const MAX_DESCRIPTORS: usize = 1 << 16;

const MAGIC: [u8; 4] = *b"GDXD";
const HEADER: usize = 4 + 2 + 1 + 1 + 1 + 8 + 8;
/// Flag bit: a CUDA IPC part follows the rkeys.
const HAS_IPC: u8 = 1;

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

/// How a process on the same node reaches described GPU memory through CUDA IPC: the
/// `cuIpcGetMemHandle` handle of the allocation holding it, the allocation's length in bytes, the
/// offset of the described bytes in it, and the UUID of the GPU that owns it (what every process
/// on the node calls that GPU, whatever its `CUDA_VISIBLE_DEVICES`).
///
/// A descriptor carries one when its memory can be exported (`cuMemAlloc` memory, such as a
/// [`DeviceBuffer`](crate::memory::DeviceBuffer)); from a peer it is untrusted: the descriptor
/// checks that its bytes lie inside the allocation length claimed, and an importer checks them
/// again against the mapping it really gets.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcPart {
    handle: [u8; 64],
    alloc_len: u64,
    offset: u64,
    uuid: [u8; 16],
}

impl IpcPart {
    /// Bytes of an IPC part in [`MemoryDescriptor::to_bytes`].
    pub const WIRE_LEN: usize = 64 + 8 + 8 + 16;

    /// An IPC part from its fields (checked when it joins a descriptor:
    /// [`MemoryDescriptor::with_ipc`]).
    pub fn new(handle: [u8; 64], alloc_len: u64, offset: u64, gpu_uuid: [u8; 16]) -> Self {
        IpcPart {
            handle,
            alloc_len,
            offset,
            uuid: gpu_uuid,
        }
    }

    /// The `CUipcMemHandle` bytes of the allocation.
    #[doc(alias = "cuIpcGetMemHandle")]
    pub fn handle(&self) -> &[u8; 64] {
        &self.handle
    }

    /// The allocation's length in bytes, as its owner reports it.
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

    fn write_to(&self, b: &mut Vec<u8>) {
        b.extend_from_slice(&self.handle);
        b.extend_from_slice(&self.alloc_len.to_le_bytes());
        b.extend_from_slice(&self.offset.to_le_bytes());
        b.extend_from_slice(&self.uuid);
    }

    /// The part at the start of `b` (exactly [`WIRE_LEN`](Self::WIRE_LEN) bytes long).
    fn read_from(b: &[u8]) -> Self {
        let mut handle = [0u8; 64];
        handle.copy_from_slice(&b[..64]);
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[80..96]);
        IpcPart {
            handle,
            alloc_len: u64::from_le_bytes(b[64..72].try_into().expect("8 bytes")),
            offset: u64::from_le_bytes(b[72..80].try_into().expect("8 bytes")),
            uuid,
        }
    }
}

impl std::fmt::Debug for IpcPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcPart")
            .field("handle", &hex(&self.handle[..8]))
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
    if s.len() != 2 * N || !s.is_ascii() {
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

/// An [`IpcPart`] through serde: the handle and the UUID as hex digits.
#[derive(serde::Serialize, serde::Deserialize)]
struct IpcFields {
    handle: String,
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
            Some(i) => Some(IpcPart::new(
                unhex("descriptor.ipc.handle", &i.handle)?,
                i.alloc_len,
                i.offset,
                unhex("descriptor.ipc.gpu_uuid", &i.gpu_uuid)?,
            )),
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
                handle: hex(&i.handle),
                alloc_len: i.alloc_len,
                offset: i.offset,
                gpu_uuid: hex(&i.uuid),
            }),
        }
    }
}

fn check_version(v: u16) -> Result<()> {
    if v != DESCRIPTOR_VERSION {
        return Err(Error::invalid(
            "descriptor.version",
            v,
            format!("this library reads descriptor version {DESCRIPTOR_VERSION}"),
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
        Self::wire_len(self.rails as usize) + self.ipc.map_or(0, |_| IpcPart::WIRE_LEN)
    }

    /// The descriptor as bytes (little endian): `GDXD`, version (u16), kind (u8), rail count
    /// (u8), flags (u8: bit 0, an IPC part follows), address (u64), length (u64), one rkey (u32)
    /// per rail, then the IPC part if any: the handle (64 bytes), the allocation length (u64),
    /// the offset in it (u64), the GPU's UUID (16 bytes).
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
        b.push(if self.ipc.is_some() { HAS_IPC } else { 0 });
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
        check_version(u16::from_le_bytes([h[4], h[5]]))?;
        let kind = DescribedKind::from_raw(h[6])?;
        let rails = h[7] as usize;
        let flags = h[8];
        if flags & !HAS_IPC != 0 {
            return Err(Error::invalid(
                "descriptor.flags",
                format!("{flags:#04x}"),
                "only bit 0 (an IPC part follows) is defined",
            ));
        }
        let has_ipc = flags & HAS_IPC != 0;
        check_rails(rails, has_ipc)?;
        let addr = u64::from_le_bytes(h[9..17].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(h[17..25].try_into().expect("8 bytes"));
        let keys_end = Self::wire_len(rails);
        let total = keys_end + if has_ipc { IpcPart::WIRE_LEN } else { 0 };
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
        let ipc = has_ipc.then(|| IpcPart::read_from(&body[4 * rails..]));
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
    let mut out = Vec::with_capacity(n.min(1024));
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
        (
            proptest::collection::vec(any::<u8>(), 64),
            any::<u64>(),
            any::<u64>(),
            any::<[u8; 16]>(),
        )
            .prop_map(|(h, a, o, u)| IpcPart::new(h.try_into().expect("64"), a, o, u))
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
                    let i = IpcPart::new(*i.handle(), alloc, off, *i.gpu_uuid());
                    MemoryDescriptor::with_ipc(a, l, k, &r, i).ok()
                }
            })
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
            len in any::<u64>(), kind in any::<u8>(), flags in 0u8..4,
        ) {
            // Half the inputs start with a plausible header so the later checks are reached.
            let mut input = b.clone();
            if real {
                let mut h = MAGIC.to_vec();
                h.extend_from_slice(&DESCRIPTOR_VERSION.to_le_bytes());
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
                    if let Some(i) = d.ipc() {
                        prop_assert!(i.offset().checked_add(d.len()).is_some_and(|e| e <= i.alloc_len()));
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
}
