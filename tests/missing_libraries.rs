//! With libcuda absent the program starts and every CUDA entry point answers a typed
//! `LibraryNotFound` naming the file names tried (tier 0; on a GPU node there is nothing to test).

use gpudirect::Error;
use gpudirect::sys::LoadError;

#[test]
fn cuda_entry_points_answer_library_not_found() {
    if gpudirect::sys::cuda::driver().is_ok() {
        println!("SKIPPED: libcuda is present on this machine");
        return;
    }
    let check = |what: &str, e: Error| match e {
        Error::Load(LoadError::LibraryNotFound { library, tried, .. }) => {
            assert_eq!(library, "libcuda", "{what}");
            assert!(
                tried.iter().any(|t| t == "libcuda.so.1"),
                "{what}: {tried:?}"
            );
            assert!(tried.iter().any(|t| t == "libcuda.so"), "{what}: {tried:?}");
        }
        other => panic!("{what}: expected LibraryNotFound, got {other:?}"),
    };
    check("init", gpudirect::cuda::init().unwrap_err());
    check("device_count", gpudirect::cuda::device_count().unwrap_err());
    check("context", gpudirect::cuda::context(0).unwrap_err());
    check(
        "DeviceInfo::all",
        gpudirect::cuda::DeviceInfo::all().unwrap_err(),
    );
}
