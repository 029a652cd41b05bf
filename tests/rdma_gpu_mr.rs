//! Tier 1 (Soft-RoCE VM): the GPU registration machinery of `ProtectionDomain::register_gpu`,
//! driven by a real host dma-buf from udmabuf (a sealed memfd exported with
//! `ioctl(/dev/udmabuf, UDMABUF_CREATE)`).
//!
//! rxe cannot import dma-bufs: `ibv_reg_dmabuf_mr` answers `EOPNOTSUPP`, which must become the
//! typed `Unsupported` saying dma-buf, and the automatic mode must record it and fall through to
//! the peer-memory step. For host memory that step is a plain `ibv_reg_mr` (what nvidia-peermem
//! makes of a device pointer), so the region it yields carries real RDMA traffic here: the bytes
//! land at the advertised address, and only inside the registered bounds.
//!
//! Prints `SKIPPED: reason` without a verbs device (or without /dev/udmabuf), and fails then when
//! `GPUDIRECT_REQUIRE` names `rdma`.

mod support;

use gpudirect::Error;
use gpudirect::rdma::*;
use gpudirect_testing::{Hardware, require, skip};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use support::rdma::*;

const PAGE: usize = 4096;

/// `struct udmabuf_create` from linux/udmabuf.h.
#[repr(C)]
struct UdmabufCreate {
    memfd: u32,
    flags: u32,
    offset: u64,
    size: u64,
}

/// `_IOW('u', 0x42, struct udmabuf_create)`.
const UDMABUF_CREATE: u64 =
    (1 << 30) | ((std::mem::size_of::<UdmabufCreate>() as u64) << 16) | ((b'u' as u64) << 8) | 0x42;
const UDMABUF_FLAGS_CLOEXEC: u32 = 1;

/// A shared memfd mapping and a udmabuf dma-buf over all of it.
struct Mapping {
    ptr: *mut u8,
    len: usize,
    _memfd: OwnedFd,
    dmabuf: OwnedFd,
}

// SAFETY: the mapping is plain shared memory, accessed only through raw copies.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// `len` bytes (a multiple of the page size), or why udmabuf is not available.
    fn new(len: usize) -> Result<Arc<Mapping>, String> {
        assert_eq!(len % PAGE, 0);
        // SAFETY: a NUL-terminated name; flags as documented.
        let fd =
            unsafe { libc::memfd_create(c"gpudirect-udmabuf".as_ptr(), libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: a new fd nothing else owns.
        let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: an open memfd.
        if unsafe { libc::ftruncate(memfd.as_raw_fd(), len as i64) } != 0 {
            return Err(format!("ftruncate: {}", std::io::Error::last_os_error()));
        }
        // udmabuf requires the memfd to be sealed against shrinking.
        // SAFETY: an open memfd created with MFD_ALLOW_SEALING.
        if unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } != 0 {
            return Err(format!("F_ADD_SEALS: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: a fresh shared mapping of the memfd's `len` bytes.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                memfd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(format!("mmap: {}", std::io::Error::last_os_error()));
        }
        let unmap = || {
            // SAFETY: the mapping made above, unmapped once on this error path.
            unsafe { libc::munmap(ptr, len) };
        };
        // SAFETY: a NUL-terminated path.
        let dev = unsafe { libc::open(c"/dev/udmabuf".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if dev < 0 {
            let e = std::io::Error::last_os_error();
            unmap();
            return Err(format!(
                "/dev/udmabuf: {e} (kernel without CONFIG_UDMABUF?)"
            ));
        }
        // SAFETY: a new fd nothing else owns.
        let dev = unsafe { OwnedFd::from_raw_fd(dev) };
        let arg = UdmabufCreate {
            memfd: memfd.as_raw_fd() as u32,
            flags: UDMABUF_FLAGS_CLOEXEC,
            offset: 0,
            size: len as u64,
        };
        // SAFETY: the ioctl reads one `struct udmabuf_create`, which `arg` is.
        let buf = unsafe { libc::ioctl(dev.as_raw_fd(), UDMABUF_CREATE as _, &arg) };
        if buf < 0 {
            let e = std::io::Error::last_os_error();
            unmap();
            return Err(format!("UDMABUF_CREATE: {e}"));
        }
        Ok(Arc::new(Mapping {
            ptr: ptr.cast(),
            len,
            _memfd: memfd,
            // SAFETY: the ioctl returned a new dma-buf fd.
            dmabuf: unsafe { OwnedFd::from_raw_fd(buf) },
        }))
    }

    fn read(&self, offset: usize, n: usize) -> Vec<u8> {
        assert!(offset + n <= self.len);
        let mut v = vec![0; n];
        // SAFETY: in bounds of the mapping; a raw copy (read after the completion that wrote it).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), v.as_mut_ptr(), n) };
        v
    }

    fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len);
        // SAFETY: in bounds; a raw copy while no work request uses these bytes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset), data.len()) };
    }

    /// The size the kernel reports for the dma-buf.
    fn dmabuf_size(&self) -> i64 {
        // SAFETY: an open fd owned by self.
        unsafe { libc::lseek(self.dmabuf.as_raw_fd(), 0, libc::SEEK_END) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`; every region over it (which holds this Arc) is gone.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// `len` bytes at `offset` of a udmabuf-backed mapping, as a registration source. `peermem`
/// says whether the peer-memory step may `ibv_reg_mr` the host address (true: host memory
/// registers that way, as device memory does under nvidia-peermem).
struct UdmabufSpan {
    map: Arc<Mapping>,
    offset: usize,
    len: usize,
    peermem: bool,
}

// SAFETY: the span lies inside the mapping (asserted at construction), which the Arc keeps mapped;
// the dma-buf covers the whole mapping, so the span is at `offset` inside it; `ibv_reg_mr` on the
// host address pins exactly these bytes.
unsafe impl GpuMrSource for UdmabufSpan {
    fn nic_addr(&self) -> u64 {
        self.map.ptr as u64 + self.offset as u64
    }
    fn nic_len(&self) -> usize {
        self.len
    }
    fn prepare(&self) -> gpudirect::Result<()> {
        Ok(())
    }
    unsafe fn export_dmabuf(&self) -> Result<(OwnedFd, u64), GpuMrRefusal> {
        let fd = self.map.dmabuf.try_clone().map_err(|e| {
            GpuMrRefusal::Failed(Error::Os {
                call: "dup",
                source: e,
            })
        })?;
        Ok((fd, self.offset as u64))
    }
    fn peermem(&self) -> Result<(), GpuMrRefusal> {
        if self.peermem {
            Ok(())
        } else {
            Err(GpuMrRefusal::NoPeermemModule)
        }
    }
}

fn span(map: &Arc<Mapping>, offset: usize, len: usize, peermem: bool) -> UdmabufSpan {
    assert!(offset + len <= map.len);
    UdmabufSpan {
        map: map.clone(),
        offset,
        len,
        peermem,
    }
}

/// A udmabuf mapping of `len` bytes, or a skip (a failure under `GPUDIRECT_REQUIRE=rdma`).
macro_rules! udmabuf {
    ($len:expr) => {
        match Mapping::new($len) {
            Ok(m) => m,
            Err(e) => {
                skip(Hardware::Rdma, format!("no udmabuf: {e}"));
                return;
            }
        }
    };
}

fn is_soft(ctx: &Context) -> bool {
    ctx.name().starts_with("rxe") || ctx.name().starts_with("siw")
}

#[test]
fn udmabuf_reaches_ibv_reg_dmabuf_mr_and_eopnotsupp_is_typed() {
    let ctx = require!(Hardware::Rdma, Context::open_by_name(None));
    let pd = ctx.alloc_pd().unwrap();
    let map = udmabuf!(16 * PAGE);
    assert_eq!(
        map.dmabuf_size(),
        (16 * PAGE) as i64,
        "a real dma-buf of the mapping's size"
    );
    let r = pd.register_gpu(
        span(&map, 40, 65544 - 40 * 2, false),
        AccessFlags::REMOTE_WRITE,
        GpuRegistration::DmaBuf,
    );
    match r {
        Err(Error::Unsupported { what, reason }) => {
            assert!(what.contains("dma-buf"), "{what}");
            assert!(reason.contains(ctx.name()), "{reason}");
            println!("dma-buf path on {}: Unsupported: {reason}", ctx.name());
        }
        Ok(mr) => {
            assert!(
                !is_soft(&ctx),
                "{} cannot import dma-bufs, yet registered {mr:?}",
                ctx.name()
            );
            assert_eq!(mr.path(), GpuMrPath::DmaBuf);
            assert_eq!(mr.remote().addr, map.ptr as u64 + 40);
            println!("dma-buf path on {}: registered {mr:?}", ctx.name());
        }
        Err(e) => panic!("unexpected error from ibv_reg_dmabuf_mr: {e:?}"),
    }
    // The plain wrapper gives the same typed answer for the same fd.
    let fd = map.dmabuf.try_clone().unwrap();
    // SAFETY: the udmabuf mapping `map` outlives the region (dropped at the end of this match).
    match unsafe { pd.register_dmabuf_fd(fd, 0, PAGE, map.ptr as u64, AccessFlags::LOCAL_WRITE) } {
        Err(Error::Unsupported { what, .. }) => assert!(what.contains("dma-buf"), "{what}"),
        Ok(r) => assert!(!is_soft(&ctx), "{r:?}"),
        Err(e) => panic!("unexpected {e:?}"),
    }
}

#[test]
fn auto_records_the_dmabuf_refusal_and_falls_through() {
    let mut p = require!(Hardware::Rdma, pair());
    let map = udmabuf!(32 * PAGE);
    if !is_soft(&p.ctx) {
        skip(
            Hardware::Rdma,
            format!(
                "{} may import dma-bufs: the fall-through is shown on Soft-RoCE",
                p.ctx.name()
            ),
        );
        return;
    }
    // The unaligned geometry: 65544 bytes starting 40 bytes into the buffer.
    let (off, len) = (PAGE + 40, 65544);
    map.write(0, &vec![0xEE; map.len]); // poison everything around the span
    let mr =
        p.pd.register_gpu(
            span(&map, off, len, true),
            AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            GpuRegistration::Auto,
        )
        .unwrap();
    println!("auto: {mr:?}");
    assert_eq!(mr.path(), GpuMrPath::Peermem);
    let refused = mr.attempts().as_slice();
    assert_eq!(refused.len(), 1, "{}", mr.attempts());
    assert_eq!(refused[0].0, GpuMrPath::DmaBuf);
    match &refused[0].1 {
        GpuMrRefusal::Unsupported(Error::Unsupported { what, .. }) => {
            assert!(what.contains("dma-buf"))
        }
        other => panic!("dma-buf must be refused as Unsupported, got {other:?}"),
    }
    assert!(
        mr.attempts()
            .to_string()
            .starts_with("dma-buf: unsupported:"),
        "{}",
        mr.attempts()
    );
    // The descriptor advertises exactly the requested bytes, at the address the NIC expects.
    let remote = mr.remote();
    assert_eq!(
        (remote.addr, remote.len),
        (map.ptr as u64 + off as u64, len as u64)
    );
    assert_eq!(remote.rkey, mr.rkey());

    // A peer writes to the advertised address: the bytes land there, nowhere else.
    let data = random_bytes(len);
    let src =
        p.pd.register(HostBuffer::from_slice(&data).unwrap(), AccessFlags::empty())
            .unwrap();
    p.a.post_send([SendRequest::write(
        src.slice(..).unwrap(),
        remote.slice(0, len as u32).unwrap(),
    )
    .tag(1)])
        .unwrap();
    let c = wait(&mut p.cq_a, 1);
    assert_eq!((c[0].tag, c[0].status), (1, WcStatus::Success));
    assert_eq!(
        map.read(off, len),
        data,
        "the written bytes landed at the IOVA"
    );
    assert!(
        map.read(0, off).iter().all(|&b| b == 0xEE),
        "bytes before the region untouched"
    );
    assert!(
        map.read(off + len, map.len - off - len)
            .iter()
            .all(|&b| b == 0xEE),
        "bytes after untouched"
    );

    // And out of the region: an RDMA write from its slice into a host region.
    let dst =
        p.pd.register_remote(HostBuffer::zeroed(len).unwrap(), AccessFlags::REMOTE_WRITE)
            .unwrap();
    let dst_remote = dst.remote();
    p.b.post_send([SendRequest::write(
        mr.slice(..).unwrap(),
        dst_remote.slice(0, len as u32).unwrap(),
    )
    .tag(2)])
        .unwrap();
    let c = wait(&mut p.cq_b, 1);
    assert_eq!((c[0].tag, c[0].status), (2, WcStatus::Success));
    assert_eq!(dst.to_vec(), data);

    // The NIC enforces the bounds: 8 bytes just before the region are refused.
    let before = RemoteSlice {
        addr: remote.addr - 8,
        rkey: remote.rkey,
        len: 8,
    };
    p.a.post_send([SendRequest::write(src.slice(0..8).unwrap(), before).tag(3)])
        .unwrap();
    let c = wait(&mut p.cq_a, 1);
    assert_eq!(c[0].tag, 3);
    assert_ne!(
        c[0].status,
        WcStatus::Success,
        "a write outside the region must fail"
    );
    assert!(
        map.read(0, off).iter().all(|&b| b == 0xEE),
        "nothing landed before the region"
    );
    println!("outside the bounds: {:?}", c[0].status);
}

#[test]
fn auto_with_no_path_lists_every_refusal() {
    let ctx = require!(Hardware::Rdma, Context::open_by_name(None));
    if !is_soft(&ctx) {
        skip(
            Hardware::Rdma,
            format!("{} may import dma-bufs", ctx.name()),
        );
        return;
    }
    let pd = ctx.alloc_pd().unwrap();
    let map = udmabuf!(4 * PAGE);
    let e = pd
        .register_gpu(
            span(&map, 0, 4 * PAGE, false),
            AccessFlags::LOCAL_WRITE,
            GpuRegistration::Auto,
        )
        .unwrap_err();
    println!("{e}");
    match &e {
        Error::NoGpuRegistrationPath { attempts } => {
            let a = attempts.as_slice();
            assert_eq!(a.len(), 2, "{attempts}");
            assert!(
                matches!(a[0], (GpuMrPath::DmaBuf, GpuMrRefusal::Unsupported(_))),
                "{attempts}"
            );
            assert!(
                matches!(a[1], (GpuMrPath::Peermem, GpuMrRefusal::NoPeermemModule)),
                "{attempts}"
            );
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(e.to_string().contains("nvidia-peermem: not tried"), "{e}");
    // Peermem alone: its own typed error.
    let e = pd
        .register_gpu(
            span(&map, 0, PAGE, false),
            AccessFlags::LOCAL_WRITE,
            GpuRegistration::Peermem,
        )
        .unwrap_err();
    assert!(
        matches!(&e, Error::Unsupported { what, .. } if what.contains("nvidia-peermem")),
        "{e}"
    );
    // Validation before any FFI: an empty span.
    let e = pd
        .register_gpu(
            span(&map, 0, 0, true),
            AccessFlags::LOCAL_WRITE,
            GpuRegistration::Auto,
        )
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { arg: "len", .. }),
        "{e}"
    );
}

#[test]
fn two_small_buffers_in_one_page_are_distinct_regions() {
    let mut p = require!(Hardware::Rdma, pair());
    let map = udmabuf!(PAGE);
    map.write(0, &[0xEE; PAGE]);
    let a =
        p.pd.register_gpu(
            span(&map, 100, 40, true),
            AccessFlags::REMOTE_WRITE,
            GpuRegistration::Auto,
        )
        .unwrap();
    let b =
        p.pd.register_gpu(
            span(&map, 200, 40, true),
            AccessFlags::REMOTE_WRITE,
            GpuRegistration::Auto,
        )
        .unwrap();
    let (ra, rb) = (a.remote(), b.remote());
    assert_eq!((ra.addr, ra.len), (map.ptr as u64 + 100, 40));
    assert_eq!((rb.addr, rb.len), (map.ptr as u64 + 200, 40));
    assert_ne!(ra.rkey, rb.rkey);
    // Descriptors refuse ranges beyond their 40 bytes before any FFI call.
    assert!(ra.slice(0, 41).is_err());
    assert!(ra.slice(40, 1).is_err());
    // Each write lands in its own 40 bytes.
    let src =
        p.pd.register(
            HostBuffer::from_slice(&[0x11; 40]).unwrap(),
            AccessFlags::empty(),
        )
        .unwrap();
    p.a.post_send([
        SendRequest::write(src.slice(..).unwrap(), ra.slice(0, 40).unwrap()).tag(1),
        SendRequest::write(src.slice(..).unwrap(), rb.slice(0, 40).unwrap()).tag(2),
    ])
    .unwrap();
    let c = wait(&mut p.cq_a, 2);
    assert!(c.iter().all(|d| d.status == WcStatus::Success), "{c:?}");
    let page = map.read(0, PAGE);
    assert!(page[100..140].iter().all(|&x| x == 0x11));
    assert!(page[200..240].iter().all(|&x| x == 0x11));
    assert!(
        page[140..200].iter().all(|&x| x == 0xEE),
        "between the two regions untouched"
    );
    // b's rkey does not reach a's bytes: a write of 8 bytes at a's address with b's key fails.
    let cross = RemoteSlice {
        addr: ra.addr,
        rkey: rb.rkey,
        len: 8,
    };
    p.a.post_send([SendRequest::write(src.slice(0..8).unwrap(), cross).tag(3)])
        .unwrap();
    let c = wait(&mut p.cq_a, 1);
    assert_ne!(
        c[0].status,
        WcStatus::Success,
        "b's rkey must not grant access to a's bytes"
    );
    drop((a, b));
}
