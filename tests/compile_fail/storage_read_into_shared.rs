//! A cuFile read writes its destination: a shared (Arc) buffer cannot be one, for a blocking read
//! or a batch request (batches hold owned buffers only).
use gpudirect::memory::DeviceBuffer;
use gpudirect::storage::{BatchOp, BatchRequest, FileHandle};
use std::sync::Arc;

fn blocking(h: &FileHandle, mut dst: Arc<DeviceBuffer<u8>>) {
    let _ = h.read(&mut dst, 0, 0, 16);
}

fn batch(h: FileHandle, dst: Arc<DeviceBuffer<u8>>) {
    let _ = BatchRequest { op: BatchOp::Read, handle: h, buffer: dst, buf_offset: 0, file_offset: 0, len: 16 };
}

fn main() {
    let _ = (blocking, batch);
}
