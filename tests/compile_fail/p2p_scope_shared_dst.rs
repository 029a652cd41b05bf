//! A scope's copy destination must be memory the caller owns alone: an `Arc`'s shared value is
//! not (others may read it while the copy writes).
use gpudirect::memory::DeviceBuffer;
use gpudirect::p2p::Copier;
use std::sync::Arc;

fn shared(copier: &Copier, src: &DeviceBuffer<u32>, mut dst: Arc<DeviceBuffer<u32>>) {
    copier.scope(|scope| {
        scope.copy(src, &mut dst).unwrap();
    });
}

fn main() {
    let _ = shared;
}
