//! `cargo run --release --example probe [-- --json]`: what this node offers GPUDirect.
//!
//! Exits 0 wherever it runs; whatever is absent is reported with the reason.

use gpudirect::topology::NodeReport;

fn main() {
    let json = std::env::args().skip(1).any(|a| a == "--json");
    let report = NodeReport::gather();
    if json {
        match serde_json::to_string_pretty(&report) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("probe: cannot render JSON: {e}");
                std::process::exit(1);
            }
        }
    } else {
        print!("{report}");
    }
}
