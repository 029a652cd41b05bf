//! What this node offers each GPUDirect path, how its GPUs and NICs are wired, whether it is
//! healthy, and what to do about it: the report `cargo run --release --example probe` prints.
//!
//! [`NodeReport::gather`] never fails and never panics: every step is fallible and what is absent
//! is recorded with the reason. The report uses gpudirect's typed APIs ([`crate::p2p`],
//! [`crate::rdma`], [`crate::storage`], [`crate::memory`]), sysfs, procfs and NVML; it runs no
//! other program. The PCIe/NUMA placement of GPUs and NICs comes from [`crate::topology`]; the
//! health checks (driver and kernel, modules, PCIe links, ACS, IOMMU, NVLink, limits and
//! settings) run over [`SystemPaths`] and an [`NvmlSource`] ([`gather_health`]); the decision
//! rules are [`advise`]; each path's status for a node health check is [`path_statuses`] and
//! [`check_required`].
//!
//! # JSON schema (version 3)
//!
//! `--json` prints a [`NodeReport`]; every field is documented on its type, and
//! `docs/probe-schema.md` gives the whole tree. Top-level keys: `schema_version`, `measured`,
//! `libraries`, `cuda`, `p2p`, `rdma`, `storage`, `async`, `health`, `paths`, `advice`,
//! `settings`. Each path section carries a one-line `verdict` and an `absent_reason` (`null` when
//! the path is there). Optional values are `null` when unknown. [`SCHEMA_VERSION`] is bumped on
//! any incompatible change.

mod advice;
mod files;
mod gather;
mod health;
mod health_advice;
mod model;
mod paths;
#[cfg(feature = "rdma")]
mod ports;
mod render;
mod verbs;

pub use advice::{advise, settings_from_env};
pub use gather::GatherOptions;
pub use health::{
    BridgeAcs, CufileConfig, CufileValue, HealthGpu, HealthInputs, HealthNic, HealthSection,
    IommuStatus, KernelInfo, Memlock, ModuleStatus, NoNvml, NvlinkAnswer, NvlinkCounters,
    NvlinkErrors, NvlinkGpu, NvlinkHealth, NvlinkLink, NvlinkReading, NvlinkRemote, NvmlSource,
    PcieHealth, PcieLink, PciePath, Requirement, RequirementCheck, SystemPaths, gather_health,
    nvlink_health,
};
pub use model::{
    Advice, AsyncSection, CopyMeasurement, CudaSection, CufileProperties, DataPath, EnvSetting,
    GidSummary, GpuAsync, GpuNicAffinity, GpuRdmaReadiness, LibraryStatus, NicAffinity, NodeReport,
    P2pPair, P2pSection, PathState, PathStatus, PortSummary, RdmaSection, SCHEMA_VERSION,
    StorageRead, StorageSection, VerbsDeviceSummary,
};
pub use paths::{check_required, path_statuses};
pub use verbs::{best_nic, gpu_affinity};
