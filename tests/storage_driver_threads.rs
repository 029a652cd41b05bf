//! Tier 2: the cuFile driver opened from many threads at once. The process opens it once and
//! never closes it, so opening and dropping handles from eight threads, registering and
//! deregistering buffers, with some threads dropping their driver handle first, never closes and
//! reopens it (which crashed cuFile 1.15 on two H200s: a segmentation fault, or a C++ exception
//! thrown out of cuFile, when eight threads opened and closed it at once; and each reopen cost
//! about half a second).
//!
//! Skips (`SKIPPED: reason`) without a GPU or libcufile; `GPUDIRECT_REQUIRE=gpu,cufile` turns
//! those skips into failures.

mod support;

use gpudirect::storage::{BufRegistration, Driver, FileHandle, OpenOptions};
use std::time::{Duration, Instant};
use support::files::{pattern, test_dir};
use support::gpu::poisoned_bytes;

const THREADS: usize = 8;
const ROUNDS: usize = 200;

/// The CUDA context of device 0 once cuFile opens, or `None` (skipped). The driver handle is
/// not kept: nothing in the tests below holds one between rounds.
fn setup() -> Option<std::sync::Arc<gpudirect::cudarc::driver::CudaContext>> {
    support::storage::cufile().map(|(ctx, _driver)| ctx)
}

/// After every handle is gone, opening again costs nothing: the driver was not closed (a close
/// and reopen costs about half a second each).
fn reopening_is_free() {
    let start = Instant::now();
    for _ in 0..100 {
        let d = Driver::open().unwrap();
        d.properties().unwrap();
    }
    let took = start.elapsed();
    println!("100 opens after every handle was dropped: {took:?}");
    assert!(
        took < Duration::from_secs(5),
        "100 opens took {took:?}: the driver is being closed and reopened"
    );
}

#[test]
// A `Driver` handle owns nothing to drop; it is dropped first all the same, as a program would.
#[allow(clippy::drop_non_drop)]
fn eight_threads_open_register_deregister_and_drop_200_times() {
    let Some(ctx) = setup() else { return };
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
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (ctx, path) = (&ctx, &path);
            s.spawn(move || {
                ctx.bind_to_thread().unwrap();
                let mut buf = Some(poisoned_bytes(0, 1 << 20, t as u8));
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
                    // Every other round (and always in the odd threads) the driver handle goes
                    // first: the registration and the file handle still work without it.
                    if i % 2 == 0 || t % 2 == 1 {
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
    println!(
        "{THREADS} threads x {ROUNDS} rounds of open, register, deregister, drop: {:?}",
        start.elapsed()
    );
    reopening_is_free();
    std::fs::remove_file(&path).unwrap();
}

/// The exact shape that threw a C++ exception out of cuFile when dropping the last handle closed
/// the driver: eight threads opening it, reading its properties and dropping it, nothing else
/// holding it.
#[test]
fn eight_threads_open_read_properties_and_drop_with_nothing_held() {
    let Some(ctx) = setup() else { return };
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let ctx = &ctx;
            s.spawn(move || {
                ctx.bind_to_thread().unwrap();
                for i in 0..ROUNDS {
                    let d = Driver::open().unwrap_or_else(|e| panic!("thread {t} round {i}: {e}"));
                    d.properties()
                        .unwrap_or_else(|e| panic!("thread {t} round {i}: properties: {e}"));
                }
            });
        }
    });
    let took = start.elapsed();
    println!("{THREADS} threads x {ROUNDS} rounds of open, properties, drop: {took:?}");
    reopening_is_free();
}
