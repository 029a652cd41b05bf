//! Hardware requirements for tests and examples: `SKIPPED: reason`, or a failure when
//! `GPUDIRECT_REQUIRE` names the missing hardware.
//!
//! `GPUDIRECT_REQUIRE` is a comma list of `gpu`, `cufile`, `rdma`, `multi-gpu`.

use std::fmt;

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
}

impl Hardware {
    /// The name used in `GPUDIRECT_REQUIRE`.
    pub fn name(self) -> &'static str {
        match self {
            Hardware::Gpu => "gpu",
            Hardware::Cufile => "cufile",
            Hardware::Rdma => "rdma",
            Hardware::MultiGpu => "multi-gpu",
        }
    }
}

impl fmt::Display for Hardware {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether `GPUDIRECT_REQUIRE` names `hw`.
pub fn required(hw: Hardware) -> bool {
    required_in(&std::env::var("GPUDIRECT_REQUIRE").unwrap_or_default(), hw)
}

fn required_in(list: &str, hw: Hardware) -> bool {
    list.split(',').map(str::trim).any(|s| s == hw.name())
}

/// In a test: print `SKIPPED: reason` and return, or panic when `hw` is required.
#[track_caller]
pub fn skip(hw: Hardware, reason: impl fmt::Display) {
    if required(hw) {
        panic!("GPUDIRECT_REQUIRE names {hw}, but it is absent: {reason}");
    }
    println!("SKIPPED: {reason}");
}

/// In an example: print `SKIPPED: reason` and exit 0, or exit 1 when `hw` is required.
pub fn skip_example(hw: Hardware, reason: impl fmt::Display) -> ! {
    if required(hw) {
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
                $crate::testing::skip($hw, e);
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
        assert!(required_in("gpu,cufile", Hardware::Cufile));
        assert!(required_in(" rdma , gpu", Hardware::Rdma));
        assert!(!required_in("gpu", Hardware::MultiGpu));
        assert!(!required_in("", Hardware::Gpu));
        assert!(required_in("gpu,multi-gpu", Hardware::MultiGpu));
    }
}
