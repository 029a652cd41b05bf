//! VMM memory shared by POSIX file descriptor: `cuMemExportToShareableHandle` and
//! `cuMemImportFromShareableHandle`, the descriptor passed with [`super::send_fd`].

use crate::cuda;
use crate::error::{Error, Result, cu, from_driver};
use crate::memory::{DeviceMemory, DeviceMemoryMut, MemoryKind, Pod, VmmBuffer, VmmChunk};
use crate::p2p::access::device_location as access_location;
use cudarc::driver::{CudaContext, sys};
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

/// What the importer needs besides the descriptor: sizes and the element size. Plain data.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VmmHandle {
    /// The buffer's size in bytes.
    pub bytes: u64,
    /// The physical allocation's size (a multiple of the allocation granularity).
    pub mapped_bytes: u64,
    /// `size_of` the element type.
    pub elem_size: u32,
    /// The exporting device's ordinal (in the exporter's numbering).
    pub device: u32,
}

impl VmmHandle {
    /// Check a handle from a peer (untrusted) for elements of `elem_size` bytes, before any FFI
    /// call: the element size matches, `bytes` is whole elements within `mapped_bytes`, and
    /// `mapped_bytes` is non-zero and fits `usize`. Returns `(mapped_bytes, elements)`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the field.
    pub fn check(&self, elem_size: usize) -> Result<(usize, usize)> {
        let size = elem_size as u64;
        if self.elem_size as u64 != size || size == 0 {
            return Err(Error::invalid(
                "handle.elem_size",
                self.elem_size,
                format!("must equal size_of::<T>() = {size} (non-zero)"),
            ));
        }
        if !self.bytes.is_multiple_of(size) || self.bytes > self.mapped_bytes {
            return Err(Error::invalid(
                "handle.bytes",
                self.bytes,
                format!(
                    "must be whole {size}-byte elements within mapped_bytes = {}",
                    self.mapped_bytes
                ),
            ));
        }
        let mapped = usize::try_from(self.mapped_bytes)
            .ok()
            .filter(|&m| m > 0)
            .ok_or_else(|| {
                Error::invalid(
                    "handle.mapped_bytes",
                    self.mapped_bytes,
                    "must be non-zero and fit usize",
                )
            })?;
        let len = usize::try_from(self.bytes / size).map_err(|_| {
            Error::invalid("handle.bytes", self.bytes, "element count must fit usize")
        })?;
        Ok((mapped, len))
    }
}

/// `cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)`: a descriptor for `buf`'s physical
/// allocation and the sizes to map it with.
///
/// The descriptor keeps the allocation alive in whoever imports it; send it with
/// [`super::send_fd`] and the [`VmmHandle`] (serialized) as the payload.
///
/// # Errors
///
/// [`Error::Unsupported`] for a buffer of several physical chunks
/// ([`VmmBuffer::alloc_chunks`]), naming the chunks: the fd covers one physical allocation, so
/// an importer would see only the first chunk. [`Error::Cuda`] from the driver
/// (`CUDA_ERROR_NOT_SUPPORTED` when the allocation was not made with the POSIX fd handle type;
/// [`VmmBuffer`] always requests it).
///
/// # C function
///
/// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html>
#[doc(alias = "cuMemExportToShareableHandle")]
pub fn export_vmm<T: Pod>(buf: &VmmBuffer<T>) -> Result<(OwnedFd, VmmHandle)> {
    check_one_chunk(&buf.chunks(), buf.mapped_bytes())?;
    buf.context()
        .bind_to_thread()
        .map_err(|e| from_driver("cuCtxSetCurrent", e))?;
    let mut fd: libc::c_int = -1;
    // SAFETY: context current; the out-pointer is an int, as the POSIX fd handle type writes;
    // the handle is the buffer's live allocation.
    cu("cuMemExportToShareableHandle", unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut libc::c_int).cast(),
            buf.handle(),
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    // SAFETY: the driver returned a new descriptor owned by the caller.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok((
        fd,
        VmmHandle {
            bytes: buf.byte_len() as u64,
            mapped_bytes: buf.mapped_bytes() as u64,
            elem_size: std::mem::size_of::<T>() as u32,
            device: buf.ordinal() as u32,
        },
    ))
}

/// The POSIX fd export covers one physical allocation: refuse a buffer of several, naming them.
fn check_one_chunk(chunks: &[VmmChunk], mapped: usize) -> Result<()> {
    if chunks.len() <= 1 {
        return Ok(());
    }
    let list: Vec<String> = chunks
        .iter()
        .enumerate()
        .map(|(i, c)| format!("chunk {i} at bytes {}..{}", c.offset, c.offset + c.size))
        .collect();
    Err(Error::Unsupported {
        what: format!(
            "POSIX fd export of a VMM buffer of {} physical chunks",
            chunks.len()
        ),
        reason: format!(
            "cuMemExportToShareableHandle exports one physical allocation, so an importer would \
             map only chunk 0 of the {mapped} bytes ({}); export the buffer by dma-buf, or \
             allocate what you share as one chunk (VmmBuffer::alloc)",
            list.join(", ")
        ),
    })
}

/// VMM memory of another process, imported from a descriptor and mapped read-write for device
/// `ordinal`; `len` elements of `T`.
///
/// Dropping it unmaps, frees the address range and releases the imported handle, without
/// synchronizing: work that uses it owns it until that work has completed.
#[derive(Debug)]
pub struct VmmImport<T: Pod> {
    ptr: u64,
    size: usize,
    len: usize,
    handle: sys::CUmemGenericAllocationHandle,
    ctx: Arc<CudaContext>,
    pid: u32,
    _elem: PhantomData<T>,
}

impl<T: Pod> VmmImport<T> {
    /// `cuMemImportFromShareableHandle`, `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`.
    /// The descriptor may be closed afterwards.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the element size differs from `size_of::<T>()` or the
    /// sizes are inconsistent; [`Error::Cuda`] from any step (after undoing the earlier ones).
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html>
    #[doc(alias = "cuMemImportFromShareableHandle")]
    pub fn open(fd: BorrowedFd<'_>, handle: &VmmHandle, ordinal: usize) -> Result<Self> {
        let (mapped, len) = handle.check(std::mem::size_of::<T>())?;
        let ctx = cuda::context(ordinal)?;
        ctx.bind_to_thread()
            .map_err(|e| from_driver("cuCtxSetCurrent", e))?;
        let mut h = 0;
        // SAFETY: context current; for the POSIX fd type the "pointer" argument carries the
        // descriptor's value; valid out-pointer.
        cu("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut h,
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        let mut ptr = 0;
        // SAFETY: valid out-pointer; default alignment; no fixed address.
        if let Err(e) = cu("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut ptr, mapped, 0, 0, 0)
        }) {
            // SAFETY: the handle imported above, unmapped.
            unsafe { sys::cuMemRelease(h) };
            return Err(e);
        }
        // SAFETY: the range and the allocation are both `mapped` bytes.
        if let Err(e) = cu("cuMemMap", unsafe { sys::cuMemMap(ptr, mapped, 0, h, 0) }) {
            // SAFETY: undo the reservation and the import.
            unsafe {
                sys::cuMemAddressFree(ptr, mapped);
                sys::cuMemRelease(h);
            }
            return Err(e);
        }
        let out = VmmImport {
            ptr,
            size: mapped,
            len,
            handle: h,
            ctx,
            pid: std::process::id(),
            _elem: PhantomData,
        };
        let desc = sys::CUmemAccessDesc {
            location: access_location(ordinal),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the mapping made above; one descriptor. On error, `out`'s drop undoes it.
        cu("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(ptr, mapped, &desc, 1)
        })?;
        Ok(out)
    }
}

// SAFETY: mapped until drop at a fixed address; `len * size_of::<T>() <= size`.
unsafe impl<T: Pod> DeviceMemory for VmmImport<T> {
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
        MemoryKind::Vmm
    }
    /// The one mapping made in [`open`](VmmImport::open).
    fn vmm_mappings(&self) -> Option<Vec<(u64, usize)>> {
        Some(vec![(self.ptr, self.size)])
    }
}

// SAFETY: no Rust reference to the mapped bytes is handed out.
unsafe impl<T: Pod> DeviceMemoryMut for VmmImport<T> {}

impl<T: Pod> Drop for VmmImport<T> {
    fn drop(&mut self) {
        if crate::completion::forked(self.pid) || self.ctx.bind_to_thread().is_err() {
            return;
        }
        // No cuCtxSynchronize (unbounded, and it waits for every stream of the context, even one
        // blocked on another process): every data path of this crate holds the buffer in its
        // InFlight (or the tracker) until its work has completed, so when this runs no work this
        // crate queued can still use the mapping. Work queued on the raw `device_ptr` by the
        // caller's own unsafe code is the caller's to finish first.
        // SAFETY: the mapping, range and handle made in `open`, undone once.
        unsafe {
            if sys::cuMemUnmap(self.ptr, self.size) != sys::CUresult::CUDA_SUCCESS {
                return;
            }
            sys::cuMemAddressFree(self.ptr, self.size);
            sys::cuMemRelease(self.handle);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_of_several_chunks_is_refused_naming_them() {
        let one = [VmmChunk {
            offset: 0,
            size: 4096,
        }];
        assert!(check_one_chunk(&one, 4096).is_ok());
        let two = [
            VmmChunk {
                offset: 0,
                size: 2 << 20,
            },
            VmmChunk {
                offset: 2 << 20,
                size: 4 << 20,
            },
        ];
        let e = check_one_chunk(&two, 6 << 20).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, Error::Unsupported { .. }));
        assert!(text.contains("2 physical chunks"), "{text}");
        assert!(text.contains("chunk 1 at bytes 2097152..6291456"), "{text}");
    }

    #[test]
    fn peer_handles_are_checked_before_ffi() {
        let h = |bytes, mapped_bytes, elem_size| VmmHandle {
            bytes,
            mapped_bytes,
            elem_size,
            device: 0,
        };
        assert_eq!(h(4096, 2 << 20, 4).check(4).unwrap(), (2 << 20, 1024));
        assert!(h(4096, 2 << 20, 8).check(4).is_err(), "element size");
        assert!(h(4098, 2 << 20, 4).check(4).is_err(), "whole elements");
        assert!(
            h(4 << 20, 2 << 20, 4).check(4).is_err(),
            "within the mapping"
        );
        assert!(h(0, 0, 4).check(4).is_err(), "empty mapping");
        assert!(h(0, 0, 0).check(0).is_err(), "zero-sized elements");
    }
}
