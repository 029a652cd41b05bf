//! Copies between device memory and host memory the engine holds, on a stream of the device
//! (through the crate's graph-capture check), waited for.

use crate::cuda::Stream;
use crate::error::Result;

/// A synchronous copy between device memory at `dev` (on `ordinal`) and host memory at `host`:
/// queued on a new stream of the device, then waited for.
pub(crate) fn copy_sync(
    ordinal: usize,
    dev: u64,
    host: *mut u8,
    len: usize,
    to_host: bool,
) -> Result<()> {
    let ctx = crate::cuda::context(ordinal)?;
    let stream = Stream::new(&ctx)?;
    // SAFETY: the caller's ranges: `host..host + len` is host memory it owns or reaches only by
    // copies, `dev..dev + len` device memory it keeps alive; the copy is waited for below.
    unsafe { copy_on(&stream, dev, host, len, to_host) }
}

/// Queue a copy on `stream` (through the graph-capture check) and wait for it, with the calling
/// thread relaxed ([`Stream::settle`]). Aborts the process when the copy, once queued, cannot be
/// proven complete: the ranges are borrowed, nothing can park them.
///
/// # Safety
///
/// Both ranges are valid for `len` bytes until this returns, and nothing else writes the
/// destination or (for host memory) reaches the source by reference meanwhile.
pub(crate) unsafe fn copy_on(
    stream: &Stream,
    dev: u64,
    host: *mut u8,
    len: usize,
    to_host: bool,
) -> Result<()> {
    let call = if to_host {
        "cuMemcpyDtoHAsync_v2"
    } else {
        "cuMemcpyHtoDAsync_v2"
    };
    let r = stream.enqueue(call, (), |raw, _| {
        // SAFETY: the ranges are the caller's contract; the stream is live and ours.
        unsafe {
            if to_host {
                crate::driver::mem::copy_dtoh_async(host.cast(), dev, len, raw)
            } else {
                crate::driver::mem::copy_htod_async(dev, host.cast_const().cast(), len, raw)
            }
        }
    });
    // The ranges are the caller's until this returns: never return while the copy may run.
    stream.settle_borrowed("a blocking copy", r.map(|_| ()))
}
