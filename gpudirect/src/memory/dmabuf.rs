//! dma-buf export of CUDA device memory, for GPUDirect RDMA registration (`ibv_reg_dmabuf_mr`)
//! and other importers; and the GPUDirect RDMA helpers that go with it.
//!
//! A dma-buf fd reaches the memory behind it for as long as the fd (or any duplicate) is open,
//! and the CUDA driver does not keep the memory alive for it. So a [`DmaBuf`] owns both the fd
//! and the memory, closes the fd first, and never lends the fd out: no safe code can hold a
//! duplicate past the memory. Register it with the NIC through
//! [`ProtectionDomain::register_dmabuf`](crate::rdma::ProtectionDomain::register_dmabuf), which
//! takes the whole export.

use super::kind::{DeviceMemory, refuse_pool};
use crate::error::{Error, MemoryKind, Result};
use gpudirect_sys::peermem::DmaBufRange;
#[cfg(feature = "rdma")]
use std::os::fd::{AsFd, BorrowedFd};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// A dma-buf file descriptor over a page-aligned range of device memory, with the numbers a
/// registration needs ([`DmaBufRange`]: offset and IOVA of the requested bytes inside it).
///
/// It owns the exported memory `M` (pass an `Arc` to share it), so the memory outlives every
/// importer that holds this value; the fd is closed before `M` is dropped. The fd itself is not
/// handed out (no `AsFd`): a duplicate could outlive the memory.
#[derive(Debug)]
pub struct DmaBuf<M> {
    fd: OwnedFd,
    range: DmaBufRange,
    ordinal: usize,
    mem: M,
}

impl<M> DmaBuf<M> {
    /// The exported memory.
    pub fn memory(&self) -> &M {
        &self.mem
    }

    /// Close the fd and take the memory back. Only the export's own importers (a region that
    /// owns the `DmaBuf`) could still reach it, and they are gone with the value.
    pub fn into_memory(self) -> M {
        drop(self.fd);
        self.mem
    }

    /// The export's geometry: `export_base`/`export_len` (page-aligned), and `offset`, `len`,
    /// `iova` of the requested bytes.
    pub fn range(&self) -> DmaBufRange {
        self.range
    }

    /// The device the memory belongs to.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The size the kernel reports for the dma-buf (`lseek(fd, 0, SEEK_END)`), in bytes.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `lseek`.
    pub fn size_from_kernel(&self) -> Result<u64> {
        // SAFETY: the fd is open and owned by self.
        let end = unsafe { libc::lseek(self.fd.as_raw_fd(), 0, libc::SEEK_END) };
        if end < 0 {
            return Err(Error::last_os("lseek"));
        }
        Ok(end as u64)
    }

    /// The fd, for importers inside the crate that keep the whole `DmaBuf` at least as long.
    #[cfg(feature = "rdma")]
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Check an export request before any FFI call: `kind` must be device memory that is not pool
/// memory, and `byte_offset..byte_offset + len` a non-empty range inside the `byte_len` bytes
/// at `ptr`, whose addresses do not pass 2^64. Returns the export geometry.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for host memory or a bad range; [`Error::NotRdmaCapable`] for pool
/// memory.
pub fn check_dmabuf_export(
    kind: MemoryKind,
    ptr: u64,
    byte_len: usize,
    byte_offset: usize,
    len: usize,
) -> Result<DmaBufRange> {
    if !kind.is_device() {
        return Err(Error::invalid(
            "mem",
            format!("{kind:?}"),
            "dma-buf export needs device memory",
        ));
    }
    refuse_pool(kind, ptr, "dma-buf export (cuMemGetHandleForAddressRange)")?;
    let end = byte_offset.checked_add(len);
    if len == 0 || end.is_none_or(|e| e > byte_len) {
        return Err(Error::invalid(
            "byte_offset + len",
            format!("{byte_offset} + {len}"),
            format!("must be a non-empty range inside the buffer's {byte_len} bytes"),
        ));
    }
    let start = ptr.checked_add(byte_offset as u64).ok_or_else(|| {
        Error::invalid(
            "byte_offset",
            byte_offset,
            format!("ptr {ptr:#x} + byte_offset passes 2^64"),
        )
    })?;
    DmaBufRange::new(start, len as u64).ok_or_else(|| {
        Error::invalid(
            "len",
            len,
            format!("{start:#x} + len, rounded up to a page, passes 2^64"),
        )
    })
}

/// Export the page-aligned range enclosing `len` bytes at `ptr` on device `ordinal`. Private: the
/// caller keeps the memory alive for as long as the fd and every duplicate ([`export_dmabuf`] does, by
/// owning it and never lending the fd out).
pub(crate) fn export_dmabuf_range(
    ordinal: usize,
    ptr: u64,
    len: u64,
) -> Result<(OwnedFd, DmaBufRange)> {
    let range = DmaBufRange::new(ptr, len).ok_or_else(|| {
        Error::invalid(
            "len",
            len,
            format!("must be non-zero and ptr {ptr:#x} + len must not overflow"),
        )
    })?;
    gpudirect_sys::cuda::require_symbols(&["cuMemGetHandleForAddressRange"])?;
    let export_len = usize::try_from(range.export_len)
        .map_err(|_| Error::invalid("len", len, "the export's length must fit usize"))?;
    let ctx = crate::cuda::context(ordinal)?;
    crate::driver::ctx::bind(&ctx)?;
    // SAFETY: libcuda present with this symbol (checked); context current. The fd becomes an
    // `OwnedFd` below, and the callers keep the memory alive while it (or a duplicate) is open:
    // `export_dmabuf` owns the memory and never lends the fd.
    let fd = unsafe { crate::driver::mem::dmabuf_fd(range.export_base, export_len) }?;
    if fd < 0 {
        return Err(Error::Unsupported {
            what: "dma-buf export".into(),
            reason: format!("cuMemGetHandleForAddressRange returned fd {fd}"),
        });
    }
    // SAFETY: the driver returned a new fd that nothing else owns.
    Ok((unsafe { OwnedFd::from_raw_fd(fd) }, range))
}

/// `cuMemGetHandleForAddressRange(.., CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)`—Export `len` bytes at
/// `byte_offset` inside `mem` as a dma-buf: the fd covers the enclosing 4 KiB-aligned range, and
/// [`DmaBuf::range`] says where the requested bytes are (offset, IOVA). The result owns `mem`.
///
/// A [`VmmBuffer`](crate::memory::VmmBuffer) made of several physical chunks
/// ([`VmmBuffer::alloc_chunks`](crate::memory::VmmBuffer::alloc_chunks)) exports as one range
/// across its chunks.
///
/// # Errors
///
/// Before any FFI call ([`check_dmabuf_export`]): [`Error::InvalidArgument`] for host memory or an
/// empty or out-of-bounds range; [`Error::NotRdmaCapable`] for stream-ordered pool memory
/// (cudarc's `CudaSlice`, [`PoolBuffer`](crate::memory::PoolBuffer)), the same refusal GPU
/// memory registration gives. Then [`Error::Load`] if the driver lacks the entry point;
/// [`Error::Cuda`] from the driver (`CUDA_ERROR_NOT_SUPPORTED` where dma-buf is not supported).
#[doc(alias = "cuMemGetHandleForAddressRange")]
pub fn export_dmabuf<M: DeviceMemory>(mem: M, byte_offset: usize, len: usize) -> Result<DmaBuf<M>> {
    let range = check_dmabuf_export(
        mem.kind(),
        mem.device_ptr(),
        mem.byte_len(),
        byte_offset,
        len,
    )?;
    let ordinal = mem.ordinal();
    let (fd, range) = export_dmabuf_range(ordinal, range.iova, range.len)?;
    Ok(DmaBuf {
        fd,
        range,
        ordinal,
        mem,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_range_is_refused_before_any_ffi() {
        let e = export_dmabuf_range(0, 0x1000, 0).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "len", .. }),
            "{e}"
        );
    }
}
