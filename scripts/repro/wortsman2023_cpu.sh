#!/usr/bin/env bash
# Wortsman et al. 2023's LR sensitivity at CPU size (conf/experiment/wortsman2023_cpu.yaml: the GPU preset's
# arms and lr grid on 4 blocks of width 64, 300 steps, one seed), in the GPU script's two sweeps:
#  1. LayerNorm, Pre-LN and Post-LN, with and without QK-norm (28 runs);
#  2. RMSNorm and DyT in the pre placement, without QK-norm (14 runs);
# then normlab compare over both, the tables of scripts/repro/repro_numbers.py (final val loss by lr per arm, LR
# sensitivity, attention logits) and their figure, final val loss by lr per arm: docs/wortsman2023_cpu_lr.png.
# usage: scripts/repro/wortsman2023_cpu.sh [hydra overrides for both sweeps...]
set -euo pipefail
here=$(dirname "$0")
root="outputs/sweeps/wortsman2023_cpu_$(date +%Y-%m-%d_%H-%M-%S)"
normlab train -m +experiment=wortsman2023_cpu "hydra.sweep.dir=${root}/layer" progress=false "$@"
normlab train -m +experiment=wortsman2023_cpu "hydra.sweep.dir=${root}/rms_dyt" norm=rms,dyt placement=pre qk_norm=false progress=false "$@"
normlab compare "${root}/layer" "${root}/rms_dyt" --out "${root}/report"
python "${here}/repro_numbers.py" lr "${root}/layer" "${root}/rms_dyt" --figure docs/wortsman2023_cpu_lr.png \
    --title "Wortsman et al. 2023's LR sensitivity at CPU size: 4 blocks of width 64, 300 steps, 1 seed (not the paper's size)"
echo "report: ${root}/report/report.md"
