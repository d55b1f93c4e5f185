#!/usr/bin/env bash
# The GPU checks this project still owes, as one command for a machine with one CUDA GPU and
# PyTorch + Triton installed (about 10 minutes; each step has its own time limit):
#
#   1. the tiled Triton kernels (kernels="triton") compiled for this GPU against the plain
#      torch path (tests/test_tiled.py::test_compiled_on_a_gpu);
#   2. benchmarks/bench_gpu.py on the 8B-shaped model at 2,048 and 8,192 tokens: sdpa, the
#      plain no-maps trace, the torch.compile'd one and the tiled kernels;
#   3. the same at 32,768 tokens for sdpa and the tiled kernels only.
#
# Results go to $OUT (default gpu-out/): logs, bench_gpu.json/.md per step. The package is
# used from src/ (PYTHONPATH), so nothing is installed; jaxtyping, beartype and pytest must
# be importable for step 1.
#
#   OUT=gpu-out bash benchmarks/gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT/short" "$OUT/long"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
python3 - <<'EOF' 2>&1 | tee "$OUT/versions.txt"
import torch, transformers, triton
print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__)
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
EOF
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_tiled.py -k "compiled_on_a_gpu" 2>&1 \
    | tee "$OUT/test_tiled.log"
timeout 360 python3 benchmarks/bench_gpu.py --device cuda --lengths 2048,8192 \
    --methods sdpa,no-maps,no-maps-compiled,no-maps-triton --out "$OUT/short" 2>&1 \
    | tee "$OUT/bench_short.log"
timeout 240 python3 benchmarks/bench_gpu.py --device cuda --lengths 32768 \
    --methods sdpa,no-maps-triton --out "$OUT/long" 2>&1 | tee "$OUT/bench_long.log"
