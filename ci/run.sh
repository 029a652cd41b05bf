#!/usr/bin/env bash
# CI (`.ci/run` calls this): formatting, lints (also per feature set of gpudirect), docs, the
# module layering, the README's test
# command (tier 0), the property tests in release, crates of users' shape that depend on gpudirect,
# packaging, then tier 1 (Soft-RoCE VM). docs/test-tiers.md describes the tiers.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never CARGO_INCREMENTAL=0
# Line tables only: full debug info made the target directory several GB, and a CI machine's disk
# has been seen nearly full (a run failed in `cargo doc` with ENOSPC).
export CARGO_PROFILE_DEV_DEBUG=line-tables-only
step() { printf '\n=== %s (%ss)\n' "$*" "$SECONDS"; }

step "setup"
bash ci/setup.sh

# A real etcd on a loopback port with a data directory of its own, for the metadata store's
# tests (tests/membership_etcd.rs finds it through GPUDIRECT_ETCD); stopped when this script ends.
etcd_dir=$(mktemp -d)
etcd_port=${GPUDIRECT_ETCD_PORT:-23790}
stop_etcd() {
  if [ -n "${etcd_pid:-}" ]; then kill "$etcd_pid" 2>/dev/null || true; wait "$etcd_pid" 2>/dev/null || true; etcd_pid=; fi
  rm -rf "$etcd_dir"
}
trap stop_etcd EXIT
start_etcd() {
  etcd --name ci --data-dir "$etcd_dir/data" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$((etcd_port + 10))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((etcd_port + 10))" \
    --initial-cluster "ci=http://127.0.0.1:$((etcd_port + 10))" >"$etcd_dir/log" 2>&1 &
  etcd_pid=$!
  for _ in $(seq 100); do
    ETCDCTL_API=3 etcdctl --endpoints="127.0.0.1:$etcd_port" endpoint health >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  cat "$etcd_dir/log"; echo "etcd did not start"; return 1
}

step "cargo fmt --check"
cargo fmt --all --check

step "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings

step "gpudirect's features: each path alone, and none (clippy of the library and its unit tests)"
# A program may build only the paths it uses (`default-features = false`). The CUDA version
# feature stays: it only picks cudarc's bindings. gpudirect alone is checked again per set; its
# dependencies come from the target directory above.
for set in "" p2p rdma storage report serde tokio transfer transfer,p2p etcd transfer,etcd; do
  echo "--- features: cuda-12080${set:+,$set}"
  cargo clippy -p gpudirect --all-targets --no-default-features \
    --features "cuda-12080${set:+,$set}" -- -D warnings
done

step "cargo doc"
RUSTDOCFLAGS=-Dwarnings cargo doc --workspace --no-deps

step "module layering (scripts/check-layers.py)"
# Each file or sub-folder imports only those before it on its folder's line of scripts/layers.txt;
# no two files of a module import each other, directly or through a longer cycle; the table's
# forbidden pairs never meet. The checkers' own tests first (this one's and check-source's): each
# rule can fail.
python3 scripts/test_checks.py
python3 scripts/check-layers.py gpudirect/src

step "rules on the sources (scripts/check-source.py)"
# Every thread the crate starts goes through driver::ctx::spawn_thread or spawn_scoped_thread; no
# binary bakes in a path of this machine (env!("CARGO_MANIFEST_DIR")). Tier-0 checks on the source
# tree: no test binary reads the sources (the GPU bundle runs them where there are none).
python3 scripts/check-source.py

step "cargo test (README's test command)"
cargo test

step "the metadata store against a real etcd (tests/membership_etcd.rs, feature etcd)"
# Keys, leases and keep-alives, watches, expiry of a SIGKILLed and a SIGSTOPped publisher, and
# etcd killed and started again (the test starts that etcd itself, from GPUDIRECT_ETCD_BIN).
# GPUDIRECT_REQUIRE=etcd: a skip here fails.
cargo clippy --features etcd --test membership_etcd -- -D warnings
start_etcd
GPUDIRECT_ETCD="127.0.0.1:$etcd_port" GPUDIRECT_ETCD_BIN="$(command -v etcd)" GPUDIRECT_REQUIRE=etcd \
  cargo test --features etcd --test membership_etcd -- --nocapture
stop_etcd

step "cargo test --release: gpudirect's unit and property tests with optimizations"
# Overflow checks are off in release: the property tests show the arithmetic is checked there too.
cargo test --release -p gpudirect --features cuda-12080 --lib

# Each on its own (they choose different CUDA versions), in the workspace's target directory so
# that the dependencies built above are reused. `check`, not `build`: dynamic-linking would need
# libcuda to link against.
for crate in cudarc-oldest cudarc-newest dynamic-linking gpudirect-only; do
  step "downstream crate $crate (tests/downstream-crates)"
  cargo check --manifest-path tests/downstream-crates/Cargo.toml -p "$crate" --target-dir target
done

step "cargo package: gpudirect-sys and gpudirect build from their packaged sources alone"
# Cargo unpacks the packaged gpudirect-sys from a temporary registry under target/package into a
# directory of CARGO_HOME named after that registry's path, and reuses what a run from the same path
# left there: a stale gpudirect-sys once failed this step. Remove those unpacked copies first.
rm -rf "${CARGO_HOME:-$HOME/.cargo}"/registry/src/-*/gpudirect-[0-9s]*
# gpudirect picks no CUDA version by itself: the verification build picks one, as a user would.
cargo package -p gpudirect-sys -p gpudirect --features gpudirect/cuda-12080 --allow-dirty

if [ -f ci/rxe-vm/run.sh ]; then
  step "tier 1: Soft-RoCE VM"
  bash ci/rxe-vm/run.sh
fi
step "done"
