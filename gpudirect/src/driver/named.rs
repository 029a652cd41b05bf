//! Errors of cudarc's `result` layer, named after the C function that answered them.

use crate::error::{Result, from_driver};
use cudarc::driver::DriverError;

/// A value from cudarc's `result` layer, its error named after the C function `call`.
#[inline]
pub(crate) fn named<T>(call: &'static str, r: std::result::Result<T, DriverError>) -> Result<T> {
    r.map_err(|e| from_driver(call, e))
}
