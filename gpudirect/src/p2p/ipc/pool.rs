//! Pool memory shared with other processes: a pool created with a POSIX-fd handle type
//! (`cuMemPoolCreate`), exported as a descriptor (`cuMemPoolExportToShareableHandle`), and its
//! allocations exported pointer by pointer (`cuMemPoolExportPointer`/`cuMemPoolImportPointer`).
//!
//! The device's default pool (cudarc's `CudaSlice`) cannot do this: it has no shareable handle
//! type. Allocate what you share from an [`IpcPool`].

use super::handle::{check_elem_size, check_imported};
use crate::cuda::{self, Stream};
use crate::driver::{self, pool};
use crate::error::{Error, Result};
use crate::memory::alloc::{Allocation, Release, thin_memory};
use crate::memory::{DeviceMemory, MemoryKind, Pod};
use crate::p2p::access::{device_location, pool_of};
use crate::p2p::home::{Home, Recorded};
use cudarc::driver::{CudaContext, sys};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// A stream-ordered memory pool on one device that other processes can import.
#[derive(Debug)]
pub struct IpcPool {
    pool: sys::CUmemoryPool,
    ctx: Arc<CudaContext>,
    /// The device the pool's memory lives on (this process's numbering).
    device: usize,
    imported: bool,
    /// The pool's own descriptor, exported when the pool is created: allocations can be shared
    /// only once the pool has been exported.
    fd: Option<OwnedFd>,
    pid: u32,
}

/// The pools this process made or imported as [`IpcPool`]s (by handle), whether imported, and
/// the pool itself (weakly): what lets [`IpcExport::new`](super::IpcExport::new) name the right
/// export API for their memory, and the transfer engine reach the pool of memory it registers.
type Known = HashMap<usize, (bool, Weak<IpcPool>)>;

fn known_pools() -> &'static Mutex<Known> {
    static POOLS: OnceLock<Mutex<Known>> = OnceLock::new();
    POOLS.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Where pool memory at `ptr` comes from: `Some(false)` for an allocation of an [`IpcPool`] made
/// here, `Some(true)` for a pointer imported into an imported one, `None` for any other pool
/// (the device's default pool: cudarc's `CudaSlice`) or when the driver cannot say. The caller
/// makes a context current.
pub(crate) fn ipc_pool_of(ptr: u64) -> Option<bool> {
    let pool = pool_of(ptr).ok()??;
    known_pools()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&(pool as usize))
        .map(|k| k.0)
}

/// The [`IpcPool`] made in this process whose memory `ptr` is, while it lives; `None` for
/// memory of another pool (the device's default pool, an imported pool) or when the driver
/// cannot say. The caller makes a context current.
#[cfg(feature = "transfer")]
pub(crate) fn exportable_pool_at(ptr: u64) -> Option<Arc<IpcPool>> {
    let pool = pool_of(ptr).ok()??;
    let known = known_pools().lock().unwrap_or_else(|e| e.into_inner());
    match known.get(&(pool as usize)) {
        Some((false, w)) => w.upgrade(),
        _ => None,
    }
}

fn remember(pool: &Arc<IpcPool>) {
    known_pools()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(pool.pool as usize, (pool.imported, Arc::downgrade(pool)));
}

// SAFETY: a CUmemoryPool is a driver handle usable from any thread.
unsafe impl Send for IpcPool {}
// SAFETY: as above; the driver synchronizes pool calls.
unsafe impl Sync for IpcPool {}

impl IpcPool {
    /// `cuMemPoolCreate` on device `ordinal` with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`,
    /// then `cuMemPoolExportToShareableHandle` right away (the driver shares allocations of a pool
    /// only after the pool itself has been exported).
    ///
    /// # Errors
    ///
    /// [`Error::Cuda`] from the driver; [`Error::NoDevice`]/[`Error::Load`] without the device.
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html>
    #[doc(alias = "cuMemPoolCreate")]
    pub fn new(ordinal: usize) -> Result<Arc<IpcPool>> {
        let ctx = cuda::context(ordinal)?;
        driver::ctx::bind(&ctx)?;
        // SAFETY: all-zero is a valid CUmemPoolProps (no handle types, invalid type; set below).
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        props.location = device_location(ordinal);
        // SAFETY: context current; valid props.
        let pool = unsafe { pool::create(&props) }?;
        let mut out = IpcPool {
            pool,
            ctx,
            device: ordinal,
            imported: false,
            fd: None,
            pid: std::process::id(),
        };
        // SAFETY: a live pool made with the POSIX fd handle type (destroyed by `out`'s drop on
        // error).
        let fd = unsafe { pool::export_fd(pool) }?;
        // SAFETY: a new descriptor owned by us.
        out.fd = Some(unsafe { OwnedFd::from_raw_fd(fd) });
        let out = Arc::new(out);
        remember(&out);
        Ok(out)
    }

    /// A descriptor for the pool (a `dup` of the one exported at creation with
    /// `cuMemPoolExportToShareableHandle`), to send with [`super::send_fd`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an imported pool; [`Error::Os`] when `dup` fails.
    #[doc(alias = "cuMemPoolExportToShareableHandle")]
    pub fn export_fd(&self) -> Result<OwnedFd> {
        let fd = self.fd.as_ref().ok_or_else(|| {
            Error::invalid(
                "self",
                "an imported pool",
                "only the creating process exports",
            )
        })?;
        fd.try_clone().map_err(|source| Error::Os {
            call: "dup",
            source,
        })
    }

    /// `cuMemPoolImportFromShareableHandle`: the pool another process exported, whose memory
    /// lives on device `pool_device` (in this process's numbering), usable from device `ordinal`
    /// (granted with `cuMemPoolSetAccess` when that is another device).
    ///
    /// Import on the device the pool lives on (`ordinal == pool_device`) for copies to other
    /// devices at the link's speed. Pointers imported into a pool used from another device are
    /// that device's to address, but their bytes stay on `pool_device`: copies of them on
    /// `ordinal`'s side cross the link, and report it
    /// ([`CopyPath::Peer`](crate::p2p::CopyPath::Peer), never `SameDevice`).
    ///
    /// # Errors
    ///
    /// [`Error::NoDevice`] for an ordinal past the device count; [`Error::Cuda`] from the driver.
    #[doc(alias = "cuMemPoolImportFromShareableHandle")]
    pub fn import(fd: BorrowedFd<'_>, pool_device: usize, ordinal: usize) -> Result<Arc<IpcPool>> {
        let ctx = cuda::context(ordinal)?;
        driver::ctx::bind(&ctx)?;
        // SAFETY: context current; `fd` is open for the call.
        let pool = unsafe { pool::import_fd(fd.as_raw_fd()) }?;
        let out = Arc::new(IpcPool {
            pool,
            ctx,
            device: pool_device,
            imported: true,
            fd: None,
            pid: std::process::id(),
        });
        remember(&out);
        if ordinal != pool_device {
            out.grant(ordinal)?;
        }
        Ok(out)
    }

    /// `cuMemPoolSetAccess`: read-write access to the pool's memory for device `ordinal`.
    ///
    /// # Errors
    ///
    /// [`Error::Cuda`] from the driver (a device that cannot reach the pool's).
    #[doc(alias = "cuMemPoolSetAccess")]
    pub(crate) fn grant(&self, ordinal: usize) -> Result<()> {
        let desc = sys::CUmemAccessDesc {
            location: device_location(ordinal),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: a live pool.
        unsafe { pool::set_access(self.pool, &[desc]) }
    }

    /// The device the pool's memory lives on (this process's numbering).
    #[cfg(feature = "transfer")]
    pub(crate) fn device(&self) -> usize {
        self.device
    }

    /// The driver's `CUmemoryPool` handle, as a number: two imports of one pool may share it.
    #[cfg(feature = "transfer")]
    pub(crate) fn handle_id(&self) -> usize {
        self.pool as usize
    }

    /// `cuMemAllocFromPoolAsync` of `len` elements on `stream` (its device must be the pool's),
    /// then `cuStreamSynchronize` so the memory is usable from any stream.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for `len == 0`, an imported pool (imported pools cannot
    /// allocate) or a stream of another device; [`Error::StreamCapturing`] while `stream`
    /// captures a CUDA graph (a captured allocation would be made at every launch);
    /// [`Error::Cuda`] from the driver.
    #[doc(alias = "cuMemAllocFromPoolAsync")]
    pub fn alloc<T: Pod>(self: &Arc<Self>, len: usize, stream: &Stream) -> Result<PoolAlloc<T>> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .filter(|&b| b > 0)
            .ok_or_else(|| Error::invalid("len", len, "at least one byte, no overflow"))?;
        if self.imported {
            return Err(Error::invalid(
                "self",
                "an imported pool",
                "imported pools cannot allocate; import pointers with PoolImport::open",
            ));
        }
        if stream.context().ordinal() != self.device {
            return Err(Error::invalid(
                "stream",
                format!("a stream of device {}", stream.context().ordinal()),
                format!("the pool lives on device {}", self.device),
            ));
        }
        let (ptr, ()) = stream.enqueue("cuMemAllocFromPoolAsync", (), |raw, ()| {
            // SAFETY: the stream's context (the pool's device) is current; a live pool and
            // stream.
            unsafe { pool::alloc_async(bytes, self.pool, raw) }
        })?;
        let how = PoolMemory {
            pool: self.clone(),
            at: None,
        };
        // SAFETY: `len` elements of this pool's memory at `ptr`, freed only by `PoolMemory`
        // (usable on any stream once the allocating stream has passed it: synchronized below).
        let out = PoolAlloc(unsafe { Allocation::new(ptr, len, &self.ctx, how) });
        stream.synchronize()?;
        Ok(out)
    }
}

impl Drop for IpcPool {
    fn drop(&mut self) {
        known_pools()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(self.pool as usize));
        if crate::completion::forked(self.pid) || driver::ctx::bind(&self.ctx).is_err() {
            return;
        }
        // SAFETY: every allocation and import holds an Arc of the pool, so none is left.
        let _ = unsafe { pool::destroy(self.pool) };
    }
}

/// What another process needs to map one pool allocation: `CUmemPoolPtrExportData` and sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct PoolPtrHandle {
    #[cfg_attr(feature = "serde", serde(with = "super::handle::hex64"))]
    data: [u8; 64],
    /// The allocation's size in bytes.
    pub bytes: u64,
    /// `size_of` the element type.
    pub elem_size: u32,
    /// The pool's device (exporter's numbering).
    pub device: u32,
}

impl PoolPtrHandle {
    /// A handle of `bytes` bytes (elements of one byte) from the allocation's export data
    /// (a peer's: checked by [`PoolImport::open`]).
    #[cfg(feature = "transfer")]
    pub(crate) fn from_export_data(data: [u8; 64], bytes: u64) -> Self {
        PoolPtrHandle {
            data,
            bytes,
            elem_size: 1,
            device: 0,
        }
    }

    /// A handle with zeroed export data, for the property tests.
    #[cfg(test)]
    pub(crate) fn for_test(bytes: u64, elem_size: u32) -> Self {
        PoolPtrHandle {
            data: [0; 64],
            bytes,
            elem_size,
            device: 0,
        }
    }

    /// Check the handle's sizes (a peer's word, untrusted) for elements of `elem_size` bytes,
    /// before any FFI call: the element size matches and is non-zero, and `bytes` is a non-zero
    /// whole number of elements whose count fits `usize`. Returns the element count. (Whether
    /// `bytes` lies within the allocation is checked after importing it.)
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the field.
    pub fn check(&self, elem_size: usize) -> Result<usize> {
        let size = check_elem_size(self.elem_size, elem_size)?;
        if self.bytes == 0 || !self.bytes.is_multiple_of(size) {
            return Err(Error::invalid(
                "handle.bytes",
                self.bytes,
                format!("must be a non-zero whole number of {size}-byte elements"),
            ));
        }
        usize::try_from(self.bytes / size)
            .map_err(|_| Error::invalid("handle.bytes", self.bytes, "element count must fit usize"))
    }
}

/// Memory of an [`IpcPool`] (an allocation, or another process's allocation imported), freed
/// with `cuMemFree`; it holds the pool, which is destroyed only once all of its memory is freed.
pub(crate) struct PoolMemory {
    pool: Arc<IpcPool>,
    /// Where an import lives (an allocation of the pool is at home).
    at: Option<Recorded>,
}

// SAFETY: pool memory (an allocation of the pool, or a pointer imported into it), valid until
// `cuMemFree`, which only `release` calls; the pool outlives it (held here); no host view.
unsafe impl Release for PoolMemory {
    const KIND: MemoryKind = MemoryKind::Pool;
    const CALL: &'static str = "cuMemFree_v2";
    type Back = ();

    unsafe fn release(self, ptr: u64) -> Result<()> {
        if let Some(at) = &self.at {
            at.forget();
        }
        // No cuCtxSynchronize (unbounded, and it waits for every stream of the context, even one
        // blocked on another process): every data path of this crate holds the buffer in its
        // InFlight (or the tracker) until its work has completed, so when this runs no work this
        // crate queued can still use it. Work queued on the raw `device_ptr` by the caller's own
        // unsafe code is the caller's to finish first.
        // SAFETY: allocated from (or imported into) the pool, freed once (the caller's).
        unsafe { driver::mem::free(ptr) }
    }
}

/// An allocation from an [`IpcPool`]; freed with `cuMemFree` on drop (importers must have freed
/// their imports first: keep it until they acknowledge). In a forked child it leaks.
#[derive(Debug)]
#[doc(alias = "cuMemAllocFromPoolAsync")]
pub struct PoolAlloc<T: Pod>(Allocation<T, PoolMemory>);

thin_memory!(PoolAlloc);

impl<T: Pod> PoolAlloc<T> {
    /// `cuMemPoolExportPointer`.
    ///
    /// # Errors
    ///
    /// [`Error::Cuda`] from the driver.
    #[doc(alias = "cuMemPoolExportPointer")]
    pub fn export(&self) -> Result<PoolPtrHandle> {
        driver::ctx::bind(self.context())?;
        // SAFETY: `ptr` is a live allocation of an exportable pool.
        let d = unsafe { pool::export_pointer(self.device_ptr()) }?;
        Ok(PoolPtrHandle {
            data: d.reserved,
            bytes: self.byte_len() as u64,
            elem_size: std::mem::size_of::<T>() as u32,
            device: self.0.how().pool.device as u32,
        })
    }
}

/// Another process's pool allocation, imported with `cuMemPoolImportPointer` into an imported
/// [`IpcPool`]. Dropping it frees the import (`cuMemFree`), which the exporter's free must follow;
/// it does not synchronize: work that uses it owns it until that work has completed. In a forked
/// child it leaks.
#[derive(Debug)]
#[doc(alias = "cuMemPoolImportPointer")]
pub struct PoolImport<T: Pod>(Allocation<T, PoolMemory>);

thin_memory!(PoolImport);

impl<T: Pod> PoolImport<T> {
    /// `cuMemPoolImportPointer` from `pool` (imported with [`IpcPool::import`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an element-size mismatch, a pool that was not imported, or
    /// a handle whose `bytes` exceed the allocation imported (checked with
    /// `cuMemGetAddressRange`; the import is freed again); [`Error::Cuda`] from the driver.
    #[doc(alias = "cuMemPoolImportPointer")]
    pub fn open(pool: &Arc<IpcPool>, handle: &PoolPtrHandle) -> Result<Self> {
        let len = handle.check(std::mem::size_of::<T>())?;
        if !pool.imported {
            return Err(Error::invalid(
                "pool",
                "a pool created in this process",
                "import pointers into a pool imported with IpcPool::import",
            ));
        }
        driver::ctx::bind(&pool.ctx)?;
        let data = sys::CUmemPoolPtrExportData {
            reserved: handle.data,
        };
        // SAFETY: a live imported pool; the driver checks the export data (a peer's bytes).
        let ptr = unsafe { pool::import_pointer(pool.pool, &data) }?;
        // `bytes` is the peer's word: check it against the allocation imported.
        // SAFETY: context current; `ptr` was just imported, freed once on failure.
        unsafe {
            check_imported(
                ptr,
                ("handle.bytes", |base| ptr.wrapping_sub(base)),
                handle.bytes,
                std::mem::align_of::<T>() as u64,
                || {
                    let _ = driver::mem::free(ptr);
                },
            )
        }?;
        let how = PoolMemory {
            pool: pool.clone(),
            // In bounds of the import (checked above).
            at: Some(Recorded::new(
                ptr,
                len * std::mem::size_of::<T>(),
                Home::Device(pool.device),
                pool.ctx.ordinal(),
            )),
        };
        // SAFETY: the imported allocation holds `len` elements at `ptr` (checked above), freed
        // only by `PoolMemory`.
        Ok(PoolImport(unsafe {
            Allocation::new(ptr, len, &pool.ctx, how)
        }))
    }
}
