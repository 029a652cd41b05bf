//! The messages that meet an intra-node endpoint, each way: the greeting (magic, version, the
//! authentication challenge), then the first message (magic, version, the sender's pid, the
//! descriptors it publishes).

use crate::error::{Error, Result};
use crate::transfer::auth::Challenge;
use crate::transfer::descriptor::{MemoryDescriptor, decode_list, encode_list};
use crate::transfer::wire::header;

const MAGIC: [u8; 4] = *b"GDXL";

/// Version 2: exported file descriptors (VMM allocations', pools') follow the first message.
const VERSION: u16 = 2;

/// Magic, version, flags (u16, 0), pid (u32).
const FIXED: usize = 4 + 2 + 2 + 4;

const GREETING_MAGIC: [u8; 4] = *b"GDXC";
const GREETING_VERSION: u16 = 1;
/// Bytes of a greeting: magic, version, challenge.
pub(crate) const GREETING_LEN: usize = 4 + 2 + Challenge::LEN;

/// The greeting of challenge `c`.
pub(super) fn greeting(c: &Challenge) -> Vec<u8> {
    let mut b = Vec::with_capacity(GREETING_LEN);
    b.extend_from_slice(&GREETING_MAGIC);
    b.extend_from_slice(&GREETING_VERSION.to_le_bytes());
    c.put(&mut b);
    b
}

/// The challenge of a peer's greeting.
///
/// # Errors
///
/// [`Error::InvalidArgument`] naming the field (`hello` for another length).
pub(super) fn from_greeting(b: &[u8]) -> Result<Challenge> {
    let h = header(b, GREETING_LEN, GREETING_MAGIC, GREETING_VERSION)?;
    if b.len() != GREETING_LEN {
        return Err(Error::invalid(
            "hello",
            format!("{} bytes", b.len()),
            format!("a greeting is {GREETING_LEN} bytes"),
        ));
    }
    Challenge::take(&h[6..])
}

/// The first message of an intra-node endpoint, each way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LocalHello {
    /// The sender's process id (as it sees itself). Only reported: what the library decides by
    /// (imports, the same-process refusal) uses the pid `SO_PEERCRED` gives.
    pub(crate) pid: u32,
    pub(crate) descriptors: Vec<MemoryDescriptor>,
}

impl LocalHello {
    pub(crate) fn encode(&self) -> Result<Vec<u8>> {
        let list = encode_list(&self.descriptors)?;
        let mut b = Vec::with_capacity(FIXED + list.len());
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&0u16.to_le_bytes());
        b.extend_from_slice(&self.pid.to_le_bytes());
        b.extend_from_slice(&list);
        Ok(b)
    }

    /// Decode a peer's first message; every field is checked.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the field.
    pub(crate) fn decode(b: &[u8]) -> Result<LocalHello> {
        let bad = |arg: &'static str, v: String, rule: &str| Err(Error::invalid(arg, v, rule));
        let h = header(b, FIXED, MAGIC, VERSION)?;
        let flags = u16::from_le_bytes([h[6], h[7]]);
        if flags != 0 {
            return bad("hello.flags", flags.to_string(), "no flags are defined");
        }
        let pid = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes"));
        if pid == 0 {
            return bad("hello.pid", "0".into(), "a process id is not 0");
        }
        let descriptors = decode_list(&b[FIXED..])?;
        Ok(LocalHello { pid, descriptors })
    }
}

#[cfg(test)]
use crate::transfer::descriptor::{DescribedKind, IpcPart};

/// `n` descriptors of GPU memory with made-up CUDA IPC handles (tests of first messages).
#[cfg(test)]
pub(super) fn descs(n: usize) -> Vec<MemoryDescriptor> {
    (0..n)
        .map(|i| {
            let part = IpcPart::new([i as u8; 64], 1 << 20, 4096, [7; 16]);
            MemoryDescriptor::with_ipc(
                0x7000_0000 + i as u64 * 4096,
                4096,
                DescribedKind::Device,
                &[],
                part,
            )
            .unwrap()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proptest_support::is_invalid;
    use proptest::prelude::*;

    #[test]
    fn a_first_message_round_trips_and_is_checked() {
        for n in [0, 1, 5] {
            let h = LocalHello {
                pid: 4242,
                descriptors: descs(n),
            };
            assert_eq!(LocalHello::decode(&h.encode().unwrap()).unwrap(), h);
        }
        let good = LocalHello {
            pid: 1,
            descriptors: descs(1),
        }
        .encode()
        .unwrap();
        for (at, byte, arg) in [
            (0, b'X', "hello.magic"),
            (4, 9, "hello.version"),
            (6, 1, "hello.flags"),
        ] {
            let mut b = good.clone();
            b[at] = byte;
            let e = LocalHello::decode(&b).unwrap_err();
            assert!(
                matches!(&e, Error::InvalidArgument { arg: a, .. } if *a == arg),
                "{e}"
            );
        }
        let mut b = good.clone();
        b[8..12].copy_from_slice(&0u32.to_le_bytes());
        assert!(LocalHello::decode(&b).is_err());
        assert!(LocalHello::decode(&good[..good.len() - 1]).is_err());
        assert!(LocalHello::decode(&good[..3]).is_err());
    }

    #[test]
    fn greetings_round_trip_and_garbage_is_refused_typed() {
        use crate::transfer::auth::Role;
        let c = Challenge::new(Role::Dialer, false).unwrap();
        let g = greeting(&c);
        assert_eq!(from_greeting(&g).unwrap(), c);
        let mut long = g.clone();
        long.push(0);
        for b in [
            &g[..GREETING_LEN - 1],
            &long[..],
            b"GDXL",
            b"definitely not a greeting at all!!!!!!!!!",
        ] {
            assert!(is_invalid(&from_greeting(b).unwrap_err()));
        }
    }

    proptest! {
        /// Any bytes as a greeting: a challenge or a typed refusal.
        #[test]
        fn garbage_greetings_are_refused_typed(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Err(e) = from_greeting(&b) {
                prop_assert!(is_invalid(&e), "{}", e);
            }
        }

        /// Any corruption of a valid first message: decoded with every field sound, or refused
        /// with a typed error.
        #[test]
        fn corrupted_first_messages_are_refused_or_sound(
            n in 0usize..4, at in any::<usize>(), byte in any::<u8>(), cut in any::<usize>(),
        ) {
            let mut b = LocalHello { pid: 99, descriptors: descs(n) }.encode().unwrap();
            let i = at % b.len();
            b[i] = byte;
            b.truncate(b.len() - cut % 3);
            match LocalHello::decode(&b) {
                Ok(h) => {
                    prop_assert!(h.pid != 0);
                    prop_assert_eq!(LocalHello::decode(&h.encode().unwrap()).unwrap(), h);
                }
                Err(e) => prop_assert!(is_invalid(&e), "{}", e),
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any pid but 0 and any descriptors: the first message gives them back exactly; every
        /// strict prefix is refused, typed, and so is any count but the true one (a huge one
        /// in front of the few bytes there are included).
        #[test]
        fn first_messages_round_trip_exactly(
            pid in 1u32.., n in 0usize..4,
            count in prop_oneof![0u32..8, Just(u32::MAX), any::<u32>()],
        ) {
            let h = LocalHello { pid, descriptors: descs(n) };
            let b = h.encode().unwrap();
            prop_assert_eq!(LocalHello::decode(&b).unwrap(), h.clone());
            for cut in 0..b.len() {
                prop_assert!(is_invalid(&LocalHello::decode(&b[..cut]).unwrap_err()));
            }
            let mut other = b.clone();
            other[12..16].copy_from_slice(&count.to_le_bytes());
            match LocalHello::decode(&other) {
                Ok(got) => prop_assert!(count as usize == n && got == h),
                Err(e) => prop_assert!(count as usize != n && is_invalid(&e), "{}", e),
            }
        }
    }
}
