//! Test data and where test files go: no GPU and no gpudirect needed (the storage bench
//! includes this file by path).
#![allow(dead_code)]

/// Deterministic pseudo-random bytes.
pub fn pattern(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v = Vec::with_capacity(n + 8);
    while v.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(n);
    v
}

/// A directory on a real (non-tmpfs) file system for test files: `GPUDIRECT_TEST_DIR`, else
/// `target/gpudirect-storage-test` under the current directory.
pub fn test_dir() -> std::path::PathBuf {
    let d = std::env::var_os("GPUDIRECT_TEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::env::current_dir()
                .unwrap()
                .join("target/gpudirect-storage-test")
        });
    std::fs::create_dir_all(&d).unwrap();
    d
}
