//! The destination of an in-flight peer copy is owned by the InFlight: it cannot be read until
//! `wait` hands it back.
use gpudirect::cuda::Stream;
use gpudirect::memory::DeviceBuffer;
use gpudirect::p2p::Copier;

fn early(copier: &Copier, s: &Stream, src: DeviceBuffer<u32>, dst: DeviceBuffer<u32>) {
    let op = copier.copy_async(src, dst).unwrap();
    let _ = dst.to_vec(s);
    let _ = op.wait();
}

fn main() {
    let _ = early;
}
