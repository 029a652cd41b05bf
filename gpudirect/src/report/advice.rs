//! The decision rules: from a gathered report to advice in plain words, and each section's
//! one-line verdict. Pure functions of the report, so they are tested with fake reports.

use super::health_advice::health_advice;
use super::model::{
    Advice, AsyncSection, CudaSection, EnvSetting, GpuAsync, NodeReport, P2pSection, RdmaSection,
    StorageSection, say,
};
use crate::topology::Affinity;

const SETTINGS: [(&str, &str); 6] = [
    (
        "NCCL_P2P_LEVEL",
        "the farthest GPU-to-GPU distance at which NCCL uses P2P (LOC, NVL, PIX, PXB, PHB, SYS); unset lets NCCL decide from the topology",
    ),
    (
        "NCCL_P2P_DISABLE",
        "1 turns off NCCL's P2P transport (NVLink and PCIe peer access); NCCL then copies through host memory",
    ),
    (
        "NCCL_IB_DISABLE",
        "1 turns off NCCL's InfiniBand/RoCE transport (and with it GPUDirect RDMA); NCCL then falls back to TCP sockets",
    ),
    (
        "NCCL_MAX_NCHANNELS",
        "the most channels (parallel rings or trees, each on its own SMs) NCCL uses; unset lets NCCL choose; fewer channels leave SMs to compute but lower bandwidth",
    ),
    (
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "hardware work queues per GPU (default 8): more lets more streams run concurrently; 1 makes kernels and copies start in issue order, which some compute/communication overlap schemes rely on",
    ),
    (
        "CUFILE_ENV_PATH_JSON",
        "the cuFile configuration file to read instead of /etc/cufile.json",
    ),
];

/// The settings worth checking, read through `get` (`std::env::var` for the real ones).
pub fn settings_from_env(get: impl Fn(&str) -> Option<String>) -> Vec<EnvSetting> {
    SETTINGS
        .iter()
        .map(|(name, what)| EnvSetting {
            name: name.to_string(),
            value: get(name),
            what: what.to_string(),
        })
        .collect()
}

/// The usual decision rules, applied to `r`.
pub fn advise(r: &NodeReport) -> Vec<Advice> {
    let mut out = Vec::new();
    if r.cuda.devices.is_empty() {
        say(
            &mut out,
            "gpu",
            format!(
                "No GPU here{}: P2P, GPUDirect RDMA, Storage and Async need one{}",
                if r.cuda.driver_version.is_none() {
                    " (no CUDA driver)"
                } else {
                    ""
                },
                if r.rdma.devices.is_empty() {
                    "; with no verbs device either, no GPUDirect path applies."
                } else {
                    "; only host-memory RDMA applies."
                }
            ),
        );
    }
    // P2P.
    let nvlink = r.p2p.pairs_where(|p| p.nvlink_links.is_some());
    if !nvlink.is_empty() {
        say(
            &mut out,
            "p2p",
            format!(
                "NVLink joins GPU pairs {}: use P2P copies (gpudirect::p2p) between them.",
                nvlink.join(", ")
            ),
        );
    }
    let pcie_peer = r
        .p2p
        .pairs_where(|p| p.can_access && p.interconnect == "pcie");
    let unknown_peer = r
        .p2p
        .pairs_where(|p| p.can_access && p.interconnect == "unknown");
    if !unknown_peer.is_empty() {
        say(
            &mut out,
            "p2p",
            format!(
                "GPU pairs {} have peer access over an unknown link (NVML could not say): use P2P copies and check the measured GB/s.",
                unknown_peer.join(", ")
            ),
        );
    }
    if !pcie_peer.is_empty() {
        say(
            &mut out,
            "p2p",
            format!(
                "GPU pairs {} have peer access without NVLink: P2P over PCIe works; measure it against the staged path.",
                pcie_peer.join(", ")
            ),
        );
    }
    let no_peer = r.p2p.pairs_where(|p| !p.can_access);
    if !no_peer.is_empty() {
        say(
            &mut out,
            "p2p",
            format!(
                "GPU pairs {} have no peer-memory path: copies between them use the staged path through pinned host memory.",
                no_peer.join(", ")
            ),
        );
    }
    for p in &r.p2p.pairs {
        if let Some(c) = &p.copy
            && c.path == "driver_staged"
        {
            say(
                &mut out,
                "p2p",
                format!(
                    "The copy {}->{} was staged by the driver ({}): grant pool/VMM access to the peer.",
                    p.src,
                    p.dst,
                    c.reason.as_deref().unwrap_or("no grant")
                ),
            );
        }
    }
    // RDMA.
    for a in &r.rdma.affinity {
        let ready = r.rdma.gpus.iter().find(|g| g.gpu == a.gpu);
        let registration = ready.map(|g| g.registration.as_str()).unwrap_or("none");
        let Some(best) = &a.best else { continue };
        let aff = a
            .nics
            .iter()
            .find(|n| &n.nic == best)
            .map(|n| n.affinity)
            .unwrap_or(Affinity::Unknown);
        let text = match (aff, registration) {
            (_, "none") => continue,
            (Affinity::SamePcieSwitch, reg) => format!(
                "GPU {}: {best} is under the same PCIe switch: use GPUDirect RDMA with {best} ({reg} registration).",
                a.gpu
            ),
            (Affinity::SameNumaNode, reg) => format!(
                "GPU {}: use {best} (same NUMA node, no common PCIe switch); GPUDirect RDMA ({reg}) crosses the root complex, so compare it with staging through host memory.",
                a.gpu
            ),
            (Affinity::AcrossCpu, _) => format!(
                "GPU {}: the nearest NIC ({best}) is across the CPU interconnect: GPUDirect RDMA is slow there; stage through host memory on the NIC's NUMA node, or use another NIC.",
                a.gpu
            ),
            (Affinity::Unknown, reg) => format!(
                "GPU {}: use {best}; its PCI placement is unknown (software RDMA or no sysfs path), so GPUDirect RDMA ({reg}) may not apply.",
                a.gpu
            ),
        };
        say(&mut out, "rdma", text);
    }
    // Without a NIC there is nothing to register for.
    for g in r.rdma.gpus.iter().filter(|_| !r.rdma.devices.is_empty()) {
        if g.registration == "none" {
            let why = if !g.gpudirect_rdma {
                "the GPU does not support GPUDirect RDMA".to_string()
            } else if g.dma_buf && !g.verbs_dmabuf {
                "libibverbs lacks ibv_reg_dmabuf_mr and nvidia-peermem is not loaded".to_string()
            } else {
                "no dma-buf support and nvidia-peermem is not loaded".to_string()
            };
            say(
                &mut out,
                "rdma",
                format!(
                    "GPU {}: no peer-memory path ({why}): RDMA must use the staged path (copy to pinned host memory and register that).",
                    g.gpu
                ),
            );
        }
    }
    if !r.rdma.devices.is_empty() && !r.rdma.devices.iter().any(|d| d.has_active_port()) {
        say(
            &mut out,
            "rdma",
            "No verbs port is ACTIVE: check the cable, the subnet manager (InfiniBand) or the net device's link (RoCE).".into(),
        );
    }
    // Storage.
    match r.storage.mode.as_str() {
        "compatibility" => say(
            &mut out,
            "storage",
            "nvidia-fs is not loaded, so cuFile runs in compatibility mode: storage::GdsFile in Mode::Auto uses gpudirect's POSIX path (faster than cuFile's own); load nvidia-fs for true GPUDirect Storage.".into(),
        ),
        "gds" => say(
            &mut out,
            "storage",
            "nvidia-fs is loaded: Mode::Auto reads page-cache-cold data with cuFile (GPUDirect Storage) and cached data through the POSIX path.".into(),
        ),
        _ => {}
    }
    if let Some(rd) = &r.storage.read
        && rd.reason.contains("5027")
    {
        say(
            &mut out,
            "storage",
            "cuFile could not register the file (5027: no udev data, common in containers): as root, write the udev entry /run/udev/data/b<major>:<minor> holding E:ID_FS_USAGE=filesystem (scripts/cufile-udev.sh in the gpudirect repository does it).".into(),
        );
    }
    // Async.
    for g in &r.async_.gpus {
        if !g.stream_mem_ops_v2 {
            say(
                &mut out,
                "async",
                format!(
                    "GPU {}: no stream memory ops v2: NIC-triggered stream waits are unavailable; order work with events.",
                    g.gpu
                ),
            );
        }
    }
    // Settings.
    let any_nvlink = !nvlink.is_empty();
    let active_nic = r.rdma.devices.iter().any(|d| d.has_active_port());
    for s in &r.settings {
        let v = s.value.as_deref().map(str::trim);
        match (s.name.as_str(), v) {
            ("NCCL_IB_DISABLE", Some("1")) if active_nic => say(
                &mut out,
                "settings",
                "NCCL_IB_DISABLE=1 while a verbs port is active: NCCL will not use RDMA here.".into(),
            ),
            ("NCCL_P2P_LEVEL", Some(l))
                if any_nvlink && matches!(l.to_ascii_uppercase().as_str(), "LOC" | "0") =>
            {
                say(
                    &mut out,
                    "settings",
                    format!("NCCL_P2P_LEVEL={l} turns off P2P although NVLink is present."),
                )
            }
            ("CUDA_DEVICE_MAX_CONNECTIONS", Some("1")) => say(
                &mut out,
                "settings",
                "CUDA_DEVICE_MAX_CONNECTIONS=1: streams share one hardware queue, so independent copies and kernels serialise.".into(),
            ),
            _ => {}
        }
    }
    out.extend(health_advice(r));
    out
}

/// The P2P verdict.
pub(crate) fn p2p_verdict(s: &P2pSection) -> String {
    if let Some(r) = &s.absent_reason {
        return format!("SKIPPED: {r}");
    }
    let pairs = s.pairs_where(|_| true).len();
    let nvl = s.pairs_where(|p| p.nvlink_links.is_some()).len();
    let peer = s.pairs_where(|p| p.can_access).len();
    let failed = s
        .pairs
        .iter()
        .filter(|p| p.copy.as_ref().is_some_and(|c| !c.verified))
        .count();
    let mut v = format!("{peer} of {pairs} GPU pairs have peer access, {nvl} over NVLink");
    if failed > 0 {
        v += &format!("; {failed} copies FAILED verification");
    }
    v
}

/// The RDMA verdict.
pub(crate) fn rdma_verdict(s: &RdmaSection, cuda: &CudaSection) -> String {
    if let Some(r) = &s.absent_reason {
        return format!("SKIPPED: {r}");
    }
    let active = s.devices.iter().filter(|d| d.has_active_port()).count();
    let mut v = format!(
        "{} verbs device(s), {active} with an active port",
        s.devices.len()
    );
    if cuda.devices.is_empty() {
        v += "; no GPU, so host-memory RDMA only";
    } else {
        let ready = s.gpus.iter().filter(|g| g.registration != "none").count();
        v += &format!(
            "; {ready} of {} GPU(s) ready for GPUDirect RDMA",
            s.gpus.len()
        );
    }
    v
}

/// The Storage verdict.
pub(crate) fn storage_verdict(s: &StorageSection) -> String {
    let mode = match s.mode.as_str() {
        "gds" => "GPUDirect Storage (nvidia-fs)".to_string(),
        "compatibility" => "cuFile in compatibility mode".to_string(),
        _ => format!("cuFile unavailable ({})", s.mode_reason),
    };
    match (&s.read, &s.absent_reason) {
        (Some(r), _) => format!(
            "{mode}; Auto read {:.2} GB/s via {} ({}){}",
            r.gb_per_s,
            r.path,
            r.reason,
            if r.verified {
                ", verified"
            } else {
                ", WRONG BYTES"
            }
        ),
        (None, Some(why)) if s.mode == "unavailable" => {
            format!("SKIPPED: {why}; {}", s.mode_reason)
        }
        (None, Some(why)) => format!("{mode}; no read: {why}"),
        (None, None) => format!("{mode}; read not measured"),
    }
}

/// The Async verdict.
pub(crate) fn async_verdict(s: &AsyncSection) -> String {
    if let Some(r) = &s.absent_reason {
        return format!("SKIPPED: {r}");
    }
    let n = s.gpus.len();
    let count = |f: fn(&GpuAsync) -> bool| match s.gpus.iter().filter(|g| f(g)).count() {
        k if k == n => "yes".to_string(),
        0 => "no".to_string(),
        k => format!("on {k} of {n}"),
    };
    format!(
        "{n} GPU(s): stream mem ops v2 {}, memory pools {}, flush remote writes {}",
        count(|g| g.stream_mem_ops_v2),
        count(|g| g.memory_pools),
        count(|g| g.can_flush_remote_writes),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::model::{CopyMeasurement, P2pPair, StorageRead};

    fn pair(src: usize, dst: usize, nvl: bool, verified: bool) -> P2pPair {
        P2pPair {
            src,
            dst,
            can_access: true,
            performance_rank: 0,
            native_atomics: true,
            interconnect: "nvlink".into(),
            nvlink_links: nvl.then_some(18),
            interconnect_detail: "NV18".into(),
            copy: Some(CopyMeasurement {
                bytes: 1,
                gb_per_s: 1.0,
                path: "peer".into(),
                reason: None,
                verified,
            }),
        }
    }

    #[test]
    fn verdicts_are_one_line_and_honest() {
        let mut p = P2pSection {
            pairs: vec![pair(0, 1, true, true), pair(1, 0, true, false)],
            nvml_unavailable: None,
            absent_reason: None,
            verdict: String::new(),
        };
        assert_eq!(
            p2p_verdict(&p),
            "1 of 1 GPU pairs have peer access, 1 over NVLink; 1 copies FAILED verification"
        );
        p.absent_reason = Some("one GPU: no pair to connect".into());
        assert_eq!(p2p_verdict(&p), "SKIPPED: one GPU: no pair to connect");

        let mut st = StorageSection {
            cufile_version: Some("1.15".into()),
            properties: None,
            mode: "compatibility".into(),
            mode_reason: "nvidia-fs is not loaded".into(),
            nvidia_fs_version: None,
            read: Some(StorageRead {
                file: "f".into(),
                bytes: 1,
                gb_per_s: 2.5,
                path: "posix".into(),
                reason: "cuFile in compatibility mode is slower".into(),
                direct: true,
                verified: true,
            }),
            absent_reason: None,
            verdict: String::new(),
        };
        assert_eq!(
            storage_verdict(&st),
            "cuFile in compatibility mode; Auto read 2.50 GB/s via posix (cuFile in compatibility mode is slower), verified"
        );
        st.read = None;
        st.mode = "unavailable".into();
        st.mode_reason = "libcufile is not loaded".into();
        st.absent_reason = Some("no GPU visible".into());
        assert_eq!(
            storage_verdict(&st),
            "SKIPPED: no GPU visible; libcufile is not loaded"
        );

        let a = AsyncSection {
            gpus: vec![GpuAsync {
                gpu: 0,
                stream_mem_ops_v2: true,
                stream_mem_ops_64: true,
                memory_pools: true,
                copy_engines: 7,
                can_flush_remote_writes: false,
                flush_rdma_writes_options: 1,
            }],
            absent_reason: None,
            verdict: String::new(),
        };
        assert_eq!(
            async_verdict(&a),
            "1 GPU(s): stream mem ops v2 yes, memory pools yes, flush remote writes no"
        );
    }
}
