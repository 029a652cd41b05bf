#!/usr/bin/env bash
# Regenerate every committed bindgen output (not part of the build: the build never runs bindgen).
#   bash scripts/regen-bindings.sh
# Needs bindgen-cli and libclang (each script lists what it needs), then review the
# diff: layout tests beside the bindings must still pass (`cargo test -p gpudirect-sys`).
set -euo pipefail
cd "$(dirname "$0")"
for s in regen-cufile.sh regen-verbs.sh; do
  if [ -f "$s" ]; then echo "== $s"; bash "$s"; else echo "== $s: absent, skipped"; fi
done
