//! Hardware requirements for gpudirect's tests, examples and benches: `SKIPPED: reason`, or a
//! failure when `GPUDIRECT_REQUIRE` names the missing hardware; and [`paired`], how a bench
//! decides a cell from paired rounds against its baseline.
//!
//! `GPUDIRECT_REQUIRE` is a comma list of `gpu`, `cufile`, `rdma`, `multi-gpu`, `etcd`. This crate is
//! a development dependency of the workspace's top-level package only (never published, never
//! a dependency of `gpudirect`); docs/test-tiers.md says how the tiers use it.
#![deny(missing_docs)]

use std::fmt;

pub mod paired;

/// Hardware a test or example needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hardware {
    /// A CUDA GPU.
    Gpu,
    /// A working cuFile library (GDS or compatibility mode).
    Cufile,
    /// A verbs (RDMA) device.
    Rdma,
    /// Two or more CUDA GPUs.
    MultiGpu,
    /// An etcd server (`GPUDIRECT_ETCD=host:port`) for the metadata store's tests.
    Etcd,
}

impl Hardware {
    /// The name used in `GPUDIRECT_REQUIRE`.
    pub fn name(self) -> &'static str {
        match self {
            Hardware::Gpu => "gpu",
            Hardware::Cufile => "cufile",
            Hardware::Rdma => "rdma",
            Hardware::MultiGpu => "multi-gpu",
            Hardware::Etcd => "etcd",
        }
    }
}

impl fmt::Display for Hardware {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

const ALL: [Hardware; 5] = [
    Hardware::Gpu,
    Hardware::Cufile,
    Hardware::Rdma,
    Hardware::MultiGpu,
    Hardware::Etcd,
];

/// Whether `GPUDIRECT_REQUIRE` names `hw` (names are case-insensitive).
///
/// # Panics
///
/// When `GPUDIRECT_REQUIRE` holds a name that is not one of `gpu`, `cufile`, `rdma`,
/// `multi-gpu`, `etcd`: a misspelled requirement must not turn into a silent skip.
#[track_caller]
pub fn required(hw: Hardware) -> bool {
    match required_in(&std::env::var("GPUDIRECT_REQUIRE").unwrap_or_default(), hw) {
        Ok(r) => r,
        Err(unknown) => panic!(
            "GPUDIRECT_REQUIRE names unknown hardware {unknown:?}; known: gpu, cufile, rdma, multi-gpu, etcd"
        ),
    }
}

fn required_in(list: &str, hw: Hardware) -> Result<bool, String> {
    let mut found = false;
    for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match ALL.iter().find(|h| h.name().eq_ignore_ascii_case(name)) {
            Some(h) => found |= *h == hw,
            None => return Err(name.to_string()),
        }
    }
    Ok(found)
}

/// In a test: print `SKIPPED: reason` and return, or panic when `hw` is required.
#[track_caller]
pub fn skip(hw: Hardware, reason: impl fmt::Display) {
    if required(hw) {
        panic!("GPUDIRECT_REQUIRE names {hw}, but it is absent: {reason}");
    }
    println!("SKIPPED: {reason}");
}

/// In an example: print `SKIPPED: reason` and exit 0, or exit 1 when `hw` is required (2 when
/// `GPUDIRECT_REQUIRE` names unknown hardware).
pub fn skip_example(hw: Hardware, reason: impl fmt::Display) -> ! {
    let list = std::env::var("GPUDIRECT_REQUIRE").unwrap_or_default();
    let required = required_in(&list, hw).unwrap_or_else(|unknown| {
        eprintln!(
            "FAILED: GPUDIRECT_REQUIRE names unknown hardware {unknown:?}; known: gpu, cufile, rdma, multi-gpu, etcd"
        );
        std::process::exit(2);
    });
    if required {
        eprintln!("FAILED: GPUDIRECT_REQUIRE names {hw}, but it is absent: {reason}");
        std::process::exit(1);
    }
    println!("SKIPPED: {reason}");
    std::process::exit(0);
}

/// Evaluate a `Result` that needs hardware; on `Err`, [`skip`] and `return` from the test.
#[macro_export]
macro_rules! require {
    ($hw:expr, $e:expr) => {
        match $e {
            Ok(v) => v,
            Err(e) => {
                $crate::skip($hw, e);
                return;
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_require_list() {
        assert_eq!(required_in("gpu,cufile", Hardware::Cufile), Ok(true));
        assert_eq!(required_in(" rdma , gpu", Hardware::Rdma), Ok(true));
        assert_eq!(required_in("gpu", Hardware::MultiGpu), Ok(false));
        assert_eq!(required_in("", Hardware::Gpu), Ok(false));
        assert_eq!(required_in("gpu,multi-gpu", Hardware::MultiGpu), Ok(true));
        assert_eq!(required_in("GPU", Hardware::Gpu), Ok(true));
        assert_eq!(required_in("gpu,,", Hardware::Gpu), Ok(true));
        assert_eq!(
            required_in("gpu,cuda", Hardware::Gpu),
            Err("cuda".to_string())
        );
    }
}
