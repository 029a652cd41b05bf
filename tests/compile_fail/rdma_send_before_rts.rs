// Sends can only be posted in RTS.
use gpudirect::rdma::{Init, QueuePair, WorkRequest};

fn f(qp: &mut QueuePair<Init>, wr: WorkRequest<'static>) {
    qp.post_send([wr]).unwrap();
}

fn main() {}
