//! Memory kinds and the completion tracker.
//!
//! Whatever a copy engine, a NIC or cuFile may still touch is owned by an [`tracker::InFlight`]
//! (or parked in the [`tracker::Tracker`]) until completion is observed.

pub mod tracker;

pub use tracker::{CompletionFlag, Fence, InFlight, Tracker};
