#!/usr/bin/env bash
# Zhu et al. 2025 (DyT) at CPU size: DyT (conf/experiment/zhu2025_cpu.yaml: init=xavier, α₀ 0.8 attention,
# 0.2 MLP and final), then LayerNorm and RMSNorm on the same grid (zhu2025_norms_cpu.yaml), on the default
# 4-block, 128-wide model, 300 steps, lr 3e-4, 1e-3, 3e-3, one seed; then normlab compare, the tables of
# scripts/repro/repro_numbers.py (with DyT's α at the end) and their figure, final val loss against lr per norm,
# in docs/zhu2025_cpu_lr.png.
# usage: scripts/repro/zhu2025_cpu.sh [hydra overrides for both sweeps...]
set -euo pipefail
here=$(dirname "$0")
root="outputs/sweeps/zhu2025_cpu_$(date +%Y-%m-%d_%H-%M-%S)"
normlab train -m +experiment=zhu2025_cpu "hydra.sweep.dir=${root}/dyt" progress=false "$@"
normlab train -m +experiment=zhu2025_norms_cpu "hydra.sweep.dir=${root}/norms" progress=false "$@"
normlab compare "${root}/dyt" "${root}/norms" --out "${root}/report"
python "${here}/repro_numbers.py" lr "${root}/dyt" "${root}/norms" --figure docs/zhu2025_cpu_lr.png \
    --title "DyT (α₀ 0.8 attention, 0.2 MLP and final) at CPU size: 4 blocks of width 128, init=xavier, 300 steps, 1 seed (not the paper's size)"
echo "report: ${root}/report/report.md"
