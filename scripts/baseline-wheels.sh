#!/usr/bin/env bash
# Fetch the Python packages the benches compare against, for a GPU node without network access:
#
#   bash scripts/baseline-wheels.sh [DIR]        # default DIR=.whl (git-ignored)
#
# - KvikIO (the storage bench's baseline): the kvikio-cu13, libkvikio-cu13 and rapids-logger wheels.
# - NIXL (the intra-node transfer bench's baseline): the nixl-cu13 wheel, unpacked and cut down to
#   its UCX backend (the wheel is about 59 MB; what the bench needs, xz-compressed, about 14 MB):
#   DIR/nixl.tar.xz. It needs torch and numpy on the node.
#
# On the GPU node:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl
#   mkdir -p /tmp/nixl && tar -xJf DIR/nixl.tar.xz -C /tmp/nixl
#   export PYTHONPATH=/tmp/site:/tmp/nixl
set -euo pipefail
DIR=${1:-.whl}
mkdir -p "$DIR"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$DIR" \
  kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 rapids-logger==0.3.0
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$tmp" nixl-cu13==1.5.1
mkdir "$tmp/x"; python3 -m zipfile -e "$tmp"/nixl_cu13-*.whl "$tmp/x"
cd "$tmp/x"
rm -rf nixl_ep_cu13                                   # expert-parallel kernels: not used
for d in nixl_cu13.libs/nixl .nixl_cu13.mesonpy.libs/plugins; do
  find "$d" -type f ! -name libplugin_UCX.so -delete  # every backend but UCX
done
rm -f nixl_cu13.libs/ucx/libucx_perftest* nixl_cu13.libs/ucx/*.la
needed=$(find . -name '*.so*' -type f -exec readelf -d {} + 2>/dev/null | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | sort -u)
for f in nixl_cu13.libs/lib*; do
  grep -qx "$(basename "$f")" <<<"$needed" || rm -f "$f"   # libraries only the removed backends used
done
cd - >/dev/null
tar -cJf "$DIR/nixl.tar.xz" -C "$tmp/x" .
ls -la "$DIR"
