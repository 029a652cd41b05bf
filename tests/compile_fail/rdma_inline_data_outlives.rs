// Inline data is borrowed until the request is posted: it cannot be dropped before.
use gpudirect::rdma::{QueuePair, Rts, SendRequest};

fn f(qp: &mut QueuePair<Rts>) {
    let wr;
    {
        let data = vec![1u8; 8];
        wr = SendRequest::send_inline(&data);
    }
    qp.post_send([wr]).unwrap();
}

fn main() {}
