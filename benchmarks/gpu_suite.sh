#!/usr/bin/env bash
# The GPU session in one call: environment facts, the GPU tests, then the export benchmark.
# Run from the repo root on the GPU machine, with the TE kit in .te/ and $OUT set:
#   bash benchmarks/gpu_suite.sh [default|full] [pytest -k expression]
set -uo pipefail
sweep=${1:-default}
select=${2:-}
source .te/setup.sh || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/nvidia-smi.txt"
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag 2>&1; nproc; free -g | head -2
python -c 'import torch, transformer_engine as te; print("torch", torch.__version__, "te", te.__version__, "gpus", torch.cuda.device_count())'
TE_CKPT_RESULTS="$out/fsdp2_export.json" python -m pytest -q -m "gpu or multigpu" ${select:+-k "$select"} tests 2>&1 | tee "$out/pytest_gpu.log"
if [ "$sweep" != none ]; then
  python benchmarks/export_memory.py --sweep "$sweep" --out "$out/export_$sweep.json" 2>&1 | tee "$out/bench_$sweep.log"
fi
