//! The request entry points of an [`Endpoint`]: registered memory goes straight to the rails,
//! staged memory through the staged path.

use super::descriptor::RemoteRange;
use super::endpoint::{Endpoint, WeakEndpoint};
use super::pending::Transfer;
use super::region::LocalRange;
use super::request::{
    Broken, Direction, TransferOptions, TransferReport, check_pairs, check_same_engine, pairs_bytes,
};
use super::staging::staged;
use crate::error::Result;

impl Endpoint {
    /// Write each local range to its remote range (same lengths), as one request.
    ///
    /// # Errors
    ///
    /// As [`transfer`](Self::transfer).
    #[doc(alias = "IBV_WR_RDMA_WRITE")]
    pub fn write(
        &self,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<Transfer> {
        self.transfer(Direction::Write, pairs, opts)
    }

    /// Read each remote range into its local range, as one request.
    ///
    /// # Errors
    ///
    /// As [`transfer`](Self::transfer).
    #[doc(alias = "IBV_WR_RDMA_READ")]
    pub fn read(
        &self,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<Transfer> {
        self.transfer(Direction::Read, pairs, opts)
    }

    /// One request: the pairs are split and striped into messages, queued on the rails, and
    /// posted within each rail's window; the returned [`Transfer`] finishes when every message
    /// has completed (or the endpoint failed: then with its error, once the NIC is done with
    /// every message or 2 s after the failure). A pair whose local memory is staged
    /// ([`MemoryPath::Staged`](super::MemoryPath::Staged)) moves through pinned bounce buffers.
    ///
    /// # Errors
    ///
    /// Before anything is queued: [`Error::InvalidArgument`](crate::Error::InvalidArgument) for
    /// no pairs, a pair whose lengths differ, a local region registered with another engine, a
    /// remote range whose descriptor has not one rkey per peer device, a notification on a read,
    /// or staged memory with several pairs; the
    /// endpoint's failure (as [`failure`](Self::failure)) once it has failed.
    ///
    /// Inside a node, also: [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a
    /// remote range whose descriptor has no CUDA IPC part (host memory, default-pool memory) or
    /// names VMM or pool memory not published when the endpoints met;
    /// [`Error::Unsupported`](crate::Error::Unsupported) when the peer is this process;
    /// [`Error::Cuda`](crate::Error::Cuda) from mapping the peer's allocation or queueing the
    /// copies.
    pub fn transfer(
        &self,
        dir: Direction,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<Transfer> {
        #[cfg(feature = "p2p")]
        if let Some(side) = self.local_side()
            && let Some(side) = side.as_any().downcast_ref::<super::local::Side>()
        {
            return super::local::request(self, side, dir, pairs, opts);
        }
        if pairs.iter().any(|(l, _)| l.region.entry.mrs.is_empty()) {
            staged(self, dir, pairs, opts)
        } else {
            self.direct(dir, pairs, opts)
        }
    }
}

/// A request checked once, to be posted many times ([`Endpoint::prepare`]): the pattern of
/// NIXL's prepared transfer handles, for the same ranges moved again and again (a layer's KV
/// blocks, a gradient buffer every step).
///
/// Inside a node, posting repeats no check and no lookup: the ranges were checked, the peer's
/// allocations mapped (and held) and the copy streams found when it was prepared. Across nodes
/// a post is [`transfer`](Endpoint::transfer) of the same pairs (its checks included).
///
/// It does not keep the endpoint open: once every clone of the endpoint is gone, a post is
/// refused.
pub struct PreparedTransfer {
    ep: WeakEndpoint,
    dir: Direction,
    opts: TransferOptions,
    bytes: u64,
    how: How,
}

enum How {
    #[cfg(feature = "p2p")]
    Local(super::local::Ready),
    Pairs(Vec<(LocalRange, RemoteRange)>),
}

impl Endpoint {
    /// Check `pairs` once for requests posted later with [`PreparedTransfer::post`], each as
    /// [`transfer`](Self::transfer)`(dir, pairs, opts)` would make it (`opts.deadline` counts
    /// from each post).
    ///
    /// # Errors
    ///
    /// The checks of [`transfer`](Self::transfer) that need no NIC: [`Error::InvalidArgument`]
    /// for no pairs, lengths that differ, a local region of another engine, a notification on a
    /// read, lengths adding up past 2^64; inside a node also everything `transfer` refuses
    /// before it queues a copy (mapping the peer's allocations included).
    ///
    /// [`Error::InvalidArgument`]: crate::Error::InvalidArgument
    #[doc(alias = "prepXferDlist")]
    #[doc(alias = "makeXferReq")]
    pub fn prepare(
        &self,
        dir: Direction,
        pairs: Vec<(LocalRange, RemoteRange)>,
        opts: TransferOptions,
    ) -> Result<PreparedTransfer> {
        check_pairs(dir, &pairs, &opts)?;
        check_same_engine(self.engine().inner.engine_id, &pairs)?;
        let bytes = pairs_bytes(&pairs)?;
        let made = |how| PreparedTransfer {
            ep: self.downgrade(),
            dir,
            opts,
            bytes,
            how,
        };
        #[cfg(feature = "p2p")]
        if let Some(side) = self.local_side()
            && let Some(side) = side.as_any().downcast_ref::<super::local::Side>()
        {
            let ready = super::local::ready(self, side, dir, pairs, bytes, opts)?;
            return Ok(made(How::Local(ready)));
        }
        Ok(made(How::Pairs(pairs)))
    }
}

impl PreparedTransfer {
    /// Make the request again: a new [`Transfer`], as
    /// [`transfer`](Endpoint::transfer) returns.
    ///
    /// # Errors
    ///
    /// The endpoint's failure (as [`Endpoint::failure`]) once it has failed;
    /// [`Error::InvalidArgument`] once it closed (every clone dropped) or, inside a node,
    /// reconnected since this was prepared (prepare again: the peer's memory may have moved);
    /// [`Error::Cuda`] from queueing the copies. Across nodes, also what
    /// [`transfer`](Endpoint::transfer) returns.
    ///
    /// [`Error::InvalidArgument`]: crate::Error::InvalidArgument
    /// [`Error::Cuda`]: crate::Error::Cuda
    #[doc(alias = "postXferReq")]
    pub fn post(&self) -> Result<Transfer> {
        let ep = self.endpoint()?;
        match &self.how {
            #[cfg(feature = "p2p")]
            How::Local(r) => super::local::post(&ep, r),
            How::Pairs(pairs) => ep.transfer(self.dir, pairs.clone(), self.opts),
        }
    }

    /// Post it and wait for it on this thread: what `post()?.wait()` gives, sooner.
    ///
    /// Inside a node, when the request moves at most 64 MiB on one copy stream (the default
    /// [`EngineConfig::copy_streams`]), its deadline is at least 100 ms, and nothing else of the
    /// endpoint is queued, being finished or still running on that stream, its copies are
    /// queued and waited for with `cuStreamSynchronize` on this thread, as a hand-written copy
    /// would be: no completion tracking, no hand-off between threads. Meanwhile the endpoint
    /// queues no other request (they wait to be queued). The deadline does not bound that wait:
    /// 64 MiB take at most a few milliseconds on any GPU link, so only a stalled GPU makes it
    /// long; copies seen done are done, as for any request. Otherwise, and across nodes, it is
    /// `post()?.wait()`.
    ///
    /// # Errors
    ///
    /// As [`post`](Self::post) and [`Transfer::wait`].
    ///
    /// [`EngineConfig::copy_streams`]: super::EngineConfig::copy_streams
    #[doc(alias = "cuStreamSynchronize")]
    pub fn run(&self) -> Result<TransferReport> {
        match &self.how {
            #[cfg(feature = "p2p")]
            How::Local(r) => super::local::run(&self.endpoint()?, r),
            How::Pairs(_) => self.post()?.wait(),
        }
    }

    /// The endpoint, while some clone of it lives; closed otherwise.
    fn endpoint(&self) -> Result<Endpoint> {
        self.ep.upgrade().ok_or_else(|| Broken::Closed.to_error())
    }

    /// Its direction.
    pub fn direction(&self) -> Direction {
        self.dir
    }

    /// Bytes each post moves.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Its options (the deadline counts from each post).
    pub fn options(&self) -> TransferOptions {
        self.opts
    }
}

impl std::fmt::Debug for PreparedTransfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedTransfer")
            .field("direction", &self.dir)
            .field("bytes", &self.bytes)
            .field("options", &self.opts)
            .field(
                "inside_node",
                &match self.how {
                    #[cfg(feature = "p2p")]
                    How::Local(_) => true,
                    How::Pairs(_) => false,
                },
            )
            .finish()
    }
}
