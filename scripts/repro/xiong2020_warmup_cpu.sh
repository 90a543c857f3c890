#!/usr/bin/env bash
# Xiong et al. 2020's warmup experiment at CPU size (conf/experiment/xiong2020_warmup_cpu.yaml: 12 blocks of
# width 64, 800 steps, peak lr 1e-3): Post-LN with 0, 50 and 400 warmup steps, then Pre-LN without warmup
# (the paper's contrast; the preset's Pre-LN runs with warmup are left out to save time), then normlab
# compare, the validation losses by step (scripts/repro/repro_numbers.py) and the loss curves in
# docs/xiong2020_warmup_cpu.png.
# usage: scripts/repro/xiong2020_warmup_cpu.sh [hydra overrides for both sweeps...]
set -euo pipefail
here=$(dirname "$0")
root="outputs/sweeps/xiong2020_warmup_cpu_$(date +%Y-%m-%d_%H-%M-%S)"
normlab train -m +experiment=xiong2020_warmup_cpu "hydra.sweep.dir=${root}/post" placement=post progress=false "$@"
normlab train -m +experiment=xiong2020_warmup_cpu "hydra.sweep.dir=${root}/pre" placement=pre optim.warmup_steps=0 progress=false "$@"
normlab compare "${root}/post" "${root}/pre" --out "${root}/report"
python "${here}/repro_numbers.py" curves "${root}/post" "${root}/pre" --figure docs/xiong2020_warmup_cpu.png \
    --title "Xiong et al. 2020's warmup at CPU size: LayerNorm, 12 blocks of width 64, Xavier, peak lr 1e-3 (not the paper's size)"
echo "report: ${root}/report/report.md"
