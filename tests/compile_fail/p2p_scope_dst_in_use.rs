//! A scope's copy destination stays borrowed until the scope ends: it cannot be read (or
//! freed) inside the scope, while the copy may still write it.
use gpudirect::cuda::Stream;
use gpudirect::memory::DeviceBuffer;
use gpudirect::p2p::Copier;

fn early(copier: &Copier, s: &Stream, src: &DeviceBuffer<u32>, mut dst: DeviceBuffer<u32>) {
    copier.scope(|scope| {
        scope.copy(src, &mut dst).unwrap();
        let _ = dst.to_vec(s);
    });
}

fn freed(copier: &Copier, src: &DeviceBuffer<u32>, mut dst: DeviceBuffer<u32>) {
    copier.scope(|scope| {
        scope.copy(src, &mut dst).unwrap();
        drop(dst);
    });
}

fn main() {
    let _ = early;
    let _ = freed;
}
