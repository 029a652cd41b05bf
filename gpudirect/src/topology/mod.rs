//! What this node offers GPUDirect: libraries, GPUs and their attributes, verbs devices.
//!
//! [`NodeReport::gather`] never fails: whatever is absent is recorded with the reason.

mod render;

use crate::device::DeviceInfo;
use serde::{Deserialize, Serialize};

/// The JSON schema version of [`NodeReport`]; bumped on any incompatible change.
pub const SCHEMA_VERSION: u32 = 1;

/// A run-time library and whether it loaded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LibraryStatus {
    /// Short name: `libcuda`, `libcufile`, `libibverbs`, `librdmacm`.
    pub name: String,
    /// Whether it loaded.
    pub loaded: bool,
    /// The file it loaded from.
    pub path: Option<String>,
    /// Its version, where the library reports one.
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

/// The CUDA section.
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

/// One port of a verbs device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortSummary {
    /// Port number (from 1).
    pub port: u8,
    /// `ACTIVE`, `DOWN`, ...
    pub state: String,
    /// `InfiniBand` or `Ethernet` (RoCE).
    pub link_layer: String,
    /// Active MTU in bytes.
    pub active_mtu: u32,
}

/// One verbs (RDMA) device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerbsDeviceSummary {
    /// Device name, such as `mlx5_0` or `rxe0`.
    pub name: String,
    /// Its ports.
    pub ports: Vec<PortSummary>,
}

/// The RDMA section.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaSection {
    /// Verbs devices.
    pub devices: Vec<VerbsDeviceSummary>,
    /// Why there are no devices, when there are none.
    pub absent_reason: Option<String>,
}

/// Everything the probe prints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeReport {
    /// [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// libcuda, libcufile, libibverbs, librdmacm.
    pub libraries: Vec<LibraryStatus>,
    /// GPUs.
    pub cuda: CudaSection,
    /// Verbs devices.
    pub rdma: RdmaSection,
}

impl NodeReport {
    /// Look at this node. Never fails and never panics: absences are recorded with reasons.
    pub fn gather() -> NodeReport {
        let mut libraries = Vec::new();
        let driver = crate::cuda::init();
        let cuda = match gpudirect_sys::cuda::driver() {
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
        };
        let rdma = RdmaSection {
            devices: Vec::new(),
            absent_reason: Some("verbs support is not built in yet".into()),
        };
        NodeReport {
            schema_version: SCHEMA_VERSION,
            libraries,
            cuda,
            rdma,
        }
    }
}

/// `13000` → `13.0`.
pub fn format_cuda_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}
