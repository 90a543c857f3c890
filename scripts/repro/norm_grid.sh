#!/usr/bin/env bash
# The norm_grid preset (conf/experiment/norm_grid.yaml), then normlab compare. Extra arguments are Hydra overrides.
exec "$(dirname "$0")/run_experiment.sh" norm_grid "$@"
