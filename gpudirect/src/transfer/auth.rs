//! Who may be a peer: the key endpoints prove to each other ([`AuthKey`]), how an endpoint was
//! authenticated ([`Authentication`]), which users an intra-node peer may run as
//! ([`LocalPeers`]), and what both transports' handshakes share: the first round's challenge,
//! the transcript and its HMAC-SHA-256.
//!
//! The handshake, on each new connection and before anything is published: each side sends a
//! challenge (its role, whether it has a key, 32 random bytes) with its transport's fields;
//! with a key, each then sends `HMAC-SHA-256(key, label || role || transcript)`, the transcript
//! being both first rounds (the dialer's first) and what binds the connection as this side sees
//! it (queue pair numbers and GIDs, or pids). Each checks the other's tag in constant time. A
//! recorded handshake replayed later meets another nonce; one relayed between two honest peers
//! meets other queue pairs; a side with a key never talks on with one without.

use crate::error::{Error, Result};
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use std::io::Read;
use std::path::Path;
use zeroize::Zeroizing;

/// A shared secret that endpoints prove to each other before either publishes a descriptor
/// ([`EngineConfig::key`](super::EngineConfig::key)): every endpoint of an engine with a key
/// meets only peers holding the same key. 16 to 1,024 bytes, used whole (random bytes are
/// best: `head -c 32 /dev/urandom > key; chmod 600 key`).
///
/// `Debug` never shows it, and its bytes are overwritten when it is dropped.
#[derive(Clone)]
pub struct AuthKey(Zeroizing<Vec<u8>>);

impl AuthKey {
    /// The shortest key, in bytes.
    pub const MIN_LEN: usize = 16;
    /// The longest key, in bytes.
    pub const MAX_LEN: usize = 1024;

    /// A key of these bytes.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] (`key`) for fewer than [`MIN_LEN`](Self::MIN_LEN) or more than
    /// [`MAX_LEN`](Self::MAX_LEN) bytes.
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<AuthKey> {
        let b = Zeroizing::new(bytes.into());
        if !(Self::MIN_LEN..=Self::MAX_LEN).contains(&b.len()) {
            return Err(Error::invalid(
                "key",
                format!("{} bytes", b.len()),
                format!("a key has {} to {} bytes", Self::MIN_LEN, Self::MAX_LEN),
            ));
        }
        Ok(AuthKey(b))
    }

    /// The key in the file at `path`: all of its bytes, as they are (a trailing newline is part
    /// of the key). The file must not be readable or writable by its group or by others (mode
    /// `0600` or `0400`, as `ssh` asks of a private key): a key others can read is no secret.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `open` or `read`; [`Error::InvalidArgument`] (`key`) for a file
    /// that group or others may access, or for a length out of range.
    #[doc(alias = "open")]
    pub fn from_file(path: impl AsRef<Path>) -> Result<AuthKey> {
        use std::os::unix::fs::PermissionsExt;
        let path = path.as_ref();
        let f = std::fs::File::open(path).map_err(|source| Error::Os {
            call: "open (the key file)",
            source,
        })?;
        // The mode of the file opened (a symbolic link is followed), not of the path's.
        let meta = f.metadata().map_err(|source| Error::Os {
            call: "fstat (the key file)",
            source,
        })?;
        let mode = meta.permissions().mode();
        if mode & 0o077 != 0 {
            return Err(Error::invalid(
                "key",
                format!("{} (mode {:o})", path.display(), mode & 0o7777),
                "a key file is for its owner only: chmod 600 (or 400)",
            ));
        }
        let mut b = Zeroizing::new(Vec::with_capacity(64));
        f.take(Self::MAX_LEN as u64 + 1)
            .read_to_end(&mut b)
            .map_err(|source| Error::Os {
                call: "read (the key file)",
                source,
            })?;
        Self::from_bytes(std::mem::take(&mut *b))
    }

    /// The key in the file whose path the environment variable `var` holds (never the key
    /// itself: the environment of a process is readable by others of its user and passed to its
    /// children); `None` when `var` is unset or empty. The examples read
    /// `GPUDIRECT_TRANSFER_KEY_FILE`.
    ///
    /// # Errors
    ///
    /// As [`from_file`](Self::from_file).
    pub fn from_env(var: &str) -> Result<Option<AuthKey>> {
        match std::env::var_os(var) {
            Some(p) if !p.is_empty() => Self::from_file(p).map(Some),
            _ => Ok(None),
        }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl PartialEq for AuthKey {
    /// Compared in time that depends only on the lengths.
    fn eq(&self, other: &AuthKey) -> bool {
        self.0.len() == other.0.len()
            && self
                .0
                .iter()
                .zip(other.0.iter())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

impl Eq for AuthKey {}

impl std::fmt::Debug for AuthKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AuthKey(<redacted>)")
    }
}

/// How an endpoint's peer was authenticated ([`Endpoint::authentication`](super::Endpoint::authentication)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Authentication {
    /// Both sides proved they hold the engine's [`AuthKey`], on every rail (or on the socket),
    /// before anything was published.
    Key,
    /// No key: any process that reached the port (or, inside a node, the socket, as the
    /// [`LocalPeers`] rule admits) is a peer.
    Unauthenticated,
}

impl std::fmt::Display for Authentication {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Authentication::Key => "authenticated (shared key)",
            Authentication::Unauthenticated => "unauthenticated",
        })
    }
}

/// Which users an intra-node peer may run as ([`EngineConfig::local_peers`](super::EngineConfig::local_peers)),
/// as the kernel gives them (`SO_PEERCRED`), checked by both sides before anything else.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum LocalPeers {
    /// The user this process runs as (its effective uid). The default.
    #[default]
    SameUser,
    /// Any user who can reach the socket (file permissions are then the only guard).
    AnyUser,
    /// These uids only.
    Users(Vec<u32>),
}

impl LocalPeers {
    /// Whether a peer running as `uid` is admitted by a process running as `mine`.
    #[cfg_attr(
        not(feature = "p2p"),
        allow(dead_code, reason = "the intra-node transport checks it")
    )]
    pub(crate) fn admits(&self, uid: u32, mine: u32) -> bool {
        match self {
            LocalPeers::SameUser => uid == mine,
            LocalPeers::AnyUser => true,
            LocalPeers::Users(v) => v.contains(&uid),
        }
    }
}

/// The side of a connection: who dialed and who listened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Dialer,
    Listener,
}

impl Role {
    fn byte(self) -> u8 {
        match self {
            Role::Dialer => 1,
            Role::Listener => 2,
        }
    }

    /// The other side.
    pub(crate) fn peer(self) -> Role {
        match self {
            Role::Dialer => Role::Listener,
            Role::Listener => Role::Dialer,
        }
    }
}

/// Bytes of a nonce.
pub(crate) const NONCE_LEN: usize = 32;
/// Bytes of a tag (HMAC-SHA-256).
pub(crate) const TAG_LEN: usize = 32;

/// The first round's challenge: the sender's role, whether it has a key, 32 random bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Challenge {
    pub(crate) role: Role,
    pub(crate) keyed: bool,
    pub(crate) nonce: [u8; NONCE_LEN],
}

impl Challenge {
    /// Bytes on the wire: role, flags (bit 0: a key), nonce.
    pub(crate) const LEN: usize = 1 + 1 + NONCE_LEN;

    /// A fresh challenge (a nonce from the OS's random source).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `getrandom`.
    pub(crate) fn new(role: Role, keyed: bool) -> Result<Challenge> {
        Ok(Challenge {
            role,
            keyed,
            nonce: random()?,
        })
    }

    pub(crate) fn put(&self, b: &mut Vec<u8>) {
        b.push(self.role.byte());
        b.push(u8::from(self.keyed));
        b.extend_from_slice(&self.nonce);
    }

    /// The challenge at the start of `b`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] (`greeting.challenge`: fewer than [`LEN`](Self::LEN) bytes;
    /// `greeting.role`, `greeting.flags`).
    pub(crate) fn take(b: &[u8]) -> Result<Challenge> {
        let Some(b) = b.get(..Self::LEN) else {
            return Err(Error::invalid(
                "greeting.challenge",
                b.len(),
                format!("{} bytes", Self::LEN),
            ));
        };
        let role = match b[0] {
            1 => Role::Dialer,
            2 => Role::Listener,
            r => {
                return Err(Error::invalid(
                    "greeting.role",
                    r,
                    "1 (dialer) or 2 (listener)",
                ));
            }
        };
        if b[1] > 1 {
            return Err(Error::invalid(
                "greeting.flags",
                b[1],
                "bit 0 (a key) alone is defined",
            ));
        }
        Ok(Challenge {
            role,
            keyed: b[1] == 1,
            nonce: b[2..Self::LEN].try_into().expect("32 bytes"),
        })
    }
}

/// Whether `theirs` may talk on with `mine`: the other role, a key on both sides or on neither,
/// and another nonce (our own challenge sent back is a reflection).
///
/// # Errors
///
/// [`Error::Authentication`] saying which.
pub(crate) fn agree(
    mine: &Challenge,
    theirs: &Challenge,
    peer: &dyn std::fmt::Display,
) -> Result<()> {
    let refuse = |reason: &str| {
        Err(Error::Authentication {
            peer: peer.to_string(),
            reason: reason.into(),
        })
    };
    if theirs.role != mine.role.peer() {
        return refuse("the peer claims this side's role (a reflected handshake?)");
    }
    if mine.keyed && !theirs.keyed {
        return refuse("this side has a key and the peer has none");
    }
    if !mine.keyed && theirs.keyed {
        return refuse("the peer has a key and this side has none (EngineConfig::key)");
    }
    if theirs.nonce == mine.nonce {
        return refuse("the peer sent this side's own nonce back (a reflected handshake)");
    }
    Ok(())
}

/// What both sides authenticate: both first rounds, the dialer's first, and what binds the
/// connection as this side sees it, each with its length.
pub(crate) struct Transcript(Vec<u8>);

impl Transcript {
    pub(crate) fn new(dialer_first: &[u8], listener_first: &[u8], binding: &[u8]) -> Transcript {
        let mut b =
            Vec::with_capacity(12 + dialer_first.len() + listener_first.len() + binding.len());
        for part in [dialer_first, listener_first, binding] {
            // Every part is a few hundred bytes at most.
            b.extend_from_slice(&(part.len() as u32).to_le_bytes());
            b.extend_from_slice(part);
        }
        Transcript(b)
    }
}

fn hmac(key: &AuthKey, label: &[u8], role: Role, t: &Transcript) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(key.bytes()).expect("any key length");
    m.update(label);
    m.update(&[role.byte()]);
    m.update(&t.0);
    m
}

/// `HMAC-SHA-256(key, label || role || transcript)`: the tag `role` sends.
pub(crate) fn tag(key: &AuthKey, label: &[u8], role: Role, t: &Transcript) -> [u8; TAG_LEN] {
    hmac(key, label, role, t).finalize().into_bytes().into()
}

/// Check, in constant time, the tag the peer (of role `role`) sent over `t`.
///
/// # Errors
///
/// [`Error::Authentication`]: another key, or another transcript (a replayed or relayed
/// handshake).
pub(crate) fn check_tag(
    key: &AuthKey,
    label: &[u8],
    role: Role,
    t: &Transcript,
    got: &[u8],
    peer: &dyn std::fmt::Display,
) -> Result<()> {
    hmac(key, label, role, t)
        .verify_slice(got)
        .map_err(|_| Error::Authentication {
            peer: peer.to_string(),
            reason: "the peer's proof does not match: another key, or a replayed or relayed \
                     handshake"
                .into(),
        })
}

/// The second round's message: `GDXM` and the tag.
const TAG_MAGIC: [u8; 4] = *b"GDXM";

/// Bytes of the second round's message.
pub(crate) const TAG_MSG_LEN: usize = 4 + TAG_LEN;

pub(crate) fn tag_message(tag: &[u8; TAG_LEN]) -> Vec<u8> {
    let mut b = Vec::with_capacity(TAG_MSG_LEN);
    b.extend_from_slice(&TAG_MAGIC);
    b.extend_from_slice(tag);
    b
}

/// The tag in the peer's second-round message.
///
/// # Errors
///
/// [`Error::Authentication`] for anything but `GDXM` and 32 bytes.
pub(crate) fn read_tag_message<'a>(b: &'a [u8], peer: &dyn std::fmt::Display) -> Result<&'a [u8]> {
    if b.len() != TAG_MSG_LEN || b[..4] != TAG_MAGIC {
        return Err(Error::Authentication {
            peer: peer.to_string(),
            reason: format!(
                "the peer's second round is not a proof ({} bytes; {TAG_MSG_LEN} expected, \
                 starting GDXM)",
                b.len()
            ),
        });
    }
    Ok(&b[4..])
}

/// `N` bytes from the OS's random source.
///
/// # Errors
///
/// [`Error::Os`] naming `getrandom`.
#[doc(alias = "getrandom")]
pub(crate) fn random<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).map_err(|e| Error::Os {
        call: "getrandom",
        source: std::io::Error::other(e.to_string()),
    })?;
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any bytes as the second round: exactly `GDXM` and 32 bytes give those 32 bytes,
        /// anything else is refused as [`Error::Authentication`]. Any bytes of a challenge's
        /// length: its role and flags are checked, its nonce read exactly.
        #[test]
        fn second_rounds_and_challenges_are_read_exactly(
            b in proptest::collection::vec(any::<u8>(), 0..40), gdxm in any::<bool>(),
            c in proptest::collection::vec(any::<u8>(), Challenge::LEN),
        ) {
            let mut m = b.clone();
            if gdxm && m.len() >= 4 {
                m[..4].copy_from_slice(&TAG_MAGIC);
            }
            let ok = m.len() == TAG_MSG_LEN && m[..4] == TAG_MAGIC;
            match read_tag_message(&m, &"peer") {
                Ok(t) => prop_assert!(ok && t == &m[4..]),
                Err(e) => prop_assert!(!ok && matches!(e, Error::Authentication { .. }), "{}", e),
            }
            match Challenge::take(&c) {
                Ok(ch) => {
                    prop_assert!(matches!(c[0], 1 | 2) && c[1] <= 1);
                    let mut again = Vec::new();
                    ch.put(&mut again);
                    prop_assert_eq!(again, c);
                }
                Err(e) => prop_assert!(
                    (!matches!(c[0], 1 | 2) || c[1] > 1) && matches!(e, Error::InvalidArgument { .. }),
                    "{}",
                    e
                ),
            }
        }
    }

    const LABEL: &[u8] = b"test-v1";

    fn key(b: u8) -> AuthKey {
        AuthKey::from_bytes(vec![b; 32]).unwrap()
    }

    fn first(c: &Challenge) -> Vec<u8> {
        let mut b = b"hdr".to_vec();
        c.put(&mut b);
        b
    }

    /// A handshake between a dialer and a listener: each side's transcript (with the binding
    /// each sees), each side's tag.
    struct Run {
        d: Challenge,
        l: Challenge,
    }

    impl Run {
        fn new() -> Run {
            Run {
                d: Challenge::new(Role::Dialer, true).unwrap(),
                l: Challenge::new(Role::Listener, true).unwrap(),
            }
        }
        fn transcript(&self, binding: &[u8]) -> Transcript {
            Transcript::new(&first(&self.d), &first(&self.l), binding)
        }
    }

    #[test]
    fn tags_check_on_the_same_transcript_and_key_only() {
        let (k, binding) = (key(1), b"qpn 1 2 gid a b".to_vec());
        let r = Run::new();
        let t = r.transcript(&binding);
        let dt = tag(&k, LABEL, Role::Dialer, &t);
        // The listener checks the dialer's tag over its own transcript: the same bytes.
        check_tag(&k, LABEL, Role::Dialer, &r.transcript(&binding), &dt, &"p").unwrap();
        // Each role's tag differs: a tag sent back as one's own is refused.
        let lt = tag(&k, LABEL, Role::Listener, &t);
        assert_ne!(dt, lt);
        assert!(check_tag(&k, LABEL, Role::Listener, &t, &dt, &"p").is_err());
        // Another key.
        let e = check_tag(&key(2), LABEL, Role::Dialer, &t, &dt, &"p").unwrap_err();
        assert!(matches!(e, Error::Authentication { .. }), "{e}");
        assert_eq!(e.absence(), None);
        // Another label (the other transport's).
        assert!(check_tag(&k, b"other", Role::Dialer, &t, &dt, &"p").is_err());
        // A relay: the listener sees other queue pairs than the dialer did.
        let relayed = r.transcript(b"qpn 1 3 gid a b");
        assert!(check_tag(&k, LABEL, Role::Dialer, &relayed, &dt, &"p").is_err());
        // Short, long or changed tags.
        assert!(check_tag(&k, LABEL, Role::Dialer, &t, &dt[..31], &"p").is_err());
        let mut bad = dt;
        bad[7] ^= 1;
        assert!(check_tag(&k, LABEL, Role::Dialer, &t, &bad, &"p").is_err());
    }

    #[test]
    fn a_recorded_second_round_fails_against_a_fresh_nonce() {
        let (k, binding) = (key(3), b"b".to_vec());
        let old = Run::new();
        let recorded = tag(&k, LABEL, Role::Dialer, &old.transcript(&binding));
        // The attacker replays the dialer's first round and its tag; the listener's nonce is
        // new.
        let replay = Run {
            d: old.d.clone(),
            l: Challenge::new(Role::Listener, true).unwrap(),
        };
        assert_ne!(replay.l.nonce, old.l.nonce);
        let e = check_tag(
            &k,
            LABEL,
            Role::Dialer,
            &replay.transcript(&binding),
            &recorded,
            &"x",
        )
        .unwrap_err();
        assert!(matches!(e, Error::Authentication { .. }), "{e}");
    }

    #[test]
    fn challenges_round_trip_and_disagreements_are_refused_typed() {
        let d = Challenge::new(Role::Dialer, true).unwrap();
        let mut b = Vec::new();
        d.put(&mut b);
        assert_eq!(b.len(), Challenge::LEN);
        assert_eq!(Challenge::take(&b).unwrap(), d);
        for (at, v, arg) in [
            (0, 0, "greeting.role"),
            (0, 3, "greeting.role"),
            (1, 2, "greeting.flags"),
        ] {
            let mut x = b.clone();
            x[at] = v;
            let e = Challenge::take(&x).unwrap_err();
            assert!(
                matches!(&e, Error::InvalidArgument { arg: a, .. } if *a == arg),
                "{e}"
            );
        }
        // Short of a whole challenge: refused, not indexed past its end.
        for n in 0..Challenge::LEN {
            let e = Challenge::take(&b[..n]).unwrap_err();
            assert!(
                matches!(
                    &e,
                    Error::InvalidArgument {
                        arg: "greeting.challenge",
                        ..
                    }
                ),
                "{n}: {e}"
            );
        }
        let l = Challenge::new(Role::Listener, true).unwrap();
        agree(&d, &l, &"p").unwrap();
        agree(&l, &d, &"p").unwrap();
        let auth = |r: Result<()>| matches!(r, Err(Error::Authentication { .. }));
        // A key on one side only: refused on both.
        let bare = Challenge::new(Role::Listener, false).unwrap();
        assert!(auth(agree(&d, &bare, &"p")));
        let bare_d = Challenge::new(Role::Dialer, false).unwrap();
        assert!(auth(agree(&bare_d, &l, &"p")));
        agree(&bare_d, &bare, &"p").unwrap();
        // Our own role, or our own challenge reflected.
        assert!(auth(agree(&d, &d.clone(), &"p")));
        let mut mirror = d.clone();
        mirror.role = Role::Listener;
        assert!(auth(agree(&d, &mirror, &"p")));
        // Nonces are fresh.
        assert_ne!(d.nonce, Challenge::new(Role::Dialer, true).unwrap().nonce);
    }

    #[test]
    fn second_round_messages_are_bounded_and_checked() {
        let t = [9u8; TAG_LEN];
        let m = tag_message(&t);
        assert_eq!(m.len(), TAG_MSG_LEN);
        assert_eq!(read_tag_message(&m, &"p").unwrap(), &t);
        for bad in [
            &m[..TAG_MSG_LEN - 1],
            b"GDXH and 32 more bytes of nothing!".as_slice(),
            &[],
        ] {
            let e = read_tag_message(bad, &"p").unwrap_err();
            assert!(matches!(e, Error::Authentication { .. }), "{e}");
        }
    }

    #[test]
    fn keys_are_bounded_redacted_and_read_from_owner_only_files() {
        assert!(AuthKey::from_bytes(vec![1; 15]).is_err());
        assert!(AuthKey::from_bytes(vec![1; 1025]).is_err());
        let k = AuthKey::from_bytes(b"0123456789abcdef".to_vec()).unwrap();
        assert_eq!(format!("{k:?}"), "AuthKey(<redacted>)");
        assert!(!format!("{k:?}").contains("0123"));
        assert_eq!(
            k,
            AuthKey::from_bytes(b"0123456789abcdef".to_vec()).unwrap()
        );
        assert_ne!(
            k,
            AuthKey::from_bytes(b"0123456789abcdeF".to_vec()).unwrap()
        );
        assert_ne!(
            k,
            AuthKey::from_bytes(b"0123456789abcdef0".to_vec()).unwrap()
        );

        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("gpudirect-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("key");
        std::fs::write(&p, b"a key of 20 bytes..\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let k = AuthKey::from_file(&p).unwrap();
        assert_eq!(
            k.bytes(),
            b"a key of 20 bytes..\n",
            "the whole file, newline included"
        );
        for mode in [0o640, 0o604, 0o620] {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = AuthKey::from_file(&p).unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument { arg: "key", .. }),
                "{mode:o}: {e}"
            );
        }
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o400)).unwrap();
        assert!(AuthKey::from_file(&p).is_ok());
        // Too short, too long, missing.
        let short = dir.join("short");
        std::fs::write(&short, b"short").unwrap();
        std::fs::set_permissions(&short, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(matches!(
            AuthKey::from_file(&short),
            Err(Error::InvalidArgument { .. })
        ));
        std::fs::write(&short, vec![7u8; 4096]).unwrap();
        assert!(matches!(
            AuthKey::from_file(&short),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(matches!(
            AuthKey::from_file(dir.join("none")),
            Err(Error::Os { .. })
        ));
        // From the environment: a path, or nothing.
        assert!(
            AuthKey::from_env("GPUDIRECT_TEST_NO_SUCH_VARIABLE_SET")
                .unwrap()
                .is_none()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn local_peer_rules() {
        assert!(LocalPeers::default().admits(1000, 1000));
        assert!(!LocalPeers::SameUser.admits(0, 1000));
        assert!(LocalPeers::AnyUser.admits(0, 1000));
        assert!(LocalPeers::Users(vec![5, 7]).admits(7, 1000));
        assert!(!LocalPeers::Users(vec![5, 7]).admits(1000, 1000));
        assert_eq!(
            Authentication::Unauthenticated.to_string(),
            "unauthenticated"
        );
    }
}
