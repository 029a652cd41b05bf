//! Source and destination must hold the same element type.
use gpudirect::cuda::Stream;
use gpudirect::memory::{DeviceBuffer, PinnedHostBuffer, copy_async};

fn mismatch(stream: &Stream, src: DeviceBuffer<u32>, dst: PinnedHostBuffer<f32>) {
    let _ = copy_async(stream, src, dst);
}

fn main() {
    let _ = mismatch;
}
