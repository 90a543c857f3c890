#!/usr/bin/env bash
# The lr_sweep preset (conf/experiment/lr_sweep.yaml), then normlab compare. Extra arguments are Hydra overrides.
exec "$(dirname "$0")/run_experiment.sh" lr_sweep "$@"
