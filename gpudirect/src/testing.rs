//! For the crate's own unit tests (the integration tests, examples and benches use the workspace's
//! `gpudirect-testing` crate): print `SKIPPED: reason`, or fail where `GPUDIRECT_REQUIRE` (a comma
//! list of `gpu`, `cufile`, `rdma`, `multi-gpu`) names the missing hardware.

use std::fmt;

/// Hardware a unit test needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)]
pub(crate) enum Hardware {
    Gpu,
    Cufile,
    Rdma,
    MultiGpu,
}

impl fmt::Display for Hardware {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Hardware::Gpu => "gpu",
            Hardware::Cufile => "cufile",
            Hardware::Rdma => "rdma",
            Hardware::MultiGpu => "multi-gpu",
        })
    }
}

/// Print `SKIPPED: reason`, or panic when `GPUDIRECT_REQUIRE` names `hw`.
#[track_caller]
pub(crate) fn skip(hw: Hardware, reason: impl fmt::Display) {
    let list = std::env::var("GPUDIRECT_REQUIRE").unwrap_or_default();
    let name = hw.to_string();
    if list
        .split(',')
        .any(|n| n.trim().eq_ignore_ascii_case(&name))
    {
        panic!("GPUDIRECT_REQUIRE names {hw}, but it is absent: {reason}");
    }
    println!("SKIPPED: {reason}");
}

/// Evaluate a `Result` that needs hardware; on `Err`, [`skip`] and `return` from the test.
#[macro_export]
macro_rules! require {
    ($hw:expr, $e:expr) => {
        match $e {
            Ok(v) => v,
            Err(e) => {
                $crate::testing::skip($hw, e);
                return;
            }
        }
    };
}
