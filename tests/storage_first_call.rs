//! The cuFile driver opened before anything else has touched CUDA. One test in its own
//! binary, so nothing ran before it.

use gpudirect::storage::Driver;
use gpudirect_testing::Hardware;

#[test]
fn driver_open_is_the_first_cuda_call() {
    let d = gpudirect_testing::require!(Hardware::Cufile, Driver::open());
    let p = d.properties().expect("properties after a first-call open");
    println!(
        "cuFile {:?} opened first; nvidia-fs {:?}, compat allowed {}",
        d.version(),
        p.nvfs_version,
        p.allow_compat_mode
    );
    let ctx = gpudirect::cuda::context(0).expect("CUDA usable after cuFile opened first");
    ctx.synchronize().unwrap();
}
