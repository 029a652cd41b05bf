// A NIC may write registered memory: the engine takes device memory by value (owned), never
// shared through an Arc someone else can still copy from.
use gpudirect::memory::DeviceBuffer;
use gpudirect::transfer::Buffer;
use std::sync::Arc;

fn main() {
    let ctx = gpudirect::cuda::context(0).unwrap();
    let dev = Arc::new(DeviceBuffer::<u8>::alloc(&ctx, 4096).unwrap());
    let _ = Buffer::device(dev);
}
