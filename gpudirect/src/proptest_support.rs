//! Strategies and checks the property tests of several modules share.

use crate::Error;
use crate::memory::MemoryKind;
use proptest::prelude::*;

pub(crate) fn invalid<T: std::fmt::Debug>(r: &crate::Result<T>) -> bool {
    matches!(r, Err(Error::InvalidArgument { .. }))
}

pub(crate) fn is_invalid(e: &Error) -> bool {
    matches!(e, Error::InvalidArgument { .. })
}

pub(crate) fn not_rdma<T>(r: &crate::Result<T>) -> bool {
    matches!(r, Err(Error::NotRdmaCapable { .. }))
}

pub(crate) fn kind() -> impl Strategy<Value = MemoryKind> {
    prop_oneof![
        Just(MemoryKind::Device),
        Just(MemoryKind::Vmm),
        Just(MemoryKind::Pool),
        Just(MemoryKind::PinnedHost),
        Just(MemoryKind::RegisteredHost),
    ]
}

/// Sizes near the edges as well as anywhere.
pub(crate) fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        0usize..=8192,
        Just(usize::MAX),
        (usize::MAX - 8192)..=usize::MAX,
        any::<usize>(),
    ]
}

pub(crate) fn addr() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..=(1 << 20),
        (u64::MAX - (1 << 20))..=u64::MAX,
        any::<u64>(),
    ]
}
