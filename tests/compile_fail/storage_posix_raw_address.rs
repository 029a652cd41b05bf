//! The POSIX path's raw-address entry points and the bounce engine's raw copies are not public:
//! the only ways in are `storage::GdsFile`, which checks the device range first, and
//! `CopyEngine::h2d`/`d2h`, which own the device buffer until the copy completes.
use gpudirect::memory::{BouncePool, CopyEngine};

fn raw(engine: &CopyEngine, pool: &BouncePool) {
    let chunk = pool.take().unwrap();
    let _ = unsafe { engine.h2d_raw(0, chunk, 0, 4096, 0x1000) };
}

fn main() {
    let _ = gpudirect::storage::posix::read_to_device;
    let _ = raw;
}
