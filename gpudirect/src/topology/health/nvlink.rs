//! NVLink per link: state, version, speed and error counters through NVML, behind a small trait
//! so tests answer for NVML; and which links are down or counting errors.

use super::{NvlinkErrors, NvlinkGpu, NvlinkHealth, NvlinkLink};

/// NVML's most NVLinks per GPU (`NVML_NVLINK_MAX_LINKS`).
pub const MAX_LINKS: u32 = 18;

/// One link as NVML answers for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvlinkReading {
    /// The link index.
    pub link: u32,
    /// `nvmlDeviceGetNvLinkState`: `Ok(true)` active; `Err` with NVML's error.
    pub active: Result<bool, String>,
    /// `nvmlDeviceGetNvLinkVersion`.
    pub version: Option<u32>,
    /// Link speed in MB/s (NVML's `NVML_FI_DEV_NVLINK_SPEED_MBPS_*` fields).
    pub speed_mbps: Option<u32>,
    /// `nvmlDeviceGetNvLinkRemotePciInfo_v2`, as sysfs spells a PCI address.
    pub remote_pci_bus_id: Option<String>,
    /// `nvmlDeviceGetNvLinkErrorCounter`, each `None` where NVML does not count it.
    pub errors: NvlinkErrors,
}

/// NVML's answer for one GPU: `NVML_FI_DEV_NVLINK_LINK_COUNT` (`None`: NVML did not say) and
/// each link in order; `Err` when NVML has no handle for the GPU.
pub type NvlinkAnswer = Result<(Option<u32>, Vec<NvlinkReading>), String>;

/// What the report asks NVML. The real one is [`open_nvml`]; tests give their own answers.
pub trait NvmlSource {
    /// The NVIDIA driver version NVML reports (`nvmlSystemGetDriverVersion`).
    fn driver_version(&self) -> Option<String>;
    /// The links of the GPU at `bus_id` (sysfs' form of a PCI address).
    fn nvlinks(&self, bus_id: &str) -> NvlinkAnswer;
}

/// NVML is not there: every answer says why.
pub struct NoNvml(pub String);

impl NvmlSource for NoNvml {
    fn driver_version(&self) -> Option<String> {
        None
    }
    fn nvlinks(&self, _bus_id: &str) -> NvlinkAnswer {
        Err(self.0.clone())
    }
}

/// NVML through nvml-wrapper, opened as the link matrix opens it.
struct RealNvml(nvml_wrapper::Nvml);

/// Open NVML for the report; `Err` with the reason (and then [`NoNvml`] answers).
pub fn open_nvml() -> Result<Box<dyn NvmlSource>, String> {
    crate::p2p::link::open_nvml().map(|n| Box::new(RealNvml(n)) as Box<dyn NvmlSource>)
}

/// The per-link speed fields NVML has (links 0 to 11).
fn speed_field(link: u32) -> Option<u32> {
    use nvml_wrapper::sys_exports::field_id::*;
    Some(match link {
        0 => NVML_FI_DEV_NVLINK_SPEED_MBPS_L0,
        1 => NVML_FI_DEV_NVLINK_SPEED_MBPS_L1,
        2 => NVML_FI_DEV_NVLINK_SPEED_MBPS_L2,
        3 => NVML_FI_DEV_NVLINK_SPEED_MBPS_L3,
        4 => NVML_FI_DEV_NVLINK_SPEED_MBPS_L4,
        5 => NVML_FI_DEV_NVLINK_SPEED_MBPS_L5,
        6 => NVML_FI_DEV_NVLINK_SPEED_MBPS_L6,
        7 => NVML_FI_DEV_NVLINK_SPEED_MBPS_L7,
        8 => NVML_FI_DEV_NVLINK_SPEED_MBPS_L8,
        9 => NVML_FI_DEV_NVLINK_SPEED_MBPS_L9,
        10 => NVML_FI_DEV_NVLINK_SPEED_MBPS_L10,
        11 => NVML_FI_DEV_NVLINK_SPEED_MBPS_L11,
        _ => return None,
    })
}

fn sample_u64(s: &nvml_wrapper::struct_wrappers::device::FieldValueSample) -> Option<u64> {
    use nvml_wrapper::enums::device::SampleValue;
    match s.value.as_ref().ok()? {
        SampleValue::U32(v) => Some(u64::from(*v)),
        SampleValue::U64(v) => Some(*v),
        SampleValue::I64(v) => u64::try_from(*v).ok(),
        SampleValue::F64(v) => (*v >= 0.0).then_some(*v as u64),
    }
}

impl NvmlSource for RealNvml {
    fn driver_version(&self) -> Option<String> {
        self.0.sys_driver_version().ok()
    }

    fn nvlinks(&self, bus_id: &str) -> NvlinkAnswer {
        use nvml_wrapper::enum_wrappers::nv_link::ErrorCounter;
        use nvml_wrapper::error::NvmlError;
        use nvml_wrapper::structs::device::FieldId;
        use nvml_wrapper::sys_exports::field_id::*;
        let (dom, rest) = bus_id.split_once(':').ok_or("unparsable PCI bus id")?;
        let dom = u32::from_str_radix(dom, 16).map_err(|e| format!("PCI bus id {bus_id}: {e}"))?;
        let dev = self
            .0
            .device_by_pci_bus_id(format!("{dom:08x}:{rest}"))
            .map_err(|e| format!("nvmlDeviceGetHandleByPciBusId: {e}"))?;
        let mut ids = vec![
            FieldId(NVML_FI_DEV_NVLINK_LINK_COUNT),
            FieldId(NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON),
        ];
        ids.extend((0..12).filter_map(speed_field).map(FieldId));
        let fields = dev.field_values_for(&ids).unwrap_or_default();
        let field = |id: u32| {
            fields
                .iter()
                .filter_map(|f| f.as_ref().ok())
                .find(|f| f.field.0 == id)
                .and_then(sample_u64)
        };
        let count = field(NVML_FI_DEV_NVLINK_LINK_COUNT).and_then(|c| u32::try_from(c).ok());
        let common = field(NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON)
            .and_then(|c| u32::try_from(c).ok())
            .filter(|c| *c > 0);
        let mut links = Vec::new();
        for l in 0..count.unwrap_or(MAX_LINKS).min(MAX_LINKS) {
            let link = dev.link_wrapper_for(l);
            let active = match link.is_active() {
                Ok(a) => Ok(a),
                // Past the GPU's links (when NVML did not give the count): stop.
                Err(NvmlError::InvalidArg) if count.is_none() => break,
                Err(NvmlError::NotSupported) if count.is_none() && l == 0 => break,
                Err(e) => Err(e.to_string()),
            };
            let counter = |c| link.error_counter(c).ok();
            links.push(NvlinkReading {
                link: l,
                version: link.version().ok(),
                speed_mbps: speed_field(l)
                    .and_then(field)
                    .and_then(|s| u32::try_from(s).ok())
                    .filter(|s| *s > 0)
                    .or(common),
                remote_pci_bus_id: if active == Ok(true) {
                    link.remote_pci_info()
                        .ok()
                        .map(|p| crate::topology::sysfs::normalize_bus_id(&p.bus_id))
                } else {
                    None
                },
                errors: NvlinkErrors {
                    replay: counter(ErrorCounter::DlReplay),
                    recovery: counter(ErrorCounter::DlRecovery),
                    crc_flit: counter(ErrorCounter::DlCrcFlit),
                    crc_data: counter(ErrorCounter::DlCrcData),
                },
                active,
            });
        }
        Ok((count, links))
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

/// One GPU's links, classified: a link is `down` when it is inactive while another link of the
/// same GPU is up (all inactive means no NVLink is connected, which is not a fault), and
/// `counting_errors` when any error counter is above zero.
pub fn classify_gpu(gpu: usize, bus_id: &str, answer: NvlinkAnswer) -> NvlinkGpu {
    let (link_count, readings) = match answer {
        Ok(a) => a,
        Err(e) => {
            return NvlinkGpu {
                gpu,
                pci_bus_id: bus_id.into(),
                link_count: None,
                active_links: 0,
                links: Vec::new(),
                error: Some(e),
            };
        }
    };
    let active = readings.iter().filter(|r| r.active == Ok(true)).count() as u32;
    let links = readings
        .into_iter()
        .map(|r| {
            let state = match &r.active {
                Ok(true) => "up".to_string(),
                Ok(false) => "down".to_string(),
                Err(e) => format!("unknown ({e})"),
            };
            NvlinkLink {
                link: r.link,
                down: r.active == Ok(false) && active > 0,
                counting_errors: r.errors.total() > 0,
                state,
                version: r.version,
                speed_mbps: r.speed_mbps,
                remote_pci_bus_id: r.remote_pci_bus_id,
                errors: r.errors,
            }
        })
        .collect();
    NvlinkGpu {
        gpu,
        pci_bus_id: bus_id.into(),
        link_count,
        active_links: active,
        links,
        error: None,
    }
}

/// Every GPU's links through `nvml`; `absent_reason` when NVML could not be opened or there is
/// no GPU.
pub fn nvlink_health(
    gpus: &[(usize, String)],
    nvml: Result<&dyn NvmlSource, String>,
) -> NvlinkHealth {
    if gpus.is_empty() {
        return NvlinkHealth {
            gpus: Vec::new(),
            absent_reason: Some("no GPU".into()),
        };
    }
    match nvml {
        Err(why) => NvlinkHealth {
            gpus: Vec::new(),
            absent_reason: Some(why),
        },
        Ok(n) => NvlinkHealth {
            gpus: gpus
                .iter()
                .map(|(g, bus)| classify_gpu(*g, bus, n.nvlinks(bus)))
                .collect(),
            absent_reason: None,
        },
    }
}
