//! Fixtures shared by the tests of the crate's modules (the RDMA and storage paths').

use super::kind::{DeviceMemory, DeviceMemoryMut};
use crate::error::MemoryKind;

/// `len` bytes of `kind` at a made-up address on device 0: for checks that must refuse it
/// before any FFI call. Never dereferenced.
pub(crate) struct FakeDevice(pub(crate) MemoryKind, pub(crate) usize);

// SAFETY: never dereferenced or handed to any library: tests use it only where the checks
// refuse it first.
unsafe impl DeviceMemory for FakeDevice {
    type Elem = u8;
    fn device_ptr(&self) -> u64 {
        0x1000
    }
    fn len(&self) -> usize {
        self.1
    }
    fn ordinal(&self) -> usize {
        0
    }
    fn kind(&self) -> MemoryKind {
        self.0
    }
}
// SAFETY: as above.
unsafe impl DeviceMemoryMut for FakeDevice {}
