//! Stream-ordered transfers: a CUDA stream starts a request when it reaches it and waits for
//! its completion word; the host takes part only through one proxy thread per endpoint, never
//! through a stream synchronize.
//!
//! # Words
//!
//! Each endpoint has a stream queue: 64-bit words that both the host and the GPU reach
//! (pinned host memory mapped for the device, [`MemopFlags::pinned_host`](crate::cuda::MemopFlags::pinned_host), when a stream is
//! involved; plain host memory for host-triggered requests on a node without CUDA). Word 0 is
//! the queue's completion word; the others are trigger words, one per armed request in a ring
//! of [`TRIGGER_SLOTS`].
//!
//! - [`Endpoint::write_on`](crate::transfer::Endpoint::write_on) / [`Endpoint::read_on`](crate::transfer::Endpoint::read_on) check the request (the same checks as
//!   [`Endpoint::write`](crate::transfer::Endpoint::write), typed errors before anything is enqueued), give it the queue's next
//!   sequence number `seq`, arm it, and enqueue `cuStreamWriteValue64(trigger, seq)` on the
//!   stream through the crate's capture-checked path (a capturing stream is refused with
//!   [`Error::StreamCapturing`](crate::Error::StreamCapturing) and nothing is enqueued).
//! - The proxy thread sees the trigger word reach `seq`, posts the request through the
//!   engine ([`Endpoint::transfer`](crate::transfer::Endpoint::transfer): planned then, with the endpoint's rails at that moment), and
//!   when it finishes writes the completion word.
//! - [`StreamTransfer::wait_on`] enqueues `cuStreamWaitValue64(completion, seq, GEQ)`;
//!   [`StreamTransfer::completion_word`] gives the word's device address and `seq` for a kernel
//!   that polls it.
//!
//! # The completion word
//!
//! The completion word holds `done`: the highest sequence number such that every request of
//! the queue up to it finished successfully, so it only grows, and a wait for `seq` (GEQ) is
//! released exactly when `seq` and everything before it are done, whatever order the requests
//! finish in.
//!
//! **Failure never hangs a stream.** When a request fails (the endpoint broke, a deadline
//! passed, a bad completion, the trigger never came, the endpoint was dropped before the stream
//! reached the trigger), the proxy sets [`STREAM_ERROR_BIT`] (bit 62) in the word:
//! `done | STREAM_ERROR_BIT`, where `done` stops at the last request before the first failure.
//! The driver's GEQ is a cyclic comparison (`(int64_t)(*word - seq) >= 0`), so with bit 62 set
//! every wait on the queue, now or later, is released (bit 63 would not do: `seq | 1 << 63`
//! compares as negative and the stream would wait forever). A queue with the bit starts nothing
//! more: its armed requests fail at once, and the endpoint's next stream request gets a fresh
//! queue (new words). **Kernels and streams must check the bit**: after a wait for `seq`, the
//! request succeeded iff `word & STREAM_ERROR_BIT == 0`, or `word & !STREAM_ERROR_BIT >= seq`;
//! otherwise its data (and that of every later request of the queue) must not be used. The
//! host gets the typed error from [`StreamTransfer::wait`].
//!
//! # Ordering: what is visible to which stream when the word is set
//!
//! - `cuStreamWriteValue64` (without `NO_MEMORY_BARRIER`) writes the trigger after the
//!   stream's earlier work and makes that work's memory writes visible first: the NIC reads
//!   source bytes the stream produced before the trigger.
//! - RDMA write: the word is set once every message's completion was polled, that is once the
//!   peer's NIC acknowledged the last message. The local source may then be reused by any stream
//!   that waited on the word. The bytes being visible at the peer is what a notification says
//!   (the peer's [`notification counter`](crate::transfer::Endpoint::notification_counter)), not this word.
//! - RDMA read into GPU memory: the engine flushes the NIC's writes to the GPU
//!   (`cuFlushGPUDirectRDMAWrites`, skipped where the device already orders them) before the
//!   request finishes, and the word is set after that: a stream that waited on the word reads
//!   the bytes. Into host memory: the completion orders the bytes before the word.
//! - The notification counter ([`Endpoint::notification_counter`](crate::transfer::Endpoint::notification_counter)) is incremented by the
//!   receiver's progress thread after it flushed the GPUs whose memory peers may write, once per
//!   notification delivered: a stream that waited for `counter >= n` sees the bytes of the
//!   first `n` notified requests.
//!
//! # The proxy thread
//!
//! One per endpoint, started by the first stream request. While a request is armed it polls
//! the armed trigger words: a short run of yields, then sleeps that double from one microsecond
//! to [`PROXY_NAP`], so an armed request costs at most about one nap of latency and the thread
//! wakes about once a nap while the stream has not reached a trigger. Where all it watches are
//! events behind copies the callers' streams run (inside a node), it naps from the first look
//! unless a request is waited for ([`StreamTransfer::wait_on`], `.await`,
//! [`StreamTransfer::wait`]) or its queue's last request was. With
//! nothing armed it sleeps on a condition variable: woken by a new request, by the completion
//! of a request it posted (a waker on the request's completion flag), or at the endpoint's close.
//!
//! # Deadlines
//!
//! A request's deadline ([`TransferOptions::deadline`](crate::transfer::TransferOptions::deadline), or the engine's) counts twice: the
//! stream must reach the trigger within it of the call, whatever the call waited for (a
//! reconnect's barrier, loading the copy kernel) counted in (else the request fails with
//! [`Error::Timeout`](crate::Error::Timeout) and its word is released with the error bit), and the transfer then has
//! its deadline again from the moment the trigger fired (the engine's bound: a deadline that
//! passes ends the endpoint). So every request ends within twice its deadline plus the NIC's
//! flush after a failure (2 s); [`StreamTransfer::wait`] and `.await` are bounded by that.
//!
//! # Lifetimes
//!
//! The words are owned by an `Arc` that the queue and every [`StreamTransfer`] share; the CUDA
//! words free themselves only once every stream that used them has passed its operations
//! (bounded wait, else leaked; never freed while a graph may hold an operation on them), and a
//! leaked `StreamTransfer` leaks them. Dropping the endpoint releases the words of
//! armed-but-unfired requests with the error bit before anything is freed.
//!
//! `cuMemFree` and `cuMemFreeHost` synchronize the device (see docs/transfer.md), so a thread that
//! frees CUDA memory while a stream waits on a word only that thread sets never returns. The
//! proxy thread therefore frees nothing: what finished requests held (their memory regions, the
//! queue's words) is dropped by the endpoint's next stream request, by
//! [`StreamTransfer::wait`], or when the endpoint goes; what code a waker runs there lets go of
//! (a transfer's last handle, the result it takes) is freed on another of the crate's threads.
//! Your own threads, and your wakers' code on the crate's: do not free CUDA memory on the thread
//! that must make progress for a stream wait to pass.
//!
//! # A second backend
//!
//! The proxy is generic over what carries the data ([`Backend`]): the RDMA backend posts
//! through the engine. Inside a node the data moves on the stream itself: the copies are
//! queued on it at the call, and the proxy only sends what follows (a notification). There
//! the copy kernel stores the trigger after its bytes; copies on the copy engines are followed
//! by an event instead of a trigger write (`Backend::fired_by`: the proxy queries the event),
//! because `cuStreamWriteValue64`'s memory barrier holds the stream's next copy back for some
//! microseconds (docs/transfer.md).
//!
//! Such a request that tells the peer nothing is *lean*: its result is known when its copies
//! are queued, and it is done once the event behind them completes. Its copies and event are
//! queued first, then it takes its `seq` and hands the proxy only the event and its deadline.
//! The proxy places it in the completion word once the event completed (or fails it at its
//! deadline, at the close or after an earlier failure of the queue, as any request); the host
//! reads its end off the event and its place off the word, or off the queue's record of what
//! the word does not tell (a failure, a success past a request still running), asking the
//! proxy (under its lock) only once the event completed or the word carries the error bit.
//! Where no event can be recorded behind the copies, a lean request fails with the driver's
//! reason (its copies stay queued, what they reach held behind them).
//!
//! # Not tested on these machines
//!
//! The GPU half (stream write and wait, capture refusal) is tested on a GPU without a NIC, and
//! the proxy's RDMA half on Soft-RoCE with host-side triggers; a GPU and a NIC together
//! (streams starting RDMA requests, the flush before the word) are not.
//!
//! # Where things live
//!
//! Bottom up, each file imports only those before it: `words` (where words live, the
//! notification counter, [`StreamWord`]), `window` (the completion word as requests finish),
//! `armed` (a queue's words, a request's outcome, [`StreamTransfer`]), `proxy` (the proxy
//! thread over a [`Backend`](proxy::Backend)). The backend that posts through an endpoint, and
//! the endpoint's `write_on`/`read_on`, are in `transfer/endpoint.rs`.

mod armed;
mod proxy;
mod window;
mod words;

pub use armed::StreamTransfer;
pub(crate) use armed::{Keep, closed_error};
#[cfg(feature = "p2p")]
pub(crate) use armed::{Mark, TriggerFence};
#[cfg(feature = "p2p")]
pub(crate) use proxy::Unmade;
pub(crate) use proxy::{Backend, Proxy, Running, Trigger};
pub use window::{PROXY_NAP, TRIGGER_SLOTS};
pub(crate) use words::{Counter, HostWords, WordMemory};
pub use words::{STREAM_ERROR_BIT, StreamWord};
