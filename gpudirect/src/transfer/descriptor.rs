//! Memory descriptors: what a peer needs to reach registered memory (address, length, memory
//! kind, one rkey per rail), serializable with serde or as bytes, and checked field by field when
//! they come from outside.

use crate::error::{Error, Result};

/// The most rails (verbs devices) an engine, and so a descriptor, may have.
pub const MAX_RAILS: usize = 16;

/// The descriptor format this library writes and reads.
pub const DESCRIPTOR_VERSION: u16 = 1;

/// The most descriptors one list ([`encode_list`], an endpoint's first message) may carry.
pub const MAX_DESCRIPTORS: usize = 1 << 16;

const MAGIC: [u8; 4] = *b"GDXD";
const HEADER: usize = 4 + 2 + 1 + 1 + 8 + 8;

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

/// A peer's registered memory, as one-sided transfers reach it: the address of the first byte
/// (a host address, or the IOVA of a GPU region), the length in bytes, the memory kind and one
/// remote key per rail of the owner's engine (in the owner's rail order).
///
/// Serialize it with serde or [`to_bytes`](Self::to_bytes) and hand it to the peer through the
/// endpoint's first message or any channel. A descriptor from outside is untrusted:
/// deserialization and [`from_bytes`](Self::from_bytes) check every field (version, kind, rail
/// count 1 to [`MAX_RAILS`], a length of at least one byte, and an address plus length within
/// 2^64), and every range taken of it ([`range`](Self::range)) is checked again.
#[derive(Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "DescriptorFields", into = "DescriptorFields")]
pub struct MemoryDescriptor {
    addr: u64,
    len: u64,
    kind: DescribedKind,
    rails: u8,
    rkeys: [u32; MAX_RAILS],
}

/// The fields as they travel through serde, before they are checked.
#[derive(serde::Serialize, serde::Deserialize)]
struct DescriptorFields {
    version: u16,
    addr: u64,
    len: u64,
    kind: DescribedKind,
    rkeys: Vec<u32>,
}

impl TryFrom<DescriptorFields> for MemoryDescriptor {
    type Error = Error;
    fn try_from(f: DescriptorFields) -> Result<Self> {
        check_version(f.version)?;
        MemoryDescriptor::new(f.addr, f.len, f.kind, &f.rkeys)
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
    /// A checked descriptor.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the field: `len` 0; `addr + len` past 2^64 (the end
    /// address must fit 64 bits); no rkey, or more than [`MAX_RAILS`].
    pub fn new(addr: u64, len: u64, kind: DescribedKind, rkeys: &[u32]) -> Result<Self> {
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
        if rkeys.is_empty() || rkeys.len() > MAX_RAILS {
            return Err(Error::invalid(
                "descriptor.rkeys",
                rkeys.len(),
                format!("one rkey per rail: 1 to {MAX_RAILS}"),
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
        })
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

    /// One rkey per rail of the owner's engine, in its rail order.
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

    /// Bytes of [`to_bytes`](Self::to_bytes) for a descriptor with `rails` rkeys.
    pub fn wire_len(rails: usize) -> usize {
        HEADER + 4 * rails
    }

    /// The descriptor as bytes (little endian): `GDXD`, version (u16), kind (u8), rail count
    /// (u8), address (u64), length (u64), then one rkey (u32) per rail.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::wire_len(self.rails as usize));
        self.write_to(&mut b);
        b
    }

    fn write_to(&self, b: &mut Vec<u8>) {
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&DESCRIPTOR_VERSION.to_le_bytes());
        b.push(self.kind.to_raw());
        b.push(self.rails);
        b.extend_from_slice(&self.addr.to_le_bytes());
        b.extend_from_slice(&self.len.to_le_bytes());
        for k in self.rkeys() {
            b.extend_from_slice(&k.to_le_bytes());
        }
    }

    /// Decode [`to_bytes`](Self::to_bytes): exactly one descriptor, every field checked.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming what is wrong: the length, the magic, an unknown
    /// version or kind, a rail count of 0 or above [`MAX_RAILS`], an empty range or one whose
    /// address plus length passes 2^64.
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
        if rails == 0 || rails > MAX_RAILS {
            return Err(Error::invalid(
                "descriptor.rails",
                rails,
                format!("one rkey per rail: 1 to {MAX_RAILS}"),
            ));
        }
        let addr = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(h[16..24].try_into().expect("8 bytes"));
        let total = Self::wire_len(rails);
        let keys = b.get(HEADER..total).ok_or_else(|| {
            Error::invalid(
                "descriptor",
                format!("{} bytes", b.len()),
                format!("{rails} rails need {total} bytes"),
            )
        })?;
        let mut rkeys = [0u32; MAX_RAILS];
        for (k, c) in rkeys.iter_mut().zip(keys.chunks_exact(4)) {
            *k = u32::from_le_bytes(c.try_into().expect("4 bytes"));
        }
        Ok((Self::new(addr, len, kind, &rkeys[..rails])?, total))
    }
}

impl std::fmt::Debug for MemoryDescriptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryDescriptor")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("kind", &self.kind)
            .field("rkeys", &format_args!("{:x?}", self.rkeys()))
            .finish()
    }
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
    let mut b = Vec::with_capacity(4 + list.len() * MemoryDescriptor::wire_len(MAX_RAILS));
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

    fn desc() -> impl Strategy<Value = MemoryDescriptor> {
        (
            crate::proptest_support::addr(),
            1u64..=(1 << 40),
            kind(),
            proptest::collection::vec(any::<u32>(), 1..=MAX_RAILS),
        )
            .prop_filter_map("fits", |(a, l, k, r)| {
                MemoryDescriptor::new(a, l, k, &r).ok()
            })
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
        b[16..24].copy_from_slice(&11u64.to_le_bytes());
        assert!(matches!(
            MemoryDescriptor::from_bytes(&b),
            Err(Error::InvalidArgument {
                arg: "descriptor.len",
                ..
            })
        ));
        let j = r#"{"version":1,"addr":18446744073709551606,"len":11,"kind":"Host","rkeys":[1]}"#;
        assert!(serde_json::from_str::<MemoryDescriptor>(j).is_err());
        let j = r#"{"version":2,"addr":0,"len":11,"kind":"Host","rkeys":[1]}"#;
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
            prop_assert_eq!(d.to_bytes().len(), MemoryDescriptor::wire_len(d.rkeys().len()));
            let j = serde_json::to_string(&d).unwrap();
            prop_assert_eq!(serde_json::from_str::<MemoryDescriptor>(&j).unwrap(), d);
        }

        /// Any bytes at all: a descriptor whose every field holds, or a typed error.
        #[test]
        fn any_bytes_decode_checked_or_refused(
            b in proptest::collection::vec(any::<u8>(), 0..120),
            real in any::<bool>(), rails in 0u8..=20, addr in crate::proptest_support::addr(),
            len in any::<u64>(), kind in any::<u8>(),
        ) {
            // Half the inputs start with a plausible header so the later checks are reached.
            let mut input = b.clone();
            if real {
                let mut h = MAGIC.to_vec();
                h.extend_from_slice(&1u16.to_le_bytes());
                h.push(kind % 4);
                h.push(rails);
                h.extend_from_slice(&addr.to_le_bytes());
                h.extend_from_slice(&len.to_le_bytes());
                h.extend_from_slice(&b);
                input = h;
            }
            match MemoryDescriptor::from_bytes(&input) {
                Ok(d) => {
                    prop_assert_ne!(d.len(), 0);
                    prop_assert!(d.addr().checked_add(d.len()).is_some());
                    prop_assert!((1..=MAX_RAILS).contains(&d.rkeys().len()));
                    prop_assert_eq!(input.len(), MemoryDescriptor::wire_len(d.rkeys().len()));
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
