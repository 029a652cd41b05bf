//! What the health checks find, as data: the kernel and driver, each path's requirements, the
//! modules, PCIe links and paths, the IOMMU, NVLink, the locked-memory limit and the cuFile
//! configuration; and where the system is read from.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Where the report reads the system from: the real paths by default, a fake tree in tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SystemPaths {
    /// sysfs (`/sys`).
    pub sysfs: PathBuf,
    /// procfs (`/proc`).
    pub procfs: PathBuf,
    /// The kernel log device (`/dev/kmsg`).
    pub kmsg: PathBuf,
    /// Installed kernel modules (`/lib/modules`).
    pub lib_modules: PathBuf,
    /// Kernel configurations (`/boot`).
    pub boot: PathBuf,
    /// cuFile's default configuration (`/etc/cufile.json`).
    pub cufile_default: PathBuf,
}

impl Default for SystemPaths {
    fn default() -> Self {
        SystemPaths::under(Path::new("/"))
    }
}

impl SystemPaths {
    /// Every path below `root` (`/` for the real system).
    pub fn under(root: &Path) -> SystemPaths {
        SystemPaths {
            sysfs: root.join("sys"),
            procfs: root.join("proc"),
            kmsg: root.join("dev/kmsg"),
            lib_modules: root.join("lib/modules"),
            boot: root.join("boot"),
            cufile_default: root.join("etc/cufile.json"),
        }
    }
}

/// The running kernel and NVIDIA driver.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelInfo {
    /// `uname -r`'s release (`/proc/sys/kernel/osrelease`).
    pub release: Option<String>,
    /// The NVIDIA kernel driver's version (`/sys/module/nvidia/version`), when loaded.
    pub nvidia_driver: Option<String>,
    /// `open` (NVIDIA's open kernel modules) or `proprietary`, from `/proc/driver/nvidia/version`.
    pub nvidia_kernel_module: Option<String>,
    /// The kernel was built with PCI P2PDMA (`null`: cannot tell).
    pub pci_p2pdma: Option<bool>,
}

/// One condition of a path's requirements.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequirementCheck {
    /// What is checked: `Linux`, `NVIDIA driver`, `GPU`, `libibverbs`, `RDMA core`, `module`, `cuFile`.
    pub item: String,
    /// What the path needs, in words.
    pub needs: String,
    /// What this node has.
    pub found: String,
    /// Met; `null` when it cannot be told.
    pub met: Option<bool>,
}

/// What one way of running a GPUDirect path needs, and whether this node has it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Requirement {
    /// `GPUDirect RDMA by dma-buf`, `GPUDirect RDMA by nvidia-peermem`, `GPUDirect Storage by
    /// nvidia-fs`, `GPUDirect Storage by PCI P2PDMA`.
    pub path: String,
    /// Every check met; `false` when one is not; `null` when one cannot be told.
    pub met: Option<bool>,
    /// The conditions.
    pub checks: Vec<RequirementCheck>,
}

/// One kernel module.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleStatus {
    /// `nvidia`, `nvidia_peermem`, `nv_peer_mem`, `nvidia_fs`, `ib_core`, `ib_uverbs`.
    pub name: String,
    /// Loaded (or built into the kernel).
    pub loaded: bool,
    /// Its version (`/sys/module/<name>/version`), when loaded and published.
    pub version: Option<String>,
    /// `Live`, `Loading`, `Unloading` (`/proc/modules`), or `built in`.
    pub state: Option<String>,
    /// Installed for the running kernel (listed in `modules.dep`); `null` when unknown.
    pub installed: Option<bool>,
    /// Kernel log lines reporting its failure, latest last (empty when the log is not readable).
    pub load_errors: Vec<String>,
}

/// One device's PCIe link.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PcieLink {
    /// `GPU 0` or the verbs device name.
    pub device: String,
    /// `gpu` or `nic`.
    pub kind: String,
    /// PCI address, sysfs' form.
    pub pci_bus_id: String,
    /// `current_link_speed` (`16.0 GT/s PCIe`).
    pub current_speed: Option<String>,
    /// `max_link_speed`.
    pub max_speed: Option<String>,
    /// `current_link_width` (lanes).
    pub current_width: Option<u32>,
    /// `max_link_width` (lanes).
    pub max_width: Option<u32>,
    /// GPUs lower their link speed when idle: the speed read again while copies to the GPU ran
    /// (only when idle speed was below the maximum and measurements were requested).
    pub speed_under_load: Option<String>,
    /// Link speed below the maximum: for a NIC as read, for a GPU only as read under load (an
    /// idle GPU's lower speed is power saving, not a fault).
    pub speed_degraded: bool,
    /// Fewer lanes than the maximum.
    pub width_degraded: bool,
    /// The device's IOMMU group.
    pub iommu_group: Option<u32>,
    /// The group's domain type: `identity` (passthrough), `DMA` or `DMA-FQ` (translated),
    /// `unmanaged` (assigned to a VM or VFIO), `blocked`.
    pub iommu_domain: Option<String>,
    /// Why the link could not be read.
    pub error: Option<String>,
}

impl PcieLink {
    /// The speed the link was seen at: under load when read so, else as read.
    pub(crate) fn speed_seen(&self) -> Option<&str> {
        self.speed_under_load
            .as_deref()
            .or(self.current_speed.as_deref())
    }
}

/// ACS on one bridge.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BridgeAcs {
    /// The bridge (a switch's downstream port or a root port).
    pub pci_bus_id: String,
    /// The ACS control register, when read.
    pub control: Option<u16>,
    /// Control bits set, lspci's names (`SrcValid`, `ReqRedir`, `CmpltRedir`, `EgressCtrl`, ...).
    pub flags: Vec<String>,
    /// P2P requests or completions are redirected up to the root complex (`ReqRedir`,
    /// `CmpltRedir` or `EgressCtrl` set); `null` when unknown.
    pub redirects: Option<bool>,
    /// Why unknown (`unknown (needs root ...)`), or `no ACS capability`.
    pub note: Option<String>,
}

/// The PCIe path between two devices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciePath {
    /// `GPU 0`.
    pub from: String,
    /// `GPU 1` or a verbs device.
    pub to: String,
    /// `gpu-nic` (a GPU and its nearest NIC) or `gpu-gpu`.
    pub kind: String,
    /// Where the two paths meet: `PCIe switch (bridge ...)`, `root port ...`, `root complex ...`,
    /// or two host bridges.
    pub meets_at: String,
    /// ACS on each bridge below the meeting point.
    pub bridges: Vec<BridgeAcs>,
    /// Traffic that could turn in a shared switch is sent up to the root complex by ACS; `false`
    /// when the paths meet only at the root complex; `null` when some bridge is unknown.
    pub acs_redirects: Option<bool>,
    /// Why there is no path (sysfs lacks a device).
    pub error: Option<String>,
}

/// The IOMMU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IommuStatus {
    /// IOMMU groups or units exist.
    pub enabled: Option<bool>,
    /// Number of IOMMU groups.
    pub groups: u32,
    /// Registered IOMMU units (`/sys/class/iommu`: `dmar0`, `ivhd0`, ...).
    pub units: Vec<String>,
    /// IOMMU-related kernel parameters (`intel_iommu=on`, `iommu=pt`, ...).
    pub cmdline: Vec<String>,
}

/// PCIe health.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PcieHealth {
    /// Every GPU's and NIC's link.
    pub links: Vec<PcieLink>,
    /// Each GPU to its nearest NIC, and every GPU pair.
    pub paths: Vec<PciePath>,
    /// The IOMMU.
    pub iommu: IommuStatus,
}

/// NVLink error counters (`nvmlDeviceGetNvLinkErrorCounter`); `null` where NVML does not count.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvlinkErrors {
    /// Data link transmit replays.
    pub replay: Option<u64>,
    /// Data link recoveries.
    pub recovery: Option<u64>,
    /// Flow-control digit CRC errors.
    pub crc_flit: Option<u64>,
    /// Data CRC errors.
    pub crc_data: Option<u64>,
}

/// One NVLink.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvlinkLink {
    /// Link index.
    pub link: u32,
    /// `up`, `down`, or `unknown (why)`.
    pub state: String,
    /// NVLink version.
    pub version: Option<u32>,
    /// Speed in 10⁶ bytes per second; `null` where NVML does not say.
    pub speed_mbps: Option<u32>,
    /// The PCI address of the device at the other end (a GPU or an NVSwitch); `null` where NVML
    /// does not say or answers its all-ones placeholder (`ffff:ff:ff.0`).
    pub remote_pci_bus_id: Option<String>,
    /// What is at the other end: `GPU n` (a GPU of this node, matched by PCI address), `GPU` (one
    /// that is not), `NVSwitch` or `IBM NPU` (`nvmlDeviceGetNvLinkRemoteDeviceType`); `null` where
    /// NVML does not say.
    pub remote_device: Option<String>,
    /// Error counters, read after the probe's own measurements.
    pub errors: NvlinkErrors,
    /// The same counters read before the probe's measurements (its P2P copies); `null` when the
    /// probe measured nothing.
    pub errors_before: Option<NvlinkErrors>,
    /// Down while another link of the GPU is up.
    pub down: bool,
    /// The replay or recovery counter is above zero: the link retransmits or retrains. CRC
    /// counts alone do not set it: a healthy link counts CRC errors and corrects them.
    pub counting_errors: bool,
    /// Some counter grew during the probe's measurements (`errors_before` to `errors`); `null`
    /// when not measured.
    pub errors_grew: Option<bool>,
}

impl NvlinkLink {
    /// Whether the link is degraded: down, counting replay or recovery errors, or with a counter
    /// that grew during the probe.
    pub fn degraded(&self) -> bool {
        self.down || self.counting_errors || self.errors_grew == Some(true)
    }
}

impl NvlinkErrors {
    /// The sum of the counters NVML gave.
    pub fn total(&self) -> u64 {
        [self.replay, self.recovery, self.crc_flit, self.crc_data]
            .iter()
            .flatten()
            .fold(0u64, |a, b| a.saturating_add(*b))
    }
}

/// One GPU's NVLinks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvlinkGpu {
    /// CUDA ordinal.
    pub gpu: usize,
    /// PCI address.
    pub pci_bus_id: String,
    /// NVLinks the GPU has (`NVML_FI_DEV_NVLINK_LINK_COUNT`).
    pub link_count: Option<u32>,
    /// Links up.
    pub active_links: u32,
    /// Each link.
    pub links: Vec<NvlinkLink>,
    /// Why NVML could not answer for this GPU.
    pub error: Option<String>,
}

impl NvlinkGpu {
    /// The indexes of the links `keep` accepts, in order.
    pub(crate) fn links_where(&self, keep: impl Fn(&NvlinkLink) -> bool) -> Vec<String> {
        self.links
            .iter()
            .filter(|l| keep(l))
            .map(|l| l.link.to_string())
            .collect()
    }
}

/// NVLink health.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvlinkHealth {
    /// Per GPU.
    pub gpus: Vec<NvlinkGpu>,
    /// Why there is nothing (no GPU, NVML not usable).
    pub absent_reason: Option<String>,
}

/// The locked-memory limit (`RLIMIT_MEMLOCK`, `ulimit -l`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Memlock {
    /// The soft limit in bytes (`null` when unlimited or unknown).
    pub soft_bytes: Option<u64>,
    /// The soft limit is unlimited.
    pub soft_unlimited: bool,
    /// The hard limit in bytes (`null` when unlimited or unknown).
    pub hard_bytes: Option<u64>,
    /// The hard limit is unlimited.
    pub hard_unlimited: bool,
    /// The process holds `CAP_IPC_LOCK`, which lifts the limit.
    pub cap_ipc_lock: Option<bool>,
    /// What it allows to be registered, in words.
    pub allows: String,
    /// Finite, below 1 GiB, and not lifted by `CAP_IPC_LOCK`.
    pub low: bool,
    /// Why it could not be read.
    pub error: Option<String>,
}

/// One value of the cuFile configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CufileValue {
    /// Dotted key (`properties.max_direct_io_size_kb`).
    pub key: String,
    /// The JSON value as written.
    pub value: String,
}

/// The cuFile configuration file in use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CufileConfig {
    /// Its path.
    pub path: String,
    /// `CUFILE_ENV_PATH_JSON` or `default`.
    pub source: String,
    /// The file exists (without it cuFile uses built-in defaults).
    pub exists: bool,
    /// Its I/O sizes and path switches, those present.
    pub values: Vec<CufileValue>,
    /// Why it could not be read or parsed.
    pub error: Option<String>,
}

/// The health checks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthSection {
    /// Kernel and driver.
    pub kernel: KernelInfo,
    /// Each path's requirements against this node.
    pub requirements: Vec<Requirement>,
    /// The kernel modules GPUDirect uses.
    pub modules: Vec<ModuleStatus>,
    /// Peer-memory clients registered with the RDMA core (`/sys/kernel/mm/memory_peers`); `null`
    /// when the RDMA core lacks the peer-memory API.
    pub peer_memory_clients: Option<Vec<String>>,
    /// Why the kernel log could not be read (`null`: it was, and `load_errors` are complete).
    pub kernel_log_unreadable: Option<String>,
    /// PCIe links, ACS, IOMMU.
    pub pcie: PcieHealth,
    /// NVLink.
    pub nvlink: NvlinkHealth,
    /// The locked-memory limit.
    pub memlock: Memlock,
    /// The cuFile configuration.
    pub cufile_config: CufileConfig,
}

/// A GPU as the health checks see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthGpu {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// PCI address.
    pub pci_bus_id: String,
    /// Compute capability.
    pub compute_capability: (i32, i32),
    /// The NIC it should use, when there is one.
    pub nearest_nic: Option<String>,
}

/// A NIC as the health checks see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthNic {
    /// Verbs device name.
    pub name: String,
    /// PCI address; `None` for software devices.
    pub pci_bus_id: Option<String>,
}

/// `GPU 3` → 3: the ordinal in a device name the health section gives a GPU.
pub fn gpu_ordinal_of(name: &str) -> Option<usize> {
    name.strip_prefix("GPU ")?.parse().ok()
}
