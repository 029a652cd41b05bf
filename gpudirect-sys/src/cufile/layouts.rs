//! The structs cuFile reads or writes, generated from the 1.14 and 1.20 headers, and tests that
//! compare them field by field with [`super::bindings`] (1.15).
//!
//! The three versions agree on every such struct, so one layout serves them all; a version outside
//! `OLDEST_KNOWN_VERSION..=NEWEST_KNOWN_VERSION` is used through the same (common) layout, with
//! slack for `CUfileDrvProps_t` (see [`super::Lib::driver_properties`]). When a new header changes
//! a struct, regenerate (`scripts/regen-cufile.sh`), and these tests fail and show which field.

#[allow(missing_docs)]
pub mod v1_14;
#[allow(missing_docs)]
pub mod v1_20;

/// Whether cuFile version `v` (`1000 * major + 10 * minor`) is one whose headers were compared.
pub fn is_known_version(v: i32) -> bool {
    (super::OLDEST_KNOWN_VERSION..=super::NEWEST_KNOWN_VERSION).contains(&v)
}

#[cfg(test)]
mod tests {
    use super::super::bindings as b15;
    use super::{v1_14 as b14, v1_20 as b20};
    use core::mem::{align_of, offset_of, size_of};

    macro_rules! same_layout {
        ($ty:ident { $($field:ident $(. $sub:ident)*),* $(,)? }) => {{
            for (name, size, align) in [
                ("1.14", size_of::<b14::$ty>(), align_of::<b14::$ty>()),
                ("1.20", size_of::<b20::$ty>(), align_of::<b20::$ty>()),
            ] {
                assert_eq!(size, size_of::<b15::$ty>(), "{} size in {name}", stringify!($ty));
                assert_eq!(align, align_of::<b15::$ty>(), "{} align in {name}", stringify!($ty));
            }
            $(
                assert_eq!(offset_of!(b14::$ty, $field $(. $sub)*), offset_of!(b15::$ty, $field $(. $sub)*),
                    "{}.{} in 1.14", stringify!($ty), stringify!($field $(. $sub)*));
                assert_eq!(offset_of!(b20::$ty, $field $(. $sub)*), offset_of!(b15::$ty, $field $(. $sub)*),
                    "{}.{} in 1.20", stringify!($ty), stringify!($field $(. $sub)*));
            )*
        }};
    }

    #[test]
    fn drv_props_is_the_same_in_1_14_1_15_1_20() {
        same_layout!(CUfileDrvProps_t {
            nvfs.major_version,
            nvfs.minor_version,
            nvfs.poll_thresh_size,
            nvfs.max_direct_io_size,
            nvfs.dstatusflags,
            nvfs.dcontrolflags,
            fflags,
            max_device_cache_size,
            per_buffer_cache_size,
            max_device_pinned_mem_size,
            max_batch_io_size,
            max_batch_io_timeout_msecs,
        });
        assert_eq!(size_of::<b15::CUfileDrvProps_t>(), 56);
    }

    #[test]
    fn io_structs_are_the_same_in_1_14_1_15_1_20() {
        same_layout!(CUfileError_t { err, cu_err });
        same_layout!(CUfileDescr_t {
            type_,
            handle,
            fs_ops
        });
        same_layout!(CUfileIOParams_t {
            mode,
            u.batch.devPtr_base,
            u.batch.file_offset,
            u.batch.devPtr_offset,
            u.batch.size,
            fh,
            opcode,
            cookie,
        });
        same_layout!(CUfileIOEvents_t {
            cookie,
            status,
            ret
        });
        assert_eq!(size_of::<b15::CUfileError_t>(), 8);
        assert_eq!(size_of::<b15::CUfileIOParams_t>(), 64);
        assert_eq!(size_of::<b15::CUfileIOEvents_t>(), 24);
    }

    #[test]
    fn parameter_values_agree_across_versions() {
        for (a, b, c) in [
            (
                b14::CUFILE_PARAM_PROPERTIES_IO_BATCHSIZE,
                b15::CUFILE_PARAM_PROPERTIES_IO_BATCHSIZE,
                b20::CUFILE_PARAM_PROPERTIES_IO_BATCHSIZE,
            ),
            (
                b14::CUFILE_PARAM_PROPERTIES_BATCH_IO_TIMEOUT_MS,
                b15::CUFILE_PARAM_PROPERTIES_BATCH_IO_TIMEOUT_MS,
                b20::CUFILE_PARAM_PROPERTIES_BATCH_IO_TIMEOUT_MS,
            ),
            (
                b14::CUFILE_PARAM_STREAM_MEMOPS_BYPASS,
                b15::CUFILE_PARAM_STREAM_MEMOPS_BYPASS,
                b20::CUFILE_PARAM_STREAM_MEMOPS_BYPASS,
            ),
            (
                b14::CUFILE_PARAM_FORCE_COMPAT_MODE,
                b15::CUFILE_PARAM_FORCE_COMPAT_MODE,
                b20::CUFILE_PARAM_FORCE_COMPAT_MODE,
            ),
            (
                b14::CUFILE_PARAM_LOG_DIR,
                b15::CUFILE_PARAM_LOG_DIR,
                b20::CUFILE_PARAM_LOG_DIR,
            ),
        ] {
            assert_eq!((a, b), (c, c));
        }
        // New in 1.20, past the end of 1.15's enums.
        assert_eq!(b20::CUFILE_PARAM_PROPERTIES_POSIX_IO_MODE, 12);
        assert_eq!(b20::CUFILE_PARAM_GDS_FALLBACK_IO, 13);
        assert_eq!(b20::CUFILE_PARAM_RDMA_TRANSPORT, 3);
    }

    #[test]
    fn parameter_enums_only_grew() {
        // Appended in 1.20; the numbering of older entries is unchanged.
        assert_eq!(b15::CUFILE_PARAM_STREAM_MEMOPS_BYPASS, 11);
        assert_eq!(b15::CUFILE_PARAM_PROPERTIES_BATCH_IO_TIMEOUT_MS, 11);
        assert_eq!(b15::CUFILE_PARAM_LOG_DIR, 2);
    }

    #[test]
    fn known_versions() {
        assert!(super::is_known_version(1150));
        assert!(!super::is_known_version(1300));
    }
}
