//! The RDMA section of the report: verbs devices and their ports ([`crate::rdma`], when built),
//! each GPU's readiness for GPUDirect RDMA, and which NIC each GPU should use
//! ([`crate::topology`]).

#[cfg(not(feature = "rdma"))]
use super::model::not_built;
use super::model::{
    CudaSection, GpuNicAffinity, GpuRdmaReadiness, NicAffinity, RdmaSection, VerbsDeviceSummary,
};
#[cfg(feature = "rdma")]
use super::ports::verbs_devices;
use crate::topology::Placement;
use std::path::Path;

/// The RDMA section: every verbs device with its ports, each GPU's readiness for GPUDirect RDMA,
/// and its NICs by placement (read under sysfs root `root`).
pub(crate) fn rdma_section(cuda: &CudaSection, root: &Path) -> RdmaSection {
    let mut s = RdmaSection {
        devices: Vec::new(),
        gpus: Vec::new(),
        affinity: Vec::new(),
        absent_reason: None,
        verdict: String::new(),
    };
    #[cfg(feature = "rdma")]
    let devices = verbs_devices(root);
    #[cfg(not(feature = "rdma"))]
    let devices: Result<Vec<VerbsDeviceSummary>, String> = Err(not_built("rdma"));
    match devices {
        Ok(d) => s.devices = d,
        Err(why) => s.absent_reason = Some(why),
    }
    let peermem = gpudirect_sys::peermem::peermem_module().map(|m| match m.version {
        Some(v) => format!("{} {v}", m.name),
        None => m.name,
    });
    let verbs_dmabuf = gpudirect_sys::ibverbs::lib()
        .map(|l| l.ibv_reg_dmabuf_mr.is_some())
        .unwrap_or(false);
    for g in &cuda.devices {
        let registration = if !g.gpudirect_rdma {
            "none"
        } else if g.dma_buf && verbs_dmabuf {
            "dma-buf"
        } else if peermem.is_some() {
            "nvidia-peermem"
        } else {
            "none"
        };
        s.gpus.push(GpuRdmaReadiness {
            gpu: g.ordinal,
            gpudirect_rdma: g.gpudirect_rdma,
            dma_buf: g.dma_buf,
            verbs_dmabuf,
            peermem: peermem.clone(),
            vmm_rdma: g.gpudirect_rdma_vmm,
            registration: registration.into(),
        });
        s.affinity
            .push(gpu_affinity(root, g.ordinal, &g.pci_bus_id, &s.devices));
    }
    s
}

/// Place every NIC relative to GPU `gpu` (PCI address `bus_id`) under sysfs root `root`, in the
/// order given, and pick the one to use ([`best_nic`]).
pub fn gpu_affinity(
    root: &Path,
    gpu: usize,
    bus_id: &str,
    nics: &[VerbsDeviceSummary],
) -> GpuNicAffinity {
    let at = Placement::of_pci(root, bus_id);
    let placed: Vec<NicAffinity> = nics
        .iter()
        .map(|n| NicAffinity {
            nic: n.name.clone(),
            affinity: at.nic(&n.name).affinity,
            active: n.has_active_port(),
        })
        .collect();
    GpuNicAffinity {
        gpu,
        gpu_pci_bus_id: bus_id.to_string(),
        best: best_nic(&placed),
        nics: placed,
    }
}

/// The closest NIC with an active port, else the closest; ties go to the first listed.
pub fn best_nic(nics: &[NicAffinity]) -> Option<String> {
    nics.iter()
        .min_by_key(|n| (!n.active, n.affinity))
        .map(|n| n.nic.clone())
}
