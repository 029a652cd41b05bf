//! [`EventFence`]: one CUDA event.

use super::backoff::{LONG_WAIT, poll_until};
use super::fence::Fence;
use crate::error::Result;
use cudarc::driver::{CudaEvent, CudaStream};
use std::time::Duration;

/// A fence on one CUDA event, recorded when the fence is made (`cuEventRecord`) and polled with
/// `cuEventQuery`. For many small operations on one stream prefer [`StreamFence`](super::StreamFence).
///
/// Awaited, it is polled by the shared completion thread (one `cuEventQuery` per round while
/// the future waits), which wakes the future.
#[derive(Debug)]
pub struct EventFence(CudaEvent);

impl EventFence {
    /// `cuEventRecord` a new event (timing disabled) on `stream`: complete once the work queued
    /// on `stream` so far has finished.
    #[doc(alias = "cuEventRecord")]
    ///
    /// # Errors
    ///
    /// [`crate::Error::StreamCapturing`] while `stream` captures a CUDA graph (an event recorded in a
    /// capture completes with the capture, not with the work); [`crate::Error::Cuda`].
    pub fn record(stream: &CudaStream) -> Result<Self> {
        let (ev, ()) = super::capture::enqueue(stream, "cuEventRecord", (), |_, ()| {
            stream
                .record_event(None)
                .map_err(|e| crate::error::from_driver("cuEventRecord", e))
        })?;
        Ok(EventFence(ev))
    }

    /// Wrap an event already recorded after the work to track.
    pub fn from_event(event: CudaEvent) -> Self {
        EventFence(event)
    }

    /// The event.
    pub fn event(&self) -> &CudaEvent {
        &self.0
    }
}

impl Fence for EventFence {
    fn is_complete(&self) -> bool {
        // A query error (a sticky context error) is "not complete": the resources are kept.
        matches!(self.0.try_is_complete(), Ok(true))
    }

    /// Complete, not yet, or [`crate::Error::Cuda`] naming `cuEventQuery` when the query fails
    /// (a sticky error: the work will never be seen complete).
    fn check(&self) -> Result<bool> {
        // The event's context current first (the completion thread may never have had it), so
        // that a query error is the work's own; a context that cannot be made current now is
        // "not yet".
        if crate::driver::ctx::bind(self.0.context()).is_err() {
            return Ok(false);
        }
        self.0
            .try_is_complete()
            .map_err(|e| crate::error::from_driver("cuEventQuery", e))
    }

    fn wait_timeout(&self, timeout: Duration) -> bool {
        if timeout >= LONG_WAIT {
            return self.0.synchronize().is_ok() && self.is_complete();
        }
        poll_until(|| self.is_complete(), timeout)
    }
}
