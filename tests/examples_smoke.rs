//! Tier 0: every example exits 0 where it runs (with `SKIPPED: reason` where hardware is absent),
//! answers `--help` with status 0, and refuses bad or contradictory values with status 2, naming
//! the value.
//!
//! Runs the example binaries cargo built beside this test (`cargo test` builds examples).

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

fn examples_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?.parent()?.join("examples");
    dir.is_dir().then_some(dir)
}

#[test]
fn examples_exit_zero() {
    let Some(dir) = examples_dir() else {
        println!("SKIPPED: no examples folder beside the test binary");
        return;
    };
    let mut ran = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        // cargo leaves hashed copies (name-hash) and .d files beside the plain names.
        let is_plain = path.extension().is_none() && !name.contains('-');
        if !is_plain || !path.is_file() {
            continue;
        }
        let start = Instant::now();
        let out = Command::new(&path).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "example {name} exited {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
            out.status
        );
        assert!(!stdout.trim().is_empty(), "example {name} printed nothing");
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "example {name} took {:?}",
            start.elapsed()
        );
        println!("example {name}: ok ({} lines)", stdout.lines().count());
        ran += 1;
    }
    assert!(ran >= 1, "no example binaries found in {}", dir.display());
}

/// Run example `name` with `args` and extra environment `env`: (status code, stdout, stderr).
/// `None` when the binary is not there (an examples folder from another build).
fn run(name: &str, args: &[&str], env: &[(&str, &str)]) -> Option<(Option<i32>, String, String)> {
    let path = examples_dir()?.join(name);
    if !path.is_file() {
        return None;
    }
    let mut cmd = Command::new(&path);
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    Some((
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// The examples whose command lines this file checks, with words their `--help` must contain.
const HELP: &[(&str, &[&str])] = &[
    (
        "async_pipeline",
        &[
            "--mib",
            "--chunk-mib",
            "--deadline-ms",
            "milliseconds",
            "PIPELINE_CHUNK_MIB",
            "GPUDIRECT_TEST_DIR",
        ],
    ),
    (
        "cufile_roundtrip",
        &[
            "--mib",
            "MiB",
            "GPUDIRECT_EXAMPLE_MIB",
            "GPUDIRECT_TEST_DIR",
        ],
    ),
    ("p2p_copy", &["--json", "--mib", "MiB"]),
    ("gpu_rdma_write", &["BYTES", "1048576"]),
    (
        "overlap_pipeline",
        &[
            "--batch-mib",
            "--steps",
            "--kernel-us",
            "microseconds",
            "OVERLAP_BATCH_MIB",
            "OVERLAP_STEPS",
            "OVERLAP_KERNEL_US",
        ],
    ),
    (
        "rdma_pingpong",
        &[
            "--server",
            "--connect",
            "--port",
            "--only",
            "--bytes",
            "MB/s",
            "host name",
        ],
    ),
];

#[test]
fn help_exits_zero_and_lists_options_units_and_environment() {
    let mut ran = 0;
    for (name, words) in HELP {
        let Some((code, stdout, stderr)) = run(name, &["--help"], &[]) else {
            println!("SKIPPED: example {name} not built beside this test");
            continue;
        };
        assert_eq!(
            code,
            Some(0),
            "{name} --help\nstdout:\n{stdout}\nstderr:\n{stderr}"
        );
        for w in *words {
            assert!(stdout.contains(w), "{name} --help lacks {w:?}:\n{stdout}");
        }
        ran += 1;
    }
    println!("--help checked for {ran} examples");
}

/// (example, arguments, environment, text the error must contain)
type BadCase = (
    &'static str,
    &'static [&'static str],
    &'static [(&'static str, &'static str)],
    &'static str,
);

#[test]
fn bad_values_exit_two_naming_the_value() {
    let cases: &[BadCase] = &[
        ("async_pipeline", &["--chunk-mib", "0"], &[], "'0'"),
        (
            "async_pipeline",
            &["--mib", "12", "--chunk-mib", "8"],
            &[],
            "not a multiple",
        ),
        (
            "async_pipeline",
            &[],
            &[("PIPELINE_DEADLINE_MS", "soon")],
            "'soon'",
        ),
        ("cufile_roundtrip", &["--mib", "0"], &[], "'0'"),
        ("cufile_roundtrip", &["--mib", "many"], &[], "'many'"),
        (
            "cufile_roundtrip",
            &[],
            &[("GPUDIRECT_EXAMPLE_MIB", "12x")],
            "'12x'",
        ),
        (
            "p2p_copy",
            &["--mib", "18446744073709551615"],
            &[],
            "more bytes than",
        ),
        ("p2p_copy", &["--mib", "-3"], &[], "-3"),
        ("p2p_copy", &["--bogus"], &[], "--bogus"),
        ("gpu_rdma_write", &["0"], &[], "'0'"),
        ("gpu_rdma_write", &["1MiB"], &[], "'1MiB'"),
        ("overlap_pipeline", &["--steps", "2"], &[], "'2'"),
        ("overlap_pipeline", &["--batch-mib", "5000"], &[], "'5000'"),
        (
            "overlap_pipeline",
            &[],
            &[("OVERLAP_STEPS", "forty")],
            "'forty'",
        ),
        (
            "overlap_pipeline",
            &[],
            &[("OVERLAP_KERNEL_US", "-1")],
            "'-1'",
        ),
        ("rdma_pingpong", &["--only", "0"], &[], "'0'"),
        ("rdma_pingpong", &["--size", "2000000"], &[], "'2000000'"),
        (
            "rdma_pingpong",
            &["--port", "70000", "--server"],
            &[],
            "'70000'",
        ),
        (
            "rdma_pingpong",
            &["--server", "--connect", "127.0.0.1"],
            &[],
            "cannot be used with",
        ),
        (
            "rdma_pingpong",
            &["--report", "--only", "64"],
            &[],
            "cannot be used with",
        ),
        (
            "rdma_pingpong",
            &["--report", "--iters", "5"],
            &[],
            "cannot be used with",
        ),
        (
            "rdma_pingpong",
            &["--connect", "127.0.0.1", "--addr", "127.0.0.1"],
            &[],
            "cannot be used with",
        ),
        (
            "rdma_pingpong",
            &["--port", "7000"],
            &[],
            "--server|--connect",
        ),
        ("rdma_pingpong", &["--bytes", "100"], &[], "--report|--only"),
    ];
    let mut ran = 0;
    for (name, args, env, says) in cases {
        let Some((code, stdout, stderr)) = run(name, args, env) else {
            println!("SKIPPED: example {name} not built beside this test");
            continue;
        };
        assert_eq!(
            code,
            Some(2),
            "{name} {args:?} {env:?} must exit 2\nstdout:\n{stdout}\nstderr:\n{stderr}"
        );
        assert!(
            stderr.contains(says),
            "{name} {args:?} {env:?}: stderr lacks {says:?}:\n{stderr}"
        );
        ran += 1;
    }
    println!("{ran} bad command lines refused");
}

#[test]
fn hosts_may_be_names_or_addresses() {
    // `localhost` resolves everywhere without a network; the example then skips or runs.
    for args in [
        ["--connect", "localhost"],
        ["--connect", "127.0.0.1"],
        ["--addr", "localhost"],
    ] {
        let Some((code, stdout, stderr)) =
            run("rdma_pingpong", &args, &[("GPUDIRECT_REQUIRE", "")])
        else {
            println!("SKIPPED: example rdma_pingpong not built beside this test");
            return;
        };
        assert_ne!(code, Some(2), "{args:?} refused:\n{stdout}\n{stderr}");
    }
}
