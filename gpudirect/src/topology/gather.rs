//! Gathering the report through gpudirect's typed APIs; each step fallible and recorded.

use super::advice::{async_verdict, p2p_verdict, rdma_verdict, storage_verdict};
use super::sysfs::{self, Affinity};
use super::*;
use crate::cuda::Stream;
use crate::memory::DeviceBuffer;
use crate::p2p::{Copier, CopyOptions, CopyPath, Interconnect, LinkMatrix};
use crate::rdma::{Context, DeviceList, GidType, LinkLayer, PortState};
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

pub(super) fn gather(opts: &GatherOptions) -> NodeReport {
    let mut libraries = Vec::new();
    let cuda =
        guarded("the GPU query", || cuda_section(&mut libraries)).unwrap_or_else(|e| CudaSection {
            driver_version: None,
            bindings_version: crate::cuda::BINDINGS_VERSION,
            devices: Vec::new(),
            absent_reason: Some(e),
        });
    libraries.push(match gpudirect_sys::cufile::lib() {
        Ok(l) => LibraryStatus::loaded(
            "libcufile",
            l.path(),
            l.version().map(format_cufile_version),
        ),
        Err(e) => LibraryStatus::missing("libcufile", e),
    });
    libraries.push(match gpudirect_sys::ibverbs::lib() {
        Ok(l) => LibraryStatus::loaded(
            "libibverbs",
            l.path(),
            sysfs::version_from_file_name(l.path()),
        ),
        Err(e) => LibraryStatus::missing("libibverbs", e),
    });
    libraries.push(match gpudirect_sys::rdmacm::lib() {
        Ok(l) => LibraryStatus::loaded(
            "librdmacm",
            l.path(),
            sysfs::version_from_file_name(l.path()),
        ),
        Err(e) => LibraryStatus::missing("librdmacm", e),
    });

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
                health::NvlinkCounters::read(n.as_ref(), &buses)
            })
            .ok()
        }
        _ => None,
    };
    let mut p2p =
        guarded("the P2P probe", || p2p_section(&cuda, opts)).unwrap_or_else(|e| P2pSection {
            pairs: Vec::new(),
            nvml_unavailable: None,
            absent_reason: Some(e),
            verdict: String::new(),
        });
    p2p.verdict = p2p_verdict(&p2p);
    let mut rdma =
        guarded("the RDMA probe", || rdma_section(&cuda, opts)).unwrap_or_else(|e| RdmaSection {
            devices: Vec::new(),
            gpus: Vec::new(),
            affinity: Vec::new(),
            absent_reason: Some(e),
            verdict: String::new(),
        });
    rdma.verdict = rdma_verdict(&rdma, &cuda);
    let mut storage =
        guarded("the storage probe", || storage_section(&cuda, opts)).unwrap_or_else(|e| {
            StorageSection {
                cufile_version: None,
                properties: None,
                mode: "unavailable".into(),
                mode_reason: e.clone(),
                nvidia_fs_version: None,
                read: None,
                absent_reason: Some(e),
                verdict: String::new(),
            }
        });
    storage.verdict = storage_verdict(&storage);
    let mut async_ = async_section(&cuda);
    async_.verdict = async_verdict(&async_);
    let health = guarded("the health checks", || {
        health_section(&cuda, &rdma, &storage, opts, &nvml, nvlink_before.as_ref())
    })
    .unwrap_or_else(|e| empty_health(&e));
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

/// The health section when gathering it failed as a whole (`why`).
fn empty_health(why: &str) -> HealthSection {
    use health::*;
    HealthSection {
        kernel: KernelInfo::default(),
        requirements: Vec::new(),
        modules: Vec::new(),
        peer_memory_clients: None,
        kernel_log_unreadable: Some(why.into()),
        pcie: PcieHealth {
            links: Vec::new(),
            paths: Vec::new(),
            iommu: IommuStatus {
                enabled: None,
                groups: 0,
                units: Vec::new(),
                cmdline: Vec::new(),
            },
        },
        nvlink: NvlinkHealth {
            gpus: Vec::new(),
            absent_reason: Some(why.into()),
        },
        memlock: limits::memlock(Err(why.into()), None),
        cufile_config: CufileConfig {
            path: String::new(),
            source: String::new(),
            exists: false,
            values: Vec::new(),
            error: Some(why.into()),
        },
    }
}

fn health_section(
    cuda: &CudaSection,
    rdma: &RdmaSection,
    storage: &StorageSection,
    opts: &GatherOptions,
    nvml: &Result<Box<dyn health::NvmlSource>, String>,
    nvlink_before: Option<&health::NvlinkCounters>,
) -> HealthSection {
    use health::{HealthGpu, HealthInputs, HealthNic};
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
    let mut h = health::gather_health(&HealthInputs {
        paths: &opts.system,
        env: &env,
        memlock: health::limits::memlock_limits(),
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
                l.current_speed
                    .as_deref()
                    .and_then(health::pcie::parse_link_speed),
                l.max_speed
                    .as_deref()
                    .and_then(health::pcie::parse_link_speed),
            ) else {
                continue;
            };
            if cur < max
                && let Some(ordinal) = health::gpu_ordinal_of(&l.device)
            {
                speed_under_load(&opts.system.sysfs, l, ordinal);
            }
        }
    }
    h
}

/// Read GPU `ordinal`'s link speed again while host-to-device copies keep it busy (an idle GPU
/// lowers its link speed): the highest speed seen within 400 ms goes to `speed_under_load`.
fn speed_under_load(sysfs_root: &Path, link: &mut health::PcieLink, ordinal: usize) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    let worker = std::thread::spawn(move || -> crate::Result<()> {
        let stream = Stream::new(&crate::cuda::context(ordinal)?)?;
        let host = vec![0x5au8; 64 << 20];
        let mut dev = DeviceBuffer::<u8>::alloc(stream.context(), host.len())?;
        while !stop2.load(Ordering::Relaxed) {
            crate::memory::copy_from_host(&stream, &host, &mut dev)?;
        }
        Ok(())
    });
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
            if let Some(v) = health::pcie::parse_link_speed(&s)
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
    health::pcie::update_degraded(link);
}

/// `1150` → `1.15`.
fn format_cufile_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

fn cuda_section(libraries: &mut Vec<LibraryStatus>) -> CudaSection {
    let driver = crate::cuda::init();
    match gpudirect_sys::cuda::driver() {
        Ok(d) => {
            libraries.push(LibraryStatus::loaded(
                "libcuda",
                d.path(),
                Some(format_cuda_version(d.version())),
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

/// Why there is no GPU, short (the full error is in the GPUs section).
fn no_gpu(cuda: &CudaSection) -> String {
    match (&cuda.driver_version, &cuda.absent_reason) {
        (None, _) => "no GPU: no CUDA driver (libcuda is not loaded)".into(),
        (Some(_), Some(r)) => format!("no GPU: {r}"),
        (Some(_), None) => "no GPU visible".into(),
    }
}

fn p2p_section(cuda: &CudaSection, opts: &GatherOptions) -> P2pSection {
    let mut s = P2pSection {
        pairs: Vec::new(),
        nvml_unavailable: None,
        absent_reason: None,
        verdict: String::new(),
    };
    match cuda.devices.len() {
        0 => {
            s.absent_reason = Some(no_gpu(cuda));
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
            (done.path.name(), Some(reason.clone()))
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

fn port_state(s: PortState) -> String {
    match s {
        PortState::Nop => "NOP".into(),
        PortState::Down => "DOWN".into(),
        PortState::Init => "INIT".into(),
        PortState::Armed => "ARMED".into(),
        PortState::Active => "ACTIVE".into(),
        PortState::ActiveDefer => "ACTIVE_DEFER".into(),
        PortState::Other(v) => format!("state {v}"),
    }
}

fn gid_type(t: GidType) -> &'static str {
    match t {
        GidType::Ib => "IB",
        GidType::RoceV1 => "RoCE v1",
        GidType::RoceV2 => "RoCE v2",
        GidType::Unknown => "unknown",
    }
}

fn verbs_device(
    ctx: &Context,
    sysfs_root: &Path,
) -> crate::Result<(Option<String>, Vec<PortSummary>)> {
    let attr = ctx.query_device()?;
    let mut ports = Vec::new();
    for port in 1..=attr.phys_port_cnt {
        let mut p = PortSummary {
            port,
            state: "unknown".into(),
            link_layer: "unknown".into(),
            active_mtu: 0,
            max_mtu: 0,
            speed_gbps: None,
            speed: None,
            gids: Vec::new(),
            error: None,
        };
        match ctx.query_port(port) {
            Ok(a) => {
                p.state = port_state(a.state);
                p.link_layer = match a.link_layer {
                    LinkLayer::Ethernet => "Ethernet",
                    _ => "InfiniBand",
                }
                .into();
                p.active_mtu = a.active_mtu.bytes();
                p.max_mtu = a.max_mtu.bytes();
                let coded = sysfs::port_speed(a.active_width, a.active_speed);
                p.speed_gbps = coded.as_ref().map(|c| c.0);
                let rate = sysfs::port_rate(sysfs_root, ctx.name(), port);
                // Newer speeds (NDR, XDR) have codes this crate does not read: use sysfs' figure.
                if p.speed_gbps.is_none() {
                    p.speed_gbps = rate
                        .as_deref()
                        .and_then(|r| r.split_whitespace().next())
                        .and_then(|n| n.parse().ok());
                }
                p.speed = rate.or(coded.map(|c| c.1));
                match ctx.gid_table(port) {
                    Ok(t) => {
                        p.gids = t
                            .iter()
                            .map(|e| GidSummary {
                                index: e.index,
                                gid: e.gid.to_string(),
                                gid_type: gid_type(e.gid_type).into(),
                            })
                            .collect()
                    }
                    Err(e) => p.error = Some(format!("GID table: {e}")),
                }
            }
            Err(e) => p.error = Some(e.to_string()),
        }
        ports.push(p);
    }
    Ok((Some(attr.fw_ver), ports))
}

fn rdma_section(cuda: &CudaSection, opts: &GatherOptions) -> RdmaSection {
    let mut s = RdmaSection {
        devices: Vec::new(),
        gpus: Vec::new(),
        affinity: Vec::new(),
        absent_reason: None,
        verdict: String::new(),
    };
    let root = opts.system.sysfs.as_path();
    match DeviceList::get() {
        Ok(list) if list.is_empty() => {
            s.absent_reason = Some(
                "no verbs device: ibv_get_device_list returned none (no RDMA NIC, rdma_rxe or siw link)"
                    .into(),
            )
        }
        Ok(list) => {
            for dev in list.iter() {
                let name = dev.name();
                let loc = sysfs::nic_location(root, &name);
                let mut d = VerbsDeviceSummary {
                    pci_bus_id: sysfs::nic_pci_address(root, &name),
                    numa_node: loc.and_then(|l| l.numa_node),
                    name,
                    fw_ver: None,
                    ports: Vec::new(),
                    error: None,
                };
                match Context::open(&dev).and_then(|c| verbs_device(&c, root)) {
                    Ok((fw, ports)) => {
                        d.fw_ver = fw;
                        d.ports = ports;
                    }
                    Err(e) => d.error = Some(e.to_string()),
                }
                s.devices.push(d);
            }
        }
        Err(e) => {
            s.absent_reason = Some(match e {
                // Displays as "no verbs device: <why>" already.
                e @ crate::Error::NoDevice { .. } => e.to_string(),
                e if !root.join("class/infiniband").is_dir() => format!(
                    "no verbs device: {e} (/sys/class/infiniband is absent: no RDMA driver is loaded in this kernel)"
                ),
                e => format!("no verbs device: {e}"),
            })
        }
    }
    let peermem = gpudirect_sys::peermem::peermem_module().map(|m| match m.version {
        Some(v) => format!("{} {v}", m.name),
        None => m.name,
    });
    let verbs_dmabuf = gpudirect_sys::ibverbs::lib()
        .map(|l| l.ibv_reg_dmabuf_mr.is_some())
        .unwrap_or(false);
    for g in &cuda.devices {
        let registration = if !g.gpudirect_rdma {
            "none"
        } else if g.dma_buf && verbs_dmabuf {
            "dma-buf"
        } else if peermem.is_some() {
            "nvidia-peermem"
        } else {
            "none"
        };
        s.gpus.push(GpuRdmaReadiness {
            gpu: g.ordinal,
            gpudirect_rdma: g.gpudirect_rdma,
            dma_buf: g.dma_buf,
            verbs_dmabuf,
            peermem: peermem.clone(),
            vmm_rdma: g.gpudirect_rdma_vmm,
            registration: registration.into(),
        });
        s.affinity
            .push(gpu_affinity(root, g.ordinal, &g.pci_bus_id, &s.devices));
    }
    s
}

/// Place every NIC relative to GPU `gpu` (PCI address `bus_id`) under sysfs root `root`, and
/// pick the one to use ([`best_nic`]).
pub fn gpu_affinity(
    root: &Path,
    gpu: usize,
    bus_id: &str,
    nics: &[VerbsDeviceSummary],
) -> GpuNicAffinity {
    let gloc = sysfs::pci_location(root, bus_id);
    let placed: Vec<NicPlacement> = nics
        .iter()
        .map(|n| NicPlacement {
            nic: n.name.clone(),
            affinity: match (&gloc, sysfs::nic_location(root, &n.name)) {
                (Some(g), Some(l)) => sysfs::classify(g, &l),
                _ => Affinity::Unknown,
            },
            active: n.ports.iter().any(|p| p.state == "ACTIVE"),
        })
        .collect();
    GpuNicAffinity {
        gpu,
        gpu_pci_bus_id: bus_id.to_string(),
        best: best_nic(&placed),
        nics: placed,
    }
}

/// The closest NIC with an active port, else the closest; ties go to the first listed.
pub fn best_nic(nics: &[NicPlacement]) -> Option<String> {
    nics.iter()
        .min_by_key(|n| (!n.active, n.affinity))
        .map(|n| n.nic.clone())
}

fn storage_section(cuda: &CudaSection, opts: &GatherOptions) -> StorageSection {
    let mut s = StorageSection {
        cufile_version: None,
        properties: None,
        mode: "unavailable".into(),
        mode_reason: String::new(),
        nvidia_fs_version: sysfs::nvidia_fs_version(&opts.system.sysfs),
        read: None,
        absent_reason: None,
        verdict: String::new(),
    };
    match gpudirect_sys::cufile::lib() {
        Ok(l) => s.cufile_version = l.version().map(format_cufile_version),
        Err(_) => s.mode_reason = "libcufile is not loaded (see Libraries)".into(),
    }
    if cuda.devices.is_empty() {
        if s.mode_reason.is_empty() {
            s.mode_reason = "the cuFile driver needs a GPU".into();
        }
        s.absent_reason = Some(no_gpu(cuda));
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
        absent_reason: cuda.devices.is_empty().then(|| no_gpu(cuda)),
        verdict: String::new(),
    }
}
