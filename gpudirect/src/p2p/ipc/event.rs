//! `cuIpcGetEventHandle`/`cuIpcOpenEventHandle`: events that order work across processes.

use super::{hex64, to_bytes, to_chars};
use crate::completion::Fence;
use crate::cuda::{self, Stream};
use crate::error::{Error, Result, cu, from_driver};
use cudarc::driver::{CudaContext, sys};
use std::sync::Arc;

/// `CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS`, the flags an IPC event requires.
const IPC_EVENT_FLAGS: u32 = 0x2 | 0x4;

/// An event another process can open: `CUipcEventHandle`'s 64 bytes. Plain data.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IpcEventHandle {
    #[serde(with = "hex64")]
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
        let mut event = std::ptr::null_mut();
        // SAFETY: context current; valid out-pointer; flags are a valid combination.
        cu("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut event, IPC_EVENT_FLAGS)
        })?;
        // SAFETY: all-zero is a valid CUipcEventHandle (plain bytes).
        let mut h: sys::CUipcEventHandle = unsafe { std::mem::zeroed() };
        // SAFETY: a live interprocess event; valid out-pointer.
        let r = cu("cuIpcGetEventHandle", unsafe {
            sys::cuIpcGetEventHandle(&mut h, event)
        });
        if let Err(e) = r {
            // SAFETY: created above, never recorded.
            unsafe { sys::cuEventDestroy_v2(event) };
            return Err(e);
        }
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
        let mut event = std::ptr::null_mut();
        let h = sys::CUipcEventHandle {
            reserved: to_chars(&handle.handle),
        };
        // SAFETY: context current; valid out-pointer; the handle is plain bytes the driver checks.
        cu("cuIpcOpenEventHandle", unsafe {
            sys::cuIpcOpenEventHandle(&mut event, h)
        })?;
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
            cu("cuEventRecord", unsafe {
                sys::cuEventRecord(self.event, raw)
            })
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
            // SAFETY: a live event and stream; flags 0.
            cu("cuStreamWaitEvent", unsafe {
                sys::cuStreamWaitEvent(raw, self.event, 0)
            })
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
        cu("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.event)
        })
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
        unsafe { sys::cuEventQuery(self.event) == sys::CUresult::CUDA_SUCCESS }
    }
}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        if crate::completion::forked(self.pid) || bind(&self.ctx).is_err() {
            return;
        }
        // SAFETY: created or opened by this value, destroyed once (the driver defers the
        // destruction until recorded work completes).
        let _ = unsafe { sys::cuEventDestroy_v2(self.event) };
    }
}

fn bind(ctx: &CudaContext) -> Result<()> {
    ctx.bind_to_thread()
        .map_err(|e| from_driver("cuCtxSetCurrent", e))
}
