#!/usr/bin/env bash
# Runner inside the GPU bundle (see scripts/bundle.sh). Usage:
#   bash run.sh [--udev] [--bench] [--only PATTERN]
#   --udev   first write the udev entry cuFile needs where no udev database exists (root; DESIGN.md)
#   --bench  also run the benches (criterion; their tables go to stdout)
# Environment: GPUDIRECT_REQUIRE (default gpu,cufile), RUN_DIR (default a fresh temp dir).
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
if [ $udev = 1 ] && [ -f scripts/cufile-udev.sh ]; then bash scripts/cufile-udev.sh "$RUN_DIR"; fi
pass=0; fail=0; failed=()
run() {  # run NAME CMD...
  local name=$1; shift
  [ -n "$only" ] && [[ "$name" != *$only* ]] && return
  echo "=== $name"
  if timeout "${STEP_TIMEOUT:-300}" "$@"; then pass=$((pass+1)); else fail=$((fail+1)); failed+=("$name"); echo "--- FAILED: $name"; fi
}
for t in deps/*; do run "test $(basename "$t")" "$t" --test-threads=1; done
for e in examples/*; do
  n=$(basename "$e")
  case "$n" in
    probe) run "example probe" "$e"; run "example probe --json" "$e" --json;;
    *) run "example $n" "$e";;
  esac
done
if [ $bench = 1 ]; then for b in benches/*; do run "bench $(basename "$b")" "$b" --bench; done; fi
[ ${#failed[@]} -gt 0 ] && printf 'failed: %s\n' "${failed[@]}"
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
