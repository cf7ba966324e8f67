#!/usr/bin/env bash
# Installs what the GPU check (bench/gpu_check.py) needs into the Python that holds a CUDA
# build of torch ($PYTHON, default python3), without replacing that torch:
#   * fbgemm-gpu and torchrec of the release paired with that torch (fbgemm-gpu 1.N pairs with
#     torch 2.(N+5): 1.6 with 2.11, 1.8 with 2.13), torchrec with --no-deps;
#   * the project's other pins from requirements.txt, except torch and fbgemm-gpu-cpu;
#   * the generated protobuf modules (odl/protos/*_pb2.py).
# WHEELS=DIR installs from a folder of wheels instead of the package index (a machine
# without network: fill DIR elsewhere with `pip download` for that Python and platform).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
torch_version=$($PY -c 'import torch; print(torch.__version__.split("+")[0])')
cuda=$($PY -c 'import torch; print(torch.version.cuda or "")')
if [ -z "$cuda" ]; then
  echo "$PY has a CPU build of torch ($torch_version): the GPU check needs a CUDA build" >&2
  exit 2
fi
minor=$(echo "$torch_version" | cut -d. -f2)
pair="1.$((minor - 5))"
echo "torch $torch_version (CUDA $cuda): fbgemm-gpu and torchrec $pair.*"
src=()
if [ -n "${WHEELS:-}" ]; then src=(--no-index --find-links "$WHEELS"); fi
pin=$(mktemp)
echo "torch==$($PY -c 'import torch; print(torch.__version__)')" >"$pin"
$PY -m pip install -q "${src[@]}" -c "$pin" "fbgemm-gpu==$pair.*"
$PY -m pip install -q "${src[@]}" --no-deps "torchrec==$pair.*"
grep -v -E '^(torch|fbgemm-gpu-cpu)==' requirements.txt >"$pin.req"
$PY -m pip install -q "${src[@]}" -c "$pin" -r "$pin.req"
for p in protos/*.proto; do
  $PY -m grpc_tools.protoc -Iprotos --python_out=odl/protos --pyi_out=odl/protos "$p"
done
rm -f "$pin" "$pin.req"
