#!/usr/bin/env bash
# Build the GPU bundle: release test, example and bench binaries, stripped and packed with a runner,
# for a GPU node without a Rust toolchain.
#
#   bash scripts/bundle.sh [OUT_DIR]          # default OUT_DIR=bundle/main (git-ignored)
#   scp -r bundle/main gpu-node:gd && ssh gpu-node 'bash gd/run.sh [--udev] [--bench]'
#
# The runner runs every test binary with GPUDIRECT_REQUIRE=gpu,cufile (override with the variable),
# then each example, optionally the benches, and ends with a line `N passed, N failed`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bundle/main}
FEATURES=${FEATURES:-}
rm -rf "$OUT"; mkdir -p "$OUT/stage/deps" "$OUT/stage/examples" "$OUT/stage/benches" "$OUT/stage/scripts"
feat=(); [ -n "$FEATURES" ] && feat=(--no-default-features --features "$FEATURES")

executables() {  # cargo's JSON messages -> "name path" of executables of one kind (test|example|bench)
  python3 -c '
import json, sys
want = sys.argv[1]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    kinds, is_test = m["target"]["kind"], m["profile"]["test"]
    if (want == "test" and is_test and "bench" not in kinds) or (want != "test" and want in kinds):
        print(m["target"]["name"], m["executable"])
' "$1"
}

cargo test --release --workspace --no-run "${feat[@]}" --message-format=json 2>/dev/null | executables test |
  while read -r name exe; do
    case "$name" in compile_fail) continue;; esac   # trybuild needs cargo: tier 0 only
    cp "$exe" "$OUT/stage/deps/"
  done
cargo build --release --examples "${feat[@]}" --message-format=json 2>/dev/null | executables example |
  while read -r name exe; do cp "$exe" "$OUT/stage/examples/$name"; done
cargo bench --no-run "${feat[@]}" --message-format=json 2>/dev/null | executables bench |
  while read -r name exe; do cp "$exe" "$OUT/stage/benches/$name"; done
find "$OUT/stage" -type f -perm -u+x -exec strip {} + 2>/dev/null || true
for s in scripts/cufile-udev.sh; do [ -f "$s" ] && cp "$s" "$OUT/stage/scripts/"; done
cp scripts/bundle-run.sh "$OUT/run.sh"
tar -C "$OUT/stage" -cf - . | xz -T0 -6 > "$OUT/bins.tar.xz"
rm -rf "$OUT/stage"
du -sh "$OUT"
size=$(du -sm "$OUT" | cut -f1)
if [ "$size" -ge 64 ]; then echo "bundle is ${size} MiB, over the 64 MiB limit" >&2; exit 1; fi
