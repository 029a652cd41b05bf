//! The node report's data: every section, the advice, the settings and each data path's
//! status, with the small helpers several parts of the report share.

use super::health::HealthSection;
use crate::cuda::DeviceInfo;
use crate::topology::Affinity;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The JSON schema version of [`NodeReport`]; bumped on any incompatible change.
pub const SCHEMA_VERSION: u32 = 3;

/// A run-time library and whether it loaded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LibraryStatus {
    /// Short name: `libcuda`, `libcufile`, `libibverbs`, `librdmacm`.
    pub name: String,
    /// Whether it loaded.
    pub loaded: bool,
    /// The file it loaded from.
    pub path: Option<String>,
    /// Its version, where the library reports one (or its file name carries one).
    pub version: Option<String>,
    /// Why it did not load (names the files tried).
    pub error: Option<String>,
}

impl LibraryStatus {
    /// A library that loaded.
    pub fn loaded(name: &str, path: &str, version: Option<String>) -> Self {
        LibraryStatus {
            name: name.into(),
            loaded: true,
            path: Some(path.into()),
            version,
            error: None,
        }
    }

    /// A library that did not load, and why.
    pub fn missing(name: &str, error: impl std::fmt::Display) -> Self {
        LibraryStatus {
            name: name.into(),
            loaded: false,
            path: None,
            version: None,
            error: Some(error.to_string()),
        }
    }
}

/// The GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaSection {
    /// `cuDriverGetVersion` (1000*major + 10*minor), when libcuda loaded.
    pub driver_version: Option<i32>,
    /// The CUDA version gpudirect's bindings were built for.
    pub bindings_version: i32,
    /// Every visible GPU.
    pub devices: Vec<DeviceInfo>,
    /// Why there are no devices, when there are none.
    pub absent_reason: Option<String>,
}

impl CudaSection {
    /// Why there is no GPU, short (the full error is in the GPUs section).
    pub(crate) fn no_gpu(&self) -> String {
        match (&self.driver_version, &self.absent_reason) {
            (None, _) => "no GPU: no CUDA driver (libcuda is not loaded)".into(),
            (Some(_), Some(r)) => format!("no GPU: {r}"),
            (Some(_), None) => "no GPU visible".into(),
        }
    }
}

/// One ordered GPU pair of the link matrix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct P2pPair {
    /// The accessing (source) GPU.
    pub src: usize,
    /// The GPU whose memory is accessed (destination).
    pub dst: usize,
    /// `cuDeviceCanAccessPeer`.
    pub can_access: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK` (0 is best).
    pub performance_rank: i32,
    /// Native atomics over the link.
    pub native_atomics: bool,
    /// `nvlink`, `nvswitch`, `pcie` or `unknown` (NVML's view).
    pub interconnect: String,
    /// Active NVLinks joining the pair (NVLink and NVSwitch only).
    pub nvlink_links: Option<u32>,
    /// The interconnect in words (`NV18`, `PCIe (hostbridge)`, `unknown (reason)`).
    pub interconnect_detail: String,
    /// The quick copy, when measured.
    pub copy: Option<CopyMeasurement>,
}

/// A measured copy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CopyMeasurement {
    /// Bytes per copy.
    pub bytes: u64,
    /// Host-timed throughput in 10⁹ bytes per second; 0 when the copy failed.
    pub gb_per_s: f64,
    /// The path that really ran: `peer`, `staged`, `driver_staged`, `same_device`, or `failed`.
    pub path: String,
    /// Why that path (the driver's refusal, a missing grant), or the error.
    pub reason: Option<String>,
    /// The destination held the source's bytes afterwards.
    pub verified: bool,
}

/// The P2P section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct P2pSection {
    /// Every ordered pair of distinct GPUs.
    pub pairs: Vec<P2pPair>,
    /// Why NVML could not say how GPUs are wired, when it could not.
    pub nvml_unavailable: Option<String>,
    /// Why there is no matrix (fewer than two GPUs, no driver, the `p2p` feature not built).
    pub absent_reason: Option<String>,
    /// One line.
    pub verdict: String,
}

impl P2pSection {
    /// No matrix, for `reason`.
    pub(crate) fn absent(reason: String) -> P2pSection {
        P2pSection {
            pairs: Vec::new(),
            nvml_unavailable: None,
            absent_reason: Some(reason),
            verdict: String::new(),
        }
    }

    /// Each unordered GPU pair (`src < dst`) that `keep` accepts, as `0-1`.
    pub(crate) fn pairs_where(&self, keep: impl Fn(&P2pPair) -> bool) -> Vec<String> {
        self.pairs
            .iter()
            .filter(|p| p.src < p.dst && keep(p))
            .map(|p| format!("{}-{}", p.src, p.dst))
            .collect()
    }

    /// Whether GPU `src` reaches GPU `dst` over NVLink, as NVML said.
    pub(crate) fn on_nvlink(&self, src: usize, dst: usize) -> bool {
        self.pairs
            .iter()
            .any(|p| p.src == src && p.dst == dst && p.nvlink_links.is_some())
    }
}

/// One GID table entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GidSummary {
    /// Index in the port's table.
    pub index: u32,
    /// The GID, sysfs' form (eight groups of four hex digits).
    pub gid: String,
    /// `IB`, `RoCE v1`, `RoCE v2` or `unknown`.
    pub gid_type: String,
}

/// One port of a verbs device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PortSummary {
    /// Port number (from 1).
    pub port: u8,
    /// `ACTIVE`, `DOWN`, ...
    pub state: String,
    /// `InfiniBand` or `Ethernet` (RoCE).
    pub link_layer: String,
    /// Active MTU in bytes.
    pub active_mtu: u32,
    /// Largest MTU the port supports, in bytes.
    pub max_mtu: u32,
    /// Link speed in Gb/s, when known.
    pub speed_gbps: Option<f64>,
    /// Link speed in words (`4X EDR`, or sysfs' `rate`), when known.
    pub speed: Option<String>,
    /// Populated GID entries.
    pub gids: Vec<GidSummary>,
    /// Why the port or its GID table could not be read, when it could not.
    pub error: Option<String>,
}

/// One verbs (RDMA) device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VerbsDeviceSummary {
    /// Device name, such as `mlx5_0` or `rxe0`.
    pub name: String,
    /// Firmware version, when the device could be queried.
    pub fw_ver: Option<String>,
    /// Its PCI address from sysfs; `null` for software devices (rxe, siw).
    pub pci_bus_id: Option<String>,
    /// Its NUMA node from sysfs, when known.
    pub numa_node: Option<i32>,
    /// Its ports.
    pub ports: Vec<PortSummary>,
    /// Whether it has type 2 memory windows (`DeviceAttr::memory_windows`; what the transfer
    /// engine's per-peer access needs); `null` when it could not be queried.
    #[serde(default)]
    pub memory_windows: Option<bool>,
    /// Why the device could not be opened or queried, when it could not.
    pub error: Option<String>,
}

impl VerbsDeviceSummary {
    /// At least one port is `ACTIVE`.
    pub(crate) fn has_active_port(&self) -> bool {
        self.ports.iter().any(|p| p.state == "ACTIVE")
    }
}

/// Whether one GPU can take part in GPUDirect RDMA, and by which registration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuRdmaReadiness {
    /// CUDA ordinal.
    pub gpu: usize,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`.
    pub gpudirect_rdma: bool,
    /// dma-buf export of device memory (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`).
    pub dma_buf: bool,
    /// libibverbs has `ibv_reg_dmabuf_mr` (rdma-core 34+).
    pub verbs_dmabuf: bool,
    /// The loaded peer-memory module (`nvidia_peermem 1.x`), if any.
    pub peermem: Option<String>,
    /// GPUDirect RDMA on VMM allocations.
    pub vmm_rdma: bool,
    /// How GPU memory would be registered: `dma-buf`, `nvidia-peermem`, or `none`.
    pub registration: String,
}

/// One NIC as seen from one GPU, in the report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicAffinity {
    /// Verbs device name.
    pub nic: String,
    /// Placement relative to the GPU.
    pub affinity: Affinity,
    /// At least one port is ACTIVE.
    pub active: bool,
}

/// Which NIC each GPU should use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuNicAffinity {
    /// CUDA ordinal.
    pub gpu: usize,
    /// The GPU's PCI address.
    pub gpu_pci_bus_id: String,
    /// Every verbs device, relative to this GPU.
    pub nics: Vec<NicAffinity>,
    /// The NIC to use: the closest with an active port (else the closest); `null` without NICs.
    pub best: Option<String>,
}

/// The RDMA section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RdmaSection {
    /// Verbs devices.
    pub devices: Vec<VerbsDeviceSummary>,
    /// Per GPU: GPUDirect RDMA readiness.
    pub gpus: Vec<GpuRdmaReadiness>,
    /// Per GPU: NIC placement and the NIC to use.
    pub affinity: Vec<GpuNicAffinity>,
    /// Why there are no verbs devices, when there are none (also: the `rdma` feature not built).
    pub absent_reason: Option<String>,
    /// One line.
    pub verdict: String,
}

impl RdmaSection {
    /// No devices, for `reason`.
    pub(crate) fn absent(reason: String) -> RdmaSection {
        RdmaSection {
            devices: Vec::new(),
            gpus: Vec::new(),
            affinity: Vec::new(),
            absent_reason: Some(reason),
            verdict: String::new(),
        }
    }
}

/// The quick verified read through [`crate::storage::GdsFile`] in `Mode::Auto`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StorageRead {
    /// The temporary file read (removed afterwards).
    pub file: String,
    /// Bytes read.
    pub bytes: u64,
    /// Host-timed throughput in 10⁹ bytes per second.
    pub gb_per_s: f64,
    /// `cufile` or `posix`: the path that ran.
    pub path: String,
    /// Why that path (the `PathReason`, in words).
    pub reason: String,
    /// Whether the file was read with `O_DIRECT`.
    pub direct: bool,
    /// The device buffer held the file's bytes afterwards.
    pub verified: bool,
}

/// `cuFileDriverGetProperties`, the parts worth showing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CufileProperties {
    /// nvidia-fs version the driver reports (`0.0` without it).
    pub nvfs_version: String,
    /// File systems and devices supported directly (`FsSupport` flag names).
    pub fs_support: Vec<String>,
    /// Compatibility mode allowed.
    pub allow_compat_mode: bool,
    /// Batch I/O supported.
    pub batch_io: bool,
    /// Stream-ordered I/O supported.
    pub streams: bool,
    /// Poll mode on.
    pub poll_mode: bool,
    /// Largest direct I/O, KiB.
    pub max_direct_io_kib: u64,
    /// Most memory `cuFileBufRegister` may pin per GPU, KiB.
    pub max_device_pinned_mem_kib: u64,
    /// Entries per batch.
    pub max_batch_io_size: u32,
}

/// The Storage section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StorageSection {
    /// `cuFileGetVersion` (`1.15`), when libcufile loaded.
    pub cufile_version: Option<String>,
    /// Driver properties, when the driver opened.
    pub properties: Option<CufileProperties>,
    /// `gds` (nvidia-fs loaded), `compatibility` (cuFile's POSIX mode), or `unavailable`.
    pub mode: String,
    /// Why that mode.
    pub mode_reason: String,
    /// nvidia-fs kernel module version (sysfs), when loaded.
    pub nvidia_fs_version: Option<String>,
    /// The quick read, when measured.
    pub read: Option<StorageRead>,
    /// Why there is no read or no driver (no GPU, no libcufile, the read failed, the `storage`
    /// feature not built).
    pub absent_reason: Option<String>,
    /// One line.
    pub verdict: String,
}

impl StorageSection {
    /// No driver and no read, for `reason`.
    pub(crate) fn absent(reason: String) -> StorageSection {
        StorageSection {
            cufile_version: None,
            properties: None,
            mode: "unavailable".into(),
            mode_reason: reason.clone(),
            nvidia_fs_version: None,
            read: None,
            absent_reason: Some(reason),
            verdict: String::new(),
        }
    }
}

/// Why a path's section is empty when the program was built without that path's `feature`.
#[cfg(not(all(feature = "p2p", feature = "rdma", feature = "storage")))]
pub(crate) fn not_built(feature: &str) -> String {
    format!("not built: this program's gpudirect has no `{feature}` feature")
}

/// One GPU's stream-ordering features.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuAsync {
    /// CUDA ordinal.
    pub gpu: usize,
    /// 32-bit stream memory ops (`cuStreamWaitValue32_v2`).
    pub stream_mem_ops_v2: bool,
    /// 64-bit stream memory ops.
    pub stream_mem_ops_64: bool,
    /// Stream-ordered memory pools.
    pub memory_pools: bool,
    /// Copy engines.
    pub copy_engines: i32,
    /// `CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES`.
    pub can_flush_remote_writes: bool,
    /// `cuFlushGPUDirectRDMAWrites` options (bit mask; 0: none).
    pub flush_rdma_writes_options: i32,
}

/// The Async section.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AsyncSection {
    /// Per GPU.
    pub gpus: Vec<GpuAsync>,
    /// Why there are none.
    pub absent_reason: Option<String>,
    /// One line.
    pub verdict: String,
}

/// Everything the probe prints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeReport {
    /// [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// Whether quick measurements were requested (`--no-measure` turns them off); each copy or
    /// read that ran has its own figures, and a path that is absent measures nothing.
    pub measured: bool,
    /// libcuda, libcufile, libibverbs, librdmacm.
    pub libraries: Vec<LibraryStatus>,
    /// GPUs.
    pub cuda: CudaSection,
    /// GPU to GPU.
    pub p2p: P2pSection,
    /// Verbs devices and GPUDirect RDMA.
    pub rdma: RdmaSection,
    /// GPUDirect Storage.
    pub storage: StorageSection,
    /// Stream ordering (key `async`).
    #[serde(rename = "async")]
    pub async_: AsyncSection,
    /// Driver and kernel against each path's needs, modules, PCIe links, ACS, IOMMU, NVLink,
    /// the locked-memory limit and the cuFile configuration.
    pub health: HealthSection,
    /// Each data path's status, as `--require` judges it.
    pub paths: Vec<PathStatus>,
    /// What to do, in plain words.
    pub advice: Vec<Advice>,
    /// Environment settings worth checking, with their current values.
    pub settings: Vec<EnvSetting>,
}

/// One piece of advice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Advice {
    /// `gpu`, `p2p`, `rdma`, `storage`, `async`, `driver`, `pcie`, `iommu`, `nvlink`, `limits` or
    /// `settings`.
    pub topic: String,
    /// What to do, in plain words.
    pub text: String,
}

/// Add the advice `text` on `topic` to `out`.
pub(crate) fn say(out: &mut Vec<Advice>, topic: &str, text: String) {
    out.push(Advice {
        topic: topic.into(),
        text,
    });
}

/// An environment variable worth checking.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvSetting {
    /// The variable.
    pub name: String,
    /// Its value in the probe's environment (`null`: unset).
    pub value: Option<String>,
    /// What it does.
    pub what: String,
}

/// A data path a job may require.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DataPath {
    /// At least one GPU.
    Gpu,
    /// At least two GPUs.
    MultiGpu,
    /// Peer access between GPUs.
    P2p,
    /// NVLink between GPUs.
    Nvlink,
    /// A verbs device with an active port (host-memory RDMA).
    Rdma,
    /// A NIC that can reach GPU memory (GPUDirect RDMA).
    GpudirectRdma,
    /// cuFile, in GDS or compatibility mode.
    Cufile,
    /// GPUDirect Storage (nvidia-fs).
    Gds,
    /// Stream memory operations (NIC- and storage-triggered stream waits).
    Async,
}

impl DataPath {
    /// Every path, in the order the report lists them.
    pub const ALL: [DataPath; 9] = [
        DataPath::Gpu,
        DataPath::MultiGpu,
        DataPath::P2p,
        DataPath::Nvlink,
        DataPath::Rdma,
        DataPath::GpudirectRdma,
        DataPath::Cufile,
        DataPath::Gds,
        DataPath::Async,
    ];

    /// The name `--require` takes (`gpudirect-rdma`).
    pub fn name(self) -> &'static str {
        match self {
            DataPath::Gpu => "gpu",
            DataPath::MultiGpu => "multi-gpu",
            DataPath::P2p => "p2p",
            DataPath::Nvlink => "nvlink",
            DataPath::Rdma => "rdma",
            DataPath::GpudirectRdma => "gpudirect-rdma",
            DataPath::Cufile => "cufile",
            DataPath::Gds => "gds",
            DataPath::Async => "async",
        }
    }

    /// What usable and degraded mean for this path, in words.
    pub fn describe(self) -> &'static str {
        match self {
            DataPath::Gpu => "a CUDA GPU; degraded when a GPU's PCIe link is below its maximum",
            DataPath::MultiGpu => "two or more GPUs",
            DataPath::P2p => {
                "peer access between GPUs; degraded when some pair lacks it, a quick copy failed, or ACS or the IOMMU hinders PCIe peers"
            }
            DataPath::Nvlink => {
                "NVLink between GPUs (NVML); degraded when a link is down, counts replay or recovery errors, or its error counters grow during the probe"
            }
            DataPath::Rdma => {
                "a verbs device with an active port; degraded when the locked-memory limit is low or a NIC's PCIe link is below its maximum"
            }
            DataPath::GpudirectRdma => {
                "a PCIe NIC that can register GPU memory (dma-buf or nvidia-peermem); degraded when some GPU cannot, a GPU's nearest NIC is across the CPU, ACS or the IOMMU sits in the way, or a link is below its maximum"
            }
            DataPath::Cufile => {
                "cuFile opens (GDS or compatibility mode); degraded when the quick read returned wrong bytes"
            }
            DataPath::Gds => {
                "GPUDirect Storage: cuFile with nvidia-fs; degraded when the quick read returned wrong bytes"
            }
            DataPath::Async => "stream memory operations on every GPU",
        }
    }
}

impl fmt::Display for DataPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DataPath {
    type Err = String;

    /// A path by name, case-insensitive.
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim().to_ascii_lowercase();
        DataPath::ALL
            .into_iter()
            .find(|p| p.name() == t)
            .ok_or_else(|| {
                let names: Vec<&str> = DataPath::ALL.iter().map(|p| p.name()).collect();
                format!("unknown path {s:?}: expected one of {}", names.join(", "))
            })
    }
}

/// How usable a path is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PathState {
    /// Usable.
    Ok,
    /// Usable, below what the hardware can do.
    Degraded,
    /// Not usable.
    Unusable,
}

impl PathState {
    /// `ok`, `degraded` or `unusable`, as the JSON spells it.
    pub fn name(self) -> &'static str {
        match self {
            PathState::Ok => "ok",
            PathState::Degraded => "degraded",
            PathState::Unusable => "unusable",
        }
    }
}

/// One path's status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathStatus {
    /// The path.
    pub path: DataPath,
    /// `ok`, `degraded` or `unusable`.
    pub state: PathState,
    /// Why it is not `ok`, each on one line.
    pub reasons: Vec<String>,
}

impl PathStatus {
    /// `gds unusable: nvidia-fs is not loaded` (one line).
    pub fn line(&self) -> String {
        let state = self.state.name();
        if self.reasons.is_empty() {
            format!("{} {state}", self.path)
        } else {
            format!("{} {state}: {}", self.path, self.reasons.join("; "))
        }
    }
}

/// A CUDA or cuFile version number as `major.minor`: `13000` → `13.0`, `1150` → `1.15`.
pub(crate) fn version_words(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}
