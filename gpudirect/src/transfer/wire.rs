//! The first message of each rail's connection (read by the peer with an RDMA read once the
//! connection's exchange has given its address): who is connecting, which rail this is, the
//! receive credits for notifications, and the descriptors the sender publishes.

use super::descriptor::{MAX_RAILS, MemoryDescriptor, decode_list, encode_list};
use crate::error::{Error, Result};

const MAGIC: [u8; 4] = *b"GDXH";
const VERSION: u16 = 1;
const FIXED: usize = 4 + 2 + 1 + 1 + 1 + 1 + 2 + 4 + 8;

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

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hello {
    /// The connecting endpoint (the same on every rail of it).
    pub(crate) nonce: u64,
    pub(crate) rail: u8,
    pub(crate) rails: u8,
    /// The sender's engine device for this rail, and how many it has (its descriptors' rkeys).
    pub(crate) device: u8,
    pub(crate) devices: u8,
    /// Receives the sender posts for notifications (rail 0).
    pub(crate) credits: u16,
    pub(crate) max_message: u32,
    pub(crate) descriptors: Vec<MemoryDescriptor>,
}

impl Hello {
    pub(crate) fn encode(&self) -> Result<Vec<u8>> {
        let list = encode_list(&self.descriptors)?;
        let mut b = Vec::with_capacity(FIXED + list.len());
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&[self.rail, self.rails, self.device, self.devices]);
        b.extend_from_slice(&self.credits.to_le_bytes());
        b.extend_from_slice(&self.max_message.to_le_bytes());
        b.extend_from_slice(&self.nonce.to_le_bytes());
        b.extend_from_slice(&list);
        Ok(b)
    }

    /// Decode a peer's first message; every field is checked.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the field.
    pub(crate) fn decode(b: &[u8]) -> Result<Hello> {
        let bad = |arg: &'static str, v: String, rule: &str| Err(Error::invalid(arg, v, rule));
        let h = header(b, FIXED, MAGIC, VERSION)?;
        let (rail, rails, device, devices) = (h[6], h[7], h[8], h[9]);
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
        let credits = u16::from_le_bytes([h[10], h[11]]);
        if !(4..=4096).contains(&credits) {
            return bad("hello.credits", credits.to_string(), "4 to 4096 receives");
        }
        let max_message = u32::from_le_bytes(h[12..16].try_into().expect("4 bytes"));
        if max_message < 4096 {
            return bad(
                "hello.max_message",
                max_message.to_string(),
                "at least 4 KiB",
            );
        }
        let nonce = u64::from_le_bytes(h[16..24].try_into().expect("8 bytes"));
        let descriptors = decode_list(&b[FIXED..])?;
        if let Some(d) = descriptors
            .iter()
            .find(|d| d.rkeys().len() != devices as usize)
        {
            return bad(
                "hello.descriptors",
                format!("{d:?}"),
                "one rkey per device of the sender",
            );
        }
        Ok(Hello {
            nonce,
            rail,
            rails,
            device,
            devices,
            credits,
            max_message,
            descriptors,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proptest_support::is_invalid;
    use crate::transfer::descriptor::DescribedKind;
    use proptest::prelude::*;

    fn hello(n: usize) -> Hello {
        Hello {
            nonce: 0x1234,
            rail: 1,
            rails: 2,
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

    #[test]
    fn a_first_message_round_trips() {
        for n in [0, 1, 7] {
            let h = hello(n);
            assert_eq!(Hello::decode(&h.encode().unwrap()).unwrap(), h);
        }
        let mut h = hello(1);
        h.devices = 3;
        let e = Hello::decode(&h.encode().unwrap()).unwrap_err();
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
    }

    proptest! {
        /// Any corruption of a valid first message: decoded with every field in range, or a
        /// typed refusal.
        #[test]
        fn corrupted_first_messages_are_refused_or_sound(
            n in 0usize..4, at in any::<usize>(), byte in any::<u8>(), cut in any::<usize>(),
        ) {
            let mut b = hello(n).encode().unwrap();
            let i = at % b.len();
            b[i] = byte;
            b.truncate(b.len() - cut % 3);
            match Hello::decode(&b) {
                Ok(h) => {
                    prop_assert!(h.rail < h.rails && h.device < h.devices);
                    prop_assert!((4..=4096).contains(&h.credits));
                    prop_assert!(h.descriptors.iter().all(|d| d.rkeys().len() == h.devices as usize));
                }
                Err(e) => prop_assert!(is_invalid(&e), "{}", e),
            }
        }
    }
}
