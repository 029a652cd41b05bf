// Sends can only be posted in RTS.
use gpudirect::rdma::{Init, QueuePair, SendRequest};

fn f(qp: &mut QueuePair<Init>, wr: SendRequest<'static>) {
    qp.post_send([wr]).unwrap();
}

fn main() {}
