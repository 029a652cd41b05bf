//! Depends on gpudirect alone, choosing the CUDA version through gpudirect's `cuda-13000` feature
//! and using cudarc through gpudirect's re-export.
//!
//! `cargo check` proves it builds; run, it prints what it finds or `SKIPPED: reason` (exit 0).

use gpudirect::cudarc::driver::{CudaContext, sys};
use std::sync::Arc;

// The bindings gpudirect reports are the ones really compiled: cudarc's, whichever crate chose
// them.
const _: () = assert!(gpudirect::cuda::BINDINGS_VERSION == 13000);
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
