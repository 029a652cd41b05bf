//! cuFile test set-up: device 0 and the cuFile driver, test files, and registration where cuFile
//! may refuse the file (no udev data for its device, as in containers and micro-VMs).

use gpudirect::Error;
use gpudirect::cudarc::driver::CudaContext;
use gpudirect::storage::{Driver, FileHandle, OpenOptions};
use gpudirect_testing::Hardware;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Device 0's context, bound to this thread, and the cuFile driver; `None` after printing
/// `SKIPPED: reason` without a GPU or libcufile (a failure when `GPUDIRECT_REQUIRE` names it).
pub fn cufile() -> Option<(Arc<CudaContext>, Driver)> {
    let ctx = match gpudirect::cuda::context(0) {
        Ok(c) => c,
        Err(e) => {
            gpudirect_testing::skip(Hardware::Gpu, e);
            return None;
        }
    };
    ctx.bind_to_thread().unwrap();
    match Driver::open() {
        Ok(d) => Some((ctx, d)),
        Err(e) => {
            gpudirect_testing::skip(Hardware::Cufile, e);
            None
        }
    }
}

/// `data` written to a new file `NAME-PID` in the test directory.
pub fn write_file(name: &str, data: &[u8]) -> PathBuf {
    let p = super::files::test_dir().join(format!("{name}-{}", std::process::id()));
    std::fs::write(&p, data).unwrap();
    p
}

/// `path` registered with cuFile, or `None` where cuFile refuses it: the refusal must be
/// `cuFileHandleRegister`'s (5027 without udev data), and a note says so.
pub fn register(d: &Driver, path: &Path, opts: &OpenOptions) -> Option<FileHandle> {
    match FileHandle::open(d, path, opts) {
        Ok(h) => Some(h),
        Err(Error::CuFile { call, code, .. }) => {
            assert_eq!(call, "cuFileHandleRegister");
            println!(
                "NOTE: cuFileHandleRegister refused {} with {code} (no udev data?): \
                 the cuFile path is not run here",
                path.display()
            );
            None
        }
        Err(e) => panic!("unexpected {e}"),
    }
}
