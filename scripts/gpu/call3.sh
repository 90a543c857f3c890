#!/usr/bin/env bash
# Device call 3 (the session after call 2): the stages of issue 38 that have never finished on a GPU, each with a
# budget sized from calls 1 and 2. Writes under $OUT: the acceptance JSON, .md and .log, the GPU's utilisation
# every 2 s (dmon.txt), and what each cut-off stage's runs had reached (leftovers.txt).
set -u -o pipefail
source .whl/setup.sh || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-outputs/gpu-call3}; mkdir -p "$OUT"
nvidia-smi dmon -s um -d 2 -o T > "$OUT/dmon.txt" 2>&1 & DMON=$!
timeout 505 python3 scripts/gpu_acceptance.py --out "$OUT" --stage deterministic pack21 ablation72 suite \
    --budget deterministic=90 --budget pack21=110 --budget ablation72=210 --budget suite=90
kill $DMON 2>/dev/null
# A stage stopped at its budget leaves its scratch dir: each run's last metrics row and its log's last lines.
{ for d in /tmp/acceptance-*-*/; do
    echo "=== $d"; find "$d" -name sweep.log -exec tail -n 30 {} \;
    find "$d" -name metrics.jsonl | sort | while read -r m; do echo "$m: $(wc -l < "$m") rows; last: $(tail -c 300 "$m")"; done
    find "$d" -name normlab.log | sort | head -4 | while read -r l; do echo "--- $l"; tail -n 8 "$l"; done
  done; } > "$OUT/leftovers.txt" 2>&1
echo "call3 done"
