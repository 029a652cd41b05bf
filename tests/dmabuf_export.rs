//! dma-buf export of device memory (GPUDirect RDMA through dma-buf), tier 2.
//! A5's arithmetic is also unit-tested in gpudirect-sys without a GPU.

use gpudirect::cudarc::driver::sys;
use gpudirect::dmabuf;
use gpudirect::memory::{DeviceMemory, MemoryKind};
use gpudirect::require;
use gpudirect::testing::Hardware;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;

/// A bare `cuMemAlloc` allocation, so this test needs nothing but the driver.
#[derive(Debug)]
struct RawAlloc {
    ptr: u64,
    len: usize,
}

impl RawAlloc {
    fn new(len: usize) -> RawAlloc {
        let mut ptr = 0;
        // SAFETY: the context is current (bound by the caller); one valid out-pointer.
        let r = unsafe { sys::cuMemAlloc_v2(&mut ptr, len) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        RawAlloc { ptr, len }
    }
}

impl Drop for RawAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAlloc_v2 above, freed once.
        unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

// SAFETY: the range is a live cuMemAlloc allocation on device 0 until drop.
unsafe impl DeviceMemory for RawAlloc {
    type Elem = u8;
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn ordinal(&self) -> usize {
        0
    }
    fn kind(&self) -> MemoryKind {
        MemoryKind::Device
    }
}

fn rdma_capable(ptr: u64) -> i32 {
    let mut v: i32 = -1;
    // SAFETY: valid out-pointer of the attribute's type (int).
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut v as *mut i32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE,
            ptr,
        )
    };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    v
}

#[test]
fn export_covers_the_enclosing_pages_with_exact_offset_and_iova() {
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    ctx.bind_to_thread().unwrap();
    let info = gpudirect::device::DeviceInfo::query(0).unwrap();
    if !info.dma_buf {
        gpudirect::testing::skip(Hardware::Gpu, "device 0 does not support dma-buf export");
        return;
    }
    let mem = Arc::new(RawAlloc::new(4 << 20));
    assert_eq!(mem.ptr % 4096, 0, "cuMemAlloc returns page-aligned memory");
    // Whole buffer.
    let whole = dmabuf::export(mem.clone(), 0, mem.len).unwrap();
    assert_eq!(whole.size_from_kernel().unwrap(), 4 << 20);
    assert_eq!(whole.range().offset, 0);
    // A5: 65544 bytes starting 40 bytes in.
    let sub = dmabuf::export(mem.clone(), 40, 65544).unwrap();
    let r = sub.range();
    assert_eq!(
        (r.export_base, r.offset, r.len, r.iova),
        (mem.ptr, 40, 65544, mem.ptr + 40)
    );
    assert_eq!(r.export_len, 17 * 4096);
    assert_eq!(sub.size_from_kernel().unwrap(), 17 * 4096);
    // Two 40-byte buffers in one page: one export page each, distinct offsets.
    let a = dmabuf::export(mem.clone(), 8192 + 100, 40).unwrap();
    let b = dmabuf::export(mem.clone(), 8192 + 200, 40).unwrap();
    assert_eq!(a.size_from_kernel().unwrap(), 4096);
    assert_eq!((a.range().offset, b.range().offset), (100, 200));
    assert!(a.as_fd().as_raw_fd() >= 0 && a.as_fd().as_raw_fd() != b.as_fd().as_raw_fd());
    // The exports own the memory: it outlives them.
    assert_eq!(Arc::strong_count(&mem), 5);
    drop((whole, a, b));
    assert_eq!(Arc::strong_count(&mem), 2);
    // Out of bounds is refused before any FFI call.
    let e = dmabuf::export(mem.clone(), mem.len - 10, 11).unwrap_err();
    assert!(matches!(e, gpudirect::Error::InvalidArgument { .. }), "{e}");
    println!(
        "dma-buf export ok: whole {} bytes, sub-range offset {} iova {:#x}",
        4 << 20,
        r.offset,
        r.iova
    );
}

#[test]
fn rdma_capable_attribute_per_memory_kind() {
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    ctx.bind_to_thread().unwrap();
    let plain = RawAlloc::new(1 << 20);
    assert_eq!(
        rdma_capable(plain.ptr),
        1,
        "cuMemAlloc memory is GPUDirect RDMA capable"
    );
    // Pool memory (what cudarc's CudaSlice uses) is not.
    let stream = ctx.default_stream();
    let pool = stream.alloc_zeros::<u8>(1 << 20).unwrap();
    let (ptr, _guard) = gpudirect::cudarc::driver::DevicePtr::device_ptr(&pool, &stream);
    assert_eq!(
        rdma_capable(ptr),
        0,
        "pool memory is not GPUDirect RDMA capable"
    );
}
