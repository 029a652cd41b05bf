//! Depends on gpudirect and on its own cudarc 0.19 with CUDA 13.4 bindings, the newest cudarc
//! 0.19.10 offers (CUmemLocation keeps its id in a union there): the version is chosen on cudarc
//! alone.
//!
//! `cargo check` proves it builds; run, it prints what it finds or `SKIPPED: reason` (exit 0).

use cudarc::driver::{CudaContext, sys};
use std::sync::Arc;

// The bindings gpudirect reports are the ones really compiled: cudarc's, whichever crate chose
// them.
const _: () = assert!(gpudirect::cuda::BINDINGS_VERSION == 13040);
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
