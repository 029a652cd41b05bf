//! `cuFileBufRegister`: an owned registration over a device buffer range.

use super::{Driver, check, check_range};
use crate::error::Result;
use crate::memory::{DeviceMemory, DeviceMemoryMut, MemoryKind};

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
        if len == 0 {
            return Err((
                crate::Error::invalid("len", 0, "a registration covers at least one byte"),
                mem,
            ));
        }
        if let Err(e) = check_range("offset", offset, len, mem.byte_len()) {
            return Err((e, mem));
        }
        if let Err(e) = super::bind_device(mem.ordinal()) {
            return Err((e, mem));
        }
        let ptr = (mem.device_ptr() + offset as u64) as *const libc::c_void;
        // SAFETY: the range lies within `mem`, which we own (so it stays allocated) until the
        // registration is dropped.
        let r = check("cuFileBufRegister", unsafe {
            (driver.lib().cuFileBufRegister)(ptr, len, 0)
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
        (self.buffer().device_ptr() + self.offset as u64) as *const libc::c_void
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
        let r = check("cuFileBufDeregister", unsafe {
            (self.driver.lib().cuFileBufDeregister)(base)
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
        if crate::memory::Tracker::global().in_forked_child() {
            // No cuFile calls and no frees in a forked child: leak the registration and memory.
            if let Some(m) = self.mem.take() {
                std::mem::forget(m);
            }
            return;
        }
        let base = self.base();
        // SAFETY: registered and not yet deregistered; any I/O using it held `&self` or owned it.
        let r = unsafe { (self.driver.lib().cuFileBufDeregister)(base) };
        if r.err != gpudirect_sys::cufile::CU_FILE_SUCCESS
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
        self.buffer().device_ptr() + self.offset as u64
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
}

// SAFETY: the registration owns `mem`, which no one else references while it is owned (it is
// itself DeviceMemoryMut).
unsafe impl<M: DeviceMemoryMut> DeviceMemoryMut for BufRegistration<M> {}
