//! dma-buf export of device memory (GPUDirect RDMA through dma-buf), tier 2.
//! A5's arithmetic is also unit-tested in gpudirect-sys without a GPU.

use gpudirect::dmabuf;
use gpudirect::memory::{DeviceBuffer, DeviceMemory, PoolBuffer};
use gpudirect::require;
use gpudirect::testing::Hardware;
use std::sync::Arc;

#[test]
fn export_covers_the_enclosing_pages_with_exact_offset_and_iova() {
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let info = gpudirect::device::DeviceInfo::query(0).unwrap();
    if !info.dma_buf {
        gpudirect::testing::skip(Hardware::Gpu, "device 0 does not support dma-buf export");
        return;
    }
    let mem = Arc::new(DeviceBuffer::<u8>::zeroed(&ctx, 4 << 20).unwrap());
    let base = mem.device_ptr();
    assert_eq!(base % 4096, 0, "cuMemAlloc returns page-aligned memory");
    // Whole buffer.
    let whole = dmabuf::export(mem.clone(), 0, mem.byte_len()).unwrap();
    assert_eq!(whole.size_from_kernel().unwrap(), 4 << 20);
    assert_eq!(whole.range().offset, 0);
    // A5: 65544 bytes starting 40 bytes in.
    let sub = dmabuf::export(mem.clone(), 40, 65544).unwrap();
    let r = sub.range();
    assert_eq!(
        (r.export_base, r.offset, r.len, r.iova),
        (base, 40, 65544, base + 40)
    );
    assert_eq!(r.export_len, 17 * 4096);
    assert_eq!(sub.size_from_kernel().unwrap(), 17 * 4096);
    // Two 40-byte buffers in one page: one export page each, distinct offsets.
    let a = dmabuf::export(mem.clone(), 8192 + 100, 40).unwrap();
    let b = dmabuf::export(mem.clone(), 8192 + 200, 40).unwrap();
    assert_eq!(a.size_from_kernel().unwrap(), 4096);
    assert_eq!((a.range().offset, b.range().offset), (100, 200));
    assert_eq!(b.size_from_kernel().unwrap(), 4096);
    // The exports own the memory: it outlives them.
    assert_eq!(Arc::strong_count(&mem), 5);
    drop((whole, a, b));
    assert_eq!(Arc::strong_count(&mem), 2);
    // Out of bounds is refused before any FFI call.
    let e = dmabuf::export(mem.clone(), mem.byte_len() - 10, 11).unwrap_err();
    assert!(matches!(e, gpudirect::Error::InvalidArgument { .. }), "{e}");
    println!(
        "dma-buf export ok: sub-range offset {} iova {:#x}",
        r.offset, r.iova
    );
}

#[test]
fn rdma_capable_attribute_per_memory_kind() {
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let plain = DeviceBuffer::<u8>::zeroed(&ctx, 1 << 20).unwrap();
    assert!(
        plain.attributes().unwrap().gpu_direct_rdma_capable,
        "cuMemAlloc memory is GPUDirect RDMA capable"
    );
    // Pool memory (what cudarc's CudaSlice uses) is not.
    let stream = ctx.default_stream();
    let pool = PoolBuffer::new(stream.alloc_zeros::<u8>(1 << 20).unwrap()).unwrap();
    assert!(
        !pool.attributes().unwrap().gpu_direct_rdma_capable,
        "pool memory is not GPUDirect RDMA capable"
    );
}
