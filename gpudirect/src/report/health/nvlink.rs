//! NVLink per link: state, version, speed, the remote end and error counters through NVML,
//! behind a small trait so tests answer for NVML; and which links are degraded.
//!
//! A healthy link counts CRC errors and corrects them, with no replay and no recovery
//! (docs/probe-schema.md gives the counts seen), so CRC counts are shown, not flagged. A link is
//! degraded when it is down while others are up, when its replay or recovery counter is above
//! zero, or when any of its counters grows while the probe's own copies run.

use super::model::{NvlinkErrors, NvlinkGpu, NvlinkHealth, NvlinkLink};
use crate::topology::normalize_bus_id;
use std::collections::HashMap;

/// NVML's most NVLinks per GPU (`NVML_NVLINK_MAX_LINKS`).
pub(super) const MAX_LINKS: u32 = 18;

/// One link as NVML answers for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvlinkReading {
    /// The link index.
    pub link: u32,
    /// `nvmlDeviceGetNvLinkState`: `Ok(true)` active; `Err` with NVML's error.
    pub active: Result<bool, String>,
    /// `nvmlDeviceGetNvLinkVersion`.
    pub version: Option<u32>,
    /// Link speed in 10⁶ bytes per second (NVML's `NVML_FI_DEV_NVLINK_SPEED_MBPS_*` fields).
    pub speed_mbps: Option<u32>,
    /// `nvmlDeviceGetNvLinkRemotePciInfo_v2`, as sysfs spells a PCI address (NVML's
    /// `ffff:ff:ff.0` placeholder included: the report drops it).
    pub remote_pci_bus_id: Option<String>,
    /// `nvmlDeviceGetNvLinkRemoteDeviceType`; `None` where NVML does not say (or says unknown).
    pub remote_device_type: Option<NvlinkRemote>,
    /// `nvmlDeviceGetNvLinkErrorCounter`, each `None` where NVML does not count it.
    pub errors: NvlinkErrors,
}

/// What NVML says is at the other end of a link (`nvmlIntNvLinkDeviceType_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NvlinkRemote {
    /// `NVML_NVLINK_DEVICE_TYPE_GPU`.
    Gpu,
    /// `NVML_NVLINK_DEVICE_TYPE_SWITCH`: an NVSwitch.
    Switch,
    /// `NVML_NVLINK_DEVICE_TYPE_IBMNPU`.
    IbmNpu,
}

impl NvlinkRemote {
    /// From NVML's value; `None` for `NVML_NVLINK_DEVICE_TYPE_UNKNOWN` (255) and anything else.
    pub fn from_raw(v: u32) -> Option<NvlinkRemote> {
        match v {
            0 => Some(NvlinkRemote::Gpu),
            1 => Some(NvlinkRemote::IbmNpu),
            2 => Some(NvlinkRemote::Switch),
            _ => None,
        }
    }

    /// How the report names it.
    pub fn name(self) -> &'static str {
        match self {
            NvlinkRemote::Gpu => "GPU",
            NvlinkRemote::Switch => "NVSwitch",
            NvlinkRemote::IbmNpu => "IBM NPU",
        }
    }
}

/// NVML's answer for one GPU: `NVML_FI_DEV_NVLINK_LINK_COUNT` (`None`: NVML did not say) and
/// each link in order; `Err` when NVML has no handle for the GPU.
pub type NvlinkAnswer = Result<(Option<u32>, Vec<NvlinkReading>), String>;

/// What the report asks NVML. The report opens the real one (through nvml-wrapper); tests give
/// their own answers.
pub trait NvmlSource {
    /// The NVIDIA driver version NVML reports (`nvmlSystemGetDriverVersion`).
    fn driver_version(&self) -> Option<String>;
    /// The links of the GPU at `bus_id` (sysfs' form of a PCI address).
    ///
    /// # Errors
    ///
    /// Why NVML has no answer for that GPU (no handle for the address, NVML not usable); the
    /// report shows it as the GPU's NVLink error.
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

/// Open NVML for the report.
///
/// # Errors
///
/// Why NVML cannot be used (no `libnvidia-ml.so.1`, no driver); the report records it.
pub fn open_nvml() -> Result<Box<dyn NvmlSource>, String> {
    crate::topology::open_nvml().map(|n| Box::new(RealNvml(n)) as Box<dyn NvmlSource>)
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
            let remote_device_type = if active == Ok(true) {
                remote_type(&self.0, &dev, l)
            } else {
                None
            };
            links.push(NvlinkReading {
                remote_device_type,
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
                        .map(|p| normalize_bus_id(&p.bus_id))
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

/// `nvmlDeviceGetNvLinkRemoteDeviceType` called directly: nvml-wrapper's `remote_device_type`
/// passes the address of a temporary and so always answers `Unknown`.
fn remote_type(
    nvml: &nvml_wrapper::Nvml,
    dev: &nvml_wrapper::Device<'_>,
    link: u32,
) -> Option<NvlinkRemote> {
    let f = nvml
        .lib()
        .nvmlDeviceGetNvLinkRemoteDeviceType
        .as_ref()
        .ok()?;
    let mut t: u32 = 255;
    // SAFETY: a live device handle of this NVML instance, a link index NVML checks, and one
    // valid out-pointer of the enum's type (an unsigned int).
    let r = unsafe { f(dev.handle(), link, &mut t) };
    (r == 0).then(|| NvlinkRemote::from_raw(t)).flatten()
}

/// NVLink error counters read at one moment, per GPU (by PCI address) and link: taken before the
/// probe's own measurements, to tell whether they grow meanwhile.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NvlinkCounters {
    /// Each GPU's links and their counters; a GPU NVML did not answer for is absent.
    pub gpus: HashMap<String, Vec<(u32, NvlinkErrors)>>,
}

impl NvlinkCounters {
    /// Read every link's counters of the GPUs at `bus_ids` through `nvml`.
    pub fn read(nvml: &dyn NvmlSource, bus_ids: &[String]) -> NvlinkCounters {
        NvlinkCounters {
            gpus: bus_ids
                .iter()
                .filter_map(|b| {
                    let (_, links) = nvml.nvlinks(b).ok()?;
                    Some((
                        b.clone(),
                        links.into_iter().map(|r| (r.link, r.errors)).collect(),
                    ))
                })
                .collect(),
        }
    }

    /// The counters of GPU `bus_id`'s link `link`, when read.
    pub fn link(&self, bus_id: &str, link: u32) -> Option<&NvlinkErrors> {
        self.gpus
            .get(bus_id)?
            .iter()
            .find(|(l, _)| *l == link)
            .map(|(_, e)| e)
    }
}

/// Whether the replay or recovery counter grew from `before` to `after`. CRC counters are left
/// out: on healthy links the corrected CRC data count grows with traffic (the probe's own copies
/// made it grow), so its growth says nothing about the link. `None` when neither counter
/// can be compared (not counted either time), or when one went down without the other growing
/// (the counters were reset meanwhile: growth cannot be told).
pub(super) fn grew(before: &NvlinkErrors, after: &NvlinkErrors) -> Option<bool> {
    let pairs = [
        (before.replay, after.replay),
        (before.recovery, after.recovery),
    ];
    let (mut compared, mut up, mut down) = (false, false, false);
    for (b, a) in pairs {
        if let (Some(b), Some(a)) = (b, a) {
            compared = true;
            up |= a > b;
            down |= a < b;
        }
    }
    match (compared, up, down) {
        (false, _, _) => None,
        (true, true, _) => Some(true),
        (true, false, true) => None,
        (true, false, false) => Some(false),
    }
}

/// A remote PCI address NVML gave, or `None` for its placeholders: an all-ones domain
/// (`ffff:ff:ff.0`), a device number past 31 (a bus has 32), or an unparsable one.
pub(super) fn known_pci(id: &str) -> Option<String> {
    let id = normalize_bus_id(id);
    let (dom, rest) = id.split_once(':')?;
    let (bus, devfn) = rest.split_once(':')?;
    let (dev, func) = devfn.split_once('.')?;
    let all_ones = |s: &str| !s.is_empty() && s.bytes().all(|b| b == b'f');
    let dev_n = u8::from_str_radix(dev, 16).ok()?;
    u16::from_str_radix(dom, 16).ok()?;
    u8::from_str_radix(bus, 16).ok()?;
    u8::from_str_radix(func, 16).ok()?;
    if all_ones(dom) || dev_n > 0x1f {
        return None;
    }
    Some(id)
}

/// What is at the other end of a link: `GPU n` when the address is a local GPU's (`gpus`:
/// ordinal and PCI address), else NVML's device type.
fn remote_device(
    pci: Option<&str>,
    kind: Option<NvlinkRemote>,
    gpus: &[(usize, String)],
) -> Option<String> {
    if let Some(p) = pci
        && matches!(kind, None | Some(NvlinkRemote::Gpu))
        && let Some((g, _)) = gpus.iter().find(|(_, b)| normalize_bus_id(b) == p)
    {
        return Some(format!("GPU {g}"));
    }
    kind.map(|k| k.name().to_string())
}

/// One GPU's links, classified: a link is `down` when it is inactive while another link of the
/// same GPU is up (all inactive means no NVLink is connected, which is not a fault);
/// `counting_errors` when its replay or recovery counter is above zero (CRC counts are corrected
/// by the link and only shown); `errors_grew` from `before` (the counters read before the probe's
/// measurements; `None`: not measured). `gpus` (ordinal, PCI address) names remote GPUs.
pub(super) fn classify_gpu(
    gpu: usize,
    bus_id: &str,
    answer: NvlinkAnswer,
    before: Option<&NvlinkCounters>,
    gpus: &[(usize, String)],
) -> NvlinkGpu {
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
            let errors_before = before.and_then(|b| b.link(bus_id, r.link)).cloned();
            let errors_grew = errors_before.as_ref().and_then(|b| grew(b, &r.errors));
            let remote_pci_bus_id = r.remote_pci_bus_id.as_deref().and_then(known_pci);
            NvlinkLink {
                link: r.link,
                down: r.active == Ok(false) && active > 0,
                counting_errors: r.errors.replay.unwrap_or(0) > 0
                    || r.errors.recovery.unwrap_or(0) > 0,
                errors_grew,
                state,
                version: r.version,
                speed_mbps: r.speed_mbps,
                remote_device: remote_device(
                    remote_pci_bus_id.as_deref(),
                    r.remote_device_type,
                    gpus,
                ),
                remote_pci_bus_id,
                errors: r.errors,
                errors_before,
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

/// Every GPU's links through `nvml`, with the counters read `before` the probe's measurements
/// (`None`: not measured); `absent_reason` when NVML could not be opened or there is no GPU.
pub fn nvlink_health(
    gpus: &[(usize, String)],
    nvml: Result<&dyn NvmlSource, String>,
    before: Option<&NvlinkCounters>,
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
                .map(|(g, bus)| classify_gpu(*g, bus, n.nvlinks(bus), before, gpus))
                .collect(),
            absent_reason: None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errs(replay: u64, recovery: u64, flit: u64, data: u64) -> NvlinkErrors {
        NvlinkErrors {
            replay: Some(replay),
            recovery: Some(recovery),
            crc_flit: Some(flit),
            crc_data: Some(data),
        }
    }

    /// A link as NVML answered on a real node: up, speed unknown, remote `ffff:ff:ff.0`, CRC data
    /// counts.
    fn h200_link(link: u32, crc_data: u64) -> NvlinkReading {
        NvlinkReading {
            link,
            active: Ok(true),
            version: Some(4),
            speed_mbps: None,
            remote_pci_bus_id: Some("ffff:ff:ff.0".into()),
            remote_device_type: None,
            errors: errs(0, 0, 0, crc_data),
        }
    }

    #[test]
    fn placeholder_remote_addresses_are_unknown() {
        assert_eq!(known_pci("ffff:ff:ff.0"), None);
        assert_eq!(known_pci("FFFFFFFF:FF:FF.0"), None);
        assert_eq!(known_pci("ffff:19:00.0"), None, "all-ones domain");
        assert_eq!(known_pci("0000:19:20.0"), None, "device 0x20 past 31");
        assert_eq!(known_pci("garbage"), None);
        assert_eq!(known_pci("0000:19:00.0").as_deref(), Some("0000:19:00.0"));
        assert_eq!(
            known_pci("00000000:19:00.0").as_deref(),
            Some("0000:19:00.0"),
            "NVML's 8-digit domain"
        );
        // Bus 0xff exists on some hosts: kept when the rest is real.
        assert_eq!(known_pci("0000:ff:1e.3").as_deref(), Some("0000:ff:1e.3"));
    }

    #[test]
    fn growth_is_told_only_from_comparable_counters() {
        assert_eq!(grew(&errs(0, 0, 0, 5), &errs(0, 0, 0, 5)), Some(false));
        // Corrected CRC counts grow with traffic on healthy links: not growth that matters.
        assert_eq!(grew(&errs(0, 0, 0, 5), &errs(0, 0, 0, 9)), Some(false));
        assert_eq!(grew(&errs(0, 0, 3, 5), &errs(0, 0, 7, 9)), Some(false));
        assert_eq!(grew(&errs(1, 0, 0, 0), &errs(2, 0, 0, 0)), Some(true));
        assert_eq!(grew(&errs(0, 1, 0, 0), &errs(0, 4, 0, 0)), Some(true));
        // Reset meanwhile: cannot tell, unless the other counter grew.
        assert_eq!(grew(&errs(3, 0, 0, 0), &errs(1, 0, 0, 0)), None);
        assert_eq!(grew(&errs(3, 0, 0, 9), &errs(1, 2, 0, 5)), Some(true));
        assert_eq!(grew(&NvlinkErrors::default(), &errs(0, 0, 0, 1)), None);
    }

    #[test]
    fn crc_counts_on_healthy_links_are_not_flagged() {
        let links: Vec<NvlinkReading> = (0..18)
            .map(|l| h200_link(l, 3 + 3 * u64::from(l)))
            .collect();
        let gpus = [
            (0, "0000:05:00.0".to_string()),
            (1, "0000:19:00.0".to_string()),
        ];
        let g = classify_gpu(0, "0000:05:00.0", Ok((Some(18), links)), None, &gpus);
        assert_eq!(g.active_links, 18);
        for l in &g.links {
            assert!(!l.degraded(), "{l:?}");
            assert_eq!(l.errors_grew, None, "not measured");
            assert_eq!(l.remote_pci_bus_id, None, "the placeholder is dropped");
            assert_eq!(l.remote_device, None);
            assert_eq!(l.errors.crc_data, Some(3 + 3 * u64::from(l.link)));
        }
    }

    #[test]
    fn replays_recoveries_growth_and_down_links_are_flagged() {
        let mut links: Vec<NvlinkReading> = (0..6).map(|l| h200_link(l, 10)).collect();
        links[1].errors.replay = Some(1);
        links[2].errors.recovery = Some(2);
        links[3].active = Ok(false);
        let before_fake = |crc4: u64| {
            let mut b: Vec<NvlinkReading> = (0..6).map(|l| h200_link(l, 10)).collect();
            b[4].errors.crc_data = Some(crc4);
            b
        };
        struct One(Vec<NvlinkReading>);
        impl NvmlSource for One {
            fn driver_version(&self) -> Option<String> {
                None
            }
            fn nvlinks(&self, _: &str) -> NvlinkAnswer {
                Ok((Some(6), self.0.clone()))
            }
        }
        // Link 4 counted 7 CRC errors before the probe and 10 after: corrected CRC errors that
        // grow with traffic are not flagged.
        let before = NvlinkCounters::read(&One(before_fake(7)), &["0000:05:00.0".into()]);
        let g = classify_gpu(0, "0000:05:00.0", Ok((Some(6), links)), Some(&before), &[]);
        let flags: Vec<(u32, bool, bool, Option<bool>)> = g
            .links
            .iter()
            .map(|l| (l.link, l.down, l.counting_errors, l.errors_grew))
            .collect();
        assert_eq!(
            flags,
            [
                (0, false, false, Some(false)),
                (1, false, true, Some(true)),
                (2, false, true, Some(true)),
                (3, true, false, Some(false)),
                (4, false, false, Some(false)),
                (5, false, false, Some(false)),
            ]
        );
        assert_eq!(g.links[4].errors_before, Some(errs(0, 0, 0, 7)));
        // All links down: no NVLink connected, not a fault.
        let all_down: Vec<NvlinkReading> = (0..2)
            .map(|l| NvlinkReading {
                active: Ok(false),
                ..h200_link(l, 0)
            })
            .collect();
        let g = classify_gpu(0, "b", Ok((Some(2), all_down)), None, &[]);
        assert!(g.links.iter().all(|l| !l.degraded()));
    }

    #[test]
    fn remote_gpus_are_named_by_address_or_type() {
        let gpus = [
            (0, "0000:05:00.0".to_string()),
            (1, "0000:19:00.0".to_string()),
        ];
        assert_eq!(
            remote_device(Some("0000:19:00.0"), Some(NvlinkRemote::Gpu), &gpus).as_deref(),
            Some("GPU 1")
        );
        assert_eq!(
            remote_device(Some("0000:19:00.0"), None, &gpus).as_deref(),
            Some("GPU 1")
        );
        assert_eq!(
            remote_device(Some("0000:c3:00.0"), Some(NvlinkRemote::Gpu), &gpus).as_deref(),
            Some("GPU")
        );
        assert_eq!(
            remote_device(None, Some(NvlinkRemote::Switch), &gpus).as_deref(),
            Some("NVSwitch")
        );
        assert_eq!(remote_device(Some("0000:c3:00.0"), None, &gpus), None);
        assert_eq!(remote_device(None, None, &gpus), None);
        assert_eq!(NvlinkRemote::from_raw(2), Some(NvlinkRemote::Switch));
        assert_eq!(NvlinkRemote::from_raw(255), None);
    }
}
