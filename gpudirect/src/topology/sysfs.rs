//! PCI placement of GPUs and NICs from sysfs, as pure functions over a sysfs root (`/sys` on a
//! real node, a fake tree in tests).

use serde::{Deserialize, Serialize};
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

/// How a GPU and a NIC are placed relative to each other, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Affinity {
    /// Below one PCIe switch (a common PCI bridge below the root port's bus): peer-to-peer
    /// traffic stays in the switch (nvidia-smi's PIX/PXB).
    SamePcieSwitch,
    /// Same NUMA node (or same host bridge) but no common switch: traffic goes through the CPU's
    /// root complex (PHB/NODE).
    SameNumaNode,
    /// Different NUMA nodes: traffic crosses the CPU interconnect (SYS).
    AcrossCpu,
    /// Placement unknown (a software device such as rxe, or sysfs lacks the path).
    Unknown,
}

impl Affinity {
    /// A short phrase for the text report.
    pub fn describe(self) -> &'static str {
        match self {
            Affinity::SamePcieSwitch => "same PCIe switch",
            Affinity::SameNumaNode => "same NUMA node",
            Affinity::AcrossCpu => "across the CPU",
            Affinity::Unknown => "unknown",
        }
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
        Some((dom, rest)) if dom.len() > 4 => format!("{}:{rest}", &dom[dom.len() - 4..]),
        _ => id,
    }
}

/// Locate a device from its canonical sysfs path (`…/devices/pci0000:00/0000:00:01.0/…`).
fn locate_path(real: &Path) -> Option<PciLocation> {
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

/// The location of PCI device `bus_id` under `sysfs` (`<sysfs>/bus/pci/devices/<bus_id>`).
pub fn pci_location(sysfs: &Path, bus_id: &str) -> Option<PciLocation> {
    let link = sysfs.join("bus/pci/devices").join(normalize_bus_id(bus_id));
    locate_path(&std::fs::canonicalize(link).ok()?)
}

/// The PCI address of verbs device `ibdev` (`<sysfs>/class/infiniband/<ibdev>/device`); `None`
/// for software devices (rxe, siw) that have no PCI parent.
pub fn nic_pci_address(sysfs: &Path, ibdev: &str) -> Option<String> {
    let real =
        std::fs::canonicalize(sysfs.join("class/infiniband").join(ibdev).join("device")).ok()?;
    let name = real.file_name()?.to_string_lossy().into_owned();
    is_bdf(&name).then_some(name)
}

/// The location of verbs device `ibdev`.
pub fn nic_location(sysfs: &Path, ibdev: &str) -> Option<PciLocation> {
    let real =
        std::fs::canonicalize(sysfs.join("class/infiniband").join(ibdev).join("device")).ok()?;
    locate_path(&real)
}

/// Classify two placements. A common PCI device above both (other than the endpoints) is a
/// switch; else the same root complex or NUMA node (a missing `numa_node` on both counts as
/// one node); else across the CPU.
pub fn classify(a: &PciLocation, b: &PciLocation) -> Affinity {
    if a.root == b.root {
        let (pa, pb) = (&a.chain[..a.chain.len() - 1], &b.chain[..b.chain.len() - 1]);
        // The first element is the root port; a shared bridge below it is a switch.
        let common = pa.iter().zip(pb).take_while(|(x, y)| x == y).count();
        if common >= 2 {
            return Affinity::SamePcieSwitch;
        }
        return Affinity::SameNumaNode;
    }
    match (a.numa_node, b.numa_node) {
        (Some(x), Some(y)) if x != y => Affinity::AcrossCpu,
        _ => Affinity::SameNumaNode,
    }
}

/// `<sysfs>/class/infiniband/<ibdev>/ports/<port>/rate`, such as `100 Gb/sec (4X EDR)`.
pub fn port_rate(sysfs: &Path, ibdev: &str, port: u8) -> Option<String> {
    let p: PathBuf = sysfs
        .join("class/infiniband")
        .join(ibdev)
        .join("ports")
        .join(port.to_string())
        .join("rate");
    let s = std::fs::read_to_string(p).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

/// A port's speed from `ibv_port_attr`'s `active_width` and `active_speed` codes, in Gb/s per
/// port, with the usual name (`4X EDR`); `None` for codes not known.
pub fn port_speed(active_width: u8, active_speed: u8) -> Option<(f64, String)> {
    let (lanes, w) = match active_width {
        1 => (1.0, "1X"),
        2 => (4.0, "4X"),
        4 => (8.0, "8X"),
        8 => (12.0, "12X"),
        16 => (2.0, "2X"),
        _ => return None,
    };
    let (gbps, s) = match active_speed {
        1 => (2.5, "SDR"),
        2 => (5.0, "DDR"),
        4 => (10.0, "QDR"),
        8 => (10.0, "FDR10"),
        16 => (14.0, "FDR"),
        32 => (25.0, "EDR"),
        64 => (50.0, "HDR"),
        128 => (100.0, "NDR"),
        _ => return None,
    };
    Some((lanes * gbps, format!("{w} {s}")))
}

/// The nvidia-fs module's version (`<sysfs>/module/nvidia_fs/version`), when loaded.
pub fn nvidia_fs_version(sysfs: &Path) -> Option<String> {
    let dir = sysfs.join("module/nvidia_fs");
    if !dir.is_dir() {
        return None;
    }
    Some(
        std::fs::read_to_string(dir.join("version"))
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "loaded (version unknown)".into()),
    )
}

/// The version in a resolved library file name: `libibverbs.so.1.14.50.0` → `1.14.50.0`; `None`
/// for a bare soname (`libibverbs.so.1`), whose number is only the ABI major.
pub fn version_from_file_name(path: &str) -> Option<String> {
    let file = path.rsplit('/').next()?;
    let (_, v) = file.split_once(".so.")?;
    v.contains('.').then(|| v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_normalise() {
        assert_eq!(normalize_bus_id("00000000:19:00.0"), "0000:19:00.0");
        assert_eq!(normalize_bus_id("0000:AB:00.0"), "0000:ab:00.0");
    }

    #[test]
    fn speeds_and_versions() {
        assert_eq!(port_speed(2, 32), Some((100.0, "4X EDR".into())));
        assert_eq!(port_speed(2, 128), Some((400.0, "4X NDR".into())));
        assert_eq!(port_speed(3, 1), None);
        assert_eq!(
            version_from_file_name("/usr/lib/libibverbs.so.1.14.50.0").as_deref(),
            Some("1.14.50.0")
        );
        assert_eq!(version_from_file_name("libibverbs.so"), None);
        assert_eq!(version_from_file_name("/lib/libibverbs.so.1"), None);
    }
}
