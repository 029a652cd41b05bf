//! `cuIpcGetMemHandle`/`cuIpcOpenMemHandle`: `cuMemAlloc` memory shared with another process.

use super::{address_range, check_import_range, hex64, to_bytes, to_chars};
use crate::cuda;
use crate::error::{Error, Result, cu, from_driver};
use crate::memory::{DeviceMemory, DeviceMemoryMut, MemoryKind, Pod};
use cudarc::driver::{CudaContext, sys};
use std::marker::PhantomData;
use std::sync::Arc;

/// What another process needs to map an exported buffer: the driver's handle to the enclosing
/// allocation, the buffer's offset in it, and its size. Plain data; serialize it for the peer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IpcMemHandle {
    /// `CUipcMemHandle`'s 64 bytes (128 hex digits when serialized).
    #[serde(with = "hex64")]
    handle: [u8; 64],
    /// Bytes from the allocation's base to the buffer.
    pub offset: u64,
    /// The buffer's size in bytes.
    pub bytes: u64,
    /// `size_of` the element type, checked by the importer.
    pub elem_size: u32,
    /// The exporting device's ordinal (in the exporter's numbering).
    pub device: u32,
}

impl IpcMemHandle {
    /// A handle from its parts (for tests and custom transports).
    pub fn from_parts(
        handle: [u8; 64],
        offset: u64,
        bytes: u64,
        elem_size: u32,
        device: u32,
    ) -> Self {
        IpcMemHandle {
            handle,
            offset,
            bytes,
            elem_size,
            device,
        }
    }

    /// The raw `CUipcMemHandle` bytes.
    pub fn bytes_raw(&self) -> &[u8; 64] {
        &self.handle
    }

    /// Check the handle's sizes (a peer's word, untrusted) for elements of `elem_size` bytes,
    /// before any FFI call: the element size matches and is non-zero, `bytes` is whole elements
    /// whose count fits `usize`, and `offset + bytes` stays within 2^64. Returns the element
    /// count. (Whether the range lies in the allocation is checked after mapping it.)
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the field.
    pub fn check(&self, elem_size: usize) -> Result<usize> {
        let size = elem_size as u64;
        if self.elem_size as u64 != size || size == 0 {
            return Err(Error::invalid(
                "handle.elem_size",
                self.elem_size,
                format!("must equal size_of::<T>() = {size} (non-zero)"),
            ));
        }
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
                    reason: "VMM memory is shared as a POSIX fd: use p2p::ipc::export_vmm".into(),
                });
            }
            MemoryKind::Pool => {
                let origin = cuda::context(buf.ordinal())
                    .ok()
                    .filter(|ctx| ctx.bind_to_thread().is_ok())
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
        let ctx = cuda::context(buf.ordinal())?;
        ctx.bind_to_thread()
            .map_err(|e| from_driver("cuCtxSetCurrent", e))?;
        let ptr = buf.device_ptr();
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: context current; valid out-pointers; `ptr` is live device memory owned by `buf`.
        cu("cuMemGetAddressRange_v2", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
        })?;
        // SAFETY: all-zero is a valid CUipcMemHandle (plain bytes).
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer; `base` is the start of a cuMemAlloc allocation.
        cu("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut h, base)
        })?;
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
                     what you share from a p2p::ipc::IpcPool"
                .into(),
        },
    }
}

/// Device memory of another process, mapped with `cuIpcOpenMemHandle`; `len` elements of `T`.
///
/// It is a data-path buffer like any other ([`DeviceMemory`], [`DeviceMemoryMut`]: copies into it
/// write the exporter's memory). Dropping it calls `cuIpcCloseMemHandle` without synchronizing:
/// work that uses it owns it (in an [`InFlight`](crate::completion::InFlight) or the tracker) until
/// that work has completed, so nothing of ours still uses the mapping when it is dropped. The
/// driver's unmap itself waits for the device like `cuMemFree` does (seen on an H200): do not drop
/// an import while a stream of the same context is blocked on something only this thread releases.
#[derive(Debug)]
pub struct IpcMemory<T: Pod> {
    base: u64,
    ptr: u64,
    len: usize,
    ctx: Arc<CudaContext>,
    pid: u32,
    _elem: PhantomData<T>,
}

impl<T: Pod> IpcMemory<T> {
    /// `cuIpcOpenMemHandle_v2` on device `ordinal` (with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, so
    /// a handle from another device maps over peer access when the pair allows it).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the handle's element size differs from `size_of::<T>()`,
    /// its size is not a whole number of elements, or its `offset..offset + bytes` does not lie
    /// (element-aligned) within the allocation mapped (checked with `cuMemGetAddressRange`; the
    /// mapping is closed again); [`Error::Cuda`] from the driver
    /// (`CUDA_ERROR_INVALID_CONTEXT` or `CUDA_ERROR_INVALID_VALUE` for a handle opened in the
    /// process that exported it, `CUDA_ERROR_MAP_FAILED` when the exporter has freed it);
    /// [`Error::NoDevice`] for an ordinal past the device count.
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html>
    #[doc(alias = "cuIpcOpenMemHandle")]
    #[doc(alias = "cuIpcOpenMemHandle_v2")]
    pub fn open(handle: &IpcMemHandle, ordinal: usize) -> Result<Self> {
        let len = handle.check(std::mem::size_of::<T>())?;
        let ctx = cuda::context(ordinal)?;
        ctx.bind_to_thread()
            .map_err(|e| from_driver("cuCtxSetCurrent", e))?;
        let h = sys::CUipcMemHandle {
            reserved: to_chars(&handle.handle),
        };
        let mut base = 0;
        // SAFETY: context current; valid out-pointer; the handle is plain bytes the driver checks.
        cu("cuIpcOpenMemHandle_v2", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        // The offset and size are the peer's word: check them against what was mapped.
        if let Err(e) = address_range(base).and_then(|(_, mapped)| {
            check_import_range(
                "handle.offset",
                handle.offset,
                handle.bytes,
                mapped,
                std::mem::align_of::<T>() as u64,
            )
        }) {
            // SAFETY: opened above, not yet used by anything; closed once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(base) };
            return Err(e);
        }
        Ok(IpcMemory {
            base,
            // In bounds of the mapping (checked above), so no overflow.
            ptr: base + handle.offset,
            len,
            ctx,
            pid: std::process::id(),
            _elem: PhantomData,
        })
    }
}

// SAFETY: the mapping stays open until drop, at a fixed address, covering `offset + bytes` of
// the exporter's allocation on this context's device.
unsafe impl<T: Pod> DeviceMemory for IpcMemory<T> {
    type Elem = T;
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }
    fn kind(&self) -> MemoryKind {
        MemoryKind::Device
    }
}

// SAFETY: no Rust reference to the mapped bytes is ever handed out.
unsafe impl<T: Pod> DeviceMemoryMut for IpcMemory<T> {}

impl<T: Pod> Drop for IpcMemory<T> {
    fn drop(&mut self) {
        if crate::completion::forked(self.pid) || self.ctx.bind_to_thread().is_err() {
            return; // forked child or dead context: leave the mapping
        }
        // No cuCtxSynchronize (unbounded, and it waits for every stream of the context, even one
        // blocked on another process): every data path of this crate holds the buffer in its
        // InFlight (or the tracker) until its work has completed, so when this runs no work this
        // crate queued can still use the mapping. Work queued on the raw `device_ptr` by the
        // caller's own unsafe code is the caller's to finish first.
        // SAFETY: `base` came from cuIpcOpenMemHandle_v2 and is closed once.
        let _ = unsafe { sys::cuIpcCloseMemHandle(self.base) };
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
