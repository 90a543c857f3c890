#!/usr/bin/env bash
# The depth reproduction at CPU size (conf/experiment/depth_cpu.yaml: LayerNorm in the pre, lns, sandwich,
# reordered and post placements, 12 blocks of width 64, 300 steps, lr 3e-3, 2 seeds packed per placement),
# then normlab compare, and scripts/repro/depth_block_angle.py: the table of final losses, block angles and
# max/median ratios, and the block angle per block at init and at the end in docs/depth_block_angle.png.
# usage: scripts/repro/depth_cpu.sh [hydra overrides for the sweep...]
set -euo pipefail
here=$(dirname "$0")
root="outputs/sweeps/depth_cpu_$(date +%Y-%m-%d_%H-%M-%S)"
normlab train -m +experiment=depth_cpu "hydra.sweep.dir=${root}" progress=false "$@"
normlab compare "${root}" --out "${root}/report"
python "${here}/depth_block_angle.py" "${root}" --figure docs/depth_block_angle.png \
    --title "Block angle per block at CPU size: LayerNorm, 12 blocks of width 64, 300 steps, lr 3e-3,\
 mean over 2 seeds (not the papers' size)"
echo "report: ${root}/report/report.md"
