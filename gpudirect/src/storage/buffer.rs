//! `cuFileBufRegister`: an owned registration over a device buffer range.

use super::context::bind_device;
use super::driver::{Driver, serialized_call};
use super::range::check_range;
use crate::error::{Error, Result};
use crate::memory::{DeviceMemory, DeviceMemoryMut, MemoryKind};

/// Check a registration of `len` bytes at byte `offset` of a buffer of `byte_len` bytes at device
/// address `ptr`: not empty, inside the buffer, and not wrapping the address space. The range's
/// device address.
pub(crate) fn registration_start(
    ptr: u64,
    byte_len: usize,
    offset: usize,
    len: usize,
) -> Result<u64> {
    if len == 0 {
        return Err(Error::invalid(
            "len",
            0,
            "a registration covers at least one byte",
        ));
    }
    check_range("offset", offset, len, byte_len)?;
    match ptr.checked_add(offset as u64) {
        Some(start) if start.checked_add(len as u64).is_some() => Ok(start),
        _ => Err(Error::invalid(
            "offset",
            format!("{ptr:#x}+{offset}+{len}"),
            "the registered range must not wrap the address space",
        )),
    }
}

/// A device buffer range registered with cuFile (`cuFileBufRegister`), owning the buffer so that it
/// cannot be freed while registered. Deregistered on drop, or by [`into_inner`](Self::into_inner).
///
/// As [`DeviceMemory`] it is the registered bytes (`u8` elements, starting at the range's start),
/// so I/O into it uses the registered base address, as cuFile requires.
pub struct BufRegistration<M: DeviceMemory> {
    mem: Option<M>,
    driver: Driver,
    offset: usize,
    len: usize,
}

impl<M: DeviceMemory> std::fmt::Debug for BufRegistration<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufRegistration")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl<M: DeviceMemory> BufRegistration<M> {
    /// `cuFileBufRegister(ptr + offset, len, flags)`—Register `len` bytes of `mem` starting at
    /// byte `offset`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when the range is empty or leaves
    /// the buffer; [`Error::CuFile`](crate::Error::CuFile) from `cuFileBufRegister`
    /// (`CU_FILE_MEMORY_ALREADY_REGISTERED`, `CU_FILE_INVALID_MAPPING_SIZE` past the pinned
    /// limit). On error `mem` is dropped; register a clone or use
    /// [`register_or_return`](Self::register_or_return) to keep it.
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/gpudirect-storage/api-reference-guide/index.html#cufilebufregister>
    #[doc(alias = "cuFileBufRegister")]
    pub fn register(driver: &Driver, mem: M, offset: usize, len: usize) -> Result<Self> {
        Self::register_or_return(driver, mem, offset, len).map_err(|(e, _)| e)
    }

    /// As [`register`](Self::register), handing `mem` back on error.
    ///
    /// # Errors
    ///
    /// As [`register`](Self::register).
    #[doc(alias = "cuFileBufRegister")]
    pub fn register_or_return(
        driver: &Driver,
        mem: M,
        offset: usize,
        len: usize,
    ) -> std::result::Result<Self, (crate::Error, M)> {
        let start = match registration_start(mem.device_ptr(), mem.byte_len(), offset, len) {
            Ok(start) => start,
            Err(e) => return Err((e, mem)),
        };
        if let Err(e) = bind_device(mem.ordinal()) {
            return Err((e, mem));
        }
        let ptr = start as *const libc::c_void;
        // SAFETY: the range lies within `mem`, which we own (so it stays allocated) until the
        // registration is dropped.
        let r = serialized_call("cuFileBufRegister", || {
            // SAFETY: as for the call without the lock (above).
            unsafe { (driver.lib().cuFileBufRegister)(ptr, len, 0) }
        });
        match r {
            Ok(()) => Ok(BufRegistration {
                mem: Some(mem),
                driver: driver.clone(),
                offset,
                len,
            }),
            Err(e) => Err((e, mem)),
        }
    }

    /// The registered range's byte offset in the buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The underlying buffer.
    pub fn buffer(&self) -> &M {
        self.mem.as_ref().expect("present until into_inner")
    }

    fn base(&self) -> *const libc::c_void {
        // Checked at registration: the sum does not wrap.
        self.buffer().device_ptr().wrapping_add(self.offset as u64) as *const libc::c_void
    }

    /// `cuFileBufDeregister`—Deregister and give the buffer back.
    ///
    /// # Errors
    ///
    /// [`Error::CuFile`](crate::Error::CuFile) from `cuFileBufDeregister`; the buffer is then
    /// leaked (never freed while cuFile may still map it).
    #[doc(alias = "cuFileBufDeregister")]
    pub fn into_inner(mut self) -> Result<M> {
        let base = self.base();
        // SAFETY: registered in `register`, deregistered once.
        let lib = self.driver.lib();
        let r = serialized_call("cuFileBufDeregister", || {
            // SAFETY: as for the call without the lock (above).
            unsafe { (lib.cuFileBufDeregister)(base) }
        });
        let mem = self.mem.take().expect("present until into_inner");
        match r {
            Ok(()) => Ok(mem),
            Err(e) => {
                std::mem::forget(mem);
                Err(e)
            }
        }
    }
}

impl<M: DeviceMemory> Drop for BufRegistration<M> {
    fn drop(&mut self) {
        if self.mem.is_none() {
            return;
        }
        if crate::completion::Tracker::global().in_forked_child() {
            // No cuFile calls and no frees in a forked child: leak the registration and memory.
            if let Some(m) = self.mem.take() {
                std::mem::forget(m);
            }
            return;
        }
        let base = self.base();
        // SAFETY: registered and not yet deregistered; any I/O using it held `&self` or owned it.
        let lib = self.driver.lib();
        let r = serialized_call("cuFileBufDeregister", || {
            // SAFETY: as for the call without the lock (above).
            unsafe { (lib.cuFileBufDeregister)(base) }
        });
        if r.is_err()
            && let Some(m) = self.mem.take()
        {
            // cuFile may still map it: leak rather than free.
            std::mem::forget(m);
        }
    }
}

// SAFETY: the registered range lies within `mem` (checked at registration), which is owned and
// stays allocated while `self` lives.
unsafe impl<M: DeviceMemory> DeviceMemory for BufRegistration<M> {
    type Elem = u8;
    fn device_ptr(&self) -> u64 {
        // Checked at registration: the sum does not wrap.
        self.buffer().device_ptr().wrapping_add(self.offset as u64)
    }
    fn len(&self) -> usize {
        self.len
    }
    fn ordinal(&self) -> usize {
        self.buffer().ordinal()
    }
    fn kind(&self) -> MemoryKind {
        self.buffer().kind()
    }
    fn vmm_mappings(&self) -> Option<Vec<(u64, usize)>> {
        self.buffer().vmm_mappings()
    }
}

// SAFETY: the registration owns `mem`, which no one else references while it is owned (it is
// itself DeviceMemoryMut).
unsafe impl<M: DeviceMemoryMut> DeviceMemoryMut for BufRegistration<M> {}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn empty_outside_and_wrapping_registrations_are_refused() {
        assert_eq!(registration_start(0x1000, 64, 8, 56).unwrap(), 0x1008);
        let e = registration_start(0x1000, 64, 8, 0).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "len", .. }),
            "{e}"
        );
        let e = registration_start(0x1000, 64, 8, 57).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "offset", .. }),
            "{e}"
        );
        let e = registration_start(u64::MAX - 3, 64, 8, 4).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "offset", .. }),
            "{e}"
        );
    }

    proptest! {
        #[test]
        fn registration_ranges_are_exact(ptr: u64, byte_len: usize, offset: usize, len: usize) {
            let end = ptr as u128 + offset as u128 + len as u128;
            let ok = len > 0
                && offset as u128 + len as u128 <= byte_len as u128
                && end <= u64::MAX as u128;
            match registration_start(ptr, byte_len, offset, len) {
                Ok(start) => prop_assert!(ok && start as u128 == ptr as u128 + offset as u128),
                Err(e) => {
                    let is_invalid = matches!(e, Error::InvalidArgument { .. });
                    prop_assert!(!ok && is_invalid)
                }
            }
        }
    }
}
