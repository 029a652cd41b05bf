//! `cuIpcGetMemHandle`/`cuIpcOpenMemHandle`: `cuMemAlloc` memory shared with another process.

use super::handle::{check_bus_id, check_elem_size, check_imported, to_bytes, to_chars};
use crate::cuda;
use crate::driver;
use crate::error::{Error, Result};
use crate::memory::alloc::{Allocation, Release, thin_memory};
use crate::memory::{DeviceMemory, MemoryKind, Pod};
use crate::p2p::home::{Home, Recorded};
use crate::p2p::link::bus_id_of;
use cudarc::driver::sys;

/// What another process needs to map an exported buffer: the driver's handle to the enclosing
/// allocation, the buffer's offset in it, and its size. Plain data; serialize it for the peer.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct IpcMemHandle {
    /// `CUipcMemHandle`'s 64 bytes (128 hex digits when serialized).
    #[cfg_attr(feature = "serde", serde(with = "super::handle::hex64"))]
    handle: [u8; 64],
    /// Bytes from the allocation's base to the buffer.
    pub offset: u64,
    /// The buffer's size in bytes.
    pub bytes: u64,
    /// `size_of` the element type, checked by the importer.
    pub elem_size: u32,
    /// The exporting device's ordinal (in the exporter's numbering).
    pub device: u32,
    /// The exporting device's PCI address, such as `0000:19:00.0`: where the memory lives, in
    /// terms every process on the node shares (ordinals depend on `CUDA_VISIBLE_DEVICES`).
    /// [`IpcMemory::open`] maps the memory on that device; `None` when the exporter did not say.
    #[cfg_attr(feature = "serde", serde(default))]
    pub pci_bus_id: Option<String>,
}

impl IpcMemHandle {
    /// A handle from its parts (for tests and custom transports).
    pub fn from_parts(
        handle: [u8; 64],
        offset: u64,
        bytes: u64,
        elem_size: u32,
        device: u32,
        pci_bus_id: Option<String>,
    ) -> Self {
        IpcMemHandle {
            handle,
            offset,
            bytes,
            elem_size,
            device,
            pci_bus_id,
        }
    }

    /// The raw `CUipcMemHandle` bytes.
    pub fn bytes_raw(&self) -> &[u8; 64] {
        &self.handle
    }

    /// Check the handle's sizes (a peer's word, untrusted) for elements of `elem_size` bytes,
    /// before any FFI call: the element size matches and is non-zero, `bytes` is whole elements
    /// whose count fits `usize`, `offset + bytes` stays within 2^64, and the PCI address (when
    /// given) is one. Returns the element count. (Whether the range lies in the allocation is
    /// checked after mapping it.)
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the field.
    pub fn check(&self, elem_size: usize) -> Result<usize> {
        let size = check_elem_size(self.elem_size, elem_size)?;
        if !self.bytes.is_multiple_of(size) {
            return Err(Error::invalid(
                "handle.bytes",
                self.bytes,
                format!("must be a whole number of {size}-byte elements"),
            ));
        }
        if self.offset.checked_add(self.bytes).is_none() {
            return Err(Error::invalid(
                "handle.offset",
                self.offset,
                "offset + bytes passes 2^64",
            ));
        }
        check_bus_id(self.pci_bus_id.as_deref())?;
        usize::try_from(self.bytes / size)
            .map_err(|_| Error::invalid("handle.bytes", self.bytes, "element count must fit usize"))
    }
}

/// A buffer exported for other processes: it owns the buffer, so the memory stays allocated while
/// the export exists.
///
/// Other processes' mappings do not keep the memory alive: keep the export until they have closed
/// their mappings (a protocol-level acknowledgement), then take the buffer back with
/// [`into_inner`](Self::into_inner) or drop it.
#[derive(Debug)]
pub struct IpcExport<B> {
    buf: B,
    handle: IpcMemHandle,
}

impl<B: DeviceMemory> IpcExport<B> {
    /// `cuIpcGetMemHandle` for `buf` (`cuMemAlloc` memory), with `cuMemGetAddressRange` for its
    /// offset in the allocation.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for other memory kinds, naming the API that shares them: VMM memory
    /// is shared by file descriptor ([`super::export_vmm`]); memory of an [`super::IpcPool`] by
    /// [`super::PoolAlloc::export`]; default-pool memory (cudarc's `CudaSlice`) is not exportable
    /// (`cuMemPoolExportPointer` needs a pool created with a shareable handle type); host memory
    /// is not device memory. [`Error::Cuda`] from the driver.
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html>
    #[doc(alias = "cuIpcGetMemHandle")]
    pub fn new(buf: B) -> Result<Self> {
        match buf.kind() {
            MemoryKind::Device => {}
            MemoryKind::Vmm => {
                return Err(Error::Unsupported {
                    what: "cuIpcGetMemHandle on VMM memory".into(),
                    reason: "VMM memory is shared as a POSIX fd: use p2p::export_vmm".into(),
                });
            }
            MemoryKind::Pool => {
                let origin = cuda::context(buf.ordinal())
                    .ok()
                    .filter(|ctx| driver::ctx::bind(ctx).is_ok())
                    .and_then(|_| super::pool::ipc_pool_of(buf.device_ptr()));
                return Err(pool_refusal(origin));
            }
            other => {
                return Err(Error::Unsupported {
                    what: format!("IPC export of {other:?} memory"),
                    reason: "only device memory is exported".into(),
                });
            }
        }
        let pci_bus_id = Some(bus_id_of(buf.ordinal())?);
        driver::ctx::bind(&*cuda::context(buf.ordinal())?)?;
        let ptr = buf.device_ptr();
        // SAFETY: context current; `ptr` is live device memory owned by `buf`.
        let (base, _) = unsafe { driver::mem::address_range(ptr) }?;
        // SAFETY: context current; `base` is the start of a cuMemAlloc allocation (kind Device).
        let h = unsafe { driver::ipc::get_mem_handle(base) }?;
        let handle = IpcMemHandle {
            handle: to_bytes(&h.reserved),
            offset: ptr.checked_sub(base).ok_or_else(|| {
                Error::invalid(
                    "buf",
                    format!("{ptr:#x}"),
                    format!("lies before its allocation's base {base:#x}"),
                )
            })?,
            bytes: buf.byte_len() as u64,
            elem_size: std::mem::size_of::<B::Elem>() as u32,
            device: buf.ordinal() as u32,
            pci_bus_id,
        };
        Ok(IpcExport { buf, handle })
    }

    /// The handle to send to the importing process.
    pub fn handle(&self) -> &IpcMemHandle {
        &self.handle
    }

    /// The exported buffer (for this process's own use; it stays exported).
    pub fn buffer(&self) -> &B {
        &self.buf
    }

    /// End the export and take the buffer back. Importers must have closed their mappings.
    pub fn into_inner(self) -> B {
        self.buf
    }
}

/// Why [`IpcExport::new`] refuses pool memory, naming the API that does share it: `origin` is
/// [`super::pool::ipc_pool_of`]'s answer.
fn pool_refusal(origin: Option<bool>) -> Error {
    match origin {
        Some(false) => Error::Unsupported {
            what: "cuIpcGetMemHandle on IpcPool memory".into(),
            reason: "memory of an IpcPool is shared pointer by pointer: send the pool's fd \
                     (IpcPool::export_fd) once and each allocation's PoolAlloc::export handle \
                     (cuMemPoolExportPointer)"
                .into(),
        },
        Some(true) => Error::Unsupported {
            what: "IPC export of imported pool memory".into(),
            reason: "a pointer imported from another process's IpcPool (PoolImport) cannot be \
                     exported again: the exporting process shares it"
                .into(),
        },
        None => Error::Unsupported {
            what: "IPC export of pool memory".into(),
            reason: "cuMemPoolExportPointer needs a pool created with a shareable handle type; \
                     the default pool (cuMemAllocAsync, cudarc's CudaSlice) has none: allocate \
                     what you share from a p2p::IpcPool"
                .into(),
        },
    }
}

/// Device memory of another process, mapped with `cuIpcOpenMemHandle`; `len` elements of `T`.
///
/// It is a data-path buffer like any other ([`DeviceMemory`], [`DeviceMemoryMut`](crate::memory::DeviceMemoryMut): copies into it
/// write the exporter's memory). [`open`](Self::open) maps it on the device it lives on, so that
/// its [`ordinal`](DeviceMemory::ordinal) is that device and a copy to another device runs peer to
/// peer from there, at the link's speed. [`open_on`](Self::open_on) maps it for another device
/// (over lazy peer access): copies then cross the link from that device's side, and report it.
///
/// Dropping it calls `cuIpcCloseMemHandle` without synchronizing: work that uses it owns it (in
/// an [`InFlight`](crate::completion::InFlight) or the tracker) until that work has completed, so
/// nothing of ours still uses the mapping when it is dropped. The driver's unmap itself waits for
/// the device like `cuMemFree` does (docs/p2p.md): do not drop an import while a stream of the
/// same context is blocked on something only this thread releases. In a forked child it leaks.
#[derive(Debug)]
#[doc(alias = "cuIpcOpenMemHandle")]
pub struct IpcMemory<T: Pod>(Allocation<T, IpcMapping>);

/// A mapping from `cuIpcOpenMemHandle`, closed with `cuIpcCloseMemHandle`.
pub(crate) struct IpcMapping {
    /// The mapping's base (the buffer may start further in).
    base: u64,
    /// Where the bytes live.
    at: Recorded,
}

// SAFETY: the exporter's device memory, mapped into this process at `base` for the context's
// device (directly, or over peer access) until `cuIpcCloseMemHandle`; no host view.
unsafe impl Release for IpcMapping {
    const KIND: MemoryKind = MemoryKind::Device;
    const CALL: &'static str = "cuIpcCloseMemHandle";
    type Back = ();

    unsafe fn release(self, _ptr: u64) -> Result<()> {
        self.at.forget();
        // No cuCtxSynchronize (unbounded, and it waits for every stream of the context, even one
        // blocked on another process): every data path of this crate holds the buffer in its
        // InFlight (or the tracker) until its work has completed, so when this runs no work this
        // crate queued can still use the mapping. Work queued on the raw `device_ptr` by the
        // caller's own unsafe code is the caller's to finish first.
        // SAFETY: `base` came from cuIpcOpenMemHandle_v2 and is closed once (the caller's).
        unsafe { driver::ipc::close_mem_handle(self.base) }
    }
}

thin_memory!(IpcMemory);

impl<T: Pod> IpcMemory<T> {
    /// `cuIpcOpenMemHandle_v2` on the device the memory lives on: the visible device at the
    /// handle's [`pci_bus_id`](IpcMemHandle::pci_bus_id).
    ///
    /// # Errors
    ///
    /// [`Error::NoDevice`] when the handle names no PCI address, or no visible device is at it
    /// (another `CUDA_VISIBLE_DEVICES`: use [`open_on`](Self::open_on)); otherwise as
    /// [`open_on`](Self::open_on).
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html>
    #[doc(alias = "cuIpcOpenMemHandle_v2")]
    pub fn open(handle: &IpcMemHandle) -> Result<Self> {
        handle.check(std::mem::size_of::<T>())?;
        let (ordinal, home) = Home::required(handle.pci_bus_id.as_deref(), "IpcMemory::open_on")?;
        Self::map(handle, ordinal, home)
    }

    /// `cuIpcOpenMemHandle_v2` on device `ordinal` (with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, so
    /// memory of another device maps over peer access when the pair allows it).
    ///
    /// When the memory lives on another device, copies of it on `ordinal`'s side cross the link
    /// (and say so: [`CopyPath::Peer`](crate::p2p::CopyPath::Peer), never `SameDevice`), pulled by
    /// `ordinal`'s copy engines; [`open`](Self::open) maps it where it lives instead.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the handle's element size differs from `size_of::<T>()`,
    /// its size is not a whole number of elements, its PCI address is malformed, or its
    /// `offset..offset + bytes` does not lie (element-aligned) within the allocation mapped
    /// (checked with `cuMemGetAddressRange`; the mapping is closed again); [`Error::Cuda`] from
    /// the driver (`CUDA_ERROR_INVALID_CONTEXT` or `CUDA_ERROR_INVALID_VALUE` for a handle opened
    /// in the process that exported it, `CUDA_ERROR_MAP_FAILED` when the exporter has freed it);
    /// [`Error::NoDevice`] for an ordinal past the device count.
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html>
    #[doc(alias = "cuIpcOpenMemHandle_v2")]
    pub fn open_on(handle: &IpcMemHandle, ordinal: usize) -> Result<Self> {
        handle.check(std::mem::size_of::<T>())?;
        let home = Home::of_bus_id(handle.pci_bus_id.as_deref())?;
        Self::map(handle, ordinal, home)
    }

    /// Open the handle on device `ordinal`, check the peer's range, record where it lives.
    fn map(handle: &IpcMemHandle, ordinal: usize, home: Home) -> Result<Self> {
        let len = handle.check(std::mem::size_of::<T>())?;
        let ctx = cuda::context(ordinal)?;
        driver::ctx::bind(&ctx)?;
        let h = sys::CUipcMemHandle {
            reserved: to_chars(&handle.handle),
        };
        // SAFETY: context current; the handle is plain bytes the driver checks.
        let base = unsafe {
            driver::ipc::open_mem_handle(h, sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        }?;
        // The offset and size are the peer's word: check them against what was mapped.
        // SAFETY: context current; `base` is the mapping just made, closed once on failure.
        let mapped = unsafe {
            check_imported(
                base,
                ("handle.offset", |_| handle.offset),
                handle.bytes,
                std::mem::align_of::<T>() as u64,
                || {
                    let _ = driver::ipc::close_mem_handle(base);
                },
            )
        }?;
        let at = Recorded::new(base, mapped, home, ordinal);
        // SAFETY: the exporter's memory mapped at `base` (`mapped` bytes, which hold
        // `offset + bytes`: checked above, so no overflow) in `ctx`, closed only by `IpcMapping`.
        Ok(IpcMemory(unsafe {
            Allocation::new(base + handle.offset, len, &ctx, IpcMapping { base, at })
        }))
    }

    /// The device, in this process's numbering, whose memory holds the bytes (the one this
    /// mapping was opened on, or another when opened with [`open_on`](Self::open_on)); `None`
    /// when that device is not visible here or the handle did not say.
    pub fn home(&self) -> Option<usize> {
        self.0.how().at.home().ordinal()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_refusals_name_the_api_that_shares_the_memory() {
        let msg = |o| pool_refusal(o).to_string();
        let own = msg(Some(false));
        assert!(own.contains("PoolAlloc::export"), "{own}");
        assert!(
            !own.contains("allocate"),
            "IpcPool memory is not told to use an IpcPool: {own}"
        );
        let imported = msg(Some(true));
        assert!(imported.contains("PoolImport"), "{imported}");
        assert!(!imported.contains("allocate"), "{imported}");
        let default = msg(None);
        assert!(
            default.contains("CudaSlice") && default.contains("IpcPool"),
            "{default}"
        );
        for o in [Some(false), Some(true), None] {
            assert!(matches!(pool_refusal(o), Error::Unsupported { .. }));
        }
    }
}
