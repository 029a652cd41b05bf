// `fill` writes the bytes: it needs `&mut`, not a shared reference.
use gpudirect::rdma::{Local, MemoryRegion};

fn f(mr: &MemoryRegion<Local>) {
    mr.fill(0, 64, 0xEE).unwrap();
}

fn main() {}
