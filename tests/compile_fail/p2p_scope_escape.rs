//! The scope handle cannot leave the closure: a copy queued through it after `scope` returned
//! would never be waited for.
use gpudirect::memory::DeviceBuffer;
use gpudirect::p2p::{Copier, CopyScope};

fn escape<'a>(copier: &'a Copier, src: &'a DeviceBuffer<u32>, dst: &'a mut DeviceBuffer<u32>) {
    let mut kept: Option<&CopyScope<'_, '_>> = None;
    copier.scope(|scope| {
        kept = Some(scope);
    });
    kept.unwrap().copy(src, dst).unwrap();
}

fn main() {
    let _ = escape;
}
