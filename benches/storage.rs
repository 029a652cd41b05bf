//! File ↔ GPU throughput: raw cuFile calls, a raw single-thread `pread` + pinned H2D baseline, and
//! the automatic path, page-cache hot and cold, runs interleaved; medians, spread and ratios.
//!
//! `cargo bench --bench storage`. Environment: `GPUDIRECT_BENCH_MIB` (file size, default 1024),
//! `GPUDIRECT_BENCH_REPS` (interleaved rounds, default 5), `GPUDIRECT_TEST_DIR` (where the file
//! goes). Cold = `fdatasync` + `posix_fadvise(DONTNEED)` before each read (the raw baseline then
//! reads with `O_DIRECT`), and `fdatasync` counted in each write. Prints `SKIPPED: reason`
//! without a GPU.

#[path = "../tests/support/files.rs"]
mod files;

use criterion::Criterion;
use files::test_dir;
use gpudirect::cudarc::driver::sys as cu;
use gpudirect::memory::DeviceBuffer;
use gpudirect::storage::{DirectIo, Driver, File, FileHandle, Mode, OpenOptions};
use gpudirect_testing::{Hardware, skip_example};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

const STAGE: usize = 64 << 20;

/// A positive whole number from the environment variable `k`, else `d`; a bad value stops the
/// bench with its name and the value (rather than silently measuring something else).
fn env_usize(k: &str, d: usize) -> usize {
    match std::env::var(k) {
        Err(_) => d,
        Ok(s) => match s.trim().parse() {
            Ok(n) if n > 0 => n,
            _ => panic!("{k}={s:?}: expected a positive whole number"),
        },
    }
}

fn drop_cache(path: &std::path::Path) {
    let f = std::fs::File::open(path).unwrap();
    // SAFETY: a valid descriptor.
    unsafe {
        libc::fdatasync(f.as_raw_fd());
        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
}

struct Pinned(*mut u8);
impl Pinned {
    fn new(len: usize) -> Self {
        let mut p = std::ptr::null_mut();
        // SAFETY: valid out-pointer; context current.
        assert_eq!(
            unsafe { cu::cuMemHostAlloc(&mut p, len, 0) },
            cu::CUresult::CUDA_SUCCESS
        );
        Pinned(p.cast())
    }
}
impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated above; all copies were synchronous.
        unsafe { cu::cuMemFreeHost(self.0.cast()) };
    }
}

/// Raw baseline: one thread, pread into one pinned buffer, synchronous H2D, repeat.
fn raw_pread_h2d(fd: i32, dst: &DeviceBuffer<u8>, len: usize, pinned: &Pinned) {
    let mut off = 0;
    while off < len {
        let n = STAGE.min(len - off);
        // SAFETY: the pinned buffer holds STAGE bytes.
        let r = unsafe { libc::pread(fd, pinned.0.cast(), n, off as i64) };
        assert!(r > 0, "pread: {}", std::io::Error::last_os_error());
        // SAFETY: ranges within the buffers.
        unsafe {
            cu::cuMemcpyHtoD_v2(
                gpudirect::memory::DeviceMemory::device_ptr(dst) + off as u64,
                pinned.0.cast(),
                r as usize,
            );
        }
        off += r as usize;
    }
}

/// Raw baseline for writes: synchronous D2H into pinned memory, pwrite, repeat.
fn raw_d2h_pwrite(fd: i32, src: &DeviceBuffer<u8>, len: usize, pinned: &Pinned) {
    let mut off = 0;
    while off < len {
        let n = STAGE.min(len - off);
        // SAFETY: ranges within the buffers.
        unsafe {
            cu::cuMemcpyDtoH_v2(
                pinned.0.cast(),
                gpudirect::memory::DeviceMemory::device_ptr(src) + off as u64,
                n,
            );
        }
        // SAFETY: the pinned buffer holds n bytes.
        let r = unsafe { libc::pwrite(fd, pinned.0.cast(), n, off as i64) };
        assert_eq!(r as usize, n, "pwrite: {}", std::io::Error::last_os_error());
        off += n;
    }
}

/// Raw cuFile calls, looped over short counts.
fn raw_cufile(h: &FileHandle, buf: u64, len: usize, write: bool) {
    let lib = gpudirect::sys::cufile::lib().unwrap();
    let mut off = 0usize;
    while off < len {
        let n = (len - off).min(1 << 30);
        // SAFETY: the buffer holds len bytes; the handle is registered.
        let r = unsafe {
            if write {
                (lib.cuFileWrite)(h.as_raw(), buf as *const _, n, off as i64, off as i64)
            } else {
                (lib.cuFileRead)(h.as_raw(), buf as *mut _, n, off as i64, off as i64)
            }
        };
        assert!(r > 0, "cuFile returned {r}");
        off += r as usize;
    }
}

fn stats(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() {
    let ctx = match gpudirect::cuda::context(0) {
        Ok(c) => c,
        Err(e) => skip_example(Hardware::Gpu, format!("no GPU: {e}")),
    };
    ctx.bind_to_thread().unwrap();
    let mib = env_usize("GPUDIRECT_BENCH_MIB", 1024);
    let reps = env_usize("GPUDIRECT_BENCH_REPS", 5);
    let len = mib
        .checked_mul(1 << 20)
        .unwrap_or_else(|| panic!("GPUDIRECT_BENCH_MIB={mib}: more bytes than addressable"));
    let path = test_dir().join(format!("bench-{}", std::process::id()));
    let out = test_dir().join(format!("bench-out-{}", std::process::id()));
    {
        let data = files::pattern(len, 42);
        std::fs::write(&path, &data).unwrap();
    }
    let gpu = DeviceBuffer::<u8>::zeroed(&ctx, len).unwrap();
    let pinned = Pinned::new(STAGE);
    let buffered = std::fs::File::open(&path).unwrap();
    let (direct, is_direct) = OpenOptions::read_only().open(&path).unwrap();
    let auto = File::open(&path, &OpenOptions::read_only(), Mode::Auto).unwrap();
    let auto_out = File::open(&out, &OpenOptions::read_write(), Mode::Auto).unwrap();
    let out_buf = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&out)
        .unwrap();
    let driver = Driver::open().ok();
    let cufile_in = driver
        .as_ref()
        .and_then(|d| FileHandle::open(d, &path, &OpenOptions::read_only()).ok());
    let cufile_out = driver.as_ref().and_then(|d| {
        FileHandle::open(d, &out, &OpenOptions::read_write().direct(DirectIo::Off)).ok()
    });
    println!(
        "{mib} MiB, {reps} rounds; cuFile read: {}, write: {}; O_DIRECT: {is_direct}; auto read path: {:?}",
        cufile_in.is_some(),
        cufile_out.is_some(),
        auto.path_for_read(0, len)
    );
    let dptr = gpudirect::memory::DeviceMemory::device_ptr(&gpu);
    let view = View { ptr: dptr, len };

    type Case<'a> = (&'static str, &'static str, bool, Box<dyn Fn() + 'a>);
    let mut cases: Vec<Case> = Vec::new();
    for cold in [false, true] {
        if let Some(h) = &cufile_in {
            cases.push((
                "read",
                "raw cuFile",
                cold,
                Box::new(move || raw_cufile(h, dptr, len, false)),
            ));
        }
        let fd = if cold && is_direct {
            direct.as_raw_fd()
        } else {
            buffered.as_raw_fd()
        };
        let (g, p) = (&gpu, &pinned);
        cases.push((
            "read",
            "raw pread+H2D",
            cold,
            Box::new(move || raw_pread_h2d(fd, g, len, p)),
        ));
        let a = &auto;
        cases.push((
            "read",
            "auto",
            cold,
            Box::new(move || {
                let mut b = view;
                a.read_to_device(&mut b, 0, 0, len).unwrap();
            }),
        ));
        let sync = move |fd: i32| {
            if cold {
                // SAFETY: a valid descriptor.
                unsafe { libc::fdatasync(fd) };
            }
        };
        if let Some(h) = &cufile_out {
            cases.push((
                "write",
                "raw cuFile",
                cold,
                Box::new(move || {
                    raw_cufile(h, dptr, len, true);
                    sync(std::os::fd::AsFd::as_fd(h).as_raw_fd());
                }),
            ));
        }
        let ofd = out_buf.as_raw_fd();
        cases.push((
            "write",
            "raw D2H+pwrite",
            cold,
            Box::new(move || {
                raw_d2h_pwrite(ofd, g, len, p);
                sync(ofd);
            }),
        ));
        let ao = &auto_out;
        cases.push((
            "write",
            "auto",
            cold,
            Box::new(move || {
                ao.write_from_device(&view, 0, 0, len).unwrap();
                sync(ofd);
            }),
        ));
    }

    let mut times: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for _ in 0..reps {
        for (i, (dir, _, cold, f)) in cases.iter().enumerate() {
            if *dir == "read" {
                if *cold {
                    drop_cache(&path);
                } else {
                    // Make sure it is cached.
                    let _ = std::fs::read(&path).map(|v| v.len());
                }
            }
            let t = Instant::now();
            f();
            // SAFETY: context current.
            unsafe { cu::cuCtxSynchronize() };
            times[i].push(len as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    println!("\n| direction | cache | path | median GB/s | min | max | vs best raw |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let mut rows = Vec::new();
    for (i, (dir, name, cold, _)) in cases.iter().enumerate() {
        let (med, lo, hi) = stats(&mut times[i]);
        rows.push((*dir, *cold, *name, med, lo, hi));
    }
    for &(dir, cold, name, med, lo, hi) in &rows {
        let best_raw = rows
            .iter()
            .filter(|r| r.0 == dir && r.1 == cold && r.2 != "auto")
            .map(|r| r.3)
            .fold(0.0, f64::max);
        println!(
            "| {dir} | {} | {name} | {med:.2} | {lo:.2} | {hi:.2} | {:.2}x |",
            if cold { "cold" } else { "hot" },
            med / best_raw
        );
    }

    // Criterion's own statistics for the headline case: the automatic path, hot read.
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    let _ = std::fs::read(&path);
    c.bench_function(&format!("auto_read_hot_{mib}MiB"), |b| {
        b.iter(|| {
            let mut g = view;
            auto.read_to_device(&mut g, 0, 0, len).unwrap()
        })
    });
    c.final_summary();
    drop(cases);
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&out);
}

/// A pointer-only view of the bench's device buffer, for the blocking calls (they finish before
/// returning, and the buffer outlives every call).
#[derive(Clone, Copy)]
struct View {
    ptr: u64,
    len: usize,
}
// SAFETY: `ptr..ptr+len` is the bench's DeviceBuffer (cuMemAlloc memory) on device 0, alive
// until main returns, after every call that uses a View.
unsafe impl gpudirect::memory::DeviceMemory for View {
    type Elem = u8;
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn ordinal(&self) -> usize {
        0
    }
    fn kind(&self) -> gpudirect::memory::MemoryKind {
        gpudirect::memory::MemoryKind::Device
    }
}

// SAFETY: the bench makes no host reference to the buffer's bytes, and no two transfers using a
// View run at once.
unsafe impl gpudirect::memory::DeviceMemoryMut for View {}
