//! Typed copies between memory kinds: blocking, and asynchronous on a [`Stream`] (the rules are
//! in the `memory` module docs).

use super::kind::{DeviceMemory, DeviceMemoryMut};
use super::pod::Pod;
use crate::completion::capture::Refused;
use crate::completion::{InFlight, StreamFence};
use crate::cuda::Stream;
use crate::driver::mem;
use crate::error::{Error, Result};

/// What an asynchronous copy returns: both buffers, owned until the copy completes.
pub type CopyInFlight<S, D> = InFlight<(S, D), StreamFence>;

#[inline]
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

#[inline]
pub(crate) fn check_len(src: usize, dst: usize) -> Result<()> {
    if src != dst {
        return Err(Error::invalid(
            "dst",
            format!("{dst} elements"),
            format!("must hold exactly as many elements as src ({src})"),
        ));
    }
    Ok(())
}

/// Where a copy reads and writes, and how many bytes: taken from the buffers before anything is
/// queued (their trait methods are not called while work is being queued).
#[derive(Clone, Copy)]
struct Plan {
    src: End,
    dst: End,
    bytes: usize,
}

/// One side of a copy: its host address (host kinds, host slices), else its device address.
#[derive(Clone, Copy)]
struct End {
    host: Option<*mut u8>,
    dev: u64,
}

impl End {
    fn of(m: &impl DeviceMemory) -> End {
        End {
            host: m.host_ptr(),
            dev: m.device_ptr(),
        }
    }

    fn host<T>(p: *const T) -> End {
        End {
            host: Some(p.cast_mut().cast()),
            dev: 0,
        }
    }
}

impl Plan {
    /// All of `src` into `dst` (same element type, lengths checked by the caller).
    fn whole<S: DeviceMemory>(src: &S, dst: &impl DeviceMemory) -> Result<Plan> {
        Ok(Plan {
            src: End::of(src),
            dst: End::of(dst),
            bytes: bytes_of::<S::Elem>(src.len())?,
        })
    }

    fn call(&self) -> &'static str {
        match (self.src.host, self.dst.host) {
            (None, None) => "cuMemcpyDtoDAsync_v2",
            (Some(_), None) => "cuMemcpyHtoDAsync_v2",
            (None, Some(_)) => "cuMemcpyDtoHAsync_v2",
            (Some(_), Some(_)) => "cuMemcpyAsync",
        }
    }
}

/// Queue the copy through the capture-checked path; `keep` is what the copy touches (leaked if
/// the stream turns out to be capturing after queueing).
///
/// # Safety
///
/// Both ranges valid for `bytes` bytes until the copy completes; `dst` not referenced meanwhile.
unsafe fn issue<R>(stream: &Stream, plan: Plan, keep: R) -> Result<R, Refused<R>> {
    let ((), keep) = stream.enqueue(plan.call(), keep, |s, _| {
        let Plan { src, dst, bytes } = plan;
        // SAFETY: forwarded from the caller.
        unsafe {
            match (src.host, dst.host) {
                (None, None) => mem::copy_dtod_async(dst.dev, src.dev, bytes, s),
                (Some(h), None) => mem::copy_htod_async(dst.dev, h.cast(), bytes, s),
                (None, Some(h)) => mem::copy_dtoh_async(h.cast(), src.dev, bytes, s),
                (Some(_), Some(_)) => mem::copy_async(dst.dev, src.dev, bytes, s),
            }
        }
    })?;
    Ok(keep)
}

/// Queue `plan` and wait for it. Returns only once the copy has completed or was never queued:
/// the borrows end when this returns, and nothing can park them. The wait runs with the calling
/// thread relaxed ([`Stream::settle`]), so a graph another thread captures in global mode
/// neither refuses it (which would return while the copy still runs) nor is broken by it. Where
/// completion cannot be proven (a capture began on the stream while the copy was queued; the
/// stream cannot be synchronized: a sticky error, a call from a host function), the process
/// aborts, as the peer copier's scope does.
///
/// # Safety
///
/// Both ranges valid for `bytes` bytes until this returns; `dst` not referenced meanwhile.
unsafe fn blocking(stream: &Stream, plan: Plan) -> Result<()> {
    // SAFETY: forwarded from the caller: the copy has completed when this returns.
    let queued = unsafe { issue(stream, plan, ()) };
    stream.settle_borrowed("a blocking copy", queued)
}

/// The byte count of `len` elements of `T`, checked (a buffer's own `byte_len` may come from a
/// user's [`DeviceMemory`] implementation).
pub(crate) fn bytes_of<T>(len: usize) -> Result<usize> {
    len.checked_mul(std::mem::size_of::<T>())
        .ok_or_else(|| Error::invalid("src", len, "len * size_of::<T>() overflows usize"))
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
/// call; [`Error::StreamCapturing`] when the stream is capturing a CUDA graph; [`Error::Cuda`]
/// when the driver rejects the copy. On error nothing was queued and both buffers are dropped,
/// except for a capture that began while the copy was queued (`enqueued: true`): then both are
/// leaked, never freed.
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
    let plan = Plan::whole(&src, &dst)?;
    // SAFETY: both buffers are owned by the InFlight below until the fence completes (or leaked
    // by `issue`); `dst` is `DeviceMemoryMut`, so nothing else references it.
    let (src, dst) = unsafe { issue(stream, plan, (src, dst)) }?;
    Ok(InFlight::new("async copy", stream.fence(), (src, dst)))
}

/// Copy all of `src` into `dst` on `stream` and wait for it (a fence of the stream, then
/// `cuStreamSynchronize` where the driver refused that wait), with the calling thread relaxed to
/// `CU_STREAM_CAPTURE_MODE_RELAXED` for the wait (its mode is put back after), so a graph
/// another thread captures in global mode is neither refused nor invalidated by it.
///
/// # Errors
///
/// As [`copy_async`], before anything was queued.
///
/// # Aborts
///
/// When the copy, once queued, cannot be proven complete: the stream cannot be synchronized
/// after retries over about 0.6 s (a sticky error, a call from a CUDA host function, the driver
/// shutting down), or a capture began on the stream while the copy was being queued. The
/// borrowed buffers cannot be parked the way [`copy_async`]'s owned ones are, so the process
/// aborts (with a message on standard error) rather than return while the copy might still
/// read or write them.
#[doc(alias = "cuMemcpyDtoDAsync_v2")]
#[doc(alias = "cuMemcpyAsync")]
pub fn copy<S, D>(stream: &Stream, src: &S, dst: &mut D) -> Result<()>
where
    S: DeviceMemory,
    S::Elem: Pod,
    D: DeviceMemoryMut<Elem = S::Elem>,
{
    check_len(src.len(), dst.len())?;
    check_device(stream, "src", src)?;
    check_device(stream, "dst", dst)?;
    let plan = Plan::whole(src, dst)?;
    // SAFETY: the borrows outlive the call; `dst` is borrowed mutably.
    unsafe { blocking(stream, plan) }
}

/// Copy host elements `src` (any host memory, pageable or pinned) into `dst`, blocking.
///
/// # Errors
///
/// As [`copy`].
///
/// # Aborts
///
/// As [`copy`].
#[doc(alias = "cuMemcpyHtoD_v2")]
#[doc(alias = "cuMemcpyHtoDAsync_v2")]
pub fn copy_from_host<D>(stream: &Stream, src: &[D::Elem], dst: &mut D) -> Result<()>
where
    D: DeviceMemoryMut,
    D::Elem: Pod,
{
    check_len(src.len(), dst.len())?;
    check_device(stream, "dst", dst)?;
    let plan = Plan {
        src: End::host(src.as_ptr()),
        dst: End::of(dst),
        bytes: std::mem::size_of_val(src),
    };
    // SAFETY: the borrows outlive the call; `dst` is borrowed mutably.
    unsafe { blocking(stream, plan) }
}

/// Copy `src` into host elements `dst`, blocking.
///
/// # Errors
///
/// As [`copy`].
///
/// # Aborts
///
/// As [`copy`].
#[doc(alias = "cuMemcpyDtoH_v2")]
#[doc(alias = "cuMemcpyDtoHAsync_v2")]
pub fn copy_to_host<S>(stream: &Stream, src: &S, dst: &mut [S::Elem]) -> Result<()>
where
    S: DeviceMemory,
    S::Elem: Pod,
{
    check_len(src.len(), dst.len())?;
    check_device(stream, "src", src)?;
    let plan = Plan {
        src: End::of(src),
        dst: End::host(dst.as_mut_ptr()),
        bytes: std::mem::size_of_val(dst),
    };
    // SAFETY: the borrows outlive the call; `dst` is borrowed mutably; `S::Elem: Pod` makes any
    // bytes the device wrote a valid value.
    unsafe { blocking(stream, plan) }
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
