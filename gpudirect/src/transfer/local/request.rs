//! An intra-node request: every range checked, the peer's allocations mapped (once, held by the
//! side), the copies queued on the calling thread's lane's streams and handed to the worker; prepared once
//! and posted many times; or queued on a caller's stream (stream-ordered).

use super::copies::{
    Events, Held, Imports, Keep, Parking, Piece, all_local_on, enqueue, park_imports, path_of,
    queue_copies, runs_long,
};
use super::fds::{PeerFd, fd_said, what};
use super::import::{Import, import, import_pool, import_pool_ptr, import_vmm, ordinal_of_uuid};
use super::kernel::{self, CopyKernel, Gather, Launcher, Lease};
use super::side::{IDLE_LOOK, Job, Lane, Side, lock};
use super::state::State;
use crate::completion::{EventFence, Fence, StreamFence, Tracker, capture, deadline_after};
use crate::cuda::Stream;
use crate::error::{Error, Result};
use crate::transfer::descriptor::RemoteRange;
use crate::transfer::descriptor::{IpcKind, IpcPart};
use crate::transfer::engine::EngineInner;
use crate::transfer::pending::Transfer;
use crate::transfer::region::{FdOf, LocalRange, MemoryPath};
use crate::transfer::request::{
    Broken, Direction, TransferOptions, TransferReport, check_pairs, check_same_engine, pairs_bytes,
};
use crate::transfer::shared::EpInner;
use crate::transfer::stream::{Mark, TriggerFence, Unmade};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// The side holds the imports a request used for as long as it lives (the next requests find
/// them mapped). Called once the copies are queued: nothing here delays them.
fn hold_imports(side: &Side, imports: &[Arc<Import>]) {
    if imports.is_empty() {
        return;
    }
    let mut held = lock(&side.held);
    for imp in imports {
        if !held.iter().any(|x| Arc::ptr_eq(x, imp)) {
            held.push(imp.clone());
        }
    }
}

/// A request checked and mapped, its copies not yet queued.
struct Prepared {
    copies: Vec<Piece>,
    /// Per pair: the local GPU (`None`: host memory) and the peer's GPU, for its path.
    gpus: Vec<(Option<usize>, usize)>,
    imports: Imports,
    timeout: Duration,
    started: Instant,
    deadline: Instant,
    epoch: u64,
}

/// Every range checked, the peer's allocations mapped (once, held by the side).
fn prepare(
    ep: &EpInner<State>,
    side: &Side,
    dir: Direction,
    pairs: &[(LocalRange, RemoteRange)],
    opts: &TransferOptions,
) -> Result<Prepared> {
    let e = &ep.engine.inner;
    check_pairs(dir, pairs, opts)?;
    check_same_engine(e.engine_id, pairs)?;
    let epoch = side.epoch.load(Ordering::Acquire);
    if let Some(err) = ep.failure() {
        return Err(err);
    }
    let any_fd = check_ipc_parts(pairs)?;
    let (exporter, this_process, fds) = peer_fds(side, pairs, any_fd)?;
    // A reconnect moves the epoch before it puts in its new connection: the connection just
    // read belongs to `epoch` only if the epoch has not moved (else a request checked against
    // the old connection would map the new peer's memory at the old descriptors' places).
    if let Some(err) = ended_since(ep, side, epoch) {
        return Err(err);
    }
    check_peer_fds(pairs, &fds)?;
    refuse_own_process(this_process)?;
    let timeout = opts.deadline.unwrap_or(e.config.deadline);
    let started = Instant::now();
    let deadline = deadline_after(started, timeout);
    let Mapping {
        copies,
        gpus,
        imports,
    } = map_pairs(e, dir, pairs, exporter, &fds)?;
    Ok(Prepared {
        copies,
        gpus,
        imports,
        timeout,
        started,
        deadline,
        epoch,
    })
}

/// Every remote range has a CUDA IPC part; returns whether any names an exported file
/// descriptor (VMM or pool memory).
fn check_ipc_parts(pairs: &[(LocalRange, RemoteRange)]) -> Result<bool> {
    let mut any_fd = false;
    for (i, (_, r)) in pairs.iter().enumerate() {
        let Some(ipc) = r.descriptor().ipc() else {
            return Err(Error::invalid(
                "pairs",
                i,
                "the remote memory has no CUDA IPC part: an intra-node endpoint reaches only GPU \
                 memory its owner could export (cuMemAlloc memory such as a DeviceBuffer, by its \
                 cuIpc handle; VMM memory inside one physical allocation such as a VmmBuffer, by \
                 its file descriptor; an allocation of an exportable pool, an IpcPool's \
                 PoolAlloc, by the pool's file descriptor and its pointer export data); host \
                 memory and memory of a pool without a shareable handle type (the device's \
                 default pool: cudarc's CudaSlice, a PoolBuffer) are not exported",
            ));
        };
        any_fd |= fd_said(ipc).is_some();
    }
    Ok(any_fd)
}

/// The exported file descriptor a remote range's IPC part names, and what it says it is.
fn said(r: &RemoteRange) -> Option<(u64, FdOf)> {
    r.descriptor().ipc().and_then(fd_said)
}

/// Pair `i`'s file descriptor from the peer, if it sent one.
fn fd_of(fds: &[Option<PeerFd>], i: usize) -> Option<&PeerFd> {
    fds.get(i).and_then(Option::as_ref)
}

/// The peer's pid as the kernel gives it, whether that is this process, and the file
/// descriptor it sent for each pair (none looked up when `any_fd` is false).
fn peer_fds(
    side: &Side,
    pairs: &[(LocalRange, RemoteRange)],
    any_fd: bool,
) -> Result<(u32, bool, Vec<Option<PeerFd>>)> {
    // Only VMM and pool memory need the peer's fds (cuIpc handles: none to look up, nothing
    // allocated).
    let wanted: Vec<Option<u64>> = if any_fd {
        pairs
            .iter()
            .map(|(_, r)| said(r).map(|(id, _)| id))
            .collect()
    } else {
        Vec::new()
    };
    side.peer(&wanted).ok_or_else(|| Broken::Closed.to_error())
}

/// VMM and pool memory: mapped from the file descriptor the peer sent when the endpoints met,
/// which the descriptor must describe as the peer's first message did. Checked before any
/// CUDA call.
fn check_peer_fds(pairs: &[(LocalRange, RemoteRange)], fds: &[Option<PeerFd>]) -> Result<()> {
    for (i, (_, r)) in pairs.iter().enumerate() {
        let (Some((id, of)), Some(ipc)) = (said(r), r.descriptor().ipc()) else {
            continue;
        };
        let memory = match of {
            FdOf::Vmm { .. } => "VMM memory",
            FdOf::Pool => "pool memory",
        };
        match fd_of(fds, i) {
            None => {
                return Err(Error::invalid(
                    "pairs",
                    i,
                    format!(
                        "the remote memory is {memory} (the peer's export {id}) whose file \
                         descriptor did not come when this endpoint met its peer: {memory} \
                         must be published when the endpoints meet (among the descriptors given \
                         to connect_local or accept); a descriptor handed over otherwise cannot \
                         be mapped"
                    ),
                ));
            }
            Some(f) if f.of != of || f.uuid != *ipc.gpu_uuid() => {
                return Err(Error::invalid(
                    "pairs",
                    i,
                    format!(
                        "the remote descriptor says the peer's export {id} is {}; the peer \
                         published it as {} (or on another GPU)",
                        what(of),
                        what(f.of)
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// The kernel's word, not the peer's first message: a peer that claims another pid is still
/// this process.
fn refuse_own_process(this_process: bool) -> Result<()> {
    if this_process {
        return Err(Error::Unsupported {
            what: "an intra-node transfer between two endpoints of one process".into(),
            reason: "CUDA IPC maps no allocation in the process that exported it: copy between \
                     the buffers directly"
                .into(),
        });
    }
    Ok(())
}

/// A request's pairs mapped: the copies, each pair's (local GPU, peer GPU), and the peer's
/// allocations they reach.
struct Mapping {
    copies: Vec<Piece>,
    gpus: Vec<(Option<usize>, usize)>,
    imports: Imports,
}

/// Each pair's copy: the local address, the peer's allocation mapped (once per allocation of
/// consecutive pairs), the remote range checked inside it. The imports taken are parked (not
/// closed here) if a pair is refused.
fn map_pairs(
    e: &EngineInner,
    dir: Direction,
    pairs: &[(LocalRange, RemoteRange)],
    exporter: u32,
    fds: &[Option<PeerFd>],
) -> Result<Mapping> {
    let mut copies = Vec::with_capacity(pairs.len());
    let mut imports = Parking(Imports::new());
    let mut gpus = Vec::with_capacity(pairs.len());
    // The previous pair's peer allocation, local GPU, the peer's GPU and its import: pairs into
    // one allocation (many small ranges of one buffer) look it up once.
    let mut last: Option<(IpcPart, usize, usize, Arc<Import>)> = None;
    for (i, (l, r)) in pairs.iter().enumerate() {
        let ipc = r.descriptor().ipc().expect("checked above");
        let (local_gpu, laddr) = local_address(l, i)?;
        let device = local_gpu.unwrap_or(0);
        let same = last
            .as_ref()
            .filter(|(p, d, ..)| p == ipc && *d == device)
            .map(|(_, _, g, imp)| (*g, imp.clone()));
        let peer_gpu = match &same {
            Some((g, _)) => *g,
            None => peer_gpu(ipc, i)?,
        };
        let (off, end) = remote_span(ipc, r, i)?;
        let imp = match same {
            Some((_, imp)) => imp,
            None => {
                let from = Exporter {
                    pid: exporter,
                    fd: fd_of(fds, i),
                    gpu: peer_gpu,
                };
                map_allocation(e, ipc, device, &from, i)?
            }
        };
        // Kept (and parked if the request is refused) before anything can fail.
        if !imports.0.iter().any(|x| Arc::ptr_eq(x, &imp)) {
            imports.0.push(imp.clone());
        }
        if end > imp.size {
            return Err(Error::invalid(
                "pairs",
                i,
                format!(
                    "the remote range ends at byte {end} of an allocation mapped with {} bytes",
                    imp.size
                ),
            ));
        }
        // off < end <= size, and base + size fits (a live mapping).
        let raddr = imp.base + off;
        let (dst, src) = match dir {
            Direction::Write => (raddr, laddr),
            Direction::Read => (laddr, raddr),
        };
        copies.push(Piece {
            dst,
            src,
            len: r.len(),
            device,
        });
        gpus.push((local_gpu, peer_gpu));
        last = Some((*ipc, device, peer_gpu, imp));
    }
    drop(last);
    let imports = std::mem::take(&mut imports.0);
    Ok(Mapping {
        copies,
        gpus,
        imports,
    })
}

/// Pair `i`'s local memory: its GPU (`None`: host memory) and address.
fn local_address(l: &LocalRange, i: usize) -> Result<(Option<usize>, u64)> {
    Ok(match l.region.device_addr(l.offset) {
        Some((o, a)) => (Some(o), a),
        None => (
            None,
            l.region
                .host_addr(l.offset)
                .ok_or_else(|| Error::invalid("pairs", i, "local memory has no address"))?
                as u64,
        ),
    })
}

/// The ordinal here of the GPU holding pair `i`'s remote memory (by its UUID).
fn peer_gpu(ipc: &IpcPart, i: usize) -> Result<usize> {
    ordinal_of_uuid(ipc.gpu_uuid())?.ok_or_else(|| Error::NoDevice {
        what: "the peer's GPU",
        reason: format!(
            "no visible GPU has the UUID {} of pair {i}'s remote memory (another \
         CUDA_VISIBLE_DEVICES?)",
            ipc.gpu_uuid()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        ),
    })
}

/// Where pair `i`'s remote range lies in the peer's allocation (offset, end): inside the length
/// the peer claims, checked before anything is mapped (the mapping's real size is checked
/// once it is mapped).
fn remote_span(ipc: &IpcPart, r: &RemoteRange, i: usize) -> Result<(u64, u64)> {
    let off = ipc.offset().checked_add(r.offset());
    let end = off.and_then(|o| o.checked_add(r.len()));
    let (Some(off), Some(end)) = (off, end) else {
        return Err(Error::invalid("pairs", i, "the remote range overflows"));
    };
    if end > ipc.alloc_len() {
        return Err(Error::invalid(
            "pairs",
            i,
            format!(
                "the remote range ends at byte {end} of an allocation the peer says holds {}",
                ipc.alloc_len()
            ),
        ));
    }
    Ok((off, end))
}

/// Who exported a pair's memory: the peer's pid (the kernel's word), the file descriptor it
/// sent for the pair (VMM, pool), and the GPU holding the memory.
struct Exporter<'a> {
    pid: u32,
    fd: Option<&'a PeerFd>,
    gpu: usize,
}

/// The peer's allocation behind `ipc` mapped for local GPU `device` (once per allocation and
/// GPU in the process).
fn map_allocation(
    e: &EngineInner,
    ipc: &IpcPart,
    device: usize,
    from: &Exporter<'_>,
    i: usize,
) -> Result<Arc<Import>> {
    let peer_gpu = from.gpu;
    let home = || crate::p2p::link::bus_id_of(peer_gpu).ok();
    Ok(match (ipc.kind(), from.fd) {
        (IpcKind::CudaIpcHandle { handle }, _) => {
            import(handle, device, ipc.alloc_len(), home, &e.stats.imports)?
        }
        (IpcKind::VmmFd { export_id }, Some(f)) => import_vmm(
            from.pid,
            *export_id,
            device,
            &f.fd,
            ipc.alloc_len(),
            home,
            &e.stats.imports,
        )?,
        (
            IpcKind::PoolPtr {
                pool_export_id,
                ptr_data,
            },
            Some(f),
        ) => {
            // The pool is imported on the GPU that holds it (a refusal after a first
            // import destroys it here, on the caller's thread: no pointer is in it yet).
            let pool = import_pool(
                from.pid,
                *pool_export_id,
                &f.fd,
                peer_gpu,
                device,
                &e.stats.pool_imports,
            )?;
            import_pool_ptr(&pool, ptr_data, ipc.alloc_len(), &e.stats.imports)?
        }
        (IpcKind::VmmFd { .. } | IpcKind::PoolPtr { .. }, None) => {
            return Err(Error::invalid(
                "pairs",
                i,
                "no exported file descriptor (checked above)",
            ));
        }
    })
}

/// The intra-node request: every range checked, the peer's allocations mapped (once), the
/// copies queued on the calling thread's lane's streams and handed to the worker.
pub(super) fn request(
    ep: &EpInner<State>,
    side: &Side,
    dir: Direction,
    pairs: Vec<(LocalRange, RemoteRange)>,
    opts: TransferOptions,
) -> Result<Transfer> {
    // Before anything is mapped: a refusal takes nothing.
    let bytes = pairs_bytes(&pairs)?;
    let Prepared {
        copies,
        gpus,
        imports,
        timeout,
        started,
        deadline,
        epoch,
    } = prepare(ep, side, dir, &pairs, &opts)?;
    let lane = side.lane_here();
    // Refused here, the imports are parked (as a refused request's are), not closed on this
    // thread.
    let streams = match streams_for(lane, &copies) {
        Ok(s) => s,
        Err(e) => {
            park_imports(imports);
            return Err(e);
        }
    };
    // The pairs themselves hold the regions: nothing to copy before the copies start.
    let keep = Keep {
        _pairs: pairs,
        _imports: imports,
        _held: None,
    };
    let report = report(dir, bytes, 0, Vec::new(), &opts);
    let when = When {
        started,
        deadline,
        timeout,
        epoch,
    };
    let job = Issue {
        streams: &streams,
        copies: &copies,
        gpus: &gpus,
        keep,
        report,
        when,
    };
    issue(ep, side, lane, job)
}

/// The streams of each local GPU a request's copies start from: (ordinal, its streams).
type GpuStreams = Vec<(usize, Arc<[Stream]>)>;

/// The streams on `lane` of each local GPU the copies start from (one GPU, almost always).
fn streams_for(lane: &Lane, copies: &[Piece]) -> Result<GpuStreams> {
    let mut streams: GpuStreams = Vec::with_capacity(1);
    for c in copies {
        if !streams.iter().any(|(d, _)| *d == c.device) {
            streams.push((c.device, lane.streams_of(c.device)?));
        }
    }
    Ok(streams)
}

/// When a request was made and must end, and the endpoint's epoch it belongs to.
struct When {
    started: Instant,
    deadline: Instant,
    timeout: Duration,
    epoch: u64,
}

/// A checked request, its copies ready to queue ([`issue`]).
struct Issue<'a> {
    /// The streams of each local GPU the copies start from.
    streams: &'a [(usize, Arc<[Stream]>)],
    copies: &'a [Piece],
    /// Per pair: the local GPU (`None`: host memory) and the peer's GPU, for its path.
    gpus: &'a [(Option<usize>, usize)],
    /// What the copies reach.
    keep: Keep,
    /// The report, with no paths and no message count yet: they are set when the copies are
    /// queued.
    report: TransferReport,
    when: When,
}

/// Queue a checked request's copies on `lane` (`job.streams` are its) and hand it to the
/// worker.
fn issue(ep: &EpInner<State>, side: &Side, lane: &Arc<Lane>, job: Issue<'_>) -> Result<Transfer> {
    let Issue {
        streams,
        copies,
        gpus,
        keep,
        mut report,
        when,
    } = job;
    let e = &ep.engine.inner;
    let eager = report.notified.is_some();
    // Under the lane's issue lock, queued then pushed: the lane's streams' order is its queue's.
    // (The worker takes only the queue's lock, briefly.)
    let mut issue = lock(&lane.issue);
    if let Some(err) = ended_since(ep, side, when.epoch) {
        // Nothing queued: the imports are parked, as a refused request's are.
        park_imports(keep._imports);
        return Err(err);
    }
    let gather = gatherable(e, &mut issue, streams, copies, gpus, report.bytes);
    let (gather, fence, keep) = match gather {
        Some((stream, kernel, true)) => {
            // Its pieces wait with the others for one launch: pushed first, so that a closed
            // endpoint's refusal leaves nothing waiting.
            let fence = Arc::new(Events::later());
            report.messages = copies.len() as u64;
            (Gathered::Waits(stream, kernel), fence, keep)
        }
        at_once => {
            // Requests waiting for a launch go first: the stream keeps the lane's order, and
            // this one's copies follow at once.
            issue.flush();
            lane.gathering.store(false, Ordering::Release);
            let mark = runs_long(report.bytes, gpus);
            let launch = at_once.as_ref().map(|(stream, kernel, _)| (stream, kernel));
            // SAFETY: `gatherable` checked the stream (the lane's private one of the pieces'
            // GPU), the launcher (its context's) and every piece (some bytes, for the kernel it
            // fits; local memory on that GPU; both ranges checked by `prepare`), which `keep`
            // holds.
            let (fence, keep, messages) = unsafe {
                launch_or_enqueue(launch, streams, copies, e.config.copy_chunk, keep, mark)
            }?;
            report.messages = messages;
            (Gathered::No, Arc::new(fence), keep)
        }
    };
    // From here on the copies run (or wait for the launch that holds the lane's order): what is
    // left costs them nothing.
    hold_imports(side, &keep._imports);
    report.paths = gpus.iter().map(|&(l, p)| path_of(l, p)).collect();
    // Made once the copies are queued: a request refused before has no transfer to end. What
    // the copies reach is the job's to hold (`keep`), not the transfer's.
    let (transfer, finish) =
        Transfer::pending(when.timeout, crate::transfer::region::Regions::new());
    // A caller waiting for it finishes what is done first on its lane itself. The
    // worker is woken when the request is issued only if someone else sees it finish (its
    // notification); otherwise when the transfer is looked at without a blocking wait, or goes
    // unfinished (a blocking wait finishes it alone, without the worker's wake-up and its polls
    // beside the caller's copies, which slow a small request: see docs/transfer.md).
    transfer.set_finisher(lane.finisher());
    let job = Job {
        fence: fence.clone(),
        keep,
        finish: Box::new(finish),
        report,
        started: when.started,
        deadline: when.deadline,
        timeout: when.timeout,
        epoch: when.epoch,
        seq: 0,
    };
    // A request that waits for a launch with a deadline within the idle worker's look wakes
    // it: left until that look, it would end late though its copies take microseconds.
    let eager = eager || matches!(gather, Gathered::Waits(..)) && when.timeout <= IDLE_LOOK;
    let refused = side.push_job(lane.index, job, eager);
    match gather {
        Gathered::Waits(stream, kernel) if refused.is_none() => {
            // SAFETY: `gatherable` checked the stream (the lane's private one of the pieces'
            // GPU), the launcher (its context's) and every piece (some bytes, for the kernel it
            // fits; local memory on that GPU; both ranges checked by `prepare`); the job holds
            // what they reach until `fence` is complete, and parks it behind `fence` if it ends
            // first.
            unsafe { issue.add(&stream, kernel, copies, fence, when.epoch) };
            lane.gathering.store(!issue.is_empty(), Ordering::Release);
        }
        // Refused (the endpoint closed): nothing queued for it.
        Gathered::Waits(..) => fence.gathered(Ok(None)),
        Gathered::No => {}
    }
    drop(issue);
    if let Some(job) = refused {
        side.end_unqueued(job);
    }
    Ok(transfer)
}

/// Queue a request's `copies` at once: in launches of `launch`'s launcher on its stream
/// ([`kernel::launch_now`]) or, without one or where no graph launched (the driver would not
/// make one; the lane's graphs are refused from now on), on the copy engines ([`enqueue`], the
/// pieces spread over `streams` in chunks of `chunk` bytes). The fence, what the request holds,
/// and how many copies went; `mark` as both take it.
///
/// # Safety
///
/// As [`kernel::launch_now`] for `launch`.
unsafe fn launch_or_enqueue(
    launch: Option<(&Stream, &Launcher)>,
    streams: &[(usize, Arc<[Stream]>)],
    copies: &[Piece],
    chunk: usize,
    keep: Keep,
    mark: bool,
) -> Result<(Events, Keep, u64)> {
    let keep = match launch {
        Some((stream, kernel)) => {
            // SAFETY: the caller's promises.
            match unsafe { kernel::launch_now(stream, kernel, copies, keep, mark) } {
                Ok((fence, keep)) => return Ok((fence, keep, copies.len() as u64)),
                Err((_, Some(keep))) => *keep,
                Err((err, None)) => return Err(err),
            }
        }
        None => keep,
    };
    enqueue(streams, copies, chunk as u64, keep, mark)
}

/// Whether a request's copies wait for a gather launch ([`issue`]).
enum Gathered {
    /// They wait, to go on this stream with this kernel.
    Waits(Stream, Launcher),
    /// They were queued at once.
    No,
}

/// Where a request's copies go in gather launches, if they may, and whether they wait for the
/// lane's next one (`true`) or go at once (after those waiting). They may with the copy kernel
/// allowed ([`EngineConfig::copy_kernel`](crate::transfer::EngineConfig::copy_kernel)) or,
/// without it, with copy graphs
/// ([`EngineConfig::copy_graphs`](crate::transfer::EngineConfig::copy_graphs)): at most
/// [`kernel::GATHER_NOW_BYTES`] on the lane's one stream of one GPU, every piece from or to that
/// GPU's memory, of some bytes and, for the kernel, 16-byte aligned and at most
/// [`kernel::GATHER_PIECE_BYTES`]. They wait with the lane busy (requests wait already, or the
/// stream has work not seen done), at most [`kernel::GATHER_REQUEST_BYTES`], room left in the
/// launch and no byte shared with a waiting piece that one of them writes. A graph takes a
/// request of one piece too: its launch, operands set, costs the caller less than a copy's
/// submission (docs/transfer.md).
fn gatherable(
    e: &EngineInner,
    waiting: &mut Gather,
    streams: &[(usize, Arc<[Stream]>)],
    copies: &[Piece],
    gpus: &[(Option<usize>, usize)],
    bytes: u64,
) -> Option<(Stream, Launcher, bool)> {
    let (by_kernel, by_graphs) = (e.config.copy_kernel, e.config.copy_graphs);
    if !(by_kernel || by_graphs) || bytes > kernel::GATHER_NOW_BYTES || copies.is_empty() {
        return None;
    }
    let [(device, mine)] = streams else {
        return None;
    };
    let [stream] = &mine[..] else {
        return None;
    };
    stream.as_private()?;
    // The kernel's rows copy pieces of at most GATHER_PIECE_BYTES; a graph's nodes any.
    let fit = copies.iter().all(|p| {
        p.len > 0 && (!by_kernel || kernel::fits(p) && p.len <= kernel::GATHER_PIECE_BYTES)
    }) && all_local_on(gpus, *device);
    if !fit {
        return None;
    }
    let timeline = stream.timeline();
    let busy = !waiting.is_empty() || timeline.completed() < timeline.issued();
    let waits = busy && bytes <= kernel::GATHER_REQUEST_BYTES && waiting.takes(stream, copies);
    let launcher = if by_kernel {
        Launcher::Kernel(CopyKernel::of(stream.context())?)
    } else {
        Launcher::Graphs(waiting.graphs(stream.context())?)
    };
    Some((stream.clone(), launcher, waits))
}

/// An intra-node request checked and mapped once, to be posted many times ([`post`]).
pub(crate) struct Ready {
    side: Weak<Side>,
    copies: Vec<Piece>,
    gpus: Vec<(Option<usize>, usize)>,
    /// Per lane of the side: the streams of each local GPU the copies start from.
    streams: Box<[GpuStreams]>,
    /// The report every post starts from (no paths, no messages yet).
    report: TransferReport,
    held: Arc<Held>,
    /// Its options (a stream-ordered post reports its notification).
    opts: TransferOptions,
    timeout: Duration,
    epoch: u64,
}

/// Check and map a request of `bytes` bytes (its pairs' total, checked) once
/// ([`Endpoint::prepare`](crate::transfer::Endpoint::prepare)): what [`request`] does before it queues
/// anything, kept.
pub(super) fn ready(
    ep: &EpInner<State>,
    side: &Side,
    dir: Direction,
    pairs: Vec<(LocalRange, RemoteRange)>,
    bytes: u64,
    opts: TransferOptions,
) -> Result<Ready> {
    let Prepared {
        copies,
        gpus,
        imports,
        timeout,
        epoch,
        ..
    } = prepare(ep, side, dir, &pairs, &opts)?;
    // Made first: refused below, its imports are parked, not closed here.
    let held = Arc::new(Held {
        _pairs: pairs,
        _imports: imports,
    });
    // Every lane's streams found (made) now: a post only queues the copies.
    let streams = side
        .lanes()
        .iter()
        .map(|lane| streams_for(lane, &copies))
        .collect::<Result<Box<[_]>>>()?;
    // Held by the side from now on, as a request's are once queued: every post finds them.
    hold_imports(side, &held._imports);
    Ok(Ready {
        side: side.me.clone(),
        copies,
        gpus,
        streams,
        report: report(dir, bytes, 0, Vec::new(), &opts),
        held,
        opts,
        timeout,
        epoch,
    })
}

/// Post a prepared request: its copies queued as [`request`] queues them, with no check or
/// lookup repeated. Refused when the endpoint failed, closed or reconnected since it was
/// prepared (the peer's memory may have moved).
pub(super) fn post(ep: &EpInner<State>, r: &Ready) -> Result<Transfer> {
    let side = current(ep, r)?;
    let lane = side.lane_here();
    let streams = r.streams_on(lane);
    let started = Instant::now();
    let keep = Keep::posted(&r.held);
    let when = When {
        started,
        deadline: deadline_after(started, r.timeout),
        timeout: r.timeout,
        epoch: r.epoch,
    };
    let job = Issue {
        streams,
        copies: &r.copies,
        gpus: &r.gpus,
        keep,
        report: r.report.clone(),
        when,
    };
    issue(ep, &side, lane, job)
}

impl Ready {
    /// How long each post may take ([`TransferOptions::deadline`], else the engine's).
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The streams on `lane` of each local GPU the copies start from.
    fn streams_on(&self, lane: &Lane) -> &GpuStreams {
        &self.streams[lane.index]
    }
}

/// The side of a prepared request, refused when the endpoint failed, closed or reconnected since
/// it was prepared (the peer's memory may have moved).
fn current(ep: &EpInner<State>, r: &Ready) -> Result<Arc<Side>> {
    let side = r.side.upgrade().ok_or_else(|| Broken::Closed.to_error())?;
    if let Some(err) = ended_since(ep, &side, r.epoch) {
        return Err(err);
    }
    if let Some(err) = ep.failure() {
        return Err(err);
    }
    Ok(side)
}

/// Why a request checked in endpoint epoch `epoch` may not be queued now (`None`: it may): the
/// endpoint failed, closed or reconnected since (the peer's memory may have moved). Asked again
/// under the lane's issue lock, which a reconnect takes to order the lanes' streams: a request
/// queued after that would not be ordered behind the old connection's copies on other lanes.
fn ended_since(ep: &EpInner<State>, side: &Side, epoch: u64) -> Option<Error> {
    (side.epoch.load(Ordering::Acquire) != epoch).then(|| {
        ep.failure().unwrap_or_else(|| {
            Error::invalid(
                "prepared",
                "an earlier connection",
                "the endpoint reconnected (or closed) since this transfer was prepared: the \
                 peer's memory may have moved; prepare it again",
            )
        })
    })
}

/// The most bytes [`run`] waits for in `cuStreamSynchronize`: 64 MiB take a few milliseconds on
/// any GPU link, so a deadline of [`RUN_SYNC_MIN_DEADLINE`] cannot pass unseen unless the GPU
/// stalls.
const RUN_SYNC_MAX_BYTES: u64 = 64 << 20;

/// The shortest deadline [`run`] waits for in `cuStreamSynchronize`.
const RUN_SYNC_MIN_DEADLINE: Duration = Duration::from_millis(100);

/// Post a prepared request and wait for it on this thread. With one stream, at most
/// [`RUN_SYNC_MAX_BYTES`], a deadline of at least [`RUN_SYNC_MIN_DEADLINE`], nothing queued on
/// this thread's lane (and, for a request with a notification, nothing queued on any lane and
/// no notification on its way or reserved), and nothing earlier left running on the lane's
/// stream (a request that ended late leaves its copies there): the copies are queued (with
/// the copy graphs, in the lane's graph launches) and waited for with `cuStreamSynchronize`,
/// holding the lane's issue lock (no request is queued
/// on it meanwhile) and, with a notification, a place reserved in the notifications' order
/// (later ones wait behind it; other lanes' requests without one go on), with no job, transfer
/// or worker in between. Otherwise `post(..).wait()`.
pub(super) fn run(ep: &EpInner<State>, r: &Ready) -> Result<TransferReport> {
    let side = current(ep, r)?;
    let lane = side.lane_here();
    let streams = r.streams_on(lane);
    let (device, stream) = match &streams[..] {
        [(d, s)]
            if s.len() == 1
                && r.report.bytes <= RUN_SYNC_MAX_BYTES
                && r.timeout >= RUN_SYNC_MIN_DEADLINE =>
        {
            (*d, &s[0])
        }
        _ => return post(ep, r)?.wait(),
    };
    // What finished requests left parked goes here, on the caller's thread (as a wait does).
    Tracker::global().reap();
    // Declared before the locks: the wake-ups of a failure run once they are let go.
    let mut wakes = None;
    let mut issue = lock(&lane.issue);
    if let Some(err) = ended_since(ep, &side, r.epoch) {
        return Err(err);
    }
    // The stream may wait (a reconnect's join) for copies its timeline does not count: the
    // synchronize would wait for them, past the request's deadline. Requests waiting for a
    // gather launch come before this one.
    let timeline = stream.timeline();
    if !issue.is_empty() || timeline.completed() < timeline.issued() || !side.barrier_done()? {
        drop(issue);
        return post(ep, r)?.wait();
    }
    // The wait must neither fail nor break another thread's global-mode capture.
    // SAFETY: the peer's allocations were mapped through CUDA when this was prepared: libcuda
    // passed the presence check.
    let Some(relaxed) = (unsafe { capture::Relaxed::new() }) else {
        drop(issue);
        return post(ep, r)?.wait();
    };
    // Nothing queued on this lane; with a notification, nothing queued on any (every earlier
    // request finished), none being finished (`finishing` held while looking) and a place
    // reserved in the request order, which holds later notifications back until it is released.
    let notified = r.report.notified.is_some();
    let reserved = {
        let _order = notified.then(|| lock(&side.finishing));
        let mut q = lock(&side.queue);
        let busy = !q.lane_empty(lane.index) || (notified && (!q.is_empty() || q.any_notified()));
        (!busy).then(|| {
            notified.then(|| Reserved {
                side: &side,
                seq: q.reserve(),
            })
        })
    };
    let Some(reserved) = reserved else {
        drop((relaxed, issue));
        return post(ep, r)?.wait();
    };
    let started = Instant::now();
    let keep = Keep::posted(&r.held);
    // With the engine's copy graphs, the copies in launches of the lane's graphs where every
    // piece starts or ends on the stream's GPU (a launch costs the caller less than a
    // submission per piece); else, or where no graph launched, one submission per piece.
    let config = &ep.engine.inner.config;
    let graphs = (config.copy_graphs
        && !config.copy_kernel
        && r.copies.iter().all(|p| p.len > 0)
        && all_local_on(&r.gpus, device))
    .then(|| issue.graphs(stream.context()))
    .flatten();
    let launcher = graphs.map(Launcher::Graphs);
    // SAFETY: the lane's private stream of the pieces' GPU, the graphs of its context, and
    // pieces of some bytes from or to that GPU's memory, both ranges checked when the request
    // was prepared, which `keep` holds. Synchronized below: no wait looks for an event.
    let (fence, keep, messages) = unsafe {
        launch_or_enqueue(
            launcher.as_ref().map(|l| (stream, l)),
            streams,
            &r.copies,
            config.copy_chunk,
            keep,
            false,
        )
    }?;
    // Nobody else issues on this lane's stream while `issue` is held: the newest epoch is this
    // one.
    let covered = timeline.issued();
    // SAFETY: the endpoint's own live stream, whose context `enqueue` made current.
    let synced = unsafe { crate::driver::stream::synchronize(stream.cu_stream()) };
    drop(relaxed);
    if let Err(e) = synced {
        // A sticky error: the copies may never be seen done; what they reach stays.
        Tracker::global().park(fence, keep);
        wakes = side.fail_later(Broken::of(&e));
        drop((reserved, issue));
        drop(wakes);
        return Err(e);
    }
    timeline.completed_through(covered);
    drop((fence, keep));
    let elapsed = started.elapsed();
    // Done is done, as when finished from the queue: the deadline is not looked at once the copies
    // are seen complete.
    let result = if let Some(tag) = r.report.notified
        && let Err(e) = side.notify(tag, r.epoch)
    {
        if let Error::Os { call, source } = &e {
            wakes = side.fail_later(Broken::Os(call, source.raw_os_error().unwrap_or(0)));
        }
        Err(e)
    } else if side.epoch.load(Ordering::Acquire) != r.epoch {
        // Done, but the endpoint failed or reconnected meanwhile.
        Err(side.ended())
    } else {
        let mut report = r.report.clone();
        report.messages = messages;
        report.paths = r.gpus.iter().map(|&(l, p)| path_of(l, p)).collect();
        report.elapsed = elapsed;
        Ok(report)
    };
    drop((reserved, issue));
    drop(wakes);
    result
}

/// A prepared run's place in the request order of notifications ([`run`]), given back when
/// dropped.
struct Reserved<'a> {
    side: &'a Side,
    seq: u64,
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        lock(&self.side.queue).release(self.seq);
    }
}

/// The report of an intra-node request (no rails; `elapsed` set when it finishes).
pub(super) fn report(
    direction: Direction,
    bytes: u64,
    messages: u64,
    paths: Vec<MemoryPath>,
    opts: &TransferOptions,
) -> TransferReport {
    TransferReport {
        direction,
        bytes,
        messages,
        rail_bytes: Vec::new(),
        paths,
        elapsed: Duration::ZERO,
        notified: opts.notify,
        reposted: 0,
    }
}

/// An intra-node request whose copies are queued on a caller's stream ([`Endpoint::write_on`]):
/// complete once the stream passed them. What they reach is held until then (the stream stored
/// the request's trigger, or an event recorded after the copies completed); dropped earlier,
/// it is parked behind that (never freed early).
pub(crate) struct Queued {
    hold: Option<(Passed, Box<dyn Send>)>,
    /// What the request did (its `elapsed` set when it is reported), until the proxy takes it.
    pub(crate) report: Option<TransferReport>,
    pub(crate) started: Instant,
    /// The endpoint's epoch when the copies were queued: a notification goes only to that peer.
    epoch: u64,
}

impl Queued {
    /// The fence whose completion fires the request, where its stream stores no trigger word.
    pub(crate) fn fired_by(&self) -> Option<&StreamFence> {
        match &self.hold {
            Some((Passed::Event(f), _)) => Some(f),
            _ => None,
        }
    }

    /// A lean request's parts: the fence after its copies, its report, and itself (what the
    /// copies reach, freed once the fence completed, parked behind it if dropped before).
    pub(crate) fn into_lean(mut self) -> Option<(StreamFence, TransferReport, Box<dyn Send>)> {
        let fence = self.fired_by()?.clone();
        let report = self.report.take()?;
        Some((fence, report, Box::new(self)))
    }
}

/// How the host sees that a stream passed a request's copies.
enum Passed {
    /// The copy kernel stores the trigger word after the bytes.
    Trigger(TriggerFence),
    /// An event recorded on the stream after the copies (`Timeline::mark`). A trigger word
    /// written by the stream (`cuStreamWriteValue64`, with its system-wide memory barrier)
    /// would hold the stream's next copy back until the barrier is through (docs/transfer.md).
    Event(StreamFence),
}

impl Fence for Passed {
    fn is_complete(&self) -> bool {
        match self {
            Passed::Trigger(f) => f.is_complete(),
            Passed::Event(f) => f.is_complete(),
        }
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        if let Some((fence, keep)) = self.hold.take() {
            if fence.is_complete() {
                drop(keep);
            } else {
                Tracker::global().park(fence, keep);
            }
        }
    }
}

/// A stream-ordered request checked and mapped, its copies not yet queued ([`stage`]); its
/// seq is taken only after this, so that nothing slow (mapping, the reconnect barrier, loading
/// the copy kernel) comes between a seq and its trigger on the stream. Dropped unqueued, the
/// imports it holds are parked (never closed on this thread).
pub(crate) struct Staged {
    copies: Vec<Piece>,
    gpus: Vec<(Option<usize>, usize)>,
    keep: Option<Keep>,
    lease: Option<Lease>,
    bytes: u64,
    dir: Direction,
    opts: TransferOptions,
    started: Instant,
    epoch: u64,
}

impl Staged {
    /// When the request began: its deadline counts from here.
    pub(crate) fn started(&self) -> Instant {
        self.started
    }

    /// Whether it can go lean: on the copy engines (an event behind the copies stands for its
    /// trigger) and telling the peer nothing (nothing left to do once the copies are done).
    pub(crate) fn lean(&self) -> bool {
        self.lease.is_none() && self.opts.notify.is_none()
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if let Some(k) = self.keep.take() {
            park_imports(k._imports);
        }
    }
}

/// Check and map a stream-ordered request for `stream`, as [`request`] does, and let copies of
/// requests a reconnect ended finish first; nothing is queued. One pair the copy kernel can
/// take gets a counter of it (loading it on the context's first use).
pub(super) fn stage(
    ep: &EpInner<State>,
    side: &Side,
    stream: &Stream,
    dir: Direction,
    pairs: Vec<(LocalRange, RemoteRange)>,
    opts: &TransferOptions,
) -> Result<Staged> {
    // Before anything is mapped: a refusal takes nothing.
    let bytes = pairs_bytes(&pairs)?;
    let Prepared {
        copies,
        gpus,
        imports,
        started,
        deadline,
        timeout,
        epoch,
    } = prepare(ep, side, dir, &pairs, opts)?;
    // The pairs themselves hold the regions, as a request's do.
    let keep = Keep {
        _pairs: pairs,
        _imports: imports,
        _held: None,
    };
    // The caller's stream is not one of the lanes' (a reconnect cannot make it wait): copies of
    // requests a reconnect ended unfinished, which may reach the same bytes, are let finish
    // first, up to the request's deadline.
    if let Err(e) = barrier_passed(ep, side, epoch, deadline, timeout) {
        park_imports(keep._imports);
        return Err(e);
    }
    let lease = kernel_lease(ep, stream, &copies, &gpus);
    Ok(Staged {
        copies,
        gpus,
        keep: Some(keep),
        lease,
        bytes,
        dir,
        opts: *opts,
        started,
        epoch,
    })
}

/// Wait (up to `deadline`) for the copies of requests the last reconnect ended, then refuse a
/// request checked in `epoch` if the endpoint reconnected meanwhile: its copies would reach the
/// old peer's memory.
fn barrier_passed(
    ep: &EpInner<State>,
    side: &Side,
    epoch: u64,
    deadline: Instant,
    timeout: Duration,
) -> Result<()> {
    side.await_barrier(deadline, timeout)?;
    ended_since(ep, side, epoch).map_or(Ok(()), Err)
}

/// A counter of the copy kernel for one piece it can take on `stream`'s GPU (loading it on the
/// context's first use), where the engine's config lets it.
fn kernel_lease(
    ep: &EpInner<State>,
    stream: &Stream,
    copies: &[Piece],
    gpus: &[(Option<usize>, usize)],
) -> Option<Lease> {
    let ordinal = stream.context().ordinal();
    match (copies, gpus) {
        ([c], [(Some(g), _)])
            if ep.engine.inner.config.copy_kernel && *g == ordinal && kernel::fits(c) =>
        {
            CopyKernel::of(stream.context()).and_then(|k| k.lease())
        }
        _ => None,
    }
}

/// A prepared request staged for `stream` ([`PreparedTransfer::post_on`]): what [`stage`]
/// makes, from what was checked and mapped when it was prepared; refused as [`post`] refuses.
///
/// [`PreparedTransfer::post_on`]: crate::transfer::PreparedTransfer::post_on
pub(super) fn stage_ready(ep: &EpInner<State>, stream: &Stream, r: &Ready) -> Result<Staged> {
    let side = current(ep, r)?;
    let started = Instant::now();
    // As `stage`: copies of requests a reconnect ended are let finish first.
    let deadline = deadline_after(started, r.timeout);
    barrier_passed(ep, &side, r.epoch, deadline, r.timeout)?;
    Ok(Staged {
        copies: r.copies.clone(),
        gpus: r.gpus.clone(),
        keep: Some(Keep::posted(&r.held)),
        lease: kernel_lease(ep, stream, &r.copies, &r.gpus),
        bytes: r.report.bytes,
        dir: r.report.direction,
        opts: r.opts,
        started,
        epoch: r.epoch,
    })
}

/// Queue a staged request's copies on `stream` (through the capture-checked path): with a
/// counter of the copy kernel, one launch that copies and then stores the trigger at `mark`;
/// else copy-engine copies (one graph launch, or a call per piece), then an event, which fires
/// the request in place of a trigger word ([`Queued::fired_by`]).
pub(super) fn enqueue_staged(
    mut staged: Staged,
    side: &Side,
    stream: &Stream,
    mark: Option<&Mark<'_>>,
) -> std::result::Result<Queued, Unmade> {
    let keep = staged.keep.take().expect("a staged request holds its keep");
    // Held until the endpoint goes, whether or not the copies are queued below (a refused
    // request's mappings then stay with the endpoint, as a queued one's do).
    hold_imports(side, &keep._imports);
    let (passed, held): (Passed, Box<dyn Send>) = match staged.lease.take() {
        Some(lease) => {
            let Some(mark) = mark else {
                staged.lease = Some(lease);
                staged.keep = Some(keep);
                return Err(
                    Error::invalid("stream", "no trigger", "the copy kernel stores one").into(),
                );
            };
            let flags = match mark.flags() {
                Ok(f) => f,
                Err(e) => {
                    staged.keep = Some(keep);
                    return Err(e.into());
                }
            };
            let c = staged.copies[0];
            let r = flags.enqueue_writing(
                stream,
                mark.slot(),
                "cuLaunchKernel",
                (keep, lease),
                |raw, trigger, (_, lease)| {
                    // SAFETY: the piece fits the kernel and runs on the stream's GPU, where its
                    // local range lies and the peer's allocation is mapped; both ranges were
                    // checked and `keep` holds them, the trigger word is held by the queue's
                    // fence, and the lease is kept with them until the word holds the seq.
                    unsafe { lease.launch(raw, &c, trigger, mark.seq) }
                },
            );
            match r {
                Ok(((), k)) => (Passed::Trigger(mark.fence()), Box::new(k)),
                Err(refused) => {
                    let (unmade, kept) = Unmade::of(refused);
                    if let Some((k, _lease)) = kept {
                        // Nothing was queued (a refused or failed launch): parked by the drop.
                        staged.keep = Some(k);
                    }
                    return Err(unmade);
                }
            }
        }
        None => {
            let copies = &staged.copies;
            // One launch of a graph of copy nodes where the engine's copy graphs are on (a
            // graph of this stream's own: launches of one graph are ordered behind each
            // other, whatever their streams); else, or where the graph is not made, one
            // `cuMemcpyAsync` per piece.
            let ordinal = stream.context().ordinal();
            let graphs = all_local_on(&staged.gpus, ordinal)
                .then(|| side.stream_graphs(stream, copies.len(), staged.started))
                .flatten();
            let call = match graphs {
                Some(_) => "cuGraphLaunch",
                None => "cuMemcpyAsync",
            };
            // Both ranges of every piece were checked: the local range inside its region,
            // which `keep` holds; the remote range inside the peer's allocation and the
            // mapping, which `keep` holds too. The event recorded after the copies tracks
            // them, and `keep` is freed only once it completed (or leaked).
            //
            // The event is recorded in the same capture-checked call, right behind the copies,
            // by this thread (a poll would record it later, behind whatever the stream took
            // meanwhile: a wait on the completion word that this very request releases). Where
            // it cannot be (no event could be made or recorded), the trigger word.
            let timeline = stream.timeline();
            let r = stream.enqueue(call, keep, |raw, _| {
                let launched = graphs
                    .as_ref()
                    // SAFETY: as above; the graphs are the stream's context's, which the
                    // enqueue made current. A launch that fails queued nothing.
                    .is_some_and(|g| unsafe { g.gather(raw, copies) }.is_ok());
                if !launched {
                    // SAFETY: as above.
                    unsafe { queue_copies(copies, raw) }?;
                }
                // SAFETY: `raw` is the timeline's stream; the enqueue made its context current.
                Ok(unsafe { timeline.issue_recorded(raw) })
            });
            let (epoch, keep) = match r {
                Ok(done) => done,
                Err(refused) => {
                    // Copies may be queued (a batch or loop that failed part way, or a
                    // capture began meanwhile), but nothing fires the request: the seq counts
                    // as nothing to do.
                    if let Some(k) = refused.kept {
                        park_behind_event(stream, k);
                    }
                    return Err(refused.error.into());
                }
            };
            match (epoch, mark) {
                (Some(epoch), _) => (Passed::Event(timeline.fence_at(epoch)), Box::new(keep)),
                (None, None) => {
                    // A lean request has no trigger to fall back on: the copies stay queued,
                    // what they reach parked behind them.
                    park_behind_event(stream, keep);
                    return Err(Error::invalid(
                        "stream",
                        "no event",
                        "no event could be recorded behind the copies",
                    )
                    .into());
                }
                (None, Some(mark)) => match mark.queue_trigger(stream, keep) {
                    Ok(((), k)) => (Passed::Trigger(mark.fence()), Box::new(k)),
                    Err(refused) => {
                        // The copies are queued; the trigger is not (parked behind an event
                        // after them), or may be (leaked).
                        let (unmade, kept) = Unmade::of(refused);
                        if let Some(k) = kept {
                            park_behind_event(stream, k);
                        }
                        return Err(unmade);
                    }
                },
            }
        }
    };
    let paths = staged.gpus.iter().map(|&(l, p)| path_of(l, p)).collect();
    Ok(Queued {
        hold: Some((passed, held)),
        report: Some(report(
            staged.dir,
            staged.bytes,
            staged.copies.len() as u64,
            paths,
            &staged.opts,
        )),
        started: staged.started,
        epoch: staged.epoch,
    })
}

/// What queued copies reach, parked behind an event recorded after them (leaked when the event
/// cannot be recorded).
fn park_behind_event(stream: &Stream, keep: Keep) {
    match EventFence::record(stream.cuda()) {
        Ok(ev) => Tracker::global().park(ev, keep),
        Err(_) => std::mem::forget(keep),
    }
}

/// Notify the peer of a stream-ordered request whose copies are done; refused when the endpoint
/// failed or reconnected since they were queued (the socket may reach another peer).
pub(super) fn notify_peer(side: &Side, q: &Queued, tag: u32) -> Result<()> {
    side.notify(tag, q.epoch)
}
