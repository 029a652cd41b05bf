//! Graphs of memory copies: `cuGraphCreate`, `cuGraphAddMemcpyNode`,
//! `cuGraphInstantiateWithFlags`, `cuGraphExecMemcpyNodeSetParams`, `cuGraphLaunch`,
//! `cuGraphExecDestroy`, `cuGraphDestroy` (the intra-node path's gathered copies on the copy
//! engines).
//!
//! Every function here needs [`GRAPH_SYMBOLS`] checked by name first (cudarc's loader panics
//! on a missing symbol) and the graph's context current. Graph objects are not thread-safe:
//! their callers serialize each graph's use.

use crate::error::{Result, cu};
use cudarc::driver::sys;

/// The symbols this module calls.
pub(crate) const GRAPH_SYMBOLS: &[&str] = &[
    "cuGraphCreate",
    "cuGraphAddMemcpyNode",
    "cuGraphInstantiateWithFlags",
    "cuGraphExecMemcpyNodeSetParams",
    "cuGraphLaunch",
    "cuGraphExecDestroy",
    "cuGraphDestroy",
];

/// The parameters of a one-dimensional copy of `len` bytes from `src` to `dst`, both unified
/// addresses (device memory, memory another process exported and this one mapped, pinned host
/// memory).
pub(crate) fn copy_1d(dst: u64, src: u64, len: u64) -> sys::CUDA_MEMCPY3D {
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    let unified = sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED;
    sys::CUDA_MEMCPY3D {
        srcXInBytes: 0,
        srcY: 0,
        srcZ: 0,
        srcLOD: 0,
        srcMemoryType: unified,
        srcHost: std::ptr::null(),
        srcDevice: src,
        srcArray: std::ptr::null_mut(),
        reserved0: std::ptr::null_mut(),
        srcPitch: len,
        srcHeight: 1,
        dstXInBytes: 0,
        dstY: 0,
        dstZ: 0,
        dstLOD: 0,
        dstMemoryType: unified,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        reserved1: std::ptr::null_mut(),
        dstPitch: len,
        dstHeight: 1,
        WidthInBytes: len,
        Height: 1,
        Depth: 1,
    }
}

/// `cuGraphCreate`—An empty graph.
///
/// # Safety
///
/// As the module docs say.
pub(crate) unsafe fn create() -> Result<sys::CUgraph> {
    let mut g = std::ptr::null_mut();
    // SAFETY: an out-pointer; flags must be 0.
    cu("cuGraphCreate", unsafe { sys::cuGraphCreate(&mut g, 0) })?;
    Ok(g)
}

/// `cuGraphAddMemcpyNode`—A copy node of `g` with no dependency, copying as `p` says in
/// context `ctx`.
///
/// # Safety
///
/// As the module docs say; `g` is live, `ctx` the current context.
pub(crate) unsafe fn add_copy(
    g: sys::CUgraph,
    p: &sys::CUDA_MEMCPY3D,
    ctx: sys::CUcontext,
) -> Result<sys::CUgraphNode> {
    let mut n = std::ptr::null_mut();
    // SAFETY: a live graph, no dependencies, parameters that outlive the call, an out-pointer.
    cu("cuGraphAddMemcpyNode", unsafe {
        sys::cuGraphAddMemcpyNode(&mut n, g, std::ptr::null(), 0, p, ctx)
    })?;
    Ok(n)
}

/// `cuGraphInstantiateWithFlags`—The executable graph of `g`.
///
/// # Safety
///
/// As the module docs say; `g` is live.
pub(crate) unsafe fn instantiate(g: sys::CUgraph) -> Result<sys::CUgraphExec> {
    let mut x = std::ptr::null_mut();
    // SAFETY: a live graph, an out-pointer, no flags.
    cu("cuGraphInstantiateWithFlags", unsafe {
        sys::cuGraphInstantiateWithFlags(&mut x, g, 0)
    })?;
    Ok(x)
}

/// `cuGraphExecMemcpyNodeSetParams`—The copy node `node` of `x` copies as `p` says from its
/// next launch on (launches already queued are not changed).
///
/// # Safety
///
/// As the module docs say; `x` is live and instantiated from the graph that holds `node`.
pub(crate) unsafe fn set_copy(
    x: sys::CUgraphExec,
    node: sys::CUgraphNode,
    p: &sys::CUDA_MEMCPY3D,
    ctx: sys::CUcontext,
) -> Result<()> {
    // SAFETY: the caller's promises; parameters that outlive the call.
    cu("cuGraphExecMemcpyNodeSetParams", unsafe {
        sys::cuGraphExecMemcpyNodeSetParams(x, node, p, ctx)
    })
}

/// `cuGraphLaunch`—Queue `x` on `stream`.
///
/// # Safety
///
/// As the module docs say; `x` and `stream` are live, and the memory its nodes reach stays
/// valid until the stream has passed the launch.
pub(crate) unsafe fn launch(x: sys::CUgraphExec, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's promises.
    cu("cuGraphLaunch", unsafe { sys::cuGraphLaunch(x, stream) })
}

/// `cuGraphExecDestroy` then `cuGraphDestroy`—An executable graph (none when null) and the
/// graph it came from (a launch in flight is not stopped: the driver frees it once it
/// completes).
///
/// # Safety
///
/// As the module docs say; both live (or `x` null), neither used again.
pub(crate) unsafe fn destroy(x: sys::CUgraphExec, g: sys::CUgraph) {
    // SAFETY: the caller's promises. Nothing to do about a failure: the handles are gone.
    unsafe {
        if !x.is_null() {
            let _ = sys::cuGraphExecDestroy(x);
        }
        let _ = sys::cuGraphDestroy(g);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_one_dimensional_copy_names_its_ends_and_bytes() {
        let p = super::copy_1d(0x2000, 0x1000, 4096);
        assert_eq!(
            (p.dstDevice, p.srcDevice, p.WidthInBytes),
            (0x2000, 0x1000, 4096)
        );
        assert_eq!(
            (p.Height, p.Depth, p.srcPitch, p.dstPitch),
            (1, 1, 4096, 4096)
        );
        assert_eq!(
            p.srcMemoryType,
            cudarc::driver::sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED
        );
    }
}
