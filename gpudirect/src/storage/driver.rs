//! The cuFile driver: opened once per process, on the first [`Driver::open`], and never closed.

use super::status::{check, cufile_error};
use crate::error::{Error, Result};
use gpudirect_sys::cufile as sys;
use std::ffi::CString;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

/// Process-wide state opened once: the first [`ensure`](Self::ensure) runs the open, under the
/// lock every open and staged-parameter call takes; a failed open leaves it closed, so a later
/// call tries again. Nothing closes it.
pub(crate) struct OnceOpen {
    /// Whether it is open.
    open: Mutex<bool>,
    /// The process that opened it (0: none), read without the lock so that a forked child never
    /// waits on a lock a thread of its parent held at the fork.
    opened_by: AtomicU32,
}

impl OnceOpen {
    pub(crate) const fn new() -> Self {
        OnceOpen {
            open: Mutex::new(false),
            opened_by: AtomicU32::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, bool> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Run `open` (under the lock) unless process `pid` has opened it already. Refused in a
    /// process other than the one that opened it (a forked child: the parent's driver state is
    /// not usable there).
    pub(crate) fn ensure(&self, pid: u32, open: impl FnOnce() -> Result<()>) -> Result<()> {
        match self.opened_by.load(Ordering::Acquire) {
            0 => {}
            p if p == pid => return Ok(()),
            p => return Err(forked_child(p)),
        }
        let mut is_open = self.lock();
        if *is_open {
            // Opened by another thread meanwhile (by this process: a child's copy of the flag
            // is seen above before the lock).
            return match self.opened_by.load(Ordering::Acquire) {
                p if p == pid => Ok(()),
                p => Err(forked_child(p)),
            };
        }
        open()?;
        self.opened_by.store(pid, Ordering::Release);
        *is_open = true;
        Ok(())
    }

    /// Run `f` under the lock, with whether it is open (no open can run meanwhile). Refused,
    /// without waiting on the lock, in process `pid` when another process opened it: a forked
    /// child would wait forever on a lock a thread of its parent held at the fork, and the
    /// parent's driver state is not usable there.
    pub(crate) fn with_lock<R>(&self, pid: u32, f: impl FnOnce(bool) -> R) -> Result<R> {
        match self.opened_by.load(Ordering::Acquire) {
            p if p != 0 && p != pid => Err(forked_child(p)),
            _ => Ok(f(*self.lock())),
        }
    }

    /// Whether it is open.
    #[cfg(test)]
    pub(crate) fn is_open(&self) -> bool {
        *self.lock()
    }
}

fn forked_child(parent: u32) -> Error {
    Error::Unsupported {
        what: "cuFile in a forked child".into(),
        reason: format!(
            "the cuFile driver was opened by process {parent}; its state does not carry over to \
             a child made by fork (open cuFile in the child only, or exec a new program)"
        ),
    }
}

/// The cuFile driver's process-wide state; also serializes the staged parameters with the open.
static DRIVER: OnceOpen = OnceOpen::new();

/// A handle to the process's cuFile driver. The first [`Driver::open`] of the process calls
/// `cuFileDriverOpen` (serialized with every other open and the staged parameters
/// ([`SizeParam`], [`BoolParam`], [`StringParam`]) under one process-wide lock; a failed open is
/// tried again by the next one); later opens, clones and drops cost nothing.
///
/// The driver is never closed while the process runs: dropping every `Driver`, handle and
/// registration does not call `cuFileDriverClose_v2`, and there is no close method. Closing and
/// reopening the driver is what broke it: with cuFile 1.15, opening and closing it from eight
/// threads at once threw a C++ exception out of cuFile (which aborts a Rust program), and each
/// close and reopen was slow even from one thread (`docs/storage.md`, "cuFile 1.15's
/// failures"). Other cuFile users keep
/// it open for the life of the process too (KvikIO opens it in a process-wide singleton). What
/// that means: the driver's resources (its threads, bounce buffers and pinned memory) stay until
/// the process exits, and parameters staged with [`SizeParam::set`] and friends only take effect
/// when set before the first [`Driver::open`].
///
/// cuFile is a C++ library: an exception it throws cannot be caught in Rust and aborts the
/// process. The library avoids the churn known to throw; it cannot rule out others.
#[derive(Clone)]
pub struct Driver {
    lib: &'static sys::Lib,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("path", &self.lib.path())
            .field("version", &self.lib.version())
            .finish()
    }
}

impl Driver {
    /// `cuFileDriverOpen()`—Open the process's cuFile driver on the first call, or hand out
    /// another handle to it.
    ///
    /// Checks libcuda first (and runs `cuInit`), so this works as a program's first CUDA call
    /// and a missing libcuda is a typed error rather than a hang inside libcufile. Only the first
    /// successful call of the process opens the driver (slow in compatibility mode:
    /// `docs/storage.md`); it stays open until the process exits (see [`Driver`] for why).
    ///
    /// # Errors
    ///
    /// [`Error::Load`] without libcuda or libcufile (naming the files tried),
    /// [`Error::DriverTooOld`], [`Error::NoDevice`] without a GPU, [`Error::CuFile`] when
    /// `cuFileDriverOpen` fails (5001 `CU_FILE_DRIVER_NOT_INITIALIZED` without nvidia-fs when
    /// compatibility mode is off; a later call tries again), [`Error::Unsupported`] in a forked
    /// child of the process that opened it.
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/gpudirect-storage/api-reference-guide/index.html#cufiledriveropen>
    #[doc(alias = "cuFileDriverOpen")]
    pub fn open() -> Result<Driver> {
        let lib = sys::lib()?;
        crate::cuda::init()?;
        if crate::cuda::device_count()? == 0 {
            return Err(Error::NoDevice {
                what: "CUDA device",
                reason: "cuDeviceGetCount reports 0 devices".into(),
            });
        }
        DRIVER.ensure(std::process::id(), || {
            // SAFETY: libcuda is present and initialised; no arguments; the lock keeps any other
            // open and every staged-parameter call from running beside it.
            check("cuFileDriverOpen", unsafe { (lib.cuFileDriverOpen)() })
        })?;
        Ok(Driver { lib })
    }

    pub(crate) fn lib(&self) -> &'static sys::Lib {
        self.lib
    }

    /// `cuFileGetVersion`: the library version as `1000 * major + 10 * minor` (1150 for 1.15).
    #[doc(alias = "cuFileGetVersion")]
    pub fn version(&self) -> Option<i32> {
        self.lib.version()
    }

    /// Where libcufile was loaded from.
    pub fn library_path(&self) -> &str {
        self.lib.path()
    }

    /// `cuFileUseCount()`: how many cuFile operations are in flight.
    #[doc(alias = "cuFileUseCount")]
    pub fn use_count(&self) -> std::ffi::c_long {
        // SAFETY: no arguments.
        unsafe { (self.lib.cuFileUseCount)() }
    }

    /// `cuFileDriverGetProperties(props)`—The driver's properties, read through the layout of the
    /// version found (identical in 1.14–1.20, with slack for a larger future struct).
    ///
    /// # Errors
    ///
    /// [`Error::CuFile`] from `cuFileDriverGetProperties`.
    #[doc(alias = "cuFileDriverGetProperties")]
    pub fn properties(&self) -> Result<DriverProperties> {
        // Under the driver's lock: cuFile 1.15 crashed (a segfault, or a C++ exception thrown out
        // of it) when several threads read the properties at once (docs/storage.md).
        let p = DRIVER
            // SAFETY: the driver is open while self lives.
            .with_lock(std::process::id(), |_| unsafe {
                self.lib.driver_properties()
            })?
            .map_err(|e| cufile_error("cuFileDriverGetProperties", e.err, e.cu_err))?;
        Ok(DriverProperties {
            nvfs_version: (p.nvfs.major_version, p.nvfs.minor_version),
            poll_threshold_kib: p.nvfs.poll_thresh_size,
            max_direct_io_kib: p.nvfs.max_direct_io_size,
            fs_support: FsSupport::from_bits_retain(p.nvfs.dstatusflags),
            use_poll_mode: p.nvfs.dcontrolflags & (1 << sys::CU_FILE_USE_POLL_MODE) != 0,
            allow_compat_mode: p.nvfs.dcontrolflags & (1 << sys::CU_FILE_ALLOW_COMPAT_MODE) != 0,
            batch_io_supported: p.fflags & (1 << sys::CU_FILE_BATCH_IO_SUPPORTED) != 0,
            streams_supported: p.fflags & (1 << sys::CU_FILE_STREAMS_SUPPORTED) != 0,
            feature_flags: p.fflags,
            max_device_cache_kib: p.max_device_cache_size,
            per_buffer_cache_kib: p.per_buffer_cache_size,
            max_device_pinned_mem_kib: p.max_device_pinned_mem_size,
            max_batch_io_size: p.max_batch_io_size,
            max_batch_io_timeout_ms: p.max_batch_io_timeout_msecs,
        })
    }

    /// `cuFileDriverSetPollMode(poll, threshold)`: poll for completions of requests up to
    /// `threshold_kib` KiB.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `threshold_kib` KiB is not representable in bytes;
    /// [`Error::CuFile`].
    #[doc(alias = "cuFileDriverSetPollMode")]
    pub fn set_poll_mode(&self, poll: bool, threshold_kib: usize) -> Result<()> {
        check_kib("threshold_kib", threshold_kib, KIB_AS_BYTES_MAX)?;
        // SAFETY: plain values.
        check("cuFileDriverSetPollMode", unsafe {
            (self.lib.cuFileDriverSetPollMode)(poll, threshold_kib)
        })
    }

    /// `cuFileDriverSetMaxDirectIOSize(kib)`: the largest direct I/O, in KiB.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `kib` KiB is not representable in bytes; [`Error::CuFile`] (`CU_FILE_DRIVER_UNSUPPORTED_LIMIT` out of range).
    #[doc(alias = "cuFileDriverSetMaxDirectIOSize")]
    pub fn set_max_direct_io_kib(&self, kib: usize) -> Result<()> {
        check_kib("kib", kib, KIB_AS_BYTES_MAX)?;
        // SAFETY: plain value.
        check("cuFileDriverSetMaxDirectIOSize", unsafe {
            (self.lib.cuFileDriverSetMaxDirectIOSize)(kib)
        })
    }

    /// `cuFileDriverSetMaxCacheSize(kib)`: GPU bounce-buffer cache per GPU, in KiB.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] over `u32::MAX` (the driver keeps it as 32 bits);
    /// [`Error::CuFile`].
    #[doc(alias = "cuFileDriverSetMaxCacheSize")]
    pub fn set_max_cache_kib(&self, kib: usize) -> Result<()> {
        check_kib("kib", kib, u32::MAX as usize)?;
        // SAFETY: plain value.
        check("cuFileDriverSetMaxCacheSize", unsafe {
            (self.lib.cuFileDriverSetMaxCacheSize)(kib)
        })
    }

    /// `cuFileDriverSetMaxPinnedMemSize(kib)`: the most memory `cuFileBufRegister` may pin, KiB.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] over `u32::MAX` (the driver keeps it as 32 bits);
    /// [`Error::CuFile`].
    #[doc(alias = "cuFileDriverSetMaxPinnedMemSize")]
    pub fn set_max_pinned_mem_kib(&self, kib: usize) -> Result<()> {
        check_kib("kib", kib, u32::MAX as usize)?;
        // SAFETY: plain value.
        check("cuFileDriverSetMaxPinnedMemSize", unsafe {
            (self.lib.cuFileDriverSetMaxPinnedMemSize)(kib)
        })
    }

    /// The largest number of requests one [`Batch`](super::Batch) may hold: the driver's
    /// `max_batch_io_size`, or 128 where it reports 0.
    #[doc(alias = "cuFileDriverGetProperties")]
    pub fn max_batch_entries(&self) -> usize {
        match self.properties() {
            Ok(p) if p.max_batch_io_size > 0 => p.max_batch_io_size as usize,
            _ => 128,
        }
    }
}

/// The most KiB whose byte count fits a `usize`.
const KIB_AS_BYTES_MAX: usize = usize::MAX / 1024;

/// Check a size argument `arg` of `kib` KiB against `max`.
pub(crate) fn check_kib(arg: &'static str, kib: usize, max: usize) -> Result<()> {
    if kib > max {
        return Err(Error::invalid(arg, kib, format!("must be at most {max}")));
    }
    Ok(())
}

bitflags::bitflags! {
    /// `CUfileDriverStatusFlags_t`: file systems and devices the driver supports directly.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    #[repr(transparent)]
    pub struct FsSupport: u32 {
        /// `CU_FILE_LUSTRE_SUPPORTED`.
        const LUSTRE = 1 << 0;
        /// `CU_FILE_WEKAFS_SUPPORTED`.
        const WEKAFS = 1 << 1;
        /// `CU_FILE_NFS_SUPPORTED`.
        const NFS = 1 << 2;
        /// `CU_FILE_GPFS_SUPPORTED`.
        const GPFS = 1 << 3;
        /// `CU_FILE_NVME_SUPPORTED`.
        const NVME = 1 << 4;
        /// `CU_FILE_NVMEOF_SUPPORTED`.
        const NVMEOF = 1 << 5;
        /// `CU_FILE_SCSI_SUPPORTED`.
        const SCSI = 1 << 6;
        /// `CU_FILE_SCALEFLUX_CSD_SUPPORTED`.
        const SCALEFLUX_CSD = 1 << 7;
        /// `CU_FILE_NVMESH_SUPPORTED`.
        const NVMESH = 1 << 8;
        /// `CU_FILE_BEEGFS_SUPPORTED`.
        const BEEGFS = 1 << 9;
        /// `CU_FILE_NVME_P2P_SUPPORTED`.
        const NVME_P2P = 1 << 11;
        /// `CU_FILE_SCATEFS_SUPPORTED`.
        const SCATEFS = 1 << 12;
        /// `CU_FILE_VIRTIOFS_SUPPORTED` (1.20).
        const VIRTIOFS = 1 << 13;
        /// `CU_FILE_PANFS_SUPPORTED` (1.20).
        const PANFS = 1 << 14;
        const _ = !0;
    }
}

/// `CUfileDrvProps_t`, typed. Sizes are in KiB as the driver reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DriverProperties {
    /// nvidia-fs version `(major, minor)`; `(0, 0)` without nvidia-fs (compatibility mode only).
    pub nvfs_version: (u32, u32),
    /// `poll_thresh_size`, KiB.
    pub poll_threshold_kib: usize,
    /// `max_direct_io_size`, KiB.
    pub max_direct_io_kib: usize,
    /// `dstatusflags`.
    pub fs_support: FsSupport,
    /// `dcontrolflags` bit `CU_FILE_USE_POLL_MODE`.
    pub use_poll_mode: bool,
    /// `dcontrolflags` bit `CU_FILE_ALLOW_COMPAT_MODE`.
    pub allow_compat_mode: bool,
    /// `fflags` bit `CU_FILE_BATCH_IO_SUPPORTED`.
    pub batch_io_supported: bool,
    /// `fflags` bit `CU_FILE_STREAMS_SUPPORTED`.
    pub streams_supported: bool,
    /// `fflags`, raw.
    pub feature_flags: u32,
    /// `max_device_cache_size`, KiB.
    pub max_device_cache_kib: u32,
    /// `per_buffer_cache_size`, KiB.
    pub per_buffer_cache_kib: u32,
    /// `max_device_pinned_mem_size`, KiB.
    pub max_device_pinned_mem_kib: u32,
    /// `max_batch_io_size`: entries per batch.
    pub max_batch_io_size: u32,
    /// `max_batch_io_timeout_msecs`.
    pub max_batch_io_timeout_ms: u32,
}

impl DriverProperties {
    /// Whether nvidia-fs is loaded (true GPUDirect); otherwise cuFile runs in compatibility mode
    /// (POSIX reads through its own bounce buffers).
    pub fn has_nvidia_fs(&self) -> bool {
        self.nvfs_version != (0, 0)
    }
}

macro_rules! params {
    ($(#[$m:meta])* $name:ident : $cty:ty { $($(#[$vm:meta])* $v:ident = $c:ident since $since:literal,)* }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum $name { $($(#[$vm])* #[doc = concat!("`", stringify!($c), "`.")] $v,)* }
        impl $name {
            /// The C value.
            pub fn raw(self) -> $cty { match self { $($name::$v => sys::$c,)* } }
            /// The oldest cuFile version (`1000 * major + 10 * minor`) that knows it.
            pub fn since(self) -> i32 { match self { $($name::$v => $since,)* } }
            /// The C name.
            pub fn c_name(self) -> &'static str { match self { $($name::$v => stringify!($c),)* } }
        }
    };
}

params!(
    /// `CUFileSizeTConfigParameter_t`: numeric parameters (`cufile.json` keys).
    SizeParam: sys::CUFileSizeTConfigParameter_t {
        ProfileStats = CUFILE_PARAM_PROFILE_STATS since 1140,
        MaxIoQueueDepth = CUFILE_PARAM_EXECUTION_MAX_IO_QUEUE_DEPTH since 1140,
        MaxIoThreads = CUFILE_PARAM_EXECUTION_MAX_IO_THREADS since 1140,
        MinIoThresholdKib = CUFILE_PARAM_EXECUTION_MIN_IO_THRESHOLD_SIZE_KB since 1140,
        MaxRequestParallelism = CUFILE_PARAM_EXECUTION_MAX_REQUEST_PARALLELISM since 1140,
        MaxDirectIoKib = CUFILE_PARAM_PROPERTIES_MAX_DIRECT_IO_SIZE_KB since 1140,
        MaxDeviceCacheKib = CUFILE_PARAM_PROPERTIES_MAX_DEVICE_CACHE_SIZE_KB since 1140,
        PerBufferCacheKib = CUFILE_PARAM_PROPERTIES_PER_BUFFER_CACHE_SIZE_KB since 1140,
        MaxDevicePinnedMemKib = CUFILE_PARAM_PROPERTIES_MAX_DEVICE_PINNED_MEM_SIZE_KB since 1140,
        IoBatchSize = CUFILE_PARAM_PROPERTIES_IO_BATCHSIZE since 1140,
        PollThresholdKib = CUFILE_PARAM_POLLTHRESHOLD_SIZE_KB since 1140,
        BatchIoTimeoutMs = CUFILE_PARAM_PROPERTIES_BATCH_IO_TIMEOUT_MS since 1140,
    }
);

params!(
    /// `CUFileBoolConfigParameter_t`: on/off parameters.
    BoolParam: sys::CUFileBoolConfigParameter_t {
        UsePollMode = CUFILE_PARAM_PROPERTIES_USE_POLL_MODE since 1140,
        AllowCompatMode = CUFILE_PARAM_PROPERTIES_ALLOW_COMPAT_MODE since 1140,
        ForceCompatMode = CUFILE_PARAM_FORCE_COMPAT_MODE since 1140,
        FsMiscApiCheckAggressive = CUFILE_PARAM_FS_MISC_API_CHECK_AGGRESSIVE since 1140,
        ParallelIo = CUFILE_PARAM_EXECUTION_PARALLEL_IO since 1140,
        ProfileNvtx = CUFILE_PARAM_PROFILE_NVTX since 1140,
        AllowSystemMemory = CUFILE_PARAM_PROPERTIES_ALLOW_SYSTEM_MEMORY since 1140,
        UsePciP2pDma = CUFILE_PARAM_USE_PCIP2PDMA since 1140,
        PreferIoUring = CUFILE_PARAM_PREFER_IO_URING since 1140,
        ForceODirectMode = CUFILE_PARAM_FORCE_ODIRECT_MODE since 1140,
        SkipTopologyDetection = CUFILE_PARAM_SKIP_TOPOLOGY_DETECTION since 1140,
        StreamMemopsBypass = CUFILE_PARAM_STREAM_MEMOPS_BYPASS since 1140,
        /// Vanilla POSIX I/O mode (1.20).
        PosixIoMode = CUFILE_PARAM_PROPERTIES_POSIX_IO_MODE since 1200,
        /// Fall back to POSIX I/O where GDS fails (1.20).
        GdsFallbackIo = CUFILE_PARAM_GDS_FALLBACK_IO since 1200,
    }
);

params!(
    /// `CUFileStringConfigParameter_t`: string parameters.
    StringParam: sys::CUFileStringConfigParameter_t {
        LoggingLevel = CUFILE_PARAM_LOGGING_LEVEL since 1140,
        LogfilePath = CUFILE_PARAM_ENV_LOGFILE_PATH since 1140,
        LogDir = CUFILE_PARAM_LOG_DIR since 1140,
        /// RDMA transport selection (1.20).
        RdmaTransport = CUFILE_PARAM_RDMA_TRANSPORT since 1200,
    }
);

/// Refuse a parameter the loaded library is too old to know (its number would mean nothing, or
/// something else).
fn gate(lib: &sys::Lib, name: &'static str, since: i32) -> Result<()> {
    match lib.version() {
        Some(v) if v >= since => Ok(()),
        found => Err(Error::Unsupported {
            what: format!("cuFile parameter {name}"),
            reason: format!("needs cuFile {since} or newer, the library reports {found:?}"),
        }),
    }
}

/// Run `f`, a cuFile call that changes the library's process-wide tables (buffer, file handle and
/// batch registration and their release), under the driver's lock. cuFile documents its I/O
/// calls as thread-safe, but 1.15 in compatibility mode corrupted its heap
/// (`malloc(): unaligned tcache chunk detected`) when eight threads registered and deregistered
/// buffers at once, as it crashed when they read the properties at once (`docs/storage.md`).
/// These calls set up and tear down; I/O never takes this lock. Refused in a forked child (see
/// [`OnceOpen::with_lock`]).
pub(crate) fn serialized<R>(f: impl FnOnce() -> R) -> Result<R> {
    DRIVER.with_lock(std::process::id(), |_| f())
}

/// [`serialized`] for a call that returns a status, checked as the C function `call`.
pub(crate) fn serialized_call(
    call: &'static str,
    f: impl FnOnce() -> sys::CUfileError_t,
) -> Result<()> {
    serialized(f).and_then(|r| check(call, r))
}

/// One parameter call of a parameter `name` that needs cuFile `since`: the library loaded and
/// new enough (checked first), then `f` under the driver's lock (no open runs beside it), its
/// result checked as the C function `call`.
fn param_call(
    name: &'static str,
    since: i32,
    call: &'static str,
    f: impl FnOnce(&'static sys::Lib) -> sys::CUfileError_t,
) -> Result<()> {
    let lib = sys::lib()?;
    gate(lib, name, since)?;
    serialized_call(call, || f(lib))
}

impl SizeParam {
    /// The largest value [`set`](Self::set) accepts: the byte count of a KiB size must fit a
    /// `usize`, and values the driver keeps as 32 bits (counts, cache and pinned sizes, the batch
    /// size and time-out) must fit a `u32`.
    pub fn max_value(self) -> usize {
        match self {
            SizeParam::MinIoThresholdKib
            | SizeParam::MaxDirectIoKib
            | SizeParam::PollThresholdKib => KIB_AS_BYTES_MAX,
            _ => u32::MAX as usize,
        }
    }

    /// `cuFileGetParameterSizeT(param, &value)`: the current value (or the staged one before
    /// the driver is opened). Needs no open driver.
    ///
    /// # Errors
    ///
    /// [`Error::Load`], [`Error::Unsupported`] for a parameter newer than the library,
    /// [`Error::CuFile`].
    #[doc(alias = "cuFileGetParameterSizeT")]
    pub fn get(self) -> Result<usize> {
        let mut v = 0usize;
        param_call(
            self.c_name(),
            self.since(),
            "cuFileGetParameterSizeT",
            |lib| {
                // SAFETY: a known parameter and one valid out-pointer.
                unsafe { (lib.cuFileGetParameterSizeT)(self.raw(), &mut v) }
            },
        )?;
        Ok(v)
    }

    /// `cuFileSetParameterSizeT(param, value)`: stage a value for the driver's open. The process
    /// opens the driver once and never closes it, so set it before the first [`Driver::open`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] over [`max_value`](Self::max_value) (checked first); as
    /// [`get`](Self::get); `CU_FILE_DRIVER_ALREADY_OPEN` once the driver is open.
    #[doc(alias = "cuFileSetParameterSizeT")]
    pub fn set(self, value: usize) -> Result<()> {
        check_kib("value", value, self.max_value())?;
        param_call(
            self.c_name(),
            self.since(),
            "cuFileSetParameterSizeT",
            |lib| {
                // SAFETY: plain values.
                unsafe { (lib.cuFileSetParameterSizeT)(self.raw(), value) }
            },
        )
    }
}

impl BoolParam {
    /// `cuFileGetParameterBool(param, &value)`.
    ///
    /// # Errors
    ///
    /// As [`SizeParam::get`].
    #[doc(alias = "cuFileGetParameterBool")]
    pub fn get(self) -> Result<bool> {
        let mut v = false;
        param_call(
            self.c_name(),
            self.since(),
            "cuFileGetParameterBool",
            |lib| {
                // SAFETY: a known parameter and one valid out-pointer.
                unsafe { (lib.cuFileGetParameterBool)(self.raw(), &mut v) }
            },
        )?;
        Ok(v)
    }

    /// `cuFileSetParameterBool(param, value)`: staged for the driver's open (before the first
    /// [`Driver::open`]).
    ///
    /// # Errors
    ///
    /// As [`SizeParam::set`].
    #[doc(alias = "cuFileSetParameterBool")]
    pub fn set(self, value: bool) -> Result<()> {
        param_call(
            self.c_name(),
            self.since(),
            "cuFileSetParameterBool",
            |lib| {
                // SAFETY: plain values.
                unsafe { (lib.cuFileSetParameterBool)(self.raw(), value) }
            },
        )
    }
}

impl StringParam {
    /// `cuFileGetParameterString(param, buf, len)`.
    ///
    /// # Errors
    ///
    /// As [`SizeParam::get`].
    #[doc(alias = "cuFileGetParameterString")]
    pub fn get(self) -> Result<String> {
        const LEN: usize = 4096;
        let mut buf = vec![0 as libc::c_char; LEN];
        param_call(
            self.c_name(),
            self.since(),
            "cuFileGetParameterString",
            |lib| {
                // SAFETY: the buffer holds LEN (< i32::MAX) bytes.
                unsafe { (lib.cuFileGetParameterString)(self.raw(), buf.as_mut_ptr(), LEN as i32) }
            },
        )?;
        *buf.last_mut().expect("non-empty") = 0;
        // SAFETY: NUL-terminated above.
        Ok(unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    /// `cuFileSetParameterString(param, value)`: staged for the driver's open (before the first
    /// [`Driver::open`]).
    ///
    /// # Errors
    ///
    /// As [`SizeParam::set`]; [`Error::InvalidArgument`] if `value` holds a NUL.
    #[doc(alias = "cuFileSetParameterString")]
    pub fn set(self, value: &str) -> Result<()> {
        let c = CString::new(value)
            .map_err(|_| Error::invalid("value", value, "must not contain NUL"))?;
        param_call(
            self.c_name(),
            self.since(),
            "cuFileSetParameterString",
            |lib| {
                // SAFETY: a NUL-terminated string valid for the call.
                unsafe { (lib.cuFileSetParameterString)(self.raw(), c.as_ptr()) }
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering::SeqCst;
    use std::sync::atomic::{AtomicBool, AtomicUsize};

    #[test]
    fn parameters_map_to_the_header_values() {
        assert_eq!(SizeParam::IoBatchSize.raw(), 9);
        assert_eq!(BoolParam::AllowCompatMode.raw(), 1);
        assert_eq!(StringParam::LogDir.raw(), 2);
        assert_eq!(
            SizeParam::MaxDirectIoKib.c_name(),
            "CUFILE_PARAM_PROPERTIES_MAX_DIRECT_IO_SIZE_KB"
        );
    }

    #[test]
    fn newer_parameters_say_their_version() {
        assert_eq!(BoolParam::GdsFallbackIo.since(), 1200);
        assert_eq!(BoolParam::GdsFallbackIo.raw(), 13);
        assert_eq!(StringParam::RdmaTransport.raw(), 3);
        assert_eq!(SizeParam::IoBatchSize.since(), 1140);
    }

    /// A fake driver: opens check that they never overlap each other, and a holder checks that
    /// the driver is open whenever it uses it.
    #[derive(Default)]
    struct Fake {
        busy: AtomicBool,
        open: AtomicBool,
        opens: AtomicUsize,
        attempts: AtomicUsize,
        /// Fail this many open attempts first.
        fail_first: AtomicUsize,
    }

    impl Fake {
        fn open(&self) -> Result<()> {
            assert!(!self.busy.swap(true, SeqCst), "open overlapped an open");
            assert!(!self.open.load(SeqCst), "opened twice");
            self.attempts.fetch_add(1, SeqCst);
            std::thread::yield_now();
            let fail = self
                .fail_first
                .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                .is_ok();
            if !fail {
                self.open.store(true, SeqCst);
                self.opens.fetch_add(1, SeqCst);
            }
            self.busy.store(false, SeqCst);
            if fail {
                Err(Error::invalid("x", 1, "refused"))
            } else {
                Ok(())
            }
        }
        /// A registration or handle: the driver must be open while it is used.
        fn use_it(&self) {
            assert!(self.open.load(SeqCst), "used while closed");
        }
    }

    const PID: u32 = 4242;

    #[test]
    fn eight_threads_open_register_and_drop_200_times_and_it_opens_once() {
        let once = OnceOpen::new();
        let fake = Fake::default();
        std::thread::scope(|s| {
            for t in 0..8 {
                let (once, fake) = (&once, &fake);
                s.spawn(move || {
                    for i in 0..200 {
                        // The driver, then a registration holding its own handle; every other
                        // round the driver handle goes first. Dropping handles closes nothing.
                        once.ensure(PID, || fake.open()).unwrap();
                        fake.use_it();
                        once.ensure(PID, || fake.open()).unwrap();
                        if (t + i) % 2 == 0 {
                            fake.use_it();
                        }
                        fake.use_it();
                    }
                });
            }
        });
        assert!(once.is_open());
        assert!(fake.open.load(SeqCst));
        assert_eq!(fake.opens.load(SeqCst), 1, "opened exactly once");
    }

    #[test]
    fn parameters_wait_for_a_running_open() {
        let once = OnceOpen::new();
        let fake = Fake::default();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..200 {
                        once.ensure(PID, || fake.open()).unwrap();
                    }
                });
                s.spawn(|| {
                    for _ in 0..200 {
                        // A staged parameter: no open runs meanwhile.
                        once.with_lock(PID, |open| {
                            assert!(!fake.busy.load(SeqCst));
                            assert_eq!(open, fake.open.load(SeqCst));
                        })
                        .unwrap();
                    }
                });
            }
        });
        assert_eq!(fake.opens.load(SeqCst), 1);
    }

    #[test]
    fn a_failed_open_takes_nothing_and_a_later_one_opens() {
        let once = OnceOpen::new();
        let fake = Fake::default();
        fake.fail_first.store(2, SeqCst);
        for _ in 0..2 {
            let e = once.ensure(PID, || fake.open()).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }));
            assert!(!once.is_open());
        }
        once.ensure(PID, || fake.open()).unwrap();
        once.ensure(PID, || fake.open()).unwrap();
        assert_eq!(
            (fake.attempts.load(SeqCst), fake.opens.load(SeqCst)),
            (3, 1)
        );
    }

    #[test]
    fn failed_opens_from_many_threads_are_retried_one_at_a_time() {
        let once = OnceOpen::new();
        let fake = Fake::default();
        fake.fail_first.store(50, SeqCst);
        let oks = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..20 {
                        if once.ensure(PID, || fake.open()).is_ok() {
                            oks.fetch_add(1, SeqCst);
                            fake.use_it();
                        }
                    }
                });
            }
        });
        assert_eq!(fake.attempts.load(SeqCst), 51, "50 failures, then one open");
        assert_eq!(fake.opens.load(SeqCst), 1);
        assert_eq!(oks.load(SeqCst), 8 * 20 - 50);
    }

    #[test]
    fn a_forked_child_does_not_use_its_parents_driver() {
        let once = OnceOpen::new();
        let fake = Fake::default();
        once.ensure(PID, || fake.open()).unwrap();
        let e = once.ensure(PID + 1, || fake.open()).unwrap_err();
        assert!(matches!(e, Error::Unsupported { .. }), "{e}");
        assert!(e.to_string().contains("forked child"), "{e}");
        assert_eq!(
            fake.attempts.load(SeqCst),
            1,
            "no open attempted in the child"
        );
        // Nor any call under the lock, which a thread of the parent may have held at the fork:
        // refused without waiting for it.
        let held = once.lock();
        let e = once.with_lock(PID + 1, |_| ()).unwrap_err();
        assert!(e.to_string().contains("forked child"), "{e}");
        drop(held);
        once.with_lock(PID, |open| assert!(open)).unwrap();
    }

    #[test]
    fn opening_without_the_library_from_many_threads_is_a_typed_error() {
        if sys::lib().is_ok() {
            println!("SKIPPED: libcufile is present (the GPU tests cover the real driver)");
            return;
        }
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..200 {
                        let e = Driver::open().unwrap_err();
                        assert!(matches!(e, Error::Load(_)), "{e}");
                        assert!(SizeParam::IoBatchSize.get().is_err());
                    }
                });
            }
        });
        assert!(!DRIVER.is_open());
    }

    proptest::proptest! {
        #[test]
        fn kib_sizes_are_bounded(kib: usize, max: usize) {
            proptest::prop_assert_eq!(check_kib("kib", kib, max).is_ok(), kib <= max);
        }

        #[test]
        fn size_parameters_fit_what_the_driver_keeps(value: usize, which in 0usize..12) {
            let all = [
                SizeParam::ProfileStats,
                SizeParam::MaxIoQueueDepth,
                SizeParam::MaxIoThreads,
                SizeParam::MinIoThresholdKib,
                SizeParam::MaxRequestParallelism,
                SizeParam::MaxDirectIoKib,
                SizeParam::MaxDeviceCacheKib,
                SizeParam::PerBufferCacheKib,
                SizeParam::MaxDevicePinnedMemKib,
                SizeParam::IoBatchSize,
                SizeParam::PollThresholdKib,
                SizeParam::BatchIoTimeoutMs,
            ];
            let p = all[which];
            let ok = check_kib("value", value, p.max_value()).is_ok();
            if p.c_name().ends_with("_KB") {
                // The byte count fits a usize (and a 32-bit field where the driver keeps one).
                proptest::prop_assert!(!ok || (value as u128) * 1024 <= usize::MAX as u128);
            }
            proptest::prop_assert!(!ok || value <= u32::MAX as usize || p.c_name().ends_with("_KB"));
            proptest::prop_assert_eq!(ok, value <= p.max_value());
        }
    }

    #[test]
    fn fs_flags_keep_unknown_bits() {
        let f = FsSupport::from_bits_retain((1 << 4) | (1 << 30));
        assert!(f.contains(FsSupport::NVME));
        assert_eq!(f.bits(), (1 << 4) | (1 << 30));
    }
}
