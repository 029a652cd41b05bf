#!/usr/bin/env bash
# Runner inside the GPU bundle (see scripts/bundle.sh). Usage:
#   bash run.sh [--udev] [--bench] [--only PATTERN]
#   (default)  every test binary, then every example (storage without the udev entry: cuFile cannot
#              register files in micro-VMs and containers, so the automatic path must fall back)
#   --udev     then, as root, write the udev entry cuFile needs (scripts/cufile-udev.sh) and run the
#              storage tests and the cufile_roundtrip example again, with the 3 GiB read
#   --bench    then run the benches (criterion; their tables go to stdout; the storage bench
#              prints its table only, with KvikIO's figures when python3 can import kvikio)
#   --only P   run only steps whose name contains P
# Environment: GPUDIRECT_REQUIRE (default gpu,cufile), STEP_TIMEOUT (default 300 s per binary;
# STORAGE_BENCH_TIMEOUT for the storage bench, default 420 s),
# RUN_DIR (default a fresh temp dir). Ends with `N passed, N failed`.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
udev=0; bench=0; only=""
while [ $# -gt 0 ]; do
  case "$1" in --udev) udev=1;; --bench) bench=1;; --only) only=$2; shift;; *) echo "unknown option $1" >&2; exit 2;; esac
  shift
done
export GPUDIRECT_REQUIRE=${GPUDIRECT_REQUIRE-gpu,cufile}
RUN_DIR=${RUN_DIR:-$(mktemp -d)}
mkdir -p "$RUN_DIR" && tar -C "$RUN_DIR" -xJf "$HERE/bins.tar.xz"
cd "$RUN_DIR"
export GPUDIRECT_TEST_DIR=${GPUDIRECT_TEST_DIR:-$RUN_DIR/storage-test}
mkdir -p "$GPUDIRECT_TEST_DIR"
pass=0; fail=0; failed=()
run() {  # run NAME CMD...
  local name=$1; shift
  [ -n "$only" ] && [[ "$name" != *$only* ]] && return
  echo "=== $name"
  local t0=$SECONDS
  if timeout "${STEP_TIMEOUT:-300}" "$@"; then pass=$((pass+1)); echo "--- ok: $name ($((SECONDS-t0)) s)"
  else fail=$((fail+1)); failed+=("$name"); echo "--- FAILED: $name ($((SECONDS-t0)) s)"; fi
}
tests() {  # tests LABEL GLOB
  for t in deps/$2; do
    [ -x "$t" ] || continue
    local n; n=$(basename "$t"); n=${n%-*}
    case "$n" in
      storage_gpu)  # the batch test alone, so that a hang cannot hide the other results
        run "$1test $n" "$t" --test-threads=1 --skip batches_split
        run "$1test $n batches" "$t" --test-threads=1 batches_split;;
      *) run "$1test $n" "$t" --test-threads=1;;
    esac
  done
}
example() {  # example LABEL NAME [ARGS]
  local label=$1 n=$2; shift 2
  [ -x "examples/$n" ] && run "${label}example $n${1:+ $*}" "examples/$n" "$@"
}
echo "node: $(nvidia-smi -L 2>/dev/null | head -1 || echo 'no nvidia-smi'); kernel $(uname -r)"
tests "" "*"
for e in examples/*; do
  n=$(basename "$e")
  case "$n" in
    probe) example "" probe; example "" probe --json;;
    *) example "" "$n";;
  esac
done
if [ $udev = 1 ]; then
  if [ -f scripts/cufile-udev.sh ] && bash scripts/cufile-udev.sh "$GPUDIRECT_TEST_DIR"; then
    GPUDIRECT_BIG_TESTS=1 tests "udev: " "storage_*"
    example "udev: " cufile_roundtrip
    example "udev: " async_pipeline
    example "udev: " async_pipeline --reads cufile
  else
    fail=$((fail+1)); failed+=("udev entry"); echo "--- FAILED: writing the udev entry"
  fi
fi
if [ $bench = 1 ]; then
  for b in benches/*; do
    case "$(basename "$b")" in
      # The storage bench's table alone (fixed repetitions, KvikIO beside it when python3 can
      # import it: put the wheels on PYTHONPATH); it takes about four minutes on 1 GiB.
      storage) STEP_TIMEOUT=${STORAGE_BENCH_TIMEOUT:-420} run "bench storage" "$b" --bench --quick;;
      *) run "bench $(basename "$b")" "$b" --bench;;
    esac
  done
fi
rm -rf "$GPUDIRECT_TEST_DIR"
[ ${#failed[@]} -gt 0 ] && printf 'failed: %s\n' "${failed[@]}"
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
