//! Uses gpudirect and cudarc together with the CUDA 13.0 bindings; runs anywhere (prints what it
//! finds, exits 0 without a GPU).

use cudarc::driver::sys::CUresult;

fn main() {
    // The same cudarc types flow between the two crates: one version, one feature.
    let e = gpudirect::error::cu("cuCtxEnablePeerAccess", CUresult::CUDA_ERROR_TOO_MANY_PEERS)
        .unwrap_err();
    assert_eq!(
        gpudirect::p2p::Refusal::of(&e),
        Some(gpudirect::p2p::Refusal::TooManyPeers)
    );
    assert_eq!(gpudirect::cuda::BINDINGS_VERSION, 13000);
    match gpudirect::p2p::LinkMatrix::probe() {
        Ok(m) => print!("{}", m.table()),
        Err(e) => println!("SKIPPED: {e}"),
    }
}
