// The dma-buf step's raw fd reaches the buffer's memory: obtaining it is unsafe.
use gpudirect::memory::DeviceBuffer;
use gpudirect::rdma::GpuMrSource;

fn leak(buf: &DeviceBuffer<u8>) {
    let _ = buf.export_dmabuf();
}

fn main() {}
