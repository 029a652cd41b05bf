// Receives can be posted from INIT on, not in RESET.
use gpudirect::rdma::{QueuePair, RecvRequest, Reset};

fn f(qp: &mut QueuePair<Reset>, r: RecvRequest) {
    qp.post_recv([r]).unwrap();
}

fn main() {}
