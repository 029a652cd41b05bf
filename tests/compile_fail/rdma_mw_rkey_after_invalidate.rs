// Invalidating a window takes the bound window: its rkey cannot be read (and handed out) after.
use gpudirect::rdma::{BoundWindow, QueuePair};

fn f(qp: &mut QueuePair, window: BoundWindow) -> u32 {
    let _pending = qp.invalidate_window(window, 0).unwrap();
    window.rkey()
}

fn main() {}
