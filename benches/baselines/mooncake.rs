//! Mooncake's transfer engine as a baseline of `transfer_local`: its C++ `transfer_engine_bench`
//! (from a wheel, unpacked by `benches/baselines/mooncake.sh`), one target process and one
//! initiator process per run, `--protocol=nvlink_intra --use_vram --operation=write`, the P2P
//! handshake on 127.0.0.1 (no metadata server). Each of its `--threads` threads submits one
//! batch of `--batch_size` blocks, waits for every block, and again, for `--duration` seconds;
//! block `i` of thread `t` is at `(i * threads + t) * size` on both sides.
//!
//! Its bench checks no bytes. `mooncake_check.so` (`mooncake_check.c`), preloaded into both
//! processes, gives each initiator's buffer a pattern of its offsets and the target's zeros,
//! and reads the target's buffer back when the target exits: after the runs, the longest span
//! written must hold its pattern and the rest zeros.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The bench inside the unpacked wheel.
const BENCH: &str = "mooncake/transfer_engine_bench";
/// The check library beside it.
const CHECK: &str = "mooncake_check.so";
/// How long the target may take to listen.
const START: Duration = Duration::from_secs(60);

/// A running Mooncake target and what runs against it need.
pub struct Mooncake {
    bench: PathBuf,
    check: Option<PathBuf>,
    logs: PathBuf,
    target: Child,
    /// `IP:port` of the target's handshake.
    segment: String,
    src_gpu: usize,
    /// The target's buffer in bytes.
    buffer: usize,
    /// The longest span an initiator reported writing (batches done, blocks laid out from 0).
    written: usize,
    runs: usize,
}

/// What the check library found in the target's buffer at its exit.
pub enum Bytes {
    /// The span written holds its pattern, the rest zeros.
    Checked { written: usize },
    /// Anything else, said in words.
    Wrong(String),
    /// No check ran, and why.
    NotChecked(String),
}

/// The last `n` lines of `path`, indented (for a failure's message).
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| format!("\n    {l}"))
        .collect()
}

/// The value after `key` in `line`, up to the next space or comma.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let rest = &line[line.find(key)? + key.len()..];
    rest.split([' ', ',']).next()
}

impl Mooncake {
    /// The bench in `dir` (the unpacked wheel), its target on GPU `dst_gpu` with a buffer of
    /// `buffer` bytes, listening; initiators will run on GPU `src_gpu`. `Err` says why not.
    pub fn start(
        dir: &Path,
        src_gpu: usize,
        dst_gpu: usize,
        buffer: usize,
    ) -> Result<Self, String> {
        let bench = dir.join(BENCH);
        if !bench.is_file() {
            return Err(format!(
                "no {} (unpack a wheel with benches/baselines/mooncake.sh)",
                bench.display()
            ));
        }
        let check = Some(dir.join(CHECK)).filter(|p| p.is_file());
        let logs = std::env::temp_dir().join(format!("gpudirect-mooncake-{}", std::process::id()));
        std::fs::create_dir_all(&logs).map_err(|e| format!("{}: {e}", logs.display()))?;
        let log = logs.join("target.log");
        let out = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(&bench);
        cmd.args(["--mode=target", "--local_server_name=127.0.0.1"])
            .args(common(dst_gpu, buffer))
            .env("GLOG_logtostderr", "1")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        preload(&mut cmd, check.as_deref(), "target", buffer);
        let mut target = cmd
            .spawn()
            .map_err(|e| format!("{}: {e}", bench.display()))?;
        // Up once it listens and its buffer is registered (it logs the handshake's address,
        // then the memory it uses); a moment more, as its registration ends after the line.
        let end = Instant::now() + START;
        let segment = loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let at = text
                .lines()
                .filter_map(|l| field(l, "listening on "))
                .next_back()
                .filter(|_| text.contains("VRAM is used"));
            if let Some(at) = at {
                break at
                    .trim_end_matches(|c: char| !c.is_ascii_digit())
                    .to_string();
            }
            if let Ok(Some(st)) = target.try_wait() {
                return Err(format!("its target exited ({st}):{}", tail(&log, 12)));
            }
            if Instant::now() > end {
                let _ = target.kill();
                let _ = target.wait();
                return Err(format!(
                    "its target did not listen in {START:?}:{}",
                    tail(&log, 12)
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        std::thread::sleep(Duration::from_secs(2));
        Ok(Mooncake {
            bench,
            check,
            logs,
            target,
            segment,
            src_gpu,
            buffer,
            written: 0,
            runs: 0,
        })
    }

    /// One initiator: `threads` threads writing batches of `batch` blocks of `size` bytes for
    /// `seconds` (whole seconds: Mooncake's `--duration`); GB/s (10^9 bytes per second) as it
    /// reports them.
    pub fn run(
        &mut self,
        size: usize,
        batch: usize,
        threads: usize,
        seconds: u64,
    ) -> Result<f64, String> {
        let span = size * batch * threads;
        // Its own buffer: the span, at least 1 MiB.
        let buffer = span.max(1 << 20);
        let log = self.logs.join(format!("init-{}.log", self.runs));
        self.runs += 1;
        let out = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(&self.bench);
        cmd.args([
            "--mode=initiator",
            "--local_server_name=127.0.0.1",
            "--operation=write",
        ])
        .arg(format!("--segment_id={}", self.segment))
        .args(common(self.src_gpu, buffer))
        .args([
            format!("--block_size={size}"),
            format!("--batch_size={batch}"),
            format!("--threads={threads}"),
            format!("--duration={seconds}"),
        ])
        .env("GLOG_logtostderr", "1")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
        preload(&mut cmd, self.check.as_deref(), "initiator", buffer);
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("{}: {e}", self.bench.display()))?;
        let end = Instant::now() + Duration::from_secs(seconds) + START;
        let st = loop {
            match child.try_wait() {
                Ok(Some(st)) => break st,
                Ok(None) if Instant::now() < end => std::thread::sleep(Duration::from_millis(20)),
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!("an initiator ran past its time:{}", tail(&log, 12)));
                }
            }
        };
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let line = text.lines().find(|l| l.contains("Test completed"));
        let parsed = line.and_then(|l| {
            let batches: usize = field(l, "batch count ")?.parse().ok()?;
            let gbs: f64 = field(l, "throughput ")?.parse().ok()?;
            Some((batches, gbs))
        });
        match parsed {
            Some((batches, gbs)) if st.success() && batches > 0 => {
                // Every block of a batch is written once the batch is done.
                self.written = self.written.max(span);
                Ok(gbs)
            }
            _ => Err(format!("an initiator failed ({st}):{}", tail(&log, 12))),
        }
    }

    /// Stop the target (SIGTERM: it frees its buffer, which the check library reads back
    /// first) and say what its buffer held.
    pub fn stop(mut self) -> Bytes {
        // Our own child, not yet waited for: its pid is still its own.
        let _ = Command::new("kill")
            .args(["-TERM", &self.target.id().to_string()])
            .status();
        let end = Instant::now() + START;
        while matches!(self.target.try_wait(), Ok(None)) && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(50));
        }
        if matches!(self.target.try_wait(), Ok(None)) {
            let _ = self.target.kill();
            let _ = self.target.wait();
        }
        let mut text = String::new();
        let _ = std::fs::File::open(self.logs.join("target.log"))
            .and_then(|mut f| f.read_to_string(&mut text));
        let result = self.bytes(&text);
        if !matches!(result, Bytes::Wrong(_)) {
            let _ = std::fs::remove_dir_all(&self.logs);
        }
        result
    }

    fn bytes(&self, log: &str) -> Bytes {
        if self.check.is_none() {
            return Bytes::NotChecked(format!(
                "no {CHECK} beside the bench (benches/baselines/mooncake.sh builds it)"
            ));
        }
        let Some(line) = log.lines().find(|l| l.starts_with("MC-CHECK")) else {
            return Bytes::NotChecked(format!(
                "the target printed no MC-CHECK line (its buffer was not a cudaMalloc of {} bytes?)",
                self.buffer
            ));
        };
        let num = |k: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(k)?.strip_prefix('='))
                .and_then(|v| v.parse::<usize>().ok())
        };
        let (Some(bytes), Some(pat), Some(first), Some(other)) = (
            num("bytes"),
            num("patterned"),
            num("first_other"),
            num("other"),
        ) else {
            return Bytes::Wrong(format!("{line} (logs in {})", self.logs.display()));
        };
        let want = self.written.min(bytes);
        if pat == want && first == want && other == 0 && self.written > 0 {
            Bytes::Checked { written: want }
        } else {
            Bytes::Wrong(format!(
                "{line}, expected patterned={want} first_other={want} other=0 (logs in {})",
                self.logs.display()
            ))
        }
    }
}

/// The flags both sides share.
fn common(gpu: usize, buffer: usize) -> [String; 7] {
    [
        "--protocol=nvlink_intra".into(),
        "--metadata_server=P2PHANDSHAKE".into(),
        "--use_vram=true".into(),
        format!("--gpu_id={gpu}"),
        format!("--buffer_size={buffer}"),
        "--report_unit=GB".into(),
        "--report_precision=6".into(),
    ]
}

/// Preload the check library (when there is one) for `role`'s buffer of `buffer` bytes.
fn preload(cmd: &mut Command, check: Option<&Path>, role: &str, buffer: usize) {
    if let Some(lib) = check {
        cmd.env("LD_PRELOAD", lib)
            .env("GPUDIRECT_MC_ROLE", role)
            .env("GPUDIRECT_MC_BYTES", buffer.to_string());
    }
}
