//! The one error type of the crate, and the plain types its variants carry.
//!
//! A leaf: nothing here imports another module of the crate. Each type is re-exported once where
//! users look for it (`Error`, `Result` and `Absence` at the crate root, [`MemoryKind`] in
//! `memory`).

use gpudirect_sys::LoadError;
use std::time::Duration;

/// How a buffer was allocated, which decides what GPUDirect can do with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum MemoryKind {
    /// `cuMemAlloc`: GPUDirect RDMA capable, exportable by dma-buf and cuIpc.
    Device,
    /// `cuMemCreate` with the GPUDirect RDMA flag, mapped with `cuMemMap`: RDMA capable,
    /// exportable as a POSIX fd.
    Vmm,
    /// Stream-ordered pool memory (`cuMemAllocAsync`, cudarc's `CudaSlice`): not GPUDirect RDMA
    /// capable; peers need `cuMemPoolSetAccess`.
    Pool,
    /// `cuMemHostAlloc` pinned host memory.
    PinnedHost,
    /// Host memory pinned in place with `cuMemHostRegister`.
    RegisteredHost,
}

impl MemoryKind {
    /// Whether the memory lives on a GPU (as opposed to pinned host memory).
    pub fn is_device(self) -> bool {
        matches!(
            self,
            MemoryKind::Device | MemoryKind::Vmm | MemoryKind::Pool
        )
    }
}

/// What a node lacks, when an [`Error`] means "this cannot work here" rather than a bad argument
/// or a failed operation: from [`Error::absence`], so that a caller can skip a path cleanly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Absence {
    /// A run-time library is not installed, or too old to have a needed symbol: libcuda,
    /// libcufile, libibverbs, librdmacm, or a stub libcuda without a driver behind it.
    Library,
    /// No device of the kind: no CUDA device, no RDMA (verbs) device or RDMA kernel driver, or
    /// an ordinal past the devices present.
    Device,
    /// The CUDA driver is older than the oldest supported one (CUDA 12.0).
    DriverTooOld,
    /// Library and device are present but lack a capability the call needs: dma-buf, peer
    /// access, GPUDirect RDMA or Storage support, an operation the NIC or driver refuses.
    Capability,
}

impl std::fmt::Display for Absence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Absence::Library => "a library is missing",
            Absence::Device => "no device",
            Absence::DriverTooOld => "the CUDA driver is too old",
            Absence::Capability => "a capability is missing",
        })
    }
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in gpudirect. Each variant names the C call or the argument.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A library or symbol is missing (libcuda, libcufile, libibverbs, librdmacm).
    #[error(transparent)]
    Load(#[from] LoadError),
    /// A CUDA driver call failed.
    #[error("{call} failed: {name} ({code})")]
    Cuda {
        /// The C function, such as `cuMemAlloc_v2`.
        call: &'static str,
        /// The `CUresult` value.
        code: u32,
        /// Its name, such as `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`.
        name: String,
    },
    /// A system or verbs call failed with an errno.
    #[error("{call} failed: {source}")]
    Os {
        /// The C function, such as `ibv_reg_mr`.
        call: &'static str,
        /// The errno, as an `io::Error` (its `raw_os_error` is the errno).
        #[source]
        source: std::io::Error,
    },
    /// An argument broke a rule; nothing was submitted.
    #[error("invalid argument `{arg}` = {value}: {rule}")]
    InvalidArgument {
        /// The argument's name.
        arg: &'static str,
        /// Its value, rendered.
        value: String,
        /// The rule it broke.
        rule: String,
    },
    /// The node lacks a feature this call needs.
    #[error("{what} is not supported: {reason}")]
    Unsupported {
        /// The feature, such as `dma-buf memory registration`.
        what: String,
        /// Why, as observed.
        reason: String,
    },
    /// No device of a kind is present.
    #[error("no {what}: {reason}")]
    NoDevice {
        /// The kind of device: `CUDA device`, `verbs device`.
        what: &'static str,
        /// Why, as observed.
        reason: String,
    },
    /// The CUDA driver is older than this library needs.
    #[error(
        "CUDA driver {found} is older than the required {required} (versions as 1000*major+10*minor)"
    )]
    DriverTooOld {
        /// `cuDriverGetVersion`.
        found: i32,
        /// The minimum.
        required: i32,
    },
    /// A cuFile call failed with a `CUfileOpError` (and, for `CU_FILE_CUDA_DRIVER_ERROR`, a CUDA
    /// cause).
    #[error("{call} failed: {name} ({code}){}", cuda_cause(*cu_err, cu_name))]
    CuFile {
        /// The C function, such as `cuFileHandleRegister`.
        call: &'static str,
        /// The `CUfileOpError` value (5000 and up; 5027 is `CU_FILE_HANDLE_NOT_REGISTERED`).
        code: u32,
        /// Its name from cufile.h, such as `CU_FILE_INVALID_VALUE` (`CU_FILE_UNKNOWN_ERROR` for a
        /// code the headers do not list).
        name: &'static str,
        /// The `CUresult` cuFile reported with it (`cu_err`), 0 when none.
        cu_err: i32,
        /// The name of `cu_err` (`CUDA_ERROR_INVALID_VALUE`), when libcuda can say.
        cu_name: Option<String>,
    },
    /// A cuFile request would exceed a limit of the library (a batch larger than
    /// `max_batch_io_size`).
    #[error("{what}: {requested} requested, the limit is {limit}")]
    LimitExceeded {
        /// What was limited, such as `cuFile batch entries`.
        what: &'static str,
        /// How many were asked for.
        requested: usize,
        /// The limit.
        limit: usize,
    },
    /// A verbs work request completed with an error status (remote access, retry exceeded,
    /// flushed, ...).
    #[error("work completion on QP {qp_num:#x} failed: {status} (vendor error {vendor_err:#x})")]
    WorkCompletion {
        /// The typed `ibv_wc_status`.
        status: crate::rdma::WcStatus,
        /// The provider's vendor syndrome.
        vendor_err: u32,
        /// The local QP number.
        qp_num: u32,
    },
    /// A work queue is full: completions must be polled before more requests are posted.
    #[error("{queue} is full ({depth} requests outstanding): poll completions first")]
    QueueFull {
        /// Which queue: `send queue`, `receive queue`, `shared receive queue`.
        queue: &'static str,
        /// Its depth.
        depth: u32,
    },
    /// rdma_cm delivered an event other than the one the connection step waits for.
    #[error("{call}: expected {expected}, got {got} (status {status})")]
    CmEvent {
        /// The step, such as `rdma_resolve_addr`.
        call: &'static str,
        /// The event waited for, such as `RDMA_CM_EVENT_ADDR_RESOLVED`.
        expected: &'static str,
        /// The event received (its name).
        got: String,
        /// The event's status (a negative errno, or a reject reason).
        status: i32,
    },
    /// Memory a NIC cannot reach through GPUDirect RDMA (pool memory from `cuMemAllocAsync`, such
    /// as cudarc's `CudaSlice`, or memory whose `CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE`
    /// is 0). Refused before any verbs call.
    #[error("memory at {ptr:#x} ({kind:?}) is not GPUDirect RDMA capable: {reason}")]
    NotRdmaCapable {
        /// The device pointer.
        ptr: u64,
        /// Its kind.
        kind: MemoryKind,
        /// What said so.
        reason: String,
    },
    /// Every GPU memory registration path was refused (automatic mode); each path with why.
    #[error("no GPU memory registration path worked: {attempts}")]
    NoGpuRegistrationPath {
        /// The paths tried, in order, and why each was refused.
        attempts: crate::rdma::GpuMrAttempts,
    },
    /// A file shrank while it was being read: the read had been limited to the `expected` bytes
    /// the file held at `file_offset` when it started, and stopped after `got`. Destination bytes
    /// past `expected` are unchanged; those between `got` and `expected` may have changed.
    #[error(
        "{call}: the file shrank during the read: {got} of the {expected} bytes at file offset {file_offset} were read"
    )]
    FileShrank {
        /// The read, such as `cuFileRead` or `pread`.
        call: &'static str,
        /// Where the read started in the file.
        file_offset: u64,
        /// The bytes the file held from `file_offset` (up to the requested length) at the start.
        expected: usize,
        /// The bytes read (0 when the library reported an error instead of a count).
        got: usize,
    },
    /// Work was not queued on a CUDA stream because the stream is capturing a CUDA graph
    /// (`cuStreamIsCapturing`): captured work runs only when the graph is launched, and again at
    /// every launch, so nothing the library tracks could say when its memory is free.
    ///
    /// With `enqueued: false` nothing was queued and the call's arguments were dropped normally.
    /// With `enqueued: true` the stream started capturing while the work was being queued: the
    /// capture was invalidated where possible (`cuStreamEndCapture` then returns no graph), and
    /// everything the work may touch was leaked, never freed.
    #[error(
        "{call} refused: the stream is capturing a CUDA graph{}",
        if *enqueued { " (capture began while the work was queued: what it uses is leaked)" } else { "" }
    )]
    StreamCapturing {
        /// The C function refused, such as `cuMemcpyAsync`.
        call: &'static str,
        /// Whether the work was queued before the capture was seen (then its resources leak).
        enqueued: bool,
    },
    /// A bounded wait ran out; whatever was in flight is kept alive, never freed early.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// How long.
        after: Duration,
    },
}

impl Error {
    /// An [`Error::InvalidArgument`].
    pub(crate) fn invalid(
        arg: &'static str,
        value: impl std::fmt::Display,
        rule: impl Into<String>,
    ) -> Self {
        Error::InvalidArgument {
            arg,
            value: value.to_string(),
            rule: rule.into(),
        }
    }

    /// An [`Error::Os`] from the calling thread's errno.
    pub fn last_os(call: &'static str) -> Self {
        Error::Os {
            call,
            source: std::io::Error::last_os_error(),
        }
    }

    /// An [`Error::Os`] from an errno value.
    pub fn errno(call: &'static str, errno: i32) -> Self {
        Error::Os {
            call,
            source: std::io::Error::from_raw_os_error(errno),
        }
    }

    /// What the node lacks, when this error means the operation cannot work on this node at all;
    /// `None` for bad arguments, failed operations, timeouts and the like.
    ///
    /// | absence | errors |
    /// | --- | --- |
    /// | [`Absence::Library`] | [`Error::Load`]; `CUDA_ERROR_STUB_LIBRARY`, `CUDA_ERROR_SYSTEM_DRIVER_MISMATCH` |
    /// | [`Absence::Device`] | [`Error::NoDevice`]; `CUDA_ERROR_NO_DEVICE`, `CUDA_ERROR_DEVICE_UNAVAILABLE`; `CU_FILE_DEVICE_NOT_FOUND` |
    /// | [`Absence::DriverTooOld`] | [`Error::DriverTooOld`]; `CUDA_ERROR_INSUFFICIENT_DRIVER` |
    /// | [`Absence::Capability`] | [`Error::Unsupported`], [`Error::NoGpuRegistrationPath`], [`Error::NotRdmaCapable`] (except pool memory, which is the caller's choice); `CUDA_ERROR_NOT_SUPPORTED`, `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`; `CU_FILE_PLATFORM_NOT_SUPPORTED`, `CU_FILE_IO_NOT_SUPPORTED`, `CU_FILE_DEVICE_NOT_SUPPORTED`, `CU_FILE_NVFS_SETUP_ERROR` |
    ///
    /// ```no_run
    /// use gpudirect::cuda;
    /// match cuda::context(0) {
    ///     Ok(ctx) => println!("device {} is here", ctx.ordinal()),
    ///     Err(e) if e.absence().is_some() => println!("SKIPPED: {e}"), // no GPU here: skip
    ///     Err(e) => return Err(e),                                       // a real failure
    /// }
    /// # Ok::<(), gpudirect::Error>(())
    /// ```
    pub fn absence(&self) -> Option<Absence> {
        match self {
            Error::Load(_) => Some(Absence::Library),
            Error::NoDevice { .. } => Some(Absence::Device),
            Error::DriverTooOld { .. } => Some(Absence::DriverTooOld),
            Error::Unsupported { .. } | Error::NoGpuRegistrationPath { .. } => {
                Some(Absence::Capability)
            }
            Error::NotRdmaCapable { kind, .. } => {
                (*kind != MemoryKind::Pool).then_some(Absence::Capability)
            }
            Error::Cuda { name, .. } => match name.as_str() {
                "CUDA_ERROR_STUB_LIBRARY" | "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH" => {
                    Some(Absence::Library)
                }
                "CUDA_ERROR_NO_DEVICE" | "CUDA_ERROR_DEVICE_UNAVAILABLE" => Some(Absence::Device),
                "CUDA_ERROR_INSUFFICIENT_DRIVER" => Some(Absence::DriverTooOld),
                "CUDA_ERROR_NOT_SUPPORTED" | "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED" => {
                    Some(Absence::Capability)
                }
                _ => None,
            },
            Error::CuFile { name, .. } => match *name {
                "CU_FILE_DEVICE_NOT_FOUND" => Some(Absence::Device),
                "CU_FILE_PLATFORM_NOT_SUPPORTED"
                | "CU_FILE_IO_NOT_SUPPORTED"
                | "CU_FILE_DEVICE_NOT_SUPPORTED"
                | "CU_FILE_NVFS_SETUP_ERROR" => Some(Absence::Capability),
                _ => None,
            },
            _ => None,
        }
    }

    /// An [`Error::Cuda`] for `code`, returned by the CUDA driver function `call` (such as
    /// `cuModuleLoadData`): for driver calls a program makes itself, through cudarc, next to
    /// gpudirect's (with cudarc's `DriverError`, pass its `.0`).
    ///
    /// ```
    /// use gpudirect::cudarc::driver::sys::CUresult;
    /// let e = gpudirect::Error::cuda("cuModuleLoadData", CUresult::CUDA_ERROR_INVALID_IMAGE);
    /// assert_eq!(e.cuda_name(), Some("CUDA_ERROR_INVALID_IMAGE"));
    /// ```
    pub fn cuda(call: &'static str, code: cudarc::driver::sys::CUresult) -> Self {
        Error::Cuda {
            call,
            code: code as u32,
            name: format!("{code:?}"),
        }
    }

    /// The CUDA code name, when this is a CUDA error.
    pub fn cuda_name(&self) -> Option<&str> {
        match self {
            Error::Cuda { name, .. } => Some(name),
            _ => None,
        }
    }
}

fn cuda_cause(cu_err: i32, cu_name: &Option<String>) -> String {
    match (cu_err, cu_name) {
        (0, _) => String::new(),
        (c, Some(n)) => format!(", CUDA cause {n} ({c})"),
        (c, None) => format!(", CUDA cause {c}"),
    }
}

/// Turn a `CUresult` from `call` into a `Result`.
pub(crate) fn cu(call: &'static str, r: cudarc::driver::sys::CUresult) -> Result<()> {
    if r == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::cuda(call, r))
    }
}

/// Turn a cudarc `DriverError` from `call` into an [`Error::Cuda`].
pub(crate) fn from_driver(call: &'static str, e: cudarc::driver::DriverError) -> Error {
    Error::cuda(call, e.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUresult;

    #[test]
    fn cuda_error_carries_code_and_name() {
        let e = cu(
            "cuCtxEnablePeerAccess",
            CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,
        )
        .unwrap_err();
        assert_eq!(e.cuda_name(), Some("CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"));
        assert_eq!(
            e.to_string(),
            "cuCtxEnablePeerAccess failed: CUDA_ERROR_PEER_ACCESS_UNSUPPORTED (217)"
        );
        assert!(cu("cuInit", CUresult::CUDA_SUCCESS).is_ok());
    }

    #[test]
    fn absence_classifies_missing_things_and_only_those() {
        let lib = Error::Load(LoadError::LibraryNotFound {
            library: "libibverbs",
            tried: vec!["libibverbs.so.1".into()],
            detail: "not found".into(),
        });
        assert_eq!(lib.absence(), Some(Absence::Library));
        let sym = Error::Load(LoadError::SymbolNotFound {
            library: "libcufile",
            path: "/x/libcufile.so.0".into(),
            symbol: "cuFileReadAsync",
        });
        assert_eq!(sym.absence(), Some(Absence::Library));
        let dev = Error::NoDevice {
            what: "verbs device",
            reason: "none".into(),
        };
        assert_eq!(dev.absence(), Some(Absence::Device));
        let old = Error::DriverTooOld {
            found: 11080,
            required: 12000,
        };
        assert_eq!(old.absence(), Some(Absence::DriverTooOld));
        let cap = Error::Unsupported {
            what: "dma-buf".into(),
            reason: "EOPNOTSUPP".into(),
        };
        assert_eq!(cap.absence(), Some(Absence::Capability));
        // By name: not every binding version has every code (no STUB_LIBRARY in some).
        for (name, want) in [
            ("CUDA_ERROR_NO_DEVICE", Some(Absence::Device)),
            ("CUDA_ERROR_STUB_LIBRARY", Some(Absence::Library)),
            (
                "CUDA_ERROR_INSUFFICIENT_DRIVER",
                Some(Absence::DriverTooOld),
            ),
            (
                "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
                Some(Absence::Capability),
            ),
            ("CUDA_ERROR_OUT_OF_MEMORY", None),
            ("CUDA_ERROR_INVALID_VALUE", None),
        ] {
            let e = Error::Cuda {
                call: "c",
                code: 1,
                name: name.into(),
            };
            assert_eq!(e.absence(), want, "{name}");
        }
        let e = cu("cuInit", CUresult::CUDA_ERROR_NO_DEVICE).unwrap_err();
        assert_eq!(e.absence(), Some(Absence::Device));
        let pool = Error::NotRdmaCapable {
            ptr: 0x1000,
            kind: MemoryKind::Pool,
            reason: "pool".into(),
        };
        assert_eq!(pool.absence(), None, "pool memory is the caller's choice");
        let dev_mem = Error::NotRdmaCapable {
            ptr: 0x1000,
            kind: MemoryKind::Device,
            reason: "attribute 0".into(),
        };
        assert_eq!(dev_mem.absence(), Some(Absence::Capability));
        let cufile = |name| Error::CuFile {
            call: "cuFileDriverOpen",
            code: 5007,
            name,
            cu_err: 0,
            cu_name: None,
        };
        assert_eq!(
            cufile("CU_FILE_PLATFORM_NOT_SUPPORTED").absence(),
            Some(Absence::Capability)
        );
        assert_eq!(cufile("CU_FILE_INVALID_VALUE").absence(), None);
        for e in [
            Error::invalid("len", 1, "rule"),
            Error::errno("ibv_reg_mr", libc::ENOMEM),
            Error::Timeout {
                what: "x",
                after: Duration::from_secs(1),
            },
        ] {
            assert_eq!(e.absence(), None, "{e}");
        }
        assert_eq!(Absence::Library.to_string(), "a library is missing");
    }

    #[test]
    fn kinds_know_where_they_live() {
        assert!(MemoryKind::Device.is_device());
        assert!(MemoryKind::Vmm.is_device());
        assert!(MemoryKind::Pool.is_device());
        assert!(!MemoryKind::PinnedHost.is_device());
        assert!(!MemoryKind::RegisteredHost.is_device());
    }

    #[test]
    fn invalid_argument_says_which_and_why() {
        let e = Error::invalid("len", 4097, "must be a multiple of 4096");
        assert_eq!(
            e.to_string(),
            "invalid argument `len` = 4097: must be a multiple of 4096"
        );
    }
}
