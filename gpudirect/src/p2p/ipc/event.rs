//! `cuIpcGetEventHandle`/`cuIpcOpenEventHandle`: events that order work across processes.

use super::handle::{to_bytes, to_chars};
use crate::completion::Fence;
use crate::cuda::{self, Stream};
use crate::driver::{self, ctx::bind, event, ipc};
use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, sys};
use std::sync::Arc;

/// `CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS`, the flags an IPC event requires.
const IPC_EVENT_FLAGS: u32 = 0x2 | 0x4;

/// An event another process can open: `CUipcEventHandle`'s 64 bytes. Plain data.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct IpcEventHandle {
    #[cfg_attr(feature = "serde", serde(with = "super::handle::hex64"))]
    handle: [u8; 64],
}

/// A CUDA event shared between processes (created here, or opened from a handle).
///
/// One process records it on a stream; others make their streams wait for it or poll it.
#[derive(Debug)]
pub struct IpcEvent {
    event: sys::CUevent,
    ctx: Arc<CudaContext>,
    handle: IpcEventHandle,
    pid: u32,
}

// SAFETY: a CUevent is a driver handle usable from any thread; the context is bound per call.
unsafe impl Send for IpcEvent {}
// SAFETY: as above; every method takes `&self` and the driver synchronizes event calls.
unsafe impl Sync for IpcEvent {}

impl IpcEvent {
    /// `cuEventCreate(CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS)` on device `ordinal`,
    /// then `cuIpcGetEventHandle`.
    ///
    /// # Errors
    ///
    /// [`Error::Cuda`] from either call, [`Error::NoDevice`]/[`Error::Load`] without the device.
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html>
    #[doc(alias = "cuIpcGetEventHandle")]
    #[doc(alias = "cuEventCreate")]
    pub fn new(ordinal: usize) -> Result<IpcEvent> {
        let ctx = cuda::context(ordinal)?;
        bind(&ctx)?;
        // SAFETY: context current; the flags are a valid combination.
        let event = unsafe { event::create(IPC_EVENT_FLAGS) }?;
        // SAFETY: a live interprocess event.
        let h = match unsafe { ipc::get_event_handle(event) } {
            Ok(h) => h,
            Err(e) => {
                // SAFETY: created above, never recorded, destroyed once.
                let _ = unsafe { event::destroy(event) };
                return Err(e);
            }
        };
        Ok(IpcEvent {
            event,
            ctx,
            handle: IpcEventHandle {
                handle: to_bytes(&h.reserved),
            },
            pid: std::process::id(),
        })
    }

    /// `cuIpcOpenEventHandle` on device `ordinal`: the event another process created.
    ///
    /// # Errors
    ///
    /// [`Error::Cuda`] from the driver (`CUDA_ERROR_INVALID_CONTEXT` or `CUDA_ERROR_INVALID_VALUE`
    /// when opened in the exporting process).
    #[doc(alias = "cuIpcOpenEventHandle")]
    pub fn open(handle: &IpcEventHandle, ordinal: usize) -> Result<IpcEvent> {
        let ctx = cuda::context(ordinal)?;
        bind(&ctx)?;
        let h = sys::CUipcEventHandle {
            reserved: to_chars(&handle.handle),
        };
        // SAFETY: context current; the handle is plain bytes the driver checks.
        let event = unsafe { ipc::open_event_handle(h) }?;
        Ok(IpcEvent {
            event,
            ctx,
            handle: handle.clone(),
            pid: std::process::id(),
        })
    }

    /// The handle to send to other processes.
    pub fn handle(&self) -> &IpcEventHandle {
        &self.handle
    }

    /// `cuEventRecord`: the event completes when the work queued on `stream` so far has.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `stream` is on another device;
    /// [`Error::StreamCapturing`] while `stream` captures a CUDA graph; [`Error::Cuda`].
    #[doc(alias = "cuEventRecord")]
    pub fn record(&self, stream: &Stream) -> Result<()> {
        self.same_device(stream)?;
        stream.enqueue("cuEventRecord", (), |raw, ()| {
            // SAFETY: a live event and stream of the current context (the stream's, which is
            // the event's: same device).
            unsafe { event::record(self.event, raw) }
        })?;
        Ok(())
    }

    /// `cuStreamWaitEvent`: work queued on `stream` after this call waits for the event.
    ///
    /// # Errors
    ///
    /// [`Error::StreamCapturing`] while `stream` captures a CUDA graph; [`Error::Cuda`] from the
    /// driver.
    #[doc(alias = "cuStreamWaitEvent")]
    pub fn wait_on(&self, stream: &Stream) -> Result<()> {
        stream.enqueue("cuStreamWaitEvent", (), |raw, ()| {
            // SAFETY: a live event and stream.
            unsafe { driver::stream::wait_event(raw, self.event) }
        })?;
        Ok(())
    }

    /// `cuEventSynchronize`: block until the event completes.
    ///
    /// # Errors
    ///
    /// [`Error::Cuda`] from the driver.
    #[doc(alias = "cuEventSynchronize")]
    pub fn synchronize(&self) -> Result<()> {
        bind(&self.ctx)?;
        // SAFETY: a live event.
        unsafe { event::synchronize(self.event) }
    }

    fn same_device(&self, stream: &Stream) -> Result<()> {
        let (mine, theirs) = (self.ctx.ordinal(), stream.context().ordinal());
        if mine != theirs {
            return Err(Error::invalid(
                "stream",
                format!("a stream of device {theirs}"),
                format!("the event belongs to device {mine}"),
            ));
        }
        Ok(())
    }
}

impl Fence for IpcEvent {
    fn is_complete(&self) -> bool {
        // SAFETY: a live event; cuEventQuery needs no current context.
        matches!(unsafe { event::query(self.event) }, Ok(true))
    }
}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        if crate::completion::forked(self.pid) || bind(&self.ctx).is_err() {
            return;
        }
        // SAFETY: created or opened by this value, destroyed once (the driver defers the
        // destruction until recorded work completes).
        let _ = unsafe { event::destroy(self.event) };
    }
}
