//! Names of `CUresult` codes that arrive as plain integers (cuFile's `cu_err`).

use cudarc::driver::{DriverError, sys};

/// The `CUresult` codes every supported binding version declares (CUDA 12.0 and later), so that
/// a raw code becomes the binding's enum only when it is one of them: an integer outside the
/// enum's values must never be turned into it.
macro_rules! known_codes {
    ($($name:ident),* $(,)?) => {
        const KNOWN: &[sys::CUresult] = &[$(sys::CUresult::$name),*];
    };
}

known_codes!(
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_ERROR_NOT_INITIALIZED,
    CUDA_ERROR_DEINITIALIZED,
    CUDA_ERROR_PROFILER_DISABLED,
    CUDA_ERROR_PROFILER_NOT_INITIALIZED,
    CUDA_ERROR_PROFILER_ALREADY_STARTED,
    CUDA_ERROR_PROFILER_ALREADY_STOPPED,
    CUDA_ERROR_STUB_LIBRARY,
    CUDA_ERROR_DEVICE_UNAVAILABLE,
    CUDA_ERROR_NO_DEVICE,
    CUDA_ERROR_INVALID_DEVICE,
    CUDA_ERROR_DEVICE_NOT_LICENSED,
    CUDA_ERROR_INVALID_IMAGE,
    CUDA_ERROR_INVALID_CONTEXT,
    CUDA_ERROR_CONTEXT_ALREADY_CURRENT,
    CUDA_ERROR_MAP_FAILED,
    CUDA_ERROR_UNMAP_FAILED,
    CUDA_ERROR_ARRAY_IS_MAPPED,
    CUDA_ERROR_ALREADY_MAPPED,
    CUDA_ERROR_NO_BINARY_FOR_GPU,
    CUDA_ERROR_ALREADY_ACQUIRED,
    CUDA_ERROR_NOT_MAPPED,
    CUDA_ERROR_NOT_MAPPED_AS_ARRAY,
    CUDA_ERROR_NOT_MAPPED_AS_POINTER,
    CUDA_ERROR_ECC_UNCORRECTABLE,
    CUDA_ERROR_UNSUPPORTED_LIMIT,
    CUDA_ERROR_CONTEXT_ALREADY_IN_USE,
    CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,
    CUDA_ERROR_INVALID_PTX,
    CUDA_ERROR_INVALID_GRAPHICS_CONTEXT,
    CUDA_ERROR_NVLINK_UNCORRECTABLE,
    CUDA_ERROR_JIT_COMPILER_NOT_FOUND,
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION,
    CUDA_ERROR_JIT_COMPILATION_DISABLED,
    CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY,
    CUDA_ERROR_INVALID_SOURCE,
    CUDA_ERROR_FILE_NOT_FOUND,
    CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND,
    CUDA_ERROR_SHARED_OBJECT_INIT_FAILED,
    CUDA_ERROR_OPERATING_SYSTEM,
    CUDA_ERROR_INVALID_HANDLE,
    CUDA_ERROR_ILLEGAL_STATE,
    CUDA_ERROR_NOT_FOUND,
    CUDA_ERROR_NOT_READY,
    CUDA_ERROR_ILLEGAL_ADDRESS,
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
    CUDA_ERROR_LAUNCH_TIMEOUT,
    CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING,
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
    CUDA_ERROR_PEER_ACCESS_NOT_ENABLED,
    CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE,
    CUDA_ERROR_CONTEXT_IS_DESTROYED,
    CUDA_ERROR_ASSERT,
    CUDA_ERROR_TOO_MANY_PEERS,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
    CUDA_ERROR_HARDWARE_STACK_ERROR,
    CUDA_ERROR_ILLEGAL_INSTRUCTION,
    CUDA_ERROR_MISALIGNED_ADDRESS,
    CUDA_ERROR_INVALID_ADDRESS_SPACE,
    CUDA_ERROR_INVALID_PC,
    CUDA_ERROR_LAUNCH_FAILED,
    CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE,
    CUDA_ERROR_NOT_PERMITTED,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_SYSTEM_NOT_READY,
    CUDA_ERROR_SYSTEM_DRIVER_MISMATCH,
    CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE,
    CUDA_ERROR_MPS_CONNECTION_FAILED,
    CUDA_ERROR_MPS_RPC_FAILURE,
    CUDA_ERROR_MPS_SERVER_NOT_READY,
    CUDA_ERROR_MPS_MAX_CLIENTS_REACHED,
    CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED,
    CUDA_ERROR_MPS_CLIENT_TERMINATED,
    CUDA_ERROR_CDP_NOT_SUPPORTED,
    CUDA_ERROR_CDP_VERSION_MISMATCH,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
    CUDA_ERROR_STREAM_CAPTURE_MERGE,
    CUDA_ERROR_STREAM_CAPTURE_UNMATCHED,
    CUDA_ERROR_STREAM_CAPTURE_UNJOINED,
    CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
    CUDA_ERROR_CAPTURED_EVENT,
    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD,
    CUDA_ERROR_TIMEOUT,
    CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE,
    CUDA_ERROR_EXTERNAL_DEVICE,
    CUDA_ERROR_INVALID_CLUSTER_SIZE,
    CUDA_ERROR_UNKNOWN,
);

/// The `CUresult` whose value is `code`, when it is one of [`KNOWN`].
fn known(code: i32) -> Option<sys::CUresult> {
    KNOWN.iter().copied().find(|r| *r as i64 == i64::from(code))
}

/// `cuGetErrorName(code)`, through cudarc's loader, for a code that arrives as an integer:
/// `None` for 0 (success), for a code the bindings do not declare (a driver newer than the
/// bindings: the caller shows the number), and when libcuda is absent or lacks the symbol
/// (checked first: cudarc's loader would panic).
pub(crate) fn error_name(code: i32) -> Option<String> {
    let r = known(code)?;
    let d = gpudirect_sys::cuda::driver().ok()?;
    if !d.has_symbol("cuGetErrorName") {
        return None;
    }
    let e = DriverError(r);
    let name = e.error_name().ok()?;
    Some(name.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_codes_map_only_to_declared_values() {
        assert_eq!(known(0), None, "success is no error");
        assert_eq!(known(1), Some(sys::CUresult::CUDA_ERROR_INVALID_VALUE));
        assert_eq!(
            known(217),
            Some(sys::CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED)
        );
        for undeclared in [-1, 3000, 5027, i32::MAX, i32::MIN] {
            assert_eq!(known(undeclared), None, "{undeclared}");
        }
        assert_eq!(error_name(0), None);
        assert_eq!(error_name(i32::MAX), None);
    }
}
