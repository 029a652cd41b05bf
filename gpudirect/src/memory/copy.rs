//! Typed copies between memory kinds: blocking, and asynchronous on a [`Stream`].
//!
//! Every copy checks, before any driver call, that source and destination hold the same element
//! type (at compile time) and the same number of elements, and that device memory belongs to the
//! stream's device (copies between devices are the `p2p` module's). Host kinds take the
//! `cuMemcpyHtoDAsync`/`cuMemcpyDtoHAsync` paths with their host address, device kinds
//! `cuMemcpyDtoDAsync`.
//!
//! Asynchronous copies take both buffers by value (or the source as an `Arc`) and return an
//! [`InFlight`] that owns them until the copy has completed: `mem::forget` of it leaks them, and
//! the destination can be read only after [`InFlight::wait`] hands it back.

use super::tracker::StreamFence;
use super::{DeviceMemory, DeviceMemoryMut, InFlight, Pod, bind};
use crate::cuda::Stream;
use crate::error::{Error, Result, cu};
use cudarc::driver::sys;

/// What an asynchronous copy returns: both buffers, owned until the copy completes.
pub type CopyInFlight<S, D> = InFlight<(S, D), StreamFence>;

fn check_device(stream: &Stream, arg: &'static str, m: &impl DeviceMemory) -> Result<()> {
    let ord = stream.context().ordinal();
    if m.kind().is_device() && m.ordinal() != ord {
        return Err(Error::invalid(
            arg,
            format!("{:?} memory on device {}", m.kind(), m.ordinal()),
            format!("must be on the stream's device {ord}; use p2p for copies between devices"),
        ));
    }
    Ok(())
}

fn check_len(src: usize, dst: usize) -> Result<()> {
    if src != dst {
        return Err(Error::invalid(
            "dst",
            format!("{dst} elements"),
            format!("must hold exactly as many elements as src ({src})"),
        ));
    }
    Ok(())
}

/// Queue the copy of `bytes` bytes; no checks. Host kinds are addressed by host pointer.
///
/// # Safety
///
/// Both ranges valid for `bytes` bytes until the copy completes; `dst` not referenced meanwhile.
unsafe fn issue(
    stream: sys::CUstream,
    src_host: Option<*mut u8>,
    src_dev: u64,
    dst_host: Option<*mut u8>,
    dst_dev: u64,
    bytes: usize,
) -> Result<()> {
    // SAFETY: forwarded from the caller.
    unsafe {
        match (src_host, dst_host) {
            (None, None) => cu(
                "cuMemcpyDtoDAsync_v2",
                sys::cuMemcpyDtoDAsync_v2(dst_dev, src_dev, bytes, stream),
            ),
            (Some(h), None) => cu(
                "cuMemcpyHtoDAsync_v2",
                sys::cuMemcpyHtoDAsync_v2(dst_dev, h.cast(), bytes, stream),
            ),
            (None, Some(h)) => cu(
                "cuMemcpyDtoHAsync_v2",
                sys::cuMemcpyDtoHAsync_v2(h.cast(), src_dev, bytes, stream),
            ),
            (Some(_), Some(_)) => cu(
                "cuMemcpyAsync",
                sys::cuMemcpyAsync(dst_dev, src_dev, bytes, stream),
            ),
        }
    }
}

/// Copy all of `src` into `dst` on `stream`, asynchronously. Lengths are in elements and must be
/// equal.
///
/// The returned [`InFlight`] owns `src` and `dst` until the copy has completed; take them back
/// with [`InFlight::wait`]. Its fence is a [`StreamFence`]: no event is recorded per copy.
///
/// # Errors
///
/// [`Error::InvalidArgument`] (lengths differ, device memory on another device) before any driver
/// call; [`Error::Cuda`] when the driver rejects the copy. On error nothing was queued and both
/// buffers are dropped.
///
/// # C function
///
/// `cuMemcpyHtoDAsync_v2`, `cuMemcpyDtoHAsync_v2`, `cuMemcpyDtoDAsync_v2`, `cuMemcpyAsync`:
/// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html>
#[doc(alias = "cuMemcpyAsync")]
#[doc(alias = "cuMemcpyHtoDAsync_v2")]
#[doc(alias = "cuMemcpyDtoHAsync_v2")]
#[doc(alias = "cuMemcpyDtoDAsync_v2")]
pub fn copy_async<S, D>(stream: &Stream, src: S, dst: D) -> Result<CopyInFlight<S, D>>
where
    S: DeviceMemory,
    S::Elem: Pod,
    D: DeviceMemoryMut<Elem = S::Elem>,
{
    check_len(src.len(), dst.len())?;
    check_device(stream, "src", &src)?;
    check_device(stream, "dst", &dst)?;
    bind(stream.context())?;
    // SAFETY: both buffers are owned by the InFlight below until the fence completes; `dst` is
    // `DeviceMemoryMut`, so nothing else references it.
    unsafe {
        issue(
            stream.cu_stream(),
            src.host_ptr(),
            src.device_ptr(),
            dst.host_ptr(),
            dst.device_ptr(),
            src.byte_len(),
        )?;
    }
    Ok(InFlight::new("async copy", stream.fence(), (src, dst)))
}

/// Copy all of `src` into `dst` on `stream` and wait for it (`cuStreamSynchronize`).
///
/// # Errors
///
/// As [`copy_async`]; plus [`Error::Cuda`] from the synchronization.
pub fn copy<S, D>(stream: &Stream, src: &S, dst: &mut D) -> Result<()>
where
    S: DeviceMemory,
    S::Elem: Pod,
    D: DeviceMemoryMut<Elem = S::Elem>,
{
    check_len(src.len(), dst.len())?;
    check_device(stream, "src", src)?;
    check_device(stream, "dst", dst)?;
    bind(stream.context())?;
    // SAFETY: the borrows outlive the copy: we synchronize before returning.
    unsafe {
        issue(
            stream.cu_stream(),
            src.host_ptr(),
            src.device_ptr(),
            dst.host_ptr(),
            dst.device_ptr(),
            src.byte_len(),
        )?;
    }
    stream.synchronize()
}

/// Copy host elements `src` (any host memory, pageable or pinned) into `dst`, blocking.
#[doc(alias = "cuMemcpyHtoD_v2")]
pub fn copy_from_host<D>(stream: &Stream, src: &[D::Elem], dst: &mut D) -> Result<()>
where
    D: DeviceMemoryMut,
    D::Elem: Pod,
{
    check_len(src.len(), dst.len())?;
    check_device(stream, "dst", dst)?;
    bind(stream.context())?;
    let bytes = std::mem::size_of_val(src);
    // SAFETY: the borrows outlive the copy: we synchronize before returning.
    unsafe {
        issue(
            stream.cu_stream(),
            Some(src.as_ptr().cast_mut().cast()),
            0,
            dst.host_ptr(),
            dst.device_ptr(),
            bytes,
        )?;
    }
    stream.synchronize()
}

/// Copy `src` into host elements `dst`, blocking.
#[doc(alias = "cuMemcpyDtoH_v2")]
pub fn copy_to_host<S>(stream: &Stream, src: &S, dst: &mut [S::Elem]) -> Result<()>
where
    S: DeviceMemory,
    S::Elem: Pod,
{
    check_len(src.len(), dst.len())?;
    check_device(stream, "src", src)?;
    bind(stream.context())?;
    let bytes = std::mem::size_of_val(dst);
    // SAFETY: the borrows outlive the copy: we synchronize before returning; `S::Elem: Pod`
    // makes any bytes the device wrote a valid value.
    unsafe {
        issue(
            stream.cu_stream(),
            src.host_ptr(),
            src.device_ptr(),
            Some(dst.as_mut_ptr().cast()),
            0,
            bytes,
        )?;
    }
    stream.synchronize()
}

/// The contents of `src` as a `Vec`, blocking.
pub(crate) fn to_vec<S>(stream: &Stream, src: &S) -> Result<Vec<S::Elem>>
where
    S: DeviceMemory,
    S::Elem: Pod,
{
    let mut v = Vec::<S::Elem>::with_capacity(src.len());
    // SAFETY: Pod: all-zero bytes are a valid value.
    unsafe {
        std::ptr::write_bytes(v.as_mut_ptr(), 0, src.len());
        v.set_len(src.len());
    }
    copy_to_host(stream, src, &mut v)?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_must_match() {
        assert!(check_len(4, 4).is_ok());
        let e = check_len(4, 3).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid argument `dst` = 3 elements: must hold exactly as many elements as src (4)"
        );
    }
}
