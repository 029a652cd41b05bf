//! A peer copy's destination must be owned (DeviceMemoryMut): an Arc'd buffer could be read by
//! other holders while the copy engine writes it.
use gpudirect::memory::DeviceBuffer;
use gpudirect::p2p::Copier;
use std::sync::Arc;

fn shared(copier: &Copier, src: DeviceBuffer<u32>, dst: Arc<DeviceBuffer<u32>>) {
    let _ = copier.copy_async(src, dst);
}

fn main() {
    let _ = shared;
}
