#!/usr/bin/env bash
# Everything CI and a fresh development machine need beyond the Rust toolchain: Debian's etcd
# (the metadata store's tests run against a real server) and protoc with protobuf's own .proto
# files (the `etcd` feature's etcd-client compiles etcd's protobuf files, which import
# google/protobuf/descriptor.proto and struct.proto; the plain build needs neither). Debian's
# protobuf-compiler only recommends libprotobuf-dev, which holds those files.
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
command -v etcd >/dev/null || need+=(etcd-server)
command -v etcdctl >/dev/null || need+=(etcd-client)
command -v protoc >/dev/null || need+=(protobuf-compiler)
[ -f /usr/include/google/protobuf/descriptor.proto ] || need+=(libprotobuf-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "ci/setup.sh: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
echo "ci/setup.sh: $(etcd --version | head -1); $(protoc --version)"
