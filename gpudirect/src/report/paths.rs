//! Each data path's status (usable, degraded, unusable) with the reasons, for a health check that
//! fails a job's prolog when a path the job needs is broken (the probe's `--require`).

use super::health::{domain_translates, gpu_ordinal_of, human_bytes};
use super::model::{DataPath, NodeReport, PathState, PathStatus};
use crate::topology::Affinity;

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

struct Acc {
    unusable: Vec<String>,
    degraded: Vec<String>,
}

impl Acc {
    fn new() -> Acc {
        Acc {
            unusable: Vec::new(),
            degraded: Vec::new(),
        }
    }
    fn finish(self, path: DataPath) -> PathStatus {
        let (state, reasons) = if !self.unusable.is_empty() {
            (PathState::Unusable, self.unusable)
        } else if !self.degraded.is_empty() {
            (PathState::Degraded, self.degraded)
        } else {
            (PathState::Ok, Vec::new())
        };
        PathStatus {
            path,
            state,
            reasons: reasons.iter().map(|r| one_line(r)).collect(),
        }
    }
}

fn fewer_than_two(r: &NodeReport) -> String {
    match r.cuda.devices.len() {
        0 => r.cuda.no_gpu(),
        n => format!("{n} GPU visible, a pair needs two"),
    }
}

fn link_problems(r: &NodeReport, kind: &str) -> Vec<String> {
    let mut v = Vec::new();
    for l in r.health.pcie.links.iter().filter(|l| l.kind == kind) {
        if l.width_degraded {
            v.push(format!(
                "{} PCIe link x{} of x{} lanes",
                l.device,
                l.current_width.unwrap_or(0),
                l.max_width.unwrap_or(0)
            ));
        }
        if l.speed_degraded {
            v.push(format!(
                "{} PCIe link at {} of {}",
                l.device,
                l.speed_seen().unwrap_or("?"),
                l.max_speed.as_deref().unwrap_or("?")
            ));
        }
    }
    v
}

fn translated(r: &NodeReport, device: &str) -> bool {
    r.health
        .pcie
        .links
        .iter()
        .any(|l| l.device == device && l.iommu_domain.as_deref().is_some_and(domain_translates))
}

fn status(r: &NodeReport, path: DataPath) -> PathStatus {
    let mut a = Acc::new();
    let gpus = r.cuda.devices.len();
    match path {
        DataPath::Gpu => {
            if gpus == 0 {
                a.unusable.push(r.cuda.no_gpu());
            }
            a.degraded.extend(link_problems(r, "gpu"));
        }
        DataPath::MultiGpu => {
            if gpus < 2 {
                a.unusable.push(fewer_than_two(r));
            }
        }
        DataPath::P2p => {
            if gpus < 2 {
                a.unusable.push(fewer_than_two(r));
            } else if let Some(why) = &r.p2p.absent_reason {
                a.unusable.push(why.clone());
            } else {
                let pairs = r.p2p.pairs_where(|_| true);
                let without = r.p2p.pairs_where(|p| !p.can_access);
                if without.len() == pairs.len() {
                    a.unusable.push("no GPU pair has peer access".into());
                } else if !without.is_empty() {
                    a.degraded.push(format!(
                        "GPU pairs {} have no peer access",
                        without.join(", ")
                    ));
                }
                for p in r
                    .p2p
                    .pairs
                    .iter()
                    .filter(|p| p.copy.as_ref().is_some_and(|c| !c.verified))
                {
                    a.degraded.push(format!(
                        "the quick copy {}->{} was not verified",
                        p.src, p.dst
                    ));
                }
                for p in r.health.pcie.paths.iter().filter(|p| p.kind == "gpu-gpu") {
                    let (Some(x), Some(y)) = (gpu_ordinal_of(&p.from), gpu_ordinal_of(&p.to))
                    else {
                        continue;
                    };
                    if r.p2p.on_nvlink(x, y) {
                        continue;
                    }
                    if p.acs_redirects == Some(true) {
                        a.degraded.push(format!(
                            "ACS redirects GPU {x}-{y} traffic to the root complex"
                        ));
                    }
                    if translated(r, &p.from) || translated(r, &p.to) {
                        a.degraded
                            .push(format!("the IOMMU translates for GPU {x} or {y}"));
                    }
                }
            }
        }
        DataPath::Nvlink => {
            let nv = &r.health.nvlink;
            if gpus < 2 {
                a.unusable.push(fewer_than_two(r));
            } else if let Some(why) = &nv.absent_reason {
                a.unusable.push(format!("NVML cannot say ({why})"));
            } else if !r.p2p.pairs.iter().any(|p| p.nvlink_links.is_some()) {
                a.unusable.push("no GPU pair is joined by NVLink".into());
            }
            for g in &nv.gpus {
                let down = g.links_where(|l| l.down).join(",");
                if !down.is_empty() {
                    a.degraded.push(format!("GPU {} NVLink {down} down", g.gpu));
                }
                let errs = g.links_where(|l| l.counting_errors).join(",");
                if !errs.is_empty() {
                    a.degraded.push(format!(
                        "GPU {} NVLink {errs} counting replay/recovery errors",
                        g.gpu
                    ));
                }
                let grew = g.links_where(|l| l.errors_grew == Some(true)).join(",");
                if !grew.is_empty() {
                    a.degraded.push(format!(
                        "GPU {} NVLink {grew} errors grew during the probe",
                        g.gpu
                    ));
                }
            }
        }
        DataPath::Rdma => {
            if let Some(why) = &r.rdma.absent_reason {
                a.unusable.push(why.clone());
            } else if !r.rdma.devices.iter().any(|d| d.has_active_port()) {
                a.unusable.push("no verbs port is ACTIVE".into());
            }
            let m = &r.health.memlock;
            if m.low {
                a.degraded.push(format!(
                    "the locked-memory limit is {} (RDMA registers at most that much host memory)",
                    m.soft_bytes.map_or("?".into(), human_bytes)
                ));
            }
            a.degraded.extend(link_problems(r, "nic"));
        }
        DataPath::GpudirectRdma => {
            if gpus == 0 {
                a.unusable.push(r.cuda.no_gpu());
            }
            let rdma = status(r, DataPath::Rdma);
            if rdma.state == PathState::Unusable {
                a.unusable
                    .extend(rdma.reasons.iter().map(|x| format!("rdma: {x}")));
            }
            if gpus > 0 && rdma.state != PathState::Unusable {
                if !r.rdma.devices.iter().any(|d| d.pci_bus_id.is_some()) {
                    a.unusable.push(
                        "no PCIe NIC: software verbs devices (rxe, siw) copy with the CPU and never reach GPU memory by DMA"
                            .into(),
                    );
                }
                let ready: Vec<_> = r
                    .rdma
                    .gpus
                    .iter()
                    .filter(|g| g.registration != "none")
                    .collect();
                if ready.is_empty() {
                    a.unusable.push(
                        "no GPU can register its memory with a NIC (neither dma-buf nor nvidia-peermem)".into(),
                    );
                } else if ready.len() < r.rdma.gpus.len() {
                    let not: Vec<String> = r
                        .rdma
                        .gpus
                        .iter()
                        .filter(|g| g.registration == "none")
                        .map(|g| g.gpu.to_string())
                        .collect();
                    a.degraded.push(format!(
                        "GPU {} cannot register memory with a NIC",
                        not.join(", ")
                    ));
                }
                for af in &r.rdma.affinity {
                    let Some(best) = &af.best else { continue };
                    let aff = af.nics.iter().find(|n| &n.nic == best).map(|n| n.affinity);
                    if aff == Some(Affinity::AcrossCpu) {
                        a.degraded.push(format!(
                            "GPU {}'s nearest NIC {best} is across the CPU interconnect",
                            af.gpu
                        ));
                    }
                    if translated(r, &format!("GPU {}", af.gpu)) || translated(r, best) {
                        a.degraded
                            .push(format!("the IOMMU translates for GPU {} or {best}", af.gpu));
                    }
                }
                for p in r.health.pcie.paths.iter().filter(|p| p.kind == "gpu-nic") {
                    if p.acs_redirects == Some(true) {
                        a.degraded.push(format!(
                            "ACS redirects {}-{} traffic to the root complex",
                            p.from, p.to
                        ));
                    }
                }
                a.degraded.extend(link_problems(r, "gpu"));
                a.degraded.extend(link_problems(r, "nic"));
            }
        }
        DataPath::Cufile | DataPath::Gds => {
            let s = &r.storage;
            if gpus == 0 {
                a.unusable.push(r.cuda.no_gpu());
            } else if s.mode == "unavailable" {
                a.unusable
                    .push(format!("cuFile unavailable: {}", s.mode_reason));
            } else if path == DataPath::Gds && s.mode != "gds" {
                a.unusable.push(format!(
                    "no GPUDirect Storage (cuFile in {} mode: {})",
                    s.mode, s.mode_reason
                ));
            }
            if s.read.as_ref().is_some_and(|rd| !rd.verified) {
                a.degraded
                    .push("the quick read returned wrong bytes".into());
            }
        }
        DataPath::Async => {
            if gpus == 0 {
                a.unusable.push(r.cuda.no_gpu());
            } else {
                let without: Vec<String> = r
                    .async_
                    .gpus
                    .iter()
                    .filter(|g| !g.stream_mem_ops_v2)
                    .map(|g| g.gpu.to_string())
                    .collect();
                if without.len() == r.async_.gpus.len() {
                    a.unusable.push("no GPU has stream memory ops v2".into());
                } else if !without.is_empty() {
                    a.degraded.push(format!(
                        "GPU {} lack stream memory ops v2",
                        without.join(", ")
                    ));
                }
            }
        }
    }
    a.finish(path)
}

/// Every path's status, from a gathered report.
pub fn path_statuses(r: &NodeReport) -> Vec<PathStatus> {
    DataPath::ALL.into_iter().map(|p| status(r, p)).collect()
}

/// Whether every path in `required` is `ok` in `r` (the probe's `--require`).
///
/// # Errors
///
/// One line, `required path not usable: ...`, naming each required path that is degraded or
/// unusable and why (paths joined by ` | `).
pub fn check_required(r: &NodeReport, required: &[DataPath]) -> Result<(), String> {
    let bad: Vec<String> = required
        .iter()
        .map(|p| {
            r.paths
                .iter()
                .find(|s| s.path == *p)
                .cloned()
                .unwrap_or_else(|| status(r, *p))
        })
        .filter(|s| s.state != PathState::Ok)
        .map(|s| s.line())
        .collect();
    if bad.is_empty() {
        Ok(())
    } else {
        Err(format!("required path not usable: {}", bad.join(" | ")))
    }
}
