#!/usr/bin/env bash
# Everything CI and a fresh development machine need beyond the Rust toolchain.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "ci/setup.sh: nothing extra needed yet"
