//! Words both the host and a stream reach: where a stream queue's words and an endpoint's
//! notification counter live ([`WordMemory`]), the counter itself, and [`StreamWord`], the
//! counter as users see it.

use crate::completion::elsewhere::{drop_elsewhere, frees_nothing_here};
use crate::cuda::{MemopFlags, Stream, WaitCondition};
use crate::error::{Error, Result};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Bit 62 of a completion word or notification counter: a request of the queue failed (or the
/// endpoint failed, for the counter). Set, it releases every GEQ wait on the word (the driver
/// compares cyclically); kernels must check it. The other bits keep their meaning.
pub const STREAM_ERROR_BIT: u64 = 1 << 62;

/// Sequence numbers stay below the error bit.
pub(crate) const MAX_SEQ: u64 = STREAM_ERROR_BIT - 1;

/// Where a queue's words live: the host reaches them atomically; with CUDA a stream reaches
/// them too.
pub(crate) trait WordMemory: Send + Sync + 'static {
    /// Word `slot` (Acquire).
    fn load(&self, slot: usize) -> u64;
    /// Set word `slot` (Release).
    fn store(&self, slot: usize, value: u64);
    /// Raise word `slot` to `value` if it holds less (atomically).
    fn raise(&self, slot: usize, value: u64);
    /// The CUDA words, when a stream can reach them.
    fn flags(&self) -> Option<&MemopFlags>;
}

/// Words in plain host memory: host-triggered requests without CUDA.
pub(crate) struct HostWords(Box<[AtomicU64]>);

impl HostWords {
    pub(crate) fn new(slots: usize) -> Self {
        HostWords((0..slots).map(|_| AtomicU64::new(0)).collect())
    }
}

impl WordMemory for HostWords {
    fn load(&self, slot: usize) -> u64 {
        self.0[slot].load(Ordering::Acquire)
    }
    fn store(&self, slot: usize, value: u64) {
        self.0[slot].store(value, Ordering::Release)
    }
    fn raise(&self, slot: usize, value: u64) {
        self.0[slot].fetch_max(value, Ordering::AcqRel);
    }
    fn flags(&self) -> Option<&MemopFlags> {
        None
    }
}

/// Pinned host words mapped for the device (only built by [`MemopFlags::pinned_host`] here,
/// whose loads and stores are host atomics that cannot fail for a slot in range; every slot
/// used is below the count allocated).
impl WordMemory for MemopFlags {
    fn load(&self, slot: usize) -> u64 {
        self.load_u64(slot).unwrap_or(0)
    }
    fn store(&self, slot: usize, value: u64) {
        let _ = self.store_u64(slot, value);
    }
    fn raise(&self, slot: usize, value: u64) {
        let _ = self.raise_u64(slot, value);
    }
    fn flags(&self) -> Option<&MemopFlags> {
        Some(self)
    }
}

/// The notification counter of an endpoint ([`Endpoint::notification_counter`](crate::transfer::Endpoint::notification_counter)): told of every
/// notification the endpoint delivers and of its failure, under the endpoint's lock.
///
/// [`Endpoint::notification_counter`](crate::transfer::Endpoint::notification_counter): crate::transfer::Endpoint::notification_counter
pub(crate) struct Counter {
    words: Box<dyn WordMemory>,
    failed: AtomicBool,
}

impl Counter {
    /// A counter in `words`, starting at the `delivered` notifications delivered so far.
    pub(crate) fn new(words: Box<dyn WordMemory>, delivered: u64) -> Counter {
        words.store(0, delivered & MAX_SEQ);
        Counter {
            words,
            failed: AtomicBool::new(false),
        }
    }

    /// `total` notifications have been delivered since the endpoint started (after the flush).
    pub(crate) fn delivered(&self, total: u64) {
        let bit = if self.failed.load(Ordering::Acquire) {
            STREAM_ERROR_BIT
        } else {
            0
        };
        self.words.store(0, (total & MAX_SEQ) | bit);
    }

    /// The endpoint failed or closed: no more notifications will come.
    pub(crate) fn failed(&self) {
        self.failed.store(true, Ordering::Release);
        self.words.store(0, self.words.load(0) | STREAM_ERROR_BIT);
    }
}

impl Drop for Counter {
    /// Let go of on a thread that frees nothing (its last handle dropped by code a waker ran on
    /// one of the crate's threads), the word goes to a thread that may wait for the streams that
    /// used it.
    fn drop(&mut self) {
        drop_words_freely(&mut self.words);
    }
}

/// On a thread that frees nothing, hand `words` (their owner being dropped) to the crate's drop
/// thread: their drop waits for the streams that used them. Elsewhere nothing: they go with
/// their owner.
pub(crate) fn drop_words_freely(words: &mut Box<dyn WordMemory>) {
    if frees_nothing_here() {
        let words = std::mem::replace(words, Box::new(HostWords::new(0)));
        drop_elsewhere(Box::new(words));
    }
}

/// A word that counts the notifications an endpoint delivered ([`Endpoint::notification_counter`](crate::transfer::Endpoint::notification_counter)):
/// the endpoint's progress thread adds one per notification, after the flush that makes its
/// bytes visible, so a stream that waits for `counter >= n` may use the data of the first `n`
/// notified requests. It counts: it does not consume the notifications, which
/// [`Endpoint::next_notification`](crate::transfer::Endpoint::next_notification) and [`Endpoint::notification`](crate::transfer::Endpoint::notification) still deliver.
///
/// When the endpoint fails or closes (reconnecting included), [`STREAM_ERROR_BIT`] is set and
/// stays: every wait on the counter is released (no stream waits forever for a notification
/// that cannot come), and work after the wait must check the bit (the other bits still count
/// the notifications delivered). The memory is shared with the endpoint by an `Arc`.
#[derive(Clone)]
pub struct StreamWord {
    counter: Arc<Counter>,
}

impl StreamWord {
    /// The endpoint's counter.
    pub(crate) fn new(counter: Arc<Counter>) -> StreamWord {
        StreamWord { counter }
    }

    /// The counter now, as the host reads it.
    pub fn value(&self) -> u64 {
        self.counter.words.load(0)
    }

    /// The counter's device address (8 bytes in pinned host memory mapped for the device), for
    /// a kernel that polls it.
    ///
    /// The address stays valid only while `self` (or a clone) lives: the word's drop waits for
    /// the streams that used it through this crate, not for a kernel given the address. Keep a
    /// clone until every such kernel has finished (launching it is `unsafe`, and this is part of
    /// its contract).
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for a counter in plain host memory.
    pub fn device_address(&self) -> Result<u64> {
        self.flags()?.device_ptr(0)
    }

    pub(crate) fn flags(&self) -> Result<&MemopFlags> {
        self.counter
            .words
            .flags()
            .ok_or_else(|| Error::Unsupported {
                what: "a stream wait on a host counter".into(),
                reason: "the counter was made in plain host memory".into(),
            })
    }

    /// `cuStreamWaitValue64(counter, n, GEQ)` on `stream`: its later work waits until `n`
    /// notifications were delivered (or the endpoint failed: then the word has
    /// [`STREAM_ERROR_BIT`]).
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for a counter in plain host memory; [`Error::StreamCapturing`]
    /// while the stream captures (nothing enqueued); [`Error::Cuda`].
    #[doc(alias = "cuStreamWaitValue64_v2")]
    pub fn wait_on(&self, stream: &Stream, n: u64) -> Result<()> {
        stream.wait_value64(self.flags()?, 0, n, WaitCondition::Geq)
    }
}

impl std::fmt::Debug for StreamWord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamWord")
            .field("value", &self.value())
            .finish()
    }
}
