//! Process limits and configuration files: the locked-memory limit (what RDMA registration of host
//! memory may pin) and the cuFile configuration in use with its I/O sizes.

use super::model::{CufileConfig, CufileValue, Memlock};
use std::path::Path;

/// Below this, a finite locked-memory limit is called low: enough for small tests, too little
/// for the buffers a training or storage job registers (NVIDIA's RDMA guides ask for unlimited).
pub(super) const MEMLOCK_LOW_BYTES: u64 = 1 << 30;

/// `CAP_IPC_LOCK`'s bit in the capability sets of `/proc/<pid>/status`.
const CAP_IPC_LOCK_BIT: u32 = 14;

/// The locked-memory limit of this process (`getrlimit(RLIMIT_MEMLOCK)`): `(soft, hard)`,
/// `None` meaning unlimited.
///
/// # Errors
///
/// `getrlimit`'s error, in words.
#[doc(alias = "getrlimit")]
pub fn memlock_limits() -> Result<(Option<u64>, Option<u64>), String> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: one valid out-pointer to an rlimit.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) };
    if rc != 0 {
        return Err(format!(
            "getrlimit(RLIMIT_MEMLOCK): {}",
            std::io::Error::last_os_error()
        ));
    }
    // rlim_t is 32 bits wide on some targets.
    #[allow(clippy::unnecessary_cast)]
    let v = |x: libc::rlim_t| (x != libc::RLIM_INFINITY).then_some(x as u64);
    Ok((v(r.rlim_cur), v(r.rlim_max)))
}

/// Whether this process holds `CAP_IPC_LOCK` (then the limit does not apply), from the `CapEff`
/// line of `<procfs>/self/status`.
pub(super) fn has_cap_ipc_lock(procfs: &Path) -> Option<bool> {
    let s = std::fs::read_to_string(procfs.join("self/status")).ok()?;
    let hex = s.lines().find_map(|l| l.strip_prefix("CapEff:"))?.trim();
    let caps = u64::from_str_radix(hex, 16).ok()?;
    Some(caps & (1 << CAP_IPC_LOCK_BIT) != 0)
}

/// `1536 MiB`, `8 MiB`, `64 KiB`.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [(u64, &str); 4] = [
        (1 << 40, "TiB"),
        (1 << 30, "GiB"),
        (1 << 20, "MiB"),
        (1 << 10, "KiB"),
    ];
    for (u, n) in UNITS {
        if b >= u && b.is_multiple_of(u) {
            return format!("{} {n}", b / u);
        }
    }
    for (u, n) in UNITS {
        if b >= u {
            return format!("{:.1} {n}", b as f64 / u as f64);
        }
    }
    format!("{b} bytes")
}

/// The locked-memory finding from the limits and the capability.
pub(super) fn memlock(
    limits: Result<(Option<u64>, Option<u64>), String>,
    cap_ipc_lock: Option<bool>,
) -> Memlock {
    let (soft, hard) = match limits {
        Ok(l) => l,
        Err(e) => {
            return Memlock {
                soft_bytes: None,
                soft_unlimited: false,
                hard_bytes: None,
                hard_unlimited: false,
                cap_ipc_lock,
                allows: "unknown".into(),
                low: false,
                error: Some(e),
            };
        }
    };
    let low = cap_ipc_lock != Some(true) && soft.is_some_and(|s| s < MEMLOCK_LOW_BYTES);
    let allows = if cap_ipc_lock == Some(true) {
        "any amount: this process holds CAP_IPC_LOCK, so the limit does not apply".to_string()
    } else {
        match soft {
            None => "any amount of host memory to be registered (unlimited)".to_string(),
            Some(s) => format!(
                "at most {} of host memory registered for RDMA at once, across every memory region of the process; GPU memory registered through dma-buf or nvidia-peermem does not count",
                human_bytes(s)
            ),
        }
    };
    Memlock {
        soft_bytes: soft,
        soft_unlimited: soft.is_none(),
        hard_bytes: hard,
        hard_unlimited: hard.is_none(),
        cap_ipc_lock,
        allows,
        low,
        error: None,
    }
}

/// The cuFile configuration keys the report shows: its I/O sizes and the switches that decide
/// the path (dotted paths into the file's JSON).
pub(super) const CUFILE_KEYS: [&str; 12] = [
    "properties.max_direct_io_size_kb",
    "properties.max_device_cache_size_kb",
    "properties.per_buffer_cache_size_kb",
    "properties.max_device_pinned_mem_size_kb",
    "properties.io_batchsize",
    "properties.poll_mode_max_size_kb",
    "properties.use_poll_mode",
    "properties.allow_compat_mode",
    "properties.posix_pool_slab_size_kb",
    "properties.posix_pool_slab_count",
    "execution.max_io_threads",
    "execution.parallel_io",
];

/// The configuration file cuFile reads: `CUFILE_ENV_PATH_JSON` when set, else `default`
/// (`/etc/cufile.json`).
pub(super) fn cufile_config_path(
    env: &dyn Fn(&str) -> Option<String>,
    default: &Path,
) -> (String, String) {
    match env("CUFILE_ENV_PATH_JSON").filter(|p| !p.trim().is_empty()) {
        Some(p) => (p, "CUFILE_ENV_PATH_JSON".into()),
        None => (default.display().to_string(), "default".into()),
    }
}

/// `text` without `//` line comments and `/* */` block comments outside strings (cuFile's
/// configuration files carry both; JSON has neither).
pub(super) fn strip_json_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    let mut in_string = false;
    while let Some(c) = chars.next() {
        if in_string {
            out.push(c);
            match c {
                '\\' => {
                    if let Some(n) = chars.next() {
                        out.push(n);
                    }
                }
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match (c, chars.peek()) {
            ('"', _) => {
                in_string = true;
                out.push(c);
            }
            ('/', Some('/')) => {
                for n in chars.by_ref() {
                    if n == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            ('/', Some('*')) => {
                chars.next();
                let mut prev = ' ';
                for n in chars.by_ref() {
                    if prev == '*' && n == '/' {
                        break;
                    }
                    if n == '\n' {
                        out.push('\n');
                    }
                    prev = n;
                }
            }
            _ => out.push(c),
        }
    }
    out
}

/// Read the cuFile configuration at `path` (named by `source`) and pick [`CUFILE_KEYS`].
pub(super) fn cufile_config(path: &str, source: &str) -> CufileConfig {
    let mut c = CufileConfig {
        path: path.into(),
        source: source.into(),
        exists: false,
        values: Vec::new(),
        error: None,
    };
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return c,
        Err(e) => {
            c.exists = Path::new(path).exists();
            c.error = Some(format!("cannot read {path}: {e}"));
            return c;
        }
    };
    c.exists = true;
    let v: serde_json::Value = match serde_json::from_str(&strip_json_comments(&text)) {
        Ok(v) => v,
        Err(e) => {
            c.error = Some(format!(
                "{path} is not valid JSON (after removing comments): {e}"
            ));
            return c;
        }
    };
    for key in CUFILE_KEYS {
        let mut cur = &v;
        let mut found = true;
        for part in key.split('.') {
            match cur.get(part) {
                Some(n) => cur = n,
                None => {
                    found = false;
                    break;
                }
            }
        }
        if found {
            c.values.push(CufileValue {
                key: key.into(),
                value: cur.to_string(),
            });
        }
    }
    c
}

/// A problem with the value of a setting the report checks, in words; `None` when the value is
/// one the consumer accepts.
pub fn setting_problem(name: &str, value: &str) -> Option<String> {
    let v = value.trim();
    let int = v.parse::<i64>().ok();
    match name {
        "NCCL_P2P_LEVEL" => {
            let named = ["LOC", "NVL", "PIX", "PXB", "PHB", "SYS"];
            (!named.contains(&v.to_ascii_uppercase().as_str()) && !matches!(int, Some(0..=5)))
                .then(|| format!("NCCL_P2P_LEVEL={value:?} is not a level NCCL knows (LOC, NVL, PIX, PXB, PHB, SYS, or 0 to 5)"))
        }
        "NCCL_IB_DISABLE" | "NCCL_P2P_DISABLE" => (!matches!(int, Some(0 | 1)))
            .then(|| format!("{name}={value:?} should be 0 or 1")),
        "NCCL_MAX_NCHANNELS" => (!matches!(int, Some(1..)))
            .then(|| format!("NCCL_MAX_NCHANNELS={value:?} should be a positive number of channels")),
        "CUDA_DEVICE_MAX_CONNECTIONS" => (!matches!(int, Some(1..=32)))
            .then(|| format!("CUDA_DEVICE_MAX_CONNECTIONS={value:?} should be a number of hardware queues from 1 to 32")),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comments_are_stripped_outside_strings() {
        let t = "{\n // a comment\n \"a\": \"x//y\", /* block\n */ \"b\": 2 // end\n}";
        let v: serde_json::Value = serde_json::from_str(&strip_json_comments(t)).unwrap();
        assert_eq!(v["a"], "x//y");
        assert_eq!(v["b"], 2);
        let t = r#"{"q": "a \" /* not */ b"}"#;
        assert_eq!(strip_json_comments(t), t);
    }

    #[test]
    fn memlock_words() {
        let m = memlock(Ok((Some(8 << 20), Some(8 << 20))), Some(false));
        assert!(m.low);
        assert!(
            m.allows.starts_with("at most 8 MiB of host memory"),
            "{}",
            m.allows
        );
        let m = memlock(Ok((None, None)), Some(false));
        assert!(!m.low && m.soft_unlimited && m.hard_unlimited);
        let m = memlock(Ok((Some(64 << 10), None)), Some(true));
        assert!(!m.low, "CAP_IPC_LOCK lifts the limit");
        assert!(m.allows.contains("CAP_IPC_LOCK"));
        assert_eq!(human_bytes(1536 << 20), "1536 MiB");
        assert_eq!(human_bytes(1_500_000), "1.4 MiB");
        assert_eq!(human_bytes(65536), "64 KiB");
        assert_eq!(human_bytes(100), "100 bytes");
    }

    #[test]
    fn setting_values_are_checked() {
        assert_eq!(setting_problem("NCCL_P2P_LEVEL", "nvl"), None);
        assert_eq!(setting_problem("NCCL_P2P_LEVEL", "3"), None);
        assert!(setting_problem("NCCL_P2P_LEVEL", "NVLINK").is_some());
        assert!(setting_problem("NCCL_IB_DISABLE", "yes").is_some());
        assert_eq!(setting_problem("NCCL_MAX_NCHANNELS", "16"), None);
        assert!(setting_problem("NCCL_MAX_NCHANNELS", "0").is_some());
        assert!(setting_problem("CUDA_DEVICE_MAX_CONNECTIONS", "64").is_some());
        assert_eq!(setting_problem("CUDA_DEVICE_MAX_CONNECTIONS", "1"), None);
    }
}
