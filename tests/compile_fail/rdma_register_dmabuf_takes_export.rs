// Registration takes the owning export, never a bare fd (which says nothing about the memory's
// lifetime).
use gpudirect::rdma::{AccessFlags, ProtectionDomain};
use std::os::fd::OwnedFd;

fn register(pd: &ProtectionDomain, fd: OwnedFd) {
    let _ = pd.register_dmabuf(fd, AccessFlags::REMOTE_WRITE);
}

fn main() {}
