#!/usr/bin/env bash
# Device call 1 of 2026-11-26 (issue 38's first GPU step, and the measurements that choose how jobs share a GPU).
# Run on a lent device from the project's root, carrying .whl:  bash scripts/gpu/call1.sh   (writes under $OUT)
set -u -o pipefail
source .whl/setup.sh || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-outputs/gpu-call1}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,compute_mode,driver_version --format=csv; nproc; uptime
  command -v nvidia-cuda-mps-control || echo "no nvidia-cuda-mps-control"
  d=$(mktemp -d /tmp/mps-probe-XXXX); export CUDA_MPS_PIPE_DIRECTORY=$d/p CUDA_MPS_LOG_DIRECTORY=$d/l; mkdir -p $d/p $d/l
  nvidia-cuda-mps-control -d; echo "mps -d exit $?"; ls -la $d/p; echo quit | nvidia-cuda-mps-control; sleep 1; ls -la $d/p
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; } 2>&1 | tee "$OUT/env.txt"
# 1. The stages issue 38 names first: the two fixes that never ran on a GPU, and the suite.
timeout 300 python3 scripts/gpu_acceptance.py --out "$OUT" --stage deterministic pack21 suite \
    --budget deterministic=60 --budget pack21=90 --budget suite=130
# 2. How small models share the GPU: in one process on streams (CUDA graphs), or in processes, with and without MPS.
timeout 80 python3 scripts/concurrency_bench.py --ks 4 --steps 50 \
    --ways serial,streams,procs,procs-mps,procs-graphs,procs-graphs-mps 2>&1 | tee "$OUT/concurrency.log"
# 3. The 8-arm sweep at 4 jobs on the GPU, without and with MPS: wall time and where the jobs' time went.
timeout 90 python3 scripts/sweep_bench.py --per-gpu 4 --mps false,true norm=none,layer,rms,batch placement=pre,post \
    model=medium max_steps=150 2>&1 | tee "$OUT/sweep_bench.log"
echo "call1 done"
