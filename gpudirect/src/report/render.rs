//! The human-readable rendering of a [`NodeReport`]: one section per path, each opening with its
//! one-line verdict.

use super::health::{NvlinkErrors, NvlinkLink, human_bytes};
use super::model::{NodeReport, PathState, version_words};
use std::fmt::{self, Write};

fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

/// `0 1 2 4 6 7` → `0-2,4,6-7`.
fn ranges(v: impl Iterator<Item = u32>) -> String {
    let span = |(a, b): (u32, u32)| {
        if a == b {
            a.to_string()
        } else {
            format!("{a}-{b}")
        }
    };
    let mut out: Vec<String> = Vec::new();
    let mut run: Option<(u32, u32)> = None;
    for x in v {
        run = match run {
            Some((a, b)) if b.checked_add(1) == Some(x) => Some((a, x)),
            Some(r) => {
                out.push(span(r));
                Some((x, x))
            }
            None => Some((x, x)),
        };
    }
    out.extend(run.map(span));
    out.join(",")
}

/// A data path's section heading and its one-line verdict.
fn path_heading(s: &mut String, title: &str, verdict: &str) -> fmt::Result {
    writeln!(s, "\n== {title}\n  verdict: {verdict}")
}

fn or_dash(v: Option<impl fmt::Display>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "-".into())
}

/// The speed with its unit (megabytes per second), or `speed unknown`.
fn nvlink_speed(mbps: Option<u32>) -> String {
    mbps.map_or_else(|| "speed unknown".into(), |v| format!("{v} MB/s"))
}

/// The other end of a link: `0000:19:00.0 (GPU 1)`, `0000:c3:00.0`, `unknown (NVSwitch)`,
/// `unknown`.
fn nvlink_remote(l: &NvlinkLink) -> String {
    match (&l.remote_pci_bus_id, &l.remote_device) {
        (Some(p), Some(d)) => format!("{p} ({d})"),
        (Some(p), None) => p.clone(),
        (None, Some(d)) => format!("unknown ({d})"),
        (None, None) => "unknown".into(),
    }
}

/// Whether the GPU's replay or recovery counters grew during the probe's measurements, in words
/// (corrected CRC counts grow with traffic on healthy links and are not counted).
fn nvlink_growth(links: &[NvlinkLink]) -> String {
    let grew: Vec<u32> = links
        .iter()
        .filter(|l| l.errors_grew == Some(true))
        .map(|l| l.link)
        .collect();
    if !grew.is_empty() {
        format!(
            "replay/recovery counters GREW during the probe on links {}",
            ranges(grew.into_iter())
        )
    } else if links.iter().any(|l| l.errors_grew.is_some()) {
        "no replay/recovery counter grew during the probe".into()
    } else {
        "error growth not measured".into()
    }
}

/// The error counts of healthy links: `no errors`, or the CRC errors they corrected (per link,
/// as a range over the links), shown as information.
fn corrected_errors(links: &[&NvlinkLink]) -> String {
    if links.iter().all(|l| l.errors.total() == 0) {
        return "no errors".into();
    }
    let span = |f: fn(&NvlinkErrors) -> Option<u64>| {
        let v: Vec<u64> = links.iter().filter_map(|l| f(&l.errors)).collect();
        match (v.iter().min(), v.iter().max()) {
            (Some(a), Some(b)) if a == b => a.to_string(),
            (Some(a), Some(b)) => format!("{a}-{b}"),
            _ => "-".into(),
        }
    };
    format!(
        "no replays or recoveries, CRC errors corrected (normal): flit {}, data {} per link",
        span(|e| e.crc_flit),
        span(|e| e.crc_data)
    )
}

impl fmt::Display for NodeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = String::new();
        writeln!(
            s,
            "gpudirect node report (schema {}, quick measurements {})",
            self.schema_version,
            if self.measured { "requested" } else { "off" }
        )?;
        self.libraries_and_gpus(&mut s)?;
        self.p2p_text(&mut s)?;
        self.rdma_text(&mut s)?;
        self.storage_text(&mut s)?;
        self.async_text(&mut s)?;
        self.health_text(&mut s)?;
        self.paths_text(&mut s)?;
        writeln!(s, "\n== Advice")?;
        if self.advice.is_empty() {
            writeln!(s, "  nothing to add")?;
        }
        for a in &self.advice {
            writeln!(s, "  - [{}] {}", a.topic, a.text)?;
        }
        writeln!(s, "\n== Settings worth checking")?;
        for e in &self.settings {
            writeln!(
                s,
                "  {:<28} {:<8} {}",
                e.name,
                e.value.as_deref().unwrap_or("(unset)"),
                e.what
            )?;
        }
        f.write_str(&s)
    }
}

impl NodeReport {
    fn libraries_and_gpus(&self, s: &mut String) -> fmt::Result {
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
                .map(version_words)
                .map(|v| format!("CUDA {v}"))
                .unwrap_or_else(|| "absent".into()),
            version_words(c.bindings_version)
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
        }
        Ok(())
    }

    fn p2p_text(&self, s: &mut String) -> fmt::Result {
        let p = &self.p2p;
        path_heading(s, "P2P", &p.verdict)?;
        if let Some(why) = &p.nvml_unavailable {
            writeln!(s, "  NVML unavailable: {why}")?;
        }
        if p.pairs.is_empty() {
            return Ok(());
        }
        writeln!(
            s,
            "  {:<6} {:<6} {:<4} {:<7} {:<20} copy",
            "pair", "access", "rank", "atomics", "interconnect"
        )?;
        for x in &p.pairs {
            let copy = match &x.copy {
                None => "not measured".to_string(),
                Some(c) => format!(
                    "{:.1} GB/s  {}{}  {}",
                    c.gb_per_s,
                    c.path,
                    c.reason
                        .as_deref()
                        .map(|r| format!(" ({r})"))
                        .unwrap_or_default(),
                    if c.verified {
                        "verified"
                    } else {
                        "NOT verified"
                    }
                ),
            };
            writeln!(
                s,
                "  {:<6} {:<6} {:<4} {:<7} {:<20} {copy}",
                format!("{}->{}", x.src, x.dst),
                yes(x.can_access),
                x.performance_rank,
                yes(x.native_atomics),
                x.interconnect_detail
            )?;
        }
        Ok(())
    }

    fn rdma_text(&self, s: &mut String) -> fmt::Result {
        let r = &self.rdma;
        path_heading(s, "RDMA (verbs)", &r.verdict)?;
        for d in &r.devices {
            writeln!(
                s,
                "  {}  fw {}  pci {}  numa {}",
                d.name,
                or_dash(d.fw_ver.as_deref()),
                d.pci_bus_id.as_deref().unwrap_or("- (no PCI device)"),
                or_dash(d.numa_node)
            )?;
            if let Some(e) = &d.error {
                writeln!(s, "    error: {e}")?;
            }
            if let Some(w) = d.memory_windows {
                writeln!(
                    s,
                    "    memory windows type 2: {} (transfer engine: per-peer access {})",
                    yes(w),
                    if w {
                        "possible"
                    } else {
                        "falls back to region rkeys"
                    }
                )?;
            }
            for p in &d.ports {
                writeln!(
                    s,
                    "    port {}: {}  {}  MTU {} (max {})  speed {}",
                    p.port,
                    p.state,
                    p.link_layer,
                    p.active_mtu,
                    p.max_mtu,
                    or_dash(p.speed.as_deref())
                )?;
                if let Some(e) = &p.error {
                    writeln!(s, "      error: {e}")?;
                }
                for g in &p.gids {
                    writeln!(s, "      GID[{}] {}  {}", g.index, g.gid, g.gid_type)?;
                }
            }
        }
        for g in &r.gpus {
            writeln!(
                s,
                "  GPU {} GPUDirect RDMA {}  dma-buf {} (ibv_reg_dmabuf_mr {})  nvidia-peermem {}  VMM RDMA {}  -> registration: {}",
                g.gpu,
                yes(g.gpudirect_rdma),
                yes(g.dma_buf),
                yes(g.verbs_dmabuf),
                g.peermem.as_deref().unwrap_or("no"),
                yes(g.vmm_rdma),
                g.registration
            )?;
        }
        for a in &r.affinity {
            let nics: Vec<String> = a
                .nics
                .iter()
                .map(|n| {
                    format!(
                        "{} {}{}",
                        n.nic,
                        n.affinity.describe(),
                        if n.active { "" } else { " (no active port)" }
                    )
                })
                .collect();
            writeln!(
                s,
                "  GPU {} [{}] NICs: {}  -> use {}",
                a.gpu,
                a.gpu_pci_bus_id,
                if nics.is_empty() {
                    "none".to_string()
                } else {
                    nics.join(", ")
                },
                a.best.as_deref().unwrap_or("none")
            )?;
        }
        Ok(())
    }

    fn storage_text(&self, s: &mut String) -> fmt::Result {
        let st = &self.storage;
        path_heading(s, "Storage (cuFile)", &st.verdict)?;
        writeln!(
            s,
            "  cuFile {}  mode {}: {}  nvidia-fs module {}",
            or_dash(st.cufile_version.as_deref()),
            st.mode,
            st.mode_reason,
            st.nvidia_fs_version.as_deref().unwrap_or("not loaded")
        )?;
        if let Some(p) = &st.properties {
            writeln!(
                s,
                "  driver: nvfs {}  compat allowed {}  batch {} (max {})  streams {}  poll {}  max direct I/O {} KiB  pinned {} KiB  fs: {}",
                p.nvfs_version,
                yes(p.allow_compat_mode),
                yes(p.batch_io),
                p.max_batch_io_size,
                yes(p.streams),
                yes(p.poll_mode),
                p.max_direct_io_kib,
                p.max_device_pinned_mem_kib,
                if p.fs_support.is_empty() {
                    "-".to_string()
                } else {
                    p.fs_support.join(" ")
                }
            )?;
        }
        if let Some(r) = &st.read {
            writeln!(
                s,
                "  read {} MiB: {:.2} GB/s via {} ({}), O_DIRECT {}, {}",
                r.bytes >> 20,
                r.gb_per_s,
                r.path,
                r.reason,
                yes(r.direct),
                if r.verified {
                    "verified"
                } else {
                    "WRONG BYTES"
                }
            )?;
        }
        Ok(())
    }

    fn async_text(&self, s: &mut String) -> fmt::Result {
        let a = &self.async_;
        path_heading(s, "Async", &a.verdict)?;
        for g in &a.gpus {
            writeln!(
                s,
                "  GPU {}: stream mem ops v2 {} (64-bit {})  memory pools {}  copy engines {}  flush remote writes {} (options {:#x})",
                g.gpu,
                yes(g.stream_mem_ops_v2),
                yes(g.stream_mem_ops_64),
                yes(g.memory_pools),
                g.copy_engines,
                yes(g.can_flush_remote_writes),
                g.flush_rdma_writes_options
            )?;
        }
        Ok(())
    }

    fn health_text(&self, s: &mut String) -> fmt::Result {
        let h = &self.health;
        let k = &h.kernel;
        writeln!(s, "\n== Driver and kernel")?;
        writeln!(
            s,
            "  Linux {}  NVIDIA driver {}{}  PCI P2PDMA {}",
            k.release.as_deref().unwrap_or("?"),
            k.nvidia_driver.as_deref().unwrap_or("not loaded"),
            k.nvidia_kernel_module
                .as_deref()
                .map(|m| format!(" ({m} kernel modules)"))
                .unwrap_or_default(),
            match k.pci_p2pdma {
                Some(true) => "yes",
                Some(false) => "no",
                None => "unknown",
            }
        )?;
        let mods: Vec<String> = h
            .modules
            .iter()
            .map(|m| {
                let what = if m.loaded {
                    format!(
                        "{}{}",
                        m.state.as_deref().unwrap_or("loaded"),
                        m.version
                            .as_deref()
                            .map(|v| format!(" {v}"))
                            .unwrap_or_default()
                    )
                } else {
                    match m.installed {
                        Some(true) => "not loaded (installed)".into(),
                        Some(false) => "not loaded (not installed)".into(),
                        None => "not loaded".into(),
                    }
                };
                format!("{} {what}", m.name)
            })
            .collect();
        writeln!(s, "  modules: {}", mods.join("; "))?;
        writeln!(
            s,
            "  peer-memory API (MLNX_OFED/DOCA-OFED): {}",
            match &h.peer_memory_clients {
                None => "absent".to_string(),
                Some(c) if c.is_empty() => "present, no client".to_string(),
                Some(c) => format!("present, clients {}", c.join(" ")),
            }
        )?;
        match &h.kernel_log_unreadable {
            Some(why) => writeln!(
                s,
                "  kernel log: not readable ({why}): load failures unknown"
            )?,
            None if h.modules.iter().all(|m| m.load_errors.is_empty()) => {
                writeln!(s, "  kernel log: read, no module load failures")?
            }
            None => {
                for m in h.modules.iter().filter(|m| !m.load_errors.is_empty()) {
                    for e in &m.load_errors {
                        writeln!(s, "  kernel log [{}]: {e}", m.name)?;
                    }
                }
            }
        }
        for r in &h.requirements {
            writeln!(
                s,
                "  {}: {}",
                r.path,
                match r.met {
                    Some(true) => "met",
                    Some(false) => "NOT met",
                    None => "unknown",
                }
            )?;
            for c in &r.checks {
                writeln!(
                    s,
                    "    {:<4} {} {}: {}",
                    match c.met {
                        Some(true) => "ok",
                        Some(false) => "NO",
                        None => "?",
                    },
                    c.item,
                    c.needs,
                    c.found
                )?;
            }
        }

        writeln!(s, "\n== PCIe")?;
        let io = &h.pcie.iommu;
        writeln!(
            s,
            "  IOMMU: {}{}{}",
            match io.enabled {
                Some(true) => format!("on ({} groups)", io.groups),
                Some(false) => "off".to_string(),
                None => "unknown".to_string(),
            },
            if io.units.is_empty() {
                String::new()
            } else {
                format!("  units {}", io.units.join(" "))
            },
            if io.cmdline.is_empty() {
                String::new()
            } else {
                format!("  kernel parameters {}", io.cmdline.join(" "))
            }
        )?;
        for l in &h.pcie.links {
            if let Some(e) = &l.error
                && l.current_speed.is_none()
            {
                writeln!(s, "  {} [{}]: {e}", l.device, l.pci_bus_id)?;
                continue;
            }
            let flag = match (l.speed_degraded, l.width_degraded) {
                (false, false) => "",
                (true, false) => "  DEGRADED (speed)",
                (false, true) => "  DEGRADED (width)",
                (true, true) => "  DEGRADED (speed and width)",
            };
            writeln!(
                s,
                "  {} [{}]: {} x{} of {} x{}{}{}{}",
                l.device,
                l.pci_bus_id,
                l.current_speed.as_deref().unwrap_or("?"),
                or_dash(l.current_width),
                l.max_speed.as_deref().unwrap_or("?"),
                or_dash(l.max_width),
                l.speed_under_load
                    .as_deref()
                    .map(|u| format!(" (under load {u})"))
                    .unwrap_or_default(),
                match (&l.iommu_group, &l.iommu_domain) {
                    (Some(g), Some(d)) => format!("  iommu group {g} ({d})"),
                    (Some(g), None) => format!("  iommu group {g}"),
                    _ => String::new(),
                },
                flag
            )?;
        }
        for p in &h.pcie.paths {
            if let Some(e) = &p.error {
                writeln!(s, "  {} <-> {}: {e}", p.from, p.to)?;
                continue;
            }
            let acs: Vec<String> = p
                .bridges
                .iter()
                .map(|b| match (&b.control, &b.note) {
                    (Some(c), _) => format!(
                        "{} ACSCtl {:#06x} [{}]",
                        b.pci_bus_id,
                        c,
                        if b.flags.is_empty() {
                            "none".to_string()
                        } else {
                            b.flags.join(" ")
                        }
                    ),
                    (None, Some(n)) => format!("{} {n}", b.pci_bus_id),
                    (None, None) => format!("{} ?", b.pci_bus_id),
                })
                .collect();
            writeln!(
                s,
                "  {} <-> {}: meet at {}; {}{}",
                p.from,
                p.to,
                p.meets_at,
                match p.acs_redirects {
                    _ if !p.meets_at.starts_with("PCIe switch") => {
                        "ACS cannot redirect (no shared switch)"
                    }
                    Some(true) => "ACS redirect YES",
                    Some(false) => "ACS redirect no",
                    None => "ACS redirect unknown",
                },
                if acs.is_empty() {
                    String::new()
                } else {
                    format!("; bridges: {}", acs.join(", "))
                }
            )?;
        }

        writeln!(s, "\n== NVLink")?;
        if let Some(why) = &h.nvlink.absent_reason {
            writeln!(s, "  SKIPPED: {why}")?;
        }
        for g in &h.nvlink.gpus {
            if let Some(e) = &g.error {
                writeln!(s, "  GPU {}: {e}", g.gpu)?;
                continue;
            }
            writeln!(
                s,
                "  GPU {}: {} of {} links up, {}",
                g.gpu,
                g.active_links,
                g.link_count.map_or(g.links.len() as u32, |c| c),
                nvlink_growth(&g.links)
            )?;
            // Healthy links on one line (their indexes as ranges), the others one by one.
            let healthy: Vec<&NvlinkLink> = g
                .links
                .iter()
                .filter(|l| l.state == "up" && !l.degraded())
                .collect();
            if !healthy.is_empty() {
                let mut remotes: Vec<String> = healthy.iter().map(|l| nvlink_remote(l)).collect();
                remotes.sort_unstable();
                remotes.dedup();
                let mut speeds: Vec<String> = healthy
                    .iter()
                    .map(|l| format!("v{} {}", or_dash(l.version), nvlink_speed(l.speed_mbps)))
                    .collect();
                speeds.sort_unstable();
                speeds.dedup();
                writeln!(
                    s,
                    "    links {}: up, {}, remote {}, {}",
                    ranges(healthy.iter().map(|l| l.link)),
                    speeds.join(" / "),
                    remotes.join(" / "),
                    corrected_errors(&healthy)
                )?;
            }
            for l in g
                .links
                .iter()
                .filter(|l| !healthy.iter().any(|h| h.link == l.link))
            {
                let e = &l.errors;
                let n = |v: Option<u64>| v.map_or("-".into(), |v| v.to_string());
                let before = match (&l.errors_before, l.errors_grew) {
                    (Some(b), Some(true)) => format!(
                        " (before the probe: replay {} recovery {} crc flit {} crc data {})",
                        n(b.replay),
                        n(b.recovery),
                        n(b.crc_flit),
                        n(b.crc_data)
                    ),
                    _ => String::new(),
                };
                writeln!(
                    s,
                    "    link {:<2} {:<5} v{} {}  remote {}  errors replay {} recovery {} crc flit {} crc data {}{}{}{}{}",
                    l.link,
                    l.state,
                    or_dash(l.version),
                    nvlink_speed(l.speed_mbps),
                    nvlink_remote(l),
                    n(e.replay),
                    n(e.recovery),
                    n(e.crc_flit),
                    n(e.crc_data),
                    before,
                    if l.down { "  DOWN" } else { "" },
                    if l.counting_errors {
                        "  REPLAY/RECOVERY ERRORS"
                    } else {
                        ""
                    },
                    if l.errors_grew == Some(true) {
                        "  ERRORS GREW"
                    } else {
                        ""
                    }
                )?;
            }
        }

        writeln!(s, "\n== Limits and configuration")?;
        let m = &h.memlock;
        let lim = |b: Option<u64>, unl: bool| {
            if unl {
                "unlimited".to_string()
            } else {
                b.map_or("?".into(), human_bytes)
            }
        };
        match &m.error {
            Some(e) => writeln!(s, "  locked memory (ulimit -l): unknown ({e})")?,
            None => writeln!(
                s,
                "  locked memory (ulimit -l): {} (hard {}){}{}: allows {}",
                lim(m.soft_bytes, m.soft_unlimited),
                lim(m.hard_bytes, m.hard_unlimited),
                if m.cap_ipc_lock == Some(true) {
                    ", CAP_IPC_LOCK held"
                } else {
                    ""
                },
                if m.low { ", LOW" } else { "" },
                m.allows
            )?,
        }
        let c = &h.cufile_config;
        writeln!(
            s,
            "  cuFile configuration: {} ({}){}",
            c.path,
            if c.source == "default" {
                "the default"
            } else {
                "from CUFILE_ENV_PATH_JSON"
            },
            if !c.exists {
                ": absent, cuFile uses built-in defaults".to_string()
            } else if let Some(e) = &c.error {
                format!(": {e}")
            } else {
                String::new()
            }
        )?;
        for v in &c.values {
            writeln!(s, "    {} = {}", v.key, v.value)?;
        }
        Ok(())
    }

    fn paths_text(&self, s: &mut String) -> fmt::Result {
        writeln!(s, "\n== Paths (what --require checks)")?;
        for p in &self.paths {
            // Upper case draws the eye to a path that works below what it should.
            let state = match p.state {
                PathState::Degraded => "DEGRADED",
                s => s.name(),
            };
            let line = format!(
                "  {:<15} {:<9}{}",
                p.path.name(),
                state,
                p.reasons.join("; ")
            );
            writeln!(s, "{}", line.trim_end())?;
        }
        Ok(())
    }
}
