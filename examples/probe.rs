//! What this node offers each GPUDirect path (P2P, RDMA, Storage, Async), how GPUs and NICs are
//! wired, whether the node is healthy (driver and kernel, modules, PCIe links, ACS, IOMMU,
//! NVLink, limits, settings), and advice:
//!
//! ```text
//! cargo run --release --example probe
//! cargo run --release --example probe -- --json
//! cargo run --release --example probe -- --no-measure --require gpu,p2p,nvlink
//! cargo run --release --example probe -- --help
//! ```
//!
//! Exits 0 wherever it runs (whatever is absent is reported with the reason), unless `--require`
//! names a path that is unusable or degraded: then it exits 1 and says why on one line (stderr).
//! A bad argument or environment setting exits 2. The JSON schema is in `docs/probe-schema.md`.
//! The text ends with how the transfer engine's endpoints would be authenticated here: with the
//! key of `--key-file` / `GPUDIRECT_TRANSFER_KEY_FILE`, or "unauthenticated".

use clap::Parser;
use gpudirect::report::{DataPath, GatherOptions, NodeReport, check_required};
use std::io::Write;
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "probe",
    about = "What this node offers each GPUDirect path, whether it is healthy, and what to do about it.",
    long_about = "What this node offers each GPUDirect path (P2P, RDMA, Storage, Async), how its GPUs and NICs \
are wired, whether it is healthy (driver and kernel against each path's needs, peer-memory and storage \
modules, PCIe link speed and width, ACS, IOMMU, NVLink state and errors, the locked-memory limit, NCCL, \
CUDA and cuFile settings), and advice in plain words.\n\n\
Exit status: 0 wherever it runs; 1 when --require names a path that is unusable or degraded (the reason \
on one line on stderr, the report still on stdout); 2 for a bad argument or environment setting.",
    after_help = "Environment:\n  \
GPUDIRECT_TEST_DIR   directory for the storage read's temporary file (as --read-dir)\n  \
GPUDIRECT_NVML_PATH  the NVML library to load (as --nvml-path)\n  \
GPUDIRECT_TRANSFER_KEY_FILE  the transfer engine's key file (as --key-file)\n  \
NCCL_P2P_LEVEL, NCCL_P2P_DISABLE, NCCL_IB_DISABLE, NCCL_MAX_NCHANNELS, CUDA_DEVICE_MAX_CONNECTIONS,\n  \
CUFILE_ENV_PATH_JSON are reported and checked, never changed."
)]
struct Args {
    /// Print the report as JSON (the schema is docs/probe-schema.md) instead of text.
    #[arg(long)]
    json: bool,

    /// Skip the quick measurements: one verified copy per GPU pair, one verified storage read,
    /// and reading an idle GPU's PCIe link speed again under load (a few seconds in all).
    #[arg(long)]
    no_measure: bool,

    /// Exit 1 when one of these paths is unusable or degraded, comma-separated: gpu, multi-gpu,
    /// p2p, nvlink, rdma, gpudirect-rdma, cufile, gds, async (--help says what each checks).
    #[arg(
        long,
        value_name = "PATH,...",
        value_delimiter = ',',
        value_parser = parse_path,
        long_help = require_help()
    )]
    require: Vec<DataPath>,

    /// Bytes per P2P copy, in MiB (1 to 4096).
    #[arg(long, value_name = "MiB", default_value = "32", value_parser = |s: &str| mib(s, 4096))]
    copy_mib: usize,

    /// Bytes of the storage read, in MiB (1 to 16384).
    #[arg(long, value_name = "MiB", default_value = "64", value_parser = |s: &str| mib(s, 16384))]
    read_mib: usize,

    /// Existing directory for the storage read's temporary file (removed afterwards); cuFile
    /// cannot register files on tmpfs. Default: the system's temporary directory.
    #[arg(long, value_name = "DIR", env = "GPUDIRECT_TEST_DIR", value_parser = existing_dir)]
    read_dir: Option<PathBuf>,

    /// The NVML library to load (libnvidia-ml.so.1) when the loader's search and the directory
    /// of libcuda do not find it.
    #[arg(long, value_name = "FILE", env = "GPUDIRECT_NVML_PATH", value_parser = existing_file)]
    nvml_path: Option<PathBuf>,

    /// The transfer engine's key file (`EngineConfig::key`): the text says whether its
    /// endpoints would be authenticated with it, or unauthenticated without one.
    #[arg(long, value_name = "FILE", env = "GPUDIRECT_TRANSFER_KEY_FILE")]
    key_file: Option<PathBuf>,
}

/// How the transfer engine's endpoints would be authenticated with `key_file`.
fn transfer_line(key_file: Option<&std::path::Path>) -> String {
    match key_file {
        None => "Transfer engine: endpoints unauthenticated (no key: --key-file PATH or \
                 GPUDIRECT_TRANSFER_KEY_FILE; any process that reaches a listener's port is a peer)"
            .into(),
        Some(p) => match gpudirect::transfer::AuthKey::from_file(p) {
            Ok(_) => format!(
                "Transfer engine: endpoints authenticated with the key in {} (peers prove they \
                 hold it before anything is published)",
                p.display()
            ),
            Err(e) => format!(
                "Transfer engine: the key file {} cannot be used ({e}): an engine with it is not \
                 made",
                p.display()
            ),
        },
    }
}

fn parse_path(s: &str) -> Result<DataPath, String> {
    s.parse()
}

fn require_help() -> String {
    let mut h = String::from(
        "Exit 1, with the reason on one line on stderr, when one of these paths is unusable or \
degraded; exit 0 when all are usable. Comma-separated, case-insensitive:\n",
    );
    for p in DataPath::ALL {
        h += &format!("  {:<15} {}\n", p.name(), p.describe());
    }
    h
}

/// `s` MiB in bytes, for 1 to `max` MiB.
fn mib(s: &str, max: u32) -> Result<usize, String> {
    let n: u32 = s
        .trim()
        .parse()
        .map_err(|e| format!("{s:?} is not a whole number of MiB: {e}"))?;
    if !(1..=max).contains(&n) {
        return Err(format!("{n} MiB is outside 1 to {max} MiB"));
    }
    usize::try_from(u64::from(n) << 20)
        .map_err(|_| format!("{n} MiB does not fit this machine's address space"))
}

fn existing_dir(s: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(s);
    match std::fs::metadata(&p) {
        Ok(m) if m.is_dir() => Ok(p),
        Ok(_) => Err(format!("{s} is not a directory")),
        Err(e) => Err(format!("{s}: {e}")),
    }
}

fn existing_file(s: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(s);
    match std::fs::metadata(&p) {
        Ok(m) if m.is_file() => Ok(p),
        Ok(_) => Err(format!("{s} is not a file")),
        Err(e) => Err(format!("{s}: {e}")),
    }
}

fn main() {
    let args = Args::parse();
    if let Some(p) = &args.nvml_path
        && std::env::var_os("GPUDIRECT_NVML_PATH").as_deref() != Some(p.as_os_str())
    {
        // SAFETY: nothing else runs yet: no thread has been started and no library reads the
        // environment concurrently.
        unsafe { std::env::set_var("GPUDIRECT_NVML_PATH", p) };
    }
    let mut opts = GatherOptions {
        measure: !args.no_measure,
        copy_bytes: args.copy_mib,
        read_bytes: args.read_mib,
        ..GatherOptions::default()
    };
    if let Some(d) = args.read_dir {
        opts.read_dir = d;
    }
    let report = NodeReport::gather_with(&opts);
    let text = if args.json {
        match serde_json::to_string_pretty(&report) {
            Ok(s) => s + "\n",
            Err(e) => {
                eprintln!("probe: cannot render JSON: {e}");
                std::process::exit(1);
            }
        }
    } else {
        format!("{report}\n{}\n", transfer_line(args.key_file.as_deref()))
    };
    // A closed pipe (`| head`) is not an error worth a panic.
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
    if let Err(why) = check_required(&report, &args.require) {
        let _ = std::io::stdout().flush();
        eprintln!("probe: {why}");
        std::process::exit(1);
    }
}
