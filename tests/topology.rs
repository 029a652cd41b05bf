//! Where GPUs and NICs sit: PCI locations, affinity and the NICs nearest each GPU, on a fake
//! sysfs tree (tier 0); and the placement of the real GPUs (GPU tier: `SKIPPED` without one).

use gpudirect::topology::{
    Affinity, MeetingPoint, PciLocation, Placement, SYSFS_ROOT, nic_names, nic_pci_address,
    normalize_bus_id,
};
use gpudirect_testing::Hardware;
use gpudirect_testing::require;
use std::path::{Path, PathBuf};

/// A fake sysfs: a root complex with a switch (GPU 0 and mlx5_0 below it), GPU 1 on another
/// root port of the same host bridge, mlx5_1 on another NUMA node's host bridge, rxe0 with no
/// PCI device.
fn fake_sysfs(tag: &str) -> PathBuf {
    let root =
        std::env::temp_dir().join(format!("gpudirect-fake-sysfs-{tag}-{}", std::process::id()));
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
    root
}

#[test]
fn locations_and_affinity_come_from_a_fake_sysfs_tree() {
    let root = fake_sysfs("locations");
    let g0 = PciLocation::of_pci(&root, "00000000:05:00.0").unwrap();
    assert_eq!(g0.root, "pci0000:00");
    assert_eq!(
        g0.chain,
        [
            "0000:00:01.0",
            "0000:01:00.0",
            "0000:02:08.0",
            "0000:05:00.0"
        ]
    );
    assert_eq!(g0.numa_node, Some(0));
    assert_eq!(g0.pci_bus_id(), Some("0000:05:00.0"));
    let g1 = PciLocation::of_pci(&root, "0000:19:00.0").unwrap();
    let n0 = PciLocation::of_nic(&root, "mlx5_0").unwrap();
    let n1 = PciLocation::of_nic(&root, "mlx5_1").unwrap();
    assert_eq!(n1.numa_node, Some(1));
    assert_eq!(g0.affinity(&n0), Affinity::SamePcieSwitch);
    assert_eq!(g1.affinity(&n0), Affinity::SameNumaNode);
    assert_eq!(g0.affinity(&n1), Affinity::AcrossCpu);
    let m = g0.meeting(&n0);
    assert_eq!(
        m.point,
        MeetingPoint::Switch {
            bridge: "0000:01:00.0".into()
        }
    );
    assert_eq!(m.bridges, ["0000:02:08.0", "0000:02:10.0"]);
    assert_eq!(g0.meeting(&g1).point.to_string(), "root complex pci0000:00");
    assert_eq!(
        nic_pci_address(&root, "mlx5_0").as_deref(),
        Some("0000:06:00.0")
    );
    assert_eq!(nic_pci_address(&root, "rxe0"), None);
    assert_eq!(PciLocation::of_nic(&root, "rxe0"), None);
    assert_eq!(PciLocation::of_pci(&root, "0000:ee:00.0"), None);
    assert_eq!(nic_names(&root), ["mlx5_0", "mlx5_1", "rxe0"]);
    assert!(nic_names(&root.join("nowhere")).is_empty());
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn nearest_nics_are_ordered_by_affinity() {
    let root = fake_sysfs("nearest");
    let g0 = Placement::of_pci(&root, "0000:05:00.0");
    assert_eq!(g0.numa_node(), Some(0));
    let near: Vec<(String, Affinity)> = g0
        .nearest_nics()
        .into_iter()
        .map(|n| (n.name, n.affinity))
        .collect();
    assert_eq!(
        near,
        [
            ("mlx5_0".to_string(), Affinity::SamePcieSwitch),
            ("mlx5_1".to_string(), Affinity::AcrossCpu),
            ("rxe0".to_string(), Affinity::Unknown),
        ]
    );
    let n = g0.nic("mlx5_1");
    assert_eq!(
        (n.pci_bus_id.as_deref(), n.numa_node),
        (Some("0000:81:00.0"), Some(1))
    );
    let rxe = g0.nic("rxe0");
    assert_eq!((rxe.pci_bus_id, rxe.numa_node), (None, None));
    // GPU 1 shares no switch with either NIC: mlx5_0 on its node first.
    let g1 = Placement::of_pci(&root, "0000:19:00.0");
    let names: Vec<String> = g1.nearest_nics().into_iter().map(|n| n.name).collect();
    assert_eq!(names, ["mlx5_0", "mlx5_1", "rxe0"]);
    assert_eq!(g1.nic("mlx5_0").affinity, Affinity::SameNumaNode);
    // A GPU sysfs does not show: every NIC unknown, listed by name.
    let ghost = Placement::of_pci(&root, "0000:EE:00.0");
    assert_eq!(ghost.pci_bus_id, "0000:ee:00.0");
    assert_eq!((ghost.location.as_ref(), ghost.numa_node()), (None, None));
    let names: Vec<(String, Affinity)> = ghost
        .nearest_nics()
        .into_iter()
        .map(|n| (n.name, n.affinity))
        .collect();
    assert_eq!(
        names,
        [
            ("mlx5_0".to_string(), Affinity::Unknown),
            ("mlx5_1".to_string(), Affinity::Unknown),
            ("rxe0".to_string(), Affinity::Unknown),
        ]
    );
    // No RDMA driver: no NIC.
    assert!(
        Placement::of_pci(&root.join("nowhere"), "0000:05:00.0")
            .nearest_nics()
            .is_empty()
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// GPU tier: each GPU's placement is read at the PCI address the driver gives, and sysfs shows
/// it; an ordinal past the count is refused.
#[test]
fn real_gpus_are_placed_at_their_pci_address() {
    let n = require!(
        Hardware::Gpu,
        gpudirect::cuda::device_count().and_then(|n| if n == 0 {
            Err(gpudirect::Error::NoDevice {
                what: "CUDA device",
                reason: "cuDeviceGetCount answered 0".into(),
            })
        } else {
            Ok(n)
        })
    );
    let sys_nics = nic_names(Path::new(SYSFS_ROOT));
    for i in 0..n {
        let p = Placement::of_gpu(i).unwrap();
        let info = gpudirect::cuda::DeviceInfo::query(i).unwrap();
        assert_eq!(p.pci_bus_id, normalize_bus_id(&info.pci_bus_id));
        let at = p.location.as_ref().expect("sysfs shows the node's GPUs");
        assert_eq!(at.pci_bus_id(), Some(p.pci_bus_id.as_str()));
        let near = p.nearest_nics();
        assert!(near.windows(2).all(|w| w[0].affinity <= w[1].affinity));
        let mut names: Vec<String> = near.into_iter().map(|n| n.name).collect();
        names.sort();
        assert_eq!(names, sys_nics);
        println!("GPU {i} at {} (NUMA {:?})", p.pci_bus_id, p.numa_node());
    }
    assert!(matches!(
        Placement::of_gpu(n),
        Err(gpudirect::Error::NoDevice { .. })
    ));
}

/// Without a driver (tier 0 here), asking for a GPU's placement is an error that says what is
/// absent, not a panic.
#[test]
fn without_a_driver_placement_is_an_absence() {
    if gpudirect::cuda::device_count().is_ok_and(|n| n > 0) {
        println!("SKIPPED: a GPU is present (the GPU test covers it)");
        return;
    }
    let e = Placement::of_gpu(0).unwrap_err();
    assert!(e.absence().is_some(), "{e:?}");
}
