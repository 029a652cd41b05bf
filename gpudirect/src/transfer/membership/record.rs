//! A member's record: what a node publishes under its segment name (its identity, its rails'
//! addresses, its local socket, its lease's time to live), in a small text format with a
//! version, read back strictly. Never rkeys or memory descriptors: those travel per peer over
//! the endpoint's own connection.

use super::name::{HostId, NodeId, SegmentName, check_rail_addr, check_socket_path, socket_path};
use crate::error::{Error, Result};
use crate::transfer::descriptor::MAX_RAILS;
use std::path::PathBuf;
use std::time::Duration;

/// The record format this library writes and reads.
pub const RECORD_VERSION: u32 = 1;
/// The largest record, in bytes.
pub const MAX_RECORD: usize = 4096;
/// The first line's start; the version follows.
const MAGIC: &str = "gpudirect-member/";
/// The shortest and longest lease time to live a record may carry.
pub(super) const MIN_TTL: Duration = Duration::from_secs(1);
pub(super) const MAX_TTL: Duration = Duration::from_secs(3600);

/// What a member publishes under its segment name.
///
/// As bytes ([`to_bytes`](Self::to_bytes)), a text of `key=value` lines after a first line
/// `gpudirect-member/1`: `name`, `node`, `host` and `ttl_ms` once each, `rail` once per rail in
/// rail order, `local` at most once. [`from_bytes`](Self::from_bytes) refuses anything else:
/// another version ([`Error::UnknownVersion`]), an unknown or repeated key, a field that breaks
/// its rule, more than [`MAX_RECORD`] bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberRecord {
    /// The segment name.
    pub name: SegmentName,
    /// The engine's identity (random per engine).
    pub node: NodeId,
    /// The host's identity ([`HostId::this_host`]): a peer on the same host may connect
    /// through [`local`](Self::local).
    pub host: HostId,
    /// The rails' `host:port` addresses, in rail order (at most 16; empty for an engine
    /// without rails).
    pub rails: Vec<String>,
    /// The Unix socket where the engine listens for intra-node endpoints, if it does.
    pub local: Option<PathBuf>,
    /// The lease's time to live: the record is gone this long after its node stopped renewing
    /// it (1 s to 1 h).
    pub ttl: Duration,
}

impl MemberRecord {
    /// Check every field's rule.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the field.
    pub fn check(&self) -> Result<()> {
        if self.rails.len() > MAX_RAILS {
            return Err(Error::invalid(
                "record.rails",
                self.rails.len(),
                "at most 16 rails",
            ));
        }
        for r in &self.rails {
            check_rail_addr(r)?;
        }
        if let Some(p) = &self.local {
            check_socket_path(p)?;
        }
        if self.rails.is_empty() && self.local.is_none() {
            return Err(Error::invalid(
                "record",
                self.name.as_str(),
                "a member has rails or a local socket (or both)",
            ));
        }
        if !(MIN_TTL..=MAX_TTL).contains(&self.ttl)
            || !self.ttl.subsec_nanos().is_multiple_of(1_000_000)
        {
            return Err(Error::invalid(
                "record.ttl",
                format!("{:?}", self.ttl),
                "1 s to 1 h, in whole milliseconds",
            ));
        }
        Ok(())
    }

    /// The record as bytes (see the type's docs).
    ///
    /// # Errors
    ///
    /// As [`check`](Self::check); [`Error::InvalidArgument`] past [`MAX_RECORD`] bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        self.check()?;
        let mut s = format!(
            "{MAGIC}{RECORD_VERSION}\nname={}\nnode={}\nhost={}\nttl_ms={}\n",
            self.name,
            self.node,
            self.host,
            self.ttl.as_millis()
        );
        for r in &self.rails {
            s.push_str("rail=");
            s.push_str(r);
            s.push('\n');
        }
        if let Some(p) = &self.local {
            s.push_str("local=");
            s.push_str(p.to_str().expect("checked: UTF-8"));
            s.push('\n');
        }
        if s.len() > MAX_RECORD {
            return Err(Error::invalid("record", s.len(), "at most 4096 bytes"));
        }
        Ok(s.into_bytes())
    }

    /// A record read from a store, checked field by field.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownVersion`] for another format version; [`Error::InvalidArgument`] for
    /// anything else that is not a valid record.
    pub fn from_bytes(b: &[u8]) -> Result<MemberRecord> {
        let bad = |why: &str| Error::invalid("record", "bytes from the store", why);
        if b.len() > MAX_RECORD {
            return Err(bad("more than 4096 bytes"));
        }
        let s = std::str::from_utf8(b).map_err(|_| bad("not UTF-8"))?;
        let mut lines = s.strip_suffix('\n').unwrap_or(s).split('\n');
        let first = lines.next().unwrap_or("");
        let v = first
            .strip_prefix(MAGIC)
            .ok_or_else(|| bad("no `gpudirect-member/` first line"))?;
        if v.is_empty() || v.len() > 9 || !v.bytes().all(|c| c.is_ascii_digit()) {
            return Err(bad("the version is not a number"));
        }
        let v: u32 = v.parse().map_err(|_| bad("the version is not a number"))?;
        if v != RECORD_VERSION {
            return Err(Error::UnknownVersion {
                what: "member record",
                found: v,
                oldest: RECORD_VERSION,
                newest: RECORD_VERSION,
            });
        }
        let (mut name, mut node, mut host, mut ttl, mut local) = (None, None, None, None, None);
        let mut rails = Vec::new();
        for line in lines {
            let (k, val) = line
                .split_once('=')
                .ok_or_else(|| bad("a line is not key=value"))?;
            let once = |slot: bool| {
                if slot {
                    Err(bad("a key is repeated"))
                } else {
                    Ok(())
                }
            };
            match k {
                "name" => {
                    once(name.is_some())?;
                    name = Some(SegmentName::new(val)?);
                }
                "node" => {
                    once(node.is_some())?;
                    node = Some(NodeId::parse(val)?);
                }
                "host" => {
                    once(host.is_some())?;
                    host = Some(HostId::new(val)?);
                }
                "ttl_ms" => {
                    once(ttl.is_some())?;
                    if val.is_empty() || val.len() > 7 || !val.bytes().all(|c| c.is_ascii_digit()) {
                        return Err(bad("ttl_ms is not a number of at most 7 digits"));
                    }
                    ttl = Some(Duration::from_millis(
                        val.parse().map_err(|_| bad("ttl_ms"))?,
                    ));
                }
                "rail" => {
                    if rails.len() == MAX_RAILS {
                        return Err(bad("more than 16 rails"));
                    }
                    check_rail_addr(val)?;
                    rails.push(val.to_string());
                }
                "local" => {
                    once(local.is_some())?;
                    local = Some(socket_path(val)?);
                }
                _ => return Err(bad("an unknown key")),
            }
        }
        let r = MemberRecord {
            name: name.ok_or_else(|| bad("no name"))?,
            node: node.ok_or_else(|| bad("no node"))?,
            host: host.ok_or_else(|| bad("no host"))?,
            rails,
            local,
            ttl: ttl.ok_or_else(|| bad("no ttl_ms"))?,
        };
        r.check()?;
        Ok(r)
    }

    /// A record read under the key of segment `name`: as [`from_bytes`](Self::from_bytes), and
    /// the record must name that segment.
    ///
    /// # Errors
    ///
    /// As [`from_bytes`](Self::from_bytes); [`Error::InvalidArgument`] when the names differ.
    pub(super) fn from_bytes_at(name: &str, b: &[u8]) -> Result<MemberRecord> {
        let r = MemberRecord::from_bytes(b)?;
        if r.name.as_str() != name {
            return Err(Error::invalid(
                "record.name",
                r.name.as_str(),
                format!("the record under {name:?} names another segment"),
            ));
        }
        Ok(r)
    }
}

#[cfg(test)]
pub(super) fn sample(name: &str) -> MemberRecord {
    MemberRecord {
        name: SegmentName::new(name).unwrap(),
        node: NodeId::random().unwrap(),
        host: HostId::new("host-a").unwrap(),
        rails: vec!["10.0.0.1:7400".into(), "10.0.1.1:7400".into()],
        local: Some("/tmp/x.sock".into()),
        ttl: Duration::from_secs(5),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips() {
        let r = sample("decode-3");
        let b = r.to_bytes().unwrap();
        assert_eq!(MemberRecord::from_bytes(&b).unwrap(), r);
        assert!(MemberRecord::from_bytes_at("decode-4", &b).is_err());
        let text = String::from_utf8(b).unwrap();
        assert!(
            text.starts_with("gpudirect-member/1\nname=decode-3\n"),
            "{text}"
        );
    }

    #[test]
    fn another_version_is_refused_typed() {
        let b = sample("a").to_bytes().unwrap();
        let s = String::from_utf8(b)
            .unwrap()
            .replace("member/1", "member/2");
        assert!(matches!(
            MemberRecord::from_bytes(s.as_bytes()),
            Err(Error::UnknownVersion { found: 2, .. })
        ));
    }

    #[test]
    fn anything_off_is_refused() {
        let good = String::from_utf8(sample("a").to_bytes().unwrap()).unwrap();
        let node = good.lines().nth(2).unwrap().to_string();
        let cases = [
            String::new(),
            "gpudirect-member/".into(),
            "gpudirect-member/x\n".into(),
            "gpudirect-member/99999999999\n".into(),
            good.replace("name=a", "name=a/b"),
            good.replace("ttl_ms=5000", "ttl_ms=10"),
            good.replace("ttl_ms=5000", "ttl_ms=99999999"),
            good.replace("ttl_ms=5000", "ttl_ms=-1"),
            good.replace("rail=10.0.0.1:7400", "rail=10.0.0.1"),
            good.replace("local=/tmp/x.sock", "local=x.sock"),
            format!("{good}{node}\n"),
            format!("{good}rkey=12\n"),
            format!("{good}junk\n"),
            good.replace("host=host-a\n", ""),
            good.replace("\n", "\r\n"),
            format!("{good}{}", "rail=10.0.0.9:1\n".repeat(16)),
            format!("{good}{}", "x".repeat(5000)),
        ];
        for c in cases {
            assert!(MemberRecord::from_bytes(c.as_bytes()).is_err(), "{c:?}");
        }
        assert!(MemberRecord::from_bytes(&[0xff, 0xfe]).is_err());
    }

    #[test]
    fn writing_checks_too() {
        let mut r = sample("a");
        r.rails.clear();
        r.local = None;
        assert!(r.to_bytes().is_err());
        let mut r = sample("a");
        r.ttl = Duration::from_millis(1500) + Duration::from_nanos(1);
        assert!(r.to_bytes().is_err());
        let mut r = sample("a");
        r.rails = vec!["10.0.0.1:1".into(); 17];
        assert!(r.to_bytes().is_err());
    }

    use proptest::prelude::*;

    /// Sound records of any fields.
    fn record() -> impl Strategy<Value = MemberRecord> {
        (
            "[a-z0-9][a-z0-9._-]{0,20}",
            any::<u128>(),
            "[A-Za-z0-9][A-Za-z0-9._-]{0,30}",
            proptest::collection::vec((any::<[u8; 4]>(), 1u16..), 0..=MAX_RAILS),
            proptest::option::of("/[a-z0-9/._=-]{0,40}"),
            1_000u64..=3_600_000,
        )
            .prop_filter_map(
                "rails or a local socket",
                |(name, node, host, rails, local, ttl)| {
                    let r = MemberRecord {
                        name: SegmentName::new(name).ok()?,
                        node: NodeId::parse(&format!("{node:032x}")).ok()?,
                        host: HostId::new(host).ok()?,
                        rails: rails
                            .iter()
                            .map(|(ip, port)| format!("{}:{port}", std::net::Ipv4Addr::from(*ip)))
                            .collect(),
                        local: local.map(PathBuf::from),
                        ttl: Duration::from_millis(ttl),
                    };
                    r.check().ok().map(|()| r)
                },
            )
    }

    /// A store's answer: a sound record, or a typed refusal.
    fn sound_or_typed(r: Result<MemberRecord>) -> std::result::Result<(), TestCaseError> {
        match r {
            Ok(got) => {
                prop_assert!(got.check().is_ok());
                let again = MemberRecord::from_bytes(&got.to_bytes().unwrap()).unwrap();
                prop_assert_eq!(again, got);
            }
            Err(e) => prop_assert!(
                matches!(
                    e,
                    Error::InvalidArgument { .. } | Error::UnknownVersion { .. }
                ),
                "{}",
                e
            ),
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any sound record comes back exactly, under its own name only.
        #[test]
        fn records_round_trip_exactly(r in record(), other in "[a-z0-9]{1,21}") {
            let b = r.to_bytes().unwrap();
            prop_assert_eq!(MemberRecord::from_bytes(&b).unwrap(), r.clone());
            prop_assert_eq!(MemberRecord::from_bytes_at(r.name.as_str(), &b).unwrap(), r.clone());
            let at = MemberRecord::from_bytes_at(&other, &b);
            prop_assert_eq!(at.is_ok(), other == r.name.as_str());
        }

        /// A cut record: refused, or (the format has no end mark: a store's value arrives whole)
        /// a sound record; one that writes the same bytes only when the cut took the last line
        /// break alone. (Bytes, not equality: paths compare without a trailing `/`.)
        #[test]
        fn cut_records_are_refused_or_sound(r in record(), cut in any::<usize>()) {
            let b = r.to_bytes().unwrap();
            let c = cut % b.len();
            let got = MemberRecord::from_bytes(&b[..c]);
            if got.as_ref().is_ok_and(|g| g.to_bytes().is_ok_and(|x| x == b)) {
                prop_assert_eq!(c, b.len() - 1);
            }
            sound_or_typed(got)?;
        }

        /// One byte of a record changed, or any bytes at all: a sound record or a typed refusal.
        #[test]
        fn changed_records_are_refused_or_sound(
            r in record(), at in any::<usize>(), byte in any::<u8>(),
            junk in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let mut b = r.to_bytes().unwrap();
            let i = at % b.len();
            b[i] = byte;
            sound_or_typed(MemberRecord::from_bytes(&b))?;
            let mut tail = r.to_bytes().unwrap();
            tail.extend_from_slice(&junk);
            sound_or_typed(MemberRecord::from_bytes(&tail))?;
            sound_or_typed(MemberRecord::from_bytes(&junk))?;
        }
    }
}
