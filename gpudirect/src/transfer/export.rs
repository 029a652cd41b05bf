//! CUDA IPC exports of registered GPU memory, for the intra-node path: each allocation exported
//! once when it is registered (a `cuIpc` handle, a VMM allocation's file descriptor, or a pool's
//! file descriptor and the allocation's pointer export data), the process-wide list of the file
//! descriptor exports a local endpoint may send, and GPUs' UUIDs.

use super::region::{ExportFd, Exported, ExportedAs, FdOf};
use crate::error::{Error, Result};
use crate::p2p::IpcPool;
use std::collections::HashMap;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

/// `cuIpcGetMemHandle` of the allocation holding `ptr` on device `ordinal`, with its base and
/// length (`cuMemGetAddressRange`) and the device's UUID.
///
/// # Errors
///
/// [`Error::Cuda`] from the driver (memory that is not `cuMemAlloc` memory); as
/// [`crate::cuda::context`].
pub(crate) fn export(ordinal: usize, ptr: u64) -> Result<Exported> {
    let uuid = uuid_of(ordinal)?;
    let ctx = crate::cuda::context(ordinal)?;
    crate::driver::ctx::bind(&ctx)?;
    // SAFETY: context current; `ptr` is live device memory that the registration holds.
    let (base, size) = unsafe { crate::driver::mem::address_range(ptr) }?;
    // SAFETY: context current; `base` starts the live `cuMemAlloc` allocation holding `ptr`.
    let h = unsafe { crate::driver::ipc::get_mem_handle(base) }?;
    Ok(Exported {
        how: ExportedAs::Handle(h.reserved.map(|c| c as u8)),
        base,
        alloc_len: size as u64,
        uuid,
    })
}

/// `cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)` of the VMM physical allocation mapped
/// at `base..base + len` on device `ordinal` (one whole mapping), under a new export id, listed
/// process-wide (by a weak reference) so that a local endpoint can send it to a peer.
///
/// # Errors
///
/// [`Error::Cuda`] from the driver (`CUDA_ERROR_NOT_SUPPORTED` for an allocation made without
/// the POSIX fd handle type); as [`crate::cuda::context`].
#[doc(alias = "cuMemExportToShareableHandle")]
#[doc(alias = "cuMemRetainAllocationHandle")]
pub(crate) fn export_vmm(ordinal: usize, base: u64, len: usize) -> Result<Exported> {
    let uuid = uuid_of(ordinal)?;
    let ctx = crate::cuda::context(ordinal)?;
    crate::driver::ctx::bind(&ctx)?;
    // SAFETY: context current; `base` is mapped VMM memory that the registration holds.
    let h = unsafe { crate::driver::vmm::retain_handle(base) }?;
    // SAFETY: `h` is live (retained above).
    let fd = unsafe { crate::driver::vmm::export_fd(h) };
    // SAFETY: the reference retained above, given back once; the mapping keeps its own.
    let _ = unsafe { crate::driver::vmm::release(h) };
    // SAFETY: the driver returned a new descriptor that the caller owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd?) };
    let v = Arc::new(ExportFd {
        id: next_export_id(),
        fd,
        of: FdOf::Vmm { len: len as u64 },
        uuid,
    });
    list(&v);
    Ok(Exported {
        how: ExportedAs::Vmm(v),
        base,
        alloc_len: len as u64,
        uuid,
    })
}

/// List `v` process-wide (weakly), forgetting exports that are gone.
fn list(v: &Arc<ExportFd>) {
    let mut all = exports();
    all.retain(|_, w| w.strong_count() > 0);
    all.insert(v.id, Arc::downgrade(v));
}

/// The pool allocation of `bytes` bytes at `ptr` on device `ordinal` (a registered buffer's
/// whole memory: a [`PoolAlloc`](crate::p2p::PoolAlloc) of an [`IpcPool`] made here): its
/// `cuMemPoolExportPointer` data, and the pool's file descriptor, exported once per pool while
/// registrations of its memory hold it (a `dup` of the one `IpcPool::new` exported), under an
/// export id listed process-wide as VMM exports are. The allocation is the buffer's own range,
/// which must lie inside what `cuMemGetAddressRange` says of `ptr`.
///
/// # Errors
///
/// [`Error::Unsupported`] for memory of a pool that cannot be exported (the device's default
/// pool: cudarc's `CudaSlice`, a `PoolBuffer`; a pointer imported from another process);
/// [`Error::InvalidArgument`] for a range the driver does not hold in one allocation;
/// [`Error::Cuda`] from the driver; [`Error::Os`] from `dup`; as [`crate::cuda::context`].
#[doc(alias = "cuMemPoolExportPointer")]
#[doc(alias = "cuMemPoolExportToShareableHandle")]
pub(crate) fn export_pool(ordinal: usize, ptr: u64, bytes: usize) -> Result<Exported> {
    let uuid = uuid_of(ordinal)?;
    let ctx = crate::cuda::context(ordinal)?;
    crate::driver::ctx::bind(&ctx)?;
    let pool = crate::p2p::exportable_pool_at(ptr).ok_or_else(|| Error::Unsupported {
        what: "CUDA IPC of this pool memory".into(),
        reason: "only memory of a pool made with a shareable handle type in this process (an \
                 IpcPool's PoolAlloc) is exported; the device's default pool (cudarc's \
                 CudaSlice, a PoolBuffer) has none, and imported pool memory is its owner's to \
                 share"
            .into(),
    })?;
    // SAFETY: context current; `ptr` is live pool memory that the registration holds.
    let (base, size) = unsafe { crate::driver::mem::address_range(ptr) }?;
    let inside = ptr >= base
        && (ptr - base)
            .checked_add(bytes as u64)
            .is_some_and(|end| end <= size as u64);
    if !inside {
        return Err(Error::invalid(
            "mem",
            format!("{ptr:#x} +{bytes}"),
            format!("cuMemGetAddressRange answers {base:#x} +{size}, which does not hold it"),
        ));
    }
    // SAFETY: context current; `ptr` starts the buffer's live allocation of an exportable pool.
    let data = unsafe { crate::driver::pool::export_pointer(ptr) }?;
    Ok(Exported {
        how: ExportedAs::Pool {
            pool: pool_fd(&pool, uuid)?,
            ptr_data: data.reserved,
        },
        base: ptr,
        alloc_len: bytes as u64,
        uuid,
    })
}

/// The export of `pool`'s file descriptor: the live one, or a new one (`dup` of the pool's).
fn pool_fd(pool: &Arc<IpcPool>, uuid: [u8; 16]) -> Result<Arc<ExportFd>> {
    type ByPool = HashMap<usize, Weak<ExportFd>>;
    static P: OnceLock<Mutex<ByPool>> = OnceLock::new();
    let mut by_pool = P
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    by_pool.retain(|_, w| w.strong_count() > 0);
    // Keyed by the pool's address: while an export of it lives, registrations hold the pool.
    let key = Arc::as_ptr(pool) as usize;
    if let Some(v) = by_pool.get(&key).and_then(Weak::upgrade) {
        return Ok(v);
    }
    let v = Arc::new(ExportFd {
        id: next_export_id(),
        fd: pool.export_fd()?,
        of: FdOf::Pool,
        uuid,
    });
    list(&v);
    by_pool.insert(key, Arc::downgrade(&v));
    Ok(v)
}

/// A new export id: a counter from a random start, so that two processes (even one that reuses
/// another's pid) are unlikely to share ids.
fn next_export_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static NEXT: OnceLock<AtomicU64> = OnceLock::new();
    NEXT.get_or_init(|| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        // Below 2^63: the counter never wraps.
        AtomicU64::new(h.finish() >> 1)
    })
    .fetch_add(1, Ordering::Relaxed)
}

/// The file descriptor exports (VMM, pool) alive in this process, by id.
fn exports() -> MutexGuard<'static, HashMap<u64, Weak<ExportFd>>> {
    static E: OnceLock<Mutex<HashMap<u64, Weak<ExportFd>>>> = OnceLock::new();
    E.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// An export (VMM or pool, as `of` says) made of any file descriptor, listed as
/// [`export_vmm`] lists one (tests without a GPU).
#[cfg(test)]
pub(crate) fn export_any_fd(fd: OwnedFd, of: FdOf, uuid: [u8; 16]) -> Arc<ExportFd> {
    let v = Arc::new(ExportFd {
        id: next_export_id(),
        fd,
        of,
        uuid,
    });
    exports().insert(v.id, Arc::downgrade(&v));
    v
}

/// The live file descriptor export `id` of this process (a registration still holds it).
pub(crate) fn published(id: u64) -> Option<Arc<ExportFd>> {
    exports().get(&id).and_then(Weak::upgrade)
}

/// The UUID of device `ordinal` (`cuDeviceGetUuid`).
///
/// # Errors
///
/// [`Error::NoDevice`] past the device count; as [`crate::cuda::device_count`].
pub(crate) fn uuid_of(ordinal: usize) -> Result<[u8; 16]> {
    let n = crate::cuda::device_count()?;
    if ordinal >= n {
        return Err(Error::NoDevice {
            what: "CUDA device",
            reason: format!("device {ordinal} requested, {n} visible"),
        });
    }
    // SAFETY: the driver is initialised (device_count) and `ordinal` is below the count.
    let dev = unsafe { crate::driver::device::get(ordinal) }?;
    // SAFETY: `dev` came from cuDeviceGet.
    unsafe { crate::driver::device::uuid(dev) }
}
