// A dma-buf export never lends its fd: a duplicate could outlive the memory behind it.
use gpudirect::memory::DeviceBuffer;
use std::os::fd::AsFd;

fn main() {
    let ctx = gpudirect::cuda::context(0).unwrap();
    let buf = DeviceBuffer::<u8>::alloc(&ctx, 4096).unwrap();
    let export = gpudirect::memory::export_dmabuf(buf, 0, 4096).unwrap();
    let _dup = export.as_fd().try_clone_to_owned();
}
