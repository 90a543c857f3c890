#!/usr/bin/env bash
# Run an experiment preset as a multirun, then compare its runs.
# usage: scripts/repro/run_experiment.sh NAME [hydra overrides...]
#   e.g. scripts/repro/run_experiment.sh lr_sweep model=tiny max_steps=200 hydra/launcher=joblib
set -euo pipefail
name=${1:?usage: run_experiment.sh NAME [overrides...]}
shift
sweep_dir="outputs/sweeps/${name}_$(date +%Y-%m-%d_%H-%M-%S)"
normlab train -m "+experiment=${name}" "hydra.sweep.dir=${sweep_dir}" "$@"
normlab compare "${sweep_dir}" --out "${sweep_dir}/report"
echo "report: ${sweep_dir}/report/report.md"
