//! The kernel, the NVIDIA driver and the kernel modules each path needs, read from `/proc`,
//! `/sys/module`, `/lib/modules` and the kernel log where an unprivileged reader may see it; and
//! each path's documented minimums checked against what was found.

use super::super::files::{dir_names, read_trimmed};
use super::model::{KernelInfo, ModuleStatus, Requirement, RequirementCheck};
use std::io::Read;
use std::path::Path;

/// The modules the report looks at: the GPU driver, the RDMA core, and the peer-memory and
/// storage modules GPUDirect uses.
pub(super) const MODULES: [&str; 6] = [
    "nvidia",
    "nvidia_peermem",
    "nv_peer_mem",
    "nvidia_fs",
    "ib_core",
    "ib_uverbs",
];

/// Most kernel log bytes read (the log is a ring buffer of a few MiB at most).
const KMSG_MAX_BYTES: usize = 16 << 20;

/// Most load-failure lines kept per module.
const MAX_LOAD_ERRORS: usize = 5;

/// `6.8.0-57-generic` → `(6, 8)`.
pub(super) fn parse_kernel_release(r: &str) -> Option<(u32, u32)> {
    let mut it = r.split(|c: char| !c.is_ascii_digit());
    let major = it.next()?.parse().ok()?;
    let minor = it.next()?.parse().ok()?;
    Some((major, minor))
}

/// `580.95.05` → `(580, 95)`.
pub(super) fn parse_driver_version(v: &str) -> Option<(u32, u32)> {
    let mut it = v.trim().split('.');
    let major = it.next()?.parse().ok()?;
    let minor = it.next().and_then(|m| m.parse().ok()).unwrap_or(0);
    Some((major, minor))
}

/// The kernel and the NVIDIA driver: `<procfs>/sys/kernel/osrelease`, `<sysfs>/module/nvidia/version`
/// (else the version in `<procfs>/driver/nvidia/version`), whose banner also says whether the open
/// kernel modules are loaded.
pub(super) fn kernel_info(sysfs: &Path, procfs: &Path, boot: &Path) -> KernelInfo {
    let release = read_trimmed(&procfs.join("sys/kernel/osrelease"));
    let banner = read_trimmed(&procfs.join("driver/nvidia/version"));
    let banner_version = banner.as_deref().and_then(|b| {
        // "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build ..."
        b.lines()
            .next()?
            .split_whitespace()
            .find(|w| {
                w.contains('.')
                    && w.split('.')
                        .all(|p| !p.is_empty() && p.bytes().all(|c| c.is_ascii_digit()))
            })
            .map(str::to_string)
    });
    let nvidia_driver = read_trimmed(&sysfs.join("module/nvidia/version")).or(banner_version);
    let nvidia_kernel_module = banner.as_deref().map(|b| {
        let first = b.lines().next().unwrap_or("");
        if first.contains("Open Kernel Module") {
            "open"
        } else {
            "proprietary"
        }
        .to_string()
    });
    let pci_p2pdma = release
        .as_deref()
        .and_then(|r| kernel_has_p2pdma(boot, procfs, r));
    KernelInfo {
        release,
        nvidia_driver,
        nvidia_kernel_module,
        pci_p2pdma,
    }
}

/// Whether the running kernel was built with PCI P2PDMA: `CONFIG_PCI_P2PDMA` in
/// `<boot>/config-<release>`, else its symbols in `<procfs>/kallsyms` (whose names an
/// unprivileged reader sees, addresses zeroed): the function `pci_p2pdma_add_resource`, listed
/// in every kernel that has P2PDMA, or `p2pdma_pgmap_ops`. `None` when neither can be read.
pub(super) fn kernel_has_p2pdma(boot: &Path, procfs: &Path, release: &str) -> Option<bool> {
    if let Ok(cfg) = std::fs::read_to_string(boot.join(format!("config-{release}"))) {
        return Some(cfg.lines().any(|l| l.trim() == "CONFIG_PCI_P2PDMA=y"));
    }
    let f = std::fs::File::open(procfs.join("kallsyms")).ok()?;
    use std::io::BufRead;
    let (mut found, mut lines) = (false, 0usize);
    for line in std::io::BufReader::new(f).lines() {
        let Ok(line) = line else { return None };
        lines += 1;
        if matches!(
            line.split_whitespace().nth(2),
            Some("pci_p2pdma_add_resource" | "p2pdma_pgmap_ops")
        ) {
            found = true;
            break;
        }
    }
    // An empty list (hidden from this reader) says nothing.
    (lines > 0).then_some(found)
}

/// Loaded modules from `<procfs>/modules`: name → state (`Live`, `Loading`, `Unloading`).
fn proc_modules(procfs: &Path) -> Option<Vec<(String, String)>> {
    let s = std::fs::read_to_string(procfs.join("modules")).ok()?;
    Some(
        s.lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                Some((f.first()?.to_string(), f.get(4)?.to_string()))
            })
            .collect(),
    )
}

/// Module file names (`nvidia_peermem`, with `-` as `_`) listed in
/// `<lib_modules>/<release>/modules.dep`; `None` when that file cannot be read.
fn installed_modules(lib_modules: &Path, release: Option<&str>) -> Option<Vec<String>> {
    let dep = std::fs::read_to_string(lib_modules.join(release?).join("modules.dep")).ok()?;
    Some(
        dep.lines()
            .filter_map(|l| {
                let file = l.split(':').next()?.rsplit('/').next()?;
                Some(file.split(".ko").next()?.replace('-', "_"))
            })
            .collect(),
    )
}

/// Read the kernel log (`/dev/kmsg` on a real node): every record's message, oldest first.
/// Unprivileged readers are refused where `kernel.dmesg_restrict` is 1: then `Err` with why.
pub(super) fn read_kernel_log(kmsg: &Path) -> Result<Vec<String>, String> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(kmsg)
        .map_err(|e| format!("{}: {e}", kmsg.display()))?;
    let mut out = Vec::new();
    let mut total = 0usize;
    // /dev/kmsg gives one record per read and EAGAIN at the end; a plain file gives chunks.
    let mut buf = vec![0u8; 8192];
    let mut pending = String::new();
    loop {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                total = total.saturating_add(n);
                pending.push_str(&String::from_utf8_lossy(&buf[..n]));
                while let Some(i) = pending.find('\n') {
                    let line: String = pending.drain(..=i).collect();
                    // "prio,seq,usec,flags;message"; continuation lines start with a space.
                    if let Some((_, msg)) = line.split_once(';') {
                        out.push(msg.trim_end().to_string());
                    }
                }
                if total >= KMSG_MAX_BYTES {
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            // A record overwritten while reading: go on with the next.
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("{}: {e}", kmsg.display())),
        }
    }
    Ok(out)
}

/// Kernel log lines that report a failure of module `name` (its name, with `_` or `-`, as a whole
/// word, and words of failure: unknown symbol, failed, error, invalid, disagrees about version).
pub(super) fn load_errors(log: &[String], name: &str) -> Vec<String> {
    let dashed = name.replace('_', "-");
    let names_it = |l: &str| {
        l.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
            .any(|w| w == name || w == dashed)
    };
    let mut v: Vec<String> = log
        .iter()
        .filter(|l| names_it(l))
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            ["unknown symbol", "fail", "error", "invalid", "disagrees"]
                .iter()
                .any(|w| l.contains(w))
        })
        .cloned()
        .collect();
    if v.len() > MAX_LOAD_ERRORS {
        v.drain(..v.len() - MAX_LOAD_ERRORS);
    }
    v
}

/// Each module in [`MODULES`]: loaded (from `<procfs>/modules`, else `<sysfs>/module/<name>`),
/// its version and state, whether this kernel has it installed, and failures in the kernel log.
/// `nv_peer_mem` (the predecessor of nvidia-peermem) is listed only when loaded or installed.
pub(super) fn module_statuses(
    sysfs: &Path,
    procfs: &Path,
    lib_modules: &Path,
    release: Option<&str>,
    log: Option<&[String]>,
) -> Vec<ModuleStatus> {
    let loaded = proc_modules(procfs);
    let installed = installed_modules(lib_modules, release);
    let mut out = Vec::new();
    for name in MODULES {
        let dir = sysfs.join("module").join(name);
        let from_proc = loaded
            .as_ref()
            .and_then(|l| l.iter().find(|(n, _)| n == name).map(|(_, s)| s.clone()));
        // Built into the kernel: in /sys/module without being in /proc/modules.
        let builtin = from_proc.is_none()
            && dir.join("parameters").is_dir()
            && !dir.join("initstate").exists();
        let is_loaded = from_proc.is_some() || dir.join("initstate").exists() || builtin;
        let state = from_proc
            .or_else(|| read_trimmed(&dir.join("initstate")))
            .or(builtin.then(|| "built in".to_string()));
        let is_installed = installed.as_ref().map(|i| i.iter().any(|m| m == name));
        if name == "nv_peer_mem" && !is_loaded && is_installed != Some(true) {
            continue;
        }
        out.push(ModuleStatus {
            name: name.into(),
            loaded: is_loaded,
            version: is_loaded
                .then(|| read_trimmed(&dir.join("version")))
                .flatten(),
            state,
            installed: if is_loaded { Some(true) } else { is_installed },
            load_errors: log.map(|l| load_errors(l, name)).unwrap_or_default(),
        });
    }
    out
}

/// Peer-memory clients registered with the RDMA core (`<sysfs>/kernel/mm/memory_peers`, present
/// only where the RDMA stack has the peer-memory API nvidia-peermem needs, as MLNX_OFED and
/// DOCA-OFED do). `None` when the API is absent.
pub(super) fn peer_memory_clients(sysfs: &Path) -> Option<Vec<String>> {
    dir_names(&sysfs.join("kernel/mm/memory_peers"))
}

/// What the requirement checks look at, gathered elsewhere.
#[derive(Debug, Clone, Default)]
pub(super) struct RequirementInputs {
    /// The kernel and driver.
    pub kernel: KernelInfo,
    /// Compute capabilities of the visible GPUs.
    pub compute_capabilities: Vec<(i32, i32)>,
    /// libibverbs has `ibv_reg_dmabuf_mr`; `None` when libibverbs did not load.
    pub verbs_dmabuf: Option<bool>,
    /// The modules.
    pub modules: Vec<ModuleStatus>,
    /// [`peer_memory_clients`].
    pub peer_memory: Option<Vec<String>>,
    /// `cuFileGetVersion` as `major.minor`, when libcufile loaded.
    pub cufile_version: Option<String>,
}

fn check(item: &str, needs: &str, found: String, met: Option<bool>) -> RequirementCheck {
    RequirementCheck {
        item: item.into(),
        needs: needs.into(),
        found,
        met,
    }
}

fn all_met(checks: &[RequirementCheck]) -> Option<bool> {
    if checks.iter().any(|c| c.met == Some(false)) {
        Some(false)
    } else if checks.iter().all(|c| c.met == Some(true)) {
        Some(true)
    } else {
        None
    }
}

/// Each GPUDirect path's documented minimums against what was found:
///
/// - GPUDirect RDMA by dma-buf: Linux 5.12 or newer, NVIDIA's open kernel modules (driver 515 or
///   newer, CUDA 11.7), a Turing or newer GPU (compute capability 7.5), libibverbs with
///   `ibv_reg_dmabuf_mr` (rdma-core 34).
/// - GPUDirect RDMA by nvidia-peermem: driver 470 or newer, the peer-memory API in the RDMA core
///   (MLNX_OFED or DOCA-OFED), the module loaded.
/// - GPUDirect Storage by nvidia-fs: the module loaded, NVIDIA's open kernel modules (nvidia-fs
///   2.17.5 and newer support only those).
/// - GPUDirect Storage by PCI P2PDMA (no nvidia-fs): a kernel with PCI P2PDMA (Linux 6.2 or newer on
///   Ubuntu), the open kernel modules 565.47 or newer, an Ampere or newer GPU, cuFile 1.13 (CUDA
///   12.8) or newer.
pub(super) fn requirements(i: &RequirementInputs) -> Vec<Requirement> {
    let k = &i.kernel;
    let kernel = k.release.as_deref().and_then(parse_kernel_release);
    let driver = k.nvidia_driver.as_deref().and_then(parse_driver_version);
    let open = k.nvidia_kernel_module.as_deref().map(|m| m == "open");
    let kernel_found = k.release.clone().unwrap_or_else(|| "unknown".into());
    let driver_found = match (&k.nvidia_driver, &k.nvidia_kernel_module) {
        (Some(v), Some(m)) => format!("{v} ({m})"),
        (Some(v), None) => v.clone(),
        (None, _) => "not loaded".into(),
    };
    let module = |n: &str| i.modules.iter().find(|m| m.name == n);
    let loaded = |n: &str| module(n).map(|m| m.loaded);
    let cc_min = i.compute_capabilities.iter().min().copied();
    let gpu_check = |needs: &str, min: (i32, i32)| {
        check(
            "GPU",
            needs,
            cc_min.map_or("no GPU".into(), |(a, b)| {
                format!("compute capability {a}.{b}")
            }),
            cc_min.map(|c| c >= min),
        )
    };
    let ver_ge = |v: Option<(u32, u32)>, min: (u32, u32)| v.map(|v| v >= min);
    // NVIDIA's open kernel modules at `min` or newer: false when either is known to fail.
    let open_at_least = |min: (u32, u32)| match (open, ver_ge(driver, min)) {
        (Some(false), _) | (_, Some(false)) => Some(false),
        (Some(true), Some(true)) => Some(true),
        _ => None,
    };

    let dmabuf = vec![
        check(
            "Linux",
            ">= 5.12",
            kernel_found.clone(),
            ver_ge(kernel, (5, 12)),
        ),
        check(
            "NVIDIA driver",
            "open kernel modules, >= 515 (CUDA 11.7)",
            driver_found.clone(),
            open_at_least((515, 0)),
        ),
        gpu_check("Turing or newer (compute capability >= 7.5)", (7, 5)),
        check(
            "libibverbs",
            "ibv_reg_dmabuf_mr (rdma-core >= 34)",
            match i.verbs_dmabuf {
                Some(true) => "has ibv_reg_dmabuf_mr".into(),
                Some(false) => "lacks ibv_reg_dmabuf_mr".into(),
                None => "not loaded".into(),
            },
            Some(i.verbs_dmabuf == Some(true)),
        ),
    ];
    let peermem_mod = module("nvidia_peermem")
        .filter(|m| m.loaded)
        .or(module("nv_peer_mem").filter(|m| m.loaded));
    let peermem = vec![
        check(
            "NVIDIA driver",
            ">= 470",
            driver_found.clone(),
            ver_ge(driver, (470, 0)),
        ),
        check(
            "RDMA core",
            "the peer-memory API (MLNX_OFED or DOCA-OFED)",
            match &i.peer_memory {
                Some(c) if c.is_empty() => "present, no client registered".into(),
                Some(c) => format!("present, clients: {}", c.join(", ")),
                None => "absent (inbox RDMA stack)".into(),
            },
            Some(i.peer_memory.is_some()),
        ),
        check(
            "module",
            "nvidia_peermem loaded",
            match peermem_mod {
                Some(m) => format!(
                    "{} loaded{}",
                    m.name,
                    m.version
                        .as_deref()
                        .map(|v| format!(" ({v})"))
                        .unwrap_or_default()
                ),
                None => match module("nvidia_peermem").and_then(|m| m.installed) {
                    Some(true) => "not loaded (installed)".into(),
                    Some(false) => "not loaded (not installed for this kernel)".into(),
                    None => "not loaded".into(),
                },
            },
            Some(peermem_mod.is_some()),
        ),
    ];
    let nvfs = vec![
        check(
            "module",
            "nvidia_fs loaded",
            match module("nvidia_fs") {
                Some(m) if m.loaded => format!(
                    "loaded{}",
                    m.version
                        .as_deref()
                        .map(|v| format!(" ({v})"))
                        .unwrap_or_default()
                ),
                Some(m) if m.installed == Some(true) => "not loaded (installed)".into(),
                _ => "not loaded".into(),
            },
            loaded("nvidia_fs"),
        ),
        check(
            "NVIDIA driver",
            "open kernel modules (nvidia-fs 2.17.5 and newer)",
            driver_found.clone(),
            open,
        ),
    ];
    let cufile = i.cufile_version.as_deref().and_then(parse_driver_version);
    let p2pdma = vec![
        check(
            "Linux",
            "PCI P2PDMA built in (6.2 or newer on Ubuntu)",
            match k.pci_p2pdma {
                Some(true) => format!("{kernel_found}, P2PDMA yes"),
                Some(false) => format!("{kernel_found}, P2PDMA no"),
                None => format!("{kernel_found}, P2PDMA unknown"),
            },
            k.pci_p2pdma,
        ),
        check(
            "NVIDIA driver",
            "open kernel modules >= 565.47",
            driver_found,
            open_at_least((565, 47)),
        ),
        gpu_check("Ampere or newer (compute capability >= 8.0)", (8, 0)),
        check(
            "cuFile",
            ">= 1.13 (CUDA 12.8)",
            i.cufile_version
                .clone()
                .unwrap_or_else(|| "not loaded".into()),
            Some(cufile.is_some_and(|v| v >= (1, 13))),
        ),
    ];
    [
        ("GPUDirect RDMA by dma-buf", dmabuf),
        ("GPUDirect RDMA by nvidia-peermem", peermem),
        ("GPUDirect Storage by nvidia-fs", nvfs),
        ("GPUDirect Storage by PCI P2PDMA", p2pdma),
    ]
    .into_iter()
    .map(|(path, checks)| Requirement {
        path: path.into(),
        met: all_met(&checks),
        checks,
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse() {
        assert_eq!(parse_kernel_release("6.8.0-57-generic"), Some((6, 8)));
        assert_eq!(parse_kernel_release("5.12.0"), Some((5, 12)));
        assert_eq!(parse_kernel_release("7.0-rc1"), Some((7, 0)));
        assert_eq!(parse_kernel_release("x"), None);
        assert_eq!(parse_driver_version("580.95.05"), Some((580, 95)));
        assert_eq!(parse_driver_version("1.15"), Some((1, 15)));
        assert_eq!(parse_driver_version("565"), Some((565, 0)));
    }

    #[test]
    fn p2pdma_from_config_or_symbols() {
        let d = std::env::temp_dir().join(format!("gd-p2pdma-{}", std::process::id()));
        let (boot, proc_) = (d.join("boot"), d.join("proc"));
        std::fs::create_dir_all(&boot).unwrap();
        std::fs::create_dir_all(&proc_).unwrap();
        assert_eq!(kernel_has_p2pdma(&boot, &proc_, "6.8.0"), None);
        std::fs::write(proc_.join("kallsyms"), "").unwrap();
        assert_eq!(kernel_has_p2pdma(&boot, &proc_, "6.8.0"), None);
        std::fs::write(
            proc_.join("kallsyms"),
            "0000000000000000 T dma_pci_p2pdma_supported\n",
        )
        .unwrap();
        assert_eq!(kernel_has_p2pdma(&boot, &proc_, "6.8.0"), Some(false));
        std::fs::write(
            proc_.join("kallsyms"),
            "0000000000000000 T pci_p2pdma_add_resource\n",
        )
        .unwrap();
        assert_eq!(kernel_has_p2pdma(&boot, &proc_, "6.8.0"), Some(true));
        // The kernel's configuration wins over the symbols.
        std::fs::write(
            boot.join("config-6.8.0"),
            "# CONFIG_PCI_P2PDMA is not set\n",
        )
        .unwrap();
        assert_eq!(kernel_has_p2pdma(&boot, &proc_, "6.8.0"), Some(false));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn load_errors_are_picked_from_the_log() {
        let log: Vec<String> = [
            "nvidia_peermem: Unknown symbol ib_register_peer_memory_client (err -2)",
            "nvidia-peermem nv_mem_client_init: failed to register",
            "nvidia_peermem: module loaded",
            "mlx5_core 0000:06:00.0: firmware version 28.39",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(load_errors(&log, "nvidia_peermem"), log[..2].to_vec());
        assert!(load_errors(&log, "nvidia_fs").is_empty());
        // A module's name inside another's is not a match.
        assert!(load_errors(&log, "nvidia").is_empty());
    }
}
