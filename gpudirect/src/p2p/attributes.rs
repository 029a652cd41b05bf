//! P2P attributes of an ordered device pair (`cuDeviceGetP2PAttribute`).

use super::access::cu_device;
use crate::driver;
use crate::error::Result;
use cudarc::driver::sys::CUdevice_P2PAttribute;

/// What the driver says about peer access from one device to another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct P2pAttributes {
    /// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK`: relative performance of the link (0 is the
    /// best; only comparable between pairs of one node).
    pub performance_rank: i32,
    /// `CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED`: peer access can be enabled.
    pub access_supported: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`: atomics over the link are native.
    pub native_atomics: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED`: CUDA arrays can be accessed over the
    /// link.
    pub cuda_array_access: bool,
}

/// `cuDeviceGetP2PAttribute` for each attribute, from device `src` to device `dst`.
///
/// For `src == dst` the driver answers `CUDA_ERROR_INVALID_DEVICE`; this returns all-false,
/// rank 0 instead (a device needs no peer mapping to itself).
///
/// # Errors
///
/// [`crate::Error::NoDevice`] for an ordinal past the device count, [`crate::Error::Cuda`] when
/// the driver call fails, [`crate::Error::Load`] without libcuda.
///
/// # C function
///
/// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PEER__ACCESS.html>
#[doc(alias = "cuDeviceGetP2PAttribute")]
pub fn p2p_attributes(src: usize, dst: usize) -> Result<P2pAttributes> {
    let (s, d) = (cu_device(src)?, cu_device(dst)?);
    if src == dst {
        return Ok(P2pAttributes::default());
    }
    let get = |attr: CUdevice_P2PAttribute| -> Result<i32> {
        // SAFETY: both devices came from cuDeviceGet (cu_device).
        unsafe { driver::peer::attribute(attr, s, d) }
    };
    Ok(P2pAttributes {
        performance_rank: get(CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK)?,
        access_supported: get(CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED)?
            != 0,
        native_atomics: get(
            CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
        )? != 0,
        // Value 4: named ..._CUDA_ARRAY_ACCESS_SUPPORTED in the headers (its older alias is the
        // name bindgen kept).
        cuda_array_access: get(
            CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_ACCESS_SUPPORTED,
        )? != 0,
    })
}
