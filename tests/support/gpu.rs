//! GPU helpers: device counts, random data with a replayable seed, streams, poisoned device
//! buffers (the library's `DeviceBuffer`) and exact comparisons.

use gpudirect::Error;
use gpudirect::cuda::Stream;
use gpudirect::memory::DeviceBuffer;
use rand::{Rng, SeedableRng, rngs::StdRng};

/// Tests that hold a stream on a host word (a "gate", `cuStreamWaitValue32/64`) run one at a
/// time: `cuMemFree` and `cuMemFreeHost` synchronize the device, so a free on another test's
/// thread while a gate is closed waits for that gate, and `cargo test` runs a binary's tests on
/// several threads. Take this first and keep it to the test's end.
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    GATES.lock().unwrap_or_else(|e| e.into_inner())
}

/// [`one_at_a_time`] for async tests (a guard that may be held across `.await`).
pub async fn one_at_a_time_async() -> tokio::sync::MutexGuard<'static, ()> {
    GATES_ASYNC.lock().await
}

static GATES: std::sync::Mutex<()> = std::sync::Mutex::new(());
static GATES_ASYNC: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The number of visible GPUs, or an error saying why there are none.
pub fn gpus() -> gpudirect::Result<usize> {
    let n = gpudirect::cuda::device_count()?;
    if n == 0 {
        return Err(Error::NoDevice {
            what: "CUDA device",
            reason: "cuDeviceGetCount answered 0".into(),
        });
    }
    Ok(n)
}

/// A seed from the clock, printed so a failure can be replayed with `P2P_TEST_SEED`.
pub fn seed() -> u64 {
    seed_from("P2P_TEST_SEED")
}

/// A seed from the environment variable `var`, else from the clock; printed so that a failure
/// can be replayed by setting `var`.
pub fn seed_from(var: &str) -> u64 {
    let s = std::env::var(var)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(7)
        });
    println!("seed {s}");
    s
}

/// `n` random words from `seed`.
pub fn random_u32(n: usize, seed: u64) -> Vec<u32> {
    let mut r = StdRng::seed_from_u64(seed);
    (0..n).map(|_| r.random()).collect()
}

/// A stream on device `ordinal`.
pub fn stream(ordinal: usize) -> Stream {
    Stream::new(&gpudirect::cuda::context(ordinal).unwrap()).unwrap()
}

/// `n` words of 0xDEADBEEF on device `ordinal`: a destination whose old contents are known.
pub fn poisoned(ordinal: usize, n: usize) -> DeviceBuffer<u32> {
    DeviceBuffer::from_slice(&stream(ordinal), &vec![0xDEAD_BEEFu32; n]).unwrap()
}

/// Compare exactly, reporting the first difference without printing megabytes.
pub fn assert_same(got: &[u32], want: &[u32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at word {i}: got {:#010x}, want {:#010x}",
            got[i], want[i]
        );
    }
}

/// `len` bytes on device `ordinal`, every one `poison`: a destination whose old contents are
/// known (zero through the library's memset, any other byte through a blocking host copy).
pub fn poisoned_bytes(ordinal: usize, len: usize, poison: u8) -> DeviceBuffer<u8> {
    if poison == 0 {
        let ctx = gpudirect::cuda::context(ordinal).unwrap();
        return DeviceBuffer::zeroed(&ctx, len).unwrap();
    }
    DeviceBuffer::from_slice(&stream(ordinal), &vec![poison; len]).unwrap()
}

/// A new device buffer on `ordinal` holding `data` (a blocking copy).
pub fn device_bytes(ordinal: usize, data: &[u8]) -> DeviceBuffer<u8> {
    DeviceBuffer::from_slice(&stream(ordinal), data).unwrap()
}

/// `to_host()`: a device byte buffer's contents, copied to the host (blocking, on a stream of its
/// own device).
pub trait ToHost {
    /// Everything, copied to the host.
    fn to_host(&self) -> Vec<u8>;
}

impl ToHost for DeviceBuffer<u8> {
    fn to_host(&self) -> Vec<u8> {
        use gpudirect::memory::DeviceMemory;
        self.to_vec(&stream(self.ordinal())).unwrap()
    }
}

/// Run test `name` alone, in a child process of this test binary, and say whether this is that
/// child: `true` there (run the test's body), `false` in the parent once the child has passed
/// (the parent panics with the child's output when it failed). For tests that capture a graph in
/// global mode: such a capture forbids potentially unsafe calls (`cuMemAlloc`,
/// `cuStreamSynchronize`) to every thread of its process that is in global mode, so tests running
/// beside it in the harness's threads would fail, and their calls would break the capture.
pub fn alone(name: &str) -> bool {
    const CHILD: &str = "GPUDIRECT_TEST_ALONE";
    if std::env::var(CHILD).is_ok_and(|t| t == name) {
        return true;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, name)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    print!("{text}");
    assert!(
        out.status.success(),
        "{name} failed in its own process:\n{text}"
    );
    assert!(
        text.contains("1 passed"),
        "{name} did not run in its own process:\n{text}"
    );
    false
}

/// Capture a memset on a new stream in global mode on another thread; run `during` while the
/// capture lasts; end it. `Ok(true)`: the capture produced a graph.
pub fn during_a_global_capture<T>(
    ctx: &std::sync::Arc<gpudirect::cudarc::driver::CudaContext>,
    during: impl FnOnce() -> T,
) -> (T, Result<bool, String>) {
    use gpudirect::cudarc::driver::sys;
    use gpudirect::memory::DeviceMemory;
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (end_tx, end_rx) = std::sync::mpsc::channel::<()>();
    let cap = ctx.clone();
    let capturer = std::thread::spawn(move || {
        // Made before the capture: allocating is itself refused in a global capture.
        let s = Stream::new(&cap).unwrap();
        let scratch = DeviceBuffer::<u8>::zeroed(&cap, 4096).unwrap();
        s.cuda()
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
            .unwrap();
        // SAFETY: a live 4096-byte buffer; the stream's context is current (begin_capture).
        let r = unsafe { sys::cuMemsetD8Async(scratch.device_ptr(), 0x11, 4096, s.cu_stream()) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        go_tx.send(()).unwrap();
        end_rx.recv().unwrap();
        let g = s.cuda().end_capture(sys::CUgraphInstantiate_flags(0));
        let out = g.map(|g| g.is_some()).map_err(|e| format!("{e:?}"));
        drop(scratch);
        out
    });
    go_rx.recv().unwrap();
    let t = during();
    end_tx.send(()).unwrap();
    (t, capturer.join().unwrap())
}
