//! Property tests of the graph-capture protocol: whatever the driver answers before and after
//! work is queued, what the work uses is freed exactly once, or never when the work may sit in a
//! graph. No GPU needed.

use super::capture::{Probe, Refused, enqueue_probed as enqueue_with};
use super::testing::Counted;
use crate::Error;
use proptest::prelude::*;
use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// The capture protocol of the one enqueue path, over every combination of answers.
    #[test]
    fn enqueue_capture_protocol(before in 0u8..3, call_ok in any::<bool>(), after in 0u8..3) {
        struct Script { answers: RefCell<Vec<u8>>, invalidated: Cell<usize> }
        impl Probe for Script {
            fn capturing(&self) -> crate::Result<bool> {
                match self.answers.borrow_mut().pop().expect("asked at most twice") {
                    0 => Ok(false),
                    1 => Ok(true),
                    _ => Err(Error::invalid("probe", 0, "cannot tell")),
                }
            }
            fn invalidate(&self) { self.invalidated.set(self.invalidated.get() + 1) }
        }
        let drops = Arc::new(AtomicUsize::new(0));
        let p = Script { answers: RefCell::new(vec![after, before]), invalidated: Cell::new(0) };
        let ran = Cell::new(false);
        let r = enqueue_with(&p, "cuMemcpyAsync", Counted(drops.clone()), |_| {
            ran.set(true);
            if call_ok { Ok(()) } else { Err(Error::invalid("call", 0, "failed")) }
        });
        prop_assert_eq!(ran.get(), before == 0, "queued only on a stream seen not capturing");
        let leaked = before == 0 && after != 0;
        match r {
            Ok(((), keep)) => {
                prop_assert!(before == 0 && call_ok && after == 0);
                drop(keep);
            }
            Err(Refused { error, kept }) => {
                prop_assert_eq!(kept.is_none(), leaked);
                if before == 1 || (leaked && after == 1) {
                    let enqueued = before == 0;
                    prop_assert!(matches!(error, Error::StreamCapturing { call: "cuMemcpyAsync", enqueued: e } if e == enqueued), "{:?}", error);
                }
                drop(kept);
            }
        }
        prop_assert_eq!(drops.load(Ordering::SeqCst), usize::from(!leaked), "freed once, or never when leaked");
        prop_assert_eq!(p.invalidated.get(), usize::from(leaked));
    }
}
