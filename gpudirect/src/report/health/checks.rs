//! Every health check run over one set of inputs ([`HealthInputs`]): the real system in the
//! probe, fake trees and fake NVML answers in tests.

use super::model::*;
use super::nvlink::{NvlinkCounters, NvmlSource};
use super::{kernel, limits, nvlink, pcie};

/// Everything [`gather_health`] reads, so tests can give their own.
pub struct HealthInputs<'a> {
    /// Where sysfs, procfs, the kernel log and the configuration files are.
    pub paths: &'a SystemPaths,
    /// The environment (`std::env::var` for the real one).
    pub env: &'a dyn Fn(&str) -> Option<String>,
    /// `getrlimit(RLIMIT_MEMLOCK)`: `(soft, hard)`, `None` meaning unlimited.
    pub memlock: Result<(Option<u64>, Option<u64>), String>,
    /// NVML, or why it is not usable.
    pub nvml: Result<&'a dyn NvmlSource, String>,
    /// NVLink error counters read before the probe's own measurements, to tell whether they grow
    /// meanwhile; `None` when nothing was measured.
    pub nvlink_before: Option<&'a NvlinkCounters>,
    /// The GPUs.
    pub gpus: &'a [HealthGpu],
    /// The verbs devices.
    pub nics: &'a [HealthNic],
    /// libibverbs has `ibv_reg_dmabuf_mr`; `None` when libibverbs did not load.
    pub verbs_dmabuf: Option<bool>,
    /// `cuFileGetVersion` as `major.minor`.
    pub cufile_version: Option<String>,
}

/// Run every health check over `i`. Never fails: what cannot be read is recorded with the reason.
pub fn gather_health(i: &HealthInputs) -> HealthSection {
    let p = i.paths;
    let mut kernel_info = kernel::kernel_info(&p.sysfs, &p.procfs, &p.boot);
    if kernel_info.nvidia_driver.is_none()
        && let Ok(n) = &i.nvml
    {
        kernel_info.nvidia_driver = n.driver_version();
    }
    let (log, kernel_log_unreadable) = match kernel::read_kernel_log(&p.kmsg) {
        Ok(l) => (Some(l), None),
        Err(e) => (None, Some(e)),
    };
    let modules = kernel::module_statuses(
        &p.sysfs,
        &p.procfs,
        &p.lib_modules,
        kernel_info.release.as_deref(),
        log.as_deref(),
    );
    let peer_memory_clients = kernel::peer_memory_clients(&p.sysfs);
    let requirements = kernel::requirements(&kernel::RequirementInputs {
        kernel: kernel_info.clone(),
        compute_capabilities: i.gpus.iter().map(|g| g.compute_capability).collect(),
        verbs_dmabuf: i.verbs_dmabuf,
        modules: modules.clone(),
        peer_memory: peer_memory_clients.clone(),
        cufile_version: i.cufile_version.clone(),
    });

    let mut links: Vec<PcieLink> = i
        .gpus
        .iter()
        .map(|g| {
            pcie::read_link(
                &p.sysfs,
                &format!("GPU {}", g.ordinal),
                "gpu",
                &g.pci_bus_id,
            )
        })
        .collect();
    links.extend(i.nics.iter().filter_map(|n| {
        Some(pcie::read_link(
            &p.sysfs,
            &n.name,
            "nic",
            n.pci_bus_id.as_deref()?,
        ))
    }));
    let mut paths = Vec::new();
    for g in i.gpus {
        let from = format!("GPU {}", g.ordinal);
        if let Some(nic) = &g.nearest_nic
            && let Some(bus) = i
                .nics
                .iter()
                .find(|n| &n.name == nic)
                .and_then(|n| n.pci_bus_id.as_deref())
        {
            paths.push(pcie::pcie_path(
                &p.sysfs,
                (&from, &g.pci_bus_id),
                (nic, bus),
                "gpu-nic",
            ));
        }
    }
    for (k, a) in i.gpus.iter().enumerate() {
        for b in &i.gpus[k + 1..] {
            paths.push(pcie::pcie_path(
                &p.sysfs,
                (&format!("GPU {}", a.ordinal), &a.pci_bus_id),
                (&format!("GPU {}", b.ordinal), &b.pci_bus_id),
                "gpu-gpu",
            ));
        }
    }
    let gpu_ids: Vec<(usize, String)> = i
        .gpus
        .iter()
        .map(|g| (g.ordinal, g.pci_bus_id.clone()))
        .collect();
    let nvml = i.nvml.as_ref().map(|n| *n).map_err(|e| e.clone());
    let (cufile_path, cufile_source) = limits::cufile_config_path(i.env, &p.cufile_default);
    HealthSection {
        kernel: kernel_info,
        requirements,
        modules,
        peer_memory_clients,
        kernel_log_unreadable,
        pcie: PcieHealth {
            links,
            paths,
            iommu: pcie::iommu_status(&p.sysfs, &p.procfs),
        },
        nvlink: nvlink::nvlink_health(&gpu_ids, nvml, i.nvlink_before),
        memlock: limits::memlock(i.memlock.clone(), limits::has_cap_ipc_lock(&p.procfs)),
        cufile_config: limits::cufile_config(&cufile_path, &cufile_source),
    }
}

/// The health section when gathering it failed as a whole (`why`).
pub fn health_unavailable(why: &str) -> HealthSection {
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
