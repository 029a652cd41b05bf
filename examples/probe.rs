//! `cargo run --release --example probe [-- --json] [-- --no-measure]`: what this node offers
//! each GPUDirect path (P2P, RDMA, Storage, Async), how GPUs and NICs are wired, and advice.
//!
//! Exits 0 wherever it runs; whatever is absent is reported with the reason. `--no-measure`
//! skips the quick copies and the storage read (a few seconds in all). The JSON schema is
//! documented in `docs/probe-schema.md`.

use gpudirect::topology::{GatherOptions, NodeReport};
use std::io::Write;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(bad) = args
        .iter()
        .find(|a| !["--json", "--no-measure"].contains(&a.as_str()))
    {
        eprintln!("probe: unknown argument {bad:?}\nusage: probe [--json] [--no-measure]");
        std::process::exit(2);
    }
    let json = args.iter().any(|a| a == "--json");
    let opts = GatherOptions {
        measure: !args.iter().any(|a| a == "--no-measure"),
        ..GatherOptions::default()
    };
    let report = NodeReport::gather_with(&opts);
    let text = if json {
        match serde_json::to_string_pretty(&report) {
            Ok(s) => s + "\n",
            Err(e) => {
                eprintln!("probe: cannot render JSON: {e}");
                std::process::exit(1);
            }
        }
    } else {
        report.to_string()
    };
    // A closed pipe (`| head`) is not an error worth a panic.
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}
