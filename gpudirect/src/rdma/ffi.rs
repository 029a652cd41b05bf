//! libibverbs as every verbs object reaches it: loaded with fork support checked, return codes
//! and NULL handles as typed errors, and the forked-child rule for destructors.

use crate::error::{Error, Result};
use gpudirect_sys::LoadError;
use gpudirect_sys::ibverbs as ibv;
use std::sync::OnceLock;

/// libibverbs, loaded, with fork support checked ([`fork_status`]).
pub(crate) fn verbs() -> Result<&'static ibv::Lib> {
    let l = ibv::lib()?;
    fork_status()?;
    Ok(l)
}

/// Process that first loaded verbs: a forked child makes no FFI frees (its verbs objects belong
/// to the parent).
fn creator_pid() -> u32 {
    static PID: OnceLock<u32> = OnceLock::new();
    *PID.get_or_init(std::process::id)
}

/// Whether this is a child forked after verbs were first used: destructors then leak instead of
/// calling into libibverbs.
fn in_forked_child() -> bool {
    std::process::id() != creator_pid()
}

/// For destructors: run `free` with the library `lib` loads, unless this is a child forked after
/// verbs were first used (its verbs objects belong to the parent: they are leaked) or the library
/// cannot be loaded.
pub(crate) fn free_in_parent<L: 'static>(
    lib: fn() -> std::result::Result<&'static L, LoadError>,
    free: impl FnOnce(&'static L),
) {
    if in_forked_child() {
        return;
    }
    if let Ok(l) = lib() {
        free(l);
    }
}

/// Fork support, as `ibv_is_fork_initialized` reports it after this library made sure of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForkStatus {
    /// `ibv_fork_init` has run (by us or by the application, or `RDMAV_FORK_SAFE` was set).
    Enabled,
    /// The kernel keeps registered pages across `fork` by itself (Linux 5.13+); nothing to do.
    Unneeded,
    /// The library is too old to say (no `ibv_is_fork_initialized`); `ibv_fork_init` was called.
    Assumed,
}

/// `ibv_is_fork_initialized`, then `ibv_fork_init` when it answers "disabled". Runs once, before
/// the first registration; every verbs entry point calls it.
///
/// # Errors
///
/// [`Error::Os`] naming `ibv_fork_init` when it fails (typically `EINVAL`: memory was already
/// registered by other code in this process before fork support could be enabled).
#[doc(alias = "ibv_fork_init")]
#[doc(alias = "ibv_is_fork_initialized")]
pub fn fork_status() -> Result<ForkStatus> {
    static STATUS: OnceLock<std::result::Result<ForkStatus, i32>> = OnceLock::new();
    let l = ibv::lib()?;
    creator_pid();
    let r = STATUS.get_or_init(|| {
        if let Some(is_init) = l.ibv_is_fork_initialized {
            // SAFETY: no arguments; reads library state.
            match unsafe { is_init() } {
                ibv::IBV_FORK_ENABLED => return Ok(ForkStatus::Enabled),
                ibv::IBV_FORK_UNNEEDED => return Ok(ForkStatus::Unneeded),
                _ => {}
            }
        }
        // SAFETY: no arguments; called before any registration made by this library.
        match unsafe { (l.ibv_fork_init)() } {
            0 if l.ibv_is_fork_initialized.is_some() => Ok(ForkStatus::Enabled),
            0 => Ok(ForkStatus::Assumed),
            e => Err(e),
        }
    });
    r.map_err(|e| Error::errno("ibv_fork_init", e))
}

/// An `Err` from a verbs return code: positive values are errnos (the modern convention), negative
/// ones mean "see errno".
pub(crate) fn rc(call: &'static str, rc: i32) -> Result<()> {
    match rc {
        0 => Ok(()),
        e if e > 0 => Err(Error::errno(call, e)),
        _ => {
            let os = std::io::Error::last_os_error();
            match os.raw_os_error() {
                Some(0) | None => Err(Error::errno(call, rc.saturating_neg())),
                _ => Err(Error::Os { call, source: os }),
            }
        }
    }
}

/// A non-NULL pointer, or the errno the call left: no handle ever wraps NULL.
pub(crate) fn nonnull<T>(call: &'static str, p: *mut T) -> Result<std::ptr::NonNull<T>> {
    match std::ptr::NonNull::new(p) {
        Some(p) => Ok(p),
        None => {
            let os = std::io::Error::last_os_error();
            // Some providers fail without setting errno; say so rather than "Success".
            let source = match os.raw_os_error() {
                Some(0) | None => std::io::Error::other("returned NULL without setting errno"),
                _ => os,
            };
            Err(Error::Os { call, source })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_is_an_error_with_errno_never_a_handle() {
        // SAFETY: sets the calling thread's errno, as a failing verb would.
        unsafe { *libc::__errno_location() = libc::ENOMEM };
        let e = nonnull::<u8>("ibv_reg_mr", std::ptr::null_mut()).unwrap_err();
        match &e {
            Error::Os { call, source } => {
                assert_eq!(*call, "ibv_reg_mr");
                assert_eq!(source.raw_os_error(), Some(libc::ENOMEM));
            }
            other => panic!("unexpected {other:?}"),
        }
        // SAFETY: as above.
        unsafe { *libc::__errno_location() = 0 };
        let e = nonnull::<u8>("ibv_alloc_pd", std::ptr::null_mut()).unwrap_err();
        assert!(e.to_string().contains("without setting errno"), "{e}");
    }

    #[test]
    fn return_codes_are_errnos() {
        assert!(rc("ibv_modify_qp", 0).is_ok());
        let e = rc("ibv_modify_qp", libc::EINVAL).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "ibv_modify_qp failed: {}",
                std::io::Error::from_raw_os_error(libc::EINVAL)
            )
        );
    }
}
