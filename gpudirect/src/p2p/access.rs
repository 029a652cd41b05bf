//! Peer access: the can-access query, an idempotent and thread-safe enable, and pool access grants.
//!
//! Peer access is process-global state of the primary contexts: once enabled it stays enabled for
//! the life of the process. Nothing in gpudirect disables it, least of all a destructor.

use crate::cuda;
use crate::driver;
use crate::error::{Error, Result};
use crate::memory::DeviceMemory;
use cudarc::driver::CudaContext;
use cudarc::driver::sys::{self, CUresult};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The `CUresult` code of `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED` (217).
const PEER_ACCESS_UNSUPPORTED: u32 = CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED as u32;
/// The `CUresult` code of `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED` (704).
const PEER_ACCESS_ALREADY_ENABLED: u32 = CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED as u32;
/// The `CUresult` code of `CUDA_ERROR_TOO_MANY_PEERS` (711).
const TOO_MANY_PEERS: u32 = CUresult::CUDA_ERROR_TOO_MANY_PEERS as u32;

/// What [`enable_peer_access`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Enabled {
    /// This call enabled it.
    Now,
    /// It was already enabled (by an earlier call, another thread, or other code in the process);
    /// the driver's `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED` was consumed.
    Already,
}

/// Why a pair of devices cannot use peer access, read from an [`Error`] that
/// [`enable_peer_access`] (or a [`Copier`](super::Copier) asked for the peer path) returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub enum PeerAccessRefusal {
    /// `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`: the pair cannot (a device and itself, no P2P path).
    Unsupported,
    /// `CUDA_ERROR_TOO_MANY_PEERS`: the device has used up its peer mappings.
    TooManyPeers,
}

impl PeerAccessRefusal {
    /// The refusal an error stands for, if it is one.
    pub fn of(e: &Error) -> Option<PeerAccessRefusal> {
        match e {
            Error::Cuda { code, .. } if *code == PEER_ACCESS_UNSUPPORTED => {
                Some(PeerAccessRefusal::Unsupported)
            }
            Error::Cuda { code, .. } if *code == TOO_MANY_PEERS => {
                Some(PeerAccessRefusal::TooManyPeers)
            }
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
    // SAFETY: both devices came from cuDeviceGet (cu_device).
    unsafe { driver::peer::can_access(d, p) }
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
    // SAFETY: driver initialised (device_count); ordinal in range.
    unsafe { driver::device::get(ordinal) }
}

/// The typed error for a pair that cannot use peer access, as the driver would answer it.
pub(crate) fn unsupported(call: &'static str) -> Error {
    Error::Cuda {
        call,
        code: PEER_ACCESS_UNSUPPORTED,
        name: "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED".to_string(),
    }
}

/// Map the answer of `cuCtxEnablePeerAccess`: already-enabled is success, consumed.
fn enable_result(r: Result<()>) -> Result<Enabled> {
    match r {
        Ok(()) => Ok(Enabled::Now),
        Err(Error::Cuda { code, .. }) if code == PEER_ACCESS_ALREADY_ENABLED => {
            Ok(Enabled::Already)
        }
        Err(e) => Err(e),
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
///   that is the driver's documented answer for such a pair. [`PeerAccessRefusal::of`]
///   classifies it.
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
    driver::ctx::bind(&ctx)?;
    // SAFETY: the current context is `device`'s primary context (bound above); `peer_ctx` is a
    // live primary context retained for the duration of the call.
    let out = enable_result(unsafe { driver::peer::enable_access(peer_ctx.cu_ctx()) })?;
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
/// the driver stages it, at a fraction of the peer path's rate, even with peer access enabled.
/// Returns `true` when this call granted it, `false` when it was already granted (or `peer` owns
/// the pool).
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
    let pool = pool_of(ptr)?.ok_or_else(|| {
        Error::invalid(
            "ptr",
            format!("{ptr:#x}"),
            "not stream-ordered pool memory (no CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE)",
        )
    })?;
    let location = device_location(peer);
    // SAFETY: `pool` is a live pool handle from the driver (it owns `ptr`).
    if unsafe { driver::pool::get_access(pool, &location) }? == READ_WRITE {
        return Ok(false);
    }
    let desc = sys::CUmemAccessDesc {
        location,
        flags: READ_WRITE,
    };
    // SAFETY: as above; one valid access descriptor.
    unsafe { driver::pool::set_access(pool, &[desc]) }?;
    Ok(true)
}

/// Read-write access, as the driver's access lists say it.
const READ_WRITE: sys::CUmemAccess_flags =
    sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;

/// `CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE`: the stream-ordered pool that owns `ptr`; `None` for
/// memory of no pool.
///
/// # Errors
///
/// [`Error::Cuda`] from `cuPointerGetAttribute` (an address the driver does not know).
pub(crate) fn pool_of(ptr: u64) -> Result<Option<sys::CUmemoryPool>> {
    // SAFETY: the attribute's type is a CUmemoryPool (a pointer-sized handle).
    let pool: sys::CUmemoryPool = unsafe {
        driver::pointer::attribute(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
            ptr,
        )
    }?;
    Ok((!pool.is_null()).then_some(pool))
}

/// Whether device `peer` has read-write access to the pool that owns `ptr`; `None` when `ptr` is
/// not pool memory or the driver cannot say.
pub(crate) fn pool_access(ptr: u64, peer: usize) -> Option<bool> {
    let pool = pool_of(ptr).ok()??;
    // SAFETY: a live pool handle from the driver.
    let flags = unsafe { driver::pool::get_access(pool, &device_location(peer)) }.ok()?;
    Some(flags == READ_WRITE)
}

/// Whether device `peer` has read-write access to the VMM mapping at `ptr` (`cuMemGetAccess`);
/// `None` when the driver cannot say (not a VMM mapping).
pub(crate) fn vmm_access(ptr: u64, peer: usize) -> Option<bool> {
    // SAFETY: the driver checks that `ptr` is a VMM mapping.
    let flags = unsafe { driver::vmm::get_access(&device_location(peer), ptr) }.ok()?;
    Some(flags == READ_WRITE as u64)
}

/// `cuMemSetAccess(base, size, {peer: read-write})` unless `cuMemGetAccess` says it is granted
/// already; `true` when this call granted it. The caller checked the range and made a context
/// current.
fn set_vmm_access(base: u64, size: usize, peer: usize) -> Result<bool> {
    if vmm_access(base, peer) == Some(true) {
        return Ok(false);
    }
    let desc = sys::CUmemAccessDesc {
        location: device_location(peer),
        flags: READ_WRITE,
    };
    // SAFETY: the driver checks that the range is made of whole mappings.
    unsafe { driver::vmm::set_access(base, size, &[desc]) }?;
    Ok(true)
}

/// Make device `ordinal`'s primary context current (the context of the device that owns the
/// memory, for the driver's VMM queries).
fn bind_owner(ordinal: usize) -> Result<()> {
    driver::ctx::bind(&*cuda::context(ordinal)?)
}

/// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`: the device the driver says `ptr` belongs to (for VMM
/// mappings, whose context is the owning device's); `None` when the driver cannot say.
fn owner_device(ptr: u64) -> Option<usize> {
    // SAFETY: the attribute's type is a C int; the driver validates `ptr`.
    let dev: i32 = unsafe {
        driver::pointer::attribute(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
    }
    .ok()?;
    usize::try_from(dev).ok()
}

/// `cuMemSetAccess`—grant device `peer` read-write access to the VMM mapping that contains `ptr`
/// (memory from `cuMemCreate` + `cuMemMap`). Returns `true` when this call granted it.
///
/// Peer access ([`enable_peer_access`]) does not cover VMM memory: each mapping carries its own
/// access list. This function finds the mapping from `ptr` alone, with
/// `cuMemGetAddressRange_v2` while the primary context of the device that owns the memory
/// (`CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`) is current; the driver does not answer that lookup for
/// every VMM mapping. Where the mapping's base and size are known, use
/// [`grant_vmm_mapping`]; for a whole buffer, [`grant_vmm_memory`] (which takes the layout from
/// the buffer itself). Peer copies ([`crate::p2p::Copier`]) grant every mapping of the buffers
/// they copy. The owning device's primary context is left current on the calling thread.
///
/// # Errors
///
/// [`Error::NoDevice`] for a `peer` past the device count; [`Error::Cuda`] from
/// `cuMemGetAddressRange_v2` (`CUDA_ERROR_NOT_FOUND` where the driver cannot find the mapping)
/// or `cuMemSetAccess` (for memory that is not a VMM mapping, or a pair without a P2P path).
///
/// # C function
///
/// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html>
#[doc(alias = "cuMemSetAccess")]
#[doc(alias = "cuMemGetAddressRange")]
pub fn grant_vmm_access(ptr: u64, peer: usize) -> Result<bool> {
    cu_device(peer)?;
    if let Some(owner) = owner_device(ptr) {
        bind_owner(owner)?;
    }
    if vmm_access(ptr, peer) == Some(true) {
        return Ok(false);
    }
    // SAFETY: a context is current (bound above, or the caller's); the driver checks `ptr`.
    let (base, size) = unsafe { driver::mem::address_range(ptr) }?;
    set_vmm_access(base, size, peer)
}

/// `cuMemSetAccess(base, bytes)`—grant device `peer` read-write access to the VMM mapping that
/// starts at `base` and is `bytes` long (a whole `cuMemMap` mapping, or several adjacent whole
/// ones). Returns `true` when this call granted it (`false`: `cuMemGetAccess` says it was
/// granted already).
///
/// # Errors
///
/// [`Error::InvalidArgument`] for `bytes == 0` or a range past 2^64 (before any driver call);
/// [`Error::NoDevice`] for a `peer` past the device count; [`Error::Cuda`] from `cuMemSetAccess`
/// (`CUDA_ERROR_INVALID_VALUE` when the range is not made of whole mappings, or a pair without a
/// P2P path).
///
/// # C function
///
/// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html>
#[doc(alias = "cuMemSetAccess")]
#[doc(alias = "cuMemGetAccess")]
pub fn grant_vmm_mapping(base: u64, bytes: usize, peer: usize) -> Result<bool> {
    check_mapping(base, bytes)?;
    cu_device(peer)?;
    if let Some(owner) = owner_device(base) {
        bind_owner(owner)?;
    }
    set_vmm_access(base, bytes, peer)
}

/// `cuMemSetAccess` on every VMM mapping of `mem`—grant device `peer` read-write access to all of
/// a VMM buffer (each physical chunk of a [`VmmBuffer::alloc_chunks`](crate::memory::VmmBuffer::alloc_chunks)
/// buffer is its own mapping). Returns `true` when this call granted any.
///
/// The mappings come from [`DeviceMemory::vmm_mappings`] where the memory knows them; otherwise
/// they are looked up with `cuMemGetAddressRange_v2`, with the primary context of the memory's own
/// device current (which it stays on return).
///
/// # Errors
///
/// [`Error::InvalidArgument`] for memory that is not [`MemoryKind::Vmm`](crate::memory::MemoryKind::Vmm),
/// or mappings that do not cover the buffer; [`Error::NoDevice`] for a `peer` past the device
/// count; [`Error::Cuda`] from the lookup or from `cuMemSetAccess`, for the first mapping that
/// fails.
///
/// # C function
///
/// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html>
#[doc(alias = "cuMemSetAccess")]
pub fn grant_vmm_memory<M: DeviceMemory>(mem: &M, peer: usize) -> Result<bool> {
    if mem.kind() != crate::memory::MemoryKind::Vmm {
        return Err(Error::invalid(
            "mem",
            format!("{:?} memory", mem.kind()),
            "must be VMM memory (cuMemCreate + cuMemMap)",
        ));
    }
    cu_device(peer)?;
    let mut granted = false;
    for (base, size) in vmm_mappings_of(mem)? {
        granted |= set_vmm_access(base, size, peer)?;
    }
    Ok(granted)
}

/// A mapping range from a caller: non-empty and below 2^64.
fn check_mapping(base: u64, bytes: usize) -> Result<()> {
    if bytes == 0 || base.checked_add(bytes as u64).is_none() {
        return Err(Error::invalid(
            "bytes",
            bytes,
            format!("must be non-zero, and {base:#x} + bytes must not pass 2^64"),
        ));
    }
    Ok(())
}

/// The VMM mappings of `mem` that hold its bytes, with the primary context of `mem`'s device
/// current on return: see [`mappings_at`].
pub(crate) fn vmm_mappings_of<M: DeviceMemory>(mem: &M) -> Result<Vec<(u64, usize)>> {
    mappings_at(
        mem.device_ptr(),
        mem.byte_len(),
        mem.ordinal(),
        mem.vmm_mappings(),
    )
}

/// The VMM mappings that hold `ptr..ptr + len` (memory of device `owner`), with `owner`'s primary
/// context current on return: `known` (the memory's own [`DeviceMemory::vmm_mappings`]) where
/// the memory knows its layout (checked by [`covering`]), else [`vmm_ranges`].
pub(crate) fn mappings_at(
    ptr: u64,
    len: usize,
    owner: usize,
    known: Option<Vec<(u64, usize)>>,
) -> Result<Vec<(u64, usize)>> {
    bind_owner(owner)?;
    match known {
        Some(maps) => covering(ptr, len, &maps),
        None => vmm_ranges(ptr, len),
    }
}

/// Of `maps` (whole mappings, `(base, bytes)`), the ones that hold bytes of `ptr..ptr + len`, in
/// order, after checking that they are non-empty, in address order without overlap, and cover
/// the range without a gap.
///
/// # Errors
///
/// [`Error::InvalidArgument`] naming the rule broken.
pub(crate) fn covering(ptr: u64, len: usize, maps: &[(u64, usize)]) -> Result<Vec<(u64, usize)>> {
    let bad = |why: String| Error::invalid("vmm_mappings", format!("{maps:x?}"), why);
    let end = ptr
        .checked_add(len as u64)
        .ok_or_else(|| Error::invalid("len", len, "ptr + len passes 2^64"))?;
    let mut prev_end = 0u64;
    for (i, &(base, size)) in maps.iter().enumerate() {
        let Some(e) = base.checked_add(size as u64).filter(|_| size > 0) else {
            return Err(bad(format!(
                "mapping {i} must be non-empty and end below 2^64"
            )));
        };
        if i > 0 && base < prev_end {
            return Err(bad(format!(
                "mapping {i} starts before mapping {} ends",
                i - 1
            )));
        }
        prev_end = e;
    }
    let mut out = Vec::new();
    let mut p = ptr;
    for &(base, size) in maps {
        if p >= end {
            break;
        }
        let e = base + size as u64; // checked above
        if e <= p {
            continue; // before the range
        }
        if base > p {
            return Err(bad(format!(
                "no mapping holds {p:#x} (buffer {ptr:#x}+{len})"
            )));
        }
        out.push((base, size));
        p = e;
    }
    if p < end {
        return Err(bad(format!(
            "the mappings end at {p:#x}, before the buffer's end {end:#x}"
        )));
    }
    Ok(out)
}

/// The VMM mappings (`cuMemGetAddressRange_v2` of each) that cover `ptr..ptr + len`, in order: a
/// buffer of several physical chunks has one per chunk. For memory that does not know its own
/// layout; the caller makes the owning device's context current.
pub(crate) fn vmm_ranges(ptr: u64, len: usize) -> Result<Vec<(u64, usize)>> {
    let end = ptr
        .checked_add(len as u64)
        .ok_or_else(|| Error::invalid("len", len, "ptr + len passes 2^64"))?;
    let mut out = Vec::new();
    let mut p = ptr;
    while p < end {
        // SAFETY: the caller made a context current; the driver checks `p`.
        let (base, size) = unsafe { driver::mem::address_range(p) }?;
        let next = base
            .checked_add(size as u64)
            .filter(|&n| base <= p && n > p);
        let Some(next) = next else {
            return Err(Error::invalid(
                "ptr",
                format!("{p:#x}"),
                format!(
                    "cuMemGetAddressRange_v2 answered {base:#x}+{size}, which does not hold it"
                ),
            ));
        };
        out.push((base, size));
        p = next;
    }
    Ok(out)
}

/// VMM memory as a copy sees it: `len` bytes at `ptr`, memory of device `owner`, and its own
/// layout ([`DeviceMemory::vmm_mappings`]) when it knows it.
pub(crate) struct VmmRange {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    pub(crate) owner: usize,
    pub(crate) known: Option<Vec<(u64, usize)>>,
}

/// Grant (`grant`) or only check read-write access for device `peer` on every VMM mapping that
/// holds `range`. `Err` with the reason the access is not there (for a peer copy's
/// [`DriverStaged`](super::CopyPath::DriverStaged) path): a mapping without the grant, mappings
/// that cannot be found, or a refused grant.
pub(crate) fn vmm_access_at(
    range: VmmRange,
    peer: usize,
    grant: bool,
) -> std::result::Result<(), String> {
    let VmmRange {
        ptr,
        len,
        owner,
        known,
    } = range;
    let maps = mappings_at(ptr, len, owner, known).map_err(|e| {
        format!("its VMM mappings could not be found, so access could not be granted ({e})")
    })?;
    for (base, size) in maps {
        if grant {
            set_vmm_access(base, size, peer)
                .map_err(|e| format!("the mapping {base:#x}+{size} refused the grant ({e})"))?;
        } else if vmm_access(base, peer) != Some(true) {
            return Err(format!("the mapping {base:#x}+{size} is not granted"));
        }
    }
    Ok(())
}

/// A `CUmemLocation` naming device `ordinal`.
pub(crate) fn device_location(ordinal: usize) -> sys::CUmemLocation {
    let id = i32::try_from(ordinal).unwrap_or(i32::MAX); // past any device: the driver refuses it
    crate::cuda::mem_location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `cuCtxEnablePeerAccess` answers, as the driver layer returns it.
    fn answer(r: CUresult) -> Result<()> {
        crate::error::cu("cuCtxEnablePeerAccess", r)
    }

    #[test]
    fn already_enabled_is_consumed() {
        assert_eq!(
            enable_result(answer(CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)).unwrap(),
            Enabled::Already
        );
        assert_eq!(
            enable_result(answer(CUresult::CUDA_SUCCESS)).unwrap(),
            Enabled::Now
        );
    }

    #[test]
    fn too_many_peers_is_typed() {
        let e = enable_result(answer(CUresult::CUDA_ERROR_TOO_MANY_PEERS)).unwrap_err();
        assert_eq!(e.cuda_name(), Some("CUDA_ERROR_TOO_MANY_PEERS"));
        assert_eq!(
            PeerAccessRefusal::of(&e),
            Some(PeerAccessRefusal::TooManyPeers)
        );
        assert!(e.to_string().contains("cuCtxEnablePeerAccess"), "{e}");
    }

    /// The layout of the evidence: one buffer of two chunks (2 MiB and 6 MiB) mapped back to back.
    const G: usize = 2 << 20;
    const BASE: u64 = 0x7f00_0000_0000;

    #[test]
    fn known_mappings_are_granted_exactly_chunk_by_chunk() {
        let maps = [(BASE, G), (BASE + G as u64, 3 * G)];
        // The whole buffer: both chunks, each exactly as mapped.
        assert_eq!(covering(BASE, 4 * G, &maps).unwrap(), maps);
        // A range inside the second chunk only (a sub-buffer forwarding its parent's mappings).
        assert_eq!(
            covering(BASE + G as u64 + 100, 4096, &maps).unwrap(),
            [(BASE + G as u64, 3 * G)]
        );
        // Across the seam: both.
        assert_eq!(covering(BASE + G as u64 - 1, 2, &maps).unwrap(), maps);
        // A buffer shorter than its mapping (the size rounded up to the granularity).
        assert_eq!(covering(BASE, 100, &[(BASE, G)]).unwrap(), [(BASE, G)]);
        // Nothing to grant for an empty range.
        assert!(covering(BASE, 0, &maps).unwrap().is_empty());
    }

    #[test]
    fn mappings_that_do_not_cover_the_buffer_are_refused() {
        let bad = |ptr, len, maps: &[(u64, usize)]| {
            let e = covering(ptr, len, maps).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::InvalidArgument {
                        arg: "vmm_mappings",
                        ..
                    }
                ),
                "{e}"
            );
            e.to_string()
        };
        // A gap between the chunks.
        let t = bad(BASE, 4 * G, &[(BASE, G), (BASE + 2 * G as u64, 2 * G)]);
        assert!(t.contains("no mapping holds"), "{t}");
        // Too short.
        let t = bad(BASE, 4 * G, &[(BASE, G), (BASE + G as u64, G)]);
        assert!(t.contains("before the buffer's end"), "{t}");
        // Starting after the buffer.
        bad(BASE, G, &[(BASE + 1, G)]);
        // None at all.
        bad(BASE, 1, &[]);
        // Out of order or overlapping, empty, or past 2^64.
        let t = bad(BASE, G, &[(BASE + G as u64, G), (BASE, G)]);
        assert!(t.contains("starts before mapping 0 ends"), "{t}");
        bad(BASE, G, &[(BASE, G), (BASE + 4096, G)]);
        bad(BASE, G, &[(BASE, 0), (BASE, G)]);
        bad(u64::MAX - 10, 4, &[(u64::MAX - 10, 4096)]);
        // The buffer itself past 2^64.
        assert!(covering(u64::MAX - 1, 4, &[(u64::MAX - 1, 1)]).is_err());
    }

    #[test]
    fn a_mapping_from_a_caller_is_checked_before_the_driver() {
        assert!(check_mapping(BASE, G).is_ok());
        for (base, bytes) in [(BASE, 0), (u64::MAX - 10, 4096)] {
            let e = grant_vmm_mapping(base, bytes, 0).unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument { arg: "bytes", .. }),
                "{e}"
            );
        }
    }

    #[test]
    fn only_vmm_memory_is_granted_by_layout() {
        struct Host;
        // SAFETY: never dereferenced; the kind is refused before any driver call.
        unsafe impl DeviceMemory for Host {
            type Elem = u8;
            fn device_ptr(&self) -> u64 {
                BASE
            }
            fn len(&self) -> usize {
                G
            }
            fn ordinal(&self) -> usize {
                0
            }
            fn kind(&self) -> crate::memory::MemoryKind {
                crate::memory::MemoryKind::PinnedHost
            }
        }
        assert_eq!(Host.vmm_mappings(), None, "unknown by default");
        let e = grant_vmm_memory(&Host, 1).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "mem", .. }),
            "{e}"
        );
    }

    #[test]
    fn unsupported_is_typed() {
        let e = enable_result(answer(CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED)).unwrap_err();
        assert_eq!(
            PeerAccessRefusal::of(&e),
            Some(PeerAccessRefusal::Unsupported)
        );
        let s = unsupported("cuCtxEnablePeerAccess");
        assert_eq!(s.cuda_name(), e.cuda_name());
        assert_eq!(s.to_string(), e.to_string());
        assert_eq!(PeerAccessRefusal::of(&Error::invalid("a", 1, "r")), None);
    }
}
