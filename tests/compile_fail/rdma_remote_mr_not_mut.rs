// A remote-writable region never hands out `&mut [u8]` (a peer may write it at any time).
use gpudirect::rdma::{MemoryRegion, Remote};

fn f(mr: &mut MemoryRegion<Remote>) {
    let _bytes: &mut [u8] = mr.as_mut_slice().unwrap();
}

fn main() {}
