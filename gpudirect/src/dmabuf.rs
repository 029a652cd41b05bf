//! dma-buf export of CUDA device memory, for GPUDirect RDMA registration (`ibv_reg_dmabuf_mr`)
//! and other importers; and the GPUDirect RDMA helpers that go with it.

use crate::error::{Error, Result, cu};
use crate::memory::DeviceMemory;
use cudarc::driver::sys;
use gpudirect_sys::peermem::DmaBufRange;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// A dma-buf file descriptor over a page-aligned range of device memory, with the numbers a
/// registration needs ([`DmaBufRange`]: offset and IOVA of the requested bytes inside it).
#[derive(Debug)]
pub struct DmaBuf {
    fd: OwnedFd,
    range: DmaBufRange,
    ordinal: usize,
}

impl DmaBuf {
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
    pub fn size_from_kernel(&self) -> Result<u64> {
        // SAFETY: the fd is open and owned by self.
        let end = unsafe { libc::lseek(self.fd.as_raw_fd(), 0, libc::SEEK_END) };
        if end < 0 {
            return Err(Error::last_os("lseek"));
        }
        Ok(end as u64)
    }

    /// Take the fd out.
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }
}

impl AsFd for DmaBuf {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// `cuMemGetHandleForAddressRange(.., CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)`—Export the page-aligned
/// range enclosing `len` bytes at `ptr` on device `ordinal` as a dma-buf.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for an empty or overflowing range; [`Error::Load`] if the driver lacks
/// the entry point; [`Error::Cuda`] from the driver (for example `CUDA_ERROR_INVALID_VALUE` for a
/// range that is not device memory of one allocation, `CUDA_ERROR_NOT_SUPPORTED` where dma-buf is
/// not supported).
#[doc(alias = "cuMemGetHandleForAddressRange")]
pub fn export_range(ordinal: usize, ptr: u64, len: u64) -> Result<DmaBuf> {
    let range = DmaBufRange::new(ptr, len).ok_or_else(|| {
        Error::invalid(
            "len",
            len,
            format!("must be non-zero and ptr {ptr:#x} + len must not overflow"),
        )
    })?;
    gpudirect_sys::cuda::require_symbols(&["cuMemGetHandleForAddressRange"])?;
    let ctx = crate::cuda::context(ordinal)?;
    ctx.bind_to_thread()
        .map_err(|e| crate::error::from_driver("cuCtxSetCurrent", e))?;
    let mut fd: i32 = -1;
    // SAFETY: libcuda present with this symbol (checked); the out-pointer is an int as the
    // handle type requires; the driver validates the range.
    cu("cuMemGetHandleForAddressRange", unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut i32).cast(),
            range.export_base,
            range.export_len as usize,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    })?;
    if fd < 0 {
        return Err(Error::Unsupported {
            what: "dma-buf export".into(),
            reason: format!("cuMemGetHandleForAddressRange returned fd {fd}"),
        });
    }
    Ok(DmaBuf {
        // SAFETY: the driver returned a new fd that nothing else owns.
        fd: unsafe { OwnedFd::from_raw_fd(fd) },
        range,
        ordinal,
    })
}

/// Export `len` bytes at `byte_offset` inside `mem` (see [`export_range`]), after checking bounds.
pub fn export<M: DeviceMemory>(mem: &M, byte_offset: usize, len: usize) -> Result<DmaBuf> {
    if !mem.kind().is_device() {
        return Err(Error::invalid(
            "mem",
            format!("{:?}", mem.kind()),
            "dma-buf export needs device memory",
        ));
    }
    let end = byte_offset.checked_add(len);
    if len == 0 || end.is_none_or(|e| e > mem.byte_len()) {
        return Err(Error::invalid(
            "byte_offset + len",
            format!("{byte_offset} + {len}"),
            format!(
                "must be a non-empty range inside the buffer's {} bytes",
                mem.byte_len()
            ),
        ));
    }
    export_range(
        mem.ordinal(),
        mem.device_ptr() + byte_offset as u64,
        len as u64,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_range_is_refused_before_any_ffi() {
        let e = export_range(0, 0x1000, 0).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "len", .. }),
            "{e}"
        );
    }
}
