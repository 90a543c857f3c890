#!/usr/bin/env bash
# The dyt_vs_norm preset (conf/experiment/dyt_vs_norm.yaml), then normlab compare. Extra arguments are Hydra overrides.
exec "$(dirname "$0")/run_experiment.sh" dyt_vs_norm "$@"
