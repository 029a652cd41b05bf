//! GPU peer-memory helpers for GPUDirect RDMA: the dma-buf export range arithmetic and detection of
//! the nvidia-peermem kernel module.
//!
//! Registering GPU memory with a NIC goes one of two ways:
//! - **dma-buf**: export the enclosing page-aligned range with `cuMemGetHandleForAddressRange`, then
//!   `ibv_reg_dmabuf_mr(pd, offset, len, iova, fd, access)` with `offset` = pointer − exported base
//!   and `iova` = pointer, so the region covers exactly the requested bytes at the address the peer
//!   is told. [`DmaBufRange`] computes those numbers.
//! - **nvidia-peermem** (or the older `nv_peer_mem`): a kernel module that lets plain `ibv_reg_mr`
//!   pin GPU memory. [`peermem_module`] says whether one is loaded.

use std::path::Path;

/// The page size dma-buf exports of CUDA memory are aligned to (bytes).
pub const DMABUF_PAGE: u64 = 4096;

/// The GPU page size nvidia-peermem pins in (bytes): registrations cover whole 64 KiB pages.
pub const GPU_PAGE: u64 = 65536;

/// Where a requested device range sits inside its page-aligned dma-buf export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaBufRange {
    /// Start of the export: the pointer rounded down to [`DMABUF_PAGE`].
    pub export_base: u64,
    /// Bytes exported: from `export_base` to the end of the request rounded up to a page.
    pub export_len: u64,
    /// `offset` for `ibv_reg_dmabuf_mr`: the requested pointer minus `export_base`.
    pub offset: u64,
    /// Bytes registered: exactly the requested length.
    pub len: u64,
    /// `iova` for `ibv_reg_dmabuf_mr`: the requested device pointer, so a remote peer addresses
    /// the bytes by the same value the local side uses.
    pub iova: u64,
}

impl DmaBufRange {
    /// The export for `len` bytes at device pointer `ptr`. `None` for an empty range or one that
    /// overflows the address space.
    pub fn new(ptr: u64, len: u64) -> Option<DmaBufRange> {
        if len == 0 {
            return None;
        }
        let end = ptr.checked_add(len)?;
        let export_base = ptr & !(DMABUF_PAGE - 1);
        let export_end = end.checked_add(DMABUF_PAGE - 1)? & !(DMABUF_PAGE - 1);
        Some(DmaBufRange {
            export_base,
            export_len: export_end - export_base,
            offset: ptr - export_base,
            len,
            iova: ptr,
        })
    }
}

/// A loaded peer-memory kernel module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeermemModule {
    /// `nvidia_peermem` or `nv_peer_mem`.
    pub name: String,
    /// Its version from sysfs, when the module publishes one.
    pub version: Option<String>,
}

/// The peer-memory module loaded in the running kernel, if any (reads `/sys/module`).
pub fn peermem_module() -> Option<PeermemModule> {
    peermem_module_in(Path::new("/sys/module"))
}

/// [`peermem_module`] against another sysfs root (for tests).
pub fn peermem_module_in(sys_module: &Path) -> Option<PeermemModule> {
    ["nvidia_peermem", "nv_peer_mem"].iter().find_map(|name| {
        let dir = sys_module.join(name);
        dir.is_dir().then(|| PeermemModule {
            name: name.to_string(),
            version: std::fs::read_to_string(dir.join("version"))
                .ok()
                .map(|v| v.trim().to_string()),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unaligned_range_is_exact() {
        // 65544 bytes starting 40 bytes into a 2 MiB-aligned allocation.
        let alloc = 0x7f00_0020_0000u64;
        let r = DmaBufRange::new(alloc + 40, 65544).unwrap();
        assert_eq!(r.export_base, alloc);
        assert_eq!(r.offset, 40);
        assert_eq!(r.len, 65544);
        assert_eq!(r.iova, alloc + 40);
        // 40 + 65544 = 65584 bytes -> 17 pages.
        assert_eq!(r.export_len, 17 * 4096);
        assert!(r.export_base + r.export_len >= r.iova + r.len);
    }

    #[test]
    fn two_small_buffers_in_one_page_are_distinct_regions() {
        let page = 0x10_0000u64;
        let a = DmaBufRange::new(page + 100, 40).unwrap();
        let b = DmaBufRange::new(page + 200, 40).unwrap();
        assert_eq!(a.export_base, b.export_base);
        assert_eq!(a.export_len, 4096);
        assert_eq!((a.offset, a.len, a.iova), (100, 40, page + 100));
        assert_eq!((b.offset, b.len, b.iova), (200, 40, page + 200));
        // The registered byte ranges do not overlap.
        assert!(a.iova + a.len <= b.iova);
    }

    #[test]
    fn aligned_and_degenerate_ranges() {
        let r = DmaBufRange::new(0x2000, 4096).unwrap();
        assert_eq!((r.export_base, r.export_len, r.offset), (0x2000, 4096, 0));
        assert_eq!(DmaBufRange::new(0x2000, 0), None);
        assert_eq!(DmaBufRange::new(u64::MAX - 10, 100), None);
        let r = DmaBufRange::new(0x2fff, 2).unwrap();
        assert_eq!(
            (r.export_base, r.export_len, r.offset),
            (0x2000, 8192, 0xfff)
        );
    }

    #[test]
    fn peermem_detection_reads_sysfs() {
        let dir = std::env::temp_dir().join(format!("gd-sysmod-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("nvidia")).unwrap();
        assert_eq!(peermem_module_in(&dir), None);
        std::fs::create_dir_all(dir.join("nvidia_peermem")).unwrap();
        std::fs::write(dir.join("nvidia_peermem/version"), "580.159.04\n").unwrap();
        assert_eq!(
            peermem_module_in(&dir),
            Some(PeermemModule {
                name: "nvidia_peermem".into(),
                version: Some("580.159.04".into())
            })
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
