//! Where imported memory really lives.
//!
//! An import of another process's memory (a CUDA IPC mapping, a VMM import, a pointer of an
//! imported pool) is mapped for one device of this process and addressed through it, but its
//! bytes stay on the device that allocated them. When the two differ, a copy "on one device"
//! crosses a link, and the driver cannot say so: `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL` answers the
//! device the mapping was opened on. So the imports say it themselves: each one mapped away from
//! its home records its address range here while it is mapped, and the copier asks by address.
//!
//! Entries are removed before the mapping is given back, so an address reused by a later
//! allocation never finds a stale entry (an import that is leaked keeps its mapping, and its
//! entry with it). While no import is mapped away from home, a lookup is one atomic load.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// The device whose memory holds an import's bytes, in this process's numbering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Home {
    /// A device this process sees.
    Device(usize),
    /// A device this process does not see (another process's `CUDA_VISIBLE_DEVICES`).
    NotVisible,
}

impl Home {
    /// The home of memory that another process allocated on the device at PCI address `bus`
    /// (absent: unknown, taken as not visible).
    pub(crate) fn of_bus_id(bus: Option<&str>) -> crate::Result<Home> {
        match bus {
            Some(b) => {
                Ok(super::link::ordinal_of_bus_id(b)?.map_or(Home::NotVisible, Home::Device))
            }
            None => Ok(Home::NotVisible),
        }
    }

    /// Whether memory mapped for device `ordinal` lives on another device.
    pub(crate) fn is_away_from(self, ordinal: usize) -> bool {
        self != Home::Device(ordinal)
    }

    /// The ordinal, when the device is visible.
    pub(crate) fn ordinal(self) -> Option<usize> {
        match self {
            Home::Device(o) => Some(o),
            Home::NotVisible => None,
        }
    }

    /// The device to map memory exported from the device at PCI address `bus` on: that device.
    ///
    /// # Errors
    ///
    /// [`crate::Error::NoDevice`] when `bus` is `None` or no visible device is there, naming
    /// `open_on` (the call that maps it for a device of the caller's choice).
    pub(crate) fn required(bus: Option<&str>, open_on: &str) -> crate::Result<(usize, Home)> {
        match Home::of_bus_id(bus)? {
            home @ Home::Device(ordinal) => Ok((ordinal, home)),
            Home::NotVisible => Err(crate::Error::NoDevice {
                what: "the device the exported memory lives on",
                reason: format!(
                    "no visible device at PCI address {bus:?}: map it for a visible device with \
                     {open_on}"
                ),
            }),
        }
    }
}

/// An import's place in the table: where it lives, and the entry [`record`] made for it (none
/// when it is mapped at home). Its owner calls [`forget`](Self::forget) before the mapping is
/// given back.
#[derive(Debug)]
pub(crate) struct Recorded {
    home: Home,
    start: Option<u64>,
}

impl Recorded {
    /// [`record`] `start..start + bytes`, memory of `home` mapped for device `mapped_for`.
    pub(crate) fn new(start: u64, bytes: usize, home: Home, mapped_for: usize) -> Recorded {
        let recorded = record(start, bytes, home, mapped_for);
        Recorded {
            home,
            start: recorded.then_some(start),
        }
    }

    /// Where the import lives.
    pub(crate) fn home(&self) -> Home {
        self.home
    }

    /// Remove the entry, if one was made.
    pub(crate) fn forget(&self) {
        if let Some(start) = self.start {
            forget(start);
        }
    }
}

/// `start -> (end, home)` of every import mapped away from its home.
type Ranges = BTreeMap<u64, (u64, Home)>;

fn ranges() -> &'static Mutex<Ranges> {
    static R: OnceLock<Mutex<Ranges>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(BTreeMap::new()))
}

/// How many entries [`ranges`] holds: zero makes [`lookup`] a single load.
static AWAY: AtomicUsize = AtomicUsize::new(0);

fn lock() -> std::sync::MutexGuard<'static, Ranges> {
    ranges().lock().unwrap_or_else(|e| e.into_inner())
}

/// Record that `start..start + bytes` is memory of `home` mapped for device `mapped_for`; nothing
/// is recorded when it is at home. Returns whether an entry was made (pass it to [`forget`]).
fn record(start: u64, bytes: usize, home: Home, mapped_for: usize) -> bool {
    if !home.is_away_from(mapped_for) || bytes == 0 {
        return false;
    }
    let end = start.saturating_add(bytes as u64);
    let mut r = lock();
    if r.insert(start, (end, home)).is_none() {
        AWAY.fetch_add(1, Ordering::AcqRel);
    }
    true
}

/// Remove the entry [`record`] made at `start` (before the mapping is given back).
fn forget(start: u64) {
    let mut r = lock();
    if r.remove(&start).is_some() {
        AWAY.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The home of the import mapped away from home that holds `ptr`, if any.
pub(crate) fn lookup(ptr: u64) -> Option<Home> {
    if AWAY.load(Ordering::Acquire) == 0 {
        return None;
    }
    let r = lock();
    let (_, &(end, home)) = r.range(..=ptr).next_back()?;
    (ptr < end).then_some(home)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imports_away_from_home_are_found_by_address_until_forgotten() {
        // Addresses no real mapping has, so that other tests of the process are not disturbed.
        let base = 0xfff0_0000_0000_0000u64;
        assert!(
            !record(base, 4096, Home::Device(3), 3),
            "at home: nothing to say"
        );
        assert_eq!(lookup(base), None);
        assert!(record(base, 4096, Home::Device(0), 1));
        assert!(record(base + 8192, 100, Home::NotVisible, 1));
        assert_eq!(lookup(base), Some(Home::Device(0)));
        assert_eq!(lookup(base + 4095), Some(Home::Device(0)));
        assert_eq!(lookup(base + 4096), None, "past the end");
        assert_eq!(lookup(base - 1), None, "before the start");
        assert_eq!(lookup(base + 8192 + 99), Some(Home::NotVisible));
        forget(base);
        assert_eq!(lookup(base), None, "a reused address finds nothing stale");
        forget(base + 8192);
        assert_eq!(lookup(base + 8192), None);
        assert!(Home::NotVisible.is_away_from(0));
        assert!(!Home::Device(2).is_away_from(2));
    }
}
