//! dma-buf export of device memory (GPUDirect RDMA through dma-buf), tier 2.
//! The range arithmetic is also unit-tested in gpudirect-sys without a GPU.

mod support;

use gpudirect::memory::{
    DeviceBuffer, DeviceMemory, MemoryKind, PoolBuffer, VmmBuffer, export_dmabuf,
};
use gpudirect_testing::{Hardware, require};
use std::sync::Arc;

#[test]
fn export_covers_the_enclosing_pages_with_exact_offset_and_iova() {
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let info = gpudirect::cuda::DeviceInfo::query(0).unwrap();
    if !info.dma_buf {
        gpudirect_testing::skip(Hardware::Gpu, "device 0 does not support dma-buf export");
        return;
    }
    let mem = Arc::new(DeviceBuffer::<u8>::zeroed(&ctx, 4 << 20).unwrap());
    let base = mem.device_ptr();
    assert_eq!(base % 4096, 0, "cuMemAlloc returns page-aligned memory");
    // Whole buffer.
    let whole = export_dmabuf(mem.clone(), 0, mem.byte_len()).unwrap();
    assert_eq!(whole.size_from_kernel().unwrap(), 4 << 20);
    assert_eq!(whole.range().offset, 0);
    // Unaligned: 65544 bytes starting 40 bytes in.
    let sub = export_dmabuf(mem.clone(), 40, 65544).unwrap();
    let r = sub.range();
    assert_eq!(
        (r.export_base, r.offset, r.len, r.iova),
        (base, 40, 65544, base + 40)
    );
    assert_eq!(r.export_len, 17 * 4096);
    assert_eq!(sub.size_from_kernel().unwrap(), 17 * 4096);
    // Two 40-byte buffers in one page: one export page each, distinct offsets.
    let a = export_dmabuf(mem.clone(), 8192 + 100, 40).unwrap();
    let b = export_dmabuf(mem.clone(), 8192 + 200, 40).unwrap();
    assert_eq!(a.size_from_kernel().unwrap(), 4096);
    assert_eq!((a.range().offset, b.range().offset), (100, 200));
    assert_eq!(b.size_from_kernel().unwrap(), 4096);
    // The exports own the memory: it outlives them.
    assert_eq!(Arc::strong_count(&mem), 5);
    drop((whole, a, b));
    assert_eq!(Arc::strong_count(&mem), 2);
    // Out of bounds is refused before any FFI call.
    let e = export_dmabuf(mem.clone(), mem.byte_len() - 10, 11).unwrap_err();
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

#[test]
fn pool_memory_is_refused_typed_like_rdma_registration() {
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let stream = ctx.default_stream();
    let pool = PoolBuffer::new(stream.alloc_zeros::<u8>(1 << 20).unwrap()).unwrap();
    let registration = gpudirect::rdma::check_rdma_capable(&pool).unwrap_err();
    match export_dmabuf(pool, 0, 1 << 20) {
        Err(gpudirect::Error::NotRdmaCapable { kind, reason, .. }) => {
            assert_eq!(kind, MemoryKind::Pool);
            assert!(reason.contains("pool memory"), "{reason}");
            assert!(reason.contains("dma-buf"), "{reason}");
        }
        other => panic!("dma-buf export of pool memory: {other:?}"),
    }
    assert!(
        matches!(
            registration,
            gpudirect::Error::NotRdmaCapable {
                kind: MemoryKind::Pool,
                ..
            }
        ),
        "the same refusal as registration: {registration}"
    );
}

/// A VMM buffer of several physical chunks mapped back to back (as PyTorch's expandable segments
/// make) behaves as one buffer and exports as one dma-buf over its whole range.
#[test]
fn a_vmm_buffer_of_several_chunks_exports_whole() {
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let g = match VmmBuffer::<u32>::granularity(&ctx) {
        Ok(g) => g,
        Err(e) => {
            gpudirect_testing::skip(Hardware::Gpu, format!("no VMM on device 0: {e}"));
            return;
        }
    };
    let sizes = [g, 2 * g, g];
    let mut buf = VmmBuffer::<u32>::alloc_chunks(&ctx, &sizes).unwrap();
    let total = 4 * g;
    assert_eq!(buf.mapped_bytes(), total);
    assert_eq!(buf.byte_len(), total);
    assert_eq!(
        buf.chunks()
            .iter()
            .map(|c| (c.offset, c.size))
            .collect::<Vec<_>>(),
        vec![(0, g), (g, 2 * g), (3 * g, g)]
    );
    // Bytes across every chunk boundary arrive exactly (copies run over the whole range).
    let stream = gpudirect::cuda::Stream::new(&ctx).unwrap();
    let data = support::gpu::random_u32(buf.len(), support::gpu::seed_from("DMABUF_TEST_SEED"));
    gpudirect::memory::copy_from_host(&stream, &data, &mut buf).unwrap();
    let mut copy = DeviceBuffer::<u32>::from_slice(&stream, &vec![0xDEAD_BEEF; buf.len()]).unwrap();
    gpudirect::memory::copy(&stream, &buf, &mut copy).unwrap();
    assert!(
        copy.to_vec(&stream).unwrap() == data,
        "device copy of the chunked range"
    );
    assert!(
        buf.to_vec(&stream).unwrap() == data,
        "host copy of the chunked range"
    );

    let info = gpudirect::cuda::DeviceInfo::query(0).unwrap();
    if !info.dma_buf {
        gpudirect_testing::skip(Hardware::Gpu, "device 0 does not support dma-buf export");
        return;
    }
    let buf = Arc::new(buf);
    let whole = export_dmabuf(buf.clone(), 0, total).expect("dma-buf export of the whole range");
    assert_eq!(
        whole.size_from_kernel().unwrap(),
        total as u64,
        "the kernel's dma-buf covers every chunk"
    );
    assert_eq!(whole.range().export_base, buf.device_ptr());
    // A range straddling chunks 0 and 1, and one inside chunk 2.
    let mid = export_dmabuf(buf.clone(), g - 100, 200).unwrap();
    assert_eq!(
        (mid.range().offset, mid.size_from_kernel().unwrap()),
        (4096 - 100, 8192)
    );
    let last = export_dmabuf(buf.clone(), 3 * g + 8, 16).unwrap();
    assert_eq!(last.size_from_kernel().unwrap(), 4096);
    println!(
        "chunked VMM: {} chunks of granularity {g}, dma-buf {total} bytes",
        sizes.len()
    );
}
