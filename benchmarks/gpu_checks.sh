#!/usr/bin/env bash
# The GPU checks, as one command for a machine with one CUDA GPU and PyTorch + Triton
# installed (its steps' time limits sum to 8 min 45 s; a step that runs out of time leaves
# the others' results):
#
#   1. on the GPU, against the CPU / the plain path: the tiled Triton kernels
#      (kernels="triton", tests/test_tiled.py::test_compiled_on_a_gpu) and every KV-cache
#      method (tests/test_kv.py::test_every_method_compresses_alike_on_a_gpu);
#   2. benchmarks/bench_kv.py on 2 layers of the 8B-shaped model (every layer has the same
#      shape, so the ratios to the prefill should be about those of all 32) at 8,192 and
#      32,768 tokens: the prefill, the capture path with no observer, the scored prefill
#      (plain, and with the tiled kernels' every-query sums), the window-only prefill and
#      each method's scoring;
#   3. benchmarks/bench_gpu.py on 2 layers at 8,192 tokens: sdpa, the plain no-maps trace
#      and the tiled kernels; at 32,768 tokens sdpa and the tiled kernels (the plain path's
#      two runs there would not fit the time limit); on the whole 32-layer model at 8,192
#      tokens sdpa and the tiled kernels (peak memory: does it fit one 80 GB GPU);
#   4. benchmarks/bench_gpu.py on 2 layers at 512 and 4,096 tokens: cw.attribute with
#      direct and with attnlrp against the sdpa forward of the same layers;
#   5. benchmarks/bench_faithfulness.py --shape llama-8b on 2 layers: one 512-token text's
#      sweep (80 configurations and the clean row) against plain eager and sdpa forwards
#      of the same batches;
#   6. benchmarks/gpu_summary.py: the one table of every case against its baseline of the
#      same run and its target, summary.json and summary.md (the README quotes it);
#   7. with PROFILE=1 only, the tiled kernels' row again under torch.profiler
#      (bench_gpu.py --profile): the kernels' and operators' table, heaviest GPU time first.
#
# Results go to $OUT (default gpu-out/): logs, bench_kv.json, trace*/ and whole/
# bench_gpu.json/.md, summary.json/.md. The package is used from src/ (PYTHONPATH), so
# nothing is installed; jaxtyping, beartype and pytest must be importable for step 1
# (install them with `python3 -m pip`: a bare `pip` may belong to another environment than
# python3, as it did on the H200 we used).
#
#   OUT=gpu-out bash benchmarks/gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT/trace"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
python3 - <<'PY' 2>&1 | tee "$OUT/versions.txt"
import torch, transformers, triton
print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__)
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
PY
timeout 90 python3 -m pytest -q -p no:cacheprovider -rA tests/test_tiled.py tests/test_kv.py \
    -k "compiled_on_a_gpu or alike_on_a_gpu" 2>&1 | tee "$OUT/tests.log"
(cd benchmarks && timeout 110 python3 bench_kv.py --shape llama-8b --layers 2 --device cuda \
    --contexts 8192,32768 --repeats 1 --triton --out "$OUT/bench_kv.json") 2>&1 \
    | tee "$OUT/bench_kv.log"
timeout 60 python3 benchmarks/bench_gpu.py --device cuda --layers 2 --lengths 8192 \
    --methods sdpa,no-maps,no-maps-triton --out "$OUT/trace" 2>&1 | tee "$OUT/bench_gpu.log"
timeout 90 python3 benchmarks/bench_gpu.py --device cuda --layers 2 --lengths 32768 \
    --methods sdpa,no-maps-triton --out "$OUT/trace-32k" 2>&1 | tee "$OUT/bench_gpu-32k.log"
timeout 90 python3 benchmarks/bench_gpu.py --device cuda --lengths 8192 \
    --methods sdpa,no-maps-triton --out "$OUT/whole" 2>&1 | tee "$OUT/bench_gpu-whole.log"
timeout 45 python3 benchmarks/bench_gpu.py --device cuda --layers 2 --lengths 512,4096 \
    --methods sdpa,attribute-direct,attribute-attnlrp --out "$OUT/attribution" 2>&1 \
    | tee "$OUT/bench_gpu-attribution.log"
(cd benchmarks && timeout 40 python3 bench_faithfulness.py --shape llama-8b --device cuda \
    --layers 2 --tokens 512 --repeats 2 --out "$OUT/faithfulness") 2>&1 \
    | tee "$OUT/bench_faithfulness.log"
python3 benchmarks/gpu_summary.py --kv "$OUT/bench_kv.json" --trace "$OUT/trace/bench_gpu.json" \
    --trace "$OUT/trace-32k/bench_gpu.json" --trace "$OUT/whole/bench_gpu.json" \
    --trace "$OUT/attribution/bench_gpu.json" \
    --faithfulness "$OUT/faithfulness/results.json" --out "$OUT"
if [ "${PROFILE:-0}" = 1 ]; then
    timeout 90 python3 benchmarks/bench_gpu.py --device cuda --layers 2 --lengths 8192 \
        --methods no-maps-triton --profile --out "$OUT/profile" 2>&1 | tee "$OUT/profile.log"
fi
