// Registered memory is owned by the engine until every transfer using it is done: a borrow of
// the caller's bytes cannot be registered.
use gpudirect::transfer::Buffer;

fn main() {
    let mut v = vec![0u8; 4096];
    let _ = Buffer::host(v.as_mut_slice());
}
