// A queue pair in the error state takes no sends: only `reset` (then INIT, RTR, RTS) or drop.
use gpudirect::rdma::{ErrorState, QueuePair, SendRequest};

fn f(qp: &mut QueuePair<ErrorState>) {
    qp.post_send([SendRequest::send_inline(b"x")]).unwrap();
}

fn main() {}
