#!/usr/bin/env bash
# Build the storage test, example and bench binaries in release mode and pack them with the runner
# into DEST (default bundle/storage): `scripts/storage-bundle.sh [DEST]`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$root/bundle/storage}
cd "$root"
cargo test --release --no-run --message-format=json 2>/dev/null > /tmp/storage-bundle.json
cargo build --release --example cufile_roundtrip --bench storage --message-format=json 2>/dev/null >> /tmp/storage-bundle.json
mkdir -p "$dest"
python3 - "$dest" <<'PY'
import json, shutil, sys
dest = sys.argv[1]
want = {("test", "storage_gpu"), ("test", "storage_first_call"), ("lib", "gpudirect"),
        ("example", "cufile_roundtrip"), ("bench", "storage")}
for line in open("/tmp/storage-bundle.json"):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    kind, name = m["target"]["kind"][0], m["target"]["name"]
    if (kind, name) in want:
        out = "gpudirect_lib" if kind == "lib" else name
        shutil.copy(m["executable"], f"{dest}/{out}")
        print("packed", out)
PY
strip "$dest"/* 2>/dev/null || true
cp scripts/storage-bundle-run.sh "$dest/run.sh"
cp scripts/cufile-udev.sh "$dest/"
du -sh "$dest"
