//! The node report (tier 0): the JSON shape pinned at every level, a sample rendering, a round
//! trip, the advice rules, the GPU-to-NIC affinity, the health checks on a fake system tree
//! (sysfs, procfs, kernel log, modules, configuration) with fake NVML answers, each path's status
//! for `--require`, and the probe's command line.

use gpudirect::cuda::DeviceInfo;
use gpudirect::report::*;
use gpudirect::topology::Affinity;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

fn gpu(ordinal: usize, bus: &str) -> DeviceInfo {
    DeviceInfo {
        ordinal,
        name: "NVIDIA H200".into(),
        pci_bus_id: bus.into(),
        total_memory_bytes: 150_754_820_096,
        compute_capability: (9, 0),
        copy_engines: 7,
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

fn pair(src: usize, dst: usize, nvlink: Option<u32>, access: bool) -> P2pPair {
    P2pPair {
        src,
        dst,
        can_access: access,
        performance_rank: 0,
        native_atomics: access,
        interconnect: if nvlink.is_some() { "nvlink" } else { "pcie" }.into(),
        nvlink_links: nvlink,
        interconnect_detail: nvlink.map_or("PCIe (system)".into(), |n| format!("NV{n}")),
        copy: Some(CopyMeasurement {
            bytes: 32 << 20,
            gb_per_s: 385.25,
            path: "peer".into(),
            reason: None,
            verified: true,
        }),
    }
}

fn nic(name: &str, active: bool) -> VerbsDeviceSummary {
    VerbsDeviceSummary {
        name: name.into(),
        fw_ver: Some("28.39.1002".into()),
        memory_windows: Some(true),
        pci_bus_id: Some("0000:06:00.0".into()),
        numa_node: Some(0),
        ports: vec![PortSummary {
            port: 1,
            state: if active { "ACTIVE" } else { "DOWN" }.into(),
            link_layer: "Ethernet".into(),
            active_mtu: 1024,
            max_mtu: 4096,
            speed_gbps: Some(100.0),
            speed: Some("100 Gb/sec (4X EDR)".into()),
            gids: vec![GidSummary {
                index: 1,
                gid: "0000:0000:0000:0000:0000:ffff:0a4d:0001".into(),
                gid_type: "RoCE v2".into(),
            }],
            error: None,
        }],
        error: None,
    }
}

fn sample() -> NodeReport {
    let mut r = NodeReport {
        schema_version: SCHEMA_VERSION,
        measured: true,
        libraries: vec![
            LibraryStatus::loaded("libcuda", "/usr/lib/libcuda.so.1", Some("13.0".into())),
            LibraryStatus::missing("libibverbs", "libibverbs not found (tried libibverbs.so.1)"),
        ],
        cuda: CudaSection {
            driver_version: Some(13000),
            bindings_version: 12080,
            devices: vec![gpu(0, "0000:05:00.0"), gpu(1, "0000:19:00.0")],
            absent_reason: None,
        },
        p2p: P2pSection {
            pairs: vec![pair(0, 1, Some(18), true), pair(1, 0, Some(18), true)],
            nvml_unavailable: None,
            absent_reason: None,
            verdict: "1 of 1 GPU pairs have peer access, 1 over NVLink".into(),
        },
        rdma: RdmaSection {
            devices: vec![nic("mlx5_0", true)],
            gpus: vec![GpuRdmaReadiness {
                gpu: 0,
                gpudirect_rdma: true,
                dma_buf: true,
                verbs_dmabuf: true,
                peermem: None,
                vmm_rdma: true,
                registration: "dma-buf".into(),
            }],
            affinity: vec![GpuNicAffinity {
                gpu: 0,
                gpu_pci_bus_id: "0000:05:00.0".into(),
                nics: vec![NicAffinity {
                    nic: "mlx5_0".into(),
                    affinity: Affinity::SamePcieSwitch,
                    active: true,
                }],
                best: Some("mlx5_0".into()),
            }],
            absent_reason: None,
            verdict: "1 verbs device(s), 1 with an active port".into(),
        },
        storage: StorageSection {
            cufile_version: Some("1.15".into()),
            properties: Some(CufileProperties {
                nvfs_version: "0.0".into(),
                fs_support: vec![],
                allow_compat_mode: true,
                batch_io: true,
                streams: true,
                poll_mode: false,
                max_direct_io_kib: 16384,
                max_device_pinned_mem_kib: 33554432,
                max_batch_io_size: 128,
            }),
            mode: "compatibility".into(),
            mode_reason: "nvidia-fs is not loaded".into(),
            nvidia_fs_version: None,
            read: Some(StorageRead {
                file: "/tmp/gpudirect-probe-1".into(),
                bytes: 64 << 20,
                gb_per_s: 3.5,
                path: "posix".into(),
                reason: "cuFile in compatibility mode is slower".into(),
                direct: true,
                verified: true,
            }),
            absent_reason: None,
            verdict: "cuFile in compatibility mode".into(),
        },
        async_: AsyncSection {
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
            verdict: "stream mem ops v2 yes".into(),
        },
        health: fake_health(),
        paths: vec![],
        advice: vec![],
        settings: settings_from_env(|k| (k == "NCCL_IB_DISABLE").then(|| "1".to_string())),
    };
    r.paths = path_statuses(&r);
    r.advice = advise(&r);
    r
}

fn keys(v: &serde_json::Value) -> Vec<String> {
    let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
    k.sort();
    k
}

#[test]
fn json_shape_is_pinned() {
    let v = serde_json::to_value(sample()).unwrap();
    assert_eq!(
        keys(&v),
        [
            "advice",
            "async",
            "cuda",
            "health",
            "libraries",
            "measured",
            "p2p",
            "paths",
            "rdma",
            "schema_version",
            "settings",
            "storage"
        ]
    );
    assert_eq!(v["schema_version"], 3);
    assert_eq!(
        keys(&v["libraries"][0]),
        ["error", "loaded", "name", "path", "version"]
    );
    assert_eq!(
        keys(&v["cuda"]),
        [
            "absent_reason",
            "bindings_version",
            "devices",
            "driver_version"
        ]
    );
    assert_eq!(
        keys(&v["cuda"]["devices"][0]),
        [
            "can_flush_remote_writes",
            "compute_capability",
            "copy_engines",
            "dma_buf",
            "gpudirect_rdma",
            "gpudirect_rdma_vmm",
            "host_register",
            "memory_pools",
            "name",
            "ordinal",
            "pci_bus_id",
            "posix_fd_handles",
            "rdma_flush_writes_options",
            "rdma_writes_ordering",
            "stream_mem_ops",
            "stream_mem_ops_64",
            "stream_wait_value_nor",
            "total_memory_bytes"
        ]
    );
    assert_eq!(
        v["cuda"]["devices"][0]["compute_capability"],
        serde_json::json!([9, 0])
    );
    assert_eq!(
        keys(&v["p2p"]),
        ["absent_reason", "nvml_unavailable", "pairs", "verdict"]
    );
    assert_eq!(
        keys(&v["p2p"]["pairs"][0]),
        [
            "can_access",
            "copy",
            "dst",
            "interconnect",
            "interconnect_detail",
            "native_atomics",
            "nvlink_links",
            "performance_rank",
            "src"
        ]
    );
    assert_eq!(
        keys(&v["p2p"]["pairs"][0]["copy"]),
        ["bytes", "gb_per_s", "path", "reason", "verified"]
    );
    assert_eq!(
        keys(&v["rdma"]),
        ["absent_reason", "affinity", "devices", "gpus", "verdict"]
    );
    assert_eq!(
        keys(&v["rdma"]["devices"][0]),
        [
            "error",
            "fw_ver",
            "memory_windows",
            "name",
            "numa_node",
            "pci_bus_id",
            "ports"
        ]
    );
    assert_eq!(
        keys(&v["rdma"]["devices"][0]["ports"][0]),
        [
            "active_mtu",
            "error",
            "gids",
            "link_layer",
            "max_mtu",
            "port",
            "speed",
            "speed_gbps",
            "state"
        ]
    );
    assert_eq!(
        keys(&v["rdma"]["devices"][0]["ports"][0]["gids"][0]),
        ["gid", "gid_type", "index"]
    );
    assert_eq!(
        keys(&v["rdma"]["gpus"][0]),
        [
            "dma_buf",
            "gpu",
            "gpudirect_rdma",
            "peermem",
            "registration",
            "verbs_dmabuf",
            "vmm_rdma"
        ]
    );
    assert_eq!(
        keys(&v["rdma"]["affinity"][0]),
        ["best", "gpu", "gpu_pci_bus_id", "nics"]
    );
    assert_eq!(
        keys(&v["rdma"]["affinity"][0]["nics"][0]),
        ["active", "affinity", "nic"]
    );
    assert_eq!(
        v["rdma"]["affinity"][0]["nics"][0]["affinity"],
        "same_pcie_switch"
    );
    assert_eq!(
        keys(&v["storage"]),
        [
            "absent_reason",
            "cufile_version",
            "mode",
            "mode_reason",
            "nvidia_fs_version",
            "properties",
            "read",
            "verdict"
        ]
    );
    assert_eq!(
        keys(&v["storage"]["properties"]),
        [
            "allow_compat_mode",
            "batch_io",
            "fs_support",
            "max_batch_io_size",
            "max_device_pinned_mem_kib",
            "max_direct_io_kib",
            "nvfs_version",
            "poll_mode",
            "streams"
        ]
    );
    assert_eq!(
        keys(&v["storage"]["read"]),
        [
            "bytes", "direct", "file", "gb_per_s", "path", "reason", "verified"
        ]
    );
    assert_eq!(keys(&v["async"]), ["absent_reason", "gpus", "verdict"]);
    assert_eq!(
        keys(&v["async"]["gpus"][0]),
        [
            "can_flush_remote_writes",
            "copy_engines",
            "flush_rdma_writes_options",
            "gpu",
            "memory_pools",
            "stream_mem_ops_64",
            "stream_mem_ops_v2"
        ]
    );
    assert_eq!(keys(&v["advice"][0]), ["text", "topic"]);
    assert_eq!(keys(&v["settings"][0]), ["name", "value", "what"]);
    let h = &v["health"];
    assert_eq!(
        keys(h),
        [
            "cufile_config",
            "kernel",
            "kernel_log_unreadable",
            "memlock",
            "modules",
            "nvlink",
            "pcie",
            "peer_memory_clients",
            "requirements"
        ]
    );
    assert_eq!(
        keys(&h["kernel"]),
        [
            "nvidia_driver",
            "nvidia_kernel_module",
            "pci_p2pdma",
            "release"
        ]
    );
    assert_eq!(keys(&h["requirements"][0]), ["checks", "met", "path"]);
    assert_eq!(
        keys(&h["requirements"][0]["checks"][0]),
        ["found", "item", "met", "needs"]
    );
    assert_eq!(
        keys(&h["modules"][0]),
        [
            "installed",
            "load_errors",
            "loaded",
            "name",
            "state",
            "version"
        ]
    );
    assert_eq!(keys(&h["pcie"]), ["iommu", "links", "paths"]);
    assert_eq!(
        keys(&h["pcie"]["links"][0]),
        [
            "current_speed",
            "current_width",
            "device",
            "error",
            "iommu_domain",
            "iommu_group",
            "kind",
            "max_speed",
            "max_width",
            "pci_bus_id",
            "speed_degraded",
            "speed_under_load",
            "width_degraded"
        ]
    );
    assert_eq!(
        keys(&h["pcie"]["paths"][0]),
        [
            "acs_redirects",
            "bridges",
            "error",
            "from",
            "kind",
            "meets_at",
            "to"
        ]
    );
    assert_eq!(
        keys(&h["pcie"]["paths"][0]["bridges"][0]),
        ["control", "flags", "note", "pci_bus_id", "redirects"]
    );
    assert_eq!(
        keys(&h["pcie"]["iommu"]),
        ["cmdline", "enabled", "groups", "units"]
    );
    assert_eq!(keys(&h["nvlink"]), ["absent_reason", "gpus"]);
    assert_eq!(
        keys(&h["nvlink"]["gpus"][0]),
        [
            "active_links",
            "error",
            "gpu",
            "link_count",
            "links",
            "pci_bus_id"
        ]
    );
    assert_eq!(
        keys(&h["nvlink"]["gpus"][0]["links"][0]),
        [
            "counting_errors",
            "down",
            "errors",
            "errors_before",
            "errors_grew",
            "link",
            "remote_device",
            "remote_pci_bus_id",
            "speed_mbps",
            "state",
            "version"
        ]
    );
    assert_eq!(
        keys(&h["nvlink"]["gpus"][0]["links"][0]["errors"]),
        ["crc_data", "crc_flit", "recovery", "replay"]
    );
    assert_eq!(
        keys(&h["memlock"]),
        [
            "allows",
            "cap_ipc_lock",
            "error",
            "hard_bytes",
            "hard_unlimited",
            "low",
            "soft_bytes",
            "soft_unlimited"
        ]
    );
    assert_eq!(
        keys(&h["cufile_config"]),
        ["error", "exists", "path", "source", "values"]
    );
    assert_eq!(keys(&h["cufile_config"]["values"][0]), ["key", "value"]);
    assert_eq!(keys(&v["paths"][0]), ["path", "reasons", "state"]);
    assert_eq!(v["paths"][5]["path"], "gpudirect-rdma");
    assert_eq!(v["paths"][5]["state"], "degraded");
    // Round trip.
    let back: NodeReport = serde_json::from_value(v.clone()).unwrap();
    assert_eq!(serde_json::to_value(&back).unwrap(), v);
}

#[test]
fn text_rendering_has_a_section_and_verdict_per_path() {
    let text = sample().to_string();
    for needle in [
        "gpudirect node report (schema 3, quick measurements requested)",
        "libcuda     loaded   /usr/lib/libcuda.so.1 (version 13.0)",
        "libibverbs  MISSING  libibverbs not found (tried libibverbs.so.1)",
        "driver: CUDA 13.0   bindings: CUDA 12.8",
        "GPU 0 NVIDIA H200  pci 0000:05:00.0  140.4 GiB  sm_90  copy engines 7",
        "dma-buf yes  GPUDirect RDMA yes  RDMA with VMM yes",
        "== P2P\n  verdict: 1 of 1 GPU pairs have peer access, 1 over NVLink",
        "0->1   yes    0    yes     NV18                 385.2 GB/s  peer  verified",
        "== RDMA (verbs)\n  verdict: ",
        "mlx5_0  fw 28.39.1002  pci 0000:06:00.0  numa 0",
        "    memory windows type 2: yes (transfer engine: per-peer access possible)",
        "port 1: ACTIVE  Ethernet  MTU 1024 (max 4096)  speed 100 Gb/sec (4X EDR)",
        "GID[1] 0000:0000:0000:0000:0000:ffff:0a4d:0001  RoCE v2",
        "-> registration: dma-buf",
        "GPU 0 [0000:05:00.0] NICs: mlx5_0 same PCIe switch  -> use mlx5_0",
        "== Storage (cuFile)\n  verdict: ",
        "cuFile 1.15  mode compatibility: nvidia-fs is not loaded  nvidia-fs module not loaded",
        "read 64 MiB: 3.50 GB/s via posix (cuFile in compatibility mode is slower), O_DIRECT yes, verified",
        "== Async\n  verdict: ",
        "GPU 0: stream mem ops v2 yes (64-bit yes)  memory pools yes  copy engines 7  flush remote writes no (options 0x1)",
        "== Advice\n  - [p2p] NVLink joins GPU pairs 0-1",
        "NCCL_IB_DISABLE              1 ",
        "== Driver and kernel\n  Linux 6.8.0-57-generic  NVIDIA driver 580.95.05 (open kernel modules)  PCI P2PDMA yes",
        "modules: nvidia Live 580.95.05; nvidia_peermem not loaded (installed); nvidia_fs not loaded (not installed); ib_core Live; ib_uverbs not loaded (not installed)",
        "peer-memory API (MLNX_OFED/DOCA-OFED): absent",
        "kernel log [nvidia_fs]: nvidia_fs: Unknown symbol nvfs_dma_map (err -2)",
        "GPUDirect RDMA by dma-buf: met",
        "GPUDirect RDMA by nvidia-peermem: NOT met",
        "    NO   RDMA core the peer-memory API (MLNX_OFED or DOCA-OFED): absent (inbox RDMA stack)",
        "== PCIe\n  IOMMU: on (3 groups)  units dmar0  kernel parameters intel_iommu=on",
        "GPU 0 [0000:05:00.0]: 16.0 GT/s PCIe x8 of 32.0 GT/s PCIe x16  iommu group 7 (DMA-FQ)  DEGRADED (width)",
        "mlx5_0 [0000:06:00.0]: 8.0 GT/s PCIe x16 of 16.0 GT/s PCIe x16  iommu group 8 (identity)  DEGRADED (speed)",
        "GPU 0 <-> GPU 1: meet at root complex pci0000:00; ACS cannot redirect (no shared switch); bridges: 0000:00:01.0 unknown (needs root",
        "    links 0-2,4,6-17: up, v4 26562 MB/s, remote 0000:19:00.0 (GPU 1), no replays or recoveries, CRC errors corrected (normal): flit 0, data 0-42 per link\n",
        "GPU 0 <-> mlx5_0: meet at PCIe switch (bridge 0000:01:00.0); ACS redirect YES; bridges: 0000:02:08.0 ACSCtl 0x001d [SrcValid ReqRedir CmpltRedir UpstreamFwd], 0000:02:10.0 ACSCtl 0x0000 [none]",
        "== NVLink\n  GPU 0: 17 of 18 links up, error growth not measured\n",
        "    link 3  down  v4 26562 MB/s  remote unknown  errors replay 0 recovery 0 crc flit 0 crc data 0  DOWN\n",
        "    link 5  up    v4 26562 MB/s  remote 0000:19:00.0 (GPU 1)  errors replay 12 recovery 0 crc flit 0 crc data 0  REPLAY/RECOVERY ERRORS\n",
        "  GPU 1: nvmlDeviceGetHandleByPciBusId: Not Found",
        "locked memory (ulimit -l): 8 MiB (hard 8 MiB), LOW: allows at most 8 MiB of host memory registered for RDMA at once",
        "    properties.allow_compat_mode = false",
        "== Paths (what --require checks)\n  gpu             DEGRADED GPU 0 PCIe link x8 of x16 lanes\n  multi-gpu       ok\n",
        "  gds             unusable no GPUDirect Storage (cuFile in compatibility mode: nvidia-fs is not loaded)",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
}

fn has(advice: &[Advice], topic: &str, needle: &str) -> bool {
    advice
        .iter()
        .any(|a| a.topic == topic && a.text.contains(needle))
}

#[test]
fn advice_follows_the_decision_rules() {
    let r = sample();
    let a = &r.advice;
    // NVLink present: use P2P.
    assert!(
        has(a, "p2p", "NVLink joins GPU pairs 0-1: use P2P"),
        "{a:#?}"
    );
    // A NIC under the same switch: GPUDirect RDMA with it.
    assert!(
        has(
            a,
            "rdma",
            "GPU 0: mlx5_0 is under the same PCIe switch: use GPUDirect RDMA with mlx5_0"
        ),
        "{a:#?}"
    );
    // No nvidia-fs: compatibility mode, the Auto path.
    assert!(
        has(
            a,
            "storage",
            "compatibility mode: storage::GdsFile in Mode::Auto"
        ),
        "{a:#?}"
    );
    // NCCL_IB_DISABLE=1 with an active port.
    assert!(has(a, "settings", "NCCL_IB_DISABLE=1"), "{a:#?}");
    assert!(!has(a, "gpu", "No GPU"));

    // No peer path: staged, for P2P and for RDMA.
    let mut r = sample();
    r.p2p.pairs = vec![pair(0, 1, None, false), pair(1, 0, None, false)];
    r.rdma.gpus[0].dma_buf = false;
    r.rdma.gpus[0].registration = "none".into();
    r.storage.mode = "gds".into();
    r.settings = settings_from_env(|_| None);
    let a = advise(&r);
    assert!(
        has(
            &a,
            "p2p",
            "pairs 0-1 have no peer-memory path: copies between them use the staged path"
        ),
        "{a:#?}"
    );
    assert!(!has(&a, "p2p", "NVLink"));
    assert!(
        has(
            &a,
            "rdma",
            "GPU 0: no peer-memory path (no dma-buf support and nvidia-peermem is not loaded): RDMA must use the staged path"
        ),
        "{a:#?}"
    );
    assert!(!has(&a, "rdma", "use GPUDirect RDMA with"));
    assert!(has(&a, "storage", "nvidia-fs is loaded"));
    assert!(!has(&a, "settings", ""));
    assert!(!has(&a, "storage", "allow_compat_mode"), "gds mode: {a:#?}");

    // PCIe peers, a NIC across the CPU.
    let mut r = sample();
    r.p2p.pairs = vec![pair(0, 1, None, true)];
    r.rdma.affinity[0].nics[0].affinity = Affinity::AcrossCpu;
    let a = advise(&r);
    assert!(
        has(&a, "p2p", "pairs 0-1 have peer access without NVLink"),
        "{a:#?}"
    );
    assert!(has(&a, "rdma", "across the CPU interconnect"), "{a:#?}");

    // NVML unknown: peer access, link unknown; no NIC: no RDMA staging advice.
    let mut r = sample();
    let mut p = pair(0, 1, None, true);
    p.interconnect = "unknown".into();
    r.p2p.pairs = vec![p];
    r.rdma.devices.clear();
    r.rdma.gpus[0].registration = "none".into();
    r.health.requirements.clear();
    let a = advise(&r);
    assert!(
        has(&a, "p2p", "pairs 0-1 have peer access over an unknown link"),
        "{a:#?}"
    );
    assert!(!has(&a, "p2p", "without NVLink"));
    assert!(!has(&a, "rdma", "staged path"), "{a:#?}");

    // No GPU at all.
    let mut r = sample();
    r.cuda.devices.clear();
    r.cuda.driver_version = None;
    assert!(has(&advise(&r), "gpu", "No GPU here (no CUDA driver)"));
}

/// Each GPU's NIC in the report: the closest with an active port ([`gpu_affinity`] over the
/// health checks' fake tree: GPU 0 and mlx5_0 below one switch, GPU 1 on another root port; the
/// placement rules themselves are tested in tests/topology.rs).
#[test]
fn each_gpu_picks_the_closest_nic_with_an_active_port() {
    let root = fake_root();
    let sysfs = root.join("sys");
    let nics = vec![nic("mlx5_1", true), nic("mlx5_0", true), nic("rxe0", true)];
    let a0 = gpu_affinity(&sysfs, 0, "0000:05:00.0", &nics);
    assert_eq!(a0.best.as_deref(), Some("mlx5_0"));
    let by = |n: &str| a0.nics.iter().find(|x| x.nic == n).unwrap().affinity;
    assert_eq!(by("mlx5_0"), Affinity::SamePcieSwitch);
    assert_eq!(by("mlx5_1"), Affinity::Unknown, "not in this tree");
    assert_eq!(by("rxe0"), Affinity::Unknown);
    // Listed in the order given.
    let order: Vec<&str> = a0.nics.iter().map(|n| n.nic.as_str()).collect();
    assert_eq!(order, ["mlx5_1", "mlx5_0", "rxe0"]);
    let a1 = gpu_affinity(&sysfs, 1, "0000:19:00.0", &nics);
    assert_eq!(a1.nics[1].affinity, Affinity::SameNumaNode);
    assert_eq!(a1.best.as_deref(), Some("mlx5_0"));
    // An active port beats a closer NIC that is down.
    let nics = vec![nic("mlx5_0", false), nic("mlx5_1", true)];
    assert_eq!(
        gpu_affinity(&sysfs, 0, "0000:05:00.0", &nics)
            .best
            .as_deref(),
        Some("mlx5_1")
    );
    // A GPU sysfs does not know: every NIC unknown, the first active one chosen.
    let a = gpu_affinity(&sysfs, 2, "0000:ee:00.0", &[nic("mlx5_0", true)]);
    assert_eq!(a.nics[0].affinity, Affinity::Unknown);
    assert_eq!(a.best.as_deref(), Some("mlx5_0"));
    assert_eq!(best_nic(&[]), None);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn gather_never_panics_and_explains_absence() {
    let r = NodeReport::gather_with(&GatherOptions {
        measure: false,
        ..GatherOptions::default()
    });
    assert_eq!(r.schema_version, SCHEMA_VERSION);
    assert!(!r.measured);
    let cuda = r.libraries.iter().find(|l| l.name == "libcuda").unwrap();
    for name in ["libcufile", "libibverbs", "librdmacm"] {
        assert!(r.libraries.iter().any(|l| l.name == name), "{name}");
    }
    if cuda.loaded {
        assert!(cuda.path.is_some());
    } else {
        let err = cuda.error.as_deref().unwrap();
        assert!(err.contains("libcuda.so.1"), "{err}");
        assert!(r.cuda.devices.is_empty());
        assert!(r.cuda.absent_reason.is_some());
    }
    if r.cuda.devices.is_empty() {
        for v in [&r.p2p.verdict, &r.async_.verdict] {
            assert!(v.starts_with("SKIPPED: no GPU"), "{v}");
        }
        assert!(r.storage.read.is_none());
    }
    if r.rdma.devices.is_empty() {
        assert!(
            r.rdma.verdict.starts_with("SKIPPED: no verbs device"),
            "{}",
            r.rdma.verdict
        );
    }
    for v in [
        &r.p2p.verdict,
        &r.rdma.verdict,
        &r.storage.verdict,
        &r.async_.verdict,
    ] {
        assert!(!v.is_empty() && !v.contains('\n'), "{v:?}");
    }
    assert_eq!(r.settings.len(), 6);
    assert_eq!(r.paths.len(), DataPath::ALL.len());
    if r.cuda.devices.is_empty() {
        for p in &r.paths {
            assert_eq!(p.state, PathState::Unusable, "{p:?}");
        }
        assert_eq!(
            r.health.nvlink.absent_reason.as_deref(),
            Some("no GPU"),
            "{:?}",
            r.health.nvlink
        );
    }
    let text = r.to_string();
    for section in [
        "== P2P",
        "== RDMA",
        "== Storage",
        "== Async",
        "== Driver and kernel",
        "== PCIe",
        "== NVLink",
        "== Limits and configuration",
        "== Paths",
        "== Advice",
    ] {
        assert!(text.contains(section), "{section}");
    }
}

#[test]
#[ignore = "prints the sample rendering"]
fn print_sample() {
    print!("{}", sample());
}

// ---- The health checks on a fake system tree ----

static FAKE_ROOTS: AtomicUsize = AtomicUsize::new(0);

/// Config space of a bridge with an AER capability then ACS with control register `ctrl`.
fn bridge_config(ctrl: u16) -> Vec<u8> {
    let mut c = vec![0u8; 4096];
    let aer = 0x0001u32 | (1 << 16) | (0x148 << 20);
    c[0x100..0x104].copy_from_slice(&aer.to_le_bytes());
    let acs = 0x000Du32 | (1 << 16);
    c[0x148..0x14c].copy_from_slice(&acs.to_le_bytes());
    c[0x14c..0x14e].copy_from_slice(&0x005fu16.to_le_bytes());
    c[0x14e..0x150].copy_from_slice(&ctrl.to_le_bytes());
    c
}

/// A whole fake system under a fresh folder: GPU 0 (0000:05:00.0, x8 of x16) and mlx5_0
/// (0000:06:00.0, 8 of 16 GT/s) below one PCIe switch whose GPU-side port has ACS redirection
/// on; GPU 1 (0000:19:00.0, idle at 2.5 GT/s) on another root port; an Intel IOMMU translating
/// for the GPUs; NVIDIA's open driver 580.95.05 on Linux 6.8 with P2PDMA; nvidia-peermem
/// installed but not loaded and no peer-memory API; nvidia-fs failing in the kernel log; a
/// cuFile configuration with comments and compatibility mode off; no CAP_IPC_LOCK.
fn fake_root() -> PathBuf {
    let n = FAKE_ROOTS.fetch_add(1, Ordering::Relaxed);
    let root = std::env::temp_dir().join(format!("gpudirect-fake-root-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let write = |rel: &str, data: &[u8]| {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, data).unwrap();
    };
    let link = |rel: &str, to: &Path| {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(to, p).unwrap();
    };
    let devs = root.join("sys/devices");
    let pcidev = |path: &str, speed: (&str, u32), max: (&str, u32), group: Option<u32>| {
        let d = devs.join(path);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("numa_node"), "0\n").unwrap();
        std::fs::write(d.join("current_link_speed"), format!("{}\n", speed.0)).unwrap();
        std::fs::write(d.join("current_link_width"), format!("{}\n", speed.1)).unwrap();
        std::fs::write(d.join("max_link_speed"), format!("{}\n", max.0)).unwrap();
        std::fs::write(d.join("max_link_width"), format!("{}\n", max.1)).unwrap();
        if let Some(g) = group {
            std::os::unix::fs::symlink(
                root.join(format!("sys/kernel/iommu_groups/{g}")),
                d.join("iommu_group"),
            )
            .unwrap();
        }
        let bdf = path.rsplit('/').next().unwrap();
        link(&format!("sys/bus/pci/devices/{bdf}"), &d);
        d
    };
    let sw = "pci0000:00/0000:00:01.0/0000:01:00.0";
    for (g, t) in [(7, "DMA-FQ"), (8, "identity"), (9, "DMA")] {
        write(
            &format!("sys/kernel/iommu_groups/{g}/type"),
            format!("{t}\n").as_bytes(),
        );
    }
    let gen5 = ("32.0 GT/s PCIe", 16);
    pcidev(
        &format!("{sw}/0000:02:08.0/0000:05:00.0"),
        ("16.0 GT/s PCIe", 8),
        gen5,
        Some(7),
    );
    let n0 = pcidev(
        &format!("{sw}/0000:02:10.0/0000:06:00.0"),
        ("8.0 GT/s PCIe", 16),
        ("16.0 GT/s PCIe", 16),
        Some(8),
    );
    pcidev(
        "pci0000:00/0000:00:03.0/0000:19:00.0",
        ("2.5 GT/s PCIe", 16),
        gen5,
        Some(9),
    );
    for (bridge, cfg) in [
        (format!("{sw}/0000:02:08.0"), bridge_config(0x001d)),
        (format!("{sw}/0000:02:10.0"), bridge_config(0)),
        ("pci0000:00/0000:00:01.0".to_string(), vec![0u8; 64]),
        ("pci0000:00/0000:00:03.0".to_string(), vec![0u8; 64]),
    ] {
        let d = devs.join(&bridge);
        std::fs::write(d.join("config"), cfg).unwrap();
        let bdf = bridge.rsplit('/').next().unwrap();
        link(&format!("sys/bus/pci/devices/{bdf}"), &d);
    }
    link("sys/class/infiniband/mlx5_0/device", &n0);
    write("sys/class/iommu/dmar0/name", b"dmar0\n");
    write("sys/module/nvidia/version", b"580.95.05\n");
    write("sys/module/nvidia/initstate", b"live\n");
    write("sys/module/ib_core/initstate", b"live\n");
    write("proc/sys/kernel/osrelease", b"6.8.0-57-generic\n");
    write(
        "proc/driver/nvidia/version",
        b"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U22)\nGCC version:  gcc version 12.3.0\n",
    );
    write(
        "proc/modules",
        b"nvidia 14381056 2 - Live 0x0000000000000000 (OE)\nib_core 462848 0 - Live 0x0000000000000000\n",
    );
    write(
        "proc/cmdline",
        b"BOOT_IMAGE=/vmlinuz-6.8.0-57-generic root=/dev/sda1 intel_iommu=on quiet\n",
    );
    write(
        "proc/self/status",
        b"Name:\tprobe\nCapEff:\t0000000000000000\n",
    );
    write(
        "boot/config-6.8.0-57-generic",
        b"CONFIG_PCI=y\nCONFIG_PCI_P2PDMA=y\n",
    );
    write(
        "lib/modules/6.8.0-57-generic/modules.dep",
        b"kernel/drivers/video/nvidia-peermem.ko.zst: kernel/drivers/infiniband/core/ib_core.ko.zst\nkernel/drivers/infiniband/core/ib_core.ko.zst:\n",
    );
    write(
        "dev/kmsg",
        b"3,812,5000123,-;nvidia_fs: Unknown symbol nvfs_dma_map (err -2)\n6,813,5000200,-;mlx5_core 0000:06:00.0: firmware version 28.39.1002\n",
    );
    write(
        "etc/cufile.json",
        b"{\n  // cuFile settings\n  \"logging\": { \"dir\": \"/var/log\" },\n  \"execution\": { \"max_io_threads\": 4 },\n  \"properties\": {\n    /* sizes in KiB */\n    \"max_direct_io_size_kb\": 16384,\n    \"per_buffer_cache_size_kb\": 1024,\n    \"allow_compat_mode\": false\n  }\n}\n",
    );
    root
}

/// NVML's answers: GPU 0 has 18 links to GPU 1, link 3 down, link 5 counting replays, link 7
/// corrected CRC errors; GPU 1 has no NVML handle.
struct FakeNvml(HashMap<String, NvlinkAnswer>);

impl NvmlSource for FakeNvml {
    fn driver_version(&self) -> Option<String> {
        Some("580.95.05".into())
    }
    fn nvlinks(&self, bus_id: &str) -> NvlinkAnswer {
        self.0
            .get(bus_id)
            .cloned()
            .unwrap_or_else(|| Err(format!("no fake answer for {bus_id}")))
    }
}

fn fake_nvml() -> FakeNvml {
    let links = (0..18)
        .map(|l| NvlinkReading {
            link: l,
            active: Ok(l != 3),
            version: Some(4),
            speed_mbps: Some(26562),
            remote_pci_bus_id: (l != 3).then(|| "0000:19:00.0".to_string()),
            remote_device_type: (l != 3).then_some(NvlinkRemote::Gpu),
            errors: NvlinkErrors {
                replay: Some(if l == 5 { 12 } else { 0 }),
                recovery: Some(0),
                crc_flit: Some(0),
                // Corrected CRC errors on a healthy link: shown, not flagged.
                crc_data: Some(if l == 7 { 42 } else { 0 }),
            },
        })
        .collect();
    FakeNvml(HashMap::from([
        ("0000:05:00.0".to_string(), Ok((Some(18), links))),
        (
            "0000:19:00.0".to_string(),
            Err("nvmlDeviceGetHandleByPciBusId: Not Found".to_string()),
        ),
    ]))
}

fn health_of(root: &Path, env: &dyn Fn(&str) -> Option<String>) -> HealthSection {
    let nvml = fake_nvml();
    let gpus = [
        HealthGpu {
            ordinal: 0,
            pci_bus_id: "0000:05:00.0".into(),
            compute_capability: (9, 0),
            nearest_nic: Some("mlx5_0".into()),
        },
        HealthGpu {
            ordinal: 1,
            pci_bus_id: "0000:19:00.0".into(),
            compute_capability: (9, 0),
            nearest_nic: None,
        },
    ];
    let nics = [HealthNic {
        name: "mlx5_0".into(),
        pci_bus_id: Some("0000:06:00.0".into()),
    }];
    gather_health(&HealthInputs {
        paths: &SystemPaths::under(root),
        env,
        memlock: Ok((Some(8 << 20), Some(8 << 20))),
        nvml: Ok(&nvml),
        nvlink_before: None,
        gpus: &gpus,
        nics: &nics,
        verbs_dmabuf: Some(true),
        cufile_version: Some("1.15".into()),
    })
}

fn fake_health() -> HealthSection {
    let root = fake_root();
    let h = health_of(&root, &|_| None);
    let _ = std::fs::remove_dir_all(&root);
    h
}

#[test]
fn health_reads_a_fake_system_exactly() {
    let root = fake_root();
    let h = health_of(&root, &|_| None);
    let k = &h.kernel;
    assert_eq!(k.release.as_deref(), Some("6.8.0-57-generic"));
    assert_eq!(k.nvidia_driver.as_deref(), Some("580.95.05"));
    assert_eq!(k.nvidia_kernel_module.as_deref(), Some("open"));
    assert_eq!(k.pci_p2pdma, Some(true));

    // Modules: peermem absent (installed, not loaded), nvidia-fs failing in the log.
    let m: Vec<_> = h
        .modules
        .iter()
        .map(|m| {
            (
                m.name.as_str(),
                m.loaded,
                m.state.as_deref(),
                m.installed,
                m.load_errors.len(),
            )
        })
        .collect();
    assert_eq!(
        m,
        [
            ("nvidia", true, Some("Live"), Some(true), 0),
            ("nvidia_peermem", false, None, Some(true), 0),
            ("nvidia_fs", false, None, Some(false), 1),
            ("ib_core", true, Some("Live"), Some(true), 0),
            ("ib_uverbs", false, None, Some(false), 0),
        ]
    );
    assert_eq!(h.modules[0].version.as_deref(), Some("580.95.05"));
    assert_eq!(
        h.modules[2].load_errors,
        ["nvidia_fs: Unknown symbol nvfs_dma_map (err -2)"]
    );
    assert_eq!(h.peer_memory_clients, None);
    assert_eq!(h.kernel_log_unreadable, None);

    // Requirements.
    let met: Vec<(&str, Option<bool>)> = h
        .requirements
        .iter()
        .map(|r| (r.path.as_str(), r.met))
        .collect();
    assert_eq!(
        met,
        [
            ("GPUDirect RDMA by dma-buf", Some(true)),
            ("GPUDirect RDMA by nvidia-peermem", Some(false)),
            ("GPUDirect Storage by nvidia-fs", Some(false)),
            ("GPUDirect Storage by PCI P2PDMA", Some(true)),
        ]
    );
    let unmet: Vec<(&str, &str)> = h.requirements[1]
        .checks
        .iter()
        .filter(|c| c.met == Some(false))
        .map(|c| (c.item.as_str(), c.found.as_str()))
        .collect();
    assert_eq!(
        unmet,
        [
            ("RDMA core", "absent (inbox RDMA stack)"),
            ("module", "not loaded (installed)"),
        ]
    );

    // PCIe links: GPU 0 narrow, GPU 1 idle (not counted without a reading under load), NIC slow.
    let links: Vec<_> = h
        .pcie
        .links
        .iter()
        .map(|l| {
            (
                l.device.as_str(),
                l.speed_degraded,
                l.width_degraded,
                l.iommu_group,
                l.iommu_domain.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        links,
        [
            ("GPU 0", false, true, Some(7), Some("DMA-FQ")),
            ("GPU 1", false, false, Some(9), Some("DMA")),
            ("mlx5_0", true, false, Some(8), Some("identity")),
        ]
    );
    // A GPU read under load below its maximum is degraded.
    let mut g1 = h.pcie.links[1].clone();
    g1.speed_under_load = Some("16.0 GT/s PCIe".into());
    g1.update_degraded();
    assert!(g1.speed_degraded);
    g1.speed_under_load = Some("32.0 GT/s PCIe".into());
    g1.update_degraded();
    assert!(!g1.speed_degraded);

    // ACS: on between GPU 0 and its NIC (in the switch); GPU 0 and 1 meet at the root complex.
    let p = &h.pcie.paths;
    assert_eq!(p.len(), 2);
    assert_eq!((p[0].from.as_str(), p[0].to.as_str()), ("GPU 0", "mlx5_0"));
    assert_eq!(p[0].meets_at, "PCIe switch (bridge 0000:01:00.0)");
    assert_eq!(p[0].acs_redirects, Some(true));
    let b: Vec<(&str, Option<u16>, Option<bool>)> = p[0]
        .bridges
        .iter()
        .map(|b| (b.pci_bus_id.as_str(), b.control, b.redirects))
        .collect();
    assert_eq!(
        b,
        [
            ("0000:02:08.0", Some(0x001d), Some(true)),
            ("0000:02:10.0", Some(0), Some(false)),
        ]
    );
    assert_eq!(
        p[0].bridges[0].flags,
        ["SrcValid", "ReqRedir", "CmpltRedir", "UpstreamFwd"]
    );
    assert_eq!((p[1].from.as_str(), p[1].to.as_str()), ("GPU 0", "GPU 1"));
    assert_eq!(p[1].meets_at, "root complex pci0000:00");
    assert_eq!(p[1].acs_redirects, Some(false));
    let root_port = p[1]
        .bridges
        .iter()
        .find(|b| b.pci_bus_id == "0000:00:03.0")
        .unwrap();
    assert_eq!(root_port.redirects, None);
    assert!(
        root_port
            .note
            .as_deref()
            .unwrap()
            .starts_with("unknown (needs root"),
        "{root_port:?}"
    );

    // IOMMU on.
    let io = &h.pcie.iommu;
    assert_eq!(io.enabled, Some(true));
    assert_eq!(io.groups, 3);
    assert_eq!(io.units, ["dmar0"]);
    assert_eq!(io.cmdline, ["intel_iommu=on"]);

    // NVLink: link 3 down, link 5 counting replays; link 7's CRC counts are not flagged; GPU 1
    // unanswered.
    let nv = &h.nvlink;
    assert_eq!(nv.absent_reason, None);
    assert_eq!(nv.gpus[0].active_links, 17);
    let flagged: Vec<(u32, bool, bool)> = nv.gpus[0]
        .links
        .iter()
        .filter(|l| l.down || l.counting_errors)
        .map(|l| (l.link, l.down, l.counting_errors))
        .collect();
    assert_eq!(flagged, [(3, true, false), (5, false, true)]);
    let l7 = &nv.gpus[0].links[7];
    assert_eq!(l7.errors.crc_data, Some(42));
    assert!(!l7.degraded(), "{l7:?}");
    assert_eq!(
        (
            l7.remote_pci_bus_id.as_deref(),
            l7.remote_device.as_deref(),
            l7.errors_grew
        ),
        (Some("0000:19:00.0"), Some("GPU 1"), None)
    );
    assert_eq!(
        nv.gpus[1].error.as_deref(),
        Some("nvmlDeviceGetHandleByPciBusId: Not Found")
    );

    // Limits and the cuFile configuration.
    assert!(h.memlock.low);
    assert_eq!(h.memlock.cap_ipc_lock, Some(false));
    let c = &h.cufile_config;
    assert_eq!(c.source, "default");
    assert!(c.exists && c.error.is_none(), "{c:?}");
    let vals: Vec<(&str, &str)> = c
        .values
        .iter()
        .map(|v| (v.key.as_str(), v.value.as_str()))
        .collect();
    assert_eq!(
        vals,
        [
            ("properties.max_direct_io_size_kb", "16384"),
            ("properties.per_buffer_cache_size_kb", "1024"),
            ("properties.allow_compat_mode", "false"),
            ("execution.max_io_threads", "4"),
        ]
    );

    // CUFILE_ENV_PATH_JSON naming a missing file.
    let missing = root.join("nowhere.json").display().to_string();
    let m2 = missing.clone();
    let h2 = health_of(&root, &move |k| {
        (k == "CUFILE_ENV_PATH_JSON").then(|| m2.clone())
    });
    assert_eq!(
        (
            h2.cufile_config.path.as_str(),
            h2.cufile_config.source.as_str(),
            h2.cufile_config.exists
        ),
        (missing.as_str(), "CUFILE_ENV_PATH_JSON", false)
    );

    // Without NVML, or without the kernel log.
    let gone = gather_health(&HealthInputs {
        paths: &SystemPaths::under(&root.join("empty")),
        env: &|_| None,
        memlock: Ok((None, None)),
        nvml: Err("NVML not usable (libnvidia-ml.so.1: not found)".into()),
        nvlink_before: None,
        gpus: &[HealthGpu {
            ordinal: 0,
            pci_bus_id: "0000:05:00.0".into(),
            compute_capability: (9, 0),
            nearest_nic: None,
        }],
        nics: &[],
        verbs_dmabuf: None,
        cufile_version: None,
    });
    assert_eq!(
        gone.nvlink.absent_reason.as_deref(),
        Some("NVML not usable (libnvidia-ml.so.1: not found)")
    );
    assert!(gone.kernel_log_unreadable.is_some());
    assert_eq!(gone.pcie.iommu.enabled, Some(false));
    assert_eq!(gone.requirements[0].met, Some(false), "no libibverbs");
    assert!(gone.pcie.links[0].error.is_some());
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn health_advice_names_each_finding() {
    let r = sample();
    let a = &r.advice;
    let exact = |topic: &str, text: &str| {
        assert!(
            a.iter().any(|x| x.topic == topic && x.text == text),
            "missing [{topic}] {text}\nin {a:#?}"
        )
    };
    exact(
        "driver",
        "The kernel log shows nvidia_fs failing (nvidia_fs: Unknown symbol nvfs_dma_map (err -2)): nvidia-fs needs the NVIDIA driver it was built for and, for NVMe, a kernel with the GDS NVMe patches or PCI P2PDMA.",
    );
    exact(
        "driver",
        "This node meets the requirements of GPUDirect Storage through PCI P2PDMA (NVMe without nvidia-fs): see NVIDIA's guide to GDS with P2PDMA for the driver and cuFile settings.",
    );
    exact(
        "pcie",
        "GPU 0's PCIe link runs x8 of x16 lanes (about 50% of its bandwidth): reseat the card, check the slot or riser, and the BIOS lane (bifurcation) settings.",
    );
    exact(
        "pcie",
        "GPU 1's PCIe link is at 2.5 GT/s PCIe of 32.0 GT/s PCIe while idle: GPUs lower their link speed when idle; run the probe with measurements (the default) to read it under load.",
    );
    exact(
        "pcie",
        "mlx5_0's PCIe link trained at 8.0 GT/s PCIe of 16.0 GT/s PCIe (about 50% of its bandwidth): check the slot, riser and cables, and the BIOS PCIe generation setting.",
    );
    exact(
        "pcie",
        "ACS on 0000:02:08.0 (SrcValid ReqRedir CmpltRedir UpstreamFwd) sends traffic between GPU 0 and mlx5_0 up to the root complex instead of across their shared PCIe switch (bridge 0000:01:00.0): peer-to-peer bandwidth drops. Turn ACS redirection off on those ports (a BIOS setting, or setpci as root after each boot) unless VMs need the isolation.",
    );
    exact(
        "iommu",
        "The IOMMU translates DMA addresses for GPU 0 (group 7, DMA-FQ), GPU 1 (group 9, DMA): GPUDirect RDMA and PCIe peer-to-peer need it off or in passthrough (NVIDIA's GPUDirect RDMA guide); boot with iommu=pt.",
    );
    exact(
        "nvlink",
        "GPU 0: NVLink 3 down while 17 others are up: bandwidth to the GPUs they reach is lower. Check `nvidia-smi nvlink -s`, the fabric manager (NVSwitch systems), then the hardware.",
    );
    exact(
        "nvlink",
        "GPU 0 NVLink 5 counts replay or recovery errors (replay 12, recovery 0; CRC flit 0, CRC data 0): the link retransmits or retrains, which costs bandwidth. Watch whether they grow (`nvidia-smi nvlink -e`); a growing count means a marginal link to report to the hardware vendor.",
    );
    exact(
        "limits",
        "The locked-memory limit (ulimit -l) is 8 MiB (hard limit 8 MiB): RDMA can register at most that much host memory per process. Raise it: `ulimit -l unlimited` in the job's shell (up to the hard limit), `* - memlock unlimited` in /etc/security/limits.conf, LimitMEMLOCK=infinity for a systemd service, `--ulimit memlock=-1` for a container.",
    );
    assert!(
        a.iter().any(|x| x.topic == "storage"
            && x.text.ends_with(
                "sets allow_compat_mode to false and nvidia-fs is not loaded: cuFile cannot open files; set it to true or load nvidia-fs."
            )),
        "{a:#?}"
    );
    // dma-buf is met: no peermem advice; GPU 0-1 are on NVLink: no ACS advice for them.
    assert!(
        !a.iter()
            .any(|x| x.text.contains("nvidia-peermem is installed")),
        "{a:#?}"
    );
    assert!(
        !a.iter().any(|x| x.text.contains("between GPU 0 and GPU 1")),
        "{a:#?}"
    );

    // Without dma-buf, the loadable peermem module is named; bad settings are named.
    let mut r = sample();
    r.health.requirements[0].met = Some(false);
    r.health.requirements[0].checks[0].met = Some(false);
    r.health.requirements[0].checks[0].found = "5.4.0-150-generic".into();
    r.settings = settings_from_env(|k| match k {
        "NCCL_P2P_LEVEL" => Some("NVLINK".into()),
        "NCCL_MAX_NCHANNELS" => Some("2".into()),
        "NCCL_P2P_DISABLE" => Some("1".into()),
        _ => None,
    });
    let a = advise(&r);
    let has_text = |t: &str| a.iter().any(|x| x.text == t);
    assert!(
        has_text(
            "GPUDirect RDMA by dma-buf is not possible here (Linux needs >= 5.12, found 5.4.0-150-generic): nvidia-peermem is no way either (RDMA core needs the peer-memory API (MLNX_OFED or DOCA-OFED), found absent (inbox RDMA stack); module needs nvidia_peermem loaded, found not loaded (installed))."
        ),
        "{a:#?}"
    );
    assert!(
        has_text(
            "nvidia-peermem is installed but not loaded: load it (`modprobe nvidia-peermem` as root) so the NIC can register GPU memory."
        ),
        "{a:#?}"
    );
    assert!(
        has_text(
            "NCCL_P2P_LEVEL=\"NVLINK\" is not a level NCCL knows (LOC, NVL, PIX, PXB, PHB, SYS, or 0 to 5)."
        ),
        "{a:#?}"
    );
    assert!(has_text(
        "NCCL_P2P_DISABLE=1 turns off P2P although NVLink is present."
    ));
    assert!(has_text(
        "NCCL_MAX_NCHANNELS=2: NCCL runs at most 2 channels, too few to fill NVLink or a fast NIC."
    ));
}

#[test]
fn path_statuses_follow_the_findings() {
    let r = sample();
    let got: Vec<(String, PathState, Vec<String>)> = r
        .paths
        .iter()
        .map(|p| (p.path.to_string(), p.state, p.reasons.clone()))
        .collect();
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert_eq!(
        got,
        [
            (
                "gpu".into(),
                PathState::Degraded,
                s(&["GPU 0 PCIe link x8 of x16 lanes"])
            ),
            ("multi-gpu".into(), PathState::Ok, s(&[])),
            ("p2p".into(), PathState::Ok, s(&[])),
            (
                "nvlink".into(),
                PathState::Degraded,
                s(&[
                    "GPU 0 NVLink 3 down",
                    "GPU 0 NVLink 5 counting replay/recovery errors"
                ])
            ),
            (
                "rdma".into(),
                PathState::Degraded,
                s(&[
                    "the locked-memory limit is 8 MiB (RDMA registers at most that much host memory)",
                    "mlx5_0 PCIe link at 8.0 GT/s PCIe of 16.0 GT/s PCIe"
                ])
            ),
            (
                "gpudirect-rdma".into(),
                PathState::Degraded,
                s(&[
                    "the IOMMU translates for GPU 0 or mlx5_0",
                    "ACS redirects GPU 0-mlx5_0 traffic to the root complex",
                    "GPU 0 PCIe link x8 of x16 lanes",
                    "mlx5_0 PCIe link at 8.0 GT/s PCIe of 16.0 GT/s PCIe"
                ])
            ),
            ("cufile".into(), PathState::Ok, s(&[])),
            (
                "gds".into(),
                PathState::Unusable,
                s(&[
                    "no GPUDirect Storage (cuFile in compatibility mode: nvidia-fs is not loaded)"
                ])
            ),
            ("async".into(), PathState::Ok, s(&[])),
        ]
    );
    assert_eq!(
        check_required(&r, &[DataPath::MultiGpu, DataPath::P2p]),
        Ok(())
    );
    assert_eq!(
        check_required(&r, &[DataPath::P2p, DataPath::Gds, DataPath::Nvlink]),
        Err("required path not usable: gds unusable: no GPUDirect Storage (cuFile in compatibility mode: nvidia-fs is not loaded) | nvlink degraded: GPU 0 NVLink 3 down; GPU 0 NVLink 5 counting replay/recovery errors".into())
    );
    assert_eq!(check_required(&r, &[]), Ok(()));

    // PCIe peers behind ACS, no NVLink; one pair without access; no PCIe NIC.
    let mut r = sample();
    r.p2p.pairs = vec![pair(0, 1, None, true), pair(1, 0, None, true)];
    r.health.pcie.paths[1].acs_redirects = Some(true);
    r.rdma.devices[0].pci_bus_id = None;
    r.paths = path_statuses(&r);
    let by = |p: DataPath| r.paths.iter().find(|x| x.path == p).unwrap().clone();
    assert_eq!(
        by(DataPath::P2p).reasons,
        [
            "ACS redirects GPU 0-1 traffic to the root complex",
            "the IOMMU translates for GPU 0 or 1"
        ]
    );
    assert_eq!(by(DataPath::Nvlink).state, PathState::Unusable);
    assert_eq!(
        by(DataPath::Nvlink).reasons[0],
        "no GPU pair is joined by NVLink"
    );
    assert_eq!(by(DataPath::GpudirectRdma).state, PathState::Unusable);
    assert!(
        by(DataPath::GpudirectRdma).reasons[0].starts_with("no PCIe NIC: software verbs devices"),
        "{:?}",
        by(DataPath::GpudirectRdma)
    );

    // No GPU at all: everything that needs one is unusable, with the short reason.
    let mut r = sample();
    r.cuda.devices.clear();
    r.cuda.driver_version = None;
    r.p2p.pairs.clear();
    r.async_.gpus.clear();
    r.paths = path_statuses(&r);
    for p in [DataPath::Gpu, DataPath::Cufile, DataPath::Async] {
        let st = r.paths.iter().find(|x| x.path == p).unwrap();
        assert_eq!(st.state, PathState::Unusable);
        assert_eq!(
            st.reasons[0],
            "no GPU: no CUDA driver (libcuda is not loaded)"
        );
    }
    assert_eq!(
        check_required(&r, &[DataPath::Gpu]),
        Err("required path not usable: gpu unusable: no GPU: no CUDA driver (libcuda is not loaded)".into())
    );

    // Names parse case-insensitively; unknown names list the known ones.
    assert_eq!(
        "GPUDirect-RDMA".parse::<DataPath>(),
        Ok(DataPath::GpudirectRdma)
    );
    let e = "nvme".parse::<DataPath>().unwrap_err();
    assert_eq!(
        e,
        "unknown path \"nvme\": expected one of gpu, multi-gpu, p2p, nvlink, rdma, gpudirect-rdma, cufile, gds, async"
    );
}

// ---- The probe's command line ----

fn probe_exe() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.parent()?.join("examples/probe");
    p.is_file().then_some(p)
}

fn run_probe(args: &[&str], env: &[(&str, &str)]) -> Option<(i32, String, String)> {
    let exe = probe_exe()?;
    let out = std::process::Command::new(exe)
        .args(args)
        .env_remove("GPUDIRECT_TEST_DIR")
        .env_remove("GPUDIRECT_NVML_PATH")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    Some((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

#[test]
fn probe_command_line() {
    let Some((rc, out, _)) = run_probe(&["--help"], &[]) else {
        println!("SKIPPED: the probe example is not built beside this test");
        return;
    };
    assert_eq!(rc, 0, "{out}");
    for needle in [
        "--json",
        "--no-measure",
        "--require <PATH,...>",
        "gpudirect-rdma",
        "--copy-mib <MiB>",
        "[default: 32]",
        "--read-dir <DIR>",
        "[env: GPUDIRECT_TEST_DIR=]",
        "[env: GPUDIRECT_NVML_PATH=]",
        "CUFILE_ENV_PATH_JSON",
        "Exit status: 0 wherever it runs; 1 when --require",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in\n{out}");
    }
    assert!(!out.contains("[-- --json]"));
    // The short help names every path too.
    let (rc, short, _) = run_probe(&["-h"], &[]).unwrap();
    assert_eq!(rc, 0);
    let names: Vec<&str> = DataPath::ALL.iter().map(|p| p.name()).collect();
    assert!(short.contains(&names.join(", ")), "{short}");

    // A bad value: exit 2 naming the value and why.
    let (rc, _, err) = run_probe(&["--copy-mib", "0"], &[]).unwrap();
    assert_eq!(rc, 2, "{err}");
    assert!(
        err.contains("'0'") && err.contains("0 MiB is outside 1 to 4096 MiB"),
        "{err}"
    );
    let (rc, _, err) = run_probe(&["--require", "gpu,nvme"], &[]).unwrap();
    assert_eq!(rc, 2, "{err}");
    assert!(
        err.contains("unknown path \"nvme\": expected one of gpu, multi-gpu"),
        "{err}"
    );
    let (rc, _, err) = run_probe(&["--frobnicate"], &[]).unwrap();
    assert_eq!(rc, 2, "{err}");
    // Environment settings are checked the same way.
    let (rc, _, err) = run_probe(
        &["--no-measure"],
        &[("GPUDIRECT_TEST_DIR", "/nonexistent/gd")],
    )
    .unwrap();
    assert_eq!(rc, 2, "{err}");
    assert!(
        err.contains("/nonexistent/gd") && err.contains("No such file"),
        "{err}"
    );
    let (rc, _, err) = run_probe(&["--no-measure"], &[("GPUDIRECT_NVML_PATH", "/")]).unwrap();
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("/ is not a file"), "{err}");

    // --require: exit 1 with one line exactly when a named path is not ok in the report printed.
    let (rc, out, err) =
        run_probe(&["--json", "--no-measure", "--require", "gpu,rdma"], &[]).unwrap();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let state = |name: &str| {
        v["paths"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["path"] == name)
            .unwrap()["state"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let all_ok = state("gpu") == "ok" && state("rdma") == "ok";
    if all_ok {
        assert_eq!(rc, 0, "{err}");
        assert!(err.is_empty(), "{err}");
    } else {
        assert_eq!(rc, 1, "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.starts_with("probe: required path not usable: "),
            "{err}"
        );
    }
    // Without --require the probe exits 0 wherever it runs.
    let (rc, out, err) = run_probe(&["--no-measure"], &[]).unwrap();
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains("== Paths (what --require checks)"), "{out}");
}

/// Two H200s as NVML answered for them: 18 links each, all up, speed unknown, the remote PCI
/// address `ffff:ff:ff.0`, a few corrected CRC data errors per link and no replay or recovery.
/// GPU 1 says its links reach NVSwitches. `crc4` is link 4's CRC data count on GPU 0.
fn h200_nvml(crc4: u64) -> FakeNvml {
    h200_nvml_replays(crc4, 0)
}

/// As [`h200_nvml`], with GPU 0's link 4 also counting `replay4` replays.
fn h200_nvml_replays(crc4: u64, replay4: u64) -> FakeNvml {
    let links = |switch: bool, crc4: u64| -> Vec<NvlinkReading> {
        (0..18)
            .map(|l| NvlinkReading {
                link: l,
                active: Ok(true),
                version: Some(4),
                speed_mbps: None,
                remote_pci_bus_id: Some("ffff:ff:ff.0".into()),
                remote_device_type: switch.then_some(NvlinkRemote::Switch),
                errors: NvlinkErrors {
                    replay: Some(if l == 4 && !switch { replay4 } else { 0 }),
                    recovery: Some(0),
                    crc_flit: Some(0),
                    crc_data: Some(if l == 4 { crc4 } else { 3 + 3 * u64::from(l) }),
                },
            })
            .collect()
    };
    FakeNvml(HashMap::from([
        (
            "0000:05:00.0".to_string(),
            Ok((Some(18), links(false, crc4))),
        ),
        ("0000:19:00.0".to_string(), Ok((Some(18), links(true, 15)))),
    ]))
}

/// The sample report with the NVLink health of `after`, its counters read from `before` first
/// (`None`: not measured); paths and advice recomputed.
fn with_nvlink(after: &FakeNvml, before: Option<&FakeNvml>) -> NodeReport {
    let gpus = [
        (0, "0000:05:00.0".to_string()),
        (1, "0000:19:00.0".to_string()),
    ];
    let buses: Vec<String> = gpus.iter().map(|g| g.1.clone()).collect();
    let before = before.map(|b| NvlinkCounters::read(b, &buses));
    let mut r = sample();
    r.health.nvlink = nvlink_health(&gpus, Ok(after), before.as_ref());
    r.paths = path_statuses(&r);
    r.advice = advise(&r);
    r
}

fn nvlink_text(r: &NodeReport) -> String {
    let text = r.to_string();
    let start = text.find("== NVLink\n").expect("an NVLink section");
    let end = text[start..].find("\n\n").map_or(text.len(), |e| start + e);
    text[start..end].to_string()
}

#[test]
fn corrected_crc_errors_on_healthy_links_do_not_degrade_nvlink() {
    for (before, growth) in [
        (None, "error growth not measured"),
        (
            Some(h200_nvml(15)),
            "no replay/recovery counter grew during the probe",
        ),
    ] {
        let r = with_nvlink(&h200_nvml(15), before.as_ref());
        assert_eq!(
            nvlink_text(&r),
            format!(
                "== NVLink\n  GPU 0: 18 of 18 links up, {growth}\n    links 0-17: up, v4 speed unknown, remote unknown, no replays or recoveries, CRC errors corrected (normal): flit 0, data 3-54 per link\n  GPU 1: 18 of 18 links up, {growth}\n    links 0-17: up, v4 speed unknown, remote unknown (NVSwitch), no replays or recoveries, CRC errors corrected (normal): flit 0, data 3-54 per link"
            )
        );
        let nv = r.paths.iter().find(|p| p.path == DataPath::Nvlink).unwrap();
        assert_eq!((nv.state, nv.reasons.len()), (PathState::Ok, 0), "{nv:?}");
        assert_eq!(check_required(&r, &[DataPath::Nvlink]), Ok(()));
        assert!(
            !r.advice.iter().any(|a| a.topic == "nvlink"),
            "{:#?}",
            r.advice
        );
        let l = &r.health.nvlink.gpus[1].links[0];
        assert_eq!(
            (l.remote_pci_bus_id.as_deref(), l.remote_device.as_deref()),
            (None, Some("NVSwitch"))
        );
    }
}

#[test]
fn nvlink_counters_that_grow_during_the_probe_degrade_it() {
    // Corrected CRC counts that grow with the probe's traffic are normal on healthy links.
    let r = with_nvlink(&h200_nvml(15), Some(&h200_nvml(9)));
    assert_eq!(r.health.nvlink.gpus[0].links[4].errors_grew, Some(false));
    assert_eq!(check_required(&r, &[DataPath::Nvlink]), Ok(()));
    // Link 4 of GPU 0 counted 9 CRC data errors and 2 replays before the probe's copies, 15 and 5
    // after: the replays grew.
    let r = with_nvlink(&h200_nvml_replays(15, 5), Some(&h200_nvml_replays(9, 2)));
    assert_eq!(
        nvlink_text(&r),
        "== NVLink\n  GPU 0: 18 of 18 links up, replay/recovery counters GREW during the probe on links 4\n    links 0-3,5-17: up, v4 speed unknown, remote unknown, no replays or recoveries, CRC errors corrected (normal): flit 0, data 3-54 per link\n    link 4  up    v4 speed unknown  remote unknown  errors replay 5 recovery 0 crc flit 0 crc data 15 (before the probe: replay 2 recovery 0 crc flit 0 crc data 9)  REPLAY/RECOVERY ERRORS  ERRORS GREW\n  GPU 1: 18 of 18 links up, no replay/recovery counter grew during the probe\n    links 0-17: up, v4 speed unknown, remote unknown (NVSwitch), no replays or recoveries, CRC errors corrected (normal): flit 0, data 3-54 per link"
    );
    let l = &r.health.nvlink.gpus[0].links[4];
    assert_eq!(
        (l.errors_grew, l.counting_errors, l.down),
        (Some(true), true, false)
    );
    assert_eq!(
        check_required(&r, &[DataPath::Nvlink]),
        Err("required path not usable: nvlink degraded: GPU 0 NVLink 4 counting replay/recovery errors; GPU 0 NVLink 4 errors grew during the probe".into())
    );
    let nvlink: Vec<&str> = r
        .advice
        .iter()
        .filter(|a| a.topic == "nvlink")
        .map(|a| a.text.as_str())
        .collect();
    assert_eq!(
        nvlink,
        [
            "GPU 0 NVLink 4 counts replay or recovery errors (replay 5, recovery 0; CRC flit 0, CRC data 15): the link retransmits or retrains, which costs bandwidth. Watch whether they grow (`nvidia-smi nvlink -e`); a growing count means a marginal link to report to the hardware vendor.",
            "GPU 0 NVLink 4's replay/recovery counters grew while the probe's copies ran (replay 2 -> 5): a marginal link. Check it under load with `nvidia-smi nvlink -e`, and report it to the hardware vendor if it keeps growing."
        ]
    );
    // The JSON carries both readings.
    let v = serde_json::to_value(&r).unwrap();
    let j = &v["health"]["nvlink"]["gpus"][0]["links"][4];
    assert_eq!(j["errors_before"]["crc_data"], 9);
    assert_eq!(j["errors"]["crc_data"], 15);
    assert_eq!(j["errors_grew"], true);
    assert_eq!(j["remote_pci_bus_id"], serde_json::Value::Null);
}
