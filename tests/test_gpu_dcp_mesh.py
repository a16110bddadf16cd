"""The 2-D mesh checks of test_dcp_mesh.py, run with real TE FusedAdam on 4 GPUs (2 x 2 meshes).

test_dcp_mesh.py proves them against the CPU stand-in on 4 gloo ranks. This runs the same check
functions (``tests/support/mesh_checks.py``) with the CUDA backend (``cpu:gloo,cuda:nccl``) and
TE's own FusedAdam, FP8 moments of DTensors too: HSDP (``fully_shard`` on a (dp_replicate,
dp_shard) mesh) and a DeepSeek-style MoE block on a (dp_shard, ep) mesh, with uneven and empty
local shards. Exports equal TE's; a streaming save, a plain save and TE's save each load through
the template path and the planner, equal to TE's own load; resharding 4 -> 2 -> 1 -> 2 -> 4;
training continues as uninterrupted. Skipped with fewer than 4 GPUs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .support.mesh_checks import (
    LAYOUTS,
    WORLD,
)

pytestmark = pytest.mark.multigpu(WORLD)


def _worker(rank: int, port: int, root: str) -> None:
    import warnings

    import torch.distributed as dist

    from .support.backends import CUDA
    from .support.distributed import init_gpu_rank
    from .support.mesh_checks import run_mesh_checks

    init_gpu_rank(rank, port, timeout_s=300, world_size=WORLD)
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    try:
        # FP8 states of DTensors too: the CPU stand-in keeps FP8 of plain tensors only.
        run_mesh_checks(CUDA, Path(root), extra_cases=((torch.uint8, "fp32"),))
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checks' root, once the 4 ranks ran them (one spawn for the module's tests)."""
    from .support.distributed import spawn

    root = tmp_path_factory.mktemp("mesh_gpu")
    spawn(_worker, str(root), nprocs=WORLD)
    return root


def test_dcp_with_te_on_two_dimensional_meshes_of_four_gpus(checked: Path) -> None:
    for layout in LAYOUTS:
        for ckpt in ("uint8_fp32/streaming", "bfloat16_remainder/te", "reshard/two_again"):
            assert (checked / layout / ckpt / ".metadata").is_file(), f"{layout}/{ckpt}"


def test_streaming_reshard_of_remainders_in_strided_regions_with_te(checked: Path) -> None:
    # The ranks ran it last (a failure there fails the spawn): its 4-rank checkpoint exists.
    assert (checked / "moe" / "strided_remainders" / "four" / ".metadata").is_file()
