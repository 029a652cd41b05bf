//! The CUDA context cuFile works in.

use crate::error::Result;
use cudarc::driver::CudaContext;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Make device `ordinal`'s primary context current on this thread (cuFile uses the current
/// context), keeping one retained context per device for the process.
pub(crate) fn bind_device(ordinal: usize) -> Result<Arc<CudaContext>> {
    static CTX: OnceLock<Mutex<HashMap<usize, Arc<CudaContext>>>> = OnceLock::new();
    let ctx = {
        let mut map = CTX
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match map.get(&ordinal) {
            Some(c) => c.clone(),
            None => {
                let c = crate::cuda::context(ordinal)?;
                map.insert(ordinal, c.clone());
                c
            }
        }
    };
    crate::driver::ctx::bind(&ctx)?;
    Ok(ctx)
}
