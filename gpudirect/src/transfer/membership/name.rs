//! Checked names: a segment's name, a node's identity (random per engine), a host's identity, a
//! rail's `host:port` and a local socket path. Each has its rule, and everything read from a
//! store is made of them: a store is outside this process and its bytes are untrusted.

use crate::error::{Error, Result};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// The longest segment name, in bytes.
pub const MAX_NAME: usize = 128;
/// The longest host identity, in bytes.
const MAX_HOST: usize = 64;
/// The longest rail address (a DNS name of 253 bytes, `:`, a port).
const MAX_ADDR: usize = 261;
/// The longest local socket path: `sun_path` less its NUL.
pub(super) const MAX_SOCKET_PATH: usize = 107;

/// Whether `s` is 1 to `max` bytes of ASCII letters, digits, `.`, `_` and `-`, starting with a
/// letter or a digit.
fn plain(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.as_bytes()[0].is_ascii_alphanumeric()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// A segment's name: what a node publishes itself under and what peers connect to
/// ([`Engine::connect_name`](crate::transfer::Engine::connect_name)). 1 to [`MAX_NAME`] bytes of
/// ASCII letters, digits, `.`, `_` and `-`, starting with a letter or a digit (so it is one
/// path segment of a store's key).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SegmentName(String);

impl SegmentName {
    /// `name`, checked.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the rule.
    pub fn new(name: impl Into<String>) -> Result<SegmentName> {
        let name = name.into();
        if !plain(&name, MAX_NAME) {
            return Err(Error::invalid(
                "segment name",
                format!("{name:?}"),
                "1 to 128 bytes of ASCII letters, digits, '.', '_' and '-', starting with a \
                 letter or a digit",
            ));
        }
        Ok(SegmentName(name))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SegmentName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for SegmentName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl std::str::FromStr for SegmentName {
    type Err = Error;
    fn from_str(s: &str) -> Result<SegmentName> {
        SegmentName::new(s)
    }
}

impl AsRef<str> for SegmentName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// A node's identity: 128 random bits drawn when an engine first publishes or connects by name,
/// so a process that restarts under the same segment name is another node (its peers' endpoints
/// to the old one end).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(u128);

impl NodeId {
    /// 128 bits from the kernel's random source.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `getrandom`.
    #[doc(alias = "getrandom")]
    pub fn random() -> Result<NodeId> {
        let mut b = [0u8; 16];
        let mut got = 0;
        while got < b.len() {
            // SAFETY: the pointer and length are those of `b`'s unfilled tail.
            let n = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast(), b.len() - got, 0) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return Err(Error::Os {
                    call: "getrandom",
                    source: e,
                });
            }
            got += n as usize;
        }
        Ok(NodeId(u128::from_le_bytes(b)))
    }

    /// The id from its 32 lowercase hexadecimal digits.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for anything else.
    pub fn parse(s: &str) -> Result<NodeId> {
        if s.len() != 32 || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(Error::invalid(
                "node id",
                format!("{s:?}"),
                "32 lowercase hexadecimal digits",
            ));
        }
        u128::from_str_radix(s, 16)
            .map(NodeId)
            .map_err(|e| Error::invalid("node id", s, e.to_string()))
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NodeId({self})")
    }
}

/// A host's identity: records with the same one are on the same kernel, where an intra-node
/// endpoint (CUDA IPC over the record's local socket) can be made. 1 to 64 bytes of ASCII
/// letters, digits, `.`, `_` and `-`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct HostId(String);

impl HostId {
    /// `id`, checked.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the rule.
    pub fn new(id: impl Into<String>) -> Result<HostId> {
        let id = id.into();
        if !plain(&id, MAX_HOST) {
            return Err(Error::invalid(
                "host id",
                format!("{id:?}"),
                "1 to 64 bytes of ASCII letters, digits, '.', '_' and '-', starting with a letter \
                 or a digit",
            ));
        }
        Ok(HostId(id))
    }

    /// This kernel's boot id (`/proc/sys/kernel/random/boot_id`: one per boot, shared by every
    /// process and namespace of the kernel), else `/etc/machine-id`.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when neither can be read; [`Error::InvalidArgument`] when what was read
    /// breaks the rule.
    pub fn this_host() -> Result<HostId> {
        let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string());
        let id = read("/proc/sys/kernel/random/boot_id")
            .or_else(|_| read("/etc/machine-id"))
            .map_err(|source| Error::Os {
                call: "open",
                source,
            })?;
        HostId::new(id)
    }

    /// The id.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for HostId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Check a rail's address: `host:port` with a port from 1 to 65535 and a host that is an IPv4
/// address, a bracketed IPv6 address or a DNS name (labels of letters, digits and `-`).
///
/// # Errors
///
/// [`Error::InvalidArgument`] naming the rule.
pub(super) fn check_rail_addr(addr: &str) -> Result<()> {
    let bad = || {
        Error::invalid(
            "rail address",
            format!("{addr:?}"),
            "host:port with an IPv4 address, [IPv6 address] or DNS name and a port from 1 to \
             65535",
        )
    };
    if addr.len() > MAX_ADDR {
        return Err(bad());
    }
    if let Ok(sa) = addr.parse::<SocketAddr>() {
        return if sa.port() == 0 { Err(bad()) } else { Ok(()) };
    }
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    let port_ok = !port.is_empty()
        && port.len() <= 5
        && port.bytes().all(|b| b.is_ascii_digit())
        && port.parse::<u16>().is_ok_and(|p| p > 0);
    let label = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    };
    // A name of digits and dots only is a malformed IPv4 address, not a name.
    let numeric = host.bytes().all(|b| b.is_ascii_digit() || b == b'.');
    if !port_ok || host.is_empty() || host.len() > 253 || numeric || !host.split('.').all(label) {
        return Err(bad());
    }
    Ok(())
}

/// Check a local socket path: absolute, 1 to 107 bytes, without NUL or line breaks.
///
/// # Errors
///
/// [`Error::InvalidArgument`] naming the rule.
pub(super) fn check_socket_path(p: &Path) -> Result<()> {
    let s = p.to_str().unwrap_or("");
    if s.is_empty()
        || s.len() > MAX_SOCKET_PATH
        || !s.starts_with('/')
        || s.bytes().any(|b| b == 0 || b == b'\n' || b == b'\r')
    {
        return Err(Error::invalid(
            "local socket path",
            format!("{p:?}"),
            "an absolute UTF-8 path of 1 to 107 bytes without NUL or line breaks",
        ));
    }
    Ok(())
}

/// A checked local socket path.
pub(super) fn socket_path(s: &str) -> Result<PathBuf> {
    let p = PathBuf::from(s);
    check_socket_path(&p)?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_names_follow_the_rule() {
        for ok in ["a", "decode-3", "prefill.pool_1", &"x".repeat(128), "0"] {
            assert!(SegmentName::new(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "-a",
            ".a",
            "a/b",
            "a b",
            "é",
            "a\n",
            &"x".repeat(129),
            "a:b",
            "..",
        ] {
            assert!(
                matches!(SegmentName::new(bad), Err(Error::InvalidArgument { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn node_ids_round_trip_and_differ() {
        let a = NodeId::random().unwrap();
        let b = NodeId::random().unwrap();
        assert_ne!(a, b);
        assert_eq!(NodeId::parse(&a.to_string()).unwrap(), a);
        for bad in ["", "0", &"A".repeat(32), &"0".repeat(33), &"g".repeat(32)] {
            assert!(NodeId::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn rail_addresses_parse() {
        for ok in [
            "10.0.0.3:7400",
            "[fe80::1]:1",
            "node-1.rack2.example:65535",
            "localhost:80",
        ] {
            assert!(check_rail_addr(ok).is_ok(), "{ok}");
        }
        for bad in [
            "10.0.0.3",
            "10.0.0.3:0",
            "10.0.0.3:65536",
            "10.0.0.300:1",
            ":80",
            "a b:80",
            "-a:80",
            "a..b:80",
            "fe80::1:80",
            "host:+80",
            "host:080000",
        ] {
            assert!(check_rail_addr(bad).is_err(), "{bad:?}");
        }
        assert!(check_rail_addr(&format!("{}:1", "a".repeat(300))).is_err());
    }

    #[test]
    fn socket_paths_are_checked() {
        assert!(socket_path("/run/x.sock").is_ok());
        for bad in ["", "rel/x", "/a\nb", &format!("/{}", "a".repeat(107))] {
            assert!(socket_path(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn this_host_has_an_id() {
        let h = HostId::this_host().unwrap();
        assert_eq!(h, HostId::this_host().unwrap());
    }

    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any id reads back from its 32 lowercase hex digits exactly; any other string is
        /// refused, typed (a sign, upper case, another length).
        #[test]
        fn node_ids_are_32_lowercase_hex_digits_exactly(
            x in any::<u128>(), s in "[0-9a-fA-F+ -]{30,34}",
        ) {
            let id = NodeId::parse(&format!("{x:032x}")).unwrap();
            prop_assert_eq!(id.0, x);
            prop_assert_eq!(NodeId::parse(&id.to_string()).unwrap(), id);
            let ok = s.len() == 32 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
            match NodeId::parse(&s) {
                Ok(n) => prop_assert!(ok && n.0 == u128::from_str_radix(&s, 16).unwrap()),
                Err(e) => prop_assert!(!ok && matches!(e, Error::InvalidArgument { .. }), "{}", e),
            }
        }

        /// Rail addresses: an IPv4 or IPv6 address with a port is taken exactly when the port
        /// is not 0; any string at all is taken or refused, typed, never more than 261 bytes.
        #[test]
        fn rail_addresses_are_checked(
            v4 in any::<[u8; 4]>(), v6 in any::<[u16; 8]>(), port in any::<u16>(),
            s in "[a-z0-9.:\\[\\]+-]{0,24}", long in 255usize..300,
        ) {
            let a4 = format!("{}:{port}", std::net::Ipv4Addr::from(v4));
            let a6 = format!("[{}]:{port}", std::net::Ipv6Addr::from(v6));
            prop_assert_eq!(check_rail_addr(&a4).is_ok(), port > 0);
            prop_assert_eq!(check_rail_addr(&a6).is_ok(), port > 0);
            if let Err(e) = check_rail_addr(&s) {
                prop_assert!(matches!(e, Error::InvalidArgument { .. }), "{}", e);
            }
            let name = format!("{}:1", "a".repeat(long));
            prop_assert_eq!(check_rail_addr(&name).is_ok(), name.len() <= MAX_ADDR && long <= 63);
        }
    }
}
