//! VMM device memory: `cuMemCreate` with the GPUDirect RDMA flag, reserved, mapped, access set.

use super::alloc::{Allocation, Release, byte_size, thin_memory};
use super::copy;
use super::pod::Pod;
use crate::driver::ctx::bind;
use crate::driver::vmm;
use crate::error::{Error, MemoryKind, Result, from_driver};
use cudarc::driver::{CudaContext, sys};
use std::sync::Arc;

/// Device memory made with the virtual memory management API: one or more physical chunks
/// (`cuMemCreate`: pinned, on one device, `gpuDirectRDMACapable = 1`, exportable as a POSIX fd),
/// mapped back to back (`cuMemMap`) into one reserved address range (`cuMemAddressReserve`), with
/// `cuMemSetAccess` read-write for the owning device.
///
/// [`alloc`](Self::alloc) makes one chunk, its size rounded up to the allocation granularity
/// ([`mapped_bytes`](Self::mapped_bytes)); [`len`](super::DeviceMemory::len) is the requested element
/// count. [`alloc_chunks`](Self::alloc_chunks) makes several chunks mapped contiguously, the
/// layout PyTorch's expandable segments produce: one address range, several physical
/// allocations ([`chunks`](Self::chunks)). Drop unmaps, frees the address range and releases the
/// handles; in a forked child it leaks.
#[derive(Debug)]
#[doc(alias = "cuMemCreate")]
#[doc(alias = "cuMemMap")]
pub struct VmmBuffer<T: Pod>(Allocation<T, VmmMapping>);

/// A reserved address range with physical allocations mapped into it back to back, given back
/// by unmapping each (`cuMemUnmap`), freeing the range (`cuMemAddressFree`) and releasing the
/// handles (`cuMemRelease`). If a chunk cannot be unmapped, nothing is freed (never under a
/// mapping): all of it leaks.
#[derive(Debug)]
pub(crate) struct VmmMapping {
    /// Bytes reserved (and, once built, mapped): the sum of the chunks.
    size: usize,
    /// The chunks mapped so far, in address order.
    chunks: Vec<(VmmChunk, sys::CUmemGenericAllocationHandle)>,
}

impl VmmMapping {
    /// One physical allocation `handle` of `size` bytes (made elsewhere: imported from another
    /// process), mapped whole at the start of a reservation of `size` bytes.
    #[cfg(feature = "p2p")]
    pub(crate) fn one(size: usize, handle: sys::CUmemGenericAllocationHandle) -> VmmMapping {
        VmmMapping {
            size,
            chunks: vec![(VmmChunk { offset: 0, size }, handle)],
        }
    }
}

// SAFETY: device memory of the context's device, mapped into the reserved range from the moment
// the allocation's length covers it (the length is set only once every chunk is mapped) until
// `release` unmaps it; no host view.
unsafe impl Release for VmmMapping {
    const KIND: MemoryKind = MemoryKind::Vmm;
    const CALL: &'static str = "cuMemUnmap";
    type Back = ();

    /// One mapping per physical chunk, at `ptr + offset`.
    fn vmm_mappings(&self, ptr: u64) -> Option<Vec<(u64, usize)>> {
        Some(
            self.chunks
                .iter()
                .map(|(c, _)| (ptr + c.offset as u64, c.size))
                .collect(),
        )
    }

    unsafe fn release(self, ptr: u64) -> Result<()> {
        // SAFETY: the mappings, reservation and handles this value made, undone once, with no
        // work using them (the caller's).
        unsafe {
            for (c, _) in &self.chunks {
                vmm::unmap(ptr + c.offset as u64, c.size)?; // still mapped: leak the rest
            }
            let _ = vmm::address_free(ptr, self.size);
            for (_, h) in &self.chunks {
                let _ = vmm::release(*h);
            }
        }
        Ok(())
    }
}

thin_memory!(VmmBuffer);

/// One physical allocation of a [`VmmBuffer`]: where it is mapped in the buffer, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct VmmChunk {
    /// Bytes from the buffer's start to the chunk's.
    pub offset: usize,
    /// The chunk's size in bytes (a multiple of the allocation granularity).
    pub size: usize,
}

/// The most physical chunks one [`VmmBuffer`] may have.
pub const MAX_VMM_CHUNKS: usize = 4096;

fn prop(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct for which all-zero is valid (TYPE_INVALID, HANDLE_TYPE_NONE, null).
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    p.location =
        crate::cuda::mem_location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, ordinal);
    p.allocFlags.gpuDirectRDMACapable = 1;
    p
}

/// `size` rounded up to a multiple of `granularity` (a power of two or any positive value).
pub(crate) fn round_up(size: usize, granularity: usize) -> Option<usize> {
    let g = granularity.max(1);
    size.checked_add(g - 1).map(|s| s / g * g)
}

/// Lay out chunks of `chunk_bytes` back to back: each must be a non-zero multiple of
/// `granularity`, at most [`MAX_VMM_CHUNKS`] of them, their sum must fit `usize` and hold a whole
/// number of `elem_size`-byte elements. Returns the chunks and the element count.
///
/// # Errors
///
/// [`Error::InvalidArgument`] naming the rule (and the chunk) broken.
pub fn plan_chunks(
    chunk_bytes: &[usize],
    granularity: usize,
    elem_size: usize,
) -> Result<(Vec<VmmChunk>, usize)> {
    if elem_size == 0 {
        return Err(Error::invalid(
            "T",
            "a zero-sized type",
            "elements need at least one byte",
        ));
    }
    if granularity == 0 {
        return Err(Error::invalid("granularity", 0, "must be at least 1"));
    }
    if chunk_bytes.is_empty() || chunk_bytes.len() > MAX_VMM_CHUNKS {
        return Err(Error::invalid(
            "chunk_bytes",
            format!("{} chunks", chunk_bytes.len()),
            format!("must hold between 1 and {MAX_VMM_CHUNKS} chunks"),
        ));
    }
    let mut chunks = Vec::with_capacity(chunk_bytes.len());
    let mut offset = 0usize;
    for (i, &size) in chunk_bytes.iter().enumerate() {
        if size == 0 || !size.is_multiple_of(granularity) {
            return Err(Error::invalid(
                "chunk_bytes",
                format!("chunk {i} of {size} bytes"),
                format!("must be a non-zero multiple of the allocation granularity {granularity}"),
            ));
        }
        chunks.push(VmmChunk { offset, size });
        offset = offset.checked_add(size).ok_or_else(|| {
            Error::invalid(
                "chunk_bytes",
                format!("chunk {i} of {size} bytes"),
                "the chunks' total overflows usize",
            )
        })?;
    }
    if !offset.is_multiple_of(elem_size) {
        return Err(Error::invalid(
            "chunk_bytes",
            format!("{offset} bytes in all"),
            format!("must be a whole number of {elem_size}-byte elements"),
        ));
    }
    Ok((chunks, offset / elem_size))
}

/// Check that `ctx`'s device can make GPUDirect RDMA capable VMM memory; the allocation
/// properties and the minimum granularity.
fn vmm_setup(ctx: &Arc<CudaContext>) -> Result<(sys::CUmemAllocationProp, usize)> {
    crate::cuda::init()?;
    bind(ctx)?;
    use sys::CUdevice_attribute as A;
    for (attr, what) in [
        (
            A::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
            "virtual memory management",
        ),
        (
            A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
            "GPUDirect RDMA with VMM memory",
        ),
    ] {
        let v = ctx
            .attribute(attr)
            .map_err(|e| from_driver("cuDeviceGetAttribute", e))?;
        if v == 0 {
            return Err(Error::Unsupported {
                what: what.into(),
                reason: format!("device {} reports {attr:?} = 0", ctx.ordinal()),
            });
        }
    }
    let p = prop(ctx.ordinal() as i32);
    // SAFETY: the driver is initialised; a valid prop.
    let gran = unsafe {
        vmm::granularity(
            &p,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    }?;
    Ok((p, gran.max(1)))
}

impl<T: Pod> VmmBuffer<T> {
    /// Allocate and map `len` elements on `ctx`'s device, as one physical chunk.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for `len == 0`; [`Error::Unsupported`] when the device lacks
    /// VMM or GPUDirect RDMA with VMM (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`);
    /// [`Error::Cuda`] from any step, after undoing the earlier ones.
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html>
    #[doc(alias = "cuMemGetAllocationGranularity")]
    #[doc(alias = "cuMemAddressReserve")]
    #[doc(alias = "cuMemSetAccess")]
    pub fn alloc(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
        let bytes = byte_size::<T>(len)?;
        let (p, gran) = vmm_setup(ctx)?;
        let size = round_up(bytes, gran)
            .ok_or_else(|| Error::invalid("len", len, "size overflows when rounded"))?;
        Self::map(ctx, p, gran, &[VmmChunk { offset: 0, size }], len)
    }

    /// Allocate one physical chunk per entry of `chunk_bytes` (bytes, each a non-zero multiple of
    /// [`granularity`](Self::granularity)) and map them back to back into one address range, as
    /// PyTorch's expandable segments do. The buffer holds `sum(chunk_bytes) / size_of::<T>()`
    /// elements.
    ///
    /// The range behaves as one buffer for copies, and exports as one dma-buf
    /// ([`export_dmabuf`](super::export_dmabuf)) across its chunks. Its POSIX fd export
    /// ([`crate::p2p::export_vmm`]) covers one physical allocation, so it refuses a buffer of
    /// several chunks.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] from [`plan_chunks`] (an empty list, more than
    /// [`MAX_VMM_CHUNKS`], a chunk that is 0 or not a multiple of the granularity, a total that
    /// overflows or is not a whole number of elements); the errors of [`alloc`](Self::alloc).
    #[doc(alias = "cuMemCreate")]
    #[doc(alias = "cuMemMap")]
    pub fn alloc_chunks(ctx: &Arc<CudaContext>, chunk_bytes: &[usize]) -> Result<Self> {
        // The granularity is not known before asking the driver: check everything else first.
        plan_chunks(chunk_bytes, 1, std::mem::size_of::<T>())?;
        let (p, gran) = vmm_setup(ctx)?;
        let (chunks, len) = plan_chunks(chunk_bytes, gran, std::mem::size_of::<T>())?;
        Self::map(ctx, p, gran, &chunks, len)
    }

    /// `cuMemGetAllocationGranularity(MINIMUM)` for the memory [`alloc`](Self::alloc) makes on
    /// `ctx`'s device: the unit of every chunk size, in bytes.
    ///
    /// # Errors
    ///
    /// As [`alloc`](Self::alloc), without allocating.
    #[doc(alias = "cuMemGetAllocationGranularity")]
    pub fn granularity(ctx: &Arc<CudaContext>) -> Result<usize> {
        vmm_setup(ctx).map(|(_, g)| g)
    }

    /// Reserve the range, create and map each chunk, set access. On error the buffer built so
    /// far is dropped, which undoes what was done.
    fn map(
        ctx: &Arc<CudaContext>,
        p: sys::CUmemAllocationProp,
        gran: usize,
        chunks: &[VmmChunk],
        len: usize,
    ) -> Result<Self> {
        crate::completion::Tracker::global().reap();
        let size = chunks
            .iter()
            .try_fold(0usize, |t, c| t.checked_add(c.size))
            .ok_or_else(|| Error::invalid("chunk_bytes", chunks.len(), "total overflows"))?;
        // SAFETY: context current (bound by `vmm_setup`); alignment = granularity.
        let ptr = unsafe { vmm::reserve(size, gran) }?;
        let how = VmmMapping {
            size,
            chunks: Vec::with_capacity(chunks.len()),
        };
        // SAFETY: an empty range for now (length 0): the reservation, given back by
        // `VmmMapping` with whatever chunks get mapped into it.
        let mut buf = unsafe { Allocation::<T, _>::new(ptr, 0, ctx, how) };
        let access = sys::CUmemAccessDesc {
            location: p.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        for &c in chunks {
            let at = ptr
                .checked_add(c.offset as u64)
                .ok_or_else(|| Error::invalid("chunk_bytes", c.offset, "address overflows"))?;
            // SAFETY: context current; a valid prop; the size is a multiple of the granularity.
            let handle = unsafe { vmm::create(c.size, &p) }?;
            // SAFETY: `at..at + c.size` lies in the reserved range, unmapped; the handle is
            // `c.size` bytes.
            if let Err(e) = unsafe { vmm::map(at, c.size, handle) } {
                // SAFETY: created above, never mapped.
                let _ = unsafe { vmm::release(handle) };
                return Err(e);
            }
            buf.how_mut().chunks.push((c, handle));
            // SAFETY: the range just mapped; one access descriptor. On error `buf`'s drop undoes
            // everything.
            unsafe { vmm::set_access(at, c.size, &[access]) }?;
        }
        // SAFETY: every chunk is mapped now: the range holds `len` elements (`len *
        // size_of::<T>() <= size`).
        unsafe { buf.set_len(len) };
        Ok(VmmBuffer(buf))
    }

    /// Bytes mapped: the requested size rounded up to the allocation granularity (the sum of
    /// the chunks).
    pub fn mapped_bytes(&self) -> usize {
        self.0.how().size
    }

    /// The physical chunks, in address order (one for [`alloc`](Self::alloc)).
    pub fn chunks(&self) -> Vec<VmmChunk> {
        self.0.how().chunks.iter().map(|(c, _)| *c).collect()
    }

    /// The `CUmemGenericAllocationHandle` of the first physical chunk (the only one for
    /// [`alloc`](Self::alloc)), for `cuMemExportToShareableHandle`.
    pub fn handle(&self) -> sys::CUmemGenericAllocationHandle {
        self.0.how().chunks.first().map_or(0, |(_, h)| *h)
    }

    /// The contents, copied to the host (blocking, on `stream`).
    ///
    /// # Errors
    ///
    /// As [`copy_to_host`](super::copy_to_host).
    pub fn to_vec(&self, stream: &crate::cuda::Stream) -> Result<Vec<T>> {
        copy::to_vec(stream, self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_laid_out_back_to_back() {
        let g = 2 << 20;
        let (c, len) = plan_chunks(&[g, 2 * g, g], g, 4).unwrap();
        assert_eq!(
            c,
            vec![
                VmmChunk { offset: 0, size: g },
                VmmChunk {
                    offset: g,
                    size: 2 * g
                },
                VmmChunk {
                    offset: 3 * g,
                    size: g
                },
            ]
        );
        assert_eq!(len, 4 * g / 4);
        let e = plan_chunks(&[g, g + 4096], g, 1).unwrap_err();
        assert!(e.to_string().contains("chunk 1"), "{e}");
        assert!(plan_chunks(&[], g, 1).is_err());
        assert!(plan_chunks(&[0], g, 1).is_err());
        assert!(plan_chunks(&[g], g, 0).is_err());
        assert!(plan_chunks(&[g, g], g, 3).is_err(), "not whole elements");
        assert!(plan_chunks(&[usize::MAX / 2 + 1, usize::MAX / 2 + 1], 1, 1).is_err());
    }

    #[test]
    fn sizes_round_up_to_granularity() {
        assert_eq!(round_up(1, 2 << 20), Some(2 << 20));
        assert_eq!(round_up(2 << 20, 2 << 20), Some(2 << 20));
        assert_eq!(round_up((2 << 20) + 1, 2 << 20), Some(4 << 20));
        assert_eq!(round_up(usize::MAX, 4096), None);
    }
}
