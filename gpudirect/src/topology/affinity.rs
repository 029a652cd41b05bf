//! Where the PCIe paths of two devices meet, and the affinity class that follows from it.

use super::pci::PciLocation;
use std::fmt;

/// How a GPU and a NIC (or any two PCI devices) are placed relative to each other, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
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
    /// A short phrase for a text report.
    pub fn describe(self) -> &'static str {
        match self {
            Affinity::SamePcieSwitch => "same PCIe switch",
            Affinity::SameNumaNode => "same NUMA node",
            Affinity::AcrossCpu => "across the CPU",
            Affinity::Unknown => "unknown",
        }
    }
}

/// The PCI device where the upward paths of two devices first meet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MeetingPoint {
    /// A PCIe switch: `bridge` (the switch's upstream side) is above both, below the root port.
    Switch {
        /// The shared bridge's PCI address.
        bridge: String,
    },
    /// The same root port, with no switch below it that both share.
    RootPort {
        /// The root port's PCI address.
        port: String,
    },
    /// The same root complex (host bridge) through different root ports.
    RootComplex {
        /// The root complex, such as `pci0000:00`.
        root: String,
    },
    /// Different host bridges: traffic goes through the CPU.
    HostBridges {
        /// The first device's host bridge.
        a: String,
        /// The second device's host bridge.
        b: String,
        /// The two sit on different NUMA nodes (both known): traffic crosses the CPU
        /// interconnect.
        across_cpu: bool,
    },
}

impl MeetingPoint {
    /// The affinity class of two devices that meet here.
    pub fn affinity(&self) -> Affinity {
        match self {
            MeetingPoint::Switch { .. } => Affinity::SamePcieSwitch,
            MeetingPoint::HostBridges {
                across_cpu: true, ..
            } => Affinity::AcrossCpu,
            _ => Affinity::SameNumaNode,
        }
    }
}

impl fmt::Display for MeetingPoint {
    /// `PCIe switch (bridge 0000:01:00.0)`, `root port 0000:00:01.0`, `root complex pci0000:00`,
    /// `pci0000:00 / pci0000:80 (different NUMA nodes: across the CPU interconnect)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MeetingPoint::Switch { bridge } => write!(f, "PCIe switch (bridge {bridge})"),
            MeetingPoint::RootPort { port } => write!(f, "root port {port}"),
            MeetingPoint::RootComplex { root } => write!(f, "root complex {root}"),
            MeetingPoint::HostBridges { a, b, across_cpu } => write!(
                f,
                "{a} / {b} ({})",
                if *across_cpu {
                    "different NUMA nodes: across the CPU interconnect"
                } else {
                    "different host bridges"
                }
            ),
        }
    }
}

/// Where two devices' PCIe paths meet, and the bridges each device's traffic passes on its way
/// there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meeting {
    /// Where they meet.
    pub point: MeetingPoint,
    /// The bridges below the meeting point, the first device's (top down) then the second's;
    /// the endpoints themselves are not listed.
    pub bridges: Vec<String>,
}

impl PciLocation {
    /// Where this device's PCIe path and `other`'s meet. A bridge shared below the root port
    /// is a PCIe switch; two host bridges with a missing `numa_node` on either side are not
    /// counted as across the CPU.
    pub fn meeting(&self, other: &PciLocation) -> Meeting {
        // The bridges above each device: its chain without the device itself.
        let above = |l: &PciLocation| -> Vec<String> {
            l.chain
                .split_last()
                .map_or_else(Vec::new, |(_, up)| up.to_vec())
        };
        let (pa, pb) = (above(self), above(other));
        if self.root != other.root {
            let mut bridges: Vec<String> = pa.iter().chain(&pb).cloned().collect();
            bridges.dedup();
            let across_cpu =
                matches!((self.numa_node, other.numa_node), (Some(x), Some(y)) if x != y);
            return Meeting {
                point: MeetingPoint::HostBridges {
                    a: self.root.clone(),
                    b: other.root.clone(),
                    across_cpu,
                },
                bridges,
            };
        }
        let common = pa.iter().zip(&pb).take_while(|(x, y)| x == y).count();
        let mut bridges: Vec<String> = pa[common..].iter().chain(&pb[common..]).cloned().collect();
        bridges.dedup();
        let point = match common {
            0 => MeetingPoint::RootComplex {
                root: self.root.clone(),
            },
            // The first of the chain is the root port; a shared bridge below it is a switch.
            1 => MeetingPoint::RootPort {
                port: pa[0].clone(),
            },
            _ => MeetingPoint::Switch {
                bridge: pa[common - 1].clone(),
            },
        };
        Meeting { point, bridges }
    }

    /// The affinity class of this device and `other`: below one PCIe switch, else the same root
    /// complex or NUMA node (a missing `numa_node` on either side counts as one node), else
    /// across the CPU.
    pub fn affinity(&self, other: &PciLocation) -> Affinity {
        self.meeting(other).point.affinity()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(root: &str, chain: &[&str], numa: Option<i32>) -> PciLocation {
        PciLocation {
            root: root.into(),
            chain: chain.iter().map(|s| s.to_string()).collect(),
            numa_node: numa,
        }
    }

    #[test]
    fn meeting_points() {
        let g = loc(
            "pci0000:00",
            &["00:01.0", "01:00.0", "02:08.0", "05:00.0"],
            Some(0),
        );
        let n = loc(
            "pci0000:00",
            &["00:01.0", "01:00.0", "02:10.0", "06:00.0"],
            Some(0),
        );
        let m = g.meeting(&n);
        assert_eq!(
            (m.point.to_string(), m.bridges, g.affinity(&n)),
            (
                "PCIe switch (bridge 01:00.0)".to_string(),
                vec!["02:08.0".to_string(), "02:10.0".to_string()],
                Affinity::SamePcieSwitch
            )
        );
        let g1 = loc("pci0000:00", &["00:03.0", "19:00.0"], Some(0));
        let m = g.meeting(&g1);
        assert_eq!(
            (m.point.to_string(), m.bridges, g.affinity(&g1)),
            (
                "root complex pci0000:00".to_string(),
                vec![
                    "00:01.0".to_string(),
                    "01:00.0".to_string(),
                    "02:08.0".to_string(),
                    "00:03.0".to_string()
                ],
                Affinity::SameNumaNode
            )
        );
        let g2 = loc("pci0000:00", &["00:03.0", "1a:00.0"], Some(0));
        assert_eq!(
            g1.meeting(&g2).point,
            MeetingPoint::RootPort {
                port: "00:03.0".into()
            }
        );
        assert_eq!(g1.affinity(&g2), Affinity::SameNumaNode);
        let far = loc("pci0000:80", &["80:01.0", "81:00.0"], Some(1));
        let m = g1.meeting(&far);
        assert_eq!(
            m.point.to_string(),
            "pci0000:00 / pci0000:80 (different NUMA nodes: across the CPU interconnect)"
        );
        assert_eq!(m.bridges, ["00:03.0", "80:01.0"]);
        assert_eq!(g1.affinity(&far), Affinity::AcrossCpu);
        // Two host bridges without NUMA information count as one node.
        let a = loc("pci0000:00", &["0000:00:01.0"], None);
        let b = loc("pci0000:80", &["0000:80:01.0"], None);
        assert_eq!(
            a.meeting(&b).point.to_string(),
            "pci0000:00 / pci0000:80 (different host bridges)"
        );
        assert_eq!(a.affinity(&b), Affinity::SameNumaNode);
    }

    #[test]
    fn an_empty_chain_meets_at_the_root_without_panicking() {
        let empty = loc("pci0000:00", &[], None);
        let g = loc("pci0000:00", &["00:01.0", "01:00.0", "05:00.0"], Some(0));
        assert_eq!(
            empty.meeting(&g),
            Meeting {
                point: MeetingPoint::RootComplex {
                    root: "pci0000:00".into()
                },
                bridges: vec!["00:01.0".into(), "01:00.0".into()],
            }
        );
        assert_eq!(g.affinity(&empty), Affinity::SameNumaNode);
    }

    #[test]
    fn affinity_orders_best_first() {
        let mut v = [
            Affinity::Unknown,
            Affinity::AcrossCpu,
            Affinity::SamePcieSwitch,
            Affinity::SameNumaNode,
        ];
        v.sort();
        assert_eq!(
            v,
            [
                Affinity::SamePcieSwitch,
                Affinity::SameNumaNode,
                Affinity::AcrossCpu,
                Affinity::Unknown
            ]
        );
    }
}
