//! Peer access between devices and copies between their contexts.

use super::named::named;
use crate::error::{Result, cu};
use cudarc::driver::{result, sys};

/// `cuDeviceCanAccessPeer(dev, peer)`—Whether `dev` can map `peer`'s memory.
///
/// # Safety
///
/// Both devices came from [`super::device::get`].
pub(crate) unsafe fn can_access(dev: sys::CUdevice, peer: sys::CUdevice) -> Result<bool> {
    let mut can = 0;
    // SAFETY: one valid out-pointer; the devices are the caller's.
    cu("cuDeviceCanAccessPeer", unsafe {
        sys::cuDeviceCanAccessPeer(&mut can, dev, peer)
    })?;
    Ok(can != 0)
}

/// `cuDeviceGetP2PAttribute(attr, src, dst)`—One attribute of the link from `src` to `dst`.
///
/// # Safety
///
/// Both devices came from [`super::device::get`].
pub(crate) unsafe fn attribute(
    attr: sys::CUdevice_P2PAttribute,
    src: sys::CUdevice,
    dst: sys::CUdevice,
) -> Result<i32> {
    let mut v = 0;
    // SAFETY: one valid out-pointer; the devices are the caller's.
    cu("cuDeviceGetP2PAttribute", unsafe {
        sys::cuDeviceGetP2PAttribute(&mut v, attr, src, dst)
    })?;
    Ok(v)
}

/// `cuCtxEnablePeerAccess(peer, 0)`—Let the current context map `peer`'s memory (process-wide,
/// until disabled). `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED` is an error like any other here.
///
/// # Safety
///
/// A context is current; `peer` is a live context.
pub(crate) unsafe fn enable_access(peer: sys::CUcontext) -> Result<()> {
    // SAFETY: flags must be 0; the rest is the caller's.
    cu("cuCtxEnablePeerAccess", unsafe {
        sys::cuCtxEnablePeerAccess(peer, 0)
    })
}

/// `cuMemcpyPeerAsync`—Queue a copy of `bytes` bytes from `src` in `src_ctx` to `dst` in
/// `dst_ctx` on `stream`.
///
/// # Safety
///
/// Both ranges stay valid, and `dst` unread and unwritten by anyone else, until the copy
/// completes; the contexts and the stream are live.
#[inline]
pub(crate) unsafe fn copy_async(
    dst: sys::CUdeviceptr,
    dst_ctx: sys::CUcontext,
    src: sys::CUdeviceptr,
    src_ctx: sys::CUcontext,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: forwarded from the caller.
    named("cuMemcpyPeerAsync", unsafe {
        result::memcpy_peer_async(dst_ctx, dst, src_ctx, src, bytes, stream)
    })
}
