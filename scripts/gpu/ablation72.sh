#!/usr/bin/env bash
# The 72-run ablation end to end on one GPU, within 9 minutes: norm x placement x lr x seed (72 runs of the medium
# preset, 500 steps, as 8 packs, 4 at once) timed from the command to its closing table, with its head (the
# command's start to the first step) and the runs that did not finish; then `normlab compare` on its sweep dir and
# the record of its answer, ablation72-<gpu>.md; the 2,000-step grid's time projected from this one's parts.
#   on a GPU machine, from the repository's root, carrying .whl:  OUT=DIR bash scripts/gpu/ablation72.sh
#   on the CPU, a tiny grid (a check of the script):             OUT=DIR bash scripts/gpu/ablation72.sh --smoke
# Writes under $OUT (default outputs/ablation72): gpu-acceptance.json, .md and .log (the stage's figures, kept as it
# goes), ablation72-<gpu>.md, ablation72-report.tar.gz (compare's report dir), ablation72-sweep.log and, on a GPU,
# ablation72-dmon.txt (the GPU's use every second, nvidia-smi dmon).
set -u -o pipefail
case "$*" in
  --smoke) smoke=(--smoke); limit=600 ;;  # the CPU's smoke budget: a cap for a hang on a loaded machine
  "") smoke=(); limit=500 ;;
  *) echo "ablation72.sh: error: unknown arguments '$*': give --smoke or nothing" >&2; exit 2 ;;
esac
if [ ${#smoke[@]} -eq 0 ]; then source .whl/setup.sh || exit 1; fi
OUT=${OUT:-outputs/ablation72}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ ${#smoke[@]} -eq 0 ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi dmon -s u -d 1 -o T > "$OUT/ablation72-dmon.txt" 2>&1 &
  dmon=$!
fi
# The stage's budget is 450 s (scripts/gpu/acceptance_stages.py); the timeout leaves the driver its start and end.
timeout $limit python3 scripts/gpu/acceptance.py --out "$OUT" --stage ablation72 "${smoke[@]}"
code=$?
if [ -n "${dmon:-}" ]; then kill "$dmon"; fi
exit $code
