//! The one allocation core: an address range of some memory kind, the context and process that
//! own it, and how it is given back. Every memory kind of the crate is a thin type over an
//! [`Allocation`]; the [`DeviceMemory`](super::DeviceMemory) implementation and the fork-guarded drop are written
//! here, once.
//!
//! The safety argument every kind shares: the range `ptr..ptr + len * size_of::<T>()` is memory
//! of the kind's [`MemoryKind`], addressable by the context's device, allocated before the
//! `Allocation` exists and given back only by its drop (or by [`Allocation::close`]), which takes
//! the value: so it stays valid, at the same address, for as long as the value lives, and moving
//! the value does not move it. Work a data path queues on the memory owns the value (in an
//! `InFlight` or the tracker) until it has completed, so the drop never runs under it; a value
//! that is forgotten leaks. In a forked child, or when the context cannot be made current, the
//! drop gives nothing back (the child's CUDA state is unusable): the memory leaks. What each kind
//! adds (how the range is mapped, where its host view is) is said on its [`Release`] type.

use super::pod::Pod;
use crate::completion::forked;
use crate::driver::ctx::bind;
use crate::error::{Error, MemoryKind, Result};
use cudarc::driver::CudaContext;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// What an [`Allocation`] does not know about its memory kind: the kind, the host view, and how
/// the memory is given back (`cuMemFree`, `cuMemFreeHost`, unmapping, an IPC close, ...), with
/// whatever the kind holds for that (VMM handles, a registered box, a cudarc slice).
///
/// # Safety
///
/// Implementors guarantee that the memory an [`Allocation`] of theirs describes is of kind
/// [`KIND`](Release::KIND) and stays valid until [`release`](Release::release) runs; and that
/// [`host_ptr`](Release::host_ptr), when `Some`, points at the same bytes in the host's address
/// space.
pub(crate) unsafe trait Release: Send + Sync + 'static {
    /// The kind of memory.
    const KIND: MemoryKind;
    /// The C function that gives the memory back, for errors.
    const CALL: &'static str;
    /// What [`Allocation::close`] hands back once the memory is given back (the registered box
    /// of host memory pinned in place; `()` for most kinds).
    type Back;

    /// The host address of the first byte, for host kinds.
    fn host_ptr(&self) -> Option<*mut u8> {
        None
    }

    /// The VMM mappings `(base, bytes)` that cover the memory at `ptr`, for kinds that know them
    /// ([`DeviceMemory::vmm_mappings`](super::DeviceMemory::vmm_mappings)).
    fn vmm_mappings(&self, ptr: u64) -> Option<Vec<(u64, usize)>> {
        let _ = ptr;
        None
    }

    /// Give the memory at `ptr` back.
    ///
    /// # Errors
    ///
    /// The driver's, when the memory could not be given back; then whatever might still be
    /// in use is leaked, never freed.
    ///
    /// # Safety
    ///
    /// Called at most once, by the [`Allocation`] that holds `self` (`ptr` is its address), in
    /// the process that made it, with its context current, and when no work that uses the memory
    /// is pending.
    unsafe fn release(self, ptr: u64) -> Result<Self::Back>;
}

/// `len` elements of `T` at device address `ptr`, of the memory kind `R`, made in `ctx` by the
/// process `pid`. See the module docs for what it guarantees.
pub(crate) struct Allocation<T: Pod, R: Release> {
    ptr: u64,
    len: usize,
    ctx: Arc<CudaContext>,
    pid: u32,
    how: ManuallyDrop<R>,
    _elem: PhantomData<T>,
}

impl<T: Pod, R: Release> Allocation<T, R> {
    /// Own the memory described: `len` elements at `ptr`, in `ctx`, given back by `how`.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len * size_of::<T>()` is memory of kind `R::KIND` that `how` may give back,
    /// valid until then (and nobody else gives it back); `ctx` is the context it belongs to.
    pub(crate) unsafe fn new(ptr: u64, len: usize, ctx: &Arc<CudaContext>, how: R) -> Self {
        Allocation {
            ptr,
            len,
            ctx: ctx.clone(),
            pid: std::process::id(),
            how: ManuallyDrop::new(how),
            _elem: PhantomData,
        }
    }

    /// The device address of the first element.
    pub(crate) fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The length in elements.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The context the memory belongs to.
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// How it was allocated.
    pub(crate) fn kind(&self) -> MemoryKind {
        R::KIND
    }

    /// The host address of the first element, for host kinds.
    pub(crate) fn host_ptr(&self) -> Option<*mut u8> {
        self.how.host_ptr()
    }

    /// The VMM mappings that cover the memory, when its kind knows them.
    pub(crate) fn vmm_mappings(&self) -> Option<Vec<(u64, usize)>> {
        self.how.vmm_mappings(self.ptr)
    }

    /// The kind's part.
    pub(crate) fn how(&self) -> &R {
        &self.how
    }

    /// The kind's part, mutably (while the memory is being built, or through `&mut` of its
    /// owner).
    pub(crate) fn how_mut(&mut self) -> &mut R {
        &mut self.how
    }

    /// Set the length, once the whole range is ready.
    ///
    /// # Safety
    ///
    /// As for [`new`](Self::new), for the new length.
    pub(crate) unsafe fn set_len(&mut self, len: usize) {
        self.len = len;
    }

    /// Give the memory back now and hand back what the kind returns ([`Release::Back`]).
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] in a forked child, where nothing is given back (the memory
    /// leaks); the error of making the context current, or of the release, after which what
    /// might still be in use leaks as well.
    pub(crate) fn close(self) -> Result<R::Back> {
        let mut me = ManuallyDrop::new(self);
        // SAFETY: `me` is never dropped, so the kind's part is taken exactly once, here.
        let how = unsafe { ManuallyDrop::take(&mut me.how) };
        // SAFETY: as above, for the context.
        let ctx = unsafe { std::ptr::read(&me.ctx) };
        if forked(me.pid) {
            std::mem::forget(how);
            return Err(Error::Unsupported {
                what: R::CALL.into(),
                reason: "in a forked child; the memory is leaked".into(),
            });
        }
        if let Err(e) = bind(&ctx) {
            std::mem::forget(how);
            return Err(e);
        }
        // SAFETY: once, in the process that made it, its context current; nothing in flight uses
        // it (in-flight work owns the allocation, so it cannot be closing).
        unsafe { how.release(me.ptr) }
    }

    /// Take the kind's part back without giving the memory back: the caller takes over (a
    /// cudarc slice handed back whole).
    pub(crate) fn into_how(self) -> R {
        let mut me = ManuallyDrop::new(self);
        // SAFETY: `me` is never dropped, so each field is taken exactly once, here.
        unsafe {
            drop(std::ptr::read(&me.ctx));
            ManuallyDrop::take(&mut me.how)
        }
    }
}

impl<T: Pod, R: Release> Drop for Allocation<T, R> {
    fn drop(&mut self) {
        if forked(self.pid) || bind(&self.ctx).is_err() {
            return; // leak: the kind's part is never dropped, nothing is given back
        }
        // SAFETY: taken once: the value is being dropped.
        let how = unsafe { ManuallyDrop::take(&mut self.how) };
        // SAFETY: once, in the process that made it, its context current; nothing in flight uses
        // it (in-flight work owns the allocation, so it is not being dropped).
        let _ = unsafe { how.release(self.ptr) };
    }
}

impl<T: Pod, R: Release> std::fmt::Debug for Allocation<T, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Allocation")
            .field("kind", &R::KIND)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("ordinal", &self.ctx.ordinal())
            .finish()
    }
}

/// `len * size_of::<T>()`, or an [`crate::Error::InvalidArgument`] on overflow or zero.
pub(crate) fn byte_size<T>(len: usize) -> Result<usize> {
    let bytes = len
        .checked_mul(std::mem::size_of::<T>())
        .ok_or_else(|| crate::Error::invalid("len", len, "len * size_of::<T>() overflows usize"))?;
    if bytes == 0 {
        return Err(crate::Error::invalid(
            "len",
            len,
            "allocations must hold at least one byte (len > 0 and T not zero-sized)",
        ));
    }
    Ok(bytes)
}

/// [`DeviceMemory`](super::DeviceMemory), [`DeviceMemoryMut`](super::DeviceMemoryMut) and `context()` for a thin
/// memory type `$t<T: Pod>` whose only field is an [`Allocation`] (`$t, without_context`: the
/// traits only).
macro_rules! thin_memory {
    ($t:ident) => {
        $crate::memory::alloc::thin_memory!($t, without_context);

        impl<T: $crate::memory::pod::Pod> $t<T> {
            /// The context the memory belongs to (for host kinds: the one it was pinned in).
            pub fn context(&self) -> &std::sync::Arc<cudarc::driver::CudaContext> {
                self.0.context()
            }
        }
    };
    // The memory traits only, for a crate-private type.
    ($t:ident, without_context) => {
        // SAFETY: the allocation's guarantees (module `alloc`), which the value owns.
        unsafe impl<T: $crate::memory::pod::Pod> $crate::memory::kind::DeviceMemory for $t<T> {
            type Elem = T;
            fn device_ptr(&self) -> u64 {
                self.0.device_ptr()
            }
            fn len(&self) -> usize {
                self.0.len()
            }
            fn ordinal(&self) -> usize {
                self.0.context().ordinal()
            }
            fn kind(&self) -> $crate::error::MemoryKind {
                self.0.kind()
            }
            fn host_ptr(&self) -> Option<*mut u8> {
                self.0.host_ptr()
            }
            fn vmm_mappings(&self) -> Option<Vec<(u64, usize)>> {
                self.0.vmm_mappings()
            }
        }

        // SAFETY: the allocation hands out no Rust reference to its bytes; a kind that does
        // (a host view) does so only through `&self`/`&mut self` of its owner, which a data path
        // holding the value by value excludes.
        unsafe impl<T: $crate::memory::pod::Pod> $crate::memory::kind::DeviceMemoryMut for $t<T> {}
    };
}
pub(crate) use thin_memory;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_size_checks_before_ffi() {
        assert_eq!(byte_size::<u32>(4).unwrap(), 16);
        assert!(matches!(
            byte_size::<u32>(0),
            Err(crate::Error::InvalidArgument { arg: "len", .. })
        ));
        assert!(byte_size::<u64>(usize::MAX / 4).is_err());
    }
}
