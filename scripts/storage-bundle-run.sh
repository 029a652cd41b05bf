#!/usr/bin/env bash
# Runner for the storage bundle on a GPU node without a Rust toolchain (copied to
# bundle/storage/run.sh by scripts/storage-bundle.sh). Runs every storage test binary with
# GPUDIRECT_REQUIRE=gpu,cufile twice: first WITHOUT the udev entry (cuFileHandleRegister answers
# 5027, the fallback is exercised), then WITH it (scripts/cufile-udev.sh, as root), then the example
# and the bench. Ends with "N passed, N failed".
set -u
B=$(cd "$(dirname "$0")" && pwd)
cd "$B/../.."
OUT=${OUT:-$B/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
export GPUDIRECT_TEST_DIR=$PWD/target/gpudirect-storage-test
mkdir -p "$GPUDIRECT_TEST_DIR"
if ! ldconfig -p | grep -q libcufile.so.0 && [[ -e /usr/local/cuda/lib64/libcufile.so.0 ]]; then
  echo "libcufile not in the loader cache: adding /usr/local/cuda/lib64 to LD_LIBRARY_PATH"
  export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
echo "== node"; nvidia-smi -L 2>&1 | head -2; uname -r; id -u
findmnt -n -o SOURCE,FSTYPE,MAJ:MIN --target "$GPUDIRECT_TEST_DIR"; ls /usr/local/cuda/lib64/libcufile* 2>&1 | head -3
lsmod 2>/dev/null | grep -i nvidia_fs || echo "no nvidia-fs module"
ls -la /run/udev/data 2>&1 | head -5
pass=0; fail=0
step() { # name timeout cmd...
  local name=$1 t=$2; shift 2
  echo; echo "== $name"
  local s=$(date +%s%N)
  timeout "$t" "$@"; local rc=$?
  if [[ $rc -eq 0 ]]; then pass=$((pass+1)); r=ok; else fail=$((fail+1)); r="FAILED(rc=$rc)"; fi
  echo "== $name: $r in $(( ($(date +%s%N) - s) / 1000000 )) ms"
}
tests() { # label
  for t in "$B"/storage_first_call "$B"/gpudirect_lib; do
    [[ -x $t ]] || continue
    step "$1 $(basename "$t")" 60 env GPUDIRECT_REQUIRE=gpu,cufile "$t" --test-threads=1 --nocapture
  done
  # The batch test alone, so that a hang cannot hide the other results.
  step "$1 storage_gpu" 120 env GPUDIRECT_REQUIRE=gpu,cufile "$B"/storage_gpu --test-threads=1 --nocapture --skip batches_split
  step "$1 storage_gpu batches" 90 env GPUDIRECT_REQUIRE=gpu,cufile "$B"/storage_gpu --test-threads=1 --nocapture batches_split
  step "$1 example cufile_roundtrip" 60 env GPUDIRECT_REQUIRE=gpu GPUDIRECT_EXAMPLE_MIB=256 "$B"/cufile_roundtrip
}
if [[ -e /run/udev/data ]]; then echo "NOTE: /run/udev/data already exists"; fi
tests "no-udev:"
step "udev entry" 10 bash "$B"/cufile-udev.sh "$GPUDIRECT_TEST_DIR"
export GPUDIRECT_BIG_TESTS=1
tests "udev:"
step "bench storage" 150 env GPUDIRECT_BENCH_MIB=${GPUDIRECT_BENCH_MIB:-1024} GPUDIRECT_BENCH_REPS=${GPUDIRECT_BENCH_REPS:-5} "$B"/storage --bench
rm -rf "$GPUDIRECT_TEST_DIR"
echo; echo "$pass passed, $fail failed"
