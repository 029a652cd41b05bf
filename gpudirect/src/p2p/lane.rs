//! The per-copy work of a [`Copier`](super::Copier) on its own stream: the true path of a pair
//! of buffers, and the one capture-checked driver call that queues the copy.
//!
//! What a copy costs in driver calls, by the memory it copies:
//!
//! | memory | path decided by | calls per copy (after the first) |
//! | --- | --- | --- |
//! | `cuMemAlloc` memory (and CUDA IPC imports mapped where they live) | its kind: peer access is enabled for the pair when the copier is made | `cuCtxGetCurrent`, the copy (the lane's stream is the copier's own private stream: no `cuStreamIsCapturing`, see [`Real`]) |
//! | pool memory | once per allocation (`CU_POINTER_ATTRIBUTE_BUFFER_ID`), then remembered | plus one `cuPointerGetAttribute` per pool buffer |
//! | VMM memory that knows its mappings | once per set of mappings (their buffer ids), then remembered | plus one `cuPointerGetAttribute` per mapping |
//! | VMM memory that does not | every copy (`cuMemGetAddressRange`, `cuMemGetAccess` per mapping) | as before the cache |
//!
//! A context switch adds `cuCtxSetCurrent` (only when the thread's current context is another).
//! Completion costs no call per copy: the copier's [`StreamFence`](crate::completion::StreamFence)
//! takes an epoch (one atomic add), and waiting synchronizes the stream once for every copy
//! issued before.
//!
//! Only successes are remembered (a grant made or seen), keyed by the allocation's identity
//! (buffer ids are unique in the process: an address freed and allocated again gets a new one),
//! so a grant made later by someone else is seen at the next copy. A grant revoked behind the
//! crate's back (`cuMemSetAccess` or `cuMemPoolSetAccess` to none) is not noticed.
//!
//! Every driver call goes through [`CopyDriver`], so that tests count them without a GPU.

use super::access::{self, VmmRange};
use super::home::{self, Home};
use super::path::CopyPath;
use crate::completion::capture::{self, Refused};
use crate::cuda::Stream;
use crate::driver;
use crate::error::Result;
use crate::memory::{DeviceMemory, MemoryKind};
use cudarc::driver::sys;
use std::collections::HashSet;
use std::sync::Mutex;

/// The driver calls a copy makes (and the one lookup that is no driver call: [`home`]).
pub(crate) trait CopyDriver {
    /// Make `ctx` current on this thread unless it is: `cuCtxGetCurrent`, and `cuCtxSetCurrent`
    /// when another context is current.
    ///
    /// # Safety
    ///
    /// `ctx` is a live context.
    unsafe fn bind(&self, ctx: sys::CUcontext) -> Result<()>;
    /// Queue `queue` on `stream` behind the graph-capture protocol (`call` names the C function
    /// in a refusal): `cuStreamIsCapturing` before and after, unless the stream is a
    /// [`PrivateStream`](capture::PrivateStream).
    fn enqueue(
        &self,
        stream: sys::CUstream,
        call: &'static str,
        queue: impl FnOnce() -> Result<()>,
    ) -> std::result::Result<(), Refused<()>>;
    /// `cuMemcpyDtoDAsync_v2` of `job`.
    ///
    /// # Safety
    ///
    /// As [`driver::mem::copy_dtod_async`].
    unsafe fn copy_dtod(&self, job: Job) -> Result<()>;
    /// `cuMemcpyPeerAsync` of `job`, between the lane's contexts.
    ///
    /// # Safety
    ///
    /// As [`driver::peer::copy_async`].
    unsafe fn copy_peer(&self, job: Job, contexts: Contexts) -> Result<()>;
    /// `cuMemcpyBatchAsync` of `dsts[i] <- srcs[i]`, `sizes[i]` bytes each, on `stream`;
    /// `Ok(false)`, queueing nothing, where the driver lacks it.
    ///
    /// # Safety
    ///
    /// As [`driver::mem::copy_batch_async`].
    unsafe fn copy_batch(
        &self,
        dsts: &mut [u64],
        srcs: &mut [u64],
        sizes: &mut [usize],
        stream: sys::CUstream,
    ) -> Result<bool>;
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID` of `ptr`; `None` when the driver cannot say.
    fn buffer_id(&self, ptr: u64) -> Option<u64>;
    /// Where the import holding `ptr` lives, when it is mapped away from its home.
    fn home(&self, ptr: u64) -> Option<Home>;
    /// Grant (or only check) device `peer`'s read-write access to the pool that owns `ptr`.
    fn pool_access(&self, ptr: u64, peer: usize, grant: bool) -> std::result::Result<(), String>;
    /// Grant (or only check) device `peer`'s access to every VMM mapping holding `range`.
    fn vmm_access(
        &self,
        range: VmmRange,
        peer: usize,
        grant: bool,
    ) -> std::result::Result<(), String>;
}

/// The driver itself, for a lane over `0`: the copier's own stream.
pub(crate) struct Real<'s>(pub(crate) &'s Stream);

impl CopyDriver for Real<'_> {
    #[inline]
    unsafe fn bind(&self, ctx: sys::CUcontext) -> Result<()> {
        if driver::ctx::current()? == Some(ctx) {
            return Ok(());
        }
        // SAFETY: a live context (the caller's).
        unsafe { driver::ctx::set_current(ctx) }
    }

    #[inline]
    fn enqueue(
        &self,
        stream: sys::CUstream,
        call: &'static str,
        queue: impl FnOnce() -> Result<()>,
    ) -> std::result::Result<(), Refused<()>> {
        match self.0.as_private() {
            // A lane's stream is the copier's own (`Copier::new` makes it with
            // `Stream::private`): no safe API hands it out, so nobody can begin a capture on
            // it, and it never waits on an event of a stream the library does not own. So the
            // two `cuStreamIsCapturing` calls per copy (most of the fixed cost of a small
            // pipelined copy: docs/p2p.md) are not made.
            Some(p) if p.cu_stream() == stream => p.enqueue(call, (), |_, ()| queue()).map(drop),
            _ => capture::enqueue_raw(stream, call, (), |_, ()| queue()).map(drop),
        }
    }

    #[inline]
    unsafe fn copy_dtod(&self, j: Job) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { driver::mem::copy_dtod_async(j.dst, j.src, j.bytes, j.stream) }
    }

    #[inline]
    unsafe fn copy_peer(&self, j: Job, c: Contexts) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { driver::peer::copy_async(j.dst, c.dst, j.src, c.src, j.bytes, j.stream) }
    }

    unsafe fn copy_batch(
        &self,
        dsts: &mut [u64],
        srcs: &mut [u64],
        sizes: &mut [usize],
        stream: sys::CUstream,
    ) -> Result<bool> {
        // SAFETY: forwarded from the caller.
        unsafe { driver::mem::copy_batch_async(dsts, srcs, sizes, stream) }
    }

    fn buffer_id(&self, ptr: u64) -> Option<u64> {
        // SAFETY: the attribute's type is an unsigned long long; the driver checks `ptr`.
        unsafe {
            driver::pointer::attribute::<u64>(
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
                ptr,
            )
        }
        .ok()
    }

    fn home(&self, ptr: u64) -> Option<Home> {
        home::lookup(ptr)
    }

    fn pool_access(&self, ptr: u64, peer: usize, grant: bool) -> std::result::Result<(), String> {
        let ok = if grant {
            access::grant_pool_access(ptr, peer).is_ok()
        } else {
            access::pool_access(ptr, peer) == Some(true)
        };
        if ok {
            Ok(())
        } else {
            Err(format!(
                "Pool memory without cuMemPoolSetAccess for device {peer}"
            ))
        }
    }

    fn vmm_access(
        &self,
        range: VmmRange,
        peer: usize,
        grant: bool,
    ) -> std::result::Result<(), String> {
        access::vmm_access_at(range, peer, grant)
            .map_err(|why| format!("Vmm memory without cuMemSetAccess for device {peer}: {why}"))
    }
}

/// One copy as the driver takes it: `bytes` bytes from `src` to `dst`, queued on `stream`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Job {
    dst: u64,
    src: u64,
    bytes: usize,
    stream: sys::CUstream,
}

/// The contexts of a copy between two devices.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Contexts {
    src: sys::CUcontext,
    dst: sys::CUcontext,
}

/// How a lane queues a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// One device: `cuMemcpyDtoDAsync` on its stream.
    Same,
    /// Two devices with peer access: `cuMemcpyPeerAsync` on the source device's stream.
    Peer,
    /// Through pinned bounce chunks: the copier's stager queues it, not the lane.
    Staged,
}

/// Which buffer of a copy an access is remembered for: the source needs the destination
/// device's access, the destination the source device's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Side {
    Src,
    Dst,
}

/// An allocation's identity: its buffer id, or the buffer ids of the VMM mappings that hold it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    One(Side, u64),
    Many(Side, Vec<u64>),
}

/// The most identities a lane remembers; past it, it forgets them all (the ones of memory that
/// still exists are learnt again at its next copy).
const MAX_REMEMBERED: usize = 4096;

/// The copier's devices, contexts, stream and planned path, and the grants it has seen.
pub(crate) struct Lane {
    src: usize,
    dst: usize,
    contexts: Contexts,
    stream: sys::CUstream,
    route: Route,
    planned: CopyPath,
    grant: bool,
    granted: Mutex<HashSet<Key>>,
}

// SAFETY: the handles are driver handles, usable from any thread; the copier that owns the lane
// keeps the contexts and the stream alive (it holds their cudarc owners) for as long as the lane.
unsafe impl Send for Lane {}
// SAFETY: as above; the only mutable state is behind a mutex.
unsafe impl Sync for Lane {}

/// What a lane is made of: its devices, contexts, stream and planned path.
pub(crate) struct LaneParts {
    /// The source device.
    pub(crate) src: usize,
    /// The destination device.
    pub(crate) dst: usize,
    /// The source device's context (the one `stream` belongs to).
    pub(crate) src_ctx: sys::CUcontext,
    /// The destination device's context.
    pub(crate) dst_ctx: sys::CUcontext,
    /// The stream copies are queued on.
    pub(crate) stream: sys::CUstream,
    /// How copies are queued.
    pub(crate) route: Route,
    /// The path reported when nothing about the buffers changes it.
    pub(crate) planned: CopyPath,
    /// Grant pool and VMM memory the peer's access rather than only check it.
    pub(crate) grant: bool,
}

impl Lane {
    /// A lane from device `parts.src` to `parts.dst`, queueing on `parts.stream`; it remembers
    /// no grant yet.
    pub(crate) fn new(parts: LaneParts) -> Lane {
        let LaneParts {
            src,
            dst,
            src_ctx,
            dst_ctx,
            stream,
            route,
            planned,
            grant,
        } = parts;
        Lane {
            src,
            dst,
            contexts: Contexts {
                src: src_ctx,
                dst: dst_ctx,
            },
            stream,
            route,
            planned,
            grant,
            granted: Mutex::new(HashSet::new()),
        }
    }

    /// The path planned when the copier was made.
    pub(crate) fn planned(&self) -> &CopyPath {
        &self.planned
    }

    /// The true path of a copy from `src` to `dst` (buffers the copier validated: device
    /// memory of its source and destination devices): grants pool and VMM memory the peer's
    /// access on the peer route (or checks it), and says where an import lives elsewhere.
    pub(crate) fn path_for<X: CopyDriver, S: DeviceMemory, D: DeviceMemory>(
        &self,
        x: &X,
        src: &S,
        dst: &D,
    ) -> CopyPath {
        match self.route {
            Route::Staged => self.planned.clone(),
            Route::Same => {
                // Memory mapped here from another device (an import opened away from its home)
                // is addressed through this device, but the copy crosses a link.
                let away = |ptr| x.home(ptr).is_some_and(|h| h.is_away_from(self.src));
                if away(src.device_ptr()) || away(dst.device_ptr()) {
                    CopyPath::Peer
                } else {
                    CopyPath::SameDevice
                }
            }
            Route::Peer => {
                let s = self.access(x, src, Side::Src, self.dst);
                let d = self.access(x, dst, Side::Dst, self.src);
                match (s, d) {
                    (Ok(()), Ok(())) => CopyPath::Peer,
                    (s, d) => {
                        let why: Vec<String> = [("src", s), ("dst", d)]
                            .into_iter()
                            .filter_map(|(arg, r)| r.err().map(|w| format!("{arg} is {w}")))
                            .collect();
                        CopyPath::DriverStaged {
                            reason: why.join("; ").into(),
                        }
                    }
                }
            }
        }
    }

    /// Device `other`'s access to `mem`, where its kind needs a grant of its own: remembered by
    /// the allocation's identity once granted (or seen granted).
    fn access<X: CopyDriver, M: DeviceMemory>(
        &self,
        x: &X,
        mem: &M,
        side: Side,
        other: usize,
    ) -> std::result::Result<(), String> {
        let (ptr, len) = (mem.device_ptr(), mem.byte_len());
        match mem.kind() {
            MemoryKind::Pool => {
                let key = x.buffer_id(ptr).map(|id| Key::One(side, id));
                if key.as_ref().is_some_and(|k| self.knows(k)) {
                    return Ok(());
                }
                // The pool queries need a current context.
                // SAFETY: the copier keeps its source context alive.
                let _ = unsafe { x.bind(self.contexts.src) };
                x.pool_access(ptr, other, self.grant)?;
                self.remember(key);
                Ok(())
            }
            MemoryKind::Vmm => {
                // Every mapping (each physical chunk) carries its own access list: the identity
                // is that of every mapping holding the buffer's bytes.
                let known = mem.vmm_mappings();
                let key = known
                    .as_ref()
                    .and_then(|maps| access::covering(ptr, len, maps).ok())
                    .and_then(|maps| {
                        maps.iter()
                            .map(|&(base, _)| x.buffer_id(base))
                            .collect::<Option<Vec<u64>>>()
                    })
                    .map(|ids| Key::Many(side, ids));
                if key.as_ref().is_some_and(|k| self.knows(k)) {
                    return Ok(());
                }
                let range = VmmRange {
                    ptr,
                    len,
                    owner: mem.ordinal(),
                    known,
                };
                x.vmm_access(range, other, self.grant)?;
                self.remember(key);
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn knows(&self, key: &Key) -> bool {
        self.granted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(key)
    }

    fn remember(&self, key: Option<Key>) {
        let Some(key) = key else { return };
        let mut g = self.granted.lock().unwrap_or_else(|e| e.into_inner());
        if g.len() >= MAX_REMEMBERED {
            g.clear();
        }
        g.insert(key);
    }

    /// Queue the copy of `bytes` bytes from `src` to `dst` on the lane's stream (route
    /// [`Route::Same`] or [`Route::Peer`]): the lane's context made current if it is not, then
    /// the copy through the capture check ([`capture::enqueue_with`]). Nothing is queued for 0
    /// bytes.
    ///
    /// # Safety
    ///
    /// Both ranges are valid for `bytes` bytes (in the lane's contexts) until the copy completes
    /// (the caller owns both until a fence issued on the lane's stream afterwards completes), and
    /// `dst` is read or written by nobody else meanwhile. A refusal that says the work may sit in
    /// a graph ([`Refused::leaked`]) means the caller must leak what the copy uses.
    pub(crate) unsafe fn enqueue<X: CopyDriver>(
        &self,
        x: &X,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> std::result::Result<(), Refused<()>> {
        if bytes == 0 {
            return Ok(());
        }
        let job = Job {
            dst,
            src,
            bytes,
            stream: self.stream,
        };
        // SAFETY: forwarded from the caller.
        unsafe { self.queue(x, |x| self.copy_one(x, job)) }
    }

    /// One copy call on the lane's route.
    ///
    /// # Safety
    ///
    /// As [`enqueue`](Self::enqueue); the lane's source context is current.
    #[inline]
    unsafe fn copy_one<X: CopyDriver>(&self, x: &X, job: Job) -> Result<()> {
        // SAFETY: the caller's ranges; for peer copies both contexts are live primary contexts
        // with peer access enabled both ways (the copier's construction).
        unsafe {
            match self.route {
                Route::Same => x.copy_dtod(job),
                Route::Peer | Route::Staged => x.copy_peer(job, self.contexts),
            }
        }
    }

    /// The lane's source context made current if it is not, then `queue` behind the capture
    /// check ([`capture::enqueue_with`]).
    ///
    /// # Safety
    ///
    /// What `queue` enqueues meets [`enqueue`](Self::enqueue)'s rules.
    #[inline]
    unsafe fn queue<X: CopyDriver>(
        &self,
        x: &X,
        queue: impl FnOnce(&X) -> Result<()>,
    ) -> std::result::Result<(), Refused<()>> {
        // SAFETY: the copier keeps its source context alive.
        if let Err(error) = unsafe { x.bind(self.contexts.src) } {
            return Err(Refused {
                error,
                kept: Some(()),
            });
        }
        let call = match self.route {
            Route::Same => "cuMemcpyDtoDAsync_v2",
            Route::Peer | Route::Staged => "cuMemcpyPeerAsync",
        };
        x.enqueue(self.stream, call, || queue(x))
    }

    /// Queue `jobs` (`(dst, src, bytes)`, none empty) in order behind one capture check: one
    /// `cuMemcpyBatchAsync` when `batch` (every pair's path is the lane's own: peer, or one
    /// device) and the driver has it, else one copy call per job. On an error some jobs may be
    /// queued.
    ///
    /// # Safety
    ///
    /// As [`enqueue`](Self::enqueue), for every job.
    pub(crate) unsafe fn enqueue_batch<X: CopyDriver>(
        &self,
        x: &X,
        jobs: &[(u64, u64, usize)],
        batch: bool,
    ) -> std::result::Result<(), Refused<()>> {
        // SAFETY: every job meets `enqueue`'s rules (the caller's).
        unsafe {
            self.queue(x, |x| {
                if batch && jobs.len() >= 2 {
                    let mut dsts: Vec<u64> = jobs.iter().map(|j| j.0).collect();
                    let mut srcs: Vec<u64> = jobs.iter().map(|j| j.1).collect();
                    let mut sizes: Vec<usize> = jobs.iter().map(|j| j.2).collect();
                    // SAFETY: the caller's ranges; the stream is the lane's own, of the current
                    // context; three arrays of one length.
                    if x.copy_batch(&mut dsts, &mut srcs, &mut sizes, self.stream)? {
                        return Ok(());
                    }
                }
                for &(dst, src, bytes) in jobs {
                    let job = Job {
                        dst,
                        src,
                        bytes,
                        stream: self.stream,
                    };
                    self.copy_one(x, job)?;
                }
                Ok(())
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use std::cell::{Cell, RefCell};
    use std::collections::BTreeMap;

    /// Answers every driver call without a GPU, and counts them by name.
    #[derive(Default)]
    struct Fake {
        calls: RefCell<BTreeMap<&'static str, usize>>,
        /// The context `cuCtxGetCurrent` answers.
        current: Cell<usize>,
        /// `cuStreamIsCapturing` answers this.
        capturing: Cell<bool>,
        /// Pool buffers (by address) granted to the peer so far.
        pool_granted: RefCell<HashSet<u64>>,
        /// Imports mapped away from home.
        homes: RefCell<BTreeMap<u64, Home>>,
        /// Whether grants are refused.
        refuse: Cell<bool>,
        /// Whether the driver lacks `cuMemcpyBatchAsync`.
        no_batch: Cell<bool>,
    }

    impl Fake {
        fn count(&self, name: &'static str) {
            *self.calls.borrow_mut().entry(name).or_default() += 1;
        }
        fn take(&self) -> BTreeMap<&'static str, usize> {
            std::mem::take(&mut *self.calls.borrow_mut())
        }
    }

    impl CopyDriver for Fake {
        unsafe fn bind(&self, ctx: sys::CUcontext) -> Result<()> {
            self.count("cuCtxGetCurrent");
            if self.current.get() != ctx as usize {
                self.count("cuCtxSetCurrent");
                self.current.set(ctx as usize);
            }
            Ok(())
        }
        fn enqueue(
            &self,
            _: sys::CUstream,
            call: &'static str,
            queue: impl FnOnce() -> Result<()>,
        ) -> std::result::Result<(), Refused<()>> {
            struct Asked<'a>(&'a Fake);
            impl capture::Probe for Asked<'_> {
                fn capturing(&self) -> Result<bool> {
                    self.0.count("cuStreamIsCapturing");
                    Ok(self.0.capturing.get())
                }
                fn invalidate(&self) {
                    self.0.count("cuStreamQuery");
                }
            }
            capture::enqueue_probed(&Asked(self), call, (), |()| queue()).map(drop)
        }
        unsafe fn copy_dtod(&self, _: Job) -> Result<()> {
            self.count("cuMemcpyDtoDAsync_v2");
            Ok(())
        }
        unsafe fn copy_peer(&self, _: Job, _: Contexts) -> Result<()> {
            self.count("cuMemcpyPeerAsync");
            Ok(())
        }
        unsafe fn copy_batch(
            &self,
            _: &mut [u64],
            _: &mut [u64],
            _: &mut [usize],
            _: sys::CUstream,
        ) -> Result<bool> {
            self.count("cuMemcpyBatchAsync");
            Ok(!self.no_batch.get())
        }
        fn buffer_id(&self, ptr: u64) -> Option<u64> {
            self.count("cuPointerGetAttribute");
            Some(ptr ^ 0x5555)
        }
        fn home(&self, ptr: u64) -> Option<Home> {
            self.homes.borrow().get(&ptr).copied()
        }
        fn pool_access(&self, ptr: u64, _: usize, grant: bool) -> std::result::Result<(), String> {
            self.count("pool grant or check");
            if self.pool_granted.borrow().contains(&ptr) {
                return Ok(());
            }
            if grant && !self.refuse.get() {
                self.pool_granted.borrow_mut().insert(ptr);
                return Ok(());
            }
            Err("not granted".into())
        }
        fn vmm_access(
            &self,
            range: VmmRange,
            _: usize,
            grant: bool,
        ) -> std::result::Result<(), String> {
            self.count("vmm grant or check");
            if grant && range.known.is_some() {
                Ok(())
            } else {
                Err("not granted".into())
            }
        }
    }

    /// A buffer of any kind at any address (never dereferenced: the fake driver copies nothing).
    struct Mem {
        ptr: u64,
        len: usize,
        ordinal: usize,
        kind: MemoryKind,
        maps: Option<Vec<(u64, usize)>>,
    }

    // SAFETY: never dereferenced; only the fake driver sees the addresses.
    unsafe impl DeviceMemory for Mem {
        type Elem = u8;
        fn device_ptr(&self) -> u64 {
            self.ptr
        }
        fn len(&self) -> usize {
            self.len
        }
        fn ordinal(&self) -> usize {
            self.ordinal
        }
        fn kind(&self) -> MemoryKind {
            self.kind
        }
        fn vmm_mappings(&self) -> Option<Vec<(u64, usize)>> {
            self.maps.clone()
        }
    }

    fn mem(ptr: u64, ordinal: usize, kind: MemoryKind) -> Mem {
        Mem {
            ptr,
            len: 4096,
            ordinal,
            kind,
            maps: None,
        }
    }

    const CTX0: usize = 0x1000;
    const CTX1: usize = 0x2000;

    /// A fake driver, a lane between the buffers' devices (the route from them), its source
    /// context current, and the two buffers.
    fn setup(
        (s, sk): (usize, MemoryKind),
        (d, dk): (usize, MemoryKind),
        grant: bool,
    ) -> (Fake, Lane, Mem, Mem) {
        let route = if s == d { Route::Same } else { Route::Peer };
        let (x, l) = (Fake::default(), lane(s, d, route, grant));
        x.current.set(if s == 0 { CTX0 } else { CTX1 });
        (x, l, mem(0x10_0000, s, sk), mem(0x20_0000, d, dk))
    }

    fn lane(src: usize, dst: usize, route: Route, grant: bool) -> Lane {
        let planned = match route {
            Route::Same => CopyPath::SameDevice,
            _ => CopyPath::Peer,
        };
        let ctx = |o: usize| (if o == 0 { CTX0 } else { CTX1 }) as sys::CUcontext;
        Lane::new(LaneParts {
            src,
            dst,
            src_ctx: ctx(src),
            dst_ctx: ctx(dst),
            stream: 0x3000 as sys::CUstream,
            route,
            planned,
            grant,
        })
    }

    /// One copy as the copier makes it: the path, then the enqueue.
    fn copy(l: &Lane, x: &Fake, src: &Mem, dst: &Mem) -> CopyPath {
        let path = l.path_for(x, src, dst);
        // SAFETY: the fake driver touches no memory.
        unsafe { l.enqueue(x, dst.ptr, src.ptr, src.len) }
            .map_err(|r| r.error)
            .unwrap();
        path
    }

    fn counts(pairs: &[(&'static str, usize)]) -> BTreeMap<&'static str, usize> {
        pairs.iter().copied().collect()
    }

    #[test]
    fn a_peer_copy_of_cumemalloc_memory_makes_four_driver_calls() {
        let (x, l, a, b) = setup((0, MemoryKind::Device), (1, MemoryKind::Device), true);
        for _ in 0..64 {
            assert_eq!(copy(&l, &x, &a, &b), CopyPath::Peer);
        }
        assert_eq!(
            x.take(),
            counts(&[
                ("cuCtxGetCurrent", 64),
                ("cuMemcpyPeerAsync", 64),
                ("cuStreamIsCapturing", 128),
            ]),
            "no attribute query, no event, no context switch"
        );
    }

    #[test]
    fn a_batch_is_one_driver_call_behind_one_capture_check() {
        let (x, l, a, b) = setup((0, MemoryKind::Device), (1, MemoryKind::Device), true);
        let jobs: Vec<(u64, u64, usize)> = (0..64).map(|i| (b.ptr + i, a.ptr + i, 1)).collect();
        // SAFETY: no driver behind `Fake`.
        assert!(unsafe { l.enqueue_batch(&x, &jobs, true) }.is_ok());
        assert_eq!(
            x.take(),
            counts(&[
                ("cuCtxGetCurrent", 1),
                ("cuMemcpyBatchAsync", 1),
                ("cuStreamIsCapturing", 2),
            ]),
            "64 copies in one call"
        );
        // A driver without the call: one copy each, still one capture check.
        x.no_batch.set(true);
        // SAFETY: as above.
        assert!(unsafe { l.enqueue_batch(&x, &jobs, true) }.is_ok());
        assert_eq!(
            x.take(),
            counts(&[
                ("cuCtxGetCurrent", 1),
                ("cuMemcpyBatchAsync", 1),
                ("cuMemcpyPeerAsync", 64),
                ("cuStreamIsCapturing", 2),
            ])
        );
        // A pair off the lane's own path (or a batch of one): never batched.
        x.no_batch.set(false);
        // SAFETY: as above.
        assert!(unsafe { l.enqueue_batch(&x, &jobs, false) }.is_ok());
        // SAFETY: as above.
        assert!(unsafe { l.enqueue_batch(&x, &jobs[..1], true) }.is_ok());
        let c = x.take();
        assert_eq!(c.get("cuMemcpyBatchAsync"), None);
        assert_eq!(c["cuMemcpyPeerAsync"], 65);
        // Capturing: nothing queued, a typed refusal.
        x.capturing.set(true);
        // SAFETY: as above.
        let r = unsafe { l.enqueue_batch(&x, &jobs, true) };
        assert!(matches!(
            r,
            Err(Refused {
                error: crate::Error::StreamCapturing { .. },
                ..
            })
        ));
        assert_eq!(x.take().get("cuMemcpyBatchAsync"), None);
    }

    #[test]
    fn a_context_switch_costs_one_call_more() {
        let (x, l, a, b) = setup((0, MemoryKind::Device), (1, MemoryKind::Device), true);
        x.current.set(CTX1); // another copier's context, as both ways on one thread
        copy(&l, &x, &a, &b);
        copy(&l, &x, &a, &b);
        assert_eq!(x.take()["cuCtxSetCurrent"], 1, "bound once, then current");
    }

    #[test]
    fn a_same_device_copy_makes_four_driver_calls_and_says_so() {
        let (x, l, a, b) = setup((0, MemoryKind::Pool), (0, MemoryKind::Vmm), true);
        assert_eq!(copy(&l, &x, &a, &b), CopyPath::SameDevice);
        assert_eq!(
            x.take(),
            counts(&[
                ("cuCtxGetCurrent", 1),
                ("cuMemcpyDtoDAsync_v2", 1),
                ("cuStreamIsCapturing", 2),
            ])
        );
    }

    #[test]
    fn an_import_mapped_away_from_home_is_reported_as_crossing_a_link() {
        let (x, l, a, b) = setup((1, MemoryKind::Device), (1, MemoryKind::Device), true);
        x.homes.borrow_mut().insert(a.ptr, Home::Device(0));
        assert_eq!(copy(&l, &x, &a, &b), CopyPath::Peer, "not same_device");
        assert_eq!(
            x.take()["cuMemcpyDtoDAsync_v2"],
            1,
            "one context: a DtoD copy"
        );
        x.homes.borrow_mut().clear();
        x.homes.borrow_mut().insert(b.ptr, Home::NotVisible);
        assert_eq!(copy(&l, &x, &a, &b), CopyPath::Peer);
        x.homes.borrow_mut().clear();
        assert_eq!(copy(&l, &x, &a, &b), CopyPath::SameDevice);
    }

    #[test]
    fn pool_grants_are_decided_once_per_allocation() {
        let (x, l, a, b) = setup((0, MemoryKind::Pool), (1, MemoryKind::Pool), true);
        assert_eq!(copy(&l, &x, &a, &b), CopyPath::Peer);
        let first = x.take();
        assert_eq!(first["pool grant or check"], 2);
        for _ in 0..10 {
            assert_eq!(copy(&l, &x, &a, &b), CopyPath::Peer);
        }
        assert_eq!(
            x.take(),
            counts(&[
                ("cuCtxGetCurrent", 10),
                ("cuMemcpyPeerAsync", 10),
                ("cuPointerGetAttribute", 20),
                ("cuStreamIsCapturing", 20),
            ]),
            "one buffer-id query per pool buffer, no grant queries"
        );
        // Another allocation (a new buffer id, even at a reused address) is decided again.
        let c = mem(0x30_0000, 0, MemoryKind::Pool);
        copy(&l, &x, &c, &b);
        assert_eq!(x.take()["pool grant or check"], 1);
    }

    #[test]
    fn a_missing_grant_is_asked_again_at_every_copy_and_reported() {
        let (x, l, a, b) = setup((0, MemoryKind::Pool), (1, MemoryKind::Device), false);
        for _ in 0..3 {
            let p = copy(&l, &x, &a, &b);
            assert_eq!(p.name(), "driver_staged", "{p}");
            assert!(p.to_string().contains("src is"), "{p}");
        }
        assert_eq!(
            x.take()["pool grant or check"],
            3,
            "failures are not remembered"
        );
        // Granted by someone else meanwhile: seen at the next copy, then remembered.
        x.pool_granted.borrow_mut().insert(a.ptr);
        assert_eq!(copy(&l, &x, &a, &b), CopyPath::Peer);
        assert_eq!(copy(&l, &x, &a, &b), CopyPath::Peer);
        assert_eq!(x.take()["pool grant or check"], 1);
    }

    #[test]
    fn vmm_grants_are_remembered_by_the_mappings_that_hold_the_buffer() {
        let (x, l) = (Fake::default(), lane(0, 1, Route::Peer, true));
        x.current.set(CTX0);
        let g = 2 << 20;
        let base = 0x7f00_0000_0000u64;
        let maps = vec![(base, g), (base + g as u64, g)];
        // Two views of one chunked buffer: one in each chunk.
        let first = Mem {
            ptr: base,
            len: 4096,
            ordinal: 0,
            kind: MemoryKind::Vmm,
            maps: Some(maps.clone()),
        };
        let second = Mem {
            ptr: base + g as u64,
            ..first_clone(&first)
        };
        let dst = mem(0x20_0000, 1, MemoryKind::Device);
        copy(&l, &x, &first, &dst);
        copy(&l, &x, &first, &dst);
        assert_eq!(x.take()["vmm grant or check"], 1, "remembered");
        copy(&l, &x, &second, &dst);
        let c = x.take();
        assert_eq!(
            c["vmm grant or check"], 1,
            "the other chunk is another identity"
        );
        assert_eq!(c["cuPointerGetAttribute"], 1, "one query per mapping held");
        // Memory that does not know its mappings is checked at every copy.
        let foreign = mem(base, 0, MemoryKind::Vmm);
        for _ in 0..2 {
            assert_eq!(copy(&l, &x, &foreign, &dst).name(), "driver_staged");
        }
        assert_eq!(x.take()["vmm grant or check"], 2);
    }

    fn first_clone(m: &Mem) -> Mem {
        Mem {
            ptr: m.ptr,
            len: m.len,
            ordinal: m.ordinal,
            kind: m.kind,
            maps: m.maps.clone(),
        }
    }

    #[test]
    fn a_capturing_stream_gets_no_copy() {
        let (x, l) = (Fake::default(), lane(0, 1, Route::Peer, true));
        x.capturing.set(true);
        // SAFETY: the fake driver touches no memory.
        let r = unsafe { l.enqueue(&x, 0x20_0000, 0x10_0000, 4096) };
        let r = r.unwrap_err();
        assert!(!r.leaked(), "refused before anything was queued");
        assert!(
            matches!(
                r.error,
                Error::StreamCapturing {
                    enqueued: false,
                    ..
                }
            ),
            "{}",
            r.error
        );
        assert_eq!(x.take().get("cuMemcpyPeerAsync"), None);
        // Nothing at all for an empty copy.
        x.capturing.set(false);
        // SAFETY: as above.
        unsafe { l.enqueue(&x, 0x20_0000, 0x10_0000, 0) }
            .map_err(|r| r.error)
            .unwrap();
        assert!(x.take().is_empty());
    }

    #[test]
    fn the_remembered_identities_are_bounded() {
        let (x, l) = (Fake::default(), lane(0, 1, Route::Peer, true));
        let dst = mem(0x20_0000, 1, MemoryKind::Device);
        for i in 0..(MAX_REMEMBERED as u64 + 10) {
            let a = mem(0x1000_0000 + i * 4096, 0, MemoryKind::Pool);
            l.path_for(&x, &a, &dst);
        }
        assert!(l.granted.lock().unwrap().len() <= MAX_REMEMBERED);
        // A refused grant is remembered nowhere.
        x.refuse.set(true);
        let a = mem(0x9000_0000, 0, MemoryKind::Pool);
        assert_eq!(l.path_for(&x, &a, &dst).name(), "driver_staged");
        assert!(!l.knows(&Key::One(Side::Src, a.ptr ^ 0x5555)));
    }
}
