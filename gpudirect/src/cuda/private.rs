//! Small blocking work on a stream of the crate's own.

use crate::driver::stream;
use crate::error::Result;
use cudarc::driver::CudaContext;

/// Run `f` on a new private stream of `ctx` created with `CU_STREAM_NON_BLOCKING`, then
/// `cuStreamSynchronize` that stream only, and destroy it.
///
/// For small blocking writes and reads that another stream may be waiting for: unlike
/// `cuCtxSynchronize` (which waits for every stream of the context) or a synchronous copy on the
/// legacy default stream (which waits for every blocking stream), this never waits behind a stream
/// blocked in `cuStreamWaitValue` until this very write lands.
pub(crate) fn on_private_stream(
    ctx: &CudaContext,
    f: impl FnOnce(cudarc::driver::sys::CUstream) -> Result<()>,
) -> Result<()> {
    crate::driver::ctx::bind(ctx)?;
    // SAFETY: context current.
    let s = unsafe { stream::create(cudarc::driver::sys::CUstream_flags::CU_STREAM_NON_BLOCKING) }?;
    // A stream made here and never shown to anyone cannot be capturing; it is checked like
    // every other stream all the same.
    let queued =
        crate::completion::capture::enqueue_raw(s, "work on a private stream", (), |s, ()| f(s))
            .map(drop)
            .map_err(crate::Error::from);
    // Synchronize even when `f` failed midway: whatever it queued finishes before we return.
    // SAFETY: the stream created above.
    let synced = unsafe { stream::synchronize(s) };
    // SAFETY: created above, destroyed once (the driver defers it past any pending work).
    let _ = unsafe { stream::destroy(s) };
    queued.and(synced)
}
