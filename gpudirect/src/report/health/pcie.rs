//! PCIe health from sysfs: each device's link (current against maximum speed and width), ACS on
//! the bridges between two devices (from PCI config space), and the IOMMU. Pure functions over a
//! sysfs root, so tests run them on fake trees.

use super::super::files::{dir_names, read_trimmed};
use super::model::{BridgeAcs, IommuStatus, PcieLink, PciePath};
use crate::topology::{MeetingPoint, PciLocation, normalize_bus_id};
use std::path::Path;

/// The ACS extended capability ID (PCIe base specification, "Access Control Services").
pub(super) const ACS_EXT_CAP_ID: u16 = 0x000D;

/// Bytes of config space an unprivileged reader gets from sysfs' `config` (the kernel cuts the
/// read short without `CAP_SYS_ADMIN`).
pub(super) const UNPRIVILEGED_CONFIG_BYTES: usize = 64;

/// ACS control register bits, by lspci's names.
const ACS_BITS: [(u16, &str); 7] = [
    (1 << 0, "SrcValid"),
    (1 << 1, "TransBlk"),
    (1 << 2, "ReqRedir"),
    (1 << 3, "CmpltRedir"),
    (1 << 4, "UpstreamFwd"),
    (1 << 5, "EgressCtrl"),
    (1 << 6, "DirectTrans"),
];

/// The bits that send peer-to-peer traffic up to the root complex instead of across the switch:
/// P2P Request Redirect, P2P Completion Redirect, P2P Egress Control.
const ACS_REDIRECT_MASK: u16 = (1 << 2) | (1 << 3) | (1 << 5);

/// The leading number of a sysfs link speed (`16.0 GT/s PCIe` → 16.0); `None` for `Unknown`.
pub fn parse_link_speed(s: &str) -> Option<f64> {
    s.split_whitespace()
        .next()?
        .parse::<f64>()
        .ok()
        .filter(|v| *v > 0.0)
}

/// Read one device's link and IOMMU group from `<sysfs>/bus/pci/devices/<bus_id>`.
pub(super) fn read_link(sysfs_root: &Path, device: &str, kind: &str, bus_id: &str) -> PcieLink {
    let bus_id = normalize_bus_id(bus_id);
    let dir = sysfs_root.join("bus/pci/devices").join(&bus_id);
    let mut l = PcieLink {
        device: device.into(),
        kind: kind.into(),
        pci_bus_id: bus_id.clone(),
        current_speed: None,
        max_speed: None,
        current_width: None,
        max_width: None,
        speed_under_load: None,
        speed_degraded: false,
        width_degraded: false,
        iommu_group: None,
        iommu_domain: None,
        error: None,
    };
    if !dir.exists() {
        l.error = Some(format!("{} is absent", dir.display()));
        return l;
    }
    l.current_speed = read_trimmed(&dir.join("current_link_speed"));
    l.max_speed = read_trimmed(&dir.join("max_link_speed"));
    let width = |f: &str| {
        read_trimmed(&dir.join(f))
            .and_then(|s| s.parse::<u32>().ok())
            .filter(|w| *w > 0)
    };
    l.current_width = width("current_link_width");
    l.max_width = width("max_link_width");
    if l.current_speed.is_none() && l.max_speed.is_none() {
        l.error = Some("sysfs has no link speed for this device (not PCIe Express?)".into());
    }
    if let Ok(g) = std::fs::read_link(dir.join("iommu_group"))
        && let Some(n) = g
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.parse::<u32>().ok())
    {
        l.iommu_group = Some(n);
        l.iommu_domain = read_trimmed(
            &sysfs_root
                .join("kernel/iommu_groups")
                .join(n.to_string())
                .join("type"),
        );
    }
    l.update_degraded();
    l
}

impl PcieLink {
    /// Set `speed_degraded` and `width_degraded` from the figures read. A GPU lowers its link
    /// speed when idle, so a GPU's speed counts only as read under load (`speed_under_load`).
    pub fn update_degraded(&mut self) {
        let max = self.max_speed.as_deref().and_then(parse_link_speed);
        let cur = if self.kind == "gpu" {
            self.speed_under_load.as_deref()
        } else {
            self.speed_seen()
        }
        .and_then(parse_link_speed);
        self.speed_degraded = matches!((cur, max), (Some(c), Some(m)) if c + 1e-9 < m);
        self.width_degraded =
            matches!((self.current_width, self.max_width), (Some(c), Some(m)) if c < m);
    }
}

/// The ACS control register of a device, from its config space bytes (`config` in sysfs).
///
/// `Ok(Some(ctrl))` when the ACS capability is found, `Ok(None)` when the device has none, `Err`
/// with the reason when the extended config space cannot be read (not root, not PCIe).
pub(super) fn acs_control(config: &[u8]) -> Result<Option<u16>, String> {
    if config.len() <= UNPRIVILEGED_CONFIG_BYTES {
        return Err(
            "unknown (needs root: sysfs gives unprivileged readers 64 bytes of config space)"
                .into(),
        );
    }
    if config.len() < 4096 {
        return Err(
            "no extended config space (conventional PCI, or the kernel cannot reach it)".into(),
        );
    }
    let u32_at = |off: usize| -> Option<u32> {
        let b = config.get(off..off.checked_add(4)?)?;
        Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let mut off = 0x100usize;
    // A well-formed list has fewer than (4096 - 256) / 4 entries; the bound stops a looped list.
    for _ in 0..960 {
        let Some(hdr) = u32_at(off) else {
            return Ok(None);
        };
        if hdr == 0 || hdr == u32::MAX {
            return Ok(None);
        }
        if (hdr & 0xffff) as u16 == ACS_EXT_CAP_ID {
            let ctrl = config
                .get(off + 6..off + 8)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .ok_or("ACS capability runs past the end of config space")?;
            return Ok(Some(ctrl));
        }
        let next = ((hdr >> 20) & 0xffc) as usize;
        if next < 0x100 {
            return Ok(None);
        }
        off = next;
    }
    Ok(None)
}

/// The names of the ACS control bits set in `ctrl`, lspci's spelling.
pub(super) fn acs_flags(ctrl: u16) -> Vec<String> {
    ACS_BITS
        .iter()
        .filter(|(bit, _)| ctrl & bit != 0)
        .map(|(_, n)| n.to_string())
        .collect()
}

/// ACS on bridge `bus_id`, read from `<sysfs>/bus/pci/devices/<bus_id>/config`.
pub(super) fn bridge_acs(sysfs_root: &Path, bus_id: &str) -> BridgeAcs {
    let path = sysfs_root
        .join("bus/pci/devices")
        .join(bus_id)
        .join("config");
    let mut b = BridgeAcs {
        pci_bus_id: bus_id.into(),
        control: None,
        flags: Vec::new(),
        redirects: None,
        note: None,
    };
    match std::fs::read(&path) {
        Err(e) => b.note = Some(format!("unknown ({}: {e})", path.display())),
        Ok(bytes) => match acs_control(&bytes) {
            Err(why) => b.note = Some(why),
            Ok(None) => {
                b.redirects = Some(false);
                b.note = Some("no ACS capability".into());
            }
            Ok(Some(ctrl)) => {
                b.control = Some(ctrl);
                b.flags = acs_flags(ctrl);
                b.redirects = Some(ctrl & ACS_REDIRECT_MASK != 0);
            }
        },
    }
    b
}

/// The PCIe path between two devices: where they meet and ACS on each bridge below that point.
/// `acs_redirects` is set only when the paths meet in a PCIe switch (elsewhere the traffic goes
/// through the root complex anyway); `None` while any bridge's ACS is unknown.
pub(super) fn pcie_path(
    sysfs_root: &Path,
    from: (&str, &str),
    to: (&str, &str),
    kind: &str,
) -> PciePath {
    let mut p = PciePath {
        from: from.0.into(),
        to: to.0.into(),
        kind: kind.into(),
        meets_at: "unknown".into(),
        bridges: Vec::new(),
        acs_redirects: None,
        error: None,
    };
    let (Some(a), Some(b)) = (
        PciLocation::of_pci(sysfs_root, from.1),
        PciLocation::of_pci(sysfs_root, to.1),
    ) else {
        p.error = Some(format!("no PCI path in sysfs for {} or {}", from.1, to.1));
        return p;
    };
    let meeting = a.meeting(&b);
    p.meets_at = meeting.point.to_string();
    p.bridges = meeting
        .bridges
        .iter()
        .map(|id| bridge_acs(sysfs_root, id))
        .collect();
    p.acs_redirects = if !matches!(meeting.point, MeetingPoint::Switch { .. }) {
        Some(false)
    } else if p.bridges.iter().any(|b| b.redirects == Some(true)) {
        Some(true)
    } else if p.bridges.iter().all(|b| b.redirects == Some(false)) {
        Some(false)
    } else {
        None
    };
    p
}

/// IOMMU state: groups present, registered units, and the kernel parameters that set it.
pub(super) fn iommu_status(sysfs_root: &Path, procfs_root: &Path) -> IommuStatus {
    let groups = dir_names(&sysfs_root.join("kernel/iommu_groups"));
    let units = dir_names(&sysfs_root.join("class/iommu")).unwrap_or_default();
    let cmdline: Vec<String> = std::fs::read_to_string(procfs_root.join("cmdline"))
        .unwrap_or_default()
        .split_whitespace()
        .filter(|t| t.contains("iommu") || t.starts_with("pcie_acs_override"))
        .map(str::to_string)
        .collect();
    IommuStatus {
        enabled: Some(groups.as_ref().is_some_and(|g| !g.is_empty()) || !units.is_empty()),
        groups: groups.map_or(0, |g| g.len() as u32),
        units,
        cmdline,
    }
}

/// Whether an IOMMU domain type translates device addresses (`DMA`, `DMA-FQ`), as opposed to
/// passthrough (`identity`).
pub fn domain_translates(domain: &str) -> bool {
    matches!(domain, "DMA" | "DMA-FQ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_with_acs(ctrl: u16, at: usize) -> Vec<u8> {
        let mut c = vec![0u8; 4096];
        // First extended capability: AER (0x0001) pointing to ACS at `at`.
        let hdr = 0x0001u32 | (1 << 16) | ((at as u32) << 20);
        c[0x100..0x104].copy_from_slice(&hdr.to_le_bytes());
        let acs = u32::from(ACS_EXT_CAP_ID) | (1 << 16);
        c[at..at + 4].copy_from_slice(&acs.to_le_bytes());
        c[at + 4..at + 6].copy_from_slice(&0x005fu16.to_le_bytes());
        c[at + 6..at + 8].copy_from_slice(&ctrl.to_le_bytes());
        c
    }

    #[test]
    fn acs_is_found_by_walking_the_extended_list() {
        let c = config_with_acs(0x001d, 0x148);
        assert_eq!(acs_control(&c), Ok(Some(0x001d)));
        assert_eq!(
            acs_flags(0x001d),
            ["SrcValid", "ReqRedir", "CmpltRedir", "UpstreamFwd"]
        );
        assert_eq!(acs_control(&config_with_acs(0, 0x200)), Ok(Some(0)));
        // No ACS: one capability whose next pointer ends the list.
        let mut c = vec![0u8; 4096];
        c[0x100..0x104].copy_from_slice(&0x0001_0001u32.to_le_bytes());
        assert_eq!(acs_control(&c), Ok(None));
        // A list that points at itself ends.
        let mut c = vec![0u8; 4096];
        let hdr = 0x0001u32 | (0x100 << 20);
        c[0x100..0x104].copy_from_slice(&hdr.to_le_bytes());
        assert_eq!(acs_control(&c), Ok(None));
        // A pointer to the last dword: header readable, control past the end.
        let mut c = vec![0u8; 4096];
        let hdr = 0x0001u32 | (0xffc << 20);
        c[0x100..0x104].copy_from_slice(&hdr.to_le_bytes());
        c[0xffc..0x1000].copy_from_slice(&u32::from(ACS_EXT_CAP_ID).to_le_bytes());
        assert!(acs_control(&c).is_err());
        assert!(acs_control(&[0u8; 64]).unwrap_err().contains("needs root"));
        assert!(
            acs_control(&[0u8; 256])
                .unwrap_err()
                .contains("no extended config space")
        );
    }

    #[test]
    fn link_speeds_parse() {
        assert_eq!(parse_link_speed("16.0 GT/s PCIe"), Some(16.0));
        assert_eq!(parse_link_speed("2.5 GT/s"), Some(2.5));
        assert_eq!(parse_link_speed("Unknown"), None);
        assert_eq!(parse_link_speed("0 GT/s"), None);
    }
}
