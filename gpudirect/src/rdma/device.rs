//! The list of verbs devices.

use super::ffi::{free_in_parent, nonnull, verbs};
use crate::error::{Error, Result};
use gpudirect_sys::ibverbs as ibv;
use std::ffi::CStr;
use std::marker::PhantomData;
use std::ptr::NonNull;

/// `ibv_get_device_list()`—the verbs devices of this node, freed on drop.
#[doc(alias = "ibv_get_device_list")]
#[doc(alias = "ibv_free_device_list")]
pub struct DeviceList {
    list: NonNull<*mut ibv::ibv_device>,
    len: usize,
}

// SAFETY: the list is an immutable array of device pointers owned by this value; libibverbs'
// device objects are process-global and thread-safe to read and open.
unsafe impl Send for DeviceList {}
// SAFETY: as above.
unsafe impl Sync for DeviceList {}

impl DeviceList {
    /// `ibv_get_device_list(&n)`—every verbs device.
    ///
    /// # Errors
    ///
    /// [`Error::Load`] without libibverbs; [`Error::NoDevice`] without kernel RDMA support
    /// (libibverbs answers `ENOSYS`); [`Error::Os`] when the call fails otherwise.
    #[doc(alias = "ibv_get_device_list")]
    pub fn get() -> Result<DeviceList> {
        let l = verbs()?;
        let mut n = 0;
        // SAFETY: one valid out-pointer.
        let p = unsafe { (l.ibv_get_device_list)(&mut n) };
        let list = match nonnull("ibv_get_device_list", p) {
            Ok(list) => list,
            // libibverbs answers ENOSYS when the kernel has no RDMA support at all.
            Err(Error::Os { source, .. }) if source.raw_os_error() == Some(libc::ENOSYS) => {
                return Err(Error::NoDevice {
                    what: "verbs device",
                    reason: "no RDMA driver in this kernel (ibv_get_device_list answered ENOSYS)"
                        .into(),
                });
            }
            Err(e) => return Err(e),
        };
        Ok(DeviceList {
            list,
            len: n.max(0) as usize,
        })
    }

    /// Every device, refusing an empty list (the usual "no RDMA here" answer).
    ///
    /// # Errors
    ///
    /// [`Error::NoDevice`] when there is no device; otherwise as [`DeviceList::get`].
    #[doc(alias = "ibv_get_device_list")]
    pub fn non_empty() -> Result<DeviceList> {
        let list = Self::get()?;
        if list.is_empty() {
            return Err(Error::NoDevice {
                what: "verbs device",
                reason:
                    "ibv_get_device_list returned no devices (no RDMA NIC, rdma_rxe or siw link)"
                        .into(),
            });
        }
        Ok(list)
    }

    /// How many devices.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The devices, in the library's order.
    pub fn iter(&self) -> impl Iterator<Item = Device<'_>> {
        (0..self.len).map(move |i| Device {
            // SAFETY: i < len entries of the list, each a non-NULL device pointer.
            ptr: unsafe { *self.list.as_ptr().add(i) },
            _list: PhantomData,
        })
    }

    /// The device called `name` (such as `rxe0` or `mlx5_0`).
    ///
    /// # Errors
    ///
    /// [`Error::NoDevice`] naming the devices present.
    pub fn find(&self, name: &str) -> Result<Device<'_>> {
        self.iter()
            .find(|d| d.name() == name)
            .ok_or_else(|| Error::NoDevice {
                what: "verbs device",
                reason: format!(
                    "no device named {name} (present: {})",
                    self.iter().map(|d| d.name()).collect::<Vec<_>>().join(", ")
                ),
            })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        free_in_parent(ibv::lib, |l| {
            // SAFETY: the list came from ibv_get_device_list and is freed once.
            unsafe { (l.ibv_free_device_list)(self.list.as_ptr()) };
        });
    }
}

impl std::fmt::Debug for DeviceList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// One verbs device, borrowed from its [`DeviceList`].
#[derive(Clone, Copy)]
pub struct Device<'list> {
    ptr: *mut ibv::ibv_device,
    _list: PhantomData<&'list DeviceList>,
}

impl Device<'_> {
    /// `ibv_get_device_name`—the kernel name, such as `rxe0`.
    #[doc(alias = "ibv_get_device_name")]
    pub fn name(&self) -> String {
        let Ok(l) = ibv::lib() else {
            return String::new();
        };
        // SAFETY: a device of a live list; the name is a NUL-terminated string inside it.
        let p = unsafe { (l.ibv_get_device_name)(self.ptr) };
        if p.is_null() {
            return String::new();
        }
        // SAFETY: non-NULL, NUL-terminated, lives as long as the list.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// `ibv_get_device_guid`—the node GUID, in host byte order.
    #[doc(alias = "ibv_get_device_guid")]
    pub fn guid(&self) -> u64 {
        match ibv::lib() {
            // SAFETY: a device of a live list.
            Ok(l) => u64::from_be(unsafe { (l.ibv_get_device_guid)(self.ptr) }),
            Err(_) => 0,
        }
    }

    pub(crate) fn as_ptr(&self) -> *mut ibv::ibv_device {
        self.ptr
    }
}

impl std::fmt::Debug for Device<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name())
            .field("guid", &format_args!("{:#018x}", self.guid()))
            .finish()
    }
}
