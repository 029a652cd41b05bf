//! Peer access: the can-access query, an idempotent and thread-safe enable, and pool access grants.
//!
//! Peer access is process-global state of the primary contexts: once enabled it stays enabled for
//! the life of the process. Nothing in gpudirect disables it, least of all a destructor.

use crate::cuda;
use crate::error::{Error, Result, cu};
use cudarc::driver::CudaContext;
use cudarc::driver::sys::{self, CUresult};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The `CUresult` code of `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED` (217).
pub const PEER_ACCESS_UNSUPPORTED: u32 = CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED as u32;
/// The `CUresult` code of `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED` (704).
pub const PEER_ACCESS_ALREADY_ENABLED: u32 =
    CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED as u32;
/// The `CUresult` code of `CUDA_ERROR_TOO_MANY_PEERS` (711).
pub const TOO_MANY_PEERS: u32 = CUresult::CUDA_ERROR_TOO_MANY_PEERS as u32;

/// What [`enable_peer_access`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Enabled {
    /// This call enabled it.
    Now,
    /// It was already enabled (by an earlier call, another thread, or other code in the process);
    /// the driver's `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED` was consumed.
    Already,
}

/// Why a pair of devices cannot use peer access, from an [`Error`] returned by this module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum Refusal {
    /// `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`: the pair cannot (a device and itself, no P2P path).
    Unsupported,
    /// `CUDA_ERROR_TOO_MANY_PEERS`: the device has used up its peer mappings.
    TooManyPeers,
}

impl Refusal {
    /// The refusal an error stands for, if it is one.
    pub fn of(e: &Error) -> Option<Refusal> {
        match e {
            Error::Cuda { code, .. } if *code == PEER_ACCESS_UNSUPPORTED => {
                Some(Refusal::Unsupported)
            }
            Error::Cuda { code, .. } if *code == TOO_MANY_PEERS => Some(Refusal::TooManyPeers),
            _ => None,
        }
    }
}

/// `cuDeviceCanAccessPeer(dev, peer)`—whether device `device` can map memory of device `peer`.
///
/// A device and itself answer `false` (the driver's answer: same-device access needs no peer
/// mapping).
///
/// # Errors
///
/// [`Error::Load`] without libcuda, [`Error::NoDevice`] for an ordinal past the device count,
/// [`Error::Cuda`] when the driver call fails.
///
/// # C function
///
/// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PEER__ACCESS.html>
#[doc(alias = "cuDeviceCanAccessPeer")]
pub fn can_access_peer(device: usize, peer: usize) -> Result<bool> {
    let (d, p) = (cu_device(device)?, cu_device(peer)?);
    let mut can = 0;
    // SAFETY: driver initialised by cu_device; one valid out-pointer and two valid device handles.
    cu("cuDeviceCanAccessPeer", unsafe {
        sys::cuDeviceCanAccessPeer(&mut can, d, p)
    })?;
    Ok(can != 0)
}

/// `cuDeviceGet(ordinal)` after the presence checks, with a typed error for a missing device.
pub(crate) fn cu_device(ordinal: usize) -> Result<sys::CUdevice> {
    let n = cuda::device_count()?;
    if ordinal >= n {
        return Err(Error::NoDevice {
            what: "CUDA device",
            reason: format!("device {ordinal} requested, {n} visible"),
        });
    }
    let mut d = 0;
    // SAFETY: driver initialised (device_count); one valid out-pointer; ordinal in range.
    cu("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut d, ordinal as i32)
    })?;
    Ok(d)
}

/// The typed error for a pair that cannot use peer access, as the driver would answer it.
pub(crate) fn unsupported(call: &'static str) -> Error {
    Error::Cuda {
        call,
        code: PEER_ACCESS_UNSUPPORTED,
        name: "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED".to_string(),
    }
}

/// Map the `CUresult` of `cuCtxEnablePeerAccess`: already-enabled is success, consumed.
pub(crate) fn enable_result(r: CUresult) -> Result<Enabled> {
    match r {
        CUresult::CUDA_SUCCESS => Ok(Enabled::Now),
        CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(Enabled::Already),
        other => cu("cuCtxEnablePeerAccess", other).map(|()| Enabled::Now),
    }
}

/// Pairs enabled in this process, with both primary contexts retained for the life of the
/// process: a primary context whose last user lets go is destroyed, and its peer mappings with it.
type Pairs = HashMap<(usize, usize), (Arc<CudaContext>, Arc<CudaContext>)>;

fn enabled_pairs() -> &'static Mutex<Pairs> {
    static PAIRS: OnceLock<Mutex<Pairs>> = OnceLock::new();
    PAIRS.get_or_init(|| Mutex::new(HashMap::new()))
}

/// `cuCtxEnablePeerAccess`—let device `device` (its primary context) access memory of device
/// `peer` directly. Idempotent and thread-safe.
///
/// A second call, or two threads at once, both answer `Ok`: the driver's
/// `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED` is consumed (the driver API keeps no sticky error for
/// it), and calls are serialised on a process-wide lock. Access is one-directional: enable
/// `(a, b)` and `(b, a)` for copies both ways. It is never disabled by gpudirect (peer access is
/// process-global; a destructor that disabled it would break every other user in the process),
/// and both primary contexts stay retained for the life of the process so that the mapping does
/// not vanish with the last user of a context.
///
/// # Errors
///
/// - [`Error::Cuda`] `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED` (217) when `device == peer` or
///   `cuDeviceCanAccessPeer` answers 0: answered without calling `cuCtxEnablePeerAccess`, since
///   that is the driver's documented answer for such a pair. [`Refusal::of`] classifies it.
/// - [`Error::Cuda`] `CUDA_ERROR_TOO_MANY_PEERS` (711) when the device has no peer mappings left.
/// - [`Error::NoDevice`], [`Error::Load`] as for [`can_access_peer`].
///
/// # C function
///
/// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PEER__ACCESS.html>
#[doc(alias = "cuCtxEnablePeerAccess")]
pub fn enable_peer_access(device: usize, peer: usize) -> Result<Enabled> {
    if device == peer {
        cu_device(device)?;
        return Err(unsupported("cuCtxEnablePeerAccess"));
    }
    if !can_access_peer(device, peer)? {
        return Err(unsupported("cuCtxEnablePeerAccess"));
    }
    let mut pairs = enabled_pairs().lock().unwrap_or_else(|e| e.into_inner());
    if pairs.contains_key(&(device, peer)) {
        return Ok(Enabled::Already);
    }
    let ctx = cuda::context(device)?;
    let peer_ctx = cuda::context(peer)?;
    ctx.bind_to_thread()
        .map_err(|e| crate::error::from_driver("cuCtxSetCurrent", e))?;
    // SAFETY: the current context is `device`'s primary context (bound above); `peer_ctx` is a
    // live primary context retained for the duration of the call; flags must be 0.
    let r = unsafe { sys::cuCtxEnablePeerAccess(peer_ctx.cu_ctx(), 0) };
    let out = enable_result(r)?;
    pairs.insert((device, peer), (ctx, peer_ctx));
    Ok(out)
}

/// Whether [`enable_peer_access`] has seen `(device, peer)` enabled in this process.
pub fn is_peer_access_enabled(device: usize, peer: usize) -> bool {
    enabled_pairs()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .contains_key(&(device, peer))
}

/// Enable peer access both ways between `a` and `b`; see [`enable_peer_access`].
///
/// # Errors
///
/// The first refusal, as [`enable_peer_access`].
#[doc(alias = "cuCtxEnablePeerAccess")]
pub fn enable_peer_access_both(a: usize, b: usize) -> Result<(Enabled, Enabled)> {
    Ok((enable_peer_access(a, b)?, enable_peer_access(b, a)?))
}

/// `cuMemPoolGetAccess`/`cuMemPoolSetAccess`—grant device `peer` read-write access to the
/// stream-ordered memory pool that owns `ptr` (pool memory, such as a cudarc `CudaSlice`).
///
/// Without this grant, a copy between pool memory and a peer device does not use the peer mapping:
/// the driver stages it (37 GB/s instead of 390 GB/s measured on NVLink H200s), even with peer
/// access enabled. Returns `true` when this call granted it, `false` when it was already granted
/// (or `peer` owns the pool).
///
/// # Errors
///
/// [`Error::InvalidArgument`] when `ptr` is not pool memory (`CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE`
/// is null); [`Error::Cuda`] from `cuPointerGetAttribute`, `cuMemPoolGetAccess` or
/// `cuMemPoolSetAccess` (`CUDA_ERROR_INVALID_DEVICE` or `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`
/// when the pool's device cannot reach `peer`).
///
/// # C function
///
/// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html>
#[doc(alias = "cuMemPoolSetAccess")]
#[doc(alias = "cuMemPoolGetAccess")]
pub fn grant_pool_access(ptr: u64, peer: usize) -> Result<bool> {
    cu_device(peer)?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: driver initialised; the out-pointer has the attribute's type (a CUmemoryPool).
    cu("cuPointerGetAttribute", unsafe {
        sys::cuPointerGetAttribute(
            (&mut pool as *mut sys::CUmemoryPool).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
            ptr,
        )
    })?;
    if pool.is_null() {
        return Err(Error::invalid(
            "ptr",
            format!("{ptr:#x}"),
            "not stream-ordered pool memory (no CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE)",
        ));
    }
    let mut location = device_location(peer);
    let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
    // SAFETY: `pool` is a live pool handle from the driver; valid in/out pointers.
    cu("cuMemPoolGetAccess", unsafe {
        sys::cuMemPoolGetAccess(&mut flags, pool, &mut location)
    })?;
    if flags == sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE {
        return Ok(false);
    }
    let desc = sys::CUmemAccessDesc {
        location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: one valid access descriptor for a live pool.
    cu("cuMemPoolSetAccess", unsafe {
        sys::cuMemPoolSetAccess(pool, &desc, 1)
    })?;
    Ok(true)
}

/// Whether device `peer` has read-write access to the pool that owns `ptr`; `None` when `ptr` is
/// not pool memory or the driver cannot say.
pub(crate) fn pool_access(ptr: u64, peer: usize) -> Option<bool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the out-pointer has the attribute's type (a CUmemoryPool).
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut pool as *mut sys::CUmemoryPool).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
            ptr,
        )
    };
    if r != CUresult::CUDA_SUCCESS || pool.is_null() {
        return None;
    }
    let mut location = device_location(peer);
    let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
    // SAFETY: live pool handle; valid pointers.
    let r = unsafe { sys::cuMemPoolGetAccess(&mut flags, pool, &mut location) };
    (r == CUresult::CUDA_SUCCESS)
        .then_some(flags == sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
}

/// Whether device `peer` has read-write access to the VMM mapping at `ptr` (`cuMemGetAccess`).
pub(crate) fn vmm_access(ptr: u64, peer: usize) -> Option<bool> {
    let location = device_location(peer);
    let mut flags: u64 = 0;
    // SAFETY: valid pointers; the driver checks that `ptr` is a VMM mapping.
    let r = unsafe { sys::cuMemGetAccess(&mut flags, &location, ptr) };
    (r == CUresult::CUDA_SUCCESS)
        .then_some(flags == sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE as u64)
}

/// `cuMemGetAddressRange`/`cuMemSetAccess`—grant device `peer` read-write access to the whole
/// VMM mapping that contains `ptr` (memory from `cuMemCreate` + `cuMemMap`). Returns `true` when
/// this call granted it.
///
/// Peer access ([`enable_peer_access`]) does not cover VMM memory: each mapping carries its own
/// access list. A buffer of several physical chunks has one mapping per chunk: peer copies
/// ([`crate::p2p::Copier`]) grant every chunk of the buffers they copy.
///
/// # Errors
///
/// [`Error::Cuda`] from `cuMemGetAddressRange_v2` or `cuMemSetAccess` (for memory that is not a
/// VMM mapping, or a pair without a P2P path).
///
/// # C function
///
/// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html>
#[doc(alias = "cuMemSetAccess")]
pub fn grant_vmm_access(ptr: u64, peer: usize) -> Result<bool> {
    cu_device(peer)?;
    if vmm_access(ptr, peer) == Some(true) {
        return Ok(false);
    }
    let (mut base, mut size) = (0u64, 0usize);
    // SAFETY: driver initialised; valid out-pointers.
    cu("cuMemGetAddressRange_v2", unsafe {
        sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
    })?;
    let desc = sys::CUmemAccessDesc {
        location: device_location(peer),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: the range is the driver's own mapping range; one valid descriptor.
    cu("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(base, size, &desc, 1)
    })?;
    Ok(true)
}

/// The VMM mappings (`cuMemGetAddressRange_v2` of each) that cover `ptr..ptr + len`, in order: a
/// buffer of several physical chunks has one per chunk. The caller makes a context current.
pub(crate) fn vmm_ranges(ptr: u64, len: usize) -> Result<Vec<(u64, usize)>> {
    let end = ptr
        .checked_add(len as u64)
        .ok_or_else(|| Error::invalid("len", len, "ptr + len passes 2^64"))?;
    let mut out = Vec::new();
    let mut p = ptr;
    while p < end {
        let (base, size) = super::ipc::address_range(p)?;
        let next = base.checked_add(size).filter(|&n| base <= p && n > p);
        let Some(next) = next else {
            return Err(Error::invalid(
                "ptr",
                format!("{p:#x}"),
                format!(
                    "cuMemGetAddressRange_v2 answered {base:#x}+{size}, which does not hold it"
                ),
            ));
        };
        out.push((base, size as usize));
        p = next;
    }
    Ok(out)
}

/// Whether device `peer` has read-write access to every VMM mapping of `ptr..ptr + len`.
pub(crate) fn vmm_range_access(ptr: u64, len: usize, peer: usize) -> Option<bool> {
    let ranges = vmm_ranges(ptr, len).ok()?;
    let mut all = true;
    for (base, _) in ranges {
        all &= vmm_access(base, peer)?;
    }
    Some(all)
}

/// [`grant_vmm_access`] for every VMM mapping of `ptr..ptr + len` (each physical chunk of a
/// buffer made by [`VmmBuffer::alloc_chunks`](crate::memory::VmmBuffer::alloc_chunks)).
///
/// # Errors
///
/// As [`grant_vmm_access`], for the first chunk that fails.
pub(crate) fn grant_vmm_range(ptr: u64, len: usize, peer: usize) -> Result<bool> {
    cu_device(peer)?;
    let mut granted = false;
    for (base, _) in vmm_ranges(ptr, len)? {
        granted |= grant_vmm_access(base, peer)?;
    }
    Ok(granted)
}

/// A `CUmemLocation` naming device `ordinal`.
pub(crate) fn device_location(ordinal: usize) -> sys::CUmemLocation {
    let id = i32::try_from(ordinal).unwrap_or(i32::MAX); // past any device: the driver refuses it
    crate::cuda::mem_location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn already_enabled_is_consumed() {
        assert_eq!(
            enable_result(CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED).unwrap(),
            Enabled::Already
        );
        assert_eq!(enable_result(CUresult::CUDA_SUCCESS).unwrap(), Enabled::Now);
    }

    #[test]
    fn too_many_peers_is_typed() {
        let e = enable_result(CUresult::CUDA_ERROR_TOO_MANY_PEERS).unwrap_err();
        assert_eq!(e.cuda_name(), Some("CUDA_ERROR_TOO_MANY_PEERS"));
        assert_eq!(Refusal::of(&e), Some(Refusal::TooManyPeers));
        assert!(e.to_string().contains("cuCtxEnablePeerAccess"), "{e}");
    }

    #[test]
    fn unsupported_is_typed() {
        let e = enable_result(CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED).unwrap_err();
        assert_eq!(Refusal::of(&e), Some(Refusal::Unsupported));
        let s = unsupported("cuCtxEnablePeerAccess");
        assert_eq!(s.cuda_name(), e.cuda_name());
        assert_eq!(s.to_string(), e.to_string());
        assert_eq!(Refusal::of(&Error::invalid("a", 1, "r")), None);
    }
}
