// Binds are send-queue requests: a window is bound only through a queue pair in RTS.
use gpudirect::rdma::{Init, MemoryWindow, QueuePair, WindowBind};

fn f(qp: &mut QueuePair<Init>, window: MemoryWindow, bind: WindowBind) {
    let _ = qp.bind_window(window, bind);
}

fn main() {}
