//! Tier 2: GPUDirect RDMA on a GPU node. What runs without a NIC (the H200 node has a GPU and
//! libibverbs, but no verbs device): the dma-buf export step of `register_gpu` on unaligned
//! sub-ranges (fd, size, offset and IOVA), the RDMA-capable check per memory kind (pool memory
//! refused with a typed error), `SYNC_MEMOPS`, the flush entry point, and the typed error when no
//! verbs device exists. With a verbs device as well, a GPU buffer is registered by the best path
//! and RDMA-written both ways over a loopback pair (`SKIPPED: no verbs device` otherwise, a
//! failure when `GPUDIRECT_REQUIRE` names `rdma`).

mod support;

use gpudirect::Error;
use gpudirect::cudarc::driver::sys;
use gpudirect::memory::{
    DeviceBuffer, DeviceMemory, DeviceMemoryMut, MemoryKind, PoolBuffer, VmmBuffer,
};
use gpudirect::rdma::*;
use gpudirect::rdma::{DmabufRegArgs, check_rdma_capable, set_sync_memops};
use gpudirect_testing::{Hardware, require, skip};
use std::os::fd::AsRawFd;

/// `len` bytes at `offset` of a device buffer, as its own (unaligned) device memory.
#[derive(Debug)]
struct Sub<M> {
    mem: M,
    offset: usize,
    len: usize,
}

// SAFETY: a sub-range of `mem`'s range (checked in `sub`), which `mem` keeps valid and unmoved.
unsafe impl<M: DeviceMemory> DeviceMemory for Sub<M> {
    type Elem = u8;
    fn device_ptr(&self) -> u64 {
        self.mem.device_ptr() + self.offset as u64
    }
    fn len(&self) -> usize {
        self.len
    }
    fn ordinal(&self) -> usize {
        self.mem.ordinal()
    }
    fn kind(&self) -> MemoryKind {
        self.mem.kind()
    }
}

// SAFETY: owned, like the buffer it wraps.
unsafe impl<M: DeviceMemoryMut> DeviceMemoryMut for Sub<M> {}

fn sub<M: DeviceMemory>(mem: M, offset: usize, len: usize) -> Sub<M> {
    assert!(offset + len <= mem.byte_len());
    Sub { mem, offset, len }
}

fn fd_size(fd: i32) -> i64 {
    // SAFETY: an open fd owned by the caller.
    unsafe { libc::lseek(fd, 0, libc::SEEK_END) }
}

fn sync_memops(ptr: u64) -> u32 {
    let mut v: u32 = 0;
    // SAFETY: a valid out-pointer at least as large as the attribute (a boolean).
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut v as *mut u32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
            ptr,
        )
    };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    v
}

#[test]
fn dmabuf_step_exports_unaligned_subranges_exactly() {
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let info = gpudirect::cuda::DeviceInfo::query(0).unwrap();
    if !info.dma_buf {
        skip(Hardware::Gpu, "device 0 does not support dma-buf export");
        return;
    }
    let buf = DeviceBuffer::<u8>::zeroed(&ctx, 4 << 20).unwrap();
    let base = buf.device_ptr();
    assert_eq!(base % 4096, 0);
    // Unaligned: 65544 bytes starting 40 bytes in.
    let s = sub(buf, 40, 65544);
    s.prepare().unwrap();
    assert_eq!(sync_memops(base + 40), 1, "SYNC_MEMOPS set by prepare");
    // SAFETY: `fd` is closed below, before the memory (moved on to `c`) is dropped.
    let (fd, offset) = unsafe { s.export_dmabuf() }.expect("dma-buf export");
    assert!(fd.as_raw_fd() >= 0);
    assert_eq!(offset, 40);
    assert_eq!(
        fd_size(fd.as_raw_fd()),
        17 * 4096,
        "the enclosing 4 KiB pages"
    );
    let args =
        DmabufRegArgs::new(offset, s.nic_len(), s.nic_addr(), AccessFlags::REMOTE_WRITE).unwrap();
    assert_eq!(
        (args.offset, args.len, args.iova),
        (40, 65544, base + 40),
        "ibv_reg_dmabuf_mr(offset = ptr - export base, len, iova = ptr)"
    );
    assert_eq!(
        args.access,
        AccessFlags::REMOTE_WRITE | AccessFlags::LOCAL_WRITE
    );
    drop(fd);
    // Two 40-byte buffers in one page: one page exported each, distinct offsets.
    let buf = s.mem;
    let a = sub(buf, 8192 + 100, 40);
    // SAFETY: closed by the `drop` below, while the memory (moved on to `c`) lives.
    let (fa, oa) = unsafe { a.export_dmabuf() }.unwrap();
    assert_eq!((oa, fd_size(fa.as_raw_fd())), (100, 4096));
    let b = sub(a.mem, 8192 + 200, 40);
    // SAFETY: closed by the `drop` below, while the memory (moved on to `c`) lives.
    let (fb, ob) = unsafe { b.export_dmabuf() }.unwrap();
    assert_eq!((ob, fd_size(fb.as_raw_fd())), (200, 4096));
    assert_ne!(fa.as_raw_fd(), fb.as_raw_fd());
    // Spanning a page boundary: 2 bytes at 4095 export two pages.
    let c = sub(b.mem, 4095, 2);
    // SAFETY: closed by the `drop` below, while the memory (moved on to `c`) lives.
    let (fc, oc) = unsafe { c.export_dmabuf() }.unwrap();
    assert_eq!((oc, fd_size(fc.as_raw_fd())), (4095, 8192));
    drop((fa, fb, fc));
    println!("dma-buf step: offset 40, 17 pages; 40-byte buffers at offsets 100 and 200");
}

#[test]
fn rdma_capable_attribute_per_memory_kind() {
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let dev = DeviceBuffer::<u8>::zeroed(&ctx, 1 << 20).unwrap();
    let attrs = check_rdma_capable(&dev).expect("cuMemAlloc memory is RDMA capable");
    assert!(attrs.gpu_direct_rdma_capable);
    dev.prepare().expect("prepare DeviceBuffer");
    assert_eq!(sync_memops(dev.device_ptr()), 1);

    match VmmBuffer::<u8>::alloc(&ctx, 1 << 20) {
        Ok(vmm) => {
            let attrs = check_rdma_capable(&vmm).expect("VMM memory with the RDMA flag");
            assert!(attrs.gpu_direct_rdma_capable);
            vmm.prepare().expect("prepare VmmBuffer");
        }
        Err(Error::Unsupported { reason, .. }) => println!("VMM part skipped: {reason}"),
        Err(e) => panic!("VmmBuffer::alloc: {e}"),
    }

    // cudarc's CudaSlice (pool memory) is refused, saying so, before any verbs call.
    let stream = ctx.default_stream();
    let pool = PoolBuffer::new(stream.alloc_zeros::<u8>(1 << 20).unwrap()).unwrap();
    let attrs = gpudirect::memory::pointer_attributes(pool.device_ptr()).unwrap();
    assert!(
        !attrs.gpu_direct_rdma_capable,
        "pool memory reports IS_GPU_DIRECT_RDMA_CAPABLE = 0"
    );
    for e in [
        check_rdma_capable(&pool).unwrap_err(),
        pool.prepare().unwrap_err(),
    ] {
        match &e {
            Error::NotRdmaCapable { kind, reason, ptr } => {
                assert_eq!(*kind, MemoryKind::Pool);
                assert_eq!(*ptr, pool.device_ptr());
                // Refused from the kind, before any FFI call (the attribute, read above, agrees).
                assert!(
                    reason.contains("pool memory") && reason.contains("not GPUDirect RDMA capable"),
                    "{reason}"
                );
            }
            other => panic!("unexpected {other:?}"),
        }
        println!("pool memory: {e}");
    }
}

#[test]
fn sync_memops_and_flush_entry_points() {
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let dev = DeviceBuffer::<u8>::zeroed(&ctx, 4096).unwrap();
    set_sync_memops(0, dev.device_ptr()).unwrap();
    assert_eq!(sync_memops(dev.device_ptr()), 1);
    let info = gpudirect::cuda::DeviceInfo::query(0).unwrap();
    for scope in [FlushScope::Owner, FlushScope::AllDevices] {
        match flush_gpudirect_rdma_writes(&ctx, scope) {
            Ok(o) => {
                assert!(info.rdma_flush_writes_options & 1 != 0);
                let expect = if info.rdma_writes_ordering >= scope.raw() {
                    FlushOutcome::AlreadyOrdered
                } else {
                    FlushOutcome::Flushed
                };
                assert_eq!(o, expect);
                println!(
                    "flush {scope:?}: {o:?} (options {}, ordering {})",
                    info.rdma_flush_writes_options, info.rdma_writes_ordering
                );
            }
            Err(Error::Unsupported { reason, .. }) => {
                assert_eq!(info.rdma_flush_writes_options & 1, 0, "{reason}");
                println!("flush {scope:?}: unsupported: {reason}");
            }
            Err(e) => panic!("flush {scope:?}: {e}"),
        }
    }
}

#[test]
fn no_verbs_device_is_a_typed_error() {
    // Without kernel RDMA support (no /sys/class/infiniband_verbs) libibverbs answers ENOSYS;
    // with it but no device, the list is empty: `NoDevice`.
    let typed = |e: &Error| match e {
        Error::NoDevice { what, .. } => *what == "verbs device",
        Error::Os { call, source } => {
            *call == "ibv_get_device_list" && source.raw_os_error() == Some(libc::ENOSYS)
        }
        Error::Load(_) => true,
        _ => false,
    };
    match DeviceList::non_empty() {
        Err(e) => {
            assert!(typed(&e), "unexpected error listing verbs devices: {e:?}");
            println!("typed: {e}");
            let e = Context::open_by_name(None).unwrap_err();
            assert!(typed(&e), "Context::open_by_name without a device: {e:?}");
        }
        Ok(list) => println!(
            "SKIPPED: this node has verbs devices ({list:?}); the no-device error is checked where none exists"
        ),
    }
}

/// GPU and NIC: register a GPU buffer by the best path, RDMA-write it out to a host region and a
/// host region into it, over a loopback pair on the first verbs device.
#[test]
fn gpu_region_round_trip_over_a_loopback_pair() {
    use support::rdma::*;
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let mut p = match pair() {
        Ok(p) => p,
        Err(e) => {
            skip(Hardware::Rdma, format!("no verbs device: {e}"));
            return;
        }
    };
    let stream = gpudirect::cuda::Stream::new(&ctx).unwrap();
    let n = 65544;
    let data = random_bytes(n + 40);
    let buf = DeviceBuffer::from_slice(&stream, &data).unwrap();
    let src = sub(buf, 40, n);
    let mr = match p.pd.register_gpu(
        src,
        AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        GpuRegistration::Auto,
    ) {
        Ok(mr) => mr,
        Err(Error::NoGpuRegistrationPath { attempts }) => {
            skip(
                Hardware::Rdma,
                format!("no GPU registration path on {}: {attempts}", p.ctx.name()),
            );
            return;
        }
        Err(e) => panic!("register_gpu: {e}"),
    };
    println!("registered {mr:?}");
    let remote = mr.remote();
    assert_eq!(
        remote.addr,
        mr.memory().device_ptr(),
        "addr = IOVA = device pointer"
    );
    assert_eq!(remote.len, n as u64);
    if mr.path() == GpuMrPath::DmaBuf {
        assert_eq!(mr.dmabuf_offset(), Some((remote.addr % 4096) as u64));
    }
    // Out of the GPU: RDMA write from the region into a host region.
    let dst =
        p.pd.register_remote(HostBuffer::zeroed(n).unwrap(), AccessFlags::REMOTE_WRITE)
            .unwrap();
    p.a.post_send([SendRequest::write(
        mr.slice(..).unwrap(),
        dst.remote().slice(0, n as u32).unwrap(),
    )])
    .unwrap();
    let c = wait(&mut p.cq_a, 1);
    assert_eq!(c[0].status, WcStatus::Success);
    assert_eq!(dst.to_vec(), &data[40..40 + n]);
    // Into the GPU: a peer writes to the advertised address.
    let back = random_bytes(n);
    let hsrc =
        p.pd.register(HostBuffer::from_slice(&back).unwrap(), AccessFlags::empty())
            .unwrap();
    p.b.post_send([SendRequest::write(
        hsrc.slice(..).unwrap(),
        remote.slice(0, n as u32).unwrap(),
    )])
    .unwrap();
    let c = wait(&mut p.cq_b, 1);
    assert_eq!(c[0].status, WcStatus::Success);
    flush_gpudirect_rdma_writes(&ctx, FlushScope::Owner).ok();
    let all = mr.memory().mem.to_vec(&stream).unwrap();
    assert_eq!(&all[40..40 + n], &back[..]);
    assert_eq!(&all[..40], &data[..40], "bytes before the region untouched");
}

/// The dma-buf step of `register_gpu` on a VMM buffer of several physical chunks covers the
/// whole range (one export across the chunks), so a NIC registration reaches every chunk.
#[test]
fn dmabuf_step_covers_every_chunk_of_a_chunked_vmm_buffer() {
    let ctx = require!(Hardware::Gpu, gpudirect::cuda::context(0));
    let info = gpudirect::cuda::DeviceInfo::query(0).unwrap();
    if !info.dma_buf {
        skip(Hardware::Gpu, "device 0 does not support dma-buf export");
        return;
    }
    let g = match VmmBuffer::<u8>::granularity(&ctx) {
        Ok(g) => g,
        Err(e) => {
            skip(Hardware::Gpu, format!("no VMM with GPUDirect RDMA: {e}"));
            return;
        }
    };
    let buf = VmmBuffer::<u8>::alloc_chunks(&ctx, &[g, g, 2 * g]).unwrap();
    check_rdma_capable(&buf).expect("chunked VMM memory is RDMA capable");
    // SAFETY: `fd` is closed before `buf` is dropped.
    let (fd, offset) = unsafe { buf.export_dmabuf() }.expect("dma-buf export");
    assert_eq!(offset, 0);
    assert_eq!(
        fd_size(fd.as_raw_fd()),
        (4 * g) as i64,
        "one export over all three chunks"
    );
    drop(fd);
    drop(buf);
}
