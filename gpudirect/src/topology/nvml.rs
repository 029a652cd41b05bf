//! NVML: the file it is opened as, and the one way it is opened for the P2P link matrix (NVLink
//! wiring) and the node report (NVLink health).

#[cfg(any(feature = "p2p", feature = "report"))]
use std::ffi::OsStr;

/// The file name NVML is opened as (driver-only nodes have it; no development package needed).
/// `GPUDIRECT_NVML_PATH` names another file, tried first.
pub const NVML_LIB: &str = "libnvidia-ml.so.1";

/// `GPUDIRECT_NVML_PATH` when set, then [`NVML_LIB`] by the loader's search, then the same file
/// beside the libcuda that was loaded (driver directories are not always on the path).
///
/// # Errors
///
/// Why NVML is not usable, naming the last file tried.
#[cfg(any(feature = "p2p", feature = "report"))]
#[doc(alias = "nvmlInit_v2")]
pub(crate) fn open_nvml() -> Result<nvml_wrapper::Nvml, String> {
    let mut tried: Vec<std::ffi::OsString> = Vec::new();
    if let Some(p) = std::env::var_os("GPUDIRECT_NVML_PATH").filter(|p| !p.is_empty()) {
        tried.push(p);
    }
    tried.push(NVML_LIB.into());
    if let Ok(d) = gpudirect_sys::cuda::driver()
        && let Some(dir) = std::path::Path::new(d.path()).parent()
        && dir.is_absolute()
    {
        tried.push(dir.join(NVML_LIB).into_os_string());
    }
    let mut last = String::new();
    for path in &tried {
        match nvml_wrapper::Nvml::builder()
            .lib_path(OsStr::new(path))
            .init()
        {
            Ok(n) => return Ok(n),
            Err(e) => last = format!("{}: {e}", path.to_string_lossy()),
        }
    }
    Err(format!("NVML not usable (last tried {last})"))
}
