//! VMM memory shared by POSIX file descriptor: `cuMemExportToShareableHandle` and
//! `cuMemImportFromShareableHandle`, the descriptor passed with [`super::send_fd`].

use super::handle::{check_bus_id, check_elem_size};
use crate::cuda;
use crate::driver::{self, vmm};
use crate::error::{Error, Result};
use crate::memory::alloc::{Allocation, Release, thin_memory};
use crate::memory::{DeviceMemory, MemoryKind, Pod, VmmBuffer, VmmChunk, VmmMapping};
use crate::p2p::access::device_location;
use crate::p2p::home::{Home, Recorded};
use crate::p2p::link::bus_id_of;
use cudarc::driver::sys;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// What the importer needs besides the descriptor: sizes and the element size. Plain data.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct VmmHandle {
    /// The buffer's size in bytes.
    pub bytes: u64,
    /// The physical allocation's size (a multiple of the allocation granularity).
    pub mapped_bytes: u64,
    /// `size_of` the element type.
    pub elem_size: u32,
    /// The exporting device's ordinal (in the exporter's numbering).
    pub device: u32,
    /// The exporting device's PCI address, such as `0000:19:00.0` (where the memory lives, in
    /// terms every process on the node shares); `None` when the exporter did not say.
    #[cfg_attr(feature = "serde", serde(default))]
    pub pci_bus_id: Option<String>,
}

impl VmmHandle {
    /// Check a handle from a peer (untrusted) for elements of `elem_size` bytes, before any FFI
    /// call: the element size matches, `bytes` is whole elements within `mapped_bytes`,
    /// `mapped_bytes` is non-zero and fits `usize`, and the PCI address (when given) is one.
    /// Returns `(mapped_bytes, elements)`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the field.
    pub fn check(&self, elem_size: usize) -> Result<(usize, usize)> {
        let size = check_elem_size(self.elem_size, elem_size)?;
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
        check_bus_id(self.pci_bus_id.as_deref())?;
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
    let pci_bus_id = Some(bus_id_of(buf.ordinal())?);
    driver::ctx::bind(buf.context())?;
    // SAFETY: context current; the handle is the buffer's live allocation, made with the POSIX
    // fd handle type (VmmBuffer always requests it).
    let fd = unsafe { vmm::export_fd(buf.handle()) }?;
    // SAFETY: the driver returned a new descriptor owned by the caller.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok((
        fd,
        VmmHandle {
            bytes: buf.byte_len() as u64,
            mapped_bytes: buf.mapped_bytes() as u64,
            elem_size: std::mem::size_of::<T>() as u32,
            device: buf.ordinal() as u32,
            pci_bus_id,
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

/// VMM memory of another process, imported from a descriptor and mapped read-write for one
/// device; `len` elements of `T`.
///
/// [`open`](Self::open) maps it for the device it lives on (its
/// [`ordinal`](DeviceMemory::ordinal)), so that a copy to another device runs peer to peer from
/// there; [`open_on`](Self::open_on) for another device (a copy on that device's side then
/// crosses the link, and reports it). Dropping it unmaps, frees the address range and releases
/// the imported handle, without synchronizing: work that uses it owns it until that work has
/// completed. In a forked child it leaks.
#[derive(Debug)]
#[doc(alias = "cuMemImportFromShareableHandle")]
pub struct VmmImport<T: Pod>(Allocation<T, ImportedVmm>);

/// The one mapping of an imported physical allocation (given back as a [`VmmBuffer`]'s are),
/// and where its bytes live.
pub(crate) struct ImportedVmm {
    mapping: VmmMapping,
    at: Recorded,
}

// SAFETY: the imported physical allocation, mapped read-write for the context's device from the
// moment the allocation is built until `VmmMapping` unmaps it (its own guarantees); no host view.
unsafe impl Release for ImportedVmm {
    const KIND: MemoryKind = MemoryKind::Vmm;
    const CALL: &'static str = "cuMemUnmap";
    type Back = ();

    fn vmm_mappings(&self, ptr: u64) -> Option<Vec<(u64, usize)>> {
        self.mapping.vmm_mappings(ptr)
    }

    unsafe fn release(self, ptr: u64) -> Result<()> {
        self.at.forget();
        // No cuCtxSynchronize: work this crate queued on the import owns it until complete.
        // SAFETY: forwarded from the caller (once, context current, nothing pending).
        unsafe { self.mapping.release(ptr) }
    }
}

thin_memory!(VmmImport);

impl<T: Pod> VmmImport<T> {
    /// Import and map for the device the memory lives on: the visible device at the handle's
    /// [`pci_bus_id`](VmmHandle::pci_bus_id). The descriptor may be closed afterwards.
    ///
    /// # Errors
    ///
    /// [`Error::NoDevice`] when the handle names no PCI address or no visible device is at it
    /// (use [`open_on`](Self::open_on)); otherwise as [`open_on`](Self::open_on).
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html>
    #[doc(alias = "cuMemImportFromShareableHandle")]
    pub fn open(fd: BorrowedFd<'_>, handle: &VmmHandle) -> Result<Self> {
        handle.check(std::mem::size_of::<T>())?;
        let (ordinal, home) = Home::required(handle.pci_bus_id.as_deref(), "VmmImport::open_on")?;
        Self::map(fd, handle, ordinal, home)
    }

    /// `cuMemImportFromShareableHandle`, `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`
    /// read-write for device `ordinal`. The descriptor may be closed afterwards.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the element size differs from `size_of::<T>()`, the
    /// sizes are inconsistent or the PCI address malformed; [`Error::NoDevice`] for an ordinal
    /// past the device count; [`Error::Cuda`] from any step (after undoing the earlier ones).
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html>
    #[doc(alias = "cuMemImportFromShareableHandle")]
    #[doc(alias = "cuMemMap")]
    pub fn open_on(fd: BorrowedFd<'_>, handle: &VmmHandle, ordinal: usize) -> Result<Self> {
        handle.check(std::mem::size_of::<T>())?;
        let home = Home::of_bus_id(handle.pci_bus_id.as_deref())?;
        Self::map(fd, handle, ordinal, home)
    }

    fn map(fd: BorrowedFd<'_>, handle: &VmmHandle, ordinal: usize, home: Home) -> Result<Self> {
        let (mapped, len) = handle.check(std::mem::size_of::<T>())?;
        let ctx = cuda::context(ordinal)?;
        driver::ctx::bind(&ctx)?;
        // SAFETY: context current; `fd` is open for the call.
        let h = unsafe { vmm::import_fd(fd.as_raw_fd()) }?;
        // SAFETY: context current; default alignment.
        let ptr = match unsafe { vmm::reserve(mapped, 0) } {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: the handle imported above, unmapped, released once.
                let _ = unsafe { vmm::release(h) };
                return Err(e);
            }
        };
        // SAFETY: the range and the allocation are both `mapped` bytes; the range is unmapped.
        if let Err(e) = unsafe { vmm::map(ptr, mapped, h) } {
            // SAFETY: undo the reservation and the import, once each.
            unsafe {
                let _ = vmm::address_free(ptr, mapped);
                let _ = vmm::release(h);
            }
            return Err(e);
        }
        let how = ImportedVmm {
            mapping: VmmMapping::one(mapped, h),
            at: Recorded::new(ptr, mapped, home, ordinal),
        };
        // SAFETY: `mapped` bytes mapped at `ptr` (given back by `how`), of which the handle's
        // `len` elements (checked: within `mapped`); access is set below, before any use.
        let out = VmmImport(unsafe { Allocation::new(ptr, len, &ctx, how) });
        let desc = sys::CUmemAccessDesc {
            location: device_location(ordinal),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the mapping made above. On error, `out`'s drop undoes everything.
        unsafe { vmm::set_access(ptr, mapped, &[desc]) }?;
        Ok(out)
    }

    /// The device, in this process's numbering, whose memory holds the bytes; `None` when it is
    /// not visible here or the handle did not say.
    pub fn home(&self) -> Option<usize> {
        self.0.how().at.home().ordinal()
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
            pci_bus_id: None,
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
        let mut named = h(4096, 2 << 20, 4);
        named.pci_bus_id = Some("0000:19:00.0".into());
        assert!(named.check(4).is_ok());
        named.pci_bus_id = Some("nineteen".into());
        assert!(named.check(4).is_err(), "a malformed PCI address");
    }
}
