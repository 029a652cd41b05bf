// An unbound window gives no access, and has no rkey to hand out.
use gpudirect::rdma::MemoryWindow;

fn f(window: &MemoryWindow) -> u32 {
    window.rkey()
}

fn main() {}
