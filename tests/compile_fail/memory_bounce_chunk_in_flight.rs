//! A bounce chunk in a copy belongs to the copy: it cannot be read or written until `wait` hands
//! it back.
use gpudirect::memory::{BouncePool, CopyEngine, DeviceBuffer};

fn main() -> gpudirect::Result<()> {
    let ctx = gpudirect::cuda::context(0)?;
    let pool = BouncePool::new(&ctx, 4096, 1)?;
    let engine = CopyEngine::new(&ctx, 1)?;
    let mut chunk = pool.take()?;
    let dst = DeviceBuffer::<u8>::alloc(&ctx, 4096)?;
    let copy = engine.h2d(0, chunk, 0, dst, 0, 4096)?;
    chunk[0] = 1; // the copy may be reading it
    let _ = copy.wait()?;
    Ok(())
}
