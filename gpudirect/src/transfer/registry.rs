//! Registration: buffers registered on every rail through the cache ([`Engine::register`],
//! [`Engine::register_all`]).

use super::engine::{Engine, EngineInner};
use super::region::{
    Backing, Buffer, CacheCounters, DeviceSlice, Entry, HostSlice, Identity, MemoryPath, RailMr,
    Region, chunks_within, coalesce,
};
use crate::error::{Error, Result};
use crate::memory::MemoryKind;
use crate::rdma::GpuRegistration;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// A buffer's identity and address range, before registration.
struct Want {
    id: Identity,
    start: u64,
    len: u64,
    ordinal: Option<usize>,
    kind: Option<MemoryKind>,
    /// Ordinary host memory (`Backing::Host { cached: true }`).
    cached: bool,
}

fn want(b: &Buffer) -> Result<Want> {
    match &*b.backing {
        Backing::Host { cached, .. } => Ok(Want {
            id: Identity::Host {
                backing: Arc::as_ptr(&b.backing) as usize,
            },
            start: b.addr(),
            len: b.len as u64,
            ordinal: None,
            kind: None,
            cached: *cached,
        }),
        Backing::Device(d) => {
            let kind = d.kind();
            let ordinal = d.ordinal();
            let id = if kind == MemoryKind::Pool {
                // Pool memory is never registered: keyed like host memory, by its backing.
                Identity::Host {
                    backing: Arc::as_ptr(&b.backing) as usize,
                }
            } else {
                let a = crate::memory::pointer_attributes(d.ptr())?;
                Identity::Device {
                    ordinal,
                    buffer_id: a.buffer_id,
                }
            };
            Ok(Want {
                id,
                start: b.addr(),
                len: b.len as u64,
                ordinal: Some(ordinal),
                kind: Some(kind),
                cached: false,
            })
        }
    }
}

/// What the registration cache of `e` has done so far.
pub(crate) fn cache_stats(e: &EngineInner) -> CacheCounters {
    let s = &e.stats;
    let live = e.cache.lock().unwrap_or_else(|e| e.into_inner()).live();
    CacheCounters {
        hits: s.hits.load(Ordering::Relaxed),
        misses: s.misses.load(Ordering::Relaxed),
        registrations: s.registered.load(Ordering::Relaxed),
        live,
        imports_opened: s.imports.load(Ordering::Relaxed),
        pool_imports_opened: s.pool_imports.load(Ordering::Relaxed),
    }
}

/// Register `bufs` with `engine` (see [`Engine::register`] and, `batch`: coalesced, the rails
/// in parallel, [`Engine::register_all`]).
pub(crate) fn register(engine: &Engine, bufs: Vec<Buffer>, batch: bool) -> Result<Vec<Region>> {
    register_inner(engine, bufs, batch)
}

fn register_inner(engine: &Engine, bufs: Vec<Buffer>, batch: bool) -> Result<Vec<Region>> {
    let inner = &*engine.inner;
    // Identities: one attribute query per backing.
    let mut by_backing: HashMap<usize, (Identity, Option<usize>, Option<MemoryKind>, bool)> =
        HashMap::new();
    let mut wants = Vec::with_capacity(bufs.len());
    for b in &bufs {
        let key = Arc::as_ptr(&b.backing) as usize;
        let w = match by_backing.get(&key) {
            Some(&(id, ordinal, kind, cached)) => Want {
                id,
                start: b.addr(),
                len: b.len as u64,
                ordinal,
                kind,
                cached,
            },
            None => {
                let w = want(b)?;
                by_backing.insert(key, (w.id, w.ordinal, w.kind, w.cached));
                w
            }
        };
        wants.push(w);
    }
    let mut cache = inner.cache.lock().unwrap_or_else(|e| e.into_inner());
    let mut found: Vec<Option<Arc<Entry>>> = wants
        .iter()
        .map(|w| cache.lookup(w.id, w.start, w.len))
        .collect();
    let hits = found.iter().filter(|f| f.is_some()).count() as u64;
    let misses = found.len() as u64 - hits;
    // What to register: per identity, the missing ranges (coalesced in a batch).
    let mut groups: HashMap<Identity, Vec<(u64, u64, usize)>> = HashMap::new();
    for (i, w) in wants.iter().enumerate() {
        if found[i].is_none() {
            groups.entry(w.id).or_default().push((w.start, w.len, i));
        }
    }
    let mut jobs: Vec<(u64, u64, Vec<usize>)> = Vec::new();
    for (_, ranges) in groups {
        if batch {
            jobs.extend(coalesce(ranges));
        } else {
            jobs.extend(ranges.into_iter().map(|(s, l, i)| (s, l, vec![i])));
        }
    }
    jobs.sort_by_key(|j| j.2[0]);
    let entries = register_jobs(engine, &bufs, &wants, &jobs, batch)?;
    for (job, e) in jobs.iter().zip(entries) {
        cache.insert(&e);
        for &i in &job.2 {
            found[i] = Some(e.clone());
        }
    }
    drop(cache);
    inner.stats.hits.fetch_add(hits, Ordering::Relaxed);
    inner.stats.misses.fetch_add(misses, Ordering::Relaxed);
    inner
        .stats
        .registered
        .fetch_add(jobs.len() as u64, Ordering::Relaxed);
    Ok(bufs
        .into_iter()
        .zip(wants)
        .zip(found)
        .map(|((buf, w), e)| {
            let entry = e.expect("found or registered");
            Region {
                at: w.start - entry.start,
                entry,
                buf,
            }
        })
        .collect())
}

/// Register each job (a range and the buffers it serves) on every rail; the rails in
/// parallel when `parallel` and there is enough to do.
fn register_jobs(
    engine: &Engine,
    bufs: &[Buffer],
    wants: &[Want],
    jobs: &[(u64, u64, Vec<usize>)],
    parallel: bool,
) -> Result<Vec<Arc<Entry>>> {
    let inner = &*engine.inner;
    let ndev = inner.devices.len();
    if ndev == 0 {
        // An engine without rails: no NIC registration; the entry holds the memory.
        return Ok(jobs
            .iter()
            .map(|job| {
                let w = &wants[job.2[0]];
                Arc::new(Entry {
                    id: w.id,
                    engine: inner.engine_id,
                    start: job.0,
                    len: job.1,
                    mrs: Vec::new(),
                    path: MemoryPath::Unregistered,
                    cached: false,
                    ordinal: w.ordinal,
                    preferred: Vec::new(),
                    _keep: backings(bufs, &job.2),
                    ipc: exported(w, job, bufs),
                })
            })
            .collect());
    }
    let one = |d: usize| -> Result<Vec<Decided>> {
        jobs.iter()
            .map(|job| register_decide(inner, d, bufs, wants, job))
            .collect()
    };
    let per_dev: Vec<Result<Vec<Decided>>> = if parallel && ndev > 1 && jobs.len() >= 4 {
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..ndev)
                .map(|d| {
                    let name = format!("gpudirect-register-{d}");
                    (
                        d,
                        crate::driver::ctx::spawn_scoped_thread(s, name, move || one(d)),
                    )
                })
                .collect();
            hs.into_iter()
                .map(|(d, h)| match h {
                    Ok(h) => h.join().unwrap_or_else(|_| {
                        Err(Error::invalid("register", "a thread", "panicked"))
                    }),
                    // No thread to be had: this device's part on the caller's.
                    Err(_) => one(d),
                })
                .collect()
        })
    } else {
        (0..ndev).map(one).collect()
    };
    let mut per_dev = per_dev.into_iter().collect::<Result<Vec<_>>>()?;
    let mut out = Vec::with_capacity(jobs.len());
    for (k, job) in jobs.iter().enumerate() {
        let w = &wants[job.2[0]];
        let (first, path) = std::mem::replace(&mut per_dev[0][k], (None, MemoryPath::Host));
        let mut mrs = Vec::with_capacity(ndev);
        if let Some(m) = first {
            mrs.push(m);
            for (d, v) in per_dev.iter_mut().enumerate().skip(1) {
                match v[k].0.take() {
                    Some(m) => mrs.push(m),
                    None => {
                        return Err(Error::Unsupported {
                            what: "the same registration on every rail".into(),
                            reason: format!(
                                "{} registered the memory at {:#x} but {} could not: {}",
                                inner.devices[0].name, job.0, inner.devices[d].name, v[k].1
                            ),
                        });
                    }
                }
            }
        }
        if let (Some(o), MemoryPath::GpuDirect(_)) = (w.ordinal, &path) {
            inner.add_gpu_target(o);
        }
        out.push(Arc::new(Entry {
            id: w.id,
            engine: inner.engine_id,
            start: job.0,
            len: job.1,
            preferred: inner.preferred_for(w.ordinal),
            ordinal: w.ordinal,
            _keep: if mrs.is_empty() {
                backings(bufs, &job.2)
            } else {
                Vec::new()
            },
            mrs,
            path,
            cached: job.2.iter().all(|&i| wants[i].cached),
            ipc: exported(w, job, bufs),
        }));
    }
    Ok(out)
}

/// Export for CUDA IPC the allocation holding `job`'s range (`cuMemAlloc` memory: its `cuIpc`
/// handle; VMM memory inside one physical allocation: its file descriptor; an allocation of an
/// exportable pool: the pool's file descriptor and its pointer export data), or say why not.
fn exported(
    w: &Want,
    job: &(u64, u64, Vec<usize>),
    bufs: &[Buffer],
) -> std::result::Result<super::region::Exported, String> {
    let (start, len) = (job.0, job.1);
    match (w.kind, w.ordinal) {
        (Some(MemoryKind::Device), Some(_ordinal)) => {
            #[cfg(feature = "p2p")]
            {
                super::export::export(_ordinal, start).map_err(|e| e.to_string())
            }
            #[cfg(not(feature = "p2p"))]
            {
                let _ = start;
                Err("gpudirect was built without the p2p feature".into())
            }
        }
        (Some(MemoryKind::Vmm), Some(_ordinal)) => {
            let mappings = match &*bufs[job.2[0]].backing {
                Backing::Device(d) => d.mappings(),
                Backing::Host { .. } => None,
            };
            match chunks_within(mappings, start, len).as_slice() {
                [(_base, _bytes)] => {
                    #[cfg(feature = "p2p")]
                    {
                        super::export::export_vmm(_ordinal, *_base, *_bytes)
                            .map_err(|e| e.to_string())
                    }
                    #[cfg(not(feature = "p2p"))]
                    {
                        Err("gpudirect was built without the p2p feature".into())
                    }
                }
                [] => Err("VMM memory whose physical allocations are not known".into()),
                many => Err(format!(
                    "a VMM range across {} physical allocations (at {}): its POSIX file \
                     descriptor export covers one, so a peer would map only the first; \
                     register the part inside one allocation, or allocate what you share as \
                     one chunk (VmmBuffer::alloc)",
                    many.len(),
                    many.iter()
                        .map(|(b, l)| format!("{b:#x} +{l}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )),
            }
        }
        (Some(MemoryKind::Pool), Some(_ordinal)) => {
            // The buffer's whole memory is the allocation (a PoolAlloc starts its own).
            #[cfg(feature = "p2p")]
            match &*bufs[job.2[0]].backing {
                Backing::Device(d) => super::export::export_pool(_ordinal, d.ptr(), d.bytes())
                    .map_err(|e| e.to_string()),
                Backing::Host { .. } => Err("pool memory without a device address".into()),
            }
            #[cfg(not(feature = "p2p"))]
            {
                Err("gpudirect was built without the p2p feature".into())
            }
        }
        (Some(k), _) => Err(format!("{k:?} memory is not exported")),
        (None, _) => Err("host memory is not exported".into()),
    }
}

/// A rail's registration of a job (`None`: staged) and the path it decided.
type Decided = (Option<RailMr>, MemoryPath);

/// Register `job` on engine device `d`, deciding its path: `None` for staged memory.
fn register_decide(
    inner: &EngineInner,
    d: usize,
    bufs: &[Buffer],
    wants: &[Want],
    job: &(u64, u64, Vec<usize>),
) -> Result<Decided> {
    let w = &wants[job.2[0]];
    let staged = |reason: String| -> Result<Decided> { Ok((None, MemoryPath::Staged { reason })) };
    if w.kind == Some(MemoryKind::Pool) {
        let e = Error::NotRdmaCapable {
            ptr: w.start,
            kind: MemoryKind::Pool,
            reason: "stream-ordered pool memory (cuMemAllocAsync, cudarc's CudaSlice) cannot be registered with a NIC".into(),
        };
        return if inner.config.staging {
            staged(e.to_string())
        } else {
            Err(e)
        };
    }
    match register_on(inner, d, bufs, wants, job) {
        Ok(m) => {
            let path = match &m {
                RailMr::Host(_) => MemoryPath::Host,
                RailMr::Gpu(g) => MemoryPath::GpuDirect(g.path()),
            };
            Ok((Some(m), path))
        }
        Err(e @ Error::NoGpuRegistrationPath { .. }) if inner.config.staging => {
            staged(e.to_string())
        }
        Err(e) => Err(e),
    }
}

fn backings(bufs: &[Buffer], idx: &[usize]) -> Vec<Arc<Backing>> {
    let mut v: Vec<Arc<Backing>> = Vec::new();
    for &i in idx {
        if !v.iter().any(|b| Arc::ptr_eq(b, &bufs[i].backing)) {
            v.push(bufs[i].backing.clone());
        }
    }
    v
}

/// Register `job`'s range on engine device `d`.
fn register_on(
    inner: &EngineInner,
    d: usize,
    bufs: &[Buffer],
    wants: &[Want],
    job: &(u64, u64, Vec<usize>),
) -> Result<RailMr> {
    let pd = &inner.devices[d].pd;
    let (start, len, idx) = job;
    let len = usize::try_from(*len).map_err(|_| Error::invalid("len", len, "fits no usize"))?;
    let keep = backings(bufs, idx);
    let w = &wants[idx[0]];
    match &*bufs[idx[0]].backing {
        Backing::Host { .. } => {
            let s = HostSlice {
                _keep: keep,
                ptr: *start as usize,
                len,
            };
            pd.register_remote(s, inner.access()).map(RailMr::Host)
        }
        Backing::Device(dev) => {
            let ordinal = w.ordinal.unwrap_or(0);
            let kind = dev.kind();
            let chunks = chunks_within(dev.mappings(), *start, len as u64);
            let how = if chunks.len() > 1 {
                GpuRegistration::DmaBuf
            } else {
                GpuRegistration::Auto
            };
            let s = DeviceSlice {
                keep,
                ptr: *start,
                len,
                ordinal,
                kind,
            };
            match pd.register_gpu(s, inner.access(), how) {
                Ok(r) => Ok(RailMr::Gpu(r)),
                Err(e) if chunks.len() > 1 => Err(name_the_chunk(ordinal, &chunks, *start, e)),
                Err(e) => Err(e),
            }
        }
    }
}

/// The typed refusal for a VMM range of several physical chunks that dma-buf could not register
/// whole: it names the first chunk whose own export fails, or where the chunks meet.
fn name_the_chunk(ordinal: usize, chunks: &[(u64, usize)], start: u64, e: Error) -> Error {
    let n = chunks.len();
    let mut culprit = None;
    for (i, &(b, l)) in chunks.iter().enumerate() {
        if let Err(ce) = crate::memory::dmabuf::export_dmabuf_range(ordinal, b, l as u64) {
            culprit = Some((i, b, l, format!("its own dma-buf export fails: {ce}")));
            break;
        }
    }
    let (i, b, l, why) = culprit.unwrap_or_else(|| {
        let (b, l) = chunks.get(1).copied().unwrap_or(chunks[0]);
        (
            1,
            b,
            l,
            "each chunk exports alone, but not the range across them".to_string(),
        )
    });
    Error::NotRdmaCapable {
        ptr: b,
        kind: MemoryKind::Vmm,
        reason: format!(
            "a VMM range of {n} physical chunks is registered whole through dma-buf only \
             (nvidia-peermem pins one allocation at a time), and dma-buf refused it ({e}); \
             chunk {i} of {n} at offset {} ({l} bytes at {b:#x}): {why}",
            b.saturating_sub(start)
        ),
    }
}
