//! CUDA IPC between two processes: the test re-executes its own binary as the importing child
//! (`P2P_IPC_CHILD` set), which maps the parent's buffers, waits on the parent's IPC event, copies
//! source to destination on the GPU and checks the source's exact bytes; the parent then checks the
//! destination's exact bytes. With two GPUs the child works on the other GPU: it maps the source
//! where it lives (the parent's GPU) and the destination for its own GPU, and every copy that
//! crosses the link says so (never `same_device`).

mod support;

use gpudirect::memory::DeviceMemory;
use gpudirect::memory::{DeviceBuffer, VmmBuffer};
use gpudirect::p2p::{
    CopyPath, IpcEvent, IpcEventHandle, IpcExport, IpcMemHandle, IpcMemory, IpcPool, PoolImport,
    PoolPtrHandle, VmmHandle, VmmImport, export_vmm, recv_fd, send_fd,
};
use gpudirect_testing::{Hardware, require};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Command;
use support::gpu::{self, assert_same, poisoned, random_u32, stream};

const CHILD: &str = "P2P_IPC_CHILD";
const N: usize = (3 << 20) / 4 + 7;

#[derive(serde::Serialize, serde::Deserialize)]
struct MemJob {
    src: IpcMemHandle,
    dst: IpcMemHandle,
    ready: IpcEventHandle,
    seed: u64,
    device: usize,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct VmmJob {
    socket: String,
    seed: u64,
    device: usize,
}

/// Run this test's own binary as the child for `test`, with `job` in the environment.
fn spawn_child(test: &str, job: String) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, job)
        .spawn()
        .unwrap()
}

fn child_device(n: usize) -> usize {
    if n > 1 { 1 } else { 0 }
}

/// The path a copy between memory of device 0 and memory addressed through device `d` must
/// report: the data crosses the link unless `d` is 0.
fn crossing(d: usize) -> CopyPath {
    if d == 0 {
        CopyPath::SameDevice
    } else {
        CopyPath::Peer
    }
}

#[test]
fn ipc_mem_two_processes() {
    if let Ok(job) = std::env::var(CHILD) {
        return mem_child(serde_json::from_str(&job).unwrap());
    }
    let n = require!(Hardware::Gpu, gpu::gpus());
    let seed = gpu::seed();
    let data = random_u32(N, seed);
    let s = stream(0);
    let src = IpcExport::new(DeviceBuffer::from_slice(&s, &data).unwrap()).unwrap();
    let dst = IpcExport::new(poisoned(0, N)).unwrap();
    let ready = IpcEvent::new(0).unwrap();
    ready.record(&s).unwrap();
    let job = MemJob {
        src: src.handle().clone(),
        dst: dst.handle().clone(),
        ready: ready.handle().clone(),
        seed,
        device: child_device(n),
    };
    assert!(
        src.handle().pci_bus_id.is_some(),
        "the handle says where it lives"
    );
    // Opening one's own handle is refused by the driver: a typed error, no panic.
    let own = IpcMemory::<u32>::open(src.handle()).unwrap_err();
    println!("opening our own handle: {own}");
    assert!(own.cuda_name().is_some(), "{own}");
    let status = spawn_child(
        "ipc_mem_two_processes",
        serde_json::to_string(&job).unwrap(),
    )
    .wait()
    .unwrap();
    assert!(status.success(), "child failed: {status:?}");
    let got = dst.into_inner().to_vec(&s).unwrap();
    assert_same(&got, &data, "child's copy into our buffer");
    drop(src);
}

fn mem_child(job: MemJob) {
    let d = job.device;
    let data = random_u32(N, job.seed);
    let ready = IpcEvent::open(&job.ready, d).unwrap();
    let s = stream(d);
    ready.wait_on(&s).unwrap();
    s.synchronize().unwrap();
    // The peer's offset and size are checked against the allocation mapped: past its end (or
    // overflowing) or misaligned for the element type is refused, and the mapping closed again.
    for (offset, bytes) in [
        (1u64 << 40, job.src.bytes),
        (u64::MAX - 3, job.src.bytes),
        (job.src.offset, job.src.bytes + (1 << 40)),
        (job.src.offset + 2, 4),
    ] {
        let mut bad = job.src.clone();
        bad.offset = offset;
        bad.bytes = bytes;
        let e = IpcMemory::<u32>::open_on(&bad, d).unwrap_err();
        assert!(
            matches!(
                e,
                gpudirect::Error::InvalidArgument {
                    arg: "handle.offset",
                    ..
                }
            ),
            "{e}"
        );
    }
    // The source where it lives (the parent's device 0), the destination for this device.
    let src = IpcMemory::<u32>::open(&job.src).unwrap();
    assert_eq!((src.ordinal(), src.home()), (0, Some(0)));
    let dst = IpcMemory::<u32>::open_on(&job.dst, d).unwrap();
    assert_eq!((dst.ordinal(), dst.home()), (d, Some(0)));
    let done = gpudirect::p2p::copy(src, dst).unwrap();
    println!("child on device {d}: copy path {}", done.path);
    assert_eq!(done.path, crossing(d));
    let (src, dst) = done.into_parts();
    // Read both mappings back through local buffers (exact bytes of the parent's source). The
    // destination, memory of device 0 addressed through device d, is copied on device d's
    // stream: a copy across the link, said as such.
    let back = gpudirect::p2p::copy(dst, poisoned(d, N)).unwrap();
    println!("child: device-0 memory mapped on {d} -> {d}: {}", back.path);
    assert_eq!(back.path, crossing(d), "never same_device across the link");
    assert_same(&back.dst.to_vec(&s).unwrap(), &data, "imported destination");
    let local = gpudirect::p2p::copy(src, poisoned(d, N)).unwrap();
    println!(
        "child: device-0 memory mapped at home -> {d}: {}",
        local.path
    );
    assert_eq!(local.path, crossing(d));
    assert_same(&local.dst.to_vec(&s).unwrap(), &data, "imported source");
    // Closing the import (cuIpcCloseMemHandle) unmaps it; in-flight work on it is owned by its
    // InFlight, so the drop adds no synchronization of its own.
    drop(back);
    println!("child: ok");
}

#[test]
fn ipc_vmm_fd_two_processes() {
    if let Ok(job) = std::env::var(CHILD) {
        return vmm_child(serde_json::from_str(&job).unwrap());
    }
    let n = require!(Hardware::Gpu, gpu::gpus());
    let seed = gpu::seed();
    let data = random_u32(N, seed);
    let s = stream(0);
    let ctx = gpudirect::cuda::context(0).unwrap();
    let src = VmmBuffer::<u32>::alloc(&ctx, N).unwrap();
    let src = gpudirect::p2p::copy(DeviceBuffer::from_slice(&s, &data).unwrap(), src)
        .unwrap()
        .dst;
    let dst = VmmBuffer::<u32>::alloc(&ctx, N).unwrap();
    let dst = gpudirect::p2p::copy(poisoned(0, N), dst).unwrap().dst;
    let path = std::env::temp_dir().join(format!("gpudirect-vmm-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let job = VmmJob {
        socket: path.display().to_string(),
        seed,
        device: child_device(n),
    };
    let mut child = spawn_child(
        "ipc_vmm_fd_two_processes",
        serde_json::to_string(&job).unwrap(),
    );
    let (sock, _) = listener.accept().unwrap();
    for buf in [&src, &dst] {
        let (fd, handle) = export_vmm(buf).unwrap();
        send_fd(&sock, fd.as_fd(), &serde_json::to_vec(&handle).unwrap()).unwrap();
    }
    let status = child.wait().unwrap();
    let _ = std::fs::remove_file(&path);
    assert!(status.success(), "child failed: {status:?}");
    let got = dst.to_vec(&s).unwrap();
    assert_same(&got, &data, "child's copy into our VMM buffer");
}

fn vmm_child(job: VmmJob) {
    let d = job.device;
    let data = random_u32(N, job.seed);
    let sock = UnixStream::connect(&job.socket).unwrap();
    let mut handles = Vec::new();
    for _ in 0..2 {
        let mut buf = [0u8; 512];
        let (fd, len) = recv_fd(&sock, &mut buf).unwrap();
        let handle: VmmHandle = serde_json::from_slice(&buf[..len]).unwrap();
        handles.push((fd, handle));
    }
    // The source mapped where it lives, the destination for this device.
    let src = VmmImport::<u32>::open(handles[0].0.as_fd(), &handles[0].1).unwrap();
    assert_eq!((src.ordinal(), src.home()), (0, Some(0)));
    let dst = VmmImport::<u32>::open_on(handles[1].0.as_fd(), &handles[1].1, d).unwrap();
    assert_eq!((dst.ordinal(), dst.home()), (d, Some(0)));
    let done = gpudirect::p2p::copy(src, dst).unwrap();
    println!("child on device {d}: VMM copy path {}", done.path);
    assert_eq!(done.path, crossing(d));
    let (src, dst) = done.into_parts();
    let s = stream(d);
    let back = gpudirect::p2p::copy(dst, poisoned(d, N)).unwrap();
    assert_eq!(back.path, crossing(d), "never same_device across the link");
    assert_same(
        &back.dst.to_vec(&s).unwrap(),
        &data,
        "imported VMM destination",
    );
    let local = gpudirect::p2p::copy(src, poisoned(d, N)).unwrap();
    assert_eq!(local.path, crossing(d));
    assert_same(&local.dst.to_vec(&s).unwrap(), &data, "imported VMM source");
    println!("child: ok");
}

#[derive(serde::Serialize, serde::Deserialize)]
struct PoolJob {
    src: PoolPtrHandle,
    dst: PoolPtrHandle,
}

#[test]
fn ipc_pool_two_processes() {
    if let Ok(job) = std::env::var(CHILD) {
        return pool_child(serde_json::from_str(&job).unwrap());
    }
    let n = require!(Hardware::Gpu, gpu::gpus());
    let seed = gpu::seed();
    let data = random_u32(N, seed);
    let s = stream(0);
    let pool = IpcPool::new(0).unwrap();
    let src = pool.alloc::<u32>(N, &s).unwrap();
    let src = gpudirect::p2p::copy(DeviceBuffer::from_slice(&s, &data).unwrap(), src)
        .unwrap()
        .dst;
    let dst = pool.alloc::<u32>(N, &s).unwrap();
    let dst = gpudirect::p2p::copy(poisoned(0, N), dst).unwrap().dst;
    let path = std::env::temp_dir().join(format!("gpudirect-pool-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let job = VmmJob {
        socket: path.display().to_string(),
        seed,
        device: child_device(n),
    };
    let mut child = spawn_child(
        "ipc_pool_two_processes",
        serde_json::to_string(&job).unwrap(),
    );
    let (sock, _) = listener.accept().unwrap();
    let payload = PoolJob {
        src: src.export().unwrap(),
        dst: dst.export().unwrap(),
    };
    let fd = pool.export_fd().unwrap();
    send_fd(&sock, fd.as_fd(), &serde_json::to_vec(&payload).unwrap()).unwrap();
    let status = child.wait().unwrap();
    let _ = std::fs::remove_file(&path);
    assert!(status.success(), "child failed: {status:?}");
    let back = gpudirect::p2p::copy(dst, poisoned(0, N)).unwrap().dst;
    assert_same(
        &back.to_vec(&s).unwrap(),
        &data,
        "child's copy into our pool memory",
    );
}

fn pool_child(job: VmmJob) {
    let d = job.device;
    let data = random_u32(N, job.seed);
    let sock = UnixStream::connect(&job.socket).unwrap();
    let mut buf = [0u8; 2048];
    let (fd, len) = recv_fd(&sock, &mut buf).unwrap();
    let handles: PoolJob = serde_json::from_slice(&buf[..len]).unwrap();
    let pool = IpcPool::import(fd.as_fd(), handles.src.device as usize, d).unwrap();
    // The peer's size is checked against the allocation imported (the import is freed again).
    let mut bad = handles.src.clone();
    bad.bytes += 1 << 40;
    let e = PoolImport::<u32>::open(&pool, &bad).unwrap_err();
    assert!(
        matches!(
            e,
            gpudirect::Error::InvalidArgument {
                arg: "handle.bytes",
                ..
            }
        ),
        "{e}"
    );
    let src = PoolImport::<u32>::open(&pool, &handles.src).unwrap();
    let dst = PoolImport::<u32>::open(&pool, &handles.dst).unwrap();
    // Both live on device 0 and are addressed through device d: a copy between them on d's
    // stream crosses the link twice, and must not say same_device.
    let done = gpudirect::p2p::copy(src, dst).unwrap();
    println!("child on device {d}: pool copy path {}", done.path);
    assert_eq!(done.path, crossing(d));
    let (src, _dst) = done.into_parts();
    let s = stream(d);
    let local = gpudirect::p2p::copy(src, poisoned(d, N)).unwrap();
    assert_eq!(local.path, crossing(d));
    assert_same(
        &local.dst.to_vec(&s).unwrap(),
        &data,
        "imported pool source",
    );
    println!("child: ok");
}

#[test]
fn pool_memory_export_is_typed_unsupported() {
    let _ = require!(Hardware::Gpu, gpu::gpus());
    let ctx = gpudirect::cuda::context(0).unwrap();
    let slice = ctx.default_stream().alloc_zeros::<u32>(16).unwrap();
    let pool = gpudirect::memory::PoolBuffer::new(slice).unwrap();
    let e = IpcExport::new(pool).unwrap_err();
    assert!(matches!(e, gpudirect::Error::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("cuMemPoolExportPointer"), "{e}");
}

#[test]
fn handles_serialize_for_out_of_band_exchange() {
    let h = IpcMemHandle::from_parts([7; 64], 40, 4096, 4, 0, Some("0000:19:00.0".into()));
    let j = serde_json::to_string(&h).unwrap();
    assert!(j.contains(&"07".repeat(64)), "{j}");
    assert_eq!(serde_json::from_str::<IpcMemHandle>(&j).unwrap(), h);
    let v = VmmHandle {
        bytes: 12,
        mapped_bytes: 2 << 20,
        elem_size: 4,
        device: 0,
        pci_bus_id: Some("0000:19:00.0".into()),
    };
    let j = serde_json::to_string(&v).unwrap();
    assert_eq!(serde_json::from_str::<VmmHandle>(&j).unwrap(), v);
}

#[test]
fn ipc_pool_memory_is_refused_naming_the_api_that_shares_it() {
    let _ = require!(Hardware::Gpu, gpu::gpus());
    let pool = match IpcPool::new(0) {
        Ok(p) => p,
        Err(e) => {
            gpudirect_testing::skip(Hardware::Gpu, format!("no IPC pool on device 0: {e}"));
            return;
        }
    };
    let s = stream(0);
    let alloc = pool.alloc::<u32>(1024, &s).unwrap();
    // The right API accepts it...
    let handle = alloc
        .export()
        .expect("PoolAlloc::export shares IpcPool memory");
    assert_eq!(handle.bytes, 4096);
    // ...and cuIpcGetMemHandle's wrapper names that API, never "allocate from an IpcPool".
    let e = IpcExport::new(alloc).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, gpudirect::Error::Unsupported { .. }), "{e}");
    assert!(text.contains("PoolAlloc::export"), "{text}");
    assert!(!text.contains("allocate"), "{text}");
}

#[test]
fn a_vmm_buffer_of_several_chunks_is_refused_by_fd_export_naming_the_chunks() {
    let _ = require!(Hardware::Gpu, gpu::gpus());
    let ctx = gpudirect::cuda::context(0).unwrap();
    let g = match VmmBuffer::<u32>::granularity(&ctx) {
        Ok(g) => g,
        Err(e) => {
            gpudirect_testing::skip(Hardware::Gpu, format!("no VMM on device 0: {e}"));
            return;
        }
    };
    let buf = VmmBuffer::<u32>::alloc_chunks(&ctx, &[g, 2 * g]).unwrap();
    let e = export_vmm(&buf).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, gpudirect::Error::Unsupported { .. }), "{e}");
    assert!(text.contains("2 physical chunks"), "{text}");
    assert!(
        text.contains(&format!("chunk 1 at bytes {g}..{}", 3 * g)),
        "{text}"
    );
    // A one-chunk buffer still exports.
    let one = VmmBuffer::<u32>::alloc_chunks(&ctx, &[g]).unwrap();
    let (_fd, h) = export_vmm(&one).unwrap();
    assert_eq!(h.mapped_bytes, g as u64);
}
