//! Source and destination of a peer copy hold the same element type.
use gpudirect::memory::DeviceBuffer;
use gpudirect::p2p::Copier;

fn mixed(copier: &Copier, src: DeviceBuffer<u32>, dst: DeviceBuffer<f32>) {
    let _ = copier.copy(src, dst);
}

fn main() {
    let _ = mixed;
}
