#!/usr/bin/env bash
# Regenerates libs/proto/src/gridrl/v1 from protos/ with the pinned generators in
# requirements-dev.txt (grpcio-tools, mypy-protobuf). Usage: scripts/gen_protos.sh [OUT_DIR]
# With OUT_DIR the code goes there instead (the freshness check diffs the two).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/libs/proto/src}
py=${PYTHON:-$root/.venv/bin/python}
mkdir -p "$out/gridrl/v1"
rm -f "$out"/gridrl/v1/*_pb2*.py "$out"/gridrl/v1/*_pb2*.pyi "$out"/gridrl/v1/descriptors.binpb
# descriptors.binpb: the same files as a FileDescriptorSet *with* their comments (the generated
# modules drop them), served by reflection so `grpcurl describe` shows the documentation.
"$py" -m grpc_tools.protoc -I"$root/protos" \
  --python_out="$out" --grpc_python_out="$out" \
  --descriptor_set_out="$out/gridrl/v1/descriptors.binpb" --include_source_info \
  --mypy_out="$out" --mypy_grpc_out="$out" \
  --plugin=protoc-gen-mypy="$(dirname "$py")/protoc-gen-mypy" \
  --plugin=protoc-gen-mypy_grpc="$(dirname "$py")/protoc-gen-mypy_grpc" \
  "$root"/protos/gridrl/v1/*.proto
touch "$out/gridrl/v1/__init__.py" "$out/gridrl/v1/py.typed"
