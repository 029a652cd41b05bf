//! An InFlight hands its resources back only through wait/try_take (after completion).
use gpudirect::cuda::Stream;
use gpudirect::memory::{DeviceBuffer, PinnedHostBuffer, copy_async};

fn peek(stream: &Stream, src: DeviceBuffer<u32>, dst: PinnedHostBuffer<u32>) {
    let op = copy_async(stream, src, dst).unwrap();
    let (_, dst) = &op.resources;
    let _ = dst;
}

fn main() {
    let _ = peek;
}
