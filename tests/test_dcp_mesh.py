"""Exports, DCP saves, streaming loads and resharding on 2-D device meshes, 4 CPU ranks (gloo).

One spawn of 4 ranks runs every check of ``tests/support/mesh_checks.py`` with the CPU stand-in
(``test_gpu_dcp_mesh.py`` runs them with real TE on 4 GPUs): HSDP (``fully_shard`` on a
(dp_replicate, dp_shard) mesh) and a DeepSeek-style MoE block on a (dp_shard, ep) mesh, with
placements that mix Replicate and Shard, uneven and empty local shards. Exports equal TE's; a
streaming save, a plain save and TE's save each load through the template path and the
planner; checkpoints reshard 4 -> 2 -> 1 -> 2 -> 4; training goes on as uninterrupted.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch.distributed as dist

from .support.backends import CPU
from .support.distributed import init_group, spawn
from .support.mesh_checks import (
    LAYOUTS,
    WORLD,
    run_mesh_checks,
)


def _worker(rank: int, port: int, root: str) -> None:
    from te_ckpt_placement import _te_hooks as te_hooks

    from .support.standin import StandInFusedAdam

    init_group(rank, port, backend="gloo", timeout_s=120, world_size=WORLD)
    te_hooks.patch_class(StandInFusedAdam)
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    try:
        run_mesh_checks(CPU, Path(root))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checks' root, once the 4 ranks ran them (one spawn for the module's tests)."""
    root = tmp_path_factory.mktemp("mesh")
    spawn(_worker, str(root), nprocs=WORLD)
    return root


def test_dcp_on_two_dimensional_meshes(checked: Path) -> None:
    for layout in LAYOUTS:
        for ckpt in ("bfloat16_remainder/streaming", "float16_fp32/te", "reshard/two_again"):
            assert (checked / layout / ckpt / ".metadata").is_file(), f"{layout}/{ckpt}"


def test_streaming_reshard_of_remainders_in_strided_regions(checked: Path) -> None:
    # The ranks ran it last (a failure there fails the spawn): its 4-rank checkpoint exists.
    assert (checked / "moe" / "strided_remainders" / "four" / ".metadata").is_file()
