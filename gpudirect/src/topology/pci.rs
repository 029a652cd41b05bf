//! Where PCI devices sit, read from a sysfs root (`/sys` on a real node, a fake tree in tests).

use std::path::{Path, PathBuf};

/// The real sysfs root.
pub const SYSFS_ROOT: &str = "/sys";

/// Where a PCI device sits: its chain of PCI devices from the root complex down.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciLocation {
    /// The root complex (host bridge), such as `pci0000:00`.
    pub root: String,
    /// PCI addresses from the root port down to the device itself (last).
    pub chain: Vec<String>,
    /// `numa_node` of the device; `None` when sysfs says -1 or has no such file.
    pub numa_node: Option<i32>,
}

impl PciLocation {
    /// The location of PCI device `bus_id` (CUDA's, NVML's or sysfs' spelling) under `sysfs`
    /// (`<sysfs>/bus/pci/devices/<bus_id>`); `None` when sysfs has no such device.
    pub fn of_pci(sysfs: &Path, bus_id: &str) -> Option<PciLocation> {
        let link = sysfs.join("bus/pci/devices").join(normalize_bus_id(bus_id));
        locate(&std::fs::canonicalize(link).ok()?)
    }

    /// The location of verbs (RDMA) device `ibdev` (`<sysfs>/class/infiniband/<ibdev>/device`);
    /// `None` for software devices (rxe, siw), which have no PCI parent.
    pub fn of_nic(sysfs: &Path, ibdev: &str) -> Option<PciLocation> {
        locate(&nic_device(sysfs, ibdev)?)
    }

    /// The device's own PCI address (the last of [`PciLocation::chain`]).
    pub fn pci_bus_id(&self) -> Option<&str> {
        self.chain.last().map(String::as_str)
    }
}

fn is_bdf(s: &str) -> bool {
    // dddd:bb:dd.f
    let b = s.as_bytes();
    b.len() == 12 && b[4] == b':' && b[7] == b':' && b[10] == b'.'
}

/// Normalise a CUDA or NVML bus id (`00000000:19:00.0`, upper or lower case) to sysfs' form
/// (`0000:19:00.0`).
pub fn normalize_bus_id(id: &str) -> String {
    let id = id.trim().to_ascii_lowercase();
    match id.split_once(':') {
        // `is_ascii`: the slice below then falls on a character boundary whatever the input.
        Some((dom, rest)) if dom.len() > 4 && dom.is_ascii() => {
            format!("{}:{rest}", &dom[dom.len() - 4..])
        }
        _ => id,
    }
}

/// Locate a device from its canonical sysfs path (`…/devices/pci0000:00/0000:00:01.0/…`).
fn locate(real: &Path) -> Option<PciLocation> {
    let mut root = None;
    let mut chain = Vec::new();
    for c in real.components() {
        let c = c.as_os_str().to_string_lossy();
        if root.is_none() && c.starts_with("pci") && c.contains(':') {
            root = Some(c.to_string());
        } else if root.is_some() && is_bdf(&c) {
            chain.push(c.to_string());
        }
    }
    let numa_node = std::fs::read_to_string(real.join("numa_node"))
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
        .filter(|n| *n >= 0);
    Some(PciLocation {
        root: root?,
        chain: (!chain.is_empty()).then_some(chain)?,
        numa_node,
    })
}

/// The canonical sysfs path of verbs device `ibdev`'s parent device.
fn nic_device(sysfs: &Path, ibdev: &str) -> Option<PathBuf> {
    std::fs::canonicalize(sysfs.join("class/infiniband").join(ibdev).join("device")).ok()
}

/// The PCI address of verbs device `ibdev` (`<sysfs>/class/infiniband/<ibdev>/device`); `None`
/// for software devices (rxe, siw) that have no PCI parent.
pub fn nic_pci_address(sysfs: &Path, ibdev: &str) -> Option<String> {
    let real = nic_device(sysfs, ibdev)?;
    let name = real.file_name()?.to_string_lossy().into_owned();
    is_bdf(&name).then_some(name)
}

/// The verbs (RDMA) devices the kernel has (`<sysfs>/class/infiniband`), by name, sorted; empty
/// when no RDMA driver is loaded.
pub fn nic_names(sysfs: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(sysfs.join("class/infiniband"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_normalise() {
        assert_eq!(normalize_bus_id("00000000:19:00.0"), "0000:19:00.0");
        assert_eq!(normalize_bus_id("0000:AB:00.0"), "0000:ab:00.0");
        assert_eq!(normalize_bus_id(" 0000:19:00.0\n"), "0000:19:00.0");
        // Not an address: returned as given (lower case), never a panic.
        assert_eq!(normalize_bus_id("ééééé:19"), "ééééé:19");
    }
}
