//! Device work cannot start on a plain borrow that could outlive it: async copies take owned
//! buffers (or Arcs), never `&`.
use gpudirect::cuda::Stream;
use gpudirect::memory::{DeviceBuffer, HostAllocFlags, PinnedHostBuffer, copy_async};

fn start(stream: &Stream, src: &PinnedHostBuffer<u32>, dst: DeviceBuffer<u32>) {
    let op = copy_async(stream, src, dst);
    drop(op);
}

fn main() {
    let _ = (start, HostAllocFlags::empty());
}
