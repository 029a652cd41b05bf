//! Element types whose every bit pattern is a valid value.

/// Plain old data: `Copy`, no padding, no pointers, and every bit pattern a valid value, so bytes
/// written by a device, a NIC or a file can be read as `Self` without undefined behaviour.
///
/// Implemented for the integer and floating-point primitives and arrays of them. `bool`, `char`,
/// references and enums are not `Pod` (not every bit pattern is valid).
///
/// # Safety
///
/// Implement only for `#[repr(C)]` or `#[repr(transparent)]` types without padding whose fields
/// are all `Pod`.
pub unsafe trait Pod: Copy + Send + Sync + 'static {}

macro_rules! pod {
    ($($t:ty),*) => {
        // SAFETY: primitives without invalid bit patterns or padding.
        $(unsafe impl Pod for $t {})*
    };
}
pod!(
    u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize, f32, f64
);

// SAFETY: arrays of Pod have no padding and every bit pattern valid.
unsafe impl<T: Pod, const N: usize> Pod for [T; N] {}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_pod<T: Pod>() {}

    #[test]
    fn primitives_and_arrays_are_pod() {
        is_pod::<u8>();
        is_pod::<f64>();
        is_pod::<[u32; 4]>();
        is_pod::<[[i16; 2]; 3]>();
    }
}
