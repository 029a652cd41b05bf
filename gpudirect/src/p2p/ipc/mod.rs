//! CUDA IPC: device memory and events shared with other processes (see the table in the
//! [`p2p`](super) module docs): handles, their checks (a peer's handle is untrusted input), and the
//! imported memory kinds, each a thin type over the allocation core.

mod event;
mod fd;
// Visible to p2p: its property tests check the peer checks.
pub(super) mod handle;
mod mem;
mod pool;
mod vmm;

pub use event::{IpcEvent, IpcEventHandle};
#[cfg(feature = "transfer")]
pub(crate) use fd::{MAX_FDS_PER_MSG, recv_fds, send_fds};
pub use fd::{recv_fd, send_fd};
pub use mem::{IpcExport, IpcMemHandle, IpcMemory};
#[cfg(feature = "transfer")]
pub(crate) use pool::exportable_pool_at;
pub use pool::{IpcPool, PoolAlloc, PoolImport, PoolPtrHandle};
pub use vmm::{VmmHandle, VmmImport, export_vmm};
