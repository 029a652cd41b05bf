//! The node report: rendering, and the JSON shape pinned (tier 0).

use gpudirect::device::DeviceInfo;
use gpudirect::topology::{
    CudaSection, LibraryStatus, NodeReport, PortSummary, RdmaSection, SCHEMA_VERSION,
    VerbsDeviceSummary,
};

fn sample() -> NodeReport {
    NodeReport {
        schema_version: SCHEMA_VERSION,
        libraries: vec![
            LibraryStatus::loaded("libcuda", "/usr/lib/libcuda.so.1", Some("13.0".into())),
            LibraryStatus::missing("libibverbs", "libibverbs not found (tried libibverbs.so.1)"),
        ],
        cuda: CudaSection {
            driver_version: Some(13000),
            bindings_version: 12080,
            devices: vec![DeviceInfo {
                ordinal: 0,
                name: "NVIDIA H200".into(),
                pci_bus_id: "0000:00:06.0".into(),
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
            }],
            absent_reason: None,
        },
        rdma: RdmaSection {
            devices: vec![VerbsDeviceSummary {
                name: "rxe0".into(),
                ports: vec![PortSummary {
                    port: 1,
                    state: "ACTIVE".into(),
                    link_layer: "Ethernet".into(),
                    active_mtu: 1024,
                }],
            }],
            absent_reason: None,
        },
    }
}

#[test]
fn json_shape_is_pinned() {
    let v = serde_json::to_value(sample()).unwrap();
    let keys = |v: &serde_json::Value| {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    assert_eq!(keys(&v), ["cuda", "libraries", "rdma", "schema_version"]);
    assert_eq!(v["schema_version"], 1);
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
        keys(&v["rdma"]["devices"][0]["ports"][0]),
        ["active_mtu", "link_layer", "port", "state"]
    );
    // Round trip.
    let back: NodeReport = serde_json::from_value(v).unwrap();
    assert_eq!(back, sample());
}

#[test]
fn text_rendering_names_what_is_there_and_what_is_not() {
    let text = sample().to_string();
    for needle in [
        "libcuda     loaded   /usr/lib/libcuda.so.1 (version 13.0)",
        "libibverbs  MISSING  libibverbs not found (tried libibverbs.so.1)",
        "driver: CUDA 13.0   bindings: CUDA 12.8",
        "GPU 0 NVIDIA H200  pci 0000:00:06.0  140.4 GiB  sm_90  copy engines 7",
        "dma-buf yes  GPUDirect RDMA yes  RDMA with VMM yes",
        "port 1: ACTIVE  Ethernet  MTU 1024",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
}

#[test]
fn gather_never_panics_and_explains_absence() {
    let r = NodeReport::gather();
    assert_eq!(r.schema_version, SCHEMA_VERSION);
    let cuda = r.libraries.iter().find(|l| l.name == "libcuda").unwrap();
    if cuda.loaded {
        assert!(cuda.path.is_some());
    } else {
        let err = cuda.error.as_deref().unwrap();
        assert!(err.contains("libcuda.so.1"), "{err}");
        assert!(r.cuda.devices.is_empty());
        assert!(r.cuda.absent_reason.is_some());
    }
}
