//! The POSIX path's raw-address entry points and its engines are not public: the only way in is
//! `storage::File`, which checks the device range first.
use gpudirect::storage::posix;

fn main() {
    let _ = posix::GpuEngines::for_device(0);
    let _ = posix::read_to_device::<posix::GpuEngines>;
    let _ = posix::write_from_device::<posix::GpuEngines>;
}
