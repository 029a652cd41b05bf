//! A copy destination cannot be read before the copy has completed: the InFlight owns it.
use gpudirect::cuda::Stream;
use gpudirect::memory::{DeviceBuffer, PinnedHostBuffer, copy_async};

fn read_early(stream: &Stream, src: DeviceBuffer<u32>, dst: PinnedHostBuffer<u32>) -> u32 {
    let op = copy_async(stream, src, dst).unwrap();
    let first = dst.as_slice()[0];
    drop(op);
    first
}

fn main() {
    let _ = read_early;
}
