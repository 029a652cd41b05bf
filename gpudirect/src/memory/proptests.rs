//! Property tests of the size, offset and range checks of the CUDA, memory, dma-buf and P2P
//! paths: for any input they never panic and never wrap, answer `InvalidArgument` (or the typed
//! refusal) for what is out of range, and `Ok` with exact numbers for what is in range. Pure
//! functions only: no GPU needed. Run in debug and release builds.

use crate::Error;
use crate::completion::capture::{Probe, Refused, enqueue_with};
use crate::cuda::memop::{MAX_BATCH_MEM_OPS, batch_spans, flag_bytes, slot_addr};
use crate::dmabuf::check_export;
use crate::memory::copy::{bytes_of, check_len};
use crate::memory::vmm::round_up;
use crate::memory::{DeviceMemory, MemoryKind, VmmChunk, byte_size, plan_chunks};
use crate::p2p::ipc::{IpcMemHandle, VmmHandle};
use crate::p2p::staging::chunk_spans;
use crate::p2p::{CopyOptions, MAX_CHUNK_BYTES, MAX_SLOTS, MAX_STAGING_BYTES, PathChoice};
use proptest::prelude::*;
use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

fn invalid<T: std::fmt::Debug>(r: &crate::Result<T>) -> bool {
    matches!(r, Err(Error::InvalidArgument { .. }))
}

fn is_invalid(e: &Error) -> bool {
    matches!(e, Error::InvalidArgument { .. })
}

fn not_rdma<T>(r: &crate::Result<T>) -> bool {
    matches!(r, Err(Error::NotRdmaCapable { .. }))
}

fn kind() -> impl Strategy<Value = MemoryKind> {
    prop_oneof![
        Just(MemoryKind::Device),
        Just(MemoryKind::Vmm),
        Just(MemoryKind::Pool),
        Just(MemoryKind::PinnedHost),
        Just(MemoryKind::RegisteredHost),
    ]
}

/// Sizes near the edges as well as anywhere.
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        0usize..=8192,
        Just(usize::MAX),
        (usize::MAX - 8192)..=usize::MAX,
        any::<usize>(),
    ]
}

fn addr() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..=(1 << 20),
        (u64::MAX - (1 << 20))..=u64::MAX,
        any::<u64>(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn dmabuf_export_ranges(k in kind(), ptr in addr(), byte_len in size(), off in size(), len in size()) {
        let r = check_export(k, ptr, byte_len, off, len);
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
        let g = check_export(MemoryKind::Vmm, ptr, byte_len, off, len).unwrap();
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
    fn memop_slots(base in addr(), slots in size(), slot in size()) {
        let f = flag_bytes(slots);
        prop_assert_eq!(f.as_ref().ok().copied(), (1..=crate::cuda::memop::MAX_FLAG_SLOTS).contains(&slots).then(|| slots * 8));
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
    fn copy_options_have_bounds(chunk in size(), slots in size()) {
        let o = CopyOptions { path: PathChoice::Auto, chunk_bytes: chunk, slots, grant_access: true };
        let ok = (1..=MAX_CHUNK_BYTES).contains(&chunk)
            && (1..=MAX_SLOTS).contains(&slots)
            && chunk.checked_mul(slots).is_some_and(|t| t <= MAX_STAGING_BYTES);
        let r = o.validate();
        prop_assert_eq!(r.is_ok(), ok);
        prop_assert!(r.is_ok() || invalid(&r));
    }

    #[test]
    fn ipc_import_ranges(offset in addr(), bytes in addr(), size in addr(), align in 0u64..64) {
        let r = crate::p2p::ipc::check_import_range("handle.offset", offset, bytes, size, align);
        if r.is_ok() {
            prop_assert!(offset.checked_add(bytes).is_some_and(|e| e <= size));
            prop_assert!(align <= 1 || offset % align == 0);
        } else {
            prop_assert!(invalid(&r));
        }
    }

    #[test]
    fn ipc_handles_from_peers(offset in addr(), bytes in addr(), mapped in addr(), elem_size in prop_oneof![0u32..=16, any::<u32>()], elem in 0usize..=16) {
        let h = IpcMemHandle::from_parts([7; 64], offset, bytes, elem_size, 0);
        match h.check(elem) {
            Ok(n) => {
                prop_assert_eq!(n as u64 * elem as u64, bytes);
                prop_assert!(offset.checked_add(bytes).is_some());
            }
            Err(e) => prop_assert!(is_invalid(&e)),
        }
        let v = VmmHandle { bytes, mapped_bytes: mapped, elem_size, device: 0 };
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
        struct Counted(Arc<AtomicUsize>);
        impl Drop for Counted {
            fn drop(&mut self) { self.0.fetch_add(1, Ordering::SeqCst); }
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
