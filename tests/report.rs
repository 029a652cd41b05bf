//! The node report (tier 0): the JSON shape pinned at every level, a sample rendering, a round
//! trip, the advice rules and the GPU-to-NIC affinity on fake inputs (a fake sysfs tree).

use gpudirect::device::DeviceInfo;
use gpudirect::topology::sysfs::{self, PciLocation};
use gpudirect::topology::*;
use std::path::{Path, PathBuf};

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
        pci_bus_id: Some("0000:1a:00.0".into()),
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
            devices: vec![gpu(0, "0000:19:00.0"), gpu(1, "0000:3b:00.0")],
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
                gpu_pci_bus_id: "0000:19:00.0".into(),
                nics: vec![NicPlacement {
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
        advice: vec![],
        settings: settings_from_env(|k| (k == "NCCL_IB_DISABLE").then(|| "1".to_string())),
    };
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
            "libraries",
            "measured",
            "p2p",
            "rdma",
            "schema_version",
            "settings",
            "storage"
        ]
    );
    assert_eq!(v["schema_version"], 2);
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
    // Round trip.
    let back: NodeReport = serde_json::from_value(v).unwrap();
    assert_eq!(back, sample());
}

#[test]
fn text_rendering_has_a_section_and_verdict_per_path() {
    let text = sample().to_string();
    for needle in [
        "gpudirect node report (schema 2, quick measurements requested)",
        "libcuda     loaded   /usr/lib/libcuda.so.1 (version 13.0)",
        "libibverbs  MISSING  libibverbs not found (tried libibverbs.so.1)",
        "driver: CUDA 13.0   bindings: CUDA 12.8",
        "GPU 0 NVIDIA H200  pci 0000:19:00.0  140.4 GiB  sm_90  copy engines 7",
        "dma-buf yes  GPUDirect RDMA yes  RDMA with VMM yes",
        "== P2P\n  verdict: 1 of 1 GPU pairs have peer access, 1 over NVLink",
        "0->1   yes    0    yes     NV18                 385.2 GB/s  peer  verified",
        "== RDMA (verbs)\n  verdict: ",
        "mlx5_0  fw 28.39.1002  pci 0000:1a:00.0  numa 0",
        "port 1: ACTIVE  Ethernet  MTU 1024 (max 4096)  speed 100 Gb/sec (4X EDR)",
        "GID[1] 0000:0000:0000:0000:0000:ffff:0a4d:0001  RoCE v2",
        "-> registration: dma-buf",
        "GPU 0 [0000:19:00.0] NICs: mlx5_0 same PCIe switch  -> use mlx5_0",
        "== Storage (cuFile)\n  verdict: ",
        "cuFile 1.15  mode compatibility: nvidia-fs is not loaded  nvidia-fs module not loaded",
        "read 64 MiB: 3.50 GB/s via posix (cuFile in compatibility mode is slower), O_DIRECT yes, verified",
        "== Async\n  verdict: ",
        "GPU 0: stream mem ops v2 yes (64-bit yes)  memory pools yes  copy engines 7  flush remote writes no (options 0x1)",
        "== Advice\n  - [p2p] NVLink joins GPU pairs 0-1",
        "NCCL_IB_DISABLE              1 ",
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
            "compatibility mode: storage::File in Mode::Auto"
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

/// A fake sysfs: a root complex with a switch (GPU 0 and mlx5_0 below it), GPU 1 on another
/// root port of the same host bridge, mlx5_1 on another NUMA node's host bridge, rxe0 with no
/// PCI device.
fn fake_sysfs() -> PathBuf {
    let root = std::env::temp_dir().join(format!("gpudirect-fake-sysfs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let dev = |p: &str, numa: i32| {
        let d = root.join("devices").join(p);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("numa_node"), format!("{numa}\n")).unwrap();
        d
    };
    let link = |from: &Path, to: &Path| {
        std::fs::create_dir_all(from.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(to, from).unwrap();
    };
    let g0 = dev(
        "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:05:00.0",
        0,
    );
    let n0 = dev(
        "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:06:00.0",
        0,
    );
    let g1 = dev("pci0000:00/0000:00:03.0/0000:19:00.0", 0);
    let n1 = dev("pci0000:80/0000:80:01.0/0000:81:00.0", 1);
    for (bdf, d) in [("0000:05:00.0", &g0), ("0000:19:00.0", &g1)] {
        link(&root.join("bus/pci/devices").join(bdf), d);
    }
    link(&root.join("class/infiniband/mlx5_0/device"), &n0);
    link(&root.join("class/infiniband/mlx5_1/device"), &n1);
    std::fs::create_dir_all(root.join("class/infiniband/rxe0/ports/1")).unwrap();
    std::fs::write(
        root.join("class/infiniband/rxe0/ports/1/rate"),
        "10 Gb/sec (1X QDR)\n",
    )
    .unwrap();
    root
}

#[test]
fn affinity_is_classified_from_a_fake_sysfs_tree() {
    let root = fake_sysfs();
    let g0 = sysfs::pci_location(&root, "00000000:05:00.0").unwrap();
    assert_eq!(g0.root, "pci0000:00");
    assert_eq!(g0.chain.len(), 4);
    assert_eq!(g0.numa_node, Some(0));
    let g1 = sysfs::pci_location(&root, "0000:19:00.0").unwrap();
    let n0 = sysfs::nic_location(&root, "mlx5_0").unwrap();
    let n1 = sysfs::nic_location(&root, "mlx5_1").unwrap();
    assert_eq!(sysfs::classify(&g0, &n0), Affinity::SamePcieSwitch);
    assert_eq!(sysfs::classify(&g1, &n0), Affinity::SameNumaNode);
    assert_eq!(sysfs::classify(&g0, &n1), Affinity::AcrossCpu);
    assert_eq!(
        sysfs::nic_pci_address(&root, "mlx5_0").as_deref(),
        Some("0000:06:00.0")
    );
    assert_eq!(sysfs::nic_pci_address(&root, "rxe0"), None);
    assert_eq!(
        sysfs::port_rate(&root, "rxe0", 1).as_deref(),
        Some("10 Gb/sec (1X QDR)")
    );
    // Two roots without NUMA information count as one node.
    let a = PciLocation {
        root: "pci0000:00".into(),
        chain: vec!["0000:00:01.0".into()],
        numa_node: None,
    };
    let b = PciLocation {
        root: "pci0000:80".into(),
        ..a.clone()
    };
    assert_eq!(sysfs::classify(&a, &b), Affinity::SameNumaNode);

    // Each GPU picks its closest NIC with an active port.
    let nics = vec![nic("mlx5_1", true), nic("mlx5_0", true), nic("rxe0", true)];
    let a0 = gpu_affinity(&root, 0, "0000:05:00.0", &nics);
    assert_eq!(a0.best.as_deref(), Some("mlx5_0"));
    let by = |n: &str| a0.nics.iter().find(|x| x.nic == n).unwrap().affinity;
    assert_eq!(by("mlx5_0"), Affinity::SamePcieSwitch);
    assert_eq!(by("mlx5_1"), Affinity::AcrossCpu);
    assert_eq!(by("rxe0"), Affinity::Unknown);
    // An active port beats a closer NIC that is down.
    let nics = vec![nic("mlx5_0", false), nic("mlx5_1", true)];
    assert_eq!(
        gpu_affinity(&root, 0, "0000:05:00.0", &nics)
            .best
            .as_deref(),
        Some("mlx5_1")
    );
    // A GPU sysfs does not know: every NIC unknown, the first active one chosen.
    let a = gpu_affinity(&root, 2, "0000:ee:00.0", &[nic("mlx5_0", true)]);
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
    assert_eq!(r.settings.len(), 3);
    let text = r.to_string();
    for section in ["== P2P", "== RDMA", "== Storage", "== Async", "== Advice"] {
        assert!(text.contains(section), "{section}");
    }
}

#[test]
#[ignore = "prints the sample rendering"]
fn print_sample() {
    print!("{}", sample());
}
