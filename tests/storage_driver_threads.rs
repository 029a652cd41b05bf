//! Tier 2: the cuFile driver opened and closed from many threads at once. In its own binary so
//! that no other test holds a driver: the open count really falls to zero and the driver is
//! really closed and reopened, many times, while other threads open it and register buffers.
//!
//! Skips (`SKIPPED: reason`) without a GPU or libcufile; `GPUDIRECT_REQUIRE=gpu,cufile` turns
//! those skips into failures.

mod support;

use gpudirect::storage::{BufRegistration, Driver, FileHandle, OpenOptions};
use gpudirect::testing::Hardware;
use support::devbuf::{DevBuf, pattern, test_dir};

const THREADS: usize = 8;
const ROUNDS: usize = 200;

#[test]
fn eight_threads_open_register_deregister_and_close_200_times() {
    let ctx = gpudirect::require!(Hardware::Gpu, gpudirect::cuda::context(0));
    ctx.bind_to_thread().unwrap();
    // Whether cuFile works at all here (then closed again: nothing holds it below).
    drop(gpudirect::require!(Hardware::Cufile, Driver::open()));
    let path = test_dir().join(format!("driver-threads-{}", std::process::id()));
    std::fs::write(&path, pattern(1 << 16, 3)).unwrap();
    // File handles too, where this node's udev data lets cuFile register the file.
    let handles = {
        let d = Driver::open().unwrap();
        match FileHandle::open(&d, &path, &OpenOptions::read_only()) {
            Ok(_) => true,
            Err(e) => {
                println!("NOTE: file handles not exercised: {e}");
                false
            }
        }
    };
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (ctx, path) = (&ctx, &path);
            s.spawn(move || {
                ctx.bind_to_thread().unwrap();
                let mut buf = Some(DevBuf::new(0, 1 << 20, t as u8));
                for i in 0..ROUNDS {
                    let at = format!("thread {t} round {i}");
                    let d = Driver::open().unwrap_or_else(|e| panic!("{at}: open: {e}"));
                    let mem = buf.take().expect("returned by into_inner");
                    let reg = BufRegistration::register(&d, mem, 4096 * t, 65536)
                        .unwrap_or_else(|e| panic!("{at}: register: {e}"));
                    let fh = handles.then(|| {
                        FileHandle::open(&d, path, &OpenOptions::read_only())
                            .unwrap_or_else(|e| panic!("{at}: handle: {e}"))
                    });
                    d.properties()
                        .unwrap_or_else(|e| panic!("{at}: properties: {e}"));
                    // Every other round the driver goes first: the registration and the handle
                    // keep it open until they are gone.
                    if i % 2 == 0 {
                        drop(d);
                        drop(fh);
                        buf = Some(reg.into_inner().unwrap_or_else(|e| panic!("{at}: {e}")));
                    } else {
                        drop(fh);
                        buf = Some(reg.into_inner().unwrap_or_else(|e| panic!("{at}: {e}")));
                        drop(d);
                    }
                }
            });
        }
    });
    // Still usable afterwards.
    let d = Driver::open().unwrap();
    d.properties().unwrap();
    drop(d);
    std::fs::remove_file(&path).unwrap();
    println!("{THREADS} threads x {ROUNDS} rounds of open, register, deregister, close: no error");
}
