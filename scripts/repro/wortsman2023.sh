#!/usr/bin/env bash
# Wortsman et al. 2023's LR sensitivity on a GPU (conf/experiment/wortsman2023.yaml), in two sweeps:
#  1. LayerNorm, Pre-LN and Post-LN, with and without QK-norm (the preset's own grid);
#  2. RMSNorm and DyT in the pre placement, without QK-norm;
# then normlab compare over both (final validation loss against lr per arm, LR sensitivity table).
# usage: scripts/repro/wortsman2023.sh [hydra overrides for both sweeps...]
set -euo pipefail
root="outputs/sweeps/wortsman2023_$(date +%Y-%m-%d_%H-%M-%S)"
normlab train -m +experiment=wortsman2023 "hydra.sweep.dir=${root}/layer" "$@"
normlab train -m +experiment=wortsman2023 "hydra.sweep.dir=${root}/rms_dyt" norm=rms,dyt placement=pre qk_norm=false "$@"
normlab compare "${root}/layer" "${root}/rms_dyt" --out "${root}/report"
echo "report: ${root}/report/report.md"
