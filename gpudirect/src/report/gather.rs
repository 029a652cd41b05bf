//! Gathering the report through gpudirect's typed APIs; each step fallible and recorded.

use super::advice::{
    advise, async_verdict, p2p_verdict, rdma_verdict, settings_from_env, storage_verdict,
};
use super::health::{
    self, HealthGpu, HealthInputs, HealthNic, HealthSection, NvlinkCounters, NvmlSource, PcieLink,
    SystemPaths, gather_health, gpu_ordinal_of, parse_link_speed,
};
#[cfg(not(all(feature = "p2p", feature = "storage")))]
use super::model::not_built;
use super::model::{
    AsyncSection, CudaSection, GpuAsync, LibraryStatus, NodeReport, P2pSection, RdmaSection,
    SCHEMA_VERSION, StorageSection, version_words,
};
#[cfg(feature = "p2p")]
use super::model::{CopyMeasurement, P2pPair};
#[cfg(feature = "storage")]
use super::model::{CufileProperties, StorageRead};
use super::paths::path_statuses;
use super::verbs::rdma_section;
use crate::cuda::DeviceInfo;
use crate::cuda::Stream;
use crate::memory::DeviceBuffer;
#[cfg(feature = "p2p")]
use crate::p2p::{Copier, CopyOptions, CopyPath, Interconnect, LinkMatrix};
#[cfg(feature = "storage")]
use crate::storage::{self, Mode, OpenOptions, PathReason};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// What [`NodeReport::gather_with`] does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatherOptions {
    /// Run the quick copies and the storage read (a few seconds in all).
    pub measure: bool,
    /// Bytes per P2P copy. Default 32 MiB.
    pub copy_bytes: usize,
    /// Time allowed for all P2P copies together; pairs past it are not measured. Default 2 s.
    pub copy_budget: Duration,
    /// Bytes of the storage read. Default 64 MiB.
    pub read_bytes: usize,
    /// Directory for the storage read's temporary file: `GPUDIRECT_TEST_DIR` when set, else
    /// the system's temporary directory.
    pub read_dir: PathBuf,
    /// Where sysfs, procfs, the kernel log and configuration files are read from (the real
    /// system by default).
    pub system: SystemPaths,
}

impl Default for GatherOptions {
    fn default() -> Self {
        GatherOptions {
            measure: true,
            copy_bytes: 32 << 20,
            copy_budget: Duration::from_secs(2),
            read_bytes: 64 << 20,
            read_dir: std::env::var_os("GPUDIRECT_TEST_DIR")
                .filter(|d| !d.is_empty())
                .map(PathBuf::from)
                .unwrap_or_else(std::env::temp_dir),
            system: SystemPaths::default(),
        }
    }
}

/// Run `f`; a panic (from a dependency) becomes `Err` with its message.
fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        format!("{what} panicked: {msg}")
    })
}

impl NodeReport {
    /// Look at this node, measuring. Never fails and never panics: absences are recorded with
    /// reasons.
    pub fn gather() -> NodeReport {
        Self::gather_with(&GatherOptions::default())
    }

    /// Look at this node with `opts`. Never fails and never panics.
    pub fn gather_with(opts: &GatherOptions) -> NodeReport {
        gather(opts)
    }
}

/// A library's status from its loader's answer: its file and version, or why it did not load.
fn library(
    name: &str,
    loaded: Result<(&str, Option<String>), impl std::fmt::Display>,
) -> LibraryStatus {
    match loaded {
        Ok((path, version)) => LibraryStatus::loaded(name, path, version),
        Err(e) => LibraryStatus::missing(name, e),
    }
}

fn gather(opts: &GatherOptions) -> NodeReport {
    let mut libraries = Vec::new();
    let cuda =
        guarded("the GPU query", || cuda_section(&mut libraries)).unwrap_or_else(|e| CudaSection {
            driver_version: None,
            bindings_version: crate::cuda::BINDINGS_VERSION,
            devices: Vec::new(),
            absent_reason: Some(e),
        });
    libraries.push(library(
        "libcufile",
        gpudirect_sys::cufile::lib().map(|l| (l.path(), l.version().map(version_words))),
    ));
    libraries.push(library(
        "libibverbs",
        gpudirect_sys::ibverbs::lib().map(|l| (l.path(), version_from_file_name(l.path()))),
    ));
    libraries.push(library(
        "librdmacm",
        gpudirect_sys::rdmacm::lib().map(|l| (l.path(), version_from_file_name(l.path()))),
    ));

    // NVML for the health checks, opened before the measurements so that NVLink error counters
    // can be read before and after the probe's own copies (growth marks a marginal link).
    let nvml = if cuda.devices.is_empty() {
        Err("no GPU".to_string())
    } else {
        guarded("opening NVML", health::open_nvml).and_then(|r| r)
    };
    let nvlink_before = match &nvml {
        Ok(n) if opts.measure => {
            let buses: Vec<String> = cuda.devices.iter().map(|d| d.pci_bus_id.clone()).collect();
            guarded("reading NVLink counters", || {
                NvlinkCounters::read(n.as_ref(), &buses)
            })
            .ok()
        }
        _ => None,
    };
    let mut p2p =
        guarded("the P2P probe", || p2p_section(&cuda, opts)).unwrap_or_else(P2pSection::absent);
    p2p.verdict = p2p_verdict(&p2p);
    let mut rdma = guarded("the RDMA probe", || rdma_section(&cuda, &opts.system.sysfs))
        .unwrap_or_else(RdmaSection::absent);
    rdma.verdict = rdma_verdict(&rdma, &cuda);
    let mut storage = guarded("the storage probe", || storage_section(&cuda, opts))
        .unwrap_or_else(StorageSection::absent);
    storage.verdict = storage_verdict(&storage);
    let mut async_ = async_section(&cuda);
    async_.verdict = async_verdict(&async_);
    let health = guarded("the health checks", || {
        health_section(&cuda, &rdma, &storage, opts, &nvml, nvlink_before.as_ref())
    })
    .unwrap_or_else(|e| health::health_unavailable(&e));
    let mut report = NodeReport {
        schema_version: SCHEMA_VERSION,
        measured: opts.measure,
        libraries,
        cuda,
        p2p,
        rdma,
        storage,
        async_,
        health,
        paths: Vec::new(),
        advice: Vec::new(),
        settings: settings_from_env(|k| std::env::var(k).ok()),
    };
    report.paths = path_statuses(&report);
    report.advice = advise(&report);
    report
}

fn health_section(
    cuda: &CudaSection,
    rdma: &RdmaSection,
    storage: &StorageSection,
    opts: &GatherOptions,
    nvml: &Result<Box<dyn NvmlSource>, String>,
    nvlink_before: Option<&NvlinkCounters>,
) -> HealthSection {
    let gpus: Vec<HealthGpu> = cuda
        .devices
        .iter()
        .map(|d| HealthGpu {
            ordinal: d.ordinal,
            pci_bus_id: d.pci_bus_id.clone(),
            compute_capability: d.compute_capability,
            nearest_nic: rdma
                .affinity
                .iter()
                .find(|a| a.gpu == d.ordinal)
                .and_then(|a| a.best.clone()),
        })
        .collect();
    let nics: Vec<HealthNic> = rdma
        .devices
        .iter()
        .map(|d| HealthNic {
            name: d.name.clone(),
            pci_bus_id: d.pci_bus_id.clone(),
        })
        .collect();
    let env = |k: &str| std::env::var(k).ok();
    let mut h = gather_health(&HealthInputs {
        paths: &opts.system,
        env: &env,
        memlock: health::memlock_limits(),
        nvml: nvml.as_ref().map(|b| b.as_ref()).map_err(|e| e.clone()),
        nvlink_before,
        gpus: &gpus,
        nics: &nics,
        verbs_dmabuf: gpudirect_sys::ibverbs::lib()
            .ok()
            .map(|l| l.ibv_reg_dmabuf_mr.is_some()),
        cufile_version: storage.cufile_version.clone(),
    });
    if opts.measure {
        for l in h.pcie.links.iter_mut().filter(|l| l.kind == "gpu") {
            let (Some(cur), Some(max)) = (
                l.current_speed.as_deref().and_then(parse_link_speed),
                l.max_speed.as_deref().and_then(parse_link_speed),
            ) else {
                continue;
            };
            if cur < max
                && let Some(ordinal) = gpu_ordinal_of(&l.device)
            {
                speed_under_load(&opts.system.sysfs, l, ordinal);
            }
        }
    }
    h
}

/// Read GPU `ordinal`'s link speed again while host-to-device copies keep it busy (an idle GPU
/// lowers its link speed): the highest speed seen within 400 ms goes to `speed_under_load`.
fn speed_under_load(sysfs_root: &Path, link: &mut PcieLink, ordinal: usize) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    let spawned =
        crate::driver::ctx::spawn_thread("gpudirect-link-load", move || -> crate::Result<()> {
            let stream = Stream::new(&crate::cuda::context(ordinal)?)?;
            let host = vec![0x5au8; 64 << 20];
            let mut dev = DeviceBuffer::<u8>::alloc(stream.context(), host.len())?;
            while !stop2.load(Ordering::Relaxed) {
                crate::memory::copy_from_host(&stream, &host, &mut dev)?;
            }
            Ok(())
        });
    let worker = match spawned {
        Ok(w) => w,
        Err(e) => {
            link.error = Some(format!("reading the link under load: {e}"));
            return;
        }
    };
    let file = sysfs_root
        .join("bus/pci/devices")
        .join(&link.pci_bus_id)
        .join("current_link_speed");
    let deadline = Instant::now() + Duration::from_millis(400);
    let mut best: Option<(f64, String)> = None;
    while Instant::now() < deadline && !worker.is_finished() {
        std::thread::sleep(Duration::from_millis(20));
        if let Ok(s) = std::fs::read_to_string(&file) {
            let s = s.trim().to_string();
            if let Some(v) = parse_link_speed(&s)
                && best.as_ref().is_none_or(|b| v > b.0)
            {
                best = Some((v, s));
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    match worker.join() {
        Ok(Ok(())) => link.speed_under_load = best.map(|b| b.1),
        Ok(Err(e)) => link.error = Some(format!("reading the link under load: {e}")),
        Err(_) => link.error = Some("reading the link under load: the copy thread panicked".into()),
    }
    link.update_degraded();
}

fn cuda_section(libraries: &mut Vec<LibraryStatus>) -> CudaSection {
    let driver = crate::cuda::init();
    match gpudirect_sys::cuda::driver() {
        Ok(d) => {
            libraries.push(LibraryStatus::loaded(
                "libcuda",
                d.path(),
                Some(version_words(d.version())),
            ));
            let (devices, absent_reason) = match driver.and_then(|_| DeviceInfo::all()) {
                Ok(v) if v.is_empty() => (v, Some("the driver reports 0 CUDA devices".into())),
                Ok(v) => (v, None),
                Err(e) => (Vec::new(), Some(e.to_string())),
            };
            CudaSection {
                driver_version: Some(d.version()),
                bindings_version: crate::cuda::BINDINGS_VERSION,
                devices,
                absent_reason,
            }
        }
        Err(e) => {
            libraries.push(LibraryStatus::missing("libcuda", &e));
            CudaSection {
                driver_version: None,
                bindings_version: crate::cuda::BINDINGS_VERSION,
                devices: Vec::new(),
                absent_reason: Some(format!("no CUDA driver: {e}")),
            }
        }
    }
}

#[cfg(not(feature = "p2p"))]
fn p2p_section(_: &CudaSection, _: &GatherOptions) -> P2pSection {
    P2pSection::absent(not_built("p2p"))
}

#[cfg(feature = "p2p")]
fn p2p_section(cuda: &CudaSection, opts: &GatherOptions) -> P2pSection {
    let mut s = P2pSection {
        pairs: Vec::new(),
        nvml_unavailable: None,
        absent_reason: None,
        verdict: String::new(),
    };
    match cuda.devices.len() {
        0 => {
            s.absent_reason = Some(cuda.no_gpu());
            return s;
        }
        1 => {
            s.absent_reason = Some("one GPU: no pair to connect".into());
            return s;
        }
        _ => {}
    }
    let m = match LinkMatrix::probe() {
        Ok(m) => m,
        Err(e) => {
            s.absent_reason = Some(format!("link matrix: {e}"));
            return s;
        }
    };
    s.nvml_unavailable = m.nvml_unavailable.clone();
    let start = Instant::now();
    for l in m.links.iter().filter(|l| l.src != l.dst) {
        let (kind, links) = match &l.interconnect {
            Interconnect::Nvlink {
                links,
                via_switch: false,
            } => ("nvlink", Some(*links)),
            Interconnect::Nvlink {
                links,
                via_switch: true,
            } => ("nvswitch", Some(*links)),
            Interconnect::Pcie { .. } => ("pcie", None),
            _ => ("unknown", None),
        };
        let copy = if !opts.measure {
            None
        } else if start.elapsed() > opts.copy_budget {
            Some(CopyMeasurement {
                bytes: 0,
                gb_per_s: 0.0,
                path: "not_measured".into(),
                reason: Some("the probe's time budget for copies was spent".into()),
                verified: false,
            })
        } else {
            Some(
                guarded("the copy", || measure_copy(l.src, l.dst, opts.copy_bytes))
                    .and_then(|r| r.map_err(|e| e.to_string()))
                    .unwrap_or_else(|e| CopyMeasurement {
                        bytes: opts.copy_bytes as u64,
                        gb_per_s: 0.0,
                        path: "failed".into(),
                        reason: Some(e),
                        verified: false,
                    }),
            )
        };
        s.pairs.push(P2pPair {
            src: l.src,
            dst: l.dst,
            can_access: l.can_access,
            performance_rank: l.attributes.performance_rank,
            native_atomics: l.attributes.native_atomics,
            interconnect: kind.into(),
            nvlink_links: links,
            interconnect_detail: l.interconnect.to_string(),
            copy,
        });
    }
    s
}

/// One warm-up copy and one timed copy of `bytes` from GPU `a` to GPU `b`, verified.
#[cfg(feature = "p2p")]
fn measure_copy(a: usize, b: usize, bytes: usize) -> crate::Result<CopyMeasurement> {
    let words = bytes / 4;
    let copier = Copier::new(a, b, CopyOptions::default())?;
    let sa = Stream::new(&crate::cuda::context(a)?)?;
    let sb = Stream::new(&crate::cuda::context(b)?)?;
    let data: Vec<u32> = (0..words as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ (a * 31 + b) as u32)
        .collect();
    let src = DeviceBuffer::from_slice(&sa, &data)?;
    let dst = DeviceBuffer::<u32>::zeroed(sb.context(), words)?;
    let warm = copier.copy(src, dst)?;
    let (src, dst) = warm.into_parts();
    let done = copier.copy(src, dst)?;
    let verified = done.dst.to_vec(&sb)? == data;
    let (path, reason) = match &done.path {
        CopyPath::Staged { reason } | CopyPath::DriverStaged { reason } => {
            (done.path.name(), Some(reason.to_string()))
        }
        p => (p.name(), None),
    };
    Ok(CopyMeasurement {
        bytes: done.bytes as u64,
        gb_per_s: done.gb_per_s(),
        path: path.into(),
        reason,
        verified,
    })
}

#[cfg(not(feature = "storage"))]
fn storage_section(_: &CudaSection, opts: &GatherOptions) -> StorageSection {
    StorageSection {
        cufile_version: gpudirect_sys::cufile::lib()
            .ok()
            .and_then(|l| l.version().map(version_words)),
        nvidia_fs_version: nvidia_fs_version(&opts.system.sysfs),
        ..StorageSection::absent(not_built("storage"))
    }
}

#[cfg(feature = "storage")]
fn storage_section(cuda: &CudaSection, opts: &GatherOptions) -> StorageSection {
    let mut s = StorageSection {
        cufile_version: None,
        properties: None,
        mode: "unavailable".into(),
        mode_reason: String::new(),
        nvidia_fs_version: nvidia_fs_version(&opts.system.sysfs),
        read: None,
        absent_reason: None,
        verdict: String::new(),
    };
    match gpudirect_sys::cufile::lib() {
        Ok(l) => s.cufile_version = l.version().map(version_words),
        Err(_) => s.mode_reason = "libcufile is not loaded (see Libraries)".into(),
    }
    if cuda.devices.is_empty() {
        if s.mode_reason.is_empty() {
            s.mode_reason = "the cuFile driver needs a GPU".into();
        }
        s.absent_reason = Some(cuda.no_gpu());
        return s;
    }
    // Held through the read, so the Auto path's own open shares it.
    let mut _driver = None;
    if s.cufile_version.is_some() || s.mode_reason.is_empty() {
        match storage::Driver::open().and_then(|d| {
            let p = d.properties()?;
            _driver = Some(d);
            Ok(p)
        }) {
            Ok(p) => {
                s.mode = if p.has_nvidia_fs() {
                    "gds"
                } else {
                    "compatibility"
                }
                .into();
                s.mode_reason = if p.has_nvidia_fs() {
                    format!(
                        "nvidia-fs {}.{} is loaded",
                        p.nvfs_version.0, p.nvfs_version.1
                    )
                } else if p.allow_compat_mode {
                    "nvidia-fs is not loaded (driver reports nvfs 0.0); compatibility mode is allowed".into()
                } else {
                    "nvidia-fs is not loaded and compatibility mode is off".into()
                };
                s.properties = Some(CufileProperties {
                    nvfs_version: format!("{}.{}", p.nvfs_version.0, p.nvfs_version.1),
                    fs_support: p
                        .fs_support
                        .iter_names()
                        .map(|(n, _)| n.to_string())
                        .collect(),
                    allow_compat_mode: p.allow_compat_mode,
                    batch_io: p.batch_io_supported,
                    streams: p.streams_supported,
                    poll_mode: p.use_poll_mode,
                    max_direct_io_kib: p.max_direct_io_kib as u64,
                    max_device_pinned_mem_kib: p.max_device_pinned_mem_kib as u64,
                    max_batch_io_size: p.max_batch_io_size,
                });
            }
            Err(e) => s.mode_reason = format!("cuFileDriverOpen: {e}"),
        }
    }
    if !opts.measure {
        return s;
    }
    match quick_read(&opts.read_dir, opts.read_bytes) {
        Ok(r) => s.read = Some(r),
        Err(e) => s.absent_reason = Some(format!("quick read: {e}")),
    }
    s
}

#[cfg(feature = "storage")]
fn reason_words(r: &PathReason) -> String {
    match r {
        PathReason::Requested => "requested".into(),
        PathReason::CufileUnavailable(e) => format!("cuFile unavailable: {e}"),
        PathReason::RegistrationFailed { code, detail } => {
            format!("cuFile registration failed ({code}): {detail}")
        }
        PathReason::CompatModeSlower => "cuFile in compatibility mode is slower".into(),
        PathReason::PageCacheHot => "data in the page cache".into(),
        PathReason::GdsDirect => "GPUDirect Storage".into(),
    }
}

/// Write `bytes` to a temporary file in `dir`, read it to GPU 0 through `Mode::Auto` twice (the
/// second read is timed: page cache hot, set-up done), verify.
#[cfg(feature = "storage")]
fn quick_read(dir: &Path, bytes: usize) -> crate::Result<StorageRead> {
    let os = |call: &'static str| move |e| crate::Error::Os { call, source: e };
    std::fs::create_dir_all(dir).map_err(os("mkdir"))?;
    let path = dir.join(format!("gpudirect-probe-{}", std::process::id()));
    let data: Vec<u8> = (0..bytes)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3])
        .collect();
    std::fs::write(&path, &data).map_err(os("write"))?;
    let result = (|| {
        let stream = Stream::new(&crate::cuda::context(0)?)?;
        let f = storage::GdsFile::open(&path, &OpenOptions::read_only(), Mode::Auto)?;
        // A first, untimed read sets up what every later transfer reuses (cuFile's or the POSIX
        // path's pinned bounce buffers and threads); the second, into a fresh buffer, is timed.
        let mut warm = DeviceBuffer::<u8>::zeroed(stream.context(), bytes)?;
        f.read_to_device(&mut warm, 0, 0, bytes)?;
        drop(warm);
        let mut dst = DeviceBuffer::<u8>::zeroed(stream.context(), bytes)?;
        let t = Instant::now();
        let tr = f.read_to_device(&mut dst, 0, 0, bytes)?;
        let secs = t.elapsed().as_secs_f64();
        let verified = tr.bytes == bytes && dst.to_vec(&stream)? == data;
        Ok(StorageRead {
            file: path.display().to_string(),
            bytes: tr.bytes as u64,
            gb_per_s: if secs > 0.0 {
                tr.bytes as f64 / secs / 1e9
            } else {
                0.0
            },
            path: match tr.path.path {
                storage::IoPath::CuFile => "cufile",
                storage::IoPath::Posix => "posix",
            }
            .into(),
            reason: reason_words(&tr.path.reason),
            direct: tr.path.direct,
            verified,
        })
    })();
    let _ = std::fs::remove_file(&path);
    result
}

fn async_section(cuda: &CudaSection) -> AsyncSection {
    AsyncSection {
        gpus: cuda
            .devices
            .iter()
            .map(|d| GpuAsync {
                gpu: d.ordinal,
                stream_mem_ops_v2: d.stream_mem_ops,
                stream_mem_ops_64: d.stream_mem_ops_64,
                memory_pools: d.memory_pools,
                copy_engines: d.copy_engines,
                can_flush_remote_writes: d.can_flush_remote_writes,
                flush_rdma_writes_options: d.rdma_flush_writes_options,
            })
            .collect(),
        absent_reason: cuda.devices.is_empty().then(|| cuda.no_gpu()),
        verdict: String::new(),
    }
}

/// The nvidia-fs module's version (`<sysfs>/module/nvidia_fs/version`), when loaded.
fn nvidia_fs_version(sysfs: &Path) -> Option<String> {
    let dir = sysfs.join("module/nvidia_fs");
    if !dir.is_dir() {
        return None;
    }
    Some(
        std::fs::read_to_string(dir.join("version"))
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "loaded (version unknown)".into()),
    )
}

/// The version in a resolved library file name: `libibverbs.so.1.14.50.0` → `1.14.50.0`; `None`
/// for a bare soname (`libibverbs.so.1`), whose number is only the ABI major.
fn version_from_file_name(path: &str) -> Option<String> {
    let file = path.rsplit('/').next()?;
    let (_, v) = file.split_once(".so.")?;
    v.contains('.').then(|| v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_from_numbers_and_file_names() {
        assert_eq!(version_words(13000), "13.0");
        assert_eq!(version_words(12080), "12.8");
        assert_eq!(version_words(1150), "1.15");
        assert_eq!(
            version_from_file_name("/usr/lib/libibverbs.so.1.14.50.0").as_deref(),
            Some("1.14.50.0")
        );
        assert_eq!(version_from_file_name("libibverbs.so"), None);
        assert_eq!(version_from_file_name("/lib/libibverbs.so.1"), None);
    }

    /// Built without some path: the report still gathers, and says so for that path.
    #[cfg(not(all(feature = "p2p", feature = "rdma", feature = "storage")))]
    #[test]
    fn paths_not_built_are_reported_as_not_built() {
        let r = NodeReport::gather_with(&GatherOptions {
            measure: false,
            ..GatherOptions::default()
        });
        let said = |reason: &Option<String>, feature: &str| {
            let why = reason.as_deref().unwrap_or_default();
            assert!(
                why.contains("not built") && why.contains(feature),
                "{feature}: {why:?}"
            );
        };
        #[cfg(not(feature = "p2p"))]
        said(&r.p2p.absent_reason, "p2p");
        #[cfg(not(feature = "rdma"))]
        said(&r.rdma.absent_reason, "rdma");
        #[cfg(not(feature = "storage"))]
        {
            said(&r.storage.absent_reason, "storage");
            assert!(r.storage.read.is_none());
        }
        assert!(r.to_string().contains("not built"));
    }
}
