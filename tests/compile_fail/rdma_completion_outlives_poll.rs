// A completion borrows the CQ's poll buffer: polling again while holding one does not compile.
use gpudirect::rdma::CompletionQueue;

fn f(cq: &mut CompletionQueue) {
    let first = cq.poll().unwrap().next();
    let _again = cq.poll();
    println!("{first:?}");
}

fn main() {}
