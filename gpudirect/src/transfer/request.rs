//! The request entry points of an [`Endpoint`]: registered memory goes straight to the rails,
//! staged memory through the staged path.

use super::descriptor::RemoteRange;
use super::endpoint::{Direction, Endpoint, Transfer, TransferOptions};
use super::region::LocalRange;
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
