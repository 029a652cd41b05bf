//! Prepared requests ([`PreparedTransfer`]): checked once ([`Endpoint::prepare`]), posted many
//! times.

use super::descriptor::RemoteRange;
use super::endpoint::{Endpoint, WeakEndpoint};
#[cfg(feature = "p2p")]
use super::local::Ready;
use super::pending::Transfer;
use super::rails::Ready as RailsReady;
use super::region::LocalRange;
use super::request::{
    Broken, Direction, TransferOptions, TransferReport, check_pairs, check_same_engine, pairs_bytes,
};
use super::stream::StreamTransfer;
use super::transport::Transport;
use crate::cuda::Stream;
use crate::error::Result;

/// A request checked once, to be posted many times ([`Endpoint::prepare`]): the pattern of
/// NIXL's prepared transfer handles, for the same ranges moved again and again (a layer's KV
/// blocks, a gradient buffer every step).
///
/// Inside a node, posting repeats no check and no lookup: the ranges were checked, the peer's
/// allocations mapped (and held) and the copy streams found when it was prepared. Across nodes,
/// on registered memory, the request's messages (work requests for each rail) are planned and
/// built at its first post and posted as built while the rails stay as they were (the same
/// rails usable, none taken back, no reconnect); otherwise they are built again. On staged
/// memory a post is [`transfer`](Endpoint::transfer) of the same pairs.
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
    Local(Box<Ready>),
    /// Registered memory across nodes: its messages built once per layout of the rails.
    Rails(Box<RailsReady>),
    /// Staged memory across nodes: a new request each time.
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
    /// read, lengths adding up past 2^64, across nodes a remote descriptor whose rkeys do not
    /// match the peer's devices (one each) or more than one pair with staged memory; the
    /// endpoint's failure once it failed; inside a node also everything `transfer` refuses
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
        match self.transport() {
            #[cfg(feature = "p2p")]
            Transport::Local(local) => {
                let ready = local.ready(dir, pairs, bytes, opts)?;
                Ok(made(How::Local(Box::new(ready))))
            }
            // Across nodes, what a post checks before any NIC work (the rkeys against the
            // peer's devices too), once here.
            Transport::Rails(rails) => Ok(made(match rails.ready(dir, &pairs, opts)? {
                Some(ready) => How::Rails(Box::new(ready)),
                None => How::Pairs(pairs),
            })),
        }
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
            How::Local(r) => ep.metered(self.dir, self.bytes, || match ep.transport() {
                Transport::Local(local) => local.post(r),
                _ => Err(Broken::Closed.to_error()),
            }),
            How::Rails(r) => ep.metered(self.dir, self.bytes, || match ep.transport() {
                Transport::Rails(rails) => rails.post_ready(r),
                #[cfg(feature = "p2p")]
                _ => Err(Broken::Closed.to_error()),
            }),
            How::Pairs(pairs) => ep.transfer(self.dir, pairs.clone(), self.opts),
        }
    }

    /// Post it ordered on `stream`, as [`Endpoint::write_on`] (or
    /// [`read_on`](Endpoint::read_on)) of the same pairs: the request starts when the stream
    /// reaches it, and its completion word is set when it finishes
    /// ([`StreamTransfer::wait_on`]).
    ///
    /// Inside a node the copies go on `stream` now, with no check or lookup repeated (as
    /// [`post`](Self::post)): as `write_on` queues them (the copy kernel for one piece it takes
    /// where [`EngineConfig::copy_kernel`] is on; else, with the engine's copy graphs, one launch
    /// of the stream's own copy graph, whose nodes are set only where they differ from its last
    /// launch and no memory was freed in the process since). Across nodes it is `write_on`
    /// (`read_on`) of the same pairs. Like `write_on`, it is not counted in the endpoint's
    /// metrics.
    ///
    /// [`EngineConfig::copy_kernel`]: super::EngineConfig::copy_kernel
    ///
    /// # Errors
    ///
    /// As [`post`](Self::post) and [`Endpoint::write_on`]: [`Error::StreamCapturing`] while
    /// `stream` captures a graph, [`Error::InvalidArgument`] on the per-thread default stream
    /// or with [`TRIGGER_SLOTS`](super::TRIGGER_SLOTS) requests armed.
    ///
    /// [`Error::StreamCapturing`]: crate::Error::StreamCapturing
    /// [`Error::InvalidArgument`]: crate::Error::InvalidArgument
    /// [`StreamTransfer::wait_on`]: super::StreamTransfer::wait_on
    #[doc(alias = "postXferReq")]
    #[doc(alias = "cuGraphLaunch")]
    pub fn post_on(&self, stream: &Stream) -> Result<StreamTransfer> {
        let ep = self.endpoint()?;
        match &self.how {
            #[cfg(feature = "p2p")]
            How::Local(r) => ep.arm_prepared(stream, r),
            How::Rails(r) => self.on(&ep, stream, r.pairs().to_vec()),
            How::Pairs(pairs) => self.on(&ep, stream, pairs.clone()),
        }
    }

    /// `write_on` or `read_on` of `pairs`, by its direction.
    fn on(
        &self,
        ep: &Endpoint,
        stream: &Stream,
        pairs: Vec<(LocalRange, RemoteRange)>,
    ) -> Result<StreamTransfer> {
        match self.dir {
            Direction::Write => ep.write_on(stream, pairs, self.opts),
            Direction::Read => ep.read_on(stream, pairs, self.opts),
        }
    }

    /// Post it and wait for it on this thread: what `post()?.wait()` gives, sooner.
    ///
    /// Inside a node, when the request moves at most 64 MiB on one copy stream (the default
    /// [`EngineConfig::copy_streams`]), its deadline is at least 100 ms, and nothing else is
    /// queued on this thread's issue lane ([`EngineConfig::copy_lanes`]) or still running on its
    /// stream (and, with a notification, nothing of the endpoint is queued or being finished),
    /// its copies are queued (with [`EngineConfig::copy_graphs`], in launches of the lane's
    /// copy graphs) and waited for with `cuStreamSynchronize` on this thread, as a hand-written
    /// copy would be: no completion tracking, no hand-off between threads.
    /// Meanwhile the lane queues no other request (they wait to be queued); other threads'
    /// lanes go on (with a notification, their requests with one wait behind it). The deadline
    /// does not bound that wait:
    /// 64 MiB take at most a few milliseconds on any GPU link, so only a stalled GPU makes it
    /// long; copies seen done are done, as for any request. Otherwise, and across nodes, it is
    /// `post()?.wait()`.
    ///
    /// # Errors
    ///
    /// As [`post`](Self::post) and [`Transfer::wait`].
    ///
    /// [`EngineConfig::copy_streams`]: super::EngineConfig::copy_streams
    /// [`EngineConfig::copy_lanes`]: super::EngineConfig::copy_lanes
    /// [`EngineConfig::copy_graphs`]: super::EngineConfig::copy_graphs
    #[doc(alias = "cuStreamSynchronize")]
    pub fn run(&self) -> Result<TransferReport> {
        match &self.how {
            #[cfg(feature = "p2p")]
            How::Local(r) => {
                let ep = self.endpoint()?;
                ep.metered(self.dir, self.bytes, || match ep.transport() {
                    Transport::Local(local) => local.run(r),
                    _ => Err(Broken::Closed.to_error()),
                })
            }
            How::Rails(_) | How::Pairs(_) => self.post()?.wait(),
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
                    How::Rails(_) | How::Pairs(_) => false,
                },
            )
            .finish()
    }
}
