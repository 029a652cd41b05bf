//! GPU memory that cannot be registered with the NIC (pool memory; a node without dma-buf and
//! nvidia-peermem) moves through pinned host bounce buffers: a ring of slots, the copy of one
//! chunk overlapping the network transfer of the one before.
//!
//! Kept small and on its own: a worker thread per staged request owns everything it touches (the
//! GPU memory, the ring, its CUDA stream) until every copy and every network transfer of it has
//! finished, so nothing is freed early whatever the caller does with the [`Transfer`].

use super::state::Link;
use super::wait::request;
use crate::cuda::Stream;
use crate::error::{Error, Result};
use crate::memory::HostChunk;
use crate::transfer::copy::copy_on;
use crate::transfer::descriptor::RemoteRange;
use crate::transfer::engine::Engine;
use crate::transfer::pending::{Settled, Transfer};
use crate::transfer::region::{Buffer, LocalRange, Region};
use crate::transfer::registry;
use crate::transfer::request::{Direction, TransferOptions, TransferReport, check_pairs};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

/// A ring of `slots` pinned host chunks of `chunk` bytes, registered with the engine: on huge
/// pages from 2 MiB in all (as the bounce pool's chunks), `cuMemHostAlloc` memory below.
pub(crate) struct Ring {
    region: Region,
    chunk: usize,
    slots: usize,
}

impl Ring {
    /// A new ring on GPU `ordinal`'s context (pinned for every context).
    pub(crate) fn new(engine: &Engine, ordinal: usize, chunk: usize, slots: usize) -> Result<Ring> {
        let ctx = crate::cuda::context(ordinal)?;
        let bytes = chunk
            .checked_mul(slots)
            .ok_or_else(|| Error::invalid("staging_chunk", chunk, "times the slots overflows"))?;
        // The bounce pool's memory: on huge pages from 2 MiB up, so the NIC reads and writes few
        // physically contiguous runs (tried afresh for each ring).
        let host = Buffer::device(HostChunk::alloc(&ctx, bytes, &AtomicBool::new(false))?)?;
        let region = registry::register(engine, vec![host], false)?
            .pop()
            .expect("one region");
        Ok(Ring {
            region,
            chunk,
            slots,
        })
    }

    /// Slot `s`'s first `len` bytes, for a network transfer.
    fn range(&self, s: usize, len: usize) -> Result<LocalRange> {
        self.region.range((s * self.chunk) as u64, len as u64)
    }

    /// Copy `len` bytes between GPU memory at `dev` and slot `s`.
    ///
    /// # Safety
    ///
    /// `dev..dev + len` is device memory kept alive meanwhile; no network transfer uses slot
    /// `s` meanwhile.
    unsafe fn copy(
        &self,
        stream: &Stream,
        dev: u64,
        s: usize,
        len: usize,
        to_host: bool,
    ) -> Result<()> {
        let host = self
            .region
            .host_addr((s * self.chunk) as u64)
            .ok_or_else(|| Error::invalid("ring", "device memory", "a ring is host memory"))?;
        debug_assert!(len <= self.chunk);
        // SAFETY: the slot lies in the ring's pinned memory (held by `self.region`), reached
        // only by this copy now (the caller's); the device range is the caller's.
        unsafe { copy_on(stream, dev, host, len, to_host) }
    }
}

/// `(offset, len)` of chunk `i` of `total` bytes cut into `chunk`-byte pieces.
pub(crate) fn chunk_at(i: usize, chunk: usize, total: u64) -> (u64, usize) {
    let off = (i as u64).saturating_mul(chunk as u64);
    (off, (total - off).min(chunk as u64) as usize)
}

/// Chunks of `total` bytes.
pub(crate) fn chunks(total: u64, chunk: usize) -> usize {
    total.div_ceil(chunk as u64) as usize
}

/// Start a staged request (one pair whose local memory is staged GPU memory). Its worker
/// holds `keep` (the endpoint, kept open) until the request has ended.
pub(crate) fn staged<K: Send + 'static>(
    inner: &Arc<Link>,
    keep: K,
    dir: Direction,
    mut pairs: Vec<(LocalRange, RemoteRange)>,
    opts: TransferOptions,
) -> Result<Transfer> {
    check_pairs(dir, &pairs, &opts)?;
    if pairs.len() != 1 {
        return Err(Error::invalid(
            "pairs",
            pairs.len(),
            "a request with staged memory moves one range",
        ));
    }
    let (local, remote) = pairs.pop().expect("one pair");
    let Some((ordinal, _)) = local.region.device_addr(local.offset) else {
        return Err(Error::invalid(
            "local",
            "host memory",
            "only GPU memory is staged",
        ));
    };
    let cfg = inner.ep.engine.inner.config.clone();
    let timeout = opts.deadline.unwrap_or(cfg.deadline);
    let ring = Ring::new(
        &inner.ep.engine,
        ordinal,
        cfg.staging_chunk,
        cfg.staging_slots,
    )?;
    let (t, done) = Transfer::pending(timeout, smallvec::smallvec![local.region.clone()]);
    // Ends the transfer when dropped unused: when the thread cannot start, its closure goes
    // unrun and the transfer ends at once (instead of its drop waiting for a finish that never
    // comes). Not a safety argument: nothing is freed by it.
    // (What `f` returns wakes the transfer's waiters when dropped: here, at once.)
    struct Finish<F: FnOnce(Result<TransferReport>) -> Settled>(Option<F>);
    impl<F: FnOnce(Result<TransferReport>) -> Settled> Drop for Finish<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f(Err(Error::Unsupported {
                    what: "a staged transfer".into(),
                    reason: "its worker thread could not start".into(),
                }));
            }
        }
    }
    let mut done = Finish(Some(done));
    let inner = inner.clone();
    crate::driver::ctx::spawn_thread("gpudirect-staging", move || {
        // The endpoint stays open to the end (dropped with the closure).
        let _ = &keep;
        let r = run(&inner, &ring, dir, &local, &remote, opts, timeout);
        // The worker held the memory, the ring and every sub-transfer to the end.
        if let Some(f) = done.0.take() {
            f(r);
        }
    })?;
    Ok(t)
}

/// The pipeline: writes copy chunk n+1 to the ring while chunk n is on the wire; reads copy
/// chunk n to the GPU while the next ones are read.
fn run(
    ep: &Link,
    ring: &Ring,
    dir: Direction,
    local: &LocalRange,
    remote: &RemoteRange,
    opts: TransferOptions,
    timeout: Duration,
) -> Result<TransferReport> {
    let started = Instant::now();
    let deadline = crate::transfer::plan::deadline_after(started, timeout);
    let (ordinal, base) = local
        .region
        .device_addr(local.offset)
        .ok_or_else(|| Error::invalid("local", "host memory", "only GPU memory is staged"))?;
    let stream = Stream::new(&crate::cuda::context(ordinal)?)?;
    let total = local.len;
    let n = chunks(total, ring.chunk);
    let mut rail_bytes: Vec<u64> = vec![0; ep.counters.len()];
    let mut messages = 0;
    let mut reposted = 0;
    let mut account = |r: TransferReport| {
        for (a, b) in rail_bytes.iter_mut().zip(&r.rail_bytes) {
            *a += b;
        }
        messages += r.messages;
        reposted += r.reposted;
    };
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    let sub = |off: u64, len: usize| remote.descriptor().range(remote.offset() + off, len as u64);
    let mut inflight: VecDeque<Transfer> = VecDeque::new();
    let res = (|| -> Result<()> {
        match dir {
            Direction::Write => {
                for i in 0..n {
                    let (off, len) = chunk_at(i, ring.chunk, total);
                    if inflight.len() == ring.slots {
                        account(inflight.pop_front().expect("full").wait()?);
                    }
                    // SAFETY: the local range is alive (held by `local`); slot i % slots is
                    // free: the transfer that used it last has finished.
                    unsafe { ring.copy(&stream, base + off, i % ring.slots, len, true)? };
                    let last = i + 1 == n;
                    if last && opts.notify.is_some() {
                        // The notification goes after every byte: the earlier chunks first.
                        while let Some(t) = inflight.pop_front() {
                            account(t.wait()?);
                        }
                    }
                    let o = TransferOptions {
                        notify: if last { opts.notify } else { None },
                        deadline: Some(left()),
                    };
                    inflight.push_back(request(
                        ep,
                        Direction::Write,
                        vec![(ring.range(i % ring.slots, len)?, sub(off, len)?)],
                        o,
                    )?);
                }
            }
            Direction::Read => {
                let issue = |i: usize| -> Result<Transfer> {
                    let (off, len) = chunk_at(i, ring.chunk, total);
                    request(
                        ep,
                        Direction::Read,
                        vec![(ring.range(i % ring.slots, len)?, sub(off, len)?)],
                        TransferOptions::default().deadline(left()),
                    )
                };
                for i in 0..n.min(ring.slots) {
                    inflight.push_back(issue(i)?);
                }
                for i in 0..n {
                    account(inflight.pop_front().expect("issued").wait()?);
                    let (off, len) = chunk_at(i, ring.chunk, total);
                    // SAFETY: the read into this slot has finished; the next read of the slot
                    // is issued only after this copy returns.
                    unsafe { ring.copy(&stream, base + off, i % ring.slots, len, false)? };
                    if i + ring.slots < n {
                        inflight.push_back(issue(i + ring.slots)?);
                    }
                }
            }
        }
        Ok(())
    })();
    // Whatever happened, every sub-transfer ends before the ring or the memory can go.
    while let Some(t) = inflight.pop_front() {
        let r = t.wait();
        if res.is_ok() {
            account(r?);
        }
    }
    res?;
    Ok(TransferReport {
        direction: dir,
        bytes: total,
        messages,
        rail_bytes,
        paths: vec![local.region.path().clone()],
        elapsed: started.elapsed(),
        notified: opts.notify,
        reposted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{HostAllocFlags, PinnedHostBuffer};
    use proptest::prelude::*;

    proptest! {
        /// Chunks of any sizes cover the bytes exactly, in order.
        #[test]
        fn chunks_cover_the_bytes(total in 1u64..(1 << 30), chunk in 1usize..(8 << 20)) {
            let n = chunks(total, chunk);
            let mut next = 0u64;
            for i in 0..n {
                let (off, len) = chunk_at(i, chunk, total);
                prop_assert_eq!(off, next);
                prop_assert!(len >= 1 && len <= chunk);
                next += len as u64;
            }
            prop_assert_eq!(next, total);
        }
    }

    /// The GPU half of the staged path: device memory through the ring's slots and back into
    /// another device buffer, every byte compared.
    #[test]
    fn staged_chunks_round_trip_through_the_copies_on_a_gpu() {
        let Ok(ctx) = crate::cuda::context(0) else {
            crate::testing::skip(crate::testing::Hardware::Gpu, "no CUDA device");
            return;
        };
        let chunk = 64 << 10;
        let slots = 3;
        let total = 5 * chunk + 123;
        let data: Vec<u8> = (0..total).map(|i| (i * 7 + 3) as u8).collect();
        let src = crate::memory::DeviceBuffer::<u8>::alloc(&ctx, total).unwrap();
        let dst = crate::memory::DeviceBuffer::<u8>::alloc(&ctx, total).unwrap();
        use crate::memory::DeviceMemory;
        let (sp, dp) = (src.device_ptr(), dst.device_ptr());
        let mut ring =
            PinnedHostBuffer::<u8>::alloc(&ctx, chunk * slots, HostAllocFlags::PORTABLE).unwrap();
        let stream = Stream::new(&ctx).unwrap();
        // SAFETY: test buffers alive for the calls; nothing else touches them.
        unsafe {
            copy_on(&stream, sp, data.as_ptr() as *mut u8, total, false).unwrap();
            let rp = ring.as_mut_slice().as_mut_ptr();
            for i in 0..chunks(total as u64, chunk) {
                let (off, len) = chunk_at(i, chunk, total as u64);
                let slot = rp.add((i % slots) * chunk);
                copy_on(&stream, sp + off, slot, len, true).unwrap();
                copy_on(&stream, dp + off, slot, len, false).unwrap();
            }
            let mut back = vec![0u8; total];
            copy_on(&stream, dp, back.as_mut_ptr(), total, true).unwrap();
            assert!(back == data, "bytes differ after staging");
        }
    }
}
