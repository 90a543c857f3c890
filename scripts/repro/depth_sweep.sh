#!/usr/bin/env bash
# The depth_sweep preset (conf/experiment/depth_sweep.yaml), then normlab compare. Extra arguments are Hydra overrides.
exec "$(dirname "$0")/run_experiment.sh" depth_sweep "$@"
