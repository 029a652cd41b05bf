//! Nothing that can queue a copy, and no borrow a copy holds, can leave the scope's closure: a
//! copy queued after `scope` returned would never be waited for. Tried: an outer variable, a
//! RefCell, a channel, a detached thread, a closure returned as the scope's value, and the
//! destination itself returned.
use gpudirect::memory::DeviceBuffer;
use gpudirect::p2p::{Copier, CopyScope};
use std::cell::RefCell;

type B = DeviceBuffer<u32>;

fn outer<'a>(copier: &'a Copier, src: &'a B, dst: &'a mut B) {
    let mut kept: Option<&CopyScope<'_, '_>> = None;
    copier.scope(|scope| {
        kept = Some(scope);
    });
    kept.unwrap().copy(src, dst).unwrap();
}

fn refcell<'a>(copier: &'a Copier, src: &'a B, dst: &'a mut B) {
    let cell = RefCell::new(None);
    copier.scope(|scope| {
        *cell.borrow_mut() = Some(scope);
    });
    cell.borrow().unwrap().copy(src, dst).unwrap();
}

fn channel<'a>(copier: &'a Copier, src: &'a B, dst: &'a mut B) {
    let (tx, rx) = std::sync::mpsc::channel();
    copier.scope(|scope| tx.send(scope).unwrap());
    rx.recv().unwrap().copy(src, dst).unwrap();
}

fn detached(copier: &'static Copier, src: &'static B, dst: &'static mut B) {
    copier.scope(|scope| {
        std::thread::spawn(move || scope.copy(src, dst));
    });
}

fn later<'a>(copier: &'a Copier, src: &'a B, dst: &'a mut B) {
    let mut run = copier.scope(|scope| move || scope.copy(src, dst));
    run().unwrap();
}

fn dst_out(copier: &Copier, src: &B, mut dst: B) {
    let d = copier.scope(|scope| {
        scope.copy(src, &mut dst).unwrap();
        &dst
    });
    let _ = d;
}

fn main() {
    let _ = (outer, refcell, channel, detached, later, dst_out);
}
