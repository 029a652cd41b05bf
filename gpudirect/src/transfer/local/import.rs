//! Peers' CUDA IPC memory mapped here: peers' GPUs found by UUID, the link between two GPUs,
//! and the process-wide caches of peers' allocations mapped here (each opened once per local
//! GPU, a pool pointer once, closed when nothing holds it) and of peers' pools imported here
//! (once each, destroyed after the last pointer imported into it is freed).

use crate::error::{Error, Result};
use crate::memory::DeviceMemory;
use crate::p2p::{
    Interconnect, IpcMemHandle, IpcMemory, IpcPool, LinkMatrix, PoolImport, PoolPtrHandle,
    VmmHandle, VmmImport,
};
use crate::transfer::export::uuid_of;
use crate::transfer::region::{IpcLink, memory_released};
use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

/// The ordinal, in this process, of the GPU with this UUID; `None` when it is not visible.
///
/// # Errors
///
/// As [`uuid_of`].
pub(crate) fn ordinal_of_uuid(uuid: &[u8; 16]) -> Result<Option<usize>> {
    static UUIDS: OnceLock<Vec<[u8; 16]>> = OnceLock::new();
    let all = match UUIDS.get() {
        Some(v) => v,
        None => {
            let n = crate::cuda::device_count()?;
            let v = (0..n).map(uuid_of).collect::<Result<Vec<_>>>()?;
            UUIDS.get_or_init(|| v)
        }
    };
    Ok(all.iter().position(|u| u == uuid))
}

/// What a copy between memory of `local` (a GPU, or host memory when `None`) and memory of the
/// peer's GPU `peer` (when visible here) crosses.
pub(crate) fn link(local: Option<usize>, peer: Option<usize>) -> IpcLink {
    match (local, peer) {
        (None, _) => IpcLink::LocalHost,
        (_, None) => IpcLink::Unknown {
            reason: "the peer's GPU is not visible to this process".into(),
        },
        (Some(a), Some(b)) if a == b => IpcLink::SameDevice,
        (Some(a), Some(b)) => {
            static MATRIX: OnceLock<std::result::Result<LinkMatrix, String>> = OnceLock::new();
            let m = MATRIX.get_or_init(|| LinkMatrix::probe().map_err(|e| e.to_string()));
            match m {
                Err(reason) => IpcLink::Unknown {
                    reason: reason.clone(),
                },
                Ok(m) => match m.link(a, b).map(|l| &l.interconnect) {
                    Some(Interconnect::Nvlink { links, .. }) => IpcLink::Nvlink { links: *links },
                    Some(Interconnect::Pcie { .. }) => IpcLink::Pcie,
                    Some(Interconnect::SameDevice) => IpcLink::SameDevice,
                    Some(Interconnect::Unknown { reason }) => IpcLink::Unknown {
                        reason: reason.clone(),
                    },
                    None => IpcLink::Unknown {
                        reason: format!("no link {a} -> {b} in the link matrix"),
                    },
                },
            }
        }
    }
}

/// An imported allocation and the local GPU it is mapped for: by its `cuIpc` handle, or by the
/// exporting process and its VMM export id; a pool pointer by the exporting process, its pool's
/// export id and the pointer's export data (imported once for every local GPU: a second import
/// of one pointer in a process may alias the first, which freeing either would free).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Key {
    Handle([u8; 64], usize),
    Vmm { pid: u32, id: u64, ordinal: usize },
    PoolPtr { pid: u32, id: u64, data: [u8; 64] },
}

impl Key {
    /// The local GPU a mapping is for; `None` for a pool pointer (every GPU granted access to
    /// its pool reaches it).
    fn ordinal(&self) -> Option<usize> {
        match *self {
            Key::Handle(_, o) | Key::Vmm { ordinal: o, .. } => Some(o),
            Key::PoolPtr { .. } => None,
        }
    }
}

/// A peer's allocation mapped here, held only to be closed when dropped.
enum Mapped {
    /// `cuIpcOpenMemHandle`.
    Handle { _mem: IpcMemory<u8> },
    /// `cuMemImportFromShareableHandle` and `cuMemMap`.
    Vmm { _mem: VmmImport<u8> },
    /// `cuMemPoolImportPointer` into an imported pool. Fields drop in order: the pointer is
    /// freed before the pool can go.
    Pool {
        _mem: PoolImport<u8>,
        _pool: Arc<ImportedPool>,
    },
    /// Tests without a GPU: counts its drops (a free of the mapping).
    #[cfg(test)]
    Fake(Arc<AtomicU64>),
}

#[cfg(test)]
impl Drop for Mapped {
    fn drop(&mut self) {
        if let Mapped::Fake(n) = self {
            n.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Every import alive in the process, by key. An entry whose import can no longer be upgraded
/// is being closed by its last holder, which removes it once the mapping is closed. Looked up
/// on every request's path: hashed with foldhash (seeded per process) rather than SipHash.
type Cache = HashMap<Key, Weak<Import>, foldhash::fast::RandomState>;

fn cache() -> MutexGuard<'static, Cache> {
    static C: OnceLock<Mutex<Cache>> = OnceLock::new();
    C.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// A peer's allocation mapped here (`cuIpcOpenMemHandle`, a VMM file descriptor imported and
/// mapped, or a pointer imported into the peer's imported pool), shared by every endpoint and
/// request that uses it; closed (`cuIpcCloseMemHandle`, unmapped and released, or freed) when
/// the last holder goes. Copies hold it until their events complete, so it is never closed
/// under a copy.
pub(crate) struct Import {
    key: Key,
    mem: Option<Mapped>,
    /// The mapping's first byte here.
    pub(crate) base: u64,
    /// The mapping's real size (`cuMemGetAddressRange` on it).
    pub(crate) size: u64,
}

impl std::fmt::Debug for Import {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Import")
            .field("device", &self.key.ordinal())
            .field("vmm", &matches!(self.key, Key::Vmm { .. }))
            .field("pool", &matches!(self.key, Key::PoolPtr { .. }))
            .field("base", &format_args!("{:#x}", self.base))
            .field("size", &self.size)
            .finish()
    }
}

/// The import of `handle` mapped for GPU `ordinal`: the live one, or a new one
/// (`cuIpcOpenMemHandle`, counted in `opened`) that must hold `alloc_len` bytes (the peer's
/// word, checked against the mapping; it is closed again if it does not). `home` gives the PCI
/// address of the GPU that owns the memory, when visible here (asked only to open).
///
/// # Errors
///
/// [`Error::InvalidArgument`] when the mapping is shorter than `alloc_len`; [`Error::Cuda`]
/// from the driver (a handle of this very process, or of freed memory).
#[doc(alias = "cuIpcOpenMemHandle")]
pub(crate) fn import(
    handle: &[u8; 64],
    ordinal: usize,
    alloc_len: u64,
    home: impl FnOnce() -> Option<String>,
    opened: &AtomicU64,
) -> Result<Arc<Import>> {
    import_as(Key::Handle(*handle, ordinal), opened, || {
        let h = IpcMemHandle::from_parts(*handle, 0, alloc_len, 1, 0, home());
        let mem = IpcMemory::<u8>::open_on(&h, ordinal)?;
        let base = mem.device_ptr();
        // SAFETY: `open_on` left `ordinal`'s context current; `base` is the mapping it made.
        let (_, size) = unsafe { crate::driver::mem::address_range(base) }?;
        Ok((Mapped::Handle { _mem: mem }, base, size as u64))
    })
}

/// The import of the VMM allocation that process `pid` (as the kernel names the socket's peer,
/// not the peer's word) exported as `id`, mapped for GPU
/// `ordinal`: the live one, or a new one (`cuMemImportFromShareableHandle` of `fd`, `cuMemMap`
/// of `mapped_len` bytes, `cuMemSetAccess` for `ordinal`; counted in `opened`). `home` gives the
/// PCI address of the GPU that owns the memory, when visible here (asked only to open).
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a `mapped_len` of 0 or past `usize`; [`Error::Cuda`] from
/// the driver (a `mapped_len` longer than the allocation, or not a multiple of its
/// granularity).
#[doc(alias = "cuMemImportFromShareableHandle")]
pub(crate) fn import_vmm(
    pid: u32,
    id: u64,
    ordinal: usize,
    fd: &OwnedFd,
    mapped_len: u64,
    home: impl FnOnce() -> Option<String>,
    opened: &AtomicU64,
) -> Result<Arc<Import>> {
    import_as(Key::Vmm { pid, id, ordinal }, opened, || {
        let h = VmmHandle {
            bytes: mapped_len,
            mapped_bytes: mapped_len,
            elem_size: 1,
            device: 0,
            pci_bus_id: home(),
        };
        let mem = VmmImport::<u8>::open_on(fd.as_fd(), &h, ordinal)?;
        let base = mem.device_ptr();
        // The mapping is exactly `mapped_len` bytes: `cuMemMap` mapped that many of the
        // allocation (it refuses more than the allocation holds).
        Ok((Mapped::Vmm { _mem: mem }, base, mapped_len))
    })
}

/// A peer's pool imported here (`cuMemPoolImportFromShareableHandle` of the file descriptor it
/// sent, on the GPU that holds the pool's memory), shared by every pointer imported into it
/// (each holds it, and is freed first); destroyed (`cuMemPoolDestroy`) when the last goes,
/// outside every cache's lock.
pub(crate) struct ImportedPool {
    /// The exporting process (as the kernel names the socket's peer) and its export id.
    key: (u32, u64),
    pool: Option<Arc<IpcPool>>,
    /// Local GPUs with read-write access to the pool's memory (`cuMemPoolSetAccess`).
    granted: Mutex<Vec<usize>>,
}

impl std::fmt::Debug for ImportedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedPool")
            .field("pid", &self.key.0)
            .field("export_id", &self.key.1)
            .finish()
    }
}

/// Imported pools by (exporting pid, export id).
type Pools = HashMap<(u32, u64), Weak<ImportedPool>>;

/// Every imported pool alive in the process, by (exporting pid, export id). An entry that can
/// no longer be upgraded is being destroyed by its last holder, which removes it after.
fn pools() -> MutexGuard<'static, Pools> {
    static P: OnceLock<Mutex<Pools>> = OnceLock::new();
    P.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

impl ImportedPool {
    /// Read-write access to the pool's memory for local GPU `ordinal` (once per GPU).
    ///
    /// # Errors
    ///
    /// [`Error::Cuda`] from `cuMemPoolSetAccess` (a GPU that cannot reach the pool's).
    #[doc(alias = "cuMemPoolSetAccess")]
    fn grant(&self, ordinal: usize) -> Result<()> {
        let mut g = self.granted.lock().unwrap_or_else(|e| e.into_inner());
        if g.contains(&ordinal) {
            return Ok(());
        }
        let pool = self.pool.as_ref().expect("held until dropped");
        crate::driver::ctx::bind(&*crate::cuda::context(pool.device())?)?;
        pool.grant(ordinal)?;
        g.push(ordinal);
        Ok(())
    }
}

impl Drop for ImportedPool {
    fn drop(&mut self) {
        // Destroyed outside the lock, the dead entry left meanwhile so that nobody imports the
        // same pool again before it is gone (`import_pool` waits for it).
        drop(self.pool.take());
        let me: *const ImportedPool = self;
        // Every key it answered to (its own, and those of aliases).
        pools().retain(|_, w| !(w.strong_count() == 0 && std::ptr::eq(w.as_ptr(), me)));
    }
}

/// The pool that process `pid` (as the kernel names the socket's peer, not the peer's word)
/// exported as `id`, imported here with read-write access for local GPU `ordinal`: the live
/// import, or a new one (`cuMemPoolImportFromShareableHandle` of `fd` on `pool_device`, the GPU
/// that holds its memory; counted in `opened`).
///
/// # Errors
///
/// [`Error::Cuda`] from the driver (a descriptor that is no pool; a GPU that cannot reach the
/// pool's); as [`crate::cuda::context`].
#[doc(alias = "cuMemPoolImportFromShareableHandle")]
pub(crate) fn import_pool(
    pid: u32,
    id: u64,
    fd: &OwnedFd,
    pool_device: usize,
    ordinal: usize,
    opened: &AtomicU64,
) -> Result<Arc<ImportedPool>> {
    let key = (pid, id);
    loop {
        let mut p = pools();
        if let Some(w) = p.get(&key) {
            if let Some(a) = w.upgrade() {
                drop(p);
                a.grant(ordinal)?;
                return Ok(a);
            }
            // Its last holder is destroying it: import it again only once it is gone.
            drop(p);
            std::thread::sleep(std::time::Duration::from_micros(50));
            continue;
        }
        let pool = IpcPool::import(fd.as_fd(), pool_device, pool_device)?;
        // One pool under two keys (its file descriptor sent under two export ids, or one peer
        // met twice from outside this pid namespace): the driver may give the live import's
        // handle again, which destroying this one would destroy under that one's pointers. It
        // is that import, listed under `key` too; the new one is never destroyed (leaked, once
        // per key).
        let same = p
            .values()
            .filter_map(Weak::upgrade)
            .find(|a| a.pool.as_ref().map(|q| q.handle_id()) == Some(pool.handle_id()));
        if let Some(a) = same {
            std::mem::forget(pool);
            p.insert(key, Arc::downgrade(&a));
            drop(p);
            a.grant(ordinal)?;
            return Ok(a);
        }
        let a = Arc::new(ImportedPool {
            key,
            pool: Some(pool),
            granted: Mutex::new(vec![pool_device]),
        });
        p.insert(key, Arc::downgrade(&a));
        drop(p);
        opened.fetch_add(1, Ordering::Relaxed);
        // On a refusal the new pool (no pointer in it yet) is destroyed here, outside the lock.
        a.grant(ordinal)?;
        return Ok(a);
    }
}

/// The pointer of `pool`'s exporter whose `cuMemPoolExportPointer` data is `data`, imported
/// into `pool`: the live import, or a new one (`cuMemPoolImportPointer`, counted in `opened`)
/// whose allocation must hold `alloc_len` bytes (the peer's word, checked against
/// `cuMemGetAddressRange` of the import; freed again if it does not). Its size is `alloc_len`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] when the allocation is shorter than `alloc_len`; [`Error::Cuda`]
/// from the driver (export data that names no live allocation of the pool).
#[doc(alias = "cuMemPoolImportPointer")]
pub(crate) fn import_pool_ptr(
    pool: &Arc<ImportedPool>,
    data: &[u8; 64],
    alloc_len: u64,
    opened: &AtomicU64,
) -> Result<Arc<Import>> {
    let (pid, id) = pool.key;
    import_as(
        Key::PoolPtr {
            pid,
            id,
            data: *data,
        },
        opened,
        || {
            let p = pool.pool.as_ref().expect("held until dropped");
            let h = PoolPtrHandle::from_export_data(*data, alloc_len);
            let mem = PoolImport::<u8>::open(p, &h)?;
            let base = mem.device_ptr();
            Ok((
                Mapped::Pool {
                    _mem: mem,
                    _pool: pool.clone(),
                },
                base,
                alloc_len,
            ))
        },
    )
}

/// The live import for `key`, or a new one made by `open` (mapping, its base, its real size).
///
/// One allocation can come under two keys: a pool's file descriptor sent under two export ids,
/// a handle with other bytes the driver ignores, or one peer met twice from outside this pid
/// namespace (each meeting its own key). The driver may then hand the new mapping the address
/// of a live import (a second import of one pointer aliases the first, which freeing either
/// would free). Such a mapping is never freed (leaked, once per key): at a live import's base
/// it is that import, listed under `key` too; overlapping one otherwise, it is refused.
///
/// # Errors
///
/// As `open`; [`Error::InvalidArgument`] (`peer`) for a mapping that overlaps a live import
/// without starting at its base.
fn import_as(
    key: Key,
    opened: &AtomicU64,
    open: impl FnOnce() -> Result<(Mapped, u64, u64)>,
) -> Result<Arc<Import>> {
    loop {
        let mut c = cache();
        if let Some(w) = c.get(&key) {
            if let Some(a) = w.upgrade() {
                return Ok(a);
            }
            // Its last holder is closing it (which waits for the device's queued work):
            // opening the same handle again before that may fail, so let it finish first.
            drop(c);
            std::thread::sleep(std::time::Duration::from_micros(50));
            continue;
        }
        let (mem, base, size) = open()?;
        // Imports being closed are skipped: their addresses may be given out again. (Mappings
        // for another local GPU are that GPU's own.)
        let end = base.saturating_add(size.max(1));
        let live = c.values().filter_map(Weak::upgrade).find(|a| {
            a.key.ordinal() == key.ordinal()
                && a.base < end
                && base < a.base.saturating_add(a.size.max(1))
        });
        if let Some(a) = live {
            // Another holder's mapping: freeing this one could free it under its copies.
            std::mem::forget(mem);
            if a.base != base {
                return Err(Error::invalid(
                    "peer",
                    format!("{base:#x} +{size}"),
                    format!(
                        "the driver mapped the peer's allocation over a live import ({:#x} \
                         +{}): one allocation described two ways",
                        a.base, a.size
                    ),
                ));
            }
            c.insert(key, Arc::downgrade(&a));
            return Ok(a);
        }
        let a = Arc::new(Import {
            key,
            mem: Some(mem),
            base,
            size,
        });
        c.insert(key, Arc::downgrade(&a));
        opened.fetch_add(1, Ordering::Relaxed);
        return Ok(a);
    }
}

impl Drop for Import {
    fn drop(&mut self) {
        // Closed outside the cache's lock: `cuIpcCloseMemHandle` (and unmapping) waits for the
        // work queued on the device, and every other import of the process would wait with it.
        // The dead entries stay in the map until the mapping is closed, so nobody opens the
        // same handle meanwhile (`import` waits for them to go). Counted first: a copy graph
        // set to these addresses is set again before its next launch.
        memory_released();
        drop(self.mem.take());
        let me: *const Import = self;
        // Every key this import answered to (its own, and those of aliases): no other import
        // can be listed under them while they are in the map.
        cache().retain(|_, w| !(w.strong_count() == 0 && std::ptr::eq(w.as_ptr(), me)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A mapping of `size` bytes at `base` that counts its frees in `freed`.
    fn fake(base: u64, size: u64, freed: &Arc<AtomicU64>) -> Result<(Mapped, u64, u64)> {
        Ok((Mapped::Fake(freed.clone()), base, size))
    }

    #[test]
    fn a_mapping_the_driver_gives_at_a_live_import_s_address_is_that_import_never_freed() {
        let opened = AtomicU64::new(0);
        let freed = Arc::new(AtomicU64::new(0));
        let pid = u32::MAX - 7;
        let key = |id, data| Key::PoolPtr {
            pid,
            id,
            data: [data; 64],
        };
        let base = 0x7e00_0000_0000;
        // One pool allocation reached under two keys (its pool's file descriptor sent under two
        // export ids, or one peer met twice from another pid namespace): the driver may hand the
        // second import the first one's address.
        let a = import_as(key(1, 9), &opened, || fake(base, 1 << 20, &freed)).unwrap();
        let b = import_as(key(2, 9), &opened, || fake(base, 1 << 20, &freed)).unwrap();
        assert!(Arc::ptr_eq(&a, &b), "two imports own one mapping");
        assert_eq!(freed.load(Ordering::Relaxed), 0, "the alias was freed");
        // Looked up again under either key: the one import, nothing opened.
        let c = import_as(key(2, 9), &opened, || panic!("opened again")).unwrap();
        assert!(Arc::ptr_eq(&a, &c));
        // A mapping overlapping a live one without starting where it does: refused, not freed.
        let e = import_as(key(3, 9), &opened, || fake(base + 4096, 4096, &freed)).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        assert_eq!(
            freed.load(Ordering::Relaxed),
            0,
            "an overlapping mapping was freed"
        );
        drop((a, b, c));
        // Freed once, and every key it answered to is gone: a new import under either opens.
        assert_eq!(freed.load(Ordering::Relaxed), 1);
        for k in [key(1, 9), key(2, 9)] {
            let d = import_as(k, &opened, || fake(base, 1 << 20, &freed)).unwrap();
            drop(d);
        }
        assert_eq!(freed.load(Ordering::Relaxed), 3);
        assert!(
            !cache()
                .keys()
                .any(|k| matches!(k, Key::PoolPtr { pid: p, .. } if *p == pid))
        );
    }

    #[test]
    fn links_without_a_gpu_say_what_they_cross() {
        assert_eq!(link(None, Some(1)), IpcLink::LocalHost);
        assert_eq!(link(Some(3), Some(3)), IpcLink::SameDevice);
        assert!(matches!(link(Some(0), None), IpcLink::Unknown { .. }));
    }
}
