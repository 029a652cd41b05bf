//! The cuFile driver: opened once per process while any [`Driver`] value lives.

use super::{check, sys};
use crate::error::{Error, Result};
use std::ffi::CString;
use std::sync::{Arc, Mutex, Weak};

struct Inner {
    lib: &'static sys::Lib,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if crate::memory::Tracker::global().in_forked_child() {
            return; // no cuFile calls in a forked child
        }
        // Every FileHandle, registration and in-flight operation holds a Driver, so nothing is
        // outstanding here. Errors cannot be reported from a drop and are ignored.
        // SAFETY: the driver was opened by Driver::open and nothing uses it any more.
        let _ = unsafe { (self.lib.cuFileDriverClose_v2)() };
    }
}

/// The cuFile driver, reference-counted: the first [`Driver::open`] of the process calls
/// `cuFileDriverOpen`, dropping the last clone (and every handle, registration and operation that
/// holds one) calls `cuFileDriverClose_v2`.
#[derive(Clone)]
pub struct Driver {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("path", &self.inner.lib.path())
            .field("version", &self.inner.lib.version())
            .finish()
    }
}

impl Driver {
    /// `cuFileDriverOpen()`—Open the cuFile driver, or share the one already open.
    ///
    /// Checks libcuda first (and runs `cuInit`), so this works as a program's first CUDA call
    /// (A13) and a missing libcuda is a typed error rather than a hang inside libcufile.
    ///
    /// # Errors
    ///
    /// [`Error::Load`] without libcuda or libcufile (naming the files tried),
    /// [`Error::DriverTooOld`], [`Error::NoDevice`] without a GPU, [`Error::CuFile`] when
    /// `cuFileDriverOpen` fails (5001 `CU_FILE_DRIVER_NOT_INITIALIZED` without nvidia-fs when
    /// compatibility mode is off).
    ///
    /// # C function
    ///
    /// <https://docs.nvidia.com/gpudirect-storage/api-reference-guide/index.html#cufiledriveropen>
    #[doc(alias = "cuFileDriverOpen")]
    pub fn open() -> Result<Driver> {
        static CURRENT: Mutex<Weak<Inner>> = Mutex::new(Weak::new());
        let lib = sys::lib()?;
        crate::cuda::init()?;
        if crate::cuda::device_count()? == 0 {
            return Err(Error::NoDevice {
                what: "CUDA device",
                reason: "cuDeviceGetCount reports 0 devices".into(),
            });
        }
        let mut cur = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(inner) = cur.upgrade() {
            return Ok(Driver { inner });
        }
        // SAFETY: libcuda is present and initialised; no arguments.
        check("cuFileDriverOpen", unsafe { (lib.cuFileDriverOpen)() })?;
        let inner = Arc::new(Inner { lib });
        *cur = Arc::downgrade(&inner);
        Ok(Driver { inner })
    }

    pub(crate) fn lib(&self) -> &'static sys::Lib {
        self.inner.lib
    }

    /// `cuFileGetVersion`: the library version as `1000 * major + 10 * minor` (1150 for 1.15).
    #[doc(alias = "cuFileGetVersion")]
    pub fn version(&self) -> Option<i32> {
        self.inner.lib.version()
    }

    /// Where libcufile was loaded from.
    pub fn library_path(&self) -> &str {
        self.inner.lib.path()
    }

    /// `cuFileUseCount()`: how many cuFile operations are in flight.
    #[doc(alias = "cuFileUseCount")]
    pub fn use_count(&self) -> std::ffi::c_long {
        // SAFETY: no arguments.
        unsafe { (self.inner.lib.cuFileUseCount)() }
    }

    /// `cuFileDriverGetProperties(props)`—The driver's properties, read through the layout of the
    /// version found (identical in 1.14–1.20, with slack for a larger future struct).
    ///
    /// # Errors
    ///
    /// [`Error::CuFile`] from `cuFileDriverGetProperties`.
    #[doc(alias = "cuFileDriverGetProperties")]
    pub fn properties(&self) -> Result<DriverProperties> {
        // SAFETY: the driver is open while self lives.
        let p = unsafe { self.inner.lib.driver_properties() }
            .map_err(|e| super::cufile_error("cuFileDriverGetProperties", e.err, e.cu_err))?;
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
    /// [`Error::CuFile`].
    #[doc(alias = "cuFileDriverSetPollMode")]
    pub fn set_poll_mode(&self, poll: bool, threshold_kib: usize) -> Result<()> {
        // SAFETY: plain values.
        check("cuFileDriverSetPollMode", unsafe {
            (self.inner.lib.cuFileDriverSetPollMode)(poll, threshold_kib)
        })
    }

    /// `cuFileDriverSetMaxDirectIOSize(kib)`: the largest direct I/O, in KiB.
    ///
    /// # Errors
    ///
    /// [`Error::CuFile`] (`CU_FILE_DRIVER_UNSUPPORTED_LIMIT` out of range).
    #[doc(alias = "cuFileDriverSetMaxDirectIOSize")]
    pub fn set_max_direct_io_kib(&self, kib: usize) -> Result<()> {
        // SAFETY: plain value.
        check("cuFileDriverSetMaxDirectIOSize", unsafe {
            (self.inner.lib.cuFileDriverSetMaxDirectIOSize)(kib)
        })
    }

    /// `cuFileDriverSetMaxCacheSize(kib)`: GPU bounce-buffer cache per GPU, in KiB.
    ///
    /// # Errors
    ///
    /// [`Error::CuFile`].
    #[doc(alias = "cuFileDriverSetMaxCacheSize")]
    pub fn set_max_cache_kib(&self, kib: usize) -> Result<()> {
        // SAFETY: plain value.
        check("cuFileDriverSetMaxCacheSize", unsafe {
            (self.inner.lib.cuFileDriverSetMaxCacheSize)(kib)
        })
    }

    /// `cuFileDriverSetMaxPinnedMemSize(kib)`: the most memory `cuFileBufRegister` may pin, KiB.
    ///
    /// # Errors
    ///
    /// [`Error::CuFile`].
    #[doc(alias = "cuFileDriverSetMaxPinnedMemSize")]
    pub fn set_max_pinned_mem_kib(&self, kib: usize) -> Result<()> {
        // SAFETY: plain value.
        check("cuFileDriverSetMaxPinnedMemSize", unsafe {
            (self.inner.lib.cuFileDriverSetMaxPinnedMemSize)(kib)
        })
    }

    /// The largest number of requests one [`Batch`](super::Batch) may hold: the driver's
    /// `max_batch_io_size`, or 128 where it reports 0.
    pub fn max_batch_entries(&self) -> usize {
        match self.properties() {
            Ok(p) if p.max_batch_io_size > 0 => p.max_batch_io_size as usize,
            _ => 128,
        }
    }
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

impl SizeParam {
    /// `cuFileGetParameterSizeT(param, &value)`: the current value (or the staged one before
    /// the driver is opened). Needs no open driver.
    ///
    /// # Errors
    ///
    /// [`Error::Load`], [`Error::Unsupported`] for a parameter newer than the library,
    /// [`Error::CuFile`].
    #[doc(alias = "cuFileGetParameterSizeT")]
    pub fn get(self) -> Result<usize> {
        let lib = sys::lib()?;
        gate(lib, self.c_name(), self.since())?;
        let mut v = 0usize;
        // SAFETY: a known parameter and one valid out-pointer.
        check("cuFileGetParameterSizeT", unsafe {
            (lib.cuFileGetParameterSizeT)(self.raw(), &mut v)
        })?;
        Ok(v)
    }

    /// `cuFileSetParameterSizeT(param, value)`: stage a value; takes effect at the next
    /// `cuFileDriverOpen` (set it before the first [`Driver::open`]).
    ///
    /// # Errors
    ///
    /// As [`get`](Self::get); `CU_FILE_DRIVER_ALREADY_OPEN` once the driver is open.
    #[doc(alias = "cuFileSetParameterSizeT")]
    pub fn set(self, value: usize) -> Result<()> {
        let lib = sys::lib()?;
        gate(lib, self.c_name(), self.since())?;
        // SAFETY: plain values.
        check("cuFileSetParameterSizeT", unsafe {
            (lib.cuFileSetParameterSizeT)(self.raw(), value)
        })
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
        let lib = sys::lib()?;
        gate(lib, self.c_name(), self.since())?;
        let mut v = false;
        // SAFETY: a known parameter and one valid out-pointer.
        check("cuFileGetParameterBool", unsafe {
            (lib.cuFileGetParameterBool)(self.raw(), &mut v)
        })?;
        Ok(v)
    }

    /// `cuFileSetParameterBool(param, value)`: staged for the next driver open.
    ///
    /// # Errors
    ///
    /// As [`SizeParam::set`].
    #[doc(alias = "cuFileSetParameterBool")]
    pub fn set(self, value: bool) -> Result<()> {
        let lib = sys::lib()?;
        gate(lib, self.c_name(), self.since())?;
        // SAFETY: plain values.
        check("cuFileSetParameterBool", unsafe {
            (lib.cuFileSetParameterBool)(self.raw(), value)
        })
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
        let lib = sys::lib()?;
        gate(lib, self.c_name(), self.since())?;
        let mut buf = vec![0 as libc::c_char; 4096];
        // SAFETY: the buffer holds `len` bytes.
        check("cuFileGetParameterString", unsafe {
            (lib.cuFileGetParameterString)(self.raw(), buf.as_mut_ptr(), buf.len() as i32)
        })?;
        *buf.last_mut().expect("non-empty") = 0;
        // SAFETY: NUL-terminated above.
        Ok(unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    /// `cuFileSetParameterString(param, value)`: staged for the next driver open.
    ///
    /// # Errors
    ///
    /// As [`SizeParam::set`]; [`Error::InvalidArgument`] if `value` holds a NUL.
    #[doc(alias = "cuFileSetParameterString")]
    pub fn set(self, value: &str) -> Result<()> {
        let lib = sys::lib()?;
        gate(lib, self.c_name(), self.since())?;
        let c = CString::new(value)
            .map_err(|_| Error::invalid("value", value, "must not contain NUL"))?;
        // SAFETY: a NUL-terminated string valid for the call.
        check("cuFileSetParameterString", unsafe {
            (lib.cuFileSetParameterString)(self.raw(), c.as_ptr())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn fs_flags_keep_unknown_bits() {
        let f = FsSupport::from_bits_retain((1 << 4) | (1 << 30));
        assert!(f.contains(FsSupport::NVME));
        assert_eq!(f.bits(), (1 << 4) | (1 << 30));
    }
}
