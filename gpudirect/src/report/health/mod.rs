//! The node's health: the checks operators otherwise run by hand when a GPUDirect path is slow or
//! will not start. Driver and kernel against what each path needs, the peer-memory and storage
//! modules, PCIe links, ACS and the IOMMU, NVLink, the locked-memory limit and the cuFile
//! configuration.
//!
//! Everything is read from sysfs, procfs, the kernel log and NVML through the roots in
//! [`SystemPaths`] and an [`NvmlSource`], so [`gather_health`] runs on fake trees in tests. The
//! PCIe/NUMA placement of GPUs and NICs it builds on is [`crate::topology`].

mod checks;
mod kernel;
mod limits;
mod model;
mod nvlink;
mod pcie;

pub use checks::{HealthInputs, gather_health};
pub use model::{
    BridgeAcs, CufileConfig, CufileValue, HealthGpu, HealthNic, HealthSection, IommuStatus,
    KernelInfo, Memlock, ModuleStatus, NvlinkErrors, NvlinkGpu, NvlinkHealth, NvlinkLink,
    PcieHealth, PcieLink, PciePath, Requirement, RequirementCheck, SystemPaths,
};
pub use nvlink::{
    NoNvml, NvlinkAnswer, NvlinkCounters, NvlinkReading, NvlinkRemote, NvmlSource, nvlink_health,
};

// For the rest of the report (health is a private module: these are not public API).
pub use checks::health_unavailable;
pub use limits::{human_bytes, memlock_limits, setting_problem};
pub use model::gpu_ordinal_of;
pub use nvlink::open_nvml;
pub use pcie::{domain_translates, parse_link_speed};
