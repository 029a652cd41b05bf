//! The rails' handshake messages. The greeting (the first round, through the connection's
//! handshake buffer, fixed size): who is connecting (a random endpoint group id, the same on
//! every rail of it), which rail this is, whether it takes a failed rail of a connected
//! endpoint back, the sender's devices, its receive credits and largest message, with the
//! authentication challenge. The descriptor message (read by the peer with an RDMA read once
//! the greetings, and with a key the proofs, were checked): the descriptors the sender
//! publishes. A rail taken back sends instead its window message: the rkeys of the windows it
//! bound again, each beside the rkey the peer's descriptors name.

use super::auth::Challenge;
use super::descriptor::{MAX_RAILS, MemoryDescriptor, decode_list, encode_list};
use crate::error::{Error, Result};

const MAGIC: [u8; 4] = *b"GDXH";
/// Version 2: the fields other than the descriptors moved to the greeting.
const VERSION: u16 = 2;
const FIXED: usize = 4 + 2;

const GREETING_MAGIC: [u8; 4] = *b"GDXA";
/// Version 2: the rail's generation, when it comes back.
const GREETING_VERSION: u16 = 2;
/// Bytes of a greeting: magic, version, challenge, group, rail, rails, device, devices,
/// credits, largest message, generation.
pub(crate) const GREETING_LEN: usize = 4 + 2 + Challenge::LEN + 16 + 4 + 2 + 4 + 4;

const WINDOWS_MAGIC: [u8; 4] = *b"GDXW";
const WINDOWS_VERSION: u16 = 1;
/// The most rkey pairs in a window message (8 bytes each, within [`MAX_HELLO`]).
pub(crate) const MAX_RENAMED: usize = (MAX_HELLO as usize - FIXED - 8) / 8;

/// The largest first message read from a peer.
pub(crate) const MAX_HELLO: u64 = 4 << 20;

/// The first `fixed` bytes of a peer's first message, once its length, `magic` and `version`
/// are checked (the rail first message here, the intra-node one in `local`).
///
/// # Errors
///
/// [`Error::InvalidArgument`] naming the field.
pub(crate) fn header(b: &[u8], fixed: usize, magic: [u8; 4], version: u16) -> Result<&[u8]> {
    let Some(h) = b.get(..fixed) else {
        return Err(Error::invalid(
            "hello",
            format!("{} bytes", b.len()),
            format!("a first message is at least {fixed} bytes"),
        ));
    };
    if h[..4] != magic {
        return Err(Error::invalid(
            "hello.magic",
            format!("{:02x?}", &h[..4]),
            format!("starts with {}", String::from_utf8_lossy(&magic)),
        ));
    }
    let v = u16::from_le_bytes([h[4], h[5]]);
    if v != version {
        return Err(Error::invalid(
            "hello.version",
            v.to_string(),
            format!("this library speaks version {version}"),
        ));
    }
    Ok(h)
}

/// What a rail's peer said: its greeting, and (once authenticated) its descriptors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hello {
    /// The connecting endpoint (random, the same on every rail of it).
    pub(crate) group: [u8; 16],
    pub(crate) rail: u8,
    pub(crate) rails: u8,
    /// 0 on a rail of a new endpoint. On a failed rail of endpoint `group` taken back (its
    /// dialer connects it alone): one more than the sender's generation of that rail (how many
    /// times it came back there); the rail's next generation is the larger of the two sides'.
    pub(crate) back: u32,
    /// The sender's engine device for this rail, and how many it has (its descriptors' rkeys).
    pub(crate) device: u8,
    pub(crate) devices: u8,
    /// Receives the sender posts for notifications (rail 0).
    pub(crate) credits: u16,
    pub(crate) max_message: u32,
    pub(crate) descriptors: Vec<MemoryDescriptor>,
}

impl Hello {
    /// The greeting: these fields (not the descriptors) and the challenge `c`.
    pub(crate) fn greeting(&self, c: &Challenge) -> Vec<u8> {
        let mut b = Vec::with_capacity(GREETING_LEN);
        b.extend_from_slice(&GREETING_MAGIC);
        b.extend_from_slice(&GREETING_VERSION.to_le_bytes());
        c.put(&mut b);
        b.extend_from_slice(&self.group);
        b.extend_from_slice(&[self.rail, self.rails, self.device, self.devices]);
        b.extend_from_slice(&self.credits.to_le_bytes());
        b.extend_from_slice(&self.max_message.to_le_bytes());
        b.extend_from_slice(&self.back.to_le_bytes());
        debug_assert_eq!(b.len(), GREETING_LEN);
        b
    }

    /// Decode a peer's greeting (no descriptors yet); every field is checked.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the field.
    pub(crate) fn from_greeting(b: &[u8]) -> Result<(Challenge, Hello)> {
        let bad = |arg: &'static str, v: String, rule: &str| Err(Error::invalid(arg, v, rule));
        let h = header(b, GREETING_LEN, GREETING_MAGIC, GREETING_VERSION)?;
        if b.len() != GREETING_LEN {
            return bad(
                "hello",
                format!("{} bytes", b.len()),
                &format!("a greeting is {GREETING_LEN} bytes"),
            );
        }
        let c = Challenge::take(&h[6..])?;
        let at = 6 + Challenge::LEN;
        let group: [u8; 16] = h[at..at + 16].try_into().expect("16 bytes");
        let f = &h[at + 16..];
        let (rail, rails, device, devices) = (f[0], f[1], f[2], f[3]);
        if rails == 0 || rails as usize > MAX_RAILS || rail >= rails {
            return bad(
                "hello.rail",
                format!("{rail} of {rails}"),
                "a rail index below a rail count of 1 to 16",
            );
        }
        if devices == 0 || devices as usize > MAX_RAILS || device >= devices {
            return bad(
                "hello.device",
                format!("{device} of {devices}"),
                "a device index below a device count of 1 to 16",
            );
        }
        let credits = u16::from_le_bytes([f[4], f[5]]);
        if !(4..=4096).contains(&credits) {
            return bad("hello.credits", credits.to_string(), "4 to 4096 receives");
        }
        let max_message = u32::from_le_bytes(f[6..10].try_into().expect("4 bytes"));
        let back = u32::from_le_bytes(f[10..14].try_into().expect("4 bytes"));
        if max_message < 4096 {
            return bad(
                "hello.max_message",
                max_message.to_string(),
                "at least 4 KiB",
            );
        }
        Ok((
            c,
            Hello {
                group,
                rail,
                rails,
                back,
                device,
                devices,
                credits,
                max_message,
                descriptors: Vec::new(),
            },
        ))
    }

    /// The window message of a rail taken back: the rail's next generation as the sender
    /// proposes it (one more than its own), and per window bound again, the rkey the peer's
    /// descriptors name (the first window's over that range) and the new window's.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for more than [`MAX_RENAMED`] pairs.
    pub(crate) fn encode_renamed(generation: u32, pairs: &[(u32, u32)]) -> Result<Vec<u8>> {
        if pairs.len() > MAX_RENAMED {
            return Err(Error::invalid(
                "windows",
                pairs.len(),
                format!("at most {MAX_RENAMED} windows are bound again"),
            ));
        }
        let mut b = Vec::with_capacity(FIXED + 8 + 8 * pairs.len());
        b.extend_from_slice(&WINDOWS_MAGIC);
        b.extend_from_slice(&WINDOWS_VERSION.to_le_bytes());
        b.extend_from_slice(&generation.to_le_bytes());
        b.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
        for (old, new) in pairs {
            b.extend_from_slice(&old.to_le_bytes());
            b.extend_from_slice(&new.to_le_bytes());
        }
        Ok(b)
    }

    /// Decode a peer's window message (generation, pairs): its count must match its length.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the field.
    pub(crate) fn decode_renamed(b: &[u8]) -> Result<(u32, Vec<(u32, u32)>)> {
        header(b, FIXED, WINDOWS_MAGIC, WINDOWS_VERSION)?;
        let rest = &b[FIXED..];
        let Some((head, pairs)) = rest.split_first_chunk::<8>() else {
            return Err(Error::invalid(
                "hello.windows",
                format!("{} bytes", b.len()),
                "a generation and a count after the header",
            ));
        };
        let generation = u32::from_le_bytes(head[..4].try_into().expect("4 bytes"));
        let n = u32::from_le_bytes(head[4..].try_into().expect("4 bytes")) as usize;
        if n > MAX_RENAMED || pairs.len() != n * 8 {
            return Err(Error::invalid(
                "hello.windows",
                format!("{n} pairs in {} bytes", pairs.len()),
                format!("at most {MAX_RENAMED} pairs of two 4-byte rkeys, nothing after them"),
            ));
        }
        let pairs: Vec<(u32, u32)> = pairs
            .chunks_exact(8)
            .map(|c| {
                let k = |i: usize| u32::from_le_bytes(c[i..i + 4].try_into().expect("4 bytes"));
                (k(0), k(4))
            })
            .collect();
        // One new name per old rkey: a second would be taken silently in place of the first.
        let mut olds: Vec<u32> = pairs.iter().map(|p| p.0).collect();
        olds.sort_unstable();
        if let Some(w) = olds.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::invalid(
                "hello.windows",
                format!("rkey {:#x} renamed twice", w[0]),
                "each old rkey once",
            ));
        }
        Ok((generation, pairs))
    }

    /// The descriptor message of `publish`.
    pub(crate) fn encode_descriptors(publish: &[MemoryDescriptor]) -> Result<Vec<u8>> {
        let list = encode_list(publish)?;
        let mut b = Vec::with_capacity(FIXED + list.len());
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&list);
        Ok(b)
    }

    /// Decode a peer's descriptor message; each descriptor must have one rkey per device of
    /// the peer (`devices`, from its greeting).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the field.
    pub(crate) fn decode_descriptors(b: &[u8], devices: u8) -> Result<Vec<MemoryDescriptor>> {
        header(b, FIXED, MAGIC, VERSION)?;
        let descriptors = decode_list(&b[FIXED..])?;
        if let Some(d) = descriptors
            .iter()
            .find(|d| d.rkeys().len() != devices as usize)
        {
            return Err(Error::invalid(
                "hello.descriptors",
                format!("{d:?}"),
                "one rkey per device of the sender",
            ));
        }
        Ok(descriptors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proptest_support::is_invalid;
    use crate::transfer::auth::Role;
    use crate::transfer::descriptor::DescribedKind;
    use proptest::prelude::*;

    fn hello(n: usize) -> Hello {
        Hello {
            group: [0x12; 16],
            rail: 1,
            rails: 2,
            back: 0,
            device: 0,
            devices: 2,
            credits: 64,
            max_message: 1 << 20,
            descriptors: (0..n)
                .map(|i| {
                    MemoryDescriptor::new(i as u64 * 4096, 4096, DescribedKind::Host, &[1, 2])
                        .unwrap()
                })
                .collect(),
        }
    }

    fn challenge() -> Challenge {
        Challenge::new(Role::Dialer, true).unwrap()
    }

    #[test]
    fn greetings_and_descriptor_messages_round_trip() {
        let c = challenge();
        for n in [0, 1, 7] {
            let mut h = hello(n);
            h.back = if n == 1 { 3 } else { 0 };
            let g = h.greeting(&c);
            assert_eq!(g.len(), GREETING_LEN);
            assert!(g.len() <= crate::rdma::HANDSHAKE_BYTES);
            let (c2, mut h2) = Hello::from_greeting(&g).unwrap();
            assert_eq!(c2, c);
            h2.descriptors =
                Hello::decode_descriptors(&Hello::encode_descriptors(&h.descriptors).unwrap(), 2)
                    .unwrap();
            assert_eq!(h2, h);
        }
        let e = Hello::decode_descriptors(
            &Hello::encode_descriptors(&hello(1).descriptors).unwrap(),
            3,
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidArgument {
                    arg: "hello.descriptors",
                    ..
                }
            ),
            "{e}"
        );
        // A greeting is exactly its size: one byte more or less is refused.
        let g = hello(0).greeting(&c);
        let mut long = g.clone();
        long.push(0);
        for b in [&g[..GREETING_LEN - 1], &long[..], b"GDXA", b""] {
            assert!(is_invalid(&Hello::from_greeting(b).unwrap_err()));
        }
    }

    #[test]
    fn window_messages_round_trip_and_refuse_what_does_not_add_up() {
        for pairs in [vec![], vec![(1, 2)], vec![(7, 0xdead_beef), (u32::MAX, 0)]] {
            let b = Hello::encode_renamed(9, &pairs).unwrap();
            assert_eq!(Hello::decode_renamed(&b).unwrap(), (9, pairs));
            // A byte more or less, or a count one off: refused.
            let mut long = b.clone();
            long.push(0);
            let mut more = b.clone();
            more[10] = more[10].wrapping_add(1);
            for x in [&b[..b.len() - 1], &long[..], &more[..], b"GDXW"] {
                assert!(is_invalid(&Hello::decode_renamed(x).unwrap_err()));
            }
        }
        // A descriptor message is no window message.
        let d = Hello::encode_descriptors(&hello(1).descriptors).unwrap();
        assert!(is_invalid(&Hello::decode_renamed(&d).unwrap_err()));
        let e = Hello::encode_renamed(1, &vec![(0, 0); MAX_RENAMED + 1]).unwrap_err();
        assert!(is_invalid(&e));
        // An old rkey renamed twice: refused, not the last name taken.
        let b = Hello::encode_renamed(3, &[(5, 1), (6, 2), (5, 3)]).unwrap();
        let e = Hello::decode_renamed(&b).unwrap_err();
        assert!(e.to_string().contains("renamed twice"), "{e}");
    }

    proptest! {
        /// Any bytes as a window message: a typed refusal or pairs that fill it exactly.
        #[test]
        fn garbage_window_messages_are_refused_typed(
            b in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let mut m = WINDOWS_MAGIC.to_vec();
            m.extend_from_slice(&WINDOWS_VERSION.to_le_bytes());
            m.extend_from_slice(&b);
            match Hello::decode_renamed(&m) {
                Ok((_, p)) => prop_assert_eq!(p.len() * 8 + 8, b.len()),
                Err(e) => prop_assert!(is_invalid(&e), "{}", e),
            }
        }

        /// Any corruption of a valid greeting: decoded with every field in range, or a typed
        /// refusal.
        #[test]
        fn corrupted_greetings_are_refused_or_sound(
            at in any::<usize>(), byte in any::<u8>(), cut in any::<usize>(),
        ) {
            let mut b = hello(0).greeting(&challenge());
            let i = at % b.len();
            b[i] = byte;
            b.truncate(b.len() - cut % 3);
            match Hello::from_greeting(&b) {
                Ok((_, h)) => {
                    prop_assert!(h.rail < h.rails && h.device < h.devices);
                    prop_assert!((4..=4096).contains(&h.credits));
                }
                Err(e) => prop_assert!(is_invalid(&e), "{}", e),
            }
        }

        /// Any bytes at all as a greeting: a typed refusal or a sound greeting, never a panic.
        #[test]
        fn garbage_greetings_are_refused_typed(b in proptest::collection::vec(any::<u8>(), 0..80)) {
            if let Err(e) = Hello::from_greeting(&b) {
                prop_assert!(is_invalid(&e), "{}", e);
            }
        }

        /// Any corruption of a valid descriptor message: decoded with one rkey per device, or a
        /// typed refusal.
        #[test]
        fn corrupted_descriptor_messages_are_refused_or_sound(
            n in 0usize..4, at in any::<usize>(), byte in any::<u8>(), cut in any::<usize>(),
        ) {
            let mut b = Hello::encode_descriptors(&hello(n).descriptors).unwrap();
            let i = at % b.len();
            b[i] = byte;
            b.truncate(b.len() - cut % 3);
            match Hello::decode_descriptors(&b, 2) {
                Ok(d) => prop_assert!(d.iter().all(|d| d.rkeys().len() == 2)),
                Err(e) => prop_assert!(is_invalid(&e), "{}", e),
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any generation and pairs: the window message gives them back exactly; every strict
        /// prefix, and any other count, is refused, typed.
        #[test]
        fn window_messages_round_trip_exactly(
            generation in any::<u32>(),
            pairs in proptest::collection::btree_map(any::<u32>(), any::<u32>(), 0..40),
            count in prop_oneof![0u32..48, Just(u32::MAX), any::<u32>()],
        ) {
            let pairs: Vec<(u32, u32)> = pairs.into_iter().collect();
            let b = Hello::encode_renamed(generation, &pairs).unwrap();
            prop_assert_eq!(Hello::decode_renamed(&b).unwrap(), (generation, pairs.clone()));
            for cut in 0..b.len() {
                prop_assert!(is_invalid(&Hello::decode_renamed(&b[..cut]).unwrap_err()));
            }
            let mut other = b.clone();
            other[10..14].copy_from_slice(&count.to_le_bytes());
            match Hello::decode_renamed(&other) {
                Ok(got) => {
                    prop_assert_eq!(count as usize, pairs.len());
                    prop_assert_eq!(got, (generation, pairs));
                }
                Err(e) => {
                    prop_assert_ne!(count as usize, pairs.len());
                    prop_assert!(is_invalid(&e));
                }
            }
        }

        /// Any descriptors with one rkey per device: the descriptor message gives them back
        /// exactly, for that device count only; every strict prefix is refused, typed.
        #[test]
        fn descriptor_messages_round_trip_exactly(
            devices in 1u8..=16, other in 0u8..=17,
            list in proptest::collection::vec((any::<u32>(), 1u64..1 << 40, any::<u32>()), 0..5),
        ) {
            let list: Vec<_> = list
                .into_iter()
                .map(|(a, l, k)| {
                    let keys = vec![k; devices as usize];
                    MemoryDescriptor::new(u64::from(a), l, DescribedKind::Device, &keys).unwrap()
                })
                .collect();
            let b = Hello::encode_descriptors(&list).unwrap();
            prop_assert_eq!(Hello::decode_descriptors(&b, devices).unwrap(), list.clone());
            match Hello::decode_descriptors(&b, other) {
                Ok(got) => {
                    prop_assert!(other == devices || list.is_empty());
                    prop_assert_eq!(got, list);
                }
                Err(e) => prop_assert!(other != devices && is_invalid(&e)),
            }
            for cut in 0..b.len() {
                prop_assert!(is_invalid(&Hello::decode_descriptors(&b[..cut], devices).unwrap_err()));
            }
        }

        /// Any sound greeting's fields come back exactly with the challenge; every strict
        /// prefix is refused, typed.
        #[test]
        fn greetings_round_trip_exactly(
            group in any::<[u8; 16]>(), rails in 1u8..=16, rail in any::<u8>(),
            devices in 1u8..=16, device in any::<u8>(), credits in 4u16..=4096,
            max_message in 4096u32.., back in any::<u32>(),
        ) {
            let h = Hello {
                group,
                rail: rail % rails,
                rails,
                back,
                device: device % devices,
                devices,
                credits,
                max_message,
                descriptors: Vec::new(),
            };
            let c = challenge();
            let g = h.greeting(&c);
            prop_assert_eq!(Hello::from_greeting(&g).unwrap(), (c, h));
            for cut in 0..g.len() {
                prop_assert!(is_invalid(&Hello::from_greeting(&g[..cut]).unwrap_err()));
            }
        }
    }
}
