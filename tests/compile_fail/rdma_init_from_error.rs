// ERR goes to RESET before INIT, as the hardware requires: `to_init` exists only on a `Reset` QP.
use gpudirect::rdma::{AccessFlags, ErrorState, QueuePair};

fn f(qp: QueuePair<ErrorState>) {
    let _ = qp.to_init(1, AccessFlags::empty());
}

fn main() {}
