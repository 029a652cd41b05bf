// One thread reading a region while another writes it does not compile: reads borrow it shared,
// writes need it exclusively.
use gpudirect::rdma::{Local, MemoryRegion};

fn f(mut mr: MemoryRegion<Local>) {
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut b = [0u8; 8];
            mr.read_at(0, &mut b).unwrap();
        });
        s.spawn(|| mr.write_at(0, &[1; 8]).unwrap());
    });
}

fn main() {}
