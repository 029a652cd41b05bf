//! Where GPUs and NICs sit on the node's PCIe tree, read from sysfs: what the data paths choose
//! by (which NIC a GPU's transfers should use, which NUMA node host staging buffers belong on).
//!
//! [`Placement::of_gpu`] locates a CUDA device; [`Placement::nearest_nics`] lists the verbs
//! (RDMA) NICs nearest first by [`Affinity`]: below the same PCIe switch, on the same NUMA node,
//! across the CPU, unknown (software devices such as rxe). [`PciLocation::meeting`] says where
//! two devices' PCIe paths meet ([`MeetingPoint`]). Everything reads a sysfs root (`/sys` on a
//! real node, a fake tree in tests); the placement needs no NVML, and nothing fails for what sysfs
//! lacks: an unknown placement is [`Affinity::Unknown`]. NVLink wiring is NVML's to tell (opened
//! as [`NVML_LIB`] by the P2P link matrix and the node report).

mod affinity;
mod nvml;
mod pci;
mod placement;

pub use affinity::{Affinity, Meeting, MeetingPoint};
pub use nvml::NVML_LIB;
pub use pci::{PciLocation, SYSFS_ROOT, nic_names, nic_pci_address, normalize_bus_id};
pub use placement::{NicPlacement, Placement};

#[cfg(any(feature = "p2p", feature = "report"))]
pub(crate) use nvml::open_nvml;
