#!/usr/bin/env bash
# Zhu et al. 2025 on a GPU: DyT (conf/experiment/zhu2025.yaml, α₀ 0.8 attention, 0.2 MLP and final), then
# LayerNorm and RMSNorm on the same grid (conf/experiment/zhu2025_norms.yaml), then compare.
# usage: scripts/repro/zhu2025.sh [hydra overrides for both sweeps...]
set -euo pipefail
root="outputs/sweeps/zhu2025_$(date +%Y-%m-%d_%H-%M-%S)"
normlab train -m +experiment=zhu2025 "hydra.sweep.dir=${root}/dyt" "$@"
normlab train -m +experiment=zhu2025_norms "hydra.sweep.dir=${root}/norms" "$@"
normlab compare "${root}/dyt" "${root}/norms" --out "${root}/report"
echo "report: ${root}/report/report.md"
