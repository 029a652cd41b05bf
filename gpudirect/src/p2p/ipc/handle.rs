//! What every IPC handle shares: its 64 opaque bytes (as hex for serde, as the C struct's
//! `char`s) and the checks of what a peer's handle says (untrusted input).

/// 64 opaque handle bytes serialized as 128 lower-case hex digits.
#[cfg(feature = "serde")]
pub(crate) mod hex64 {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    /// Serialize as hex.
    pub fn serialize<S: Serializer>(bytes: &[u8; 64], s: S) -> Result<S::Ok, S::Error> {
        let mut out = String::with_capacity(128);
        for b in bytes {
            out.push_str(&format!("{b:02x}"));
        }
        s.serialize_str(&out)
    }

    /// Parse 128 hex digits.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 64], D::Error> {
        let s = String::deserialize(d)?;
        parse(&s).map_err(D::Error::custom)
    }

    pub(crate) fn parse(s: &str) -> Result<[u8; 64], String> {
        if s.len() != 128 {
            return Err(format!(
                "an IPC handle is 128 hex digits, got {} characters",
                s.len()
            ));
        }
        // Digits only: `from_str_radix` would also take a sign ("+f").
        if let Some(at) = s.bytes().position(|c| !c.is_ascii_hexdigit()) {
            return Err(format!("an IPC handle is 128 hex digits, not one at {at}"));
        }
        let mut out = [0u8; 64];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16)
                .map_err(|e| format!("bad hex at {}: {e}", 2 * i))?;
        }
        Ok(out)
    }
}

/// The 64 handle bytes as unsigned bytes.
pub(crate) fn to_bytes(reserved: &[std::ffi::c_char; 64]) -> [u8; 64] {
    let mut out = [0u8; 64];
    for (o, &c) in out.iter_mut().zip(reserved) {
        *o = c as u8;
    }
    out
}

/// The 64 handle bytes as the C struct's `char` array.
pub(crate) fn to_chars(bytes: &[u8; 64]) -> [std::ffi::c_char; 64] {
    let mut out = [0 as std::ffi::c_char; 64];
    for (o, &b) in out.iter_mut().zip(bytes) {
        *o = b as std::ffi::c_char;
    }
    out
}

/// Check a peer-supplied buffer range against the allocation actually mapped: the buffer
/// `offset..offset + bytes` (bytes from the mapping's base) must lie within the `size` bytes the
/// driver reports (`cuMemGetAddressRange`) and start on an `align`-byte boundary. The offset and
/// size come from another process (deserialized), so nothing about them is trusted.
pub(crate) fn check_import_range(
    offset_arg: &'static str,
    offset: u64,
    bytes: u64,
    size: u64,
    align: u64,
) -> crate::Result<()> {
    match offset.checked_add(bytes) {
        Some(end) if end <= size => {}
        _ => {
            return Err(crate::Error::invalid(
                offset_arg,
                format!("{offset}..{offset}+{bytes}"),
                format!("must lie within the {size}-byte allocation mapped"),
            ));
        }
    }
    if align > 1 && !offset.is_multiple_of(align) {
        return Err(crate::Error::invalid(
            offset_arg,
            offset,
            format!("must be a multiple of the element alignment {align}"),
        ));
    }
    Ok(())
}

/// Check a peer's element size (untrusted) against `size_of::<T>()` = `elem_size`: equal and
/// non-zero. Returns it as a `u64`.
pub(crate) fn check_elem_size(theirs: u32, elem_size: usize) -> crate::Result<u64> {
    let size = elem_size as u64;
    if u64::from(theirs) != size || size == 0 {
        return Err(crate::Error::invalid(
            "handle.elem_size",
            theirs,
            format!("must equal size_of::<T>() = {size} (non-zero)"),
        ));
    }
    Ok(size)
}

/// Check a peer's range against the allocation the driver says holds the import at `ptr`
/// (`cuMemGetAddressRange`): `offset(base)..+ bytes` must lie within it, `align`-aligned (see
/// [`check_import_range`], whose `offset_arg` names the field). On failure `undo` gives the
/// import back before the error is returned. Returns the allocation's size in bytes.
///
/// # Safety
///
/// A context is current; `ptr` is an import just made, that nothing uses yet.
pub(crate) unsafe fn check_imported(
    ptr: u64,
    (offset_arg, offset): (&'static str, impl FnOnce(u64) -> u64),
    bytes: u64,
    align: u64,
    undo: impl FnOnce(),
) -> crate::Result<usize> {
    // SAFETY: the caller's.
    let r = unsafe { crate::driver::mem::address_range(ptr) }.and_then(|(base, size)| {
        check_import_range(offset_arg, offset(base), bytes, size as u64, align).map(|()| size)
    });
    if r.is_err() {
        undo();
    }
    r
}

/// The longest PCI address a handle may carry (`dddddddd:bb:dd.f` is 16 characters).
const MAX_BUS_ID: usize = 32;

/// Check a PCI address from a peer (untrusted): at most [`MAX_BUS_ID`] characters, and a PCI
/// address (`domain:bus:device.function`, hexadecimal).
pub(crate) fn check_bus_id(bus: Option<&str>) -> crate::Result<()> {
    match bus {
        Some(b) if b.len() > MAX_BUS_ID || crate::p2p::link::parse_bus_id(b).is_none() => {
            Err(crate::Error::invalid(
                "handle.pci_bus_id",
                b.chars().take(MAX_BUS_ID).collect::<String>(),
                "must be a PCI address such as 0000:19:00.0",
            ))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::p2p::IpcMemHandle;

    #[test]
    fn imported_ranges_must_lie_within_the_mapped_allocation() {
        let ok = |o, b, s, a| check_import_range("handle.offset", o, b, s, a).is_ok();
        assert!(ok(0, 4096, 4096, 4));
        assert!(ok(256, 3840, 4096, 4));
        assert!(ok(4096, 0, 4096, 4));
        // Past the end, by a byte or by overflow.
        assert!(!ok(256, 3841, 4096, 4));
        assert!(!ok(4097, 0, 4096, 4));
        assert!(!ok(u64::MAX, 2, 4096, 1));
        assert!(!ok(8, u64::MAX - 4, u64::MAX, 1));
        // Misaligned for the element type.
        assert!(!ok(2, 4, 4096, 4));
        assert!(ok(2, 4, 4096, 2));
        let e = check_import_range("handle.offset", 4000, 200, 4096, 8).unwrap_err();
        assert!(
            matches!(
                e,
                crate::Error::InvalidArgument {
                    arg: "handle.offset",
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn handle_bytes_round_trip_through_hex_and_chars() {
        let mut b = [0u8; 64];
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i * 37 + 200) as u8;
        }
        assert_eq!(to_bytes(&to_chars(&b)), b);
    }

    #[cfg(feature = "serde")]
    #[test]
    fn handles_round_trip_through_serde() {
        let mut b = [0u8; 64];
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i * 37 + 200) as u8;
        }
        let h = IpcMemHandle::from_parts(b, 40, 4096, 4, 0, Some("0000:19:00.0".into()));
        let j = serde_json::to_string(&h).unwrap();
        let back: IpcMemHandle = serde_json::from_str(&j).unwrap();
        assert_eq!(back, h);
        assert!(hex64::parse("zz").is_err());
        // `from_str_radix` takes a sign: "+f" is no pair of hex digits.
        assert!(hex64::parse(&"+f".repeat(64)).is_err());
        let bad = j.replace(&format!("{:02x}", b[0]), "g0");
        assert!(serde_json::from_str::<IpcMemHandle>(&bad).is_err());
        // A handle from a peer that names no PCI address still reads (and opens only with
        // `open_on`).
        let old = j.replace(",\"pci_bus_id\":\"0000:19:00.0\"", "");
        assert_ne!(old, j);
        assert_eq!(
            serde_json::from_str::<IpcMemHandle>(&old)
                .unwrap()
                .pci_bus_id,
            None
        );
    }

    #[test]
    fn a_peers_pci_address_is_checked() {
        assert!(check_bus_id(None).is_ok());
        assert!(check_bus_id(Some("0000:19:00.0")).is_ok());
        assert!(check_bus_id(Some("00000001:AB:1f.0")).is_ok());
        for bad in ["", "garbage", "0000:zz:00.0", &"0".repeat(4096)] {
            let e = check_bus_id(Some(bad)).unwrap_err();
            assert!(
                matches!(
                    e,
                    crate::Error::InvalidArgument {
                        arg: "handle.pci_bus_id",
                        ..
                    }
                ),
                "{e}"
            );
            assert!(e.to_string().len() < 400, "a long value is cut: {e}");
        }
        let h = IpcMemHandle::from_parts([1; 64], 0, 16, 4, 0, Some("x".into()));
        assert!(h.check(4).is_err());
    }

    #[test]
    fn a_peers_pci_address_is_hex_digits_and_nothing_more() {
        // `from_str_radix` takes a sign ("+19"); a fourth field, or a function that is missing
        // or no digit, went unread.
        for bad in [
            "+000:19:00.0",
            "0000:+19:00.0",
            "0000:19:+0.0",
            "0000:19:00.+0",
            "0000:19:00.0:7",
            "0000:19:00",
            "0000:19:00.",
            "0000:19:00.z",
            "0000::00.0",
        ] {
            assert!(check_bus_id(Some(bad)).is_err(), "{bad:?}");
        }
    }

    use proptest::prelude::*;

    /// Whether `s` is `hex:hex:hex.hex`, every field 1 or more hex digits of a u32.
    fn pci_shape(s: &str) -> bool {
        let field = |p: &str| {
            !p.is_empty()
                && p.bytes().all(|b| b.is_ascii_hexdigit())
                && u64::from_str_radix(p, 16).is_ok_and(|v| v <= u32::MAX as u64)
        };
        let f: Vec<&str> = s.split(':').collect();
        f.len() == 3
            && field(f[0])
            && field(f[1])
            && f[2]
                .split_once('.')
                .is_some_and(|(d, x)| field(d) && field(x))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any 64 bytes read back from their hex digits exactly (either case); one character
        /// changed reads as the new digit or is refused; every strict prefix is refused.
        #[cfg(feature = "serde")]
        #[test]
        fn handle_hex_is_read_exactly_or_refused(
            b in proptest::collection::vec(any::<u8>(), 64), at in 0usize..128, c in any::<char>(),
        ) {
            let b: [u8; 64] = b.try_into().expect("64");
            let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
            prop_assert_eq!(hex64::parse(&h), Ok(b));
            prop_assert_eq!(hex64::parse(&h.to_uppercase()), Ok(b));
            let mut s = h.clone();
            s.replace_range(at..at + 1, c.encode_utf8(&mut [0; 4]));
            match hex64::parse(&s) {
                Ok(got) => {
                    let mut want = b;
                    let k = at / 2;
                    want[k] = u8::from_str_radix(&s[2 * k..2 * k + 2], 16).unwrap();
                    prop_assert_eq!(got, want);
                }
                Err(_) => prop_assert!(!c.is_ascii_hexdigit()),
            }
            prop_assert!(hex64::parse(&h[..at]).is_err());
        }

        /// A PCI address written out reads back exactly; any string is taken exactly when it
        /// is `hex:hex:hex.hex` (digits only, no sign, nothing after the function).
        #[test]
        fn pci_addresses_are_read_exactly_or_refused(
            dom in any::<u32>(), bus in any::<u8>(), dev in 0u8..32, func in 0u8..8,
            s in prop_oneof![
                "[0-9a-fA-F:.+ -]{0,20}",
                // Near the shape: fields that may hold a sign, separators that may be wrong,
                // something after the function.
                (
                    "[+ ]?[0-9a-fA-F]{0,3}", "[:.]", "[+]?[0-9a-f]{0,3}", "[:.]",
                    "[+]?[0-9a-f]{0,3}", "[:.]", "[+]?[0-9a-z]{0,2}", "(:[0-9a-z]{0,2})? ?",
                )
                    .prop_map(|(a, b, c, d, e, f, g, h)| [a, b, c, d, e, f, g, h].concat()),
            ],
        ) {
            for id in [
                format!("{dom:04x}:{bus:02x}:{dev:02x}.{func}"),
                format!("{dom:08X}:{bus:02X}:{dev:02x}.{func}"),
            ] {
                let want = (dom, u32::from(bus), u32::from(dev));
                prop_assert_eq!(crate::p2p::link::parse_bus_id(&id), Some(want));
                prop_assert!(check_bus_id(Some(&id)).is_ok());
            }
            let r = check_bus_id(Some(&s));
            prop_assert_eq!(r.is_ok(), pci_shape(s.trim()), "{:?}", s);
            if let Err(e) = r {
                let typed = matches!(e, crate::Error::InvalidArgument { arg: "handle.pci_bus_id", .. });
                prop_assert!(typed);
            }
        }
    }
}
