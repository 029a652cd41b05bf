//! Tier 0: every example exits 0 where it runs (with `SKIPPED: reason` where hardware is absent).
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
