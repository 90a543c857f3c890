#!/usr/bin/env bash
# Xiong et al. 2020 at CPU scale (conf/experiment/xiong2020.yaml), in three parts:
#  1. the step-0 gradients averaged over seeds: the preset's two models (Pre-LN, Post-LN), one step
#     each, seeds 0-7 (each seed draws its own init and its own first batch; the paper averages over both);
#  2. the preset itself: warmup 0 vs 50 steps, then normlab compare;
#  3. scripts/repro/plot_xiong2020.py: the paper's Figure 3 (FFN gradient norm by layer at init) and the
#     warmup effect on the loss, into the sweep's report dir.
# usage: scripts/repro/xiong2020.sh [hydra overrides for both sweeps...]
set -euo pipefail
here=$(dirname "$0")
stamp=$(date +%Y-%m-%d_%H-%M-%S)
sweep_dir="outputs/sweeps/xiong2020_${stamp}"
init_dir="outputs/sweeps/xiong2020_init_${stamp}"
# Step 0's gradient does not depend on the lr or the warmup, so one of each per placement.
normlab train -m +experiment=xiong2020 "hydra.sweep.dir=${init_dir}" "$@" \
    max_steps=1 optim.warmup_steps=0 eval_batches=1 seed=0,1,2,3,4,5,6,7 progress=false
normlab train -m +experiment=xiong2020 "hydra.sweep.dir=${sweep_dir}" "$@"
normlab compare "${sweep_dir}" --out "${sweep_dir}/report"
# docs/reproductions.md shows the report's per-layer gradient plot under this name
cp "${sweep_dir}/report/layers_grad_norm.png" "${sweep_dir}/report/xiong2020_layers_grad_norm.png"
python "${here}/plot_xiong2020.py" --init "${init_dir}" --runs "${sweep_dir}" --out "${sweep_dir}/report"
echo "report: ${sweep_dir}/report/report.md"
