//! The one error type of the crate, and the plain types its variants carry.
//!
//! A leaf: nothing here imports another module of the crate. Each type is re-exported once where
//! users look for it (`Error`, `Result` and `Absence` at the crate root, [`MemoryKind`] in
//! `memory`).

use gpudirect_sys::LoadError;
use std::time::Duration;

/// How a buffer was allocated, which decides what GPUDirect can do with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
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
        status: WcStatus,
        /// The provider's vendor syndrome.
        vendor_err: u32,
        /// The local QP number.
        qp_num: u32,
    },
    /// A work queue, or the completion queue its completions go to, has no room for the whole
    /// chain: nothing was posted. Every posted request holds an entry of its queue, and one of
    /// that completion queue (signaled or not), until a completion that covers it is polled; each
    /// queue pair also keeps one entry of its send completion queue for its teardown, and a
    /// completion queue serving the queue pairs of a shared receive queue keeps room for that
    /// queue's whole depth. Poll completions, then post again. Requests that will never complete
    /// (the peer is gone) are flushed by moving the queue pair to the error state
    /// (`QueuePair::into_error`): polling the flushes frees their entries, and
    /// `QueuePair::reset` makes the queue pair usable again.
    #[error("{queue} is full ({depth} requests outstanding): poll completions first")]
    QueueFull {
        /// Which queue: `send queue`, `receive queue`, `shared receive queue`, `completion
        /// queue`.
        queue: &'static str,
        /// Its depth (for a completion queue, its capacity).
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
        attempts: GpuMrAttempts,
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
    /// A metadata store (named segments, membership) could not do an operation: unreachable,
    /// refused, or it answered what it should not.
    #[error("metadata store ({store}): {op} failed: {reason}")]
    Store {
        /// The store: `embedded`, `etcd`.
        store: &'static str,
        /// The operation, such as `publish` or `lookup`.
        op: &'static str,
        /// Why, as observed.
        reason: String,
    },
    /// No live member publishes this segment name.
    #[error("no member is named {name:?} in the metadata store")]
    UnknownName {
        /// The segment name looked up.
        name: String,
    },
    /// Another live node publishes this segment name.
    #[error("segment name {name:?} is taken by node {node}")]
    NameTaken {
        /// The segment name.
        name: String,
        /// The node holding it.
        node: String,
    },
    /// The peer left the membership (its lease expired, or it withdrew its name): its
    /// endpoints end.
    #[error("peer {name:?} (node {node}) left the membership")]
    PeerLeft {
        /// The peer's segment name.
        name: String,
        /// Its node identity.
        node: String,
    },
    /// Bytes in a format version this library does not read.
    #[error("{what} version {found} is not one this library reads ({oldest} to {newest})")]
    UnknownVersion {
        /// What was read, such as `member record`.
        what: &'static str,
        /// The version found.
        found: u32,
        /// The oldest version read.
        oldest: u32,
        /// The newest version read.
        newest: u32,
    },
    /// A peer of the transfer engine was refused by the handshake that says who it is: a key on
    /// one side only, a wrong key, a replayed or relayed handshake, or (inside a node) a user
    /// the configured rule does not admit. Nothing was published to it.
    #[error("authentication with {peer} failed: {reason}")]
    Authentication {
        /// The peer, as far as it is known (an address, or a pid and user).
        peer: String,
        /// Why it was refused.
        reason: String,
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
#[inline]
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

// The plain code types errors carry, defined here so that this module imports no other: the
// status of a verbs work completion, and what the GPU memory registration paths refused. Each is
// re-exported once, under `rdma`.

use gpudirect_sys::ibverbs as ibv;
use std::ffi::CStr;
use std::fmt;

/// `enum ibv_wc_status`: how a verbs work request completed. Printed with the text of
/// `ibv_wc_status_str` where libibverbs is present.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[doc(alias = "ibv_wc_status")]
#[doc(alias = "ibv_wc_status_str")]
#[non_exhaustive]
#[allow(missing_docs)]
pub enum WcStatus {
    Success,
    LocalLength,
    LocalQpOperation,
    LocalEecOperation,
    LocalProtection,
    /// The QP went to the error state: the request was flushed, not executed.
    Flushed,
    MemoryWindowBind,
    BadResponse,
    LocalAccess,
    RemoteInvalidRequest,
    /// The peer refused the access (bad rkey, bounds, or permissions).
    RemoteAccess,
    RemoteOperation,
    /// Transport retries ran out: the peer did not answer.
    RetryExceeded,
    /// Receiver-not-ready retries ran out: the peer posted no receive.
    RnrRetryExceeded,
    LocalRddViolation,
    RemoteInvalidRdRequest,
    RemoteAborted,
    InvalidEecn,
    InvalidEecState,
    Fatal,
    ResponseTimeout,
    General,
    TagMatching,
    TagMatchingRndvIncomplete,
    /// A value this crate does not know.
    Other(u32),
}

impl WcStatus {
    /// From the raw `enum ibv_wc_status` value.
    pub fn from_raw(v: u32) -> Self {
        use WcStatus::*;
        match v {
            ibv::IBV_WC_SUCCESS => Success,
            ibv::IBV_WC_LOC_LEN_ERR => LocalLength,
            ibv::IBV_WC_LOC_QP_OP_ERR => LocalQpOperation,
            ibv::IBV_WC_LOC_EEC_OP_ERR => LocalEecOperation,
            ibv::IBV_WC_LOC_PROT_ERR => LocalProtection,
            ibv::IBV_WC_WR_FLUSH_ERR => Flushed,
            ibv::IBV_WC_MW_BIND_ERR => MemoryWindowBind,
            ibv::IBV_WC_BAD_RESP_ERR => BadResponse,
            ibv::IBV_WC_LOC_ACCESS_ERR => LocalAccess,
            ibv::IBV_WC_REM_INV_REQ_ERR => RemoteInvalidRequest,
            ibv::IBV_WC_REM_ACCESS_ERR => RemoteAccess,
            ibv::IBV_WC_REM_OP_ERR => RemoteOperation,
            ibv::IBV_WC_RETRY_EXC_ERR => RetryExceeded,
            ibv::IBV_WC_RNR_RETRY_EXC_ERR => RnrRetryExceeded,
            ibv::IBV_WC_LOC_RDD_VIOL_ERR => LocalRddViolation,
            ibv::IBV_WC_REM_INV_RD_REQ_ERR => RemoteInvalidRdRequest,
            ibv::IBV_WC_REM_ABORT_ERR => RemoteAborted,
            ibv::IBV_WC_INV_EECN_ERR => InvalidEecn,
            ibv::IBV_WC_INV_EEC_STATE_ERR => InvalidEecState,
            ibv::IBV_WC_FATAL_ERR => Fatal,
            ibv::IBV_WC_RESP_TIMEOUT_ERR => ResponseTimeout,
            ibv::IBV_WC_GENERAL_ERR => General,
            ibv::IBV_WC_TM_ERR => TagMatching,
            ibv::IBV_WC_TM_RNDV_INCOMPLETE => TagMatchingRndvIncomplete,
            o => Other(o),
        }
    }

    /// The C name, such as `IBV_WC_REM_ACCESS_ERR`.
    pub fn c_name(self) -> &'static str {
        use WcStatus::*;
        match self {
            Success => "IBV_WC_SUCCESS",
            LocalLength => "IBV_WC_LOC_LEN_ERR",
            LocalQpOperation => "IBV_WC_LOC_QP_OP_ERR",
            LocalEecOperation => "IBV_WC_LOC_EEC_OP_ERR",
            LocalProtection => "IBV_WC_LOC_PROT_ERR",
            Flushed => "IBV_WC_WR_FLUSH_ERR",
            MemoryWindowBind => "IBV_WC_MW_BIND_ERR",
            BadResponse => "IBV_WC_BAD_RESP_ERR",
            LocalAccess => "IBV_WC_LOC_ACCESS_ERR",
            RemoteInvalidRequest => "IBV_WC_REM_INV_REQ_ERR",
            RemoteAccess => "IBV_WC_REM_ACCESS_ERR",
            RemoteOperation => "IBV_WC_REM_OP_ERR",
            RetryExceeded => "IBV_WC_RETRY_EXC_ERR",
            RnrRetryExceeded => "IBV_WC_RNR_RETRY_EXC_ERR",
            LocalRddViolation => "IBV_WC_LOC_RDD_VIOL_ERR",
            RemoteInvalidRdRequest => "IBV_WC_REM_INV_RD_REQ_ERR",
            RemoteAborted => "IBV_WC_REM_ABORT_ERR",
            InvalidEecn => "IBV_WC_INV_EECN_ERR",
            InvalidEecState => "IBV_WC_INV_EEC_STATE_ERR",
            Fatal => "IBV_WC_FATAL_ERR",
            ResponseTimeout => "IBV_WC_RESP_TIMEOUT_ERR",
            General => "IBV_WC_GENERAL_ERR",
            TagMatching => "IBV_WC_TM_ERR",
            TagMatchingRndvIncomplete => "IBV_WC_TM_RNDV_INCOMPLETE",
            Other(_) => "IBV_WC_?",
        }
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let raw = match self {
            WcStatus::Other(v) => Some(*v),
            _ => None,
        };
        let text = ibv::lib().ok().and_then(|l| {
            let v = raw.unwrap_or_else(|| status_raw(*self));
            // SAFETY: returns a static string for any value.
            let p = unsafe { (l.ibv_wc_status_str)(v) };
            // SAFETY: non-NULL static NUL-terminated string.
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        });
        match (text, raw) {
            (Some(t), _) => write!(f, "{t} ({})", self.c_name()),
            (None, Some(v)) => write!(f, "status {v}"),
            (None, None) => f.write_str(self.c_name()),
        }
    }
}

fn status_raw(s: WcStatus) -> u32 {
    (0..=ibv::IBV_WC_TM_RNDV_INCOMPLETE)
        .find(|v| WcStatus::from_raw(*v) == s)
        .unwrap_or(u32::MAX)
}

/// One way of handing GPU memory to a NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum GpuMrPath {
    /// `ibv_reg_dmabuf_mr` over a dma-buf export of the memory.
    DmaBuf,
    /// `ibv_reg_mr` on the device pointer, resolved by the nvidia-peermem kernel module.
    Peermem,
}

impl fmt::Display for GpuMrPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GpuMrPath::DmaBuf => "dma-buf",
            GpuMrPath::Peermem => "nvidia-peermem",
        })
    }
}

/// Why a GPU memory registration path ([`GpuMrPath`]) was not taken.
#[derive(Debug)]
#[non_exhaustive]
pub enum GpuMrRefusal {
    /// The CUDA device reports `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0`: nothing was tried.
    NoDmaBufSupport {
        /// The CUDA device ordinal.
        ordinal: usize,
    },
    /// Neither `nvidia_peermem` nor `nv_peer_mem` is loaded (`/sys/module`): nothing was tried.
    NoPeermemModule,
    /// The path was tried and the stack cannot do it: [`Error::Unsupported`] (for dma-buf:
    /// `ibv_reg_dmabuf_mr` answered `EOPNOTSUPP`, or libibverbs lacks it), or the driver's
    /// `CUDA_ERROR_NOT_SUPPORTED` from the export.
    Unsupported(Error),
    /// The path was tried and failed otherwise (export or registration error, with its errno or
    /// CUDA code).
    Failed(Error),
}

impl GpuMrRefusal {
    /// The error this refusal stands for, when the path was the only one asked for.
    pub fn into_error(self, path: GpuMrPath) -> Error {
        match self {
            GpuMrRefusal::NoDmaBufSupport { ordinal } => Error::Unsupported {
                what: format!("{path} memory registration"),
                reason: format!(
                    "CUDA device {ordinal} reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0"
                ),
            },
            GpuMrRefusal::NoPeermemModule => Error::Unsupported {
                what: format!("{path} memory registration"),
                reason: "neither nvidia_peermem nor nv_peer_mem is loaded (/sys/module)".into(),
            },
            GpuMrRefusal::Unsupported(e) | GpuMrRefusal::Failed(e) => e,
        }
    }

    /// The underlying error, when the path was tried.
    pub fn error(&self) -> Option<&Error> {
        match self {
            GpuMrRefusal::Unsupported(e) | GpuMrRefusal::Failed(e) => Some(e),
            _ => None,
        }
    }
}

impl fmt::Display for GpuMrRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuMrRefusal::NoDmaBufSupport { ordinal } => write!(
                f,
                "not tried: CUDA device {ordinal} reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0"
            ),
            GpuMrRefusal::NoPeermemModule => f.write_str(
                "not tried: neither nvidia_peermem nor nv_peer_mem is loaded (/sys/module)",
            ),
            GpuMrRefusal::Unsupported(e) => write!(f, "unsupported: {e}"),
            GpuMrRefusal::Failed(e) => write!(f, "failed: {e}"),
        }
    }
}

/// The paths refused during one registration, in the order tried, with why. Printable: one
/// `path: refusal` per entry, separated by `; `.
#[derive(Debug, Default)]
pub struct GpuMrAttempts(pub Vec<(GpuMrPath, GpuMrRefusal)>);

impl GpuMrAttempts {
    /// The entries.
    pub fn as_slice(&self) -> &[(GpuMrPath, GpuMrRefusal)] {
        &self.0
    }

    /// The refusal recorded for `path`, if it was refused.
    pub fn refusal(&self, path: GpuMrPath) -> Option<&GpuMrRefusal> {
        self.0.iter().find(|(p, _)| *p == path).map(|(_, r)| r)
    }

    /// Whether no path was refused.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Display for GpuMrAttempts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("no path refused");
        }
        for (i, (p, r)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{p}: {r}")?;
        }
        Ok(())
    }
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
            Error::Authentication {
                peer: "10.0.0.1:7400".into(),
                reason: "wrong key".into(),
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

    #[test]
    fn statuses_round_trip_and_name_themselves() {
        for v in 0..=ibv::IBV_WC_TM_RNDV_INCOMPLETE {
            let s = WcStatus::from_raw(v);
            assert!(!matches!(s, WcStatus::Other(_)), "{v}");
            assert_eq!(status_raw(s), v);
        }
        assert_eq!(
            WcStatus::from_raw(ibv::IBV_WC_WR_FLUSH_ERR),
            WcStatus::Flushed
        );
        assert_eq!(WcStatus::RemoteAccess.c_name(), "IBV_WC_REM_ACCESS_ERR");
        assert!(
            WcStatus::RetryExceeded
                .to_string()
                .contains("IBV_WC_RETRY_EXC_ERR")
        );
    }
}
