#!/usr/bin/env bash
# Device call 2 of 2026-11-26: telemetry after its rewrite (issue 36), the CUDA tests after the fixes of call 1,
# and a packed arm's speed on the GPU (what the ablation72 stage rests on). Writes under $OUT.
set -u -o pipefail
source .whl/setup.sh || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-outputs/gpu-call2}; mkdir -p "$OUT"
# 1. Telemetry's overhead, eager and compiled, medium and GPT-2 small's shape, with a profiler summary.
timeout 112 python3 scripts/gpu_acceptance.py --out "$OUT" --stage telemetry --budget telemetry=105
# 2. tests/test_cuda.py after call 1's two failures were fixed.
timeout 55 python3 -m pytest -q -n 0 -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -25 | tee "$OUT/test_cuda.log"
# 3. One arm's 9 lr x seed runs as a pack against one run alone (medium, 60 steps).
timeout 45 python3 scripts/pack_bench.py --gpu --lrs 1e-3,3e-3,1e-2 --seeds 0,1,2 --steps 60 --sequential 1 \
    --rounds 1 --kernel-steps 3 2>&1 | tee "$OUT/pack_bench.log"
echo "call2 done"
