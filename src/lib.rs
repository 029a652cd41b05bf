//! Host package for the workspace's examples, integration tests and benches. Its docs are the
//! README, so the README's code blocks are compiled as doctests.
#![doc = include_str!("../README.md")]

/// `docs/transfer.md`, so that its code blocks are compiled as doctests too.
#[cfg(doctest)]
#[doc = include_str!("../docs/transfer.md")]
pub struct TransferDoc;
