// A region shared between threads (an `Arc`) cannot be written through it: `write_at` and `fill`
// need `&mut`, so no thread copies out of the region while another copies in.
use gpudirect::rdma::{MemoryRegion, Remote};
use std::sync::Arc;

fn f(mr: MemoryRegion<Remote>) {
    let mr = Arc::new(mr);
    let other = mr.clone();
    let t = std::thread::spawn(move || other.write_at(0, b"torn").unwrap());
    let mut b = [0u8; 4];
    mr.read_at(0, &mut b).unwrap();
    mr.fill(0, 4, 0).unwrap();
    t.join().unwrap();
}

fn main() {}
