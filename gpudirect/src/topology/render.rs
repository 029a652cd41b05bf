//! The human-readable rendering of a [`NodeReport`].

use super::{NodeReport, format_cuda_version};
use std::fmt::{self, Write};

fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

impl fmt::Display for NodeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = String::new();
        writeln!(s, "gpudirect node report")?;
        writeln!(s, "\n== Libraries")?;
        for l in &self.libraries {
            if l.loaded {
                writeln!(
                    s,
                    "  {:<11} loaded   {} {}",
                    l.name,
                    l.path.as_deref().unwrap_or("?"),
                    l.version
                        .as_deref()
                        .map(|v| format!("(version {v})"))
                        .unwrap_or_default()
                )?;
            } else {
                writeln!(
                    s,
                    "  {:<11} MISSING  {}",
                    l.name,
                    l.error.as_deref().unwrap_or("?")
                )?;
            }
        }
        writeln!(s, "\n== GPUs")?;
        let c = &self.cuda;
        writeln!(
            s,
            "  driver: {}   bindings: CUDA {}",
            c.driver_version
                .map(format_cuda_version)
                .map(|v| format!("CUDA {v}"))
                .unwrap_or_else(|| "absent".into()),
            format_cuda_version(c.bindings_version)
        )?;
        if let Some(r) = &c.absent_reason {
            writeln!(s, "  no GPU: {r}")?;
        }
        for d in &c.devices {
            writeln!(
                s,
                "  GPU {} {}  pci {}  {:.1} GiB  sm_{}{}  copy engines {}",
                d.ordinal,
                d.name,
                d.pci_bus_id,
                d.total_memory_bytes as f64 / (1u64 << 30) as f64,
                d.compute_capability.0,
                d.compute_capability.1,
                d.copy_engines
            )?;
            writeln!(
                s,
                "    dma-buf {}  GPUDirect RDMA {}  RDMA with VMM {}  stream mem ops v2 {} (64-bit {})  memory pools {}",
                yes(d.dma_buf),
                yes(d.gpudirect_rdma),
                yes(d.gpudirect_rdma_vmm),
                yes(d.stream_mem_ops),
                yes(d.stream_mem_ops_64),
                yes(d.memory_pools)
            )?;
            writeln!(
                s,
                "    flush RDMA writes options {:#x}  RDMA writes ordering {}  host register {}  POSIX fd handles {}",
                d.rdma_flush_writes_options,
                d.rdma_writes_ordering,
                yes(d.host_register),
                yes(d.posix_fd_handles)
            )?;
        }
        writeln!(s, "\n== RDMA (verbs)")?;
        if let Some(r) = &self.rdma.absent_reason {
            writeln!(s, "  no verbs device: {r}")?;
        }
        for d in &self.rdma.devices {
            writeln!(s, "  {}", d.name)?;
            for p in &d.ports {
                writeln!(
                    s,
                    "    port {}: {}  {}  MTU {}",
                    p.port, p.state, p.link_layer, p.active_mtu
                )?;
            }
        }
        f.write_str(&s)
    }
}
