//! Typed peer copies between device buffers, blocking and asynchronous, on the true path.

use super::access::{self, PeerAccessRefusal};
use super::lane::{Lane, LaneParts, Real, Route};
use super::path::CopyPath;
use super::staging::{Failed, Stager};
use crate::completion::{InFlight, StreamFence, Tracker};
use crate::cuda::{self, Stream};
use crate::error::{Error, Result};
use crate::memory::{DeviceMemory, DeviceMemoryMut, MemoryKind, check_chunk_bytes};
use cudarc::driver::CudaContext;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which path to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum PathChoice {
    /// Same device when it is one; peer when peer access can be enabled; staged otherwise.
    #[default]
    Auto,
    /// Always gpudirect's staged pipeline (to measure it, or to avoid peer mappings).
    Staged,
    /// Peer or fail with the driver's refusal (never a silent fallback).
    Peer,
}

/// How a [`Copier`] copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct CopyOptions {
    /// Path selection.
    pub path: PathChoice,
    /// Staged path: bytes per chunk (and per pinned bounce chunk): a multiple of
    /// [`BOUNCE_ALIGN`](crate::memory::BOUNCE_ALIGN) of at most [`MAX_CHUNK_BYTES`](crate::memory::MAX_CHUNK_BYTES). Default
    /// 8 MiB.
    pub chunk_bytes: usize,
    /// Staged path: bounce chunks in the copier's ring, the copy's pipeline depth. Default 4.
    pub slots: usize,
    /// Peer path: grant the other device access to pool and VMM buffers
    /// (`cuMemPoolSetAccess`/`cuMemSetAccess`) so the copy really runs peer to peer. Default
    /// `true`; with `false` such copies are reported as [`CopyPath::DriverStaged`].
    pub grant_access: bool,
}

/// The most bounce chunks a [`CopyOptions`] may ask for.
pub const MAX_SLOTS: usize = 64;
/// The most pinned memory one copier's staging ring may hold (`chunk_bytes * slots`): 4 GiB.
pub const MAX_STAGING_BYTES: usize = 4 << 30;

impl CopyOptions {
    /// Check the options before anything is allocated: `chunk_bytes` a non-zero multiple of
    /// [`BOUNCE_ALIGN`](crate::memory::BOUNCE_ALIGN) of at most [`MAX_CHUNK_BYTES`](crate::memory::MAX_CHUNK_BYTES) (the
    /// bounce pool's chunk sizes), `slots` in `1..=`[`MAX_SLOTS`], and their product (the pinned
    /// memory of the staging ring) at most [`MAX_STAGING_BYTES`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the option.
    pub fn validate(&self) -> Result<()> {
        check_chunk_bytes(self.chunk_bytes)?;
        if self.slots == 0 || self.slots > MAX_SLOTS {
            return Err(Error::invalid(
                "slots",
                self.slots,
                format!("must be between 1 and {MAX_SLOTS} bounce chunks"),
            ));
        }
        match self.chunk_bytes.checked_mul(self.slots) {
            Some(total) if total <= MAX_STAGING_BYTES => Ok(()),
            _ => Err(Error::invalid(
                "chunk_bytes * slots",
                format!("{} * {}", self.chunk_bytes, self.slots),
                format!("the staging ring may hold at most {MAX_STAGING_BYTES} bytes"),
            )),
        }
    }
}

impl Default for CopyOptions {
    fn default() -> Self {
        CopyOptions {
            path: PathChoice::Auto,
            chunk_bytes: 8 << 20,
            slots: 4,
            grant_access: true,
        }
    }
}

/// What an asynchronous peer copy returns: both buffers (and, on the staged path, the copier's
/// ring of bounce chunks), owned until the copier's stream has passed the copy.
pub type PeerCopyInFlight<S, D> = InFlight<Copied<S, D>, StreamFence>;

/// A finished copy: the buffers back, the path that ran, the bytes moved.
pub struct Copied<S, D> {
    /// The source buffer.
    pub src: S,
    /// The destination buffer, now holding the source's bytes.
    pub dst: D,
    /// The path that ran.
    pub path: CopyPath,
    /// Bytes copied.
    pub bytes: usize,
    /// Host-measured time from enqueue to completion (blocking copies; zero for async ones).
    pub elapsed: Duration,
    /// The staged path's ring of bounce chunks (through the copier's inner state) until the
    /// copy is done; `None` on the peer and same-device paths, where nothing of the copier's
    /// is needed (see [`Copier::keep`]).
    _keep: Option<Arc<Inner>>,
}

impl<S, D> std::fmt::Debug for Copied<S, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Copied")
            .field("path", &self.path)
            .field("bytes", &self.bytes)
            .field("elapsed", &self.elapsed)
            .finish_non_exhaustive()
    }
}

impl<S, D> Copied<S, D> {
    /// Host-measured throughput in 10⁹ bytes per second; 0 when not measured.
    pub fn gb_per_s(&self) -> f64 {
        let s = self.elapsed.as_secs_f64();
        if s > 0.0 {
            self.bytes as f64 / s / 1e9
        } else {
            0.0
        }
    }

    /// The buffers.
    pub fn into_parts(self) -> (S, D) {
        (self.src, self.dst)
    }
}

/// What in-flight copies keep alive: the contexts, the stream and the staged path's chunks.
struct Inner {
    _src_ctx: Arc<CudaContext>,
    _dst_ctx: Arc<CudaContext>,
    /// The stream every copy runs on (of the source device); a staged copy's last step is a wait
    /// here for its last chunk.
    stream: Stream,
    /// The staged path: the copier's lanes and ring of bounce chunks.
    stager: Option<Stager>,
}

/// Copies from device `src` to device `dst`, with the path chosen once (peer access enabled,
/// bounce chunks taken) and reused by every copy.
///
/// Copies through one `Copier` run in submission order, on the copier's own stream. A copy of
/// `cuMemAlloc` memory costs two driver calls to issue (`cuCtxGetCurrent` and the copy: the
/// copier's stream is its own, so it needs no graph-capture question) and none to track: its
/// fence is an epoch of the stream's [`Timeline`](crate::completion::Timeline), and waiting
/// synchronizes the stream once for every copy issued before. Pool and VMM memory add one `cuPointerGetAttribute` per
/// buffer (per VMM mapping) after the first copy of each allocation. A copier may be shared by
/// threads: issuing takes no lock (but the staged path's, which queues several steps). For many
/// small copies between buffers the caller keeps, [`scope`](Copier::scope) issues them with
/// nothing owned or fenced per copy, and [`copy_batch_async`](Copier::copy_batch_async) in one
/// driver call.
///
/// The staged path moves each chunk through pinned host memory on two lanes of the devices'
/// shared copy engines (device-to-host on one, host-to-device on the other, pipelined over the
/// copier's ring of `slots` bounce chunks from the crate's shared pool), and ends each copy with
/// a wait of the copier's stream on its last chunk: its fence is an epoch of that stream too.
/// The ring's chunks go back to the pool when the copier and its last copy are gone.
pub struct Copier {
    src: usize,
    dst: usize,
    lane: Lane,
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Copier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Copier")
            .field("src", &self.src)
            .field("dst", &self.dst)
            .field("path", self.path())
            .finish()
    }
}

impl Copier {
    /// Prepare copies from device `src` to device `dst`.
    ///
    /// With [`PathChoice::Auto`] this enables peer access both ways
    /// ([`enable_peer_access`](super::enable_peer_access)); a refusal (`CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`, also for
    /// `src == dst` when staging is requested, or `CUDA_ERROR_TOO_MANY_PEERS`) selects the staged
    /// path with that reason.
    ///
    /// # Errors
    ///
    /// [`Error::NoDevice`] or [`Error::Load`] without the devices; the refusal itself with
    /// [`PathChoice::Peer`]; [`Error::InvalidArgument`] for options out of bounds
    /// ([`CopyOptions::validate`]), before any driver call;
    /// [`Error::Cuda`] when creating streams or taking the staged path's pinned chunks fails.
    #[doc(alias = "cuMemcpyPeerAsync")]
    pub fn new(src: usize, dst: usize, opts: CopyOptions) -> Result<Copier> {
        opts.validate()?;
        let src_ctx = cuda::context(src)?;
        let dst_ctx = cuda::context(dst)?;
        let (path, route) = match opts.path {
            PathChoice::Staged => (
                CopyPath::Staged {
                    reason: "requested".into(),
                },
                Route::Staged,
            ),
            PathChoice::Auto if src == dst => (CopyPath::SameDevice, Route::Same),
            PathChoice::Auto => match access::enable_peer_access_both(src, dst) {
                Ok(_) => (CopyPath::Peer, Route::Peer),
                Err(e) if PeerAccessRefusal::of(&e).is_some() => (
                    CopyPath::Staged {
                        reason: e.cuda_name().unwrap_or("refused").into(),
                    },
                    Route::Staged,
                ),
                Err(e) => return Err(e),
            },
            PathChoice::Peer => {
                access::enable_peer_access_both(src, dst)?;
                (CopyPath::Peer, Route::Peer)
            }
        };
        // The copier's own: never handed out, and it waits only on the staging lanes' events.
        let stream = Stream::private(&src_ctx)?;
        let stager = match route {
            Route::Staged => Some(Stager::new(src, dst, opts.chunk_bytes, opts.slots)?),
            _ => None,
        };
        let lane = Lane::new(LaneParts {
            src,
            dst,
            src_ctx: src_ctx.cu_ctx(),
            dst_ctx: dst_ctx.cu_ctx(),
            stream: stream.cu_stream(),
            route,
            planned: path,
            grant: opts.grant_access,
        });
        Ok(Copier {
            src,
            dst,
            lane,
            inner: Arc::new(Inner {
                _src_ctx: src_ctx,
                _dst_ctx: dst_ctx,
                stream,
                stager,
            }),
        })
    }

    /// The planned path (a copy of pool or VMM memory without grants reports
    /// [`CopyPath::DriverStaged`] instead of `Peer`, and a copy of an import mapped away from
    /// the device it lives on `Peer` instead of `SameDevice`; see [`Copied::path`]).
    pub fn path(&self) -> &CopyPath {
        self.lane.planned()
    }

    /// Source device ordinal.
    pub fn src(&self) -> usize {
        self.src
    }

    /// Destination device ordinal.
    pub fn dst(&self) -> usize {
        self.dst
    }

    /// Copy all of `src` into `dst` (equal lengths, in elements) and wait for it.
    ///
    /// # Errors
    ///
    /// As [`copy_async`](Self::copy_async); [`Error::Timeout`] when completion cannot be
    /// observed (a failed stream: the buffers are then parked, never freed early).
    #[doc(alias = "cuMemcpyPeer")]
    pub fn copy<S, D>(&self, src: S, dst: D) -> Result<Copied<S, D>>
    where
        S: DeviceMemory,
        D: DeviceMemoryMut<Elem = S::Elem>,
    {
        let start = Instant::now();
        let mut done = self.submit(src, dst)?.wait()?;
        done.elapsed = start.elapsed();
        Ok(done)
    }

    /// Enqueue a copy of all of `src` into `dst` (equal lengths, in elements); the returned [`InFlight`] owns
    /// both buffers (and, staged, the ring of bounce chunks) until the copy completes.
    ///
    /// Work already enqueued on other streams that writes `src` or uses `dst` must be complete
    /// (or synchronised) first: the copy runs on the copier's own streams. Its fence is the
    /// copier's stream ([`StreamFence`]): waiting for one copy waits for every copy issued on
    /// the copier before it, and costs one `cuStreamSynchronize` for all of them.
    ///
    /// # Errors
    ///
    /// Before any work is enqueued (the buffers are dropped, nothing touched them):
    /// [`Error::InvalidArgument`] when a buffer is not device memory, lives on another device than
    /// the copier's, or `dst` holds a different number of elements than `src`. When queueing
    /// fails, [`Error::Cuda`] (or [`Error::StreamCapturing`]); a staged copy that failed midway
    /// keeps the buffers parked in the [`Tracker`] until what was queued completes.
    #[doc(alias = "cuMemcpyPeerAsync")]
    #[doc(alias = "cuMemcpyDtoDAsync")]
    pub fn copy_async<S, D>(&self, src: S, dst: D) -> Result<PeerCopyInFlight<S, D>>
    where
        S: DeviceMemory,
        D: DeviceMemoryMut<Elem = S::Elem>,
    {
        self.submit(src, dst)
    }

    /// A pair checked before any FFI call: its source and destination addresses and bytes. The
    /// common case is one straight test; the refusal is built apart, off the path of every copy.
    #[inline]
    fn checked<S, D>(&self, src: &S, dst: &D) -> Result<(u64, u64, usize)>
    where
        S: DeviceMemory,
        D: DeviceMemoryMut<Elem = S::Elem>,
    {
        let (s, d, n) = (src.device_ptr(), dst.device_ptr(), src.len());
        let bytes = n.checked_mul(std::mem::size_of::<S::Elem>());
        let fits = |ptr: u64, b: usize| ptr.checked_add(b as u64).is_some();
        match bytes {
            Some(b)
                if src.kind().is_device()
                    && dst.kind().is_device()
                    && src.ordinal() == self.src
                    && dst.ordinal() == self.dst
                    && dst.len() == n
                    && fits(s, b)
                    && fits(d, b) =>
            {
                Ok((s, d, b))
            }
            _ => Err(self.refusal(
                (src.kind(), src.ordinal(), s),
                (dst.kind(), dst.ordinal(), d),
                (n, dst.len(), bytes),
            )),
        }
    }

    /// Why [`checked`](Self::checked) refused a pair: the first of its rules the pair breaks
    /// (`(kind, ordinal, address)` of each buffer; their lengths in elements and the source's
    /// bytes, `None` on overflow).
    #[cold]
    #[inline(never)]
    fn refusal(
        &self,
        src: (MemoryKind, usize, u64),
        dst: (MemoryKind, usize, u64),
        (src_len, dst_len, bytes): (usize, usize, Option<usize>),
    ) -> Error {
        for (arg, (kind, ord, _), want) in [("src", src, self.src), ("dst", dst, self.dst)] {
            if !kind.is_device() {
                return Error::invalid(
                    arg,
                    format!("{kind:?} memory"),
                    "peer copies take device memory (Device, Vmm or Pool)",
                );
            }
            if ord != want {
                return Error::invalid(
                    arg,
                    format!("memory of device {ord}"),
                    format!(
                        "this copier copies from device {} to {}",
                        self.src, self.dst
                    ),
                );
            }
        }
        if dst_len != src_len {
            return Error::invalid(
                "dst",
                format!("{dst_len} elements"),
                format!("must hold exactly as many elements as src ({src_len})"),
            );
        }
        let Some(bytes) = bytes else {
            return Error::invalid("src", src_len, "len * size_of overflows usize");
        };
        let (arg, ptr) = if src.2.checked_add(bytes as u64).is_none() {
            ("src", src.2)
        } else {
            ("dst", dst.2)
        };
        Error::invalid(
            arg,
            format!("{ptr:#x} + {bytes} bytes"),
            "the range must not pass the end of the address space",
        )
    }

    /// Enqueue one copy per pair (all of each `src` into its `dst`, equal lengths, in
    /// elements) as one operation: the copies go in one `cuMemcpyBatchAsync` where
    /// the driver has it (CUDA 12.8 and later) and every pair takes the copier's own path (peer,
    /// or one device), else one copy call each (each staged copy through the bounce ring). Many
    /// small copies then cost one driver call instead of one each. The returned [`InFlight`]
    /// owns every buffer until the last copy completes; waiting gives one [`Copied`] per pair,
    /// in the pairs' order. The copies of one batch run in no order among themselves: two
    /// destinations that overlap (views of one allocation) get unspecified bytes.
    ///
    /// As with [`copy_async`](Self::copy_async), work on other streams that writes a source or
    /// uses a destination must be complete first.
    ///
    /// # Errors
    ///
    /// Before anything is queued (the buffers are dropped, nothing touched them):
    /// [`Error::InvalidArgument`] naming `pairs` for an empty batch, or the index of a pair that
    /// [`copy_async`](Self::copy_async) would refuse (and why). When queueing fails,
    /// [`Error::Cuda`] (or [`Error::StreamCapturing`]); copies queued before the failure keep
    /// every buffer parked in the [`Tracker`] until they complete.
    #[doc(alias = "cuMemcpyBatchAsync")]
    pub fn copy_batch_async<S, D>(
        &self,
        pairs: Vec<(S, D)>,
    ) -> Result<InFlight<Vec<Copied<S, D>>, StreamFence>>
    where
        S: DeviceMemory,
        D: DeviceMemoryMut<Elem = S::Elem>,
    {
        if pairs.is_empty() {
            return Err(Error::invalid(
                "pairs",
                0,
                "a batch holds at least one pair",
            ));
        }
        let mut jobs = Vec::with_capacity(pairs.len());
        for (i, (src, dst)) in pairs.iter().enumerate() {
            let (s, d, bytes) = self
                .checked(src, dst)
                .map_err(|e| Error::invalid("pairs", i, e.to_string()))?;
            jobs.push((d, s, bytes));
        }
        let done: Vec<Copied<S, D>> = pairs
            .into_iter()
            .zip(&jobs)
            .map(|((src, dst), &(_, _, bytes))| Copied {
                path: self.lane.path_for(&Real(&self.inner.stream), &src, &dst),
                src,
                dst,
                bytes,
                elapsed: Duration::ZERO,
                _keep: self.keep(),
            })
            .collect();
        let Some(stager) = &self.inner.stager else {
            let own = done
                .iter()
                .all(|c| matches!(c.path, CopyPath::Peer | CopyPath::SameDevice));
            let jobs: Vec<(u64, u64, usize)> = jobs.into_iter().filter(|j| j.2 > 0).collect();
            if jobs.is_empty() {
                return Ok(InFlight::new(
                    "peer copies",
                    self.inner.stream.fence(),
                    done,
                ));
            }
            // SAFETY: every range is owned by `done` (validated: equal lengths, no wrap), which
            // goes into the InFlight (or the tracker) with a fence issued after the copies on
            // the lane's stream.
            return match unsafe {
                self.lane
                    .enqueue_batch(&Real(&self.inner.stream), &jobs, own)
            } {
                Ok(()) => Ok(InFlight::new(
                    "peer copies",
                    self.inner.stream.fence(),
                    done,
                )),
                Err(r) if r.leaked() => {
                    // The copies may sit in a graph: leak, never free.
                    std::mem::forget(done);
                    Err(r.error)
                }
                Err(r) => {
                    // Some copies may be queued: the fence issued now covers them.
                    Tracker::global().park(self.inner.stream.fence(), done);
                    Err(r.error)
                }
            };
        };
        let mut last = None;
        for &(d, s, bytes) in &jobs {
            // SAFETY: every range is owned by `done`, which goes into the InFlight, or the
            // tracker, with the last fence the stager gives (each covers the copies before it:
            // every staged copy ends with a wait of the copier's stream).
            match unsafe { stager.enqueue(&self.inner.stream, d, s, bytes) } {
                Ok(fence) => last = Some(fence),
                Err(Failed {
                    error,
                    fence: Some(fence),
                }) => {
                    Tracker::global().park(fence, done);
                    return Err(error);
                }
                Err(Failed { error, fence: None }) => {
                    std::mem::forget(done);
                    return Err(error);
                }
            }
        }
        let fence = last.unwrap_or_else(|| self.inner.stream.fence());
        Ok(InFlight::new("peer copies", fence, done))
    }

    /// What a copy in flight keeps of the copier: its inner state on the staged path (the
    /// ring of bounce chunks the copy's chunks pass through); nothing on the other paths. A
    /// peer or same-device copy touches its two buffers (each keeps its own memory valid) and
    /// the copier's stream, which its fence holds with the stream's context; on the peer path
    /// both devices' primary contexts, and so the peer mapping, are held for the life of the
    /// process by the enabled pair (`access::enable_peer_access`'s table), whatever memory the
    /// buffers are. One `Arc` fewer to count up and down per copy: small pipelined copies pay
    /// for every one.
    fn keep(&self) -> Option<Arc<Inner>> {
        self.inner.stager.as_ref().map(|_| self.inner.clone())
    }

    fn submit<S, D>(&self, src: S, dst: D) -> Result<PeerCopyInFlight<S, D>>
    where
        S: DeviceMemory,
        D: DeviceMemoryMut<Elem = S::Elem>,
    {
        let (s, d, bytes) = self.checked(&src, &dst)?;
        let path = self.lane.path_for(&Real(&self.inner.stream), &src, &dst);
        let done = Copied {
            src,
            dst,
            path,
            bytes,
            elapsed: Duration::ZERO,
            _keep: self.keep(),
        };
        // SAFETY: both ranges are owned by `done` (validated: equal lengths, no wrap), which goes
        // into the InFlight, or the tracker, with a fence that covers the copy (the copier's ring
        // of chunks stays alive through `done`'s `_keep`).
        match unsafe { self.queue(d, s, bytes) } {
            Ok(fence) => Ok(InFlight::new(
                "peer copy",
                fence.unwrap_or_else(|| self.inner.stream.fence()),
                done,
            )),
            // Nothing queued: the buffers are free to go.
            Err((error, Left::Nothing)) => Err(error),
            Err((error, Left::Covered(fence))) => {
                Tracker::global().park(fence, done);
                Err(error)
            }
            Err((error, Left::Unprovable)) => {
                std::mem::forget(done);
                Err(error)
            }
        }
    }

    /// Queue the copy of `bytes` bytes from `src` to `dst` (ranges [`checked`](Self::checked))
    /// on the copier's path, every step through the capture check. `Ok(None)`: on the lane, so
    /// the copier stream's next fence covers it; `Ok(Some(fence))`: staged, covered by `fence`.
    /// The copier's streams are its own and never exposed, so they cannot be capturing; if one
    /// ever were, the failure says [`Left::Unprovable`].
    ///
    /// # Safety
    ///
    /// Both ranges stay valid and untouched by anyone else until a fence covering the copy (or
    /// the failure's) has completed; after [`Left::Unprovable`], for ever.
    unsafe fn queue(
        &self,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> std::result::Result<Option<StreamFence>, (Error, Left)> {
        let Some(stager) = &self.inner.stager else {
            // SAFETY: the caller's.
            return match unsafe {
                self.lane
                    .enqueue(&Real(&self.inner.stream), dst, src, bytes)
            } {
                Ok(()) => Ok(None),
                Err(r) if r.leaked() => Err((r.error, Left::Unprovable)),
                // One driver call that failed queued nothing.
                Err(r) => Err((r.error, Left::Nothing)),
            };
        };
        // SAFETY: the caller's; the ring's chunks belong to the copier, alive while the copy may
        // run (an owner's `_keep`, or a scope's borrow of the copier).
        match unsafe { stager.enqueue(&self.inner.stream, dst, src, bytes) } {
            Ok(fence) => Ok(Some(fence)),
            // A copy that failed midway may have left work queued (a device-to-host copy with no
            // host-to-device copy after it): the fence covers all of it.
            Err(Failed {
                error,
                fence: Some(fence),
            }) => Err((error, Left::Covered(fence))),
            Err(Failed { error, fence: None }) => Err((error, Left::Unprovable)),
        }
    }
}

/// What a copy that failed to queue may have left running.
pub(super) enum Left {
    /// Nothing: it was refused before any FFI call, or its one driver call failed.
    Nothing,
    /// Work that this fence covers, a fence of the copier's stream (a staged copy that failed
    /// midway: the stream was made to wait for every chunk of the ring), so any later fence of
    /// that stream covers it too.
    Covered(StreamFence),
    /// Work that no fence can prove done (it may sit in a graph, or could not be joined to the
    /// copier's stream).
    Unprovable,
}

impl Copier {
    /// Queue a copy of all of `src` into `dst` for a scope: the checks, grants and driver calls
    /// of [`copy_async`](Self::copy_async), with nothing to own and no fence made on the lane.
    /// Every copy that succeeds (and whatever a failed one left, but for [`Left::Unprovable`])
    /// is covered by a fence of the copier's stream issued after it.
    ///
    /// # Safety
    ///
    /// Both buffers stay borrowed (neither freed nor otherwise used) until such a fence has
    /// completed; after [`Left::Unprovable`], for ever.
    pub(super) unsafe fn queue_borrowed<S, D>(
        &self,
        src: &S,
        dst: &D,
    ) -> std::result::Result<(), (Error, Left)>
    where
        S: DeviceMemory,
        D: DeviceMemoryMut<Elem = S::Elem>,
    {
        let (s, d, bytes) = self.checked(src, dst).map_err(|e| (e, Left::Nothing))?;
        // Grants pool and VMM memory the peer's access (or checks it), as every copy does; the
        // path itself is the copier's to report (`path`), not the scope's.
        let _ = self.lane.path_for(&Real(&self.inner.stream), src, dst);
        // SAFETY: the caller's, for the validated ranges (equal lengths, no wrap).
        unsafe { self.queue(d, s, bytes) }.map(drop)
    }

    /// The copier's stream: every copy runs on it, or ends with a wait of it.
    pub(super) fn stream(&self) -> &Stream {
        &self.inner.stream
    }
}

/// Copy all of `src` into `dst` (equal lengths, in elements) (devices taken from the buffers) and wait.
///
/// A one-off [`Copier`] with default options: peer when possible, staged otherwise, same-device
/// copy when both live on one device. Reuse a `Copier` for repeated copies.
///
/// # Errors
///
/// As [`Copier::new`] and [`Copier::copy`].
#[doc(alias = "cuMemcpyPeer")]
pub fn copy<S, D>(src: S, dst: D) -> Result<Copied<S, D>>
where
    S: DeviceMemory,
    D: DeviceMemoryMut<Elem = S::Elem>,
{
    Copier::new(src.ordinal(), dst.ordinal(), CopyOptions::default())?.copy(src, dst)
}

/// Enqueue a copy of all of `src` into `dst` (equal lengths, in elements); see [`Copier::copy_async`].
///
/// # Errors
///
/// As [`Copier::new`] and [`Copier::copy_async`].
#[doc(alias = "cuMemcpyPeerAsync")]
pub fn copy_async<S, D>(src: S, dst: D) -> Result<PeerCopyInFlight<S, D>>
where
    S: DeviceMemory,
    D: DeviceMemoryMut<Elem = S::Elem>,
{
    Copier::new(src.ordinal(), dst.ordinal(), CopyOptions::default())?.copy_async(src, dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_staged_enqueue_fences_the_orphaned_d2h() {
        use crate::memory::DeviceBuffer;
        use crate::testing::Hardware;
        let ctx = crate::require!(Hardware::Gpu, crate::cuda::context(0));
        let chunk = 64 << 20;
        let copier = Copier::new(
            0,
            0,
            CopyOptions {
                path: PathChoice::Staged,
                chunk_bytes: chunk,
                slots: 2,
                ..Default::default()
            },
        )
        .unwrap();
        let src = DeviceBuffer::<u8>::zeroed(&ctx, 4 * chunk).unwrap();
        let dst = DeviceBuffer::<u8>::zeroed(&ctx, 4 * chunk).unwrap();
        // Chunk 0's D2H (64 MiB, milliseconds) is queued, its H2D never is: nothing else is on
        // the copier's stream, so without the cover its fence would complete at once.
        super::super::staging::FAIL_AFTER_D2H.with(|f| f.set(Some(0)));
        let r = copier.copy_async(src, dst);
        super::super::staging::FAIL_AFTER_D2H.with(|f| f.set(None));
        assert!(r.is_err(), "the injected failure is reported");
        // The parked fence is the copier's stream's: once that stream is idle, the orphaned
        // D2H (the last copy through chunk 0, still in the ring) must have finished.
        copier.inner.stream.synchronize().unwrap();
        let stager = copier.inner.stager.as_ref().unwrap();
        assert_eq!(
            stager.slot_complete(0),
            Some(true),
            "D2H still running past the fence"
        );
        // The copier goes on: the next copy's chunks wait for what is left in the ring.
        let data: Vec<u8> = (0..4 * chunk).map(|i| (i * 131 + 7) as u8).collect();
        let stream = crate::cuda::Stream::new(&ctx).unwrap();
        let src = DeviceBuffer::from_slice(&stream, &data).unwrap();
        let dst = DeviceBuffer::<u8>::zeroed(&ctx, 4 * chunk).unwrap();
        let done = copier.copy(src, dst).unwrap();
        assert!(
            done.dst.to_vec(&stream).unwrap() == data,
            "copy after a failure"
        );
        Tracker::global().reap();
    }

    #[test]
    fn a_peer_copy_in_flight_is_moved_without_a_memcpy_call() {
        use crate::memory::DeviceBuffer;
        // A pipelined caller moves each copy's `InFlight` several times (into its queue, out,
        // through the wait). Up to 128 bytes the compiler moves it with a few vector stores;
        // above, each move is a call to `memcpy`, a noticeable share of a copy's bookkeeping
        // (docs/p2p.md).
        type Op = PeerCopyInFlight<Arc<DeviceBuffer<u8>>, DeviceBuffer<u8>>;
        assert!(
            std::mem::size_of::<Op>() <= 128,
            "{}",
            std::mem::size_of::<Op>()
        );
    }

    #[test]
    fn zero_chunk_is_rejected_before_cuda() {
        let e = Copier::new(
            0,
            0,
            CopyOptions {
                chunk_bytes: 0,
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(matches!(
            e,
            Error::InvalidArgument {
                arg: "chunk_bytes",
                ..
            }
        ));
    }
}
