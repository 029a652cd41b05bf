//! The driver API's initialisation (`cuInit`).

use crate::error::{Result, cu};

/// `cuInit(0)`—Initialise the driver API for this process.
///
/// # Safety
///
/// Only the presence check of the [`driver`](super) module docs.
pub(crate) unsafe fn init() -> Result<()> {
    // SAFETY: flags 0; libcuda is present (the caller's).
    cu("cuInit", unsafe { cudarc::driver::sys::cuInit(0) })
}
