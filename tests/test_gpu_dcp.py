"""The DCP checks of test_dcp.py, run with real TE FusedAdam under FSDP2 on 2 GPUs.

test_dcp.py proves the DCP behaviour against the CPU stand-in on a gloo mesh. This runs the same
check functions (``tests/support/dcp_checks.py``) with the CUDA backend, on a CUDA mesh
(``cpu:gloo,cuda:nccl``, as async saves need) with TE's own FusedAdam, so the stand-in's answers
(the fake step's count, TE's load of the same checkpoint, re-derived FP16/FP8 scales, continued
training) are checked against the real thing:

1. sync round trip (``cpu_offload`` True and False; BF16 with remainders, FP16, FP8 and BF16 with
   FP32 masters), equal to TE's own load and to continued uninterrupted training;
2. ``dcp.async_save`` with the default stager, ``DefaultStager`` options and ``PassThroughStager``;
3. resharding 2 -> 1 and 1 -> 2, then training on;
4. ``full_state_dict=True`` without and with the policy;
5. DCP's fake step on a fresh TE optimizer;
6. every export under the policy on the CPU; and the Stateful adapter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multigpu

WORLD = 2


def _worker(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .support.backends import CUDA
    from .support.dcp_checks import run_all_checks
    from .support.distributed import init_gpu_rank

    init_gpu_rank(rank, port, timeout_s=300)
    mesh = init_device_mesh("cuda", (WORLD,))
    # Async saves run their collectives in a background thread, on a group of their own.
    async_pg = dist.new_group(backend="gloo")
    try:
        # FP8 states of DTensors too: the CPU stand-in keeps FP8 of plain tensors only.
        run_all_checks(
            CUDA, mesh, async_pg, Path(root), extra_sync=((torch.uint8, "fp32", True, "sync_fp8"),)
        )
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


def test_dcp_with_te_on_two_gpus(tmp_path: Path) -> None:
    from .support.distributed import spawn

    spawn(_worker, str(tmp_path))
    for ckpt in ("sync_fp8", "async/pass_through", "stateful/async", "reshard/one_to_two"):
        assert (tmp_path / ckpt / ".metadata").is_file(), f"{ckpt}: no checkpoint"


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "dcp_walkthrough.py"


def test_dcp_walkthrough_example_runs_as_written(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from .support.distributed import free_port

    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
               f"--master_port={free_port()}", str(EXAMPLE), str(tmp_path / "ckpt")]  # fmt: skip
    proc = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # The example checks itself: the optimizer and weights it loaded last are the ones it saved.
    assert proc.stdout.count("loaded exactly what it saved") == WORLD, proc.stdout[-2000:]
    for ckpt in ("sync", "async", "stateful", "stateful_async"):
        assert (tmp_path / "ckpt" / ckpt / ".metadata").is_file(), ckpt
