//! Property tests of the size, offset and range checks of the P2P paths (staging, copy options, IPC handles from peers): for any input they never
//! panic and never wrap, answer `InvalidArgument` (or the typed refusal) for what is out of
//! range, and `Ok` with exact numbers for what is in range. Pure functions only: no GPU needed.
//! Run in debug and release builds.

use crate::memory::{BOUNCE_ALIGN, MAX_CHUNK_BYTES, SHARED_LANES};
use crate::p2p::staging::{chunk_spans, lanes_of, schedule};
use crate::p2p::{CopyOptions, MAX_SLOTS, MAX_STAGING_BYTES, PathChoice};
use crate::p2p::{IpcMemHandle, VmmHandle};
use crate::proptest_support::{addr, invalid, is_invalid, size};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn staged_chunks_cover_the_copy_exactly(chunk in 0usize..(1 << 30), k in 0usize..2000, extra in any::<usize>()) {
        let bytes = if chunk == 0 { extra } else { chunk.saturating_mul(k).saturating_add(extra % chunk) };
        let mut next = 0usize;
        let mut n = 0;
        for (off, len) in chunk_spans(bytes, chunk) {
            prop_assert_eq!(off, next);
            prop_assert!((1..=chunk).contains(&len));
            next = off.checked_add(len).unwrap();
            n += 1;
            prop_assert!(n <= 2001);
        }
        prop_assert_eq!(next, if chunk == 0 { 0 } else { bytes });
    }

    #[test]
    fn staged_chunks_take_the_ring_slots_in_turn(chunk in 1usize..(1 << 24), k in 0usize..300, extra in 0usize..(1 << 24), slots in 0usize..=MAX_SLOTS, next in any::<usize>()) {
        let bytes = chunk.saturating_mul(k).saturating_add(extra % chunk);
        let plan: Vec<_> = schedule(bytes, chunk, slots, next).collect();
        if slots == 0 {
            prop_assert!(plan.is_empty());
        } else {
            let spans: Vec<_> = chunk_spans(bytes, chunk).collect();
            prop_assert_eq!(plan.len(), spans.len());
            for (i, ((span, s), want)) in plan.iter().zip(&spans).enumerate() {
                prop_assert_eq!(span, want);
                // In turn from the cursor: a slot comes back only after all the others.
                prop_assert_eq!(*s, (next % slots + i) % slots);
            }
        }
    }

    #[test]
    fn copiers_take_two_distinct_lanes(n in any::<usize>()) {
        let (d2h, h2d) = lanes_of(n);
        prop_assert!(d2h < SHARED_LANES && h2d < SHARED_LANES && d2h != h2d);
        // The next copiers' pairs are other lanes, until they come round again.
        for m in 1..SHARED_LANES / 2 {
            let (a, b) = lanes_of(n.wrapping_add(m));
            prop_assert!(a != d2h && a != h2d && b != d2h && b != h2d);
        }
    }

    #[test]
    fn copy_options_have_bounds(chunk in prop_oneof![size(), (0usize..=(1 << 19)).prop_map(|p| p * BOUNCE_ALIGN)], slots in size()) {
        let o = CopyOptions { path: PathChoice::Auto, chunk_bytes: chunk, slots, grant_access: true };
        let ok = (1..=MAX_CHUNK_BYTES).contains(&chunk)
            && chunk % BOUNCE_ALIGN == 0
            && (1..=MAX_SLOTS).contains(&slots)
            && chunk.checked_mul(slots).is_some_and(|t| t <= MAX_STAGING_BYTES);
        let r = o.validate();
        prop_assert_eq!(r.is_ok(), ok);
        prop_assert!(r.is_ok() || invalid(&r));
    }

    #[test]
    fn ipc_import_ranges(offset in addr(), bytes in addr(), size in addr(), align in 0u64..64) {
        let r = crate::p2p::ipc::handle::check_import_range("handle.offset", offset, bytes, size, align);
        if r.is_ok() {
            prop_assert!(offset.checked_add(bytes).is_some_and(|e| e <= size));
            prop_assert!(align <= 1 || offset % align == 0);
        } else {
            prop_assert!(invalid(&r));
        }
    }

    #[test]
    fn ipc_handles_from_peers(offset in addr(), bytes in addr(), mapped in addr(), elem_size in prop_oneof![0u32..=16, any::<u32>()], elem in 0usize..=16) {
        let h = IpcMemHandle::from_parts([7; 64], offset, bytes, elem_size, 0, None);
        match h.check(elem) {
            Ok(n) => {
                prop_assert_eq!(n as u64 * elem as u64, bytes);
                prop_assert!(offset.checked_add(bytes).is_some());
            }
            Err(e) => prop_assert!(is_invalid(&e)),
        }
        let v = VmmHandle { bytes, mapped_bytes: mapped, elem_size, device: 0, pci_bus_id: None };
        match v.check(elem) {
            Ok((m, n)) => {
                prop_assert_eq!(m as u64, mapped);
                prop_assert!(m > 0 && bytes <= mapped);
                prop_assert_eq!(n as u64 * elem as u64, bytes);
            }
            Err(e) => prop_assert!(is_invalid(&e)),
        }
        let p = crate::p2p::ipc::PoolPtrHandle::for_test(bytes, elem_size);
        match p.check(elem) {
            Ok(n) => prop_assert!(n > 0 && n as u64 * elem as u64 == bytes),
            Err(e) => prop_assert!(is_invalid(&e)),
        }
    }
}
