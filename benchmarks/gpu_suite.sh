#!/usr/bin/env bash
# The GPU session in one call: environment facts, the GPU tests, then the export benchmark.
# Run from the repo root on the GPU machine, with the TE kit in .te/ (docs/contributing.md) and
# $OUT set; TE_CKPT_NO_KIT=1 uses an installed Transformer Engine instead of the kit:
#   bash benchmarks/gpu_suite.sh [default|full|none] [pytest -k expression]
set -uo pipefail
sweep=${1:-default}
select=${2:-}
if [ -z "${TE_CKPT_NO_KIT:-}" ]; then
  if [ ! -f .te/setup.sh ]; then
    echo "no TE kit in .te/ (docs/contributing.md says how to set it up), and TE_CKPT_NO_KIT is unset" >&2
    exit 2
  fi
  source .te/setup.sh || exit 1
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/nvidia-smi.txt"
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag 2>&1; nproc; free -g | head -2
python -c 'import torch, transformer_engine as te; print("torch", torch.__version__, "te", te.__version__, "gpus", torch.cuda.device_count())'
TE_CKPT_RESULTS="$out/fsdp2_export.json" TE_CKPT_FRESH_LOAD_RESULTS="$out/fresh_load.json" python -m pytest -q -m "gpu or multigpu" ${select:+-k "$select"} tests 2>&1 | tee "$out/pytest_gpu.log"
if [ "$sweep" != none ]; then
  python benchmarks/export_memory.py --sweep "$sweep" --out "$out/export_$sweep.json" 2>&1 | tee "$out/bench_$sweep.log"
fi
