//! The link matrix: for every ordered device pair, peer access, P2P attributes and the physical
//! interconnect (NVLink with its link count, or PCIe) as NVML reports it.

use super::access::{can_access_peer, cu_device};
use super::attributes::{P2pAttributes, p2p_attributes};
use crate::cuda::{self, DeviceInfo};
use crate::driver;
use crate::error::Result;

/// NVML's maximum NVLink count per GPU (`NVML_NVLINK_MAX_LINKS`).
const NVML_NVLINK_MAX_LINKS: u32 = 18;

/// How two devices are wired, as NVML reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(tag = "kind", rename_all = "snake_case"))]
#[non_exhaustive]
pub enum Interconnect {
    /// The same device.
    SameDevice,
    /// NVLink: `links` active links join the pair (directly, or through NVSwitches when
    /// `via_switch`, where `links` is the smaller of the two devices' switch link counts).
    Nvlink {
        /// Active links.
        links: u32,
        /// Through NVSwitch rather than GPU to GPU.
        via_switch: bool,
    },
    /// PCIe; `common_ancestor` is NVML's topology level (`single`, `multiple`, `hostbridge`,
    /// `node`, `system`), when known.
    Pcie {
        /// `nvmlDeviceGetTopologyCommonAncestor`, lower-case.
        common_ancestor: Option<String>,
    },
    /// NVML is absent or could not say; `reason` says why.
    Unknown {
        /// What failed.
        reason: String,
    },
}

/// One ordered pair of the matrix.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Link {
    /// The accessing device.
    pub src: usize,
    /// The device whose memory is accessed.
    pub dst: usize,
    /// `cuDeviceCanAccessPeer(src, dst)`.
    pub can_access: bool,
    /// `cuDeviceGetP2PAttribute`.
    pub attributes: P2pAttributes,
    /// NVML's view of the wiring.
    pub interconnect: Interconnect,
}

/// Peer access and wiring of every ordered device pair, including each device with itself.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct LinkMatrix {
    /// The devices, by ordinal ([`DeviceInfo::query`] of each).
    pub devices: Vec<DeviceInfo>,
    /// `devices.len()²` pairs, row-major: `links[src * n + dst]`.
    pub links: Vec<Link>,
    /// Where NVML was loaded from, or why not (`None` when it loaded).
    pub nvml_unavailable: Option<String>,
}

impl LinkMatrix {
    /// Probe every ordered pair of visible devices.
    ///
    /// NVML (opened as [`NVML_LIB`](crate::topology::NVML_LIB)) supplies the interconnect; without it every pair's
    /// interconnect is [`Interconnect::Unknown`], which is not an error.
    ///
    /// # Errors
    ///
    /// [`crate::Error::Load`] without libcuda, [`crate::Error::Cuda`] when a CUDA query fails.
    #[doc(alias = "cuDeviceGetP2PAttribute")]
    #[doc(alias = "nvmlDeviceGetNvLinkState")]
    pub fn probe() -> Result<LinkMatrix> {
        let n = cuda::device_count()?;
        let devices = (0..n).map(DeviceInfo::query).collect::<Result<Vec<_>>>()?;
        let nvml = Nvml::open();
        let nvml_unavailable = nvml.as_ref().err().cloned();
        let wiring = match &nvml {
            Ok(nv) => nv.wiring(&devices),
            Err(reason) => Wiring::unknown(n, reason),
        };
        let mut links = Vec::with_capacity(n * n);
        for src in 0..n {
            for dst in 0..n {
                links.push(Link {
                    src,
                    dst,
                    can_access: src != dst && can_access_peer(src, dst)?,
                    attributes: p2p_attributes(src, dst)?,
                    interconnect: wiring.pair(src, dst),
                });
            }
        }
        Ok(LinkMatrix {
            devices,
            links,
            nvml_unavailable,
        })
    }

    /// The pair `src → dst`.
    pub fn link(&self, src: usize, dst: usize) -> Option<&Link> {
        let n = self.devices.len();
        (src < n && dst < n).then(|| &self.links[src * n + dst])
    }

    /// A compact text table: one row per ordered pair.
    pub fn table(&self) -> String {
        let mut s = String::new();
        for d in &self.devices {
            s += &format!("GPU{} {} [{}]\n", d.ordinal, d.name, d.pci_bus_id);
        }
        if let Some(why) = &self.nvml_unavailable {
            s += &format!("NVML unavailable: {why}\n");
        }
        s += &format!(
            "{:<8} {:<6} {:<5} {:<7} {:<6} {}\n",
            "pair", "access", "rank", "atomics", "array", "interconnect"
        );
        for l in &self.links {
            s += &format!(
                "{:<8} {:<6} {:<5} {:<7} {:<6} {}\n",
                format!("{}->{}", l.src, l.dst),
                yes(l.can_access),
                l.attributes.performance_rank,
                yes(l.attributes.native_atomics),
                yes(l.attributes.cuda_array_access),
                l.interconnect
            );
        }
        s
    }
}

fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

impl std::fmt::Display for Interconnect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Interconnect::SameDevice => f.write_str("same device"),
            Interconnect::Nvlink {
                links,
                via_switch: false,
            } => write!(f, "NV{links}"),
            Interconnect::Nvlink {
                links,
                via_switch: true,
            } => write!(f, "NV{links} (NVSwitch)"),
            Interconnect::Pcie {
                common_ancestor: Some(a),
            } => write!(f, "PCIe ({a})"),
            Interconnect::Pcie {
                common_ancestor: None,
            } => f.write_str("PCIe"),
            Interconnect::Unknown { reason } => write!(f, "unknown ({reason})"),
        }
    }
}

/// `cuDeviceGetPCIBusId` of device `ordinal`, such as `0000:19:00.0`: a name for the device that
/// every process on the node shares, whatever its `CUDA_VISIBLE_DEVICES`.
///
/// # Errors
///
/// As [`cu_device`]; [`crate::Error::Cuda`] from the driver.
pub(crate) fn bus_id_of(ordinal: usize) -> Result<String> {
    let dev = cu_device(ordinal)?;
    // SAFETY: `dev` came from cuDeviceGet.
    Ok(unsafe { driver::device::pci_bus_id(dev) }?.to_ascii_lowercase())
}

/// The ordinal, in this process, of the device at PCI address `bus` (as [`bus_id_of`] spells
/// it, in either case); `None` when no visible device is there.
///
/// # Errors
///
/// As [`bus_id_of`] for each visible device.
pub(crate) fn ordinal_of_bus_id(bus: &str) -> Result<Option<usize>> {
    let Some(want) = parse_bus_id(bus) else {
        return Ok(None);
    };
    for ordinal in 0..cuda::device_count()? {
        if parse_bus_id(&bus_id_of(ordinal)?) == Some(want) {
            return Ok(Some(ordinal));
        }
    }
    Ok(None)
}

/// A PCI address as `(domain, bus, device)`, parsed from `dddd:bb:dd.f` or `dddddddd:bb:dd.f`
/// (a peer's word too: every field hex digits, nothing after the function).
pub(crate) fn parse_bus_id(s: &str) -> Option<(u32, u32, u32)> {
    // Digits only: `from_str_radix` would also take a sign ("+19").
    let hex = |p: &str| {
        (!p.is_empty() && p.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| u32::from_str_radix(p, 16).ok())
            .flatten()
    };
    let (dom, rest) = s.trim().split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (dev, func) = rest.split_once('.')?;
    hex(func)?;
    Some((hex(dom)?, hex(bus)?, hex(dev)?))
}

/// Per device: NVML's view of its active links.
#[derive(Debug, Clone, Default)]
struct DeviceLinks {
    /// PCI addresses at the far end of each active link.
    remotes: Vec<(u32, u32, u32)>,
    /// NVML's common-ancestor level to each other device.
    ancestors: Vec<Option<String>>,
}

/// Wiring of all devices, or why it is unknown.
enum Wiring {
    Known {
        addrs: Vec<Option<(u32, u32, u32)>>,
        links: Vec<Result<DeviceLinks, String>>,
    },
    Unknown(String),
}

impl Wiring {
    fn unknown(_n: usize, reason: &str) -> Wiring {
        Wiring::Unknown(reason.to_string())
    }

    fn pair(&self, src: usize, dst: usize) -> Interconnect {
        if src == dst {
            return Interconnect::SameDevice;
        }
        match self {
            Wiring::Unknown(reason) => Interconnect::Unknown {
                reason: reason.clone(),
            },
            Wiring::Known { addrs, links } => classify(addrs, links, src, dst),
        }
    }
}

/// Classify the pair from each device's link remotes: direct links to the other device's address,
/// or links to something that is no GPU of this node on both sides (NVSwitch).
fn classify(
    addrs: &[Option<(u32, u32, u32)>],
    links: &[Result<DeviceLinks, String>],
    src: usize,
    dst: usize,
) -> Interconnect {
    let (a, b) = match (&links[src], &links[dst]) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            return Interconnect::Unknown { reason: e.clone() };
        }
    };
    if let Some(dst_addr) = addrs[dst] {
        let direct = a.remotes.iter().filter(|r| **r == dst_addr).count() as u32;
        if direct > 0 {
            return Interconnect::Nvlink {
                links: direct,
                via_switch: false,
            };
        }
    }
    let is_gpu = |r: &(u32, u32, u32)| addrs.iter().any(|x| x.as_ref() == Some(r));
    let switch_a = a.remotes.iter().filter(|r| !is_gpu(r)).count() as u32;
    let switch_b = b.remotes.iter().filter(|r| !is_gpu(r)).count() as u32;
    if switch_a > 0 && switch_b > 0 {
        return Interconnect::Nvlink {
            links: switch_a.min(switch_b),
            via_switch: true,
        };
    }
    Interconnect::Pcie {
        common_ancestor: a.ancestors.get(dst).cloned().flatten(),
    }
}

/// NVML, opened through nvml-wrapper ([`crate::topology::NVML_LIB`]).
struct Nvml(nvml_wrapper::Nvml);

impl Nvml {
    fn open() -> std::result::Result<Nvml, String> {
        crate::topology::open_nvml().map(Nvml)
    }

    fn handle(
        &self,
        addr: Option<(u32, u32, u32)>,
    ) -> std::result::Result<nvml_wrapper::Device<'_>, String> {
        let (dom, bus, dev) = addr.ok_or("unparsable PCI bus id")?;
        self.0
            .device_by_pci_bus_id(format!("{dom:08x}:{bus:02x}:{dev:02x}.0"))
            .map_err(|e| format!("nvmlDeviceGetHandleByPciBusId: {e}"))
    }

    fn wiring(&self, devices: &[DeviceInfo]) -> Wiring {
        let addrs: Vec<_> = devices
            .iter()
            .map(|d| parse_bus_id(&d.pci_bus_id))
            .collect();
        let links = addrs
            .iter()
            .map(|&a| {
                let h = self.handle(a)?;
                let mut remotes = Vec::new();
                for l in 0..NVML_NVLINK_MAX_LINKS {
                    let link = h.link_wrapper_for(l);
                    if link.is_active().unwrap_or(false)
                        && let Ok(pci) = link.remote_pci_info()
                    {
                        remotes.push((pci.domain, pci.bus, pci.device));
                    }
                }
                let ancestors = addrs
                    .iter()
                    .map(|&o| {
                        let other = self.handle(o).ok()?;
                        h.topology_common_ancestor(other)
                            .ok()
                            .map(|t| format!("{t:?}").to_lowercase())
                    })
                    .collect();
                Ok(DeviceLinks { remotes, ancestors })
            })
            .collect();
        Wiring::Known { addrs, links }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_bus_id_forms() {
        assert_eq!(parse_bus_id("0000:19:00.0"), Some((0, 0x19, 0)));
        assert_eq!(parse_bus_id("00000001:AB:1f.0"), Some((1, 0xab, 0x1f)));
        assert_eq!(parse_bus_id("garbage"), None);
    }

    fn dl(remotes: &[(u32, u32, u32)]) -> Result<DeviceLinks, String> {
        Ok(DeviceLinks {
            remotes: remotes.to_vec(),
            ancestors: vec![None, Some("system".into())],
        })
    }

    #[test]
    fn classifies_direct_switch_and_pcie() {
        let addrs = vec![Some((0, 1, 0)), Some((0, 2, 0))];
        // Direct: four links from GPU0 land on GPU1.
        let direct = vec![dl(&[(0, 2, 0); 4]), dl(&[(0, 1, 0); 4])];
        assert_eq!(
            classify(&addrs, &direct, 0, 1),
            Interconnect::Nvlink {
                links: 4,
                via_switch: false
            }
        );
        // NVSwitch: 18 links each to addresses that are no GPU.
        let sw = vec![dl(&[(0, 9, 0); 18]), dl(&[(0, 10, 0); 18])];
        assert_eq!(
            classify(&addrs, &sw, 0, 1),
            Interconnect::Nvlink {
                links: 18,
                via_switch: true
            }
        );
        let none = vec![dl(&[]), dl(&[])];
        assert_eq!(
            classify(&addrs, &none, 0, 1),
            Interconnect::Pcie {
                common_ancestor: Some("system".into())
            }
        );
        let err = vec![Err("no handle".to_string()), dl(&[])];
        assert!(matches!(
            classify(&addrs, &err, 0, 1),
            Interconnect::Unknown { .. }
        ));
    }

    /// A device as `DeviceInfo::query` might describe it.
    fn device(ordinal: usize) -> DeviceInfo {
        DeviceInfo {
            ordinal,
            name: "GPU".into(),
            pci_bus_id: "0000:01:00.0".into(),
            total_memory_bytes: 1 << 30,
            compute_capability: (9, 0),
            copy_engines: 2,
            dma_buf: true,
            gpudirect_rdma: true,
            gpudirect_rdma_vmm: true,
            rdma_flush_writes_options: 1,
            rdma_writes_ordering: 100,
            stream_mem_ops: true,
            stream_mem_ops_64: true,
            stream_wait_value_nor: true,
            memory_pools: true,
            posix_fd_handles: true,
            host_register: true,
            can_flush_remote_writes: false,
        }
    }

    #[test]
    fn matrix_serializes() {
        let m = LinkMatrix {
            devices: vec![device(0)],
            links: vec![Link {
                src: 0,
                dst: 0,
                can_access: false,
                attributes: P2pAttributes::default(),
                interconnect: Interconnect::SameDevice,
            }],
            nvml_unavailable: None,
        };
        #[cfg(feature = "serde")]
        {
            let j = serde_json::to_string(&m).unwrap();
            assert!(j.contains("\"kind\":\"same_device\""), "{j}");
            let back: LinkMatrix = serde_json::from_str(&j).unwrap();
            assert_eq!(back, m);
        }
        assert!(m.table().contains("0->0"));
        assert_eq!(
            Interconnect::Nvlink {
                links: 18,
                via_switch: false
            }
            .to_string(),
            "NV18"
        );
    }
}
