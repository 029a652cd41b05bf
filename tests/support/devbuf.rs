//! Test-only device buffers over raw `cuMemAlloc_v2` (until the memory kinds land), poisoned on
//! allocation, with host copies for checking.
#![allow(dead_code)]

use gpudirect::cudarc::driver::sys;
use gpudirect::memory::{DeviceMemory, DeviceMemoryMut, MemoryKind};

/// `cuMemAlloc_v2` memory, freed on drop.
pub struct DevBuf {
    ptr: u64,
    len: usize,
    ordinal: usize,
}

fn ck(call: &str, r: sys::CUresult) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{call}");
}

impl DevBuf {
    /// `len` bytes on device `ordinal` (its context must be current), filled with `poison`.
    pub fn new(ordinal: usize, len: usize, poison: u8) -> Self {
        let mut ptr = 0;
        // SAFETY: valid out-pointer; context current.
        unsafe {
            ck("cuMemAlloc_v2", sys::cuMemAlloc_v2(&mut ptr, len.max(1)));
            ck("cuMemsetD8_v2", sys::cuMemsetD8_v2(ptr, poison, len.max(1)));
            // The memset runs on the legacy stream: finish it before work on other streams.
            ck("cuCtxSynchronize", sys::cuCtxSynchronize());
        }
        DevBuf { ptr, len, ordinal }
    }

    /// Copy everything to the host.
    pub fn to_host(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        // SAFETY: both ranges are `len` bytes.
        unsafe {
            ck("cuCtxSynchronize", sys::cuCtxSynchronize());
            ck(
                "cuMemcpyDtoH_v2",
                sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), self.ptr, self.len),
            );
        }
        v
    }

    /// Copy `data` to the start.
    pub fn fill_from(&mut self, data: &[u8]) {
        assert!(data.len() <= self.len);
        // SAFETY: `data.len()` bytes fit.
        unsafe {
            ck(
                "cuMemcpyHtoD_v2",
                sys::cuMemcpyHtoD_v2(self.ptr, data.as_ptr().cast(), data.len()),
            )
        };
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`; every use in the tests has completed (blocking calls, or
        // AsyncIo/Batch handed the buffer back after completion).
        unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

// SAFETY: the allocation is `len` bytes of cuMemAlloc memory on `ordinal`, valid until drop, and
// does not move with the value.
unsafe impl DeviceMemory for DevBuf {
    type Elem = u8;
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn ordinal(&self) -> usize {
        self.ordinal
    }
    fn kind(&self) -> MemoryKind {
        MemoryKind::Device
    }
}

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

// SAFETY: a DevBuf is an owned allocation; the tests hand out no host references to its bytes.
unsafe impl DeviceMemoryMut for DevBuf {}
