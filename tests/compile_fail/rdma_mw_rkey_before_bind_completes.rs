// A window's rkey is reachable only once its bind's completion was polled: a pending bind has
// none (`PendingBind::finish` gives the `BoundWindow` that has it).
use gpudirect::rdma::{MemoryWindow, QueuePair, WindowBind};

fn f(qp: &mut QueuePair, window: MemoryWindow, bind: WindowBind) -> u32 {
    let pending = qp.bind_window(window, bind).unwrap();
    pending.rkey()
}

fn main() {}
