#!/usr/bin/env bash
# Mooncake's transfer engine as a baseline of benches/transfer_local.rs: unpack its C++ bench
# from a wheel of Mooncake's transfer engine (downloaded beforehand; the CUDA 13 build for
# `--protocol=nvlink_intra`) and build the library that checks what it moved.
#
#   bash benches/baselines/mooncake.sh WHEEL DIR
#   GPUDIRECT_MOONCAKE_DIR=DIR cargo bench --bench transfer_local -- --quick
#
# DIR gets mooncake/transfer_engine_bench, the libraries bundled in the wheel that it loads, in
# <package>.libs/ beside it (its RPATH is $ORIGIN/../<package>.libs: the layout is kept), and
# mooncake_check.so (mooncake_check.c). Only those: the python parts are left in the wheel.
# The bench also loads libcudart.so.13, which the wheel does not ship (a CUDA 13 runtime on
# LD_LIBRARY_PATH: torch's nvidia/cu13/lib does), and libibverbs, libmlx5, libnuma and libcurl
# from the system.
set -euo pipefail
[ $# = 2 ] || { echo "usage: $0 WHEEL DIR" >&2; exit 2; }
WHEEL=$1 DIR=$2
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$DIR"
python3 - "$WHEEL" "$DIR" <<'PY'
import os, subprocess, sys, zipfile

z = zipfile.ZipFile(sys.argv[1])
out = sys.argv[2]
bench = "mooncake/transfer_engine_bench"
if bench not in z.namelist():
    sys.exit(f"{sys.argv[1]}: no {bench} in it")
libs = {os.path.basename(n): n for n in z.namelist()
        if n.split("/")[0].endswith(".libs") and not n.endswith("/")}

def needed(path):
    d = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True)
    return [l.split("[")[1].split("]")[0] for l in d.stdout.splitlines() if "(NEEDED)" in l]

# The bench and, transitively, what it needs from the bundled libraries.
todo, seen = [bench], set()
while todo:
    n = todo.pop()
    if n in seen:
        continue
    seen.add(n)
    z.extract(n, out)
    todo += [libs[l] for l in needed(os.path.join(out, n)) if l in libs]
os.chmod(os.path.join(out, bench), 0o755)
print(f"{out}: {bench} and {len(seen) - 1} bundled libraries")
PY
cc -O2 -Wall -shared -fPIC -o "$DIR/mooncake_check.so" "$HERE/mooncake_check.c" -ldl
du -sh "$DIR"
