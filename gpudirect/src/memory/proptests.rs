//! Property tests of the size, offset and range checks of the memory kinds, copies and dma-buf export: for any input they never
//! panic and never wrap, answer `InvalidArgument` (or the typed refusal) for what is out of
//! range, and `Ok` with exact numbers for what is in range. Pure functions only: no GPU needed.
//! Run in debug and release builds.

use super::alloc::byte_size;
use super::copy::{bytes_of, check_len};
use super::dmabuf::check_dmabuf_export;
use super::kind::DeviceMemory;
use super::vmm::{VmmChunk, plan_chunks, round_up};
use crate::error::MemoryKind;
use crate::proptest_support::{addr, invalid, is_invalid, kind, not_rdma, size};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn dmabuf_export_ranges(k in kind(), ptr in addr(), byte_len in size(), off in size(), len in size()) {
        let r = check_dmabuf_export(k, ptr, byte_len, off, len);
        match k {
            MemoryKind::Pool => prop_assert!(not_rdma(&r)),
            MemoryKind::PinnedHost | MemoryKind::RegisteredHost => prop_assert!(invalid(&r)),
            _ => {
                let in_buf = len > 0 && off.checked_add(len).is_some_and(|e| e <= byte_len);
                if !in_buf {
                    prop_assert!(invalid(&r));
                }
                if let Ok(g) = r {
                    prop_assert!(in_buf);
                    prop_assert_eq!(g.iova, ptr + off as u64);
                    prop_assert_eq!(g.len, len as u64);
                    prop_assert_eq!(g.export_base % 4096, 0);
                    prop_assert_eq!(g.export_len % 4096, 0);
                    prop_assert_eq!(g.offset, g.iova - g.export_base);
                    prop_assert!(g.offset + g.len <= g.export_len);
                } else {
                    // Refused inside the buffer only when the addresses pass 2^64.
                    prop_assert!(!in_buf || (ptr as u128 + off as u128 + len as u128 + 4095) > u64::MAX as u128);
                }
            }
        }
    }

    #[test]
    fn dmabuf_export_in_range_is_ok(ptr in 0u64..(1 << 52), byte_len in 1usize..(1 << 40), a in any::<usize>(), b in any::<usize>()) {
        let off = a % byte_len;
        let len = 1 + b % (byte_len - off);
        let g = check_dmabuf_export(MemoryKind::Vmm, ptr, byte_len, off, len).unwrap();
        prop_assert_eq!((g.iova, g.len), (ptr + off as u64, len as u64));
    }

    #[test]
    fn vmm_chunk_plans(chunks in prop::collection::vec(size(), 0..6), gran in prop_oneof![Just(0usize), Just(1), Just(4096), Just(2 << 20), any::<usize>()], elem in 0usize..=16) {
        match plan_chunks(&chunks, gran, elem) {
            Ok((plan, len)) => {
                prop_assert_eq!(plan.len(), chunks.len());
                let mut next = 0usize;
                for (c, &want) in plan.iter().zip(&chunks) {
                    prop_assert_eq!(*c, VmmChunk { offset: next, size: want });
                    prop_assert!(want > 0 && want % gran == 0);
                    next = next.checked_add(want).unwrap();
                }
                prop_assert_eq!(len.checked_mul(elem), Some(next));
            }
            Err(e) => prop_assert!(is_invalid(&e)),
        }
    }

    #[test]
    fn vmm_chunks_of_the_granularity_are_ok(n in prop::collection::vec(1usize..64, 1..8), g in prop_oneof![Just(4096usize), Just(2 << 20)]) {
        let chunks: Vec<usize> = n.iter().map(|k| k * g).collect();
        let (plan, len) = plan_chunks(&chunks, g, 4).unwrap();
        prop_assert_eq!(len * 4, chunks.iter().sum::<usize>());
        prop_assert_eq!(plan.last().map(|c| c.offset + c.size), Some(len * 4));
    }

    #[test]
    fn rounding_and_byte_sizes(s in size(), g in size(), len in size()) {
        if let Some(r) = round_up(s, g) {
            let g = g.max(1);
            prop_assert!(r >= s && r % g == 0 && r - s < g);
        } else {
            prop_assert!(s.checked_add(g.max(1) - 1).is_none());
        }
        let b = byte_size::<u32>(len);
        prop_assert_eq!(b.is_ok(), len > 0 && len.checked_mul(4).is_some());
        prop_assert!(b.is_ok() || invalid(&b));
        let b = bytes_of::<u64>(len);
        prop_assert_eq!(b.as_ref().ok().copied(), len.checked_mul(8));
    }

    #[test]
    fn copy_lengths(a in size(), b in size()) {
        let r = check_len(a, b);
        prop_assert_eq!(r.is_ok(), a == b);
        prop_assert!(r.is_ok() || invalid(&r));
    }

    #[test]
    fn byte_len_saturates_instead_of_wrapping(len in size()) {
        struct Fake(usize);
        // SAFETY: never used for memory access; only its arithmetic is tested.
        unsafe impl DeviceMemory for Fake {
            type Elem = u64;
            fn device_ptr(&self) -> u64 { 0 }
            fn len(&self) -> usize { self.0 }
            fn ordinal(&self) -> usize { 0 }
            fn kind(&self) -> MemoryKind { MemoryKind::Device }
        }
        prop_assert_eq!(Fake(len).byte_len(), len.saturating_mul(8));
    }
}
