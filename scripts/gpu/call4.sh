#!/usr/bin/env bash
# Device call 4 (after call 3's fixes): packed attention folded into one fused call (its speed against the math
# kernel, and its values), the 21-run pack again (its fp32 sample now at stable lrs), telemetry's overhead after
# the step path's changes, and where a telemetry step's host time goes on the GPU. Writes under $OUT.
set -u -o pipefail
source .whl/setup.sh || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-outputs/gpu-call4}; mkdir -p "$OUT"
nvidia-smi dmon -s um -d 2 -o T > "$OUT/dmon.txt" 2>&1 & DMON=$!
# 1. A 9-member medium pack's forward+backward: attention under vmap (math kernel), folded with the math kernel,
#    folded with torch's choice (normlab's path); bf16 and fp32.
timeout 50 python3 scripts/pack_bench.py --gpu --attention --lrs 1e-3,3e-3,1e-2 --seeds 0,1,2 \
    --precisions bf16,fp32 2>&1 | tee "$OUT/packs.log"
# 2. The acceptance stages: the 21-run pack, then telemetry.
timeout 180 python3 scripts/gpu_acceptance.py --out "$OUT" --stage pack21 telemetry \
    --budget pack21=80 --budget telemetry=95
# 3. A telemetry step's added host time by phase (statistics, row, sinks) on the GPU, medium's shape.
timeout 40 python3 scripts/telemetry_host.py --device cuda --width 256 --batch 32 --seq 128 --sinks jsonl \
    --pairs 20 --processes 1 2>&1 | tee "$OUT/telemetry_host.log"
kill $DMON 2>/dev/null
rm -f "$OUT"/gpu-h1*.json  # the device-named copy of gpu-acceptance.json: 8 files come back at most
echo "call4 done"
