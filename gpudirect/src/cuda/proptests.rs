//! Property tests of the slot and batch arithmetic of stream memory operations: for any input they never
//! panic and never wrap, answer `InvalidArgument` (or the typed refusal) for what is out of
//! range, and `Ok` with exact numbers for what is in range. Pure functions only: no GPU needed.
//! Run in debug and release builds.

use super::memop::{MAX_BATCH_MEM_OPS, MAX_FLAG_SLOTS, batch_spans, flag_bytes, slot_addr};
use crate::proptest_support::{addr, invalid, is_invalid, size};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn memop_slots(base in addr(), slots in size(), slot in size()) {
        let f = flag_bytes(slots);
        prop_assert_eq!(f.as_ref().ok().copied(), (1..=MAX_FLAG_SLOTS).contains(&slots).then(|| slots * 8));
        prop_assert!(f.is_ok() || invalid(&f));
        let r = slot_addr(base, slots, slot);
        if slot >= slots {
            prop_assert!(invalid(&r));
        }
        match r {
            Ok(a) => prop_assert_eq!(a as u128, base as u128 + 8 * slot as u128),
            Err(e) => prop_assert!(is_invalid(&e)),
        }
    }

    #[test]
    fn memop_batches_cover_every_op_once(n in 0usize..20_000) {
        let mut next = 0;
        for (start, len) in batch_spans(n) {
            prop_assert_eq!(start, next);
            prop_assert!((1..=MAX_BATCH_MEM_OPS).contains(&len));
            next += len;
        }
        prop_assert_eq!(next, n);
    }
}
