//! A scope's copy destination stays borrowed until the scope ends: inside the scope it cannot
//! be read, freed, copied into twice or carried out in a panic, and the copier cannot be
//! dropped, while a copy may still write it.
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

fn twice(copier: &Copier, src: &DeviceBuffer<u32>, mut dst: DeviceBuffer<u32>) {
    copier.scope(|scope| {
        scope.copy(src, &mut dst).unwrap();
        scope.copy(src, &mut dst).unwrap();
    });
}

fn in_a_panic(copier: &Copier, src: &DeviceBuffer<u32>, mut dst: DeviceBuffer<u32>) {
    copier.scope(|scope| {
        scope.copy(src, &mut dst).unwrap();
        std::panic::panic_any(&dst);
    });
}

fn copier_dropped(copier: Copier, src: &DeviceBuffer<u32>, mut dst: DeviceBuffer<u32>) {
    copier.scope(|scope| {
        scope.copy(src, &mut dst).unwrap();
        drop(copier);
    });
}

fn main() {
    let _ = (early, freed, twice, in_a_panic, copier_dropped);
}
