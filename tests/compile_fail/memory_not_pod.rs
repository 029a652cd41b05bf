//! Device bytes are only read into types where every bit pattern is valid: `bool` is not Pod.
use gpudirect::memory::DeviceBuffer;
use std::sync::Arc;

fn alloc(ctx: &Arc<gpudirect::cudarc::driver::CudaContext>) {
    let _ = DeviceBuffer::<bool>::alloc(ctx, 16);
}

fn main() {
    let _ = alloc;
}
