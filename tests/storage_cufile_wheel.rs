//! Tier 0: the real libcufile from the `nvidia-cufile` wheels (1.14 and 1.20), on a machine
//! without a GPU. Each check runs in a child process (the library may abort or hang without
//! libcuda: 1.20's `cuFileDriverOpen` hangs), with a time limit.
//!
//! Under cargo the wheels are fetched with pip into `cufile-wheels/` of the target directory
//! (`CARGO_TARGET_DIR`, else the checkout's `target/`) when absent
//! (`tests/support/cufile-wheel.sh` does the same by hand), in one quick try; without pip (or a
//! network) the test prints `SKIPPED: reason`; `GPUDIRECT_CUFILE_WHEEL_FETCH=0` skips it
//! without trying. `GPUDIRECT_CUFILE_WHEEL_DIR` points at an already unpacked set. Outside cargo
//! (the GPU bundle) there is no checkout: without that variable the test skips at once,
//! fetching nothing.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "GPUDIRECT_WHEEL_TEST_CHILD";

/// `GPUDIRECT_CUFILE_WHEEL_DIR`, else `cufile-wheels` in the target directory of the checkout
/// cargo runs this test from (cargo sets `CARGO_MANIFEST_DIR` for the tests it runs;
/// `CARGO_TARGET_DIR` when the caller set one). The path the checkout had at build time means
/// nothing where the binary is carried to (the GPU bundle).
fn wheel_dir() -> Result<PathBuf, String> {
    if let Some(d) = std::env::var_os("GPUDIRECT_CUFILE_WHEEL_DIR") {
        return Ok(PathBuf::from(d));
    }
    match std::env::var_os("CARGO_MANIFEST_DIR") {
        Some(d) => Ok(std::env::var_os("CARGO_TARGET_DIR")
            .map_or_else(|| Path::new(&d).join("target"), PathBuf::from)
            .join("cufile-wheels")),
        None => Err(
            "not run by cargo (no checkout to fetch them into), and GPUDIRECT_CUFILE_WHEEL_DIR is \
             not set"
                .into(),
        ),
    }
}

fn find(dir: &Path, name: &str, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            find(&p, name, out);
        } else if p.file_name().is_some_and(|f| f == name) {
            out.push(p);
        }
    }
}

/// The unpacked `libcufile.so.0` of each wheel, fetching them when absent.
fn libraries() -> Result<Vec<PathBuf>, String> {
    let dir = wheel_dir()?;
    let mut libs = Vec::new();
    find(&dir, "libcufile.so.0", &mut libs);
    if libs.len() >= 2 {
        return Ok(libs);
    }
    if std::env::var_os("GPUDIRECT_CUFILE_WHEEL_FETCH").is_some_and(|v| v == "0") {
        return Err(format!(
            "not in {} and GPUDIRECT_CUFILE_WHEEL_FETCH=0 (no fetch)",
            dir.display()
        ));
    }
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    for pkg in ["nvidia-cufile", "nvidia-cufile-cu12"] {
        // One try with a short timeout: without a network, pip's retries took seconds to fail.
        let st = Command::new("python3")
            .args(["-m", "pip", "download", "--no-deps", "--quiet"])
            .args(["--retries", "0", "--timeout", "3", pkg, "-d"])
            .arg(&dir)
            .stdout(Stdio::null())
            .status()
            .map_err(|e| format!("python3 -m pip unavailable: {e}"))?;
        if !st.success() {
            return Err(format!("pip download {pkg} failed ({st}); no network?"));
        }
    }
    let wheels: Vec<_> = std::fs::read_dir(&dir)
        .map_err(|e| e.to_string())?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    for w in wheels {
        let stem = w.file_stem().unwrap().to_string_lossy().into_owned();
        let st = Command::new("python3")
            .args(["-m", "zipfile", "-e"])
            .arg(&w)
            .arg(dir.join(stem))
            .status()
            .map_err(|e| e.to_string())?;
        if !st.success() {
            return Err(format!("unzip {} failed", w.display()));
        }
    }
    libs.clear();
    find(&dir, "libcufile.so.0", &mut libs);
    if libs.is_empty() {
        return Err("no libcufile.so.0 in the wheels".into());
    }
    Ok(libs)
}

/// In the child: load through GPUDIRECT_LIBCUFILE_PATH, read the version, open the driver.
fn child() {
    let lib = gpudirect::sys::cufile::lib().expect("the wheel's library loads");
    println!("LOADED {} version {:?}", lib.path(), lib.version());
    let batch = gpudirect::storage::SizeParam::IoBatchSize.get();
    println!("PARAM io_batchsize {batch:?}");
    // A 1.20 parameter: refused (typed) by 1.14, answered by 1.20.
    let newer = gpudirect::storage::BoolParam::GdsFallbackIo.get();
    println!("PARAM gds_fallback_io {newer:?}");
    match gpudirect::storage::Driver::open() {
        Ok(d) => println!("OPENED {:?} (this machine has a GPU)", d.version()),
        Err(e) => println!("TYPED_ERROR {e:?} :: {e}"),
    }
}

#[test]
fn wheel_library_loads_and_driver_open_is_a_typed_error() {
    if std::env::var_os(CHILD_ENV).is_some() {
        child();
        return;
    }
    let libs = match libraries() {
        Ok(l) => l,
        Err(reason) => {
            // Not hardware: GPUDIRECT_REQUIRE does not apply.
            println!("SKIPPED: cuFile wheels unavailable: {reason}");
            return;
        }
    };
    for lib in libs {
        let mut c = Command::new(std::env::current_exe().unwrap())
            .args([
                "wheel_library_loads_and_driver_open_is_a_typed_error",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, "1")
            .env(gpudirect::sys::cufile::PATH_ENV, &lib)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let start = Instant::now();
        let status = loop {
            if let Some(s) = c.try_wait().unwrap() {
                break s;
            }
            if start.elapsed() > Duration::from_secs(60) {
                let _ = c.kill();
                panic!(
                    "child for {} hung (our Driver::open must not)",
                    lib.display()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let out = c.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        println!("{}:\n{stdout}", lib.display());
        assert!(
            status.success(),
            "{status}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("LOADED"), "{stdout}");
        assert!(
            stdout.contains(&lib.display().to_string()),
            "loaded from the env path: {stdout}"
        );
        assert!(
            stdout.contains("version Some(1140)")
                || stdout.contains("version Some(1200)")
                || stdout.contains("version Some("),
            "{stdout}"
        );
        assert!(stdout.contains("PARAM io_batchsize Ok("), "{stdout}");
        if stdout.contains("version Some(1140)") {
            assert!(
                stdout.contains("PARAM gds_fallback_io Err(Unsupported"),
                "{stdout}"
            );
        }
        if stdout.contains("version Some(1200)") {
            assert!(stdout.contains("PARAM gds_fallback_io Ok("), "{stdout}");
        }
        if gpudirect::sys::cuda::driver().is_err() {
            // No libcuda here: the typed load error names libcuda and the files tried.
            assert!(
                stdout.contains("TYPED_ERROR Load(LibraryNotFound"),
                "{stdout}"
            );
            assert!(stdout.contains("libcuda.so.1"), "{stdout}");
        } else {
            assert!(
                stdout.contains("TYPED_ERROR") || stdout.contains("OPENED"),
                "{stdout}"
            );
        }
    }
}
