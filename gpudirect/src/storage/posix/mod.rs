//! The POSIX path: `pread` into pinned bounce chunks and copy them to the GPU, chunked, on
//! several threads at once, each pipelining its own copies; writes run the other way (a copy to
//! a chunk, then `pwrite`). `O_DIRECT` is used where the file allows it, with aligned reads
//! around unaligned requests; a refusal falls back to the buffered descriptor.
//!
//! # Where the time goes, and the design
//!
//! A hot read (the file in the page cache) is two copies: the kernel's copy from the page cache
//! into a pinned chunk (`pread`, bound by the core that runs it), and the copy engine's DMA from
//! the chunk to the GPU (shared by all streams, and several times what one core's `pread`
//! moves). So (the figures behind each choice are in `docs/storage.md`):
//!
//! - **Many readers.** Enough threads that their `pread`s together outrun the DMA: one per core
//!   up to 16 ([`PosixConfig::for_node`]). The threads are started once and kept
//!   (the pool in `workers.rs`); the calling thread is one of them, so a small transfer never
//!   waits for a thread to wake.
//! - **Chunks of 4 MiB**: the per-copy cost dominates smaller ones (a 1 MiB host-to-device copy
//!   is slower than a 4 MiB one), and with 16 MiB chunks every byte went to memory and back
//!   before the DMA read it, whatever the thread count.
//! - **No wait on the critical path.** Each thread owns `depth` chunks (2 by default) and its own
//!   stream (a lane of the device's [`CopyEngine`](crate::memory::CopyEngine)): it queues a
//!   chunk's copy right after its `pread` and reads the next chunk into its other buffer while
//!   the copy runs; it waits for a copy only when it needs that buffer again. That wait spins
//!   under the default context scheduling (the lane's events are not blocking-sync ones): near
//!   the copy engine's limit a reader often waits, and sleeping until an interrupt made hot
//!   reads slower.
//! - **No lock per chunk.** Threads claim chunks from one atomic counter (so the file is read in
//!   order, which the kernel's read-ahead likes, and a slow thread takes fewer chunks); the only
//!   locks are the lane's event list and, twice per thread per transfer, the chunk pool.
//! - **No allocation per call.** Chunks come from the device's process-wide
//!   [`BouncePool`](crate::memory::BouncePool); events are recycled per lane.
//! - **A ramp.** A read through the page cache long enough for it starts with one chunk per
//!   thread of growing sizes (`chunk / threads`, `2 * chunk / threads`, ..., `chunk`), so that
//!   the copy engine gets its first copy after a small `pread` instead of waiting for every
//!   thread's full first chunk, and the threads stay out of step (see `Plan`); hot reads ran
//!   faster with it in every paired run measured. `GPUDIRECT_POSIX_RAMP=0` (read once) turns it
//!   off; `1`, the default, on.
//!
//! Cold reads (`O_DIRECT`) are bound by the device's queue, not by memory copies: they use
//! [`PosixConfig::direct_threads`] threads, each with one request per chunk in flight, in
//! chunks of their own ([`PosixConfig::direct_read_chunk`], 1 MiB: smaller requests than the
//! page-cache reads' 4 MiB, which the disks measured served faster). Buffered
//! writes to one file are serialized by the file system (ext4 and XFS take the inode lock), so
//! they use [`PosixConfig::write_threads`] (1) thread, with its device-to-host copies queued
//! `depth` chunks ahead of its `pwrite`s; `O_DIRECT` writes (durable writes) use
//! `direct_threads`.
//!
//! Copying to the GPU straight from the page cache (the file mapped with `mmap`, the pages
//! registered read-only with `cuMemHostRegister`) was measured and is slower than the bounce
//! chunks: registering did not scale over threads, and a register, copy, unregister pipeline
//! stayed well below what the bounce path reads a hot file at (`docs/storage.md`, "Measured and
//! not adopted").
//!
//! The copies are behind the crate-private [`Staging`](stage::Staging) trait, so the chunking,
//! the threads and the pipelining are tested on host memory (a test-only staging) without a GPU.

mod config;
mod plan;
mod stage;
mod sys;
#[cfg(test)]
mod testing;
mod transfer;
mod workers;

pub use config::{POSIX_ENV, PosixConfig};
pub(crate) use stage::GpuStaging;
pub use sys::DIRECT_ALIGN;
pub(crate) use sys::PosixFile;
pub(crate) use transfer::{Request, read_to_device, write_from_device};
