#!/usr/bin/env bash
# The next device call (prepared 2026-11-26, not yet run): telemetry's eager overhead at CUDA's stack cap 2^22
# and at 2^24 on one machine (calls 2 and 4 measured 15% and 66% on two machines), the host time a telemetry step
# adds by phase on the GPU, then the 8-arm sweep and the suite. Then run `--call 2` (pack21, ablation72, torchrun)
# in a second call. Writes under $OUT (8 files at most come back): each cap's JSON and eager profile (the host's time
# by op and CUDA runtime call), the host split, and the sweep's and suite's JSON, .md and log.
set -u -o pipefail
source .whl/setup.sh || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-outputs/gpu-call5}; mkdir -p "$OUT"
# 1. A telemetry step's added host time by phase (statistics, row, sinks), medium's shape, eager.
timeout 60 python3 scripts/bench/telemetry_host.py --device cuda --width 256 --batch 32 --seq 128 --sinks jsonl \
    --pairs 20 --processes 1 2>&1 | tee "$OUT/telemetry_host.log"
# 2. The telemetry stage at CUDA's cap as committed (2^22), then at 2^24 (this machine's copy of probe_sites.py
#    edited: the device's tree is a copy), each in a folder of its own.
timeout 110 python3 scripts/gpu/acceptance.py --out "$OUT/cap22" --stage telemetry --budget telemetry=100
sed -i 's/^STACK_ELEMENTS = 1 << 22$/STACK_ELEMENTS = 1 << 24/' normlab/telemetry/sites.py
grep -n "^STACK_ELEMENTS" normlab/telemetry/sites.py | tee -a "$OUT/telemetry_host.log"
timeout 110 python3 scripts/gpu/acceptance.py --out "$OUT/cap24" --stage telemetry --budget telemetry=100
sed -i 's/^STACK_ELEMENTS = 1 << 24$/STACK_ELEMENTS = 1 << 22/' normlab/telemetry/sites.py
# 3. The 8-arm sweep and the suite (tests/test_cuda.py first).
timeout 230 python3 scripts/gpu/acceptance.py --out "$OUT" --stage sweep8 suite --budget sweep8=95 --budget suite=120
# The device-named copies of gpu-acceptance.json (gpu-h100.json, gpu-h200.json: the call may land on either).
find "$OUT" -maxdepth 2 -name "gpu-*.json" ! -name gpu-acceptance.json -delete
rm -f "$OUT"/cap2*/*.log "$OUT"/cap2*/*.md "$OUT"/cap2*/telemetry-profile-*-compile.txt
echo "call5 done"
