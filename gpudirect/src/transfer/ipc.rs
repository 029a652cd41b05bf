//! CUDA IPC for the intra-node path: registered allocations exported once, peers' GPUs found by
//! UUID, the link between two GPUs, and the process-wide cache of peers' allocations mapped
//! here (each opened once per local GPU, closed when nothing holds it).

use super::region::{Exported, IpcLink};
use crate::error::{Error, Result};
use crate::memory::DeviceMemory;
use crate::p2p::{Interconnect, IpcMemHandle, IpcMemory, LinkMatrix};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

/// `cuIpcGetMemHandle` of the allocation holding `ptr` on device `ordinal`, with its base and
/// length (`cuMemGetAddressRange`) and the device's UUID.
///
/// # Errors
///
/// [`Error::Cuda`] from the driver (memory that is not `cuMemAlloc` memory); as
/// [`crate::cuda::context`].
pub(crate) fn export(ordinal: usize, ptr: u64) -> Result<Exported> {
    let uuid = uuid_of(ordinal)?;
    let ctx = crate::cuda::context(ordinal)?;
    crate::driver::ctx::bind(&ctx)?;
    // SAFETY: context current; `ptr` is live device memory that the registration holds.
    let (base, size) = unsafe { crate::driver::mem::address_range(ptr) }?;
    // SAFETY: context current; `base` starts the live `cuMemAlloc` allocation holding `ptr`.
    let h = unsafe { crate::driver::ipc::get_mem_handle(base) }?;
    Ok(Exported {
        handle: h.reserved.map(|c| c as u8),
        base,
        alloc_len: size as u64,
        uuid,
    })
}

/// The UUID of device `ordinal` (`cuDeviceGetUuid`).
///
/// # Errors
///
/// [`Error::NoDevice`] past the device count; as [`crate::cuda::device_count`].
pub(crate) fn uuid_of(ordinal: usize) -> Result<[u8; 16]> {
    let n = crate::cuda::device_count()?;
    if ordinal >= n {
        return Err(Error::NoDevice {
            what: "CUDA device",
            reason: format!("device {ordinal} requested, {n} visible"),
        });
    }
    // SAFETY: the driver is initialised (device_count) and `ordinal` is below the count.
    let dev = unsafe { crate::driver::device::get(ordinal) }?;
    // SAFETY: `dev` came from cuDeviceGet.
    unsafe { crate::driver::device::uuid(dev) }
}

/// The ordinal, in this process, of the GPU with this UUID; `None` when it is not visible.
///
/// # Errors
///
/// As [`uuid_of`].
pub(crate) fn ordinal_of_uuid(uuid: &[u8; 16]) -> Result<Option<usize>> {
    static UUIDS: OnceLock<Vec<[u8; 16]>> = OnceLock::new();
    let all = match UUIDS.get() {
        Some(v) => v,
        None => {
            let n = crate::cuda::device_count()?;
            let v = (0..n).map(uuid_of).collect::<Result<Vec<_>>>()?;
            UUIDS.get_or_init(|| v)
        }
    };
    Ok(all.iter().position(|u| u == uuid))
}

/// What a copy between memory of `local` (a GPU, or host memory when `None`) and memory of the
/// peer's GPU `peer` (when visible here) crosses.
pub(crate) fn link(local: Option<usize>, peer: Option<usize>) -> IpcLink {
    match (local, peer) {
        (None, _) => IpcLink::LocalHost,
        (_, None) => IpcLink::Unknown {
            reason: "the peer's GPU is not visible to this process".into(),
        },
        (Some(a), Some(b)) if a == b => IpcLink::SameDevice,
        (Some(a), Some(b)) => {
            static MATRIX: OnceLock<std::result::Result<LinkMatrix, String>> = OnceLock::new();
            let m = MATRIX.get_or_init(|| LinkMatrix::probe().map_err(|e| e.to_string()));
            match m {
                Err(reason) => IpcLink::Unknown {
                    reason: reason.clone(),
                },
                Ok(m) => match m.link(a, b).map(|l| &l.interconnect) {
                    Some(Interconnect::Nvlink { links, .. }) => IpcLink::Nvlink { links: *links },
                    Some(Interconnect::Pcie { .. }) => IpcLink::Pcie,
                    Some(Interconnect::SameDevice) => IpcLink::SameDevice,
                    Some(Interconnect::Unknown { reason }) => IpcLink::Unknown {
                        reason: reason.clone(),
                    },
                    None => IpcLink::Unknown {
                        reason: format!("no link {a} -> {b} in the link matrix"),
                    },
                },
            }
        }
    }
}

/// An imported allocation: the handle's bytes and the local GPU it is mapped for.
type Key = ([u8; 64], usize);

/// Every import alive in the process, by key. An entry whose import can no longer be upgraded
/// is being closed by its last holder, which removes it once the mapping is closed.
fn cache() -> MutexGuard<'static, HashMap<Key, Weak<Import>>> {
    static C: OnceLock<Mutex<HashMap<Key, Weak<Import>>>> = OnceLock::new();
    C.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// A peer's allocation mapped here with `cuIpcOpenMemHandle`, shared by every endpoint and
/// request that uses it; closed (`cuIpcCloseMemHandle`) when the last holder goes. Copies hold
/// it until their events complete, so it is never closed under a copy.
pub(crate) struct Import {
    key: Key,
    mem: Option<IpcMemory<u8>>,
    /// The mapping's first byte here.
    pub(crate) base: u64,
    /// The mapping's real size (`cuMemGetAddressRange` on it).
    pub(crate) size: u64,
}

impl std::fmt::Debug for Import {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Import")
            .field("device", &self.key.1)
            .field("base", &format_args!("{:#x}", self.base))
            .field("size", &self.size)
            .finish()
    }
}

/// The import of `handle` mapped for GPU `ordinal`: the live one, or a new one
/// (`cuIpcOpenMemHandle`, counted in `opened`) that must hold `alloc_len` bytes (the peer's
/// word, checked against the mapping; it is closed again if it does not). `home` gives the PCI
/// address of the GPU that owns the memory, when visible here (asked only to open).
///
/// # Errors
///
/// [`Error::InvalidArgument`] when the mapping is shorter than `alloc_len`; [`Error::Cuda`]
/// from the driver (a handle of this very process, or of freed memory).
#[doc(alias = "cuIpcOpenMemHandle")]
pub(crate) fn import(
    handle: &[u8; 64],
    ordinal: usize,
    alloc_len: u64,
    home: impl FnOnce() -> Option<String>,
    opened: &AtomicU64,
) -> Result<Arc<Import>> {
    let key = (*handle, ordinal);
    loop {
        let mut c = cache();
        if let Some(w) = c.get(&key) {
            if let Some(a) = w.upgrade() {
                return Ok(a);
            }
            // Its last holder is closing it (which waits for the device's queued work):
            // opening the same handle again before that may fail, so let it finish first.
            drop(c);
            std::thread::sleep(std::time::Duration::from_micros(50));
            continue;
        }
        let h = IpcMemHandle::from_parts(*handle, 0, alloc_len, 1, 0, home());
        let mem = IpcMemory::<u8>::open_on(&h, ordinal)?;
        let base = mem.device_ptr();
        // SAFETY: `open_on` left `ordinal`'s context current; `base` is the mapping it made.
        let (_, size) = unsafe { crate::driver::mem::address_range(base) }?;
        let a = Arc::new(Import {
            key,
            mem: Some(mem),
            base,
            size: size as u64,
        });
        c.insert(key, Arc::downgrade(&a));
        opened.fetch_add(1, Ordering::Relaxed);
        return Ok(a);
    }
}

impl Drop for Import {
    fn drop(&mut self) {
        // Closed outside the cache's lock: `cuIpcCloseMemHandle` waits for the work queued on
        // the device, and every other import of the process would wait with it. The dead entry
        // stays in the map until the mapping is closed, so nobody opens the same handle
        // meanwhile (`import` waits for it to go).
        drop(self.mem.take());
        let mut c = cache();
        // The entry is this import's: no other can be made for the key while it is in the map.
        if c.get(&self.key).is_some_and(|w| w.strong_count() == 0) {
            c.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_without_a_gpu_say_what_they_cross() {
        assert_eq!(link(None, Some(1)), IpcLink::LocalHost);
        assert_eq!(link(Some(3), Some(3)), IpcLink::SameDevice);
        assert!(matches!(link(Some(0), None), IpcLink::Unknown { .. }));
    }
}
