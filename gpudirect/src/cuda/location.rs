//! `CUmemLocation` values, built the same way for every binding version.

use cudarc::driver::sys;

/// A `CUmemLocation` of kind `type_` and `id` (a device ordinal, a NUMA node), for every binding
/// version: from CUDA 13.2 on, cudarc's `CUmemLocation` holds `id` in an anonymous union, with the
/// same layout (a C `int` after the 4-byte kind).
pub(crate) fn mem_location(type_: sys::CUmemLocationType, id: i32) -> sys::CUmemLocation {
    const _: () = assert!(
        size_of::<sys::CUmemLocation>() == 8
            && size_of::<sys::CUmemLocationType>() == 4
            && std::mem::offset_of!(sys::CUmemLocation, type_) == 0
    );
    // SAFETY: a plain C struct for which all-zero is valid (CU_MEM_LOCATION_TYPE_INVALID, id 0).
    let mut loc: sys::CUmemLocation = unsafe { std::mem::zeroed() };
    loc.type_ = type_;
    // SAFETY: bytes 4..8 are `id` (a C int) in every version: 8 bytes in all, the 4-byte kind at
    // offset 0 (asserted above); `loc` is a live local, written in bounds and aligned (align 4).
    unsafe { (&raw mut loc).cast::<u8>().add(4).cast::<i32>().write(id) };
    loc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_location_sets_kind_and_id() {
        let loc = mem_location(
            sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            0x0102_0304,
        );
        // SAFETY: CUmemLocation is 8 bytes of plain data (asserted in `mem_location`).
        let raw: [u8; 8] = unsafe { std::mem::transmute(loc) };
        let kind = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as u32;
        assert_eq!(raw[..4], kind.to_ne_bytes());
        assert_eq!(raw[4..], 0x0102_0304_i32.to_ne_bytes());
    }
}
