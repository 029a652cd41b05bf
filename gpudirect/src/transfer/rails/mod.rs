//! The verbs transport: an endpoint's rails, one reliable queue pair per rail to one peer,
//! connected through rdma_cm, with a progress thread that waits on the rails' completion
//! channels and finishes requests, unless a thread waiting for one polls them itself.
//!
//! # Where things live
//!
//! Bottom up, each file imports only those before it:
//!
//! - `rail`: one rail (queue pair, completion queues, rdma_cm link), its messages, counters and
//!   lane (failed or up, credits, notification counts).
//! - `windows`: per-peer memory windows, bound at connect over the published descriptors and
//!   revoked when the endpoint closes or breaks.
//! - `state`: the endpoint's verbs state under its lock ([`Link`](state::Link)), requests'
//!   accounting, a rail failing (its messages moved to the rails left), breaking the endpoint
//!   and finishing requests.
//! - `grant`: windows over a region bound after connect through every rail (for a descriptor
//!   handed to the peer out of band), revoked with the endpoint's others.
//! - `post`: a request checked, planned and posted within each rail's window; notifications
//!   against credits.
//! - `progress`: the progress thread: completions, notifications delivered, control messages
//!   (how many notifications arrived on a failed rail), deadlines.
//! - `wait`: a waiting thread polling the completion queues itself (one at a time), and how it
//!   hands them back to the progress thread.
//! - `staging`: GPU memory the NIC cannot reach, through a ring of pinned bounce buffers.
//! - `handshake`: a rail's connection resources and its handshake (greetings, with a key the
//!   proofs, then the descriptor messages).
//! - `back`: a failed rail taken back (connected again alone, its windows bound again) at
//!   the dialing side, and at the listener that accepted its endpoint.
//! - `handle`: the rails as the endpoint holds them ([`Rails`]): start, requests, reconnect,
//!   close.
//! - `listen`: accepting endpoints (an rdma_cm listener; handshakes concurrent and bounded) and
//!   connecting them.

mod back;
mod grant;
mod handle;
mod handshake;
mod listen;
mod post;
mod progress;
mod rail;
mod staging;
mod state;
mod wait;
mod windows;

pub(crate) use handle::Rails;
pub use listen::ListenerStats;
pub(crate) use listen::{Listener, connect, listen};
pub(crate) use post::Ready;
pub use rail::{RailFailure, RailState, RailStats};
