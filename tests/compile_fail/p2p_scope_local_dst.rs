//! A scope's copies may only borrow buffers that outlive the scope: one made inside the closure
//! would be freed before the scope waits for the copy.
use gpudirect::memory::DeviceBuffer;
use gpudirect::p2p::Copier;

fn local(copier: &Copier, src: &DeviceBuffer<u32>, make: fn() -> DeviceBuffer<u32>) {
    copier.scope(|scope| {
        let mut dst = make();
        scope.copy(src, &mut dst).unwrap();
    });
}

fn main() {
    let _ = local;
}
