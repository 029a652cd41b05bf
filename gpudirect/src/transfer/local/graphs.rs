//! Gathered copies on the copy engines ([`EngineConfig::copy_graphs`]): the pieces of one or of
//! several requests queued as one launch of an executable graph of copy nodes, where
//! `cuMemcpyAsync` takes a submission of some microseconds of host time per piece. A lane keeps
//! one graph per number of pieces (1 to the most a launch takes) per context, made at the first
//! launch of that many and then launched again with each node's operands set anew
//! (`cuGraphExecMemcpyNodeSetParams`, which changes later launches only) where they differ from
//! the node's last: the same pieces launched again (a prepared request, a block sent to the same
//! place every step) are launched as they are, unless memory went away since they were set
//! (another allocation may lie at the same addresses: every node is set again).
//!
//! [`EngineConfig::copy_graphs`]: crate::transfer::EngineConfig::copy_graphs

use super::copies::Piece;
use crate::driver::graph;
use crate::error::{Error, Result};
use crate::transfer::region::memory_released_count;
use cudarc::driver::{CudaContext, sys};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// The copy graphs of one lane on one context.
pub(super) struct CopyGraphs {
    /// By number of pieces less one: the graph made for that many, once launched.
    made: Mutex<Vec<Option<Made>>>,
    /// A graph could not be made: the lane gathers no more here (the copy engines take each
    /// piece with a submission of its own).
    refused: AtomicBool,
    /// Holds the context the graphs live in.
    ctx: Arc<CudaContext>,
}

/// A graph of copy nodes and its executable graph.
struct Made {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    nodes: Vec<sys::CUgraphNode>,
    /// The piece each node copies at its next launch (what it was made from or last set to).
    set: Vec<Piece>,
    /// [`memory_released_count`] when the nodes were last made or set.
    released: u64,
}

// SAFETY: driver handles, used only under the `made` lock (graph objects are not thread-safe;
// the lock serializes them), with their context current, or dropped.
unsafe impl Send for Made {}

impl Drop for Made {
    fn drop(&mut self) {
        // SAFETY: live handles (the executable graph unless instantiating it failed), never
        // used again; a launch in flight completes first (the driver frees the executable
        // graph once it has). The handles name their context: none need be current (a
        // failure, which is ignored, leaks them at worst).
        unsafe { graph::destroy(self.exec, self.graph) };
    }
}

impl CopyGraphs {
    /// Graphs for `ctx`, of up to `most` pieces a launch; `None` where the driver lacks the
    /// graph calls (the copy engines then copy each piece with a submission of its own).
    pub(super) fn new(ctx: &Arc<CudaContext>, most: usize) -> Option<Arc<CopyGraphs>> {
        gpudirect_sys::cuda::require_symbols(graph::GRAPH_SYMBOLS).ok()?;
        Some(Arc::new(CopyGraphs {
            made: Mutex::new((0..most).map(|_| None).collect()),
            refused: AtomicBool::new(false),
            ctx: ctx.clone(),
        }))
    }

    /// The context the graphs live in.
    pub(super) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Whether a graph could not be made here (nothing more is gathered with these).
    pub(super) fn refused(&self) -> bool {
        self.refused.load(Ordering::Acquire)
    }

    /// Queue on `stream` the copies of `pieces` (1 to the most a launch takes, each of some bytes) as
    /// one graph launch: the graph of that many copies, its nodes set to these pieces (or made
    /// anew from them, where the driver refuses a node's new operands). An error queued
    /// nothing.
    ///
    /// # Safety
    ///
    /// `stream` is live in the graphs' context, which is current; both ranges of each piece are
    /// memory the context reaches, held (a registration's [`Backing`] or a peer's import, whose
    /// drops count in [`memory_released`]) from before this call until the stream has passed
    /// the launch.
    ///
    /// [`Backing`]: crate::transfer::region::Backing
    /// [`memory_released`]: crate::transfer::region::memory_released
    pub(super) unsafe fn gather(&self, stream: sys::CUstream, pieces: &[Piece]) -> Result<()> {
        let mut made = self.made.lock().unwrap_or_else(|e| e.into_inner());
        let most = made.len();
        if pieces.is_empty() || pieces.len() > most || pieces.iter().any(|p| p.len == 0) {
            return Err(Error::invalid(
                "pieces",
                pieces.len(),
                format!("one graph launch copies 1 to {most} pieces of some bytes"),
            ));
        }
        let ctx = self.ctx.cu_ctx();
        // Read while the caller holds every piece's memory (see `stale`).
        let released = memory_released_count();
        let slot = &mut made[pieces.len() - 1];
        // SAFETY: the graph's handles are live (under the lock); the context is current.
        let set = slot
            .as_mut()
            .is_some_and(|m| unsafe { set_all(m, pieces, released, ctx) }.is_ok());
        if !set {
            // None made yet, or a node refused its new operands (the nodes set before it change
            // nothing until a launch, and none comes): made anew from these pieces.
            *slot = None;
            // SAFETY: the context is current; the pieces' memory is the caller's promise.
            match unsafe { make(pieces, released, ctx) } {
                Ok(m) => *slot = Some(m),
                Err(e) => {
                    // This launch fails (nothing queued); later requests take the copy engines.
                    self.refused.store(true, Ordering::Release);
                    return Err(e);
                }
            }
        }
        let m = slot.as_ref().expect("made above");
        // SAFETY: a live executable graph whose every node copies one of `pieces`; the stream
        // and the memory are the caller's promises.
        unsafe { graph::launch(m.exec, stream) }
    }
}

/// Set every node of `m` to copy its piece of `pieces` (as many as its nodes), only those
/// [`stale`] names. On an error the caller makes the graph anew (the nodes set before it change
/// nothing until a launch).
///
/// # Safety
///
/// `m`'s handles are live and used by no other thread; `ctx` is current.
unsafe fn set_all(
    m: &mut Made,
    pieces: &[Piece],
    released: u64,
    ctx: sys::CUcontext,
) -> Result<()> {
    let fresh = m.released == released;
    for (i, p) in pieces.iter().enumerate().take(m.nodes.len()) {
        if !stale(fresh, &m.set[i], p) {
            continue;
        }
        let params = graph::copy_1d(p.dst, p.src, p.len);
        // SAFETY: a node of the graph `m.exec` was made from.
        unsafe { graph::set_copy(m.exec, m.nodes[i], &params, ctx) }?;
        m.set[i] = *p;
    }
    m.released = released;
    Ok(())
}

/// Whether a node set to `was` must be set to `p` before its next launch: where they differ,
/// and always once memory went away since it was set (`fresh` false: another allocation may lie
/// at the same addresses). `released` is read at the launch, while the caller holds the memory
/// of every piece launched (from before the launch until the stream passes it): memory at a
/// node's addresses that changed since its set was freed after that set's read, and moved the
/// count.
fn stale(fresh: bool, was: &Piece, p: &Piece) -> bool {
    !fresh || was != p
}

/// A graph of one copy node per piece (no edges: they run in any order, at once), and its
/// executable graph.
///
/// # Safety
///
/// `ctx` is current; the pieces' memory is live.
unsafe fn make(pieces: &[Piece], released: u64, ctx: sys::CUcontext) -> Result<Made> {
    // SAFETY: the context is current.
    let g = unsafe { graph::create() }?;
    let mut m = Made {
        graph: g,
        exec: std::ptr::null_mut(),
        nodes: Vec::with_capacity(pieces.len()),
        set: pieces.to_vec(),
        released,
    };
    for p in pieces {
        let params = graph::copy_1d(p.dst, p.src, p.len);
        // SAFETY: a live graph; the context is current.
        m.nodes.push(unsafe { graph::add_copy(g, &params, ctx) }?);
    }
    // SAFETY: as above.
    m.exec = unsafe { graph::instantiate(g) }?;
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_is_set_again_only_when_its_piece_or_the_memory_changed() {
        let p = |dst, src, len| Piece {
            dst,
            src,
            len,
            device: 0,
        };
        let was = p(0x1000, 0x2000, 64);
        assert!(!stale(true, &was, &p(0x1000, 0x2000, 64)), "the same piece");
        assert!(
            stale(true, &was, &p(0x1008, 0x2000, 64)),
            "another destination"
        );
        assert!(stale(true, &was, &p(0x1000, 0x2008, 64)), "another source");
        assert!(stale(true, &was, &p(0x1000, 0x2000, 65)), "another length");
        assert!(
            stale(false, &was, &p(0x1000, 0x2000, 64)),
            "memory went away"
        );
    }
}
