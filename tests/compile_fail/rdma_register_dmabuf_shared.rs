// A NIC may write what is registered: a shared (Arc) export cannot be registered.
use gpudirect::memory::DmaBuf;
use gpudirect::memory::DeviceBuffer;
use gpudirect::rdma::{AccessFlags, ProtectionDomain};
use std::sync::Arc;

fn register(pd: &ProtectionDomain, export: DmaBuf<Arc<DeviceBuffer<u8>>>) {
    let _ = pd.register_dmabuf(export, AccessFlags::REMOTE_WRITE);
}

fn main() {}
