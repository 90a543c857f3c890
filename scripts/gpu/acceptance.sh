#!/usr/bin/env bash
# The GPU acceptance beside the ablation, in one command within 10 minutes: telemetry's overhead (medium preset, eager
# and compiled) beside its A/A control, with one telemetry step profiled; the 8-arm sweep (target 20 s) and the 21-run
# pack (30 s), command to closing table, each beside runs made another way; tests/test_cuda.py (0 failed, 60 s); and
# whether a sweep under MPS ends when SIGTERM stops it.
#   on a GPU machine, from the repository's root, carrying .whl:  OUT=DIR bash scripts/gpu/acceptance.sh
#   on the CPU, at tiny sizes (a check of the script):            OUT=DIR bash scripts/gpu/acceptance.sh --smoke
# Writes under $OUT (default outputs/gpu-acceptance): gpu-acceptance.json, .md and .log (the figures, kept as they
# come), the two telemetry profiles (telemetry-profile-medium-eager.txt, -compile.txt) and mps-sigterm.txt.
set -u -o pipefail
case "$*" in
  --smoke) smoke=(--smoke); limit=1800 ;;  # the CPU's smoke budgets: caps for a hang on a loaded machine
  "") smoke=(); limit=570 ;;
  *) echo "acceptance.sh: error: unknown arguments '$*': give --smoke or nothing" >&2; exit 2 ;;
esac
if [ ${#smoke[@]} -eq 0 ]; then source .whl/setup.sh || exit 1; fi
OUT=${OUT:-outputs/gpu-acceptance}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The stages' budgets sum to 535 s (scripts/gpu/acceptance_stages.py); the timeout leaves the driver its start and end.
timeout $limit python3 scripts/gpu/acceptance.py --out "$OUT" --stage telemetry sweep8 pack21 cuda_tests mps_sigterm "${smoke[@]}"
