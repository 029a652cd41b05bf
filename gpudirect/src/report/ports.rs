//! Verbs devices and their ports, read through [`crate::rdma`] (feature `rdma`) and sysfs.

use super::files::read_trimmed;
use super::model::{GidSummary, PortSummary, VerbsDeviceSummary};
use crate::rdma::{Context, DeviceList, GidType, LinkLayer, PortState};
use crate::topology::{PciLocation, nic_pci_address};
use std::path::Path;

fn port_state(s: PortState) -> String {
    match s {
        PortState::Nop => "NOP".into(),
        PortState::Down => "DOWN".into(),
        PortState::Init => "INIT".into(),
        PortState::Armed => "ARMED".into(),
        PortState::Active => "ACTIVE".into(),
        PortState::ActiveDefer => "ACTIVE_DEFER".into(),
        PortState::Other(v) => format!("state {v}"),
    }
}

fn gid_type(t: GidType) -> &'static str {
    match t {
        GidType::Ib => "IB",
        GidType::RoceV1 => "RoCE v1",
        GidType::RoceV2 => "RoCE v2",
        GidType::Unknown => "unknown",
    }
}

fn verbs_device(
    ctx: &Context,
    sysfs_root: &Path,
) -> crate::Result<(Option<String>, bool, Vec<PortSummary>)> {
    let attr = ctx.query_device()?;
    let mut ports = Vec::new();
    for port in 1..=attr.phys_port_cnt {
        let mut p = PortSummary {
            port,
            state: "unknown".into(),
            link_layer: "unknown".into(),
            active_mtu: 0,
            max_mtu: 0,
            speed_gbps: None,
            speed: None,
            gids: Vec::new(),
            error: None,
        };
        match ctx.query_port(port) {
            Ok(a) => {
                p.state = port_state(a.state);
                p.link_layer = match a.link_layer {
                    LinkLayer::Ethernet => "Ethernet",
                    _ => "InfiniBand",
                }
                .into();
                p.active_mtu = a.active_mtu.bytes();
                p.max_mtu = a.max_mtu.bytes();
                let coded = port_speed(a.active_width, a.active_speed);
                p.speed_gbps = coded.as_ref().map(|c| c.0);
                let rate = port_rate(sysfs_root, ctx.name(), port);
                // Newer speeds (NDR, XDR) have codes this crate does not read: use sysfs' figure.
                if p.speed_gbps.is_none() {
                    p.speed_gbps = rate
                        .as_deref()
                        .and_then(|r| r.split_whitespace().next())
                        .and_then(|n| n.parse().ok());
                }
                p.speed = rate.or(coded.map(|c| c.1));
                match ctx.gid_table(port) {
                    Ok(t) => {
                        p.gids = t
                            .iter()
                            .map(|e| GidSummary {
                                index: e.index,
                                gid: e.gid.to_string(),
                                gid_type: gid_type(e.gid_type).into(),
                            })
                            .collect()
                    }
                    Err(e) => p.error = Some(format!("GID table: {e}")),
                }
            }
            Err(e) => p.error = Some(e.to_string()),
        }
        ports.push(p);
    }
    let windows = attr.memory_windows().type_2();
    Ok((Some(attr.fw_ver), windows, ports))
}

/// Every verbs device with its ports (read under sysfs root `root`), or why there is none.
pub(crate) fn verbs_devices(root: &Path) -> Result<Vec<VerbsDeviceSummary>, String> {
    match DeviceList::get() {
        Ok(list) if list.is_empty() => Err(
            "no verbs device: ibv_get_device_list returned none (no RDMA NIC, rdma_rxe or siw link)"
                .into(),
        ),
        Ok(list) => Ok(list
            .iter()
            .map(|dev| {
                let name = dev.name();
                let mut d = VerbsDeviceSummary {
                    pci_bus_id: nic_pci_address(root, &name),
                    numa_node: PciLocation::of_nic(root, &name).and_then(|l| l.numa_node),
                    name,
                    fw_ver: None,
                    ports: Vec::new(),
                    memory_windows: None,
                    error: None,
                };
                match Context::open(&dev).and_then(|c| verbs_device(&c, root)) {
                    Ok((fw, windows, ports)) => {
                        d.fw_ver = fw;
                        d.memory_windows = Some(windows);
                        d.ports = ports;
                    }
                    Err(e) => d.error = Some(e.to_string()),
                }
                d
            })
            .collect()),
        Err(e) => Err(match e {
            // Displays as "no verbs device: <why>" already.
            e @ crate::Error::NoDevice { .. } => e.to_string(),
            e if !root.join("class/infiniband").is_dir() => format!(
                "no verbs device: {e} (/sys/class/infiniband is absent: no RDMA driver is loaded in this kernel)"
            ),
            e => format!("no verbs device: {e}"),
        }),
    }
}

/// `<sysfs>/class/infiniband/<ibdev>/ports/<port>/rate`, such as `100 Gb/sec (4X EDR)`.
fn port_rate(sysfs: &Path, ibdev: &str, port: u8) -> Option<String> {
    read_trimmed(
        &sysfs
            .join("class/infiniband")
            .join(ibdev)
            .join("ports")
            .join(port.to_string())
            .join("rate"),
    )
}

/// `ibv_port_attr`'s `active_width` codes: lanes and name.
const WIDTHS: [(u8, f64, &str); 5] = [
    (1, 1.0, "1X"),
    (2, 4.0, "4X"),
    (4, 8.0, "8X"),
    (8, 12.0, "12X"),
    (16, 2.0, "2X"),
];

/// `ibv_port_attr`'s `active_speed` codes: Gb/s per lane and name.
const SPEEDS: [(u8, f64, &str); 8] = [
    (1, 2.5, "SDR"),
    (2, 5.0, "DDR"),
    (4, 10.0, "QDR"),
    (8, 10.0, "FDR10"),
    (16, 14.0, "FDR"),
    (32, 25.0, "EDR"),
    (64, 50.0, "HDR"),
    (128, 100.0, "NDR"),
];

/// A port's speed from `ibv_port_attr`'s `active_width` and `active_speed` codes, in Gb/s per
/// port, with the usual name (`4X EDR`); `None` for codes not known.
fn port_speed(active_width: u8, active_speed: u8) -> Option<(f64, String)> {
    let code = |table: &[(u8, f64, &'static str)], c: u8| {
        table
            .iter()
            .find(|(k, _, _)| *k == c)
            .map(|(_, v, n)| (*v, *n))
    };
    let (lanes, w) = code(&WIDTHS, active_width)?;
    let (gbps, s) = code(&SPEEDS, active_speed)?;
    Some((lanes * gbps, format!("{w} {s}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_speeds_and_rates() {
        assert_eq!(port_speed(2, 32), Some((100.0, "4X EDR".into())));
        assert_eq!(port_speed(2, 128), Some((400.0, "4X NDR".into())));
        assert_eq!(port_speed(16, 1), Some((5.0, "2X SDR".into())));
        assert_eq!(port_speed(3, 1), None);
        assert_eq!(port_speed(1, 3), None);
        let root = std::env::temp_dir().join(format!("gd-port-rate-{}", std::process::id()));
        let dir = root.join("class/infiniband/rxe0/ports/1");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("rate"), "10 Gb/sec (1X QDR)\n").unwrap();
        assert_eq!(
            port_rate(&root, "rxe0", 1).as_deref(),
            Some("10 Gb/sec (1X QDR)")
        );
        assert_eq!(port_rate(&root, "rxe0", 2), None);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
