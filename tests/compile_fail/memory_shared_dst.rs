//! A shared (Arc) buffer may be a copy source, never a destination: other holders could read it
//! while the copy writes.
use gpudirect::cuda::Stream;
use gpudirect::memory::{DeviceBuffer, PinnedHostBuffer, copy_async};
use std::sync::Arc;

fn shared(stream: &Stream, src: DeviceBuffer<u32>, dst: Arc<PinnedHostBuffer<u32>>) {
    let _ = copy_async(stream, src, dst);
}

fn main() {
    let _ = shared;
}
