// While an invalidation is in flight the window has no rkey to hand out either.
use gpudirect::rdma::{BoundWindow, QueuePair};

fn f(qp: &mut QueuePair, window: BoundWindow) -> u32 {
    let pending = qp.invalidate_window(window, 0).unwrap();
    pending.rkey()
}

fn main() {}
