//! Advice from the health checks, in plain words: one item per finding.

use super::health::{
    PcieLink, Requirement, domain_translates, gpu_ordinal_of as gpu_ordinal, human_bytes,
    parse_link_speed, setting_problem,
};
use super::model::{Advice, NodeReport, say};

fn unmet(r: &Requirement) -> String {
    r.checks
        .iter()
        .filter(|c| c.met == Some(false))
        .map(|c| format!("{} needs {}, found {}", c.item, c.needs, c.found))
        .collect::<Vec<_>>()
        .join("; ")
}

/// A link's bandwidth as a share of its maximum (speed times lanes), in percent. An idle GPU's
/// lowered speed is not counted: without a reading under load its speed is taken as the maximum.
fn link_share(l: &PcieLink) -> Option<u32> {
    let max = l.max_speed.as_deref().and_then(parse_link_speed)?;
    let cur = match (l.kind.as_str(), l.speed_under_load.as_deref()) {
        (_, Some(u)) => parse_link_speed(u)?,
        ("gpu", None) => max,
        _ => l.current_speed.as_deref().and_then(parse_link_speed)?,
    };
    let (cw, mw) = (l.current_width?, l.max_width?);
    Some(((cur * f64::from(cw)) / (max * f64::from(mw)) * 100.0).round() as u32)
}

/// The advice the health section gives about `r`.
pub fn health_advice(r: &NodeReport) -> Vec<Advice> {
    let mut out = Vec::new();
    let h = &r.health;
    let has_gpu = !r.cuda.devices.is_empty();
    let has_nic = r.rdma.devices.iter().any(|d| d.pci_bus_id.is_some());
    let req = |p: &str| h.requirements.iter().find(|q| q.path == p);
    let module = |n: &str| h.modules.iter().find(|m| m.name == n);

    // Driver, kernel and modules.
    if has_gpu && has_nic {
        let dmabuf = req("GPUDirect RDMA by dma-buf");
        let peermem = req("GPUDirect RDMA by nvidia-peermem");
        if let Some(d) = dmabuf.filter(|d| d.met == Some(false)) {
            let fallback = if peermem.is_some_and(|p| p.met == Some(true)) {
                "GPU memory is registered through nvidia-peermem instead".to_string()
            } else {
                format!(
                    "nvidia-peermem is no way either ({})",
                    peermem.map(unmet).unwrap_or_default()
                )
            };
            say(
                &mut out,
                "driver",
                format!(
                    "GPUDirect RDMA by dma-buf is not possible here ({}): {fallback}.",
                    unmet(d)
                ),
            );
        }
        if let Some(m) = module("nvidia_peermem")
            && !m.loaded
            && m.installed == Some(true)
            && dmabuf.is_some_and(|d| d.met != Some(true))
        {
            say(
                &mut out,
                "driver",
                "nvidia-peermem is installed but not loaded: load it (`modprobe nvidia-peermem` as root) so the NIC can register GPU memory.".into(),
            );
        }
    }
    for name in ["nvidia_peermem", "nv_peer_mem", "nvidia_fs"] {
        if let Some(m) = module(name)
            && let Some(last) = m.load_errors.last()
        {
            let why = match name {
                "nvidia_fs" => {
                    "nvidia-fs needs the NVIDIA driver it was built for and, for NVMe, a kernel with the GDS NVMe patches or PCI P2PDMA"
                }
                _ => {
                    "nvidia-peermem needs the peer-memory API of MLNX_OFED or DOCA-OFED; with the kernel's own RDMA stack register GPU memory by dma-buf instead"
                }
            };
            say(
                &mut out,
                "driver",
                format!("The kernel log shows {name} failing ({last}): {why}."),
            );
        }
    }
    if let Some(m) = module("nvidia_fs")
        && m.loaded
        && h.kernel.nvidia_kernel_module.as_deref() == Some("proprietary")
    {
        say(
            &mut out,
            "driver",
            "nvidia-fs is loaded with NVIDIA's proprietary kernel modules: nvidia-fs 2.17.5 and newer support only the open kernel modules.".into(),
        );
    }
    if has_gpu
        && r.storage.mode != "gds"
        && req("GPUDirect Storage by PCI P2PDMA").is_some_and(|q| q.met == Some(true))
    {
        say(
            &mut out,
            "driver",
            "This node meets the requirements of GPUDirect Storage through PCI P2PDMA (NVMe without nvidia-fs): see NVIDIA's guide to GDS with P2PDMA for the driver and cuFile settings.".into(),
        );
    }

    // PCIe links.
    for l in &h.pcie.links {
        let share = link_share(l)
            .map(|s| format!(" (about {s}% of its bandwidth)"))
            .unwrap_or_default();
        if l.width_degraded {
            say(
                &mut out,
                "pcie",
                format!(
                    "{}'s PCIe link runs x{} of x{} lanes{share}: reseat the card, check the slot or riser, and the BIOS lane (bifurcation) settings.",
                    l.device,
                    l.current_width.unwrap_or(0),
                    l.max_width.unwrap_or(0)
                ),
            );
        }
        if l.speed_degraded {
            say(
                &mut out,
                "pcie",
                format!(
                    "{}'s PCIe link trained at {} of {}{}{share}: check the slot, riser and cables, and the BIOS PCIe generation setting.",
                    l.device,
                    l.speed_seen().unwrap_or("?"),
                    l.max_speed.as_deref().unwrap_or("?"),
                    if l.speed_under_load.is_some() {
                        " while copies ran"
                    } else {
                        ""
                    }
                ),
            );
        } else if l.kind == "gpu"
            && l.speed_under_load.is_none()
            && let (Some(c), Some(m)) = (
                l.current_speed.as_deref().and_then(parse_link_speed),
                l.max_speed.as_deref().and_then(parse_link_speed),
            )
            && c < m
        {
            say(
                &mut out,
                "pcie",
                format!(
                    "{}'s PCIe link is at {} of {} while idle: GPUs lower their link speed when idle; run the probe with measurements (the default) to read it under load.",
                    l.device,
                    l.current_speed.as_deref().unwrap_or("?"),
                    l.max_speed.as_deref().unwrap_or("?")
                ),
            );
        }
    }

    // ACS.
    let mut acs_unknown = Vec::new();
    for p in &h.pcie.paths {
        if p.kind == "gpu-gpu"
            && let (Some(a), Some(b)) = (gpu_ordinal(&p.from), gpu_ordinal(&p.to))
            && r.p2p.on_nvlink(a, b)
        {
            continue;
        }
        match p.acs_redirects {
            Some(true) => {
                let on: Vec<String> = p
                    .bridges
                    .iter()
                    .filter(|b| b.redirects == Some(true))
                    .map(|b| format!("{} ({})", b.pci_bus_id, b.flags.join(" ")))
                    .collect();
                say(
                    &mut out,
                    "pcie",
                    format!(
                        "ACS on {} sends traffic between {} and {} up to the root complex instead of across their shared {}: peer-to-peer bandwidth drops. Turn ACS redirection off on those ports (a BIOS setting, or setpci as root after each boot) unless VMs need the isolation.",
                        on.join(", "),
                        p.from,
                        p.to,
                        p.meets_at
                    ),
                );
            }
            None if p.error.is_none() => acs_unknown.push(format!("{}-{}", p.from, p.to)),
            _ => {}
        }
    }
    if !acs_unknown.is_empty() {
        say(
            &mut out,
            "pcie",
            format!(
                "ACS on the switch ports between {} could not be read (the extended config space needs root): run the probe as root to check whether ACS redirects their peer traffic.",
                acs_unknown.join(", ")
            ),
        );
    }

    // IOMMU.
    let translated: Vec<String> = h
        .pcie
        .links
        .iter()
        .filter_map(|l| {
            let d = l.iommu_domain.as_deref()?;
            domain_translates(d).then(|| {
                format!(
                    "{} (group {}, {d})",
                    l.device,
                    l.iommu_group.map_or("?".into(), |g| g.to_string())
                )
            })
        })
        .collect();
    if !translated.is_empty() {
        say(
            &mut out,
            "iommu",
            format!(
                "The IOMMU translates DMA addresses for {}: GPUDirect RDMA and PCIe peer-to-peer need it off or in passthrough (NVIDIA's GPUDirect RDMA guide); boot with iommu=pt.",
                translated.join(", ")
            ),
        );
    }

    // NVLink.
    for g in &h.nvlink.gpus {
        let down = g.links_where(|l| l.down);
        if !down.is_empty() {
            say(
                &mut out,
                "nvlink",
                format!(
                    "GPU {}: NVLink {} down while {} others are up: bandwidth to the GPUs they reach is lower. Check `nvidia-smi nvlink -s`, the fabric manager (NVSwitch systems), then the hardware.",
                    g.gpu,
                    down.join(", "),
                    g.active_links
                ),
            );
        }
        let n = |v: Option<u64>| v.map_or("-".into(), |v| v.to_string());
        for l in g.links.iter().filter(|l| l.counting_errors) {
            let e = &l.errors;
            say(
                &mut out,
                "nvlink",
                format!(
                    "GPU {} NVLink {} counts replay or recovery errors (replay {}, recovery {}; CRC flit {}, CRC data {}): the link retransmits or retrains, which costs bandwidth. Watch whether they grow (`nvidia-smi nvlink -e`); a growing count means a marginal link to report to the hardware vendor.",
                    g.gpu,
                    l.link,
                    n(e.replay),
                    n(e.recovery),
                    n(e.crc_flit),
                    n(e.crc_data)
                ),
            );
        }
        for l in g.links.iter().filter(|l| l.errors_grew == Some(true)) {
            let (Some(b), e) = (&l.errors_before, &l.errors) else {
                continue;
            };
            let changes: Vec<String> = [
                ("replay", b.replay, e.replay),
                ("recovery", b.recovery, e.recovery),
            ]
            .into_iter()
            .filter_map(|(what, b, a)| match (b, a) {
                (Some(b), Some(a)) if a > b => Some(format!("{what} {b} -> {a}")),
                _ => None,
            })
            .collect();
            say(
                &mut out,
                "nvlink",
                format!(
                    "GPU {} NVLink {}'s replay/recovery counters grew while the probe's copies ran ({}): a marginal link. Check it under load with `nvidia-smi nvlink -e`, and report it to the hardware vendor if it keeps growing.",
                    g.gpu,
                    l.link,
                    changes.join(", ")
                ),
            );
        }
    }

    // Limits and configuration.
    let m = &h.memlock;
    if m.low {
        let hard = if m.hard_unlimited {
            "unlimited".to_string()
        } else {
            m.hard_bytes.map_or("?".into(), human_bytes)
        };
        say(
            &mut out,
            "limits",
            format!(
                "The locked-memory limit (ulimit -l) is {} (hard limit {hard}): RDMA can register at most that much host memory per process. Raise it: `ulimit -l unlimited` in the job's shell (up to the hard limit), `* - memlock unlimited` in /etc/security/limits.conf, LimitMEMLOCK=infinity for a systemd service, `--ulimit memlock=-1` for a container.",
                m.soft_bytes.map_or("?".into(), human_bytes)
            ),
        );
    }
    let c = &h.cufile_config;
    if c.source == "CUFILE_ENV_PATH_JSON" && !c.exists {
        say(
            &mut out,
            "storage",
            format!(
                "CUFILE_ENV_PATH_JSON names {}, which does not exist: cuFile uses its built-in defaults.",
                c.path
            ),
        );
    }
    if let Some(e) = &c.error {
        say(&mut out, "storage", format!("cuFile configuration: {e}."));
    }
    if r.storage.mode != "gds"
        && has_gpu
        && c.values
            .iter()
            .any(|v| v.key == "properties.allow_compat_mode" && v.value == "false")
    {
        say(
            &mut out,
            "storage",
            format!(
                "{} sets allow_compat_mode to false and nvidia-fs is not loaded: cuFile cannot open files; set it to true or load nvidia-fs.",
                c.path
            ),
        );
    }

    // Settings.
    let any_nvlink = r.p2p.pairs.iter().any(|p| p.nvlink_links.is_some());
    for s in &r.settings {
        let Some(v) = s.value.as_deref() else {
            continue;
        };
        if let Some(problem) = setting_problem(&s.name, v) {
            say(&mut out, "settings", format!("{problem}."));
            continue;
        }
        match (s.name.as_str(), v.trim()) {
            ("NCCL_P2P_DISABLE", "1") if any_nvlink => say(
                &mut out,
                "settings",
                "NCCL_P2P_DISABLE=1 turns off P2P although NVLink is present.".into(),
            ),
            ("NCCL_MAX_NCHANNELS", n) if n.parse::<u32>().is_ok_and(|n| n <= 2) => say(
                &mut out,
                "settings",
                format!(
                    "NCCL_MAX_NCHANNELS={n}: NCCL runs at most {n} channels, too few to fill NVLink or a fast NIC."
                ),
            ),
            _ => {}
        }
    }
    out
}
