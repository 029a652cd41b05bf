//! Depends on gpudirect and on cudarc with `dynamic-linking`: libcuda is linked at build time by
//! this crate's choice (linking needs the CUDA driver library or the toolkit's stub; `cargo check`
//! does not). gpudirect's own presence check then agrees with the linked library.
//!
//! `cargo check` proves it builds; run, it prints what it finds or `SKIPPED: reason` (exit 0).

use cudarc::driver::{CudaContext, sys};
use std::sync::Arc;

// The bindings gpudirect reports are the ones really compiled: cudarc's, whichever crate chose
// them.
const _: () = assert!(gpudirect::cuda::BINDINGS_VERSION == 12080);
const _: () = assert!(gpudirect::cuda::BINDINGS_VERSION as u32 == sys::CUDA_VERSION);

fn main() {
    println!("bindings: CUDA {}", gpudirect::cuda::BINDINGS_VERSION);
    // One cudarc in the build: the context gpudirect hands out is this crate's cudarc type.
    let ctx: gpudirect::Result<Arc<CudaContext>> = gpudirect::cuda::context(0);
    match ctx {
        Ok(ctx) => println!("GPU {}: primary context retained", ctx.ordinal()),
        Err(e) if e.absence().is_some() => println!("SKIPPED: {e}"),
        Err(e) => {
            eprintln!("FAILED: {e}");
            std::process::exit(1);
        }
    }
}
