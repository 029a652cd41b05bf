#!/usr/bin/env bash
# Fetch and unpack the cuFile wheels the tier-0 test `storage_cufile_wheel` loads (it does this
# itself when they are absent; this is the same, by hand, e.g. for a CI cache step).
#   nvidia-cufile       libcufile 1.20 (CUDA 13)
#   nvidia-cufile-cu12  libcufile 1.14 (CUDA 12)
# Needs python3 with pip and network access to the Python package index.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=${GPUDIRECT_CUFILE_WHEEL_DIR:-${CARGO_TARGET_DIR:-$root/target}/cufile-wheels}
mkdir -p "$dir"
python3 -m pip download --no-deps --quiet nvidia-cufile nvidia-cufile-cu12 -d "$dir"
for w in "$dir"/*.whl; do
  python3 -m zipfile -e "$w" "${w%.whl}"
done
find "$dir" -name libcufile.so.0
