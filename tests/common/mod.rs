//! Helpers shared by the P2P integration tests.
#![allow(dead_code)]

use gpudirect::Error;
use gpudirect::cuda::Stream;
use gpudirect::memory::DeviceBuffer;
use rand::{Rng, SeedableRng, rngs::StdRng};

/// The number of visible GPUs, or an error saying why there are none.
pub fn gpus() -> gpudirect::Result<usize> {
    let n = gpudirect::cuda::device_count()?;
    if n == 0 {
        return Err(Error::NoDevice {
            what: "CUDA device",
            reason: "cuDeviceGetCount answered 0".into(),
        });
    }
    Ok(n)
}

/// A seed from the clock, printed so a failure can be replayed with `P2P_TEST_SEED`.
pub fn seed() -> u64 {
    let s = std::env::var("P2P_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(7)
        });
    println!("seed {s}");
    s
}

/// `n` random words from `seed`.
pub fn random_u32(n: usize, seed: u64) -> Vec<u32> {
    let mut r = StdRng::seed_from_u64(seed);
    (0..n).map(|_| r.random()).collect()
}

/// A stream on device `ordinal`.
pub fn stream(ordinal: usize) -> Stream {
    Stream::new(&gpudirect::cuda::context(ordinal).unwrap()).unwrap()
}

/// `n` words of 0xDEADBEEF on device `ordinal`: a destination whose old contents are known.
pub fn poisoned(ordinal: usize, n: usize) -> DeviceBuffer<u32> {
    DeviceBuffer::from_slice(&stream(ordinal), &vec![0xDEAD_BEEFu32; n]).unwrap()
}

/// Compare exactly, reporting the first difference without printing megabytes.
pub fn assert_same(got: &[u32], want: &[u32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at word {i}: got {:#010x}, want {:#010x}",
            got[i], want[i]
        );
    }
}
