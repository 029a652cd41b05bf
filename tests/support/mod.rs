//! Helpers shared by the integration tests (each test binary includes the whole tree with
//! `mod support;` and uses what it needs).
//!
//! - [`gpu`]: GPU counts, random data with a replayable seed, streams, poisoned device buffers
//!   (the library's `DeviceBuffer`) and exact comparisons.
//! - [`files`]: deterministic file contents and the directory test files go in (no GPU needed;
//!   the storage bench includes this file too).
//! - [`storage`]: device 0 with the cuFile driver, test files, registration that cuFile may
//!   refuse (no udev data).
//! - [`rdma`]: a loopback pair of connected RC queue pairs on the first verbs device, and bounded
//!   completion waits.
//! - [`etcd`]: a one-member etcd of a test's own (its command line, stopping it).
//! - `cufile-wheel.sh`: fetches the cuFile wheels `storage_cufile_wheel` loads, by hand.
#![allow(dead_code, unused_imports)]

pub mod etcd;
pub mod files;
pub mod gpu;
pub mod rdma;
pub mod storage;
