//! A GPU's placement and the NICs nearest to it: what a data path picks its NIC (rail) by.

use super::affinity::Affinity;
use super::pci::{self, PciLocation};
use crate::Result;
use std::path::{Path, PathBuf};

/// Where one GPU (or any PCI device) sits on the node's PCIe tree, read from a sysfs root.
///
/// ```no_run
/// # fn main() -> gpudirect::Result<()> {
/// use gpudirect::topology::Placement;
/// let gpu = Placement::of_gpu(0)?;
/// // The NIC to use for GPU 0: the nearest one (rxe/siw and NICs sysfs cannot place last).
/// if let Some(nic) = gpu.nearest_nics().first() {
///     println!("GPU 0 at {} -> {} ({})", gpu.pci_bus_id, nic.name, nic.affinity.describe());
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The device's PCI address, as sysfs spells it (`0000:19:00.0`).
    pub pci_bus_id: String,
    /// Where it sits; `None` when sysfs has no such PCI device (a partial tree, or a virtual
    /// machine that hides it): then every NIC's affinity to it is [`Affinity::Unknown`].
    pub location: Option<PciLocation>,
    /// The sysfs root it was read from; NICs are looked up in the same tree.
    sysfs: PathBuf,
}

/// One verbs (RDMA) NIC as seen from a [`Placement`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicPlacement {
    /// The verbs device name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// Its PCI address; `None` for software devices (rxe, siw).
    pub pci_bus_id: Option<String>,
    /// Its NUMA node, when sysfs says: where host staging buffers for it belong.
    pub numa_node: Option<i32>,
    /// Where it sits relative to the GPU.
    pub affinity: Affinity,
}

impl Placement {
    /// CUDA device `ordinal`'s placement on this node: its PCI address from the driver, located
    /// in `/sys`.
    ///
    /// # Errors
    ///
    /// [`crate::Error::Load`] without libcuda, [`crate::Error::NoDevice`] for an ordinal past
    /// the device count, [`crate::Error::Cuda`] when the driver fails the query. A GPU that sysfs
    /// does not show is not an error: its [`Placement::location`] is `None`.
    #[doc(alias = "cuDeviceGetPCIBusId")]
    pub fn of_gpu(ordinal: usize) -> Result<Placement> {
        let bus_id = crate::cuda::DeviceInfo::query(ordinal)?.pci_bus_id;
        Ok(Placement::of_pci(Path::new(pci::SYSFS_ROOT), &bus_id))
    }

    /// The placement of PCI device `bus_id` (CUDA's, NVML's or sysfs' spelling) under `sysfs`
    /// (`/sys`, or a fake tree).
    pub fn of_pci(sysfs: &Path, bus_id: &str) -> Placement {
        Placement {
            pci_bus_id: pci::normalize_bus_id(bus_id),
            location: PciLocation::of_pci(sysfs, bus_id),
            sysfs: sysfs.to_path_buf(),
        }
    }

    /// The device's NUMA node, when sysfs says.
    pub fn numa_node(&self) -> Option<i32> {
        self.location.as_ref().and_then(|l| l.numa_node)
    }

    /// Verbs device `ibdev` as seen from this device. A NIC sysfs cannot place (rxe, siw, or a
    /// name sysfs does not have) is [`Affinity::Unknown`].
    pub fn nic(&self, ibdev: &str) -> NicPlacement {
        let at = PciLocation::of_nic(&self.sysfs, ibdev);
        NicPlacement {
            name: ibdev.to_string(),
            pci_bus_id: pci::nic_pci_address(&self.sysfs, ibdev),
            numa_node: at.as_ref().and_then(|l| l.numa_node),
            affinity: match (&self.location, &at) {
                (Some(g), Some(n)) => g.affinity(n),
                _ => Affinity::Unknown,
            },
        }
    }

    /// Every verbs NIC the kernel has (`<sysfs>/class/infiniband`), nearest first: below the
    /// same PCIe switch, then the same NUMA node, then across the CPU, then unknown; NICs of one
    /// class by name. Empty when no RDMA driver is loaded. Port state is not looked at: a NIC
    /// whose ports are down is listed where it sits.
    pub fn nearest_nics(&self) -> Vec<NicPlacement> {
        let mut v: Vec<NicPlacement> = pci::nic_names(&self.sysfs)
            .iter()
            .map(|n| self.nic(n))
            .collect();
        // Stable: names are sorted already.
        v.sort_by_key(|n| n.affinity);
        v
    }
}
